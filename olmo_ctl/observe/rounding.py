"""Rounding across a change of device layout: how far two values of one step may differ and still be
the same training up to rounding.

Another device layout (another device count, slice count or per-device batch) regroups the sums a
step makes across devices, the loss and the gradients, and so changes their last bits: by design, not
a divergence. On one layout the trainer is bitwise deterministic, so there every difference is one.
Across a layout change, values a and b of one step are equal up to layout rounding while

    |a - b| <= k * eps * sqrt(n) * max(|a|, |b|)

- eps: the machine epsilon of the dtype those sums round to: float32 (the trainer sums the loss and
  accumulates gradients in float32), bfloat16 where the recipe keeps its parameters in bfloat16 (each
  update rounds there);
- k = log2(tokens per step): a step's loss and gradients are means over its tokens, reduced by a tree
  of that depth whose every level rounds once (the classic bound for a pairwise sum, Higham,
  "Accuracy and Stability of Numerical Algorithms", 4.2); a layout regroups that tree;
- n: the steps since the layouts parted (1 on the first step computed on the other layout): each
  step's rounding of the state adds up as a random walk.

Training can amplify a rounding difference beyond this bound (an unstable phase, a loss spike); a
value beyond it is reported as a divergence, with the bound, whatever its cause. `compare` and the
monitor's replay check both judge by `RoundingModel`; a run directory's layouts come from its journal
(`rundir.attempt_targets`). docs/monitoring-and-compare.md explains it for users.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# float32 and bfloat16: the gap between 1 and the next representable number.
EPS = {"float32": float(np.finfo(np.float32).eps), "bfloat16": 2.0**-7}
FORMULA = "k * eps * sqrt(n) * max(|a|, |b|)"


@dataclass(frozen=True)
class RoundingModel:
    """The layout-rounding bound of one run's recipe (see the module docstring)."""

    dtype: str  # the dtype the layout-dependent sums round to
    eps: float
    k: float  # log2(tokens per step)
    tokens_per_step: int

    def tolerance(self, a, b, n):
        """The largest |a - b| that is layout rounding, `n` steps after the layouts parted (0 where
        n < 1: the same layout, bitwise)."""
        a, b, n = np.asarray(a, float), np.asarray(b, float), np.asarray(n, float)
        scale = np.fmax(np.abs(a), np.abs(b))
        tol = self.k * self.eps * np.sqrt(np.maximum(n, 0.0)) * np.where(np.isfinite(scale), scale, 0.0)
        return np.where(n >= 1, tol, 0.0)

    def to_dict(self) -> dict:
        return {
            "formula": FORMULA,
            "dtype": self.dtype,
            "eps": self.eps,
            "k": self.k,
            "tokens_per_step": self.tokens_per_step,
        }


def rounding_model(recipe) -> RoundingModel | None:
    """The bound of a run of `recipe` (a core.recipe.Recipe); None without one."""
    if recipe is None:
        return None
    try:
        tokens = int(recipe.train.global_batch) * int(recipe.train.seq_len)
        dtype = "bfloat16" if recipe.model.param_dtype == "bfloat16" else "float32"
    except (AttributeError, TypeError, ValueError):
        return None
    if tokens < 2:
        return None
    return RoundingModel(dtype, EPS[dtype], math.log2(tokens), tokens)


def layout_of_attempts(journal: list | None, run_doc: dict | None) -> Callable[[int], str | None]:
    """attempt -> its device layout as a person reads it (`cpu-2`, `2 x v5p-256`), from the run
    directory's record of its target; None where nothing names one."""
    from olmo_ctl.rundir import attempt_targets

    target_of = attempt_targets(journal, run_doc)

    def of(attempt: int) -> str | None:
        t = target_of(int(attempt))
        return None if t is None else t.on

    return of


def step_layouts(attempts: np.ndarray, layout_of: Callable[[int], str | None] | None) -> list[str | None]:
    """The layout that computed each point of a series (`Series.attempts`: the attempt of each)."""
    if layout_of is None:
        return [None] * len(attempts)
    cache: dict[int, str | None] = {}
    out = []
    for a in attempts.tolist():
        if a not in cache:
            cache[a] = layout_of(a)
        out.append(cache[a])
    return out


def replay_bounds(
    mismatches,
    first_step: Callable[[str, int], int | None],
    layout_of: Callable[[int], str | None],
    model: RoundingModel | None,
) -> list[float | None]:
    """For each replayed value that differs (`series.Mismatch`): the layout-rounding bound it is within,
    or None where it is not rounding (one layout or an unknown one: bitwise; or beyond the bound).
    The later attempt restored the state the earlier one had before its first step (`first_step(tag,
    attempt)`): the layouts parted there, so step s is n = s - first + 1 steps after."""
    out: list[float | None] = []
    for m in mismatches:
        before, after = layout_of(m.earlier_attempt), layout_of(m.later_attempt)
        first = first_step(m.tag, m.later_attempt)
        if model is None or before is None or after is None or before == after or first is None:
            out.append(None)
            continue
        tol = float(model.tolerance(m.earlier, m.later, m.step - first + 1))
        out.append(tol if abs(m.later - m.earlier) <= tol else None)
    return out
