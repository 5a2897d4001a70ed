"""The backend interface (torchx's Scheduler is the model: submit = send(render(attempt))).

A backend is generic over its request type (`Backend[JobSet]`, `Backend[LocalRequest]`). What it
does with an attempt (the run, its directory, the attempt number, the device, the resolved recipe,
its batch plan and the site settings, all resolved once by the caller), in the order the one submit
path (`olmo_ctl.supervise.submit`) calls it:

  validate(attempt)  refusals that need no I/O, before anything is written (a TPU device on the
                     local backend, a placeholder image, a run root the pods cannot see)
  checks(attempt)    refusals that ask the backend's world (the Kueue objects the attempt names)
  render(attempt)    pure and printable: a JobSet for GKE, a command line and environment for the
                     local backend; what `--dry-run` prints
  send(request)      hands that request to the backend and returns a `Handle`

Submitting is `send(render(attempt))`, written once (`supervise.attempts.submit_next`), so `submit
--dry-run` prints exactly what a submit applies. Backends are found by name in
`olmo_ctl.backends.REGISTRY`; nothing outside a backend asks which one it is.

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

import abc
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from olmo_ctl.backends.options import NoOptions
from olmo_ctl.core.contracts import LogProgress, State
from olmo_ctl.core.devices import Target
from olmo_ctl.core.errors import BadInput

if TYPE_CHECKING:  # pure modules, but a backend that only reads status needs none of them
    from olmo_ctl.core.batching import Plan
    from olmo_ctl.core.config import Settings
    from olmo_ctl.core.recipe import Recipe

__all__ = [
    "Attempt",
    "AttemptStatus",
    "Backend",
    "Handle",
    "Hold",
    "LogProgress",
    "SmokeProfile",
    "State",
    "Target",
]


@dataclass(frozen=True)
class Hold:
    """What holds a live attempt before it runs, as its source says it (`observe.waiting` words it in
    one line). `kind`: `quota` (the queue has too little left), `queued` (waiting in the queue for any
    other reason), `no-flavor` / `no-queue` (no flavor of the queue fits the slice, the queue does not
    exist: no capacity changes that), `admission-check`, `requeued` (evicted, requeued as it is),
    `deactivated`, `no-workload` (Kueue cannot make the queue's object for it: an object it names is
    missing), `unschedulable` (no node fits its pods), `node-not-ready`, `kubelet-admission`,
    `image-pull` (the kubelet backs off pulling), `bad-image` (a pull no retry fixes), `pods-refused`
    (the API server refuses its pods), `stale-selector` (its pods keep a node selector of a flavor it
    no longer holds: jobset#1294)."""

    kind: str
    message: str  # the source's own words, e.g. "insufficient unused quota for google.com/tpu in flavor ..."
    by: str  # who says so: "Kueue", "scheduler", "kubelet", "node lifecycle", "API server"


@dataclass(frozen=True)
class AttemptStatus:
    """One attempt's normalised state, and the typed facts the supervisor, the policy and the eval job
    decide on. A backend fills the fields its world has (a local process is never evicted); `details`
    is the backend's own vocabulary (the pod, the container, the JobSet's reason), for people and the
    backend itself: nothing above `backends/` reads it."""

    state: State
    reason: str = ""  # copied from the source: Kueue/JobSet condition, exit code, last log line
    source: str = ""  # where the reason came from, e.g. "Workload condition Evicted"
    exit_code: int | None = None
    last_log_lines: tuple[str, ...] = ()
    # A live attempt admitted but waiting for capacity, and why: `unschedulable` (no node fits its
    # pods), `node-not-ready` (its pods sit on NotReady nodes), `kubelet-admission` (a just-repaired
    # node's kubelet refused a pod). Waiting is never failing: no admission timeout applies.
    wait_cause: str | None = None
    # A set-up no retry changes (a queue or image that does not exist, pods the API server refuses):
    # the supervisor exits 2 naming it, with the backend's `hint`.
    config_error: str | None = None
    deactivated: str | None = None  # who deactivated its Workload and why: kept, never run again by us
    evicted: str | None = None  # the eviction's reason: the same attempt is requeued and resumed
    preempted: bool = False  # evicted by a higher-priority workload (rather than requeued for a fault)
    image_pull: str | None = None  # the image the kubelet backs off pulling (a bounded wait)
    pods_refused: bool = False  # fewer pods than expected: the API server refused to create them
    cause: str | None = None  # what holds an admitted attempt, in the source's words
    restarts: int = 0  # restarts of the attempt in place (JobSet status.restarts)
    workload: str | None = None  # the queue's object for the attempt (Kueue Workload name)
    hold: Hold | None = None  # why a live attempt is not running yet (None: it is, or nothing holds it)
    # Child Jobs of the attempt that failed on a rule that counts (a crash), seen while they lasted:
    # (job, uid, message). The supervisor counts them whatever the JobSet counted (a crashed slice's Job
    # Failed after a lost peer's: JobSet restarts without counting).
    crashes: tuple[tuple[str, str, str], ...] = ()
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Attempt:
    """One attempt of a run: everything a backend needs to render it, resolved once by the caller
    (`supervise.attempts.new_request`): the target, the resolved recipe (what run.yaml holds) and its
    one plan on that target are required."""

    run: str
    run_dir: str
    attempt: int
    target: Target
    recipe: Recipe
    plan: Plan  # batching.Plan of `recipe` on `target`
    settings: Settings | None = None  # site settings; None: the backend's own
    recipe_path: str | None = None  # None: the trainer reads <run_dir>/run.yaml
    extra_args: tuple[str, ...] = ()  # appended to the trainer's command line
    env: tuple[tuple[str, str], ...] = ()  # extra environment of the trainer (test fault injection)

    def __post_init__(self) -> None:
        p, t = self.plan, self.target
        if p.device != t.name or p.slices != t.slices:
            raise ValueError(
                f"attempt {self.attempt} of {self.run}: its plan is for {p.device} x {p.slices}, not {t.on}"
            )

    @property
    def device(self) -> str:
        """The target's device name (what the journal and the trainer's `--device` carry)."""
        return self.target.name

    @property
    def slices(self) -> int:
        return self.target.slices


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


@dataclass(frozen=True)
class SmokeProfile:
    """How `olmo-ctl smoke` drives this backend: a cluster schedules and starts pods in seconds, not
    milliseconds, so it runs longer and polls less often than this machine's processes."""

    max_steps: int = 100
    poll_s: float = 0.2


Req = TypeVar("Req")


class Backend(abc.ABC, Generic[Req]):
    """What every backend implements. `validate`, `checks`, `notes`, `printable`, `wait_gone`,
    `progress` and `live_attempts` have defaults; the rest is the backend's own."""

    name: ClassVar[str] = ""
    trains_here: ClassVar[bool] = False  # the trainer runs on this machine (it sees this machine's files)
    smoke: ClassVar[SmokeProfile] = SmokeProfile()
    # The base backoff before resubmitting a failed attempt: a cluster's capacity comes back in
    # minutes, a process on this machine restarts in seconds.
    retry_backoff_s: ClassVar[float] = 300.0
    settings: Settings | None = None  # the site settings it was made from (recorded with each attempt)
    # Its site options (`backends/options.py`), the same class `backends.OPTIONS` names.
    options: ClassVar[type] = NoOptions
    # The placeholder settings (`core.config.PLACEHOLDERS`) this backend cannot submit with: a cluster
    # needs a real image and a bucket its pods see; processes on this machine need neither.
    needs_real: ClassVar[tuple[str, ...]] = ()

    # ------------------------------------------------------------------ made from the site settings
    @classmethod
    @abc.abstractmethod
    def from_settings(cls, settings: Settings, run_root: str | None = None) -> Backend:
        """The backend a command uses, from its resolved site settings (`run_root`: where this
        command's runs live, when not the settings' own)."""

    @classmethod
    def for_status(cls, handle: Handle, run_dir: str) -> Backend:
        """A backend that answers `status` for a journal's `handle` (monitor): quick to give up, so a
        refresh falls back to the journal instead of hanging."""
        raise NotImplementedError(f"backend {cls.name} cannot read back an attempt")

    @classmethod
    def placeholders(cls, settings: Settings) -> list[str]:
        """The settings of `needs_real` that still hold their placeholder (a submit refuses them; a
        dry run renders with them)."""
        return settings.placeholders(cls.needs_real)

    # ------------------------------------------------------------------ before anything is written
    def validate_target(
        self, target: Target, settings: Settings | None, run_dir: str, *, render_only: bool = False
    ) -> None:
        """Refuse (BadInput) a target this backend cannot run, with these site settings and a run
        directory there, without I/O: what a command can say from its command line alone, before it
        reads the run directory. `render_only`: the attempt is only printed (--dry-run), so
        placeholder settings are fine."""

    def settings_of(self, attempt: Attempt) -> Settings | None:
        """The site settings `attempt` renders with: its own, else the backend's."""
        return attempt.settings or self.settings

    def validate(self, attempt: Attempt, *, render_only: bool = False) -> None:
        """Refuse (BadInput) an attempt this backend cannot run, without I/O (by default what
        `validate_target` refuses)."""
        self.validate_target(
            attempt.target, self.settings_of(attempt), attempt.run_dir, render_only=render_only
        )

    def checks(self, attempt: Attempt) -> None:
        """Refuse (BadInput) an attempt that the backend's world cannot admit (objects it names that
        do not exist); called once per command, before the run is created or changed."""

    def notes(self, attempt: Attempt, *, render_only: bool = False) -> list[str]:
        """Remarks on how the attempt will run, for the person at the terminal (one line each)."""
        return []

    # ------------------------------------------------------------------ the attempt
    @abc.abstractmethod
    def render(self, attempt: Attempt) -> Req:  # pure; what --dry-run prints
        ...

    @abc.abstractmethod
    def send(self, request: Req) -> Handle: ...

    @staticmethod
    def printable(request: Any) -> Any:
        """The rendered request as plain data (YAML/JSON)."""
        return request.to_dict() if hasattr(request, "to_dict") else request

    @abc.abstractmethod
    def status(self, handle: Handle) -> AttemptStatus: ...

    @abc.abstractmethod
    def stop(self, handle: Handle, graceful: bool = True) -> None: ...

    def wait_gone(self, handle: Handle, timeout_s: float, poll_s: float) -> bool:
        """Wait until the stopped attempt can no longer write to the run directory; False on timeout.
        By default: until its status is no longer live."""
        deadline = time.monotonic() + timeout_s
        while self.status(handle).state.live:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        return True

    @abc.abstractmethod
    def logs(self, handle: Handle, tail: int = 50) -> list[str]: ...

    def hint(self, status: AttemptStatus) -> str:
        """What to do about an attempt that cannot go on as it is (its `config_error`, a
        deactivation, a failure), in this backend's own words and tools: one line for the terminal."""
        if status.config_error:
            return "fix what it names, then run the same command again"
        if status.deactivated:
            return "it is kept as it is; let it run again, then run the same command"
        return f"see the attempt's log: olmo-ctl logs RUN (backend {self.name})"

    def read_log(self, handle: Handle, host: int | None = None) -> tuple[str, list[str]]:
        """The attempt's whole log so far, for `olmo-ctl logs`: (where it was read, its lines). `host`:
        that host's lines only (BadInput when the attempt has no such host); None: every host's where
        the backend keeps them in one place, else the first failed host's, else host 0's. No lines
        when the attempt's logs are gone."""
        if host not in (None, 0):
            raise BadInput(f"the {self.name} backend keeps one log per attempt", "leave out --host")
        return "", self.logs(handle, 0)

    def progress(self, handle: Handle) -> LogProgress:
        """What the backend sees of the trainer's progress (step lines, a committed step) at no extra
        cost; empty where reading it would cost cluster calls (the run directory tells then)."""
        return LogProgress()

    @abc.abstractmethod
    def find_live(self, run: str, run_dir: str | None = None) -> Handle | None:
        """A live attempt of this run, if any (reattach). `run_dir` is the run's identity: an attempt
        of another run of the same name (another run root) is never this run's."""
        ...

    def live_attempts(self, run: str, run_dir: str | None = None) -> list[Handle]:
        """Every live attempt of this run, newest first: the lease holder stops any but its own (one a
        supervisor that lost the lease created anyway). By default only the newest is known."""
        h = self.find_live(run, run_dir)
        return [h] if h is not None else []
