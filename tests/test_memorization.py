"""The memorization alarm of `monitor --reference`: real TensorBoard files for a run and a reference,
the case study's signature (training loss below the reference, held-out loss not) flagged with its step
range, and a faithful run that is better on both, or one without held-out loss, left alone."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from helpers.cli import clean_env, invoke
from helpers.events import write_segment

from olmo_ctl.observe.memorization import memorization

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "docs" / "monitor-schema.json").read_text())
STEPS = range(1, 3001)
EVAL_EVERY = 250


def ref_train(step: int) -> float:
    return 2.5 + 3.0 / math.sqrt(step) + 0.01 * math.sin(step)


def ref_heldout(step: int) -> float:
    return 2.6 + 3.0 / math.sqrt(step)


def write_run(run: Path, train, heldout) -> Path:
    """tensorboard/ with train/CE loss every step and eval/lm_loss every EVAL_EVERY steps."""

    def values(tag, step):
        return float(np.float32(train(step) if tag == "train/CE loss" else heldout(step)))

    write_segment(run / "tensorboard", list(STEPS), tags=["train/CE loss"], values=values, segment=0)
    write_segment(
        run / "tensorboard",
        [s for s in STEPS if s % EVAL_EVERY == 0],
        tags=["eval/lm_loss"],
        values=values,
        segment=1,
    )
    return run


def monitor(run: Path, *args: str, tmp_path: Path):
    return invoke("monitor", str(run), "--no-backend", *args, env=clean_env(tmp_path))


@pytest.fixture
def reference(tmp_path) -> Path:
    return write_run(tmp_path / "ref", ref_train, ref_heldout)


def test_training_loss_below_the_reference_while_held_out_is_not_is_flagged(tmp_path, reference):
    # From step 1500 the run's training loss is 0.05 below the reference's; its held-out loss is not.
    memorizing = write_run(
        tmp_path / "run",
        lambda s: ref_train(s) - (0.05 if s > 1500 else 0.0),
        lambda s: ref_heldout(s) + 0.002,
    )
    p = monitor(memorizing, "--reference", str(reference), "-o", "json", tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    jsonschema.validate(rep, SCHEMA)
    m = rep["memorization"]
    assert m["judged"] and m["alarm"]
    ((r),) = m["ranges"]
    assert (r["start"], r["end"]) == (1501, 3000)  # the evaluation windows (1500, 1750] ... (2750, 3000]
    assert r["train_delta"] == pytest.approx(-0.05, abs=1e-4)
    assert r["heldout_delta"] == pytest.approx(0.002, abs=1e-4)
    assert any(w.startswith("memorization? steps 1501-3000") for w in rep["warnings"])
    p = monitor(memorizing, "--reference", str(reference), tmp_path=tmp_path)
    assert "memorization? steps 1501-3000: training loss -0.050 against the reference" in p.stdout


def test_a_run_better_on_both_and_a_run_like_the_reference_are_not_flagged(tmp_path, reference):
    better = write_run(tmp_path / "better", lambda s: ref_train(s) - 0.05, lambda s: ref_heldout(s) - 0.05)
    same = write_run(tmp_path / "same", ref_train, ref_heldout)
    for run in (better, same):
        rep = json.loads(monitor(run, "--reference", str(reference), "-o", "json", tmp_path=tmp_path).stdout)
        assert rep["memorization"]["judged"] and not rep["memorization"]["alarm"], rep["memorization"][
            "ranges"
        ]
        assert not any(w.startswith("memorization?") for w in rep["warnings"])
    # without a reference there is no judgement at all
    assert json.loads(monitor(same, "-o", "json", tmp_path=tmp_path).stdout)["memorization"] is None


def test_a_curve_reference_needs_its_held_out_curve(tmp_path, reference):
    train_csv = tmp_path / "ai2-train.csv"
    held_csv = tmp_path / "ai2-c4.csv"
    train_csv.write_text("step,loss\n" + "".join(f"{s},{ref_train(s)}\n" for s in STEPS))
    held_csv.write_text("".join(f"{s},{ref_heldout(s)}\n" for s in STEPS if s % EVAL_EVERY == 0))
    memorizing = write_run(tmp_path / "run", lambda s: ref_train(s) - 0.05, ref_heldout)
    rep = json.loads(
        monitor(memorizing, "--reference", str(train_csv), "-o", "json", tmp_path=tmp_path).stdout
    )
    assert not rep["memorization"]["judged"]
    assert rep["memorization"]["reason"] == "no held-out loss on the reference"
    args = ("--reference", str(train_csv), "--reference-heldout", str(held_csv), "-o", "json")
    rep = json.loads(monitor(memorizing, *args, tmp_path=tmp_path).stdout)
    assert rep["memorization"]["alarm"] and rep["memorization"]["ranges"][0]["start"] == 1
    p = monitor(memorizing, "--reference-heldout", str(held_csv), tmp_path=tmp_path)
    assert p.returncode == 2 and "--reference-heldout needs --reference" in p.stderr


def test_noise_alone_and_a_single_window_do_not_raise_it():
    steps = np.arange(1, 2001)
    rng = np.random.default_rng(0)
    ref = (steps, 3.0 + rng.normal(0, 0.01, len(steps)))
    run = (steps, 3.0 + rng.normal(0, 0.01, len(steps)))
    ev = np.arange(250, 2001, 250)
    held = (ev, np.full(len(ev), 3.1))
    assert not memorization(run, held, ref, held)["alarm"]
    # one low window is not a trend: min_points consecutive evaluations are
    dip = (steps, np.where((steps > 500) & (steps <= 750), ref[1] - 0.05, ref[1]))
    m = memorization(dip, held, ref, held)
    assert [p["step"] for p in m["points"] if p["flagged"]] == [750] and not m["alarm"]
