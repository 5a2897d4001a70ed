"""Median whole-process wall time of `olmo-ctl --help` and of the tpu7x-128 stage-1 dry-run, and
the dry-run against XPK's `workload create --dry-run` for the same slice.

    .venv/bin/python benchmarks/cli_latency.py [--runs 15] [--xpk PATH]

Each sample is a fresh process (interpreter start-up, imports, work, exit), as a user sees it.
The target is well under 0.2 s: nothing heavy (jax, kubernetes, google-cloud-storage) may be
imported on these paths. With `--xpk` (an `xpk` executable, e.g. from `pip install xpk` in a
virtual environment of its own) the two dry-runs take turns, `--runs` pairs, and the ratio of the
medians is printed (the target: at least 4x).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 0.2
TARGET_XPK_RATIO = 4.0
XPK_DRY_RUN = [
    "workload", "create", "--cluster", "bench", "--workload", "bench", "--tpu-type", "tpu7x-128",
    "--command", "python -m olmo_ctl.trainer", "--project", "bench", "--zone", "us-central1-a", "--dry-run",
]  # fmt: skip


def command() -> list[str]:
    script = Path(sys.executable).with_name("olmo-ctl")
    if script.exists():
        return [str(script)]
    found = shutil.which("olmo-ctl")
    return [found] if found else [sys.executable, "-m", "olmo_ctl"]


def medians_in_turns(argvs: list[list[str]], runs: int, env: dict[str, str]) -> list[float]:
    """The median wall time of each command, `runs` samples each, the commands taking turns (a, b, a,
    b, ...) so a change in load hits all of them; each is run once first to warm the page cache."""
    for argv in argvs:
        subprocess.run(argv, capture_output=True, env=env, check=True)
    samples: list[list[float]] = [[] for _ in argvs]
    for _ in range(runs):
        for argv, out in zip(argvs, samples, strict=True):
            t0 = time.perf_counter()
            subprocess.run(argv, capture_output=True, env=env, check=True)
            out.append(time.perf_counter() - t0)
    return [statistics.median(s) for s in samples]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--xpk", help="an xpk executable: time its workload create --dry-run beside ours")
    args = ap.parse_args()
    base = command()
    with tempfile.TemporaryDirectory() as tmp:
        # A user's Python caches each module's bytecode on first use: so does each side here (the
        # first, warming run writes it), whatever this shell's PYTHONDONTWRITEBYTECODE says.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("OLMO_CTL_") and k != "PYTHONDONTWRITEBYTECODE"
        }
        env["XDG_CONFIG_HOME"] = tmp
        dry_run = "olmo-ctl submit --stage 1 --device tpu7x-128 --dry-run"
        cases = {
            "olmo-ctl --help": ["--help"],
            dry_run: [
                "submit",
                "--stage",
                "1",
                "--device",
                "tpu7x-128",
                "--dry-run",
                "--output-manifest",
                str(Path(tmp) / "jobset.yaml"),
            ],
        }
        worst = 0.0
        for label, extra in cases.items():
            (m,) = medians_in_turns([base + extra], args.runs, env)
            worst = max(worst, m)
            print(f"{m * 1000:7.1f} ms  median of {args.runs}  {label}")
        if args.xpk:
            ours, theirs = medians_in_turns([base + cases[dry_run], [args.xpk, *XPK_DRY_RUN]], args.runs, env)
            ratio = theirs / ours
            print(f"{theirs * 1000:7.1f} ms  median of {args.runs}  xpk {' '.join(XPK_DRY_RUN)}")
            print(f"{ours * 1000:7.1f} ms  median of {args.runs}  {dry_run} (in turns with xpk)")
            verdict = "ok" if ratio >= TARGET_XPK_RATIO else "SLOW"
            print(
                f"ratio: {ratio:.2f}x faster than xpk (target: at least {TARGET_XPK_RATIO:.0f}x) -> {verdict}"
            )
    print(f"target: under {TARGET_S * 1000:.0f} ms -> {'ok' if worst < TARGET_S else 'SLOW'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
