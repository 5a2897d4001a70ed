"""YaRN RoPE on the full-attention layers (stage 3): frequencies equal to Hugging Face's, and logit
parity with `Olmo3ForCausalLM` configured with YaRN on its full-attention layer type, at a sequence
four times its original context."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from olmo_ctl.checkpoints import convert  # noqa: E402
from olmo_ctl.checkpoints.parity import hf_logits, logit_stats, our_logits, run_parity  # noqa: E402
from olmo_ctl.core.recipe import RopeScalingConfig, load_recipe  # noqa: E402

ORIGINAL, SEQ = 16, 64
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10.0,
    "factor": 8.0,
    "original_max_position_embeddings": ORIGINAL,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "attention_factor": 0.1 * math.log(8.0) + 1.0,
}
# Six layers, full attention every fourth and on the last (the last-layer rule); head_dim 32 and theta
# 10 put YaRN's ramp over frequency indices 0..7, so all three regimes (kept, blended, interpolated) occur.
CONFIG = dict(
    vocab_size=250,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    sliding_window=8,
    layer_types=["sliding_attention"] * 3 + ["full_attention", "sliding_attention", "full_attention"],
    rope_parameters={
        "full_attention": YARN,
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
    },
)


def _hf_inv_freq(rope_parameters: dict, hidden: int, heads: int):
    from transformers import Olmo3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = Olmo3Config(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_hidden_layers=4,
        rope_parameters=rope_parameters,
        max_position_embeddings=65536,
    )
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, None, layer_type="full_attention")
    return inv.numpy(), factor


def test_olmo3_stage3_frequencies_equal_hf_yarn():
    from olmo_ctl.trainer.model import rope_inv_freq

    m = load_recipe(stage=3).model
    rs = m.rope_scaling
    ref, ref_factor = _hf_inv_freq(convert._rope_parameters(m), m.d_model, m.n_heads)
    ours, factor = rope_inv_freq(m.head_dim, m.rope_theta, rs)
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-6)
    assert factor == pytest.approx(ref_factor, rel=1e-15) == pytest.approx(1.2079441541679836, rel=1e-15)
    plain, one = rope_inv_freq(m.head_dim, m.rope_theta)
    assert one == 1.0
    kept = np.isclose(np.asarray(ours), np.asarray(plain), rtol=1e-6)
    divided = np.isclose(np.asarray(ours), np.asarray(plain) / 8, rtol=1e-6)
    assert kept[:18].all() and divided[35:].all() and not (kept | divided)[19:35].any()  # ramp 18..35


@pytest.fixture(scope="module")
def yarn_pair(tmp_path_factory):
    from transformers import Olmo3Config, Olmo3ForCausalLM

    d = tmp_path_factory.mktemp("yarn")
    torch.manual_seed(3)
    cfg = Olmo3Config(
        **CONFIG,
        max_position_embeddings=ORIGINAL * 8,
        rms_norm_eps=1e-6,
        pad_token_id=1,
        eos_token_id=2,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = Olmo3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(d / "hf")
    convert.hf_to_orbax(str(d / "hf"), str(d / "orbax"))
    return str(d / "hf"), str(d / "orbax")


def test_yarn_config_maps_from_hf(yarn_pair):
    _, orbax = yarn_pair
    _, cfg, _ = convert.load_orbax(orbax)
    assert cfg.rope_scaling == RopeScalingConfig(
        factor=8.0, beta_fast=32.0, beta_slow=1.0, original_context=ORIGINAL, full_layers_only=True
    )
    assert [cfg.layer_rope_scaled(i) for i in range(6)] == [False, False, False, True, False, True]
    assert convert.hf_config_from_model(cfg)["rope_parameters"]["full_attention"] == YARN


def test_yarn_logit_parity_beyond_the_original_context(yarn_pair):
    hf, orbax = yarn_pair
    res = run_parity(hf, orbax, seq_len=SEQ, batch=2, dtype="fp32")
    print("YaRN fp32 parity at", SEQ, "tokens (original context", ORIGINAL, "):", res)
    assert res["kl_max"] < 1e-9 and res["top1_agreement"] == 1.0

    # The comparison can fail: without YaRN, or with YaRN on every layer, the logits move.
    params, cfg, _ = convert.load_orbax(orbax)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, SEQ))
    ref = hf_logits(hf, tokens)[..., : cfg.vocab_size].reshape(-1, cfg.vocab_size)
    for wrong in (
        dataclasses.replace(cfg, rope_scaling=None),
        dataclasses.replace(cfg, rope_scaling=dataclasses.replace(cfg.rope_scaling, full_layers_only=False)),
    ):
        ours = our_logits(params, wrong, tokens)[..., : cfg.vocab_size].reshape(-1, cfg.vocab_size)
        assert logit_stats(ref, ours)["kl_mean"] > 1e-4


def test_yarn_round_trips_to_hf(yarn_pair, tmp_path):
    hf, orbax = yarn_pair
    convert.orbax_to_hf(orbax, str(tmp_path / "back"))
    a, _ = convert.load_hf_dir(hf)
    b, _ = convert.load_hf_dir(str(tmp_path / "back"))
    assert convert._rope_from_hf(a) == convert._rope_from_hf(b)
    assert a["layer_types"] == b["layer_types"]
