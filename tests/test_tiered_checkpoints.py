"""Tiered checkpoints (OLMo-core's ephemeral_save_interval): the real trainer saves an ephemeral
checkpoint every `checkpoint.ephemeral_interval` steps beside the permanent ones every
`checkpoint.interval`, deletes each only once a later one has committed, trains the same numbers as a
run without them, and a SIGKILL at every point of the deletion window loses nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from helpers.trainer import TAGS, same_steps, scalars, train

from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.trainer.checkpoint import redundant_steps

ROOT = Path(__file__).resolve().parent.parent
# Permanent every 20 steps (the newest one kept), ephemeral every 5: the smoke run's own interval is 20.
TIERED = ("--set", "checkpoint.ephemeral_interval=5", "--set", "checkpoint.keep=1")


def committed(run_dir) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.parametrize(
    "steps,keep,gone",
    [
        ([5], 1, []),  # the newest is never deleted
        ([5, 10], 1, [5]),
        ([20, 25], 1, []),  # a permanent one and the newest
        ([20, 25, 30], 1, [25]),
        ([20, 35, 40], 1, [20, 35]),  # a newer permanent one: the older goes (keep 1)
        ([20, 35, 40], 2, [35]),
        ([20, 40, 45], 0, []),  # keep 0: every permanent one stays
    ],
)
def test_what_a_newer_commit_makes_redundant(steps, keep, gone):
    assert redundant_steps(steps, 20, keep) == gone
    assert redundant_steps(steps, 0, keep) == []  # not tiered: Orbax's own keep applies


def test_an_ephemeral_interval_not_shorter_than_the_permanent_one_is_refused():
    with pytest.raises(BadInput, match="must be shorter than checkpoint.interval"):
        load_recipe("smoke", overrides=["checkpoint.ephemeral_interval=20"])
    fp = load_recipe("smoke").fingerprint()
    assert load_recipe("smoke", overrides=["checkpoint.ephemeral_interval=5"]).fingerprint() == fp


def test_a_tiered_run_keeps_the_newest_and_the_permanent_and_trains_the_same_numbers(tmp_path, smoke_run):
    run = tmp_path / "tiered"
    p = train(run, "--stop-at-step", "40", *TIERED)
    assert committed(run) == [40]  # 20 was permanent, but keep 1 and 40 is newer
    assert "committed step 40" in p.stdout
    got, want = scalars(run), scalars(smoke_run)
    assert same_steps(want, got, range(1, 41)) == []
    # an ephemeral checkpoint was written every 5 steps (each save logs its duration)
    assert sorted(got["checkpoint/save_duration_s"]) == list(range(5, 41, 5))
    p = train(run, "--stop-at-step", "47", *TIERED)  # a stop between two saves: the newest, ephemeral
    assert "restored checkpoint 40" in p.stdout and committed(run) == [40, 47]
    # monitor tells the two apart (the tiers come from run.yaml's recipe)
    (run / "run.yaml").write_text(
        yaml.safe_dump(
            {"run": "tiered", "recipe": load_recipe("smoke", overrides=list(TIERED[1::2])).to_dict()}
        )
    )
    m = subprocess.run(
        [sys.executable, "-m", "olmo_ctl", "monitor", str(run), "-o", "json"], capture_output=True, text=True
    )
    assert m.returncode == 0, m.stderr
    rep = json.loads(m.stdout)
    jsonschema.validate(rep, json.loads((ROOT / "docs" / "monitor-schema.json").read_text()))
    ck = rep["checkpoint"]
    assert (ck["committed_step"], ck["ephemeral"], ck["permanent_step"]) == (47, True, 40)
    t = subprocess.run(
        [sys.executable, "-m", "olmo_ctl", "monitor", str(run)], capture_output=True, text=True
    )
    assert "step 47 (ephemeral; permanent: step 40)" in t.stdout, t.stdout


@pytest.mark.chaos
@pytest.mark.parametrize(
    "at,before",
    [
        ("15:0", 10),  # 10 committed, 5 not yet deleted, 15 not started
        ("15:1", 10),  # 5 deleted, 15 not started
        ("45:1", 40),  # 40 committed: 20 deleted (keep 1), 35 not yet, 45 not started
        ("45:2", 40),  # both deleted, 45 not started
    ],
)
def test_a_kill_anywhere_in_the_deletion_window_loses_nothing(tmp_path, smoke_run, at, before):
    run = tmp_path / "run"
    p = train(run, "--stop-at-step", "45", *TIERED, env={"OLMO_CTL_FAULT_KILL_IN_PRUNE": at}, expect=None)
    assert p.returncode == -9 and "FAULT INJECTION" in p.stdout, p.stdout[-2000:]
    assert committed(run)[-1] == before  # the newest commit survived the kill
    p = train(run, "--stop-at-step", "45", *TIERED)
    assert f"restored checkpoint {before}" in p.stdout
    assert committed(run) == [40, 45]
    got = scalars(run)
    assert same_steps(scalars(smoke_run), got, range(1, 41)) == []
    for tag in TAGS:
        assert sorted(got[tag]) == list(range(1, 46))


def test_a_checkpoint_keeps_the_class_it_was_saved_with_when_the_interval_is_amended(tmp_path):
    """`amend --set checkpoint.interval=15` after permanent 20 / ephemeral 5 to step 30: 20 stays
    (permanent when saved), 30 goes (ephemeral when saved); a checkpoint saved before the class was
    recorded is permanent at a multiple of any interval the run has had."""
    import jax.numpy as jnp

    from olmo_ctl.rundir import checkpoint_intervals, saved_permanent
    from olmo_ctl.trainer.checkpoint import Checkpointer

    d = tmp_path / "checkpoints"
    state = {"w": jnp.arange(4, dtype=jnp.float32)}
    ck = Checkpointer(str(d), keep=0, async_save=False, permanent_every=20)
    for step in range(5, 31, 5):
        ck.save(step, state, {"step": step})
    ck.close()
    assert committed(tmp_path) == [20, 30]
    ck = Checkpointer(str(d), keep=0, async_save=False, permanent_every=15)
    for step in (35, 40):
        ck.save(step, state, {"step": step})
    ck.close()
    assert committed(tmp_path) == [20, 40]

    meta = d / "20" / "meta" / "metadata"  # as a checkpoint written before the class was recorded
    doc = json.loads(meta.read_text())
    assert doc.pop("permanent") is True
    meta.write_text(json.dumps(doc))
    assert not saved_permanent(str(d), 20, (15,))
    run_doc = {
        "recipe": {"checkpoint": {"interval": 20}},
        "amendments": [{"values": {"checkpoint.interval": 15}}],
    }
    assert checkpoint_intervals(run_doc) == (20, 15)
    assert saved_permanent(str(d), 20, checkpoint_intervals(run_doc))
    ck = Checkpointer(str(d), keep=0, async_save=False, permanent_every=15, past_intervals=(20,))
    ck.save(45, state, {"step": 45})
    ck.close()
    assert committed(tmp_path) == [20, 45]
