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

A part with `decay_from: a` (kind cosine or linear, no warmup) decays from the real step `a` instead
of its warmup's end: the cosine or the line at (n - a) / (T - a). `continue_horizon` writes one when an
amended `train.max_steps` moves the horizon of a part that is decaying (`olmo-ctl amend`): the part
keeps its own horizon through the last step already trained, S, and from S + 1 a continuation takes over
at the same point of the decay, u = (S - W) / (T - W) (the half cosine's: (S - W + T') / 2T'), now
stretched to the new horizon T2: a = (S - u * T2) / (1 - u), so that (S - a) / (T2 - a) = u. AI2's
extension of OLMo 3 7B is this rule taken at the middle of the decay: from u = 1/2 the continuation is
the half cosine of pretrain-2 (warmup S, t_max T2).

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


def decay_start(part) -> float:
    """The step the part's decay starts from: its warmup's end, or its `decay_from` (a continuation)."""
    start = getattr(part, "decay_from", None)
    return part.warmup_steps if start is None else start


def _part_lr(part, peak: float, max_steps: int, n, ops):
    t_max = part_t_max(part, max_steps)
    warm = part.warmup_steps
    eta_min = peak * part.alpha
    top = eta_min + (peak - eta_min) / 2 if part.kind == "half_cosine" else peak
    warm_lr = top * ops.minimum(n, ops.num(warm)) / warm if warm > 0 else ops.num(top)
    start = decay_start(part)
    span = max(1, t_max - start)  # static; a part never reaches its decay branch when t_max <= warmup
    cur = n - start
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


def phase(part, max_steps: int, n: int) -> float | None:
    """Where step n is on the part's decay: 0 at its start, 1 from its horizon on; None in its warmup."""
    t_max = part_t_max(part, max_steps)
    if n < part.warmup_steps:
        return None
    if n >= t_max:
        return 1.0
    if part.kind == "half_cosine":  # the second half of a cosine over 2T'
        span = max(1, t_max - part.warmup_steps)
        return (n - part.warmup_steps + span) / (2 * span)
    start = decay_start(part)
    return (n - start) / max(1, t_max - start)


def _part_dict(p) -> dict:
    d = {
        "kind": p.kind,
        "warmup_steps": p.warmup_steps,
        "alpha": p.alpha,
        "t_max": p.t_max,
        "last_step": getattr(p, "last_step", 0),
    }
    if getattr(p, "decay_from", None) is not None:
        d["decay_from"] = p.decay_from
    return d


def continue_horizon(sched, max_steps: int, new_max_steps: int, step: int) -> dict | None:
    """The schedule (a plain `schedule:` mapping) of a run whose `train.max_steps` goes from `max_steps`
    to `new_max_steps` once steps 1..`step` have been trained; None when the schedule stays as it is.

    Every step up to `step` keeps its LR: parts that depend on `train.max_steps` (t_max 0) get it
    written out. The part that sets step `step` + 1, when it is decaying towards `train.max_steps`,
    ends at `step` and its continuation (module docstring) follows the new horizon. A part in its warmup,
    one with its own t_max, one not begun, or one past its horizon (at its final LR) stays as it is."""
    ps = parts(sched)
    out: list[dict] = []
    prev_last = 0
    changed = False
    for i, p in enumerate(ps):
        d = _part_dict(p)
        last = d["last_step"]
        if last and last <= step:  # wholly trained: its LRs stay
            changed |= not d["t_max"]
            out.append({**d, "t_max": d["t_max"] or max_steps})
            prev_last = last
            continue
        u = phase(p, max_steps, step)
        if step <= prev_last or d["t_max"] or u is None:
            out += [_part_dict(q) for q in ps[i:]]  # not begun, its own horizon, or warming up
            break
        changed = True
        if u >= 1:  # past its horizon: it stays at its final LR
            out.append({**d, "t_max": max_steps})
            out += [_part_dict(q) for q in ps[i + 1 :]]
            break
        out.append({**d, "t_max": max_steps, "last_step": step})
        out.append(
            {
                "kind": "linear" if d["kind"] == "linear" else "cosine",
                "warmup_steps": 0,
                "alpha": d["alpha"],
                "t_max": 0,
                "last_step": last,
                "decay_from": (step - u * new_max_steps) / (1 - u),
            }
        )
        out += [_part_dict(q) for q in ps[i + 1 :]]
        break
    if not changed:
        return None
    return {
        "kind": "stitched",
        "warmup_steps": sched.warmup_steps,
        "alpha": sched.alpha,
        "t_max": sched.t_max,
        "parts": out,
    }


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
