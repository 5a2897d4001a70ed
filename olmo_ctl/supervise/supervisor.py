"""`resume-until-done`: keep a run going, attempt after attempt, until its final step is committed.

A small explicit state machine; every transition prints one timestamped line and is journaled
with its reason:

    start ──► (committed >= final) ─────────────────────────────────────────► done (exit 0)
      │ lease held for the whole loop (a second supervisor exits 2, naming the holder)
      ▼
    find a live attempt (journal's last handle, then the backend) ──► watch   (reattach: never a
      │ none                                                            ▲      second submission)
      ▼                                                                 │
    backoff (only after a failed attempt) ──► submit ───────────────────┘
    watch: queued (waits, spends nothing) → admitted → running; stall check; resize requests;
           waiting for capacity (queued, requeued by Kueue for any reason, admitted with pods
           Unschedulable, on NotReady nodes or refused by a repaired node's kubelet): no budget, no
           deadline, journaled once as `waiting` (cause) and once as `waited` (cause, seconds);
           preempted by Kueue → the same attempt is queued again (its pods checkpoint on SIGTERM,
           Kueue resumes the same JobSet on readmission): nothing deleted, no budget spent
      ├─ succeeded and final step committed ──────────────────────────────► done (exit 0)
      ├─ failed-user ─────────────────────────────► failed (exit 1, last log lines) unless retried
      ├─ a queue set-up Kueue can never admit ────► failed (exit 2, naming the missing object)
      ├─ the Workload deactivated (spec.active=false) ─► deactivated (exit 130, the attempt kept)
      ├─ pods refused by the API server past --admission-timeout ─► failed (exit 2, naming why)
      ├─ admitted, not running past --admission-timeout, no wait cause ─► stopped, failed-infra ─┐
      ├─ preempted (terminal) / failed-infra / missing / stalled ─► retry budget ◄──────────────┘
      │                                     progress refills it; N in a row without it ─► gave up (exit 4)
      ├─ a stop request (`olmo-ctl stop`: stop.json) ─► ends without resubmitting (exit 130)
      ├─ amended (`olmo-ctl amend`): ended at its old final step, or stopped at its next checkpoint
      │  for `--restart` (restart.json) ─► restarted: submit at once, the final step as amended
      └─ Ctrl-C ──► detach (exit 130, the attempt keeps running) or stop it (--stop-on-exit)

An attempt is deleted only once it is terminal, or when asked (resize, --stop-on-exit, a stall or
the admission deadline), and always with its pods' grace period (they checkpoint on SIGTERM).

The run finishing, failing, being resized (falling back to another device) or giving up is handed
to `notify` (the site settings' webhook and command, `supervise.notify`). Output is one line per
change (`Printer`) or one JSON object per line (`JsonlPrinter`, `-o jsonl`, for log shippers).

Waits are not failures, and each is journaled once when it starts (`waiting`, with its `cause`) and
once when it ends (`waited`, with `cause` and `seconds`):
  - `api-unreachable`: a Kubernetes call found no answer within its retry budget (a control-plane
    upgrade, an outage). Every backend call goes through `PatientBackend`, which waits with capped
    exponential backoff and calls again; the supervisor never exits because the API is down;
  - `image-pull`: the kubelet backs off pulling the image (a registry's 429, a timeout); bounded by
    `--image-pull-timeout` (exit 2 naming the image). A pull no retry fixes (InvalidImageName,
    ErrImageNeverPull, not found, denied, unauthorized) exits 2 at once, naming the image;
  - `deletion`: an ended attempt is still being deleted (its pods Terminating on a NotReady node
    until the node returns); the next attempt waits for it to be gone.
Storage unreachable past its own retries raises `Unreachable` (exit 3): the attempt is left
untouched. The clock and sleep are injectable, so tests drive it with a fake clock.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NoReturn, cast

from olmo_ctl.backends.base import AttemptStatus, Backend, Handle, State, Target
from olmo_ctl.backends.kube import ApiUnreachable
from olmo_ctl.core.contracts import primary_loss_tag
from olmo_ctl.core.devices import Device
from olmo_ctl.core.errors import (
    EXIT_BAD_INPUT,
    EXIT_GAVE_UP,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    BadInput,
    Interrupted,
    OlmoCtlError,
)
from olmo_ctl.observe.reader import read_scalars
from olmo_ctl.rundir import Lease, LeaseLost, RunDir, parse_iso, run_recipe, utc_now_iso
from olmo_ctl.supervise import resize
from olmo_ctl.supervise.attempts import (
    last_handle,
    live_attempt,
    prepare,
    run_target,
    stop_and_wait,
    submit_next,
)
from olmo_ctl.supervise.policy import (
    DEFAULT_ADMISSION_TIMEOUT_S,
    DONE,
    GIVE_UP,
    STOP,
    CrashCount,
    Fallback,
    History,
    Outcome,
    RestartLoop,
    RetryPolicy,
    StallWatch,
    waiting_for,
)

API_BACKOFF_CAP_S = 300.0  # the longest pause between calls while the Kubernetes API is unreachable
# Off a terminal: a progress line only when the step moved, at most every PROGRESS_EVERY_S for the first
# PROGRESS_FAST_FOR_S after the first one (a short run, a demo: its steps seen as they go), then at
# most every PROGRESS_LATER_EVERY_S (a days-long run's log stays readable).
PROGRESS_EVERY_S = 10.0
PROGRESS_FAST_FOR_S = 600.0
PROGRESS_LATER_EVERY_S = 60.0


class Printer:
    """One timestamped line per state change; on a TTY a progress bar with step and ETA, elsewhere (a
    pipe, a `nohup` log) a progress line when the step moved, at most every `progress_every_s` for
    `PROGRESS_FAST_FOR_S`, then at most every `PROGRESS_LATER_EVERY_S` (or `progress_every_s`, if
    longer)."""

    def __init__(
        self,
        run: str,
        stream=None,
        clock: Callable[[], float] = time.time,
        progress_every_s: float = PROGRESS_EVERY_S,
    ):
        self.run = run
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.clock = clock
        self.progress_every_s = progress_every_s
        self._bar = False
        self._last_progress: tuple[float, int] | None = None  # (when, step) of the last progress line
        self._first_progress: float | None = None  # when the first progress line was printed

    def line(self, text: str) -> None:
        if self._bar:
            self.stream.write("\r\033[K")
            self._bar = False
        ts = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.clock()))
        self.stream.write(f"{ts} {self.run}: {text}\n")
        self.stream.flush()

    def record(self, rec: dict, text: str) -> None:
        """A journaled decision (`rec` is its journal record): one line."""
        self.line(text)

    def block(self, title: str, lines: list[str]) -> None:
        """A titled block of lines (a failed attempt's last log lines), indented under its line."""
        self.line(title)
        for ln in lines:
            self.stream.write(f"    {ln}\n")
        self.stream.flush()

    def progress(self, step: int, final: int, eta_s: float | None) -> None:
        if final <= 0:
            return
        eta = "?" if eta_s is None else _fmt_s(eta_s)
        if not self.tty:
            now = self.clock()
            last, first = self._last_progress, self._first_progress
            every = self.progress_every_s
            if first is not None and now - first >= PROGRESS_FAST_FOR_S:
                every = max(every, PROGRESS_LATER_EVERY_S)
            if last is not None and (step == last[1] or now - last[0] < every):
                return
            self._last_progress = (now, step)
            self._first_progress = now if first is None else first
            self.line(f"step {step}/{final} ({100 * min(step, final) / final:.1f}%), ETA {eta}")
            return
        width = 30
        done = int(width * min(step, final) / final)
        self.stream.write(f"\r\033[K[{'#' * done}{'.' * (width - done)}] step {step}/{final} ETA {eta}")
        self.stream.flush()
        self._bar = True


class JsonlPrinter(Printer):
    """`-o jsonl`: one JSON object per line and nothing else, for log shippers. A journaled decision is
    its journal record plus `run` and `text` (the line the table output prints); any other line is
    `{"time", "run", "event": "message", "text"}`; log lines are `{"event": "log_lines", "lines"}`."""

    def __init__(self, run: str, stream=None, clock: Callable[[], float] = time.time):
        super().__init__(run, stream, clock)
        self.tty = False  # no progress bar

    def _emit(self, obj: dict) -> None:
        self.stream.write(json.dumps(obj, default=str) + "\n")
        self.stream.flush()

    def line(self, text: str) -> None:
        self._emit({"time": utc_now_iso(self.clock()), "run": self.run, "event": "message", "text": text})

    def record(self, rec: dict, text: str) -> None:
        self._emit({**rec, "run": self.run, "text": text})

    def block(self, title: str, lines: list[str]) -> None:
        self._emit(
            {
                "time": utc_now_iso(self.clock()),
                "run": self.run,
                "event": "log_lines",
                "text": title,
                "lines": lines,
            }
        )


class PatientBackend:
    """The backend, with every call that finds the Kubernetes API unreachable (`ApiUnreachable`, after
    the call's own retry budget) handed to `down(error, failures_in_row)`, which waits, and then made
    again; `up()` is told when a call answers. Other attributes are the backend's own."""

    def __init__(self, backend, down: Callable[[ApiUnreachable, int], None], up: Callable[[], None]):
        self._backend, self._down, self._up = backend, down, up

    def __getattr__(self, name: str):
        attr = getattr(self._backend, name)
        if not callable(attr):
            return attr

        def patient(*args, **kwargs):
            failures = 0
            while True:
                try:
                    out = attr(*args, **kwargs)
                except ApiUnreachable as e:
                    failures += 1
                    self._down(e, failures)
                    continue
                self._up()
                return out

        return patient


def _fmt_s(s: float) -> str:
    s = int(max(0, s))
    h, m = divmod(s, 3600)
    m, sec = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


@dataclass
class Watched:
    """How a watched attempt ended (or why the watch stopped it)."""

    status: AttemptStatus
    stalled: str | None = None
    config_error: str | None = None
    deactivated: str | None = None  # who set spec.active=false on the Workload, and why
    restarted: str | None = None  # stopped at a checkpoint for `olmo-ctl amend --restart`


class Supervisor:
    def __init__(
        self,
        rundir: RunDir,
        backend,
        policy: RetryPolicy,
        *,
        device: Device | None = None,
        poll_s: float = 10.0,
        lease_ttl_s: float | None = None,
        stop_on_exit: bool = False,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        printer: Printer | None = None,
        rng: random.Random | None = None,
        reattach_hint: str = "",
        extra_args: tuple[str, ...] = (),
        slices: int | None = None,
        notify: Callable[[dict], None] | None = None,
        delete_patience_s: float | None = None,
        fallback: Fallback | None = None,
    ):
        self.rd = rundir
        self.fallback = fallback  # --fallback: the devices to move to when capacity stays away
        self.notify = notify  # told when the run finishes, fails, is resized or gives up
        self.extra_args = tuple(extra_args)  # trainer flags for every attempt (e.g. --allow-version-change)
        self.backend = cast(Backend, PatientBackend(backend, self._api_down, self._api_up))
        self.policy = policy
        self._asked = (device, slices)  # the command line's device and slice count (None: the run's own)
        self.target: Target | None = None  # the run's, once it is read (`_run`); a resize moves it
        self.poll_s = poll_s
        self.lease_ttl_s = lease_ttl_s or max(300.0, 6 * poll_s)
        self.stop_on_exit = stop_on_exit
        self.clock = clock
        self.sleep = sleep
        self.out = printer or Printer(rundir.name, clock=clock)
        self.rng = rng or random.Random()
        self.reattach_hint = reattach_hint or f"olmo-ctl resume-until-done {rundir.name}"
        self.lease: Lease | None = None
        self.handle: Handle | None = None
        self._slow_named: set[tuple] = set()  # (attempt, host, part) already journaled
        self._capacity_wait: dict | None = None  # the wait for capacity in progress: attempt, cause, since
        self._strays_checked = float("-inf")
        self._waits: dict[str, float] = {}  # cause -> since when the run waits for it
        # An ended attempt not gone after this long is journaled as a `deletion` wait (and waited for).
        self.delete_patience_s = delete_patience_s or 60 * min(30.0, 3 * poll_s)

    # ------------------------------------------------------------------ helpers

    @property
    def device(self) -> str | None:
        """The name of the device the run is on, as the journal and the terminal say it."""
        if self.target is not None:
            return self.target.name
        return None if self._asked[0] is None else self._asked[0].name

    @property
    def slices(self) -> int | None:
        return self.target.slices if self.target is not None else self._asked[1]

    def _journal(self, event: str, reason: str, **kw) -> dict:
        kw.setdefault("attempt", self.handle.attempt if self.handle else None)
        kw.setdefault("device", self.device)
        return self.rd.append(event, reason=reason, t=self.clock(), fence=self.lease, **kw)

    def _stop_note(self) -> str:
        """`; step 57 not checkpointed (...): resumes from 50` when the last attempt's trainer stopped
        without the time to write its checkpoint (its `exited` record says so), else ""."""
        from olmo_ctl.core.contracts import EXITED_EVENT, stop_unsaved_note

        journal = self.rd.journal()
        last = next((r.get("attempt") for r in reversed(journal) if r.get("event") == "submitted"), None)
        for r in reversed(journal):
            if r.get("event") == EXITED_EVENT and r.get("attempt") == last:
                note = stop_unsaved_note(r.get("stop_unsaved"))
                return f"; {note}" if note else ""
        return ""

    def _say(self, event: str, reason: str, **kw) -> dict:
        """A decision: journaled and printed as one line."""
        rec = self._journal(event, reason, **kw)
        a = kw.get("attempt", self.handle.attempt if self.handle else None)
        self.out.record(
            rec, f"{event}" + (f" (attempt {a})" if a else "") + (f": {reason}" if reason else "")
        )
        return rec

    def _tell(self, what: str, rec: dict, exit_code: int | None = None) -> None:
        """Hand a run-level outcome (finished, failed, resized, gave_up) to the notifier; a notifier
        never changes the run's outcome (supervise.notify reports its own failures)."""
        if self.notify is None:
            return
        final = getattr(self, "final", None)
        step = rec.get("committed_step")
        text = (
            f"run {self.rd.name} {what.replace('_', ' ')}"
            + (f" at step {step}/{final}" if step is not None and final else "")
            + (f": {rec['reason']}" if rec.get("reason") else "")
        )
        self.notify(
            {
                "run": self.rd.name,
                "event": what,
                "time": rec.get("time"),
                "run_dir": self.rd.path,
                "attempt": rec.get("attempt"),
                "device": rec.get("device"),
                "committed_step": step,
                "final_step": final,
                "reason": rec.get("reason", ""),
                "exit_code": exit_code,
                "text": text,
            }
        )

    def _stop_requested(self) -> dict | None:
        """A stop in progress (`olmo-ctl stop` wrote stop.json): the supervisor ends, submitting nothing."""
        return self.rd.pending_stop()

    def _stopped_on_request(self, req: dict, committed: int) -> int:
        self._say(
            "supervisor_stopped",
            f"stop requested ({req.get('reason') or 'olmo-ctl stop'}); no further attempt",
            committed_step=committed,
        )
        self.handle = None
        self.out.line(
            f"stopped on request at committed step {committed}/{self.final}; continue with: {self.reattach_hint}"
        )
        return EXIT_INTERRUPTED

    def _wait_started(self, cause: str, reason: str) -> float:
        """The run waits for `cause`: journaled (`waiting`) once, when it starts; returns since when."""
        if cause not in self._waits:
            self._waits[cause] = self.clock()
            self._say("waiting", reason, cause=cause, committed_step=self.rd.committed_step())
        return self._waits[cause]

    def _wait_ended(self, cause: str) -> None:
        """The wait for `cause` is over: journaled (`waited`, with its duration) once."""
        since = self._waits.pop(cause, None)
        if since is not None:
            seconds = round(self.clock() - since, 1)
            self._say("waited", f"{cause} over after {_fmt_s(seconds)}", cause=cause, seconds=seconds)

    def _api_down(self, error: ApiUnreachable, failures: int) -> None:
        """A Kubernetes call found no answer: wait (capped exponential backoff), renewing the lease."""
        self._wait_started("api-unreachable", f"the Kubernetes API is unreachable, waiting: {error.message}")
        self._wait(min(API_BACKOFF_CAP_S, max(self.poll_s, 1.0) * 2 ** min(failures - 1, 16)))

    def _api_up(self) -> None:
        if "api-unreachable" in self._waits:
            self._wait_ended("api-unreachable")

    def _on(self) -> str:
        return f"{self.device}" if (self.slices or 1) == 1 else f"{self.slices} x {self.device}"

    def _beat(self) -> None:
        if self.lease is not None:
            self.rd.heartbeat(self.lease, now=self.clock())

    def _wait(self, seconds: float) -> None:
        """Sleep, renewing the lease at least every poll."""
        end = self.clock() + seconds
        while True:
            left = end - self.clock()
            if left <= 0:
                return
            self.sleep(min(left, self.poll_s))
            self._beat()
            if self._stop_requested() is not None:
                return  # the loop ends the run instead of submitting

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        self.lease = self.rd.acquire_lease(ttl_s=self.lease_ttl_s, now=self.clock(), say=self.out.line)
        try:
            return self._run()
        except KeyboardInterrupt:
            return self._interrupted()
        except LeaseLost as e:
            self.lease = None
            self.out.line(f"stopping: {e.message}")
            raise
        except OlmoCtlError as e:
            if e.exit_code == EXIT_UNREACHABLE:  # the attempt is left as it is
                self.out.line(f"stopping, the attempt left untouched: {e.one_line()}")
                try:
                    self._journal("supervisor_stopped", f"unreachable: {e.one_line()}")
                except OlmoCtlError:
                    pass
            raise
        finally:
            if self.lease is not None:
                self.rd.release_lease(self.lease, now=self.clock())

    def _run(self) -> int:
        # Every attempt renders from it; amendments (`olmo-ctl amend`) are taken up between attempts.
        self.recipe = self.rd.recipe(pending=True)
        self.final = int(self.recipe.train.max_steps)
        if self._stop_requested() is not None:
            # Left by a stop that ran while no supervisor did (or did not finish): starting a supervisor
            # continues the run on purpose.
            self.rd.clear_stop()
        self.target = run_target(self.rd, *self._asked)
        self._preferred, self._fell_back_at = self._device_timeline()
        committed = self.rd.committed_step()
        history = History(best_step=committed)
        self._say(
            "supervisor_started",
            f"committed step {committed}/{self.final}; holder {self.lease.holder if self.lease else '-'}",
            committed_step=committed,
            attempt=None,
        )
        self.handle, st = live_attempt(self.rd, self.backend)
        # The previous attempt, over: deleted before a successor is submitted.
        ended = last_handle(self.rd, self.backend.name) if self.handle is None else None
        if self.handle is not None:
            self._say(
                "reattached",
                f"attempt {self.handle.attempt} is {st.state.value} ({self.handle.name})",
                committed_step=committed,
            )
        last_failure: str | None = None
        while True:
            committed = self.rd.committed_step()
            if self.handle is None:
                self._follow_amendments()
                if committed >= self.final:
                    return self._done(committed)
                stop = self._stop_requested()
                if stop is not None:
                    return self._stopped_on_request(stop, committed)
                if last_failure is not None:
                    delay = self.policy.backoff_s(history.failures_in_row, self.rng)
                    self._say(
                        "backoff",
                        f"waiting {delay:.0f} s before the next attempt after {last_failure}",
                        committed_step=committed,
                        delay_s=round(delay, 3),
                        attempt=None,
                    )
                    self._wait(delay)
                    committed = self.rd.committed_step()
                    stop = self._stop_requested()
                    if stop is not None:
                        return self._stopped_on_request(stop, committed)
                reason = (
                    "first attempt"
                    if self.rd.last_attempt() is None
                    else (
                        f"resume from step {committed}"
                        + (f" after {last_failure}" if last_failure else "")
                        + self._stop_note()
                    )
                )
                req = self.rd.pending_resize()
                if req is not None:  # recorded while no attempt ran: the next attempt goes to its device
                    self.handle = self._resize(None, req)
                if self.handle is None:
                    if ended is not None:
                        self._retire(ended)
                        ended = None
                    self._beat()  # a supervisor that lost its lease must not submit
                    assert self.target is not None  # read by _run before the loop
                    request = prepare(
                        self.backend,
                        self.rd.name,
                        self.rd.path,
                        0,
                        self.target,
                        self.recipe,
                        extra_args=self.extra_args,
                    )
                    self.handle = submit_next(
                        self.rd,
                        self.backend,
                        request,
                        reason,
                        committed_step=committed,
                        t=self.clock(),
                        fence=self.lease,
                        admission_timeout_s=self.policy.admission_timeout_s,
                    )
                    self.out.record(
                        self.rd.last_attempt() or {"event": "submitted", "attempt": self.handle.attempt},
                        f"submitted attempt {self.handle.attempt} on {self._on()} ({self.handle.name}): "
                        f"{reason}",
                    )
            watched = self._watch(self.handle)
            st = watched.status
            committed = self.rd.committed_step()
            if watched.deactivated:
                return self._deactivated(watched, committed)
            ran_final = self._follow_amendments()
            if watched.restarted or (st.state == State.SUCCEEDED and ran_final <= committed < self.final):
                # Not a failure: stopped for an amendment, or done with the horizon it was started with
                # while the run's was extended. The next attempt takes the amendments.
                why = watched.restarted or f"attempt {self.handle.attempt} reached its final step {ran_final}"
                self._say("restarted", f"{why}; continuing to step {self.final}", committed_step=committed)
                self._retire(self.handle)
                self.handle, last_failure = None, None
                continue
            stop = self._stop_requested()
            if stop is not None and committed < self.final:
                return self._stopped_on_request(stop, committed)  # `stop` journals how the attempt ended
            action = self.policy.decide(
                Outcome(
                    st.state,
                    st.reason,
                    committed,
                    self.final,
                    watched.stalled,
                    st.exit_code,
                    watched.config_error,
                ),
                history,
            )
            history = action.history
            if action.kind == DONE:
                self._say(action.event, action.reason, committed_step=committed)
                return self._done(committed)
            if action.kind == STOP and action.exit_code == EXIT_BAD_INPUT:
                rec = self._say(action.event, action.reason, committed_step=committed, state=st.state.value)
                self._tell("failed", rec, EXIT_BAD_INPUT)
                self._retire(self.handle)  # nothing of it runs; gone, so the next try renders anew
                self.handle = None
                raise BadInput(
                    f"run `{self.rd.name}`: {watched.config_error}",
                    self.backend.hint(replace(watched.status, config_error=watched.config_error)),
                )
            if action.kind == STOP:
                rec = self._say(
                    action.event,
                    action.reason,
                    committed_step=committed,
                    state=st.state.value,
                    exit_code=st.exit_code,
                    last_log_lines=list(st.last_log_lines[-20:]),
                )
                self._tell("failed", rec, action.exit_code)
                self._show_logs(st)
                self.out.line(
                    "stopped: a deterministic failure of the training program is not retried "
                    "(fix it, or pass --retry-user-errors)"
                )
                self.handle = None
                return int(action.exit_code or 0)
            if action.journal:
                self._say(
                    action.event,
                    action.reason,
                    committed_step=committed,
                    state=st.state.value,
                    exit_code=st.exit_code,
                )
            if action.kind == GIVE_UP:
                rec = self._say(
                    "gave_up",
                    action.gave_up,
                    committed_step=committed,
                    last_log_lines=list(st.last_log_lines[-20:]),
                )
                self._tell("gave_up", rec, EXIT_GAVE_UP)
                self._show_logs(st)
                self.handle = None
                return int(action.exit_code or 0)
            last_failure = action.failure
            self._retire(self.handle)
            self.handle = None

    def _follow_amendments(self) -> int:
        """Take up the run's amendments (`olmo-ctl amend`): the final step and the recipe of the next
        attempt, pending ones included. Returns the final step of the attempts already submitted
        (the amendments bound so far)."""
        doc = self.rd.read_run()
        if not doc.get("amendments"):
            return self.final
        recipe = run_recipe(doc, self.rd.p("run.yaml"), pending=True)
        final = int(recipe.train.max_steps)
        if final != self.final:
            self.out.line(f"amended: final step {self.final} -> {final}")
        self.recipe, self.final = recipe, final
        return int(run_recipe(doc, self.rd.p("run.yaml")).train.max_steps)

    def _restart(self, h: Handle, request: dict) -> Watched:
        """`olmo-ctl amend --restart`: stop the attempt once its next checkpoint has committed (or at
        once when it is not training yet), so the next attempt takes the amendment."""
        self.out.line(
            f"restart request {request.get('id')}: stopping attempt {h.attempt} at its next checkpoint"
        )
        committed, how = resize.stop_for_resize(
            self.rd,
            self.backend,
            h,
            "at-next-checkpoint",
            time.monotonic() + 6 * 3600.0,
            self._beat,
            self.out.line,
        )
        self.rd.clear_restart()
        return Watched(
            self.backend.status(h),
            restarted=f"attempt {h.attempt} stopped at step {committed} ({how}) for the amendment",
        )

    def _retire(self, h: Handle) -> None:
        """Make sure an ended attempt is gone before the next one is submitted (a terminal JobSet
        still holds its name and may hold quota), with its pods' grace period: never grace 0. A delete
        that takes longer than `delete_patience_s` (pods Terminating on a NotReady node stay so until
        the node returns) is a `deletion` wait, never an error."""
        while not stop_and_wait(
            self.backend,
            h,
            graceful=True,
            timeout_s=self.delete_patience_s,
            poll_s=min(2.0, self.poll_s),
            heartbeat=self._beat,
        ):
            self._wait_started(
                "deletion",
                f"attempt {h.attempt} ({h.name}) is still being deleted after {_fmt_s(self.delete_patience_s)} "
                "(its pods are Terminating: a node that is NotReady finishes them when it returns); "
                "the next attempt waits until it is gone",
            )
            self._wait(self.poll_s)
        self._wait_ended("deletion")

    def _done(self, committed: int) -> int:
        loss = self._last_loss()
        rec = self._say(
            "done",
            f"final step {committed}/{self.final} committed" + (f", loss {loss}" if loss else ""),
            committed_step=committed,
            attempt=None,
            loss=loss,
        )
        self._tell("finished", rec, EXIT_OK)
        return EXIT_OK

    def _last_loss(self) -> str | None:
        """The final training loss: from the trainer's last step line, else from the run's events."""
        if self.handle is not None:
            seen = self.backend.progress(self.handle)
            if seen.loss is not None:
                return seen.loss
        try:
            s = read_scalars(self.rd.p("tensorboard")).series(primary_loss_tag())
            return f"{float(s.values[-1]):.4f}" if s is not None and len(s) else None
        except (OlmoCtlError, OSError, ValueError):
            return None  # the loss is a courtesy; the run is done either way

    def _show_logs(self, st: AttemptStatus) -> None:
        lines = list(st.last_log_lines) or (self.backend.logs(self.handle, 20) if self.handle else [])
        if lines:
            self.out.block("last log lines:", lines[-20:])

    def _interrupted(self) -> NoReturn:
        """Ctrl-C: journaled, then one line (Interrupted: stderr, exit 130) saying what keeps running.
        The attempt in hand may have ended since the loop last looked (its trainer exited between two
        polls, or the loop was retiring it): the backend is asked once, and an attempt it calls over
        is not said to keep running (a second Ctrl-C, or no answer, leaves it as the loop knew it)."""
        h = self.handle
        ended = None
        if h is not None:
            try:
                inner = getattr(self.backend, "_backend", self.backend)  # not PatientBackend's endless wait
                st = inner.status(h)
                ended = st if st.state.terminal else None
            except (Exception, KeyboardInterrupt):
                ended = None
        if h is not None and ended is not None:
            self._journal(
                "supervisor_detached",
                f"interrupted; attempt {h.attempt} had ended ({ended.state.value})",
                committed_step=self.rd.committed_step(),
            )
            why = f"{ended.state.value}: {ended.reason}" if ended.reason else ended.state.value
            raise Interrupted(
                f"attempt {h.attempt} has ended ({why}); nothing is running; continue with: {self.reattach_hint}"
            )
        if h is not None and self.stop_on_exit:
            self.out.line(f"interrupted: stopping attempt {h.attempt} (--stop-on-exit)")
            self.backend.stop(h, graceful=True)
            self._journal(
                "stopped", "interrupted with --stop-on-exit", committed_step=self.rd.committed_step()
            )
            raise Interrupted(
                f"attempt {h.attempt} stopped (--stop-on-exit); continue with: {self.reattach_hint}"
            )
        self._journal(
            "supervisor_detached",
            "interrupted; the attempt keeps running" if h else "interrupted",
            committed_step=self.rd.committed_step(),
        )
        if h is not None:
            raise Interrupted(
                f"detached: attempt {h.attempt} keeps running ({h.name}); reattach with: {self.reattach_hint}"
            )
        raise Interrupted(f"nothing is running; continue with: {self.reattach_hint}")

    # ------------------------------------------------------------------ watching one attempt

    def _watch(self, h: Handle) -> Watched:
        last_label: str | None = None
        stall: StallWatch | None = None
        sig = None
        admitted_at: float | None = None
        t0_step, t0 = self.rd.committed_step(), self.clock()
        last = self.rd.last_attempt() or {}
        # Event segments are named by their writer's start time: this attempt's are newer than its submission.
        since = (
            parse_iso(last["time"]) - 300 if last.get("attempt") == h.attempt and last.get("time") else 0.0
        )
        admission_limit = self._admission_limit(h, last)
        self._capacity_wait = self._open_wait(h)
        loop = RestartLoop(self.policy.restart_loop_limit)
        crashed = CrashCount()
        while True:
            self._beat()
            restart = self.rd.pending_restart()
            if restart is not None:
                if restart.get("attempt") in (None, h.attempt):
                    return self._restart(h, restart)
                self.rd.clear_restart()  # for an attempt that has ended: its successor has the amendment
            req = self.rd.pending_resize()
            if req is not None:
                resized = self._resize(h, req)
                assert resized is not None  # a live attempt's resize leaves an attempt (the old or the new)
                if resized.attempt != h.attempt:
                    self._end_wait(f"resized to attempt {resized.attempt}", attempt=h.attempt)
                h = self.handle = resized
                last_label, stall, sig, admitted_at = None, None, None, None
                admission_limit = self._admission_limit(h, self.rd.last_attempt() or {})
                loop = RestartLoop(self.policy.restart_loop_limit)
            st = self.backend.status(h)
            now = self.clock()
            self._stop_strays(h)
            # Evicted: Kueue requeues this same attempt (any reason but a deactivation); watched on.
            label = st.state.value
            if st.evicted:
                label = "preempted" if st.preempted else "requeued"
            waiting = None if st.state.terminal else waiting_for(st)
            if waiting is None:  # a wait ends before the line of what ended it
                self._end_wait("deactivated" if st.deactivated else label)
            if label != last_label:
                if st.state.live:
                    self._say(label, st.reason or label, committed_step=self.rd.committed_step())
                last_label = label
            if st.deactivated:
                return Watched(st, deactivated=st.deactivated)
            if st.state.terminal:
                return Watched(st)
            if st.config_error:
                return Watched(st, config_error=st.config_error)
            restarts = st.restarts
            # The committed step matters only when the JobSet restarted: listed then, not every poll.
            listed = loop.committed is None or restarts != loop.restarts
            committed_now = self.rd.committed_step() if listed else loop.committed
            loop_why = loop.observe(restarts, st.state == State.RUNNING, committed_now or 0)
            new_crashes, crash_why = crashed.observe(st.crashes, st.details.get("max_restarts"))
            for crash in new_crashes:
                self.out.line(f"attempt {h.attempt}: a crash on {crash}")
            loop_why = loop_why or crash_why
            if loop_why:
                self._say("stalled", loop_why, committed_step=loop.committed)
                self.backend.stop(h, graceful=True)
                return Watched(self.backend.status(h), stalled=loop_why)
            if st.image_pull is not None:
                since = self._wait_started(
                    "image-pull", f"the kubelet backs off pulling the image: {st.reason}"
                )
                limit = self.policy.image_pull_timeout_s
                if now - since > limit:
                    return Watched(
                        st,
                        config_error=f"image {st.image_pull} not pulled after {_fmt_s(now - since)} "
                        f"(--image-pull-timeout {limit:.0f} s): {st.reason}",
                    )
            elif "image-pull" in self._waits:
                self._wait_ended("image-pull")
            if waiting is not None:
                self._start_wait(*waiting)
            if self._fallback_move(st, now):
                continue  # the resize it asked for is carried out at the top of the loop
            if st.state != State.RUNNING:
                stall, sig = None, None  # a requeue or a restart starts over: start-up and compile again
            elif stall is None:
                p = self.policy
                stall = StallWatch(p.stall_factor, p.stall_min_s, p.startup_limit_s, started_at=now)
            # The admission timeout is for what cannot fix itself; a wait (for capacity, an image) has none.
            if st.state == State.ADMITTED and not st.evicted and waiting is None and st.image_pull is None:
                admitted_at = now if admitted_at is None else admitted_at
                if now - admitted_at > admission_limit:
                    cause = st.cause or st.reason
                    limit_why = (
                        f"admitted but not running after {now - admitted_at:.0f} s (--admission-timeout "
                        f"{admission_limit:.0f} s): {cause}"
                    )
                    self.out.line(f"stopping attempt {h.attempt}: {limit_why}")
                    if st.pods_refused:
                        # The API server refuses the pods (a ResourceQuota, Pod Security, a webhook):
                        # a configuration no retry changes. Exit 2 naming it; the attempt is retired.
                        return Watched(st, config_error=f"pods refused: {limit_why}")
                    self.backend.stop(h, graceful=True)
                    return Watched(
                        AttemptStatus(
                            State.FAILED_INFRA,
                            limit_why,
                            "supervisor --admission-timeout",
                            details=dict(st.details),
                            restarts=st.restarts,
                            workload=st.workload,
                        )
                    )
            else:
                admitted_at = None
            if st.state == State.RUNNING and stall is not None:
                committed = self.rd.committed_step()
                prog = self.backend.progress(h)
                self._name_slow_hosts(h, prog.slow_hosts)
                new_sig = (committed, self.rd.progress_signature(since_unix=since), prog.step)
                if sig is not None and new_sig != sig:
                    stall.progress(now)
                sig = new_sig
                step = max(committed, new_sig[2] or 0)
                eta = None
                if step > t0_step and now > t0:
                    eta = (self.final - step) * (now - t0) / (step - t0_step)
                self.out.progress(step, self.final, eta)
                why = stall.stalled(now)
                if why:
                    self._say("stalled", why, committed_step=committed)
                    self.backend.stop(h, graceful=True)
                    end = self.backend.status(h)
                    return Watched(end, stalled=why)
            self.sleep(self.poll_s)

    def _stop_strays(self, h: Handle) -> None:
        """Any live attempt of this run but ours was created by a supervisor that lost the lease (paused
        past its expiry while it created it): ours trains the same steps from the same checkpoints, so
        the stray is killed at once rather than left to write checkpoints next to ours."""
        now = self.clock()
        if now - self._strays_checked < min(60.0, 10 * self.poll_s):  # a list call and a status per attempt
            return
        self._strays_checked = now
        for other in self.backend.live_attempts(self.rd.name, self.rd.path):
            if other.attempt != h.attempt:
                self._say(
                    "stray_stopped",
                    f"attempt {other.attempt} ({other.name}) runs beside attempt {h.attempt}: "
                    "created by a supervisor that lost the lease; stopped",
                    attempt=other.attempt,
                )
                self.backend.stop(other, graceful=False)

    def _name_slow_hosts(self, h: Handle, messages: tuple[str, ...]) -> None:
        """A slow host the trainer named: journaled and said once per attempt, not at every poll."""
        from olmo_ctl.core.stragglers import parse_slow_host_line

        for msg in messages:
            slow = parse_slow_host_line(msg)
            key = (h.attempt, slow.host, slow.part) if slow else (h.attempt, msg)
            if key not in self._slow_named:
                self._slow_named.add(key)
                self._say("slow_host", msg, committed_step=self.rd.committed_step())

    def _admission_limit(self, h: Handle, last: dict) -> float:
        """--admission-timeout of resume-until-done, else the one `submit` recorded for this attempt."""
        if self.policy.admission_timeout_s is not None:
            return float(self.policy.admission_timeout_s)
        recorded = last.get("admission_timeout_s") if last.get("attempt") == h.attempt else None
        return float(recorded) if recorded is not None else DEFAULT_ADMISSION_TIMEOUT_S

    # ------------------------------------------------------------------ waiting for capacity

    def _open_wait(self, h: Handle) -> dict | None:
        """A wait of this attempt journaled by an earlier supervisor and not ended (it detached or was
        stopped while waiting): carried on, so a wait is journaled once however often one reattaches."""
        last = None
        for r in self.rd.journal():
            if r.get("attempt") == h.attempt and r.get("event") in ("waiting", "waited"):
                last = r
        if last is None or last["event"] != "waiting":
            return None
        return {"attempt": h.attempt, "cause": last.get("cause"), "since": parse_iso(last["time"])}

    def _start_wait(self, cause: str, why: str) -> None:
        if self._capacity_wait is not None:
            return  # one wait, however its cause changes (queued, then admitted and unschedulable)
        assert self.handle is not None
        self._say("waiting", why, cause=cause, committed_step=self.rd.committed_step())
        self._capacity_wait = {"attempt": self.handle.attempt, "cause": cause, "since": self.clock()}

    def _end_wait(self, ended_by: str, attempt: int | None = None) -> None:
        w, self._capacity_wait = self._capacity_wait, None
        if w is None:
            return
        seconds = max(0.0, self.clock() - w["since"])
        self._say(
            "waited",
            f"{_fmt_s(seconds)} waiting for capacity ({w['cause']}); then {ended_by}",
            cause=w["cause"],
            seconds=round(seconds, 1),
            attempt=attempt if attempt is not None else w["attempt"],
            committed_step=self.rd.committed_step(),
        )

    def _deactivated(self, watched: Watched, committed: int) -> int:
        """spec.active=false: Kueue keeps the Workload and never runs it until someone sets it true.
        Respected: no new attempt, nothing deleted; one line naming who and why, exit 130."""
        h = self.handle
        assert h is not None
        wl = watched.status.workload or "-"
        rec = self._say(
            "deactivated",
            f"{watched.deactivated}: {watched.status.reason}",
            committed_step=committed,
            workload=wl,
        )
        self._tell("failed", rec, EXIT_INTERRUPTED)
        self.handle = None
        self.out.line(
            f"stopped: Workload {wl} of attempt {h.attempt} is deactivated by {watched.deactivated}; "
            f"the attempt is kept and no new one submitted. To go on: {self.backend.hint(watched.status)}, "
            f"then {self.reattach_hint}"
        )
        return EXIT_INTERRUPTED

    # ------------------------------------------------------------------ fallback devices

    def _device_timeline(self) -> tuple[str, float | None]:
        """The preferred device (the one the run last fell back from while on it; else the current one)
        and when the run fell back last (None: it is on the preferred device), from the journal."""
        preferred, at = str(self.device), None
        for r in self.rd.journal():
            if r.get("event") == "fallback":
                if at is None:  # a fallback from the preferred device starts a chain
                    preferred = str(r.get("from") or preferred)
                at = parse_iso(r["time"])
            elif r.get("event") == "returned":
                at = None
        return preferred, (at if self.device != preferred else None)

    def _fallback_move(self, st: AttemptStatus, now: float) -> bool:
        """--fallback: when the attempt has waited for capacity past --fallback-after, ask to resize it to
        the next device; when it has trained on a fallback for --return-after, ask to go back to the
        preferred device (the fallback attempt checkpoints its last step on SIGTERM: a checkpoint
        boundary). True when a resize was asked for."""
        if self.fallback is None or self.rd.pending_resize() is not None:
            return False
        w = self._capacity_wait
        waiting_s = now - w["since"] if w is not None else None
        on_fallback_s = now - self._fell_back_at if self._fell_back_at is not None else None
        move = self.fallback.move(
            self._preferred, str(self.device), waiting_s, on_fallback_s, st.state == State.RUNNING
        )
        if move is None:
            return False
        kind, to = move
        committed = self.rd.committed_step()
        if kind == "fallback":
            why = (
                f"waited {_fmt_s(waiting_s or 0)} for capacity ({w['cause'] if w else '-'}) on {self.device}"
            )
            self._say(
                "fallback",
                f"{why}; continues on {to}",
                committed_step=committed,
                device=to,
                to=to,
                **{"from": self.device},
            )
            self._fell_back_at = now
            resize.record_request(self.rd, to, "now")
        else:
            why = f"trained {_fmt_s(on_fallback_s or 0)} on fallback {self.device}; tries {to} again"
            self._say("returned", why, committed_step=committed, device=to, to=to, **{"from": self.device})
            self._fell_back_at = None
            resize.record_request(self.rd, to, "now")
        return True  # the resize it asks for journals `resized` and tells the notifier

    def _resize(self, h: Handle | None, req: dict) -> Handle | None:
        self.out.line(f"resize request {req.get('id')}: to {req.get('device')}")
        new = resize.carry_out_request(
            self.rd, self.backend, h, req, heartbeat=self._beat, log=self.out.line, fence=self.lease
        )
        if new is None:
            return h
        self.target = self.rd.target() or self.target  # the attempt the resize submitted
        self.out.line(f"resized: attempt {new.attempt} on {self._on()}")
        self._tell(
            "resized",
            {
                "time": utc_now_iso(self.clock()),
                "attempt": new.attempt,
                "device": self.device,
                "committed_step": self.rd.committed_step(),
                "reason": f"continues on {self._on()}" + (f" ({req['reason']})" if req.get("reason") else ""),
            },
        )
        return new
