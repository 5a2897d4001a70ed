"""OLMo-core's n-gram repetition filter: does an instance hold a short pattern repeated many times back
to back? Both datasets (`data.TokenDataset`, `packed.PackedDataset`) ignore the labels of one that does.

numpy only.
"""

from __future__ import annotations

import numpy as np

NGRAM_MIN_PERIOD = 1
NGRAM_MAX_PERIOD = 13
NGRAM_MIN_REPEATS = 32


def _longest_true_run(mask: np.ndarray) -> int:
    if not mask.any():
        return 0
    d = np.diff(np.concatenate(([0], mask.view(np.int8), [0])))
    return int((np.flatnonzero(d == -1) - np.flatnonzero(d == 1)).max())


def has_repetition(
    tokens: np.ndarray,
    min_period: int = NGRAM_MIN_PERIOD,
    max_period: int = NGRAM_MAX_PERIOD,
    min_repeats: int = NGRAM_MIN_REPEATS,
) -> bool:
    """Whether some `p`-token pattern (min_period <= p <= max_period) occurs `min_repeats` times back to back.

    A window of `p * min_repeats` tokens is p-periodic exactly when `x[i] == x[i+p]` holds on a run
    of `p * (min_repeats - 1)` consecutive positions.
    """
    x = np.asarray(tokens)
    for p in range(min_period, max_period + 1):
        if len(x) < p * min_repeats:
            break
        if _longest_true_run(x[p:] == x[:-p]) >= p * (min_repeats - 1):
            return True
    return False
