"""The step functions, pure and jitted by the caller: the trainer runs them, preflight compiles them.

`make_train_step(recipe)` is one whole training step — loss over the micro-batches (a `lax.scan`
accumulating fp32 gradients), AdamW with clipping and skip-step — as a function of the train state
and a batch laid out `[accum, micro_global, T]`. `abstract_train_state` and `micro_batch_sharding`
give the shapes and shardings both callers jit it with, so what preflight compiles is what runs.

Step semantics (docs/CONTRACTS.md): the state's `step` counts completed steps; running the step on
a state at `step = N` produces the state after step N+1.
"""

from __future__ import annotations

from olmo_ctl.core.recipe import Recipe

IGNORE_INDEX = -100


def token_losses(params, input_ids, labels, cfg, segment_ids=None):
    """(CE sum, z-loss sum, token count) over non-ignored labels; fp32.

    Over the padded vocabulary, as OLMo-core computes it: the padded LM-head rows (never a label)
    still take part in the softmax and in the z-loss's logsumexp (but for the zero rows a converted
    model was padded with: `ModelConfig.softmax_vocab_size`, `model.forward`). `segment_ids` (packed data):
    attention stays within each document.
    """
    import jax.numpy as jnp

    ce_tok, lse, mask = _token_ce(params, input_ids, labels, cfg, segment_ids)
    ce = jnp.sum(ce_tok)
    z = jnp.sum(jnp.where(mask, lse * lse, 0.0))
    return ce, z, jnp.sum(mask).astype(jnp.float32)


def _token_ce(params, input_ids, labels, cfg, segment_ids=None):
    """Per-token CE [B, T] (0 at ignored labels), the logsumexp [B, T] and the label mask; fp32."""
    import jax
    import jax.numpy as jnp

    from olmo_ctl.trainer.model import forward

    logits = forward(params, input_ids, cfg, segment_ids=segment_ids)  # [B, T, padded_vocab_size], fp32
    lse = jax.nn.logsumexp(logits, axis=-1)
    mask = labels != IGNORE_INDEX
    target = jnp.take_along_axis(logits, jnp.where(mask, labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(mask, lse - target, 0.0), lse, mask


def make_train_step(recipe: Recipe):
    """state, batch {input_ids, labels[, segment_ids]: [accum, micro_global, T]} -> state, metrics
    (device scalars). `segment_ids` come with packed data (documents masked from each other)."""
    import jax
    import jax.numpy as jnp

    from olmo_ctl.trainer import flat_fsdp, optim

    cfg, z_coef = recipe.model, recipe.optimizer.z_loss

    def step(state, batch):
        params = state["params"]
        # One denominator for the whole global batch, so accumulation over micro-batches is exact.
        n_tokens = jnp.sum(batch["labels"] != IGNORE_INDEX).astype(jnp.float32)
        if "instance_mask" in batch:
            # Instances the n-gram repetition filter masked still count in the denominator (as in
            # OLMo-core): each would have contributed seq_len - 1 labelled tokens.
            filtered = jnp.sum(1 - batch["instance_mask"]).astype(jnp.float32)
            n_tokens = n_tokens + filtered * (batch["labels"].shape[-1] - 1)
        n_tokens = jnp.maximum(n_tokens, 1.0)

        def micro_loss(p, ids, labels, seg):
            ce, z, _ = token_losses(p, ids, labels, cfg, seg)
            return (ce + z_coef * z) / n_tokens, (ce, z)

        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

        def accumulate(params, micro):
            def body(carry, mb):
                g_acc, ce_acc, z_acc = carry
                (_, (ce, z)), g = grad_fn(params, mb["input_ids"], mb["labels"], mb.get("segment_ids"))
                g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
                return (g_acc, ce_acc + ce, z_acc + z), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            return jax.lax.scan(body, (zeros, jnp.float32(0), jnp.float32(0)), micro)[0]

        micro = {k: batch[k] for k in ("input_ids", "labels", "segment_ids") if k in batch}
        if flat_fsdp.applies(params):  # the CPU: one gather, one gradient reduction (trainer/flat_fsdp.py)
            grads, ce_sum, z_sum = flat_fsdp.grads(params, micro, accumulate)
        else:
            grads, ce_sum, z_sum = accumulate(params, micro)
        ce_loss, z_loss = ce_sum / n_tokens, z_sum / n_tokens
        adam = optim.AdamState(**state["opt"])
        window = optim.SkipWindow(**state["skip"])
        step_number = state["step"] + 1  # this is the (step+1)-th step; it produces checkpoint step+1
        params, adam, window, info = optim.optimizer_step(
            params, grads, adam, window, ce_loss, step_number, recipe
        )
        new_state = {"step": step_number, "params": params, "opt": adam._asdict(), "skip": window._asdict()}
        metrics = {
            "ce": ce_loss,
            "z": z_coef * z_loss,
            "grad_norm": info["grad_norm"],
            "lr": info["lr"],
            "skipped": info["skipped"].astype(jnp.float32),
            "tokens": n_tokens,
        }
        return new_state, metrics

    return step


def make_eval_step(recipe: Recipe):
    """params, batch {input_ids, labels[, segment_ids]: [n_micro, micro, T]} -> (CE sums, token counts),
    one of each per micro-batch ([n_micro] fp32).

    A `lax.scan` over the micro-batches, so one micro-batch's logits are live at a time
    (`core.batching.eval_micro_batch` sizes it); each micro-batch's sums are reduced as a one-pass
    forward of those rows would, and the caller adds them up on the host.
    """
    import jax

    cfg = recipe.model

    def step(params, batch):
        def body(carry, mb):
            ce, _, n = token_losses(params, mb["input_ids"], mb["labels"], cfg, mb.get("segment_ids"))
            return carry, (ce, n)

        _, (ce, n) = jax.lax.scan(body, None, batch)
        return ce, n

    return step


def jit_eval_step(recipe: Recipe):
    """The eval step as the trainer runs it and preflight compiles it."""
    import jax

    return jax.jit(make_eval_step(recipe))


def make_lm_eval_step(recipe: Recipe, n_labels: int):
    """The LM evaluator's step (trainer/lm_eval.py): params, batch {input_ids, labels: [n_micro, micro,
    T], label_index, weight: [n_micro, micro]} -> (CE sums fp32, weights int32), each [n_micro,
    n_labels]: per micro-batch, the CE of each label's rows and their weights (a row's label index
    -1: a padding row, in no label). Sums are elementwise, never a matmul (TPU matmuls round fp32)."""
    import jax
    import jax.numpy as jnp

    cfg = recipe.model

    def step(params, batch):
        def body(carry, mb):
            ce_tok, _, _ = _token_ce(params, mb["input_ids"], mb["labels"], cfg)
            onehot = mb["label_index"][:, None] == jnp.arange(n_labels)[None, :]  # [micro, n_labels]
            ce_rows = jnp.sum(ce_tok, axis=-1)  # [micro]
            ce = jnp.sum(jnp.where(onehot, ce_rows[:, None], 0.0), axis=0)
            w = jnp.sum(jnp.where(onehot, mb["weight"][:, None], 0), axis=0)
            return carry, (ce, w)

        _, (ce, w) = jax.lax.scan(body, None, batch)
        return ce, w

    return step


def jit_lm_eval_step(recipe: Recipe, n_labels: int, mesh):
    """The LM evaluator's step, its sums replicated (every host reads them)."""
    import jax

    from olmo_ctl.trainer import sharding

    return jax.jit(make_lm_eval_step(recipe, n_labels), out_shardings=sharding.replicated(mesh))


def eval_layout(recipe: Recipe, plan) -> tuple[int, int]:
    """(micro-batches, instances per micro-batch) of one eval batch on `plan`'s slice; their product
    may exceed the eval batch (the rest is padding: `eval_device_batch`)."""
    from olmo_ctl.core.batching import eval_micro_batch

    micro = eval_micro_batch(recipe, plan)
    return -(-(recipe.eval.batch_size or recipe.train.global_batch) // micro), micro


def eval_device_batch(batch: dict, recipe: Recipe, plan, mesh, local_devices: int, n_proc: int = 1) -> dict:
    """This process's rows of one eval batch as global device arrays `[n_micro, micro, T]`, laid out as
    the train step's micro-batches (each device's part of each micro-batch is its own rows). Each
    process pads its rows up to its share of `n_micro x micro` with rows whose labels are all
    IGNORE_INDEX: they add no CE and no tokens, so the loss is the unpadded batch's."""
    import jax
    import numpy as np

    n_micro, micro = eval_layout(recipe, plan)
    rows_per_proc = local_devices // plan.seq_shards
    # Per-row values of the LM evaluator (trainer/lm_eval.py) ride along, split over the rows only.
    fill = {"input_ids": recipe.model.pad_token_id, "labels": IGNORE_INDEX, "label_index": -1, "weight": 0}
    out = {}
    for k in (k for k in fill if k in batch):
        x = np.asarray(batch[k], np.int32)
        pad = n_micro * micro // n_proc - x.shape[0]
        x = np.concatenate([x, np.full((pad, *x.shape[1:]), fill[k], np.int32)]) if pad else x
        rows = x.ndim == 1
        out[k] = jax.make_array_from_process_local_data(
            micro_row_sharding(mesh) if rows else micro_batch_sharding(mesh),
            micro_layout(x, rows_per_proc, n_micro),
            (n_micro, micro) if rows else (n_micro, micro, recipe.train.seq_len),
        )
    return out


def abstract_eval_batch(recipe: Recipe, plan, mesh) -> dict:
    """One eval batch as sharded `ShapeDtypeStruct`s (what preflight compiles the eval step with)."""
    import jax
    import jax.numpy as jnp

    n_micro, micro = eval_layout(recipe, plan)
    shard = micro_batch_sharding(mesh)
    shape = (n_micro, micro, recipe.train.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=shard) for k in ("input_ids", "labels")}


def init_state(recipe: Recipe, params):
    """The train state before step 1: step 0, fresh Adam moments and an empty skip-step window."""
    import jax.numpy as jnp

    from olmo_ctl.trainer import optim

    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt": optim.init_adam(params)._asdict(),
        "skip": optim.init_skip_window(recipe.optimizer.skip_step.window)._asdict(),
    }


def fresh_state(recipe: Recipe, state_shard, params=None):
    """The sharded train state before step 1; parameters from the recipe's seed unless `params` is given."""
    import jax

    from olmo_ctl.trainer import model

    if params is None:
        params = jax.jit(lambda k: model.init_params(recipe.model, k), out_shardings=state_shard["params"])(
            jax.random.PRNGKey(recipe.train.seed)
        )
    return jax.jit(lambda p: init_state(recipe, p), out_shardings=state_shard)(params)


def abstract_train_state(recipe: Recipe, mesh):
    """The train state as sharded `ShapeDtypeStruct`s, and its shardings: FSDP-sharded params and
    Adam moments, everything else replicated. Nothing is allocated (the trainer restores or
    initialises into these; preflight compiles against them)."""
    import jax

    from olmo_ctl.trainer import model, sharding

    abstract_params = jax.eval_shape(
        lambda k: model.init_params(recipe.model, k), jax.random.PRNGKey(recipe.train.seed)
    )
    p_shard = sharding.param_shardings(abstract_params, mesh)
    rep = sharding.replicated(mesh)
    abstract_state = jax.eval_shape(lambda p: init_state(recipe, p), abstract_params)
    state_shard = {
        "step": rep,
        "params": p_shard,
        "opt": {"mu": p_shard, "nu": p_shard, "count": rep},
        "skip": jax.tree.map(lambda _: rep, abstract_state["skip"]),
    }
    state = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract_state, state_shard
    )
    return state, state_shard


def micro_batch_sharding(mesh):
    """[accum, micro-batch, T]: the accumulation axis replicated, the batch over every device (the
    sequence over "seq" when sequences are sharded)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from olmo_ctl.trainer import sharding

    return NamedSharding(mesh, PartitionSpec(None, *sharding.batch_sharding(mesh).spec))


def micro_row_sharding(mesh):
    """[accum, micro-batch, 1] per-instance values (the n-gram filter's instance mask)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from olmo_ctl.trainer import sharding

    return NamedSharding(mesh, PartitionSpec(None, *sharding.row_sharding(mesh).spec))


def micro_layout(x, local_devices: int, accum: int):
    """[rows, ...] (this process's rows, contiguous per device) -> [accum, rows/accum, ...].

    Micro-batch m takes rows m*b..(m+1)*b-1 of every device's share, so each device's part of each
    micro-batch is data it already holds: accumulation moves no data between devices.
    """
    import numpy as np

    rows = x.shape[0]
    b = rows // (local_devices * accum)
    y = x.reshape(local_devices, accum, b, *x.shape[1:])
    return np.ascontiguousarray(np.swapaxes(y, 0, 1)).reshape(accum, local_devices * b, *x.shape[1:])


def device_batch(batch: dict, recipe: Recipe, plan, mesh, local_devices: int, micro_shard) -> dict:
    """This process's rows of a global batch as global device arrays `[accum, micro_global, T]`."""
    import jax
    import numpy as np

    accum, t = plan.grad_accum, recipe.train
    rows_per_proc = local_devices // plan.seq_shards  # devices of one row share it over its seq shards
    local = {
        k: micro_layout(np.asarray(batch[k], np.int32), rows_per_proc, accum)
        for k in ("input_ids", "labels", "segment_ids")
        if k in batch
    }
    if recipe.data.ngram_filter:
        local["instance_mask"] = micro_layout(
            np.asarray(batch["instance_mask"], np.int32)[:, None], rows_per_proc, accum
        )
    return {
        k: jax.make_array_from_process_local_data(
            micro_row_sharding(mesh) if k == "instance_mask" else micro_shard,
            v,
            (accum, t.global_batch // accum, v.shape[-1]),
        )
        for k, v in local.items()
    }


def jit_train_step(recipe: Recipe, state_shard):
    """The train step jitted as the trainer runs it: the state donated, the new state FSDP-sharded."""
    import jax

    return jax.jit(make_train_step(recipe), donate_argnums=(0,), out_shardings=(state_shard, None))
