"""The OLMo 3 model: parameter layout and count, init, layer pattern, sliding window, remat, dtypes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_ctl.core.batching import PROJ_NAMES, budget_names, param_count
from olmo_ctl.core.recipe import ModelConfig, load_model, load_recipe
from olmo_ctl.trainer import model as M

QUICK_COMPILES = True  # small programs compiled once or twice: tests/conftest.py::_quick_compiles

SMOKE = load_recipe("smoke").model
OLMO3_7B = load_model("olmo3-7b")  # recipes/models/olmo3-7b.yaml


def tiny(**kw) -> ModelConfig:
    base = dict(
        n_layers=8,
        d_model=32,
        n_heads=4,
        n_kv_heads=4,
        head_dim=8,
        mlp_hidden=64,
        vocab_size=100,
        padded_vocab_size=128,
        sliding_window=8,
        compute_dtype="float32",
        remat="none",
        eos_token_id=0,
        pad_token_id=1,
        name="tiny",
    )
    base.update(kw)
    return dataclasses.replace(OLMO3_7B, **base)


@pytest.mark.parametrize(
    "cfg",
    [SMOKE, OLMO3_7B, dataclasses.replace(OLMO3_7B, n_heads=16, n_kv_heads=16, head_dim=256)],
    ids=["smoke", "olmo3-7b", "olmo3-7b-hd256"],
)
def test_param_count_matches_batching(cfg):
    shapes = jax.eval_shape(lambda: M.init_params(cfg, jax.random.PRNGKey(0)))
    assert M.count_params(shapes) == param_count(cfg)
    assert {"embed", "lm_head", "final_norm", "blocks"} == set(shapes)
    assert shapes["blocks"]["attn"]["wq"].shape[0] == cfg.n_layers
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(shapes))
    if cfg == OLMO3_7B:
        assert M.count_params(shapes) == 7_298_617_344


def test_init_truncated_normal_and_ones():
    cfg = tiny(d_model=128, mlp_hidden=256)
    p = M.init_params(cfg, jax.random.PRNGKey(0))
    w = np.asarray(p["blocks"]["mlp"]["w1"]).ravel()
    assert abs(w.std() - 0.02 * 0.9866) < 0.0002  # std of a normal truncated at +-3 sigma
    assert np.abs(w).max() <= 3 * 0.02 + 1e-7
    assert np.abs(w).max() > 2.5 * 0.02
    for norm in (
        p["final_norm"],
        p["blocks"]["attn_norm"],
        p["blocks"]["mlp_norm"],
        p["blocks"]["attn"]["q_norm"],
    ):
        assert np.all(np.asarray(norm) == 1.0)
    assert not np.array_equal(np.asarray(p["embed"][:, :32]), np.asarray(p["lm_head"][:, :128].T))  # untied
    p16 = M.init_params(dataclasses.replace(cfg, param_dtype="bfloat16"), jax.random.PRNGKey(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))


def test_full_attention_layers_sit_at_i_plus_1_mod_4():
    cfg = OLMO3_7B
    assert [i for i in range(32) if M.layer_window(cfg, i) is None] == [3, 7, 11, 15, 19, 23, 27, 31]
    assert M.layer_window(cfg, 0) == 4096


def _naive_forward(params, tokens, cfg, windows):
    """Layer by layer in Python, each layer's window given explicitly."""
    T = tokens.shape[1]
    cos, sin = M.rope_tables(T, cfg.head_dim, cfg.rope_theta)
    x = params["embed"][tokens]
    for i, w in enumerate(windows):
        p = jax.tree.map(lambda a, i=i: a[i], params["blocks"])
        x = M.block(p, x, cos, sin, cfg, w, "reference")
    x = M.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return x @ params["lm_head"]


@pytest.mark.parametrize("n_layers,full", [(10, (3, 7, 9)), (11, (3, 7, 10)), (9, (3, 7, 8))])
def test_scan_matches_layer_by_layer_with_full_layers_at_3_7_and_the_last(n_layers, full):
    """Two groups of four, then tail layers: sliding, except the last layer, which OLMo-core forces
    to full attention (force_full_attention_on_last_layer) when n_layers is not a multiple of 4."""
    cfg = tiny(n_layers=n_layers)
    assert tuple(i for i in range(n_layers) if cfg.layer_is_full(i)) == full
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 24), 0, cfg.vocab_size)
    got = jax.jit(lambda p, t: M.forward(p, t, cfg))(params, tokens)
    right = [None if i in full else 8 for i in range(n_layers)]
    want = _naive_forward(params, tokens, cfg, right)
    scale = float(jnp.max(jnp.abs(want)))
    right_diff = float(jnp.max(jnp.abs(got - want)))
    assert right_diff < 1e-5 * scale
    old_rule = [None if i in (3, 7) else 8 for i in range(n_layers)]  # every tail layer sliding
    assert float(jnp.max(jnp.abs(got - _naive_forward(params, tokens, cfg, old_rule)))) > 1e-2 * scale
    wrong = [None if i in (2, 6) else 8 for i in range(n_layers)]
    assert float(jnp.max(jnp.abs(got - _naive_forward(params, tokens, cfg, wrong)))) > 1e-2 * scale


def test_last_layer_rule_leaves_olmo3_7b_and_hf_export_consistent():
    from olmo_ctl.checkpoints.convert import hf_config_from_model, model_config_from_hf

    assert [i for i in range(32) if OLMO3_7B.layer_is_full(i)] == [3, 7, 11, 15, 19, 23, 27, 31]
    cfg = tiny(n_layers=6)
    hf = hf_config_from_model(cfg)
    assert hf["layer_types"] == ["sliding_attention"] * 3 + [
        "full_attention",
        "sliding_attention",
        "full_attention",
    ]
    back = model_config_from_hf(hf)
    assert [back.layer_is_full(i) for i in range(6)] == [cfg.layer_is_full(i) for i in range(6)]


def test_tokens_beyond_the_window_change_only_through_full_layers():
    """Sliding layers: position t sees t-W+1..t, so 3 sliding layers reach back 3(W-1) tokens.
    Changing token 0 leaves positions > 3(W-1) untouched until the full layer (index 3) runs."""
    W, T = 6, 32
    reach = 3 * (W - 1)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, T), 2, 100)
    tokens2 = tokens.at[0, 0].set(tokens[0, 0] + 1 if tokens[0, 0] < 99 else 2)

    cfg = tiny(n_layers=4, sliding_window=W)
    params = M.init_params(cfg, jax.random.PRNGKey(0))

    def changed(f):
        a, b = f(tokens), f(tokens2)
        return np.asarray(jnp.any(jnp.abs(a - b) > 0, axis=-1))[0]

    # Layers 0-2 alone, all sliding (a 3-layer model would make its last layer full).
    first3 = jax.tree.map(lambda w: w[:3], params["blocks"])
    sliding_only = changed(jax.jit(lambda t: _naive_forward({**params, "blocks": first3}, t, cfg, [W] * 3)))
    assert sliding_only[: reach + 1].all() and not sliding_only[reach + 1 :].any()
    with_full = changed(jax.jit(lambda t: M.forward(params, t, cfg)))  # layer 3 is full attention
    assert with_full.all()


def test_remat_policies_give_the_same_gradients():
    cfg = tiny(n_layers=4)
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, cfg.vocab_size)
    grads = {}
    modes = ("none", "full", "save_proj", "mlp", "budget")
    for remat in modes:
        c = dataclasses.replace(cfg, remat=remat, remat_budget=0.3)
        grads[remat] = jax.jit(jax.grad(lambda p, c=c: jnp.mean(M.forward(p, tokens, c) ** 2)))(params)
    for remat in modes[1:]:
        for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[remat]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)


def _temp_bytes(cfg, tokens) -> int:
    """Temporary buffers of the compiled gradient: what the activations kept for the backward need."""
    params = jax.eval_shape(lambda: M.init_params(cfg, jax.random.PRNGKey(0)))
    grad = jax.jit(jax.grad(lambda p: jnp.mean(M.forward(p, tokens, cfg) ** 2)))
    return grad.lower(params).compile().memory_analysis().temp_size_in_bytes


def test_remat_modes_keep_less_in_the_order_the_plan_assumes():
    """Compiled, the modes keep less in the order the plan's estimate puts them: none > mlp >
    save_proj >= budget >= full. Four scanned groups of layers: with one group, its backward follows
    its forward at once and rematerialisation saves nothing."""
    from olmo_ctl.core.batching import activation_bytes_per_instance as estimate

    cfg = tiny(n_layers=16, d_model=64, n_heads=4, head_dim=16, mlp_hidden=256, sliding_window=64)
    tokens = jnp.zeros((4, 128), jnp.int32)
    got = {
        r: _temp_bytes(dataclasses.replace(cfg, remat=r, remat_budget=0.2), tokens)
        for r in ("none", "mlp", "save_proj", "budget", "full")
    }
    print(got)
    assert got["none"] > got["mlp"] > got["save_proj"] >= got["budget"] >= got["full"]
    est = {r: estimate(dataclasses.replace(cfg, remat=r, remat_budget=0.2), 128) for r in got}
    assert sorted(est, key=est.__getitem__) == sorted(got, key=got.__getitem__)


def test_the_budget_mode_keeps_projections_in_order_while_they_fit():
    """OLMo 3 32B's budgets: 0.5 (pre- and mid-training) keeps every projection; 0.3 (long context)
    all but the last MLP input projection; a tiny budget keeps the query projection only."""
    o32 = load_model("olmo3-32b")
    assert budget_names(dataclasses.replace(o32, remat_budget=0.5)) == PROJ_NAMES
    assert budget_names(dataclasses.replace(o32, remat_budget=0.3)) == PROJ_NAMES[:5]
    assert budget_names(dataclasses.replace(o32, remat_budget=0.035)) == ("q_proj",)
    from olmo_ctl.core.batching import activation_bytes_per_instance as act

    by_mode = {
        r: act(dataclasses.replace(o32, remat=r, remat_budget=0.3), 8192)
        for r in ("none", "mlp", "save_proj", "budget", "full")
    }
    assert by_mode["none"] > by_mode["mlp"] > by_mode["save_proj"] > by_mode["budget"] > by_mode["full"]


def test_bf16_compute_with_fp32_params_returns_fp32_logits():
    cfg = tiny(compute_dtype="bfloat16")
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, cfg.vocab_size)
    logits = jax.jit(lambda p: M.forward(p, tokens, cfg))(params)
    assert logits.dtype == jnp.float32 and logits.shape == (2, 16, 128)
    c32 = dataclasses.replace(cfg, compute_dtype="float32")
    ref = jax.jit(lambda p: M.forward(p, tokens, c32))(params)
    assert 0 < float(jnp.max(jnp.abs(logits - ref))) < 0.05
    g = jax.jit(jax.grad(lambda p: jnp.mean(M.forward(p, tokens, cfg) ** 2)))(params)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g))


def test_blocked_attention_path_matches_reference_in_the_model():
    cfg = tiny(n_layers=4)
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, cfg.vocab_size)
    a = jax.jit(lambda p: M.forward(p, tokens, cfg, attention="reference"))(params)
    b = jax.jit(lambda p: M.forward(p, tokens, cfg, attention="blocked"))(params)
    assert float(jnp.max(jnp.abs(a - b))) < 1e-5


def test_cpu_projections_give_jax_gradients_with_fewer_transposes():
    """On the CPU a projection's weight gradient is x^T dy in the weight's own order (a custom VJP):
    the same gradients as JAX's rule (what every other platform traces, here via a GPU compile
    target), in a program with fewer transposes and copies."""
    import re

    from olmo_ctl.trainer import attention as A

    cfg = tiny(n_layers=2)
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, cfg.vocab_size)

    def loss(p):
        return jnp.mean(M.forward(p, tokens, cfg, attention="blocked") ** 2)

    cpu = jax.jit(jax.grad(loss)).lower(params).compile()
    with A.compile_target("gpu"):
        rule = jax.jit(jax.grad(loss)).lower(params).compile()

    def moves(compiled):
        return len(re.findall(r"%\S*(?:transpose|copy)\S* = ", compiled.as_text()))

    print(f"transposes and copies: cpu projections {moves(cpu)}, JAX's rule {moves(rule)}")
    assert moves(cpu) < moves(rule)
    for a, b in zip(jax.tree.leaves(cpu(params)), jax.tree.leaves(rule(params)), strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * max(1.0, float(jnp.max(jnp.abs(b))))


def test_program_size_does_not_grow_with_depth():
    tokens = jnp.zeros((1, 8), jnp.int32)

    def n_eqns(n_layers):
        cfg = tiny(n_layers=n_layers)
        shapes = jax.eval_shape(lambda: M.init_params(cfg, jax.random.PRNGKey(0)))
        return len(jax.make_jaxpr(lambda p: M.forward(p, tokens, cfg))(shapes).jaxpr.eqns)

    assert n_eqns(4) == n_eqns(32)
