"""Learning-rate schedules as functions of the step: OLMo-core's formulas, no jax.

The n-th step (1-based; it produces checkpoint n) trains with `lr(n)`: OLMo-core increments its global
step before the scheduler sets the LR, so its step N also uses `get_lr(N)`. Each part is one of
OLMo-core's schedulers (`olmo_core/optim/scheduler.py`), with `peak` the optimizer's LR,
`eta_min = alpha * peak`, `W` the warmup and `T` the part's `t_max` (0 = `train.max_steps`):

* `cosine` (CosWithWarmup): n < W: peak * min(n, W) / W; n >= T: eta_min;
  else eta_min + (peak - eta_min) * (1 + cos(pi * (n - W) / (T - W))) / 2.
* `half_cosine` (HalfCosWithWarmup, the second half of a cosine): n < W: the linear warmup to
  eta_min + (peak - eta_min) / 2; n >= T: eta_min; else the cosine above at (n - W + T') / 2T'
  with T' = T - W.
* `linear` (LinearWithWarmup): n < W: warmup; n >= T: eta_min;
  else peak - (peak - eta_min) * (n - W) / (T - W).

A `stitched` schedule is a list of parts: part k sets the LR of every step up to and including its
`last_step` (the last part, `last_step` 0, runs to the end). AI2's stage 1 is two parts: its
pretrain-1 script (cosine over a 5T-token horizon) until the step-596,047 checkpoint it continued
from, then pretrain-2's half cosine over a 7T-token horizon.

`lr_at` evaluates in Python floats (what `olmo-ctl plan --lr-at` prints); `evaluate` takes the math
operations as an argument so the trainer runs the very same expression on jax scalars.
"""

from __future__ import annotations

import math
from typing import Any


class _PyOps:
    """Python-float operations (for the plan and tests)."""

    pi = math.pi
    cos = staticmethod(math.cos)
    minimum = staticmethod(min)

    @staticmethod
    def where(cond, a, b):
        return a if cond else b

    @staticmethod
    def num(x) -> float:
        return float(x)


def parts(sched) -> tuple:
    """The schedule's parts: its `parts` when stitched, else itself as one part."""
    return tuple(sched.parts) if sched.kind == "stitched" else (sched,)


def part_t_max(part, max_steps: int) -> int:
    return part.t_max or max_steps


def _part_lr(part, peak: float, max_steps: int, n, ops):
    t_max = part_t_max(part, max_steps)
    warm = part.warmup_steps
    eta_min = peak * part.alpha
    top = eta_min + (peak - eta_min) / 2 if part.kind == "half_cosine" else peak
    warm_lr = top * ops.minimum(n, ops.num(warm)) / warm if warm > 0 else ops.num(top)
    span = max(1, t_max - warm)  # static; a part never reaches its decay branch when t_max <= warmup
    cur = n - warm
    if part.kind == "linear":
        decay_lr = peak - (peak - eta_min) * (cur / span)
    else:
        total = span
        if part.kind == "half_cosine":
            cur = cur + span
            total = 2 * span
        decay_lr = eta_min + (peak - eta_min) * (1 + ops.cos(ops.pi * cur / total)) / 2
    return ops.where(n < warm, warm_lr, ops.where(n >= t_max, ops.num(eta_min), decay_lr))


def evaluate(sched, peak: float, max_steps: int, n, ops: Any = _PyOps):
    """LR of step n under `sched` (a ScheduleConfig) with the given math operations."""
    ps = parts(sched)
    lr = _part_lr(ps[-1], peak, max_steps, n, ops)
    for p in reversed(ps[:-1]):
        lr = ops.where(n <= p.last_step, _part_lr(p, peak, max_steps, n, ops), lr)
    return lr


def lr_at(recipe, step: int) -> float:
    """The LR the recipe's `step`-th step trains with (Python float, float64 arithmetic)."""
    return float(evaluate(recipe.schedule, recipe.optimizer.lr, recipe.train.max_steps, float(step)))


def lr_curve(recipe, points: int = 2000) -> tuple[list[int], list[float]]:
    """Steps 1..max_steps sampled (every part boundary and warmup end included) and their LRs."""
    T = recipe.train.max_steps
    stride = max(1, T // points)
    steps = set(range(1, T + 1, stride)) | {T}
    for p in parts(recipe.schedule):
        for s in (
            p.warmup_steps - 1,
            p.warmup_steps,
            getattr(p, "last_step", 0),
            getattr(p, "last_step", 0) + 1,
        ):
            if 1 <= s <= T:
                steps.add(s)
    xs = sorted(steps)
    return xs, [lr_at(recipe, s) for s in xs]


def parse_steps(text: str) -> list[int]:
    """`1,2000,596047` -> [1, 2000, 596047]; raises ValueError naming the bad item."""
    out = []
    for item in text.split(","):
        item = item.strip().replace("_", "")
        if not item:
            continue
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"`{item}` is not a step number (steps are 1-based integers)")
        out.append(int(item))
    if not out:
        raise ValueError("no step given")
    return out
