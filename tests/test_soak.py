"""The soak (tests/helpers/soak.py, benchmarks/soak.py) under the shipped fault timeline: the run
finishes by itself through every fault class, a fallback to v5p-8 and the return; its losses equal an
uninterrupted twin's bit for bit up to the fallback; a step trained twice logs the same loss twice."""

from __future__ import annotations

import pytest
from helpers.soak import load_timeline, run_soak

from olmo_ctl.sandbox.faults import KINDS, parse_fault

STEPS = 200


def test_the_shipped_timeline_holds_every_fault_class_keyed_by_committed_step():
    timeline = load_timeline()
    assert {f["kind"] for f in timeline} == set(KINDS)
    steps = [f["at_step"] for f in timeline]
    assert steps == sorted(steps) and 0 < steps[0] and steps[-1] < STEPS
    for f in timeline:  # what is sent is a fault the sandbox takes
        parse_fault({k: v for k, v in f.items() if k not in ("at_step", "after")})


@pytest.mark.chaos
@pytest.mark.soak  # about ten minutes, its own lane (make test-soak): CI's bound leaves no room for it
@pytest.mark.gcs
def test_the_soak_finishes_by_itself_with_the_twins_losses(tmp_path):
    r = run_soak(tmp_path / "soak", steps=STEPS)
    facts = r.to_dict()
    assert r.rc == 0 and r.twin_rc == 0, f"{facts}\n{r.log_tail}"
    assert r.final_committed == 200, facts
    # Every fault came at its committed step, while the run was going.
    assert not r.unapplied and not r.injector_errors, facts
    assert all(f["committed"] >= f["at_step"] for f in r.faults), facts
    assert r.devices[0] == "v5p-16" and "v5p-8" in r.devices and r.devices[-1] == "v5p-16", facts
    assert r.journal_events.get("fallback") == 1 and r.journal_events.get("returned") == 1, facts
    assert not {"gave_up", "failed"} & set(r.journal_events), facts
    assert r.same_device_equal, r.first_difference
    assert r.replay_mismatches == 0, facts
    # On the v5p-8 the sums are ordered otherwise: its first step differs by rounding only.
    assert r.diff_first_step_after_fallback is not None and r.diff_first_step_after_fallback < 1e-5, facts
    assert r.max_diff_after_fallback is not None and r.max_diff_after_fallback < 1e-2, facts
    assert 0 < r.goodput < 1 and sum(r.lost_s.values()) + r.train_s == pytest.approx(r.wall_s, rel=1e-6)
    # `monitor -o json` of the same run: every second in one bucket, the host event's outage as recovery
    gp = r.monitor_goodput
    assert abs(gp["productive_s"] + sum(gp["buckets"].values()) - gp["wall_s"]) < 1.0, facts
    assert abs(gp["productive_s"] + sum(gp["lost_s"].values()) - gp["wall_s"]) < 1.0, facts
    assert gp["buckets"]["infrastructure_recovery"] > 0, facts
