"""Causal attention with an optional sliding window, in two implementations checked against each other.

Semantics (both paths): query i sees key j when j <= i and, with a window W, i - W < j (the token
itself plus the W-1 before it). Softmax scale 1/sqrt(head_dim); scores and softmax in fp32.

* `reference`: plain einsum + mask + fp32 softmax. Builds the [T, T] score matrix per head; used on
  CPU and as the ground truth in tests.
* `blocked`: flash-style (online softmax) in pure JAX with a hand-written backward pass
  (`jax.custom_vjp`). Queries and keys are cut into blocks; a query block visits only the key blocks
  its causal window can reach (blocks wholly outside are skipped with `lax.cond`), so neither the
  forward nor the backward pass ever holds more than one [block, block] score tile per head. Memory
  saved for the backward pass is the output and one log-sum-exp per query. Runs on every platform,
  so CI checks it against `reference` on CPU; it is the default on TPU and GPU.

Layouts: q [B, T, H, D], k and v [B, T, KV, D] with H a multiple of KV (grouped-query attention).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("reference", "blocked")
DEFAULT_BLOCK = 512
_NEG = -1e30  # finite "minus infinity": a fully masked tile never produces NaN


def resolve(impl: str) -> str:
    """`auto` -> `reference` on CPU, `blocked` on accelerators."""
    if impl == "auto":
        return "reference" if jax.default_backend() == "cpu" else "blocked"
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {impl!r}; known: auto, {', '.join(IMPLEMENTATIONS)}")
    return impl


def attend(q, k, v, *, window: int | None, impl: str = "reference", block: int = DEFAULT_BLOCK):
    """Causal (optionally sliding-window) attention; returns [B, T, H, D] in q's dtype."""
    impl = resolve(impl)
    if window is not None and window >= q.shape[1]:
        window = None  # the window covers the whole sequence: plain causal attention
    if impl == "reference":
        return reference_attention(q, k, v, window=window)
    return blocked_attention(q, k, v, window=window, block=block)


def _repeat_kv(x, n_heads: int):
    rep = n_heads // x.shape[2]
    return x if rep == 1 else jnp.repeat(x, rep, axis=2)


def causal_mask(q_pos, k_pos, window: int | None):
    """Boolean [Tq, Tk]: key visible from query."""
    ok = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        ok &= k_pos[None, :] > q_pos[:, None] - window
    return ok


# ----------------------------------------------------------------------------- reference


def reference_attention(q, k, v, *, window: int | None):
    B, T, H, D = q.shape
    k, v = _repeat_kv(k, H), _repeat_kv(v, H)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(D)
    pos = jnp.arange(T)
    s = jnp.where(causal_mask(pos, pos, window)[None, None], s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(q.dtype)


# ----------------------------------------------------------------------------- blocked (flash-style)


def blocked_attention(q, k, v, *, window: int | None, block: int = DEFAULT_BLOCK):
    B, T, H, D = q.shape
    k, v = _repeat_kv(k, H), _repeat_kv(v, H)
    blk = min(block, T)
    Tp = -(-T // blk) * blk
    # [B, H, T, D]; padded positions sit after the real ones, so causality hides them from real queries.
    qh, kh, vh = (jnp.pad(x.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Tp - T), (0, 0))) for x in (q, k, v))
    o = _flash(qh, kh, vh, window, blk)
    return o[:, :, :T].transpose(0, 2, 1, 3)


def _span(n_blocks: int, window: int | None, blk: int) -> int:
    """Key blocks a query block can reach (itself included)."""
    if window is None:
        return n_blocks
    return min(n_blocks, -(-(window - 1) // blk) + 1)


def _tile(x, i, blk):
    return jax.lax.dynamic_slice_in_dim(x, i * blk, blk, axis=2)


def _scores(qi, kj, i, j, window, blk, scale):
    s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj, preferred_element_type=jnp.float32) * scale
    q_pos = i * blk + jnp.arange(blk)
    k_pos = j * blk + jnp.arange(blk)
    return s, causal_mask(q_pos, k_pos, window)[None, None]


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


def _forward(q, k, v, window, blk):
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
                s, mask = _scores(qi, kj, i, j, window, blk, scale)
                m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _NEG), axis=-1))
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                denom = denom * corr + jnp.sum(p, axis=-1)
                pv = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
                return m_new, denom, acc * corr[..., None] + pv

            return jax.lax.cond(j >= 0, visit, lambda c: c, carry)

        init = (jnp.full((B, H, blk), _NEG, jnp.float32), jnp.zeros((B, H, blk), jnp.float32),
                jnp.zeros((B, H, blk, D), jnp.float32))
        m, denom, acc = _loop(0, span, kv_step, init)
        o_i = (acc / denom[..., None]).astype(q.dtype)
        return (jax.lax.dynamic_update_slice_in_dim(o_all, o_i, i * blk, axis=2),
                jax.lax.dynamic_update_slice_in_dim(lse_all, m + jnp.log(denom), i * blk, axis=2))

    out = (jnp.zeros((B, H, Tp, D), q.dtype), jnp.zeros((B, H, Tp), jnp.float32))
    return _loop(0, n, q_block, out)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(q, k, v, window, blk):
    return _forward(q, k, v, window, blk)[0]


def _flash_fwd(q, k, v, window, blk):
    o, lse = _forward(q, k, v, window, blk)
    return o, (q, k, v, o, lse)


def _flash_bwd(window, blk, res, do):
    q, k, v, o, lse = res
    B, H, Tp, D = q.shape
    n = Tp // blk
    span = _span(n, window, blk)
    scale = 1.0 / math.sqrt(D)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, H, Tp]

    def probs(qi, kj, i, j):
        s, mask = _scores(qi, kj, i, j, window, blk, scale)
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
                return dq + jnp.einsum("bhqk,bhkd->bhqd", ds.astype(k.dtype), kj,
                                       preferred_element_type=jnp.float32) * scale

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
                dv = dv + jnp.einsum("bhqk,bhqd->bhkd", p.astype(do.dtype), doi, preferred_element_type=jnp.float32)
                dp = jnp.einsum("bhqd,bhkd->bhqk", doi, vj, preferred_element_type=jnp.float32)
                ds = p * (dp - di[..., None])
                dk = dk + jnp.einsum("bhqk,bhqd->bhkd", ds.astype(q.dtype), qi,
                                     preferred_element_type=jnp.float32) * scale
                return dk, dv

            return jax.lax.cond(i < n, visit, lambda x: x, c)

        zeros = jnp.zeros((B, H, blk, D), jnp.float32)
        dk, dv = _loop(0, span, step, (zeros, zeros))
        return (jax.lax.dynamic_update_slice_in_dim(dk_all, dk.astype(k.dtype), j * blk, axis=2),
                jax.lax.dynamic_update_slice_in_dim(dv_all, dv.astype(v.dtype), j * blk, axis=2))

    dq = _loop(0, n, dq_block, jnp.zeros_like(q))
    dk, dv = _loop(0, n, dkv_block, (jnp.zeros_like(k), jnp.zeros_like(v)))
    return dq, dk, dv


_flash.defvjp(_flash_fwd, _flash_bwd)
