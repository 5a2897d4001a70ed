"""Resize: continue a run on another device at the same global batch.

A resize is "commit the latest state, stop the attempt, submit the next attempt on the new device".
The global batch, sequence length and so tokens per step never change: `batching.make_plan` recomputes
only the per-device batch and the accumulation for the new device count, and a device that cannot
hold the global batch exactly is refused before anything is touched. The trainer restores the
checkpoint into the new mesh's shardings (Orbax reshards on restore), and the data loader's state
is global, so the next attempt continues at step N+1 with batch N+1.

Who acts: the run's lease decides. When a live supervisor holds it, `resize` only records the
request (`<run>/resize.json`, journal `resize_requested`) and the supervisor carries it out between
two of its own polls, so the two never both submit. Otherwise `resize` takes the lease itself for
the duration, so a supervisor started meanwhile waits instead of racing it.

Modes: `now` stops the attempt at once (SIGTERM / JobSet deletion: the trainer finishes the step in
flight, checkpoints it and exits 143); `at-next-checkpoint` first waits for the next scheduled
checkpoint to commit, so no progress rests on the stop's grace period.
"""

from __future__ import annotations

import difflib
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from olmo_ctl.backends.base import Attempt, Backend, State, Target
from olmo_ctl.backends.jobset import dump_yaml
from olmo_ctl.core.batching import Plan, make_plan, read_launch_record
from olmo_ctl.core.devices import Device
from olmo_ctl.core.errors import EXIT_TIMEOUT, BadInput, OlmoCtlError
from olmo_ctl.rundir import LeaseHeld, _holder_process_dead, utc_now_iso
from olmo_ctl.supervise.attempts import last_handle, prepare, stop_and_wait, submit_next

MODES = ("now", "at-next-checkpoint")
PLAN_FIELDS = (
    "device",
    "devices",
    "global_batch",
    "per_device_batch",
    "grad_accum",
    "seq_len",
    "tokens_per_step",
    "estimated_bytes_per_device",
)
LEASE_TTL_S = 600.0  # resize may block in a graceful stop (the trainer writing its checkpoint)


class ResizeTimeout(OlmoCtlError):
    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message, hint, EXIT_TIMEOUT)


# ---------------------------------------------------------------- planning (pure)


@dataclass(frozen=True)
class ResizePlan:
    run: str
    from_attempt: int
    to_attempt: int
    old: Plan
    new: Plan
    old_request: Any = None  # the rendered requests (JobSet dicts, or local command lines)
    new_request: Any = None
    new_attempt: Attempt | None = None  # the attempt request `new_request` was rendered from

    def plan_lines(self) -> list[str]:
        """`field  old -> new` for every plan field; the invariant ones say so (slices: when multislice)."""
        out = []
        fields = PLAN_FIELDS if self.old.slices == self.new.slices == 1 else ("slices", *PLAN_FIELDS)
        for f in fields:
            a, b = getattr(self.old, f), getattr(self.new, f)
            if f == "estimated_bytes_per_device":
                f, a, b = "estimated GiB/device", f"{a / 2**30:.1f}", f"{b / 2**30:.1f}"
            same = " (unchanged)" if a == b and f in ("global_batch", "seq_len", "tokens_per_step") else ""
            out.append(f"{f:<22}{a} -> {b}{same}")
        return out

    def manifest_diff(self) -> str:
        return request_diff(
            self.old_request,
            self.new_request,
            f"attempt {self.from_attempt} ({on(self.old)})",
            f"attempt {self.to_attempt} ({on(self.new)})",
        )

    def to_dict(self) -> dict:
        return {
            "run": self.run,
            "from_attempt": self.from_attempt,
            "to_attempt": self.to_attempt,
            "old": {f: getattr(self.old, f) for f in ("slices", *PLAN_FIELDS)},
            "new": {f: getattr(self.new, f) for f in ("slices", *PLAN_FIELDS)},
        }


def on(plan: Plan) -> str:
    """What a plan runs on: `v5p-256`, or `2 x v5p-256` for multislice."""
    return plan.device if plan.slices == 1 else f"{plan.slices} x {plan.device}"


def _on_gke(device) -> bool:
    """TPU slices and GPU nodes run on GKE (a resize may move between them); cpu-N and gpu-N locally."""
    return bool(device.is_tpu or device.is_gpu_nodes)


def plan_resize(
    recipe,
    old_device,
    new_device,
    run: str,
    from_attempt: int,
    to_attempt: int,
    old_slices: int = 1,
    new_slices: int = 1,
) -> ResizePlan:
    """The old and new plans of a resize (from `old_slices` x `old_device` to `new_slices` x
    `new_device`); BadInput when the new one cannot hold the global batch."""
    if old_device.name == new_device.name and old_slices == new_slices:
        where = new_device.name if new_slices == 1 else f"{new_slices} x {new_device.name}"
        raise BadInput(
            f"run `{run}` already runs on {where}", "name another device or slice count (--slices)"
        )
    if _on_gke(old_device) != _on_gke(new_device):
        raise BadInput(
            f"cannot resize `{run}` from {old_device.name} to {new_device.name}: one runs on GKE (a TPU "
            "slice or GPU nodes), the other is a local device",
            "a resize stays on the run's backend (GKE: TPU slices and GPU nodes, either way; local <-> local)",
        )
    old = make_plan(recipe, old_device, old_slices)
    new = make_plan(recipe, new_device, new_slices, keep_batch=True)  # amend refuses another batch
    # make_plan holds these by construction; a resize that changed them would silently change the run.
    for f in ("global_batch", "seq_len", "tokens_per_step", "max_steps"):
        if getattr(old, f) != getattr(new, f):
            raise AssertionError(f"resize would change {f}: {getattr(old, f)} -> {getattr(new, f)}")
    return ResizePlan(run, from_attempt, to_attempt, old, new)


def _request_text(request: Any) -> str:
    if request is None:
        return ""
    return dump_yaml(_summarized(Backend.printable(request)))


def _summarized(x: Any) -> Any:
    """A rendered request with each `--plan` launch record (a line of JSON hundreds of characters
    long, whose values the plan lines above the diff give) shown as a short summary."""
    if isinstance(x, dict):
        return {k: _summarized(v) for k, v in x.items()}
    if isinstance(x, list):
        return [
            _plan_summary(v) if i and x[i - 1] == "--plan" and isinstance(v, str) else _summarized(v)
            for i, v in enumerate(x)
        ]
    return x


def _plan_summary(record: str) -> str:
    try:
        target, plan = read_launch_record(record)
    except BadInput:
        return record
    return f"<plan: {target.on}, per-device batch {plan.per_device_batch} x {plan.grad_accum}>"


def request_diff(old: Any, new: Any, old_name: str, new_name: str) -> str:
    """A unified diff of two rendered requests (a JobSet's YAML, or a local command line and env),
    each `--plan` record summarized."""
    a, b = _request_text(old).splitlines(), _request_text(new).splitlines()
    return "\n".join(difflib.unified_diff(a, b, fromfile=old_name, tofile=new_name, lineterm="", n=2))


# ---------------------------------------------------------------- the run's current attempt


def current_attempt(rundir) -> tuple[int, str, Any]:
    """(attempt number, device, handle or None) of the run's newest submitted attempt."""
    last = rundir.last_attempt()
    if last is None:
        doc = rundir.read_run()
        return 0, doc.get("device"), None
    return int(last.get("attempt") or 0), last.get("device"), last_handle(rundir)


def prepare_resize(rundir, backend, to_device: Device, to_slices: int | None = None) -> ResizePlan:
    """Plan the resize of the run in `rundir` to `to_slices` x `to_device` (None: the run's own slice
    count), with both attempts rendered (no side effect)."""
    recipe = rundir.recipe(pending=True)
    attempt = int((rundir.last_attempt() or {}).get("attempt") or 0)  # no handle needed here
    old_target = rundir.target()
    if old_target is None:
        raise BadInput(f"run `{rundir.name}` records no device", "submit it first")
    done = rundir.committed_step()
    if done >= recipe.train.max_steps:
        raise BadInput(
            f"run `{rundir.name}` is complete (checkpoint {done} of {recipe.train.max_steps} committed)",
            "there is nothing left to run on another device",
        )
    nxt = max(attempt, rundir.next_attempt_number() - 1) + 1
    slices = old_target.slices
    to_slices = slices if to_slices is None else to_slices
    new_target = Target.of(to_device, to_slices)
    rp = plan_resize(
        recipe, old_target.device, new_target.device, rundir.name, attempt, nxt, slices, to_slices
    )
    old_req = (
        backend.render(
            prepare(backend, rundir.name, rundir.path, max(attempt, 1), old_target, recipe, plan=rp.old)
        )
        if attempt
        else None
    )
    new_att = prepare(backend, rundir.name, rundir.path, nxt, new_target, recipe, plan=rp.new)
    return ResizePlan(
        rp.run, rp.from_attempt, rp.to_attempt, rp.old, rp.new, old_req, backend.render(new_att), new_att
    )


# ---------------------------------------------------------------- requests for a supervisor


def supervisor_alive(rundir, now: float | None = None) -> dict | None:
    """The lease document when a live supervisor holds the run, else None."""
    lease = rundir.read_lease()
    if not lease or not lease.get("holder") or lease.get("released"):
        return None
    now = time.time() if now is None else now
    if now - float(lease.get("heartbeat_unix", 0)) > float(lease.get("ttl_s", 0)):
        return None
    if _holder_process_dead(lease):
        return None
    return lease


def record_request(rundir, device: str, mode: str, plan: ResizePlan | None = None) -> dict:
    """Write `<run>/resize.json` for the supervisor and journal `resize_requested`."""
    if mode not in MODES:
        raise BadInput(f"resize mode `{mode}` is not one of {', '.join(MODES)}")
    doc: dict[str, object] = {
        "device": device,
        "mode": mode,
        "reason": f"resize to {on(plan.new) if plan else device} ({mode})",
        "time": utc_now_iso(),
        "id": uuid.uuid4().hex[:8],
    }
    if plan is not None:
        doc["slices"] = plan.new.slices
    rundir.store.write_text(rundir.p("resize.json"), json.dumps(doc))
    rundir.append(
        "resize_requested",
        device=device,
        reason=doc["reason"],
        request=doc["id"],
        mode=mode,
        plan=plan.to_dict() if plan else None,
    )
    return doc


def wait_for_request(rundir, request_id: str, timeout_s: float, poll_s: float = 1.0) -> dict:
    """Wait until the supervisor journals `resized` and the new attempt's `submitted` (or a refusal) for
    `request_id`."""
    deadline = time.monotonic() + timeout_s
    while True:
        journal = rundir.journal()
        for i, rec in enumerate(journal):
            if rec.get("request") != request_id:
                continue
            if rec.get("event") == "resize_refused":
                return rec
            # `resized` is journaled just before the new attempt's `submitted`: wait for both.
            if rec.get("event") == "resized" and any(
                r.get("event") == "submitted" and r.get("attempt") == rec.get("attempt")
                for r in journal[i + 1 :]
            ):
                return rec
        if time.monotonic() >= deadline:
            raise ResizeTimeout(
                f"the supervisor has not carried out resize request {request_id} within "
                f"{timeout_s:g} s; it stays recorded in {rundir.p('resize.json')}",
                "watch `olmo-ctl monitor`; the supervisor carries it out at its next poll",
            )
        time.sleep(poll_s)


# ---------------------------------------------------------------- carrying a resize out


@dataclass
class ResizeResult:
    run: str
    action: str  # resized | requested | resubmitted
    from_device: str
    to_device: str
    committed_step: int | None = None
    attempt: int | None = None
    handle: Any = None
    request: dict | None = None
    notes: list[str] = field(default_factory=list)


def _stop_and_wait(backend, handle, deadline: float, heartbeat: Callable[[], None]) -> None:
    """Stop the attempt and block until it can no longer write to the run directory."""
    if not stop_and_wait(
        backend,
        handle,
        graceful=True,
        timeout_s=max(0.0, deadline - time.monotonic()),
        poll_s=1.0,
        heartbeat=heartbeat,
    ):
        raise ResizeTimeout(
            f"attempt {handle.attempt} ({handle.name}) did not stop in time",
            "it is still terminating; run the same resize again to continue once it is gone",
        )


def stop_for_resize(
    rundir,
    backend,
    handle,
    mode: str,
    deadline: float,
    heartbeat: Callable[[], None] = lambda: None,
    log: Callable[[str], None] = lambda s: None,
    poll_s: float = 2.0,
) -> tuple[int, str]:
    """Make sure the latest state is committed and the attempt `handle` has stopped.

    Returns (committed step after the stop, how the attempt ended). `at-next-checkpoint` asks the
    trainer to stop once its next checkpoint commits (`RunDir.request_stop_at_checkpoint`: it ends on
    that checkpoint, with no step past it and no extra write) and waits for a committed step newer
    than the one at the call, or the attempt's end; a trainer that trains on past that checkpoint (one
    that does not read the request) is stopped then, and checkpoints where it is.
    """
    before = rundir.committed_step()
    status = backend.status(handle)
    # Only a running trainer has progress to wait for; a queued or starting attempt is stopped at once.
    if status.state == State.RUNNING and mode == "at-next-checkpoint":
        log(f"waiting for the next checkpoint after step {before} of attempt {handle.attempt}")
        rundir.request_stop_at_checkpoint(handle.attempt)
        try:
            status = _wait_for_the_checkpoint_stop(
                rundir, backend, handle, before, deadline, heartbeat, poll_s
            )
        finally:
            rundir.clear_stop_at_checkpoint()
    if status.state.live:
        log(f"stopping attempt {handle.attempt} ({handle.name}): it checkpoints its last completed step")
    # An ended attempt is removed too: an evicted JobSet is only suspended, and Kueue would admit it
    # again next to its successor.
    _stop_and_wait(backend, handle, deadline, heartbeat)
    end = backend.status(handle)
    after = rundir.committed_step()
    if after < before:  # a listing that went backwards would restart the run from an older state
        raise OlmoCtlError(f"committed step went back from {before} to {after} while stopping", exit_code=1)
    how = f"{end.state.value} ({end.reason})" if end.reason else end.state.value
    if end.state not in (State.PREEMPTED, State.SUCCEEDED) and backend.progress(handle).committed == after:
        # A backend that cannot see the exit code (a trainer another process started) may see its log.
        how = f"the trainer committed step {after} and exited"
    return after, how


def _wait_for_the_checkpoint_stop(
    rundir, backend, handle, before: int, deadline: float, heartbeat, poll_s: float
):
    """Wait until attempt `handle` has committed a step newer than `before` and, having been asked to,
    stopped on it; returns its status (still live when its trainer went on past that checkpoint, or
    shows no step line to tell: it is stopped by the caller)."""
    status = backend.status(handle)
    while status.state.live:
        committed = rundir.committed_step()
        if committed > before:
            step = backend.progress(handle).max_step
            if step is None or step > committed:  # not stopping on its own: it is stopped now
                return status
        if time.monotonic() >= deadline:
            raise ResizeTimeout(
                f"no new checkpoint after step {before} before the time limit; nothing was stopped",
                "use --now (the trainer checkpoints on SIGTERM) or a longer --timeout",
            )
        heartbeat()
        time.sleep(poll_s)
        status = backend.status(handle)
    return status


def submit_resized(
    rundir,
    backend,
    plan: ResizePlan,
    committed_step: int,
    mode: str,
    request_id: str | None = None,
    fence=None,
):
    """Submit attempt `plan.to_attempt` on the new device and journal `resized` and `submitted`."""
    resized = dict(
        attempt=plan.to_attempt,
        device=plan.new.device,
        committed_step=committed_step,
        reason=f"{on(plan.old)} -> {on(plan.new)} ({mode})",
        from_device=plan.old.device,
        slices=plan.new.slices,
        from_slices=plan.old.slices,
        from_attempt=plan.from_attempt,
        request=request_id,
        mode=mode,
        global_batch=plan.new.global_batch,
        tokens_per_step=plan.new.tokens_per_step,
        old_plan=plan.to_dict()["old"],
        new_plan=plan.to_dict()["new"],
    )
    request = plan.new_attempt
    assert request is not None, "a resize submits the attempt prepare_resize made"
    return submit_next(
        rundir,
        backend,
        request,
        f"resize from {on(plan.old)}",
        numbered=True,
        committed_step=committed_step,
        first=("resized", resized),
        fence=fence,
    )


def resize_run(
    rundir,
    backend,
    plan: ResizePlan,
    mode: str = "now",
    timeout_s: float = 3600.0,
    log: Callable[[str], None] = lambda s: None,
    wait: bool = True,
) -> ResizeResult:
    """Carry out a confirmed resize: hand it to the run's supervisor, or do it under the run's lease."""
    if mode not in MODES:
        raise BadInput(f"resize mode `{mode}` is not one of {', '.join(MODES)}")
    deadline = time.monotonic() + timeout_s
    res = ResizeResult(rundir.name, "", plan.old.device, plan.new.device)
    lease = None
    if supervisor_alive(rundir) is None:
        try:
            lease = rundir.acquire_lease(ttl_s=LEASE_TTL_S)
        except LeaseHeld:
            lease = None  # a supervisor took it just now: hand the resize to it
    if lease is None:
        res.action = "requested"
        res.request = record_request(rundir, plan.new.device, mode, plan)
        log(f"run `{rundir.name}` has a live supervisor: resize request {res.request['id']} recorded")
        if wait:
            rec = wait_for_request(rundir, res.request["id"], max(0.0, deadline - time.monotonic()))
            if rec.get("event") != "resized":
                raise OlmoCtlError(f"the supervisor refused the resize: {rec.get('reason')}", exit_code=1)
            res.action, res.attempt, res.committed_step = (
                "resized",
                rec.get("attempt"),
                rec.get("committed_step"),
            )
        return res
    try:

        def beat():
            rundir.heartbeat(lease)

        _, _, handle = current_attempt(rundir)
        live = handle if handle is not None and backend.status(handle).state.live else None
        if live is None:
            live = backend.find_live(rundir.name, rundir.path)
        if live is not None:
            res.committed_step, how = stop_for_resize(rundir, backend, live, mode, deadline, beat, log)
            res.notes.append(f"attempt {live.attempt} ended: {how}")
            if how.startswith("succeeded"):
                res.notes.append("the attempt finished before it was stopped")
        else:
            if handle is not None:  # never submit while the last attempt exists (suspended, terminating)
                _stop_and_wait(backend, handle, deadline, beat)
            res.committed_step = rundir.committed_step()
            res.notes.append("no live attempt: the next one starts from the last committed checkpoint")
        res.handle = submit_resized(rundir, backend, plan, res.committed_step, mode, fence=lease)
        res.attempt, res.action = res.handle.attempt, "resized"
        log(f"attempt {plan.to_attempt} submitted on {on(plan.new)} from checkpoint {res.committed_step}")
        return res
    finally:
        rundir.release_lease(lease)


# ---------------------------------------------------------------- the supervisor's side


def carry_out_request(
    rundir,
    backend,
    handle,
    request: dict,
    deadline_s: float | None = None,
    heartbeat: Callable[[], None] = lambda: None,
    log: Callable[[str], None] = lambda s: None,
    fence=None,
):
    """For a supervisor holding the lease: stop `handle` for the recorded `request`, submit the next
    attempt on the requested device and clear the request. Returns the new handle, or None when
    nothing changed (the request was refused and journalled `resize_refused`, or was already carried
    out): the supervisor carries on with `handle`.

    A request already carried out (a supervisor that died between submitting and clearing it) is
    only cleared. Waiting for the next checkpoint is bounded (6 h by default); when it runs out the
    request is refused and nothing was stopped."""
    rid = request.get("id")
    mode = request.get("mode") or "now"

    def refuse(why: str):
        rundir.append("resize_refused", device=request.get("device"), reason=why, request=rid)
        rundir.clear_resize()
        log(f"resize request {rid} refused: {why}")
        return None

    if rid and any(r.get("event") == "resized" and r.get("request") == rid for r in rundir.journal()):
        rundir.clear_resize()
        return None
    try:
        to = rundir.resize_target(request)  # the request as written
        plan = prepare_resize(rundir, backend, to.device, request.get("slices"))
    except OlmoCtlError as e:
        return refuse(e.one_line())
    if mode not in MODES:
        return refuse(f"unknown resize mode `{mode}`")
    if deadline_s is None:
        deadline_s = 6 * 3600.0 if mode == "at-next-checkpoint" else 3600.0
    deadline = time.monotonic() + deadline_s
    committed = rundir.committed_step()
    if handle is not None:
        try:
            committed, how = stop_for_resize(rundir, backend, handle, mode, deadline, heartbeat, log)
        except ResizeTimeout as e:
            if backend.status(handle).state.live and "nothing was stopped" in e.message:
                return refuse(e.one_line())
            raise
        log(f"attempt {handle.attempt} ended for the resize: {how}; committed step {committed}")
    new = submit_resized(rundir, backend, plan, committed, mode, request_id=rid, fence=fence)
    rundir.clear_resize()
    return new
