"""The attempt lifecycle, written once: the run's site settings, an attempt request, submit it, stop one,
find the live one.

submit, resume-until-done, resize, smoke and monitor all go through here (the one submit path that
checks an attempt before the run is created is `supervise.submit`):

  run_settings      site settings not chosen on this command line are the run's own (those its last
                    attempt was submitted with)
  prepare           the one maker of attempts: the run, its directory, the attempt number, the target,
                    the resolved recipe, its one plan and the site settings, validated by the backend
  submit_next       render it, send it, journal `submitted` (the one place an attempt is submitted)
  stop_and_wait     stop an attempt and wait until it can no longer write to the run directory
  last_handle       the handle of the run's newest submitted attempt, from the journal
  live_attempt      the run's live attempt, from the journal's last handle or else the backend
  ensure_run        create run.yaml for a new run, or check that a recipe is the run's own

The run's identity is its `run.yaml` (resolved recipe + data fingerprint), written once: a later
attempt with another recipe or other data is refused, and a later attempt on another device is a
resize (`olmo-ctl resize`), never a silent change. Attempt numbers come from the journal. An
attempt is never submitted while the run's previous attempt is still live.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from olmo_ctl.backends import REGISTRY, backend_for_status
from olmo_ctl.backends.base import Attempt, AttemptStatus, Backend, Handle, Target
from olmo_ctl.core import faults
from olmo_ctl.core.batching import Plan, make_plan
from olmo_ctl.core.config import RUN_SITE_SETTINGS, Settings
from olmo_ctl.core.errors import BadInput

if TYPE_CHECKING:  # the run directory (and storage) load where a run is touched, not for --dry-run
    from olmo_ctl.core.devices import Device
    from olmo_ctl.core.recipe import Recipe
    from olmo_ctl.rundir import Lease, RunDir

# ---------------------------------------------------------------- the run's site settings


def run_settings(settings: Settings, rundir: RunDir) -> Settings:
    """Settings not chosen on this command line, in the environment or the config file are the run's
    own: the backend of its last attempt, and the site settings (image, queue, service account, ...)
    that attempt was submitted with, so a resize or a resumed supervisor renders what submit rendered."""
    if not rundir.exists():
        return settings
    last = rundir.last_attempt() or {}
    chosen = {k for k, src in settings.sources.items() if not src.startswith("default")}
    values: dict[str, Any] = {}
    sources = dict(settings.sources)
    where = f"run {rundir.name} (attempt {last.get('attempt')})"
    if "backend" not in chosen and last.get("backend") in REGISTRY and last["backend"] != settings.backend:
        values["backend"], sources["backend"] = last["backend"], where
    recorded = last.get("site")
    site: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    for name in RUN_SITE_SETTINGS:
        if name not in chosen and name in site and site[name] != getattr(settings, name):
            values[name], sources[name] = site[name], where
    if not values:
        return settings
    return dataclasses.replace(settings, **values, sources=sources)


def handle_status(run_dir: str, handle: dict) -> AttemptStatus | None:
    """The backend's status of the attempt a journal `handle` names (None: no backend to ask)."""
    h = Handle.from_dict(handle)
    backend = backend_for_status(h, run_dir)
    return backend.status(h) if backend is not None else None


# ---------------------------------------------------------------- attempt requests


def prepare(
    backend: Backend,
    run: str,
    run_dir: str,
    attempt: int,
    target: Target,
    recipe: Recipe,
    *,
    settings: Settings | None = None,
    plan: Plan | None = None,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    render_only: bool = False,
) -> Attempt:
    """The one place an attempt is made, whoever asks (a new run's first attempt or a run's next one
    for submit and resume-until-done, a resized attempt, a smoke attempt, an eval job's attempt): the
    resolved recipe on `target` with its one plan (made here unless given), then the backend's
    `validate` refusals (no I/O; `render_only`: only printed, placeholders fine). BadInput when the
    backend refuses it; nothing is written."""
    request = Attempt(
        run=run,
        run_dir=run_dir,
        attempt=attempt,
        target=target,
        recipe=recipe,
        plan=plan if plan is not None else make_plan(recipe, target.device, target.slices),
        settings=settings,
        extra_args=tuple(extra_args),
        env=tuple((env or {}).items()),
    )
    backend.validate(request, render_only=render_only)
    return request


def submit_next(
    rundir: RunDir,
    backend: Backend,
    request: Attempt,
    reason: str,
    *,
    committed_step: int | None = None,
    t: float | None = None,
    show: Callable[[Any], None] | None = None,
    first: tuple[str, dict] | None = None,
    fence: Lease | None = None,
    admission_timeout_s: float | None = None,
    numbered: bool = False,
) -> Handle:
    """Render `request` as the run's next attempt, send it and journal `submitted` (with the device,
    the slice count and the site settings it was rendered with; the caller checked liveness).

    The attempt number is the journal's next one, unless `numbered` (the request's own number).
    With `fence` (the caller's lease) the number is reserved under the lease first, the lease is
    checked once more just before the create, and the journal lines are written only while the lease
    is still ours: a caller that lost the lease creates nothing, and undoes a create that raced with
    the takeover.

    `show` sees the rendered request before it is sent (--output-manifest); `first` is a journal
    record written just before `submitted` once the attempt is sent (a resize's `resized`);
    `admission_timeout_s` (--admission-timeout) is recorded with it for the supervisor."""
    from olmo_ctl.rundir import LeaseLost

    n = request.attempt if numbered else rundir.next_attempt_number()
    if fence is not None:  # reserved under the lease before anything exists (LeaseLost if taken over)
        n = rundir.reserve_attempt(fence, n)
    request = dataclasses.replace(request, attempt=n)
    committed = rundir.committed_step() if committed_step is None else committed_step
    rundir.check_not_from_scratch(committed)
    rendered = backend.render(request)
    if show is not None:
        show(backend.printable(rendered))
    if fence is not None:
        rundir.heartbeat(fence)  # the last check before the create
        _fault_pause_before_create()
    # Pending amendments (`olmo-ctl amend`) take effect with this attempt, from the step after the one
    # it restores; no attempt of the run is live now, so no step is trained in between.
    rundir.bind_amendments(n)
    handle = backend.send(rendered)
    settings = backend.settings_of(request)
    site = {k: getattr(settings, k) for k in RUN_SITE_SETTINGS} if settings is not None else None
    try:
        if first is not None:
            rundir.append(
                first[0], fence=fence, **{**first[1], **({"attempt": n} if "attempt" in first[1] else {})}
            )
        rundir.append(
            "submitted",
            attempt=n,
            device=request.device,
            slices=request.slices,
            committed_step=committed,
            reason=reason,
            handle=handle.to_dict(),
            backend=backend.name,
            t=t,
            fence=fence,
            admission_timeout_s=admission_timeout_s,
            site=site,
        )
    except LeaseLost:
        # Taken over while creating it: the new holder owns the run, so what we just made goes away.
        backend.stop(handle, graceful=False)
        raise
    return handle


# Fault injection for tests (core/faults.py): paused past the lease's expiry at the worst moment.
PAUSE_BEFORE_CREATE_ENV = faults.PAUSE_BEFORE_CREATE.name


def _fault_pause_before_create() -> None:
    import os
    import signal

    if os.environ.pop(PAUSE_BEFORE_CREATE_ENV, None):  # once per process
        os.kill(os.getpid(), signal.SIGSTOP)


# ---------------------------------------------------------------- stopping, and the live attempt


def stop_and_wait(
    backend: Backend,
    handle: Handle,
    *,
    graceful: bool = True,
    timeout_s: float = 600.0,
    poll_s: float = 2.0,
    heartbeat: Callable[[], None] = lambda: None,
) -> bool:
    """Stop the attempt and wait until it is gone (pods still checkpointing through their grace
    period), renewing the caller's lease meanwhile. False when `timeout_s` passed first."""
    backend.stop(handle, graceful=graceful)
    deadline = time.monotonic() + timeout_s
    while True:
        if backend.wait_gone(
            handle, timeout_s=min(30.0, max(0.0, deadline - time.monotonic())), poll_s=poll_s
        ):
            return True
        heartbeat()
        if time.monotonic() >= deadline:
            return False


def last_handle(rundir: RunDir, backend: str | None = None) -> Handle | None:
    """The handle of the run's newest submitted attempt (of `backend`, when given), from the journal."""
    last = rundir.last_attempt()
    h = last.get("handle") if last else None
    if not isinstance(h, dict) or (backend is not None and h.get("backend") != backend):
        return None
    return Handle.from_dict(h)


def live_attempt(rundir: RunDir, backend: Backend) -> tuple[Handle | None, Any]:
    """The run's live attempt (handle, status), from the journal's last submission or the backend."""
    h = last_handle(rundir, backend.name)
    if h is not None:
        st = backend.status(h)
        if st.state.live:
            return h, st
    h = backend.find_live(rundir.name, rundir.path)
    if h is not None:
        st = backend.status(h)
        if st.state.live:
            return h, st
    return None, None


# ---------------------------------------------------------------- the run


def data_fingerprint(recipe) -> str:
    """The fingerprint the trainer's loader checks (file names and sizes, seq_len, data seed)."""
    from olmo_ctl.data.files import dataset_fingerprint, resolve_files

    return dataset_fingerprint(resolve_files(recipe, "train"), recipe.train.seq_len, recipe.data.seed)


def check_run(rundir: RunDir, recipe, device: str | None, *, fingerprint: bool = True) -> str | None:
    """Check that `recipe` (if given) can continue the run, or create it; writes nothing. Returns the
    data fingerprint of a new run (None without `fingerprint`: only the arguments are checked)."""
    if not rundir.exists():
        if recipe is None:
            from olmo_ctl.rundir import did_you_mean, near_runs

            near = near_runs(rundir.path.rsplit("/", 1)[0], rundir.name)
            raise BadInput(
                f"run `{rundir.name}` does not exist at {rundir.path}",
                did_you_mean(near)
                + ("or " if near else "")
                + "create it: pass --recipe or --stage (and --device)",
            )
        if device is None:
            raise BadInput(
                f"run `{rundir.name}` is new: it needs a device", "pass --device, e.g. cpu-1 or tpu7x-128"
            )
        return data_fingerprint(recipe) if fingerprint else None
    if recipe is not None:
        rundir.check_matches(recipe.fingerprint(), data_fingerprint(recipe), recipe)
    return None


def ensure_run(rundir: RunDir, recipe, device: str | None, slices: int | None = None) -> dict:
    """Create run.yaml for a new run; for an existing one check that `recipe` (if given) is its recipe."""
    fp = check_run(rundir, recipe, device)
    if fp is not None:
        assert device is not None  # check_run refuses a new run without one
        return rundir.create_run(recipe.to_dict(), recipe.fingerprint(), fp, device, slices or 1)
    return rundir.read_run()


def run_target(rundir: RunDir, device: Device | None = None, slices: int | None = None) -> Target:
    """The target of an existing run's next attempt: the one it is on (`RunDir.target`: its last
    attempt's, else run.yaml's). A `device` or `slices` asked for that differs from it is a resize:
    BadInput naming the command."""
    current = rundir.target()
    if current is None:
        if device is None:
            raise BadInput(f"run `{rundir.name}` records no device", "pass --device, e.g. cpu-1 or tpu7x-128")
        return Target.of(device, slices)
    if device is not None and device.name != current.name:
        raise BadInput(
            f"run `{rundir.name}` runs on {current.name}, not {device.name}",
            f"to move it, use `olmo-ctl resize {rundir.name} --device {device.name}` (same global batch)",
        )
    if slices is not None and slices != current.slices:
        Target.of(current.device, slices)  # a count the run's device cannot take at all: that, first
        raise BadInput(
            f"run `{rundir.name}` runs on {current.slices} x {current.name}, not {slices}",
            f"to change the slice count, use `olmo-ctl resize {rundir.name} --device {current.name} "
            f"--slices {slices}` (same global batch)",
        )
    return current
