"""Device mesh and parameter/batch shardings.

The mesh always has two axes, ("data", "fsdp"):
* `fsdp` (default): data = 1, fsdp = every device. Every parameter is sharded over all devices.
* `hybrid`: data = `data_parallel` replicas x fsdp = devices / data_parallel. Parameters are sharded
  over `fsdp` and replicated over `data` (gradients are reduced over both).
The batch is always split over ("data", "fsdp"), so every device holds a disjoint part of it.

Sequence sharding (context parallelism, `plan.seq_shards` > 1): the mesh gains a third axis, "seq",
of that size. Each instance's tokens are split over it ([B, T] is sharded (("data", "fsdp"), "seq")),
parameters are sharded over ("fsdp", "seq") together, and attention re-shards queries, keys and
values from the sequence to the heads around the attention itself (an all-to-all each way, as
DeepSpeed-Ulysses does): every device then attends over the whole sequence for n_heads / seq_shards
heads, with the unchanged kernels, windows and document masks. With seq_shards 1 the mesh is the
two-axis one above.

A parameter is sharded on its largest axis divisible by the `fsdp` size, never on the leading layer
axis of stacked block weights (scan slices that axis every layer). If no axis divides, it is replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp")  # the batch axes
SEQ = "seq"  # the sequence axis, present only when sequences are sharded


_active: Mesh | None = None


def make_mesh(devices=None, kind: str = "fsdp", data_parallel: int = 1, activate: bool = True,
              seq_shards: int = 1) -> Mesh:
    """The ("data", "fsdp") mesh, or ("data", "fsdp", "seq") with `seq_shards` > 1 (consecutive
    devices share an instance). With `activate` the model traced afterwards pins its activations to
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
    if seq_shards > 1:
        if n % (dp * seq_shards):
            raise ValueError(f"seq_shards={seq_shards} x data_parallel={dp} does not divide the {n} devices")
        mesh = Mesh(np.asarray(devices).reshape(dp, n // (dp * seq_shards), seq_shards), AXES + (SEQ,))
    else:
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


def seq_shards(mesh) -> int:
    """How many devices each sequence is split over on this mesh (1 without a "seq" axis)."""
    return dict(mesh.shape).get(SEQ, 1) if mesh is not None else 1


def _spec_for(path, shape: tuple[int, ...], fsdp: int, axis="fsdp") -> PartitionSpec:
    stacked = jax.tree_util.keystr(path).startswith("['blocks']")
    first = 1 if stacked else 0
    dims = [None] * len(shape)
    if fsdp > 1:
        candidates = [a for a in range(first, len(shape)) if shape[a] % fsdp == 0]
        if candidates:
            dims[max(candidates, key=lambda a: (shape[a], -a))] = axis
    return PartitionSpec(*dims)


def param_partition_specs(params_or_shapes, mesh: Mesh):
    """PartitionSpec per parameter (works on arrays or `jax.ShapeDtypeStruct`s); with a "seq" axis
    parameters are sharded over ("fsdp", "seq") together."""
    s = seq_shards(mesh)
    fsdp, axis = (mesh.shape["fsdp"] * s, ("fsdp", SEQ)) if s > 1 else (mesh.shape["fsdp"], "fsdp")
    return jax.tree_util.tree_map_with_path(lambda p, x: _spec_for(p, tuple(x.shape), fsdp, axis), params_or_shapes)


def param_shardings(params_or_shapes, mesh: Mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_partition_specs(params_or_shapes, mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[B, T]: the batch dimension split over ("data", "fsdp"), the sequence over "seq" when present."""
    return NamedSharding(mesh, PartitionSpec(AXES, SEQ) if seq_shards(mesh) > 1 else PartitionSpec(AXES))


def row_sharding(mesh: Mesh) -> NamedSharding:
    """[B, ...] per-instance values: the batch dimension split over ("data", "fsdp") only."""
    return NamedSharding(mesh, PartitionSpec(AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
