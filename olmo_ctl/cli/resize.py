"""`olmo-ctl resize`: continue a run on another device at the same global batch."""

import sys
from typing import Annotated

import typer

from olmo_ctl.cli.app import DeviceOpt, app, output_width
from olmo_ctl.cli.options import SiteFlags, SlicesOpt, TimeoutOpt, _echo, note, site_options
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.text import fit, wrap


@app.command(example="olmo-ctl resize olmo3-7b-s1 --device v5p-256 -y --at-next-checkpoint")
@site_options()
def resize(
    run: Annotated[
        str, typer.Argument(metavar="RUN", help="The run to resize (its name under the run root).")
    ],
    device: DeviceOpt,
    slices: SlicesOpt = None,
    at_next_checkpoint: Annotated[
        bool,
        typer.Option(
            "--at-next-checkpoint", help="Wait for the next scheduled checkpoint to commit, then stop."
        ),
    ] = False,
    now: Annotated[
        bool,
        typer.Option(
            "--now", help="Stop at once: the trainer checkpoints its last completed step (the default)."
        ),
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    timeout: TimeoutOpt = 3600.0,
    no_preflight: Annotated[
        bool,
        typer.Option(
            "--no-preflight", help="Skip compiling the step for the new slice before stopping anything."
        ),
    ] = False,
    *,
    site: SiteFlags,
) -> None:
    """Continue a run on another device (or slice count) at the same global batch.

    Commits the latest state, stops the attempt and submits the next one on --device (and --slices).
    With a live supervisor, the request is recorded for it to carry out. Exit codes: 0 resized, 1 the
    supervisor refused the request, 2 bad input (nothing stopped), 3 unreachable, 124 timed out
    waiting, 130 declined at the prompt.
    """
    from olmo_ctl.backends import existing_runs, make_backend
    from olmo_ctl.backends.base import Target
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.supervise.attempts import run_settings
    from olmo_ctl.supervise.resize import on, prepare_resize, resize_run, supervisor_alive
    from olmo_ctl.supervise.submit import check_attempt

    if at_next_checkpoint and now:
        raise BadInput("--at-next-checkpoint and --now are exclusive", "give one of them")
    mode = "at-next-checkpoint" if at_next_checkpoint else "now"
    settings = existing_runs(site.resolve())
    rundir = RunDir.of(settings.run_root, run)
    settings = run_settings(settings, rundir)  # not chosen here: the run's own backend and site settings
    be = make_backend(settings)
    target = Target.parse(device, slices)  # the command line's, parsed once
    be.validate_target(target, settings, rundir.path)  # the device itself, first
    plan = prepare_resize(rundir, be, target.device, slices)
    assert plan.new_attempt is not None
    for line in be.notes(plan.new_attempt):
        note(line)
    # The new attempt is checked as submit checks one, before anything is stopped.
    check_attempt(be, plan.new_attempt, preflight=not no_preflight, log=note)
    lines = [
        f"resize run `{run}`: attempt {plan.from_attempt} on {on(plan.old)} -> attempt {plan.to_attempt} "
        f"on {on(plan.new)} ({mode})"
    ] + ["  " + ln for ln in plan.plan_lines()]
    width = output_width()
    typer.echo("\n".join(fit(lines, width)))
    diff = plan.manifest_diff()  # each --plan record summarized: the lines above give its values
    if diff:
        typer.echo(diff)
    if supervisor_alive(rundir):
        typer.echo(
            "\n".join(
                wrap("a live supervisor drives this run: the resize is recorded for it to carry out", width)
            )
        )
    if not yes:
        if not sys.stdin.isatty():
            raise BadInput(
                "resize needs a confirmation and there is no terminal to ask on", "pass -y to confirm"
            )
        if not typer.confirm(f"Resize `{run}` to {on(plan.new)}?", default=False):
            _echo("not resized; nothing changed")
            raise typer.Exit(130)
    res = resize_run(rundir, be, plan, mode, timeout, log=_echo)
    for n in res.notes:
        _echo(n)
    if res.action == "requested":
        assert res.request is not None  # a requested resize carries the request it recorded
        typer.echo(f"resize request {res.request['id']} recorded for the supervisor of `{run}`")
    else:
        typer.echo(
            f"resized `{run}`: attempt {res.attempt} on {on(plan.new)} from committed step "
            f"{res.committed_step} (global batch {plan.new.global_batch}, per-device batch "
            f"{plan.old.per_device_batch} -> {plan.new.per_device_batch}, accumulation "
            f"{plan.old.grad_accum} -> {plan.new.grad_accum})"
        )
