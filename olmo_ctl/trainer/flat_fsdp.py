"""FSDP on the CPU with one weight gather and one gradient reduce-scatter per step.

Under XLA's SPMD partitioner, an FSDP step gathers every layer's slice of every parameter where it is
used, in the forward pass and again in the backward pass, and reduce-scatters every gradient on its
own: on the smoke model that is 92 all-gathers and 16 all-reduces per device per step. On TPUs and
GPUs XLA's collective combiners merge them; its CPU compiler has none, and each collective there is
a rendezvous of the device threads, which cost the CPU step about a quarter of its time
(docs/trainer-performance.md).

`grads` runs the gradient part of the step as PyTorch FSDP does with its flat parameters, inside
`jax.shard_map`: each device flattens its shards of the parameters into one vector, one all-gather
over "fsdp" gives every device the whole model, the device's micro-batches run on it, and one
reduce-scatter over "fsdp" hands each device the summed gradients of its own shards (plus a psum
over "data" on a hybrid mesh). Parameters no axis of which divides the fsdp size are replicated;
their gradients, and the loss sums, travel in one all-reduce. The state, its shardings and the
checkpoints are FSDP's as before: only the collectives inside the step change, and with them the
last bits of a step's arithmetic (a sum over devices in another order).

It applies where the step is compiled for the CPU on a ("data", "fsdp") mesh with more than one
fsdp device and one parameter dtype (`applies`); everywhere else, and for every TPU slice preflight
compiles for, the partitioner's own collectives run unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from olmo_ctl.trainer import attention, sharding


def _mesh():
    mesh = sharding.activation_mesh()
    return mesh if isinstance(mesh, Mesh) else None


def applies(params) -> bool:
    """Whether the step takes the flat path: compiled for the CPU, a concrete ("data", "fsdp") mesh
    (no "seq" axis) with fsdp > 1, and every parameter of one dtype."""
    mesh = _mesh()
    if attention.target()[0] != "cpu" or mesh is None or tuple(mesh.axis_names) != sharding.AXES:
        return False
    if mesh.shape["fsdp"] < 2:
        return False
    return len({x.dtype for x in jax.tree.leaves(params)}) == 1


def _sharded_axis(spec: PartitionSpec) -> int | None:
    return next((i for i, a in enumerate(spec) if a is not None), None)


def grads(params, micro: dict, accumulate: Callable):
    """(gradients, CE sum, z sum) of the step over `micro` ({name: [accum, micro_global, ...]}), the
    gradients sharded as `params`. `accumulate(full_params, local_micro)` -> (gradients, CE sum, z
    sum) over this device's rows: the step's own micro-batch loop."""
    mesh = _mesh()
    assert mesh is not None
    n, dp = mesh.shape["fsdp"], mesh.shape["data"]
    specs = sharding.param_partition_specs(params, mesh)
    treedef = jax.tree_util.tree_structure(params)
    axes = [_sharded_axis(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))]

    sharded = [i for i, a in enumerate(axes) if a is not None]  # leaf indices, in leaf order
    replicated = [i for i, a in enumerate(axes) if a is None]

    def local(shards, local_micro):
        shards = jax.tree.leaves(shards)
        gathered = jax.lax.all_gather(jnp.concatenate([shards[i].reshape(-1) for i in sharded]), "fsdp")
        full, at = list(shards), 0  # gathered: [n, total], row d = device d's shards in leaf order
        for i in sharded:
            x = shards[i]
            full[i] = jnp.concatenate(
                [gathered[d, at : at + x.size].reshape(x.shape) for d in range(n)], axes[i]
            )
            at += x.size
        g, ce, z = accumulate(jax.tree_util.tree_unflatten(treedef, full), local_micro)
        g = jax.tree.leaves(g)

        def piece(i, d):  # device d's shard of gradient i
            size = g[i].shape[axes[i]] // n
            return jax.lax.slice_in_dim(g[i], d * size, (d + 1) * size, axis=axes[i]).reshape(-1)

        rows = jnp.stack([jnp.concatenate([piece(i, d) for i in sharded]) for d in range(n)])
        mine = jax.lax.psum_scatter(rows, "fsdp", scatter_dimension=0, tiled=False)
        if dp > 1:
            mine = jax.lax.psum(mine, "data")
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
