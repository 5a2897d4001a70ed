"""`olmo-ctl convert`: Hugging Face Olmo3ForCausalLM <-> Orbax checkpoints."""

from typing import Annotated

import typer

from olmo_ctl.cli.app import OlmoTyper, app
from olmo_ctl.core.errors import BadInput

convert_app = OlmoTyper(
    help="Convert between a Hugging Face Olmo3ForCausalLM directory and Orbax parameters."
)
app.add_typer(
    convert_app,
    name="convert",
    example="olmo-ctl convert hf-to-orbax ./Olmo-3-1025-7B gs://my-bucket/init/olmo3-7b",
)

OverwriteOpt = Annotated[
    bool, typer.Option("--overwrite", help="Replace an existing, non-empty destination.")
]
CkptRecipeOpt = Annotated[
    str | None,
    typer.Option(
        "--recipe",
        help="For a training checkpoint (<run-dir>/checkpoints/<N>) without run.yaml: the recipe of its model.",
    ),
]


def _need(*modules: str, extra: str) -> None:
    import importlib.util

    for m in modules:
        if importlib.util.find_spec(m) is None:
            raise BadInput(f"`{m}` is not installed", f"pip install 'olmo-ctl[{extra}]'")


@convert_app.command(
    "hf-to-orbax", example="olmo-ctl convert hf-to-orbax ./Olmo-3-1025-7B gs://my-bucket/init/olmo3-7b"
)
def hf_to_orbax(
    hf_dir: Annotated[
        str, typer.Argument(help="Hugging Face model directory (config.json + safetensors), local or gs://.")
    ],
    orbax_dir: Annotated[str, typer.Argument(help="Destination Orbax directory, local or gs://.")],
    vocab_size: Annotated[
        int | None,
        typer.Option(
            "--vocab-size", help="Real vocabulary size when config.json's vocab_size is already padded."
        ),
    ] = None,
    padded_vocab_size: Annotated[
        int | None,
        typer.Option(
            "--padded-vocab-size",
            help="Embedding rows to train with (default: rounded up to a multiple of 128).",
        ),
    ] = None,
    param_dtype: Annotated[str, typer.Option("--param-dtype", help="float32 or bfloat16.")] = "float32",
    overwrite: OverwriteOpt = False,
) -> None:
    """Convert a Hugging Face Olmo3ForCausalLM checkpoint into Orbax parameters (+ olmo_model.json).

    Streams one stored chunk (at most 64 MiB) at a time: memory stays a few hundred MiB at any size.

    Exit codes: 0 written, 2 bad input (a destination that is not empty: --overwrite).
    """
    _need("jax", "orbax.checkpoint", extra="trainer")
    if param_dtype not in ("float32", "bfloat16"):
        raise BadInput(f"--param-dtype {param_dtype} is not float32 or bfloat16")
    from olmo_ctl.trainer.quiet import cpu_only

    cpu_only()  # before JAX loads: no TPU runtime noise
    from olmo_ctl.checkpoints.convert import hf_to_orbax as run

    cfg = run(
        hf_dir,
        orbax_dir,
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size,
        param_dtype="bfloat16" if param_dtype == "bfloat16" else "float32",
        overwrite=overwrite,
    )
    typer.echo(
        f"wrote {orbax_dir}: {cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size} "
        f"(padded to {cfg.padded_vocab_size}), params {param_dtype}"
    )


@convert_app.command(
    "orbax-to-hf",
    example="olmo-ctl convert orbax-to-hf gs://my-bucket/runs/olmo3-7b-s1/checkpoints/2000 ./olmo3-7b-s1-2000",
)
def orbax_to_hf(
    orbax_dir: Annotated[
        str,
        typer.Argument(
            help="Orbax directory written by `convert hf-to-orbax`, or <run-dir>/checkpoints/<N>; local or gs://."
        ),
    ],
    hf_dir: Annotated[str, typer.Argument(help="Destination Hugging Face directory, local or gs://.")],
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype", help="float32 or bfloat16 (default: the dtype the model was converted from)."
        ),
    ] = None,
    recipe: CkptRecipeOpt = None,
    truncate_vocab: Annotated[
        bool,
        typer.Option(
            "--truncate-vocab",
            help="Write only the tokenizer's vocab_size rows (a training checkpoint's padded rows, which "
            "it trained, are dropped: the export's softmax then differs from the checkpoint's).",
        ),
    ] = False,
    overwrite: OverwriteOpt = False,
) -> None:
    """Convert Orbax parameters back to a Hugging Face Olmo3ForCausalLM / Olmo2ForCausalLM directory.

    Streams one stored chunk at a time into safetensors files laid out in advance. The vocabulary keeps
    the rows the model's softmax covers: every padded row of a training checkpoint (as OLMo-core's
    export does), a converted model's own rows; --truncate-vocab keeps vocab_size rows.

    Exit codes: 0 written, 2 bad input (a destination that is not empty: --overwrite).
    """
    _need("jax", "orbax.checkpoint", extra="trainer")
    if dtype not in (None, "float32", "bfloat16"):
        raise BadInput(f"--dtype {dtype} is not float32 or bfloat16")
    from olmo_ctl.trainer.quiet import cpu_only

    cpu_only()  # before JAX loads: no TPU runtime noise
    from olmo_ctl.checkpoints.convert import orbax_to_hf as run

    cfg, rows = run(
        orbax_dir, hf_dir, dtype=dtype, overwrite=overwrite, recipe=recipe, truncate_vocab=truncate_vocab
    )
    family = "Olmo2ForCausalLM" if cfg.architecture == "olmo2" else "Olmo3ForCausalLM"
    typer.echo(
        f"wrote {hf_dir}: {family}, {cfg.n_layers} layers, vocab {rows} rows (tokenizer {cfg.vocab_size})"
    )
