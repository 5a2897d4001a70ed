"""The memorization alarm of `monitor --reference`: real TensorBoard files for a run and a reference,
the case study's signature (training loss below the reference, held-out loss not) flagged with its step
range, and a faithful run that is better on both, or one without held-out loss, left alone; the
threshold derived from the runs' own noise as documented; and a real `data audit` that found instances
read twice raising the alarm on its own."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from helpers.cli import clean_env, invoke
from helpers.events import write_segment
from helpers.trainer import train

from olmo_ctl.core import faults
from olmo_ctl.observe.memorization import (
    DEFAULT_THRESHOLD,
    FALSE_ALARM_RATE,
    derived_threshold,
    gap_sigma,
    memorization,
)

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


def faithful_pair(gaps: np.ndarray, offset: float = 0.0):
    """A run and its reference evaluated at every step (one training step per window): the run's training
    delta is `offset + gaps`, its held-out delta `offset`."""
    steps = np.arange(1, len(gaps) + 1)
    ref = (steps, np.full(len(steps), 3.0))
    held_ref = (steps, np.full(len(steps), 3.1))
    return (steps, 3.0 + offset + gaps), (steps, held_ref[1] + offset), ref, held_ref


def test_the_threshold_is_the_documented_rule_over_the_gap_noise():
    # docs/monitoring-and-compare.md: T = max(0.02, 2 z sigma), z = 1.86 for a false-alarm rate of 1e-3
    # per evaluation over two in a row; sigma the gap's noise between adjacent evaluations.
    doc = (ROOT / "docs" / "monitoring-and-compare.md").read_text()
    assert "`max(0.02, 2 z σ)`" in doc and "z = 1.86" in doc and "1 in 1,000" in doc
    z = 1.8570
    assert derived_threshold(0.03) == pytest.approx(2 * z * 0.03, rel=1e-3)
    assert derived_threshold(0.001) == DEFAULT_THRESHOLD == 0.02
    assert derived_threshold(None) == DEFAULT_THRESHOLD
    assert FALSE_ALARM_RATE == 1e-3
    # sigma is read from the gap's second differences: a white gap's own sd, a drift or a jump hardly moves it
    rng = np.random.default_rng(1)
    noise = rng.normal(0, 0.03, 400)
    assert gap_sigma(noise) == pytest.approx(0.03, rel=0.1)
    drift_and_jump = noise + np.linspace(0, 0.2, 400) - np.where(np.arange(400) >= 200, 0.1, 0.0)
    assert gap_sigma(drift_and_jump) == pytest.approx(gap_sigma(noise), rel=0.05)
    assert gap_sigma(noise[:11]) is None and gap_sigma(noise[:12]) is not None  # too few: the floor
    m = memorization(*faithful_pair(noise))
    assert m["threshold_rule"] == "derived" and m["gap_sigma"] == pytest.approx(gap_sigma(noise), rel=1e-9)
    assert m["threshold"] == derived_threshold(m["gap_sigma"])
    assert memorization(*faithful_pair(noise), threshold=0.05)["threshold_rule"] == "given"


def test_a_noisy_faithful_run_does_not_raise_it_and_a_repeat_above_the_noise_does():
    # a faithful run whose gap between adjacent evaluations is 0.03 nats of noise (the smoke model's
    # scale: benchmarks/memorization_noise.py) raised a fixed 0.02-nat alarm again and again
    rng = np.random.default_rng(2)
    gaps = rng.normal(0, 0.03, 1000)
    assert memorization(*faithful_pair(gaps), threshold=DEFAULT_THRESHOLD)["alarm"]
    m = memorization(*faithful_pair(gaps))
    pairs = sum(a["flagged"] and b["flagged"] for a, b in zip(m["points"], m["points"][1:], strict=False))
    assert not m["alarm"] and pairs == 0, m["ranges"]
    # a repeat from evaluation 600 on, training loss 0.3 below while held-out is not: flagged at once
    gaps[600:] -= 0.3
    m = memorization(*faithful_pair(gaps))
    assert m["alarm"] and m["ranges"][0]["start"] == 601


def test_a_recorded_audit_with_instances_read_twice_raises_it(tmp_path, reference):
    """A real run, `data audit`ed after 3 steps (nothing read twice: no alarm), then resumed two batches
    back (its steps 4-5 read batches 1-2 again) and audited again: the alarm names the audit's count,
    with or without --reference, although the losses alone cannot show it in five steps."""
    run = tmp_path / "run"
    train(run, "--stop-at-step", "3", "--set", "checkpoint.interval=1")
    env = clean_env(tmp_path)
    assert invoke("data", "audit", str(run), env=env).returncode == 0
    rep = json.loads(monitor(run, "--reference", str(reference), "-o", "json", tmp_path=tmp_path).stdout)
    jsonschema.validate(rep, SCHEMA)
    m = rep["memorization"]
    assert m["audit"]["repeated"] == 0 and m["audit"]["committed_step"] == 3 and not m["alarm"]
    assert not any(w.startswith("memorization") for w in rep["warnings"])
    train(run, "--stop-at-step", "5", "--set", "checkpoint.interval=1", env={faults.DATA_SHIFT.name: "-2"})
    p = invoke("data", "audit", str(run), env=env)
    assert p.returncode == 1 and "16 read twice" in p.stdout, p.stdout
    for args in (("--reference", str(reference)), ()):
        rep = json.loads(monitor(run, *args, "-o", "json", tmp_path=tmp_path).stdout)
        jsonschema.validate(rep, SCHEMA)
        m = rep["memorization"]
        assert m["alarm"] and m["audit"]["repeated"] == 16 and m["audit"]["committed_step"] == 5
        assert m["reference"] == (str(reference) if args else None)
        (w,) = [w for w in rep["warnings"] if w.startswith("memorization")]
        assert w.startswith("memorization: `olmo-ctl data audit` of steps 1-5 (")
        assert "found 16 instances read twice, the first at step 4 (read at step 2)" in w
    assert "found 16 instances read twice" in monitor(run, tmp_path=tmp_path).stdout
