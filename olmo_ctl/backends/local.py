"""The local backend: an attempt is the trainer as a child process group on this machine.

`render` builds the command line and environment (pure, what `--dry-run` prints); `submit` starts
it in a new session (its own process group, so Ctrl-C in the supervisor's terminal does not reach
it and `stop` can signal the whole group) with stdout/stderr appended to `logs/attempt-<N>.log`.

Each attempt leaves `attempts/<N>.json` (pid, pgid, process start time, command line). A
supervisor restarted after a crash finds a live attempt again from that file: the pid must be alive
AND be our trainer (same start time, `olmo_ctl.trainer` with this run directory on its command line),
so a recycled pid is never mistaken for it. When the process exits while we are its parent, the exit
code is written into the same file, so a later supervisor can still classify it.

Exit codes mean what `olmo_ctl.core.contracts.exit_state` says: 0 SUCCEEDED; 143/137 (SIGTERM/SIGKILL)
PREEMPTED; 1/2 FAILED_USER; others FAILED_INFRA.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from olmo_ctl import storage
from olmo_ctl.backends.base import Attempt, AttemptStatus, Backend, Handle, State
from olmo_ctl.core.contracts import LogProgress, exit_state, log_progress
from olmo_ctl.rundir import proc_start_time  # noqa: F401 - also what callers import from here

TRAINER_MODULE = "olmo_ctl.trainer"


@dataclass(frozen=True)
class LocalRequest:
    attempt: Attempt
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment
    log_path: str = ""
    state_dir: str = ""

    def to_dict(self) -> dict:
        return {"argv": list(self.argv), "env": dict(self.env), "log": self.log_path,
                "attempt_file": os.path.join(self.state_dir, "attempts", f"{self.attempt.attempt}.json")}


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


class LocalBackend(Backend):
    name = "local"
    trains_here = True

    def __init__(self, run_root: str, python: str | None = None, state_root: str | None = None,
                 stop_grace_s: float = 120.0):
        self.run_root = str(run_root)
        self.python = python or sys.executable
        self.state_root = state_root
        self.stop_grace_s = stop_grace_s
        self._procs: dict[int, subprocess.Popen] = {}

    # Local run dirs keep attempt files and logs inside; a gs:// run dir keeps them on this machine.
    def state_dir(self, run: str, run_dir: str | None = None) -> str:
        rd = run_dir or storage.join(self.run_root, run)
        if not storage.is_gcs(rd):
            return rd
        base = self.state_root or os.path.join(
            os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state"), "olmo-ctl", "local")
        return os.path.join(base, run)

    def render(self, attempt: Attempt) -> LocalRequest:
        argv = [self.python, "-m", TRAINER_MODULE, "--run-dir", attempt.run_dir, "--device", attempt.device,
                "--attempt", str(attempt.attempt)]
        if attempt.recipe_path:
            argv += ["--recipe", attempt.recipe_path]
        argv += list(attempt.extra_args)
        env = {"PYTHONUNBUFFERED": "1"}
        kind, _, n = attempt.device.rpartition("-")
        if kind == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={int(n)}"
        env.update(dict(attempt.env))
        sd = self.state_dir(attempt.run, attempt.run_dir)
        return LocalRequest(attempt, tuple(argv), env, os.path.join(sd, "logs", f"attempt-{attempt.attempt}.log"), sd)

    def _attempt_file(self, state_dir: str, n: int) -> str:
        return os.path.join(state_dir, "attempts", f"{n}.json")

    def send(self, request: LocalRequest) -> Handle:
        a = request.attempt
        os.makedirs(os.path.dirname(request.log_path), exist_ok=True)
        os.makedirs(os.path.join(request.state_dir, "attempts"), exist_ok=True)
        env = dict(os.environ)
        env.update(request.env)
        if "XLA_FLAGS" in request.env and os.environ.get("XLA_FLAGS"):
            other = [f for f in os.environ["XLA_FLAGS"].split() if "xla_force_host_platform_device_count" not in f]
            env["XLA_FLAGS"] = " ".join(other + [request.env["XLA_FLAGS"]])
        with open(request.log_path, "ab") as log:
            log.write(f"=== attempt {a.attempt} on {a.device} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
                      f": {' '.join(request.argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(list(request.argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, close_fds=True)
        self._procs[proc.pid] = proc
        info = {"pid": proc.pid, "pgid": proc.pid, "start_time": proc_start_time(proc.pid), "host": socket.gethostname(),
                "argv": list(request.argv), "log": request.log_path, "run_dir": a.run_dir, "started": time.time(),
                "exit_code": None}
        self._write_json(self._attempt_file(request.state_dir, a.attempt), info)
        return Handle("local", str(proc.pid), a.attempt,
                      {"pid": proc.pid, "start_time": info["start_time"], "state_dir": request.state_dir,
                       "log": request.log_path, "run_dir": a.run_dir})

    @staticmethod
    def _write_json(path: str, d: dict) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(d, f)
        os.replace(tmp, path)

    def _info(self, handle: Handle) -> dict:
        try:
            with open(self._attempt_file(handle.data["state_dir"], handle.attempt)) as f:
                return json.load(f)
        except (OSError, ValueError, KeyError):
            return {}

    def _is_ours(self, info: dict) -> bool:
        pid = info.get("pid")
        if not pid or info.get("host") not in (None, socket.gethostname()):
            return False
        st = proc_start_time(int(pid))
        if st is None or (info.get("start_time") is not None and st != info["start_time"]):
            return False
        cmd = _cmdline(int(pid))
        return TRAINER_MODULE in cmd and info.get("run_dir") in cmd

    def status(self, handle: Handle) -> AttemptStatus:
        pid = int(handle.data.get("pid") or handle.name)
        proc = self._procs.get(pid)
        info = self._info(handle)
        if proc is not None:
            code = proc.poll()
            if code is not None and info and info.get("exit_code") is None:
                info["exit_code"] = code
                info["ended"] = time.time()
                self._write_json(self._attempt_file(handle.data["state_dir"], handle.attempt), info)
        else:
            code = info.get("exit_code")
            if code is None:
                if self._is_ours(info):
                    return AttemptStatus(State.RUNNING, f"pid {pid} running", "process")
                if not info:
                    return AttemptStatus(State.MISSING, "no attempt file", "local")
                return self._ended_unwatched(handle, pid)
        state, reason = exit_state(code)
        if state == State.RUNNING:
            return AttemptStatus(State.RUNNING, f"pid {pid} running", "process")
        return AttemptStatus(state, reason, "process exit code", code, tuple(self.logs(handle, 20)))

    def _ended_unwatched(self, handle: Handle, pid: int) -> AttemptStatus:
        """A trainer that exited while no process of ours was its parent: no exit code to read, so its
        last log lines say how it ended (`committed step N` is its last line on exit 0 and on 143)."""
        lines = self.logs(handle, 50)
        seen = log_progress(lines)
        last = lines[-1].strip() if lines else ""
        why = f"pid {pid} exited (started by another process: exit code unknown)"
        if seen.committed is not None and seen.final is not None and seen.committed >= seen.final:
            return AttemptStatus(State.SUCCEEDED, f"{why}; its log ends with `{last}`", "log", None, tuple(lines[-20:]))
        if seen.committed is not None:
            return AttemptStatus(State.PREEMPTED, f"{why}; its log ends with `{last}`", "log", None, tuple(lines[-20:]))
        return AttemptStatus(State.FAILED_INFRA, why, "process", None, tuple(lines[-20:]))

    def stop(self, handle: Handle, graceful: bool = True) -> None:
        """SIGTERM to the process group (the trainer checkpoints and exits 143), SIGKILL after the grace."""
        pid = int(handle.data.get("pid") or handle.name)
        proc = self._procs.get(pid)
        if proc is None and not self._is_ours(self._info(handle)):
            return
        if proc is not None and proc.poll() is not None:
            self.status(handle)
            return
        try:
            os.killpg(pid, signal.SIGTERM if graceful else signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.time() + (self.stop_grace_s if graceful else 10)
        while time.time() < deadline:
            if proc is not None:
                if proc.poll() is not None:
                    break
            elif proc_start_time(pid) is None:
                break
            time.sleep(0.1)
        else:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if proc is not None:
                proc.wait(10)
        self.status(handle)  # records the exit code

    def logs(self, handle: Handle, tail: int = 50) -> list[str]:
        path = handle.data.get("log")
        if not path:
            return []
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 64 * 1024))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return []
        return lines[-tail:] if tail else lines

    def progress(self, handle: Handle) -> LogProgress:
        """The trainer's step and committed lines, from the tail of its log file."""
        return log_progress(self.logs(handle, 50))

    def find_live(self, run: str) -> Handle | None:
        sd = self.state_dir(run)
        d = os.path.join(sd, "attempts")
        try:
            names = sorted((int(n[:-5]) for n in os.listdir(d) if n.endswith(".json") and n[:-5].isdigit()),
                           reverse=True)
        except FileNotFoundError:
            names = []
        for n in names:
            try:
                with open(os.path.join(d, f"{n}.json")) as f:
                    info = json.load(f)
            except (OSError, ValueError):
                continue
            if info.get("exit_code") is None and self._is_ours(info):
                return Handle("local", str(info["pid"]), n, {"pid": info["pid"], "start_time": info.get("start_time"),
                                                             "state_dir": sd, "log": info.get("log"),
                                                             "run_dir": info.get("run_dir")})
        return self._find_unrecorded(run, sd)

    def _find_unrecorded(self, run: str, sd: str) -> Handle | None:
        """A trainer of this run with no attempt file: a supervisor died between starting it and
        writing the file. Found by its command line, so it is adopted instead of started twice."""
        run_dir = storage.join(self.run_root, run)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            cmd = _cmdline(int(entry))
            if TRAINER_MODULE not in cmd or "--run-dir" not in cmd or "--attempt" not in cmd:
                continue
            i, k = cmd.index("--run-dir"), cmd.index("--attempt")
            if i + 1 >= len(cmd) or cmd[i + 1] != run_dir or k + 1 >= len(cmd) or not cmd[k + 1].isdigit():
                continue
            pid, n = int(entry), int(cmd[k + 1])
            start = proc_start_time(pid)
            if start is None:
                continue
            log = os.path.join(sd, "logs", f"attempt-{n}.log")  # where submit sent its output
            info = {"pid": pid, "pgid": os.getpgid(pid), "start_time": start, "host": socket.gethostname(),
                    "argv": cmd, "log": log, "run_dir": run_dir, "started": time.time(), "exit_code": None,
                    "adopted": True}
            os.makedirs(os.path.join(sd, "attempts"), exist_ok=True)
            self._write_json(self._attempt_file(sd, n), info)
            return Handle("local", str(pid), n, {"pid": pid, "start_time": start, "state_dir": sd, "log": log,
                                                 "run_dir": run_dir})
        return None
