"""Tools over checkpoints that are not the training loop: `evaluate` (`olmo-ctl eval` and eval jobs),
`convert` (Hugging Face <-> Orbax), `surgery` (warm Adam), `soup` (the mean of checkpoints, tensor by
tensor), `parity` (HF logits against ours), `kl` (token KL between two checkpoints) and `data_audit`
(`olmo-ctl data audit`).

They sit above the trainer (they run its model, evaluators and checkpoint reader) and below observe,
supervise and cli, which reach the trainer only through them.
"""
