"""`olmo-ctl generate`: continue prompts with a checkpoint (ours or a Hugging Face directory)."""

import json
from typing import Annotated

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, print_data
from olmo_ctl.cli.convert import CkptRecipeOpt, _need
from olmo_ctl.cli.evaluate import cpu_count
from olmo_ctl.core.errors import BadInput


def read_prompts(path: str) -> list[str]:
    """The `prompt` of each line of a JSONL file (a line may also be a JSON string)."""
    from olmo_ctl import storage

    try:
        text = storage.store_for(path).read_text(path)
    except (storage.NotFound, FileNotFoundError, IsADirectoryError):
        raise BadInput(f"--prompts {path}: no such file", "one JSON object a line, with a `prompt`") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise BadInput(f"{path}:{n} is not JSON", "one JSON object a line, with a `prompt`") from None
        prompt = row if isinstance(row, str) else row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(prompt, str):
            raise BadInput(f"{path}:{n} has no `prompt` string", "one JSON object a line, with a `prompt`")
        out.append(prompt)
    return out


@app.command(example="olmo-ctl generate runs/smoke-demo/checkpoints/100 --prompt 'Once upon a time'")
def generate(
    checkpoint: Annotated[
        str,
        typer.Argument(
            metavar="CHECKPOINT",
            help="<run-dir>/checkpoints/<N>, an Orbax directory with olmo_model.json, or a Hugging Face "
            "OLMo 2 / OLMo 3 directory; local or gs://.",
        ),
    ],
    prompt: Annotated[list[str] | None, typer.Option("--prompt", help="A prompt (repeatable).")] = None,
    prompts: Annotated[
        str | None, typer.Option("--prompts", help='A JSONL file of prompts: one `{"prompt": ...}` a line.')
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="New tokens per prompt at most.")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", help="0: greedy; above: sampled.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Sample from the top-p nucleus.")] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sampling (same seed, same text).")] = 0,
    stop: Annotated[
        list[str] | None, typer.Option("--stop", help="End a completion before this text (repeatable).")
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Prompts decoded together.", min=1)] = 8,
    device: Annotated[
        str,
        typer.Option(
            "--device", help="cpu-N: N host CPU devices of this process, the prompts split over them."
        ),
    ] = "cpu-1",
    tokenizer: Annotated[
        str | None,
        typer.Option(
            "--tokenizer", help="Tokenizer directory or tokenizer.json (default: the checkpoint's)."
        ),
    ] = None,
    recipe: CkptRecipeOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """Continue prompts with a checkpoint, greedy or sampled, with a KV cache.

    Prefills each batch of prompts, then decodes a token a step until a stop token, a --stop text or
    --max-tokens. Exit codes: 0 generated, 2 bad input.
    """
    texts = list(prompt or []) + (read_prompts(prompts) if prompts else [])
    n = cpu_count(device, "generate")
    _need("jax", "orbax.checkpoint", extra="trainer")
    from olmo_ctl.trainer.quiet import cpu_devices

    devices = cpu_devices(n)  # before anything starts JAX: this process's host CPU devices
    from olmo_ctl.checkpoints.generate import generate as run
    from olmo_ctl.trainer.decode import Sampling

    sampling = Sampling(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=tuple(stop or ())
    )
    done = run(
        checkpoint,
        texts,
        sampling,
        devices=devices,
        recipe=recipe,
        tokenizer=tokenizer,
        batch_size=batch_size,
    )
    if output != Output.table:
        print_data([g.to_dict() for g in done], output)
        return
    for i, g in enumerate(done):
        if i:
            typer.echo("")
        typer.echo(f"prompt {i + 1}: {json.dumps(g.prompt)}")
        typer.echo(f"completion ({g.tokens} tokens, {g.finish_reason}): {json.dumps(g.text)}")
