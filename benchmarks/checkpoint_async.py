"""The step-time hiccup of a checkpoint save on the smoke model: asynchronous Orbax save against a synchronous one.

Runs the trainer's own step (`olmo_ctl.trainer.step.jit_train_step`) on the smoke recipe and saves the
train state with the trainer's `Checkpointer` (the same Composite(state, meta) items) every
`--every` steps, once with `async_save=True` and once with `async_save=False`. Every step is timed on
its own (blocked until its result is ready). The hiccup of a save is the time the save call blocks
plus the extra time of the `--window` steps after it, over the median step time of steps far from
any save; the async save then finishes in the background while those steps run.

    PYTHONPATH=. python benchmarks/checkpoint_async.py [--saves 4] [--every 12] [--window 6]

The last stdout line is one JSON object: step_s, and for `sync` and `async` the median save-call
seconds (`*_call_s`) and the median hiccup (`*_hiccup_s`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def measure(recipe, async_save: bool, saves: int, every: int, window: int, directory: str) -> dict:
    import jax
    import numpy as np

    from olmo_ctl.core import batching
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.trainer import sharding
    from olmo_ctl.trainer.checkpoint import Checkpointer
    from olmo_ctl.trainer.step import abstract_train_state, fresh_state, jit_train_step, micro_batch_sharding

    t = recipe.train
    plan = batching.make_plan(recipe, get_device(f"cpu-{jax.device_count()}"))
    mesh = sharding.make_mesh(jax.devices(), t.mesh, t.data_parallel)
    _, state_shard = abstract_train_state(recipe, mesh)
    state = fresh_state(recipe, state_shard)
    step_fn = jit_train_step(recipe, state_shard)
    shape = (plan.grad_accum, t.global_batch // plan.grad_accum, t.seq_len)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, recipe.model.vocab_size, size=(t.global_batch, t.seq_len + 1), dtype=np.int32)
    host = {"input_ids": tokens[:, :-1].reshape(shape).copy(), "labels": tokens[:, 1:].reshape(shape).copy()}
    batch = {
        k: jax.make_array_from_process_local_data(micro_batch_sharding(mesh), v, shape)
        for k, v in host.items()
    }
    ckpt = Checkpointer(directory, keep=2, async_save=async_save)
    meta = {"data": {"epoch": 1}, "note": "benchmark"}

    def one(state):
        t0 = time.perf_counter()
        state, m = step_fn(state, batch)
        jax.block_until_ready((state, m))
        return state, time.perf_counter() - t0

    for _ in range(3):  # compile and warm up
        state, _ = one(state)
    calls, hiccups, quiet = [], [], []
    n = 3
    for _ in range(saves):
        for _ in range(every - window):
            state, dt = one(state)
            quiet.append(dt)
        n += every - window
        t0 = time.perf_counter()
        ckpt.save(n, state, meta)
        call = time.perf_counter() - t0
        after = []
        for _ in range(window):
            state, dt = one(state)
            after.append(dt)
        n += window
        ckpt.wait()  # outside the window: a save still running after it would be counted as free
        calls.append(call)
        hiccups.append((call, after))
    ckpt.close()
    step_s = statistics.median(quiet)
    return {
        "step_s": step_s,
        "call_s": statistics.median(calls),
        "hiccup_s": statistics.median(c + sum(a) - window * step_s for c, a in hiccups),
        "window_s": statistics.median(c + sum(a) for c, a in hiccups),
    }


def main(argv: list[str] | None = None) -> int:
    from olmo_ctl.core.recipe import load_recipe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="smoke")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--every", type=int, default=12)
    ap.add_argument("--window", type=int, default=6)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    args = ap.parse_args(argv)
    if args.every <= args.window:
        ap.error("--every must be larger than --window")
    recipe = load_recipe(args.recipe, overrides=args.overrides)
    out = {}
    root = tempfile.mkdtemp(prefix="ckpt-bench-")
    try:
        for mode, flag in (("sync", False), ("async", True)):
            r = measure(recipe, flag, args.saves, args.every, args.window, os.path.join(root, mode))
            print(
                f"{mode:5s} save: call blocks {r['call_s'] * 1e3:7.1f} ms, hiccup {r['hiccup_s'] * 1e3:7.1f} ms "
                f"(step {r['step_s'] * 1e3:.1f} ms; {args.window} steps after the save took "
                f"{r['window_s'] * 1e3:.1f} ms)"
            )
            out[f"{mode}_call_s"] = round(r["call_s"], 4)
            out[f"{mode}_hiccup_s"] = round(r["hiccup_s"], 4)
            out.setdefault("step_s", round(r["step_s"], 4))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"recipe": recipe.name, **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
