"""FLOPs per token (OLMo-core and MaxText formulas) and MFU against the published OLMo 3 7B numbers."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from olmo_ctl.core import flops
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.recipe import load_model

OLMO3_7B = load_model("olmo3-7b")  # recipes/models/olmo3-7b.yaml


def test_olmo3_7b_olmo_core_formula_at_8192():
    assert flops.flops_per_token_olmo_core(OLMO3_7B, 8192) == pytest.approx(4.94e10, rel=0.01)


def test_olmo3_7b_maxtext_formula_at_8192():
    m = OLMO3_7B
    assert flops.flops_per_token_maxtext(m, 8192) == pytest.approx(4.78e10, rel=0.01)
    # The case study's "1565 TFLOP per step" per device on 128 devices at 4,194,304 tokens per step.
    per_step_per_device = flops.flops_per_token_maxtext(m, 8192) * 4_194_304 / 128
    assert per_step_per_device / 1e12 == pytest.approx(1565, rel=0.005)


def test_mfu_on_ironwood():
    assert flops.mfu(513.0, get_device("tpu7x-128")) == pytest.approx(0.445, abs=0.001)
    assert flops.mfu(513.0, get_device("tpu7x-8")) == pytest.approx(513 / 1153.5)
    assert flops.mfu(263.0, get_device("v5p-256")) == pytest.approx(263 / 459)


def test_sliding_window_discounts_only_olmo_core():
    m = OLMO3_7B
    wide = dataclasses.replace(OLMO3_7B, sliding_window=8192)
    # 24 sliding layers see 4096 keys instead of 8192: 24 * 12 * H * D * 4096 FLOPs fewer.
    diff = flops.flops_per_token_olmo_core(wide, 8192) - flops.flops_per_token_olmo_core(m, 8192)
    assert diff == 24 * 12 * 32 * 128 * 4096
    assert flops.flops_per_token_maxtext(wide, 8192) == flops.flops_per_token_maxtext(m, 8192)
    # Below the window every layer is effectively full attention.
    assert flops.flops_per_token_olmo_core(m, 2048) == flops.flops_per_token_olmo_core(wide, 2048)


def test_head_dim_variant_has_identical_flops():
    m = OLMO3_7B
    v = dataclasses.replace(OLMO3_7B, n_heads=16, n_kv_heads=16, head_dim=256)
    for f in flops.FORMULAS:
        assert flops.flops_per_token(v, 8192, f) == flops.flops_per_token(m, 8192, f)


def test_olmo_core_params_term_matches_param_count():
    from olmo_ctl.core.batching import param_count

    m = OLMO3_7B
    attn_only = flops.flops_per_token_olmo_core(m, 8192) - sum(
        12 * m.n_heads * m.head_dim * flops.attention_window(m, i, 8192) for i in range(m.n_layers)
    )
    assert attn_only == 6 * (param_count(m) - m.padded_vocab_size * m.d_model)


def test_module_is_pure():
    import subprocess

    code = "import olmo_ctl.core.flops, sys; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_formula():
    with pytest.raises(ValueError):
        flops.flops_per_token(OLMO3_7B, 8192, "palm")
