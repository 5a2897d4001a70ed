"""Mesh and shardings on 4 forced host devices: FSDP and hybrid FSDP x DP give the unsharded numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
from jax.sharding import PartitionSpec as P

from olmo_ctl.core.recipe import load_model
from olmo_ctl.trainer import model as M
from olmo_ctl.trainer import sharding as S

QUICK_COMPILES = True  # small programs compiled once or twice: tests/conftest.py::_quick_compiles


class _FakeMesh:
    def __init__(self, data, fsdp):
        self.shape = {"data": data, "fsdp": fsdp}


def test_7b_specs_shard_the_largest_divisible_axis_never_the_layer_axis():
    shapes = jax.eval_shape(lambda: M.init_params(load_model("olmo3-7b"), jax.random.PRNGKey(0)))
    specs = S.param_partition_specs(shapes, _FakeMesh(1, 256))
    assert specs["embed"] == P("fsdp", None)  # 100352 rows = 256 x 392
    assert specs["lm_head"] == P(None, "fsdp")
    assert specs["blocks"]["mlp"]["w1"] == P(None, None, "fsdp")  # [32, 4096, 11008]: 11008 = 256 x 43
    assert specs["blocks"]["mlp"]["w2"] == P(None, "fsdp", None)
    assert specs["blocks"]["attn"]["wq"] == P(None, "fsdp", None)  # ties go to the first axis
    assert specs["blocks"]["attn_norm"] == P(None, "fsdp")
    assert specs["final_norm"] == P("fsdp")
    # 32 layers would divide 32 devices, but the layer axis is never sharded; 4096 is larger anyway.
    specs32 = S.param_partition_specs(shapes, _FakeMesh(1, 32))
    assert all(s[0] is None for s in jax.tree.leaves(specs32["blocks"], is_leaf=lambda x: isinstance(x, P)))
    # Nothing divides 3: replicated.
    odd = S.param_partition_specs(shapes, _FakeMesh(1, 3))
    assert odd["blocks"]["attn"]["wq"] == P(None, None, None)


def _fsdp_and_hybrid_on_4_devices() -> dict:
    """Loss and gradients of the smoke model on 4 of this process's host devices (tests/conftest.py)."""
    import re

    import jax.numpy as jnp

    from olmo_ctl.core.recipe import load_recipe

    devs = jax.devices()[:4]
    assert len(devs) == 4, "needs 4 host devices (tests/conftest.py sets jax_num_cpu_devices)"
    cfg = load_recipe("smoke").model
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 64), 0, cfg.vocab_size)
    loss = lambda p, t: jnp.mean(M.forward(p, t, cfg) ** 2)  # noqa: E731
    want_loss, want_grad = jax.jit(jax.value_and_grad(loss))(params, tokens)
    out = {}
    for kind, dp in (("fsdp", 1), ("hybrid", 2)):
        mesh = S.make_mesh(devs, kind=kind, data_parallel=dp, activate=False)
        p = jax.device_put(params, S.param_shardings(params, mesh))
        t = jax.device_put(tokens, S.batch_sharding(mesh))
        with jax.set_mesh(mesh):
            got_loss, got_grad = jax.jit(jax.value_and_grad(loss))(p, t)
        out[kind] = {
            "mesh": dict(mesh.shape),
            "loss_diff": abs(float(got_loss - want_loss)),
            "grad_diff": max(
                float(jnp.max(jnp.abs(a - b)))
                for a, b in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad), strict=True)
            ),
            "embed_shards": len({str(s.index) for s in p["embed"].addressable_shards}),
            "w1_shard_shape": list(p["blocks"]["mlp"]["w1"].addressable_shards[0].data.shape),
            "tokens_shard_shape": list(t.addressable_shards[0].data.shape),
        }
    # make_mesh activates its mesh: the compiled FSDP step gathers weights and never all-reduces
    # whole activations (which is what XLA picks for the same program without an activation mesh).
    mesh = S.make_mesh(devs)
    try:
        p = jax.device_put(params, S.param_shardings(params, mesh))
        t = jax.device_put(tokens, S.batch_sharding(mesh))
        hlo = jax.jit(jax.grad(loss)).lower(p, t).compile().as_text()
    finally:
        S.deactivate()
    act = f"[{tokens.shape[0]},{tokens.shape[1]},{cfg.d_model}]"
    out["activation_all_reduces"] = len(re.findall(r"\S+" + re.escape(act) + r"\S* all-reduce\(", hlo))
    out["all_gathers"] = len(re.findall(r" all-gather\(", hlo))
    hlo = jax.jit(jax.grad(loss)).lower(p, t).compile().as_text()
    out["activation_all_reduces_without_mesh"] = len(
        re.findall(r"\S+" + re.escape(act) + r"\S* all-reduce\(", hlo)
    )
    return out


def test_fsdp_and_hybrid_match_single_device():
    out = _fsdp_and_hybrid_on_4_devices()
    fsdp, hybrid = out["fsdp"], out["hybrid"]
    assert fsdp["mesh"] == {"data": 1, "fsdp": 4} and hybrid["mesh"] == {"data": 2, "fsdp": 2}
    for res in (fsdp, hybrid):
        assert res["loss_diff"] < 1e-6 and res["grad_diff"] < 1e-6
        assert res["tokens_shard_shape"] == [2, 64]  # the batch is split over every device
    assert fsdp["embed_shards"] == 4 and fsdp["w1_shard_shape"] == [4, 64, 44]  # smoke: mlp_hidden 176 / 4
    assert out["activation_all_reduces"] == 0 and out["all_gathers"] > 0
    assert out["activation_all_reduces_without_mesh"] > 0  # the check can tell the difference
    assert hybrid["embed_shards"] == 2 and hybrid["w1_shard_shape"] == [4, 64, 88]  # replicated over data


def test_bad_hybrid_mesh():
    import pytest

    with pytest.raises(ValueError):
        S.make_mesh(jax.devices()[:1] * 3, kind="hybrid", data_parallel=2)  # 3 devices, 2 replicas
    with pytest.raises(ValueError):
        S.make_mesh(kind="ring")


# ---------------------------------------------------------------- multislice


class _Dev:
    """A device as the mesh sees it: an id, its slice (None: the runtime names none), a platform."""

    def __init__(self, i, slice_index=None, platform="cpu"):
        self.id, self.platform = i, platform
        if slice_index is not None:
            self.slice_index = slice_index

    def __repr__(self):
        return f"d{self.id}"


def test_multislice_puts_the_slices_on_the_outer_data_axis():
    # 2 slices x 4 devices, listed interleaved: grouped by slice_index, slice 0 in the first rows.
    devs = [_Dev(i, slice_index=i % 2) for i in range(8)]
    grid = S.multislice_devices(devs, "fsdp", 1, 2)
    assert grid.shape == (2, 4)
    assert [[d.slice_index for d in row] for row in grid] == [[0] * 4, [1] * 4]
    # hybrid (2 replicas inside each slice): data = 2 slices x 2, fsdp = 2 devices of one slice
    grid = S.multislice_devices(devs, "hybrid", 2, 2)
    assert grid.shape == (4, 2)
    assert [{d.slice_index for d in row} for row in grid] == [{0}, {0}, {1}, {1}]
    # no slice_index (CPU): N equal consecutive groups
    grid = S.multislice_devices([_Dev(i) for i in range(8)], "fsdp", 1, 2)
    assert [[d.id for d in row] for row in grid] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # the sandbox's emulated slices: CPU devices all say slice_index 0; the slices are the processes
    # as the join numbers them (slice 0: processes 0 and 1, slice 1: 2 and 3), in any listed order
    emulated = [_Dev(i, slice_index=0) for i in range(8)]
    for d in emulated:
        d.process_index = (7 - d.id) // 2
    grid = S.multislice_devices(emulated, "fsdp", 1, 2)
    assert [sorted(d.process_index for d in row) for row in grid] == [[0, 0, 1, 1], [2, 2, 3, 3]]
    for bad, why in (
        ([_Dev(i, i % 3) for i in range(6)], "slice_index"),
        ([_Dev(i, 0 if i < 5 else 1) for i in range(8)], "unequal"),
        ([_Dev(i) for i in range(7)], "do not split"),
    ):
        try:
            S.multislice_devices(bad, "fsdp", 1, 2)
        except ValueError as e:
            assert why in str(e)
        else:
            raise AssertionError(f"accepted {bad}")


def test_multislice_mesh_on_a_real_two_slice_tpu_topology():
    """libtpu's own description of 2 x v5p-16 (compile-only devices, no TPU attached): make_mesh groups
    its devices by slice through create_hybrid_device_mesh; the parameters are sharded within a slice
    (fsdp = 8) and replicated over the two slices; the batch is split over all 16 devices."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("needs libtpu (pip install 'olmo-ctl[tpu]')")
    code = textwrap.dedent("""
        import json
        from jax.experimental import topologies
        from olmo_ctl.trainer import sharding as S
        topo = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2", num_slices=2)
        devs = list(topo.devices)
        out = {}
        for kind, dp in (("fsdp", 1), ("hybrid", 2)):
            m = S.make_mesh(devs, kind, dp, activate=False, slices=2)
            out[kind] = {"shape": dict(m.shape), "slices": [sorted({d.slice_index for d in row}) for row in m.devices],
                         "batch": S.batch_sharding(m).shard_shape((32, 8))[0]}
        print(json.dumps(out))
    """)
    env = {
        **os.environ,
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_ACCELERATOR_TYPE": "v5p-16",
    }
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["fsdp"] == {"shape": {"data": 2, "fsdp": 8}, "slices": [[0], [1]], "batch": 2}
    assert out["hybrid"] == {"shape": {"data": 4, "fsdp": 4}, "slices": [[0], [0], [1], [1]], "batch": 2}


# ---------------------------------------------------------------- a sequence-shard group on one host


class _HostDev:
    """A device of host `process_index` (what the mesh's host rule reads)."""

    def __init__(self, i, process_index):
        self.id, self.process_index = i, process_index

    def __repr__(self):
        return f"d{self.id}@h{self.process_index}"


def test_sequence_shard_groups_are_laid_out_host_by_host():
    import numpy as np

    # A TPU torus row as create_hybrid_device_mesh orders it: consecutive devices on different hosts.
    row = [_HostDev(i, i % 4) for i in range(16)]
    arr = np.asarray(row, dtype=object).reshape(1, 16)
    assert [d.process_index for d in arr[0, :4]] == [0, 1, 2, 3]
    laid = S.host_major(arr)
    assert [d.process_index for d in laid[0]] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert [d.id for d in laid[0, :4]] == [0, 4, 8, 12]  # each host's devices keep their order
    for s in (2, 4):
        S.check_seq_groups(laid, s, "fsdp", 1, 2)  # every group is one host's
    # A row already host by host (the CPU twin) is unchanged.
    twin = np.asarray([_HostDev(i, i // 2) for i in range(4)], dtype=object).reshape(1, 4)
    assert [d.id for d in S.host_major(twin)[0]] == [0, 1, 2, 3]


def test_a_layout_whose_sequence_shard_group_spans_hosts_is_refused_with_exit_2():
    import numpy as np
    import pytest

    from olmo_ctl.core.errors import BadInput

    # hybrid, 2 replicas of a torus order: each of a slice's 4 hosts has 2 devices in each replica, so
    # a group of 4 needs two hosts however the replica is laid out
    arr = np.asarray([_HostDev(i, i % 4 + 4 * (i // 8)) for i in range(16)], dtype=object).reshape(2, 8)
    laid = S.host_major(arr)
    S.check_seq_groups(laid, 2, "hybrid", 2, 1)
    with pytest.raises(S.LayoutSpansHosts) as e:
        S.check_seq_groups(laid, 4, "hybrid", 2, 1)
    assert isinstance(e.value, BadInput) and e.value.exit_code == 2
    assert e.value.one_line().startswith(
        "train.seq_shards 4 with mesh hybrid (data_parallel 2) (2 data replicas of 8 devices): the "
        "sequence-shard group of replica 0, devices 0..3, spans hosts 0, 1 (host 0 has 2 devices in that replica)"
    )


def test_multislice_sequence_shards_stay_on_one_host_of_a_real_two_slice_topology():
    """libtpu's 2 x v5p-32 (compile-only devices): its torus order puts consecutive devices on four
    different hosts; with seq_shards 2 and 4 make_mesh keeps every group on one host, each slice in its
    own rows, and the mesh still holds every device once."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("needs libtpu (pip install 'olmo-ctl[tpu]')")
    code = textwrap.dedent("""
        import json
        from jax.experimental import mesh_utils, topologies
        from olmo_ctl.trainer import sharding as S
        topo = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x4", num_slices=2)
        devs = list(topo.devices)
        torus = mesh_utils.create_hybrid_device_mesh((1, 16), (2, 1), devs)
        out = {"torus_row": [d.process_index for d in torus[0][:4]]}
        for kind, dp, s in (("fsdp", 1, 2), ("fsdp", 1, 4), ("hybrid", 2, 2)):
            m = S.make_mesh(devs, kind, dp, activate=False, slices=2, seq_shards=s)
            groups = m.devices.reshape(-1, s)
            out[f"{kind}-{s}"] = {
                "shape": dict(m.shape),
                "hosts_per_group": sorted({len({d.process_index for d in g}) for g in groups}),
                "devices": len({d.id for d in m.devices.flat}),
                "slices": [sorted({d.slice_index for d in row.flat}) for row in m.devices],
            }
        print(json.dumps(out))
    """)
    env = {
        **os.environ,
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_ACCELERATOR_TYPE": "v5p-32",
    }
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["torus_row"] == [0, 1, 2, 3]  # what the mesh must not use as it is
    assert out["fsdp-2"]["shape"] == {"data": 2, "fsdp": 8, "seq": 2}
    assert out["fsdp-4"]["shape"] == {"data": 2, "fsdp": 4, "seq": 4}
    assert out["hybrid-2"]["shape"] == {"data": 4, "fsdp": 4, "seq": 2}
    for key in ("fsdp-2", "fsdp-4", "hybrid-2"):
        assert out[key]["hosts_per_group"] == [1], key
        assert out[key]["devices"] == 32, key
    assert out["fsdp-4"]["slices"] == [[0], [1]] and out["hybrid-2"]["slices"] == [[0], [0], [1], [1]]
