"""Outliving the control plane: an unreachable Kubernetes API is waited out, and a delete that takes
long (pods Terminating on a NotReady node) is waited for; neither ends supervision.

Compressed timers: the supervisor runs on a fake clock (`WorldScript`: its sleeps move the test
cluster's clock too), so a 10-minute outage costs the few calls that fail in it, each of which gives
up after `QUICK.budget_s` of real time instead of the 300 s a real client spends.
"""

from __future__ import annotations

import io
import time

import pytest
from test_image_pull_errors import WorldScript
from test_supervisor_gke import admit_run, setup

from olmo_ctl.backends.gke import GKEBackend
from olmo_ctl.backends.kube import ApiUnreachable, KubeRetryPolicy
from olmo_ctl.core.errors import BadInput
from olmo_ctl.sandbox.kube_server import tiny_jobset
from olmo_ctl.supervise.policy import RetryPolicy
from olmo_ctl.supervise.supervisor import Printer, Supervisor

QUICK = KubeRetryPolicy(base_s=0.01, max_s=0.05, budget_s=1.0, connect_timeout_s=1.0, read_timeout_s=1.5)


def supervise(rd, be, script, poll_s=30.0, delete_patience_s=None, **policy):
    buf = io.StringIO()
    sup = Supervisor(
        rd,
        be,
        RetryPolicy(**policy),
        poll_s=poll_s,
        clock=script.time,
        sleep=script.sleep,
        printer=Printer(rd.name, stream=buf, clock=script.time),
        delete_patience_s=delete_patience_s,
    )
    return sup.run(), buf.getvalue()


def _backend(srv) -> GKEBackend:
    return GKEBackend(namespace="default", host=srv.url, retry=QUICK)


@pytest.mark.parametrize(
    "mode, says", [("refuse", "Connection refused"), ("unavailable", "HTTP 503"), ("hang", "timed out")]
)
def test_an_api_outage_refuses_or_hangs_every_request_for_its_duration(srv, mode, says):
    be = _backend(srv)
    h = be.send(tiny_jobset("o1-a1", run="o1"))
    srv.outage(mode, for_s=3.0)  # longer than a read timeout
    t0 = time.monotonic()
    with pytest.raises(ApiUnreachable) as ei:
        be.status(h)
    assert says in ei.value.message, ei.value.message
    while srv.outage_mode() is not None:
        assert time.monotonic() - t0 < 10
        time.sleep(0.1)
    time.sleep(0.1)
    assert be.status(h).state.live  # the same objects, on the same port
    with pytest.raises(BadInput):
        srv.outage("flaky", 1)


def test_a_10_minute_api_outage_is_ridden_out_and_the_run_finishes(tmp_path, srv, gcs):
    rd, be = setup(tmp_path, srv, gcs.bucket)
    be.retry = QUICK
    script = WorldScript(
        srv,
        rd,
        {
            1: [
                (60, admit_run),
                (120, lambda s, n: s.commit(10)),
                (150, lambda s, n: s.srv.outage("refuse")),  # a zonal control plane's upgrade
                (750, lambda s, n: s.srv.end_outage()),
                (800, lambda s, n: s.commit(20)),
                (830, lambda s, n: s.srv.cluster.complete(n)),
            ]
        },
    )
    rc, out = supervise(rd, be, script, backoff_base_s=1, max_retries=1)
    assert rc == 0, out
    j = rd.journal()
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]
    assert not [r for r in j if r["event"] in ("failed", "preempted", "gave_up", "supervisor_stopped")]
    waits = [r for r in j if r["event"] in ("waiting", "waited") and r["cause"] == "api-unreachable"]
    assert [(r["event"], r["cause"]) for r in waits] == [
        ("waiting", "api-unreachable"),
        ("waited", "api-unreachable"),
    ]
    assert 600 <= waits[1]["seconds"] <= 600 + 300 + 60  # the outage, then at most one capped backoff
    assert "Kubernetes API is unreachable" in waits[0]["reason"]
    assert j[-1]["event"] == "done"


def test_a_hanging_api_server_is_waited_out_too(tmp_path, srv, gcs):
    rd, be = setup(tmp_path, srv, gcs.bucket)
    be.retry = QUICK
    script = WorldScript(
        srv,
        rd,
        {
            1: [
                (60, admit_run),
                (90, lambda s, n: s.srv.outage("hang")),
                (690, lambda s, n: s.srv.end_outage()),
                (720, lambda s, n: s.commit(20)),
                (750, lambda s, n: s.srv.cluster.complete(n)),
            ]
        },
    )
    rc, out = supervise(rd, be, script, backoff_base_s=1, max_retries=1)
    assert rc == 0, out
    # (the queue before admission is a wait for capacity of its own)
    assert [r["cause"] for r in rd.journal() if r["event"] == "waited" and r["cause"] != "queued"] == [
        "api-unreachable"
    ]


def test_pods_stuck_terminating_on_a_not_ready_node_are_ridden_out(tmp_path, srv, gcs):
    """Every node's kubelet stops answering for half an hour, and Kueue evicts the workload meanwhile
    (PodsReadyTimeout): its pods are deleted and stay Terminating until their node returns; Kueue
    requeues the same Workload, the supervisor waits (no new attempt, no retry spent) and the same
    attempt finishes once the node is back."""
    rd, be = setup(tmp_path, srv, gcs.bucket)
    seen: dict = {}

    def look(s, n):
        seen["pods"] = [
            (p["metadata"].get("deletionTimestamp") is not None, p["status"].get("phase"))
            for p in s.srv.cluster.pods(n)
        ]

    script = WorldScript(
        srv,
        rd,
        {
            1: [
                (60, admit_run),
                (120, lambda s, n: s.srv.world.kubelet_down(None, for_s=1800)),
                (150, lambda s, n: s.srv.cluster.evict(n, reason="PodsReadyTimeout")),
                (900, look),
                (2400, admit_run),
                (2500, lambda s, n: s.commit(20)),
                (2600, lambda s, n: s.srv.cluster.complete(n)),
            ],
        },
    )
    rc, out = supervise(rd, be, script, backoff_base_s=1, max_retries=1, poll_s=300)
    assert rc == 0, out
    assert seen["pods"] and all(deleting and phase == "Running" for deleting, phase in seen["pods"]), seen
    j = rd.journal()
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]
    assert not [r for r in j if r["event"] in ("failed", "backoff", "gave_up")]
    assert any(r["event"] == "requeued" for r in j)
