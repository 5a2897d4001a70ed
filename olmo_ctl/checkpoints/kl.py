"""Token-level KL between two checkpoints on identical held-out tokens (`olmo-ctl verify`).

KL(reference || run) at every labelled position of the same rows: sum over the vocabulary of
p_ref (log p_ref - log p_run), the model's padded vocabulary included (as the training loss's
softmax); the mean over positions in float64. Rows are the run's held-out instances: `eval.lm`'s
padded documents when the recipe has them (`trainer/lm_eval.py`), else `data.eval`'s contiguous
instances, the first ones covering at least `n_tokens` labelled positions, or every one the data holds
when it holds fewer (the report says how many were taken).

Both models are sharded over the devices as the trainer shards them (`evaluate.load_sharded`: each
host reads only its shards), the rows streamed a pass at a time (a multiple of the devices, split
over them), and each pass reduced on the devices to a sum and a count: no host holds a model, all the
rows or a pass's logits, so a 32B on a slice and 16M tokens cost what one pass costs, times the passes.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from olmo_ctl.core.errors import BadInput
from olmo_ctl.trainer.lm_eval import IGNORE_INDEX


def heldout_row_iter(recipe, n_tokens: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, labels) [seq_len] of the first held-out instances covering `n_tokens` labels (all of
    them when the data holds fewer), in order."""
    T = recipe.train.seq_len
    if recipe.eval.lm.enabled:
        from olmo_ctl.trainer import lm_eval

        m = recipe.model
        data = lm_eval.LMEvalData(lm_eval.resolve_sets(recipe), T, m.eos_token_id, m.pad_token_id)
        have = 0
        for i in range(len(data)):
            b = data.batch([i], rows=1)
            yield b["input_ids"][0], b["labels"][0]
            have += int(np.sum(b["labels"][0] != IGNORE_INDEX))
            if have >= n_tokens:
                return
    elif recipe.data.eval:
        from olmo_ctl.trainer import data as data_lib

        ds = data_lib.TokenDataset(
            data_lib.resolve_files(recipe, "eval"), T, vocab_size=recipe.model.vocab_size
        )
        n = min(-(-n_tokens // (T - 1)), len(ds))
        for b in data_lib.eval_batches(recipe, 1, n, dataset=ds):
            yield from zip(b["input_ids"], b["labels"], strict=True)
    else:
        raise BadInput(
            "the run has no held-out tokens for the KL (neither eval.lm nor data.eval)",
            "set eval.lm or data.eval in the run's recipe, or pass --kl-tokens 0 to skip the KL",
        )


def _passes(rows: Iterator[tuple[np.ndarray, np.ndarray]], per_pass: int, pad_id: int):
    """[per_pass, T] arrays of the rows; the last pass filled with rows no position of which counts."""
    ids: list = []
    labels: list = []
    for x, y in rows:
        ids.append(x)
        labels.append(y)
        if len(ids) == per_pass:
            yield np.asarray(ids, np.int32), np.asarray(labels, np.int32)
            ids, labels = [], []
    if ids:
        T = len(ids[0])
        while len(ids) < per_pass:
            ids.append(np.full(T, pad_id, np.int32))
            labels.append(np.full(T, IGNORE_INDEX, np.int32))
        yield np.asarray(ids, np.int32), np.asarray(labels, np.int32)


def _put(a: np.ndarray, sharding):
    """`a`, held by every process alike, as a global array: each process puts its devices' parts."""
    import jax

    def part(index: tuple[slice, ...] | None) -> np.ndarray:
        return a if index is None else a[index]

    return jax.make_array_from_callback(a.shape, sharding, part)


def sharded_token_kl(
    ref_params, ref_cfg, run_params, run_cfg, recipe, n_tokens: int, mesh, per_pass: int
) -> tuple[float, int]:
    """(mean KL(reference || run) per labelled position, positions) over `heldout_row_iter(recipe,
    n_tokens)`, `per_pass` rows at a time (a multiple of the mesh's devices), both models' parameters
    sharded over `mesh` (`evaluate.load_sharded`), every process of a multi-host slice taking part."""
    import jax
    import jax.numpy as jnp

    from olmo_ctl.trainer import sharding
    from olmo_ctl.trainer.model import forward

    if ref_cfg.padded_vocab_size != run_cfg.padded_vocab_size:
        raise BadInput(
            f"the reference's vocabulary ({ref_cfg.padded_vocab_size}) is not the run's ({run_cfg.padded_vocab_size})",
            "compare checkpoints of the same model shape",
        )
    rows_at = sharding.row_sharding(mesh)

    def kl_sum(pa, pb, x, y):
        la = jax.nn.log_softmax(forward(pa, x, ref_cfg), axis=-1)
        lb = jax.nn.log_softmax(forward(pb, x, run_cfg), axis=-1)
        kl = jnp.sum(jnp.exp(la) * (la - lb), axis=-1)  # [B, T]
        counted = y != IGNORE_INDEX
        return jnp.sum(jnp.where(counted, kl, 0.0)), jnp.sum(counted)

    total, count = 0.0, 0
    with jax.set_mesh(mesh):
        fn = jax.jit(kl_sum, out_shardings=(sharding.replicated(mesh), sharding.replicated(mesh)))
        for x, y in _passes(heldout_row_iter(recipe, n_tokens), per_pass, recipe.model.pad_token_id):
            # every process holds the same rows; each puts on its devices the part they hold
            s, c = fn(ref_params, run_params, _put(x, rows_at), _put(y, rows_at))
            total += float(np.asarray(s, np.float64))
            count += int(c)
    return (total / count if count else 0.0), count
