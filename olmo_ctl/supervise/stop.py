"""`olmo-ctl stop`: end a run on purpose, at a checkpoint, so that nothing resubmits it.

    1. the run is complete, or has neither a live attempt nor a live supervisor: nothing to do
    2. `stop.json` and a `stop_requested` journal line: a supervisor that sees them ends instead of
       submitting the next attempt (it checks before each submission, after each attempt and while
       it backs off)
    3. the live attempt is stopped with its grace period: each trainer checkpoints its last completed
       step on SIGTERM (the local backend's processes; the pods of a deleted JobSet)
    4. the supervisor, if one held the run, is waited for until it released its lease; an attempt it
       submitted in between is stopped too
    5. `stopped` is journaled (so `monitor` and `runs` show the run as stopped) and stop.json removed

A later `resume-until-done` or `submit` continues the run from its last committed step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from olmo_ctl.backends.base import Backend, Handle
from olmo_ctl.core.errors import EXIT_TIMEOUT, OlmoCtlError
from olmo_ctl.rundir import RunDir
from olmo_ctl.supervise.attempts import live_attempt, stop_and_wait
from olmo_ctl.supervise.resize import supervisor_alive

REASON = "stopped on request (olmo-ctl stop)"


@dataclass
class StopResult:
    action: str  # "stopped" | "complete" | "idle" (nothing live to stop)
    committed_step: int
    final_step: int
    attempts: list[int] = field(default_factory=list)  # the attempts stopped
    supervisor: str | None = None  # the holder of the lease that ended


def stop_run(
    rundir: RunDir,
    backend: Backend,
    *,
    timeout_s: float = 900.0,
    poll_s: float = 1.0,
    log: Callable[[str], None] = lambda _: None,
) -> StopResult:
    # BadInput (exit 2) for a run that does not exist; the final step as amended
    final = int(rundir.recipe(pending=True).train.max_steps)
    committed = rundir.committed_step()
    lease = supervisor_alive(rundir)
    if rundir.last_attempt() is None and lease is None:  # never submitted: no backend to ask
        return StopResult("complete" if committed >= final else "idle", committed, final)
    handle, _ = live_attempt(rundir, backend)
    if handle is None and lease is None:
        return StopResult("complete" if committed >= final else "idle", committed, final)
    deadline = time.monotonic() + timeout_s
    newest = rundir.last_attempt() or {}
    rundir.request_stop(REASON, handle.attempt if handle else newest.get("attempt"))
    stopped: list[int] = []

    def stop(h: Handle) -> None:
        log(f"stopping attempt {h.attempt} ({h.name}): its trainer checkpoints on SIGTERM")
        left = max(1.0, deadline - time.monotonic())
        if not stop_and_wait(backend, h, graceful=True, timeout_s=left, poll_s=min(2.0, poll_s)):
            raise OlmoCtlError(
                f"attempt {h.attempt} ({h.name}) of run `{rundir.name}` is still stopping after "
                f"{timeout_s:g} s",
                f"it keeps checkpointing; check with `olmo-ctl monitor {rundir.path}` or run "
                f"`olmo-ctl stop {rundir.name}` again",
                EXIT_TIMEOUT,
            )
        stopped.append(h.attempt)

    if handle is not None:
        stop(handle)
    holder = lease.get("holder") if lease else None
    if lease is not None:
        log(f"waiting for the supervisor ({holder}) to end")
        while supervisor_alive(rundir) is not None:
            if time.monotonic() >= deadline:
                raise OlmoCtlError(
                    f"the supervisor of run `{rundir.name}` ({holder}) has not ended {timeout_s:g} s "
                    "after the stop request",
                    "it ends at its next poll; if it is hung, stop it (Ctrl-C) and run `olmo-ctl stop` again",
                    EXIT_TIMEOUT,
                )
            time.sleep(poll_s)
        late, _ = live_attempt(rundir, backend)  # submitted between its last check and our request
        if late is not None:
            stop(late)
    committed = rundir.committed_step()
    last = rundir.last_attempt() or {}
    rundir.append(
        "stopped",
        attempt=stopped[-1] if stopped else last.get("attempt"),
        device=last.get("device"),
        reason=f"{REASON} at committed step {committed}",
        committed_step=committed,
    )
    rundir.clear_stop()
    return StopResult("stopped", committed, final, stopped, holder)
