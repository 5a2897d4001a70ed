"""`olmo-ctl verify`'s arithmetic (observe/verify.py): landmarks both sides have, deltas per surface,
σ from the per-task standard errors in quadrature, the verdict naming what moved, the cache."""

from __future__ import annotations

import math

import pytest

from olmo_ctl.core.errors import BadInput
from olmo_ctl.observe import verify as V


def _res(c4: float, acc: dict[str, tuple[float, float]], bpb: float = 1.0) -> dict:
    """An `eval -o json` result: one LM label, accuracy tasks (value, stderr) and a BPB task."""
    ds = {t: {"acc_v1": v, "acc_v2": v, "bpb_v1": 2.0, "stderr": se} for t, (v, se) in acc.items()}
    ds["code_bpb"] = {"bpb_v1": bpb, "bpb_v2": bpb, "stderr": 0.01}
    return {
        "checkpoint": "x",
        "step": 1,
        "lm": {"c4": {"ce_loss": c4, "ppl": math.exp(c4), "tokens": 10}},
        "downstream": ds,
    }


def test_a_run_against_itself_is_delta_zero_and_within_noise():
    r = _res(3.0, {"arc": (0.5, 0.05), "mmlu": (0.3, 0.04)})
    m = V.landmark(1000, r, r, 0.0)
    assert m["lm"] == {"c4": 0.0} and m["kl"] == 0.0
    assert m["downstream"]["arc"] == m["downstream"]["mmlu"] == m["downstream"]["code_bpb"] == 0.0
    assert m["downstream"]["macro"] == 0.0 and m["within_noise"] and m["verdict"] == "within noise"
    assert m["downstream"]["sigma"] == pytest.approx(math.sqrt(2 * 0.05**2 + 2 * 0.04**2) / 2)


def test_each_surface_that_moved_is_named():
    ref = _res(3.0, {"arc": (0.5, 0.01), "mmlu": (0.3, 0.01)})
    run = _res(3.1, {"arc": (0.45, 0.01), "mmlu": (0.25, 0.01)})
    m = V.landmark(2000, run, ref, 0.2)
    assert m["lm"]["c4"] == pytest.approx(0.1)
    assert m["downstream"]["macro"] == pytest.approx(-0.05)
    assert not m["within_noise"]
    assert "held-out loss (c4 +0.1000 nats" in m["verdict"]
    assert "downstream (macro accuracy -0.0500" in m["verdict"] and "KL (0.2 nats/token" in m["verdict"]
    only_lm = V.landmark(2000, _res(3.1, {"arc": (0.5, 0.01)}), _res(3.0, {"arc": (0.5, 0.01)}), 0.0)
    assert only_lm["verdict"].startswith("moved: held-out loss") and "downstream" not in only_lm["verdict"]


def test_a_downstream_delta_inside_its_noise_is_not_a_move():
    ref = _res(3.0, {"arc": (0.50, 0.05)})
    run = _res(3.0, {"arc": (0.45, 0.05)})  # |Δ| 0.05 < 2σ = 2 * sqrt(2) * 0.05
    assert V.landmark(1, run, ref, None)["within_noise"]
    assert not V.landmark(1, run, ref, None, sigmas=0.5)["within_noise"]


def test_the_macro_is_over_accuracy_tasks_only():
    value, tasks = V.macro(_res(3.0, {"arc": (0.6, 0.0), "mmlu": (0.2, 0.0)}, bpb=9.0)["downstream"])
    assert tasks == ["arc", "mmlu"] and value == pytest.approx(0.4)


def test_reference_checkpoints_named_by_step_and_landmarks_in_common(tmp_path):
    ref = tmp_path / "ref"
    for name in (
        "stage1-step1000",
        "stage1-step3000",
        "step-2000",
        "5000",
        "7000.orbax-checkpoint-tmp-12",
        "notes",
    ):
        (ref / name).mkdir(parents=True)
    steps = V.checkpoints_of(str(ref))
    assert sorted(steps) == [1000, 2000, 3000, 5000] and steps[1000].endswith("stage1-step1000")
    run = {1000: "r/1000", 3000: "r/3000", 4000: "r/4000"}
    assert V.landmarks(run, steps, None, "r", "ref") == [1000, 3000]
    assert V.landmarks(run, steps, [3000], "r", "ref") == [3000]
    with pytest.raises(BadInput, match="step 4000 is not a checkpoint of both"):
        V.landmarks(run, steps, [4000], "r", "ref")
    with pytest.raises(BadInput, match="have no checkpoint step in common"):
        V.landmarks({10: "r/10"}, steps, None, "r", "ref")
    with pytest.raises(BadInput, match="does not exist"):
        V.checkpoints_of(str(tmp_path / "nothing"))


def test_an_evaluation_is_computed_once_then_read_from_the_run_directory(tmp_path):
    calls = []
    path = V.cache_path(str(tmp_path), "eval", "gs://b/ref/stage1-step1000", {"tasks": ["a"]})
    assert "/eval/verify/eval-1000-" in path
    assert V.cache_path(str(tmp_path), "eval", "gs://b/ref/stage1-step1000", {"tasks": ["b"]}) != path
    first = V.cached(path, lambda: calls.append(1) or {"x": 1.5})
    again = V.cached(path, lambda: calls.append(1) or {"x": 9})
    assert first == ({"x": 1.5}, False) and again == ({"x": 1.5}, True) and calls == [1]


def test_the_plot_is_a_png(tmp_path):
    r = _res(3.0, {"arc": (0.5, 0.05)})
    marks = [V.landmark(s, r, r, 0.0) for s in (1000, 2000)]
    V.plot(marks, str(tmp_path / "v.png"))
    assert (tmp_path / "v.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
