"""Fenced submission: a supervisor paused past its lease's expiry (SIGSTOP: a laptop lid, a long retry)
can neither create an attempt nor journal once a successor took the run over.

Real supervisors (`olmo-ctl resume-until-done` processes) and real trainers on the local backend,
stopped and continued with real signals.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.waiting import kill_stopped_or_running, wait_for

from olmo_ctl.backends.local import LocalBackend
from olmo_ctl.rundir import RunDir

STEPS = 30


def supervisor(root: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "olmo_ctl",
            "resume-until-done",
            "--recipe",
            "smoke",
            "--device",
            "cpu-1",
            "--backend",
            "local",
            "--run",
            "fenced",
            "--run-root",
            root,
            "--poll",
            "0.2",
            "--lease-ttl",
            "2",
            "--set",
            f"train.max_steps={STEPS}",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def state_of(pid: int) -> str:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return data[data.rfind(")") + 2 :].split()[0]


def holds_a_lock(pid: int) -> bool:
    return any(
        ln.split()[4:5] == [str(pid)] for ln in Path("/proc/locks").read_text().splitlines() if "->" not in ln
    )


def stop_between_writes(pid: int) -> None:
    """SIGSTOP `pid` at a moment it holds no file lock (not inside a lease write): a process stopped
    inside one keeps its successor from writing at all (safe, but not the case under test)."""
    for _ in range(200):
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: state_of(pid) == "T", 10, "the stop")
        if not holds_a_lock(pid):
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.013)
    raise AssertionError("could not stop the supervisor outside its lease writes")


def live_attempts(root: str) -> list[int]:
    return sorted(h.attempt for h in LocalBackend(root).live_attempts("fenced"))


@pytest.mark.chaos
def test_a_supervisor_paused_before_its_create_creates_nothing_after_a_takeover(tmp_path):
    """A reserves attempt 1 under its lease, checks the lease one last time and is stopped (SIGSTOP)
    just before it creates the attempt. Past the lease's TTL, B takes the run over: attempt 1 was
    reserved, so B's attempt is 2. A continues (SIGCONT) and creates attempt 1, but may not journal it:
    it removes what it made and exits. B finishes the run; the journal knows only attempt 2."""
    root = str(tmp_path / "runs")
    a = supervisor(root, env={"OLMO_CTL_FAULT_PAUSE_BEFORE_CREATE": "1"})
    b = None
    try:
        wait_for(lambda: state_of(a.pid) == "T", 120, "A to stop itself before the create")
        time.sleep(2.5)  # past the lease's TTL on every clock
        b = supervisor(root)
        rd = RunDir.of(root, "fenced")
        wait_for(lambda: any(r["event"] == "submitted" for r in rd.journal()), 120, "B's first attempt")
        os.kill(a.pid, signal.SIGCONT)
        a_out, a_err = a.communicate(timeout=120)
        assert a.returncode != 0, a_out + a_err
        assert "lease" in (a_out + a_err).lower()
        # From here on one live attempt at most: A removed its own creation (or B stopped it as a stray).
        wait_for(lambda: live_attempts(root) in ([2], []), 60, "attempt 1 to be gone")
        b_out, b_err = b.communicate(timeout=600)
        assert b.returncode == 0, b_out[-3000:] + b_err[-3000:]
    finally:
        kill_stopped_or_running(a, b)
    j = RunDir.of(root, "fenced").journal()
    submitted = [r["attempt"] for r in j if r["event"] == "submitted"]
    assert submitted == [2], submitted
    assert j[-1]["event"] == "done" and j[-1]["committed_step"] == STEPS
    assert live_attempts(root) == []


@pytest.mark.chaos
def test_a_supervisor_paused_while_watching_leaves_the_run_to_its_successor(tmp_path):
    """A is stopped while its attempt trains; B takes over and reattaches to the same attempt; A,
    continued, loses its lease at its next heartbeat and exits without journaling or touching it."""
    root = str(tmp_path / "runs")
    # Steps slowed to 0.5 s, so that attempt 1 still trains when B comes (a trainer that loads its
    # compiled step from the compilation cache would otherwise finish its 30 steps first).
    a = supervisor(root, env={"OLMO_CTL_FAULT_SLOW_DATA": "0:500"})
    b = None
    rd = RunDir.of(root, "fenced")
    try:
        # Attempt 1 created and journaled (stopped between the two, A would rightly undo its create
        # when it wakes up without the lease, and B would go on with attempt 2).
        wait_for(
            lambda: live_attempts(root) == [1] and any(r["event"] == "running" for r in rd.journal()),
            120,
            "attempt 1 running",
        )
        stop_between_writes(a.pid)
        time.sleep(2.5)
        b = supervisor(root)
        wait_for(lambda: any(r["event"] == "reattached" for r in rd.journal()), 120, "B to reattach")
        n_lines = len(rd.journal())
        os.kill(a.pid, signal.SIGCONT)
        a_out, a_err = a.communicate(timeout=60)
        assert a.returncode != 0 and "lease" in (a_out + a_err).lower(), a_out + a_err
        assert live_attempts(root) in ([1], [])  # untouched by A
        b_out, b_err = b.communicate(timeout=600)
        assert b.returncode == 0, b_out[-3000:] + b_err[-3000:]
    finally:
        kill_stopped_or_running(a, b)
    j = rd.journal()
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]
    holders = {r["reason"].rsplit("holder ", 1)[-1] for r in j if r["event"] == "supervisor_started"}
    assert len(holders) == 2
    assert j[-1]["event"] == "done" and len(j) >= n_lines


def test_the_lease_holder_stops_a_stray_attempt(tmp_path):
    """The backstop: an attempt of the run that is live but not the supervisor's (one a supervisor that
    lost the lease created and never removed) is killed and journaled `stray_stopped`."""
    from helpers.attempts import attempt

    root = str(tmp_path / "runs")
    sup = supervisor(root, "--set", "train.max_steps=400")
    rd = RunDir.of(root, "fenced")
    try:
        wait_for(lambda: live_attempts(root) == [1], 120, "attempt 1")
        backend = LocalBackend(root)
        stray = backend.send(
            backend.render(
                attempt(
                    "fenced",
                    rd.path,
                    7,
                    "cpu-1",
                    recipe_path="smoke",
                    extra_args=("--set", "train.max_steps=400"),
                )
            )
        )
        wait_for(
            lambda: any(r["event"] == "stray_stopped" for r in rd.journal()), 60, "the stray to be stopped"
        )
        wait_for(lambda: live_attempts(root) == [1], 30, "the stray to be gone")
        # Its parent (this process) reads the exit code once the kill has landed and the child is reaped.
        code = wait_for(lambda: backend.status(stray).exit_code, 30, "the stray's exit code")
        assert code in (-9, 137)
        assert [r["attempt"] for r in rd.journal() if r["event"] == "stray_stopped"] == [7]
    finally:
        sup.kill()
        for h in LocalBackend(root).live_attempts("fenced"):
            LocalBackend(root).stop(h, graceful=False)
