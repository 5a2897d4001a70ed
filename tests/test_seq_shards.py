"""Sequence sharding (context parallelism) and document masking.

- The plan shards sequences when a slice has more devices than instances (stage 3 on tpu7x-128).
- One whole training step on 8 forced host devices with each sequence split 2 and 4 ways gives the
  unsharded step's loss, gradient norm and gradients to fp32 rounding, with packed documents.
- Attention never crosses a document: changing one document of a packed instance leaves the logits
  of the others unchanged, and each document's logits equal the document run alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from olmo_ctl.core import batching
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe

QUICK_COMPILES = True  # small programs compiled once or twice: tests/conftest.py::_quick_compiles


@pytest.mark.parametrize(
    "stage,device", [(3, "tpu7x-128"), (3, "v5p-256"), (1, "tpu7x-1024"), (2, "tpu7x-512")]
)
def test_plan_shards_sequences_when_devices_outnumber_instances(stage, device):
    r = load_recipe(stage=stage)
    p = batching.make_plan(r, get_device(device))
    assert p.seq_shards > 1
    assert p.per_device_batch * p.grad_accum * p.devices == p.global_batch * p.seq_shards
    assert p.data_parallel * p.seq_shards == p.devices
    assert p.global_batch == r.train.global_batch


def test_plan_keeps_whole_sequences_when_it_can_and_checks_a_fixed_seq_shards():
    p = batching.make_plan(load_recipe(stage=1), get_device("tpu7x-128"))
    assert p.seq_shards == 1 and p.data_parallel == 128
    r = load_recipe("smoke", overrides=["train.seq_shards=2"])
    p = batching.make_plan(r, get_device("cpu-4"))
    assert (p.seq_shards, p.data_parallel, p.per_device_batch * p.grad_accum) == (2, 2, 4)
    with pytest.raises(BadInput, match="train.seq_shards 4 does not fit cpu-2"):
        batching.make_plan(load_recipe("smoke", overrides=["train.seq_shards=4"]), get_device("cpu-2"))
    with pytest.raises(BadInput, match="must divide train.seq_len"):
        load_recipe("smoke", overrides=["train.seq_shards=3"])


def _sharded_step_against_unsharded(impl: str, shards: tuple[int, ...], model: tuple[str, ...] = ()) -> dict:
    """One training step on 1 device and on 8 of this process's host devices (tests/conftest.py) with
    each sequence split s ways, for s in `shards`; `model` overrides the smoke model."""
    import jax

    from olmo_ctl.trainer import model as M
    from olmo_ctl.trainer import sharding as S
    from olmo_ctl.trainer import step as ST

    assert jax.device_count() >= 8, "needs 8 host devices (tests/conftest.py sets jax_num_cpu_devices)"
    r = load_recipe(
        "smoke",
        overrides=[
            "train.seq_len=64",
            "train.global_batch=8",
            "model.sliding_window=16",
            f"model.attention={impl}",
            *model,
        ],
    )
    cfg = r.model
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (2, 4, 64)).astype(np.int32)  # [accum, micro, T]
    seg = np.sort(rng.integers(0, 4, (2, 4, 64)), axis=-1).astype(np.int32)  # packed documents
    labels = np.where(rng.random((2, 4, 64)) < 0.1, -100, np.roll(ids, -1, -1)).astype(np.int32)
    host = {"input_ids": ids, "labels": labels, "segment_ids": seg}

    def run(seq_shards):
        devs = jax.devices()[: 8 if seq_shards else 1]
        mesh = S.make_mesh(devs, seq_shards=max(seq_shards, 1))
        try:
            state, shard = ST.abstract_train_state(r, mesh)
            st = jax.jit(lambda p: ST.init_state(r, p), out_shardings=shard)(params)
            batch = {k: jax.device_put(v, ST.micro_batch_sharding(mesh)) for k, v in host.items()}
            with jax.set_mesh(mesh):
                new, m = jax.jit(ST.make_train_step(r), out_shardings=(shard, None))(st, batch)
        finally:
            S.deactivate()
        # the first Adam moment is (1 - beta1) x the clipped gradient: compare gradients, not the
        # parameters (Adam's first update is ~lr x sign(g), which rounding can flip where g ~ 0)
        return mesh, batch, jax.device_get(new["opt"]["mu"]), {k: float(v) for k, v in m.items()}

    _, _, want_p, want_m = run(0)
    out = {}
    for s in shards:
        mesh, batch, got_p, got_m = run(s)
        out[s] = {
            "mesh": dict(mesh.shape),
            "ids_shard": list(batch["input_ids"].addressable_shards[0].data.shape),
            "ce": [want_m["ce"], got_m["ce"]],
            "gn": [want_m["grad_norm"], got_m["grad_norm"]],
            "grad_rel_diff": max(
                float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
                for a, b in zip(jax.tree.leaves(got_p), jax.tree.leaves(want_p), strict=True)
            ),
        }
    return out


@pytest.mark.parametrize("impl,shards", [("reference", (2, 4)), ("blocked", (4,))])
def test_sequence_sharded_step_matches_the_unsharded_step(impl, shards):
    out = _sharded_step_against_unsharded(impl, shards)
    assert sorted(out) == sorted(shards)
    for s, res in out.items():
        assert res["mesh"] == {"data": 1, "fsdp": 8 // s, "seq": s}
        assert res["ids_shard"] == [2, 4 // (8 // s), 64 // s]  # each device holds 1/s of its instances
        ce_w, ce_g = res["ce"]
        assert abs(ce_w - ce_g) <= 2e-6 * abs(ce_w), res
        gn_w, gn_g = res["gn"]
        assert abs(gn_w - gn_g) <= 1e-5 * abs(gn_w), res
        assert res["grad_rel_diff"] < 1e-5, res


# OLMo 2 32B's layout at smoke size: 40 query heads over 8 KV heads scaled to 10 over 2 (head_dim 8),
# every layer full attention.
OLMO2_GQA = (
    "model.n_heads=10",
    "model.n_kv_heads=2",
    "model.head_dim=8",
    "model.architecture=olmo2",
    "model.full_attention_every=1",
    "model.sliding_window=0",
)


def test_sequence_sharding_at_the_32b_head_ratio():
    """Sequence shards split the heads: 2 shards give each device 5 query heads and 1 KV head."""
    out = _sharded_step_against_unsharded("blocked", (2,), OLMO2_GQA)
    res = out[2]
    assert res["mesh"] == {"data": 1, "fsdp": 4, "seq": 2}
    ce_w, ce_g = res["ce"]
    assert abs(ce_w - ce_g) <= 2e-6 * abs(ce_w), res
    assert res["grad_rel_diff"] < 1e-5, res


def _tiny():
    import jax

    from olmo_ctl.trainer import model as M

    cfg = load_recipe(
        "smoke", overrides=["train.seq_len=64", "model.sliding_window=16", "model.compute_dtype=float32"]
    ).model
    return cfg, M.init_params(cfg, jax.random.PRNGKey(3))


@pytest.mark.parametrize("impl", ["reference", "blocked"])
def test_attention_never_crosses_a_document(impl):
    import jax.numpy as jnp

    from olmo_ctl.trainer import model as M
    from olmo_ctl.trainer.packed import segment_ids

    cfg, params = _tiny()
    eos = cfg.eos_token_id
    rng = np.random.default_rng(5)
    docs = [np.append(rng.integers(0, 256, n), eos) for n in (20, 9, 30)]
    packed = np.concatenate(docs + [np.full(64 - sum(map(len, docs)), cfg.pad_token_id)])
    seg = segment_ids(packed, eos)
    changed = packed.copy()
    changed[21:29] = rng.integers(0, 256, 8)  # the second document's tokens
    logits = M.forward(
        params,
        jnp.asarray(np.stack([packed, changed])),
        cfg,
        attention=impl,
        segment_ids=jnp.asarray(np.stack([seg, seg])),
    )
    a, b = np.asarray(logits[0]), np.asarray(logits[1])
    first, third = slice(0, 21), slice(31, 62)
    assert np.array_equal(a[first], b[first]) and np.array_equal(a[third], b[third])
    assert np.abs(a[21:30] - b[21:30]).max() > 1e-3  # the changed document itself did move
    # each document equals the document run alone (RoPE is relative: only rounding differs)
    start = 0
    for d in docs:
        alone = np.asarray(M.forward(params, jnp.asarray(d[None]), cfg, attention=impl))[0]
        np.testing.assert_allclose(a[start : start + len(d)], alone, atol=2e-4, rtol=0)
        start += len(d)
    # without segment ids the third document does see the others
    plain = np.asarray(M.forward(params, jnp.asarray(packed[None]), cfg, attention=impl))[0]
    assert np.abs(plain[third] - a[third]).max() > 1e-3


PACKED = (
    "--set",
    "data.packed=true",
    "--set",
    "data.source_group_size=2",
    "--set",
    "checkpoint.interval=3",
    "--set",
    "eval.interval=3",
)


@pytest.mark.chaos
def test_local_run_with_seq_shards_trains_resumes_bitwise_and_matches_unsharded(tmp_path):
    """The real trainer on cpu-4 over packed smoke data: seq_shards 2 against 1 (the plan's choice, FSDP
    over the 4 devices). Each resumes from checkpoint 3 bit for bit; the FSDP one with background
    prefetch workers."""
    from helpers.trainer import resume_copy, same_steps, scalars, train

    a = tmp_path / "a"
    first = train(a, "--stop-at-step", "6", "--set", "train.seq_shards=2", *PACKED, device="cpu-4")
    assert "committed step 6" in first.stdout
    b = resume_copy(a, 3, tmp_path / "b")
    second = train(b, "--stop-at-step", "6", "--set", "train.seq_shards=2", *PACKED, device="cpu-4")
    assert "restored checkpoint 3" in second.stdout
    A, B = scalars(a), scalars(b)
    assert same_steps(A, B, range(4, 7)) == []  # bit for bit after the resume
    c = tmp_path / "c"
    train(c, "--stop-at-step", "6", *PACKED, device="cpu-4")
    C = scalars(c)
    for s in range(1, 7):
        ce_a, ce_c = float(A["train/CE loss"][s]), float(C["train/CE loss"][s])
        assert abs(ce_a - ce_c) <= 1e-5 * abs(ce_c), (s, ce_a, ce_c)
    d = resume_copy(c, 3, tmp_path / "d")
    p = train(d, "--stop-at-step", "6", "--set", "data.prefetch_workers=2", *PACKED, device="cpu-4")
    assert "on cpu-4" in p.stdout and "restored checkpoint 3" in p.stdout
    assert same_steps(C, scalars(d), range(4, 7)) == []
