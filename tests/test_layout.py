"""One rule for what a layout may be, applied by the plan (so by `plan`, `preflight`, `submit`, `resize`
and the trainer, which all call `batching.make_plan`): every trainer process loads an equal share of
whole instances, and a sequence-shard group never spans hosts. A layout the trainer would refuse on
the slice is refused at plan time, exit 2, with the reason."""

from __future__ import annotations

import json

import pytest
from helpers.cli import clean_env, invoke

from olmo_ctl.core.batching import make_plan
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe


@pytest.mark.parametrize("device,hosts", [("v5p-1024", 128), ("tpu7x-1024", 128), ("tpu7x-2048", 256)])
def test_stage3_on_more_hosts_than_instances_is_refused_at_plan_time(device, hosts, tmp_path):
    # stage 3's global batch of 64 splits over these devices by sharding each sequence, but the loader
    # hands each of the slice's hosts whole instances: 64 over 128 or 256 hosts does not go.
    r = invoke("plan", "--stage", "3", "--device", device, env=clean_env(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and r.stdout == ""
    assert (
        f"global batch 64 cannot be loaded by the {hosts} trainer processes (hosts) of {device}" in lines[0]
    )
    assert "at most 64 hosts" in lines[0]


def test_submit_refuses_the_same_layout_before_rendering_a_jobset(tmp_path):
    r = invoke("submit", "--stage", "3", "--device", "v5p-1024", "--dry-run", env=clean_env(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    assert "cannot be loaded by the 128 trainer processes" in r.stderr


def test_a_sequence_shard_group_that_would_span_hosts_is_refused():
    twin = get_device("cpu-2x2")  # 2 hosts of 2 devices
    with pytest.raises(BadInput) as e:
        make_plan(load_recipe("smoke", overrides=["train.seq_shards=4"]), twin)
    assert e.value.one_line().startswith(
        "train.seq_shards 4 on cpu-2x2: a sequence-shard group of 4 devices would span hosts "
        "(each host of cpu-2x2 has 2)"
    )
    # within a host it is a layout like any other
    p = make_plan(load_recipe("smoke", overrides=["train.seq_shards=2"]), twin)
    assert (p.seq_shards, p.devices, p.data_parallel) == (2, 4, 2)
    # on one host the same 4-way split is allowed
    assert (
        make_plan(load_recipe("smoke", overrides=["train.seq_shards=4"]), get_device("cpu-4")).seq_shards == 4
    )


def test_the_plans_own_choice_of_seq_shards_stays_within_a_host():
    for stage in (1, 2, 3):
        recipe = load_recipe(stage=stage)
        for name in ("v5p-256", "v5p-512", "tpu7x-256", "tpu7x-512"):
            dev = get_device(name)
            p = make_plan(recipe, dev)
            assert dev.devices_per_process % p.seq_shards == 0, (stage, name, p.seq_shards)


def test_an_eval_batch_the_hosts_cannot_share_is_refused_with_its_key(tmp_path):
    r = invoke(
        "plan",
        "--recipe",
        "smoke",
        "--device",
        "cpu-2x2",
        "--set",
        "eval.batch_size=3",
        env=clean_env(tmp_path),
    )
    assert r.returncode == 2 and "eval batch 3 cannot be loaded by the 2 trainer processes" in r.stderr
    assert "eval.batch_size" in r.stderr


def test_a_multislice_sequence_shard_group_that_would_span_hosts_is_refused_at_plan_time(tmp_path):
    """2 x v5p-16 (4 hosts of 4 devices): 8-way sequence shards fit every other rule (16 devices, heads
    8), but a group of 8 would need two hosts; plan refuses it with exit 2 before anything runs."""
    args = ["--recipe", "smoke", "--device", "v5p-16", "--slices", "2"]
    wide = ["--set", "model.n_heads=8", "--set", "model.n_kv_heads=8", "--set", "train.seq_shards=8"]
    r = invoke("plan", *args, *wide, env=clean_env(tmp_path))
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.count("\n") == 1
    assert r.stderr.startswith(
        "error: train.seq_shards 8 on 2 x v5p-16: a sequence-shard group of 8 devices would span hosts "
        "(each host of v5p-16 has 4)"
    )
    assert "choose one of 1, 2, 4, or 0" in r.stderr
    # 4 (one host's devices) is a layout like any other, and the plan's own choice stays within a host
    ok = invoke(
        "plan", *args, *wide[:4], "--set", "train.seq_shards=4", "-o", "json", env=clean_env(tmp_path)
    )
    assert ok.returncode == 0, ok.stderr
    own = invoke("plan", *args, "-o", "json", env=clean_env(tmp_path))
    assert json.loads(own.stdout)["seq_shards"] == 2  # global batch 8 over 16 devices: each instance on 2
