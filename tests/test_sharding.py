"""Mesh and shardings on 4 forced host devices: FSDP and hybrid FSDP x DP give the unsharded numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
from jax.sharding import PartitionSpec as P

from olmo_ctl.core.recipe import ModelConfig
from olmo_ctl.trainer import model as M
from olmo_ctl.trainer import sharding as S


class _FakeMesh:
    def __init__(self, data, fsdp):
        self.shape = {"data": data, "fsdp": fsdp}


def test_7b_specs_shard_the_largest_divisible_axis_never_the_layer_axis():
    shapes = jax.eval_shape(lambda: M.init_params(ModelConfig(), jax.random.PRNGKey(0)))
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


SCRIPT = textwrap.dedent("""
    import json, dataclasses
    import jax, jax.numpy as jnp
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.trainer import model as M, sharding as S
    assert jax.device_count() == 4
    cfg = load_recipe("smoke").model
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 64), 0, cfg.vocab_size)
    loss = lambda p, t: jnp.mean(M.forward(p, t, cfg) ** 2)
    want_loss, want_grad = jax.jit(jax.value_and_grad(loss))(params, tokens)
    out = {}
    for kind, dp in (("fsdp", 1), ("hybrid", 2)):
        mesh = S.make_mesh(kind=kind, data_parallel=dp, activate=False)
        p = jax.device_put(params, S.param_shardings(params, mesh))
        t = jax.device_put(tokens, S.batch_sharding(mesh))
        with jax.set_mesh(mesh):
            got_loss, got_grad = jax.jit(jax.value_and_grad(loss))(p, t)
        out[kind] = {
            "mesh": dict(mesh.shape),
            "loss_diff": abs(float(got_loss - want_loss)),
            "grad_diff": max(float(jnp.max(jnp.abs(a - b))) for a, b in
                             zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad))),
            "embed_shards": len({str(s.index) for s in p["embed"].addressable_shards}),
            "w1_shard_shape": list(p["blocks"]["mlp"]["w1"].addressable_shards[0].data.shape),
            "tokens_shard_shape": list(t.addressable_shards[0].data.shape),
        }
    # make_mesh activates its mesh: the compiled FSDP step gathers weights and never all-reduces
    # whole activations (which is what XLA picks for the same program without an activation mesh).
    import re
    mesh = S.make_mesh()
    p = jax.device_put(params, S.param_shardings(params, mesh))
    t = jax.device_put(tokens, S.batch_sharding(mesh))
    hlo = jax.jit(jax.grad(loss)).lower(p, t).compile().as_text()
    act = f"[{tokens.shape[0]},{tokens.shape[1]},{cfg.d_model}]"
    out["activation_all_reduces"] = len(re.findall(r"\\S+" + re.escape(act) + r"\\S* all-reduce\\(", hlo))
    out["all_gathers"] = len(re.findall(r" all-gather\\(", hlo))
    S.deactivate()
    hlo = jax.jit(jax.grad(loss)).lower(p, t).compile().as_text()
    out["activation_all_reduces_without_mesh"] = len(re.findall(r"\\S+" + re.escape(act) + r"\\S* all-reduce\\(", hlo))
    print("RESULT " + json.dumps(out))
""")


def test_fsdp_and_hybrid_match_single_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
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
        S.make_mesh(jax.devices() * 3, kind="hybrid", data_parallel=2)
    with pytest.raises(ValueError):
        S.make_mesh(kind="ring")
