"""`olmo-ctl amend`: change a run's horizon, intervals, evaluation or logging from its next attempt on."""

from typing import Annotated

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, print_data
from olmo_ctl.cli.options import SiteFlags, TimeoutOpt, _echo, site_options
from olmo_ctl.cli.run_arg import RunArg, open_run


@app.command(example="olmo-ctl amend olmo3-7b-s1 --set train.max_steps=1668931")
@site_options(roles=("runs", "cluster"))
def amend(
    run: RunArg,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="KEY=VALUE to change (repeatable): train.max_steps, checkpoint.*, eval.*, logging.*, runtime.*.",
        ),
    ] = None,
    restart: Annotated[
        bool,
        typer.Option(
            "--restart", help="Stop the live attempt at its next checkpoint so the change applies now."
        ),
    ] = False,
    timeout: TimeoutOpt = 3600.0,
    output: OutputOpt = Output.table,
    *,
    site: SiteFlags,
) -> None:
    """Change RUN from its next attempt on, keeping it the same run: its final step (the LR schedule
    continues to the new horizon), checkpoint, evaluation and logging settings. The change is recorded
    in run.yaml with the step it takes effect at, and shown by `monitor`. The live attempt goes on as it
    started unless --restart. The model, data, seeds, batch and optimizer cannot change: a device
    change is `resize`, anything else a new run.

    Exit codes: 0 recorded (and, with --restart, the attempt stopped or the request handed to the
    supervisor), 2 bad input (nothing changed), 3 cluster or storage unreachable, 124 no checkpoint
    within --timeout (the amendment stays recorded for the next attempt).
    """
    from olmo_ctl.supervise.amend import amend_run

    rundir, settings, backend = open_run(run, site)
    res = amend_run(
        rundir, backend, set_ or [], restart=restart, settings=settings, timeout_s=timeout, log=_echo
    )
    if output != Output.table:
        print_data({"run": rundir.name, **res.to_dict()}, output)
        return
    for n in res.notes:
        _echo(n)
    what = ", ".join(f"{c['key']} {c['old']} -> {c['new']}" for c in res.amendment["changes"])
    if res.action == "restarted":
        typer.echo(
            f"amended `{rundir.name}`: {what} from step {res.amendment.get('from_step')} "
            f"(attempt {res.attempt}, final step {res.final_step})"
        )
    else:
        typer.echo(
            f"amended `{rundir.name}`: {what}, from the next attempt (committed step {res.committed_step}, "
            f"final step {res.final_step})"
        )
