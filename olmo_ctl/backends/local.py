"""The local backend: an attempt is the trainer as a child process group on this machine.

`render` builds the command line and environment (pure, what `--dry-run` prints); `submit` starts
it in a new session (its own process group, so Ctrl-C in the supervisor's terminal does not reach
it and `stop` can signal the whole group) with stdout/stderr appended to `logs/attempt-<N>.log`.

Each attempt leaves `attempts/<N>.json` (pid, pgid, process start time, command line). A
supervisor restarted after a crash finds a live attempt again from that file: the pid must be alive
AND be our trainer (same start time, `olmo_ctl.trainer` with this run directory on its command line),
so a recycled pid is never mistaken for it. When the process exits while we are its parent, the exit
code is written into the same file, so a later supervisor can still classify it.

A multi-host device (`cpu-PxD`) starts P trainer processes in one process group, joined by
`jax.distributed` through a coordinator on a free local port (`trainer/multihost.py`); the attempt
file lists them under `hosts`. The attempt behaves like a JobSet: it succeeds when every host exits
0; when one host fails, the others get SIGTERM and, after the grace period, SIGKILL, and the attempt
ends with the first failure's exit code. Every host's lines go to the one attempt log, prefixed
`host <h>: `.

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
from typing import TYPE_CHECKING

from olmo_ctl import storage
from olmo_ctl.backends.base import Attempt, AttemptStatus, Backend, Handle, State, Target
from olmo_ctl.core.contracts import (
    COORDINATOR_ENV,
    LOG_PREFIX_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
    TRAINER_MODULE,
    LogProgress,
    exit_state,
    log_progress,
    trainer_argv,
)
from olmo_ctl.core.errors import BadInput
from olmo_ctl.ports import free_port
from olmo_ctl.rundir import (
    proc_start_time,  # noqa: F401 - also what callers import from here
    warn,
)

if TYPE_CHECKING:
    from olmo_ctl.core.config import Settings


@dataclass(frozen=True)
class LocalRequest:
    attempt: Attempt
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment
    log_path: str = ""
    state_dir: str = ""
    processes: int = 1  # trainer processes (hosts); each adds its id and log prefix to `env`

    def to_dict(self) -> dict:
        d: dict[str, object] = {
            "argv": list(self.argv),
            "env": dict(self.env),
            "log": self.log_path,
            "attempt_file": os.path.join(self.state_dir, "attempts", f"{self.attempt.attempt}.json"),
        }
        if self.processes > 1:
            d["processes"] = self.processes
            d["env_per_process"] = {
                PROCESS_ID_ENV: f"0..{self.processes - 1}",
                LOG_PREFIX_ENV: "host <h>: ",
                COORDINATOR_ENV: "127.0.0.1:<a free port>",
            }
        return d

    def host_env(self, host: int, coordinator: str | None) -> dict[str, str]:
        if self.processes <= 1:
            return dict(self.env)
        return {
            **self.env,
            PROCESS_ID_ENV: str(host),
            LOG_PREFIX_ENV: f"host {host}: ",
            COORDINATOR_ENV: coordinator or "",
        }


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


class LocalBackend(Backend[LocalRequest]):
    name = "local"
    trains_here = True
    retry_backoff_s = 5.0

    def __init__(
        self,
        run_root: str,
        python: str | None = None,
        state_root: str | None = None,
        stop_grace_s: float = 120.0,
    ):
        self.run_root = str(run_root)
        self.python = python or sys.executable
        self.state_root = state_root
        self.stop_grace_s = stop_grace_s
        self.settings: Settings | None = (
            None  # the site settings it was made from (recorded with each attempt)
        )
        self._procs: dict[object, subprocess.Popen] = {}  # by pid; looked up with a handle's JSON `pid`

    @classmethod
    def from_settings(cls, settings, run_root: str | None = None) -> LocalBackend:
        backend = cls(run_root or settings.run_root)
        backend.settings = settings
        return backend

    @classmethod
    def for_status(cls, handle: Handle, run_dir: str) -> LocalBackend:
        return cls(run_dir.rstrip("/").rsplit("/", 1)[0])

    def validate_target(
        self, target: Target, settings: Settings | None, run_dir: str, *, render_only: bool = False
    ) -> None:
        """The local backend runs cpu-N, cpu-PxD and gpu-N on this machine."""
        dev = target.device
        if dev.is_gpu_nodes:
            raise BadInput(
                f"`{dev.name}` is GPU nodes on GKE ({dev.vms} x {dev.machine_type}); the local backend runs "
                "cpu-N or gpu-N (this machine's GPUs)",
                f"use --backend gke, or a local device such as gpu-{dev.chips_per_vm}",
            )
        if dev.is_tpu:
            raise BadInput(
                f"`{dev.name}` is a TPU slice; the local backend runs cpu-N or gpu-N",
                "use --backend gke, or a local device such as cpu-4",
            )

    # Local run dirs keep attempt files and logs inside; a gs:// run dir keeps them on this machine.
    def state_dir(self, run: str, run_dir: str | None = None) -> str:
        rd = run_dir or storage.join(self.run_root, run)
        if not storage.is_gcs(rd):
            return rd
        base = self.state_root or os.path.join(
            os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state"), "olmo-ctl", "local"
        )
        return os.path.join(base, run)

    def render(self, attempt: Attempt) -> LocalRequest:
        argv = trainer_argv(self.python, attempt.run_dir, attempt.target, attempt.plan, attempt.attempt)
        if attempt.recipe_path:
            argv += ["--recipe", attempt.recipe_path]
        argv += list(attempt.extra_args)
        env = {"PYTHONUNBUFFERED": "1"}
        dev = attempt.target.device
        if dev.platform == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={dev.devices_per_process}"
        if dev.processes > 1:
            env[NUM_PROCESSES_ENV] = str(dev.processes)
        env.update(dict(attempt.env))
        sd = self.state_dir(attempt.run, attempt.run_dir)
        return LocalRequest(
            attempt,
            tuple(argv),
            env,
            os.path.join(sd, "logs", f"attempt-{attempt.attempt}.log"),
            sd,
            dev.processes,
        )

    def _attempt_file(self, state_dir: str, n: int) -> str:
        return os.path.join(state_dir, "attempts", f"{n}.json")

    def send(self, request: LocalRequest) -> Handle:
        a = request.attempt
        os.makedirs(os.path.dirname(request.log_path), exist_ok=True)
        os.makedirs(os.path.join(request.state_dir, "attempts"), exist_ok=True)
        env = dict(os.environ)
        env.update(request.env)
        if "XLA_FLAGS" in request.env and os.environ.get("XLA_FLAGS"):
            other = [
                f for f in os.environ["XLA_FLAGS"].split() if "xla_force_host_platform_device_count" not in f
            ]
            env["XLA_FLAGS"] = " ".join(other + [request.env["XLA_FLAGS"]])
        coordinator = f"127.0.0.1:{free_port()}" if request.processes > 1 else None
        procs: list[subprocess.Popen] = []
        with open(request.log_path, "ab") as log:
            log.write(
                f"=== attempt {a.attempt} on {a.device} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
                f": {' '.join(request.argv)}\n".encode()
            )
            log.flush()
            for h in range(request.processes):
                # One process group per attempt, not the supervisor's: Ctrl-C in the supervisor's
                # terminal reaches no trainer, and `stop` signals the whole group (every host and its
                # workers) at once. One host: its own session too (no controlling terminal). Several:
                # host 0 leads a new group in this session, the others join it (a group cannot span
                # sessions).
                group = (
                    {"start_new_session": True}
                    if request.processes == 1
                    else {"process_group": procs[0].pid if procs else 0}
                )
                procs.append(
                    subprocess.Popen(
                        list(request.argv),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env={**env, **request.host_env(h, coordinator)},
                        close_fds=True,
                        **group,
                    )
                )
        for p in procs:
            self._procs[p.pid] = p
        hosts = [{"pid": p.pid, "start_time": proc_start_time(p.pid), "exit_code": None} for p in procs]
        info = {
            "pid": procs[0].pid,
            "pgid": procs[0].pid,
            "start_time": hosts[0]["start_time"],
            "host": socket.gethostname(),
            "argv": list(request.argv),
            "log": request.log_path,
            "run_dir": a.run_dir,
            "started": time.time(),
            "exit_code": None,
            "hosts": hosts,
            "coordinator": coordinator,
        }
        self._write_json(self._attempt_file(request.state_dir, a.attempt), info)
        return Handle(
            "local",
            str(procs[0].pid),
            a.attempt,
            {
                "pid": procs[0].pid,
                "start_time": info["start_time"],
                "state_dir": request.state_dir,
                "log": request.log_path,
                "run_dir": a.run_dir,
                "pids": [p.pid for p in procs],
            },
        )

    @staticmethod
    def _write_json(path: str, d: dict) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(d, f)
        os.replace(tmp, path)

    def _info(self, handle: Handle) -> dict:
        try:
            return read_attempt_file(self._attempt_file(handle.data["state_dir"], handle.attempt)) or {}
        except KeyError:
            return {}

    @staticmethod
    def _hosts(info: dict, handle: Handle | None = None) -> list[dict]:
        """The attempt's processes: `hosts` in the attempt file (one entry for an older single-host file)."""
        if info.get("hosts"):
            return info["hosts"]
        pid = (
            info.get("pid")
            or (handle.data.get("pid") if handle else None)
            or (handle.name if handle else None)
        )
        return [
            {
                "pid": int(pid) if pid else None,
                "start_time": info.get("start_time"),
                "exit_code": info.get("exit_code"),
            }
        ]

    def _host_alive(self, info: dict, h: dict) -> bool:
        """Alive AND our trainer: same start time, `olmo_ctl.trainer` with this run dir on its command line."""
        pid = h.get("pid")
        if not pid or info.get("host") not in (None, socket.gethostname()):
            return False
        st = proc_start_time(int(pid))
        if st is None or (h.get("start_time") is not None and st != h["start_time"]):
            return False
        cmd = _cmdline(int(pid))
        return TRAINER_MODULE in cmd and info.get("run_dir") in cmd

    def _is_ours(self, info: dict) -> bool:
        return bool(info) and any(self._host_alive(info, h) for h in self._hosts(info))

    def status(self, handle: Handle) -> AttemptStatus:
        info = self._info(handle)
        hosts = self._hosts(info, handle)
        watched = any(self._procs.get(h.get("pid")) is not None for h in hosts)
        if not info and not watched:
            return AttemptStatus(State.MISSING, "no attempt file", "local")
        if info.get("exit_code") is not None:
            return self._ended(handle, info["exit_code"], hosts)
        changed, running, gone = False, [], []
        for i, h in enumerate(hosts):
            if h.get("exit_code") is not None:
                continue
            proc = self._procs.get(h.get("pid"))
            code = proc.poll() if proc is not None else None
            if code is not None:
                h["exit_code"], h["ended"], changed = code, time.time(), True
            elif proc is not None or self._host_alive(info, h):
                running.append(i)
            else:
                gone.append(i)
        failed = [h for h in hosts if h.get("exit_code") not in (None, 0)]
        if running:
            if failed and info:
                changed |= self._fail_the_rest(info, hosts, failed, running)
            if changed and info:
                self._write_json(self._attempt_file(handle.data["state_dir"], handle.attempt), info)
            pid = int(handle.data.get("pid") or handle.name)
            if failed:
                first = min(failed, key=lambda h: h.get("ended", 0))
                return AttemptStatus(
                    State.RUNNING,
                    f"host {hosts.index(first)} exited {first['exit_code']}: stopping the other hosts",
                    "process",
                )
            what = (
                f"pid {pid} running" if len(hosts) == 1 else f"{len(running)} of {len(hosts)} hosts running"
            )
            return AttemptStatus(State.RUNNING, what, "process")
        if gone and not failed:  # ended while no process of ours was its parent: no exit code to read
            return self._ended_unwatched(handle, int(handle.data.get("pid") or handle.name))
        code = self._attempt_code(hosts)
        if info:
            info["exit_code"], info["ended"] = code, time.time()
            self._write_json(self._attempt_file(handle.data["state_dir"], handle.attempt), info)
        return self._ended(handle, code, hosts)

    @staticmethod
    def _attempt_code(hosts: list[dict]) -> int:
        """0 when every host exited 0; otherwise the first failure's exit code (as a JobSet's first failed job)."""
        failed = [h for h in hosts if h.get("exit_code") not in (None, 0)]
        if not failed:
            return 0
        return min(failed, key=lambda h: h.get("ended", 0))["exit_code"]

    def _ended(self, handle: Handle, code: int, hosts: list[dict]) -> AttemptStatus:
        state, reason = exit_state(code)
        if state == State.RUNNING:
            return AttemptStatus(
                State.RUNNING, f"pid {handle.data.get('pid') or handle.name} running", "process"
            )
        if len(hosts) > 1 and code != 0:
            first = min(
                (h for h in hosts if h.get("exit_code") not in (None, 0)),
                key=lambda h: h.get("ended", 0),
                default=None,
            )
            if first is not None:
                reason = f"{reason} (first failed host: {hosts.index(first)})"
        return AttemptStatus(state, reason, "process exit code", code, tuple(self.logs(handle, 20)))

    def _fail_the_rest(self, info: dict, hosts: list[dict], failed: list[dict], running: list[int]) -> bool:
        """One host failed: SIGTERM the others once, SIGKILL them after the grace period."""
        now = time.time()
        failing = info.get("failing")
        if failing is None:
            first = min(failed, key=lambda h: h.get("ended", 0))
            info["failing"] = {"host": hosts.index(first), "code": first["exit_code"], "since": now}
            self._signal_hosts(info, [hosts[i] for i in running], signal.SIGTERM)
            return True
        if now - failing["since"] > self.stop_grace_s and not failing.get("killed"):
            self._signal_hosts(info, [hosts[i] for i in running], signal.SIGKILL)
            failing["killed"] = now
            return True
        return False

    def _signal_hosts(self, info: dict, hosts: list[dict], sig: int) -> None:
        """Signal these hosts (each checked to be our live trainer) and their workers: the attempt's
        process group when every host of the attempt is meant, else each host's process."""
        live = [
            h
            for h in hosts
            if h.get("pid") and (self._procs.get(h["pid"]) is not None or self._host_alive(info, h))
        ]
        everyone = len(live) == len([h for h in self._hosts(info) if h.get("exit_code") is None])
        pgid = info.get("pgid")
        if live and everyone and pgid:
            try:
                os.killpg(int(pgid), sig)
                return
            except (ProcessLookupError, PermissionError):
                pass  # the group's leader and members may be gone: the processes one by one
        for h in live:
            try:
                os.kill(int(h["pid"]), sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _ended_unwatched(self, handle: Handle, pid: int) -> AttemptStatus:
        """A trainer that exited while no process of ours was its parent: no exit code to read, so its
        last log lines say how it ended (`committed step N` is its last line on exit 0 and on 143)."""
        lines = self.logs(handle, 50)
        seen = log_progress(lines)
        last = lines[-1].strip() if lines else ""
        why = f"pid {pid} exited (started by another process: exit code unknown)"
        if seen.committed is not None and seen.final is not None and seen.committed >= seen.final:
            return AttemptStatus(
                State.SUCCEEDED, f"{why}; its log ends with `{last}`", "log", None, tuple(lines[-20:])
            )
        if seen.committed is not None:
            return AttemptStatus(
                State.PREEMPTED, f"{why}; its log ends with `{last}`", "log", None, tuple(lines[-20:])
            )
        return AttemptStatus(State.FAILED_INFRA, why, "process", None, tuple(lines[-20:]))

    def stop(self, handle: Handle, graceful: bool = True) -> None:
        """SIGTERM to every host's process group (each trainer checkpoints and exits 143), SIGKILL after
        the grace period."""
        info = self._info(handle)
        hosts = self._hosts(info, handle)
        live = [
            h
            for h in hosts
            if (self._procs.get(h.get("pid")) is not None and self._procs[h["pid"]].poll() is None)
            or self._host_alive(info, h)
        ]
        if not live:
            self.status(handle)
            return
        self._signal_hosts(info, live, signal.SIGTERM if graceful else signal.SIGKILL)
        deadline = time.time() + (self.stop_grace_s if graceful else 10)

        def alive(h: dict) -> bool:
            proc = self._procs.get(h.get("pid"))
            if proc is not None:
                return proc.poll() is None
            return proc_start_time(int(h["pid"])) is not None

        while time.time() < deadline and any(alive(h) for h in live):
            time.sleep(0.1)
        rest = [h for h in live if alive(h)]
        if rest:
            self._signal_hosts(info, rest, signal.SIGKILL)
            for h in rest:
                proc = self._procs.get(h.get("pid"))
                if proc is not None:
                    proc.wait(10)
        self.status(handle)  # records the exit codes

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

    def read_log(self, handle: Handle, host: int | None = None) -> tuple[str, list[str]]:
        """The attempt log (`logs/attempt-<N>.log`), whole; with `host`, that host's lines (their
        `host <h>: ` prefix dropped)."""
        path = handle.data.get("log") or ""
        hosts = len(handle.data.get("pids") or self._hosts(self._info(handle), handle))
        if host is not None and not 0 <= host < hosts:
            raise BadInput(
                f"attempt {handle.attempt} has {hosts} host{'s' if hosts != 1 else ''} (0..{hosts - 1}), "
                f"not host {host}",
                "pass --host 0" if hosts == 1 else f"pass --host 0..{hosts - 1}, or leave it out for all",
            )
        try:
            with open(path, "rb") as f:
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return path, []
        if host is None or hosts == 1:
            return path, lines
        prefix = f"host {host}: "
        return path, [ln[len(prefix) :] for ln in lines if ln.startswith(prefix)]

    def progress(self, handle: Handle) -> LogProgress:
        """The trainer's step and committed lines, from the tail of its log file."""
        return log_progress(self.logs(handle, 50))

    def find_live(self, run: str, run_dir: str | None = None) -> Handle | None:
        # (the state directory lies under this backend's own run root: one run per name there)
        live = self._recorded_live(run)
        return live[0] if live else self._find_unrecorded(run, self.state_dir(run))

    def live_attempts(self, run: str, run_dir: str | None = None) -> list[Handle]:
        return self._recorded_live(run) or [h for h in [self._find_unrecorded(run, self.state_dir(run))] if h]

    def _recorded_live(self, run: str) -> list[Handle]:
        """Attempts with an attempt file whose trainers are alive, newest first."""
        sd = self.state_dir(run)
        d = os.path.join(sd, "attempts")
        try:
            names = sorted(
                (int(n[:-5]) for n in os.listdir(d) if n.endswith(".json") and n[:-5].isdigit()), reverse=True
            )
        except FileNotFoundError:
            names = []
        out = []
        for n in names:
            info = read_attempt_file(os.path.join(d, f"{n}.json"))
            if info is None:
                continue
            if info.get("exit_code") is None and self._is_ours(info):
                out.append(
                    Handle(
                        "local",
                        str(info["pid"]),
                        n,
                        {
                            "pid": info["pid"],
                            "start_time": info.get("start_time"),
                            "state_dir": sd,
                            "log": info.get("log"),
                            "run_dir": info.get("run_dir"),
                            "pids": [h["pid"] for h in self._hosts(info)],
                        },
                    )
                )
        return out

    def _find_unrecorded(self, run: str, sd: str) -> Handle | None:
        """Trainers of this run with no attempt file: a supervisor died between starting them and
        writing the file. Found by their command lines (all hosts of the newest such attempt), so the
        attempt is adopted instead of started twice."""
        run_dir = storage.join(self.run_root, run)
        found: dict[int, list[tuple[int, int, str]]] = {}  # attempt -> [(host, pid, start)]
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
            found.setdefault(n, []).append((_host_of(pid), pid, start))
        if not found:
            return None
        n = max(found)
        procs = sorted(found[n])
        pid, start = procs[0][1], procs[0][2]
        log = os.path.join(sd, "logs", f"attempt-{n}.log")  # where submit sent its output
        info = {
            "pid": pid,
            "pgid": os.getpgid(pid),
            "start_time": start,
            "host": socket.gethostname(),
            "argv": _cmdline(pid),
            "log": log,
            "run_dir": run_dir,
            "started": time.time(),
            "exit_code": None,
            "adopted": True,
            "hosts": [{"pid": p, "start_time": st, "exit_code": None} for _, p, st in procs],
        }
        os.makedirs(os.path.join(sd, "attempts"), exist_ok=True)
        self._write_json(self._attempt_file(sd, n), info)
        return Handle(
            "local",
            str(pid),
            n,
            {
                "pid": pid,
                "start_time": start,
                "state_dir": sd,
                "log": log,
                "run_dir": run_dir,
                "pids": [p for _, p, _ in procs],
            },
        )


def attempt_file_problem(info: object) -> str | None:
    """Why a parsed attempts/<N>.json is not an attempt file (the fields `status` computes with), else None."""
    if not isinstance(info, dict):
        return "not a JSON object"
    ints, strs = ("pid", "pgid", "exit_code"), ("start_time", "host", "run_dir", "log")
    for k in ints:
        if info.get(k) is not None and (type(info[k]) is not int):
            return f"`{k}` is not an integer"
    for k in strs:
        if info.get(k) is not None and not isinstance(info[k], str):
            return f"`{k}` is not a string"
    hosts = info.get("hosts")
    if hosts is not None and not (
        isinstance(hosts, list)
        and all(
            isinstance(h, dict)
            and all(h.get(k) is None or type(h[k]) is int for k in ("pid", "exit_code"))
            and (h.get("start_time") is None or isinstance(h["start_time"], str))
            and (h.get("ended") is None or type(h["ended"]) in (int, float))
            for h in hosts
        )
    ):
        return "`hosts` is not a list of {pid, start_time, exit_code}"
    return None


def read_attempt_file(path: str) -> dict | None:
    """attempts/<N>.json; None when there is none, or when it cannot be read (torn, or edited by hand:
    one warning naming it, and it counts as absent: its trainers, if alive, are still found by their
    command lines, `_find_unrecorded`)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        warn(f"`{path}` cannot be read ({e.strerror}): skipped, as if absent", once_key=path)
        return None
    try:
        info = json.loads(data)
        why = attempt_file_problem(info)
    except ValueError:
        why = "not JSON" if data.strip() else "empty"
    if why is not None:
        warn(
            f"`{path}` is not an attempt file ({why}): skipped, as if absent (torn, or edited by hand?)",
            once_key=path,
        )
        return None
    return info


def _host_of(pid: int) -> int:
    """The host index a trainer process was started with (its OLMO_CTL_PROCESS_ID), 0 when single-host."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(PROCESS_ID_ENV.encode() + b"="):
                    return int(item.split(b"=", 1)[1] or 0)
    except (OSError, ValueError):
        pass
    return 0
