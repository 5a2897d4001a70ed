"""`surgery soup`: the float32 weighted mean of N checkpoints of one model (training checkpoints and
converted directories, mixed), read and written tensor by tensor, refused in one line before anything
is written, and read back by `convert orbax-to-hf` and `--init-from`."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from helpers.cli import invoke
from helpers.trainer import train

from olmo_ctl.checkpoints import convert
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.trainer.checkpoint import Checkpointer, checkpoints_dir, storage_bytes_read
from olmo_ctl.trainer.model import param_shapes

SMOKE = load_recipe("smoke").model


def random_params(seed: int, cfg=SMOKE) -> dict:
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: (rng.standard_normal(s) * 0.02).astype(np.float32),
        param_shapes(cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def training_checkpoint(run_dir: str, step: int, params: dict, seed: int) -> str:
    """A committed checkpoint written by the trainer's Checkpointer, with Adam moments that are not zero
    (so reading them would show in the bytes read)."""
    rng = np.random.default_rng(1000 + seed)
    moments = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), params)
    state = {
        "step": np.asarray(step, np.int32),
        "params": params,
        "opt": {"mu": moments, "nu": jax.tree.map(np.abs, moments), "count": np.asarray(step, np.int32)},
        "skip": {
            "losses": np.zeros(8, np.float32),
            "grad_norms": np.zeros(8, np.float32),
            "recorded": np.zeros((), np.int32),
        },
    }
    ck = Checkpointer(checkpoints_dir(run_dir), async_save=False)
    ck.save(step, state, {"step": step, "data": None})
    ck.close()
    return f"{run_dir}/checkpoints/{step}"


def converted(path: str, params: dict, cfg=SMOKE) -> str:
    convert.save_orbax(path, params, cfg)
    return path


def float32_mean(trees: list[dict], weights: list[float]) -> dict:
    """The rule, written out: acc = 0; acc += float32(w_i) * float32(x_i), in order."""

    def mean(*xs):
        acc = np.zeros(xs[0].shape, np.float32)
        for x, w in zip(xs, weights, strict=True):
            acc += np.float32(w) * x.astype(np.float32)
        return acc

    return jax.tree.map(mean, *trees)


def same_bits(a: dict, b: dict) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb, strict=True)
    )


@pytest.fixture
def three(tmp_path):
    """Two training checkpoints of one run (no run.yaml: the model is given by --recipe) and a
    converted directory, with their parameters."""
    params = [random_params(i) for i in range(3)]
    run = str(tmp_path / "run")
    paths = [
        training_checkpoint(run, 100, params[0], 0),
        training_checkpoint(run, 200, params[1], 1),
        converted(str(tmp_path / "converted"), params[2]),
    ]
    return paths, params


def test_soup_of_three_is_the_float32_mean_bit_for_bit_and_reads_only_parameters(three, tmp_path):
    paths, params = three
    out = tmp_path / "soup"
    before = storage_bytes_read()
    r = invoke("surgery", "soup", *paths, "--out", str(out), "--recipe", "smoke")
    read = storage_bytes_read() - before
    assert r.returncode == 0, r.stderr
    n_params = sum(x.size for x in jax.tree.leaves(params[0]))
    assert r.stdout == (
        f"wrote {out}: float32 mean of 3 checkpoints of olmo3-smoke (weights 0.333333, 0.333333,"
        f" 0.333333), 14 tensors, {n_params:,} parameters, float32\n"
    )
    soup, cfg, meta = convert.load_orbax(str(out))
    assert same_bits(soup, float32_mean(params, [1 / 3] * 3))
    assert cfg == SMOKE and meta["hf_dtype"] is None
    # The parameters of 3 sources (random floats: stored at about their size) and metadata; the moments
    # of either training checkpoint (2x its parameters) would take it past 5x.
    params_bytes = 4 * n_params
    assert 3 * params_bytes <= read < 4 * params_bytes, read / params_bytes

    manifest = json.loads((out / "soup.json").read_text())
    assert manifest["sources"] == [
        {"path": paths[0], "kind": "training", "step": 100, "weight": 1 / 3},
        {"path": paths[1], "kind": "training", "step": 200, "weight": 1 / 3},
        {"path": paths[2], "kind": "converted", "step": None, "weight": 1 / 3},
    ]
    assert (manifest["model"], manifest["dtype"], manifest["tensors"]) == ("olmo3-smoke", "float32", 14)
    assert manifest["parameters"] == n_params and manifest["bytes"] == params_bytes


def test_weights_are_used_as_given_in_float32(three, tmp_path):
    paths, params = three
    out = tmp_path / "soup"
    r = invoke("surgery", "soup", *paths, "--out", str(out), "--recipe", "smoke", "--weights", "0.5,0.3,0.2")
    assert r.returncode == 0, r.stderr
    soup, _, _ = convert.load_orbax(str(out))
    assert same_bits(soup, float32_mean(params, [0.5, 0.3, 0.2]))
    assert not same_bits(soup, float32_mean(params, [1 / 3] * 3))
    assert [s["weight"] for s in json.loads((out / "soup.json").read_text())["sources"]] == [0.5, 0.3, 0.2]


def test_a_converted_source_gives_the_model_and_its_hugging_face_family_to_the_output(tmp_path):
    """No --recipe needed when a converted source records the model; its HF config travels on, so the
    soup converts back to the family it came from."""
    hf = convert.hf_config_from_model(SMOKE)
    a, b = random_params(0), random_params(1)
    convert.save_orbax(str(tmp_path / "a"), a, SMOKE, hf, "bfloat16")
    run = str(tmp_path / "run")
    ck = training_checkpoint(run, 7, b, 1)
    out = tmp_path / "soup"
    r = invoke("surgery", "soup", str(tmp_path / "a"), ck, "--out", str(out), "-o", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["sources"][1] == {"path": ck, "kind": "training", "step": 7, "weight": 0.5}
    meta = convert.read_meta(str(out))
    assert meta["hf_config"] == hf and meta["hf_dtype"] == "bfloat16"


def test_the_soup_converts_to_hugging_face_and_starts_a_run_with_init_from(three, tmp_path):
    paths, params = three
    out = tmp_path / "soup"
    assert invoke("surgery", "soup", *paths, "--out", str(out), "--recipe", "smoke").returncode == 0
    soup = float32_mean(params, [1 / 3] * 3)

    r = invoke("convert", "orbax-to-hf", str(out), str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    got = convert.read_safetensors(tmp_path / "hf" / "model.safetensors")
    want = convert.params_to_hf_state(soup, SMOKE, "float32")
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)

    p = train(tmp_path / "next", "--stop-at-step", "1", "--init-from", str(out))
    assert f"initialised parameters from {out}" in p.stdout


def test_soup_on_gcs(gcs, tmp_path):
    b = f"gs://{gcs.bucket}"
    params = [random_params(i) for i in range(2)]
    paths = [training_checkpoint(f"{b}/run", 3, params[0], 0), converted(f"{b}/conv", params[1])]
    r = invoke("surgery", "soup", *paths, "--out", f"{b}/soup")
    assert r.returncode == 0, r.stderr
    soup, cfg, _ = convert.load_orbax(f"{b}/soup")
    assert same_bits(soup, float32_mean(params, [0.5, 0.5])) and cfg == SMOKE
    assert (
        json.loads(convert.store_for(f"{b}/soup").read_bytes(f"{b}/soup/soup.json"))["sources"][0]["step"]
        == 3
    )
    r = invoke("surgery", "soup", *paths, "--out", f"{b}/soup")
    assert r.returncode == 2 and "already holds files" in r.stderr


REFUSALS = {
    "different shapes": (
        lambda d: [
            converted(
                f"{d}/other",
                random_params(1, dataclasses.replace(SMOKE, n_layers=2)),
                dataclasses.replace(SMOKE, n_layers=2),
            )
        ],
        [],
        "holds a different model than",
    ),
    "different width": (
        lambda d: [
            converted(
                f"{d}/other",
                random_params(1, dataclasses.replace(SMOKE, mlp_hidden=128)),
                dataclasses.replace(SMOKE, mlp_hidden=128),
            )
        ],
        [],
        "params['blocks']['mlp']['w1'] is (4, 64, 128), not (4, 64, 176)",
    ),
    "different vocab": (
        lambda d: [converted(f"{d}/other", random_params(1), dataclasses.replace(SMOKE, vocab_size=200))],
        [],
        "vocab_size 200 ≠ 258",
    ),
    "weights not summing to 1": (
        lambda d: [converted(f"{d}/other", random_params(1))],
        ["--weights", "0.5,0.4"],
        "--weights sum to 0.9, not 1",
    ),
    "a weight per checkpoint": (
        lambda d: [converted(f"{d}/other", random_params(1))],
        ["--weights", "0.5,0.25,0.25"],
        "--weights has 3 weights for 2 checkpoints",
    ),
    "a negative weight": (
        lambda d: [converted(f"{d}/other", random_params(1))],
        ["--weights", "1.5,-0.5"],
        "are not all positive",
    ),
    "not numbers": (
        lambda d: [converted(f"{d}/other", random_params(1))],
        ["--weights", "half,half"],
        "is not a comma-separated list of numbers",
    ),
    "a path that does not exist": (lambda d: [f"{d}/nowhere"], [], "nowhere` does not exist"),
    "a step that is not committed": (
        lambda d: [f"{d}/run/checkpoints/5"],
        [],
        "is not a committed checkpoint",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_are_one_line_exit_2_and_write_nothing(case, tmp_path):
    second, extra, message = REFUSALS[case]
    first = converted(str(tmp_path / "first"), random_params(0))
    training_checkpoint(str(tmp_path / "run"), 4, random_params(2), 2)
    out = tmp_path / "soup"
    r = invoke("surgery", "soup", first, *second(str(tmp_path)), "--out", str(out), *extra)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr and r.stderr.count("\n") == 1 and r.stdout == "", r.stderr
    assert not out.exists()


def test_refused_without_a_model_or_into_a_directory_that_holds_files(tmp_path):
    run = str(tmp_path / "run")
    paths = [
        training_checkpoint(run, 1, random_params(0), 0),
        training_checkpoint(run, 2, random_params(1), 1),
    ]
    r = invoke("surgery", "soup", *paths, "--out", str(tmp_path / "soup"))
    assert (
        r.returncode == 2 and "is not recorded (no run.yaml in its run directory); pass --recipe" in r.stderr
    )
    assert not (tmp_path / "soup").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine\n")
    r = invoke("surgery", "soup", *paths, "--out", str(tmp_path / "full"), "--recipe", "smoke")
    assert r.returncode == 2 and "already exists and is not empty" in r.stderr
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
