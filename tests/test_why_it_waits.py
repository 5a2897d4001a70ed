"""Why a run waits: `runs` and `monitor` print what holds its live attempt in one line, from the
backend's typed status: Kueue's pending reason (too little quota left), the scheduler's (no node
fits the pods), the kubelet's (an image pull backing off).

Each cause is set up in the sandbox cluster (`olmo_ctl.sandbox`) as a cause, never as an outcome: a
second run on a queue whose quota the first run holds, a pool whose nodes are gone, a registry that
answers 429. The attempts are submitted with `olmo-ctl submit` and never need a trainer.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import pytest

from olmo_ctl.backends.base import AttemptStatus, Hold, State
from olmo_ctl.observe.waiting import wait_of

IMAGE = "us-docker.pkg.dev/p/r/olmo-ctl:0.1.0"
DEVICE = "v5p-8"
SCHEMA = json.loads((Path(__file__).resolve().parent.parent / "docs" / "monitor-schema.json").read_text())


def _cli(capsys, *argv: str) -> tuple[int, str]:
    from olmo_ctl.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    return rc, capsys.readouterr().out


@pytest.fixture
def sandbox(tmp_path, monkeypatch, gcs):
    """The sandbox cluster with one v5p-8 slice, kubectl's environment pointed at it, and a run root
    on the GCS emulator."""
    from olmo_ctl.sandbox.sandbox import Sandbox

    for k in [k for k in os.environ if k.startswith("OLMO_CTL_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    with Sandbox(slices={DEVICE: 1}) as sb:
        monkeypatch.setenv("KUBECONFIG", str(sb.write_kubeconfig(tmp_path / "kubeconfig")))
        yield sb, f"gs://{gcs.bucket}/runs"


def submit(capsys, root: str, run: str) -> None:
    rc, out = _cli(
        capsys,
        *("submit", "--recipe", "smoke", "--device", DEVICE, "--run", run, "--run-root", root),
        *("--backend", "gke", "--no-preflight", "--image", IMAGE),
    )
    assert rc == 0, out


def shown(capsys, root: str, run: str) -> tuple[dict, str, dict, str]:
    """(runs -o json's row, runs' table, monitor -o json's attempt.waiting, monitor's table) of `run`."""
    rc, out = _cli(capsys, "runs", "--run-root", root, "-o", "json")
    assert rc == 0, out
    (row,) = [r for r in json.loads(out)["runs"] if r["name"] == run]
    rc, table = _cli(capsys, "runs", "--run-root", root)
    assert rc == 0, table
    rc, out = _cli(capsys, "monitor", f"{root}/{run}", "-o", "json")
    assert rc == 0, out
    rep = json.loads(out)
    jsonschema.validate(rep, SCHEMA)
    rc, text = _cli(capsys, "monitor", f"{root}/{run}")
    assert rc == 0, text
    return row, table, rep["attempt"]["waiting"], " ".join(text.replace("│", " ").split())


def under_its_row(table: str, run: str) -> str:
    """The line `runs` prints under `run`'s row."""
    lines = table.splitlines()
    (i,) = [i for i, ln in enumerate(lines) if ln.split()[:1] == [run]]
    assert lines[i + 1].startswith("  └ "), table
    return lines[i + 1][4:]


def check(capsys, root: str, run: str, state: str, cause: str, kind: str, line: str) -> str:
    row, table, mon, text = shown(capsys, root, run)
    assert row["state"] == state, row
    w = row["waiting"]
    assert (w["cause"], w["kind"]) == (cause, kind), w
    assert w["line"].startswith(line), w["line"]
    assert "\n" not in w["line"]
    assert w["since"] and w["seconds"] is not None and w["reason"]
    assert under_its_row(table, run) == w["line"]
    assert {k: mon[k] for k in ("cause", "kind", "line", "since")} == {
        k: w[k] for k in ("cause", "kind", "line", "since")
    }
    assert f"waiting {w['line']}; since {w['since']}" in text, text
    return w["line"]


def test_a_run_held_by_quota_says_kueue_has_too_little_left(sandbox, capsys):
    """The queue's quota is one v5p-8 slice (and its node's CPU and memory) and the first run holds
    it: the second waits for quota, in Kueue's words."""
    sb, root = sandbox
    submit(capsys, root, "first")
    submit(capsys, root, "second")
    line = check(capsys, root, "second", "queued", "queued", "quota", "waiting for quota: ")
    assert re.search(r"insufficient unused quota for (google\.com/tpu|cpu|memory) in flavor", line), line
    assert line.endswith("(Kueue)"), line
    row, _, _, _ = shown(capsys, root, "first")
    assert row["waiting"] is None  # the first one is not held


def test_a_run_whose_pods_no_node_fits_says_the_scheduler_s_reason(sandbox, capsys):
    """Quota is there but the pool has no node left: Kueue admits, the scheduler cannot place the pods."""
    from olmo_ctl.sandbox.faults import parse_fault

    sb, root = sandbox
    sb.fault(parse_fault({"kind": "capacity", "pool": f"{DEVICE}-np-0", "nodes": 0}))
    submit(capsys, root, "nonodes")
    line = check(capsys, root, "nonodes", "admitted", "unschedulable", "unschedulable", "unschedulable: 0/")
    assert "nodes are available" in line and line.endswith("(scheduler)"), line


def test_a_run_whose_image_pull_backs_off_names_the_image(sandbox, capsys):
    """The registry answers 429: the kubelet backs off pulling the image."""
    from olmo_ctl.sandbox.faults import parse_fault

    sb, root = sandbox
    sb.fault(parse_fault({"kind": "image-pull", "image-error": "transient"}))
    submit(capsys, root, "pull")
    line = check(capsys, root, "pull", "admitted", "image-pull", "image-pull", "image pull back-off: ")
    assert line == f"image pull back-off: {IMAGE} (kubelet)", line


def test_the_line_is_the_hold_in_one_line_and_only_while_live():
    hold = Hold("unschedulable", "0/2 nodes are available:\n 2 Insufficient google.com/tpu.", "scheduler")
    st = AttemptStatus(State.ADMITTED, "Unschedulable: pod p: ...", hold=hold)
    assert wait_of(st) == (
        "unschedulable",
        "unschedulable",
        "unschedulable: 0/2 nodes are available: 2 Insufficient google.com/tpu. (scheduler)",
    )
    assert wait_of(AttemptStatus(State.RUNNING, "2/2 pods running")) is None
    assert wait_of(AttemptStatus(State.FAILED_INFRA, "x", hold=hold)) is None
    assert wait_of(None) is None


def test_a_wait_only_the_journal_knows_is_printed_from_it(tmp_path):
    """--no-backend-status: the supervisor's journaled wait in progress, marked as the journal's."""
    from olmo_ctl.observe.monitor import live_attempt_of

    journal = [
        {"time": "2026-01-01T00:00:00+00:00", "event": "submitted", "attempt": 1, "device": DEVICE},
        {
            "time": "2026-01-01T00:01:00+00:00",
            "event": "waiting",
            "attempt": 1,
            "cause": "unschedulable",
            "reason": "Unschedulable: pod p: 0/1 nodes are available",
        },
    ]
    live = live_attempt_of(str(tmp_path), journal, None, now=1767225720.0)  # 01:02
    assert live["waiting"] == {
        "cause": "unschedulable",
        "since": "2026-01-01T00:01:00+00:00",
        "seconds": 60.0,
        "reason": "Unschedulable: pod p: 0/1 nodes are available",
        "kind": None,
        "line": "waiting for capacity (unschedulable): Unschedulable: pod p: 0/1 nodes are available (journal)",
    }


def _workload(*conditions: dict, checks: tuple = ()) -> dict:
    return {
        "metadata": {"name": "jobset-w-a1-0"},
        "spec": {"active": True},
        "status": {"conditions": list(conditions), "admissionChecks": list(checks)},
    }


@pytest.mark.parametrize(
    "workload, line",
    [
        (
            _workload(
                {
                    "type": "QuotaReserved",
                    "status": "False",
                    "reason": "Pending",
                    "message": "couldn't assign flavors to pod set slice: flavor 1xv5p-8 doesn't match node affinity",
                }
            ),
            "no flavor fits: flavor 1xv5p-8 doesn't match node affinity (Kueue)",
        ),
        (
            _workload(
                {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved"},
                {"type": "Admitted", "status": "False", "reason": "Pending"},
                checks=(
                    {"name": "dws-prov", "state": "Pending", "message": "Waiting for ProvisioningRequest"},
                ),
            ),
            "waiting for admission checks: dws-prov: Pending (Waiting for ProvisioningRequest) (Kueue)",
        ),
    ],
)
def test_kueue_s_other_reasons_are_named_in_one_line(workload, line):
    from olmo_ctl.backends.gke_status import classify

    jobset = {"metadata": {"name": "w-a1"}, "spec": {"suspend": True}, "status": {}}
    st = classify(jobset, workload)
    assert st.state == State.QUEUED and wait_of(st) is not None
    assert wait_of(st)[2] == line
