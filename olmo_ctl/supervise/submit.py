"""The one submit path: one attempt with one plan, checked, then the run created, then submitted.

submit, resume-until-done, resize and smoke all go through it, so every check that submit makes,
they make:

  prepare_run    the run's site settings, its backend (by name from the registry), the run
                 directory, the target (device and slice count) of its next attempt, and that attempt
                 from `attempts.prepare` (its one plan, the backend's `validate` refusals). Reads the
                 run directory, writes nothing.
  dry_run        the same for `submit --dry-run`, from the command line alone (no storage read)
  check_attempt  the backend's `checks` (the Kueue objects the attempt names) and the preflight
                 compile (TPU slices, where libtpu is installed); writes nothing
  create_run     run.yaml for a new run: after the checks, so a refused run leaves nothing behind
  submit_run     `olmo-ctl submit`: all of the above, then the attempt under the run's lease

Each returns values; the caller prints (the CLI says what to do next).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from olmo_ctl.backends import existing_runs, make_backend, placeholders
from olmo_ctl.backends.base import Attempt, Backend, Handle, Target
from olmo_ctl.core.config import Settings
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.mixes import data_root_note
from olmo_ctl.core.names import validate_run_name
from olmo_ctl.supervise.attempts import (
    check_run,
    last_handle,
    live_attempt,
    prepare,
    run_settings,
    run_target,
    submit_next,
)

if TYPE_CHECKING:
    from olmo_ctl.core.devices import Device
    from olmo_ctl.core.recipe import Recipe
    from olmo_ctl.rundir import RunDir


@dataclass(frozen=True)
class Prepared:
    """A run's next attempt, resolved once and validated; nothing written yet."""

    rundir: RunDir
    backend: Backend
    request: Attempt  # its device, slice count, recipe, plan and site settings
    settings: Settings  # the command's, with what it did not choose taken from the run
    new_run: bool
    data_fingerprint: str | None  # of a new run: what run.yaml records
    committed_step: int | None = None  # of an existing run
    notes: list[str] = field(default_factory=list)  # the backend's remarks, for the terminal

    @property
    def complete(self) -> bool:
        """The run's final step is committed: there is nothing left to submit."""
        return (
            not self.new_run
            and self.committed_step is not None
            and self.committed_step >= int(self.request.recipe.train.max_steps)
        )

    @property
    def on(self) -> str:
        return self.request.target.on


def prepare_run(
    settings: Settings,
    run: str,
    *,
    recipe: Recipe | None = None,
    device: Device | None = None,
    slices: int | None = None,
    attempt: int | None = None,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    backend: Backend | None = None,
) -> Prepared:
    """The run's next attempt: a new run from `recipe` on `device` (and `slices`), or an existing
    run's next attempt, on its own device and slice count (another one is a resize: refused), from its
    run.yaml (a `recipe` given must be that one). `backend`: this one instead of the settings' own."""
    from olmo_ctl.rundir import RunDir

    if placeholders(settings):
        # No run root set: a run of this machine's (`make demo`'s, under `runs/`) continues with its own
        # backend and settings; anything else still needs them set.
        mine = existing_runs(settings)
        here = RunDir.of(mine.run_root, validate_run_name(run))
        if mine is not settings and here.exists() and not placeholders(run_settings(mine, here)):
            settings = run_settings(mine, here)
    if placeholders(settings):  # before the placeholder run root is read
        raise BadInput(
            f"site settings still hold placeholders ({', '.join(placeholders(settings))})",
            "see `olmo-ctl config show`; `submit --dry-run` works without them",
        )
    asked, first = settings, backend
    if device is not None:
        # A device this command's backend refuses on the command line alone (one it cannot run, a run
        # root its pods cannot see) is named before any storage is touched.
        run_dir = f"{settings.run_root.rstrip('/')}/{validate_run_name(run)}"
        first = first or make_backend(settings)
        first.validate_target(Target.of(device, slices), settings, run_dir)
    rundir = RunDir.of(settings.run_root, run)
    settings = run_settings(settings, rundir)
    # One backend: the one given, or the command line's when the run's own settings (its backend, the
    # site settings its last attempt was submitted with) are the same; else the run's.
    if first is None or (backend is None and settings is not asked):
        first = make_backend(settings)
    backend = first
    new = not rundir.exists()
    committed = None
    if new:
        check_run(rundir, recipe, None if device is None else device.name, fingerprint=False)
        assert device is not None  # check_run refuses a new run without one
        target = Target.of(device, slices)
    else:
        target = run_target(rundir, device, slices)
        committed = rundir.committed_step()
    run_recipe = rundir.recipe(pending=True) if recipe is None else recipe
    n = attempt if attempt is not None else (1 if new else rundir.next_attempt_number())
    request = prepare(
        backend,
        rundir.name,
        rundir.path,
        n,
        target,
        run_recipe,
        settings=settings,
        extra_args=extra_args,
        env=env,
    )
    # Last, what may read the data (a new run's fingerprint; an existing run's check of `recipe`).
    fingerprint = check_run(rundir, recipe, target.name)
    return Prepared(rundir, backend, request, settings, new, fingerprint, committed, backend.notes(request))


def dry_run(
    settings: Settings,
    run: str,
    recipe: Recipe,
    target: Target,
    attempt: int | None = None,
    extra_args: tuple[str, ...] = (),
) -> tuple[Backend, Attempt, list[str]]:
    """What `submit --dry-run` renders: attempt `attempt` (1) of `run` from the command line alone,
    placeholders allowed; (backend, request, notes)."""
    backend = make_backend(settings)
    run_dir = f"{settings.run_root.rstrip('/')}/{run}"
    n = 1 if attempt is None else attempt
    request = prepare(
        backend, run, run_dir, n, target, recipe, settings=settings, extra_args=extra_args, render_only=True
    )
    data = data_root_note(recipe.data.root)  # what a submit would read, said before it is read
    return backend, request, backend.notes(request, render_only=True) + ([data] if data else [])


def check_attempt(
    backend: Backend, request: Attempt, *, preflight: bool = True, log: Callable[[str], None] = lambda s: None
) -> None:
    """Everything that can refuse an attempt before it is queued: the backend's checks, then the
    preflight compile of its step (TPU slices where libtpu is installed; cached per recipe, device and
    trainer). BadInput (exit 2) or a compile failure (exit 1); nothing is written."""
    backend.checks(request)
    if preflight:
        from olmo_ctl.preflight.compile import submit_check

        submit_check(
            request.recipe,
            request.target.device,
            request.plan,
            log=log,
            settings=backend.settings_of(request),
        )


def create_run(prep: Prepared) -> None:
    """run.yaml of a new run (nothing for an existing one)."""
    if prep.new_run:
        r = prep.request
        assert prep.data_fingerprint is not None
        prep.rundir.create_run(
            r.recipe.to_dict(), r.recipe.fingerprint(), prep.data_fingerprint, r.device, r.slices
        )


@dataclass(frozen=True)
class Submitted:
    """What `olmo-ctl submit` did: the attempt it submitted, or nothing for a complete run."""

    prepared: Prepared
    handle: Handle | None  # None: the run is complete, nothing was submitted


def submit_run(
    prep: Prepared,
    *,
    checks: bool = True,
    preflight: bool = True,
    log: Callable[[str], None] = lambda s: None,
    show: Callable[[Any], None] | None = None,
    admission_timeout_s: float | None = None,
    numbered: bool = False,
) -> Submitted:
    """`olmo-ctl submit`: check the attempt, create the run, then submit it under the run's lease
    (a supervisor running the run refuses us, exit 2). A complete run submits nothing."""
    if prep.complete:
        return Submitted(prep, None)
    if checks:
        check_attempt(prep.backend, prep.request, preflight=preflight, log=log)
    create_run(prep)
    rundir, backend = prep.rundir, prep.backend
    lease = rundir.acquire_lease(ttl_s=120)
    try:
        h, st = live_attempt(rundir, backend)
        if h is not None:
            raise BadInput(
                f"attempt {h.attempt} of run `{rundir.name}` is still {st.state.value} ({h.name})",
                f"supervise it with `olmo-ctl resume-until-done {rundir.name}`; "
                "a second attempt would write the same checkpoints",
            )
        ended = last_handle(rundir, backend.name)
        if ended is not None:
            # An ended attempt is deleted first (it holds its name, perhaps quota), with its grace period.
            backend.stop(ended, graceful=True)
        handle = submit_next(
            rundir,
            backend,
            prep.request,
            "first attempt" if prep.new_run else "submitted by hand",
            show=show,
            fence=lease,
            admission_timeout_s=admission_timeout_s,
            numbered=numbered,
        )
    finally:
        rundir.release_lease(lease)
    return Submitted(prep, handle)
