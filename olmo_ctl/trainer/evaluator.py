"""The interface of every evaluation the training loop runs (OLMo-core's `Evaluator`), and the
simplest one, the held-out loss.

An evaluator has a `name`, an `interval` (it runs after every step that is a multiple of it) and
`run(params)`, which evaluates the parameters and returns an `Evaluation`: the scalars to log at that
step (event tag -> value) and the rest of its `eval step N ...` line. One hook drives every
evaluator, in order (`hooks.EvaluatorHook`): it fetches the pending step metrics first, pauses the
hang watchdog while one runs, logs on process 0 and prints the line. A new evaluator is one class
and one line in `EvaluatorHook.for_recipe`.

  HeldOutLoss          `eval.interval`             `eval/lm_loss` over `eval.batches` of `data.eval`
  lm_eval.LMEvaluator  `eval.lm.interval`          OLMo-core's per-label LM losses (`eval/lm/...`)
  downstream.DownstreamEvaluator  `eval.downstream.interval`  ai2-olmo-eval's tasks (`eval/downstream/...`)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from olmo_ctl.core.contracts import EVAL_LOSS_TAG


@dataclass(frozen=True)
class Evaluation:
    """What one evaluation found: the scalars logged at its step, and its line's summary."""

    metrics: dict[str, float]  # event tag -> value
    summary: str  # what follows `eval step N ` in the log, e.g. `lm_loss 3.0000`


class Evaluator(ABC):
    """One evaluation the loop runs every `interval` steps (see the module docstring)."""

    name: str
    interval: int

    @abstractmethod
    def run(self, params) -> Evaluation:
        """Evaluate `params` (every host calls it at the same step: it may run collectives)."""


class HeldOutLoss(Evaluator):
    """The held-out loss every `eval.interval` steps, on the same batches each time (`eval/lm_loss`)."""

    name = "lm_loss"

    def __init__(self, eval_step, eval_sets: list, interval: int):
        self.eval_step, self.eval_sets, self.interval = eval_step, eval_sets, interval

    @classmethod
    def for_recipe(cls, s) -> HeldOutLoss | None:
        """For the run's setup `s`: the eval step in micro-batches of `s.plan`'s layout; None without
        held-out batches (`eval.batches` 0 or no `data.eval`)."""
        from olmo_ctl.trainer.step import jit_eval_step

        sets = _eval_batches(s)
        return cls(jit_eval_step(s.recipe), sets, s.recipe.eval.interval) if sets else None

    def run(self, params) -> Evaluation:
        import jax

        # Per micro-batch sums, added on the host in float64 in a fixed order.
        host = jax.device_get([self.eval_step(params, b) for b in self.eval_sets])
        ce = sum(float(c) for cs, _ in host for c in cs)
        n = sum(float(k) for _, ks in host for k in ks)
        loss = ce / max(n, 1.0)
        return Evaluation({EVAL_LOSS_TAG: loss}, f"lm_loss {loss:.4f}")


def _eval_batches(s) -> list[dict[str, Any]]:
    """The held-out batches, identical every time (device arrays `[n_micro, micro, T]`, reused at each
    eval)."""
    from olmo_ctl.trainer import data as data_lib
    from olmo_ctl.trainer.step import eval_device_batch

    recipe = s.recipe
    if recipe.eval.batches <= 0 or not recipe.data.eval:
        return []
    bs = recipe.eval.batch_size or recipe.train.global_batch
    return [
        eval_device_batch(b, recipe, s.plan, s.mesh, s.local_devices, s.n_proc)
        for b in data_lib.eval_batches(recipe, recipe.eval.batches, bs, s.proc, s.n_proc)
    ]
