"""Decode tokens/s on the CPU: the KV-cache decoder (`olmo_ctl/trainer/decode.py`, what `olmo-ctl generate`
runs) against transformers' `generate` on the same tiny OLMo 3 model.

The model is the smoke recipe's shape (4 layers, d_model 64, 4 heads of 16, 3:1 sliding/full with a
32-token window, 258-token vocabulary) as a random `Olmo3ForCausalLM` (weights drawn large enough
that greedy choices are clear: `rows_same_as_transformers` counts the rows both decode alike, and
for a row that differs, `rows_other_forward_agrees_with` says whose token transformers' own forward
pass, without a cache, picks at the first step where they part), converted to our parameters
with `convert`'s own code, so both sides hold the same weights. Both decode greedily `--new` tokens
after `--batch` prompts of `--prompt` tokens (no stop token: every row runs to the end), fp32, on this
machine's CPU (one JAX device; PyTorch with its default threads). Each side is warmed up once (our
compile), then timed `--repeats` times, the sides taking turns; the best repeat of each counts (the
machine may be shared). The last stdout line is one JSON object: both throughputs (new tokens per
second, all rows) and `ratio` (ours / transformers).

    PYTHONPATH=. python benchmarks/decode.py [--batch 8] [--prompt 32] [--new 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    import transformers

    from olmo_ctl.checkpoints import convert
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.trainer.decode import JaxEngine, Sampling

    m = load_recipe("smoke").model
    torch.manual_seed(0)
    hf = transformers.Olmo3ForCausalLM(
        transformers.Olmo3Config(
            vocab_size=m.vocab_size,
            hidden_size=m.d_model,
            intermediate_size=m.mlp_hidden,
            num_hidden_layers=m.n_layers,
            num_attention_heads=m.n_heads,
            num_key_value_heads=m.n_kv_heads,
            head_dim=m.head_dim,
            sliding_window=m.sliding_window,
            layer_types=[
                "full_attention" if m.layer_is_full(i) else "sliding_attention" for i in range(m.n_layers)
            ],
            max_position_embeddings=4096,
            rope_theta=m.rope_theta,
            rms_norm_eps=m.rms_norm_eps,
            pad_token_id=m.pad_token_id,
            eos_token_id=m.eos_token_id,
            bos_token_id=None,
            tie_word_embeddings=False,
        )
    ).eval()
    with torch.no_grad():  # peaked logits (as tests/test_decode.py): an argmax no rounding flips
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    cfg = convert.model_config_from_hf(hf.config.to_dict())
    params = convert.hf_state_to_params({k: v.numpy() for k, v in hf.state_dict().items()}, cfg)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 256, size=(args.batch, args.prompt))
    engine = JaxEngine(params, cfg, batch_size=args.batch)
    greedy = Sampling(max_tokens=args.new, stop_token_ids=(-1,))
    ids = [list(map(int, p)) for p in prompts]
    batch = torch.from_numpy(prompts.astype(np.int64))

    def ours() -> list[list[int]]:
        return [c.tokens for c in engine.generate(ids, greedy)]

    def theirs() -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(
                batch, max_new_tokens=args.new, do_sample=False, eos_token_id=None, pad_token_id=1
            )
        return out[:, args.prompt :].tolist()

    mine, hers = ours(), theirs()  # the warm-up (our compile), and the tokens each picks
    same = sum(a == b for a, b in zip(mine, hers, strict=True))
    # Where a row differs: which side transformers' own forward (no cache) agrees with at the first
    # differing step (transformers 5.24's generate leaves its forward past a sliding window, now and then).
    forward_sides = []
    for r, (a, b) in enumerate(zip(mine, hers, strict=True)):
        if a != b:
            t = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            with torch.no_grad():
                logits = hf(torch.tensor([ids[r] + a[:t]])).logits[0, -1]
            forward_sides.append(
                "ours"
                if int(logits.argmax()) == a[t]
                else "transformers"
                if int(logits.argmax()) == b[t]
                else "neither"
            )
    best = {"ours": float("inf"), "transformers": float("inf")}
    for _ in range(args.repeats):
        for name, fn in (("ours", ours), ("transformers", theirs)):
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    tokens = args.batch * args.new
    rate = {k: tokens / v for k, v in best.items()}
    for k in ("ours", "transformers"):
        print(f"{k:>12}: {rate[k]:10,.0f} new tokens/s ({best[k] * 1e3:.1f} ms for {tokens} tokens)")
    print(f"{'ratio':>12}: {rate['ours'] / rate['transformers']:.2f}x")
    print(
        f"{'tokens':>12}: {same} of {args.batch} rows the same as transformers' generate"
        + (f"; where not, its own forward picks as {', '.join(forward_sides)}" if forward_sides else "")
    )
    print(
        json.dumps(
            {
                "batch": args.batch,
                "prompt": args.prompt,
                "new": args.new,
                "ours_tokens_per_s": round(rate["ours"], 1),
                "transformers_tokens_per_s": round(rate["transformers"], 1),
                "ratio": round(rate["ours"] / rate["transformers"], 3),
                "rows_same_as_transformers": same,
                "rows_other_forward_agrees_with": forward_sides,
                "torch_threads": torch.get_num_threads(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
