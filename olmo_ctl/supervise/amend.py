"""`olmo-ctl amend`: change a run from its next attempt on (core/amend.py says what may change).

1. the change is checked against the run's recipe as amended so far and recorded in run.yaml,
   pending (`RunDir.amend`); a refused one writes nothing
2. the live attempt goes on with the recipe it started with; the run's next attempt, whoever submits
   it (its supervisor, `submit`, `resize`), takes the amendment up from the step after the checkpoint
   it restores (`RunDir.bind_amendments`, called by `attempts.submit_next`)
3. with `restart`, the live attempt is stopped once its next checkpoint has committed: by the run's
   supervisor when one is live (`restart.json`; it submits the next attempt as after any stop),
   else here, under the run's lease, and the next attempt submitted at once
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from olmo_ctl.backends.base import Backend
from olmo_ctl.core.config import Settings
from olmo_ctl.rundir import LeaseHeld, RunDir
from olmo_ctl.supervise.attempts import live_attempt, prepare, run_target, submit_next
from olmo_ctl.supervise.resize import LEASE_TTL_S, stop_for_resize, supervisor_alive


@dataclass
class AmendResult:
    amendment: dict
    committed_step: int
    final_step: int  # the run's, as amended
    action: str  # pending (from the next attempt) | requested (its supervisor restarts) | restarted
    live_attempt: int | None = None
    attempt: int | None = None  # the attempt `restarted` submitted
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "amendment": self.amendment["id"],
            "changes": self.amendment["changes"],
            "action": self.action,
            "committed_step": self.committed_step,
            "final_step": self.final_step,
            "from_step": self.amendment.get("from_step"),
            "live_attempt": self.live_attempt,
            "attempt": self.attempt,
        }


def amend_run(
    rundir: RunDir,
    backend: Backend,
    sets: list[str] | tuple[str, ...],
    *,
    restart: bool = False,
    settings: Settings | None = None,
    timeout_s: float = 3600.0,
    log: Callable[[str], None] = lambda _: None,
) -> AmendResult:
    if restart:  # who drives the run is read below: an unreadable lease.json is bad input before any write
        rundir.read_lease()
    rec = rundir.amend(sets, restart=restart)  # BadInput, nothing written, for a change the run cannot take
    final = int(rundir.recipe(pending=True).train.max_steps)
    handle, _ = live_attempt(rundir, backend)
    res = AmendResult(rec, rec["committed_step"], final, "pending", handle.attempt if handle else None)
    if handle is None:
        res.notes.append("no live attempt: the run's next attempt takes the amendment up")
        return res
    if not restart:
        res.notes.append(
            f"attempt {handle.attempt} goes on as it started; the next attempt takes the amendment up "
            "(--restart: stop it at its next checkpoint)"
        )
        return res
    lease = None
    if supervisor_alive(rundir) is None:
        try:
            lease = rundir.acquire_lease(ttl_s=LEASE_TTL_S)
        except LeaseHeld:
            lease = None  # a supervisor took the run just now: it restarts the attempt
    if lease is None:
        req = rundir.request_restart(rec["id"], handle.attempt)
        res.action = "requested"
        res.notes.append(
            f"restart request {req['id']} recorded: the run's supervisor stops attempt {handle.attempt} at its "
            "next checkpoint and submits the next one"
        )
        return res
    try:

        def beat() -> None:
            rundir.heartbeat(lease)

        deadline = time.monotonic() + timeout_s
        committed, how = stop_for_resize(rundir, backend, handle, "at-next-checkpoint", deadline, beat, log)
        rundir.append(
            "restarted",
            attempt=handle.attempt,
            committed_step=committed,
            reason=f"stopped at step {committed} ({how}) for amendment {rec['id']}",
            fence=lease,
        )
        recipe = rundir.recipe(pending=True)
        request = prepare(backend, rundir.name, rundir.path, 0, run_target(rundir), recipe, settings=settings)
        new = submit_next(
            rundir,
            backend,
            request,
            f"restart for amendment {rec['id']}",
            committed_step=committed,
            fence=lease,
        )
        res.action, res.attempt, res.committed_step = "restarted", new.attempt, committed
        res.final_step = int(recipe.train.max_steps)
        res.amendment = next((a for a in rundir.amendments() if a.get("id") == rec["id"]), rec)
        return res
    finally:
        rundir.release_lease(lease)
