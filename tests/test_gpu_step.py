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
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_step.py"),
            "--dry-run",
            "--xla-flags",
            "h200-141gb-8",
        ],
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
    assert last["platform"] == "cpu" and last["attention"] == "banded"  # auto on the CPU
    assert last["tokens_per_s"] > 0 and last["step_s"] > 0 and last["loss"] > 0
    assert 0 < last["mfu_olmo_core"] and 0 < last["mfu_maxtext"]
    # The machine type's XLA flags reached JAX (an unknown one would have aborted it), and MFU is
    # against that machine type's peak; no reference ratio for a model that is not the whole 7B.
    assert last["machine_type"] == "h200-141gb-8" and last["xla_flags"] == "h200-141gb-8 (12 flags)"
    assert last["ratio_to_reference"] is None and last["reference_tokens_per_s"] is None
