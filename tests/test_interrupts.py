"""Ctrl-C is the same for every command that runs until it is stopped: one line on stderr
(`interrupted: ...`, saying what was left and how to go on), exit 130, nothing half-written.
resume-until-done's detach from a training attempt is tests/test_supervisor_local.py's; here, its
Ctrl-C after the attempt ended. `logs -f`'s is tests/test_runs_logs_stop.py's (it needs a pod)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from helpers.cli import spawn
from helpers.waiting import alive, wait_for

ROOT = Path(__file__).resolve().parent.parent


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    e = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    e.update(PYTHONPATH=str(ROOT), **(env or {}))
    return spawn(*args, env=e)


def interrupt(p: subprocess.Popen, timeout_s: float = 60.0) -> tuple[str, str]:
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=timeout_s)
    return out, err


def _pid(path: Path) -> int | None:
    try:
        return json.loads(path.read_text()).get("pid")
    except (OSError, ValueError):
        return None  # being written


def test_monitor_watch_ends_with_one_line_and_130(smoke_run, tmp_path):
    p = start("monitor", str(smoke_run), "--watch", "--interval", "0.2", "--no-backend", "-o", "json")
    assert p.stdout is not None
    first = p.stdout.readline()  # the first report is out: the view is live
    assert json.loads(first)["run"]
    out, err = interrupt(p)
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1] == f"interrupted: stopped watching {smoke_run}; the run is untouched"
    assert err.count("interrupted") == 1 and "Traceback" not in err


def test_smoke_stops_its_attempts_and_removes_its_scratch_run_directories(tmp_path):
    scratch = {"TMPDIR": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    p = start("smoke", "--backend", "local", "--device", "cpu-1", env=scratch)
    info = wait_for(
        lambda: glob.glob(str(tmp_path / "olmo-ctl-smoke-*" / "smoke-cpu-1-*" / "attempts" / "1.json")),
        120,
        "smoke's attempt 1 to start",
    )[0]
    root = Path(info).parents[2]
    pid = wait_for(lambda: _pid(Path(info)), 30, "attempt 1's pid")
    out, err = interrupt(p)
    assert p.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last == f"interrupted: smoke stopped its attempts and removed its run directories ({root})", err
    assert not root.exists()
    wait_for(lambda: not alive(pid), 30, "the trainer of attempt 1 to be gone")


def test_a_foreground_sandbox_stops_on_ctrl_c_with_130_and_removes_its_kubeconfig(tmp_path):
    from olmo_ctl.sandbox.sandbox import env_file_for

    kc = tmp_path / "kubeconfig"
    p = start("sandbox", "--kubeconfig", str(kc), "--no-run-pods")
    wait_for(lambda: env_file_for(kc).exists(), 60, "the sandbox to serve")
    out, err = interrupt(p)
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1] == (
        "interrupted: sandbox stopped: its pods' processes killed, its kubeconfig removed"
    )
    assert out.startswith(f"export KUBECONFIG={kc}\n")  # the environment, printed once it served
    assert not kc.exists() and not env_file_for(kc).exists()


def _exited(pid: int) -> bool:
    """The process is over: gone, or a zombie its parent (here, this process's backend) has not reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_resume_until_done_interrupted_after_its_attempt_ended_says_nothing_is_running(tmp_path):
    """Ctrl-C lands after the attempt's trainer exited but before the supervisor's next look at it:
    the line says the attempt has ended and nothing is running, not that it keeps running."""
    import io

    from olmo_ctl.backends.local import LocalBackend
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.core.errors import Interrupted
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.supervise.policy import RetryPolicy
    from olmo_ctl.supervise.supervisor import Printer, Supervisor

    rd = RunDir.of(str(tmp_path), "ended")
    r = load_recipe("smoke", overrides=["train.max_steps=20"])
    rd.create_run(r.to_dict(), r.fingerprint(), "fp", "cpu-1")
    go = tmp_path / "go"
    trainer = tmp_path / "python-fake"  # a trainer that fails once the supervisor has seen it running
    trainer.write_text(
        f'#!/bin/sh\nwhile [ ! -e {go} ]; do sleep 0.05; done\necho "ValueError: loss is NaN"\nexit 1\n'
    )
    trainer.chmod(0o755)

    def ctrl_c_once_it_exited(seconds: float) -> None:
        assert sup.handle is not None  # the supervisor is watching attempt 1
        go.touch()
        wait_for(lambda: _exited(int(sup.handle.data["pid"])), 30, "the trainer to exit")
        raise KeyboardInterrupt

    sup = Supervisor(
        rd, LocalBackend(str(tmp_path), python=str(trainer)), RetryPolicy(), device=get_device("cpu-1"),
        poll_s=0.05, sleep=ctrl_c_once_it_exited, printer=Printer(rd.name, stream=io.StringIO()),
    )  # fmt: skip
    with pytest.raises(Interrupted) as e:
        sup.run()
    assert e.value.one_line() == (
        "attempt 1 has ended (failed-user: exit 1); nothing is running; "
        "continue with: olmo-ctl resume-until-done ended"
    )
    assert rd.journal()[-1]["event"] == "supervisor_detached"
    assert rd.journal()[-1]["reason"] == "interrupted; attempt 1 had ended (failed-user)"


def test_a_ctrl_c_handled_inside_code_run_from_a_string_still_exits_130(tmp_path):
    """CPython 3.11 marks a KeyboardInterrupt raised in code run from a string (exec: a dataclass's
    generated methods, as during a first import) as unhandled even once it is caught, and then ends
    the interpreter with SIGINT instead of its exit code: smoke interrupted at that moment exited -2."""
    import sys

    code = (
        "import olmo_ctl.cli as cli\n"
        "def main():\n"
        "    try:\n"
        "        exec('raise KeyboardInterrupt')\n"
        "    except KeyboardInterrupt:\n"
        "        return cli.EXIT_INTERRUPTED\n"
        "cli.main = main\n"
        "cli.entry()\n"
    )
    (tmp_path / "handled.py").write_text(code)  # run as `python -m olmo_ctl` is: with -m
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}"}
    p = subprocess.run([sys.executable, "-m", "handled"], env=env, timeout=120)
    assert p.returncode == 130
