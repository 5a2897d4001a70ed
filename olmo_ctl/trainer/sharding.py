"""Device mesh and parameter/batch shardings.

The mesh always has two axes, ("data", "fsdp"):
* `fsdp` (default): data = 1, fsdp = every device. Every parameter is sharded over all devices.
* `hybrid`: data = `data_parallel` replicas x fsdp = devices / data_parallel. Parameters are sharded
  over `fsdp` and replicated over `data` (gradients are reduced over both).
The batch is always split over ("data", "fsdp"), so every device holds a disjoint part of it.

A parameter is sharded on its largest axis divisible by the `fsdp` size, never on the leading layer
axis of stacked block weights (scan slices that axis every layer). If no axis divides, it is replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp")


_active: Mesh | None = None


def make_mesh(devices=None, kind: str = "fsdp", data_parallel: int = 1, activate: bool = True) -> Mesh:
    """The ("data", "fsdp") mesh. With `activate` the model traced afterwards pins its activations to
    batch sharding on this mesh (see `activation_mesh`); without that XLA may keep weights sharded and
    all-reduce activations every layer instead of gathering weights (FSDP)."""
    global _active
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if kind == "fsdp":
        dp = 1
    elif kind == "hybrid":
        dp = data_parallel
        if dp < 1 or n % dp:
            raise ValueError(f"data_parallel={dp} does not divide the {n} devices")
    else:
        raise ValueError(f"unknown mesh kind {kind!r} (fsdp or hybrid)")
    mesh = Mesh(np.asarray(devices).reshape(dp, n // dp), AXES)
    if activate:
        _active = mesh
    return mesh


def deactivate() -> None:
    """Forget the mesh `make_mesh` activated: activations are then constrained only by a `jax.set_mesh`
    mesh, if any."""
    global _active
    _active = None


def activation_mesh():
    """The mesh activations are constrained to: the current `jax.set_mesh` mesh when it has our axes
    (as an abstract mesh), else the last mesh `make_mesh` activated, else None."""
    ambient = jax.sharding.get_abstract_mesh()
    if not ambient.empty and set(AXES) <= set(ambient.axis_names):
        return ambient
    return _active


def _spec_for(path, shape: tuple[int, ...], fsdp: int) -> PartitionSpec:
    stacked = jax.tree_util.keystr(path).startswith("['blocks']")
    first = 1 if stacked else 0
    dims = [None] * len(shape)
    if fsdp > 1:
        candidates = [a for a in range(first, len(shape)) if shape[a] % fsdp == 0]
        if candidates:
            dims[max(candidates, key=lambda a: (shape[a], -a))] = "fsdp"
    return PartitionSpec(*dims)


def param_partition_specs(params_or_shapes, mesh: Mesh):
    """PartitionSpec per parameter (works on arrays or `jax.ShapeDtypeStruct`s)."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree_util.tree_map_with_path(lambda p, x: _spec_for(p, tuple(x.shape), fsdp), params_or_shapes)


def param_shardings(params_or_shapes, mesh: Mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_partition_specs(params_or_shapes, mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over every device."""
    return NamedSharding(mesh, PartitionSpec(AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
