"""Waiting for capacity is not failing (issue 19, items 1 and 6): resume-until-done with the GKE
backend against the sandbox cluster (nodes, Kueue, JobSet, Jobs under upstream's rules), on a fake
clock that also moves the cluster's clock, so hours of outage take a second or two.

The causes are the sandbox's faults (`sandbox.faults.parse_fault`, what `olmo-ctl sandbox fault`
sends); what the pods, Jobs, JobSets and Workloads do follows from the rules. The test plays the
trainer by committing checkpoints into the run directory.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import jsonschema
import pytest
from rich.console import Console

from olmo_ctl.backends.gke import GKEBackend
from olmo_ctl.backends.kube import KubeRetryPolicy
from olmo_ctl.cli.monitor import render
from olmo_ctl.core.config import Settings
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.observe.monitor import build_report, load
from olmo_ctl.rundir import COMMIT_MARKER, RunDir
from olmo_ctl.sandbox.cluster.objects import find_cond
from olmo_ctl.sandbox.faults import parse_fault
from olmo_ctl.sandbox.sandbox import Sandbox
from olmo_ctl.supervise.policy import RetryPolicy
from olmo_ctl.supervise.supervisor import Printer, Supervisor

FAST = KubeRetryPolicy(base_s=0.01, max_s=0.05, budget_s=3.0, connect_timeout_s=1.0, read_timeout_s=5.0)
SCHEMA = json.loads((Path(__file__).resolve().parent.parent / "docs" / "monitor-schema.json").read_text())
DEVICE = "tpu7x-8"
POOL = f"{DEVICE}-np-0"


class Clock:
    """The supervisor's clock and sleep; each sleep moves the sandbox's world on as much and runs
    the script: [(seconds after the first sleep, action(clock))]."""

    def __init__(self, sb: Sandbox, script: list):
        self.sb, self.script = sb, sorted(script, key=lambda a: a[0])
        self.t = 1_800_000_000.0
        self.t0: float | None = None
        self.seen: list[dict] = []  # what the cluster showed at each sleep (for assertions)

    def time(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t0 = self.t if self.t0 is None else self.t0
        self.t += s
        self.sb.world.advance(s)
        while self.script and self.t - self.t0 >= self.script[0][0]:
            self.script.pop(0)[1](self)

    def fault(self, **keys) -> str:
        return self.sb.fault(parse_fault(keys))


@pytest.fixture
def sandbox():
    with Sandbox(slices={DEVICE: 1}) as sb:
        yield sb


def setup(tmp_path, sb, bucket, steps=20):
    rd = RunDir.of(f"gs://{bucket}/{tmp_path.name}", "wt")
    r = load_recipe("smoke", overrides=[f"train.max_steps={steps}"])
    rd.create_run(r.to_dict(), r.fingerprint(), "fp", DEVICE)
    settings = Settings(
        image="registry.example.com/olmo-ctl:test", run_root=f"gs://{bucket}", queue="multislice-queue"
    )
    return rd, GKEBackend(namespace="default", host=sb.url, retry=FAST, settings=settings)


def supervise(rd, be, clock, **policy):
    buf = io.StringIO()
    sup = Supervisor(
        rd,
        be,
        RetryPolicy(**policy),
        poll_s=60,
        clock=clock.time,
        sleep=clock.sleep,
        printer=Printer(rd.name, stream=buf, clock=clock.time),
    )
    return sup.run(), buf.getvalue()


def commit(rd: RunDir, step: int) -> None:
    rd.store.write_bytes(rd.p("checkpoints", str(step), "state", "x"), b"x")
    rd.store.write_bytes(rd.p("checkpoints", str(step), COMMIT_MARKER), b"ok")


def pods(sb: Sandbox) -> list[dict]:
    """Copies of the attempt's pods as they are now."""
    return copy.deepcopy(
        [p for p in sb.world.items("Pod", "default") if p["metadata"]["name"].startswith("wt-a1-")]
    )


def live_pod(sb: Sandbox) -> dict:
    (p,) = [
        p
        for p in pods(sb)
        if p["status"].get("phase") in ("Pending", "Running") and not p["metadata"].get("deletionTimestamp")
    ]
    return p


def finish(c: Clock, rd: RunDir) -> None:
    commit(rd, 20)
    c.sb.server.cluster.complete("wt-a1")


def waits(rd: RunDir) -> list[tuple]:
    return [
        (r["event"], r["cause"], r.get("seconds"))
        for r in rd.journal()
        if r["event"] in ("waiting", "waited")
    ]


@pytest.mark.chaos
def test_a_capacity_outage_longer_than_admission_timeout_times_retries_is_waited_out(tmp_path, sandbox, gcs):
    """The pool loses its nodes for 3 h (admission timeout 600 s x 2 retries is 20 min): the pods are
    deleted by pod GC (DisruptionTarget DeletionByPodGC), the Job's Ignore rule replaces them, the
    replacement stays Unschedulable while the Workload keeps its quota. One wait, no retry spent, the
    same attempt runs on when the nodes are back and the run finishes."""
    rd, be = setup(tmp_path, sandbox, gcs.bucket)
    seen: dict = {}

    def outage(c: Clock) -> None:
        commit(rd, 10)
        seen["before"] = live_pod(c.sb)["metadata"]["uid"]
        c.fault(kind="capacity", pool=POOL, nodes=0, **{"for": "3h"})
        seen["nodes"] = len(c.sb.world.items("Node", None))

    def during(c: Clock) -> None:
        seen["pending"] = live_pod(c.sb)
        seen["report"] = build_report(load(rd.path), now=c.t, ask_backend=False)

    clock = Clock(sandbox, [(600, outage), (3600, during), (3 * 3600 + 1800, lambda c: finish(c, rd))])
    rc, out = supervise(rd, be, clock, backoff_base_s=60, max_retries=2, admission_timeout_s=600)
    assert rc == 0, out
    assert seen["nodes"] == 0
    # Pod GC removed the pod of the deleted node; the Job's Ignore rule (DisruptionTarget
    # DeletionByPodGC) replaced it without a JobSet restart, and the replacement waits for a node.
    assert seen["pending"]["metadata"]["uid"] != seen["before"]
    assert find_cond(seen["pending"], "PodScheduled")["reason"] == "Unschedulable"
    assert (sandbox.server.cluster.jobset("wt-a1")["status"].get("restarts") or 0) == 0
    # monitor, during the outage: the state, since when, why (in -o json, and in its table)
    rep = seen["report"]
    jsonschema.validate(rep, SCHEMA)
    w = rep["attempt"]["waiting"]
    assert w["cause"] == "unschedulable" and w["reason"].startswith("Unschedulable: pod wt-a1-slice-0-0-")
    assert 2900 <= w["seconds"] <= 3000 and w["since"] == next(
        r["time"] for r in rd.journal() if r["event"] == "waiting" and r["cause"] == "unschedulable"
    )
    table = io.StringIO()
    Console(file=table, width=200).print(render(rep))
    text = " ".join(table.getvalue().split())
    assert (
        f"waiting for capacity (unschedulable) since {w['since']}, {w['seconds'] / 60:.1f} min: Unschedulable"
        in text
    ), text
    j = rd.journal()
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]
    assert not [r for r in j if r["event"] in ("failed", "backoff", "gave_up", "stalled")]
    w = [x for x in waits(rd) if x[1] == "unschedulable"]
    assert [x[0] for x in w] == ["waiting", "waited"], waits(rd)
    assert 3 * 3600 - 120 <= w[1][2] <= 3 * 3600 + 240  # the nodes came back after 3 h
    assert "waited 3h" in out or "3h0" in out
    assert j[-1]["event"] == "done" and j[-1]["committed_step"] == 20


def test_a_host_event_is_a_wait_and_the_slice_comes_back_without_a_new_attempt(tmp_path, sandbox, gcs):
    """Every host of the slice goes down for 20 min: node lifecycle marks the node Unknown and its pod
    not ready (NodeNotReady), taint eviction deletes the pod after its 300 s toleration, the pod stays
    Terminating until the kubelet is back, which reports the container ContainerStatusUnknown 137;
    the Job's Ignore rule replaces the pod and the attempt runs on: a wait (node-not-ready)."""
    rd, be = setup(tmp_path, sandbox, gcs.bucket)
    seen: dict = {}

    def event(c: Clock) -> None:
        commit(rd, 10)
        c.fault(kind="host-event", pool=DEVICE, **{"for": "20m"})

    def at_10m(c: Clock) -> None:
        (node,) = c.sb.world.items("Node", None)
        seen["ready"] = find_cond(node, "Ready")["status"]
        seen["taints"] = sorted((t["key"], t["effect"]) for t in node["spec"]["taints"])
        (p,) = pods(c.sb)
        seen["pod"] = p

    clock = Clock(sandbox, [(600, event), (1200, at_10m), (3600, lambda c: finish(c, rd))])
    rc, out = supervise(rd, be, clock, backoff_base_s=60, max_retries=1, admission_timeout_s=300)
    assert rc == 0, out
    assert seen["ready"] == "Unknown"
    assert ("node.kubernetes.io/unreachable", "NoExecute") in seen["taints"]
    assert seen["pod"]["metadata"].get("deletionTimestamp")  # evicted, stuck Terminating
    assert find_cond(seen["pod"], "DisruptionTarget")["reason"] == "DeletionByTaintManager"
    j = rd.journal()
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]
    assert not [r for r in j if r["event"] in ("failed", "backoff", "gave_up", "stalled")]
    w = [x for x in waits(rd) if x[1] == "node-not-ready"]
    assert [x[0] for x in w] == ["waiting", "waited"], waits(rd)
    assert 20 * 60 - 120 <= w[1][2] <= 20 * 60 + 240
    assert j[-1]["event"] == "done"
    # The evicted pod was replaced (the Job's Ignore rule on DisruptionTarget): no JobSet restart.
    assert (sandbox.server.cluster.jobset("wt-a1")["status"].get("restarts") or 0) == 0


def workload(sb: Sandbox) -> dict:
    js = sb.world.get("JobSet", "default", "wt-a1")
    assert js is not None
    wl = sb.world.workload_of(js)
    assert wl is not None
    return copy.deepcopy(wl)


def test_a_pods_ready_timeout_requeue_is_a_wait_on_the_same_workload(tmp_path, sandbox, gcs):
    """waitForPodsReady (600 s): with no node the pods never get ready, Kueue evicts the Workload
    (PodsReadyTimeout), suspends the JobSet and requeues the same Workload after its backoff, again and
    again; when the nodes are back it runs. Nothing deleted, one attempt, no retry spent."""
    sandbox.world.pods_ready_timeout_s = 600
    sandbox.fault(parse_fault({"kind": "capacity", "pool": POOL, "nodes": 0}))
    rd, be = setup(tmp_path, sandbox, gcs.bucket)
    seen: dict = {}

    def before(c: Clock) -> None:
        seen["wl"] = workload(c.sb)

    def back(c: Clock) -> None:
        seen["wl_back"] = workload(c.sb)
        c.fault(kind="capacity", pool=POOL, nodes=1)

    clock = Clock(sandbox, [(60, before), (2 * 3600, back), (2 * 3600 + 1200, lambda c: finish(c, rd))])
    rc, out = supervise(rd, be, clock, backoff_base_s=60, max_retries=1, admission_timeout_s=300)
    assert rc == 0, out
    wl = seen["wl_back"]
    assert wl["metadata"]["uid"] == seen["wl"]["metadata"]["uid"]  # the same Workload throughout
    evictions = {e["reason"]: e["count"] for e in wl["status"]["schedulingStats"]["evictions"]}
    assert evictions["PodsReadyTimeout"] >= 2, evictions
    j = rd.journal()
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]
    assert not [r for r in j if r["event"] in ("failed", "backoff", "gave_up", "stalled")]
    req = [r for r in j if r["event"] == "requeued"]
    assert req and req[0]["reason"].startswith("PodsReadyTimeout: Exceeded the PodsReady timeout")
    assert not [d for d in sandbox.server.cluster.deleted if d[0] == "JobSet"]
    w = waits(rd)
    assert w[0][:2] == ("waiting", "unschedulable") and w[-1][:2] == ("waited", "unschedulable"), w
    assert len(w) == 2 and w[-1][2] >= 2 * 3600 - 120  # one wait across the requeues
    assert j[-1]["event"] == "done"


def test_kueue_deactivating_past_its_requeuing_limit_stops_with_one_line(tmp_path, sandbox, gcs):
    """requeuingStrategy.backoffLimitCount 2: the third PodsReadyTimeout deactivates the Workload
    (DeactivatedDueToRequeuingLimitExceeded). The supervisor respects it: one line naming Kueue and
    why, `deactivated` journaled, exit 130, no new attempt, nothing deleted."""
    sandbox.world.pods_ready_timeout_s = 600
    sandbox.world.requeuing_backoff_limit_count = 2
    sandbox.fault(parse_fault({"kind": "capacity", "pool": POOL, "nodes": 0}))
    rd, be = setup(tmp_path, sandbox, gcs.bucket)
    clock = Clock(sandbox, [])
    rc, out = supervise(rd, be, clock, backoff_base_s=60, max_retries=5)
    assert rc == 130, out
    j = rd.journal()
    (d,) = [r for r in j if r["event"] == "deactivated"]
    assert d["reason"].startswith(
        "Kueue (requeuingStrategy.backoffLimitCount exceeded): The workload is deactivated due to "
        "exceeding the maximum number of re-queuing retries"
    ), d
    assert d["workload"] == workload(sandbox)["metadata"]["name"]
    last = out.strip().splitlines()[-1]
    assert "stopped: Workload" in last and "deactivated by Kueue" in last and "kubectl patch workload" in last
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]
    assert not [r for r in j if r["event"] in ("failed", "backoff", "gave_up")]
    assert not [x for x in sandbox.server.cluster.deleted if x[0] == "JobSet"]
    assert waits(rd)[-1][:2] == ("waited", "unschedulable")


def test_an_admin_hold_stops_the_run_and_a_reattach_respects_it(tmp_path, sandbox, gcs):
    """Someone sets spec.active=false on the running attempt's Workload (an admin hold): Kueue evicts
    it (Deactivated) and suspends the JobSet; the supervisor stops with one line (exit 130), submits
    nothing, deletes nothing; a second supervisor stops the same way while the hold lasts."""
    rd, be = setup(tmp_path, sandbox, gcs.bucket)

    def hold(c: Clock) -> None:
        commit(rd, 10)
        with c.sb.server.store.lock:
            wl = c.sb.world.workload_of(c.sb.world.get("JobSet", "default", "wt-a1"))
            wl["spec"]["active"] = False
            c.sb.world.save("Workload", wl)
            c.sb.world.reconcile()

    rc, out = supervise(rd, be, Clock(sandbox, [(600, hold)]))
    assert rc == 130, out
    (d,) = [r for r in rd.journal() if r["event"] == "deactivated"]
    assert d["reason"].startswith("someone outside Kueue set spec.active=false on Workload jobset-wt-a1-"), d
    assert "Deactivated: The workload is deactivated" in d["reason"]
    assert sandbox.server.cluster.jobset("wt-a1")["spec"]["suspend"] is True
    rc2, out2 = supervise(rd, be, Clock(sandbox, []))
    assert rc2 == 130, out2
    assert [r["event"] for r in rd.journal()].count("deactivated") == 2
    assert [r["attempt"] for r in rd.journal() if r["event"] == "submitted"] == [1]
    assert not [x for x in sandbox.server.cluster.deleted if x[0] in ("JobSet", "Pod")]


def test_a_wait_is_journaled_once_across_a_detach_and_a_reattach(tmp_path, sandbox, gcs):
    """Ctrl-C while waiting detaches (exit 130, the attempt keeps waiting); the next supervisor
    carries the same wait on: one `waiting`, one `waited` whose seconds count from the first."""
    from olmo_ctl.core.errors import Interrupted

    rd, be = setup(tmp_path, sandbox, gcs.bucket)

    def ctrl_c(c: Clock) -> None:
        raise KeyboardInterrupt

    clock = Clock(
        sandbox,
        [(300, lambda c: c.fault(kind="capacity", pool=POOL, nodes=0, **{"for": "2h"})), (1800, ctrl_c)],
    )
    with pytest.raises(Interrupted):
        supervise(rd, be, clock)
    assert [x[:2] for x in waits(rd)] == [("waiting", "unschedulable")]
    clock.script = [(2 * 3600 + 900, lambda c: finish(c, rd))]
    rc, out = supervise(rd, be, clock)
    assert rc == 0, out
    w = waits(rd)
    assert [x[:2] for x in w] == [("waiting", "unschedulable"), ("waited", "unschedulable")], w
    assert 2 * 3600 - 120 <= w[1][2] <= 2 * 3600 + 240  # from the first supervisor's start of it
    assert [r["attempt"] for r in rd.journal() if r["event"] == "submitted"] == [1]


def test_an_admission_check_eviction_is_a_requeue_of_the_same_workload(tmp_path, sandbox, gcs):
    """An AdmissionCheck eviction (a ProvisioningRequest check retracting, as for flex-start): Kueue
    suspends the JobSet and requeues the same Workload after UpdateRequeueState's backoff; the
    supervisor waits (`requeued`) and the same attempt runs on."""
    rd, be = setup(tmp_path, sandbox, gcs.bucket)
    seen: dict = {}

    def evict(c: Clock) -> None:
        commit(rd, 10)
        seen["uid"] = workload(c.sb)["metadata"]["uid"]
        c.sb.server.cluster.evict("wt-a1", reason="AdmissionCheck", preempted_reason=None)

    clock = Clock(sandbox, [(600, evict), (1800, lambda c: finish(c, rd))])
    rc, out = supervise(rd, be, clock, backoff_base_s=60, max_retries=1, admission_timeout_s=300)
    assert rc == 0, out
    j = rd.journal()
    (req,) = [r for r in j if r["event"] == "requeued"]
    assert req["reason"].startswith("AdmissionCheck: The workload was evicted: AdmissionCheck")
    assert [x[:2] for x in waits(rd)] == [("waiting", "requeued"), ("waited", "requeued")]
    assert workload(sandbox)["metadata"]["uid"] == seen["uid"]
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]
    assert not [r for r in j if r["event"] in ("failed", "backoff", "gave_up")]
    assert not [x for x in sandbox.server.cluster.deleted if x[0] == "JobSet"]
    assert j[-1]["event"] == "done"


def test_a_just_repaired_kubelet_refusing_pods_is_a_wait_that_spends_nothing(tmp_path, sandbox, gcs):
    """A repair (20 min) after which the kubelet refuses pods for an hour (its device plugin not
    ready; the admission timeout is 5 minutes): each pod is rejected at the kubelet's pod sync (UnexpectedAdmissionError), the Job fails
    BackoffLimitExceeded and the launch template's RestartOnPodNotStarted restarts the JobSet without
    spending maxRestarts, again and again; the supervisor waits (kubelet-admission) past the admission
    timeout, and the same attempt runs on when the kubelet is ready."""
    rd, be = setup(tmp_path, sandbox, gcs.bucket)

    def repair(c: Clock) -> None:
        commit(rd, 10)
        c.fault(kind="repair", pool=DEVICE, **{"for": "20m"})
        c.fault(kind="admission-error", pool=DEVICE, **{"for": "40m"})

    seen: dict = {}

    def probe(c: Clock) -> None:  # ten minutes into the refusals: what the status names
        seen["status"] = be.status(be.find_live(rd.name, rd.path))

    clock = Clock(sandbox, [(600, repair), (600 + 30 * 60, probe), (600 + 50 * 60, lambda c: finish(c, rd))])
    rc, out = supervise(rd, be, clock, backoff_base_s=60, max_retries=1, admission_timeout_s=300)
    assert rc == 0, out
    j = rd.journal()
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]
    assert not [r for r in j if r["event"] in ("failed", "backoff", "gave_up", "stalled")], out
    # One wait (it began as the repair's Unschedulable), through the repair and the refusals.
    ((_, _, none), (_, _, seconds)) = waits(rd)
    assert none is None and 40 * 60 - 120 <= seconds <= 40 * 60 + 240, waits(rd)
    d = seen["status"]
    assert d.wait_cause == "kubelet-admission" and "UnexpectedAdmissionError" in (d.cause or ""), d
    st = sandbox.server.cluster.jobset("wt-a1")["status"]
    assert st["restarts"] > 3 and (st.get("restartsCountTowardsMax") or 0) == 0


def test_goodput_of_a_host_event_adds_up_and_the_outage_is_recovery(tmp_path, sandbox, gcs):
    """`monitor -o json` goodput of the host event above: the supervisor journals `admitted` after
    `running` (the slice's pods restarted in place) and a node-not-ready wait. The trainer is played
    by event files at the journal's times: steps 1..10 before the event, 11..20 after it. Productive
    time plus the buckets is the wall time, and the outage is recovery, not queueing nor productive."""
    from helpers.events import write_segment

    from olmo_ctl import storage
    from olmo_ctl.rundir import parse_iso

    rd, be = setup(tmp_path, sandbox, gcs.bucket)

    def event(c: Clock) -> None:
        commit(rd, 10)
        c.fault(kind="host-event", pool=DEVICE, **{"for": "20m"})

    clock = Clock(sandbox, [(600, event), (3600, lambda c: finish(c, rd))])
    rc, out = supervise(rd, be, clock, backoff_base_s=60, max_retries=1, admission_timeout_s=300)
    assert rc == 0, out
    j = [(parse_iso(r["time"]), r["event"]) for r in rd.journal()]
    started = j[0][0]
    running = [t for t, ev in j if ev == "running"]
    (restarted,) = [t for t, ev in j if ev == "admitted"]  # after `running`: the restart in place
    assert len(running) == 2 and running[0] < restarted < running[1]
    local = tmp_path / "tb"
    write_segment(local, range(1, 11), tags=["train/CE loss"], wall0=running[0] + 100, step_s=40)
    write_segment(
        local,
        range(11, 21),
        tags=["train/CE loss"],
        wall0=running[1] + 120 - 400,
        step_s=40,
        start_time=1800001800,
    )
    ends = running[1] + 120 + 400 + 5  # the final save, 2 s, committed 5 s after step 20
    write_segment(
        local, [20], segment=1, tags=["checkpoint/save_duration_s"], wall0=ends - 20, step_s=1, start_time=1800001800,
        values=lambda tag, s: 2.0,
    )  # fmt: skip
    for f in local.iterdir():
        if f.name.startswith("events.out.tfevents."):
            path = storage.join(rd.path, "tensorboard", f.name)
            storage.store_for(path).write_bytes(path, f.read_bytes())
    rep = build_report(load(rd.path), ask_backend=False)
    jsonschema.validate(rep, SCHEMA)
    gp = rep["goodput"]
    b = gp["buckets"]
    assert abs(gp["productive_s"] + sum(b.values()) - gp["wall_s"]) < 1.0
    assert gp["wall_s"] == pytest.approx(ends - started)
    assert gp["productive_s"] == pytest.approx(400.0 + 400.0)  # 10 steps of 40 s, twice
    assert b["queueing"] == 0.0  # submitted and running at once: the later `admitted` is no queue
    assert b["program_startup"] == pytest.approx(100.0 + 120.0)  # `running` -> the first step, twice
    assert b["wasted_progress"] == pytest.approx(restarted - (running[0] + 500))  # step 10 -> the event
    assert b["infrastructure_recovery"] == pytest.approx(running[1] - restarted)  # node-not-ready too
    assert b["waiting_for_capacity"] == 0.0
    assert b["checkpoint_save"] == pytest.approx(2.0) and b["other"] == pytest.approx(3.0)
