"""The backend interface (torchx's Scheduler is the model: submit = send(render(attempt))).

`render(attempt)` is pure and printable: it turns an attempt request (the run, its directory, the
attempt number, the device, the resolved recipe, its batch plan and the site settings) into the
backend's request: a JobSet for GKE, a command line and environment for the local backend. `send`
hands that request to the backend and returns a `Handle`. Submitting is `send(render(attempt))`,
written once (`supervise.attempts.submit_next`), so `submit --dry-run` prints exactly what a submit
applies.

Every backend answers `status` with one normalised state (`olmo_ctl.core.contracts.State`) and a
human reason copied from its source:

  QUEUED        waiting for capacity (Kueue pending, JobSet suspended): never a failure, never a retry
  ADMITTED      capacity granted, pods starting
  RUNNING       trainer processes running
  PREEMPTED     evicted / disrupted / SIGTERM / node loss: retry with no blame
  FAILED_INFRA  infrastructure failure (image pull, unschedulable, OOM-kill, unknown exit): retry
  FAILED_USER   deterministic failure of the program (exit 1/2, Python error): do not retry blindly
  SUCCEEDED     the attempt finished (the trainer reached its final or --stop-at step)
  MISSING       no such attempt any more (deleted, or never created)

and `progress` with what it can see of the trainer's progress without extra cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from olmo_ctl.core.contracts import LogProgress, State

__all__ = ["Attempt", "AttemptStatus", "Backend", "Handle", "LogProgress", "State"]


@dataclass(frozen=True)
class AttemptStatus:
    state: State
    reason: str = ""  # copied from the source: Kueue/JobSet condition, exit code, last log line
    source: str = ""  # where the reason came from, e.g. "Workload condition Evicted"
    exit_code: int | None = None
    last_log_lines: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Attempt:
    """One attempt of a run: everything a backend needs to render it, resolved once by the caller."""

    run: str
    run_dir: str
    attempt: int
    device: str
    recipe_path: str | None = None  # None: the trainer reads <run_dir>/run.yaml
    extra_args: tuple[str, ...] = ()  # appended to the trainer's command line
    recipe: Any = None  # the resolved Recipe (what run.yaml holds)
    plan: Any = None  # its batching.Plan on `device`
    settings: Any = None  # site settings (config.Settings); None: the backend's own
    env: tuple[tuple[str, str], ...] = ()  # extra environment of the trainer (test fault injection)
    slices: int = 1  # slices of `device` (multislice when > 1; GKE only)


@dataclass(frozen=True)
class Handle:
    """What identifies a submitted attempt to its backend; serialisable into the journal."""

    backend: str
    name: str  # JobSet name, or local process-group id as text
    attempt: int
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"backend": self.backend, "name": self.name, "attempt": self.attempt, "data": dict(self.data)}

    @staticmethod
    def from_dict(d: dict) -> Handle:
        return Handle(d["backend"], d["name"], int(d["attempt"]), dict(d.get("data") or {}))


class Backend:
    """What every backend implements (`printable`, `wait_gone` and `progress` have defaults)."""

    name: str = ""
    trains_here: bool = False  # the trainer runs on this machine (it sees this machine's files)

    def render(self, attempt: Attempt) -> Any:  # pure; what --dry-run prints
        raise NotImplementedError

    def send(self, request: Any) -> Handle:
        raise NotImplementedError

    @staticmethod
    def printable(request: Any) -> Any:
        """The rendered request as plain data (YAML/JSON)."""
        return request.to_dict() if hasattr(request, "to_dict") else request

    def status(self, handle: Handle) -> AttemptStatus:
        raise NotImplementedError

    def stop(self, handle: Handle, graceful: bool = True) -> None:
        raise NotImplementedError

    def wait_gone(self, handle: Handle, timeout_s: float, poll_s: float) -> bool:
        """Wait until the stopped attempt can no longer write to the run directory; False on timeout.
        By default: until its status is no longer live."""
        deadline = time.monotonic() + timeout_s
        while self.status(handle).state.live:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        return True

    def logs(self, handle: Handle, tail: int = 50) -> list[str]:
        raise NotImplementedError

    def progress(self, handle: Handle) -> LogProgress:
        """What the backend sees of the trainer's progress (step lines, a committed step) at no extra
        cost; empty where reading it would cost cluster calls (the run directory tells then)."""
        return LogProgress()

    def find_live(self, run: str) -> Handle | None:  # a live attempt of this run, if any (reattach)
        raise NotImplementedError

    def live_attempts(self, run: str) -> list[Handle]:
        """Every live attempt of this run, newest first: the lease holder stops any but its own (one a
        supervisor that lost the lease created anyway). By default only the newest is known."""
        h = self.find_live(run)
        return [h] if h is not None else []
