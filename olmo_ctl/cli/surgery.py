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
    "soup",
    example="olmo-ctl surgery soup runs/smoke-demo/checkpoints/80 runs/smoke-demo/checkpoints/100 --out runs/smoke-demo-soup",
)
def soup(
    checkpoints: Annotated[
        list[str],
        typer.Argument(
            metavar="CHECKPOINTS",
            help="Checkpoints of one model to average: committed step dirs (RUN/checkpoints/N) and"
            " directories written by `convert hf-to-orbax`, local or gs://.",
        ),
    ],
    out: Annotated[
        str, typer.Option("--out", help="New directory for the averaged parameters (local or gs://).")
    ],
    weights: Annotated[
        str | None,
        typer.Option(
            "--weights",
            metavar="W,W,...",
            help="One weight per checkpoint, in their order, positive, summing to 1 (default: equal).",
        ),
    ] = None,
    recipe: Annotated[
        str | None,
        typer.Option("--recipe", help="The model of step dirs whose run directory has no run.yaml."),
    ] = None,
    output: OutputOpt = Output.table,
) -> None:
    """Average the parameters of several checkpoints of one model into OUT, tensor by tensor.

    The mean is OLMo-core's: a float32 accumulator, `acc += w_i * x_i` in the order given. OUT is a
    parameter directory (the `convert hf-to-orbax` layout, with olmo_model.json and the manifest
    soup.json) that `eval`, `convert orbax-to-hf` and `--init-from` read. Only parameters are read,
    never optimizer state.

    Exit codes: 0 written, 2 bad input (nothing written: checkpoints of different models, weights
    that are not one per checkpoint or do not sum to 1, OUT not empty, a path that is not a checkpoint).
    """
    from olmo_ctl.checkpoints.soup import parse_weights, soup_weights

    ws = None if weights is None else parse_weights(weights)
    soup_weights(len(checkpoints), ws)  # refused before JAX loads
    from olmo_ctl.trainer.quiet import cpu_only

    cpu_only()  # before JAX loads: no TPU runtime noise
    from olmo_ctl.checkpoints.soup import soup as run

    res = run(list(checkpoints), out, ws, recipe)
    if output != Output.table:
        print_data(res, output)
        return
    shares = ", ".join(f"{s['weight']:.6g}" for s in res["sources"])
    typer.echo(
        f"wrote {res['out']}: float32 mean of {len(res['sources'])} checkpoints of {res['model']}"
        f" (weights {shares}), {res['tensors']} tensors, {res['parameters']:,} parameters, {res['dtype']}"
    )
