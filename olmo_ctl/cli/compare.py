"""`olmo-ctl compare`: step-aligned deltas between two runs, or a run and a reference curve."""

from typing import Annotated

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, console, print_data
from olmo_ctl.cli.monitor import _g
from olmo_ctl.core.contracts import primary_loss_tag


@app.command(example="olmo-ctl compare runs/smoke-straight runs/smoke-resumed")
def compare(
    a: Annotated[
        str,
        typer.Argument(metavar="A", help="Run directory (local or gs://) or a CSV/TSV curve of step,value."),
    ],
    b: Annotated[
        str,
        typer.Argument(
            metavar="B", help="Run directory or curve file compared against A (deltas are B - A)."
        ),
    ],
    tags: Annotated[
        list[str] | None,
        typer.Option("--tags", help=f"Tag to compare (repeatable); default {primary_loss_tag()}."),
    ] = None,
    bin_steps: Annotated[int, typer.Option("--bin", help="Steps per bin for binned means.")] = 2000,
    threshold: Annotated[
        float | None,
        typer.Option(
            "--threshold",
            help="|Δ| above which two curves diverge (default 0 for two runs, 0.05 against a curve file); "
            "from a change of device layout, at least the layout-rounding bound.",
        ),
    ] = None,
    per_step: Annotated[
        bool, typer.Option("--per-step", help="With -o json: every common step as [step, A, B, B-A].")
    ] = False,
    output: OutputOpt = Output.table,
) -> None:
    """Compare two runs (or a run and a reference curve) step by step.

    Reports max |Δ|, binned means, the first step where |Δ| passes the threshold, and a one-line
    verdict. On one device layout two runs must agree bitwise; from the first step two runs computed
    on different layouts (their journals say), a Δ within k * eps * sqrt(n) * |value| is rounding
    ("equal up to layout rounding"; docs/monitoring-and-compare.md).

    Exit codes: 0 compared (whatever the verdict), 2 bad input, 3 storage unreachable.
    """
    from olmo_ctl.observe.compare import compare as do_compare

    res = do_compare(a, b, tags, bin_steps=bin_steps, threshold=threshold, per_step=per_step)
    if output != Output.table:
        print_data(res, output)
        return
    from rich.table import Table

    con = console()
    for tag, r in res["tags"].items():
        con.print(f"[bold]{tag}[/bold]: {r['verdict']}")
        if not r.get("bins"):
            continue
        t = Table(show_edge=False)
        for col in ("steps", "points", "mean A", "mean B", "mean Δ", "max |Δ|"):
            t.add_column(col, justify="right")
        bins = r["bins"]
        shown = bins if len(bins) <= 40 else bins[:: max(1, len(bins) // 40)]
        for x in shown:
            t.add_row(
                f"{x['start']}-{x['end']}",
                str(x["points"]),
                _g(x["mean_a"], ".5g"),
                _g(x["mean_b"], ".5g"),
                _g(x["mean_delta"], ".3g"),
                _g(x["max_abs_delta"], ".3g"),
            )
        con.print(t)
    con.print(f"verdict: {res['verdict']}")
