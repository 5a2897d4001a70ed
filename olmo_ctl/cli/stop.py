"""`olmo-ctl stop`: stop a run at a checkpoint, on purpose; a supervisor watching it ends."""

from typing import Annotated

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, print_data
from olmo_ctl.cli.options import SiteFlags, TimeoutOpt, _echo, site_options
from olmo_ctl.cli.run_arg import RunArg, open_run


@app.command(example="olmo-ctl stop olmo3-7b-s1")
@site_options(roles=("runs", "cluster"))
def stop(
    run: RunArg,
    timeout: TimeoutOpt = 900.0,
    poll: Annotated[float, typer.Option("--poll", min=0.05, help="Seconds between checks.")] = 1.0,
    output: OutputOpt = Output.table,
    *,
    site: SiteFlags,
) -> None:
    """Stop RUN gracefully: its attempt checkpoints its last completed step and ends, a supervisor
    (resume-until-done) watching it ends instead of resubmitting, and the journal records the run as
    stopped. `resume-until-done RUN` or `submit` continues it later from that checkpoint.

    Example: olmo-ctl stop olmo3-7b-s1

    Exit codes: 0 stopped (or nothing live to stop), 2 no such run, 3 cluster or storage unreachable,
    124 still stopping after --timeout, 130 Ctrl-C (the stop may be half way: run it again).
    """
    from olmo_ctl.supervise.stop import stop_run

    rundir, _settings, backend = open_run(run, site)
    res = stop_run(rundir, backend, timeout_s=timeout, poll_s=poll, log=_echo)
    if output != Output.table:
        print_data(
            {
                "run": rundir.name,
                "action": res.action,
                "attempts_stopped": res.attempts,
                "supervisor": res.supervisor,
                "committed_step": res.committed_step,
                "final_step": res.final_step,
            },
            output,
        )
        return
    if res.action == "complete":
        typer.echo(
            f"run `{rundir.name}` is complete ({res.committed_step}/{res.final_step}): nothing to stop"
        )
    elif res.action == "idle":
        typer.echo(
            f"run `{rundir.name}` has no live attempt and no supervisor: nothing to stop "
            f"(committed step {res.committed_step}/{res.final_step})"
        )
    else:
        what = ", ".join(f"attempt {n}" for n in res.attempts) or "no attempt was live"
        typer.echo(
            f"stopped run `{rundir.name}` at committed step {res.committed_step}/{res.final_step} ({what}"
            + ("; its supervisor ended" if res.supervisor else "")
            + f"); continue with: olmo-ctl resume-until-done {rundir.name}"
        )
