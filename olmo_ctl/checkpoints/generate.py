"""`olmo-ctl generate`: continue prompts with a checkpoint, in this process, on host CPU devices.

The checkpoint is any `eval` reads (`checkpoints/evaluate.py:open_checkpoint`: a run's step directory,
an Orbax directory with olmo_model.json, a Hugging Face OLMo 2 or OLMo 3 directory), its parameters
read into the trainer's shardings over the devices (`load_sharded`); the decoder is
`trainer/decode.py`'s engine. The prompts are text, tokenized with the checkpoint's tokenizer (a run's
`data.tokenizer`, a Hugging Face directory's tokenizer.json) or `--tokenizer`.
"""

from __future__ import annotations

from dataclasses import dataclass

from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import tokenizer_spec


@dataclass(frozen=True)
class Generation:
    """One prompt's completion as `generate` reports it."""

    prompt: str
    text: str
    tokens: int
    finish_reason: str

    def to_dict(self) -> dict:
        return {
            "prompt": self.prompt,
            "text": self.text,
            "tokens": self.tokens,
            "finish_reason": self.finish_reason,
        }


def tokenizer_of(ckpt, tokenizer: str | None) -> str:
    """The tokenizer spec of `ckpt` (`--tokenizer` first); a BadInput when there is none."""
    if tokenizer:
        return tokenizer
    if ckpt.recipe is not None and ckpt.recipe.data.tokenizer:
        return tokenizer_spec(ckpt.recipe)
    if ckpt.kind == "hf":
        return ckpt.path
    raise BadInput(
        f"`{ckpt.given}` names no tokenizer to read the prompts with",
        "--tokenizer PATH (a Hugging Face tokenizer directory or tokenizer.json, local or gs://)",
    )


def generate(
    checkpoint: str,
    prompts: list[str],
    sampling,
    *,
    devices,
    recipe: str | None = None,
    tokenizer: str | None = None,
    batch_size: int = 8,
) -> list[Generation]:
    """Each of `prompts` continued by the model at `checkpoint` with `sampling` (decode.Sampling), on
    `devices` (a list of JAX devices, the rows split over them)."""
    from tokenizers import Tokenizer

    from olmo_ctl.checkpoints.evaluate import load_sharded, open_checkpoint
    from olmo_ctl.data.tokenizer import tokenizer_path
    from olmo_ctl.trainer import sharding
    from olmo_ctl.trainer.decode import JaxEngine

    if not prompts:
        raise BadInput("no prompt to continue", "pass --prompt TEXT (repeatable) or --prompts FILE")
    sampling.check()
    ckpt = open_checkpoint(checkpoint, recipe)
    tok = Tokenizer.from_file(tokenizer_path(tokenizer_of(ckpt, tokenizer)))
    ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
    empty = [p for p, i in zip(prompts, ids, strict=True) if not i]
    if empty:
        raise BadInput(f"prompt {empty[0]!r} has no tokens", "give every prompt some text")
    mesh = sharding.make_mesh(devices, activate=False)
    params = load_sharded(ckpt, mesh)
    engine = JaxEngine(
        params,
        ckpt.model,
        decode=lambda t: tok.decode(t, skip_special_tokens=True),
        mesh=mesh,
        batch_size=batch_size,
    )
    done = engine.generate(ids, sampling)
    return [
        Generation(p, c.text or "", len(c.tokens), c.finish_reason)
        for p, c in zip(prompts, done, strict=True)
    ]
