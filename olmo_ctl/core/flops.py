"""Training FLOPs per token and MFU, shared by the trainer (TensorBoard) and the CLI (plan, monitor).

Two formulas, because the two references we compare against count differently:

* OLMo-core (`flops_per_token_olmo_core`): 6 x (non-embedding parameters, LM head included)
  + per layer 12 x n_heads x head_dim x min(window, seq_len). Attention is not halved for causality
  but sliding layers are charged only for the keys they can see. ~4.94e10 for OLMo 3 7B at 8192.
* MaxText (`flops_per_token_maxtext`): 3 x (2 x every matmul weight, LM head included) + per layer
  6 x seq_len x n_heads x head_dim (causal attention halved, no window discount). ~4.78e10 for OLMo 3 7B
  at 8192; the TPU case study's "1565 TFLOP per step per device" is this formula.

MFU is the fraction (0..1) of the device's peak dense bf16 throughput; callers that show percent
multiply by 100. Pure Python: no jax, so `olmo-ctl plan` stays instant.
"""

from __future__ import annotations

from olmo_ctl.core.devices import Device
from olmo_ctl.core.recipe import ModelConfig

FORMULAS = ("olmo_core", "maxtext")


def _attn_proj_params(m: ModelConfig) -> int:
    q = m.n_heads * m.head_dim
    kv = m.n_kv_heads * m.head_dim
    return m.d_model * q + 2 * m.d_model * kv + q * m.d_model  # wq, wk, wv, wo


def _block_matmul_params(m: ModelConfig) -> int:
    return _attn_proj_params(m) + 3 * m.d_model * m.mlp_hidden  # + w1, w2, w3


def _non_embedding_params(m: ModelConfig) -> int:
    """Every parameter but the input embedding (norm weights and the LM head included), as OLMo-core counts."""
    q = m.n_heads * m.head_dim
    kv = m.n_kv_heads * m.head_dim
    block = _block_matmul_params(m) + q + kv + 2 * m.d_model  # + q/k norms, post-attn and post-MLP norms
    return m.n_layers * block + m.d_model + m.padded_vocab_size * m.d_model  # + final norm + LM head


def attention_window(m: ModelConfig, layer: int, seq_len: int) -> int:
    """Keys a query can see at most in `layer` (full layers: the whole sequence)."""
    return seq_len if m.layer_is_full(layer) else min(m.sliding_window, seq_len)


def flops_per_token_olmo_core(m: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token, OLMo-core's window-discounted formula."""
    attn = sum(12 * m.n_heads * m.head_dim * attention_window(m, i, seq_len) for i in range(m.n_layers))
    return float(6 * _non_embedding_params(m) + attn)


def flops_per_token_maxtext(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, MaxText's formula (causal-halved attention on every layer, no window)."""
    weights = 6 * (m.n_layers * _block_matmul_params(m) + m.d_model * m.padded_vocab_size)
    attn = m.n_layers * 6 * seq_len * m.n_heads * m.head_dim  # 3 x (4 x S x H x D / 2)
    return float(weights + attn)


def flops_per_token(m: ModelConfig, seq_len: int, formula: str = "olmo_core") -> float:
    if formula == "olmo_core":
        return flops_per_token_olmo_core(m, seq_len)
    if formula == "maxtext":
        return flops_per_token_maxtext(m, seq_len)
    raise ValueError(f"unknown FLOPs formula {formula!r}; known: {', '.join(FORMULAS)}")


def tflops_per_device(tokens_per_s_per_device: float, flops_per_tok: float) -> float:
    """Achieved model TFLOP/s per device from the per-device token throughput."""
    return tokens_per_s_per_device * flops_per_tok / 1e12


def mfu(tflops_per_device: float, device: Device) -> float:
    """Model FLOPs utilisation as a fraction of the device's peak dense bf16 TFLOP/s (per JAX device)."""
    return tflops_per_device / device.peak_tflops_per_device
