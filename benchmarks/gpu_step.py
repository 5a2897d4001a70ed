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
import shutil
import subprocess
import sys
import time

# Fractions of the model's layers tried, largest first, until one fits.
LAYER_FRACTIONS = (1, 3 / 4, 1 / 2, 1 / 4, 1 / 8)
# OLMo-core README ("Official training scripts"): OLMo 7B, context 4096, bf16, on H100s.
REFERENCE = {"tokens_per_s_per_gpu": 10_000, "what": "OLMo-core 7B, context 4096, bf16, per H100"}
# nvidia-smi's GPU name -> the GKE machine type of that GPU (core/generations.py GPU_MACHINES).
GPU_NAME_TO_MACHINE = (("H100", "h100-mega-80gb-8"), ("H200", "h200-141gb-8"), ("B200", "b200-8"))
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


def _base_recipe(name: str | None, dry_run: bool):
    from olmo_ctl.core.recipe import load_recipe

    if name:
        return load_recipe(recipe=name, overrides=TINY if dry_run else [])
    return load_recipe(stage=1, overrides=TINY if dry_run else [])


def _recipe(base, layers: int, seq: int, batch: int, remat: str | None, attention: str):
    """`base` with one configuration's layers, sequence, per-device batch, remat and attention."""
    train = dataclasses.replace(base.train, seq_len=seq, global_batch=batch, max_per_device_batch=batch)
    model = dataclasses.replace(
        base.model, n_layers=layers, remat=remat or base.model.remat, attention=attention
    )
    return dataclasses.replace(base, train=train, model=model)


def gpu_machine_of_this_host() -> str | None:
    """The GKE machine type whose GPU `nvidia-smi` names first here (None: no NVIDIA GPU, or another)."""
    if shutil.which("nvidia-smi") is None:
        return None
    p = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
    )
    name = (p.stdout.splitlines() or [""])[0]
    return next((m for key, m in GPU_NAME_TO_MACHINE if key in name), None)


def machine_xla_flags(machine: str | None) -> list[str]:
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.core.xla_flags import xla_flags_for

    return xla_flags_for(get_device(machine), None, None) if machine else []


def _is_oom(e: BaseException) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "Out of memory" in text


def run_one(recipe, steps: int, machine: str | None = None) -> dict:
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
    device = get_device(machine or ("gpu-1" if platform == "gpu" else "cpu-1"))
    out = {
        "device": device.name,
        "machine_type": machine,
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
        out[f"mfu_{formula}"] = round(flops_lib.mfu(tf, device), 6)
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    peak = (stats or {}).get("peak_bytes_in_use")
    out["peak_memory_gib"] = None if peak is None else round(peak / 2**30, 2)
    # The reference is for the 7B's whole model: a ratio only where this is that model (all 32 layers).
    seven_b = (m.d_model, m.n_layers, m.n_heads) == (4096, 32, 32)
    out["reference_tokens_per_s"] = REFERENCE["tokens_per_s_per_gpu"] if seven_b else None
    out["reference"] = REFERENCE["what"] if seven_b else None
    ratio = tokens_per_s / REFERENCE["tokens_per_s_per_gpu"]
    out["ratio_to_reference"] = round(ratio, 3) if seven_b else None
    return out


def check_flags() -> int:
    """Start JAX once per GPU machine type with its XLA_FLAGS (an unknown flag aborts the process at
    start); one JSON line each. 0 when every set parses."""
    from olmo_ctl.core.generations import GPU_MACHINES

    bad = 0
    for name, machine in GPU_MACHINES.items():
        env = dict(os.environ, XLA_FLAGS=" ".join(machine.xla_flags))
        code = "import jax, jax.numpy as jnp; print(jax.default_backend(), float(jnp.ones(8).sum()))"
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        unknown = [ln for ln in p.stderr.splitlines() if "in XLA_FLAGS" in ln]
        row = {
            "machine_type": name,
            "flags": len(machine.xla_flags),
            "parse": p.returncode == 0,
            "backend": p.stdout.split()[0] if p.returncode == 0 and p.stdout.split() else None,
            "error": (unknown or p.stderr.strip().splitlines()[-1:] or [""])[0][:300]
            if p.returncode
            else None,
        }
        bad += p.returncode != 0
        print(json.dumps(row), flush=True)
    return 1 if bad else 0


def layer_counts(n_layers: int) -> list[int]:
    """The model's own layer count, then the fractions of LAYER_FRACTIONS (at least 1, no repeats)."""
    out: list[int] = []
    for f in LAYER_FRACTIONS:
        n = max(1, int(n_layers * f))
        if n not in out:
            out.append(n)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dry-run", action="store_true", help="tiny model on the CPU: build, compile, run one step"
    )
    ap.add_argument(
        "--check-flags", action="store_true", help="only start JAX with each GPU machine type's XLA flags"
    )
    ap.add_argument("--recipe", help="recipe name or file (default: the stage-1 recipe, OLMo 3 7B)")
    ap.add_argument(
        "--layers", type=int, action="append", help="layer counts to try (default: the model's, then fewer)"
    )
    ap.add_argument("--seq", type=int, help="sequence length (default: the recipe's)")
    ap.add_argument(
        "--batch",
        type=int,
        help="sequences per step, one device (default 1; a recipe's global batch if <= 64)",
    )
    ap.add_argument("--remat", choices=("none", "save_proj", "full"), help="default: the recipe's")
    ap.add_argument(
        "--attention", default="auto", choices=("auto", "cudnn", "blocked", "banded", "reference", "splash")
    )
    ap.add_argument(
        "--xla-flags",
        default="auto",
        help="auto (the machine type of the GPU found), none, or a GPU machine type (h100-mega-80gb-8)",
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--all", action="store_true", help="try every layer count, not only until one fits")
    args = ap.parse_args(argv)
    if args.check_flags:
        return check_flags()
    machine = None if args.dry_run else gpu_machine_of_this_host()
    if args.xla_flags not in ("auto", "none"):
        machine = args.xla_flags
    flags = [] if args.xla_flags == "none" else machine_xla_flags(machine)
    if flags:  # before JAX starts: XLA reads XLA_FLAGS once, when its first backend comes up
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()
    base = _base_recipe(args.recipe, args.dry_run)
    seq = args.seq or base.train.seq_len
    batch = args.batch or (base.train.global_batch if base.train.global_batch <= 64 else 1)
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
        layers, seq, steps = args.layers or [2], min(seq, 128), 1
    else:
        layers, steps = args.layers or layer_counts(base.model.n_layers), args.steps
    best = None
    for n in layers:
        recipe = _recipe(base, n, seq, batch, args.remat, args.attention)
        try:
            row = run_one(recipe, steps, machine)
            row["fits"] = True
            row["xla_flags"] = "none" if not flags else f"{machine} ({len(flags)} flags)"
        except Exception as e:  # noqa: BLE001 - an out-of-memory is a result: try fewer layers
            if not _is_oom(e):
                raise
            import gc

            import jax

            gc.collect()  # the failed attempt's state, held by the traceback's frames, before the next
            jax.clear_caches()
            row = {
                "n_layers": n,
                "seq_len": seq,
                "batch": batch,
                "remat": recipe.model.remat,
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
