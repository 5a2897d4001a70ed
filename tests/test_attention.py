"""Blocked (flash-style) attention against the plain reference: values, gradients, window semantics."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_ctl.core.generations import DEFAULT_SPLASH_BLOCKS
from olmo_ctl.trainer import attention as A

QUICK_COMPILES = True  # small programs compiled once or twice: tests/conftest.py::_quick_compiles

CASES = [
    # B, T, H, KV, D, window, block
    (2, 64, 4, 4, 16, 20, 16),  # window shorter than T, not a multiple of the block
    (2, 70, 4, 2, 16, None, 16),  # full causal, grouped-query, T not a multiple of the block
    (1, 50, 2, 1, 8, 7, 8),  # multi-query, tiny window
    (1, 48, 2, 2, 8, 48, 16),  # window = T: plain causal
    (1, 40, 10, 2, 8, 12, 16),  # the 32B's grouped-query ratio (5 query heads per KV head, as 40/8)
]


def _qkv(B, T, H, KV, D, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (
        jax.random.normal(ks[0], (B, T, H, D)),
        jax.random.normal(ks[1], (B, T, KV, D)),
        jax.random.normal(ks[2], (B, T, KV, D)),
        jax.random.normal(ks[3], (B, T, H, D)),
    )


@pytest.mark.parametrize("B,T,H,KV,D,window,block", CASES)
def test_blocked_matches_reference_fp32(B, T, H, KV, D, window, block):
    q, k, v, g = _qkv(B, T, H, KV, D)
    ref = A.attend(q, k, v, window=window, impl="reference")
    blk = jax.jit(lambda q, k, v: A.attend(q, k, v, window=window, impl="blocked", block=block))(q, k, v)
    diff = float(jnp.max(jnp.abs(ref - blk)))
    print(f"max |blocked - reference| forward {diff:.2e}")
    assert diff < 1e-5

    def loss(impl):
        return lambda q, k, v: jnp.sum(A.attend(q, k, v, window=window, impl=impl, block=block) * g)

    g_ref = jax.jit(jax.grad(loss("reference"), (0, 1, 2)))(q, k, v)
    g_blk = jax.jit(jax.grad(loss("blocked"), (0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", g_ref, g_blk, strict=True):
        d = float(jnp.max(jnp.abs(a - b)))
        print(f"max |blocked - reference| d{name} {d:.2e}")
        assert d < 1e-5 * max(1.0, float(jnp.max(jnp.abs(a))))


@pytest.mark.parametrize("B,T,H,KV,D,window,block", CASES)
def test_banded_matches_reference_fp32(B, T, H, KV, D, window, block):
    """Sliding layers by chunks of `window` queries (T not a multiple of it included); full layers
    (window None, or a window as long as the sequence) run the blocked kernel."""
    q, k, v, g = _qkv(B, T, H, KV, D)
    if window is not None and window < T:
        assert A.banded_fits(q.shape, window)  # the chunks run, not the blocked fallback
    ref = _values_and_grads(lambda q, k, v: A.attend(q, k, v, window=window, impl="reference"), q, k, v, g)
    got = _values_and_grads(lambda q, k, v: A.attend(q, k, v, window=window, impl="banded"), q, k, v, g)
    _assert_close(ref, got)


def test_banded_runs_only_where_its_chunks_are_few_windows_and_small():
    assert A.banded_fits((4, 128, 4, 16), 32)  # the smoke model's step on one of two devices
    assert not A.banded_fits((1, 40, 2, 8), 20)  # two chunks: as much score work as a [T, T] tile
    assert not A.banded_fits((1, 8192, 32, 128), 4096)  # OLMo 3 7B's sliding layers: blocked
    assert not A.banded_fits((64, 65536, 32, 128), 4096)  # scores far above the cap
    # Where it does not fit, `banded` is the blocked kernel (the same program, tile loops and all).
    q, k, v, _ = _qkv(1, 40, 2, 2, 8)
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: A.attend(q, k, v, window=20, impl="banded"))(q, k, v))
    assert jaxpr == str(jax.make_jaxpr(lambda q, k, v: A.attend(q, k, v, window=20, impl="blocked"))(q, k, v))


@pytest.mark.parametrize("window", [20, 7])
def test_banded_segments_match_reference(window):
    B, T, H, KV, D = 2, 70, 4, 2, 16
    q, k, v, g = _qkv(B, T, H, KV, D)
    seg = _segments(B, T)
    ref = _values_and_grads(
        lambda q, k, v: A.attend(q, k, v, window=window, impl="reference", segment_ids=seg), q, k, v, g
    )
    got = _values_and_grads(
        lambda q, k, v: A.attend(q, k, v, window=window, impl="banded", segment_ids=seg), q, k, v, g
    )
    _assert_close(ref, got)


def test_banded_keeps_scores_linear_in_the_sequence():
    """Forward + backward at T = 1024 with a 64-token window: no intermediate as large as one head's
    [T, T] score matrix (the reference path builds several), so its memory grows with T x window."""
    T, W = 1024, 64
    q, k, v, g = _qkv(1, T, 2, 2, 8)

    def largest(impl):
        f = jax.grad(lambda q, k, v: jnp.sum(A.attend(q, k, v, window=W, impl=impl) * g), (0, 1, 2))
        jaxpr = jax.make_jaxpr(f)(q, k, v)
        return max(int(np.prod(getattr(o.aval, "shape", ()))) for e in jaxpr.jaxpr.eqns for o in e.outvars)

    assert largest("banded") <= 2 * T * 2 * W  # [B, H, T / W, W, 2W]: two heads, 2W keys per query
    assert largest("reference") >= 2 * T * T  # the check can tell the two apart


def test_blocked_bf16_close_to_reference():
    q, k, v, _ = _qkv(2, 64, 4, 4, 16)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    ref = A.attend(q, k, v, window=24, impl="reference").astype(jnp.float32)
    blk = A.attend(q, k, v, window=24, impl="blocked", block=16).astype(jnp.float32)
    assert blk.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(ref - blk))) < 2e-2


@pytest.mark.parametrize("impl", ["reference", "blocked", "banded"])
def test_window_semantics(impl):
    """Query i sees keys j with i - W < j <= i: the token itself plus W-1 before it."""
    T, W = 40, 8
    q, k, v, _ = _qkv(1, T, 2, 2, 8)
    base = A.attend(q, k, v, window=W, impl=impl, block=16)
    j = 10
    v2 = v.at[:, j].add(1.0)
    changed = np.asarray(
        jnp.any(jnp.abs(A.attend(q, k, v2, window=W, impl=impl, block=16) - base) > 1e-6, axis=(0, 2, 3))
    )
    assert list(np.nonzero(changed)[0]) == list(range(j, j + W))


def test_blocked_never_builds_full_score_matrix():
    """The jaxpr of the blocked forward + backward holds no [T, T]-sized intermediate."""
    T, blk = 256, 32
    q, k, v, g = _qkv(1, T, 2, 2, 8)

    def f(q, k, v):
        return jnp.sum(A.attend(q, k, v, window=None, impl="blocked", block=blk) * g)

    jaxpr = jax.make_jaxpr(jax.grad(f, (0, 1, 2)))(q, k, v)
    sizes = []

    def walk(jp):
        for eqn in jp.eqns:
            for var in eqn.outvars:
                sizes.append(int(np.prod(getattr(var.aval, "shape", ()))))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    assert max(sizes) < 2 * T * T  # one head's full score matrix would be 2 x T x T here
    ref = jax.make_jaxpr(lambda q, k, v: A.attend(q, k, v, window=None, impl="reference"))(q, k, v)
    assert any(
        int(np.prod(getattr(o.aval, "shape", ()))) >= 2 * T * T for e in ref.jaxpr.eqns for o in e.outvars
    )


def test_auto_is_banded_on_cpu():
    assert jax.default_backend() == "cpu"
    assert A.resolve("auto") == "banded"
    with pytest.raises(ValueError):
        A.resolve("magic")


@pytest.mark.parametrize("window", [None, 4096])
def test_blocked_at_8192_tokens_needs_far_less_than_one_score_matrix(window):
    """Compiled forward + backward at 8192 tokens: XLA's temporary buffers stay far below one head's
    [8192, 8192] fp32 score matrix (256 MiB); the reference path needs several of them."""
    T = 8192
    sd = jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32)
    one_matrix = T * T * 4

    def temp_bytes(impl):
        f = jax.grad(lambda q, k, v: jnp.sum(A.attend(q, k, v, window=window, impl=impl)), (0, 1, 2))
        return jax.jit(f).lower(sd, sd, sd).compile().memory_analysis().temp_size_in_bytes

    blocked = temp_bytes("blocked")
    print(
        f"temp bytes at T=8192: blocked {blocked / 2**20:.1f} MiB, one score matrix {one_matrix / 2**20:.0f} MiB"
    )
    assert blocked < one_matrix / 8
    assert temp_bytes("reference") > one_matrix  # the check can tell the two apart


def test_blocked_inside_a_layer_scan_keeps_no_stacked_tiles():
    """The model scans its layers; under `grad`, an enclosing `lax.scan` must not turn the kernel's
    per-tile intermediates into stacked residuals (that rebuilds a full score matrix per head)."""
    T = 2048
    sd = jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32)
    one_matrix = 2 * T * T * 4  # both heads

    def temp_bytes(impl):
        def loss(q, k, v):
            def layer(x, _):
                return A.attend(x, k, v, window=None, impl=impl, block=256), None

            return jnp.sum(jax.lax.scan(layer, q, None, length=2)[0])

        f = jax.jit(jax.grad(loss, (0, 1, 2)))
        return f.lower(sd, sd, sd).compile().memory_analysis().temp_size_in_bytes

    blocked = temp_bytes("blocked")
    print(f"temp bytes, 2 scanned layers at T={T}: blocked {blocked / 2**20:.1f} MiB")
    assert blocked < one_matrix / 4
    assert temp_bytes("reference") > one_matrix


# ----------------------------------------------------------------------------- segment ids


def _segments(B, T, seed=1):
    """Packed documents: ids rise at random boundaries (some instances hold several documents)."""
    starts = jax.random.bernoulli(jax.random.PRNGKey(seed), 0.03, (B, T)).astype(jnp.int32)
    return jnp.cumsum(starts, axis=1)


def _values_and_grads(fn, q, k, v, g):
    """Output and (dq, dk, dv) for the cotangent g, from one compiled function."""

    def f(q, k, v):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(g)

    return jax.jit(f)(q, k, v)


def _assert_close(a, b, tol=1e-5):
    (oa, ga), (ob, gb) = a, b
    assert float(jnp.max(jnp.abs(oa - ob))) < tol
    for name, x, y in zip("qkv", ga, gb, strict=True):
        d = float(jnp.max(jnp.abs(x - y)))
        assert d < tol, f"d{name} differs by {d:.2e}"


def test_reference_segments_never_cross():
    """A value changed in one document moves only that document's outputs."""
    T = 48
    q, k, v, _ = _qkv(1, T, 2, 2, 8)
    seg = jnp.asarray([[0] * 20 + [1] * 28])
    base = A.attend(q, k, v, window=None, impl="reference", segment_ids=seg)
    moved = A.attend(q, k, v.at[:, 5].add(1.0), window=None, impl="reference", segment_ids=seg)
    changed = np.nonzero(np.asarray(jnp.any(jnp.abs(moved - base) > 1e-6, axis=(0, 2, 3))))[0]
    assert list(changed) == list(range(5, 20))
    # The first document's outputs are those of attention over that document alone.
    alone = A.attend(q[:, :20], k[:, :20], v[:, :20], window=None, impl="reference")
    assert float(jnp.max(jnp.abs(alone - base[:, :20]))) < 1e-6


@pytest.mark.parametrize("window", [None, 20])
def test_blocked_segments_match_reference(window):
    B, T, H, KV, D = 2, 70, 4, 2, 16
    q, k, v, g = _qkv(B, T, H, KV, D)
    seg = _segments(B, T)
    assert int(seg.max()) >= 1
    ref = _values_and_grads(
        lambda q, k, v: A.attend(q, k, v, window=window, impl="reference", segment_ids=seg), q, k, v, g
    )
    blk = _values_and_grads(
        lambda q, k, v: A.attend(q, k, v, window=window, impl="blocked", block=16, segment_ids=seg),
        q,
        k,
        v,
        g,
    )
    _assert_close(ref, blk)


# ----------------------------------------------------------------------------- splash (interpret mode)


@pytest.mark.parametrize("window,segments", [(None, False), (100, False), (100, True), (None, True)])
def test_splash_matches_reference_fp32(window, segments):
    """Values and gradients, grouped-query (2 heads per KV head), three 128-token blocks each way:
    the local mask skips whole blocks, the causal mask computes half, segment ids cut documents."""
    B, T, H, KV, D = 1, 384, 2, 1, 16
    q, k, v, g = _qkv(B, T, H, KV, D)
    seg = _segments(B, T) if segments else None
    ref = _values_and_grads(
        lambda q, k, v: A.attend(q, k, v, window=window, impl="reference", segment_ids=seg), q, k, v, g
    )
    spl = _values_and_grads(
        lambda q, k, v: A.splash_attention(q, k, v, window=window, segment_ids=seg, blocks=(128, 128, 128)),
        q,
        k,
        v,
        g,
    )
    _assert_close(ref, spl)


def test_splash_through_attend_pads_the_sequence():
    """`attend(impl="splash")` with the default blocks on a length that is no multiple of 128."""
    q, k, v, g = _qkv(1, 200, 2, 2, 16)
    ref = _values_and_grads(lambda q, k, v: A.attend(q, k, v, window=64, impl="reference"), q, k, v, g)
    spl = _values_and_grads(lambda q, k, v: A.attend(q, k, v, window=64, impl="splash"), q, k, v, g)
    _assert_close(ref, spl)


def test_splash_masks_follow_olmo3_window():
    """The kernel's LocalMask sees exactly what `causal_mask` sees (itself + window-1 before)."""
    T, W = 256, 37
    mask = A.splash_mask(T, W)
    pos = jnp.arange(T)
    assert np.array_equal(np.asarray(mask[:, :]), np.asarray(A.causal_mask(pos, pos, W)))
    assert np.array_equal(np.asarray(A.splash_mask(T, None)[:, :]), np.asarray(A.causal_mask(pos, pos, None)))


def test_splash_blocks_per_generation():
    assert A.splash_blocks("tpu7x", 8192) == ((2048, 2048, 512), 8192)  # the profiles' (core/generations.py)
    assert A.splash_blocks("v5p", 8192) == ((1024, 1024, 512), 8192)
    (bq, bkv, bkvc), tp = A.splash_blocks("tpu7x", 1000)  # cut to the sequence, padded to the block
    assert bq == bkv == 1024 and tp == 1024 and bkv % bkvc == 0
    (bq, bkv, _), tp = A.splash_blocks("unknown", 8192)
    assert (bq, bkv) == DEFAULT_SPLASH_BLOCKS[:2] and tp == 8192


# ----------------------------------------------------------------------------- choice by platform


def test_auto_picks_by_platform_and_cudnn_falls_back():
    assert A.resolve("auto", platform="tpu") == "splash"
    assert A.resolve("auto", platform="gpu", cudnn=True) == "cudnn"
    assert A.resolve("auto", platform="gpu", cudnn=False) == "blocked"  # no cuDNN: the blocked kernel
    assert A.resolve("auto", platform="cpu") == "banded"
    assert A.resolve("cudnn", platform="cpu") == "blocked"


@pytest.mark.parametrize(
    "dtype,expect", [("bfloat16", "cudnn"), ("float16", "cudnn"), ("float32", "blocked")]
)
def test_auto_picks_cudnn_on_gpu_only_for_half_precision_compute(dtype, expect):
    # cuDNN's fused attention raises NotImplementedError on float32 inputs (the smoke recipe computes
    # in float32): `auto` and an explicit `cudnn` take the blocked kernel there instead of exit 3.
    assert A.resolve("auto", platform="gpu", cudnn=True, dtype=jnp.dtype(dtype)) == expect
    assert A.resolve("cudnn", platform="gpu", cudnn=True, dtype=dtype) == expect
    assert A.resolve("auto", platform="tpu", dtype=dtype) == "splash"


def test_attend_with_float32_inputs_never_reaches_cudnn_on_a_gpu_target(monkeypatch):
    # attend() passes its inputs' dtype to resolve(): on a GPU target where cuDNN works, float32 q/k/v
    # take the blocked kernel (here on the CPU the cuDNN call itself would raise, so a wrong choice fails).
    monkeypatch.setattr(A, "cudnn_available", lambda: True)
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 16, 2, 8), jnp.float32)
    with A.compile_target("gpu"):
        out = A.attend(q, q, q, window=None, impl="auto", block=8)
    ref = A.reference_attention(q, q, q, window=None)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert A.resolve("splash", platform="cpu") == "splash"  # explicit: interpret mode off TPU
    with A.compile_target("tpu", "tpu7x"):
        assert A.resolve("auto") == "splash" and A.target() == ("tpu", "tpu7x")
    assert A.target()[0] == jax.default_backend()
    with pytest.raises(ValueError, match="unknown attention"):
        A.resolve("flash")


@pytest.mark.parametrize("window", [None, 100])
def test_splash_at_the_32b_head_ratio(window):
    """OLMo 2/3 32B's 40 query heads over 8 KV heads, scaled to 10 over 2: five query heads read one
    KV head in the kernel's grouped-query path (values and gradients, dK/dV summed over the group)."""
    B, T, H, KV, D = 1, 256, 10, 2, 8
    q, k, v, g = _qkv(B, T, H, KV, D, seed=5)
    ref = _values_and_grads(lambda q, k, v: A.attend(q, k, v, window=window, impl="reference"), q, k, v, g)
    spl = _values_and_grads(
        lambda q, k, v: A.splash_attention(q, k, v, window=window, blocks=(128, 128, 128)), q, k, v, g
    )
    _assert_close(ref, spl)


def test_cudnn_unavailable_here_runs_blocked_and_matches_reference():
    assert jax.default_backend() == "cpu" and not A.cudnn_available()
    q, k, v, g = _qkv(1, 64, 4, 2, 16)
    ref = _values_and_grads(lambda q, k, v: A.attend(q, k, v, window=20, impl="reference"), q, k, v, g)
    fb = _values_and_grads(lambda q, k, v: A.attend(q, k, v, window=20, impl="cudnn"), q, k, v, g)
    _assert_close(ref, fb)


@pytest.mark.parametrize(
    "window,segments,heads",
    [(20, False, (4, 2)), (None, True, (4, 2)), (20, True, (4, 2)), (20, False, (10, 2))],
)
def test_cudnn_call_window_and_segments(window, segments, heads):
    """The exact `dot_product_attention` call the GPU path makes, run by XLA on the CPU: OLMo 3's
    window maps to local_window_size=(W-1, 0), and segment ids to its mask; (10, 2) heads is the
    32B's grouped-query ratio."""
    q, k, v, g = _qkv(2, 64, *heads, 16)
    seg = _segments(2, 64, seed=3) if segments else None
    ref = _values_and_grads(
        lambda q, k, v: A.attend(q, k, v, window=window, impl="reference", segment_ids=seg), q, k, v, g
    )
    xla = _values_and_grads(
        lambda q, k, v: A.cudnn_attention(q, k, v, window=window, segment_ids=seg, implementation="xla"),
        q,
        k,
        v,
        g,
    )
    _assert_close(ref, xla)


def test_model_with_segment_ids_keeps_documents_apart():
    """Two documents packed into one instance: the first one's logits are those of it alone."""
    from olmo_ctl.core.recipe import ModelConfig
    from olmo_ctl.trainer import model as M

    cfg = ModelConfig(
        name="tiny",
        n_layers=4,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        mlp_hidden=64,
        vocab_size=50,
        padded_vocab_size=64,
        sliding_window=8,
        full_attention_every=4,
        rope_theta=500000.0,
        rms_norm_eps=1e-6,
        init_std=0.02,
        param_dtype="float32",
        compute_dtype="float32",
        remat="none",
        attention="reference",
        eos_token_id=1,
        pad_token_id=2,
    )
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 32), 0, cfg.vocab_size)
    seg = jnp.asarray([[0] * 12 + [1] * 20])
    for impl in ("reference", "blocked"):
        fwd = jax.jit(lambda p, t, s, impl=impl: M.forward(p, t, cfg, attention=impl, segment_ids=s))
        packed = fwd(params, tokens, seg)
        alone = fwd(params, tokens[:, :12], None)
        assert float(jnp.max(jnp.abs(packed[:, :12] - alone))) < 1e-4
        plain = fwd(params, tokens, None)
        assert float(jnp.max(jnp.abs(packed[:, 12:] - plain[:, 12:]))) > 1e-3  # the second one is cut off
