"""The one submit path: one attempt with one plan, checked, then the run created, then submitted.

submit, resume-until-done, resize and smoke all go through it, so every check that submit makes,
they make:

  prepare_run    the run's site settings, its backend (by name from the registry), the run
                 directory (a new run only where no run was: `RunDir.check_new`), the target (device
                 and slice count) of its next attempt, and that attempt from `attempts.prepare` (its
                 one plan, the backend's `validate` refusals). Reads the run directory, writes nothing.
  dry_run        the same for `submit --dry-run`: the attempt `submit_run` would send, with its
                 refusals and its attempt number; from the command line alone only where the run
                 root cannot be read (placeholders, no access from this machine), and then it says so
  check_attempt  the backend's `checks` (the Kueue objects the attempt names) and the preflight
                 compile (TPU slices, where libtpu is installed); writes nothing
  create_run     run.yaml for a new run: after the checks, so a refused run leaves nothing behind
  submit_run     `olmo-ctl submit`: all of the above, then the attempt under the run's lease

Each returns values; the caller prints (the CLI says what to do next).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from olmo_ctl.backends import existing_runs, make_backend, placeholders
from olmo_ctl.backends.base import Attempt, Backend, Handle, Target
from olmo_ctl.core.config import Settings
from olmo_ctl.core.errors import BadInput, OlmoCtlError
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
        # No run root set (or one on this machine): a run of this machine's (`make demo`'s, under
        # `runs/`) continues with its own backend and settings; anything else still needs them set.
        mine = _local_runs(settings)
        if mine is not None:
            here = RunDir.of(mine.run_root, validate_run_name(run))
            if here.exists() and not placeholders(run_settings(mine, here)):
                settings = run_settings(mine, here)
    if placeholders(settings):  # before the placeholder run root is read
        _refuse_placeholders(settings, run, recipe, device, slices, backend)
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
        rundir.check_new()  # run.yaml gone where its journal and checkpoints remain: not a new run
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


def _local_runs(settings: Settings) -> Settings | None:
    """`settings` for finding a run of this machine (`backends.existing_runs`: no run root set, this
    machine's `runs/`), or with a run root on this machine; None where the run root is a placeholder
    or on GCS (not read before the site settings are whole)."""
    from olmo_ctl import storage

    mine = existing_runs(settings)
    if mine is not settings or (
        "run_root" not in placeholders(settings) and not storage.is_gcs(settings.run_root)
    ):
        return mine
    return None


def _refuse_placeholders(
    settings: Settings,
    run: str,
    recipe: Recipe | None,
    device: Device | None,
    slices: int | None,
    backend: Backend | None,
) -> NoReturn:
    """Site settings that still hold placeholders cannot make this run; the most specific reason is
    said first, since setting the site would not help: a device the settings' backend cannot run (a
    local cpu-N under the default GKE backend: add --backend local), a run to continue that is not
    under this machine's run root (with the names close to it), else the placeholders."""
    from olmo_ctl.rundir import did_you_mean, near_runs

    if device is not None:
        be = backend or make_backend(settings)
        be.validate_target(
            Target.of(device, slices), settings, f"{settings.run_root.rstrip('/')}/{run}", render_only=True
        )
    mine = _local_runs(settings)
    if recipe is None and mine is not None:  # a run to continue, looked for on this machine: not there
        root = mine.run_root
        rel = os.path.relpath(root)
        shown = root if rel.startswith("..") else f"./{rel}"
        why = ", where this machine's runs are while no run root is set" if mine is not settings else ""
        near = near_runs(root, run)
        raise BadInput(
            f"no run `{run}` under {shown}{why}",
            did_you_mean(near)
            + ("or " if near else "")
            + "pass --run-root for a run elsewhere, or --recipe/--stage and --device to create one",
        )
    raise BadInput(
        f"site settings still hold placeholders ({', '.join(placeholders(settings))})",
        "see `olmo-ctl config show`; `submit --dry-run` works without them",
    )


def refuse_ingredients(prep: Prepared) -> None:
    """`submit` sends an attempt of a run of one recipe: a run of ingredients' name is refused."""
    from olmo_ctl.rundir import Composite

    name = prep.rundir.name
    if Composite(prep.settings.run_root, name).exists():
        raise BadInput(
            f"`{name}` is a run of ingredients: `resume-until-done` runs it",
            "submit one of its ingredients' runs (NAME-i1, ...), or choose another run name",
        )


@dataclass(frozen=True)
class DryRun:
    """What `submit --dry-run` shows: the attempt the same `submit` would send (None: the run is
    complete, a submit sends nothing), and the lines for the terminal."""

    backend: Backend
    request: Attempt | None
    notes: list[str]
    prepared: Prepared | None = None  # None: rendered from the command line alone


def dry_run(
    settings: Settings,
    run: str,
    recipe: Recipe | None,
    device: Device | None,
    slices: int | None = None,
    attempt: int | None = None,
    extra_args: tuple[str, ...] = (),
) -> DryRun:
    """`submit --dry-run`: what the same `submit` would do, writing nothing. Where the run root can be
    read, the run is prepared as `submit_run` prepares it (`prepare_run`: every refusal of the run
    directory and the recipe, with the same line and exit code; an existing run's own recipe, device and
    slices), a run of ingredients is refused, a complete run sends nothing, a live supervisor's lease is
    refused, and the attempt number is the one `submit_next` would take (the journal's next, above any
    the run's lease reserved). The cluster is not asked (its Kueue objects, a live attempt) and nothing
    is compiled. Where the run root cannot be read (site settings with placeholders, or storage that
    refuses this machine), attempt 1 (or `attempt`) of a new run from the command line alone, and a
    note says why."""
    from olmo_ctl.rundir import LeaseHeld, RunDir

    validate_run_name(run)
    why = None
    if placeholders(settings):
        mine = _local_runs(settings)  # a run of this machine's continues with its own settings
        here = None if mine is None else RunDir.of(mine.run_root, run)
        if (
            mine is None
            or here is None
            or not os.path.isdir(here.path)
            or not here.exists()
            or placeholders(run_settings(mine, here))
        ):
            return _from_command_line(settings, run, recipe, device, slices, attempt, extra_args)
    else:
        try:
            RunDir.of(settings.run_root, run).exists()
        except BadInput:
            raise
        except OlmoCtlError as e:  # no credentials, storage unreachable: what this machine cannot read
            why = (
                f"the run root {settings.run_root} could not be read ({e.one_line()}): shown as a new run's "
                "attempt; `submit` reads the run directory first"
            )
    if why is not None:
        shown = _from_command_line(settings, run, recipe, device, slices, attempt, extra_args)
        return dataclasses.replace(shown, notes=[why, *shown.notes])
    prep = prepare_run(
        settings, run, recipe=recipe, device=device, slices=slices, attempt=attempt, extra_args=extra_args
    )
    refuse_ingredients(prep)
    data = data_root_note(prep.request.recipe.data.root)
    notes = prep.notes + ([data] if data else [])
    if prep.complete:
        return DryRun(prep.backend, None, notes, prep)
    n = prep.request.attempt
    if not prep.new_run:
        held = prep.rundir.live_lease()
        if held is not None:
            raise LeaseHeld(prep.rundir.name, held)
        n = max(n, int((prep.rundir.read_lease() or {}).get("reserved_attempt", 0)) + 1)
    return DryRun(prep.backend, dataclasses.replace(prep.request, attempt=n), notes, prep)


def _from_command_line(
    settings: Settings,
    run: str,
    recipe: Recipe | None,
    device: Device | None,
    slices: int | None,
    attempt: int | None,
    extra_args: tuple[str, ...],
) -> DryRun:
    """Attempt `attempt` (1) of a new run `run`, from the command line alone, placeholders allowed."""
    if recipe is None:
        raise BadInput("no recipe given", "pass --stage 1|2|3 or --recipe FILE|NAME")
    if device is None:
        raise BadInput("--dry-run renders a new run's attempt: it needs --device", "e.g. --device tpu7x-128")
    backend = make_backend(settings)
    run_dir = f"{settings.run_root.rstrip('/')}/{run}"
    n = 1 if attempt is None else attempt
    target = Target.of(device, slices)
    request = prepare(
        backend, run, run_dir, n, target, recipe, settings=settings, extra_args=extra_args, render_only=True
    )
    data = data_root_note(recipe.data.root)  # what a submit would read, said before it is read
    return DryRun(backend, request, backend.notes(request, render_only=True) + ([data] if data else []))


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
