"""The session's trained smoke run (the `smoke_run` fixture of tests/conftest.py), and copies of it.

The fixture trains once per test session what many tests only read: the smoke recipe, 40 steps on
`cpu-1` without a stop (checkpoints 20 and 40, eval at 20 and 40, every step's events, no run.yaml:
the trainer was given `--recipe smoke`; its output is kept in `trainer_log(run)`). A test reads `smoke_run` directly and never writes there;
a test that changes a run (resumes it, writes into it, hands it to a command that might) works on
`copy_run(smoke_run, tmp_path / "name")`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

STEPS = 40  # what the session run trained; its checkpoints: CHECKPOINTS
CHECKPOINTS = (20, 40)


def trainer_log(run_dir: Path) -> Path:
    """Where `train_smoke_run` keeps the trainer's output: beside the run directory, not in it."""
    return run_dir.with_name(run_dir.name + ".log")


def train_smoke_run(run_dir: Path) -> Path:
    from helpers.trainer import train

    p = train(run_dir, "--stop-at-step", str(STEPS))
    trainer_log(run_dir).write_text(p.stdout)
    assert f"committed step {STEPS}" in p.stdout, p.stdout[-2000:]
    assert sorted(int(c.name) for c in (run_dir / "checkpoints").iterdir()) == list(CHECKPOINTS)
    return run_dir


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of the run directory `src` at `dst` (which must not exist), to change freely."""
    shutil.copytree(src, dst)
    return dst
