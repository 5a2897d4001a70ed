"""Ctrl-C is the same for every command that runs until it is stopped: one line on stderr
(`interrupted: ...`, saying what was left and how to go on), exit 130, nothing half-written.
resume-until-done's detach is tests/test_supervisor_local.py's (it needs a training attempt)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
from pathlib import Path

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
