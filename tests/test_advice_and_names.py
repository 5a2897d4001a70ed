"""What a refusal advises, and the names it guesses (a new user's findings).

Advice never names what is already set, what the tool refuses, or a change that would not help: the
plan's "does not fit" names only changes with which the plan fits (`batching._memory_advice`), a
resize never suggests another global batch (which `amend` refuses). A mistyped device, recipe key or
task name gets the one close name (`core.text.closest`, difflib), in the one place each is checked.
A shipped stage that starts from another's checkpoint says how. A lost lease is not bad input (exit
3); `amend` refuses a step count the trainer cannot count and a key given twice; a run.yaml without a
fingerprint says so in words; any valid Kubernetes quantity parses."""

from __future__ import annotations

import re

import pytest
from helpers.cli import clean_env, invoke

from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.rundir import LeaseLost, RunDir


@pytest.fixture
def env(tmp_path):
    return clean_env(tmp_path / "xdg")


# ---------------------------------------------------------------- the plan's memory advice


def test_advice_never_names_the_remat_already_set_nor_a_larger_slice_than_the_largest(env):
    # The largest v5e slice, remat already full: neither may be advised.
    p = invoke("plan", "--stage", "3", "--device", "v5litepod-256", "--set", "model.remat=full", env=env)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.splitlines()) == 1, p.stderr
    assert "does not fit on v5litepod-256" in p.stderr
    assert "remat" not in p.stderr.partition("usable;")[2] and "larger slice" not in p.stderr


def test_every_change_advised_makes_the_plan_fit(env):
    p = invoke("plan", "--model", "olmo3-32b", "--stage", "3", "--device", "v5p-512", env=env)
    assert p.returncode == 2 and "model.remat=full" in p.stderr, p.stderr
    fits = invoke(
        "plan",
        "--model",
        "olmo3-32b",
        "--stage",
        "3",
        "--device",
        "v5p-512",
        "--set",
        "model.remat=full",
        env=env,
    )
    assert fits.returncode == 0, fits.stderr
    advice = p.stderr.partition("usable;")[2]
    devices = re.findall(r"\b(?:v5p|tpu7x|v6e|v5litepod)-\d+\b", advice)
    assert devices, advice
    for d in devices:  # each slice named holds it as it is
        q = invoke("plan", "--model", "olmo3-32b", "--stage", "3", "--device", d, env=env)
        assert q.returncode == 0, (d, q.stderr)


def test_a_resize_never_advises_another_global_batch(tmp_path, env):
    root = tmp_path / "runs"
    r = load_recipe("smoke", overrides=["train.max_steps=40"])
    RunDir.of(str(root), "r").create_run(r.to_dict(), r.fingerprint(), "fp", "cpu-1")
    p = invoke("resize", "r", "--device", "cpu-3", "--run-root", str(root), "--backend", "local", env=env)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert "cannot be split exactly over the 3 devices of cpu-3" in p.stderr
    assert "global_batch" not in p.stderr.partition(";")[2], p.stderr  # amend refuses it
    a = invoke(
        "amend", "r", "--run-root", str(root), "--backend", "local", "--set", "train.global_batch=6", env=env
    )
    assert a.returncode == 2 and "step shape" in a.stderr
    # A new run's plan may still change the recipe's batch: there the advice stays.
    n = invoke("plan", "--recipe", "smoke", "--device", "cpu-3", env=env)
    assert n.returncode == 2 and "or change train.global_batch" in n.stderr


# ---------------------------------------------------------------- did you mean


@pytest.mark.parametrize(
    "device, meant",
    [
        ("cpu1", "cpu-1"),
        ("h200-141gb", "h200-141gb-8"),
        ("h100-80gb-8", "h100-mega-80gb-8"),
        ("v5p256", "v5p-256"),
    ],
)
def test_a_mistyped_device_gets_the_closest_name(device, meant, env):
    p = invoke("plan", "--recipe", "smoke", "--device", device, env=env)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.splitlines()) == 1, p.stderr
    assert f"`{device}` is not a device type" in p.stderr and f"did you mean `{meant}`?" in p.stderr


def test_no_guess_between_equally_close_names_or_none_close(env):
    for device in ("cpu-l", "zzz"):
        p = invoke("plan", "--recipe", "smoke", "--device", device, env=env)
        assert p.returncode == 2 and "did you mean" not in p.stderr, p.stderr


def test_a_mistyped_recipe_key_gets_the_closest_key(env):
    p = invoke("plan", "--recipe", "smoke", "--device", "cpu-1", "--set", "train.max_step=5", env=env)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert "unknown key `train.max_step`; did you mean `train.max_steps`?" in p.stderr
    p = invoke("plan", "--recipe", "smoke", "--device", "cpu-1", "--set", "trian.max_steps=5", env=env)
    assert "did you mean `train`?" in p.stderr


def test_a_mistyped_task_gets_the_closest_label():
    pytest.importorskip("olmo_eval", reason="the eval extra (ai2-olmo-eval) is not installed")
    from olmo_ctl.trainer.downstream import check_tasks

    with pytest.raises(BadInput) as e:
        check_tasks(["copycolor_10way"])
    assert "did you mean `copycolors_10way`?" in e.value.one_line()


# ---------------------------------------------------------------- where a stage starts


def test_the_7b_stage_2_says_it_starts_from_stage_1_by_warm_adam_surgery(env):
    p = invoke("plan", "--stage", "2", "--device", "tpu7x-128", env=env)
    assert p.returncode == 0, p.stderr
    note = " ".join(p.stderr.split())
    assert "note: stage 2 starts from a stage-1 checkpoint" in note
    assert "`olmo-ctl surgery warm-adam STAGE1_RUN_DIR/checkpoints/1413814 RUN_DIR`" in note
    s = invoke("submit", "--stage", "2", "--device", "tpu7x-128", "--dry-run", env=env)
    assert s.returncode == 0 and "olmo-ctl surgery warm-adam" in s.stderr, s.stderr
    assert "surgery" not in invoke("plan", "--stage", "1", "--device", "tpu7x-128", env=env).stderr
    # A refusal stays one line: the note comes only with a plan.
    q = invoke("plan", "--stage", "3", "--device", "b200-8x128", env=env)
    assert q.returncode == 2 and len(q.stderr.splitlines()) == 1


def test_every_stage_start_is_a_shipped_recipe_of_the_stage_before():
    from olmo_ctl.core.recipe import STAGE_STARTS, start_note

    for name, (before, how) in STAGE_STARTS.items():
        r, prev = load_recipe(name), load_recipe(before)
        assert prev.stage == r.stage - 1 and prev.model.name == r.model.name
        assert how in ("warm-adam", "start-from", "init-from")
        text = start_note(r)
        assert text is not None and (how != "start-from" or bool(r.ingredients))
        if how != "init-from":
            assert f"checkpoints/{prev.train.max_steps}" in text
    assert start_note(load_recipe("smoke")) is None


# ---------------------------------------------------------------- exit codes and words


def test_a_lost_lease_is_not_bad_input(tmp_path):
    rd = RunDir.of(str(tmp_path / "runs"), "r")
    r = load_recipe("smoke")
    rd.create_run(r.to_dict(), r.fingerprint(), "fp", "cpu-1")
    lease = rd.acquire_lease(ttl_s=60, now=1000.0)
    (tmp_path / "runs" / "r" / "lease.json").unlink()  # taken over (then released) by another
    with pytest.raises(LeaseLost) as e:
        rd.heartbeat(lease, now=1010.0)
    assert e.value.exit_code == 3 and "another supervisor took over" in e.value.one_line()


def test_a_run_without_a_recipe_fingerprint_says_so_in_words(tmp_path):
    rd = RunDir.of(str(tmp_path / "runs"), "r")
    r = load_recipe("smoke")
    rd.create_run(r.to_dict(), None, None, "cpu-1")  # as a hand-written run.yaml may have it
    with pytest.raises(BadInput) as e:
        rd.check_matches(r.fingerprint(), "data-fp")
    assert "None" not in e.value.one_line() and "(no fingerprint, this one fingerprint " in e.value.one_line()


def test_a_mistyped_run_name_gets_the_closest_runs(tmp_path, env):
    """`logs`, `stop` and `monitor` of `sbu1` where `sub1` exists say `did you mean `sub1`?`."""
    root = tmp_path / "runs"
    for name in ("sub1", "other"):
        (root / name).mkdir(parents=True)
        (root / name / "run.yaml").write_text("run: x\n")
    for cmd in ("logs", "stop", "monitor"):
        p = invoke(cmd, "sbu1", "--run-root", str(root), env=env)
        assert p.returncode == 2 and "did you mean `sub1`?" in p.stderr and "other" not in p.stderr, p.stderr
