"""Optimizer: AdamW against optax, weight-decay mask, schedules, skip-step, fp32 state guard."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.trainer import optim

QUICK_COMPILES = True  # small programs compiled once or twice: tests/conftest.py::_quick_compiles


def _params(dtype=jnp.float32):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return {
        "embed": jax.random.normal(k[0], (16, 8), jnp.float32).astype(dtype),
        "blocks": {"w": jax.random.normal(k[1], (8, 8), jnp.float32).astype(dtype)},
        "final_norm": jnp.ones((8,), dtype),
    }


def _grads(seed: int, scale: float = 1.0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {
        "embed": scale * jax.random.normal(k[0], (16, 8)),
        "blocks": {"w": scale * jax.random.normal(k[1], (8, 8))},
        "final_norm": scale * jax.random.normal(k[2], (8,)),
    }


@pytest.fixture(scope="module")
def recipe():
    return load_recipe("smoke")


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def test_adamw_matches_optax_with_clip_and_embedding_excluded_from_decay(recipe):
    opt = recipe.optimizer
    params = _params()
    mask = optim.weight_decay_mask(params)
    assert mask["embed"] is False and mask["blocks"]["w"] is True and mask["final_norm"] is True
    ref = optax.chain(
        optax.clip_by_global_norm(opt.grad_clip),
        optax.adamw(
            1e-2, b1=opt.betas[0], b2=opt.betas[1], eps=opt.eps, weight_decay=opt.weight_decay, mask=mask
        ),
    )
    ref_state = ref.init(params)
    ref_params = params
    adam = optim.init_adam(params)
    ours = params
    for i in range(5):
        g = _grads(i, scale=3.0 if i % 2 else 0.1)  # some steps clipped, some not
        upd, ref_state = ref.update(g, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, upd)
        ours, adam, norm = optim.adamw_update(ours, g, adam, 1e-2, opt)
        np.testing.assert_allclose(float(norm), float(optax.tree.norm(g)), rtol=1e-6)  # pre-clip norm
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    assert int(adam.count) == 5


def test_weight_decay_skips_only_the_input_embedding(recipe):
    opt = dataclasses.replace(recipe.optimizer, weight_decay=0.5)
    params = _params()
    zero = jax.tree.map(jnp.zeros_like, params)
    new, _, _ = optim.adamw_update(params, zero, optim.init_adam(params), 0.1, opt)
    np.testing.assert_array_equal(np.asarray(new["embed"]), np.asarray(params["embed"]))
    np.testing.assert_allclose(
        np.asarray(new["blocks"]["w"]), np.asarray(params["blocks"]["w"]) * (1 - 0.05), rtol=1e-6
    )
    np.testing.assert_allclose(np.asarray(new["final_norm"]), 0.95, rtol=1e-6)


def test_schedules(recipe):
    s1 = dataclasses.replace(recipe.schedule, kind="cosine", warmup_steps=10, alpha=0.1)
    lr = lambda s, n: float(optim.learning_rate(s, 1.0, 110, n))  # noqa: E731
    assert lr(s1, 1) == pytest.approx(0.1)
    assert lr(s1, 5) == pytest.approx(0.5)
    assert lr(s1, 10) == pytest.approx(1.0)
    assert lr(s1, 60) == pytest.approx(0.55, abs=1e-6)  # half-way down the cosine: (1 + 0.1) / 2
    assert lr(s1, 110) == pytest.approx(0.1)
    s2 = dataclasses.replace(recipe.schedule, kind="linear", warmup_steps=0, alpha=0.0)
    assert lr(s2, 0) == pytest.approx(1.0)
    assert lr(s2, 55) == pytest.approx(0.5)
    assert lr(s2, 110) == pytest.approx(0.0)
    values = [lr(s2, n) for n in range(111)]
    assert all(a > b for a, b in zip(values, values[1:], strict=False))


def _run_skip_steps(recipe, losses):
    """Apply optimizer_step with the given CE losses; return (per-step states, skipped flags)."""
    params = _params()
    adam = optim.init_adam(params)
    window = optim.init_skip_window(recipe.optimizer.skip_step.window)
    step = jax.jit(lambda p, g, a, w, loss, n: optim.optimizer_step(p, g, a, w, loss, n, recipe))
    history = []
    for n, loss in enumerate(losses, start=1):
        before = (params, adam)
        params, adam, window, info = step(params, _grads(n % 7), adam, window, jnp.float32(loss), n)
        history.append((before, (params, adam), bool(info["skipped"])))
    return history


def test_spike_is_skipped_and_changes_nothing(recipe):
    rng = np.random.default_rng(0)
    normal = list(3.0 + 0.01 * rng.standard_normal(70))
    history = _run_skip_steps(recipe, normal + [10.0] + [3.0])
    assert [h[2] for h in history[:70]] == [False] * 70
    before, after, skipped = history[70]
    assert skipped
    assert _bits(after[0]) == _bits(before[0])  # parameters, bit for bit
    assert _bits(after[1].mu) == _bits(before[1].mu) and _bits(after[1].nu) == _bits(before[1].nu)
    assert int(after[1].count) == int(before[1].count) == 70  # bias-correction count not advanced
    assert history[71][2] is False and int(history[71][1][1].count) == 71  # training goes on


def test_nothing_is_skipped_before_min_history(recipe):
    rng = np.random.default_rng(1)
    # 62 normal steps, then a spike as the 63rd value: fewer than 64 recorded, so it is applied.
    history = _run_skip_steps(recipe, list(3.0 + 0.01 * rng.standard_normal(62)) + [50.0])
    assert not any(h[2] for h in history)
    # The same spike as the 64th value is judged (and skipped).
    history = _run_skip_steps(recipe, list(3.0 + 0.01 * rng.standard_normal(63)) + [50.0])
    assert [h[2] for h in history] == [False] * 63 + [True]


def test_grad_norm_spike_is_skipped_too(recipe):
    window = optim.init_skip_window(128)
    rng = np.random.default_rng(2)
    for v in 1.0 + 0.05 * rng.standard_normal(80):
        window, skip = optim.skip_decision(window, 3.0, v, 64, 6.0)
        assert not bool(skip)
    window, skip = optim.skip_decision(window, 3.0, 5.0, 64, 6.0)
    assert bool(skip)
    assert int(window.recorded) == 81  # the spike is recorded in the window


def test_moments_stay_fp32_with_bf16_params_and_compute(recipe):
    from olmo_ctl.trainer.model import init_params
    from olmo_ctl.trainer.train import init_state, make_train_step

    r = dataclasses.replace(
        recipe, model=dataclasses.replace(recipe.model, param_dtype="bfloat16", compute_dtype="bfloat16")
    )
    params = init_params(r.model, jax.random.PRNGKey(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    state = init_state(r, params)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 2, 128)), jnp.int32)
    state, metrics = jax.jit(make_train_step(r))(state, {"input_ids": ids, "labels": ids})
    assert np.isfinite(float(metrics["ce"]))
    for leaf in jax.tree.leaves((state["opt"]["mu"], state["opt"]["nu"])):
        assert leaf.dtype == jnp.float32
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state["params"]))
    optim.check_fp32_state(state["params"], optim.AdamState(**state["opt"]), "bfloat16")
    # The guard fails loudly when a moment has been demoted, or the weights are not the configured dtype.
    demoted = optim.AdamState(
        jax.tree.map(lambda x: x.astype(jnp.bfloat16), state["opt"]["mu"]),
        state["opt"]["nu"],
        state["opt"]["count"],
    )
    with pytest.raises(optim.OptimizerDtypeError, match="mu"):
        optim.check_fp32_state(state["params"], demoted, "bfloat16")
    with pytest.raises(optim.OptimizerDtypeError, match="configured float32"):
        optim.check_fp32_state(state["params"], optim.AdamState(**state["opt"]), "float32")


def test_gradient_accumulation_is_exact(recipe):
    """One step over 8 instances at once equals 4 accumulated micro-batches of 2 (up to fp32 rounding),
    with ignored labels spread unevenly so a per-micro-batch mean would differ."""
    from olmo_ctl.trainer.model import init_params
    from olmo_ctl.trainer.train import IGNORE_INDEX, init_state, make_train_step

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 256, (8, 128)).astype(np.int32)
    labels = np.roll(ids, -1, axis=1)
    labels[:2, 16:] = IGNORE_INDEX  # the first micro-batch has far fewer target tokens
    step = jax.jit(make_train_step(recipe))
    params = init_params(recipe.model, jax.random.PRNGKey(0))
    out = {}
    for accum in (1, 4):
        batch = {
            "input_ids": jnp.asarray(ids.reshape(accum, 8 // accum, 128)),
            "labels": jnp.asarray(labels.reshape(accum, 8 // accum, 128)),
        }
        state, m = step(init_state(recipe, params), batch)
        out[accum] = (m, state["params"])
    (m1, p1), (m4, p4) = out[1], out[4]
    for k in ("ce", "z", "grad_norm"):
        np.testing.assert_allclose(float(m4[k]), float(m1[k]), rtol=2e-5)
    assert float(m1["tokens"]) == float(m4["tokens"]) == 6 * 128 + 2 * 16
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)  # Adam step ~3e-4


def test_linear_schedule_with_warmup(recipe):
    s = dataclasses.replace(recipe.schedule, kind="linear", warmup_steps=10, alpha=0.0)
    lr = lambda n: float(optim.learning_rate(s, 1.0, 110, n))  # noqa: E731
    assert lr(5) == pytest.approx(0.5) and lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.5) and lr(110) == pytest.approx(0.0)


def _olmo_core_skips(losses, norms, window=128, sigma=6.0):
    """OLMo-core's SkipStepOptimizer rule, written out over Python lists (the reference): it keeps
    `window` + 1 values and judges the latest against the mean and std of all the others, once
    max(20, window // 2) values are held."""
    hl, hn, out = [], [], []
    for loss, norm in zip(losses, norms, strict=True):
        hl.append(loss)
        hn.append(norm)
        del hl[: -(window + 1)], hn[: -(window + 1)]
        if len(hl) < max(20, window // 2):
            out.append(False)
            continue
        pl, pn = np.array(hl[:-1], np.float64), np.array(hn[:-1], np.float64)
        ok = (loss - pl.mean()) <= sigma * pl.std(ddof=1) and (norm - pn.mean()) <= sigma * pn.std(ddof=1)
        out.append(not ok)
    return out


def test_skip_decisions_match_olmo_core_over_the_128_previous_values():
    # A huge value 128 steps back still counts (it inflates the std, so the moderate spike at the
    # 129th value is applied); a window of the 127 previous values would skip it. Then a long random
    # run with spikes: every decision equals the reference's.
    losses = [100.0] + [3.0 + 0.01 * ((i * 7919) % 13 - 6) for i in range(127)] + [3.5, 3.0]
    norms = [1.0 + 0.001 * (i % 5) for i in range(len(losses))]
    rng = np.random.default_rng(3)
    tail = 3.0 + 0.02 * rng.standard_normal(300)
    tail[[150, 151, 220, 299]] += [1.0, 0.3, 5.0, 0.2]
    tail_norms = 1.0 + 0.01 * rng.standard_normal(300)
    tail_norms[[90, 260]] += 2.0
    for ls, ns in ((losses, norms), (list(tail), list(tail_norms))):
        window = optim.init_skip_window(128)
        step = jax.jit(lambda w, a, b: optim.skip_decision(w, a, b, 64, 6.0))
        ours = []
        for a, b in zip(ls, ns, strict=True):
            window, skip = step(window, jnp.float32(a), jnp.float32(b))
            ours.append(bool(skip))
        ref = _olmo_core_skips([float(np.float32(x)) for x in ls], [float(np.float32(x)) for x in ns])
        assert ours == ref
    assert any(ref)  # the random run's spikes are skipped
    # the first case is decided by the 128th previous value: applied, where 127 would skip it
    assert _olmo_core_skips(losses, norms)[128] is False
    assert _olmo_core_skips(losses, norms, window=127)[128] is True
