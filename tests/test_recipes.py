"""Recipes: the OLMo 3 stage values, the parameter count, and validation that names the key and file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from olmo_ctl.core.batching import param_count
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import RECIPES_DIR, load_recipe


def test_stage1_recipe_values():
    r = load_recipe(stage=1)
    assert (r.name, r.stage) == ("olmo3-7b-stage1", 1)
    t = r.train
    assert (t.seq_len, t.global_batch, t.max_steps) == (8192, 512, 1413814)
    assert r.tokens_per_step == 4_194_304
    assert r.tokens_per_step * t.max_steps == 5_929_965_715_456  # end of epoch 1
    assert r.optimizer.lr == 3e-4 and r.optimizer.betas == (0.9, 0.95)
    # AI2's two scripts, stitched (values recomputed in test_schedule.py).
    assert r.schedule.kind == "stitched"
    p1, p2 = r.schedule.parts
    assert (p1.kind, p1.warmup_steps, p1.alpha, p1.t_max, p1.last_step) == ("cosine", 2000, 0.1, 1192093, 596047)
    assert (p2.kind, p2.warmup_steps, p2.alpha, p2.t_max, p2.last_step) == ("half_cosine", 597046, 0.1, 1668931, 0)
    assert (r.data.mix, r.data.train, r.data.seed) == ("OLMo-mix-0625-official", (), 34521)


def test_stage2_recipe_values():
    r = load_recipe(stage=2)
    assert (r.train.global_batch, r.train.max_steps) == (256, 47684)
    assert (r.schedule.kind, r.schedule.warmup_steps, r.schedule.alpha) == ("linear", 0, 0.0)
    assert (r.data.mix, r.data.seed, r.model.rope_scaling) == ("OLMo-midtraining-mix-0625-100B", 1337, None)


def test_stage3_recipe_values():
    r = load_recipe(stage=3)
    assert (r.name, r.stage) == ("olmo3-7b-stage3", 3)
    assert (r.train.seq_len, r.train.global_batch, r.train.max_steps) == (65536, 64, 11921)
    assert r.tokens_per_step == 4_194_304 and r.tokens_per_step * (r.train.max_steps - 1) < 50e9 <= r.tokens_per_step * r.train.max_steps
    assert r.optimizer.lr == 2.0712352850360292e-4
    assert (r.schedule.kind, r.schedule.warmup_steps, r.schedule.alpha) == ("linear", 200, 0.0)
    y = r.model.rope_scaling
    assert (y.kind, y.factor, y.beta_fast, y.beta_slow, y.original_context, y.full_layers_only) == \
        ("yarn", 8.0, 32.0, 1.0, 8192, True)
    assert [i for i in range(32) if r.model.layer_rope_scaled(i)] == [3, 7, 11, 15, 19, 23, 27, 31]
    assert (r.data.mix, r.data.seed) == ("OLMo-longmino-mix-0625", 34521)
    assert param_count(r.model) == 7_298_617_344


def test_olmo3_7b_parameter_count():
    m = load_recipe(stage=1).model
    assert m.padded_vocab_size == 100352
    assert param_count(m) == 7_298_617_344


def test_overrides_are_validated_like_the_file():
    r = load_recipe(stage=1, overrides=["train.max_steps=100", "optimizer.lr=1e-4", "schedule.warmup_steps=10"])
    assert (r.train.max_steps, r.optimizer.lr) == (100, 1e-4)
    assert r.fingerprint() != load_recipe(stage=1).fingerprint()
    assert load_recipe(stage=1).fingerprint() == load_recipe(stage=1).fingerprint()
    with pytest.raises(BadInput, match="unknown key `train.bogus`"):
        load_recipe(stage=1, overrides=["train.bogus=1"])
    with pytest.raises(BadInput, match="train.global_batch"):
        load_recipe(stage=1, overrides=["train.global_batch=abc"])
    with pytest.raises(BadInput, match="key.sub=value"):
        load_recipe(stage=1, overrides=["train.global_batch"])
    with pytest.raises(BadInput, match="schedule.warmup_steps"):
        load_recipe(stage=2, overrides=["train.max_steps=100", "schedule.warmup_steps=100"])
    with pytest.raises(BadInput, match="data.mix"):
        load_recipe(stage=1, overrides=["data.mix=no-such-mix"])
    with pytest.raises(BadInput, match="data.train"):
        load_recipe(stage=1, overrides=["data.train=[a.npy]"])  # a mix and paths: which one?
    with pytest.raises(BadInput, match="model.rope_scaling.factor"):
        load_recipe(stage=3, overrides=["model.rope_scaling.factor=0.5"])


def test_bad_recipe_files(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("name: x\ntrain: {seq_len: 128, global_batch: 8}\nmodle: {}\n")
    with pytest.raises(BadInput) as e:
        load_recipe(str(f))
    assert "unknown key `modle`" in e.value.message and str(f) in e.value.message
    f.write_text("name: [unclosed\n")
    with pytest.raises(BadInput, match="not valid YAML"):
        load_recipe(str(f))
    with pytest.raises(BadInput, match="does not exist"):
        load_recipe(str(tmp_path / "missing.yaml"))
    with pytest.raises(BadInput, match="not a recipe"):
        load_recipe("no-such-recipe")
    with pytest.raises(BadInput, match="exclusive"):
        load_recipe("smoke", stage=1)
    with pytest.raises(BadInput, match="not a stage"):
        load_recipe(stage=4)


def test_smoke_recipe_is_olmo3_shaped():
    m = load_recipe("smoke").model
    assert m.sliding_window < load_recipe("smoke").train.seq_len
    assert [m.layer_is_full(i) for i in range(m.n_layers)] == [False, False, False, True]


# ---------------------------------------------------------------- every shipped recipe, pinned

RECIPE_GOLDEN = Path(__file__).resolve().parent / "goldens" / "recipes.json"


def shipped_recipes() -> dict[str, dict]:
    """Each shipped recipe's resolved values (`to_dict()`, in its key order) and fingerprint."""
    return {p.stem: {"fingerprint": (r := load_recipe(p.stem)).fingerprint(), "recipe": r.to_dict()}
            for p in sorted(RECIPES_DIR.glob("*.yaml"))}


def test_every_shipped_recipe_resolves_to_its_golden_values_and_fingerprint():
    golden = json.loads(RECIPE_GOLDEN.read_text())
    now = shipped_recipes()
    assert sorted(now) == sorted(golden)
    for name, want in golden.items():
        assert now[name]["fingerprint"] == want["fingerprint"], name
        # Serialised without sorting: the key order is run.yaml's too.
        assert json.dumps(now[name]["recipe"]) == json.dumps(want["recipe"]), name


def regenerate() -> None:
    recipes = shipped_recipes()
    RECIPE_GOLDEN.write_text(json.dumps(recipes, indent=1) + "\n")
    print(f"wrote tests/goldens/{RECIPE_GOLDEN.name} ({len(recipes)} recipes)")


if __name__ == "__main__":
    regenerate()
