"""`olmo-ctl logs`: an attempt's log, read through the backend that ran it, once or followed.

The attempt comes from the journal (`submitted` records carry each attempt's backend handle): the
newest one, or `--attempt N`. The backend reads it (`Backend.read_log`): the local backend's
`logs/attempt-<N>.log` (every host's lines, prefixed `host <h>: `; `--host H` keeps one host's),
a GKE attempt's pod (`--host H`: the H-th TPU VM in slice, worker order; default the failed pod, else
host 0) through the Kubernetes API. An attempt whose logs are gone (a deleted JobSet's pods) shows
the last lines the supervisor journaled for it, with a note saying so.

Following polls: each round asks the attempt's status, reads the log and prints the lines past
those already printed; it ends after the first read that follows a terminal status (so the last
lines are never cut off). A log that changes source (another pod) is printed from its start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from olmo_ctl.backends.base import Backend, Handle
from olmo_ctl.core.errors import BadInput
from olmo_ctl.rundir import RunDir


@dataclass
class AttemptLog:
    attempt: int
    handle: Handle
    where: str  # the file or pod it was read from ("journal" for the journaled last lines)
    lines: list[str]
    note: str = ""  # for the person at the terminal (e.g. why only journaled lines are shown)


def attempt_handle(rundir: RunDir, attempt: int | None = None) -> Handle:
    """The handle of attempt `attempt` (None: the newest) from the run's journal."""
    subs = [
        r for r in rundir.journal() if r.get("event") == "submitted" and isinstance(r.get("handle"), dict)
    ]
    if not subs:
        rundir.read_run()  # a run that does not exist says so (exit 2)
        raise BadInput(
            f"run `{rundir.name}` has no submitted attempt yet",
            f"start one: olmo-ctl resume-until-done {rundir.name}",
        )
    if attempt is None:
        return Handle.from_dict(subs[-1]["handle"])
    for r in reversed(subs):
        if r.get("attempt") == attempt:
            return Handle.from_dict(r["handle"])
    nums = sorted({int(r["attempt"]) for r in subs if r.get("attempt") is not None})
    raise BadInput(
        f"run `{rundir.name}` has no attempt {attempt}",
        f"its attempts: {', '.join(map(str, nums))}",
    )


def _journaled_lines(rundir: RunDir, attempt: int) -> list[str]:
    recs = [r for r in rundir.journal() if r.get("attempt") == attempt and r.get("last_log_lines")]
    return list(recs[-1]["last_log_lines"]) if recs else []


def read_attempt_log(rundir: RunDir, backend: Backend, handle: Handle, host: int | None = None) -> AttemptLog:
    where, lines = backend.read_log(handle, host)
    if lines or backend.status(handle).state.live:
        return AttemptLog(handle.attempt, handle, where, lines)
    journaled = _journaled_lines(rundir, handle.attempt)
    if journaled:
        return AttemptLog(
            handle.attempt,
            handle,
            "journal",
            journaled,
            f"attempt {handle.attempt}'s log is gone ({handle.name}); its last lines as the supervisor "
            "journaled them",
        )
    return AttemptLog(handle.attempt, handle, where, [], f"attempt {handle.attempt} left no log lines")


def follow(
    backend: Backend,
    handle: Handle,
    emit: Callable[[str], None],
    *,
    host: int | None = None,
    poll_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
    on_source: Callable[[str], None] = lambda _: None,
) -> None:
    """Print the attempt's log as it grows until the attempt ends (see the module docstring)."""
    where, printed = None, 0
    while True:
        live = backend.status(handle).state.live
        src, lines = backend.read_log(handle, host)
        if src != where or len(lines) < printed:
            if where is not None and src:
                on_source(src)
            where, printed = src, 0
        for ln in lines[printed:]:
            emit(ln)
        printed = len(lines)
        if not live:
            return
        sleep(poll_s)
