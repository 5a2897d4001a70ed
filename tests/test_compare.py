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
