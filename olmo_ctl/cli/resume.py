"""`olmo-ctl resume-until-done`: supervise a run until its final step is committed."""

import signal
import threading
from collections.abc import Callable
from enum import Enum
from typing import Annotated

import typer

from olmo_ctl.cli.app import ModelOpt, RecipeOpt, SetOpt, StageOpt, app
from olmo_ctl.cli.options import (
    AdmissionTimeoutOpt,
    AllowVersionChangeOpt,
    SiteFlags,
    SlicesOpt,
    note,
    site_options,
)
from olmo_ctl.core.devices import Target
from olmo_ctl.core.errors import BadInput, Interrupted
from olmo_ctl.core.names import default_run_name, validate_run_name
from olmo_ctl.core.recipe import Recipe, load_recipe, start_note


class LinesOutput(str, Enum):
    table = "table"  # one timestamped line per change (a progress bar on a terminal)
    jsonl = "jsonl"  # one JSON object per line, for log shippers


@app.command(
    "resume-until-done",
    example="olmo-ctl resume-until-done --recipe smoke --device cpu-1 --backend local --run demo --run-root runs",
)
@site_options()
def resume_until_done(
    run_name: Annotated[str | None, typer.Argument(metavar="RUN", help="Run name (or --run).")] = None,
    run: Annotated[
        str | None, typer.Option("--run", help="Run name (default: from the recipe name).")
    ] = None,
    stage: StageOpt = None,
    model: ModelOpt = None,
    recipe: RecipeOpt = None,
    set_: SetOpt = None,
    device: Annotated[
        str | None, typer.Option("--device", help="Device of a new run (e.g. cpu-1, tpu7x-128).")
    ] = None,
    slices: SlicesOpt = None,
    retry_backoff: Annotated[
        float | None,
        typer.Option(
            "--retry-backoff",
            help="Base backoff before a resubmission, seconds [env OLMO_CTL_RETRY_BACKOFF_SECONDS; "
            "300 on GKE, 5 locally]; doubles per attempt without progress, with jitter, up to a cap.",
        ),
    ] = None,
    max_retries: Annotated[
        int | None,
        typer.Option(
            "--max-retries",
            help="Attempts in a row without a new committed step before giving up "
            "[env OLMO_CTL_MAX_RETRIES, 5]; progress refills it.",
        ),
    ] = None,
    retry_user_errors: Annotated[
        bool,
        typer.Option("--retry-user-errors", help="Retry deterministic training failures (exit 1/2) too."),
    ] = False,
    stop_on_exit: Annotated[
        bool, typer.Option("--stop-on-exit", help="On Ctrl-C stop the attempt instead of leaving it running.")
    ] = False,
    poll: Annotated[float, typer.Option("--poll", help="Seconds between status checks.")] = 10.0,
    lease_ttl: Annotated[
        float | None,
        typer.Option(
            "--lease-ttl",
            help="Seconds without a heartbeat before another supervisor may take the run over "
            "[default: max(300, 6 x --poll)]; it watches the lease that long on its own clock first.",
        ),
    ] = None,
    stall_factor: Annotated[
        float,
        typer.Option(
            "--stall-factor", help="Stalled after this many median step intervals without progress."
        ),
    ] = 20.0,
    stall_min: Annotated[
        float, typer.Option("--stall-min", help="Never stalled sooner than this (s).")
    ] = 300.0,
    startup_timeout: Annotated[
        float, typer.Option("--startup-timeout", help="Longest start-up/compile before the first step (s).")
    ] = 1800.0,
    no_preflight: Annotated[
        bool,
        typer.Option(
            "--no-preflight", help="Skip compiling the step for the slice before the first submission."
        ),
    ] = False,
    allow_version_change: AllowVersionChangeOpt = False,
    admission_timeout: AdmissionTimeoutOpt = None,
    image_pull_timeout: Annotated[
        float | None,
        typer.Option(
            "--image-pull-timeout",
            min=1,
            help="Wait this many seconds for the kubelet's image pull backoff (a registry's 429, a timeout) "
            "before stopping with exit 2 naming the image (default 21600, or OLMO_CTL_IMAGE_PULL_TIMEOUT_SECONDS); "
            "a pull no retry fixes (not found, denied, InvalidImageName) exits 2 at once.",
        ),
    ] = None,
    fallback: Annotated[
        str | None,
        typer.Option(
            "--fallback",
            help="Devices (comma-separated, in order) to resize the run to when an attempt waits for capacity "
            "longer than --fallback-after: the same global batch and data order, across TPU generations too.",
        ),
    ] = None,
    fallback_after: Annotated[
        str | None,
        typer.Option(
            "--fallback-after",
            help="How long an attempt waits for capacity before the next --fallback device (90s, 30m, 2h; default 2h).",
        ),
    ] = None,
    return_after: Annotated[
        str | None,
        typer.Option(
            "--return-after",
            help="How long the run trains on a fallback device before it tries the preferred one again "
            "(its attempt checkpoints on SIGTERM; default: it stays).",
        ),
    ] = None,
    start_from: Annotated[
        str | None,
        typer.Option(
            "--start-from",
            help="A recipe of ingredients: the committed checkpoint (<run>/checkpoints/<N>) every ingredient "
            "starts from, with its parameters and Adam moments (as `surgery warm-adam`).",
        ),
    ] = None,
    concurrent: Annotated[
        int | None,
        typer.Option(
            "--concurrent",
            min=1,
            help="A recipe of ingredients: how many ingredients train at once (default: what the run of "
            "ingredients was created with, else 1; a new one keeps it).",
        ),
    ] = None,
    output: Annotated[
        LinesOutput,
        typer.Option(
            "--output",
            "-o",
            help="table (one line per change) or jsonl (one JSON object per line: each journaled decision "
            "with its journal fields, for log shippers).",
        ),
    ] = LinesOutput.table,
    *,
    site: SiteFlags,
) -> int:
    """Supervise a run until its final step is committed.

    Reattaches to a live attempt, waits while queued (a preempted attempt is requeued by Kueue),
    resubmits after a failure with backoff. Exit codes: 0 the final step is committed, 1 a user error
    in training, 2 bad input (a directory that lost its run.yaml too), another supervisor holding the run
    (or the run of ingredients), a queue set-up Kueue can never admit or an image no node can pull, 3 storage
    unreachable (an unreachable Kubernetes API is waited out) or the lease lost to another supervisor, 4 gave up (a
    crash loop, retries exhausted), 130 Ctrl-C (detaches and leaves the attempt running) or
    `olmo-ctl stop` (ends it). The site settings' notify_webhook / notify_command hear when the run
    finishes, fails, is resized or gives up.
    """
    if run_name and run and run_name != run:
        raise BadInput(f"two run names: `{run_name}` and --run `{run}`", "give one")
    settings = site.resolve()
    r = None
    if recipe is not None or stage is not None or model is not None:
        r = load_recipe(recipe, stage, set_ or (), model=model)
    elif set_:
        raise BadInput("--set needs --recipe or --stage", "an existing run keeps its recipe (run.yaml)")
    name = run_name or run or (default_run_name(r) if r is not None else None)
    if name is None:
        raise BadInput("which run?", "pass RUN, or --recipe/--stage with --device to create one")
    validate_run_name(name)
    if start_from is not None and (r is None or not r.ingredients):
        raise BadInput(
            "--start-from is for a recipe of ingredients (its `ingredients:` list)",
            "start one run from a checkpoint with `olmo-ctl surgery warm-adam` or the trainer's --init-from",
        )
    if concurrent is not None and r is not None and not r.ingredients:
        raise BadInput(
            "--concurrent is for a recipe of ingredients (its `ingredients:` list)",
            "a run of one recipe trains one attempt at a time",
        )
    if poll <= 0:
        raise BadInput(f"--poll {poll} must be positive")
    if lease_ttl is not None and lease_ttl < 2 * poll:
        raise BadInput(
            f"--lease-ttl {lease_ttl:g} must be at least twice --poll ({poll:g})",
            "the supervisor renews its lease once per poll",
        )
    policy_args = dict(
        retry_backoff_s=retry_backoff,
        max_retries=max_retries,
        retry_user_errors=retry_user_errors,
        stall_factor=stall_factor,
        stall_min_s=stall_min,
        startup_limit_s=startup_timeout,
        admission_timeout_s=admission_timeout,
        image_pull_timeout_s=image_pull_timeout,
    )
    fall = _fallback(fallback, fallback_after, return_after, device)
    extra_args = ("--allow-version-change",) if allow_version_change else ()
    dev = None if device is None else Target.parse(device, slices).device  # the command line's, parsed once
    from olmo_ctl.backends import existing_runs
    from olmo_ctl.rundir import Composite
    from olmo_ctl.supervise import ingredients as ingr

    mine = existing_runs(settings)  # no run root set: this machine's runs/ (a run of one recipe: prepare_run)
    composite = Composite(mine.run_root, name)
    composite_exists = composite.exists()
    if composite_exists:
        settings = mine
    elif mine is not settings:
        composite = Composite(settings.run_root, name)  # a new run goes where the settings say
    if r is not None and not r.ingredients and composite_exists:
        raise BadInput(
            f"`{name}` is a run of ingredients ({composite.recipe().name}), not a run of {r.name}",
            f"continue it with `olmo-ctl resume-until-done {name}`, or choose another run name",
        )
    # What every run this command supervises shares (one run, or each ingredient of a run of them).
    shared = dict(
        settings=settings,
        extra_args=extra_args,
        no_preflight=no_preflight,
        fall=fall,
        policy_args=policy_args,
        poll=poll,
        stop_on_exit=stop_on_exit,
        lease_ttl=lease_ttl,
        output=output,
    )
    if (r is not None and r.ingredients) or (r is None and composite_exists):

        def one(
            run: str,
            recipe: Recipe | None,
            device: str | None,
            slices: int | None,
            log: Callable[[str], None],
            cancel: threading.Event | None = None,
        ) -> int:
            d = None if device is None else Target.parse(device, slices).device
            return _supervise(run, recipe, d, slices, log, hint_run=name, cancel=cancel, **shared)

        whole = (
            f"olmo-ctl resume-until-done {name} --run-root {settings.run_root} --backend {settings.backend}"
        )
        with _term_is_ctrl_c():
            return ingr.supervise(
                composite,
                r,
                device=device,
                slices=slices,
                start_from=start_from,
                supervise_one=one,
                log=note,
                concurrent=concurrent,
                hint=whole,
                lease_ttl_s=lease_ttl or max(ingr.DEFAULT_LEASE_TTL_S, 6 * poll),  # as one run's supervisor's
            )
    if concurrent is not None:
        raise BadInput(
            f"--concurrent: `{name}` is a run of one recipe, not of ingredients",
            "a run of one recipe trains one attempt at a time",
        )
    start = start_note(r) if r is not None else None  # a stage that starts from another's checkpoint
    return _supervise(name, r, dev, slices, note, start=start, **shared)


class _term_is_ctrl_c:
    """SIGTERM (tmux closing, systemd stopping) detaches a supervisor as Ctrl-C does; only the main
    thread installs it (a supervisor run beside others is ended through its `cancel` event)."""

    def __enter__(self):
        self.old = None
        if threading.current_thread() is threading.main_thread():

            def on_term(signum, frame):
                raise KeyboardInterrupt

            self.old = signal.signal(signal.SIGTERM, on_term)
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)
        return False


def _supervise(
    name,
    r,
    dev,
    slices,
    note,
    *,
    settings,
    extra_args,
    no_preflight,
    fall,
    policy_args,
    poll,
    stop_on_exit,
    lease_ttl,
    output,
    hint_run: str | None = None,
    cancel: threading.Event | None = None,
    start: str | None = None,
) -> int:
    """One run supervised until its final step is committed (or the supervisor ends): the exit code.
    `hint_run`: the run a person continues with (a run of ingredients' own name), if not this one.
    `cancel`: a supervisor run beside others (a thread): it ends as on Ctrl-C once this is set, and
    prints lines rather than a progress bar. `start`: a note on what the run's stage starts from,
    said once the run's checks have passed."""
    from olmo_ctl.supervise.notify import Notifier
    from olmo_ctl.supervise.policy import RetryPolicy
    from olmo_ctl.supervise.submit import check_attempt, create_run, prepare_run
    from olmo_ctl.supervise.supervisor import JsonlPrinter, Printer, Supervisor

    # The next attempt, resolved and checked as submit checks it, before run.yaml exists.
    prep = prepare_run(settings, name, recipe=r, device=dev, slices=slices, extra_args=extra_args)
    policy = RetryPolicy.from_env(default_backoff_s=prep.backend.retry_backoff_s, **policy_args)
    if fall is not None:
        from olmo_ctl.core.batching import make_plan

        for d in fall.devices:  # a fallback the run cannot use is bad input now, not a refusal later
            try:
                make_plan(prep.request.recipe, Target.parse(d).device, prep.request.slices)
            except BadInput as e:
                raise BadInput(f"--fallback {d}: {e.message}", e.hint) from None
    for line in prep.notes + ([start] if start is not None and not prep.complete else []):
        note(line)
    if not prep.complete:
        check_attempt(prep.backend, prep.request, preflight=not no_preflight, log=note)
    create_run(prep)
    rundir, be = prep.rundir, prep.backend
    hint = f"olmo-ctl resume-until-done {hint_run or name} --run-root {prep.settings.run_root} --backend {be.name}"
    printer: Printer | None = JsonlPrinter(name) if output == LinesOutput.jsonl else None
    extra: dict = {}
    if cancel is not None:
        if printer is None:
            printer = Printer(name)
            printer.tty = False  # several runs' lines interleave; no bar to redraw

        def sleep(seconds: float) -> None:
            if cancel.wait(seconds):
                raise KeyboardInterrupt

        extra["sleep"] = sleep
        if cancel.is_set():
            raise Interrupted(f"nothing is running; continue with: {hint}")
    sup = Supervisor(
        rundir,
        be,
        policy,
        device=dev,
        poll_s=poll,
        stop_on_exit=stop_on_exit,
        reattach_hint=hint,
        lease_ttl_s=lease_ttl,
        slices=slices,
        extra_args=extra_args,
        printer=printer,
        notify=Notifier.from_settings(prep.settings, log=note),
        fallback=fall,
        **extra,
    )
    sup.out.line(f"run directory: {rundir.path}")
    with _term_is_ctrl_c():  # a terminating supervisor detaches like Ctrl-C
        return sup.run()


DEFAULT_FALLBACK_AFTER = "2h"


def _fallback(devices: str | None, after: str | None, back: str | None, device: str | None):
    """The --fallback policy (`supervise.policy.Fallback`), or None; bad input before anything is written."""
    from olmo_ctl.core.durations import parse_duration
    from olmo_ctl.supervise.policy import Fallback

    if devices is None:
        if after is not None or back is not None:
            raise BadInput(
                "--fallback-after and --return-after need --fallback",
                "e.g. --fallback v5p-256 --fallback-after 2h",
            )
        return None
    names = [d.strip() for d in devices.split(",") if d.strip()]
    if not names:
        raise BadInput("--fallback names no device", "e.g. --fallback v5p-256,tpu7x-64")
    for n in names:
        d = Target.parse(n).device
        d.check_launchable("--fallback")
        if not d.is_tpu:
            raise BadInput(f"--fallback {n}: a fallback is a TPU slice on GKE", "e.g. --fallback v5p-256")
    if len(set(names)) != len(names) or (device is not None and device in names):
        raise BadInput(f"--fallback {devices} names a device twice (or the run's own --device)")
    after_s = parse_duration(after or DEFAULT_FALLBACK_AFTER, "--fallback-after")
    back_s = parse_duration(back, "--return-after") if back is not None else None
    if after_s <= 0 or (back_s is not None and back_s <= 0):
        raise BadInput("--fallback-after and --return-after must be positive durations", "e.g. 30m, 2h")
    return Fallback(tuple(names), after_s, back_s)
