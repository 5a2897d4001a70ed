"""`olmo-ctl stop`: stop a run at a checkpoint, on purpose; a supervisor watching it ends."""

import os
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

    Exit codes: 0 stopped (or nothing live to stop), 2 no such run, 3 cluster or storage unreachable,
    124 still stopping after --timeout, 130 Ctrl-C (the stop may be half way: run it again).
    """
    from olmo_ctl.supervise.stop import stop_run

    if _stop_ingredients(run, site, timeout, poll, output):
        return
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
            + f"); continue with: {continue_hint(rundir.name, rundir.path.rsplit('/', 1)[0], backend.name)}"
        )


def continue_hint(name: str, root: str, backend: str) -> str:
    """The command that continues a stopped run, as the supervisor's own Ctrl-C hint spells it: with
    its run root and backend, so that it works as printed whatever the site settings say."""
    return f"olmo-ctl resume-until-done {name} --run-root {root} --backend {backend}"


def _stop_ingredients(run: str, site: SiteFlags, timeout: float, poll: float, output: Output) -> bool:
    """`stop NAME` of a run of ingredients (docs/ingredients.md): each ingredient's run stopped as one
    run is, and the supervisor of the whole ends before the next; False when RUN is not one."""
    from olmo_ctl import storage
    from olmo_ctl.backends import existing_runs
    from olmo_ctl.rundir import Composite
    from olmo_ctl.supervise import ingredients
    from olmo_ctl.supervise.stop import stop_run

    settings = existing_runs(site.resolve())
    if "/" in run:
        root, _, name = run.rstrip("/").rpartition("/")
    else:
        root, name = settings.run_root, run
    if not storage.is_gcs(root) and not os.path.isdir(root):
        return False  # open_run says what is wrong
    comp = Composite(root, name)
    if not comp.exists():
        return False

    backends: list[str] = []

    def one(rd):
        _rd, _settings, backend = open_run(rd.path, site)
        backends.append(backend.name)
        return rd.name, stop_run(rd, backend, timeout_s=timeout, poll_s=poll, log=_echo)

    results = ingredients.stop(comp, one)
    if output != Output.table:
        print_data(
            {
                "run": name,
                "kind": "ingredients",
                "ingredients": [
                    {
                        "run": n,
                        "action": r.action,
                        "attempts_stopped": r.attempts,
                        "committed_step": r.committed_step,
                        "final_step": r.final_step,
                    }
                    for n, r in results
                ],
            },
            output,
        )
        return True
    if not results:
        typer.echo(f"run of ingredients `{name}` is complete (its soup is written): nothing to stop")
        return True
    for n, r in results:
        typer.echo(f"{n}: {r.action} at committed step {r.committed_step}/{r.final_step}")
    backend = backends[-1] if backends else settings.backend
    typer.echo(
        f"stopped run of ingredients `{name}`; continue with: "
        + continue_hint(name, root if storage.is_gcs(root) else os.path.abspath(root), backend)
    )
    return True
