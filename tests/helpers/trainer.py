"""The bundled trainer as a subprocess, and what its run directory's event files hold.

`train(run_dir, *args)` runs `python -m olmo_ctl.trainer --recipe smoke` on the CPU (its `--device`
decides the host device count, so an inherited XLA_FLAGS is dropped) and asserts its exit code;
`scalars(run_dir)` reads every scalar back with TensorBoard's EventAccumulator; `same_steps` lists the
steps whose loss or gradient norm differ bit for bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

TAGS = ("train/CE loss", "optim/total grad norm")


def train(
    run_dir: Path, *extra: str, device: str = "cpu-1", env: dict | None = None, expect: int | None = 0
) -> subprocess.CompletedProcess:
    """The smoke recipe's trainer on `run_dir`; asserts exit `expect` (None: any) and returns the process."""
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # --device decides the device count
    base["JAX_PLATFORMS"] = "cpu"
    cmd = [
        sys.executable,
        "-m",
        "olmo_ctl.trainer",
        "--recipe",
        "smoke",
        "--run-dir",
        str(run_dir),
        "--device",
        device,
        *extra,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**base, **(env or {})}, timeout=900)
    if expect is not None:
        assert p.returncode == expect, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def scalars(run_dir: Path) -> dict[str, dict[int, np.float32]]:
    """{tag: {step: value}}, asserting that no step of a tag was written twice."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={SCALARS: 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"{tag}: duplicate steps"
        out[tag] = {e.step: np.float32(e.value) for e in events}
    return out


def resume_copy(src: Path, step: int, dst: Path) -> Path:
    """A new run directory holding only checkpoint `step` of `src` (as if the run had stopped there)."""
    shutil.copytree(src / "checkpoints" / str(step), dst / "checkpoints" / str(step))
    return dst


def same_steps(a: dict, b: dict, steps) -> list[str]:
    """`tag step s: a != b` for every step of `steps` where the two runs' TAGS differ in any bit."""
    bad = []
    for tag in TAGS:
        for s in steps:
            if a[tag][s].tobytes() != b[tag][s].tobytes():
                bad.append(f"{tag} step {s}: {a[tag][s]!r} != {b[tag][s]!r}")
    return bad
