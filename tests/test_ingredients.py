"""Mid-training as ingredients, supervised as one (supervise/ingredients.py, docs/ingredients.md): the
smoke recipe's three anneals (`smoke-soup`, data orders 1, 2, 3) from one start under one
`resume-until-done`, a SIGKILL of the supervisor and of a trainer mid-ingredient, the soup at the end,
evaluated; each ingredient's losses equal the same ingredient trained alone."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from helpers.cli import clean_env, invoke, spawn
from helpers.trainer import same_steps, scalars, train
from helpers.waiting import wait_for

from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe

RECIPE = "smoke-soup"


def _committed(run: Path) -> list[int]:
    d = run / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def _journal(run: Path) -> list[dict]:
    p = run / "journal.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def test_the_recipe_of_ingredients_and_its_refusals():
    r = load_recipe(RECIPE)
    assert [i.name for i in r.ingredients] == ["order-1", "order-2", "order-3"]
    subs = [r.ingredient_recipe(k) for k in range(3)]
    assert [s.data.seed for s in subs] == [1, 2, 3] and all(not s.ingredients for s in subs)
    assert len({s.training_fingerprint() for s in subs}) == 3  # three different runs
    assert "ingredients" not in load_recipe("smoke").to_dict()  # a run of one recipe is as it was
    for bad, says in (
        (["ingredients=[{set: [model.d_model=128]}, {set: [data.seed=2]}]"], "is not key=value of what"),
        (["ingredients=[{set: [train.global_batch=16]}, {set: []}]"], "one batch"),
        (["ingredients=[{set: [data.seed=2]}]"], "needs two or more"),
        (["ingredients=[{name: a}, {name: a}]"], "names one twice"),
        (["ingredients=[{set: [train.max_steps=-1]}, {}]"], "ingredient 1"),
    ):
        with pytest.raises(BadInput, match=says):
            load_recipe("smoke", overrides=bad)


@pytest.fixture(scope="module")
def flow(tmp_path_factory, smoke_run):
    """resume-until-done of the three ingredients from the smoke run's step 40, started twice at the
    same moment (one of the two supervisors drives it, the other exits at once), its supervisor killed
    (SIGKILL) once ingredient 2 has committed step 10, that ingredient's trainer killed too, then a
    second resume-until-done to the end."""
    root = tmp_path_factory.mktemp("ingredients") / "runs"
    env = {
        **clean_env(tmp_path_factory.mktemp("xdg")),
        "OLMO_CTL_RETRY_BACKOFF_SECONDS": "0.2",
    }
    start = str(smoke_run / "checkpoints" / "40")
    args = ("resume-until-done", "soup", "--recipe", RECIPE, "--device", "cpu-1", "--backend", "local")
    args += ("--run-root", str(root), "--start-from", start, "--poll", "0.5")
    first, rival = spawn(*args, env=env), spawn(*args, env=env)
    i2 = root / "soup-i2"
    try:
        ended = lambda: first.poll() is not None or rival.poll() is not None  # noqa: E731
        wait_for(ended, 120, "one of the two supervisors to end")
        if first.poll() is not None and rival.poll() is None:
            first, rival = rival, first  # the one still running drives the run of ingredients
        _, rival_err = rival.communicate(timeout=30)
        wait_for(lambda: 10 in _committed(i2) or first.poll() is not None, 240, "ingredient 2's step 10")
        assert first.poll() is None, (
            f"both supervisors ended: {first.communicate()[1][-2000:]}\n{rival_err[-2000:]}"
        )
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        trainer = next(r for r in reversed(_journal(i2)) if r["event"] == "submitted")["handle"]["data"][
            "pid"
        ]
        os.kill(trainer, signal.SIGKILL)  # the attempt the killed supervisor left running
    finally:
        for p in (first, rival):
            if p.poll() is None:
                p.kill()
    killed_at = _committed(i2)
    second = invoke(*args[:2], "--backend", "local", "--run-root", str(root), "--poll", "0.5", env=env)
    rival_run = (rival.returncode, rival_err, first.pid)
    return {
        "root": root,
        "env": env,
        "start": start,
        "killed_at": killed_at,
        "second": second,
        "rival": rival_run,
    }


def test_a_second_supervisor_of_a_run_of_ingredients_is_refused_naming_the_first(flow):
    """Two `resume-until-done` of one new run of ingredients at the same moment: the run of ingredients
    has a lease as a run has, so the second exits 2 with the line a run's held lease gives, naming the
    supervisor that holds it; no traceback."""
    rc, err, holder = flow["rival"]
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err[-3000:]
    assert err.startswith("error: run `soup` is supervised by ") and f" pid {holder} (since " in err, err
    assert (
        "stop that supervisor first, or wait for its lease to expire (300 s after its last heartbeat)" in err
    )


def test_every_ingredient_finishes_once_and_the_soup_is_the_last_step(flow):
    root, second = flow["root"], flow["second"]
    assert second.returncode == 0, second.stderr
    assert flow["killed_at"][-1] >= 10
    for k in (1, 2, 3):
        run = root / f"soup-i{k}"
        assert _committed(run)[-1] == 20, k
        subs = [r for r in _journal(run) if r["event"] == "submitted"]
        assert len(subs) == (2 if k == 2 else 1), (k, subs)  # ingredient 1 never ran again
    assert "ingredient 1 of 3" not in second.stderr  # committed: skipped
    events = [r["event"] for r in _journal(root / "soup")]
    assert events.count("souped") == 1 and events[-1] == "souped"
    manifest = json.loads((root / "soup" / "soup" / "soup.json").read_text())
    assert [s["path"] for s in manifest["sources"]] == [
        str(root / f"soup-i{k}" / "checkpoints" / "20") for k in (1, 2, 3)
    ]
    again = invoke(
        "resume-until-done", "soup", "--backend", "local", "--run-root", str(root), env=flow["env"]
    )
    assert again.returncode == 0 and "souping" not in again.stderr  # nothing redone


def test_each_ingredient_trains_what_it_would_alone(flow, tmp_path):
    """Ingredient 2 (killed mid-way with its supervisor) against the same ingredient trained alone:
    warm-Adam from the same start, the recipe with its override, bit for bit."""
    alone = tmp_path / "alone"
    assert invoke("surgery", "warm-adam", flow["start"], str(alone), env=flow["env"]).returncode == 0
    train(alone, "--recipe", RECIPE, "--set", "ingredients=[]", "--set", "data.seed=2")
    got, want = scalars(flow["root"] / "soup-i2"), scalars(alone)
    assert same_steps(want, got, range(1, 21)) == []
    other = scalars(flow["root"] / "soup-i3")  # another data order trains other numbers
    assert same_steps(want, other, range(1, 21)) != []


def test_the_soup_is_the_mean_and_eval_reads_it(flow):
    from olmo_ctl.checkpoints.convert import load_orbax

    root = flow["root"]
    soup, _, _ = load_orbax(str(root / "soup" / "soup"))
    parts = [load_orbax(str(root / f"soup-i{k}" / "checkpoints" / "20"))[0] for k in (1, 2, 3)]
    w = np.float32(1 / 3)
    for path in (("embed",), ("blocks", "mlp", "w1")):
        acc = np.zeros_like(parts[0][path[0]] if len(path) == 1 else parts[0]["blocks"]["mlp"]["w1"])
        for p in parts:
            x = p[path[0]] if len(path) == 1 else p["blocks"]["mlp"]["w1"]
            acc += w * x.astype(np.float32)
        got = soup[path[0]] if len(path) == 1 else soup["blocks"]["mlp"]["w1"]
        assert np.array_equal(got, acc), path
    p = invoke(
        "eval",
        str(root / "soup" / "soup"),
        "--lm",
        "smoke_eval=builtin://smoke/eval/*.npy",
        "--device",
        "cpu-1",
        "-o",
        "json",
        env=flow["env"],
    )
    assert p.returncode == 0, p.stderr
    assert 0 < json.loads(p.stdout)["lm"]["smoke_eval"]["ce_loss"] < 6
    assert "at seq_len 128 " in p.stderr  # the ingredients' sequence length, read from soup.json's recipe
    manifest = json.loads((root / "soup" / "soup" / "soup.json").read_text())
    assert manifest["recipe"]["train"]["seq_len"] == 128
    m = json.loads(invoke("monitor", str(root / "soup"), "-o", "json", env=flow["env"]).stdout)
    assert "recipe" not in m["soup"]  # monitor's view of the soup stays what it averaged


def test_monitor_runs_and_stop_speak_of_the_whole(flow):
    root, env = flow["root"], flow["env"]
    m = invoke("monitor", str(root / "soup"), "-o", "json", env=env)
    assert m.returncode == 0, m.stderr
    rep = json.loads(m.stdout)
    assert rep["kind"] == "ingredients" and rep["state"] == "done"
    assert [(i["run"], i["step"], i["state"]) for i in rep["ingredients"]] == [
        (f"soup-i{k}", 20, "done") for k in (1, 2, 3)
    ]
    assert rep["soup"]["path"].endswith("/soup/soup")
    t = invoke("monitor", str(root / "soup"), env=env)
    assert "run of 3 ingredients (smoke-soup): done" in t.stdout and "data.seed=2" in t.stdout
    rows = json.loads(invoke("runs", "--run-root", str(root), "-o", "json", env=env).stdout)["runs"]
    whole = next(r for r in rows if r["name"] == "soup")
    assert (whole["step"], whole["final_step"], whole["state"]) == (60, 60, "done")
    s = invoke("stop", "soup", "--run-root", str(root), "--backend", "local", env=env)
    assert s.returncode == 0 and "nothing to stop" in s.stdout
    before = sorted(p.name for p in (root / "soup").iterdir())
    for cmd in ("resume-until-done", "submit"):  # a run of one recipe never lands in a run of ingredients
        x = invoke(
            cmd,
            "soup" if cmd != "submit" else "--run=soup",
            "--recipe",
            "smoke",
            "--device",
            "cpu-1",
            "--backend",
            "local",
            "--run-root",
            str(root),
            env=env,
        )
        assert x.returncode == 2 and "is a run of ingredients" in x.stderr, (cmd, x.stderr)
    assert sorted(p.name for p in (root / "soup").iterdir()) == before
    ms = invoke("monitor", str(root / "soup" / "soup"), env=env)  # the soup itself: what it averaged
    assert ms.returncode == 0 and "soup of 3 checkpoints of olmo3-smoke" in ms.stdout, ms.stderr
    assert ms.stdout.count("0.333333 x ") == 3
    lg = invoke("logs", "soup", "--run-root", str(root), "--backend", "local", env=env)
    assert lg.returncode == 2 and "is a run of ingredients (soup-i1, soup-i2, soup-i3)" in lg.stderr


def test_bad_input_writes_nothing(tmp_path, smoke_run):
    env = clean_env(tmp_path / "xdg")
    root = tmp_path / "runs"
    base = ("resume-until-done", "x", "--recipe", RECIPE, "--device", "cpu-1", "--backend", "local")
    base += ("--run-root", str(root))
    for extra, says in (
        (("--start-from", str(tmp_path / "nowhere" / "checkpoints" / "3")), "does not exist"),
        (("--start-from", str(smoke_run / "checkpoints" / "7")), "not a committed"),
    ):
        p = invoke(*base, *extra, env=env)
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert not root.exists() or not any(root.iterdir())
    p = invoke(
        "resume-until-done",
        "y",
        "--recipe",
        "smoke",
        "--device",
        "cpu-1",
        "--backend",
        "local",
        "--run-root",
        str(root),
        "--start-from",
        str(smoke_run / "checkpoints" / "40"),
        env=env,
    )
    assert p.returncode == 2 and "--start-from is for a recipe of ingredients" in p.stderr
    assert not root.exists() or not any(root.iterdir())


@pytest.mark.chaos
def test_ctrl_c_and_stop_then_resume_redo_nothing_committed(tmp_path, smoke_run):
    """Ctrl-C detaches (130) and leaves the ingredient's attempt running; `stop NAME` ends that
    attempt at a checkpoint and the supervisor of the whole with 130; a later resume-until-done
    finishes every ingredient and the soup, each ingredient still bit for bit its run alone."""
    root = tmp_path / "runs"
    env = {**clean_env(tmp_path / "xdg"), "OLMO_CTL_RETRY_BACKOFF_SECONDS": "0.2"}
    args = ("resume-until-done", "cc", "--recipe", RECIPE, "--device", "cpu-1", "--backend", "local")
    args += ("--run-root", str(root), "--start-from", str(smoke_run / "checkpoints" / "40"), "--poll", "0.5")
    p = spawn(*args, env=env)
    wait_for(lambda: 10 in _committed(root / "cc-i1"), 240, "ingredient 1's step 10")
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "resume-until-done cc --run-root" in err, err[-2000:]  # the whole
    bare = ("resume-until-done", "cc", "--backend", "local", "--run-root", str(root), "--poll", "0.5")
    q = spawn(*bare, env=env)
    wait_for(lambda: 10 in _committed(root / "cc-i2"), 240, "ingredient 2's step 10")
    s = invoke("stop", "cc", "--run-root", str(root), "--backend", "local", env=env)
    assert s.returncode == 0, s.stderr
    assert q.wait(timeout=120) == 130
    assert "stopped" in [r["event"] for r in _journal(root / "cc")]
    assert not (root / "cc-i3").exists()  # the stop came before ingredient 3 was started
    r = invoke(*bare, env=env)
    assert r.returncode == 0, r.stderr
    assert (root / "cc" / "soup" / "soup.json").exists()
    for k in (1, 2, 3):
        assert _committed(root / f"cc-i{k}")[-1] == 20
    assert len([x for x in _journal(root / "cc-i1") if x["event"] == "submitted"]) == 1


@pytest.mark.chaos
def test_concurrent_ingredients_train_side_by_side_and_detach_together(tmp_path, flow):
    """`--concurrent 2`: two ingredients train at once (the second is submitted before the first is
    done); Ctrl-C detaches both (130, one line for the whole); a bare resume-until-done keeps the
    width it was created with, trains the third and soups; every ingredient bit for bit as the
    one-after-another flow trained it."""
    root = tmp_path / "runs"
    env = {**clean_env(tmp_path / "xdg"), "OLMO_CTL_RETRY_BACKOFF_SECONDS": "0.2"}
    args = ("resume-until-done", "par", "--recipe", RECIPE, "--device", "cpu-1", "--backend", "local")
    args += ("--run-root", str(root), "--start-from", flow["start"], "--poll", "0.5", "--concurrent", "2")
    # The first two ingredients' steps are slowed (the fault knob: 0.7 s each, sleeping, no change to a
    # bit) so that the first is not done before the second reaches step 10, however fast the machine.
    p = spawn(*args, env={**env, "OLMO_CTL_FAULT_SLOW_DATA": "0:700"})
    try:
        wait_for(
            lambda: all(10 in _committed(root / f"par-i{k}") for k in (1, 2)),
            300,
            "step 10 of ingredients 1, 2",
        )
        assert not (root / "par-i3").exists()  # two at a time
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err[-3000:]
    assert "detached from 2 ingredient(s) of `par`" in err and "Traceback" not in err, err[-3000:]
    assert f"reattach with: olmo-ctl resume-until-done par --run-root {root} --backend local" in err
    for k in (1, 2):
        events = [r["event"] for r in _journal(root / f"par-i{k}")]
        assert "supervisor_detached" in events, (k, events)
    bare = ("resume-until-done", "par", "--backend", "local", "--run-root", str(root), "--poll", "0.5")
    r = invoke(*bare, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (root / "par" / "soup" / "soup.json").exists()
    assert "concurrent: 2" in (root / "par" / "ingredients.yaml").read_text()
    for k in (1, 2, 3):
        assert _committed(root / f"par-i{k}")[-1] == 20
        got, want = scalars(root / f"par-i{k}"), scalars(flow["root"] / f"soup-i{k}")
        assert same_steps(want, got, range(1, 21)) == [], k
    once = invoke(
        "resume-until-done",
        "x",
        "--recipe",
        "smoke",
        "--concurrent",
        "2",
        "--device",
        "cpu-1",
        "--backend",
        "local",
        "--run-root",
        str(root),
        env=env,
    )
    assert once.returncode == 2 and "--concurrent is for a recipe of ingredients" in once.stderr
    assert not (root / "x").exists()
