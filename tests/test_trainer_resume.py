"""Exact resume of the real trainer (subprocesses, real Orbax checkpoints, real event files).

A: the smoke recipe trained 40 steps without a stop (the session's `smoke_run`). B: trained to 20, stopped, resumed to 40.
The logged `train/CE loss` and `optim/total grad norm` of steps 21-40 must be bitwise equal; a resume
deliberately one batch early or late (fault injection) must fail that same comparison.
"""

from __future__ import annotations

import pytest
from helpers.trainer import TAGS, resume_copy, same_steps, scalars, train


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smoke_run):
    root = tmp_path_factory.mktemp("resume")
    a, b = smoke_run, root / "b"  # A: the session's uninterrupted 40 steps (tests/conftest.py), read only
    first = train(b, "--stop-at-step", "20")
    second = train(b, "--stop-at-step", "40")
    return {"root": root, "a": a, "b": b, "first": first, "second": second, "A": scalars(a), "B": scalars(b)}


def test_resumed_run_is_bitwise_equal_to_uninterrupted(runs):
    assert "committed step 20" in runs["first"].stdout
    assert "restored checkpoint 20" in runs["second"].stdout
    assert sorted(int(p.name) for p in (runs["b"] / "checkpoints").iterdir()) == [20, 40]
    A, B = runs["A"], runs["B"]
    assert same_steps(A, B, range(21, 41)) == []
    for tag in TAGS:  # one value per step, no gap, no duplicate (checked in scalars())
        assert sorted(B[tag]) == list(range(1, 41))


def test_smoke_recipe_learns_and_logs_eval(runs):
    A = runs["A"]
    ce = A["train/CE loss"]
    assert ce[40] <= 0.7 * ce[1], (ce[1], ce[40])
    assert sorted(A["eval/lm_loss"]) == [20, 40]
    assert A["eval/lm_loss"][40] < A["eval/lm_loss"][20]
    for tag in (
        "train/PPL",
        "train/Z loss",
        "optim/LR (group 0)",
        "optim/LR (group 1)",
        "optim/step skipped",
        "optim/step_skipped",
        "throughput/total tokens",
        "perf/total_tokens",
        "throughput/device/TPS",
        "throughput/device/TPS (actual avg)",
        "throughput/device/TFLOPS",
        "throughput/device/MFU",
        "throughput/device/MFU (actual avg)",
        "throughput/device/data loading (s)",
        "perf/step_time_s",
    ):
        assert sorted(A[tag]) == list(range(1, 41)), tag
    assert A["perf/total_tokens"][40] == 40 * 8 * 128
    assert sorted(A["checkpoint/save_duration_s"]) == [20, 40]


@pytest.mark.parametrize("shift", [1, -1])
def test_off_by_one_data_resume_is_detected(runs, shift):
    run = resume_copy(runs["b"], 20, runs["root"] / f"shift{shift}")
    p = train(run, "--stop-at-step", "22", env={"OLMO_CTL_TEST_DATA_SHIFT": str(shift)})
    assert "FAULT INJECTION" in p.stdout
    bad = same_steps(runs["A"], scalars(run), range(21, 23))
    assert any("train/CE loss step 21" in b for b in bad), bad


def test_resume_with_background_prefetch_workers(runs):
    run = resume_copy(runs["a"], 20, runs["root"] / "prefetch")
    train(run, "--stop-at-step", "30", "--set", "data.prefetch_workers=2")
    assert same_steps(runs["A"], scalars(run), range(21, 31)) == []


# The resume on 4 host devices (FSDP, background prefetch) is checked beside the sequence-sharded one,
# on the same cpu-4 runs: test_seq_shards.py::test_local_run_with_seq_shards_trains_resumes_bitwise_and_matches_unsharded.


def test_data_fingerprint_guard(runs):
    run = resume_copy(runs["a"], 20, runs["root"] / "fp")
    p = train(run, "--stop-at-step", "21", "--set", "train.seq_len=64", expect=2)
    assert "train.seq_len 128 -> 64" in p.stderr and "--allow-data-change" in p.stderr
    fewer = '--set=data.train=["{root}/train/part-00000.npy", "{root}/train/part-00001.npy", "{root}/train/part-00002.npy"]'
    p = train(run, "--stop-at-step", "21", fewer, expect=2)
    assert "number of token files 4 -> 3" in p.stderr
    assert "Traceback" not in p.stderr
    p = train(run, "--stop-at-step", "21", fewer, "--allow-data-change")
    assert "committed step 21" in p.stdout and "data changed" in p.stdout


def test_compare_finds_the_resume_exact_and_names_a_desynchronised_one(runs):
    """`olmo-ctl compare` on the real trainer's runs: the resumed run equals its uninterrupted twin
    (max |Δ| = 0); a resume that restarts the data order elsewhere is named at its first step."""
    from olmo_ctl.observe.compare import compare

    same = compare(str(runs["a"]), str(runs["b"]), ["train/CE loss", "optim/total grad norm"])
    for tag in ("train/CE loss", "optim/total grad norm"):
        assert same["tags"][tag]["common_steps"] == 40 and same["tags"][tag]["max_abs_delta"] == 0.0, same[
            "verdict"
        ]
    desync = resume_copy(runs["b"], 20, runs["root"] / "desync")
    train(desync, "--stop-at-step", "30", "--set", "data.seed=999", "--allow-data-change")
    off = compare(str(runs["a"]), str(desync))
    r = off["tags"]["train/CE loss"]
    assert r["first_exceed_step"] == 21 and r["bins"][0]["max_abs_delta"] > 0
    assert "diverge at step 21" in off["verdict"]
