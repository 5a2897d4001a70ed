"""HF Olmo3ForCausalLM <-> Orbax conversion and logit parity, on tiny random models (no downloads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from olmo_ctl.core.errors import BadInput

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from olmo_ctl.checkpoints import convert  # noqa: E402
from olmo_ctl.checkpoints.parity import run_parity  # noqa: E402

# A: window 16 < the 64-token test sequence, vocab 300 padded to 384, full layers at 3 and 7.
CONFIG_A = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    sliding_window=16,
)
# B: grouped-query, head_dim 32 != hidden/heads, full attention every 2nd layer, window 8.
CONFIG_B = dict(
    vocab_size=200,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 3,
)
SEQ = 64


def make_hf(path, spec: dict, seed: int, dtype=None) -> str:
    """A random Olmo3ForCausalLM with peaked logits and non-trivial norm weights, saved as safetensors."""
    from transformers import Olmo3Config, Olmo3ForCausalLM

    torch.manual_seed(seed)
    cfg = Olmo3Config(
        **spec,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        pad_token_id=1,
        eos_token_id=2,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = Olmo3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    return str(path)


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", "from olmo_ctl.cli import entry; entry()", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


@pytest.fixture(scope="module")
def pair_a(tmp_path_factory):
    d = tmp_path_factory.mktemp("a")
    hf = make_hf(d / "hf", CONFIG_A, seed=0)
    r = cli("convert", "hf-to-orbax", hf, str(d / "orbax"))
    assert r.returncode == 0, r.stderr
    assert "padded to 384" in r.stdout
    return hf, str(d / "orbax")


@pytest.fixture(scope="module")
def pair_b(tmp_path_factory):
    d = tmp_path_factory.mktemp("b")
    hf = make_hf(d / "hf", CONFIG_B, seed=1)
    convert.hf_to_orbax(hf, str(d / "orbax"))
    return hf, str(d / "orbax")


def test_parity_fp32_through_the_cli(pair_a):
    hf, orbax = pair_a
    r = cli("parity", hf, orbax, "--seq-len", str(SEQ), "--batch", "2", "--dtype", "fp32", "-o", "json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    print("config A fp32", res)
    assert set(res) == {"kl_mean", "kl_max", "top1_agreement", "top10_overlap", "dtype", "seq_len", "tokens"}
    assert res["kl_mean"] < 1e-6 and res["kl_max"] < 1e-5
    assert res["top1_agreement"] == 1.0 and res["top10_overlap"] == 1.0
    assert (res["dtype"], res["seq_len"], res["tokens"]) == ("fp32", SEQ, 2 * SEQ)


def test_parity_fp32_gqa_head_dim_and_pattern(pair_b):
    res = run_parity(*pair_b, seq_len=SEQ, batch=2, dtype="fp32")
    print("config B fp32", res)
    assert res["kl_mean"] < 1e-6 and res["top1_agreement"] == 1.0


def test_parity_long_sequence_uses_blocked_attention(pair_a):
    from olmo_ctl.checkpoints import parity

    seq = parity.LONG_SEQ + 256  # above the threshold: our side runs the blocked kernel
    res = run_parity(*pair_a, seq_len=seq, batch=1, dtype="fp32")
    print("config A fp32, blocked attention", res)
    assert res["kl_mean"] < 1e-6 and res["top1_agreement"] == 1.0 and res["tokens"] == seq


@pytest.mark.parametrize("pair", ["pair_a", "pair_b"])
def test_parity_bf16_is_reported(pair, request):
    res = run_parity(*request.getfixturevalue(pair), seq_len=SEQ, batch=2, dtype="bf16")
    print(f"{pair} bf16", res)
    assert res["dtype"] == "bf16"
    assert 0 < res["kl_mean"] < 0.05 and res["top1_agreement"] > 0.8


def test_a_mismatched_pair_fails(tmp_path, pair_a):
    other = make_hf(tmp_path / "other", CONFIG_A, seed=7)  # same shape, different weights
    res = run_parity(other, pair_a[1], seq_len=SEQ, batch=2, dtype="fp32")
    print("mismatched", res)
    assert res["kl_mean"] > 0.1 and res["top1_agreement"] < 0.5


def _assert_same_dirs(a: str, b: str) -> None:
    ca, sa = convert.load_hf_dir(a)
    cb, sb = convert.load_hf_dir(b)
    assert set(sa) == set(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert np.array_equal(sa[k].view(np.uint8), sb[k].view(np.uint8)), k
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "sliding_window",
        "layer_types",
        "rope_parameters",
        "eos_token_id",
        "pad_token_id",
    ):
        assert ca.get(key) == cb.get(key), key


@pytest.mark.parametrize("pair", ["pair_a", "pair_b"])
def test_round_trip_is_exact(pair, request, tmp_path):
    hf, orbax = request.getfixturevalue(pair)
    if pair == "pair_a":  # one of them through the command line
        r = cli("convert", "orbax-to-hf", orbax, str(tmp_path / "back"))
        assert r.returncode == 0, r.stderr
    else:
        convert.orbax_to_hf(orbax, str(tmp_path / "back"))
    _assert_same_dirs(hf, str(tmp_path / "back"))
    from transformers import Olmo3ForCausalLM

    assert (
        Olmo3ForCausalLM.from_pretrained(str(tmp_path / "back")).config.vocab_size
        == json.load(open(os.path.join(hf, "config.json")))["vocab_size"]
    )


def test_bf16_round_trip_is_bit_exact_and_padding_is_zero(tmp_path):
    hf = make_hf(tmp_path / "hf", CONFIG_A, seed=3, dtype=torch.bfloat16)
    convert.hf_to_orbax(hf, str(tmp_path / "orbax"))
    params, cfg, meta = convert.load_orbax(str(tmp_path / "orbax"))
    assert meta["hf_dtype"] == "bfloat16" and params["embed"].dtype == np.float32
    assert (cfg.vocab_size, cfg.padded_vocab_size) == (300, 384)
    assert not params["embed"][300:].any() and not params["lm_head"][:, 300:].any()
    convert.orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back"))
    _assert_same_dirs(hf, str(tmp_path / "back"))


def test_refuses_to_overwrite_and_bad_layer_pattern(tmp_path, pair_a):
    r = cli("convert", "hf-to-orbax", pair_a[0], pair_a[1])
    assert r.returncode == 2 and "--overwrite" in r.stderr and "Traceback" not in r.stderr
    hf = json.load(open(os.path.join(pair_a[0], "config.json")))
    hf["layer_types"] = ["full_attention", "sliding_attention"] * 4
    with pytest.raises(BadInput):
        convert.model_config_from_hf(hf)
    with pytest.raises(BadInput):
        run_parity(str(tmp_path / "missing"), pair_a[1], seq_len=8, batch=1)


@pytest.mark.gcs
def test_gcs_round_trip(tmp_path, pair_a, gcs):
    sys.path.insert(0, os.path.dirname(__file__))

    bucket = gcs.bucket
    convert.hf_to_orbax(pair_a[0], f"gs://{bucket}/conv/orbax")
    convert.orbax_to_hf(f"gs://{bucket}/conv/orbax", f"gs://{bucket}/conv/hf")
    convert.orbax_to_hf(f"gs://{bucket}/conv/orbax", str(tmp_path / "back"))
    _assert_same_dirs(pair_a[0], str(tmp_path / "back"))
    res = run_parity(f"gs://{bucket}/conv/hf", f"gs://{bucket}/conv/orbax", seq_len=32, batch=1)
    assert res["kl_mean"] < 1e-6 and res["top1_agreement"] == 1.0


def test_a_training_checkpoint_exports_to_hf_and_matches(tmp_path, smoke_run):
    """The session's trained smoke run (tests/conftest.py): export `<run>/checkpoints/40` to HF, compare logits."""
    step_dir = str(smoke_run / "checkpoints" / "40")
    with pytest.raises(BadInput) as e:  # no run.yaml: the model must be named
        convert.orbax_to_hf(step_dir, str(tmp_path / "hf"))
    assert "run.yaml" in e.value.one_line() and "--recipe" in e.value.one_line()
    r = cli("convert", "orbax-to-hf", step_dir, str(tmp_path / "hf"), "--recipe", "smoke")
    assert r.returncode == 0, r.stderr
    res = run_parity(str(tmp_path / "hf"), step_dir, seq_len=128, batch=2, recipe="smoke")
    print("trained smoke checkpoint", res)
    assert res["kl_mean"] < 1e-6 and res["top1_agreement"] == 1.0
    # Every row of the padded vocabulary is kept (the trainer trained them: they take softmax mass), as
    # OLMo-core's export keeps them; --truncate-vocab keeps the tokenizer's rows only.
    cfg = convert._run_checkpoint_model(step_dir, recipe="smoke")
    assert cfg.vocab_size < cfg.padded_vocab_size and not cfg.softmax_vocab_size
    rows = {}
    for name, flag in (("hf", ()), ("hf-truncated", ("--truncate-vocab",))):
        if flag:
            r = cli("convert", "orbax-to-hf", step_dir, str(tmp_path / name), "--recipe", "smoke", *flag)
            assert r.returncode == 0, r.stderr
        head = convert.read_safetensors_header(tmp_path / name / "model.safetensors")
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert (
            head["lm_head.weight"].shape[0]
            == head["model.embed_tokens.weight"].shape[0]
            == config["vocab_size"]
        )
        rows[name] = config["vocab_size"]
    assert rows == {"hf": cfg.padded_vocab_size, "hf-truncated": cfg.vocab_size}
    assert f"vocab {cfg.vocab_size} rows" in r.stdout
