"""OLMo 2 and OLMo 3 at the 32B's grouped-query ratio (5 query heads per KV head, as 40 over 8), on
tiny random Hugging Face models: `Olmo2ForCausalLM` and `Olmo3ForCausalLM` against our model at fp32
(KL < 1e-9), HF -> Orbax -> HF bit for bit, and the OLMo 2 family kept through the round trip."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from olmo_ctl.core.errors import BadInput

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from olmo_ctl.checkpoints import convert  # noqa: E402
from olmo_ctl.checkpoints.parity import run_parity  # noqa: E402

# 10 query heads over 2 KV heads (the 32B's 40/8), head_dim 8 != hidden/heads, vocab 250 padded to 256.
SHAPE = dict(
    vocab_size=250,
    hidden_size=48,
    intermediate_size=112,
    num_hidden_layers=5,
    num_attention_heads=10,
    num_key_value_heads=2,
    head_dim=8,
)
SEQ = 48


def make_hf(path, family: str, seed: int, dtype=None) -> str:
    """A random OLMo 2 or OLMo 3 model (peaked logits, non-trivial norms), saved as safetensors."""
    if family == "olmo2":
        from transformers import Olmo2Config as Config
        from transformers import Olmo2ForCausalLM as Model

        extra: dict = {}
    else:
        from transformers import Olmo3Config as Config  # type: ignore[assignment]
        from transformers import Olmo3ForCausalLM as Model  # type: ignore[assignment]

        extra = {  # 3 sliding : 1 full, the last layer full (OLMo-core's rule)
            "sliding_window": 12,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"] * 2,
        }
    torch.manual_seed(seed)
    cfg = Config(
        **SHAPE,
        **extra,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        pad_token_id=1,
        eos_token_id=2,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=["olmo2", "olmo3"])
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = make_hf(d / "hf", request.param, seed=11)
    cfg = convert.hf_to_orbax(hf, str(d / "orbax"))
    return request.param, hf, str(d / "orbax"), cfg


def test_the_family_is_read_from_config_json(pair):
    family, _, _, cfg = pair
    assert cfg.architecture == family
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.padded_vocab_size) == (10, 2, 8, 256)
    if family == "olmo2":
        assert (cfg.full_attention_every, cfg.sliding_window, cfg.rope_scaling) == (1, 0, None)
        assert all(cfg.layer_is_full(i) for i in range(cfg.n_layers))
    else:
        assert (cfg.full_attention_every, cfg.sliding_window) == (4, 12)
        assert [cfg.layer_is_full(i) for i in range(5)] == [False, False, False, True, True]


def test_fp32_parity_at_the_32b_head_ratio(pair):
    family, hf, orbax, _ = pair
    res = run_parity(hf, orbax, seq_len=SEQ, batch=2, dtype="fp32")
    print(family, "fp32", res)
    assert res["kl_max"] < 1e-9 and res["top1_agreement"] == 1.0 and res["top10_overlap"] == 1.0


def test_a_model_of_the_other_family_is_told_apart(pair, tmp_path):
    """The same weights read as the other family differ wherever a sliding layer's window matters."""
    family, hf, orbax, _ = pair
    other = make_hf(tmp_path / "other", "olmo3" if family == "olmo2" else "olmo2", seed=11)
    res = run_parity(other, orbax, seq_len=SEQ, batch=2, dtype="fp32")
    assert res["kl_mean"] > 1e-4


def test_round_trip_is_bit_exact_and_keeps_the_family(pair, tmp_path):
    family, hf, orbax, _ = pair
    convert.orbax_to_hf(orbax, str(tmp_path / "back"))
    ca, sa = convert.load_hf_dir(hf)
    cb, sb = convert.load_hf_dir(str(tmp_path / "back"))
    assert set(sa) == set(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and np.array_equal(sa[k].view(np.uint8), sb[k].view(np.uint8)), k
    assert cb["model_type"] == family
    assert cb["architectures"] == ["Olmo2ForCausalLM" if family == "olmo2" else "Olmo3ForCausalLM"]
    for key in ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window"):
        assert ca.get(key) == cb.get(key), key
    res = run_parity(str(tmp_path / "back"), orbax, seq_len=SEQ, batch=1, dtype="fp32")
    assert res["kl_max"] < 1e-9


@pytest.mark.parametrize("pair", ["olmo2"], indirect=True)
def test_an_olmo2_model_written_without_its_original_config(pair):
    """A model from a recipe (no original config.json to keep fields from) converts to a valid
    Olmo2Config that transformers loads."""
    cfg = pair[3]
    hf = convert.hf_config_from_model(cfg)
    assert hf["model_type"] == "olmo2" and "sliding_window" not in hf and "layer_types" not in hf
    from transformers import Olmo2Config

    loaded = Olmo2Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    assert loaded.rope_parameters["rope_theta"] == cfg.rope_theta
    assert loaded.num_key_value_heads == 2


@pytest.mark.parametrize("pair", ["olmo2"], indirect=True)
def test_olmo2_refuses_what_it_is_not(pair):
    hf = pair[1]
    base = json.load(open(os.path.join(hf, "config.json")))
    bad = {**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0}}
    with pytest.raises(BadInput, match="not OLMo 2's"):
        convert.model_config_from_hf(bad)
    with pytest.raises(BadInput, match="not olmo3 or olmo2"):
        convert.model_config_from_hf({**base, "model_type": "llama"})
