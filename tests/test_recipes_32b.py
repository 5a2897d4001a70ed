"""The 32B recipes: OLMo 2 32B (stages 1-2) and OLMo 3 32B (stages 1-3) hold the values of OLMo-core's
official scripts (docs/recipes.md), `--model NAME --stage N` selects them (the OLMo 3 7B staying the
default), and the plan keeps each one's global batch on every slice that can hold it."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from olmo_ctl.core import schedule
from olmo_ctl.core.batching import make_plan, param_count
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import (
    DEFAULT_MODEL,
    MODEL_STAGE_RECIPES,
    RECIPES_DIR,
    load_recipe,
    resolve_recipe_path,
    shipped_recipes,
)

ROOT = Path(__file__).resolve().parent.parent
OLMO3_7B_EPOCH_TOKENS = 5_929_965_715_456  # OLMo-mix-0625-official at 8192 (docs/recipes.md, stage 1)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    return subprocess.run(
        [sys.executable, "-m", "olmo_ctl", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )


# ---------------------------------------------------------------- the values


def test_the_32b_models_have_olmo_cores_shape():
    # config.py olmo2_32B: 64 layers, d_model 5120, 40 heads over 8 KV heads, MLP 27,648.
    for model in ("olmo2-32b", "olmo3-32b"):
        m = load_recipe(model=model, stage=1).model
        assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.mlp_hidden) == (
            64,
            5120,
            40,
            8,
            128,
            27648,
        )
        assert (m.vocab_size, m.padded_vocab_size, m.rope_theta, m.rms_norm_eps) == (
            100278,
            100352,
            5e5,
            1e-6,
        )
        assert param_count(m) == 32_234_279_936
    olmo2 = load_recipe(model="olmo2-32b", stage=1).model
    assert all(olmo2.layer_is_full(i) for i in range(64))
    olmo3 = load_recipe(model="olmo3-32b", stage=1).model
    assert [i for i in range(64) if olmo3.layer_is_full(i)] == list(range(3, 64, 4))


def test_olmo2_32b_stage1():
    r = load_recipe(model="olmo2-32b", stage=1)
    assert (r.name, r.stage, r.model.name) == ("olmo2-32b-stage1", 1, "olmo2-32b")
    t = r.train
    assert (t.seq_len, t.global_batch) == (4096, 2048) and r.tokens_per_step == 2048 * 4096
    # Stopped at the released checkpoint stage1-step721901-tokens6056B.
    assert t.max_steps == 721_901 and round(t.max_steps * r.tokens_per_step / 1e9) == 6056
    o = r.optimizer
    assert (o.lr, o.betas, o.eps, o.weight_decay, o.grad_clip, o.z_loss) == (
        6e-4,
        (0.9, 0.95),
        1e-8,
        0.1,
        1.0,
        1e-5,
    )
    s = r.schedule
    assert (s.kind, s.warmup_steps, s.alpha) == ("cosine", 2000, 0.1)
    assert s.t_max == math.ceil(6.5e12 / r.tokens_per_step)  # max_duration 6.5T tokens
    assert (r.data.mix, r.data.seed, r.data.ngram_filter, t.seed) == ("OLMoE-mix-0824", 34521, False, 12536)
    assert (r.checkpoint.interval, r.checkpoint.async_save) == (1000, True)
    assert (r.eval.lm.mix, r.eval.lm.interval, r.eval.downstream.interval) == (
        "v3-small-ppl-validation",
        1000,
        1000,
    )
    assert len(r.eval.downstream.tasks) == 15 and r.eval.downstream.tasks[0] == "mmlu_stem_mc_5shot"


def test_olmo2_32b_stage2_anneals_from_where_stage1_stopped():
    s1, r = load_recipe(model="olmo2-32b", stage=1), load_recipe(model="olmo2-32b", stage=2)
    # the anneal recomputes only the feed-forward (anneal:122-125): the same network otherwise
    assert (r.name, r.stage, r.model) == ("olmo2-32b-stage2", 2, dataclasses.replace(s1.model, remat="mlp"))
    assert (r.train.seq_len, r.train.global_batch) == (4096, 2048)
    assert r.train.max_steps == math.ceil(100e9 / r.tokens_per_step) == 11921  # 100B tokens
    # The script reads its LR from the stage-1 checkpoint: the LR stage 1's last step trained with.
    assert r.optimizer.lr == schedule.lr_at(s1, s1.train.max_steps)
    assert 6e-5 < r.optimizer.lr < 7e-5
    assert (r.schedule.kind, r.schedule.warmup_steps, r.schedule.alpha, r.schedule.t_max) == (
        "linear",
        0,
        0.0,
        0,
    )
    assert schedule.lr_at(r, r.train.max_steps) == 0.0
    assert (r.data.mix, r.data.seed) == ("dolmino100", 1110)  # ingredient 1
    assert r.eval.lm.mix == "" and r.eval.downstream.tasks == s1.eval.downstream.tasks
    # Ingredient 3: seed 2662, 300B tokens of dolmino300 (stage2-ingredient3-step35763-tokens301B).
    i3 = load_recipe(
        model="olmo2-32b",
        stage=2,
        overrides=["data.seed=2662", "data.mix=dolmino300", "train.max_steps=35763"],
    )
    assert i3.train.max_steps == math.ceil(300e9 / i3.tokens_per_step)


def test_olmo3_32b_stage1():
    r = load_recipe(model="olmo3-32b", stage=1)
    assert (r.name, r.stage, r.model.name) == ("olmo3-32b-stage1", 1, "olmo3-32b")
    t = r.train
    assert (t.seq_len, t.global_batch) == (8192, 1024) and r.tokens_per_step == 8 * 1024 * 1024
    # The checkpoint both mid-training scripts load: 5.50T tokens (the OLMo 3 README's stage-1 budget).
    assert t.max_steps == 656_000 and round(t.max_steps * r.tokens_per_step / 1e10) == 550
    assert (r.optimizer.lr, r.optimizer.weight_decay, r.optimizer.z_loss) == (6e-4, 0.1, 1e-5)
    s = r.schedule
    assert (s.kind, s.warmup_steps, s.alpha) == ("cosine", 2000, 0.1)
    assert s.t_max == OLMO3_7B_EPOCH_TOKENS // r.tokens_per_step  # epoch 1 (see the recipe)
    assert OLMO3_7B_EPOCH_TOKENS % r.tokens_per_step == 0
    assert (r.data.mix, r.data.seed, r.data.ngram_filter, t.seed) == (
        "OLMo-mix-0925-official",
        34521,
        True,
        12536,
    )
    assert (r.checkpoint.interval, r.checkpoint.async_save, r.logging.metrics_every) == (1000, False, 50)
    assert (r.eval.lm.mix, r.eval.lm.interval, r.eval.downstream.interval) == (
        "v3-small-ppl-validation",
        1000,
        1000,
    )
    # The 7B's 26 tasks (OLMo-core's "fast" set), sorted as the script sorts them.
    tasks = r.eval.downstream.tasks
    assert tasks == tuple(sorted(tasks)) and set(tasks) == set(load_recipe(stage=1).eval.downstream.tasks)


def test_olmo3_32b_stage2():
    s1, r = load_recipe(model="olmo3-32b", stage=1), load_recipe(model="olmo3-32b", stage=2)
    assert (r.name, r.stage, r.model) == ("olmo3-32b-stage2", 2, s1.model)
    assert (r.train.seq_len, r.train.global_batch) == (8192, 512) and r.tokens_per_step == 4 * 1024 * 1024
    assert r.train.max_steps == math.ceil(100e9 / r.tokens_per_step) == 23842
    assert r.optimizer.lr == 0.0002071235285
    assert (r.schedule.kind, r.schedule.warmup_steps, r.schedule.alpha) == ("linear", 0, 0.0)
    assert (r.data.mix, r.data.seed, r.data.ngram_filter) == (
        "OLMo-midtraining-mix-0925-ingredient1-100B",
        42069,
        True,
    )
    assert (r.eval.lm.enabled, r.eval.downstream.tasks) == (False, ())
    assert (r.checkpoint.interval, r.checkpoint.async_save) == (1000, False)


def test_olmo3_32b_stage3():
    r = load_recipe(model="olmo3-32b", stage=3)
    assert (r.name, r.stage) == ("olmo3-32b-stage3", 3)
    assert (r.train.seq_len, r.train.global_batch) == (65536, 128) and r.tokens_per_step == 8 * 1024 * 1024
    assert r.train.max_steps == math.ceil(100e9 / r.tokens_per_step) == 11921
    assert r.optimizer.lr == 0.0002071235285
    assert (r.schedule.kind, r.schedule.warmup_steps, r.schedule.alpha) == ("linear", 200, 0.0)
    y = r.model.rope_scaling
    assert y is not None
    assert (y.factor, y.beta_fast, y.beta_slow, y.original_context, y.full_layers_only) == (
        8.0,
        32.0,
        1.0,
        8192,
        True,
    )
    assert [i for i in range(64) if r.model.layer_rope_scaled(i)] == list(range(3, 64, 4))
    d = r.data
    assert (d.mix, d.seed, d.packed, d.source_group_size, d.source_permutation_seed, d.ngram_filter) == (
        "OLMo-longmino-mix-0925",
        34521,
        True,
        8,
        123,
        True,
    )
    assert (r.eval.lm.enabled, r.eval.downstream.tasks) == (False, ())


# ---------------------------------------------------------------- selection: --model NAME --stage N


def test_model_and_stage_name_a_shipped_recipe_each():
    pairs = [(m, s, name) for m, stages in MODEL_STAGE_RECIPES.items() for s, name in stages.items()]
    assert sorted(name for *_, name in pairs) == sorted(
        n for n in shipped_recipes() if "-stage" in n and "cosine" not in n
    )
    for model, stage, name in pairs:
        r = load_recipe(model=model, stage=stage)
        assert (r.name, r.stage) == (name, stage)
        assert r.model.name == model


def test_the_7b_stays_the_default():
    assert DEFAULT_MODEL == "olmo3-7b"
    for stage in (1, 2, 3):
        path = resolve_recipe_path(stage=stage)
        assert (
            path
            == resolve_recipe_path(stage=stage, model="olmo3-7b")
            == RECIPES_DIR / f"olmo3-7b-stage{stage}.yaml"
        )
        assert (
            load_recipe(stage=stage).fingerprint() == load_recipe(stage=stage, model="olmo3-7b").fingerprint()
        )


@pytest.mark.parametrize(
    "kwargs,expect",
    [
        ({"model": "olmo2-32b", "stage": 3}, "--model olmo2-32b has no stage 3"),
        ({"model": "olmo3-32b", "stage": 4}, "--model olmo3-32b has no stage 4"),
        ({"model": "olmo9-1b", "stage": 1}, "--model olmo9-1b has no shipped stage recipes"),
        ({"model": "olmo3-32b"}, "--model olmo3-32b needs --stage"),
        ({"model": "olmo3-32b", "recipe": "smoke"}, "--model olmo3-32b needs --stage"),
        ({"stage": 4}, "--stage 4 is not a stage"),
    ],
)
def test_a_bad_combination_is_refused(kwargs, expect):
    with pytest.raises(BadInput, match=expect):
        resolve_recipe_path(**kwargs)


def test_the_cli_selects_a_32b_stage_and_keeps_the_7b_default():
    p = _cli("plan", "--model", "olmo2-32b", "--stage", "1", "--device", "v5p-512", "-o", "json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert (d["recipe"], d["global_batch"], d["seq_len"], d["tokens_per_step"]) == (
        "olmo2-32b-stage1",
        2048,
        4096,
        2048 * 4096,
    )
    assert d["per_device_batch"] * d["grad_accum"] * d["devices"] == 2048
    d7 = json.loads(_cli("plan", "--stage", "1", "--device", "v5p-512", "-o", "json").stdout)
    assert (d7["recipe"], d7["global_batch"]) == ("olmo3-7b-stage1", 512)
    p = _cli("plan", "--model", "olmo2-32b", "--stage", "3", "--device", "v5p-512")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith("error: --model olmo2-32b has no stage 3") and len(p.stderr.splitlines()) == 1


# ---------------------------------------------------------------- the plan holds the global batch

SLICES = [f"{g}-{n}" for g in ("v5p", "tpu7x") for n in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)]
RECIPES_32B = [(m, s) for m in ("olmo2-32b", "olmo3-32b") for s in MODEL_STAGE_RECIPES[m]]


@pytest.mark.parametrize("model,stage", RECIPES_32B)
def test_the_plan_keeps_the_global_batch_on_every_slice_that_divides_it(model, stage):
    r = load_recipe(model=model, stage=stage)
    planned = 0
    for name in SLICES:
        device = get_device(name)
        if r.train.global_batch % device.devices:
            continue
        try:
            p = make_plan(r, device)
        except BadInput as e:  # only memory may refuse: never the batch
            assert "does not fit" in e.one_line(), (name, e.one_line())
            assert device.devices <= 8 or stage == 3, name  # 65,536-token sequences on small slices
            continue
        assert p.global_batch == r.train.global_batch, name
        assert p.per_device_batch * p.grad_accum * p.devices == p.global_batch * p.seq_shards, name
        planned += 1
    assert planned >= (3 if stage == 3 else 8)  # stage 3 fits tpu7x-512 and up by the estimate
