"""The names of the OLMo 3 data mixes the package ships (their file lists are data: `olmo_ctl/data/mixes/`)."""

# name -> (stage, OLMo-core script that trains on it)
MIXES = {
    "OLMo-mix-0625-official": (1, "OLMo-3-1025-7B-pretrain-1.py, OLMo-3-1025-7B-pretrain-2.py"),
    "OLMo-midtraining-mix-0625-100B": (2, "OLMo-3-1025-7B-midtrain.py"),
    "OLMo-longmino-mix-0625": (3, "OLMo-3-1025-7B-long-context.py"),
}

# Validation mixes for `eval.lm` (OLMo-core's LM evaluator): name -> where AI2 evaluates on it.
EVAL_MIXES = {
    "v3-small-ppl-validation": "OLMo-3-1025-7B-pretrain-1.py:131-141 (LMEvaluatorCallbackConfig)",
}
