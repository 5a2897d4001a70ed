"""Training tokens/s on CPU for the smoke model: our jitted step vs Hugging Face Olmo3ForCausalLM (eager).

Both sides run the same step on the same config, batch and optimizer: forward, token cross-entropy
(fp32 logits), backward, global-norm clipping to 1.0, AdamW (lr, betas, eps and weight decay from the
recipe; no decay on the input embedding). Ours is one `jax.jit`-compiled function; the reference is
PyTorch eager. Prints both throughputs and their ratio.

    .venv/bin/python benchmarks/train_step.py [--steps 10] [--recipe smoke] [--set model.n_layers=8 ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def ours(recipe, tokens, steps: int) -> float:
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax

    from olmo_ctl.trainer import model as M

    cfg = dataclasses.replace(recipe.model, compute_dtype="float32", remat="none")
    o = recipe.optimizer
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    mask = {k: jax.tree.map(lambda _, k=k: k != "embed", v) for k, v in params.items()}
    tx = optax.chain(optax.clip_by_global_norm(o.grad_clip),
                     optax.adamw(o.lr, b1=o.betas[0], b2=o.betas[1], eps=o.eps, weight_decay=o.weight_decay,
                                 mask=mask))
    opt = tx.init(params)

    def loss_fn(p, x, y):
        logits = M.forward(p, x, cfg)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))

    @jax.jit
    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        upd, s = tx.update(g, s, p)
        return optax.apply_updates(p, upd), s, loss

    x, y = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
    params, opt, loss = step(params, opt, x, y)  # compile
    loss.block_until_ready()
    t = time.perf_counter()
    for _ in range(steps):
        params, opt, loss = step(params, opt, x, y)
    loss.block_until_ready()
    return x.size * steps / (time.perf_counter() - t)


def reference(recipe, tokens, steps: int) -> float:
    import torch
    from transformers import Olmo3Config, Olmo3ForCausalLM

    from olmo_ctl.trainer.convert import hf_config_from_model

    m, o = recipe.model, recipe.optimizer
    hf = hf_config_from_model(m)
    hf.pop("architectures", None), hf.pop("model_type", None), hf.pop("dtype", None)
    cfg = Olmo3Config(**{**hf, "vocab_size": m.padded_vocab_size})
    torch.manual_seed(0)
    model = Olmo3ForCausalLM(cfg).train()
    decay = [p for n, p in model.named_parameters() if "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if "embed_tokens" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=o.lr, betas=o.betas, eps=o.eps)
    x = torch.from_numpy(tokens[:, :-1]).long()
    y = torch.from_numpy(tokens[:, 1:]).long()

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=x, use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        return loss

    step()  # warm-up
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return x.numel() * steps / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    from olmo_ctl.core.recipe import load_recipe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="smoke")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    args = ap.parse_args(argv)
    recipe = load_recipe(args.recipe, overrides=args.overrides)
    m, t = recipe.model, recipe.train
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, m.vocab_size, size=(t.global_batch, t.seq_len + 1), dtype=np.int32)
    print(f"{recipe.name}: {m.n_layers} layers, d_model {m.d_model}, batch {t.global_batch} x {t.seq_len} tokens, "
          f"{args.steps} steps, fp32, CPU")
    a = ours(recipe, tokens, args.steps)
    print(f"ours (jax.jit)           {a:10.0f} tokens/s")
    b = reference(recipe, tokens, args.steps)
    print(f"HF Olmo3 (torch eager)   {b:10.0f} tokens/s")
    print(f"ratio                    {a / b:10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
