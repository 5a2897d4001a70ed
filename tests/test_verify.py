"""`olmo-ctl verify`'s arithmetic (observe/verify.py): landmarks both sides have, deltas per surface,
σ from the per-task standard errors in quadrature and from per-document variance, every task judged
jointly, the three levels (identical within the floor, same recipe inside the bands, moved naming
what moved), the cache."""

from __future__ import annotations

import math

import numpy as np
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


def test_a_run_against_itself_is_delta_zero_and_identical():
    r = _res(3.0, {"arc": (0.5, 0.05), "mmlu": (0.3, 0.04)})
    floor = V.floor_of(r, _res(3.0001, {"arc": (0.5, 0.05), "mmlu": (0.3, 0.04)}), 1e-6)
    m = V.landmark(1000, r, r, 0.0, floor=floor)
    assert m["lm"] == {"c4": 0.0} and m["kl"] == 0.0
    assert m["downstream"]["arc"] == m["downstream"]["mmlu"] == m["downstream"]["code_bpb"] == 0.0
    assert m["downstream"]["macro"] == 0.0 and m["within_noise"]
    assert m["level"] == "identical" and m["verdict"] == "within noise (identical)"
    assert m["downstream"]["sigma"] == pytest.approx(math.sqrt(2 * 0.05**2 + 2 * 0.04**2) / 2)
    assert V.landmark(1000, r, r, 0.0)["level"] == "same recipe"  # no floor measured: never identical


def test_each_surface_that_moved_is_named():
    ref = _res(3.0, {"arc": (0.5, 0.01), "mmlu": (0.3, 0.01)})
    run = _res(3.1, {"arc": (0.45, 0.01), "mmlu": (0.25, 0.01)})
    m = V.landmark(2000, run, ref, 0.6, lm_tolerance=0.02)
    assert m["lm"]["c4"] == pytest.approx(0.1)
    assert m["downstream"]["macro"] == pytest.approx(-0.05)
    assert not m["within_noise"] and m["level"] == "moved"
    assert "held-out loss (c4 +0.1000 nats, tolerance 0.02)" in m["verdict"]
    assert (
        "downstream (macro accuracy -0.0500" in m["verdict"]
        and "KL (0.6 nats/token, band 0.5)" in m["verdict"]
    )
    # two of three tasks beyond 2σ where 0.14 are expected by chance
    assert "downstream tasks (2 of 3 beyond 2σ" in m["verdict"]
    only_lm = V.landmark(
        2000, _res(3.1, {"arc": (0.5, 0.01)}), _res(3.0, {"arc": (0.5, 0.01)}), 0.0, lm_tolerance=0.02
    )
    assert only_lm["verdict"].startswith("moved: held-out loss") and "downstream" not in only_lm["verdict"]


def _with_docs(res: dict, ce: list[float], tokens: list[int]) -> dict:
    res["lm"]["c4"].update(ce_loss=sum(ce) / sum(tokens), instances={"ce": ce, "tokens": tokens})
    return res


def test_the_held_out_sigma_is_each_side_s_ratio_estimate_in_quadrature():
    rng = np.random.default_rng(0)
    n = rng.integers(50, 400, size=200)
    a, b = n * rng.normal(3.0, 0.4, 200), n * rng.normal(3.02, 0.4, 200)
    run = _with_docs(_res(0, {}), a.tolist(), n.tolist())
    ref = _with_docs(_res(0, {}), b.tolist(), n.tolist())
    want = 0.0
    for x in (a, b):  # the ratio estimator's linearised variance, numpy's way
        L = x.sum() / n.sum()
        want += np.var(x - L * n, ddof=1) * len(n) / n.sum() ** 2
    m = V.landmark(1, run, ref, None)
    assert m["lm_sigma"]["c4"] == pytest.approx(math.sqrt(want), rel=1e-9)
    assert m["level"] == "same recipe"  # Δ ≈ -0.02 inside 2σ ≈ 0.08
    far = _with_docs(_res(0, {}), (a * 1.2).tolist(), n.tolist())
    moved = V.landmark(1, far, ref, None)
    assert (
        moved["level"] == "moved"
        and "held-out loss (c4 +0.5" in moved["verdict"]
        and "2σ = " in moved["verdict"]
    )


def test_tasks_are_judged_jointly_against_chance():
    tasks = {f"t{i}": (0.5, 0.01) for i in range(26)}
    ref = _res(3.0, tasks)
    four = _res(3.0, {**tasks, **{f"t{i}": (0.54, 0.01) for i in range(4)}})
    five = _res(3.0, {**tasks, **{f"t{i}": (0.54, 0.01) for i in range(5)}})
    j4, j5 = (V.joint_tasks(x["downstream"], ref["downstream"], sorted(tasks), 2.0) for x in (four, five))
    assert (len(j4["beyond"]), j4["judged"]) == (4, 26) and j4["expected"] == pytest.approx(
        26 * 0.0455, abs=1e-3
    )
    from scipy.stats import binom, norm

    p0 = 2 * norm.sf(2.0)
    assert j4["p"] == pytest.approx(binom.sf(3, 26, p0), rel=1e-9)
    assert j5["p"] == pytest.approx(binom.sf(4, 26, p0), rel=1e-9)
    assert j4["p"] > V.JOINT_ALPHA > j5["p"]
    assert V.binomial_tail(0, 26, 0.05) == 1.0
    # Four beyond 2σ of 26 is what chance gives about one time in 35; five, one in 170: moved.
    assert "downstream tasks" not in V.landmark(1, four, ref, None)["verdict"]
    assert "downstream tasks (5 of 27 beyond 2σ" in V.landmark(1, five, ref, None)["verdict"]


def test_tokens_per_step_and_the_data_audit_are_named():
    r = _res(3.0, {"arc": (0.5, 0.05)})
    m = V.landmark(100, r, r, 0.0, tokens_per_step={"run": 4_194_304, "reference": 2_097_152})
    assert m["level"] == "moved" and "tokens per step (run 4,194,304, reference 2,097,152)" in m["verdict"]
    audit = {"departs_at": 7, "reason": "repeats", "repeated": 128}
    assert (
        "data order (departs at step 7: repeats; 128 instances read twice)"
        in V.landmark(100, r, r, 0.0, audit=audit)["verdict"]
    )
    assert V.landmark(5, r, r, 0.0, audit=audit)["level"] == "same recipe"  # not yet at step 5


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
