"""The KV-cache decoder (olmo_ctl/trainer/decode.py) against transformers' `generate` on tiny random
OLMo 3 and OLMo 2 models (sliding window, grouped-query heads, YaRN past the original context): the
same greedy tokens, each step's logits equal to the full forward's at that position, a batch of
prompts of different lengths equal to each alone, on one device and on a mesh; seeded sampling and
stop strings."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from olmo_ctl.checkpoints import convert  # noqa: E402
from olmo_ctl.core.errors import BadInput  # noqa: E402
from olmo_ctl.trainer.decode import JaxEngine, Sampling  # noqa: E402

NEW = 40  # tokens generated
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10.0,
    "factor": 8.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "attention_factor": 0.1 * math.log(8.0) + 1.0,
}
CASES = {
    # window 8 < the 50 tokens decoded; 2 key-value heads for 4 query heads; full attention at 1 and 3
    "olmo3": (
        "Olmo3",
        dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
    ),
    "olmo2": ("Olmo2", dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)),
    # YaRN on the full layers, decoding far past the original 16 positions; head_dim 32 != 64 / 2
    "olmo3-yarn": (
        "Olmo3",
        dict(
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=8,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={
                "full_attention": YARN,
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            },
        ),
    ),
}


@functools.cache
def build(case: str):
    """(the transformers model, our parameters, our ModelConfig) of one case, from the same weights."""
    family, spec = CASES[case]
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    torch.manual_seed(7)
    hf = model_cls(
        config_cls(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=160,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            pad_token_id=1,
            eos_token_id=2,
            bos_token_id=None,
            tie_word_embeddings=False,
            **spec,
        )
    )
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    hf.eval()
    cfg = convert.model_config_from_hf(hf.config.to_dict())
    params = convert.hf_state_to_params({k: v.numpy() for k, v in hf.state_dict().items()}, cfg)
    return hf, params, cfg


@pytest.fixture(params=list(CASES))
def model(request):
    return build(request.param)


@pytest.fixture
def olmo3():
    """The sliding-window, grouped-query case: what every case shares beyond the arithmetic."""
    return build("olmo3")


def hf_greedy(hf, prompt: list[int], new: int = NEW) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=1
        )
    return out[0, len(prompt) :].tolist()


NEVER = (-1,)  # a stop token no step produces: every row runs to max_tokens, as transformers is told


def test_greedy_equals_transformers_and_each_step_equals_the_full_forward(model):
    import jax
    import jax.numpy as jnp

    from olmo_ctl.trainer.model import forward

    hf, params, cfg = model
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, cfg.vocab_size, 10)]
    engine = JaxEngine(params, cfg)
    (c,) = engine.generate([prompt], Sampling(max_tokens=NEW, stop_token_ids=NEVER), keep_logits=True)
    assert c.tokens == hf_greedy(hf, prompt) and c.finish_reason == "length"
    seq = jnp.asarray([prompt + c.tokens[:-1]], jnp.int32)
    full = np.asarray(jax.jit(lambda p, t: forward(p, t, cfg, attention="reference"))(params, seq))[0]
    steps = np.stack(engine.step_logits[:NEW])[:, 0]  # [NEW, V]
    np.testing.assert_allclose(steps, full[len(prompt) - 1 :], rtol=0, atol=1e-5)


def test_a_batch_of_prompts_of_other_lengths_decodes_each_as_alone_on_a_mesh_too(olmo3):
    import jax

    from olmo_ctl.trainer import sharding

    _, params, cfg = olmo3
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, n)] for n in (3, 12, 7)]
    greedy = Sampling(max_tokens=20, stop_token_ids=NEVER)
    alone = [JaxEngine(params, cfg).generate([p], greedy)[0].tokens for p in prompts]
    assert [c.tokens for c in JaxEngine(params, cfg).generate(prompts, greedy)] == alone
    mesh = sharding.make_mesh(jax.devices()[:2], activate=False)
    assert [c.tokens for c in JaxEngine(params, cfg, mesh=mesh).generate(prompts, greedy)] == alone
    assert [c.tokens for c in JaxEngine(params, cfg, batch_size=2).generate(prompts, greedy)] == alone


def test_sampling_is_reproducible_with_a_seed_and_a_tiny_nucleus_is_greedy(olmo3):
    _, params, cfg = olmo3
    engine = JaxEngine(params, cfg)
    prompts = [[5, 6, 7], [8, 9]]
    sampled = Sampling(max_tokens=24, temperature=1.5, top_p=0.95, seed=3, stop_token_ids=NEVER)
    a, b = engine.generate(prompts, sampled), engine.generate(prompts, sampled)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    other = engine.generate(prompts, Sampling(**{**sampled.__dict__, "seed": 4}))
    assert [c.tokens for c in other] != [c.tokens for c in a]
    # draws follow the prompt (its place in the request), not its batch: copies of one prompt differ,
    # and any batch size gives the same samples
    copies = [c.tokens for c in engine.generate([[5, 6, 7]] * 3, sampled)]
    assert len({tuple(t) for t in copies}) == 3, copies
    assert [c.tokens for c in JaxEngine(params, cfg, batch_size=1).generate(prompts, sampled)] == [
        c.tokens for c in a
    ]
    greedy = engine.generate(prompts, Sampling(max_tokens=24, stop_token_ids=NEVER))
    nucleus = engine.generate(
        prompts, Sampling(max_tokens=24, temperature=1.0, top_p=1e-6, stop_token_ids=NEVER)
    )
    assert [c.tokens for c in nucleus] == [c.tokens for c in greedy]
    assert all(lp <= 0 for c in a for lp in c.logprobs) and len(a[0].logprobs) == 24


def test_stop_tokens_and_stop_strings_end_a_row(olmo3):
    _, params, cfg = olmo3
    text = lambda ids: "".join(chr(ord("a") + t % 26) for t in ids)  # noqa: E731 - a made-up detokenizer
    engine = JaxEngine(params, cfg, decode=text)
    prompt = [11, 12, 13]
    (free,) = engine.generate([prompt], Sampling(max_tokens=30, stop_token_ids=NEVER))
    # the 6th token as a stop token: it ends the row there and is kept
    (c,) = engine.generate([prompt], Sampling(max_tokens=30, stop_token_ids=(free.tokens[5],)))
    first = free.tokens.index(free.tokens[5])
    assert c.tokens == free.tokens[: first + 1] and c.finish_reason == "stop"
    # a stop string: the text ends before it, the tokens at the one that completed it
    stop = text(free.tokens[8:10])
    at = free.text.find(stop)
    (s,) = engine.generate([prompt], Sampling(max_tokens=30, stop=(stop,), stop_token_ids=NEVER))
    assert s.finish_reason == "stop" and s.text == free.text[:at]
    assert stop in text(s.tokens) and stop not in text(s.tokens[:-1])


def test_bad_sampling_and_prompts_are_refused(olmo3):
    _, params, cfg = olmo3
    engine = JaxEngine(params, cfg)
    for bad in (Sampling(max_tokens=0), Sampling(temperature=-1), Sampling(top_p=0), Sampling(top_p=1.5)):
        with pytest.raises(BadInput):
            engine.generate([[5]], bad)
    with pytest.raises(BadInput, match="outside the vocabulary"):
        engine.generate([[5, cfg.vocab_size]], Sampling(max_tokens=2))
    with pytest.raises(BadInput, match="no tokens"):
        engine.generate([[]], Sampling(max_tokens=2))
    with pytest.raises(BadInput, match="need a tokenizer"):
        engine.generate([[5]], Sampling(max_tokens=2, stop=("x",)))


def test_generate_continues_prompts_with_a_run_checkpoint(smoke_run, tmp_path):
    """`olmo-ctl generate` on a run's step directory (the trainer's own, without run.yaml: `--recipe`):
    its recipe's tokenizer reads the prompts, the
    rows split over two host devices decode as the engine does on one; bad options are one line, exit 2."""
    import json

    from helpers.cli import clean_env, invoke

    from olmo_ctl.checkpoints.evaluate import load_sharded, open_checkpoint
    from olmo_ctl.data.tokenizer import tokenizer_path
    from olmo_ctl.trainer import sharding

    env = clean_env(tmp_path / "xdg")
    ckpt = str(smoke_run / "checkpoints" / "40")
    prompts = ["The quick brown fox", "Once upon"]
    args = ["--prompt", prompts[0], "--prompt", prompts[1], "--max-tokens", "12", "--recipe", "smoke"]
    p = invoke("generate", ckpt, *args, "--device", "cpu-2", "-o", "json", env=env)
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert [r["prompt"] for r in rows] == prompts and all(r["tokens"] == 12 for r in rows), rows

    import jax
    from tokenizers import Tokenizer

    c = open_checkpoint(ckpt, "smoke")
    tok = Tokenizer.from_file(tokenizer_path(c.recipe.data.tokenizer))
    params = load_sharded(c, sharding.make_mesh(jax.devices()[:1], activate=False))
    ids = [tok.encode(t, add_special_tokens=False).ids for t in prompts]
    want = JaxEngine(params, c.model, decode=lambda t: tok.decode(t)).generate(ids, Sampling(max_tokens=12))
    assert [r["text"] for r in rows] == [w.text for w in want]

    for bad, said in (
        (["--top-p", "0"], "top-p 0.0 is not in (0, 1]"),
        (["--device", "v5p-8"], "--device v5p-8"),
        (["--prompts", str(tmp_path / "none.jsonl")], "no such file"),
    ):
        p = invoke("generate", ckpt, "--prompt", "x", "--recipe", "smoke", *bad, env=env)
        assert p.returncode == 2 and said in p.stderr and "Traceback" not in p.stderr, p.stderr
