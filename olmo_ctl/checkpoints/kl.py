"""Token-level KL between two checkpoints on identical held-out tokens (`olmo-ctl verify`).

KL(reference || run) at every labelled position of the same rows: sum over the vocabulary of
p_ref (log p_ref - log p_run), the model's padded vocabulary included (as the training loss's
softmax); the mean over positions in float64. Rows are the run's held-out instances: `eval.lm`'s
padded documents when the recipe has them (`trainer/lm_eval.py`), else `data.eval`'s contiguous
instances, the first ones covering at least `n_tokens` labelled positions.
"""

from __future__ import annotations

import numpy as np

from olmo_ctl.core.errors import BadInput
from olmo_ctl.trainer.lm_eval import IGNORE_INDEX

ROWS_PER_CALL = 4


def heldout_rows(recipe, n_tokens: int) -> dict[str, np.ndarray]:
    """{input_ids, labels} [rows, seq_len]: the first held-out instances covering `n_tokens` labels."""
    T = recipe.train.seq_len
    ids, labels, have = [], [], 0
    if recipe.eval.lm.enabled:
        from olmo_ctl.trainer import lm_eval

        m = recipe.model
        data = lm_eval.LMEvalData(lm_eval.resolve_sets(recipe), T, m.eos_token_id, m.pad_token_id)
        for i in range(len(data)):
            b = data.batch([i], rows=1)
            ids.append(b["input_ids"][0])
            labels.append(b["labels"][0])
            have += int(np.sum(b["labels"][0] != IGNORE_INDEX))
            if have >= n_tokens:
                break
    elif recipe.data.eval:
        from olmo_ctl.trainer import data as data_lib

        n = -(-n_tokens // (T - 1))
        for b in data_lib.eval_batches(recipe, 1, n):
            ids.extend(b["input_ids"])
            labels.extend(b["labels"])
    else:
        raise BadInput(
            "the run has no held-out tokens for the KL (neither eval.lm nor data.eval)",
            "set eval.lm or data.eval in the run's recipe, or pass --kl-tokens 0 to skip the KL",
        )
    return {"input_ids": np.asarray(ids, np.int32), "labels": np.asarray(labels, np.int32)}


def mean_token_kl(ref_params, ref_cfg, run_params, run_cfg, rows: dict[str, np.ndarray]) -> tuple[float, int]:
    """(mean KL(reference || run) per labelled position, positions) over `rows`."""
    import jax
    import jax.numpy as jnp

    from olmo_ctl.trainer.model import forward

    if ref_cfg.padded_vocab_size != run_cfg.padded_vocab_size:
        raise BadInput(
            f"the reference's vocabulary ({ref_cfg.padded_vocab_size}) is not the run's ({run_cfg.padded_vocab_size})",
            "compare checkpoints of the same model shape",
        )

    def kl_rows(pa, pb, x, y):
        la = jax.nn.log_softmax(forward(pa, x, ref_cfg), axis=-1)
        lb = jax.nn.log_softmax(forward(pb, x, run_cfg), axis=-1)
        kl = jnp.sum(jnp.exp(la) * (la - lb), axis=-1)  # [B, T]
        return jnp.where(y != IGNORE_INDEX, kl, 0.0)

    fn = jax.jit(kl_rows)
    total, count = 0.0, 0
    x, y = rows["input_ids"], rows["labels"]
    for k in range(0, len(x), ROWS_PER_CALL):
        kl = np.asarray(
            fn(ref_params, run_params, x[k : k + ROWS_PER_CALL], y[k : k + ROWS_PER_CALL]), np.float64
        )
        total += float(kl.sum())
        count += int(np.sum(y[k : k + ROWS_PER_CALL] != IGNORE_INDEX))
    return (total / count if count else 0.0), count
