"""Retry and stall policy as data: pure functions of what happened, no clock or I/O of their own.

The supervisor asks these questions, each answered once here:
  - `waiting_for`: is a live attempt waiting for capacity (queued, requeued by Kueue, admitted with
    its pods Unschedulable, on NotReady nodes or refused by a just-repaired node's kubelet)? A wait
    spends no retry budget and has no deadline: capacity comes back by itself;
  - `RetryPolicy.decide`: an attempt ended; what now (done, stop, give up, or retry)? The whole
    outcome -> action table;
  - `backoff_s`: how long to wait before the next attempt (exponential with jitter, capped);
  - `RetryBudget.record`: does the run still have retries (only attempts that made no progress spend
    one; a committed step that advances refills the budget; a run still queued spends nothing);
  - `StallWatch.stalled`: has a running attempt stopped making progress (no new step, event or
    checkpoint for k x the median interval between them, or a start-up/compile over a limit)? And
    `RestartLoop.observe`: has its JobSet restarted in place again and again without a new checkpoint?
"""

from __future__ import annotations

import os
import random
import statistics
from dataclasses import dataclass, field

from olmo_ctl.backends.base import AttemptStatus
from olmo_ctl.core.contracts import State, final_committed
from olmo_ctl.core.errors import EXIT_BAD_INPUT, EXIT_GAVE_UP, EXIT_OK, EXIT_RUN_FAILED, BadInput
from olmo_ctl.observe.waiting import CAPACITY_CAUSES, wait_of

DEFAULT_BACKOFF_S = 300.0
DEFAULT_MAX_RETRIES = 5
DEFAULT_ADMISSION_TIMEOUT_S = 1800.0  # admitted (quota granted) until every pod runs; compile not included
# The kubelet backing off an image pull (a registry's 429 while a whole slice pulls after a repair):
# waited for this long before the run stops with exit 2 naming the image.
DEFAULT_IMAGE_PULL_TIMEOUT_S = 6 * 3600.0
DEFAULT_RESTART_LOOP_LIMIT = 6


def _env_number(name: str, kind: type, default):
    """`OLMO_CTL_<name>` (the prefix every other setting has), else the unprefixed `<name>` that
    earlier versions read, else `default`."""
    for var in ("OLMO_CTL_" + name, name):
        raw = os.environ.get(var)
        if raw is not None and raw.strip() != "":
            name = var
            break
    else:
        return default
    try:
        v = kind(raw)
    except ValueError:
        raise BadInput(f"env {name}={raw!r} is not a number", f"e.g. {name}={default}") from None
    if v < 0:
        raise BadInput(f"env {name}={raw!r} must be >= 0")
    return v


@dataclass(frozen=True)
class RetryPolicy:
    backoff_base_s: float = DEFAULT_BACKOFF_S
    backoff_cap_s: float = 3600.0
    jitter: float = 0.25  # the delay is drawn from [d * (1 - jitter), d]
    max_retries: int = DEFAULT_MAX_RETRIES  # attempts in a row without progress before giving up
    stall_factor: float = 20.0  # k: stalled after k x the median interval between progress signals
    stall_min_s: float = 300.0  # never call a run stalled sooner than this
    startup_limit_s: float = 1800.0  # start-up and compile until the first progress signal
    retry_user_errors: bool = False
    # Admitted but not every pod running for longer than this: stopped, an infrastructure failure.
    # None: the value `submit --admission-timeout` recorded for the attempt, else the default.
    admission_timeout_s: float | None = None
    # Pods waiting on ImagePullBackOff for longer than this: the run stops, exit 2 naming the image.
    image_pull_timeout_s: float = DEFAULT_IMAGE_PULL_TIMEOUT_S
    # In-place JobSet restarts that spend no maxRestarts, each after the trainers ran, with no new
    # committed step: at this many the attempt is stopped as a restart loop (`RestartLoop`).
    restart_loop_limit: int = DEFAULT_RESTART_LOOP_LIMIT

    @classmethod
    def from_env(
        cls,
        retry_backoff_s: float | None = None,
        max_retries: int | None = None,
        *,
        default_backoff_s: float = DEFAULT_BACKOFF_S,
        **kw,
    ) -> RetryPolicy:
        """Flags win over env (`OLMO_CTL_RETRY_BACKOFF_SECONDS`, `OLMO_CTL_MAX_RETRIES`; the unprefixed
        names too), which win over the defaults (`default_backoff_s`: the backend's own)."""
        base = (
            retry_backoff_s
            if retry_backoff_s is not None
            else _env_number("RETRY_BACKOFF_SECONDS", float, default_backoff_s)
        )
        n = max_retries if max_retries is not None else _env_number("MAX_RETRIES", int, DEFAULT_MAX_RETRIES)
        if kw.get("image_pull_timeout_s") is None:
            kw["image_pull_timeout_s"] = _env_number(
                "IMAGE_PULL_TIMEOUT_SECONDS", float, DEFAULT_IMAGE_PULL_TIMEOUT_S
            )
        if base < 0:
            raise BadInput(f"--retry-backoff {base} must be >= 0")
        if n < 1:
            raise BadInput(f"--max-retries {n} must be >= 1", "it is how many attempts in a row may fail")
        cap = max(kw.pop("backoff_cap_s", 3600.0), base)
        return cls(backoff_base_s=float(base), max_retries=int(n), backoff_cap_s=cap, **kw)

    def decide(self, outcome: Outcome, history: History) -> Action:
        """The outcome -> action table of `resume-until-done`, row by row (first match wins):

        | outcome                                            | event     | action  | exit |
        | final step committed (whatever the exit)           | succeeded | DONE    | 0    |
        | a configuration error (a queue, class or flavor    | failed    | STOP    | 2    |
        |   missing: Kueue would never admit the attempt;    |           |         |      |
        |   an image no node can pull, or not pulled within  |           |         |      |
        |   --image-pull-timeout)                            |           |         |      |
        | failed-user, not stalled, user errors not retried  | failed    | STOP    | 1    |
        | stalled (journaled when it was stopped)            | stalled   | RETRY   |      |
        | succeeded before the final step                    | failed    | RETRY   |      |
        | preempted                                          | preempted | RETRY   |      |
        | failed-infra, missing, failed-user (retried)       | failed    | RETRY   |      |
        and a RETRY that is the `max_retries`-th attempt in a row without a new committed step
        (progress refills the budget) becomes GIVE_UP (exit 4, `gave_up`: a crash loop).
        A preemption is not an outcome: Kueue requeues the same attempt, which is watched on (queued
        again) and spends nothing; so is an attempt waiting for capacity.
        """
        st = outcome.state
        if final_committed(outcome.committed, outcome.final):
            reason = (
                outcome.reason
                if st == State.SUCCEEDED
                else f"final step committed ({st.value}: {outcome.reason})"
            )
            return Action(DONE, "succeeded", reason, history, exit_code=EXIT_OK)
        if outcome.config_error:
            return Action(
                STOP,
                "failed",
                f"configuration error: {outcome.config_error}",
                history,
                exit_code=EXIT_BAD_INPUT,
            )
        if outcome.stalled:
            what, reason = "stalled", outcome.stalled
        elif st == State.SUCCEEDED:
            what, reason = (
                "failed",
                f"exited cleanly at committed step {outcome.committed} < final {outcome.final}",
            )
        elif st == State.PREEMPTED:
            what, reason = "preempted", outcome.reason
        else:
            what, reason = "failed", f"{st.value}: {outcome.reason}"
        if st == State.FAILED_USER and not self.retry_user_errors and not outcome.stalled:
            return Action(STOP, what, reason, history, exit_code=EXIT_RUN_FAILED)
        after = history.after(outcome.committed)
        if after.failures_in_row >= self.max_retries:
            diag = (
                f"{after.failures_in_row} attempts in a row ended without a new committed step "
                f"(still {outcome.committed}/{outcome.final}); last: {reason}"
            )
            return Action(
                GIVE_UP,
                what,
                reason,
                after,
                journal=not outcome.stalled,
                exit_code=EXIT_GAVE_UP,
                gave_up=f"crash loop: {diag}",
            )
        return Action(RETRY, what, reason, after, journal=not outcome.stalled)

    def backoff_s(self, failures_in_row: int, rng: random.Random | None = None) -> float:
        """Delay before the next attempt after `failures_in_row` consecutive attempts without progress.

        0 (the last attempt made progress, e.g. a preemption after hours of training) waits the base;
        each further failure doubles it, up to the cap; jitter spreads many runs preempted together.
        """
        d = min(self.backoff_cap_s, self.backoff_base_s * (2 ** max(0, failures_in_row - 1)))
        r = (rng or random).random()
        return d * (1.0 - self.jitter * r)


def waiting_for(st: AttemptStatus) -> tuple[str, str] | None:
    """(cause, why) when a live attempt waits for capacity, else None. The causes:
    `queued` (Kueue has not admitted it), `requeued` (Kueue evicted it and requeues the same Workload,
    for any reason: Preempted, NodeFailures, PodsReadyTimeout, AdmissionCheck, ...), `admission-checks`
    (quota reserved, checks pending), `unschedulable` (no node fits its pods: capacity), `node-not-ready`
    (its pods sit on NotReady nodes), `kubelet-admission` (the kubelet of a just-repaired node refused a
    pod). Not a wait: a deactivated Workload (a decision, not capacity) and pods refused by the API
    server (a configuration: `--admission-timeout` applies, then exit 2). The cause is the one `runs`
    and `monitor` print (`observe.waiting`) where the backend names what holds the attempt."""
    if st.deactivated or st.config_error:
        return None
    w = wait_of(st)
    if w is not None:
        return (w[0], st.reason) if w[0] in CAPACITY_CAUSES else None
    if st.state == State.QUEUED:  # a backend that does not name its holds
        if st.evicted:
            return "requeued", st.reason
        if "admission checks" in st.reason:
            return "admission-checks", st.reason
        return "queued", st.reason
    if st.state == State.ADMITTED and st.wait_cause:
        return st.wait_cause, st.reason
    return None


@dataclass(frozen=True)
class Outcome:
    """How a watched attempt ended (or why the watch stopped it), and where the run stands."""

    state: State
    reason: str = ""
    committed: int = 0  # the committed step after the attempt
    final: int = 0  # the run's final step
    stalled: str | None = None  # why the watch stopped a stalled attempt
    exit_code: int | None = None
    config_error: str | None = None  # what is missing for Kueue to ever admit the attempt


@dataclass(frozen=True)
class History:
    """Attempts in a row that ended without advancing the committed step, and the best step so far."""

    failures_in_row: int = 0
    best_step: int = 0

    def after(self, committed_step: int) -> History:
        if committed_step > self.best_step:
            return History(0, committed_step)
        return History(self.failures_in_row + 1, self.best_step)


# What the supervisor does next.
DONE = "done"  # the final step is committed: exit 0
STOP = "stop"  # a deterministic failure of the program (exit 1) or a configuration error (exit 2)
GIVE_UP = "give-up"  # a crash loop: exit 4
RETRY = "retry"  # back off, then submit the next attempt


@dataclass(frozen=True)
class Action:
    kind: str  # DONE | STOP | GIVE_UP | RETRY
    event: str  # the journal event of how the attempt ended (succeeded, failed, preempted, stalled)
    reason: str
    history: History  # the history after this attempt
    journal: bool = True  # False: the event is already journaled (a stall, when it was stopped)
    exit_code: int | None = None  # for DONE, STOP and GIVE_UP
    gave_up: str = ""  # for GIVE_UP: the `gave_up` record's reason

    @property
    def failure(self) -> str:
        """What the next backoff line names."""
        return f"{self.event} ({self.reason})"


@dataclass
class RetryBudget:
    """Counts attempts in a row that ended without advancing the committed step."""

    max_retries: int
    failures_in_row: int = 0
    best_step: int = 0

    def record(self, committed_step: int) -> bool:
        """Record an attempt that ended (not succeeded) with `committed_step` committed.

        Returns True while retries remain, False when `max_retries` attempts in a row made no
        progress (a crash loop).
        """
        if committed_step > self.best_step:
            self.best_step = committed_step
            self.failures_in_row = 0
        else:
            self.failures_in_row += 1
        return self.failures_in_row < self.max_retries


@dataclass
class StallWatch:
    """Progress of one running attempt: signals are new step lines, event segments or checkpoints."""

    factor: float
    min_s: float
    startup_limit_s: float
    started_at: float
    last_progress_at: float | None = None
    intervals: list[float] = field(default_factory=list)

    def progress(self, now: float) -> None:
        if self.last_progress_at is not None:
            self.intervals.append(now - self.last_progress_at)
            del self.intervals[:-50]
        self.last_progress_at = now

    def median_interval_s(self) -> float | None:
        return statistics.median(self.intervals) if self.intervals else None

    def limit_s(self) -> float:
        med = self.median_interval_s()
        return self.min_s if med is None else max(self.min_s, self.factor * med)

    def stalled(self, now: float) -> str | None:
        """A reason when the attempt is stalled, else None."""
        if self.last_progress_at is None:
            waited = now - self.started_at
            if waited > self.startup_limit_s:
                return f"no progress {waited:.0f} s after start (start-up/compile limit {self.startup_limit_s:.0f} s)"
            return None
        idle = now - self.last_progress_at
        limit = self.limit_s()
        if idle > limit:
            med = self.median_interval_s()
            why = f"{self.factor:g} x median interval {med:.1f} s" if med is not None else "minimum"
            return f"no new step, event or checkpoint for {idle:.0f} s (limit {limit:.0f} s: {why})"
        return None


@dataclass
class RestartLoop:
    """In-place JobSet restarts of one attempt that spend no `maxRestarts` (a lost peer, a pod that
    never started: the launch template's failure policy) are bounded here by progress instead: a
    restart counts when the attempt's trainers ran since the previous one, and a new committed step
    starts the count again. At `limit` the attempt is a restart loop (stopped like a stalled one)."""

    limit: int
    restarts: int = 0  # the JobSet's status.restarts when last seen
    counted: int = 0  # restarts after a run, since the last new committed step
    ran: bool = False  # the trainers ran since the last restart seen
    committed: int | None = None

    def observe(self, restarts: int, running: bool, committed: int) -> str | None:
        """The JobSet's restart count, whether every pod runs now, and the committed step; a reason
        when the attempt is in a restart loop, else None."""
        if self.committed is None:  # restarts before the watch began are not known to be a loop
            self.restarts, self.committed = restarts, committed
        elif committed > self.committed:
            self.counted, self.committed = 0, committed
        if restarts > self.restarts:
            self.counted += 1 if self.ran else 0
            self.restarts, self.ran = restarts, False
        self.ran = self.ran or running
        if self.counted >= self.limit:
            return (
                f"the JobSet restarted {self.counted} times after its trainers ran with no new "
                f"checkpoint since step {self.committed} (a restart loop; limit {self.limit})"
            )
        return None


@dataclass
class CrashCount:
    """Crashes of one attempt (its child Jobs failed on a counting rule), counted by olmo-ctl whatever
    JobSet counted: a crashed slice's Job Failed after a peer slice's lost peer restarts the JobSet
    without spending maxRestarts (RestartOnLostPeer matched first). Past the JobSet's `maxRestarts`
    the attempt has crashed as often as JobSet would allow (stopped like a stalled one)."""

    seen: dict[str, str] = field(default_factory=dict)  # Job uid -> "job: message"

    def observe(
        self, crashes: tuple[tuple[str, str, str], ...], max_restarts: int | None
    ) -> tuple[list[str], str | None]:
        """The crashes of a status: the new ones (for the log), and a reason once more than
        `max_restarts` were seen (None: the JobSet's limit is not known, or not reached)."""
        new = []
        for job, uid, msg in crashes:
            if uid and uid not in self.seen:
                self.seen[uid] = f"{job}: {msg}"
                new.append(self.seen[uid])
        if max_restarts is not None and len(self.seen) > max_restarts:
            return new, (
                f"{len(self.seen)} crashes counted, more than the JobSet's maxRestarts {max_restarts} (a crashed "
                f"slice's Job that failed after another slice's lost peer is not counted by JobSet); last: "
                f"{list(self.seen.values())[-1]}"
            )
        return new, None


@dataclass(frozen=True)
class Fallback:
    """`resume-until-done --fallback A,B --fallback-after D --return-after D`: the devices a run moves to
    when its attempt has waited for capacity longer than `after_s` (each in turn, the same global batch
    and data order through the resize path), and how long it trains on a fallback before it tries the
    preferred device again at a checkpoint boundary (None: it stays)."""

    devices: tuple[str, ...]
    after_s: float
    return_after_s: float | None = None

    def chain(self, preferred: str) -> tuple[str, ...]:
        return (preferred, *[d for d in self.devices if d != preferred])

    def move(
        self,
        preferred: str,
        current: str,
        waiting_s: float | None,
        on_fallback_s: float | None,
        running: bool,
    ) -> tuple[str, str] | None:
        """("fallback", device) when the attempt has waited past `after_s` and a next device is left;
        ("return", preferred) when it has trained on a fallback for `return_after_s`; else None."""
        chain = self.chain(preferred)
        if waiting_s is not None and waiting_s > self.after_s:
            i = chain.index(current) if current in chain else 0
            return ("fallback", chain[i + 1]) if i + 1 < len(chain) else None
        if (
            running
            and current != preferred
            and self.return_after_s is not None
            and on_fallback_s is not None
            and on_fallback_s >= self.return_after_s
        ):
            return ("return", preferred)
        return None
