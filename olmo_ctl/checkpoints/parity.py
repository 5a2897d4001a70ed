"""Logit parity between a Hugging Face `Olmo3ForCausalLM` or `Olmo2ForCausalLM` (config.json's
`model_type` chooses) and our JAX model on the same tokens.

Both run on the CPU. Tokens are drawn uniformly from the real vocabulary with a fixed seed. Logits
are compared over the real vocabulary only (our padded rows never count), in float64:
* `kl_mean`, `kl_max`: per-token KL(HF || ours) = sum_v p_hf(v) (log p_hf(v) - log p_ours(v));
* `top1_agreement`: fraction of tokens whose argmax agrees;
* `top10_overlap`: mean |top10_hf & top10_ours| / 10.
With `dtype=bf16` both models keep their stored weights and compute in bfloat16 (HF casts its
weights to bf16; ours casts at each matmul, norms and softmax in fp32), which shows the
framework noise floor; fp32 parity of a faithful conversion is ~1e-12.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from olmo_ctl.core.errors import BadInput

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
LONG_SEQ = 2048  # above this our side uses the blocked attention (tested equal to the reference)


def logit_stats(ref: np.ndarray, ours: np.ndarray) -> dict:
    """ref, ours: [N, V] logits over the same real vocabulary."""
    ref = ref.astype(np.float64)
    ours = ours.astype(np.float64)
    lp_ref = ref - _logsumexp(ref)
    lp_ours = ours - _logsumexp(ours)
    kl = np.sum(np.exp(lp_ref) * (lp_ref - lp_ours), axis=-1)
    kl = np.maximum(kl, 0.0)  # rounding can make a ~0 KL slightly negative
    k = min(10, ref.shape[-1])
    top_ref = np.argsort(-ref, axis=-1, kind="stable")[:, :k]
    top_ours = np.argsort(-ours, axis=-1, kind="stable")[:, :k]
    overlap = np.mean([len(set(a) & set(b)) / k for a, b in zip(top_ref, top_ours, strict=True)])
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agreement": float(np.mean(ref.argmax(-1) == ours.argmax(-1))),
        "top10_overlap": float(overlap),
    }


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return m + np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def hf_logits(hf_dir: str, tokens: np.ndarray, dtype: str = "fp32") -> np.ndarray:
    import torch
    from transformers import Olmo2ForCausalLM, Olmo3ForCausalLM

    from olmo_ctl.checkpoints.convert import local_copy, read_hf_config

    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    cls = Olmo2ForCausalLM if read_hf_config(hf_dir).get("model_type") == "olmo2" else Olmo3ForCausalLM
    with local_copy(hf_dir) as d:
        model = cls.from_pretrained(d, dtype=torch_dtype)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens.astype(np.int64)), use_cache=False).logits
    return out.float().numpy()


def our_logits(params, cfg, tokens: np.ndarray, dtype: str = "fp32", attention: str = "auto") -> np.ndarray:
    import jax

    from olmo_ctl.trainer.model import forward

    cfg = dataclasses.replace(cfg, compute_dtype=DTYPES[dtype], remat="none")
    fn = jax.jit(lambda p, t: forward(p, t, cfg, attention=attention))
    return np.asarray(fn(params, jax.numpy.asarray(tokens, jax.numpy.int32)))


def run_parity(
    hf_dir: str,
    orbax_dir: str,
    *,
    seq_len: int = 256,
    batch: int = 2,
    dtype: str = "fp32",
    seed: int = 0,
    attention: str = "auto",
    recipe: str | None = None,
) -> dict:
    from olmo_ctl.checkpoints.convert import load_orbax, read_hf_config

    if dtype not in DTYPES:
        raise BadInput(f"--dtype {dtype} is not fp32 or bf16")
    if seq_len < 1 or batch < 1:
        raise BadInput("--seq-len and --batch must be positive")
    read_hf_config(hf_dir)  # before loading either model
    params, cfg, _ = load_orbax(orbax_dir, recipe=recipe)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, size=(batch, seq_len), dtype=np.int64)
    ref = hf_logits(hf_dir, tokens, dtype)
    if ref.shape[:2] != tokens.shape or ref.shape[-1] < cfg.vocab_size:
        raise BadInput(
            f"the HF model returned logits {ref.shape}; expected [{batch}, {seq_len}, >= {cfg.vocab_size}]",
            "HF_DIR and ORBAX_DIR must be the same architecture",
        )
    if attention == "auto" and seq_len > LONG_SEQ:
        attention = "blocked"  # the reference path would hold a [T, T] fp32 score matrix per head
    ours = our_logits(params, cfg, tokens, dtype, attention)
    V = cfg.vocab_size
    stats = logit_stats(ref[..., :V].reshape(-1, V), ours[..., :V].reshape(-1, V))
    return {**stats, "dtype": dtype, "seq_len": seq_len, "tokens": int(batch * seq_len)}
