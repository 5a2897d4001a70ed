"""OLMo 3 in JAX: pure functions over a nested-dict pytree of parameters.

One block ("reordered norm", no pre-norm):
    h   = x + RMSNorm(attn(x))           attn: q = RMSNorm(x Wq), k = RMSNorm(x Wk) over the FULL
    out = h + RMSNorm(W2(silu(W1 h) * W3 h))   projections, then head split, RoPE, softmax attention
Layer i uses full causal attention where (i+1) % full_attention_every == 0 and on the last layer
(OLMo-core forces it), a sliding window otherwise (query i sees keys j with i - window < j <= i).
RoPE is plain (theta) on every layer, or YaRN-scaled on the full-attention layers (stage 3).
Untied input embedding and LM head, no biases, no embedding scaling, a final RMSNorm before the
LM head.

Parameters (cfg.param_dtype; L = n_layers, d = d_model, q = n_heads*head_dim, kv = n_kv_heads*head_dim):
    embed [V, d]   lm_head [d, V]   final_norm [d]        (V = padded_vocab_size)
    blocks/attn/{wq [L,d,q], wk [L,d,kv], wv [L,d,kv], wo [L,q,d], q_norm [L,q], k_norm [L,kv]}
    blocks/attn_norm [L,d] (post-attention), blocks/mlp_norm [L,d] (post-feedforward)
    blocks/mlp/{w1 [L,d,h] (gate), w3 [L,d,h] (up), w2 [L,h,d] (down)}
Layers are stacked on a leading axis and run with `lax.scan` over groups of `full_attention_every`
layers (3 sliding + 1 full), so compile time does not grow with depth. Norms, softmax, RoPE and the
logits are fp32; matmuls run in cfg.compute_dtype. On a ("data", "fsdp") mesh (the one
`sharding.make_mesh` made, or the current `jax.set_mesh`), activations are constrained to batch
sharding after every block.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# Names given to projection outputs, saved by remat="save_proj" (and by "budget": core/batching.py).
from olmo_ctl.core.batching import PROJ_NAMES, budget_names
from olmo_ctl.core.recipe import ModelConfig
from olmo_ctl.trainer import attention as attn_lib
from olmo_ctl.trainer import sharding

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def dtype_of(name: str):
    return _DTYPES[name]


# ----------------------------------------------------------------------------- parameters


def param_shapes(cfg: ModelConfig) -> dict:
    """Shapes of every parameter, in the pytree layout of `init_params`."""
    L, d, h, V = cfg.n_layers, cfg.d_model, cfg.mlp_hidden, cfg.padded_vocab_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {
        "embed": (V, d),
        "blocks": {
            "attn": {
                "wq": (L, d, q),
                "wk": (L, d, kv),
                "wv": (L, d, kv),
                "wo": (L, q, d),
                "q_norm": (L, q),
                "k_norm": (L, kv),
            },
            "attn_norm": (L, d),
            "mlp_norm": (L, d),
            "mlp": {"w1": (L, d, h), "w3": (L, d, h), "w2": (L, h, d)},
        },
        "final_norm": (d,),
        "lm_head": (d, V),
    }


def _is_norm(path) -> bool:
    return "norm" in jax.tree_util.keystr(path)


def init_params(cfg: ModelConfig, key) -> dict:
    """Truncated normal (std cfg.init_std, cut at +-3 sigma) for embeddings and every linear; norms = 1."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    dtype = dtype_of(cfg.param_dtype)
    out = []
    for (path, shape), k in zip(leaves, keys, strict=True):
        if _is_norm(path):
            out.append(jnp.ones(shape, dtype))
        else:
            w = jax.random.truncated_normal(k, -3.0, 3.0, shape, jnp.float32) * cfg.init_std
            out.append(w.astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def count_params(params) -> int:
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))


# ----------------------------------------------------------------------------- pieces


def rms_norm(x, weight, eps: float):
    """RMSNorm in fp32 (like the reference), returned in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * y).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling=None):
    """Inverse frequencies [head_dim/2] (fp32) and the cos/sin scale for plain RoPE or YaRN.

    YaRN (OLMo-core `YaRNRoPEScalingConfig.compute_scaled_inv_freq`, HF `_compute_yarn_parameters`):
    blend the original frequencies (extrapolation) with the same divided by `factor` (interpolation)
    along a linear ramp over frequency index i, 0 at i <= low and 1 at i >= high, where
    d(r) = head_dim * ln(original_context / (2 pi r)) / (2 ln theta), low = max(floor(d(beta_fast)), 0),
    high = min(ceil(d(beta_slow)), head_dim/2 - 1) (OLMo-core's clamp; HF clamps at head_dim - 1, the
    same wherever d(beta_slow) < head_dim/2, as for OLMo 3). cos and sin are multiplied by
    0.1 ln(factor) + 1, so attention logits scale by its square (both frameworks do this).
    """
    pos_freqs = theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    inv_freq = 1.0 / pos_freqs
    if scaling is None:
        return inv_freq, 1.0

    def dim_for(rotations: float) -> float:
        return (
            head_dim * math.log(scaling.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        )

    half = head_dim // 2
    low = max(math.floor(dim_for(scaling.beta_fast)), 0)
    high = min(math.ceil(dim_for(scaling.beta_slow)), half - 1)
    span = high - low if high != low else 0.001
    ramp = jnp.clip((jnp.arange(half, dtype=jnp.float32) - low) / span, 0.0, 1.0)  # 1: interpolate
    interp = 1.0 / (scaling.factor * pos_freqs)
    return interp * ramp + inv_freq * (1.0 - ramp), scaling.attention_factor


def rope_tables(seq_len: int, head_dim: int, theta: float, scaling=None):
    """cos/sin [T, head_dim] in fp32 for rotate-half RoPE (the frequency table repeated twice);
    `scaling` (a RopeScalingConfig) gives YaRN's frequencies and cos/sin scale."""
    inv_freq, attn_factor = rope_inv_freq(head_dim, theta, scaling)
    freqs = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if attn_factor == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * attn_factor, jnp.sin(emb) * attn_factor


def apply_rope(x, cos, sin):
    """x [B, T, H, D] -> same dtype; rotation done in fp32."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[None, :, None, :] + rotated * sin[None, :, None, :]).astype(x.dtype)


@jax.custom_vjp
def _projection(x, w):
    return jnp.einsum("btd,df->btf", x, w)


def _projection_fwd(x, w):
    return _projection(x, w), (x, w)


def _projection_bwd(res, dy):
    x, w = res
    return jnp.einsum("btf,df->btd", dy, w), jnp.einsum("btd,btf->df", x, dy)


_projection.defvjp(_projection_fwd, _projection_bwd)


def _matmul(x, w, dtype):
    """x [B, T, d] @ w [d, f]. On the CPU the weight's gradient is x^T dy in w's own [d, f] order
    (`_projection`): JAX's transpose rule forms (dy^T x)^T, and XLA's CPU dot library takes no
    transposed operand, so every projection paid a transpose of dy and one of its result, where
    this pays one of x, shared by q, k and v (and by w1 and w3). Elsewhere JAX's own rule: the
    programs preflight compiles for TPU slices are unchanged (docs/trainer-performance.md)."""
    if attn_lib.target()[0] == "cpu":
        return _projection(x, w.astype(dtype))
    return jnp.einsum("btd,df->btf", x, w.astype(dtype))


def attention_block(p, x, cos, sin, cfg: ModelConfig, window: int | None, attention: str, segment_ids=None):
    """x [B, T, d] -> [B, T, d] (before the post-attention norm)."""
    B, T, _ = x.shape
    dt = x.dtype
    q = checkpoint_name(_matmul(x, p["wq"], dt), "q_proj")  # [B, T, H*D]
    k = checkpoint_name(_matmul(x, p["wk"], dt), "k_proj")  # [B, T, KV*D]
    v = checkpoint_name(_matmul(x, p["wv"], dt), "v_proj")
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)  # QK-norm over the full projection
    k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q.reshape(B, T, cfg.n_heads, cfg.head_dim), cos, sin)
    k = apply_rope(k.reshape(B, T, cfg.n_kv_heads, cfg.head_dim), cos, sin)
    v = v.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
    q, k, v = (_constrain_heads(t) for t in (q, k, v))  # sequence-sharded -> head-sharded (all-to-all)
    o = attn_lib.attend(q, k, v, window=window, impl=attention, segment_ids=segment_ids)  # [B, T, H, D]
    o = _constrain_batch(o)  # back to sequence-sharded
    return checkpoint_name(_matmul(o.reshape(B, T, -1), p["wo"], dt), "o_proj")


def mlp_block(p, x):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""
    dt = x.dtype
    gate = checkpoint_name(_matmul(x, p["w1"], dt), "w1_proj")
    up = checkpoint_name(_matmul(x, p["w3"], dt), "w3_proj")
    return _matmul(jax.nn.silu(gate) * up, p["w2"], dt)


def block(p, x, cos, sin, cfg: ModelConfig, window: int | None, attention: str, segment_ids=None):
    """One reordered-norm OLMo 3 block; p holds one layer's weights (no layer axis). With
    remat="mlp" the feed-forward is recomputed in the backward pass and nothing else is."""
    h = x + rms_norm(
        attention_block(p["attn"], x, cos, sin, cfg, window, attention, segment_ids),
        p["attn_norm"],
        cfg.rms_norm_eps,
    )
    h = _constrain_batch(h)
    mlp = jax.checkpoint(mlp_block) if cfg.remat == "mlp" else mlp_block
    out = h + rms_norm(mlp(p["mlp"], h), p["mlp_norm"], cfg.rms_norm_eps)
    return _constrain_batch(out)


def _layer(p, x, cos, sin, segment_ids, *, cfg: ModelConfig, window: int | None, attention: str):
    return block(p, x, cos, sin, cfg, window, attention, segment_ids)


def _remat(fn, cfg: ModelConfig):
    policy = cfg.remat
    if policy in ("none", "mlp"):  # mlp: the block wraps its feed-forward itself
        return fn
    if policy == "full":
        return jax.checkpoint(fn)
    if policy == "save_proj":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(*PROJ_NAMES))
    if policy == "budget":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(*budget_names(cfg)))
    raise ValueError(f"unknown remat policy {policy!r}")


def _constrain_batch(x):
    """Keep activations batch-sharded over ("data", "fsdp") on the activation mesh, if there is one,
    and [B, T, ...] sequence-sharded over "seq" when the mesh has it."""
    mesh = sharding.activation_mesh()
    if mesh is None:
        return x
    n, seq = mesh.shape["data"] * mesh.shape["fsdp"], sharding.seq_shards(mesh)
    if x.shape[0] % n:
        return x
    spec: jax.sharding.PartitionSpec | jax.sharding.NamedSharding
    if seq > 1 and x.ndim >= 2 and x.shape[1] % seq == 0:
        spec = jax.sharding.PartitionSpec(sharding.AXES, sharding.SEQ, *([None] * (x.ndim - 2)))
    elif n == 1:
        return x
    else:
        spec = jax.sharding.PartitionSpec(sharding.AXES, *([None] * (x.ndim - 1)))
    if isinstance(mesh, jax.sharding.Mesh):
        spec = jax.sharding.NamedSharding(mesh, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def _constrain_heads(x):
    """[B, T, H, D] with the whole sequence on each device and the heads split over "seq" (only when
    sequences are sharded): attention then runs unchanged on n_heads / seq_shards heads per device."""
    mesh = sharding.activation_mesh()
    seq = sharding.seq_shards(mesh)
    if seq == 1 or x.shape[2] % seq or x.shape[0] % (mesh.shape["data"] * mesh.shape["fsdp"]):
        return x
    spec: jax.sharding.PartitionSpec | jax.sharding.NamedSharding
    spec = jax.sharding.PartitionSpec(sharding.AXES, None, sharding.SEQ, None)
    if isinstance(mesh, jax.sharding.Mesh):
        spec = jax.sharding.NamedSharding(mesh, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def layer_window(cfg: ModelConfig, i: int) -> int | None:
    """None for full attention, else the sliding window (token itself + window-1 before it)."""
    return None if cfg.layer_is_full(i) else cfg.sliding_window


def layer_rope(cfg: ModelConfig, seq_len: int):
    """i -> (cos, sin) for layer i: YaRN tables on the layers `cfg.layer_rope_scaled` names, else plain."""
    plain = rope_tables(seq_len, cfg.head_dim, cfg.rope_theta)
    if cfg.rope_scaling is None:
        return lambda i: plain
    scaled = rope_tables(seq_len, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    return lambda i: scaled if cfg.layer_rope_scaled(i) else plain


# ----------------------------------------------------------------------------- forward


def forward(params, tokens, cfg: ModelConfig, *, attention: str | None = None, segment_ids=None):
    """tokens int32 [B, T] -> logits float32 [B, T, padded_vocab_size]; with `cfg.softmax_vocab_size`
    set, the logits of the rows past it are float32's lowest value (out of every softmax).

    `attention` overrides cfg.attention; `auto` resolves by the platform compiled for
    (`attention.resolve`). `segment_ids` [B, T] (optional): documents packed into one instance;
    attention never crosses from one segment to another.
    """
    impl = attn_lib.resolve(attention or cfg.attention)
    dt = dtype_of(cfg.compute_dtype)
    B, T = tokens.shape
    rope = layer_rope(cfg, T)  # layer -> (cos, sin); within a group, layer j's type is fixed

    x = _constrain_batch(jnp.take(params["embed"], tokens, axis=0).astype(dt))  # [B, T, d]

    P = cfg.full_attention_every
    L = cfg.n_layers
    n_groups, n_tail = divmod(L, P)
    blocks = params["blocks"]

    # A group is P consecutive layers: P-1 sliding then one full (positions fixed by (i+1) % P == 0).
    layer_fns = [
        _remat(partial(_layer, cfg=cfg, window=layer_window(cfg, j), attention=impl), cfg) for j in range(P)
    ]

    def group_step(h, group_params):
        for j in range(P):
            h = layer_fns[j](jax.tree.map(lambda w, j=j: w[j], group_params), h, *rope(j), segment_ids)
        return h, None

    if n_groups:
        grouped = jax.tree.map(lambda w: w[: n_groups * P].reshape(n_groups, P, *w.shape[1:]), blocks)
        x, _ = jax.lax.scan(group_step, x, grouped)
    if n_tail:
        # Leftover layers (n_layers not a multiple of P): sliding, except the last layer, which is
        # always full attention (OLMo-core's force_full_attention_on_last_layer).
        first = n_groups * P
        if n_tail > 1:
            tail = jax.tree.map(lambda w: w[first : L - 1], blocks)
            x, _ = jax.lax.scan(lambda h, p: (layer_fns[0](p, h, *rope(first), segment_ids), None), x, tail)
        x = layer_fns[P - 1](jax.tree.map(lambda w: w[L - 1], blocks), x, *rope(L - 1), segment_ids)

    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    logits = jnp.einsum("btd,dv->btv", x, params["lm_head"].astype(dt), preferred_element_type=jnp.float32)
    n, V = cfg.softmax_vocab_size, logits.shape[-1]
    if 0 < n < V:
        # Rows a converted model never had (zeros padding added) take no probability mass. Finite, so
        # sums over the vocabulary (a KL's p * log p) stay finite where both sides leave a row out.
        logits = jnp.where(jnp.arange(V) < n, logits, jnp.finfo(jnp.float32).min)
    return logits
