"""Learning-rate schedules: AI2's stitched stage-1 schedule, recomputed here from OLMo-core's formulas,
`plan --lr-at` / `--plot-lr`, the trainer's jax LR equal to the plan's, and schedule validation."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from olmo_ctl.core import schedule
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
STEPS = (1, 2, 1999, 2000, 2001, 300000, 596047, 596048, 597045, 597046, 597047, 1000000, 1413814)


def ai2_stage1_lr(n: int) -> float:
    """OLMo 3 7B stage 1 as OLMo-core ran it, written out from its scripts and scheduler classes.

    pretrain-1: CosWithWarmup(warmup=2000, alpha_f=0.1), t_max = ceil(5e12 / 4194304) (the trainer's
    max_steps for a token duration); the run continued from the step-596,047 checkpoint.
    pretrain-2: HalfCosWithWarmup(warmup = (5e12 // 4194304) // 2 + 2000 // 2), t_max = ceil(7e12 /
    4194304). The trainer increments its step before setting the LR: step n trains with get_lr(n).
    """
    peak, alpha_f, tokens_per_step = 3e-4, 0.1, 8192 * 512
    eta_min = peak * alpha_f
    if n <= 596047:
        warmup, t_max = 2000, math.ceil(5e12 / tokens_per_step)
        if n < warmup:
            return peak * min(n, warmup) / warmup
        if n >= t_max:
            return eta_min
        return eta_min + (peak - eta_min) * (1 + math.cos(math.pi * (n - warmup) / (t_max - warmup))) / 2
    warmup, t_max = int(5e12) // tokens_per_step // 2 + 2000 // 2, math.ceil(7e12 / tokens_per_step)
    if n < warmup:
        max_lr = eta_min + (peak - eta_min) / 2
        return max_lr * min(n, warmup) / warmup
    if n >= t_max:
        return eta_min
    current, total = (n - warmup) + (t_max - warmup), 2 * (t_max - warmup)
    return eta_min + (peak - eta_min) * (1 + math.cos(math.pi * current / total)) / 2


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    return subprocess.run(
        [sys.executable, "-m", "olmo_ctl", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def test_the_formula_constants_are_the_issue_s():
    assert math.ceil(5e12 / 4194304) == 1192093 and math.ceil(7e12 / 4194304) == 1668931
    assert int(5e12) // 4194304 // 2 + 2000 // 2 == 597046
    assert ai2_stage1_lr(1413814) == pytest.approx(3.93e-5, rel=1e-3)  # AI2's final LR


def test_plan_lr_at_gives_olmo_core_values():
    p = cli(
        "plan",
        "--stage",
        "1",
        "--device",
        "tpu7x-128",
        "--lr-at",
        "1,2000,596047,596048,597046,1413814",
        "-o",
        "json",
    )
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)["lr_at"]
    assert list(got) == ["1", "2000", "596047", "596048", "597046", "1413814"]
    for s, lr in got.items():
        assert lr == pytest.approx(ai2_stage1_lr(int(s)), rel=1e-9), s
    # Part 2's warmup branch applies on the 998 steps 596,048..597,045: below the part-1 value.
    assert got["596048"] < got["596047"] and got["596048"] < got["597046"]


def test_stage1_schedule_at_many_steps():
    r = load_recipe(stage=1)
    for n in STEPS:
        assert schedule.lr_at(r, n) == pytest.approx(ai2_stage1_lr(n), rel=1e-12), n
    # The case study's single cosine stays available as its own recipe, and differs where the issue says.
    c = load_recipe("olmo3-7b-stage1-cosine")
    assert (c.schedule.kind, c.schedule.warmup_steps, c.schedule.alpha, c.schedule.t_max) == (
        "cosine",
        2000,
        0.1,
        0,
    )
    assert schedule.lr_at(c, 1413814) == pytest.approx(3e-5, rel=1e-12)
    # The issue's numbers: the single cosine runs 20% higher near the stitch, 24% lower at the end.
    assert schedule.lr_at(c, 597000) / schedule.lr_at(r, 597000) == pytest.approx(1.2, abs=0.001)
    assert schedule.lr_at(c, 1413814) / schedule.lr_at(r, 1413814) == pytest.approx(3.0 / 3.9325, abs=0.001)
    assert {k: v for k, v in c.to_dict().items() if k not in ("name", "description", "schedule")} == {
        k: v for k, v in r.to_dict().items() if k not in ("name", "description", "schedule")
    }


def test_stage2_and_stage3_are_linear_with_warmup():
    r2, r3 = load_recipe(stage=2), load_recipe(stage=3)
    peak = 2.0712352850360292e-4
    assert schedule.lr_at(r2, 1) == pytest.approx(peak * (1 - 1 / 47684), rel=1e-12)
    assert schedule.lr_at(r2, 47684) == 0.0
    assert schedule.lr_at(r3, 100) == pytest.approx(peak * 100 / 200, rel=1e-12)
    assert schedule.lr_at(r3, 200) == pytest.approx(peak, rel=1e-12)
    assert schedule.lr_at(r3, 6060) == pytest.approx(peak - peak * (6060 - 200) / (11921 - 200), rel=1e-12)
    assert schedule.lr_at(r3, 11921) == 0.0


def test_trainer_lr_is_the_plan_lr_in_fp32():
    import jax

    from olmo_ctl.trainer import optim

    for name in ("olmo3-7b-stage1", "olmo3-7b-stage1-cosine", "olmo3-7b-stage3"):
        r = load_recipe(name)
        f = jax.jit(lambda n, r=r: optim.learning_rate(r.schedule, r.optimizer.lr, r.train.max_steps, n))
        for n in STEPS:
            if n <= r.train.max_steps:
                want = schedule.lr_at(r, n)
                assert float(f(n)) == pytest.approx(want, rel=2e-6, abs=1e-12), (name, n)


def test_plot_lr_writes_a_png(tmp_path):
    out = tmp_path / "lr.png"
    p = cli("plan", "--stage", "1", "--device", "tpu7x-128", "--plot-lr", str(out))
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "learning-rate curve written" in p.stdout
    xs, ys = schedule.lr_curve(load_recipe(stage=1))
    assert xs[0] == 1 and xs[-1] == 1413814 and {596047, 596048, 597046} <= set(xs)
    assert max(ys) == pytest.approx(3e-4, rel=1e-12)


def test_lr_at_refusals_exit_2(tmp_path):
    p = cli("plan", "--stage", "1", "--device", "tpu7x-128", "--lr-at", "1,x")
    assert p.returncode == 2 and "--lr-at" in p.stderr and "`x`" in p.stderr
    p = cli("plan", "--stage", "1", "--device", "tpu7x-128", "--lr-at", "0")
    assert p.returncode == 2
    p = cli("plan", "--stage", "1", "--device", "tpu7x-128", "--plot-lr", str(tmp_path / "lr.jpg"))
    assert p.returncode == 2 and ".png" in p.stderr
    assert not (tmp_path / "lr.jpg").exists()


def test_stitched_schedule_validation():
    with pytest.raises(BadInput, match=r"schedule.parts\[1\].last_step"):
        load_recipe(
            stage=1,
            overrides=["schedule.parts=[{kind: cosine, last_step: 10}, {kind: linear, last_step: 5}]"],
        )
    with pytest.raises(BadInput, match=r"schedule.parts\[0\].last_step"):
        load_recipe(stage=1, overrides=["schedule.parts=[{kind: cosine, last_step: 0}, {kind: linear}]"])
    with pytest.raises(BadInput, match="schedule.parts"):
        load_recipe(stage=1, overrides=["schedule.kind=cosine"])  # leftover parts are refused...
    r = load_recipe(stage=1, overrides=["schedule.kind=cosine", "schedule.parts=[]"])  # ...unless cleared
    assert schedule.lr_at(r, 1413814) == pytest.approx(3e-5)
    with pytest.raises(BadInput, match=r"schedule.parts\[1\].warmup_steps"):
        load_recipe(
            stage=1, overrides=["schedule.parts=[{kind: cosine, last_step: 10}, {warmup_steps: 2000000}]"]
        )
    with pytest.raises(BadInput, match="schedule.warmup_steps"):
        load_recipe("olmo3-7b-stage1-cosine", overrides=["train.max_steps=100"])  # warmup 2000 >= 100 steps
