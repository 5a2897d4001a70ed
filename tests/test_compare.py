"""`olmo-ctl compare`: step-aligned deltas between runs and reference curves."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.cli import invoke as cli
from helpers.events import value, write_segment

from olmo_ctl.observe.compare import compare, compare_series, read_curve


def twin_runs(tmp_path, desync=None):
    """An uninterrupted run (1..120) and a resumed twin (1..60, then 41..120 after restoring checkpoint 40)."""
    a = tmp_path / "uninterrupted"
    write_segment(a / "tensorboard", range(1, 121))
    b = tmp_path / "resumed"
    write_segment(b / "tensorboard", range(1, 61), attempt=1)
    write_segment(
        b / "tensorboard",
        range(41, 121),
        attempt=2,
        start_time=1767229200,
        values=lambda tag, s: value(tag, s, desync=desync),
    )
    return a, b


def test_resumed_run_matches_its_twin_exactly(tmp_path):
    a, b = twin_runs(tmp_path)
    res = compare(str(a), str(b), ["train/CE loss", "train/PPL"], bin_steps=50)
    for tag in ("train/CE loss", "train/PPL"):
        r = res["tags"][tag]
        assert r["common_steps"] == 120 and r["max_abs_delta"] == 0.0 and r["first_exceed_step"] is None
        assert [x["start"] for x in r["bins"]] == [1, 51, 101] and [x["points"] for x in r["bins"]] == [
            50,
            50,
            20,
        ]
    assert res["verdict"].startswith("train/CE loss: identical: max |Δ| = 0 on 120 common steps")


def test_desynchronised_run_names_the_first_diverging_step(tmp_path):
    a, b = twin_runs(tmp_path, desync=77)
    p = cli("compare", str(a), str(b), "--bin", "40", "--per-step", "-o", "json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    r = res["tags"]["train/CE loss"]
    assert r["first_exceed_step"] == 77
    assert r["max_abs_delta"] == pytest.approx(0.01, rel=1e-4)
    assert r["bins"][0]["max_abs_delta"] == 0.0 and r["bins"][1]["max_abs_delta"] > 0
    assert "diverge at step 77" in res["verdict"]
    rows = r["steps"]
    assert len(rows) == 120 and rows[75][3] == 0.0 and rows[76][0] == 77
    assert rows[76][3] == pytest.approx(value("train/CE loss", 77, desync=77) - value("train/CE loss", 77))
    t = cli("compare", str(a), str(b))
    assert t.returncode == 0 and "diverge at step 77" in t.stdout


def test_reference_curve_file(tmp_path):
    a, _ = twin_runs(tmp_path)
    csv = tmp_path / "ref.csv"
    rows = ["step,loss"] + [
        f"{s},{value('train/CE loss', s) + (0.2 if s >= 90 else 0.001)}" for s in range(10, 200, 10)
    ]
    csv.write_text("\n".join(rows) + "\n")
    s, v = read_curve(str(csv))
    assert s[0] == 10 and len(s) == 19
    res = compare(str(a), str(csv))
    r = res["tags"]["train/CE loss"]
    assert r["common_steps"] == 12 and r["only_b"] == 7 and r["threshold"] == 0.05
    assert r["first_exceed_step"] == 90
    tsv = tmp_path / "ref.tsv"
    tsv.write_text("\n".join(x.replace(",", "\t") for x in rows[1:]))
    assert compare(str(csv), str(tsv))["tags"]["train/CE loss"]["max_abs_delta"] == 0.0


def test_nan_on_one_side_is_a_divergence():
    s = np.arange(1, 6)
    a = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    b = a.copy()
    b[3] = np.nan
    r = compare_series((s, a), (s, b), threshold=0.0)
    assert r["first_exceed_step"] == 4 and r["max_abs_delta"] is None
    both = compare_series((s, b), (s, b.copy()))
    assert both["max_abs_delta"] == 0.0


def test_bad_inputs(tmp_path):
    p = cli("compare", str(tmp_path / "missing.csv"), str(tmp_path / "x"))
    assert p.returncode == 2 and p.stderr.startswith("error:") and "Traceback" not in p.stderr
    bad = tmp_path / "bad.csv"
    bad.write_text("step,value\n1,2\nthree,four\n")
    a, _ = twin_runs(tmp_path)
    p = cli("compare", str(a), str(bad))
    assert p.returncode == 2 and "line 3" in p.stderr


# The bundled trainer's resumed run against its uninterrupted twin, and a desynchronised resume named at
# its first step: test_trainer_resume.py::test_compare_finds_the_resume_exact_and_names_a_desynchronised_one
# (on the runs that test already trains).


def test_a_bin_covers_only_the_steps_the_runs_have(tmp_path):
    """A 100-step run at the default --bin 2000: one bin, steps 1-100 (not 1-2000)."""
    a, b = tmp_path / "a", tmp_path / "b"
    write_segment(a / "tensorboard", range(1, 101))
    write_segment(b / "tensorboard", range(1, 101))
    (r,) = compare(str(a), str(b))["tags"].values()
    assert [(x["start"], x["end"], x["points"]) for x in r["bins"]] == [(1, 100, 100)]
    t = cli("compare", str(a), str(b))
    assert t.returncode == 0 and "1-100" in t.stdout and "2000" not in t.stdout
    r = compare(str(a), str(b), bin_steps=40)["tags"]["train/CE loss"]
    assert [(x["start"], x["end"]) for x in r["bins"]] == [(1, 40), (41, 80), (81, 100)]


# ---------------------------------------------------------------- across a device-layout change


def ulps(x: float, n: int) -> float:
    """`x` moved by `n` float32 steps (units in the last place): what another summation order gives."""
    y = np.float32(x)
    for _ in range(abs(n)):
        y = np.nextafter(y, np.float32(np.inf if n > 0 else -np.inf))
    return float(y)


def run_on(run, attempts, *, values=None):
    """A run directory (smoke recipe, batch 8 x 128 tokens): run.yaml, a journal placing each attempt on
    its device, and its events; `attempts` = [(attempt, device, steps)]; `values(attempt, tag, step)`."""
    import yaml

    from olmo_ctl.core.recipe import load_recipe

    r = load_recipe("smoke", overrides=["train.max_steps=120"])
    run.mkdir(parents=True)
    doc = {
        "run": run.name,
        "recipe": r.to_dict(),
        "recipe_fingerprint": r.fingerprint(),
        "device": attempts[0][1],
    }
    (run / "run.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    recs = [
        {"time": "2026-01-01T00:00:00Z", "event": "submitted", "attempt": a, "device": d}
        for a, d, _ in attempts
    ]
    (run / "journal.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    for a, _d, steps in attempts:
        write_segment(
            run / "tensorboard",
            steps,
            attempt=a,
            start_time=1767225600 + 100 * a,
            values=(lambda tag, s, a=a: values(a, tag, s)) if values else None,
        )
    return run


def resized_twins(tmp_path, *, device2="cpu-2", perturb=None):
    """A straight cpu-1 run (1..120) and its twin resized at checkpoint 60 (attempt 2 on `device2` from
    step 61), whose attempt 2 writes `perturb(tag, step, value)` (default: the straight run's values)."""
    a = run_on(tmp_path / "straight", [(1, "cpu-1", range(1, 121))])

    def values(attempt, tag, step):
        v = value(tag, step)
        return perturb(tag, step, v) if attempt == 2 and perturb else v

    b = run_on(
        tmp_path / "resized", [(1, "cpu-1", range(1, 66)), (2, device2, range(61, 121))], values=values
    )
    return a, b


def few_ulps(tag, step, v):
    """Another layout's last bits: a few ulps of the losses, growing slowly with the steps since 60."""
    if tag not in ("train/CE loss", "train/PPL"):
        return v
    return ulps(v, (-1) ** step * (1 + (step - 61) // 20))


def test_a_resize_is_equal_up_to_layout_rounding(tmp_path):
    a, b = resized_twins(tmp_path, perturb=few_ulps)
    p = cli("compare", str(a), str(b), "--tags", "train/CE loss", "--tags", "train/PPL", "-o", "json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    for tag in ("train/CE loss", "train/PPL"):
        r = res["tags"][tag]
        assert r["first_exceed_step"] is None and r["threshold"] == 0.0
        assert 0 < r["max_abs_delta"] < 1e-5
        assert r["layout_changed"] is True and r["layout_change_step"] == 61
        assert r["layouts"] == {"a": "cpu-1", "b": "cpu-2"}
        rt = r["rounding_tolerance"]
        assert (rt["dtype"], rt["eps"], rt["k"], rt["tokens_per_step"]) == ("float32", 2.0**-23, 10.0, 1024)
        assert r["max_abs_delta"] <= rt["at_max_abs_delta_step"]
        assert r["verdict"].startswith("equal up to layout rounding: max |Δ| = ")
        assert "layouts differ from step 61: cpu-1 vs cpu-2" in r["verdict"]
    assert "diverge" not in res["verdict"]
    t = cli("compare", str(a), str(b))
    assert t.returncode == 0 and "equal up to layout rounding" in t.stdout and "diverge" not in t.stdout


def test_across_a_layout_change_a_real_divergence_is_still_one(tmp_path):
    """A changed data order (the loss moves by 0.01 from step 90) is far beyond rounding: diverge there."""
    a, b = resized_twins(tmp_path, perturb=lambda tag, s, v: few_ulps(tag, s, value(tag, s, desync=90)))
    r = compare(str(a), str(b))["tags"]["train/CE loss"]
    assert r["first_exceed_step"] == 90 and r["layout_change_step"] == 61
    assert r["first_exceed_delta"] == pytest.approx(0.01, rel=1e-3)
    assert r["rounding_tolerance"]["at_first_exceed_step"] < 1e-4
    assert r["verdict"].startswith("diverge at step 90 (Δ = 0.01, threshold 0; layout-rounding bound ")


def test_on_one_layout_bitwise_stays_the_rule(tmp_path):
    """The same last-bit differences from a resume on the same device are a divergence: one layout is
    bitwise deterministic."""
    a, b = resized_twins(tmp_path, device2="cpu-1", perturb=few_ulps)
    r = compare(str(a), str(b))["tags"]["train/CE loss"]
    assert r["first_exceed_step"] == 61 and r["layout_changed"] is False and r["rounding_tolerance"] is None
    assert r["verdict"].startswith("diverge at step 61 (Δ = ")
    same = compare(*map(str, resized_twins(tmp_path / "exact")))["tags"]["train/CE loss"]
    assert same["max_abs_delta"] == 0.0 and same["verdict"].startswith("identical")
