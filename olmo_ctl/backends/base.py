"""The backend interface: render (pure, printable) is separate from submit; every backend answers
`status` with one normalised state and a human reason copied from its source.

States:
  QUEUED        waiting for capacity (Kueue pending, JobSet suspended): never a failure, never a retry
  ADMITTED      capacity granted, pods starting
  RUNNING       trainer processes running
  PREEMPTED     evicted / disrupted / SIGTERM / node loss: retry with no blame
  FAILED_INFRA  infrastructure failure (image pull, unschedulable, OOM-kill, unknown exit): retry
  FAILED_USER   deterministic failure of the program (exit 1/2, Python error): do not retry blindly
  SUCCEEDED     the attempt finished (the trainer reached its final or --stop-at step)
  MISSING       no such attempt any more (deleted, or never created)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol


class State(str, enum.Enum):
    QUEUED = "queued"
    ADMITTED = "admitted"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FAILED_INFRA = "failed-infra"
    FAILED_USER = "failed-user"
    SUCCEEDED = "succeeded"
    MISSING = "missing"

    @property
    def live(self) -> bool:
        """The attempt may still make progress (a supervisor must not submit another)."""
        return self in (State.QUEUED, State.ADMITTED, State.RUNNING)

    @property
    def terminal(self) -> bool:
        return not self.live


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
    """One attempt of a run: what a backend renders."""

    run: str
    run_dir: str
    attempt: int
    device: str
    recipe_path: str | None = None  # None: the trainer reads <run_dir>/run.yaml
    extra_args: tuple[str, ...] = ()


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


class Backend(Protocol):
    name: str

    def render(self, attempt: Attempt) -> Any: ...  # pure; what --dry-run prints
    def submit(self, request: Any) -> Handle: ...
    def status(self, handle: Handle) -> AttemptStatus: ...
    def stop(self, handle: Handle, graceful: bool = True) -> None: ...
    def logs(self, handle: Handle, tail: int = 50) -> list[str]: ...
    def find_live(self, run: str) -> Handle | None: ...  # a live attempt of this run, if any (reattach)
