"""resume-until-done with the local backend: real trainer processes, real kills, real checkpoints."""

from __future__ import annotations

import glob
import io
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cli import spawn
from helpers.waiting import wait_for

from olmo_ctl.backends.base import Handle, State
from olmo_ctl.backends.local import LocalBackend, proc_start_time
from olmo_ctl.core.contracts import exit_state
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.rundir import RunDir
from olmo_ctl.supervise.policy import RetryPolicy
from olmo_ctl.supervise.supervisor import Printer, Supervisor

SMOKE = ["--set", "checkpoint.interval=5", "--set", "eval.interval=1000"]


def cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return spawn(*args, env={**os.environ, **(env or {})}, **kw)


def journal(run_dir: str) -> list[dict]:
    return RunDir(run_dir).journal()


def attempt_info(run_dir: str, n: int) -> dict | None:
    try:
        with open(os.path.join(run_dir, "attempts", f"{n}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def log_has_steps(run_dir: str, n: int) -> bool:
    try:
        return "step " in Path(run_dir, "logs", f"attempt-{n}.log").read_text()
    except OSError:
        return False


def latest_logged_step(run_dir: str, n: int) -> int:
    """The last `step N/M` line attempt n printed (0 before its first step)."""
    try:
        lines = Path(run_dir, "logs", f"attempt-{n}.log").read_text().splitlines()
    except OSError:
        return 0
    steps = [
        int(ln.split()[1].split("/")[0]) for ln in lines if ln.startswith("step ") and "/" in ln.split()[1]
    ]
    return max(steps, default=0)


def fake_python(tmp_path: Path, body: str) -> str:
    """An interpreter stand-in for trainers that misbehave in ways the real one must not be made to."""
    p = tmp_path / "python-fake"
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(0o755)
    return str(p)


def new_run(tmp_path: Path, name: str, steps: int = 20) -> RunDir:
    rd = RunDir.of(str(tmp_path), name)
    r = load_recipe("smoke", overrides=[f"train.max_steps={steps}"])
    rd.create_run(r.to_dict(), r.fingerprint(), "fp", "cpu-1")
    return rd


def supervise(rd: RunDir, backend, policy: RetryPolicy, **kw) -> tuple[int, str]:
    buf = io.StringIO()
    sup = Supervisor(
        rd,
        backend,
        policy,
        device=get_device("cpu-1"),
        poll_s=0.05,
        printer=Printer(rd.name, stream=buf),
        **kw,
    )
    return sup.run(), buf.getvalue()


# ---------------------------------------------------------------- failures and policy (fast)


def test_crash_loop_stops_after_max_retries_with_backoff_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MAX_RETRIES", "3")
    monkeypatch.setenv("RETRY_BACKOFF_SECONDS", "0.2")
    rd = new_run(tmp_path, "crash")
    be = LocalBackend(
        str(tmp_path),
        python=fake_python(tmp_path, 'echo "Fatal Python error: Segmentation fault"\nkill -SEGV $$'),
    )
    rc, out = supervise(rd, be, RetryPolicy.from_env())
    assert rc == 4
    j = rd.journal()
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1, 2, 3]
    fails = [r for r in j if r["event"] == "failed"]
    assert len(fails) == 3 and all("SIGSEGV" in r["reason"] for r in fails)
    delays = [r["delay_s"] for r in j if r["event"] == "backoff"]
    assert len(delays) == 2 and 0.15 <= delays[0] <= 0.2 and 0.3 <= delays[1] <= 0.4  # base, then doubled
    gave_up = [r for r in j if r["event"] == "gave_up"]
    assert len(gave_up) == 1 and "crash loop: 3 attempts in a row" in gave_up[0]["reason"]
    assert "Segmentation fault" in out and "gave_up" in out


def test_user_failure_stops_at_once_with_last_log_lines(tmp_path):
    rd = new_run(tmp_path, "userfail")
    be = LocalBackend(
        str(tmp_path),
        python=fake_python(
            tmp_path, 'echo "step 1/10 loss 5.0"\necho "ValueError: loss is NaN at step 2"\nexit 1'
        ),
    )
    rc, out = supervise(rd, be, RetryPolicy(backoff_base_s=0, max_retries=5))
    assert rc == 1
    assert "ValueError: loss is NaN at step 2" in out
    j = rd.journal()
    assert len([r for r in j if r["event"] == "submitted"]) == 1
    failed = [r for r in j if r["event"] == "failed"][0]
    assert failed["exit_code"] == 1 and "ValueError: loss is NaN at step 2" in failed["last_log_lines"]
    # --retry-user-errors retries it (here until the budget runs out)
    rc, _ = supervise(rd, be, RetryPolicy(backoff_base_s=0, max_retries=2, retry_user_errors=True))
    assert rc == 4


def test_stalled_attempt_is_stopped_journaled_and_resubmitted(tmp_path):
    rd = new_run(tmp_path, "stall")
    be = LocalBackend(
        str(tmp_path), python=fake_python(tmp_path, "while true; do sleep 0.2; done"), stop_grace_s=5
    )
    rc, out = supervise(rd, be, RetryPolicy(backoff_base_s=0, max_retries=2, startup_limit_s=0.5))
    assert rc == 4
    j = rd.journal()
    stalled = [r for r in j if r["event"] == "stalled"]
    assert [r["attempt"] for r in stalled] == [1, 2] and "start-up/compile" in stalled[0]["reason"]
    for n in (1, 2):  # both stopped: nothing left running
        info = attempt_info(rd.path, n)
        assert info["exit_code"] is not None and proc_start_time(info["pid"]) is None


def test_local_backend_never_mistakes_another_process_for_its_trainer(tmp_path):
    sd = str(tmp_path / "r")
    os.makedirs(os.path.join(sd, "attempts"))
    me = os.getpid()  # alive, but not a trainer of this run (as a recycled pid would be)
    with open(os.path.join(sd, "attempts", "1.json"), "w") as f:
        json.dump(
            {
                "pid": me,
                "start_time": proc_start_time(me),
                "host": socket.gethostname(),
                "run_dir": sd,
                "exit_code": None,
                "log": os.path.join(sd, "logs", "attempt-1.log"),
            },
            f,
        )
    be = LocalBackend(str(tmp_path))
    assert be.find_live("r") is None
    h = Handle("local", str(me), 1, {"pid": me, "state_dir": sd, "run_dir": sd})
    assert be.status(h).state == State.FAILED_INFRA
    be.stop(h)  # must not signal us
    assert [exit_state(c)[0] for c in (0, 143, -15, 137, -9, 1, 2, 3, -11)] == [
        State.SUCCEEDED,
        State.PREEMPTED,
        State.PREEMPTED,
        State.PREEMPTED,
        State.PREEMPTED,
        State.FAILED_USER,
        State.FAILED_USER,
        State.FAILED_INFRA,
        State.FAILED_INFRA,
    ]


def test_output_is_one_timestamped_line_per_change_with_a_bar_on_a_tty_and_progress_lines_elsewhere():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        p = Printer("r1", stream=stream, clock=lambda: 1_800_000_000.0)
        p.line("running (attempt 1): pid 7")
        p.progress(40, 100, 125.0)
        p.line("preempted (attempt 1): exit -9 (SIGKILL)")
    assert pipe.getvalue() == (
        "2027-01-15T08:00:00Z r1: running (attempt 1): pid 7\n"
        "2027-01-15T08:00:00Z r1: step 40/100 (40.0%), ETA 2m05s\n"
        "2027-01-15T08:00:00Z r1: preempted (attempt 1): exit -9 (SIGKILL)\n"
    )
    bar = tty.getvalue().split("\n")[1]
    assert "step 40/100 ETA 2m05s" in bar and bar.startswith("\r\x1b[K[############")
    assert bar.endswith("\r\x1b[K2027-01-15T08:00:00Z r1: preempted (attempt 1): exit -9 (SIGKILL)")


def test_off_a_terminal_progress_is_a_line_at_most_every_interval_and_only_when_the_step_moved():
    now = [1_800_000_000.0]
    pipe = io.StringIO()
    p = Printer("r1", stream=pipe, clock=lambda: now[0], progress_every_s=60.0)
    for t, step in ((0, 10), (30, 20), (70, 10), (71, 30), (100, 40), (131, 50)):
        now[0] = 1_800_000_000.0 + t
        p.progress(step, 100, None)
    assert pipe.getvalue().splitlines() == [
        "2027-01-15T08:00:00Z r1: step 10/100 (10.0%), ETA ?",  # the first step seen
        # 30 s: too soon; 70 s: the step is the one last printed
        "2027-01-15T08:01:11Z r1: step 30/100 (30.0%), ETA ?",
        # 100 s: too soon after 71 s
        "2027-01-15T08:02:11Z r1: step 50/100 (50.0%), ETA ?",
    ]


def test_off_a_terminal_progress_comes_every_ten_seconds_then_once_a_minute_after_ten_minutes():
    """By default (a pipe: `make demo > log`, CI, `nohup`), a short run's steps are seen as they go: a
    line at most every 10 s while the step moves, for the first 10 minutes; then at most once a minute,
    so a days-long run's log stays readable."""
    now = [1_800_000_000.0]
    pipe = io.StringIO()
    p = Printer("r1", stream=pipe, clock=lambda: now[0])
    for t, step in ((0, 0), (5, 5), (10, 20), (20, 20), (25, 30), (601, 400), (631, 420), (662, 450)):
        now[0] = 1_800_000_000.0 + t
        p.progress(step, 1000, None)
    assert [ln.split(": ", 1)[1] for ln in pipe.getvalue().splitlines()] == [
        "step 0/1000 (0.0%), ETA ?",
        # 5 s: too soon
        "step 20/1000 (2.0%), ETA ?",
        # 20 s: the step is the one last printed
        "step 30/1000 (3.0%), ETA ?",
        "step 400/1000 (40.0%), ETA ?",  # past 10 minutes: once a minute from here
        # 631 s: too soon after 601 s
        "step 450/1000 (45.0%), ETA ?",
    ]


# ---------------------------------------------------------------- the real trainer


@pytest.mark.chaos
def test_reattach_after_supervisor_kill_and_second_supervisor_refused(tmp_path):
    root = str(tmp_path / "runs")
    rdir = os.path.join(root, "reattach")
    args = [
        "resume-until-done",
        "--recipe",
        "smoke",
        "--device",
        "cpu-1",
        "--backend",
        "local",
        "--run",
        "reattach",
        "--run-root",
        root,
        "--poll",
        "0.2",
        "--set",
        "train.max_steps=80",
        *SMOKE,
    ]
    a = cli(*args)
    wait_for(lambda: log_has_steps(rdir, 1), 120, "attempt 1 training")
    b = cli("resume-until-done", "reattach", "--run-root", root, "--backend", "local")
    _, err = b.communicate(timeout=60)
    assert b.returncode == 2 and "supervised by" in err and f"pid {a.pid}" in err
    a.kill()  # the supervisor dies; its trainer (another session) must not
    a.wait()
    pid = attempt_info(rdir, 1)["pid"]
    assert proc_start_time(pid) is not None
    c = cli("resume-until-done", "reattach", "--run-root", root, "--backend", "local", "--poll", "0.2")
    out, err = c.communicate(timeout=240)
    assert c.returncode == 0, out + err
    j = journal(rdir)
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]  # never a second submission
    assert any(r["event"] == "reattached" and r["attempt"] == 1 for r in j)
    assert j[-1]["event"] == "done" and j[-1]["committed_step"] == 80
    assert "done" in out and "80/80" in out


def test_ctrl_c_detaches_then_stop_on_exit_stops(tmp_path):
    root = str(tmp_path / "runs")
    rdir = os.path.join(root, "detach")
    a = cli(
        "resume-until-done",
        "--recipe",
        "smoke",
        "--device",
        "cpu-1",
        "--backend",
        "local",
        "--run",
        "detach",
        "--run-root",
        root,
        "--poll",
        "0.2",
        "--set",
        "train.max_steps=20000",  # never reached: the test stops it
        *SMOKE,
    )
    wait_for(lambda: log_has_steps(rdir, 1), 120, "attempt 1 training")
    a.send_signal(signal.SIGINT)
    out, err = a.communicate(timeout=60)
    # Ctrl-C is one line on stderr (core.errors.Interrupted), the attempt named and how to reattach.
    last = err.strip().splitlines()[-1]
    assert a.returncode == 130 and last.startswith("interrupted: detached: attempt 1 keeps running"), err
    assert "resume-until-done detach" in last and "detached" not in out
    pid = attempt_info(rdir, 1)["pid"]
    assert proc_start_time(pid) is not None  # the attempt keeps running
    b = cli(
        "resume-until-done",
        "detach",
        "--run-root",
        root,
        "--backend",
        "local",
        "--poll",
        "0.2",
        "--stop-on-exit",
    )
    wait_for(lambda: any(r["event"] == "reattached" for r in journal(rdir)), 60, "reattach")
    b.send_signal(signal.SIGINT)
    out, err = b.communicate(timeout=120)
    assert b.returncode == 130 and "stopping attempt 1" in out
    assert err.strip().splitlines()[-1].startswith("interrupted: attempt 1 stopped (--stop-on-exit)"), err
    assert proc_start_time(pid) is None
    j = journal(rdir)
    assert [r["event"] for r in j].count("submitted") == 1
    assert j[-1]["event"] == "stopped"
    # the trainer journals its own end, stopped by SIGTERM after its checkpoint
    (exited,) = [r for r in j if r["event"] == "exited"]
    assert (exited["attempt"], exited["exit_code"], exited["reason"]) == (1, 143, "exit 143 (SIGTERM)")


@pytest.mark.chaos
def test_submit_returns_once_submitted_and_never_doubles_a_live_attempt(tmp_path):
    root = str(tmp_path / "runs")
    rdir = os.path.join(root, "sub")
    args = [
        "submit",
        "--recipe",
        "smoke",
        "--device",
        "cpu-1",
        "--backend",
        "local",
        "--run",
        "sub",
        "--run-root",
        root,
        "--set",
        "train.max_steps=20",
        *SMOKE,
    ]
    # Its steps are slowed (1 s each, its 20 steps outlast the three submits below): the attempt is
    # still live when they come, whatever the machine's speed.
    first = cli(*args, env={"OLMO_CTL_FAULT_SLOW_DATA": "0:1000"})
    out, err = first.communicate(timeout=60)
    assert f"run directory: {rdir}" in out and f"resume-until-done sub --run-root {root}" in out, out + err
    again = cli(*args)
    _, err = again.communicate(timeout=60)
    assert again.returncode == 2 and "attempt 1 of run `sub` is still running" in err
    other = cli(*[a if a != "train.max_steps=20" else "train.max_steps=30" for a in args])
    _, err = other.communicate(timeout=60)
    assert other.returncode == 2 and "another recipe" in err
    # Evaluation settings are not what the run trains: past the recipe check, to the live attempt.
    evals = cli(*args, "--set", "eval.interval=7")
    _, err = evals.communicate(timeout=60)
    assert evals.returncode == 2 and "attempt 1 of run `sub` is still running" in err, err
    sup = cli("resume-until-done", "sub", "--run-root", root, "--backend", "local", "--poll", "0.2")
    out, err = sup.communicate(timeout=240)
    assert sup.returncode == 0, out + err
    j = journal(rdir)
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]
    assert j[-1]["event"] == "done" and j[-1]["committed_step"] == 20


@pytest.mark.gcs
@pytest.mark.chaos
def test_gs_run_dir_resumes_from_orbax_commit_markers(tmp_path, gcs):
    bucket = gcs.bucket
    root = f"gs://{bucket}/runs"
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    sup = cli(
        "resume-until-done",
        "--recipe",
        "smoke",
        "--device",
        "cpu-1",
        "--backend",
        "local",
        "--run",
        "g1",
        "--run-root",
        root,
        "--poll",
        "0.2",
        "--set",
        "train.max_steps=24",
        *SMOKE,
        env={**env, "RETRY_BACKOFF_SECONDS": "0"},
    )
    rd = RunDir(f"{root}/g1")
    state = str(tmp_path / "state" / "olmo-ctl" / "local" / "g1")
    wait_for(lambda: rd.committed_step() >= 5, 180, "a committed checkpoint on gs://", every=0.2)
    info = attempt_info(state, 1)
    os.kill(info["pid"], signal.SIGKILL)
    out, err = sup.communicate(timeout=240)
    assert sup.returncode == 0, out + err
    assert rd.committed_steps() == [5, 10, 15, 20, 24]
    restored = Path(state, "logs", "attempt-2.log").read_text()
    first = int(restored.split("restored checkpoint ")[1].split()[0])
    assert first >= 5 and first % 5 == 0
    j = rd.journal()
    assert [r["event"] for r in j if r.get("attempt") == 1][-1] == "preempted"
    assert j[-1]["event"] == "done" and j[-1]["committed_step"] == 24


# ---------------------------------------------------------------- chaos


def read_losses(logdir: str) -> dict[int, list[int]]:
    """Every `train/CE loss` record of every event file: step -> float32 bit patterns, in file order."""
    from tensorboard.compat.proto import event_pb2

    out: dict[int, list[int]] = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        data = Path(path).read_bytes()
        i = 0
        while i + 12 <= len(data):
            (n,) = struct.unpack_from("<Q", data, i)
            if i + 12 + n + 4 > len(data):
                break
            ev = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            for v in ev.summary.value:
                if v.tag == "train/CE loss":
                    out.setdefault(ev.step, []).append(
                        struct.unpack("<I", struct.pack("<f", v.simple_value))[0]
                    )
    return out


@pytest.mark.chaos
def test_chaos_kills_and_bitwise_identical_losses(tmp_path):
    steps = 70
    sets = ["--set", f"train.max_steps={steps}", *SMOKE]
    root = str(tmp_path / "runs")
    # The reference: one uninterrupted trainer.
    ref_dir = os.path.join(root, "reference")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "olmo_ctl.trainer",
            "--recipe",
            "smoke",
            "--run-dir",
            ref_dir,
            "--device",
            "cpu-1",
            "--attempt",
            "1",
            *sets,
        ],
        check=True,
        capture_output=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    ref = read_losses(os.path.join(ref_dir, "tensorboard"))
    assert sorted(ref) == list(range(1, steps + 1))

    rdir = os.path.join(root, "chaos")
    sup = cli(
        "resume-until-done",
        "--recipe",
        "smoke",
        "--device",
        "cpu-1",
        "--backend",
        "local",
        "--run",
        "chaos",
        "--run-root",
        root,
        "--poll",
        "0.1",
        *sets,
        env={"RETRY_BACKOFF_SECONDS": "0.2", "MAX_RETRIES": "30"},
    )
    rng = random.Random(20261130)
    plan = ["checkpoint" if i % 3 == 0 else "random" for i in range(10)] + ["term"]
    rng.shuffle(plan)
    kills: list[tuple[int, str]] = []  # (attempt, how)
    ckpt_dir = os.path.join(rdir, "checkpoints")
    for how in plan:
        n = len(kills) + 1
        info = wait_for(lambda: attempt_info(rdir, n), 120, f"attempt {n}")  # noqa: B023
        if how == "checkpoint":  # while Orbax writes a step: a tmp directory exists

            def writing(
                info=info,
            ):  # a tmp directory this attempt made (a killed one may leave its own behind)
                found = []
                for d in glob.glob(os.path.join(ckpt_dir, "*.orbax-checkpoint-tmp*")):
                    try:  # Orbax renames it on commit, possibly between the glob and the stat
                        if os.stat(d).st_ctime >= info["started"]:
                            found.append(d)
                    except FileNotFoundError:
                        continue
                return found or None

            try:
                wait_for(writing, 60, "a checkpoint write", every=0.005)
            except AssertionError:
                break
        elif how == "random":
            # A random moment, but never so late that this attempt could finish the run (a fast
            # machine trains the smoke model to the end within seconds).
            deadline = time.time() + rng.uniform(0.5, 7.0)
            while time.time() < deadline and latest_logged_step(rdir, n) < steps - 15:
                time.sleep(0.02)
        else:
            wait_for(lambda: log_has_steps(rdir, n), 60, "steps")  # noqa: B023
        if sup.poll() is not None or proc_start_time(info["pid"]) != info["start_time"]:
            break  # the run finished (or the attempt ended) before this kill
        os.kill(info["pid"], signal.SIGTERM if how == "term" else signal.SIGKILL)
        kills.append((n, how))
    out, err = sup.communicate(timeout=300)
    assert sup.returncode == 0, out[-3000:] + err[-3000:]
    assert len(kills) == 11, f"the run finished after only {kills}"
    assert sum(h == "checkpoint" for _, h in kills) >= 3

    j = journal(rdir)
    ended = {r["attempt"]: r for r in j if r["event"] in ("preempted", "failed")}
    for n, how in kills:  # the journal lists each kill
        assert n in ended, (n, how)
        assert ("SIGTERM" if how == "term" else "SIGKILL") in ended[n]["reason"]
    assert j[-1]["event"] == "done" and j[-1]["committed_step"] == steps
    delays = [r["delay_s"] for r in j if r["event"] == "backoff"]
    assert len(delays) == len(kills) and 0.15 <= delays[0] <= 0.2  # RETRY_BACKOFF_SECONDS through the CLI

    # No attempt started from a partial checkpoint: every restore names a committed step.
    committed = set(RunDir(rdir).committed_steps())
    for log in glob.glob(os.path.join(rdir, "logs", "attempt-*.log")):
        for line in Path(log).read_text().splitlines():
            if line.startswith("restored checkpoint "):
                step = int(line.split()[2])
                assert step in committed, (log, line)

    # Per-step loss equals the uninterrupted run's, bit for bit, including steps replayed after a kill.
    got = read_losses(os.path.join(rdir, "tensorboard"))
    assert sorted(got) == list(range(1, steps + 1))
    for step, vals in got.items():
        assert set(vals) == {ref[step][0]}, (step, vals, ref[step])


def test_a_trainer_started_without_its_attempt_file_is_found_and_adopted(tmp_path):
    """A supervisor killed between starting a trainer and recording it: the next one finds the
    trainer by its command line instead of starting a second one."""
    from helpers.attempts import attempt

    root = str(tmp_path / "runs")
    backend = LocalBackend(root)
    run_dir = os.path.join(root, "orphan")
    req = backend.render(attempt("orphan", run_dir, 3, "cpu-1", recipe_path="smoke"))
    os.makedirs(os.path.dirname(req.log_path), exist_ok=True)
    with open(req.log_path, "ab") as log:  # what submit does, minus the attempt file
        proc = subprocess.Popen(
            list(req.argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **req.env},
        )
    try:
        wait_for(
            lambda: "olmo_ctl.trainer" in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(), 30, "exec"
        )
        h = backend.find_live("orphan")
        assert h is not None and h.attempt == 3 and int(h.data["pid"]) == proc.pid
        assert attempt_info(run_dir, 3)["adopted"] is True
        assert backend.status(h).state == State.RUNNING
        backend.stop(h, graceful=False)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert backend.find_live("orphan") is None
