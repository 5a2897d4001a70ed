"""`olmo-ctl amend`: a run's horizon, intervals, evaluation and logging changed from its next attempt on,
the schedule continued to the new horizon (docs/runs-logs-stop.md#amending-a-run), everything that makes
it another run refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers.cli import clean_env, invoke, spawn
from helpers.runs import copy_run
from helpers.trainer import scalars
from helpers.waiting import wait_for

from olmo_ctl.core import amend, schedule
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.rundir import RunDir

LR = "optim/LR (group 0)"
PEAK, ETA_MIN = 3e-3, 3e-4  # the smoke recipe's optimizer.lr and alpha * lr


def cosine(n: float, start: float, horizon: float) -> float:
    """The docs' continuation: eta_min + (peak - eta_min) (1 + cos(pi (n - a) / (T2 - a))) / 2."""
    return ETA_MIN + (PEAK - ETA_MIN) * (1 + math.cos(math.pi * (n - start) / (horizon - start))) / 2


@pytest.fixture
def env(tmp_path):
    return clean_env(tmp_path / "xdg")


def new_run(root: Path, name: str, overrides=("train.max_steps=40",)) -> RunDir:
    rd = RunDir.of(str(root), name)
    r = load_recipe("smoke", overrides=list(overrides))
    rd.create_run(r.to_dict(), r.fingerprint(), "fp", "cpu-1")
    return rd


# ---------------------------------------------------------------- the schedule continued (pure)


def test_the_continuation_keeps_every_trained_step_and_the_point_of_the_decay():
    r = load_recipe("smoke", overrides=["train.max_steps=40"])  # cosine, warmup 10, over 40 steps
    values = amend.bind(r, amend.changes(r, ["train.max_steps=60"], 20), from_step=21)
    parts = values["schedule"]["parts"]
    assert parts[0] == {"kind": "cosine", "warmup_steps": 10, "alpha": 0.1, "t_max": 40, "last_step": 20}
    # u = (20 - 10) / (40 - 10) = 1/3 at step 20; a = (20 - 60/3) / (2/3) = 0
    assert parts[1]["kind"] == "cosine" and parts[1]["decay_from"] == pytest.approx(0.0, abs=1e-12)
    amended = amend.apply(r, values)
    for n in range(1, 21):
        assert schedule.lr_at(amended, n) == schedule.lr_at(r, n)
    for n in (21, 30, 45, 59, 60):
        assert schedule.lr_at(amended, n) == pytest.approx(cosine(n, 0.0, 60), rel=1e-12)
    assert schedule.lr_at(amended, 20) == pytest.approx(2.325e-3, rel=1e-12)


def test_at_the_middle_of_the_decay_the_continuation_is_ai2s_half_cosine():
    """AI2's pretrain-2: HalfCosWithWarmup(warmup = the middle of pretrain-1's decay), t_max = 7T steps."""
    r = load_recipe("olmo3-7b-stage1-cosine", overrides=["train.max_steps=1192093"])  # the 5T horizon
    middle = (1192093 + 2000) // 2  # u = 1/2 there (an integer here: 597,046.5 rounds down, u ~ 1/2)
    amended = amend.apply(
        r, amend.bind(r, [{"key": "train.max_steps", "old": 1192093, "new": 1668931}], middle + 1)
    )
    half = load_recipe(
        "olmo3-7b-stage1-cosine",
        overrides=[
            "train.max_steps=1668931",
            "schedule.kind=half_cosine",
            f"schedule.warmup_steps={middle}",
        ],
    )
    for n in (middle + 1, 700000, 1000000, 1413814, 1668930):
        assert schedule.lr_at(amended, n) == pytest.approx(schedule.lr_at(half, n), rel=2e-6)


def test_the_7b_example_of_the_docs():
    """docs/runs-logs-stop.md: the 5T-horizon cosine extended to 7T from the step-596,047 checkpoint."""
    r = load_recipe("olmo3-7b-stage1-cosine", overrides=["train.max_steps=1192093"])
    change = amend.changes(r, ["train.max_steps=1668931"], 596047)
    values = amend.bind(r, change, 596048)
    amended = amend.apply(r, values)
    assert values["schedule"]["parts"][1]["decay_from"] == pytest.approx(-473238.796, abs=1e-3)
    want = {596047: 1.6536e-4, 596048: 1.6536e-4, 1000000: 8.9916e-5, 1413814: 3.9339e-5, 1668931: 3.0e-5}
    for n, lr in want.items():
        assert schedule.lr_at(amended, n) == pytest.approx(lr, rel=1e-4), n
    ai2 = load_recipe("olmo3-7b-stage1")  # AI2's own stitch ends 0.04% away from it
    assert schedule.lr_at(amended, 1413814) == pytest.approx(schedule.lr_at(ai2, 1413814), rel=1e-3)


def test_the_trainer_runs_the_continuation_in_fp32_as_the_docs_state():
    import jax

    from olmo_ctl.trainer import optim

    r = load_recipe("olmo3-7b-stage1-cosine", overrides=["train.max_steps=1192093"])
    amended = amend.apply(r, amend.bind(r, amend.changes(r, ["train.max_steps=1668931"], 596047), 596048))
    s = load_recipe("smoke", overrides=["train.max_steps=40"])
    smoke = amend.apply(s, amend.bind(s, amend.changes(s, ["train.max_steps=60"], 20), 21))
    for rec, steps in ((amended, (596047, 596048, 1000000, 1413814)), (smoke, (20, 21, 45, 60))):
        f = jax.jit(lambda n, r=rec: optim.learning_rate(r.schedule, r.optimizer.lr, r.train.max_steps, n))
        for n in steps:
            assert float(f(n)) == pytest.approx(schedule.lr_at(rec, n), rel=2e-6), n


def test_a_horizon_of_its_own_a_warmup_or_a_reached_horizon_keep_the_schedule():
    r = load_recipe("smoke", overrides=["train.max_steps=40", "schedule.t_max=40"])
    assert amend.bind(r, [{"key": "train.max_steps", "old": 40, "new": 60}], 21) == {"train.max_steps": 60}
    r = load_recipe("smoke", overrides=["train.max_steps=40"])
    assert "schedule" not in amend.bind(r, [{"key": "train.max_steps", "old": 40, "new": 60}], 6)  # warmup
    ai2 = load_recipe("olmo3-7b-stage1")  # part 2 has its own horizon (7T): only part 1 is written out
    assert "schedule" not in amend.bind(
        ai2, [{"key": "train.max_steps", "old": 1413814, "new": 1500000}], 900000
    )


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "sets,says",
    [
        (["model.d_model=64"], "`model.d_model` is the network"),
        (["data.seed=7"], "new run"),
        (["train.seed=7"], "the run's seed"),
        (["train.global_batch=16"], "olmo-ctl resize"),
        (["train.mesh=hybrid"], "olmo-ctl resize"),
        (["optimizer.lr=1e-3"], "new run"),
        (["schedule.alpha=0.2"], "continues to the new horizon"),
        (["train.max_steps=20"], "committed step 20"),
        (["train.max_steps=40"], "already has train.max_steps = 40"),
        (["eval.interval=0"], "eval.interval"),
        (["train.max_stepz=60"], "unknown key"),
        (["train.max_steps=100000000000000000000000"], "must be at most 2,147,483,647"),  # 10^23 steps
        (["eval.interval=5", "eval.interval=6"], "--set eval.interval is given twice"),
        (["nonsense"], "not key.sub=value"),
        ([], "at least one --set"),
    ],
)
def test_a_refused_amendment_is_one_line_exit_2_and_changes_nothing(tmp_path, env, sets, says):
    rd = new_run(tmp_path / "runs", "r")
    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "20"
    ckpt.mkdir(parents=True)
    (ckpt / "commit_success.txt").write_text("")
    before = {p.name: p.read_bytes() for p in Path(rd.path).iterdir() if p.is_file()}
    args = [a for s in sets for a in ("--set", s)]
    p = invoke("amend", "r", "--run-root", str(tmp_path / "runs"), "--backend", "local", *args, env=env)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert says in p.stderr, p.stderr
    assert {p.name: p.read_bytes() for p in Path(rd.path).iterdir() if p.is_file()} == before


def test_a_run_without_amendments_reads_as_before(tmp_path):
    rd = new_run(tmp_path / "runs", "r")
    doc = rd.read_run()
    assert "amendments" not in doc
    assert rd.recipe().fingerprint() == doc["recipe_fingerprint"] == rd.recipe(pending=True).fingerprint()
    assert "decay_from" not in json.dumps(load_recipe("olmo3-7b-stage1").to_dict())


# ---------------------------------------------------------------- recorded, bound, shown


def test_recorded_pending_then_bound_by_the_next_attempt_and_shown_by_monitor(tmp_path, env):
    root = tmp_path / "runs"
    rd = new_run(root, "r")
    ckpt = root / "r" / "checkpoints" / "20"
    ckpt.mkdir(parents=True)
    (ckpt / "commit_success.txt").write_text("")
    args = ("--run-root", str(root), "--backend", "local")
    p = invoke(
        "amend", "r", "--set", "train.max_steps=60", "--set", "eval.interval=10", *args, "-o", "json", env=env
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert (out["action"], out["committed_step"], out["final_step"], out["from_step"]) == (
        "pending",
        20,
        60,
        None,
    )
    assert rd.recipe().train.max_steps == 40  # what an attempt trains until the next one takes it up
    assert rd.recipe(pending=True).train.max_steps == 60
    rep = json.loads(invoke("monitor", str(rd.path), "-o", "json", env=env).stdout)
    assert rep["final_step"] == 60 and rep["amendments"][0]["from_step"] is None

    (bound,) = rd.bind_amendments(attempt=2)  # what submit_next does before it sends the next attempt
    assert (bound["from_step"], bound["attempt"]) == (21, 2)
    assert rd.bind_amendments(attempt=3) == []  # bound once
    r = rd.recipe()
    assert (r.train.max_steps, r.eval.interval) == (60, 10)
    assert schedule.lr_at(r, 40) == pytest.approx(cosine(40, 0.0, 60), rel=1e-12)
    rd.check_matches(r.fingerprint(), None, r)  # the amended recipe is the run's own
    rd.check_matches(load_recipe("smoke", overrides=["train.max_steps=40"]).fingerprint(), None)
    events = [(e["event"], e.get("from_step")) for e in rd.journal()]
    assert events == [("amended", None), ("amendment_applied", 21)]
    text = invoke("monitor", str(rd.path), env=env).stdout
    assert "amended train.max_steps 40 -> 60, eval.interval 20 -> 10: from step 21 (attempt 2)" in " ".join(
        text.replace("│", " ").split()
    )


# ---------------------------------------------------------------- a real run to its new final step


def test_a_finished_run_extended_resumes_to_the_new_final_step_with_the_stitched_lr(tmp_path, smoke_run, env):
    """The session's smoke run (the smoke recipe, max_steps 100, stopped at 40) extended to 140 from
    step 41: u = (40 - 10) / 90 = 1/3, a = (40 - 140/3) / (2/3) = -10."""
    root = tmp_path / "runs"
    run_dir = copy_run(smoke_run, root / "ext")
    r = load_recipe("smoke")
    RunDir(str(run_dir)).create_run(r.to_dict(), r.fingerprint(), "fp", "cpu-1", adopt=True)
    before = scalars(run_dir)[LR]
    args = ("--run-root", str(root), "--backend", "local")
    sets = ("train.max_steps=140", "eval.interval=1000", "checkpoint.interval=1000")  # only the final one
    assert invoke("amend", "ext", *(a for s in sets for a in ("--set", s)), *args, env=env).returncode == 0
    env = {**env, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    p = invoke("resume-until-done", "ext", *args, "--poll", "0.2", env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rd = RunDir(str(run_dir))
    assert rd.committed_step() == 140
    lr = scalars(run_dir)[LR]
    assert max(lr) == 140 and all(lr[n] == before[n] for n in before)
    for n in (41, 50, 80, 120, 140):
        assert lr[n] == pytest.approx(cosine(n, -10.0, 140), rel=2e-6), n
    assert lr[40] == pytest.approx(cosine(40, -10.0, 140), rel=2e-6)  # continuous at the stitch
    (a,) = rd.amendments()
    assert (a["from_step"], a["attempt"]) == (41, 1)


@pytest.mark.chaos
def test_amend_restart_extends_a_live_run_mid_flight_to_the_new_final_step(tmp_path, env):
    """A supervised run (40 steps, checkpoints every 20) amended to 60 while it trains: its supervisor
    stops it once checkpoint 20 has committed, the next attempt trains on to 60 with the continued
    cosine."""
    root = tmp_path / "runs"
    env = {**env, "JAX_PLATFORMS": "cpu", "OLMO_CTL_FAULT_SLOW_DATA": "0:250"}
    env.pop("XLA_FLAGS", None)
    args = ("--run-root", str(root), "--backend", "local")
    sup = spawn(
        "resume-until-done", "--recipe", "smoke", "--set", "train.max_steps=40", "--device", "cpu-1",
        "--run", "live", *args, "--poll", "0.2", env=env,
    )  # fmt: skip
    rd = RunDir.of(str(root), "live")
    try:
        wait_for(lambda: _logged(root / "live") >= 1, 120, "attempt 1's first step")
        assert rd.committed_step() < 20
        p = invoke("amend", "live", "--set", "train.max_steps=60", "--restart", *args, env=env)
        assert p.returncode == 0, p.stderr
        assert "recorded" in p.stderr + p.stdout
        out, err = sup.communicate(timeout=300)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sup.returncode == 0, out[-3000:] + err[-3000:]
    assert rd.committed_step() == 60
    (a,) = rd.amendments()
    # Stopped once checkpoint 20 committed: SIGTERM, and the trainer checkpoints the step it is at, S.
    last = a["from_step"] - 1
    assert last >= 20 and a["attempt"] == 2
    events = [e["event"] for e in rd.journal()]
    assert "restart_requested" in events and "restarted" in events and "failed" not in events
    lr = scalars(root / "live")[LR]
    u = (last - 10) / 30  # the 40-step cosine's point of the decay at S
    start = (last - u * 60) / (1 - u)
    for n in range(1, last + 1):  # as the 40-step recipe set them
        assert lr[n] == pytest.approx(
            schedule.lr_at(load_recipe("smoke", overrides=["train.max_steps=40"]), n)
        )
    for n in (last, last + 1, 45, 59, 60):
        assert lr[n] == pytest.approx(cosine(n, start, 60), rel=2e-6), n
    assert max(lr) == 60


def _logged(run_dir: Path) -> int:
    """The last `step N/M` line attempt 1 printed (0 before its first step)."""
    try:
        lines = (run_dir / "logs" / "attempt-1.log").read_text(errors="replace").splitlines()
    except OSError:
        return 0
    steps = [
        int(ln.split()[1].split("/")[0]) for ln in lines if ln.startswith("step ") and "/" in ln.split()[1]
    ]
    return max(steps, default=0)


@pytest.mark.chaos
def test_amend_restart_without_a_supervisor_stops_the_attempt_and_submits_the_next(tmp_path, env):
    """`submit` alone, no supervisor: `amend --restart` waits for checkpoint 20, stops the attempt,
    submits the next one, which trains on to the new final step; a supervisor started later finishes it."""
    root = tmp_path / "runs"
    env = {**env, "JAX_PLATFORMS": "cpu", "OLMO_CTL_FAULT_SLOW_DATA": "0:250"}
    env.pop("XLA_FLAGS", None)
    args = ("--run-root", str(root), "--backend", "local")
    p = invoke(
        "submit", "--recipe", "smoke", "--set", "train.max_steps=40", "--device", "cpu-1", "--run", "bare",
        *args, "--no-preflight", env=env,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    rd = RunDir.of(str(root), "bare")
    wait_for(lambda: _logged(root / "bare") >= 1, 120, "attempt 1's first step")
    assert rd.committed_step() < 20
    p = invoke("amend", "bare", "--set", "train.max_steps=60", "--restart", *args, "-o", "json", env=env)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert (out["action"], out["live_attempt"], out["attempt"], out["final_step"]) == ("restarted", 1, 2, 60)
    last = out["from_step"] - 1
    assert last == out["committed_step"] >= 20
    p = invoke("resume-until-done", "bare", *args, "--poll", "0.2", env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert rd.committed_step() == 60
    assert [e["attempt"] for e in rd.journal() if e["event"] == "submitted"] == [1, 2]
    u = (last - 10) / 30
    lr = scalars(root / "bare")[LR]
    for n in (last + 1, 50, 60):
        assert lr[n] == pytest.approx(cosine(n, (last - u * 60) / (1 - u), 60), rel=2e-6), n


@pytest.mark.chaos
def test_without_restart_the_live_attempt_ends_at_its_final_step_and_the_next_goes_on(tmp_path, env):
    """Amended while attempt 1 trains, no --restart: attempt 1 ends at its old final step 20 (not a
    failure), attempt 2 trains 21..30; the 20-step cosine had reached its horizon, so they train at
    eta_min."""
    root = tmp_path / "runs"
    env = {**env, "JAX_PLATFORMS": "cpu", "OLMO_CTL_FAULT_SLOW_DATA": "0:250"}
    env.pop("XLA_FLAGS", None)
    args = ("--run-root", str(root), "--backend", "local")
    sup = spawn(
        "resume-until-done", "--recipe", "smoke", "--set", "train.max_steps=20", "--device", "cpu-1",
        "--run", "on", *args, "--poll", "0.2", env=env,
    )  # fmt: skip
    rd = RunDir.of(str(root), "on")
    try:
        wait_for(lambda: _logged(root / "on") >= 1, 120, "attempt 1's first step")
        p = invoke("amend", "on", "--set", "train.max_steps=30", *args, env=env)
        assert p.returncode == 0 and "goes on as it started" in p.stderr, p.stderr
        out, err = sup.communicate(timeout=300)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sup.returncode == 0, out[-3000:] + err[-3000:]
    assert rd.committed_step() == 30
    (a,) = rd.amendments()
    assert (a["from_step"], a["attempt"]) == (21, 2)
    events = [e["event"] for e in rd.journal()]
    assert "restarted" in events and "failed" not in events and "backoff" not in events
    lr = scalars(root / "on")[LR]
    assert all(lr[n] == pytest.approx(ETA_MIN, rel=2e-6) for n in range(21, 31))
