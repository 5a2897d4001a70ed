"""Recipes: the OLMo 3 stage values, the parameter count, validation that names the key and file, the
layers (base -> model -> file -> --set) and the twice-set rule, fingerprints and evaluation, and every
shipped recipe pinned to its golden values (`make goldens` rewrites tests/goldens/recipes.json)."""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from olmo_ctl.core.batching import param_count
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import (
    FINGERPRINTED_EVAL_KEYS,
    RECIPES_DIR,
    ModelConfig,
    Recipe,
    load_model,
    load_recipe,
    recipe_from_dict,
    shipped_models,
    shipped_recipes,
)


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
    assert (p1.kind, p1.warmup_steps, p1.alpha, p1.t_max, p1.last_step) == (
        "cosine",
        2000,
        0.1,
        1192093,
        596047,
    )
    assert (p2.kind, p2.warmup_steps, p2.alpha, p2.t_max, p2.last_step) == (
        "half_cosine",
        597046,
        0.1,
        1668931,
        0,
    )
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
    assert (
        r.tokens_per_step == 4_194_304
        and r.tokens_per_step * (r.train.max_steps - 1) < 50e9 <= r.tokens_per_step * r.train.max_steps
    )
    assert r.optimizer.lr == 2.0712352850360292e-4
    assert (r.schedule.kind, r.schedule.warmup_steps, r.schedule.alpha) == ("linear", 200, 0.0)
    y = r.model.rope_scaling
    assert (y.kind, y.factor, y.beta_fast, y.beta_slow, y.original_context, y.full_layers_only) == (
        "yarn",
        8.0,
        32.0,
        1.0,
        8192,
        True,
    )
    assert [i for i in range(32) if r.model.layer_rope_scaled(i)] == [3, 7, 11, 15, 19, 23, 27, 31]
    assert (r.data.mix, r.data.seed) == ("OLMo-longmino-mix-0625", 34521)
    assert param_count(r.model) == 7_298_617_344


def test_olmo3_7b_parameter_count():
    m = load_recipe(stage=1).model
    assert m.padded_vocab_size == 100352
    assert param_count(m) == 7_298_617_344


def test_overrides_are_validated_like_the_file():
    r = load_recipe(
        stage=1, overrides=["train.max_steps=100", "optimizer.lr=1e-4", "schedule.warmup_steps=10"]
    )
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


# ---------------------------------------------------------------- layers: base -> model -> file -> --set


def test_the_model_is_written_once_in_a_model_file():
    """No stage file repeats a model value: each names its model file (and stage 3 adds YaRN)."""
    stage_files = sorted(RECIPES_DIR.glob("*.yaml"))
    assert sorted(p.stem for p in stage_files) == shipped_recipes()
    assert shipped_models() == ["olmo2-32b", "olmo3-32b", "olmo3-7b", "smoke"]
    for p in stage_files:
        model = yaml.safe_load(p.read_text()).get("model")
        # a stage may add YaRN, or choose what the backward pass recomputes (OLMo 2's anneal, OLMo 3's stage 3)
        extra = (
            set(model) - {"from", "rope_scaling", "remat", "remat_budget"}
            if isinstance(model, dict)
            else set()
        )
        assert isinstance(model, str | dict) and not extra, (p.name, model)
    assert load_model("olmo3-7b") == load_recipe(stage=1).model == load_recipe(stage=2).model
    assert load_model("smoke") == load_recipe("smoke").model
    assert load_recipe(stage=3).model == dataclasses.replace(
        load_model("olmo3-7b"), rope_scaling=load_recipe(stage=3).model.rope_scaling
    )
    cosine, stage1 = load_recipe("olmo3-7b-stage1-cosine"), load_recipe(stage=1)
    assert cosine.source.endswith("olmo3-7b-stage1-cosine.yaml")
    assert (
        dataclasses.replace(
            cosine, name=stage1.name, description=stage1.description, schedule=stage1.schedule
        )
        == stage1
    )


def test_the_32b_models():
    """OLMo 2 32B: OLMo-core's olmo2_32B (64 x 5120, 40 query heads over 8 KV heads, MLP 27,648, every
    layer full attention) is 32.2B parameters; OLMo 3 32B has the same tensors and OLMo 3's 3:1 window."""
    from olmo_ctl.trainer.model import param_shapes

    o2, o3 = load_model("olmo2-32b"), load_model("olmo3-32b")
    assert (o2.architecture, o2.full_attention_every, o2.sliding_window) == ("olmo2", 1, 0)
    assert (o3.architecture, o3.full_attention_every, o3.sliding_window) == ("olmo3", 4, 4096)
    shapes = param_shapes(o2)
    assert shapes == param_shapes(o3)
    assert shapes["blocks"]["attn"]["wk"] == (64, 5120, 8 * 128)
    n = param_count(o2)
    assert 32.0e9 < n < 32.4e9 and param_count(o3) == n, n
    assert all(o2.layer_is_full(i) for i in range(64))
    assert sum(o3.layer_is_full(i) for i in range(64)) == 16


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["model.architecture=olmo2"], "model.full_attention_every"),  # the smoke model slides
        (["model.sliding_window=0"], "model.sliding_window"),  # sliding layers need a window
        (["model.architecture=olmo4"], "model.architecture"),
        (
            [
                "model.architecture=olmo2",
                "model.full_attention_every=1",
                "model.rope_scaling.factor=8",
                "model.rope_scaling.original_context=64",
            ],
            "model.rope_scaling",
        ),
    ],
)
def test_an_impossible_architecture_is_refused(overrides, key):
    with pytest.raises(BadInput, match=key.replace(".", r"\.")):
        load_recipe("smoke", overrides=overrides)


def test_no_model_values_as_defaults():
    """A recipe gets its model from a model file, or is refused saying it has none."""
    with pytest.raises(TypeError):
        ModelConfig()  # the constructor has no 7B (or any) defaults
    with pytest.raises(BadInput, match="the recipe has no model") as e:
        recipe_from_dict({"name": "x", "data": {"mix": "OLMo-mix-0625-official"}}, "x.yaml")
    assert "model: NAME" in e.value.hint and "olmo3-7b" in e.value.hint
    with pytest.raises(BadInput, match=r"`model.n_layers` is missing \(and 17 more"):
        recipe_from_dict(
            {"name": "x", "model": {"name": "m"}, "data": {"mix": "OLMo-mix-0625-official"}}, "x.yaml"
        )


def _write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


def test_a_user_delta_names_a_shipped_base_and_model(tmp_path):
    f = _write(
        tmp_path / "short.yaml",
        """\
        name: stage1-short
        base: olmo3-7b-stage1
        model: olmo3-7b
        train: {max_steps: 20000}
        checkpoint: {interval: 500}
        """,
    )
    r = load_recipe(str(f))
    s1 = load_recipe(stage=1)
    assert (r.name, r.stage, r.description, r.source) == ("stage1-short", 1, s1.description, str(f))
    assert (r.train.max_steps, r.train.global_batch, r.checkpoint.interval, r.checkpoint.keep) == (
        20000,
        512,
        500,
        3,
    )
    assert r.model == s1.model and r.schedule == s1.schedule  # sections merge key by key
    # A delta next to it, by relative path; its `model:` keys (no model file named) change the base's.
    (tmp_path / "sub").mkdir()
    g = _write(
        tmp_path / "sub" / "deeper.yaml",
        """\
        name: deeper
        base: ../short.yaml
        model: {remat: save_proj}
        """,
    )
    d = load_recipe(str(g))
    assert (d.name, d.train.max_steps, d.model.remat, d.model.n_layers) == ("deeper", 20000, "save_proj", 32)
    # --set comes last: over the file, its base and its model.
    o = load_recipe(str(g), overrides=["model.remat=none", "train.max_steps=10"])
    assert (o.model.remat, o.train.max_steps) == ("none", 10)
    # A model file by path, next to the recipe.
    _write(
        tmp_path / "tiny.yaml",
        (RECIPES_DIR / "models" / "smoke.yaml").read_text().replace("n_layers: 4", "n_layers: 8"),
    )
    t = load_recipe(str(_write(tmp_path / "t.yaml", "name: t\nbase: smoke\nmodel: ./tiny.yaml\n")))
    assert (t.model.n_layers, t.model.d_model, t.train.seq_len) == (8, 64, 128)


def test_a_key_set_twice_at_one_level_is_refused(tmp_path):
    # A file and the model file it names are one statement: another value for one of its keys is refused...
    f = _write(tmp_path / "r.yaml", "name: r\nbase: smoke\nmodel: {from: smoke, n_layers: 8}\n")
    with pytest.raises(BadInput) as e:
        load_recipe(str(f))
    assert e.value.message == (
        f"{f}: `model.n_layers` is set twice: 8 here and 4 in its model "
        f"`{RECIPES_DIR / 'models' / 'smoke.yaml'}`"
    )
    assert "--set model.n_layers" in e.value.hint and e.value.exit_code == 2
    # ... the same value is not a second statement, and --set (the command line) still wins.
    _write(f, "name: r\nbase: smoke\nmodel: {from: smoke, n_layers: 4, rms_norm_eps: 1.0e-6}\n")
    assert load_recipe(str(f)).model == load_recipe("smoke").model
    assert load_recipe(str(f), overrides=["model.n_layers=8"]).model.n_layers == 8
    # A key written twice in one mapping of one file (YAML alone would keep the last).
    _write(f, "name: r\nbase: smoke\ntrain:\n  max_steps: 10\n  max_steps: 20\n")
    with pytest.raises(BadInput, match=r"`max_steps` is set twice in one mapping \(lines 4 and 5\)"):
        load_recipe(str(f))
    _write(f, "name: r\nbase: smoke\ntrain: {seq_len: 64}\ntrain: {max_steps: 20}\n")
    with pytest.raises(BadInput, match=r"`train` is set twice in one mapping \(lines 3 and 4\)"):
        load_recipe(str(f))
    # A base overridden by its delta is not twice at one level: that is what a delta is.
    _write(f, "name: r\nbase: smoke\nmodel: smoke\ntrain: {max_steps: 20}\n")
    assert load_recipe(str(f)).train.max_steps == 20


def test_bad_layers_name_the_file_and_the_key(tmp_path):
    f = tmp_path / "r.yaml"
    for text, says in [
        ("name: r\nbase: no-such\n", "`base: no-such` is not a shipped recipe"),
        ("name: r\nbase: smoke\nmodel: no-such\n", "`model: no-such` is not a shipped model"),
        ("name: r\nbase: ./missing.yaml\n", "does not exist"),
        ("name: r\nbase: [smoke]\n", "`base` must name a recipe or a file"),
        ("name: r\nmodel: 7\n", "`model` must be a model name, a file or a mapping"),
        ("name: r\nbase: ./r.yaml\n", "`base:` leads back to"),
        ("name: r\nbase: smoke\nmodel: {from: smoke, n_layer: 2}\n", "unknown key `model.n_layer`"),
        ("base: smoke\n", "missing key `name`"),
    ]:
        _write(f, text)
        with pytest.raises(BadInput, match=re.escape(says)) as e:
            load_recipe(str(f))
        assert e.value.message.startswith(f"{f}: "), e.value.message
    # Two files that are each other's base.
    _write(tmp_path / "a.yaml", "name: a\nbase: ./b.yaml\n")
    _write(tmp_path / "b.yaml", "name: b\nbase: ./a.yaml\n")
    with pytest.raises(BadInput, match="`base:` leads back to"):
        load_recipe(str(tmp_path / "a.yaml"))
    # An unknown key in a base or a model file names that file, not the recipe that names it.
    _write(tmp_path / "base.yaml", "name: b\nbase: smoke\ntrain: {bogus: 1}\n")
    with pytest.raises(BadInput, match=re.escape(f"{tmp_path / 'base.yaml'}: unknown key `train.bogus`")):
        load_recipe(str(_write(f, "name: r\nbase: ./base.yaml\n")))
    _write(tmp_path / "m.yaml", "name: m\nlayers: 2\n")
    with pytest.raises(BadInput, match=re.escape(f"{tmp_path / 'm.yaml'}: unknown key `model.layers`")):
        load_recipe(str(_write(f, "name: r\nbase: smoke\nmodel: ./m.yaml\n")))
    # A mapping that is not a local file cannot name files relative to itself; shipped names work.
    with pytest.raises(BadInput, match="is a relative path, but `gs://b/r.yaml` is not a local file"):
        recipe_from_dict({"name": "r", "base": "./x.yaml"}, "gs://b/r.yaml")
    assert recipe_from_dict({"name": "r", "base": "smoke"}, "gs://b/r.yaml").model == load_model("smoke")


def test_the_delta_recipes_in_the_docs_resolve(tmp_path):
    """docs/recipes.md's two user files, written out as shown, and the refusal it describes."""
    docs = (Path(__file__).resolve().parent.parent / "docs" / "recipes.md").read_text()
    blocks = re.findall(r"```yaml\n(# (my-[\w-]+\.yaml).*?\n)```", docs, re.S)
    assert [name for _, name in blocks] == ["my-stage1-short.yaml", "my-stage1-short-remat.yaml"]
    for text, name in blocks:
        (tmp_path / name).write_text(text)
    short, remat = (load_recipe(str(tmp_path / name)) for _, name in blocks)
    assert (short.train.max_steps, short.checkpoint.interval, short.model.remat) == (20000, 500, "full")
    assert (
        remat.model
        == load_recipe(str(tmp_path / "my-stage1-short.yaml"), overrides=["model.remat=save_proj"]).model
    )
    assert dataclasses.replace(remat, name=short.name, source=short.source, model=short.model) == short
    (tmp_path / "refused.yaml").write_text(
        blocks[1][0].replace("model: {remat", "model: {from: olmo3-7b, remat")
    )
    with pytest.raises(
        BadInput, match="`model.remat` is set twice: 'save_proj' here and 'full' in its model"
    ):
        load_recipe(str(tmp_path / "refused.yaml"))


# ---------------------------------------------------------------- fingerprints and evaluation


def test_evaluation_is_not_what_a_run_trains():
    s1 = load_recipe(stage=1)
    for sets in (
        ["eval.interval=500"],
        ["eval.batches=16", "eval.batch_size=64"],
        ["data.eval=[gs://b/v.npy]"],
    ):
        r = load_recipe(stage=1, overrides=sets)
        assert r.fingerprint() != s1.fingerprint()  # run.yaml's fingerprint: as it always was
        assert r.training_fingerprint() == s1.training_fingerprint(), sets
    for sets in (
        ["train.max_steps=100"],
        ["data.seed=1"],
        ["checkpoint.interval=1000"],
        ["model.remat=none"],
    ):
        assert load_recipe(stage=1, overrides=sets).training_fingerprint() != s1.training_fingerprint(), sets


def test_an_eval_key_added_later_stays_out_of_the_fingerprint(monkeypatch):
    s1 = load_recipe(stage=1)
    before = (s1.fingerprint(), s1.training_fingerprint())
    plain = Recipe.to_dict

    def with_evaluators(self):
        d = plain(self)
        d["eval"]["evaluators"] = ["arc_challenge:rc::olmes", "mmlu:mc::olmes"]
        return d

    monkeypatch.setattr(Recipe, "to_dict", with_evaluators)
    assert (s1.fingerprint(), s1.training_fingerprint()) == before
    assert FINGERPRINTED_EVAL_KEYS == ("interval", "batches", "batch_size")


# ---------------------------------------------------------------- every shipped recipe, pinned

RECIPE_GOLDEN = Path(__file__).resolve().parent / "goldens" / "recipes.json"


def resolved_recipes() -> dict[str, dict]:
    """Each shipped recipe's resolved values (`to_dict()`, in its key order) and fingerprint."""
    return {
        p.stem: {"fingerprint": (r := load_recipe(p.stem)).fingerprint(), "recipe": r.to_dict()}
        for p in sorted(RECIPES_DIR.glob("*.yaml"))
    }


def test_every_shipped_recipe_resolves_to_its_golden_values_and_fingerprint():
    golden = json.loads(RECIPE_GOLDEN.read_text())
    now = resolved_recipes()
    assert sorted(now) == sorted(golden)
    for name, want in golden.items():
        assert now[name]["fingerprint"] == want["fingerprint"], name
        # Serialised without sorting: the key order is run.yaml's too.
        assert json.dumps(now[name]["recipe"]) == json.dumps(want["recipe"]), name


def regenerate() -> None:
    recipes = resolved_recipes()
    RECIPE_GOLDEN.write_text(json.dumps(recipes, indent=1) + "\n")
    print(f"wrote tests/goldens/{RECIPE_GOLDEN.name} ({len(recipes)} recipes)")


if __name__ == "__main__":
    regenerate()
