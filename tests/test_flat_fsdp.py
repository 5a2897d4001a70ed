"""FSDP on the CPU with one gather and one gradient reduction a step (trainer/flat_fsdp.py), against the
partitioner's own per-parameter collectives: the same training, the same state layout, far fewer
collectives."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.trainer import attention, flat_fsdp, sharding
from olmo_ctl.trainer.step import abstract_train_state, fresh_state, jit_train_step, micro_batch_sharding

QUICK_COMPILES = True  # small programs compiled a few times: tests/conftest.py::_quick_compiles


def _batch(recipe, mesh, accum, segments):
    t, m = recipe.train, recipe.model
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, m.vocab_size, size=(t.global_batch, t.seq_len + 1), dtype=np.int32)
    shape = (accum, t.global_batch // accum, t.seq_len)
    batch = {"input_ids": tokens[:, :-1].reshape(shape), "labels": tokens[:, 1:].reshape(shape).copy()}
    batch["labels"][0, 0, :5] = -100  # some ignored labels
    if segments:  # packed documents: ids rise at random boundaries
        batch["segment_ids"] = np.cumsum(rng.random(shape) < 0.05, axis=-1).astype(np.int32)
    shard = micro_batch_sharding(mesh)
    return {k: jax.device_put(v, shard) for k, v in batch.items()}


def _train(devices, kind, dp, *, flat, monkeypatch, accum=1, segments=False, steps=3):
    """(per-step CE, final params, the compiled step's collectives) of `steps` smoke-model steps."""
    recipe = load_recipe("smoke", overrides=["train.global_batch=8"])
    mesh = sharding.make_mesh(devices, kind, dp)
    try:
        with monkeypatch.context() as m:
            if not flat:
                m.setattr(flat_fsdp, "applies", lambda params: False)
            _, shard = abstract_train_state(recipe, mesh)
            state = fresh_state(recipe, shard)
            assert flat_fsdp.applies(state["params"]) is flat
            batch = _batch(recipe, mesh, accum, segments)
            step = jit_train_step(recipe, shard)
            hlo = step.lower(state, batch).compile().as_text()
            ces = []
            for _ in range(steps):
                state, metrics = step(state, batch)
                ces.append(float(metrics["ce"]))
    finally:
        sharding.deactivate()
    collectives = {
        op: len(re.findall(rf" {op}(?:-start)?\(", hlo))
        for op in ("all-gather", "reduce-scatter", "all-reduce")
    }
    shards = {str(s.index) for s in state["params"]["blocks"]["mlp"]["w1"].addressable_shards}
    return ces, jax.tree.map(np.asarray, state["params"]), collectives, len(shards)


def _assert_same_training(a, b):
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1]), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)


@pytest.mark.parametrize(
    "n,kind,dp,accum,segments",
    [
        (2, "fsdp", 1, 1, False),  # the local twin on a 2-core machine: cpu-2
        # 2 replicas x 2 shards (the gradients also summed over "data"), two micro-batches accumulated,
        # packed documents
        pytest.param(4, "hybrid", 2, 2, True, marks=pytest.mark.chaos),  # more compiles: the chaos lane
    ],
)
def test_flat_collectives_train_as_the_partitioner_does_with_one_gather_and_one_reduction(
    monkeypatch, n, kind, dp, accum, segments
):
    devices = jax.devices()[:n]
    flat = _train(devices, kind, dp, flat=True, monkeypatch=monkeypatch, accum=accum, segments=segments)
    gspmd = _train(devices, kind, dp, flat=False, monkeypatch=monkeypatch, accum=accum, segments=segments)
    print(f"{n} devices {kind}: collectives flat {flat[2]}, partitioner {gspmd[2]}")
    _assert_same_training(flat, gspmd)
    assert flat[0][-1] < flat[0][0]  # it trains
    assert flat[3] == gspmd[3] == n // dp  # the state stays FSDP-sharded
    assert flat[2]["all-gather"] == 1 and flat[2]["all-reduce"] <= 3
    assert gspmd[2]["all-gather"] > 10  # the check can tell the two apart


def test_flat_collectives_apply_only_to_a_cpu_step_on_more_than_one_fsdp_device(monkeypatch):
    params = {"w": jax.numpy.zeros((4, 4))}
    for devices, kind, dp, seq, want in [
        (jax.devices()[:2], "fsdp", 1, 1, True),
        (jax.devices()[:1], "fsdp", 1, 1, False),  # nothing to gather
        (jax.devices()[:2], "hybrid", 2, 1, False),  # data parallel: the partitioner's two all-reduces
        (jax.devices()[:4], "fsdp", 1, 2, False),  # sequence shards: the partitioner's layout
    ]:
        sharding.make_mesh(devices, kind, dp, seq_shards=seq)
        try:
            assert flat_fsdp.applies(params) is want, (len(devices), kind, dp, seq)
            with attention.compile_target("tpu", "v5p"):  # a slice preflight compiles for: never
                assert flat_fsdp.applies(params) is False
        finally:
            sharding.deactivate()
    sharding.make_mesh(jax.devices()[:2])
    try:
        mixed = {"w": jax.numpy.zeros((4, 4)), "b": jax.numpy.zeros((4,), jax.numpy.bfloat16)}
        assert flat_fsdp.applies(mixed) is False  # one flat vector needs one dtype
        assert flat_fsdp.applies({"w": jax.numpy.zeros((3, 7))}) is False  # no axis divides: replicated
        with monkeypatch.context() as m:
            m.setattr(jax, "process_count", lambda: 2)
            assert flat_fsdp.applies(params) is False  # the multi-host twin: the partitioner's, as on a slice
        monkeypatch.setattr(flat_fsdp, "MAX_PARAM_BYTES", 4 * 4 * 4 - 1)
        assert flat_fsdp.applies(params) is False  # a model too large to hold whole on every device
    finally:
        sharding.deactivate()
    assert flat_fsdp.applies(params) is False  # no mesh
