"""After `make demo`, the commands the README shows work bare, as typed, with no site settings: the run
root is this machine's `runs/` while no flag, environment variable or config file sets one, `monitor`
takes a run's name as `logs` and `stop` do, and every "continue with:" hint printed on the way runs as
printed.

Every command is the real command line in its own process, `olmo-ctl` on PATH as after `source
.venv/bin/activate`, in a directory of its own with an empty user config."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cli import ROOT
from helpers.waiting import wait_for

HINT = re.compile(r"continue with: (olmo-ctl [^\n]+)")


def _olmo_ctl_dir() -> str:
    here = Path(sys.executable).parent
    assert (here / "olmo-ctl").exists(), "olmo-ctl is not installed beside this Python"
    return str(here)


def test_after_make_demo_the_commands_work_bare_and_each_hint_works_as_printed(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OLMO_CTL_", "TPU_", "XLA_"))}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    env["PATH"] = _olmo_ctl_dir() + os.pathsep + env.get("PATH", "")

    def sh(cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """`cmd` as a person types it into a shell in the demo's directory."""
        return subprocess.run(
            cmd, shell=True, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout
        )

    # What `make demo` runs (Makefile: DEMO_ROOT=runs, --backend local), with more steps than the
    # smoke recipe's warmup, so that a stop lands mid-run.
    steps = ["--set train.max_steps=120", "--set checkpoint.interval=60", "--set eval.interval=60"]
    demo = subprocess.Popen(
        "olmo-ctl resume-until-done --recipe smoke --device cpu-1 --backend local --run smoke-demo "
        "--run-root runs --poll 0.2 " + " ".join(steps),
        shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        log = tmp_path / "runs" / "smoke-demo" / "logs" / "attempt-1.log"
        wait_for(
            lambda: demo.poll() is not None or (log.exists() and "step " in log.read_text()),
            120,
            "the demo's attempt 1 training",
        )
        assert demo.poll() is None, demo.communicate()
        stop = sh("olmo-ctl stop smoke-demo")
        demo_out, demo_err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert demo.returncode == 130, demo_out + demo_err
    hints = HINT.findall(stop.stdout) + HINT.findall(demo_out + demo_err)
    assert len(hints) == 2, (stop.stdout, demo_out, demo_err)  # stop's, and the stopped supervisor's
    for hint in hints:
        t0 = time.monotonic()
        p = sh(hint, timeout=180)
        assert p.returncode == 0, (hint, p.stdout[-2000:], p.stderr[-2000:])
        assert "final step 120/120 committed" in p.stdout, (hint, p.stdout[-2000:])
        assert time.monotonic() - t0 < 120

    runs = sh("olmo-ctl runs -o json")
    assert runs.returncode == 0, runs.stderr
    listed = json.loads(runs.stdout)
    assert listed["run_root"] == str(tmp_path / "runs")
    assert [(r["name"], r["step"], r["final_step"]) for r in listed["runs"]] == [("smoke-demo", 120, 120)]
    for cmd, says in [
        ("olmo-ctl monitor smoke-demo", "120 / 120"),
        ("olmo-ctl logs smoke-demo", "committed step 120"),
        ("olmo-ctl data audit smoke-demo", "ok: every step read its batch of the order"),
        ("olmo-ctl stop smoke-demo", "is complete (120/120): nothing to stop"),
    ]:
        p = sh(cmd)
        assert p.returncode == 0, (cmd, p.stdout[-2000:], p.stderr[-2000:])
        assert says in p.stdout, (cmd, p.stdout[-2000:])
    # GKE without a run root still needs one on gs:// to create a run; a site file's run root wins.
    p = sh("olmo-ctl submit --stage 1 --device tpu7x-128")
    assert p.returncode == 2 and "placeholders (run_root, image)" in p.stderr, p.stderr
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "xdg" / "olmo-ctl").mkdir(parents=True)
    (tmp_path / "xdg" / "olmo-ctl" / "config.yaml").write_text(f"run_root: {tmp_path / 'elsewhere'}\n")
    p = sh("olmo-ctl runs")
    assert p.returncode == 0 and p.stdout == f"no runs under {tmp_path / 'elsewhere'}\n", p.stdout + p.stderr


def _journal(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _created(run: Path) -> str:
    """When run.yaml says the run was created (a run made again says another time)."""
    (line,) = [ln for ln in (run / "run.yaml").read_text().splitlines() if ln.startswith("created:")]
    return line


@pytest.mark.chaos  # a whole demo under two supervisors: about 40 s (`make -n demo` deletes nothing: everyday)
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_again_after_ctrl_c_reattaches_to_its_attempt_and_deletes_nothing(tmp_path):
    """`make demo`, Ctrl-C while its trainer starts, `make demo` again: the second continues the same run
    (its run.yaml, journal and checkpoints kept), reattaches to the attempt the first left running (no
    second attempt beside it) and supervises it to the final step. The trainer's start-up is made long
    (OLMO_CTL_FAULT_SLOW_START), so the Ctrl-C lands while the attempt is live on any machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OLMO_CTL_", "TPU_", "XLA_", "MAKE"))}
    env.update(XDG_CONFIG_HOME=str(tmp_path / "xdg"), OLMO_CTL_FAULT_SLOW_START="5")
    root = tmp_path / "runs"
    run = root / "smoke-demo"
    # `-o .venv/.installed`: the demo's set-up is taken as done (never a pip install from a test).
    make = ["make", "-s", "-o", ".venv/.installed", "demo", f"DEMO_ROOT={root}"]
    first = subprocess.Popen(
        make, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(
            lambda: (
                first.poll() is not None
                or any(r["event"] == "running" for r in _journal(run / "journal.jsonl"))
            ),
            120,
            "the demo's attempt 1 running",
        )
        assert first.poll() is None, first.communicate()
        os.killpg(first.pid, signal.SIGINT)  # Ctrl-C at the terminal: make and the supervisor
        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert "detached: attempt 1 keeps running" in err, (out, err)
    created = _created(run)
    (trainer,) = [
        r["handle"]["data"]["pid"] for r in _journal(run / "journal.jsonl") if r["event"] == "submitted"
    ]
    os.kill(trainer, 0)  # still training: the Ctrl-C reached no trainer
    second = subprocess.run(make, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, (second.stdout[-3000:], second.stderr[-3000:])
    assert _created(run) == created  # the same run: never deleted nor made again
    events = [r["event"] for r in _journal(run / "journal.jsonl")]
    assert events.count("submitted") == 1 and "reattached" in events, events
    assert "final step 100/100 committed" in second.stdout, second.stdout
    assert second.stdout.startswith(f"demo: continuing {run} "), second.stdout
