"""AdamW with OLMo 3's skip-step rule, the LR schedules, and the fp32 optimizer-state guard.

Pure functions over pytrees; everything that decides step k is a function of the state checkpointed
before it, so a restored run replays bit for bit.

* AdamW as OLMo-core/PyTorch: `p <- p - lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)`, weight decay
  on every parameter except the input embedding (top-level `embed`), global-norm clipping to
  `grad_clip` before the moments (the logged norm is the pre-clip one).
* Moments (`mu`, `nu`) and the bias-correction `count` are fp32 whatever the parameter or compute
  dtype. optax's `scale_by_adam` makes `nu` in the parameters' dtype, so a bf16 weight dtype would
  silently demote it (the +0.93 loss regression seen in the TPU case study); we keep our own state
  and `check_fp32_state` fails loudly if anything is not fp32.
* Skip-step (OLMo-core `SkipStepOptimizer`): the current step's CE loss and pre-clip grad norm are
  judged against the 128 values recorded before it; once 64 values are held (the current one
  included), the update is skipped when either value exceeds mean + 6 * std (Bessel-corrected) of those
  previous values; then the current values replace the oldest. A skipped step
  leaves parameters, both moments and the bias-correction count untouched (the spike still enters the
  window, and the LR schedule, which follows the global step, still advances).
* Schedules are functions of the 1-based step number n (the n-th step, which produces checkpoint n),
  OLMo-core's schedulers as written in `core/schedule.py` (pure Python, shared with `plan --lr-at`):
  stage 1 = AI2's two stitched parts (cosine over a 5T horizon, then a half cosine over 7T),
  stage 2/3 = linear decay to 0 (stage 3 after a 200-step warmup).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from olmo_ctl.core import schedule
from olmo_ctl.core.recipe import OptimizerConfig, Recipe, ScheduleConfig

EMBED_KEY = "embed"  # the input embedding: the only parameter without weight decay


class OptimizerDtypeError(RuntimeError):
    """The optimizer state is not fp32: training on would silently lose precision."""


class AdamState(NamedTuple):
    mu: Any  # first moment, fp32, shaped like params
    nu: Any  # second moment, fp32, shaped like params
    # int32: bias-correction count = number of applied (not skipped) updates. The field is named like
    # optax's (and the checkpoint's key); mypy reads it as overriding the tuple method `count`.
    count: jax.Array  # type: ignore[assignment]


class SkipWindow(NamedTuple):
    losses: jax.Array  # [window] fp32 ring buffer of CE losses
    grad_norms: jax.Array  # [window] fp32 ring buffer of pre-clip grad norms
    recorded: jax.Array  # int32: values ever recorded (the ring position is recorded % window)


# ---------------------------------------------------------------- schedules


class _JnpOps:
    """The jax operations `core.schedule.evaluate` runs on (fp32 scalars, traceable)."""

    pi = jnp.pi
    cos = staticmethod(jnp.cos)
    minimum = staticmethod(jnp.minimum)
    where = staticmethod(jnp.where)

    @staticmethod
    def num(x):
        return jnp.asarray(x, jnp.float32)


def learning_rate(sched: ScheduleConfig, peak: float, max_steps: int, n):
    """LR of the n-th step (1-based): `core.schedule`'s formulas on jax fp32 scalars (traceable)."""
    n = jnp.asarray(n, jnp.float32)
    return jnp.asarray(schedule.evaluate(sched, float(peak), max_steps, n, _JnpOps), jnp.float32)


# ---------------------------------------------------------------- state


def weight_decay_mask(params) -> Any:
    """True where weight decay applies: everything but the top-level input embedding."""
    if not isinstance(params, dict) or EMBED_KEY not in params:
        raise ValueError(f"params must be a dict with a top-level `{EMBED_KEY}` (the input embedding)")
    return {k: jax.tree.map(lambda _, on=k != EMBED_KEY: on, v) for k, v in params.items()}


def init_adam(params) -> AdamState:
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return AdamState(mu=zeros, nu=jax.tree.map(jnp.copy, zeros), count=jnp.zeros((), jnp.int32))


def init_skip_window(window: int) -> SkipWindow:
    return SkipWindow(
        losses=jnp.zeros((window,), jnp.float32),
        grad_norms=jnp.zeros((window,), jnp.float32),
        recorded=jnp.zeros((), jnp.int32),
    )


def check_fp32_state(params, adam: AdamState, param_dtype: str = "float32") -> None:
    """Fail loudly unless the moments are fp32 and the weights have the configured master dtype."""
    bad = []
    for name, tree in (("mu", adam.mu), ("nu", adam.nu)):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if jnp.dtype(leaf.dtype) != jnp.float32:
                bad.append(f"{name}{jax.tree_util.keystr(path)}: {leaf.dtype}")
    want = jnp.dtype(param_dtype)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if jnp.dtype(leaf.dtype) != want:
            bad.append(f"params{jax.tree_util.keystr(path)}: {leaf.dtype} (configured {param_dtype})")
    if bad:
        raise OptimizerDtypeError(
            "optimizer state has the wrong dtype (Adam moments must be fp32; a demoted moment silently"
            " degrades training): "
            + "; ".join(bad[:5])
            + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        )


# ---------------------------------------------------------------- skip-step


def skip_decision(window: SkipWindow, loss, grad_norm, min_history: int, sigma: float):
    """Record (loss, grad_norm) and decide whether this step's update is skipped.

    Returns (new_window, skip: bool scalar). Non-finite values are not recorded (they would poison
    the statistics); whether to stop on them is the training loop's call.
    """
    size = window.losses.shape[0]
    loss = jnp.asarray(loss, jnp.float32)
    grad_norm = jnp.asarray(grad_norm, jnp.float32)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # Judged against the window as it stands: the `size` values recorded before this step (OLMo-core
    # keeps rolling_interval_length + 1 values and takes its statistics over all but the latest).
    held = jnp.minimum(window.recorded, size)
    prev = jnp.arange(size) < held
    n_prev = jnp.maximum(held, 2).astype(jnp.float32)

    def exceeds(buf, x):
        mean = jnp.sum(jnp.where(prev, buf, 0.0)) / n_prev
        var = jnp.sum(jnp.where(prev, (buf - mean) ** 2, 0.0)) / (n_prev - 1.0)  # Bessel-corrected
        return ~((x - mean) <= sigma * jnp.sqrt(var))  # NaN counts as exceeding

    # OLMo-core judges once it holds min_history values, the current one included.
    active = held + finite.astype(jnp.int32) >= min_history
    skip = active & (exceeds(window.losses, loss) | exceeds(window.grad_norms, grad_norm))
    pos = window.recorded % size  # then the oldest value makes room for this one
    losses = jnp.where(finite, window.losses.at[pos].set(loss), window.losses)
    norms = jnp.where(finite, window.grad_norms.at[pos].set(grad_norm), window.grad_norms)
    recorded = window.recorded + finite.astype(jnp.int32)
    return SkipWindow(losses, norms, recorded), skip


# ---------------------------------------------------------------- the update


def global_norm(grads) -> jax.Array:
    return optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))


def adamw_update(params, grads, adam: AdamState, lr, opt: OptimizerConfig, skip=None):
    """One AdamW step with pre-moment global-norm clipping.

    Returns (new_params, new_adam, grad_norm_pre_clip). Where `skip` is true, params and the whole
    Adam state (moments and count) come back bit for bit unchanged.
    """
    b1, b2 = opt.betas
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    norm = optax.tree.norm(grads)
    scale = jnp.minimum(1.0, opt.grad_clip / (norm + 1e-6))  # torch's clip_grad_norm_ (same eps)
    grads = jax.tree.map(lambda g: g * scale, grads)
    count = adam.count + 1
    c = count.astype(jnp.float32)
    bc1 = 1.0 - jnp.float32(b1) ** c
    bc2 = 1.0 - jnp.float32(b2) ** c
    mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, adam.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, adam.nu, grads)
    decay = weight_decay_mask(params)
    lr = jnp.asarray(lr, jnp.float32)

    def new_param(p, m, v, wd_on):
        p32 = p.astype(jnp.float32)
        upd = (m / bc1) / (jnp.sqrt(v / bc2) + opt.eps)
        if wd_on:
            upd = upd + opt.weight_decay * p32
        return (p32 - lr * upd).astype(p.dtype)

    new_params = jax.tree.map(new_param, params, mu, nu, decay)
    new_adam = AdamState(mu, nu, count)
    if skip is not None:
        keep = lambda new, old: jnp.where(skip, old, new)  # noqa: E731
        new_params = jax.tree.map(keep, new_params, params)
        new_adam = jax.tree.map(keep, new_adam, adam)
    return new_params, new_adam, norm


def optimizer_step(params, grads, adam: AdamState, window: SkipWindow, loss, step_number, recipe: Recipe):
    """The whole optimizer for step `step_number` (1-based): LR, clip, skip-step, AdamW.

    Returns (params, adam, window, info) with info = {lr, grad_norm, skipped}.
    """
    opt = recipe.optimizer
    lr = learning_rate(recipe.schedule, opt.lr, recipe.train.max_steps, step_number)
    norm = global_norm(grads)
    if opt.skip_step.enabled:
        window, skip = skip_decision(window, loss, norm, opt.skip_step.min_history, opt.skip_step.sigma)
    else:
        skip = jnp.zeros((), bool)
    params, adam, _ = adamw_update(params, grads, adam, lr, opt, skip)
    return params, adam, window, {"lr": lr, "grad_norm": norm, "skipped": skip}
