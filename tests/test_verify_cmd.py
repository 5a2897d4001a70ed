"""`olmo-ctl verify` end to end on the CPU: real trainer runs of the smoke recipe, evaluated by `eval`'s
machinery at their common checkpoints, with the token KL between them.

A run against an identical run is Δ 0 and KL 0 at every landmark, exit 0, and a second verify reads
every evaluation from the run directory. A run with the case study's loader bug planted (two hosts,
each striding its share of every batch again: half the instances read twice, half never) against the
same training without it: its KL and held-out loss move, and the verdict names the KL (exit 1); the
bug-free two-host twin of a one-host run stays within noise. Bad input is one line and exit 2."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.cli import clean_env, invoke

from olmo_ctl.core import faults

pytest.importorskip("olmo_eval", reason="the eval extra (ai2-olmo-eval) is not installed")

LM = "smoke_eval={root}/eval/*.npy"  # the smoke held-out files as the LM surface
ARGS = (
    "--recipe",
    "smoke",
    "--tasks",
    "copycolors_10way",
    "--limit",
    "20",
    "--lm",
    LM,
    "--kl-tokens",
    "2048",
)


def _verify(run, ref, *extra: str, env, expect: int = 0) -> dict:
    p = invoke("verify", str(run), "--reference", str(ref), *ARGS, *extra, "-o", "json", env=env)
    assert p.returncode == expect, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(p.stdout)


def test_a_run_against_itself_is_delta_zero_and_kl_zero_then_instant(smoke_run, tmp_path):
    env = clean_env(tmp_path / "xdg")
    run, ref = tmp_path / "run", tmp_path / "ref"
    shutil.copytree(smoke_run, run)
    shutil.copytree(smoke_run, ref)
    res = _verify(run, ref, "--plot", str(tmp_path / "v.png"), env=env)
    assert [m["step"] for m in res["landmarks"]] == [20, 40]
    for m in res["landmarks"]:
        assert m["lm"] == {"smoke_eval": 0.0} and m["kl"] == 0.0
        assert m["downstream"]["copycolors_10way"] == 0.0 and m["downstream"]["macro"] == 0.0
        assert m["within_noise"] and m["verdict"] == "within noise (identical)" and m["level"] == "identical"
    assert res["verdict"] == "within noise (identical) at all 2 landmark(s)" and res["level"] == "identical"
    assert res["precision"] == "float32" and res["floor"]["between"] == ["float32", "bfloat16"]
    # 2 landmarks x (run, reference, KL), and the floor: the reference in bfloat16 and its KL
    assert (res["evaluated"], res["cached"]) == (8, 0)
    assert (tmp_path / "v.png").read_bytes()[:4] == b"\x89PNG"
    again = _verify(run, ref, env=env)
    assert (again["evaluated"], again["cached"]) == (0, 8) and again["landmarks"] == res["landmarks"]


@pytest.mark.chaos  # a second trainer run and two sides evaluated at two landmarks: about a minute
def test_two_runs_of_one_recipe_with_other_data_orders_are_the_same_recipe(smoke_run, tmp_path):
    """Data seeds 2 and the smoke run's own: every surface differs (another order of the same data),
    and each stays inside its band: same recipe, not identical, exit 0."""
    from helpers.trainer import train

    env = clean_env(tmp_path / "xdg")
    other = tmp_path / "seed2"
    train(other, "--stop-at-step", "40", "--set", "data.seed=2")
    res = _verify(other, smoke_run, env=env)
    assert (
        res["level"] == "same recipe" and res["verdict"] == "within noise (same recipe) at all 2 landmark(s)"
    )
    for m in res["landmarks"]:
        assert m["level"] == "same recipe" and m["kl"] > m["floor"]["kl"], m
        assert m["lm"]["smoke_eval"] != 0 and m["lm_sigma"]["smoke_eval"] > abs(m["lm"]["smoke_eval"]) / 2
    assert res["audit"]["departs_at"] is None  # the run read its own order


@pytest.mark.chaos  # three trainer runs (two of them two-host twins): a few minutes
def test_the_planted_loader_bug_moves_held_out_loss_and_kl_and_the_verdict_names_them(smoke_run, tmp_path):
    from test_multihost import host_codes, start, wait_ended

    env = clean_env(tmp_path / "xdg")
    ckpts = ("--stop-at-step", "40", "--set", "checkpoint.interval=20")
    runs = {}
    for name, fault in (("clean", {}), ("bug", {faults.DOUBLE_SHARD.name: "1"})):
        runs[name] = start(tmp_path, "cpu-2x2", 100, *ckpts, env=fault, run=name)
    for backend, h in runs.values():
        assert wait_ended(backend, h, 600) and host_codes(backend, h) == [0, 0]
    twin = _verify(tmp_path / "clean", smoke_run, env=env)  # two hosts against one, no bug
    assert twin["verdict"].startswith("within noise (") and twin["level"] != "moved", twin
    bug = _verify(tmp_path / "bug", tmp_path / "clean", env=env, expect=1)
    last = bug["landmarks"][-1]
    assert not last["within_noise"] and last["level"] == "moved" and bug["level"] == "moved"
    # The run's own data audit names the loader: it departs from the order at its first step.
    assert "data order (departs at step " in last["verdict"] and "read twice" in last["verdict"], last
    assert bug["verdict"].startswith("moved at ")
    assert last["kl"] > 10 * max(m["kl"] for m in twin["landmarks"])
    # Measured: 0.15 nats/token at step 40, the twin's 0.001; both inside the default KL band of two
    # independent 7B runs (0.5). With the band set from this machine's twin, the KL is named too.
    band = 10 * max(m["kl"] for m in twin["landmarks"])
    kl_named = _verify(
        tmp_path / "bug", tmp_path / "clean", "--kl-tolerance", f"{band:.6f}", env=env, expect=1
    )
    assert "KL (" in kl_named["landmarks"][-1]["verdict"], kl_named["landmarks"][-1]
    # The held-out loss moves the same way: up (the loader re-reads what it has read, so the model sees
    # fewer distinct documents), by more than the layout drift of two hosts against one. That drift is
    # rounding compounded over 40 steps and depends on the CPU the steps ran on: measured -0.002
    # against +0.016 on one machine, 0.009 against +0.024 on another, so the bug's delta sits on
    # either side of verify's default held-out tolerance (0.02) depending on the machine. The bug's run
    # and its clean twin share one layout, so its delta holds none of the drift.
    drift = max(abs(m["lm"]["smoke_eval"]) for m in twin["landmarks"])
    assert last["lm"]["smoke_eval"] > 1.5 * drift, (last["lm"], drift)
    # With the held-out tolerance set from the measured drift (the noise floor of this machine's two
    # layouts) instead of the default, the verdict names the held-out loss beside the KL.
    tol = max(1.25 * drift, 0.002)
    named = _verify(tmp_path / "bug", tmp_path / "clean", "--lm-tolerance", f"{tol:.6f}", env=env, expect=1)
    assert named["evaluated"] == 0  # every evaluation read back from the first call's cache
    assert "held-out loss (smoke_eval +" in named["landmarks"][-1]["verdict"], (named["landmarks"][-1], tol)


@pytest.mark.parametrize(
    "extra,message",
    [
        (("--steps", "30"), "step 30 is not a checkpoint of both the run and the reference"),
        (("--tasks", "no_such_task"), "unknown downstream task 'no_such_task'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(smoke_run, tmp_path, extra, message):
    env = clean_env(tmp_path / "xdg")
    p = invoke("verify", str(smoke_run), "--reference", str(smoke_run), *ARGS, *extra, env=env)
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    errors = [x for x in p.stderr.splitlines() if not x.startswith("note: ")]
    assert len(errors) == 1 and message in errors[0], p.stderr


def test_a_reference_without_a_common_step_and_a_missing_one_are_exit_2(smoke_run, tmp_path):
    env = clean_env(tmp_path / "xdg")
    ref = tmp_path / "ai2"
    (ref / "stage1-step1000").mkdir(parents=True)
    for reference, message in (
        (ref, "have no checkpoint step in common"),
        (tmp_path / "nowhere", "does not exist"),
    ):
        p = invoke("verify", str(smoke_run), "--reference", str(reference), *ARGS, env=env)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (smoke_run / "eval").exists()  # nothing written into the run


def test_a_missing_tokenizer_is_exit_2_before_any_checkpoint_is_read(smoke_run, tmp_path):
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.rundir import RunDir

    env = clean_env(tmp_path / "xdg")
    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    r = load_recipe("smoke", overrides=[f"data.tokenizer={tmp_path / 'no-tokenizer'}"])
    RunDir(str(run)).create_run(r.to_dict(), r.fingerprint(), "", "cpu-1", adopt=True)
    args = ("--tasks", "copycolors_10way", "--lm", LM)
    p = invoke("verify", str(run), "--reference", str(smoke_run), *args, env=env)
    assert p.returncode == 2 and "no-tokenizer" in p.stderr and "tokenizer.json" in p.stderr, p.stderr
    assert not (run / "eval").exists()
