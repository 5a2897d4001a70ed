"""The attempt lifecycle, written once: choose a backend, submit an attempt, stop one, find the live one.

submit, resume-until-done, resize, smoke and monitor all go through here:

  make_backend      the backend for the site settings, after the checks that need no I/O (the device
                    suits the backend, no placeholder settings, a gs:// run root for GKE)
  attempt_request   an attempt request: the run, its directory, the attempt number, the device, the
                    resolved recipe (from run.yaml, read once), its plan and the site settings
  submit_next       render it, send it, journal `submitted` (the one place an attempt is submitted)
  stop_and_wait     stop an attempt and wait until it can no longer write to the run directory
  last_handle       the handle of the run's newest submitted attempt, from the journal
  live_attempt      the run's live attempt, from the journal's last handle or else the backend
  submit_attempt    `olmo-ctl submit`: create the run (or check it), then submit its next attempt

The run's identity is its `run.yaml` (resolved recipe + data fingerprint), written once: a later
attempt with another recipe or other data is refused, and a later attempt on another device is a
resize (`olmo-ctl resize`), never a silent change. Attempt numbers come from the journal. An
attempt is never submitted while the run's previous attempt is still live.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from olmo_ctl.backends.base import Attempt, AttemptStatus, Backend, Handle
from olmo_ctl.core.batching import make_plan
from olmo_ctl.core.devices import Device, get_device
from olmo_ctl.core.errors import BadInput

if TYPE_CHECKING:  # the run directory (and storage) load where a run is touched, not for --dry-run
    from olmo_ctl.rundir import Lease, RunDir

# ---------------------------------------------------------------- the backend


def check_device(backend: str, device: Device) -> None:
    """The GKE backend runs TPU slices; the local backend runs cpu-N and gpu-N."""
    if backend == "gke" and not device.is_tpu:
        raise BadInput(f"`{device.name}` is a local device; the GKE backend runs on TPU slices",
                       "use --backend local, or a TPU device such as tpu7x-128")
    if backend == "local" and device.is_tpu:
        raise BadInput(f"`{device.name}` is a TPU slice; the local backend runs cpu-N or gpu-N",
                       "use --backend gke, or a local device such as cpu-4")


def check_site(settings: Any, render_only: bool = False) -> None:
    """What a GKE submission needs of the site settings: no placeholders (unless only rendering) and a
    run root on GCS (TPU pods cannot see this machine's files)."""
    if settings.backend != "gke":
        return
    if not render_only and settings.placeholders():
        raise BadInput(f"site settings still hold placeholders ({', '.join(settings.placeholders())})",
                       "see `olmo-ctl config show`; --dry-run works without them")
    if not settings.run_root.startswith("gs://"):
        raise BadInput(f"run root `{settings.run_root}` is not on GCS; TPU pods cannot see this machine's files",
                       "set the run root to gs://BUCKET/PREFIX (--run-root, OLMO_CTL_RUN_ROOT or run_root "
                       "in the config file)")


def make_backend(settings: Any, device: Device | str | None = None, run_root: str | None = None, *,
                 render_only: bool = False) -> Backend:
    """The backend of `settings.backend`, checked against `device` and the site settings first."""
    if device is not None:
        check_device(settings.backend, get_device(device) if isinstance(device, str) else device)
    check_site(settings, render_only)
    # Each backend loads when chosen: a command never pays for the other's modules.
    if settings.backend == "local":
        from olmo_ctl.backends.local import LocalBackend

        return LocalBackend(run_root or settings.run_root)
    from olmo_ctl.backends.gke import GKEBackend

    return GKEBackend(settings=settings)


def run_settings(settings: Any, rundir: RunDir) -> Any:
    """A backend not chosen (flag, env or config file) is the run's own: that of its last attempt."""
    if settings.sources.get("backend", "default") != "default" or not rundir.exists():
        return settings
    last = rundir.last_attempt() or {}
    if last.get("backend") in ("gke", "local") and last["backend"] != settings.backend:
        return dataclasses.replace(settings, backend=last["backend"])
    return settings


def backend_for_handle(handle: Handle, run_dir: str) -> Backend | None:
    """A backend that can answer `status` for `handle` (monitor): quick to give up on a cluster that
    does not answer, so a refresh falls back to the journal instead of hanging."""
    if handle.backend == "local":
        from olmo_ctl.backends.local import LocalBackend

        return LocalBackend(run_dir.rstrip("/").rsplit("/", 1)[0])
    if handle.backend == "gke":
        from olmo_ctl.backends.gke import GKEBackend
        from olmo_ctl.backends.kube import KubeRetryPolicy

        quick = KubeRetryPolicy(budget_s=20.0, max_attempts=4, connect_timeout_s=5.0, read_timeout_s=15.0)
        return GKEBackend(namespace=handle.data.get("namespace"), context=handle.data.get("context"), retry=quick)
    try:
        mod = importlib.import_module(f"olmo_ctl.backends.{handle.backend}")
    except ImportError:
        return None
    factory = getattr(mod, "backend_for_status", None)
    return factory(run_dir, handle) if factory else None


def handle_status(run_dir: str, handle: dict) -> AttemptStatus | None:
    """The backend's status of the attempt a journal `handle` names (None: no backend to ask)."""
    h = Handle.from_dict(handle)
    backend = backend_for_handle(h, run_dir)
    return backend.status(h) if backend is not None else None


# ---------------------------------------------------------------- attempt requests


def new_request(run: str, run_dir: str, attempt: int, device: Device | str, recipe: Any, settings: Any = None,
                extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None, plan: Any = None,
                slices: int = 1) -> Attempt:
    """The attempt request every backend renders: resolved recipe, device, slices and plan (made here
    unless given)."""
    dev = get_device(device) if isinstance(device, str) else device
    return Attempt(run=run, run_dir=run_dir, attempt=attempt, device=dev.name, extra_args=tuple(extra_args),
                   recipe=recipe, plan=plan if plan is not None else make_plan(recipe, dev, slices), settings=settings,
                   env=tuple((env or {}).items()), slices=slices)


def attempt_request(rundir: RunDir, attempt: int, device: str, recipe: Any = None, settings: Any = None,
            extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None, slices: int = 1) -> Attempt:
    """The request of attempt `attempt` of an existing run (its recipe from run.yaml unless given)."""
    return new_request(rundir.name, rundir.path, attempt, device, recipe if recipe is not None else rundir.recipe(),
                       settings, extra_args, env, slices=slices)


def submit_next(rundir: RunDir, backend: Backend, device: str, reason: str, *, recipe: Any = None,
                extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None, attempt: int | None = None,
                committed_step: int | None = None, t: float | None = None,
                show: Callable[[Any], None] | None = None, first: tuple[str, dict] | None = None,
                fence: Lease | None = None, admission_timeout_s: float | None = None, slices: int = 1) -> Handle:
    """Render the run's next attempt on `slices` x `device`, send it and journal `submitted` (with the
    device and the slice count; the caller checked liveness).

    With `fence` (the caller's lease) the attempt number is reserved under the lease first, the lease
    is checked once more just before the create, and the journal lines are written only while the
    lease is still ours: a caller that lost the lease creates nothing, and undoes a create that raced
    with the takeover.

    `show` sees the rendered request before it is sent (--output-manifest); `first` is a journal
    record written just before `submitted` once the attempt is sent (a resize's `resized`);
    `admission_timeout_s` (--admission-timeout) is recorded with it for the supervisor."""
    from olmo_ctl.rundir import LeaseLost

    n = attempt if attempt is not None else rundir.next_attempt_number()
    if fence is not None:  # reserved under the lease before anything exists (LeaseLost if taken over)
        n = rundir.reserve_attempt(fence, n)
    committed = rundir.committed_step() if committed_step is None else committed_step
    rendered = backend.render(attempt_request(rundir, n, device, recipe, None, extra_args, env, slices))
    if show is not None:
        show(backend.printable(rendered))
    if fence is not None:
        rundir.heartbeat(fence)  # the last check before the create
        _fault_pause_before_create()
    handle = backend.send(rendered)
    try:
        if first is not None:
            rundir.append(first[0], fence=fence, **{**first[1], **({"attempt": n} if "attempt" in first[1] else {})})
        rundir.append("submitted", attempt=n, device=device, slices=slices, committed_step=committed, reason=reason,
                      handle=handle.to_dict(), backend=backend.name, t=t, fence=fence,
                      admission_timeout_s=admission_timeout_s)
    except LeaseLost:
        # Taken over while creating it: the new holder owns the run, so what we just made goes away.
        backend.stop(handle, graceful=False)
        raise
    return handle


# Fault injection for tests: the process stops itself (SIGSTOP) after its last lease check and before
# it creates the attempt, the worst moment to be paused past the lease's expiry. Never in a real run.
PAUSE_BEFORE_CREATE_ENV = "OLMO_CTL_FAULT_PAUSE_BEFORE_CREATE"


def _fault_pause_before_create() -> None:
    import os
    import signal

    if os.environ.pop(PAUSE_BEFORE_CREATE_ENV, None):  # once per process
        os.kill(os.getpid(), signal.SIGSTOP)


# ---------------------------------------------------------------- stopping, and the live attempt


def stop_and_wait(backend: Backend, handle: Handle, *, graceful: bool = True, timeout_s: float = 600.0,
                  poll_s: float = 2.0, heartbeat: Callable[[], None] = lambda: None) -> bool:
    """Stop the attempt and wait until it is gone (pods still checkpointing through their grace
    period), renewing the caller's lease meanwhile. False when `timeout_s` passed first."""
    backend.stop(handle, graceful=graceful)
    deadline = time.monotonic() + timeout_s
    while True:
        if backend.wait_gone(handle, timeout_s=min(30.0, max(0.0, deadline - time.monotonic())), poll_s=poll_s):
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
    h = backend.find_live(rundir.name)
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


def check_run(rundir: RunDir, recipe, device: str | None) -> str | None:
    """Check that `recipe` (if given) can continue the run, or create it; writes nothing. Returns the
    data fingerprint of a new run."""
    if not rundir.exists():
        if recipe is None:
            raise BadInput(f"run `{rundir.name}` does not exist at {rundir.path}",
                           "create it: pass --recipe or --stage (and --device)")
        if device is None:
            raise BadInput(f"run `{rundir.name}` is new: it needs a device", "pass --device, e.g. cpu-1 or tpu7x-128")
        return data_fingerprint(recipe)
    if recipe is not None:
        rundir.check_matches(recipe.fingerprint(), data_fingerprint(recipe), recipe)
    return None


def ensure_run(rundir: RunDir, recipe, device: str | None, slices: int | None = None) -> dict:
    """Create run.yaml for a new run; for an existing one check that `recipe` (if given) is its recipe."""
    fp = check_run(rundir, recipe, device)
    if fp is not None:
        return rundir.create_run(recipe.to_dict(), recipe.fingerprint(), fp, device, slices or 1)
    return rundir.read_run()


def run_device(rundir: RunDir, requested: str | None) -> str:
    """The device the next attempt uses: the last attempt's (or run.yaml's); another one is a resize."""
    last = rundir.last_attempt()
    current = (last or {}).get("device") or rundir.read_run().get("device")
    if requested is not None and current is not None and requested != current:
        raise BadInput(f"run `{rundir.name}` runs on {current}, not {requested}",
                       f"to move it, use `olmo-ctl resize {rundir.name} --device {requested}` (same global batch)")
    return requested or current


def run_slices(rundir: RunDir, requested: int | None) -> int:
    """The slice count of an existing run's next attempt: the last attempt's (else run.yaml's; 1 where
    neither says); another count is a resize, like another device."""
    last = rundir.last_attempt() or {}
    current = last.get("slices")
    if current is None:
        current = rundir.read_run().get("slices")
    current = int(current or 1)
    if requested is not None and requested != current:
        device = last.get("device") or rundir.read_run().get("device")
        raise BadInput(f"run `{rundir.name}` runs on {current} x {device}, not {requested}",
                       f"to change the slice count, use `olmo-ctl resize {rundir.name} --device {device} "
                       f"--slices {requested}` (same global batch)")
    return current


def submit_attempt(recipe=None, device=None, settings=None, run: str | None = None, run_dir: str | None = None,
                   attempt: int | None = None, backend: Backend | None = None,
                   before_create: Callable[[int], None] | None = None, show: Callable[[Any], None] | None = None,
                   out: Callable[[str], None] | None = None, extra_args: tuple[str, ...] = (),
                   admission_timeout_s: float | None = None, slices: int | None = None) -> Handle:
    """`olmo-ctl submit`: create the run (or its next attempt) and submit it; returns once submitted.
    `slices` (None: the run's own, 1 for a new run) is the number of slices of `device`.

    The run is checked before `before_create(slices)` (the preflight compile) runs, and created after it, so
    a refused run leaves nothing behind."""
    from olmo_ctl.rundir import RunDir

    out = out or (lambda s: sys.stdout.write(s + "\n"))
    dev_name = getattr(device, "name", device)
    rundir = RunDir(run_dir, run)
    backend = backend or make_backend(settings, device, run_dir.rsplit("/", 1)[0] if run_dir else None)
    new = not rundir.exists()
    fp = check_run(rundir, recipe, dev_name)
    if not new:
        dev_name = run_device(rundir, dev_name)
        slices = run_slices(rundir, slices)
    slices = slices or 1
    if before_create is not None:
        before_create(slices)
    if fp is not None:
        rundir.create_run(recipe.to_dict(), recipe.fingerprint(), fp, dev_name, slices)
    lease = rundir.acquire_lease(ttl_s=120)  # a supervisor running this run refuses us (exit 2)
    try:
        h, st = live_attempt(rundir, backend)
        if h is not None:
            raise BadInput(f"attempt {h.attempt} of run `{rundir.name}` is still {st.state.value} ({h.name})",
                           f"supervise it with `olmo-ctl resume-until-done {rundir.name}`; "
                           "a second attempt would write the same checkpoints")
        ended = last_handle(rundir, backend.name)
        if ended is not None:
            # An ended attempt is deleted first (it holds its name, perhaps quota), with its grace period.
            backend.stop(ended, graceful=True)
        handle = submit_next(rundir, backend, dev_name, "first attempt" if new else "submitted by hand",
                             recipe=recipe, extra_args=extra_args, attempt=attempt, show=show, fence=lease,
                             admission_timeout_s=admission_timeout_s, slices=slices)
    finally:
        rundir.release_lease(lease)
    root = settings.run_root if settings is not None else rundir.path.rsplit("/", 1)[0]
    out(f"run directory: {rundir.path}")
    on = dev_name if slices == 1 else f"{slices} x {dev_name}"
    out(f"attempt {handle.attempt} of run `{rundir.name}` submitted on {on} ({backend.name}: {handle.name})")
    out("next: supervise it until the final step with")
    out(f"  olmo-ctl resume-until-done {rundir.name} --run-root {root} --backend {backend.name}")
    out(f"  olmo-ctl monitor {rundir.path}")
    return handle
