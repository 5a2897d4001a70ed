"""Checkpoint surgery: warm-Adam stage-2 init (params + moments kept, step 0, fresh data) and souping."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers.runs import copy_run
from helpers.trainer import scalars, train

from olmo_ctl.trainer.checkpoint import open_step


def olmo_ctl(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-c", "from olmo_ctl.cli import entry; entry()", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == expect, p.stdout + p.stderr
    return p


def load(path) -> tuple[dict, dict]:
    ck, step = open_step(str(path))
    return ck.restore_host(step)


def leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb, strict=True)
    )


@pytest.fixture
def src(smoke_run):
    """Stage 1: the session's smoke run (40 steps, checkpoints 20 and 40; tests/conftest.py), read only."""
    return smoke_run


def test_warm_adam_keeps_params_and_moments_and_resumes_as_stage2_at_step_0(src, tmp_path):
    dst = tmp_path / "stage2"
    out = olmo_ctl("surgery", "warm-adam", str(src / "checkpoints" / "40"), str(dst))
    assert "step 0" in out.stdout
    s_state, _ = load(src / "checkpoints" / "40")
    d_state, d_meta = load(dst / "checkpoints" / "0")
    assert leaves_equal(d_state["params"], s_state["params"])
    assert leaves_equal(d_state["opt"]["mu"], s_state["opt"]["mu"])
    assert leaves_equal(d_state["opt"]["nu"], s_state["opt"]["nu"])
    assert int(d_state["opt"]["count"]) == int(s_state["opt"]["count"]) == 40
    assert int(d_state["step"]) == 0 and int(d_state["skip"]["recorded"]) == 0
    assert d_meta["data"] is None

    # Stage 2: linear decay from the peak, no warmup, fresh data order from the first batch.
    p = train(
        dst,
        "--stop-at-step",
        "2",
        "--set",
        "schedule.kind=linear",
        "--set",
        "schedule.warmup_steps=0",
        "--set",
        "schedule.alpha=0",
        "--set",
        "data.seed=1337",
    )
    assert "restored checkpoint 0" in p.stdout
    ev = scalars(dst)
    assert sorted(ev["train/CE loss"]) == [1, 2]
    assert ev["optim/LR (group 0)"][1] == pytest.approx(3e-3 * (1 - 1 / 100), rel=1e-6)
    assert (
        ev["train/CE loss"][1] < scalars(src)["train/CE loss"][1] - 0.3
    )  # trained weights, not a fresh init
    after, meta = load(dst / "checkpoints" / "2")
    assert int(after["opt"]["count"]) == 42  # the source's moments were updated on, not re-initialised
    assert meta["data"]["batches_seen"] == 2


def test_warm_adam_refuses_a_run_that_has_checkpoints(src, tmp_path):
    run = copy_run(src, tmp_path / "stage1")  # the destination: never the shared run itself
    p = olmo_ctl("surgery", "warm-adam", str(run / "checkpoints" / "40"), str(run), expect=2)
    assert "already holds checkpoints" in p.stderr


def test_soup_of_identical_checkpoints_is_the_checkpoint_and_of_two_is_the_float32_mean(src, tmp_path):
    """Trained checkpoints (the smoke run has no run.yaml: its recipe is given); more in test_soup.py."""
    from olmo_ctl.checkpoints.convert import load_orbax

    ck40 = str(src / "checkpoints" / "40")
    olmo_ctl("surgery", "soup", ck40, ck40, "--out", str(tmp_path / "same"), "--recipe", "smoke")
    soup, _, _ = load_orbax(str(tmp_path / "same"))
    s40, _ = load(ck40)
    assert leaves_equal(soup, s40["params"])

    ck20 = str(src / "checkpoints" / "20")
    olmo_ctl("surgery", "soup", ck20, ck40, "--out", str(tmp_path / "mean"), "--recipe", "smoke")
    mean, _, _ = load_orbax(str(tmp_path / "mean"))
    s20, _ = load(ck20)
    half = np.float32(0.5)
    for m, a, b in zip(
        jax.tree.leaves(mean), jax.tree.leaves(s20["params"]), jax.tree.leaves(s40["params"]), strict=True
    ):
        assert np.array_equal(m, np.zeros(m.shape, np.float32) + half * np.asarray(a) + half * np.asarray(b))


def test_init_from_a_converted_checkpoint(src, tmp_path):
    """`--init-from` starts a run (fresh optimizer, step 0) from parameters written by the converter."""
    from olmo_ctl.checkpoints import convert
    from olmo_ctl.core.recipe import load_recipe

    s40, _ = load(src / "checkpoints" / "40")
    convert.save_orbax(str(tmp_path / "converted"), s40["params"], load_recipe("smoke").model)
    run = tmp_path / "run"
    p = train(run, "--stop-at-step", "1", "--init-from", str(tmp_path / "converted"))
    assert "initialised parameters from" in p.stdout
    ev = scalars(run)
    assert ev["train/CE loss"][1] < scalars(src)["train/CE loss"][1] - 0.3
    after, _ = load(run / "checkpoints" / "1")
    assert int(after["opt"]["count"]) == 1
    p = train(
        tmp_path / "bad",
        "--stop-at-step",
        "1",
        "--init-from",
        str(tmp_path / "converted"),
        "--set",
        "model.d_model=32",
        expect=2,
    )
    assert "does not hold parameters of this recipe's model" in p.stderr


@pytest.mark.chaos
def test_stage2_to_stage3_hand_off_with_packing_yarn_and_seq_shards(src, tmp_path):
    """Stage 3 as the recipe starts it, at smoke size: warm-Adam from the last checkpoint, then packed
    documents (groups of 8 files, permutation seed 123), YaRN, LinearWithWarmup, each sequence split
    over 2 of 4 devices; the step-0 checkpoint written on one device restores onto that mesh."""
    dst = tmp_path / "stage3"
    olmo_ctl("surgery", "warm-adam", str(src / "checkpoints" / "40"), str(dst))
    p = train(
        dst,
        "--stop-at-step",
        "2",
        "--set",
        "schedule.kind=linear",
        "--set",
        "schedule.warmup_steps=2",
        "--set",
        "schedule.alpha=0",
        "--set",
        "data.seed=34521",
        "--set",
        "data.packed=true",
        "--set",
        "data.source_group_size=8",
        "--set",
        "data.source_permutation_seed=123",
        "--set",
        "model.rope_scaling={kind: yarn, factor: 4.0, beta_fast: 32.0, beta_slow: 1.0, "
        "original_context: 32, full_layers_only: true}",
        "--set",
        "train.seq_shards=2",
        device="cpu-4",
    )
    assert "restored checkpoint 0" in p.stdout
    ev = scalars(dst)
    assert ev["optim/LR (group 0)"][1] == pytest.approx(3e-3 * 1 / 2, rel=1e-6)  # warmup step 1 of 2
    assert ev["train/CE loss"][1] < scalars(src)["train/CE loss"][1] - 0.3  # the stage-2 weights
    after, meta = load(dst / "checkpoints" / "2")
    assert int(after["opt"]["count"]) == 42  # the stage-2 moments, updated on
    assert meta["data"]["batches_seen"] == 2 and ":packed=g8:" in meta["data"]["fingerprint"]


def test_a_step_without_its_commit_marker_is_never_restored_listed_or_souped(src, tmp_path):
    """A step directory copied by hand and cut off midway (no commit marker, two files missing) is not
    a checkpoint for anyone: the run directory, `open_step` (surgery, `--start-from`, `--init-from`),
    the soup (which writes nothing) and the trainer, which restores the step before it and moves the
    half copy aside (never deleting it) so the step can be saved again."""
    from olmo_ctl.checkpoints.surgery import check_committed
    from olmo_ctl.core.errors import BadInput
    from olmo_ctl.rundir import RunDir

    run = copy_run(src, tmp_path / "half")
    half = run / "checkpoints" / "40"
    for f in ("commit_success.txt", "meta/metadata", "state/_METADATA"):
        (half / f).unlink()
    assert RunDir(str(run)).committed_steps() == [20]
    for check in (open_step, check_committed):
        with pytest.raises(BadInput, match="not a committed checkpoint"):
            check(str(half))
    p = olmo_ctl(
        "surgery", "soup", str(half), str(src / "checkpoints" / "40"), "--out", str(tmp_path / "s"), expect=2
    )
    assert "not a committed checkpoint" in p.stderr and "Traceback" not in p.stderr
    assert not [f for f in os.listdir(tmp_path) if f.startswith("s")]

    p = train(run, "--stop-at-step", "40")
    assert "restored checkpoint 20" in p.stdout and "has no commit marker" in p.stdout, p.stdout[-2000:]
    assert RunDir(str(run)).committed_steps() == [20, 40]
    (aside,) = os.listdir(run / "checkpoints.uncommitted")
    assert aside.startswith("40-") and (run / "checkpoints.uncommitted" / aside / "state").is_dir()
    want, got = scalars(src), scalars(run)
    assert all(got["train/CE loss"][s] == want["train/CE loss"][s] for s in range(21, 41))
