"""Causal attention with an optional sliding window: five implementations, checked against each other.

Semantics (every path): query i sees key j when j <= i and, with a window W, i - W < j (the token
itself plus the W-1 before it); with segment ids (documents packed into one instance), also only
when both carry the same id, so attention never crosses a document boundary. Softmax scale
1/sqrt(head_dim); scores and softmax in fp32.

* `reference`: plain einsum + mask + fp32 softmax. Builds the [T, T] score matrix per head; used on
  CPU and as the ground truth in tests.
* `blocked`: flash-style (online softmax) in pure JAX with a hand-written backward pass
  (`jax.custom_vjp`). Queries and keys are cut into blocks; a query block visits only the key blocks
  its causal window can reach (blocks wholly outside are skipped with `lax.cond`), so neither the
  forward nor the backward pass ever holds more than one [block, block] score tile per head. Memory
  saved for the backward pass is the output and one log-sum-exp per query. Runs on every platform,
  so CI checks it against `reference` on CPU.
* `banded`: sliding-window layers as chunks of `window` queries, each chunk against the keys of its
  own chunk and the one before (2 x window keys: every key its window reaches), in two batched
  einsums differentiated by JAX; the scores kept for the backward pass are [B, H, T, 2 x window].
  It runs where the sequence is at least three windows long and those scores are small
  (`banded_fits`); full-attention layers and long windows run `blocked`. On the CPU it does half
  the score work of a [T, T] tile when the window is a quarter of the sequence (the smoke model), in
  a handful of operations (docs/trainer-performance.md).
* `splash`: the Pallas TPU kernel MaxText uses (`jax.experimental.pallas.ops.tpu.splash_attention`),
  with a `LocalMask` for sliding layers and a `CausalMask` for full ones; it computes only the
  (block_q, block_kv) tiles its mask touches. Block sizes per TPU generation: its profile's
  `splash_blocks` (`core/generations.py`). On a ("data", "fsdp") mesh it runs under `shard_map`,
  one batch shard per device (a Pallas call cannot be partitioned by XLA). Off TPU it runs in
  Pallas interpret mode (slow: tests only).
* `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` with `local_window_size` for
  sliding layers, on NVIDIA GPUs. Where cuDNN is unavailable it falls back to `blocked`.

`auto` resolves by the platform the step is compiled for (`target`): splash on TPU, cudnn on GPU
for bf16/fp16 compute (blocked where cuDNN is unavailable or the compute dtype is float32, which
cuDNN's fused attention does not take), banded on CPU (measured faster there than blocked and
reference: docs/trainer-performance.md). Preflight sets the target to the TPU slice it
compiles for (`compile_target`), so `auto` and the block sizes follow the slice, not this machine.

Layouts: q [B, T, H, D], k and v [B, T, KV, D] with H a multiple of KV (grouped-query attention);
segment ids [B, T] int32.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp

from olmo_ctl.core.generations import generation_of_device_kind, splash_blocks_of

IMPLEMENTATIONS = ("reference", "blocked", "banded", "splash", "cudnn")
CHOICES = ("auto", *IMPLEMENTATIONS)
DEFAULT_BLOCK = 512
_NEG = -1e30  # finite "minus infinity": a fully masked tile never produces NaN
_PAD_SEGMENT = -1  # segment id of padding: a padded query always sees itself, never a real key
log = logging.getLogger(__name__)

SPLASH_FUSED_BWD = True  # one backward kernel for dq, dk and dv (MaxText's default)

_TARGET: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "attention_target", default=None
)


def target() -> tuple[str, str]:
    """(platform, generation) the step is compiled for: `compile_target`'s, else this process's devices."""
    t = _TARGET.get()
    if t is not None:
        return t
    platform = jax.default_backend()
    if platform != "tpu":
        return platform, ""
    return platform, generation_of_device_kind(jax.devices()[0].device_kind) or ""


@contextlib.contextmanager
def compile_target(platform: str, generation: str = ""):
    """Trace for `platform` (and TPU `generation`) rather than this process's own devices."""
    token = _TARGET.set((platform, generation))
    try:
        yield
    finally:
        _TARGET.reset(token)


@functools.lru_cache(maxsize=1)
def cudnn_available() -> bool:
    """cuDNN fused attention compiles on this process's GPU (False on any other platform)."""
    if jax.default_backend() != "gpu":
        return False
    try:
        x = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
        jax.jit(partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")).lower(
            x, x, x
        ).compile()
        return True
    except Exception as e:  # noqa: BLE001 - missing cuDNN, too old a GPU, ...: fall back
        log.warning(
            "cuDNN fused attention is unavailable (%s); using the blocked kernel",
            str(e).splitlines()[0][:200],
        )
        return False


# cuDNN's fused attention takes half-precision inputs only (float32 raises NotImplementedError).
CUDNN_DTYPES = ("bfloat16", "float16")


def resolve(impl: str, platform: str | None = None, cudnn: bool | None = None, dtype=None) -> str:
    """The implementation that runs: `auto` by platform; `cudnn` falls back to `blocked` without cuDNN
    or for a compute dtype cuDNN does not take (float32: the smoke recipe's).

    `platform` defaults to the compile target's; `cudnn` to whether cuDNN attention works here;
    `dtype` is the attention inputs' (None: not known yet, judged by platform alone).
    """
    if impl not in CHOICES:
        raise ValueError(f"unknown attention implementation {impl!r}; known: {', '.join(CHOICES)}")
    if platform is None:
        platform = target()[0]
    if impl == "auto":
        impl = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}.get(platform, "banded")
    if impl == "cudnn":
        if dtype is not None and jnp.dtype(dtype).name not in CUDNN_DTYPES:
            return "blocked"
        ok = (platform in ("gpu", "cuda") and cudnn_available()) if cudnn is None else cudnn
        if not ok:
            return "blocked"
    return impl


def attend(
    q, k, v, *, window: int | None, impl: str = "reference", block: int = DEFAULT_BLOCK, segment_ids=None
):
    """Causal (optionally sliding-window) attention; returns [B, T, H, D] in q's dtype.

    `segment_ids` [B, T] (optional): a query sees only keys of its own segment.
    """
    impl = resolve(impl, dtype=q.dtype)
    if window is not None and window >= q.shape[1]:
        window = None  # the window covers the whole sequence: plain causal attention
    if impl == "reference":
        return reference_attention(q, k, v, window=window, segment_ids=segment_ids)
    if impl == "splash":
        return splash_attention(q, k, v, window=window, segment_ids=segment_ids)
    if impl == "cudnn":
        return cudnn_attention(q, k, v, window=window, segment_ids=segment_ids)
    if impl == "banded" and window is not None and banded_fits(q.shape, window):
        return banded_attention(q, k, v, window=window, segment_ids=segment_ids)
    return blocked_attention(q, k, v, window=window, block=block, segment_ids=segment_ids)


def _repeat_kv(x, n_heads: int):
    rep = n_heads // x.shape[2]
    return x if rep == 1 else jnp.repeat(x, rep, axis=2)


def causal_mask(q_pos, k_pos, window: int | None):
    """Boolean [Tq, Tk]: key visible from query."""
    ok = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        ok &= k_pos[None, :] > q_pos[:, None] - window
    return ok


def _same_segment(seg_q, seg_k):
    """[B, Tq], [B, Tk] -> boolean [B, 1, Tq, Tk]."""
    return (seg_q[:, :, None] == seg_k[:, None, :])[:, None]


# ----------------------------------------------------------------------------- reference


def reference_attention(q, k, v, *, window: int | None, segment_ids=None):
    B, T, H, D = q.shape
    k, v = _repeat_kv(k, H), _repeat_kv(v, H)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(D)
    pos = jnp.arange(T)
    mask = causal_mask(pos, pos, window)[None, None]
    if segment_ids is not None:
        mask = mask & _same_segment(segment_ids, segment_ids)
    s = jnp.where(mask, s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(
        q.dtype
    )


# ----------------------------------------------------------------------------- banded (sliding layers)


BANDED_MIN_CHUNKS = 3  # fewer: as much score work as one [T, T] tile, or more
BANDED_MAX_SCORE_BYTES = 64 * 2**20  # one fp32 [B, H, T, 2 x window] score tensor (it keeps a few)


def banded_fits(shape: tuple[int, ...], window: int) -> bool:
    """Whether `banded` runs for q of `shape` [B, T, H, D] (else `blocked`): the sequence is at least
    BANDED_MIN_CHUNKS windows long, and its scores fit BANDED_MAX_SCORE_BYTES. Long windows (OLMo 3's
    4096 of 8192) take the blocked kernel, which never holds more than a tile."""
    B, T, H, _ = shape
    chunks = -(-T // window)
    return chunks >= BANDED_MIN_CHUNKS and B * H * chunks * window * 2 * window * 4 <= BANDED_MAX_SCORE_BYTES


def banded_attention(q, k, v, *, window: int, segment_ids=None):
    """Sliding-window attention by chunks of `window` queries: chunk c attends to the keys of chunks
    c - 1 and c, which hold every key its queries' windows reach. Two batched einsums and a softmax
    over [B, H, n_chunks, window, 2 x window] scores; JAX differentiates it."""
    B, T, H, D = q.shape
    k, v = _repeat_kv(k, H), _repeat_kv(v, H)
    C = window
    n = -(-T // C)
    Tp = n * C  # padded positions sit after the real ones, so causality hides them from real queries

    def heads(x):  # [B, T, H, D] -> [B, H, Tp, D]
        return jnp.pad(x.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Tp - T), (0, 0)))

    def with_previous(x):  # [..., Tp, X] -> [..., n, 2C, X]: chunk c - 1 (zeros before the first), chunk c
        lead = x.shape[:-2]
        prev = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(C, 0), (0, 0)])[..., :Tp, :]
        return jnp.concatenate([prev.reshape(*lead, n, C, -1), x.reshape(*lead, n, C, -1)], axis=-2)

    kk, vv = with_previous(heads(k)), with_previous(heads(v))
    s = jnp.einsum(
        "bhnqd,bhnkd->bhnqk", heads(q).reshape(B, H, n, C, D), kk, preferred_element_type=jnp.float32
    ) / math.sqrt(D)
    q_pos = (jnp.arange(n)[:, None] * C + jnp.arange(C)[None, :])[:, :, None]  # [n, C, 1]
    k_pos = (jnp.arange(n)[:, None] * C - C + jnp.arange(2 * C)[None, :])[:, None, :]  # [n, 1, 2C]
    mask = ((k_pos >= 0) & (k_pos <= q_pos) & (k_pos > q_pos - window))[None, None]
    if segment_ids is not None:
        seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, Tp - T)), constant_values=_PAD_SEGMENT)
        seg_k = with_previous(seg[:, :, None])[..., 0]  # [B, n, 2C]
        mask = mask & (seg.reshape(B, n, C)[:, :, :, None] == seg_k[:, :, None, :])[:, None]
    p = jax.nn.softmax(jnp.where(mask, s, _NEG), axis=-1)
    o = jnp.einsum("bhnqk,bhnkd->bhnqd", p.astype(v.dtype), vv, preferred_element_type=jnp.float32)
    return o.reshape(B, H, Tp, D)[:, :, :T].transpose(0, 2, 1, 3).astype(q.dtype)


# ----------------------------------------------------------------------------- blocked (flash-style)


def blocked_attention(q, k, v, *, window: int | None, block: int = DEFAULT_BLOCK, segment_ids=None):
    B, T, H, D = q.shape
    k, v = _repeat_kv(k, H), _repeat_kv(v, H)
    blk = min(block, T)
    Tp = -(-T // blk) * blk
    # [B, H, T, D]; padded positions sit after the real ones, so causality hides them from real queries.
    qh, kh, vh = (jnp.pad(x.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Tp - T), (0, 0))) for x in (q, k, v))
    seg = None
    if segment_ids is not None:
        seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, Tp - T)), constant_values=_PAD_SEGMENT)
    o = _flash(qh, kh, vh, seg, window, blk)
    return o[:, :, :T].transpose(0, 2, 1, 3)


def _span(n_blocks: int, window: int | None, blk: int) -> int:
    """Key blocks a query block can reach (itself included)."""
    if window is None:
        return n_blocks
    return min(n_blocks, -(-(window - 1) // blk) + 1)


def _tile(x, i, blk):
    return jax.lax.dynamic_slice_in_dim(x, i * blk, blk, axis=2)


def _scores(qi, kj, i, j, window, blk, scale, seg=None):
    s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj, preferred_element_type=jnp.float32) * scale
    q_pos = i * blk + jnp.arange(blk)
    k_pos = j * blk + jnp.arange(blk)
    mask = causal_mask(q_pos, k_pos, window)[None, None]
    if seg is not None:
        seg_i = jax.lax.dynamic_slice_in_dim(seg, i * blk, blk, axis=1)
        seg_j = jax.lax.dynamic_slice_in_dim(seg, j * blk, blk, axis=1)
        mask = mask & _same_segment(seg_i, seg_j)
    return s, mask


def _loop(lower: int, upper: int, body, init):
    """`fori_loop` as a while loop. A fori_loop with static bounds becomes a `scan`, and an enclosing
    `lax.scan` under `grad` (the layer stack) then keeps every tile of these loops as a stacked
    residual: a full [T, T] score matrix per head again (found by compiling for a TPU slice). A while
    loop cannot be differentiated, which guarantees only the hand-written backward pass runs."""

    def cond(c):
        return c[0] < upper

    def step(c):
        i, x = c
        return i + 1, body(i, x)

    return jax.lax.while_loop(cond, step, (jnp.int32(lower), init))[1]


def _forward(q, k, v, seg, window, blk):
    B, H, Tp, D = q.shape
    n = Tp // blk
    span = _span(n, window, blk)
    scale = 1.0 / math.sqrt(D)

    def q_block(i, out):
        o_all, lse_all = out
        qi = _tile(q, i, blk)

        def kv_step(t, carry):
            j = i - (span - 1) + t  # oldest reachable block first; the diagonal block comes last

            def visit(c):
                m, denom, acc = c
                kj, vj = _tile(k, j, blk), _tile(v, j, blk)
                s, mask = _scores(qi, kj, i, j, window, blk, scale, seg)
                m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _NEG), axis=-1))
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                denom = denom * corr + jnp.sum(p, axis=-1)
                pv = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
                return m_new, denom, acc * corr[..., None] + pv

            return jax.lax.cond(j >= 0, visit, lambda c: c, carry)

        init = (
            jnp.full((B, H, blk), _NEG, jnp.float32),
            jnp.zeros((B, H, blk), jnp.float32),
            jnp.zeros((B, H, blk, D), jnp.float32),
        )
        m, denom, acc = _loop(0, span, kv_step, init)
        o_i = (acc / denom[..., None]).astype(q.dtype)
        return (
            jax.lax.dynamic_update_slice_in_dim(o_all, o_i, i * blk, axis=2),
            jax.lax.dynamic_update_slice_in_dim(lse_all, m + jnp.log(denom), i * blk, axis=2),
        )

    out = (jnp.zeros((B, H, Tp, D), q.dtype), jnp.zeros((B, H, Tp), jnp.float32))
    return _loop(0, n, q_block, out)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, seg, window, blk):
    return _forward(q, k, v, seg, window, blk)[0]


def _flash_fwd(q, k, v, seg, window, blk):
    o, lse = _forward(q, k, v, seg, window, blk)
    return o, (q, k, v, seg, o, lse)


def _flash_bwd(window, blk, res, do):
    q, k, v, seg, o, lse = res
    B, H, Tp, D = q.shape
    n = Tp // blk
    span = _span(n, window, blk)
    scale = 1.0 / math.sqrt(D)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, H, Tp]

    def probs(qi, kj, i, j):
        s, mask = _scores(qi, kj, i, j, window, blk, scale, seg)
        return jnp.where(mask, jnp.exp(s - _tile(lse, i, blk)[..., None]), 0.0)

    def dq_block(i, dq_all):
        qi, doi, di = _tile(q, i, blk), _tile(do, i, blk), _tile(delta, i, blk)

        def step(t, dq):
            j = i - (span - 1) + t

            def visit(dq):
                kj, vj = _tile(k, j, blk), _tile(v, j, blk)
                p = probs(qi, kj, i, j)
                dp = jnp.einsum("bhqd,bhkd->bhqk", doi, vj, preferred_element_type=jnp.float32)
                ds = p * (dp - di[..., None])
                return (
                    dq
                    + jnp.einsum(
                        "bhqk,bhkd->bhqd", ds.astype(k.dtype), kj, preferred_element_type=jnp.float32
                    )
                    * scale
                )

            return jax.lax.cond(j >= 0, visit, lambda x: x, dq)

        dq = _loop(0, span, step, jnp.zeros((B, H, blk, D), jnp.float32))
        return jax.lax.dynamic_update_slice_in_dim(dq_all, dq.astype(q.dtype), i * blk, axis=2)

    def dkv_block(j, dkv_all):
        dk_all, dv_all = dkv_all
        kj, vj = _tile(k, j, blk), _tile(v, j, blk)

        def step(t, c):
            i = j + t  # query blocks that can see key block j

            def visit(c):
                dk, dv = c
                qi, doi, di = _tile(q, i, blk), _tile(do, i, blk), _tile(delta, i, blk)
                p = probs(qi, kj, i, j)
                dv = dv + jnp.einsum(
                    "bhqk,bhqd->bhkd", p.astype(do.dtype), doi, preferred_element_type=jnp.float32
                )
                dp = jnp.einsum("bhqd,bhkd->bhqk", doi, vj, preferred_element_type=jnp.float32)
                ds = p * (dp - di[..., None])
                dk = (
                    dk
                    + jnp.einsum(
                        "bhqk,bhqd->bhkd", ds.astype(q.dtype), qi, preferred_element_type=jnp.float32
                    )
                    * scale
                )
                return dk, dv

            return jax.lax.cond(i < n, visit, lambda x: x, c)

        zeros = jnp.zeros((B, H, blk, D), jnp.float32)
        dk, dv = _loop(0, span, step, (zeros, zeros))
        return (
            jax.lax.dynamic_update_slice_in_dim(dk_all, dk.astype(k.dtype), j * blk, axis=2),
            jax.lax.dynamic_update_slice_in_dim(dv_all, dv.astype(v.dtype), j * blk, axis=2),
        )

    dq = _loop(0, n, dq_block, jnp.zeros_like(q))
    dk, dv = _loop(0, n, dkv_block, (jnp.zeros_like(k), jnp.zeros_like(v)))
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- splash (Pallas, TPU)


def splash_blocks(generation: str, seq_len: int) -> tuple[tuple[int, int, int], int]:
    """((block_q, block_kv, block_kv_compute), padded length) for a sequence on a TPU generation.

    Blocks are cut to the sequence (rounded up to the 128-lane width); the sequence is padded to a
    multiple of both blocks (padding sits after the real tokens: causality hides it).
    """
    bq, bkv, bkvc = splash_blocks_of(generation)
    t128 = -(-seq_len // 128) * 128
    bq, bkv = min(bq, t128), min(bkv, t128)
    bkvc = min(bkvc, bkv)
    if bkv % bkvc:
        bkvc = bkv
    step = math.lcm(bq, bkv)
    return (bq, bkv, bkvc), -(-seq_len // step) * step


def splash_mask(seq_len: int, window: int | None):
    """The kernel's mask for one head: causal, or local with OLMo 3's window (itself + window-1 before)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    if window is None or window >= seq_len:
        return sa.CausalMask((seq_len, seq_len))
    return sa.LocalMask((seq_len, seq_len), window_size=(window - 1, 0), offset=0)


def _splash_kernel(
    seq_len: int, n_heads: int, window: int | None, blocks: tuple[int, int, int], interpret: bool
):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    bq, bkv, bkvc = blocks
    sizes = sa.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkvc,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkvc,
        block_q_dq=None if SPLASH_FUSED_BWD else bq,  # the fused backward kernel has no dq blocks
        block_kv_dq=None if SPLASH_FUSED_BWD else bkv,
        use_fused_bwd_kernel=SPLASH_FUSED_BWD,
    )
    mask = sa.MultiHeadMask([splash_mask(seq_len, window)] * n_heads)
    # Built inside each trace: the mask's block tables become constants of that program (a kernel
    # cached across traces would carry one trace's values into another).
    return sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_mask_blocks(seq_len: int, window: int | None, block_q: int, block_kv: int) -> int:
    """How many (query block, key block) tiles the kernel computes for one head: those its mask touches."""
    n_q, n_kv = -(-seq_len // block_q), -(-seq_len // block_kv)
    count = 0
    for i in range(n_q):
        q_lo, q_hi = i * block_q, min(seq_len, (i + 1) * block_q) - 1
        for j in range(n_kv):
            k_lo, k_hi = j * block_kv, min(seq_len, (j + 1) * block_kv) - 1
            if k_lo <= q_hi and (window is None or k_hi > q_lo - window):
                count += 1
    return count


# Matmuls per computed tile, each 2 * block_q * block_kv * head_dim FLOPs: forward QK^T and PV; the dq
# kernel recomputes S, then dP and dQ; the dkv kernel recomputes S, then dP, dV and dK (and dQ when fused).
SPLASH_TILE_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4, "dkv_fused": 5}


def splash_scope(seq_len: int, window: int | None, blocks: tuple[int, int, int]) -> str:
    """The named scope around a splash call; preflight reads the mask back from it to count FLOPs."""
    return f"splash_T{seq_len}_W{window or 0}_Q{blocks[0]}_K{blocks[1]}"


def splash_attention(
    q,
    k,
    v,
    *,
    window: int | None,
    segment_ids=None,
    generation: str | None = None,
    interpret: bool | None = None,
    blocks: tuple[int, int, int] | None = None,
):
    """Splash attention (see the module doc). Off TPU it runs in interpret mode unless told otherwise.

    `blocks` (block_q, block_kv, block_kv_compute) overrides the generation's profile's `splash_blocks`.
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    from olmo_ctl.trainer import sharding

    B, T, H, D = q.shape
    platform, gen = target()
    generation = gen if generation is None else generation
    interpret = platform != "tpu" if interpret is None else interpret
    if window is not None and window >= T:
        window = None
    if blocks is None:
        blocks, Tp = splash_blocks(generation, T)
    else:
        Tp = -(-T // math.lcm(blocks[0], blocks[1])) * math.lcm(blocks[0], blocks[1])
    mesh = sharding.activation_mesh()
    n = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    seq = sharding.seq_shards(mesh)
    shard = (n > 1 or seq > 1) and B % n == 0 and H % seq == 0
    # Under sequence sharding each device runs the kernel on its H / seq heads (see sharding.py).
    kernel = _splash_kernel(Tp, H // seq if shard else H, window, blocks, interpret)

    def heads_first(x):  # [B, T, N, D] -> [B, N, Tp, D]
        return jnp.pad(x.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Tp - T), (0, 0)))

    # The kernel takes the softmax scale folded into the queries.
    qh = heads_first((q.astype(jnp.float32) / math.sqrt(D)).astype(q.dtype))
    kh, vh = heads_first(k), heads_first(v)
    args = [qh, kh, vh]
    if segment_ids is not None:
        args.append(
            jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, Tp - T)), constant_values=_PAD_SEGMENT)
        )

    def run(qh, kh, vh, seg=None):
        if seg is None:
            return jax.vmap(kernel)(qh, kh, vh)
        return jax.vmap(lambda a, b, c, s: kernel(a, b, c, segment_ids=sa.SegmentIds(s, s)))(qh, kh, vh, seg)

    if shard:
        spec4 = jax.sharding.PartitionSpec(sharding.AXES, sharding.SEQ if seq > 1 else None, None, None)
        specs = (spec4, spec4, spec4) + (
            (jax.sharding.PartitionSpec(sharding.AXES, None),) if len(args) == 4 else ()
        )
        run = jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=spec4, check_vma=False)
    with jax.named_scope(splash_scope(Tp, window, blocks)):
        o = run(*args)
    return o[:, :, :T].transpose(0, 2, 1, 3).astype(q.dtype)


# ----------------------------------------------------------------------------- cuDNN (GPU)


def cudnn_attention(
    q, k, v, *, window: int | None, segment_ids=None, implementation: Literal["xla", "cudnn"] = "cudnn"
):
    """`jax.nn.dot_product_attention` with cuDNN: causal, plus the local window for sliding layers.

    Its `local_window_size=(left, right)` lets query i see keys i-left..i+right, so OLMo 3's window W
    (itself + W-1 before) is (W-1, 0). Segment ids become a boolean mask (materialised [T, T]).
    `implementation="xla"` runs the same call on any platform (tests check the window on CPU).
    """
    mask = None if segment_ids is None else _same_segment(segment_ids, segment_ids)
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        is_causal=True,
        scale=1.0 / math.sqrt(q.shape[-1]),
        local_window_size=None if window is None else (window - 1, 0),
        implementation=implementation,
    )
