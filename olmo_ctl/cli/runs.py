"""`olmo-ctl runs`: the runs under a run root, one line each."""

from typing import Annotated

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, output_width, plural, print_data
from olmo_ctl.cli.options import SiteFlags, note, site_options
from olmo_ctl.core.text import table_lines, wrap


def _loss(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


@app.command(example="olmo-ctl runs --run-root runs -o json")
@site_options(roles=("runs",))
def runs(
    backend_status: Annotated[
        bool,
        typer.Option(
            "--backend-status/--no-backend-status",
            help="Ask the backend about attempts the journal says may be live (--no-backend-status: "
            "the journal only, no cluster calls).",
        ),
    ] = True,
    all_: Annotated[
        bool,
        typer.Option(
            "--all",
            help="Also list the runs `olmo-ctl smoke` made (smoke-DEVICE-..., and their -twin): "
            "by default they are only counted.",
        ),
    ] = False,
    output: OutputOpt = Output.table,
    *,
    site: SiteFlags,
) -> None:
    """List the runs under the run root: name, stage, device, committed step / final step, state, last
    loss and when each last changed; under a queued or admitted run, what holds it in one line (Kueue's
    reason, the scheduler's, an image pull). The runs `olmo-ctl smoke` made are counted, not listed,
    unless --all.

    Exit codes: 0 ok, 2 the run root does not exist, 3 storage unreachable.
    """
    from olmo_ctl.backends import existing_runs
    from olmo_ctl.observe.runs import list_runs
    from olmo_ctl.supervise.attempts import handle_status

    settings = existing_runs(site.resolve())
    listed = list_runs(settings.run_root, handle_status if backend_status else None, smoke=all_)
    rows = listed.rows
    if output != Output.table:
        print_data(
            {
                "run_root": settings.run_root,
                "runs": [r.to_dict() for r in rows],
                "smoke_runs_hidden": listed.smoke_hidden,
            },
            output,
        )
        return
    if listed.smoke_hidden:
        note(
            f"{plural(listed.smoke_hidden, 'smoke run')} (made by `olmo-ctl smoke`) not listed; --all lists them"
        )
    if not rows:
        typer.echo(f"no runs under {settings.run_root}")
        return
    head = ("RUN", "STAGE", "DEVICE", "STEP", "STATE", "LOSS", "UPDATED")
    table = [
        (
            r.name,
            str(r.stage) if r.stage else "-",
            r.device or "-",
            f"{r.step}/{r.final_step}" if r.final_step is not None else str(r.step),
            r.state,
            _loss(r.last_loss),
            (r.updated or "-")[:19].replace("T", " "),
        )
        for r in rows
    ]
    width = output_width()
    after = [  # why a run waits, under its row
        wrap(f"  └ {r.waiting['line']}", width, 4) if r.waiting and r.waiting.get("line") else []
        for r in rows
    ]
    # A run of ingredients' state names the ingredient going on: in a narrow terminal it wraps in its cell.
    for line in table_lines(head, table, flex=("STATE",), width=width, after=after):
        typer.echo(line)
