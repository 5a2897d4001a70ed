"""benchmarks/gpu_step.py: its --dry-run builds, compiles and runs the trainer's own step on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_compiles_the_trainers_step_and_prints_json():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_step.py"), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    last = rows[-1]
    assert last["summary"] and last["fits"] and last["dry_run"]
    for key in (
        "tokens_per_s",
        "mfu_olmo_core",
        "mfu_maxtext",
        "step_s",
        "peak_memory_gib",
        "n_layers",
        "seq_len",
    ):
        assert key in last
    assert last["platform"] == "cpu" and last["attention"] == "blocked"  # auto on the CPU
    assert last["tokens_per_s"] > 0 and last["step_s"] > 0 and last["loss"] > 0
    assert 0 < last["mfu_olmo_core"] and 0 < last["mfu_maxtext"]
