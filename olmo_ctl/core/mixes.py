"""The names of the data mixes the package ships (their file lists are data: `olmo_ctl/data/mixes/`)."""

# name -> (stage, OLMo-core script that trains on it)
MIXES = {
    # OLMo 3 7B
    "OLMo-mix-0625-official": (1, "OLMo-3-1025-7B-pretrain-1.py, OLMo-3-1025-7B-pretrain-2.py"),
    "OLMo-midtraining-mix-0625-100B": (2, "OLMo-3-1025-7B-midtrain.py"),
    "OLMo-longmino-mix-0625": (3, "OLMo-3-1025-7B-long-context.py"),
    # OLMo 3 32B
    "OLMo-mix-0925-official": (1, "OLMo-3-1025-32B-pretrain.py"),
    "OLMo-midtraining-mix-0925-ingredient1-100B": (2, "OLMo-3-1025-32B-midtrain-ingredient-1.py"),
    "OLMo-midtraining-mix-0925-ingredient2-100B": (2, "OLMo-3-1025-32B-midtrain-ingredient-2.py"),
    "OLMo-longmino-mix-0925": (3, "OLMo-3-1025-32B-long-context.py"),
    # OLMo 2 32B
    "OLMoE-mix-0824": (1, "OLMo-2-0325-32B-train.py"),
    "dolmino100": (2, "OLMo-2-0325-32B-anneal.py (ingredients 1 and 2)"),
    "dolmino300": (2, "OLMo-2-0325-32B-anneal.py (ingredient 3)"),
}

# Validation mixes for `eval.lm` (OLMo-core's LM evaluator): name -> where AI2 evaluates on it.
EVAL_MIXES = {
    "v3-small-ppl-validation": "OLMo-3-1025-7B-pretrain-1.py:131-141 (LMEvaluatorCallbackConfig)",
}

# The base directory the shipped recipes read their mixes from (`data.root`): AI2's bucket. A run
# reads a copy elsewhere with `--set data.root=gs://YOUR-BUCKET` (the directory holding `preprocessed/`).
AI2_DATA_ROOT = "gs://olmo-data"
DATA_ROOT_HINT = "--set data.root=gs://YOUR-BUCKET (the directory holding `preprocessed/`)"


def data_root_note(root: str) -> str | None:
    """What to tell someone about to run a recipe whose `data.root` is AI2's bucket (None otherwise)."""
    if root.rstrip("/") != AI2_DATA_ROOT:
        return None
    return (
        f"data.root is {AI2_DATA_ROOT}, AI2's bucket, as in the shipped recipes: the run reads its data mix "
        f"there; to read your own copy pass {DATA_ROOT_HINT}"
    )
