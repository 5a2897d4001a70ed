"""FSDP on the CPU with one weight gather and one gradient reduction per step.

Under XLA's SPMD partitioner, an FSDP step gathers every layer's slice of every parameter where it is
used, in the forward pass and again in the backward pass, and reduces every gradient on its own: on
the smoke model that is 92 all-gathers and 16 all-reduces per device per step. On TPUs and GPUs XLA's
collective combiners merge them; its CPU compiler has none, and each collective there is a rendezvous
of the device threads (docs/trainer-performance.md).

`grads` runs the gradient part of the step as PyTorch FSDP does with its flat parameters, inside
`jax.shard_map`: each device flattens its shards of the parameters into one vector, one all-gather
over "fsdp" gives every device the whole model, the device's micro-batches run on it, and one
all-reduce of the gradients laid out shard by shard leaves each device the sum of its own shards'
gradients (a reduce-scatter's result, through the all-reduce the partitioner's CPU programs use; on
a hybrid mesh the same all-reduce spans "data" too). Parameters no axis
of which divides the fsdp size are replicated; their gradients and the loss sums travel in a second
all-reduce. The state, its FSDP shardings and the checkpoints are unchanged: only the collectives
inside the step change, and with them the last bits of a step's arithmetic (sums over devices in
another order).

It applies where the step is compiled for the CPU in one process (the local twin, `cpu-N`) on a
("data", "fsdp") mesh whose fsdp axis shards at least one parameter, with one parameter dtype and a
model of at most MAX_PARAM_BYTES (every device holds it whole for the step: the local twin's small
models). Everywhere else the partitioner's own collectives run unchanged (`applies`): on every TPU
slice preflight compiles for, and in the multi-host twin (`cpu-PxD`, several processes), which is
there to run what a slice's hosts run.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from olmo_ctl.trainer import attention, sharding

# The whole model is gathered on every device for the step, with its fp32 gradients: the flat path is
# for models whose full copy is small next to a host's memory (the local twin's); above this many bytes
# of parameters the partitioner's FSDP, which never holds a whole model, runs instead.
MAX_PARAM_BYTES = 256 * 2**20


def _mesh():
    mesh = sharding.activation_mesh()
    return mesh if isinstance(mesh, Mesh) else None


def _sharded_axis(spec: PartitionSpec) -> int | None:
    return next((i for i, a in enumerate(spec) if a is not None), None)


def _axes(params, mesh) -> list[int | None]:
    """Per parameter leaf, the axis its FSDP spec shards (None: replicated)."""
    specs = sharding.param_partition_specs(params, mesh)
    return [_sharded_axis(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))]


def applies(params) -> bool:
    """Whether the step takes the flat path: compiled for the CPU in one process, on a concrete
    ("data", "fsdp") mesh (no "seq" axis) with fsdp > 1 that shards at least one parameter, every
    parameter of one dtype, and at most MAX_PARAM_BYTES of them."""
    mesh = _mesh()
    if attention.target()[0] != "cpu" or mesh is None or tuple(mesh.axis_names) != sharding.AXES:
        return False
    if (
        jax.process_count() > 1
    ):  # the multi-host twin runs the partitioner's collectives, as a slice's hosts do
        return False
    leaves = jax.tree.leaves(params)
    if mesh.shape["fsdp"] < 2 or len({x.dtype for x in leaves}) != 1:
        return False
    if sum(x.size * x.dtype.itemsize for x in leaves) > MAX_PARAM_BYTES:
        return False
    return any(a is not None for a in _axes(params, mesh))


def grads(params, micro: dict, accumulate: Callable):
    """(gradients, CE sum, z sum) of the step over `micro` ({name: [accum, micro_global, ...]}), the
    gradients sharded as `params`. `accumulate(full_params, local_micro)` -> (gradients, CE sum, z
    sum) over this device's rows: the step's own micro-batch loop."""
    mesh = _mesh()
    assert mesh is not None
    n, dp = mesh.shape["fsdp"], mesh.shape["data"]
    specs = sharding.param_partition_specs(params, mesh)
    treedef = jax.tree_util.tree_structure(params)
    axes = _axes(params, mesh)
    axis = {i: a for i, a in enumerate(axes) if a is not None}  # sharded leaf -> its sharded axis
    sharded = list(axis)  # leaf indices, in leaf order
    replicated = [i for i, a in enumerate(axes) if a is None]

    def local(shards, local_micro):
        shards = jax.tree.leaves(shards)
        sizes = [shards[i].size for i in sharded]
        # Row d of `gathered` is device d's shards in leaf order; device d holds block d of its axis.
        gathered = jax.lax.all_gather(jnp.concatenate([shards[i].reshape(-1) for i in sharded]), "fsdp")
        full = list(shards)
        for i, part in zip(sharded, jnp.split(gathered, np.cumsum(sizes)[:-1], axis=1), strict=True):
            x, a = shards[i], axis[i]
            whole = jnp.moveaxis(part.reshape(n, *x.shape), 0, a)  # [..., n, block, ...]
            full[i] = whole.reshape(*x.shape[:a], n * x.shape[a], *x.shape[a + 1 :])
        g, ce, z = accumulate(jax.tree_util.tree_unflatten(treedef, full), local_micro)
        g = jax.tree.leaves(g)
        rows = jnp.concatenate(  # [n, total]: row d holds device d's blocks of every sharded gradient
            [
                jnp.moveaxis(
                    g[i].reshape(*g[i].shape[: axis[i]], n, -1, *g[i].shape[axis[i] + 1 :]), axis[i], 0
                ).reshape(n, -1)
                for i in sharded
            ],
            axis=1,
        )
        # One all-reduce and this device's row of it: a reduce-scatter's result, through the
        # collective the partitioner's own CPU programs use (multi-process runs included).
        summed = jax.lax.psum(rows, sharding.AXES if dp > 1 else "fsdp")
        mine = jax.lax.dynamic_index_in_dim(summed, jax.lax.axis_index("fsdp"), axis=0, keepdims=False)
        rest = jax.lax.psum(
            jnp.concatenate([*(g[i].reshape(-1) for i in replicated), jnp.stack([ce, z])]), sharding.AXES
        )
        out = list(g)
        for flat, indices in ((mine, sharded), (rest, replicated)):
            at = 0
            for i in indices:
                out[i] = flat[at : at + shards[i].size].reshape(shards[i].shape)
                at += shards[i].size
        return jax.tree_util.tree_unflatten(treedef, out), rest[-2], rest[-1]

    micro_specs = {k: PartitionSpec(None, sharding.AXES) for k in micro}
    # check_vma=False: with it, JAX would make each device's gradient of the gathered (replicated)
    # parameters a psum over devices by itself, one all-reduce per parameter, the very collectives
    # this replaces; the reductions here are explicit.
    run = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(specs, micro_specs),
        out_specs=(specs, PartitionSpec(), PartitionSpec()),
        check_vma=False,
    )
    return run(params, micro)
