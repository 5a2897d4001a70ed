"""The data-coverage audit: real trainers record the instances of every step, `olmo-ctl data audit`
replays the epoch order against them, and the case study's loader bug (a share strided a second time)
and a resume one batch off are caught and named."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from helpers.cli import clean_env, invoke
from helpers.trainer import train
from helpers.waiting import wait_for
from test_multihost import last_step, start, wait_ended

from olmo_ctl.backends.base import State
from olmo_ctl.core import faults
from olmo_ctl.trainer.audit import AUDIT_DIR, read_records
from olmo_ctl.trainer.data import epoch_order

GLOBAL_BATCH = 8  # the smoke recipe's
SEED = 42


def audit(run_dir: Path, tmp_path: Path) -> tuple[int, dict]:
    p = invoke("data", "audit", str(run_dir), "-o", "json", env=clean_env(tmp_path))
    return p.returncode, json.loads(p.stdout) if p.stdout.strip() else {"stderr": p.stderr}


def test_each_checkpoint_carries_the_instances_of_its_steps(tmp_path):
    run = tmp_path / "r"
    train(run, "--stop-at-step", "4", "--set", "checkpoint.interval=2")
    files = sorted(p.name for p in (run / AUDIT_DIR).iterdir())
    assert files == [
        "a0000-r000000000-p0000of0001-s000000001-000000002.npz",
        "a0000-r000000000-p0000of0001-s000000003-000000004.npz",
    ]
    (r1, r2) = sorted(read_records(str(run)), key=lambda r: int(r.steps[0]))
    n = r1.instances
    order = epoch_order(n, SEED, 1, GLOBAL_BATCH)
    assert r1.steps.tolist() == [1, 2] and r2.steps.tolist() == [3, 4]
    assert r1.batches.tolist() == [0, 1] and r1.epochs.tolist() == [1, 1]
    assert np.array_equal(np.concatenate([r1.ids, r2.ids]).reshape(-1), order[: 4 * GLOBAL_BATCH])
    rc, rep = audit(run, tmp_path)
    assert rc == 0, rep
    assert {k: rep[k] for k in ("instances", "distinct", "repeated", "skipped", "first_departure")} == {
        "instances": 32,
        "distinct": 32,
        "repeated": 0,
        "skipped": 0,
        "first_departure": None,
    }


def test_a_resume_one_batch_off_is_a_departure_with_a_skipped_batch(tmp_path):
    run = tmp_path / "r"
    train(run, "--stop-at-step", "3")
    train(run, "--stop-at-step", "5", env={faults.DATA_SHIFT.name: "1"})
    rc, rep = audit(run, tmp_path)
    assert rc == 1, rep
    assert rep["first_departure"]["step"] == 4
    assert "expected epoch 1 batch 3" in rep["first_departure"]["reason"]
    assert (rep["instances"], rep["distinct"], rep["repeated"], rep["skipped"]) == (40, 40, 0, GLOBAL_BATCH)
    p = invoke("data", "audit", str(run), env=clean_env(tmp_path))
    assert p.returncode == 1
    assert "DEPARTS at step 4: read batch [(1, 4)] of the order, expected epoch 1 batch 3" in p.stdout


@pytest.mark.chaos
def test_the_double_shard_bug_is_caught_and_its_first_repeat_named(tmp_path):
    """Two hosts, each striding its rows of the batch again (the case study's bug): the training runs
    and its loss falls, but half of every batch is read twice and half never."""
    b, h = start(tmp_path, "cpu-2x2", 100, "--stop-at-step", "4", env={faults.DOUBLE_SHARD.name: "1"})
    assert wait_ended(b, h, 300).state == State.SUCCEEDED
    rc, rep = audit(tmp_path / "mh", tmp_path)
    assert rc == 1, rep
    assert rep["first_departure"]["step"] == 1
    assert (rep["instances"], rep["distinct"], rep["repeated"], rep["skipped"]) == (32, 16, 16, 16)
    order = epoch_order(rep_instances(tmp_path / "mh"), SEED, 1, GLOBAL_BATCH)
    # host 0's rows of batch 0 are order[0:4]; strided again it reads order[0], order[2], order[0], ...
    assert rep["first_repeat"] == {
        "instance": int(order[0]),
        "epoch": 1,
        "step": 1,
        "first_read_step": 1,
    }


def rep_instances(run: Path) -> int:
    return read_records(str(run))[0].instances


@pytest.mark.chaos
def test_the_audit_holds_across_sigkills_a_resize_and_other_process_counts(tmp_path):
    """2 x 2 to step 4; 2 x 2 again, SIGKILLed on every host past step 7 (its steps after its last
    checkpoint are trained again by the next attempt); 1 x 4 to 10; 4 x 1 to 12: every step read its
    batch of the order, whichever attempt's training of it was committed."""
    from olmo_ctl.rundir import RunDir

    ckpt = ("--set", "checkpoint.interval=2")
    b, h = start(tmp_path, "cpu-2x2", 12, *ckpt, "--stop-at-step", "4", attempt=1)
    assert wait_ended(b, h, 300).state == State.SUCCEEDED
    b, h = start(tmp_path, "cpu-2x2", 12, *ckpt, attempt=2, env={faults.SLOW_DATA.name: "0:1500"})
    wait_for(lambda: last_step(h) >= 7, 300, "attempt 2 to pass step 7")
    for pid in h.data["pids"]:
        os.kill(pid, signal.SIGKILL)
    assert wait_ended(b, h, 120).state != State.SUCCEEDED
    killed_at = RunDir(str(tmp_path / "mh")).committed_step()
    assert killed_at in (6, 8), killed_at
    for n, (device, stop) in enumerate([("cpu-1x4", 10), ("cpu-4x1", 12)], 3):
        b, h = start(tmp_path, device, 12, *ckpt, "--stop-at-step", str(stop), attempt=n)
        assert wait_ended(b, h, 300).state == State.SUCCEEDED
    rc, rep = audit(tmp_path / "mh", tmp_path)
    assert rc == 0, rep
    assert (rep["instances"], rep["distinct"], rep["repeated"], rep["skipped"]) == (96, 96, 0, 0)
    launches = [(la["attempt"], la["processes"], la["first_step"], la["last_step"]) for la in rep["launches"]]
    assert launches == [(1, 2, 1, 4), (2, 2, 5, killed_at), (3, 1, killed_at + 1, 10), (4, 4, 11, 12)]
    # attempt 2 also recorded steps it trained but never committed: attempt 3's training of them counts
    recorded_by_2 = {int(s) for r in read_records(str(tmp_path / "mh")) if r.attempt == 2 for s in r.steps}
    assert max(recorded_by_2) == killed_at  # written with checkpoints only: nothing past the last one


def test_the_table_counts_one_process_in_the_singular(smoke_run, tmp_path):
    """The session's smoke run trained on cpu-1: one attempt of one process, said so."""
    p = invoke("data", "audit", str(smoke_run), env=clean_env(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "(restored step 0, 1 process): steps 1..40" in p.stdout.splitlines()[1], p.stdout
