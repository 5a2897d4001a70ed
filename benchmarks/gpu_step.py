"""The trainer's own train step on one GPU: tokens/s, MFU (both formulas), step time, peak memory, as JSON.

A 7B-shaped OLMo 3 (d_model 4096, 32 heads of 128, SwiGLU 11008, vocab 100352) at sequence 8192 and
per-device batch 1 with `remat=full`: first the full 32 layers, then fewer (24, 16, 8, 4) until one
fits. Each configuration is compiled and run with `olmo_ctl.trainer.train.make_train_step` (model,
loss, AdamW with skip-step, exactly what the trainer runs) and the attention `auto` picks on the GPU
(cuDNN fused attention with the local window for sliding layers; the blocked kernel without cuDNN).
Parameters and Adam moments are fp32, as in training; a 7B model's state alone is ~84 GiB.

One JSON line per configuration tried; the last line is the summary (the largest that ran):
  {"device", "attention", "n_layers", "seq_len", "batch", "remat", "step_s", "tokens_per_s",
   "mfu_olmo_core", "mfu_maxtext", "tflops_per_device_olmo_core", "peak_memory_gib", ...}

    python benchmarks/gpu_step.py                 # on a machine with one NVIDIA GPU (pip install '.[gpu]')
    python benchmarks/gpu_step.py --dry-run       # tiny model, compiles and runs one step on the CPU
    python benchmarks/gpu_step.py --layers 8 --steps 5 --batch 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

DEFAULT_LAYERS = (32, 24, 16, 8, 4)
TINY = [
    "model.n_layers=4",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=4",
    "model.head_dim=16",
    "model.mlp_hidden=128",
    "model.vocab_size=500",
    "model.padded_vocab_size=512",
    "model.sliding_window=32",
    "model.eos_token_id=1",
    "model.pad_token_id=2",
]


def _recipe(layers: int, seq: int, batch: int, remat: str, attention: str, dry_run: bool):
    from olmo_ctl.core.recipe import load_recipe

    sets = [
        f"train.seq_len={seq}",
        f"train.global_batch={batch}",
        f"train.max_per_device_batch={batch}",
        f"model.remat={remat}",
        f"model.attention={attention}",
    ]
    if dry_run:
        sets = TINY + sets
    r = load_recipe(stage=1, overrides=sets)
    return dataclasses.replace(r, model=dataclasses.replace(r.model, n_layers=layers))


def _is_oom(e: BaseException) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "Out of memory" in text


def run_one(recipe, steps: int) -> dict:
    """Compile the trainer's step for one device, run `steps` steps after one warm-up, report."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from olmo_ctl.core import flops as flops_lib
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.trainer import attention as attn_lib
    from olmo_ctl.trainer import model as model_lib
    from olmo_ctl.trainer.train import init_state, make_train_step

    m, t = recipe.model, recipe.train
    dev = jax.devices()[0]
    platform = jax.default_backend()
    params = model_lib.init_params(m, jax.random.PRNGKey(0))
    state = init_state(recipe, params)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, m.vocab_size, size=(1, t.global_batch, t.seq_len + 1), dtype=np.int32)
    batch = {"input_ids": jnp.asarray(ids[..., :-1]), "labels": jnp.asarray(ids[..., 1:])}
    step = jax.jit(make_train_step(recipe), donate_argnums=(0,))
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    state, metrics = compiled(state, batch)  # warm-up
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - t0) / steps
    tokens_per_s = t.global_batch * t.seq_len / step_s
    device = get_device("gpu-1" if platform == "gpu" else "cpu-1")
    out = {
        "device": device.name,
        "device_kind": dev.device_kind,
        "platform": platform,
        "attention": attn_lib.resolve(m.attention),
        "n_layers": m.n_layers,
        "seq_len": t.seq_len,
        "batch": t.global_batch,
        "remat": m.remat,
        "compile_s": round(compile_s, 2),
        "steps": steps,
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens_per_s, 1),
        "loss": float(metrics["ce"]),
    }
    for formula in ("olmo_core", "maxtext"):
        tf = flops_lib.tflops_per_device(tokens_per_s, flops_lib.flops_per_token(m, t.seq_len, formula))
        out[f"tflops_per_device_{formula}"] = round(tf, 2)
        out[f"mfu_{formula}"] = round(flops_lib.mfu(tf, device), 4)
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    peak = (stats or {}).get("peak_bytes_in_use")
    out["peak_memory_gib"] = None if peak is None else round(peak / 2**30, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dry-run", action="store_true", help="tiny model on the CPU: build, compile, run one step"
    )
    ap.add_argument(
        "--layers", type=int, action="append", help=f"layer counts to try (default {DEFAULT_LAYERS})"
    )
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1, help="sequences per step (one device)")
    ap.add_argument("--remat", default="full", choices=("none", "save_proj", "full"))
    ap.add_argument(
        "--attention", default="auto", choices=("auto", "cudnn", "blocked", "reference", "splash")
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--all", action="store_true", help="try every layer count, not only until one fits")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
        layers, seq, steps = args.layers or [2], min(args.seq, 128), 1
    else:
        layers, seq, steps = args.layers or list(DEFAULT_LAYERS), args.seq, args.steps
    best = None
    for n in layers:
        recipe = _recipe(n, seq, args.batch, args.remat, args.attention, args.dry_run)
        try:
            row = run_one(recipe, steps)
            row["fits"] = True
        except Exception as e:  # noqa: BLE001 - an out-of-memory is a result: try fewer layers
            if not _is_oom(e):
                raise
            row = {
                "n_layers": n,
                "seq_len": seq,
                "batch": args.batch,
                "remat": args.remat,
                "fits": False,
                "error": str(e).strip().splitlines()[0][:300],
            }
        row["dry_run"] = args.dry_run
        print(json.dumps(row), flush=True)
        if row["fits"] and best is None:
            best = row
            if not args.all:
                break
    summary = dict(best or {"fits": False}, summary=True)
    print(json.dumps(summary), flush=True)
    return 0 if best else 1


if __name__ == "__main__":
    sys.exit(main())
