"""`olmo-ctl surgery`: checkpoint surgery for stage 2 (warm-Adam) and parameter souping."""

from typing import Annotated

import typer

from olmo_ctl.cli.app import OlmoTyper, Output, OutputOpt, app, print_data

surgery_app = OlmoTyper(
    help="Checkpoint surgery: start stage 2 from stage 1 (warm Adam), average checkpoints."
)
app.add_typer(
    surgery_app,
    name="surgery",
    example="olmo-ctl surgery warm-adam gs://b/runs/s1/checkpoints/1413814 gs://b/runs/s2",
)


@surgery_app.command(
    "warm-adam", example="olmo-ctl surgery warm-adam gs://b/runs/s1/checkpoints/1413814 gs://b/runs/s2"
)
def warm_adam(
    src_checkpoint: Annotated[
        str, typer.Argument(metavar="SRC", help="Committed checkpoint step dir: <run>/checkpoints/<N>.")
    ],
    dst_run_dir: Annotated[
        str, typer.Argument(metavar="DST_RUN_DIR", help="New run directory for stage 2 (local or gs://).")
    ],
    output: OutputOpt = Output.table,
) -> None:
    """Start a stage-2 run from SRC's parameters and Adam moments, at step 0 with a fresh data order.

    Exit codes: 0 written, 2 bad input.
    """
    from olmo_ctl.trainer.quiet import cpu_only

    cpu_only()  # before JAX loads: no TPU runtime noise
    from olmo_ctl.checkpoints.surgery import warm_adam as run

    out = run(src_checkpoint, dst_run_dir)
    if output != Output.table:
        print_data(out, output)
        return
    typer.echo(
        f"wrote {out['out']}: parameters and Adam moments of step {out['source_step']}"
        f" (Adam count {out['adam_count']}), step 0, fresh data state"
    )


@surgery_app.command(
    "soup", example="olmo-ctl surgery soup runs/a/checkpoints/900 runs/a/checkpoints/1000 --out runs/a-soup"
)
def soup(
    checkpoints: Annotated[
        list[str], typer.Argument(metavar="CHECKPOINTS", help="Committed checkpoint step dirs to average.")
    ],
    out: Annotated[str, typer.Option("--out", help="New run directory for the averaged checkpoint.")],
    output: OutputOpt = Output.table,
) -> None:
    """Average the parameters of several checkpoints into OUT/checkpoints/0.

    Exit codes: 0 written, 2 bad input.
    """
    from olmo_ctl.trainer.quiet import cpu_only

    cpu_only()  # before JAX loads: no TPU runtime noise
    from olmo_ctl.checkpoints.surgery import soup as run

    res = run(list(checkpoints), out)
    if output != Output.table:
        print_data(res, output)
        return
    typer.echo(f"wrote {res['out']}: mean of {res['sources']} checkpoints' parameters")
