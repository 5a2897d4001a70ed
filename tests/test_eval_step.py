"""Evaluation in micro-batches: the held-out loss equals the one-pass forward, and the eval step's
memory follows the micro-batch, not the eval batch (`eval.micro_batch`, `core.batching.eval_micro_batch`).

Real model, real jitted steps on the 8 host CPU devices of the test process (FSDP mesh).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from olmo_ctl.core.batching import eval_micro_batch, make_plan
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe

QUICK_COMPILES = True  # small programs compiled once or twice: tests/conftest.py::_quick_compiles

SETS = ["train.seq_len=64", "train.global_batch=16", "model.sliding_window=16", "eval.batch_size=16"]


def _recipe(*more: str):
    return load_recipe("smoke", overrides=[*SETS, *more])


def _plan(recipe, grad_accum: int = 1, rows: int = 8):
    """A plan of `rows` data-parallel devices with the train step's micro-batch = global / grad_accum."""
    base = make_plan(recipe, get_device("cpu-8"))
    return dataclasses.replace(
        base,
        devices=rows,
        data_parallel=rows,
        grad_accum=grad_accum,
        per_device_batch=16 // grad_accum // rows,
    )


@pytest.fixture(scope="module")
def model():
    import jax

    from olmo_ctl.trainer import model as M

    r = _recipe()
    params = M.init_params(r.model, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (16, 64)).astype(np.int32)
    labels = np.where(rng.random((16, 64)) < 0.1, -100, np.roll(ids, -1, -1)).astype(np.int32)
    return params, {"input_ids": ids, "labels": labels}


def _mesh():
    import jax

    from olmo_ctl.trainer import sharding as S

    return S.make_mesh(jax.devices()[:8])


def _micro_eval(recipe, plan, params, host):
    """The trainer's path: its batch layout and jitted eval step -> per-micro-batch (CE, tokens)."""
    import jax

    from olmo_ctl.trainer import sharding as S
    from olmo_ctl.trainer import step as ST

    mesh = _mesh()
    try:
        p = jax.device_put(params, S.replicated(mesh))
        batch = ST.eval_device_batch(host, recipe, plan, mesh, local_devices=8)
        with jax.set_mesh(mesh):
            ce, n = jax.device_get(ST.jit_eval_step(recipe)(p, batch))
        return ce, n, [np.asarray(batch["input_ids"])[m] for m in range(len(ce))]
    finally:
        S.deactivate()


def _one_pass(recipe, params, ids, labels):
    """The forward of all `ids` rows at once, as the eval step ran before micro-batches."""
    import jax

    from olmo_ctl.trainer import sharding as S
    from olmo_ctl.trainer import step as ST

    mesh = _mesh()
    try:
        shard = S.batch_sharding(mesh)
        p = jax.device_put(params, S.replicated(mesh))
        x, y = jax.device_put(ids, shard), jax.device_put(labels, shard)
        with jax.set_mesh(mesh):
            ce, _, n = jax.jit(lambda p, x, y: ST.token_losses(p, x, y, recipe.model))(p, x, y)
        return float(ce), float(n)
    finally:
        S.deactivate()


def test_micro_batches_give_the_one_pass_loss(model):
    params, host = model
    r = _recipe("eval.micro_batch=8")
    ce, n, micro_ids = _micro_eval(r, _plan(r), params, host)
    assert len(ce) == 2  # the 16-instance eval batch in two forward passes of 8
    whole_ce, whole_n = _one_pass(r, params, host["input_ids"], host["labels"])
    assert float(np.sum(n, dtype=np.float64)) == whole_n  # token counts are exact
    assert float(np.sum(ce, dtype=np.float64)) == pytest.approx(whole_ce, rel=1e-6)
    # Each micro-batch is reduced as a one-pass forward of its own rows: bit for bit.
    rows = {tuple(row): i for i, row in enumerate(host["input_ids"])}
    for m, ids in enumerate(micro_ids):
        idx = [rows[tuple(row)] for row in ids]
        assert len(set(idx)) == 8
        want_ce, want_n = _one_pass(r, params, host["input_ids"][idx], host["labels"][idx])
        assert np.float32(ce[m]).tobytes() == np.float32(want_ce).tobytes()
        assert n[m] == want_n


def test_one_micro_batch_is_the_one_pass_forward_bit_for_bit(model):
    params, host = model
    r = _recipe("eval.micro_batch=16")
    ce, n, _ = _micro_eval(r, _plan(r), params, host)
    whole_ce, whole_n = _one_pass(r, params, host["input_ids"], host["labels"])
    assert len(ce) == 1 and np.float32(ce[0]).tobytes() == np.float32(whole_ce).tobytes() and n[0] == whole_n


def _eval_temp_bytes(recipe, plan) -> int:
    import jax

    from olmo_ctl.trainer import sharding as S
    from olmo_ctl.trainer import step as ST

    mesh = _mesh()
    try:
        state, _ = ST.abstract_train_state(recipe, mesh)
        batch = ST.abstract_eval_batch(recipe, plan, mesh)
        with jax.set_mesh(mesh):
            compiled = ST.jit_eval_step(recipe).lower(state["params"], batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes
    finally:
        S.deactivate()


def test_the_eval_steps_memory_follows_the_micro_batch_not_the_eval_batch():
    logits_per_instance = 64 * 8192 * 4  # fp32 logits of one instance

    def temps(batch: int, micro: int) -> int:
        r = _recipe(
            "model.vocab_size=8192",
            "model.padded_vocab_size=8192",
            f"eval.batch_size={batch}",
            f"eval.micro_batch={micro}",
        )
        return _eval_temp_bytes(r, _plan(r))

    bounded = temps(16, 8)  # one instance per device per forward pass
    assert temps(64, 8) == bounded  # four times the eval batch, the same memory
    # One pass over 64 instances holds 8 per device: 7 instances' logits more.
    assert temps(64, 64) - bounded >= 7 * logits_per_instance


def test_an_eval_batch_that_is_not_a_multiple_of_the_micro_batch_is_padded_with_ignored_rows(model):
    params, host = model
    real = {k: v[:12] for k, v in host.items()}  # 12 instances over 8 devices
    for micro, passes in ((0, 1), (8, 2)):  # the default pads to one pass of 16; 8 pads to two
        r = _recipe("eval.batch_size=12", f"eval.micro_batch={micro}")
        ce, n, _ = _micro_eval(r, _plan(r), params, real)
        assert len(ce) == passes
        assert float(np.sum(n, dtype=np.float64)) == float(np.sum(real["labels"] != -100))
        whole = _whole_ce(r, params, real)
        assert float(np.sum(ce, dtype=np.float64)) == pytest.approx(whole, rel=1e-6)


def _whole_ce(recipe, params, host) -> float:
    """CE sum of every row of `host`, 4 rows at a time on one device (no padding, no mesh)."""
    import jax

    from olmo_ctl.trainer import step as ST

    f = jax.jit(lambda p, x, y: ST.token_losses(p, x, y, recipe.model)[0])
    ids, labels = host["input_ids"], host["labels"]
    return sum(float(f(params, ids[i : i + 4], labels[i : i + 4])) for i in range(0, len(ids), 4))


def test_the_micro_batch_is_the_train_steps_unless_set():
    r = _recipe()
    assert eval_micro_batch(r, _plan(r, grad_accum=2)) == 8  # train micro-batch 16 / 2
    assert eval_micro_batch(r, _plan(r, grad_accum=1)) == 16
    more = _recipe("eval.batch_size=24")  # 16 would pad 24 to 32; 8 splits it
    assert eval_micro_batch(more, _plan(more, grad_accum=1)) == 8
    odd = _recipe("eval.batch_size=12")  # 8 and 16 both pad to 16: the larger, one pass
    assert eval_micro_batch(odd, _plan(odd, grad_accum=1)) == 16
    few = _recipe("eval.batch_size=4")  # fewer instances than devices: one padded pass over the rows
    assert eval_micro_batch(few, _plan(few, grad_accum=1)) == 8
    assert eval_micro_batch(_recipe("eval.micro_batch=8"), _plan(r, grad_accum=1)) == 8
    with pytest.raises(BadInput, match=r"eval.micro_batch 4 is not a multiple of the 8 data-parallel rows"):
        eval_micro_batch(_recipe("eval.micro_batch=4"), _plan(r))


def test_a_negative_micro_batch_is_refused_by_the_recipe():
    with pytest.raises(BadInput, match="eval.micro_batch"):
        _recipe("eval.micro_batch=-1")


@pytest.mark.chaos
def test_the_trainer_logs_the_same_eval_loss_in_micro_batches_and_refuses_a_bad_one(tmp_path):
    """Real trainer processes on 4 CPU devices: the smoke recipe's 8-instance eval batch in one forward
    pass and in two of 4 log the same `eval/lm_loss`; a micro-batch that does not fit the rows is exit 2."""
    from helpers.trainer import scalars, train

    def eval_loss(name: str, micro: int) -> float:
        run = tmp_path / name
        sets = ("--set", "eval.interval=2", "--set", f"eval.micro_batch={micro}")
        p = train(run, "--stop-at-step", "2", *sets, device="cpu-4")
        assert "eval step 2 lm_loss" in p.stdout
        return float(scalars(run)["eval/lm_loss"][2])

    assert eval_loss("micro", 4) == pytest.approx(eval_loss("one-pass", 8), rel=1e-6)
    p = train(
        tmp_path / "bad", "--stop-at-step", "2", "--set", "eval.micro_batch=2", device="cpu-4", expect=2
    )
    assert "eval.micro_batch 2 is not a multiple of the 4 data-parallel rows of cpu-4" in p.stderr
    assert not (tmp_path / "bad" / "checkpoints").exists() or not any(
        (tmp_path / "bad" / "checkpoints").iterdir()
    )


@pytest.mark.chaos
def test_two_hosts_pad_a_small_eval_batch_and_log_the_one_device_loss(tmp_path):
    """The multi-host twin (2 processes x 2 devices) with an eval batch of 2: each host pads its one
    instance with an ignored row to fill the 4 devices; the loss is that of the unpadded batch on one
    device."""
    from helpers.trainer import scalars, train
    from test_multihost import host_codes, start, wait_ended

    sets = ("--set", "eval.interval=2", "--set", "eval.batch_size=2", "--set", "eval.batches=1")
    train(tmp_path / "one", "--stop-at-step", "2", *sets)
    backend, h = start(tmp_path, "cpu-2x2", 100, "--stop-at-step", "2", *sets, run="two")
    assert wait_ended(backend, h, 300) and host_codes(backend, h) == [0, 0]
    one, two = (float(scalars(tmp_path / r)["eval/lm_loss"][2]) for r in ("one", "two"))
    assert two == pytest.approx(one, rel=1e-5)
