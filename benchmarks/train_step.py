"""Training tokens/s on the CPU for the smoke model: the trainer's own step against Hugging Face eager PyTorch.

Ours is exactly what the trainer runs: `olmo_ctl.trainer.step.jit_train_step` (forward, fp32 token
cross-entropy + z-loss, gradient accumulation scan, global-norm clipping, AdamW, skip-step), jitted
with the trainer's state shardings and donation, on the trainer's state (`init_state`) and batch layout
`[accum, micro, T]`, for the recipe's plan on this machine's CPU device. The reference is
Olmo3ForCausalLM of the same shape (layers, widths, heads, window, padded vocabulary) in PyTorch
eager, with token cross-entropy on fp32 logits, `clip_grad_norm_` and `torch.optim.AdamW` (no
decay on the input embedding). Both see the same tokens, `global_batch x seq_len` per step.

    PYTHONPATH=. python benchmarks/train_step.py [--steps 20] [--repeats 5] [--recipe smoke] [--set k=v ...]
                                                 [--devices N] [--variant NAME:k=v[,k=v...] ...]

Ours runs on `cpu-N`, one host device per core by default (what the local twin uses on this machine:
XLA runs each device's part of the step on its own thread), PyTorch with its default intra-op threads
(one per core).

Each side is timed `--repeats` times over `--steps` steps after a warm-up, the two sides taking
turns (the best repeat of each counts, as the machine is shared); the last stdout line is one JSON object with both throughputs and
`ratio` (ours / reference).

`--variant NAME:k=v[,k=v...]` (repeatable) adds our step with those recipe overrides on top of
`--set`, timed in the same turns (e.g. `--variant dp:train.shard_group=1` against the recipe's
FSDP layout): a comparison of layouts within one process and one machine load, which two separate
runs on a shared machine cannot give. The JSON then has `variants`: NAME -> tokens/s and ratio.
Two keys of a variant turn off a CPU measure of the trainer's step rather than set the recipe:
`flat_fsdp=off` (the partitioner's per-parameter collectives instead of one gather and one
gradient reduction, trainer/flat_fsdp.py) and `cpu_projection=off` (JAX's own transpose rule for the
projections' weight gradients, trainer/model.py `_matmul`); `model.attention=blocked` is the
attention before `banded`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _devices_from_argv(argv: list[str]) -> int:
    """`--devices N` (default: every core of this machine, as the local twin would use it)."""
    for i, a in enumerate(argv):
        if a == "--devices" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--devices="):
            return int(a.split("=", 1)[1])
    return os.cpu_count() or 1


# The device count must be set before jax is imported: the trainer's step runs on cpu-N, N host devices
# (one per core by default), as PyTorch's eager kernels use every core through their intra-op threads.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={_devices_from_argv(sys.argv)}"
    ).strip()


SWITCHES = ("flat_fsdp", "cpu_projection")


def _switched_off(off: set[str]):
    """A context in which the step is traced without the CPU measures named in `off`."""
    import contextlib

    import jax.numpy as jnp

    from olmo_ctl.trainer import flat_fsdp, model

    stack = contextlib.ExitStack()

    def patch(module, name, value):
        old = getattr(module, name)
        setattr(module, name, value)
        stack.callback(setattr, module, name, old)

    if "flat_fsdp" in off:
        patch(flat_fsdp, "applies", lambda params: False)
    if "cpu_projection" in off:
        patch(model, "_matmul", lambda x, w, dtype: jnp.einsum("btd,df->btf", x, w.astype(dtype)))
    return stack


def ours(recipe, tokens, off: set[str] = frozenset()):
    """A function that runs `steps` trainer steps and returns the seconds they took (compiled, warm)."""
    import jax
    import numpy as np

    from olmo_ctl.core import batching
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.trainer import sharding
    from olmo_ctl.trainer.step import abstract_train_state, fresh_state, jit_train_step, micro_batch_sharding

    t = recipe.train
    device = get_device(f"cpu-{jax.device_count()}")
    plan = batching.make_plan(recipe, device)
    kind, replicas = batching.mesh_layout(recipe, device.devices)  # as the trainer lays it out
    mesh = sharding.make_mesh(jax.devices(), kind, replicas)
    _, state_shard = abstract_train_state(recipe, mesh)
    state = fresh_state(recipe, state_shard)
    step = jit_train_step(recipe, state_shard)
    accum = plan.grad_accum
    shape = (accum, t.global_batch // accum, t.seq_len)
    shard = micro_batch_sharding(mesh)
    batch = {
        "input_ids": np.ascontiguousarray(tokens[:, :-1]).reshape(shape),
        "labels": np.ascontiguousarray(tokens[:, 1:]).reshape(shape),
    }
    batch = {k: jax.make_array_from_process_local_data(shard, v, shape) for k, v in batch.items()}
    box = [state]

    def run(steps: int) -> float:
        state = box[0]
        t0 = time.perf_counter()
        for _ in range(steps):
            state, m = step(state, batch)
        jax.block_until_ready((state, m))
        box[0] = state
        if not np.isfinite(float(m["ce"])):
            raise SystemExit("our loss is not finite")
        return time.perf_counter() - t0

    with _switched_off(set(off)):
        run(3)  # compile and warm up: the step is traced here
    return run


def reference(recipe, tokens):
    """The same for Hugging Face Olmo3ForCausalLM in PyTorch eager."""
    import torch
    from transformers import Olmo3Config, Olmo3ForCausalLM

    from olmo_ctl.checkpoints.convert import hf_config_from_model

    m, o = recipe.model, recipe.optimizer
    hf = hf_config_from_model(m)
    hf.pop("architectures", None), hf.pop("model_type", None), hf.pop("dtype", None)
    cfg = Olmo3Config(**{**hf, "vocab_size": m.padded_vocab_size})
    torch.manual_seed(0)
    model = Olmo3ForCausalLM(cfg).train()
    decay = [p for n, p in model.named_parameters() if "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if "embed_tokens" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
    )
    x = torch.from_numpy(tokens[:, :-1]).long()
    y = torch.from_numpy(tokens[:, 1:]).long()

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=x, use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        return loss

    def run(steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return time.perf_counter() - t0

    run(3)
    return run


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    from olmo_ctl.core.recipe import load_recipe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="smoke")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:k=v[,k=v...]")
    ap.add_argument(
        "--devices",
        type=int,
        default=os.cpu_count() or 1,
        help="host CPU devices of the trainer's step (cpu-N; default: one per core)",
    )
    args = ap.parse_args(argv)
    recipe = load_recipe(args.recipe, overrides=args.overrides)
    m, t = recipe.model, recipe.train
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, m.vocab_size, size=(t.global_batch, t.seq_len + 1), dtype=np.int32)
    print(
        f"{recipe.name}: {m.n_layers} layers, d_model {m.d_model}, batch {t.global_batch} x {t.seq_len} tokens, "
        f"{m.compute_dtype} compute, attention {m.attention}, {args.steps} steps x {args.repeats}, CPU; "
        f"ours on cpu-{__import__('jax').device_count()}, PyTorch with {__import__('torch').get_num_threads()} threads"
    )
    runners = {"ours": ours(recipe, tokens)}
    for v in args.variant:
        name, _, sets = v.partition(":")
        if not name or not sets or name in ("ours", "reference"):
            raise SystemExit(f"--variant {v!r}: expected NAME:k=v[,k=v...] with a NAME of its own")
        pairs = sets.split(",")
        off = {p.partition("=")[0] for p in pairs if p.partition("=")[0] in SWITCHES}
        if any(p.partition("=")[2] != "off" for p in pairs if p.partition("=")[0] in off):
            raise SystemExit(f"--variant {v!r}: {', '.join(SWITCHES)} take the value off")
        overrides = [p for p in pairs if p.partition("=")[0] not in SWITCHES]
        runners[name] = ours(load_recipe(args.recipe, overrides=[*args.overrides, *overrides]), tokens, off)
    runners["reference"] = reference(recipe, tokens)
    best = {k: float("inf") for k in runners}
    for _ in range(args.repeats):  # interleaved, so a change in the machine's load hits both sides
        for k, run in runners.items():
            best[k] = min(best[k], run(args.steps))
    tokens_s = {k: t.global_batch * t.seq_len * args.steps / best[k] for k in runners}
    a, b = tokens_s["ours"], tokens_s["reference"]
    print(
        f"ours (trainer step, jax.jit)  {a:10.0f} tokens/s  ({best['ours'] / args.steps * 1e3:.1f} ms/step)"
    )
    print(
        f"HF Olmo3 (torch eager)        {b:10.0f} tokens/s  ({best['reference'] / args.steps * 1e3:.1f} ms/step)"
    )
    print(f"ratio                         {a / b:10.2f}x")
    variants = {}
    for name, tok_s in tokens_s.items():
        if name not in ("ours", "reference"):
            variants[name] = {"tokens_s": round(tok_s), "ratio": round(tok_s / b, 3)}
            print(f"variant {name:22s}{tok_s:10.0f} tokens/s  ratio {tok_s / b:.2f}x")
    import jax

    print(
        json.dumps(
            {
                "recipe": recipe.name,
                "device": f"cpu-{jax.device_count()}",
                "ours_tokens_s": round(a),
                "reference_tokens_s": round(b),
                "ratio": round(a / b, 3),
                **({"variants": variants} if variants else {}),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
