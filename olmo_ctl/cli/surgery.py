"""`olmo-ctl surgery`: checkpoint surgery for stage 2 (warm-Adam) and parameter souping."""

from typing import Annotated

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, print_json

surgery_app = typer.Typer(
    help="Checkpoint surgery: stage-2 warm-Adam init, parameter soups.", no_args_is_help=True
)
app.add_typer(surgery_app, name="surgery")


@surgery_app.command("warm-adam")
def warm_adam(
    src_checkpoint: Annotated[
        str, typer.Argument(help="Committed checkpoint step dir: <run>/checkpoints/<N>.")
    ],
    dst_run_dir: Annotated[str, typer.Argument(help="New run directory for stage 2 (local or gs://).")],
    output: OutputOpt = Output.table,
) -> None:
    """Start a stage-2 run from SRC's parameters and Adam moments, at step 0 with a fresh data order."""
    from olmo_ctl.trainer.quiet import cpu_only

    cpu_only()  # before JAX loads: no TPU runtime noise
    from olmo_ctl.trainer.surgery import warm_adam as run

    out = run(src_checkpoint, dst_run_dir)
    if output == Output.json:
        print_json(out)
        return
    typer.echo(
        f"wrote {out['out']}: parameters and Adam moments of step {out['source_step']}"
        f" (Adam count {out['adam_count']}), step 0, fresh data state"
    )


@surgery_app.command("soup")
def soup(
    checkpoints: Annotated[list[str], typer.Argument(help="Committed checkpoint step dirs to average.")],
    out: Annotated[str, typer.Option("--out", help="New run directory for the averaged checkpoint.")],
    output: OutputOpt = Output.table,
) -> None:
    """Average the parameters of several checkpoints into OUT/checkpoints/0."""
    from olmo_ctl.trainer.quiet import cpu_only

    cpu_only()  # before JAX loads: no TPU runtime noise
    from olmo_ctl.trainer.surgery import soup as run

    res = run(list(checkpoints), out)
    if output == Output.json:
        print_json(res)
        return
    typer.echo(f"wrote {res['out']}: mean of {res['sources']} checkpoints' parameters")
