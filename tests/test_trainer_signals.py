"""SIGTERM mid-run: the trainer finishes the step, checkpoints it, exits 143; the next attempt resumes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from helpers.trainer import scalars, train

from olmo_ctl.observe.monitor import _timeline, timeline_summary
from olmo_ctl.rundir import RunDir
from olmo_ctl.supervise.supervisor import Supervisor


def _sigterm_at(cmd: list[str], env: dict, prefix: str) -> tuple[int, str]:
    """Run the trainer `cmd`, SIGTERM it once it prints a line starting with `prefix`; (exit code,
    its whole output)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    deadline = time.monotonic() + 300
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(prefix):
                proc.send_signal(signal.SIGTERM)
                break
            assert time.monotonic() < deadline, "".join(lines)
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "".join(lines) + rest


def test_sigterm_checkpoints_the_completed_step_and_next_attempt_resumes(tmp_path):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [
        sys.executable,
        "-m",
        "olmo_ctl.trainer",
        "--recipe",
        "smoke",
        "--run-dir",
        str(run),
        "--device",
        "cpu-1",
        "--attempt",
        "1",
        "--set",
        "checkpoint.interval=1000",
        "--set",
        "logging.metrics_every=1",
    ]
    code, out = _sigterm_at(cmd, env, "step 7/")
    assert code == 143, out[-3000:]
    m = re.search(r"committed step (\d+)", out)
    assert m, out[-3000:]
    n = int(m.group(1))
    assert 7 <= n < 100
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [n]  # committed, no tmp left
    steps = sorted(scalars(run)["train/CE loss"])
    assert steps == list(range(1, n + 1))  # every completed step was logged before the exit

    p = train(run, "--attempt", "2", "--stop-at-step", str(n + 3))
    assert f"restored checkpoint {n}" in p.stdout
    assert f"committed step {n + 3}" in p.stdout
    assert sorted(scalars(run)["train/CE loss"]) == list(range(1, n + 4))
    names = sorted(os.listdir(run / "tensorboard"))
    assert all(
        re.fullmatch(r"events\.out\.tfevents\.\d{10}\.[A-Za-z0-9_-]+\.a000[12]\.s\d{5}", x) for x in names
    ), names
    assert {x.split(".")[-2] for x in names} == {"a0001", "a0002"}


@pytest.mark.chaos
def test_non_finite_loss_exits_1_and_never_checkpoints_it(tmp_path):
    run = tmp_path / "run"
    p = train(
        run,
        "--stop-at-step",
        "30",
        "--set",
        "optimizer.lr=1e6",
        "--set",
        "schedule.warmup_steps=0",
        "--set",
        "checkpoint.interval=2",
        expect=1,
    )
    assert "loss is not finite at step" in p.stderr and "Traceback" not in p.stderr
    assert not list((run / "checkpoints").glob("[0-9]*"))
    ce = scalars(run)["train/CE loss"]  # the finite steps before it were logged, once
    assert sorted(ce) == list(range(1, len(ce) + 1)) and len(ce) >= 1


def test_sigkill_replays_from_the_last_checkpoint_and_readers_see_each_step_once(tmp_path):
    """A SIGKILL after steps past the last checkpoint were logged: the next attempt replays them (same
    values, bit for bit) and TensorBoard's reader keeps one value per step, the replayed one."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    run = tmp_path / "run"
    sets = [
        "--set",
        "checkpoint.interval=1000",
        "--set",
        "logging.metrics_every=1",
        "--set",
        "logging.upload_every_s=0",
    ]
    train(run, "--attempt", "1", "--stop-at-step", "5", *sets)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [
        sys.executable,
        "-m",
        "olmo_ctl.trainer",
        "--recipe",
        "smoke",
        "--run-dir",
        str(run),
        "--device",
        "cpu-1",
        "--attempt",
        "2",
        *sets,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        for line in proc.stdout:
            if line.startswith("step 8/"):
                time.sleep(0.5)  # let the upload of step 8 land
                proc.kill()
                break
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [5]
    first = scalars(run)["train/CE loss"]
    last = max(first)
    assert last >= 8  # steps past checkpoint 5 were logged before the kill

    p = train(run, "--attempt", "3", "--stop-at-step", str(last + 2), *sets)
    assert "restored checkpoint 5" in p.stdout
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={SCALARS: 0})
    acc.Reload()
    events = acc.Scalars("train/CE loss")
    assert [e.step for e in events] == list(range(1, last + 3))
    replayed = {e.step: e.value for e in events}
    for s in range(6, last + 1):
        assert replayed[s] == first[s]  # the replay is the same computation


def test_a_stop_with_too_little_time_for_its_write_writes_none_and_the_previous_checkpoint_stands(tmp_path):
    """A stop budget (the pod's grace period, a spot VM's notice: OLMO_CTL_STOP_BUDGET_S) shorter than
    the attempt's measured checkpoint write: on SIGTERM the trainer starts no write (one cut off by the
    kill is lost anyway), says so and exits 143; checkpoint 5 stands and the next attempt resumes
    from it."""
    run = tmp_path / "run"
    RunDir(str(run)).append(
        "submitted", attempt=1, device="cpu-1"
    )  # an olmo-ctl attempt: it journals its exit
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", OLMO_CTL_STOP_BUDGET_S="0.001")
    cmd = [sys.executable, "-m", "olmo_ctl.trainer", "--recipe", "smoke", "--run-dir", str(run)]
    cmd += ["--device", "cpu-1", "--attempt", "1", "--set", "checkpoint.interval=5"]
    cmd += ["--set", "logging.metrics_every=1"]
    code, out = _sigterm_at(cmd, env, "step 8/")
    assert code == 143, out[-3000:]
    m = re.search(r"stop: step (\d+) not checkpointed: a checkpoint write took ([0-9.]+) s", out)
    assert m and int(m.group(1)) >= 8, out[-3000:]
    assert "the run resumes from checkpoint 5" in out and out.rstrip().endswith("committed step 5"), out[
        -3000:
    ]
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [5]  # no partial write left
    # The journal says which happened; monitor's timeline and the supervisor's next submit say it too.
    exited = [r for r in RunDir(str(run)).journal() if r["event"] == "exited"]
    assert len(exited) == 1 and exited[0]["exit_code"] == 143, exited
    unsaved = exited[0]["stop_unsaved"]
    assert unsaved["step"] == int(m.group(1)) and unsaved["committed_step"] == 5, unsaved
    assert unsaved["write_s"] > unsaved["left_s"] and unsaved["budget_s"] == 0.001, unsaved
    note = f"step {unsaved['step']} not checkpointed (a write takes"
    assert note in exited[0]["reason"] and exited[0]["reason"].endswith("resumes from 5"), exited
    summary = timeline_summary(_timeline(RunDir(str(run)).journal()))
    assert any(note in line for line in summary), summary
    assert note in Supervisor._stop_note(SimpleNamespace(rd=RunDir(str(run))))
    p = train(run, "--attempt", "2", "--stop-at-step", "7", "--set", "checkpoint.interval=5")
    assert "restored checkpoint 5" in p.stdout, p.stdout[-3000:]
