"""Device mesh and parameter/batch shardings.

The mesh always has two axes, ("data", "fsdp"):
* `fsdp` (default): data = 1, fsdp = every device. Every parameter is sharded over all devices.
* `hybrid`: data = `data_parallel` replicas x fsdp = devices / data_parallel. Parameters are sharded
  over `fsdp` and replicated over `data` (gradients are reduced over both).
The batch is always split over ("data", "fsdp"), so every device holds a disjoint part of it.
* multislice (`slices` = N > 1): the slices are the outer part of `data` (data = N x the per-slice
  replicas), joined over the data-center network (DCN); `fsdp` stays inside a slice (ICI), so weight
  gathers never cross DCN and only the gradient all-reduce does. The devices are grouped by their
  `slice_index` (jax.experimental.mesh_utils.create_hybrid_device_mesh on TPU).

Sequence sharding (context parallelism, `plan.seq_shards` > 1): the mesh gains a third axis, "seq",
of that size. Each instance's tokens are split over it ([B, T] is sharded (("data", "fsdp"), "seq")),
parameters are sharded over ("fsdp", "seq") together, and attention re-shards queries, keys and
values from the sequence to the heads around the attention itself (an all-to-all each way, as
DeepSpeed-Ulysses does): every device then attends over the whole sequence for n_heads / seq_shards
heads, with the unchanged kernels, windows and document masks. With seq_shards 1 the mesh is the
two-axis one above. A sequence-shard group stays on one host: the loader hands each process whole
instances (`step.device_batch`), so the devices sharing one must be that process's own. The TPU
torus order (create_hybrid_device_mesh) interleaves hosts along a row (on 2 x v5p-32 the process
of consecutive devices runs 0, 1, 2, 3, 0, ...), so with seq_shards > 1 each data replica's devices
are laid out host by host (`host_major`); a layout where a group still spans hosts is refused
(`LayoutSpansHosts`, exit 2). The plan refuses it first (core/batching.py `_seq_candidates`).

A parameter is sharded on its largest axis divisible by the `fsdp` size, never on the leading layer
axis of stacked block weights (scan slices that axis every layer). If no axis divides, it is replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmo_ctl.core.errors import BadInput

AXES = ("data", "fsdp")  # the batch axes
SEQ = "seq"  # the sequence axis, present only when sequences are sharded


_active: Mesh | None = None


def make_mesh(
    devices=None,
    kind: str = "fsdp",
    data_parallel: int = 1,
    activate: bool = True,
    slices: int = 1,
    seq_shards: int = 1,
) -> Mesh:
    """The ("data", "fsdp") mesh, or ("data", "fsdp", "seq") with `seq_shards` > 1 (consecutive
    devices share an instance). With `activate` the model traced afterwards pins its activations to
    batch sharding on this mesh (see `activation_mesh`); without that XLA may keep weights sharded and
    all-reduce activations every layer instead of gathering weights (FSDP). With `slices` > 1 the
    slices are the outer data-parallel (DCN) part of `data` (`multislice_devices`); sequence shards
    stay inside a slice."""
    global _active
    devices = list(jax.devices() if devices is None else devices)
    if slices > 1:
        arr = multislice_devices(devices, kind, data_parallel, slices)
    else:
        n = len(devices)
        if kind == "fsdp":
            dp = 1
        elif kind == "hybrid":
            dp = data_parallel
            if dp < 1 or n % dp:
                raise ValueError(f"data_parallel={dp} does not divide the {n} devices")
        else:
            raise ValueError(f"unknown mesh kind {kind!r} (fsdp or hybrid)")
        arr = np.asarray(devices).reshape(dp, n // dp)
    if seq_shards > 1:
        rows, cols = arr.shape
        if cols % seq_shards:
            raise ValueError(
                f"seq_shards={seq_shards} does not divide the {cols} devices of each data replica"
            )
        arr = host_major(arr)
        check_seq_groups(arr, seq_shards, kind, data_parallel, slices)
        mesh = Mesh(arr.reshape(rows, cols // seq_shards, seq_shards), AXES + (SEQ,))
    else:
        mesh = Mesh(arr, AXES)
    if activate:
        _active = mesh
    return mesh


class LayoutSpansHosts(BadInput):
    """A sequence-shard group of the mesh would span hosts: the layout cannot be loaded (exit 2)."""


def _host(d) -> int:
    return int(getattr(d, "process_index", 0))


def host_major(arr: np.ndarray) -> np.ndarray:
    """Each data replica (row) of a [rows, cols] device array with its devices grouped host by host:
    hosts in the order they first appear in the row, each host's devices in their own order. A row
    already laid out so (the CPU twin, one process's devices) is unchanged."""
    out = np.empty_like(arr)
    for r, row in enumerate(arr):
        order: dict[int, list] = {}
        for d in row:
            order.setdefault(_host(d), []).append(d)
        out[r] = [d for ds in order.values() for d in ds]
    return out


def check_seq_groups(arr: np.ndarray, seq_shards: int, kind: str, data_parallel: int, slices: int) -> None:
    """Refuse a [rows, cols] device array in which a group of `seq_shards` consecutive devices of a row
    (one instance's sequence shards) belongs to more than one host."""
    rows, cols = arr.shape
    for r in range(rows):
        for g in range(0, cols, seq_shards):
            hosts = sorted({_host(d) for d in arr[r, g : g + seq_shards]})
            if len(hosts) > 1:
                per_host = sum(1 for d in arr[r] if _host(d) == hosts[0])
                where = f"{slices} slices, " if slices > 1 else ""
                raise LayoutSpansHosts(
                    f"train.seq_shards {seq_shards} with mesh {kind}"
                    + (f" (data_parallel {data_parallel})" if kind == "hybrid" else "")
                    + f" ({where}{rows} data replicas of {cols} devices): the sequence-shard group of "
                    f"replica {r}, devices {g}..{g + seq_shards - 1}, spans hosts "
                    f"{', '.join(map(str, hosts))} (host {hosts[0]} has {per_host} devices in that replica)",
                    "a sequence-shard group must stay on one host: choose a train.seq_shards that divides "
                    "each host's devices in a replica, or 0 to let the plan choose",
                )


def _slice_groups(devices: list, slices: int) -> list[list]:
    """The devices of each slice, slice 0 first: by `slice_index` (the TPU runtime's, set on every
    device of a multislice job); where the runtime names one slice only (CPU devices say 0: the
    sandbox's emulated slices), by process, as the join numbers them (slice s: processes s x P ..
    (s + 1) x P - 1); else in the order given (N equal consecutive groups)."""
    n = len(devices)
    if slices < 1 or n % slices:
        raise ValueError(f"{slices} slices do not split the {n} devices")
    index = [getattr(d, "slice_index", None) for d in devices]
    procs = [getattr(d, "process_index", None) for d in devices]
    if slices > 1 and set(index) <= {0, None} and all(p is not None for p in procs):
        hosts = sorted({p for p in procs if p is not None})
        if len(hosts) % slices:
            raise ValueError(f"{slices} slices do not split the {len(hosts)} processes")
        per_slice = len(hosts) // slices
        groups = [
            [d for d in devices if hosts.index(d.process_index) // per_slice == s] for s in range(slices)
        ]
        if len({len(g) for g in groups}) != 1:
            raise ValueError(f"slices of unequal size: {[len(g) for g in groups]} devices")
        return groups
    if all(i is not None for i in index):
        found = sorted({i for i in index if i is not None})
        if found != list(range(slices)):
            raise ValueError(f"the devices carry slice_index {found}, expected 0..{slices - 1}")
        groups = [[d for d in devices if d.slice_index == s] for s in range(slices)]
        if len({len(g) for g in groups}) != 1:
            raise ValueError(f"slices of unequal size: {[len(g) for g in groups]} devices")
        return groups
    per = n // slices
    return [devices[i * per : (i + 1) * per] for i in range(slices)]


def multislice_devices(devices: list, kind: str, data_parallel: int, slices: int) -> np.ndarray:
    """The [slices x dp, per_slice / dp] device array of a multislice mesh: row block s holds slice s.

    On TPU, jax.experimental.mesh_utils.create_hybrid_device_mesh orders each slice's devices for its
    ICI torus (mesh shape (dp, per_slice/dp) inside a slice, DCN shape (slices, 1) across them);
    elsewhere (tests, CPU) each slice's devices keep their order."""
    groups = _slice_groups(devices, slices)
    per = len(groups[0])
    dp = 1 if kind == "fsdp" else data_parallel
    if kind not in ("fsdp", "hybrid"):
        raise ValueError(f"unknown mesh kind {kind!r} (fsdp or hybrid)")
    if dp < 1 or per % dp:
        raise ValueError(f"data_parallel={dp} does not divide the {per} devices of a slice")
    if all(
        getattr(d, "platform", None) == "tpu" and getattr(d, "slice_index", None) is not None for d in devices
    ):
        from jax.experimental import mesh_utils

        return mesh_utils.create_hybrid_device_mesh((dp, per // dp), (slices, 1), devices)
    return np.concatenate([np.asarray(g, dtype=object).reshape(dp, per // dp) for g in groups], axis=0)


def deactivate() -> None:
    """Forget the mesh `make_mesh` activated: activations are then constrained only by a `jax.set_mesh`
    mesh, if any."""
    global _active
    _active = None


def activation_mesh():
    """The mesh activations are constrained to: the current `jax.set_mesh` mesh when it has our axes
    (as an abstract mesh), else the last mesh `make_mesh` activated, else None."""
    ambient = jax.sharding.get_abstract_mesh()
    if not ambient.empty and ambient.manual_axes:
        return None
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
    return jax.tree_util.tree_map_with_path(
        lambda p, x: _spec_for(p, tuple(x.shape), fsdp, axis), params_or_shapes
    )


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
