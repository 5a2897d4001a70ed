"""`olmo-ctl parity`: run our model and the Hugging Face model on the same tokens and compare logits."""

from typing import Annotated

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, print_data
from olmo_ctl.cli.convert import CkptRecipeOpt, _need
from olmo_ctl.core.errors import BadInput


@app.command(
    example="olmo-ctl parity ./Olmo-3-1025-7B gs://my-bucket/init/olmo3-7b --seq-len 8192 --batch 1 --dtype bf16"
)
def parity(
    hf_dir: Annotated[
        str, typer.Argument(metavar="HF_DIR", help="Hugging Face Olmo3ForCausalLM directory, local or gs://.")
    ],
    orbax_dir: Annotated[
        str,
        typer.Argument(
            metavar="ORBAX_DIR",
            help="Orbax directory with olmo_model.json, or <run-dir>/checkpoints/<N>; local or gs://.",
        ),
    ],
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per sequence.")] = 256,
    batch: Annotated[int, typer.Option("--batch", help="Sequences.")] = 2,
    dtype: Annotated[str, typer.Option("--dtype", help="fp32 or bf16.")] = "fp32",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random tokens.")] = 0,
    recipe: CkptRecipeOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """Compare the logits of the Hugging Face model and ours on the same random tokens.

    Reports KL(HF || ours), top-1 and top-10 agreement. Exit codes: 0 compared, 2 bad input.
    """
    if dtype not in ("fp32", "bf16"):
        raise BadInput(f"--dtype {dtype} is not fp32 or bf16")
    _need("jax", "orbax.checkpoint", extra="trainer")
    _need("torch", "transformers", extra="parity")
    from olmo_ctl.trainer.quiet import cpu_only

    cpu_only()  # before JAX loads: no TPU runtime noise
    from olmo_ctl.checkpoints.parity import run_parity

    res = run_parity(hf_dir, orbax_dir, seq_len=seq_len, batch=batch, dtype=dtype, seed=seed, recipe=recipe)
    if output != Output.table:
        print_data(res, output)
        return
    typer.echo(f"parity {dtype}, {res['tokens']} tokens (seq {seq_len})")
    typer.echo(f"  KL(HF || ours)  mean {res['kl_mean']:.3e}  max {res['kl_max']:.3e}")
    typer.echo(f"  top-1 agreement {res['top1_agreement']:.4f}")
    typer.echo(f"  top-10 overlap  {res['top10_overlap']:.4f}")
