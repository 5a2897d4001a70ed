"""The training loss: token-mean CE + z-loss over the padded vocab (OLMo-core), one denominator per global batch,
and instances masked by the n-gram repetition filter still counted in that denominator."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.trainer import model
from olmo_ctl.trainer.train import IGNORE_INDEX, init_state, make_train_step, token_losses

QUICK_COMPILES = True  # small programs compiled once or twice: tests/conftest.py::_quick_compiles


def _batch(recipe, rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    T = recipe.train.seq_len
    ids = rng.integers(0, recipe.model.vocab_size, size=(rows, T), dtype=np.int32)
    labels = np.concatenate([ids[:, 1:], np.full((rows, 1), IGNORE_INDEX, np.int32)], axis=1)
    return ids, labels


def test_filtered_instances_count_in_the_denominator():
    recipe = load_recipe("smoke", overrides=["train.seq_len=32", "model.sliding_window=16"])
    params = model.init_params(recipe.model, jax.random.key(0))
    ids, labels = _batch(recipe, 4)
    labels[1] = IGNORE_INDEX  # the filter masked instance 1: no label, still in the denominator
    ce_sum, _, n_real = token_losses(params, jnp.asarray(ids), jnp.asarray(labels), recipe.model)
    assert float(n_real) == 3 * 31

    step = jax.jit(make_train_step(recipe))
    batch = {"input_ids": jnp.asarray(ids)[None], "labels": jnp.asarray(labels)[None]}
    _, m_plain = step(init_state(recipe, params), batch)
    mask = jnp.asarray([[1], [0], [1], [1]], jnp.int32)[None]
    _, m_filtered = step(init_state(recipe, params), {**batch, "instance_mask": mask})

    assert float(m_plain["tokens"]) == 3 * 31
    assert float(m_filtered["tokens"]) == 4 * 31
    np.testing.assert_allclose(float(m_plain["ce"]), float(ce_sum) / (3 * 31), rtol=1e-6)
    np.testing.assert_allclose(float(m_filtered["ce"]), float(ce_sum) / (4 * 31), rtol=1e-6)


def test_loss_is_over_the_padded_vocabulary_like_olmo_core():
    """The padded LM-head rows (never a label) take part in the softmax and the z-loss, as in
    OLMo-core (its LM head outputs all padded_vocab_size logits)."""
    recipe = load_recipe("smoke", overrides=["train.seq_len=32", "model.sliding_window=16"])
    cfg = recipe.model
    assert cfg.padded_vocab_size > cfg.vocab_size
    params = model.init_params(cfg, jax.random.key(0))
    ids, labels = _batch(recipe, 2)
    ce, z, n = token_losses(params, jnp.asarray(ids), jnp.asarray(labels), cfg)

    logits = np.asarray(model.forward(params, jnp.asarray(ids), cfg), np.float64)
    assert logits.shape[-1] == cfg.padded_vocab_size
    mask = labels != IGNORE_INDEX
    target = np.take_along_axis(logits, np.where(mask, labels, 0)[..., None], axis=-1)[..., 0]

    def lse(x):
        m = x.max(-1, keepdims=True)
        return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]

    full, real = lse(logits), lse(logits[..., : cfg.vocab_size])
    np.testing.assert_allclose(float(ce), np.sum((full - target)[mask]), rtol=1e-5)
    np.testing.assert_allclose(float(z), np.sum((full**2)[mask]), rtol=1e-5)
    assert float(n) == mask.sum()
    # Not the real-vocabulary loss: the padded rows carry probability mass here.
    # Not the real-vocabulary loss: the padded rows carry probability mass (near-uniform logits at
    # init: about ln(384 / 258) = 0.40 per token).
    assert np.mean((full - real)[mask]) > 0.3
