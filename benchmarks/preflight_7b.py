"""Compile the full 32-layer OLMo 3 7B stage-1 step for tpu7x-128 and v5p-256 and print the table.

Each compile takes one to a few minutes of CPU; results are cached (see `olmo_ctl.preflight.compile`), so a
second run prints the table at once. `--no-cache` recompiles everything.

    python benchmarks/preflight_7b.py [--no-cache] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from olmo_ctl.core.devices import GIB, get_device
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.preflight.compile import run_preflight

CASES = (
    # (device, remat, head_dim, per-device micro-batch, global batch override); the per-device share
    # of the global batch is 4, so micro-batch 2 runs 2 accumulation steps.
    ("tpu7x-128", "full", 128, 4, None),
    ("v5p-256", "full", 128, 4, None),
    ("tpu7x-128", "save_proj", 128, 4, None),
    ("v5p-256", "save_proj", 128, 4, None),
    ("tpu7x-128", "full", 128, 2, None),
    ("tpu7x-128", "full", 256, 2, None),
    ("v5p-256", "full", 128, 2, None),
    ("tpu7x-128", "none", 128, 4, None),
    ("tpu7x-128", "none", 128, 16, 2048),  # a large per-device batch without remat: must not fit
    ("tpu7x-128", "full", 256, 4, None),
    ("tpu7x-128", "save_proj", 128, 1, None),
    ("v5p-256", "none", 128, 4, None),
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-cache", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="run only cases whose device matches")
    args = ap.parse_args()
    base = load_recipe(stage=1)
    rows = []
    head = (
        "| device | remat | head dim | batch/dev x accum | args GiB | temps GiB | peak GiB | HBM GiB | fits |"
        " XLA TFLOP/step | formula TFLOP/step | XLA/formula | compile s |"
    )
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for dev_name, remat, hd, batch, gb in CASES:
        if args.only and args.only not in dev_name:
            continue
        recipe = base
        if gb:
            recipe = dataclasses.replace(base, train=dataclasses.replace(base.train, global_batch=gb))
        r = run_preflight(
            recipe,
            get_device(dev_name),
            remat=remat,
            head_dim=hd,
            per_device_batch=batch,
            use_cache=not args.no_cache,
        )
        rows.append(r.to_dict())
        xla = f"{r.xla_flops_per_step / 1e12:,.0f}" if r.xla_flops_per_step else "-"
        ratio = f"{r.xla_vs_formula:.3f}" if r.xla_vs_formula else "-"
        fits = "yes" if r.fits else f"no ({r.shortfall_gib:.1f} GiB over)"
        print(
            f"| {dev_name} | {remat} | {hd} | {r.per_device_batch} x {r.grad_accum} |"
            f" {r.argument_bytes_per_device / GIB:.2f} | {r.temp_bytes_per_device / GIB:.2f} |"
            f" {r.peak_gib:.2f} | {r.hbm_bytes_per_device / GIB:.0f} | {fits} | {xla} |"
            f" {r.formula_flops_per_step / 1e12:,.0f} | {ratio} | {r.compile_s:.0f}{' (cached)' if r.cached else ''} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
