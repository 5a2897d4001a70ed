"""Placement read right: JobSet's exclusive-placement refusal of follower pods before their leader is
scheduled is transient (the leader's own state is the news), FailedCreate events of an earlier
restart's Jobs (same names) are history, and doctor names the JobSet controller's version, warning
before the jobset#1088 fix (v0.11.0)."""

from __future__ import annotations

import pytest

from olmo_ctl.backends import doctor
from olmo_ctl.backends.gke import GKEBackend
from olmo_ctl.backends.gke_status import classify, current_failed_creates
from olmo_ctl.backends.kube import KubeRetryPolicy, make_api_client
from olmo_ctl.core.contracts import State
from olmo_ctl.sandbox.kube_server import tiny_jobset
from olmo_ctl.sandbox.sandbox import NODEPOOL_LABEL, Sandbox

FAST = KubeRetryPolicy(base_s=0.01, max_s=0.05, budget_s=3.0)
EXCLUSIVE = "alpha.jobset.sigs.k8s.io/exclusive-topology"
LEADER_REFUSAL = (
    'Error creating: admission webhook "vpod.kb.io" denied the request: leader pod not yet scheduled, '
    "not creating follower pod. this is an expected, transient error"
)


def slice_jobset(name: str) -> dict:
    """A one-slice tpu7x-16 JobSet (2 pods x 4 chips), one slice per node pool, as olmo-ctl renders it."""
    js = tiny_jobset(name, queue="multislice-queue", workers=2)
    js["metadata"]["annotations"] = {EXCLUSIVE: NODEPOOL_LABEL}
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["nodeSelector"] = {
        "cloud.google.com/gke-tpu-accelerator": "tpu7x",
        "cloud.google.com/gke-tpu-topology": "2x2x2",
    }
    pod["containers"][0]["resources"] = {
        "requests": {"google.com/tpu": "4"},
        "limits": {"google.com/tpu": "4"},
    }
    return js


def test_followers_wait_for_their_leader_and_the_leaders_state_is_reported():
    with Sandbox(slices={"tpu7x-16": 2}) as sb:
        be = GKEBackend(namespace="default", host=sb.url, retry=FAST)
        sb.world.kubelet_down(None)  # every node NotReady: the leader cannot be scheduled
        h = be.send(slice_jobset("ex-a1"))
        pods = sb.server.cluster.pods(h.name)
        assert len(pods) == 1  # the leader; its follower is refused by the webhook
        msgs = [e["message"] for e in sb.server.cluster.events() if e["reason"] == "FailedCreate"]
        assert msgs == [LEADER_REFUSAL]
        st = be.status(h)
        assert st.state == State.ADMITTED
        assert st.reason.startswith(
            f"Unschedulable: pod {pods[0]['metadata']['name']}: 0/4 nodes are available"
        )
        assert not st.pods_refused and st.details["unschedulable"] is True
        sb.world.kubelet_back()  # the leader is scheduled; the follower is created on its node pool
        pods = sb.server.cluster.pods(h.name)
        assert [p["status"]["phase"] for p in pods] == ["Running", "Running"]
        pools = {sb.world.node_pool(p["spec"]["nodeName"]) for p in pods}
        assert len(pools) == 1 and pods[1]["spec"]["nodeSelector"][NODEPOOL_LABEL] in pools
        assert be.status(h).state == State.RUNNING


def test_a_follower_of_a_leader_whose_node_is_gone_gets_an_empty_node_pool():
    """jobset#1088 as v0.10.1 has it: the mutating webhook ignores the leader's missing node."""
    with Sandbox(slices={"tpu7x-16": 1}) as sb:
        be = GKEBackend(namespace="default", host=sb.url, retry=FAST)
        h = be.send(slice_jobset("gone-a1"))
        leader, follower = sb.server.cluster.pods(h.name)
        pool = follower["spec"]["nodeSelector"][NODEPOOL_LABEL]
        assert pool == sb.world.node_pool(leader["spec"]["nodeName"]) != ""
        with sb.server.store.lock:
            node = sb.world.get("Node", "", leader["spec"]["nodeName"])
            sb.world.store.delete(sb.world.store.resource_of(node), node, "Background", None)
            # The Job controller's replacement follower, through the webhooks:
            again = sb.world.copy(follower)
            del again["spec"]["nodeSelector"][NODEPOOL_LABEL]
            assert sb.world.refuse_pod(again) is None
        assert again["spec"]["nodeSelector"][NODEPOOL_LABEL] == ""  # no node has it: never scheduled


def test_the_leader_refusal_is_not_pods_refused():
    js = slice_jobset("r-a1")
    js["status"] = {"restarts": 0}
    wl = {
        "metadata": {"name": "wl"},
        "spec": {"active": True},
        "status": {
            "conditions": [
                {"type": "QuotaReserved", "status": "True"},
                {"type": "Admitted", "status": "True"},
            ]
        },
    }
    leader = {
        "metadata": {"name": "r-a1-slice-0-0-abcde"},
        "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False"}]},
    }
    refusal = {
        "involvedObject": {"kind": "Job", "name": "r-a1-slice-0", "uid": "u1"},
        "reason": "FailedCreate",
        "message": LEADER_REFUSAL,
        "lastTimestamp": "2026-01-01T00:00:00Z",
    }
    st = classify(js, wl, [leader], [refusal])
    assert st.state == State.ADMITTED and "not_created" not in st.details
    assert "follower pods wait for their leader pod to be scheduled" in st.reason
    quota = dict(refusal, message='Error creating: pods "r-a1-slice-0-1-" is forbidden: exceeded quota: q')
    st = classify(js, wl, [leader], [refusal, quota])
    assert st.pods_refused is True and "exceeded quota" in st.reason


def test_failed_creates_of_an_earlier_restart_are_history(srv):
    be = GKEBackend(namespace="default", host=srv.url, retry=FAST)
    refuse = {"on": True}
    quota = "exceeded quota: tpu-quota, requested: cpu=100m, used: cpu=1, limited: cpu=1"

    def resource_quota(pod):
        return (
            quota
            if refuse["on"]
            and pod["metadata"]["annotations"].get("batch.kubernetes.io/job-completion-index") == "1"
            else None
        )

    srv.world.pod_admission.append(resource_quota)
    h = be.send(tiny_jobset("fc-a1", run="fc", max_restarts=2))
    srv.cluster.admit(h.name)
    st = be.status(h)
    assert st.details.get("not_created") is True and quota in st.reason  # the restart of now: current
    refuse["on"] = False
    srv.world.reconcile()
    srv.cluster.run_pods(h.name)
    assert be.status(h).state == State.RUNNING
    # A restart: the Jobs are recreated under the same names; now followers wait for their leader.
    js = srv.cluster.jobset(h.name)
    with srv.store.lock:
        live = srv.world.get("JobSet", "default", h.name)
        live["metadata"].setdefault("annotations", {})[EXCLUSIVE] = NODEPOOL_LABEL
        srv.world.save("JobSet", live)
        srv.world.exclusive_placement_webhook = True
    srv.cluster.restart(h.name)
    js = srv.cluster.jobset(h.name)
    assert js["status"]["restarts"] == 1
    st = be.status(h)
    assert quota not in st.reason and "not_created" not in st.details, st.reason
    old = [e for e in srv.cluster.events() if quota in e.get("message", "")]
    assert old and old[0]["involvedObject"]["name"] in {j["metadata"]["name"] for j in _jobs(srv, h.name)}
    assert current_failed_creates(old, _jobs(srv, h.name)) == []


def _jobs(srv, name):
    with srv.store.lock:
        return [
            j
            for j in srv.world.items("Job", "default")
            if j["metadata"]["labels"].get("jobset.sigs.k8s.io/jobset-name") == name
        ]


@pytest.mark.parametrize(
    "image, release", [("registry.k8s.io/jobset/jobset:v0.10.1", (0, 10, 1)), ("x/jobset@sha256:ab", None)]
)
def test_a_jobset_release_is_read_from_its_image_tag(image, release):
    assert doctor.jobset_release(image) == release


def test_doctor_reports_the_jobset_version_and_warns_before_the_1088_fix():
    with Sandbox(slices={"tpu7x-16": 1}) as sb:
        kube = doctor.Cluster(make_api_client(host=sb.url))
        c = doctor.check_jobset_controller(kube)
        assert c.ok and c.message.startswith(
            "warning: JobSet controller v0.10.1 (registry.k8s.io/jobset/jobset:v0.10.1)"
        )
        assert "predates v0.11.0" in c.message and "jobset#1088" in c.message
        with sb.server.store.lock:
            dep = sb.world.get("Deployment", "jobset-system", "jobset-controller-manager")
            dep["spec"]["template"]["spec"]["containers"][0]["image"] = (
                "registry.k8s.io/jobset/jobset:v0.11.1"
            )
            sb.world.save("Deployment", dep)
        c = doctor.check_jobset_controller(kube)
        assert c == doctor.Check(
            "jobset-version", True, "JobSet controller v0.11.1 (registry.k8s.io/jobset/jobset:v0.11.1)"
        )
        with sb.server.store.lock:  # before v0.10.0 the failure policy's message patterns are pruned
            dep = sb.world.get("Deployment", "jobset-system", "jobset-controller-manager")
            dep["spec"]["template"]["spec"]["containers"][0]["image"] = "registry.k8s.io/jobset/jobset:v0.9.1"
            sb.world.save("Deployment", dep)
        c = doctor.check_jobset_controller(kube)
        assert not c.ok and c.message.startswith(
            "JobSet controller v0.9.1 (registry.k8s.io/jobset/jobset:v0.9.1) predates v0.10.0: the launch "
            "template's failure policy needs onJobFailureMessagePatterns"
        )
        with sb.server.store.lock:
            sb.world.delete(
                "Deployment", sb.world.get("Deployment", "jobset-system", "jobset-controller-manager")
            )
            sb.world.reconcile()
        c = doctor.check_jobset_controller(kube)
        assert c.ok and c.message.startswith("warning: no Deployment jobset-system/jobset-controller-manager")


def test_two_slices_leaders_take_two_node_pools_whatever_the_order():
    """JobSet's leader pods carry a required anti-affinity to pods of its other Jobs in their topology
    domain (pod_mutating_webhook.go setExclusiveAffinities): two slices' leaders never share a node
    pool, even when the first free nodes in name order are both in one pool."""
    with Sandbox(slices={"tpu7x-16": 2}) as sb:
        be = GKEBackend(namespace="default", host=sb.url, retry=FAST)
        js = slice_jobset("two-a1")
        js["spec"]["replicatedJobs"][0]["replicas"] = 2
        sb.world.kubelet_down(None)  # both leaders wait, then are scheduled in one pass
        h = be.send(js)
        sb.world.kubelet_back()
        pods = sb.server.cluster.pods(h.name)
        assert len(pods) == 4 and all(p["status"]["phase"] == "Running" for p in pods), [
            (p["metadata"]["name"], p["status"]["phase"]) for p in pods
        ]
        by_job: dict[str, set] = {}
        for p in pods:
            job = next(r["name"] for r in p["metadata"]["ownerReferences"] if r["kind"] == "Job")
            by_job.setdefault(job, set()).add(sb.world.node_pool(p["spec"]["nodeName"]))
        assert sorted(len(v) for v in by_job.values()) == [1, 1]  # each slice on one pool
        assert len(set.union(*by_job.values())) == 2  # and the two slices on two
