"""Median whole-process wall time of `olmo-ctl --help` and of the tpu7x-128 stage-1 dry-run.

    .venv/bin/python benchmarks/cli_latency.py [--runs 15]

Each sample is a fresh process (interpreter start-up, imports, work, exit), as a user sees it.
The target is well under 0.2 s: nothing heavy (jax, kubernetes, google-cloud-storage) may be
imported on these paths.
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


def command() -> list[str]:
    script = Path(sys.executable).with_name("olmo-ctl")
    if script.exists():
        return [str(script)]
    found = shutil.which("olmo-ctl")
    return [found] if found else [sys.executable, "-m", "olmo_ctl"]


def median_s(argv: list[str], runs: int, env: dict[str, str]) -> float:
    subprocess.run(argv, capture_output=True, env=env, check=True)  # warm the page cache
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, capture_output=True, env=env, check=True)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    base = command()
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
        env["XDG_CONFIG_HOME"] = tmp
        cases = {
            "olmo-ctl --help": ["--help"],
            "olmo-ctl submit --stage 1 --device tpu7x-128 --dry-run": [
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
            m = median_s(base + extra, args.runs, env)
            worst = max(worst, m)
            print(f"{m * 1000:7.1f} ms  median of {args.runs}  {label}")
    print(f"target: under {TARGET_S * 1000:.0f} ms -> {'ok' if worst < TARGET_S else 'SLOW'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
