"""Scoring of generated text: the verifiers AI2 used for OLMo 2 Instruct's RLVR rewards and generative
evaluations (verifiers.py), and the IFEval instruction checks (ifeval.py)."""
