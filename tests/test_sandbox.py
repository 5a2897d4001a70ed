"""The sandbox cluster: configured as XPK configures Kueue, objects applied through the API take part in
admission and preemption, and kubectl (when on the PATH) gets, describes, applies and deletes against it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from olmo_ctl.sandbox.cluster import kueue
from olmo_ctl.sandbox.kube_server import tiny_jobset
from olmo_ctl.sandbox.sandbox import (
    Sandbox,
    parse_priority_classes,
    parse_slices,
    start_subprocess,
    stop_subprocess,
)

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "us-docker.pkg.dev/p/r/olmo-ctl:0.1.0"


def tpu_jobset(name: str, priority: str | None = None) -> dict:
    """A one-slice tpu7x-128 JobSet (16 pods x 4 chips) queued in multislice-queue."""
    js = tiny_jobset(name, queue="multislice-queue", workers=16)
    if priority:
        js["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] = priority
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["nodeSelector"] = {
        "cloud.google.com/gke-tpu-accelerator": "tpu7x",
        "cloud.google.com/gke-tpu-topology": "4x4x4",
    }
    pod["containers"][0]["resources"] = {
        "requests": {"google.com/tpu": "4"},
        "limits": {"google.com/tpu": "4"},
    }
    return js


def test_kueue_is_configured_as_xpk_configures_it():
    sb = Sandbox(
        slices=parse_slices(["tpu7x-128=2", "v5p-256"]), priority_classes=parse_priority_classes(["high"])
    )
    w = sb.world
    cq = w.get("ClusterQueue", "", "cluster-queue")
    assert cq["spec"]["preemption"] == {"reclaimWithinCohort": "Never", "withinClusterQueue": "LowerPriority"}
    assert cq["spec"]["namespaceSelector"] == {}
    group, cpu_memory = cq["spec"]["resourceGroups"]
    assert group["coveredResources"] == ["google.com/tpu"]
    assert {f["name"]: f["resources"] for f in group["flavors"]} == {
        "2xtpu7x-128": [{"name": "google.com/tpu", "nominalQuota": "128"}],
        "1xv5p-256": [{"name": "google.com/tpu", "nominalQuota": "128"}],
    }
    # The trainers' CPU and memory: every node's allocatable (GKE's reservations of a tpu7x-standard-4t,
    # 224 vCPU and 960 GiB: 223.37 cores and 956356 MiB; of a ct5p-hightpu-4t, 208 and 448 GiB: 207.41
    # cores and 442554 MiB), 32 nodes of each.
    assert cpu_memory == {
        "coveredResources": ["cpu", "memory"],
        "flavors": [
            {
                "name": "cpu-memory",
                "resources": [
                    {"name": "cpu", "nominalQuota": f"{32 * 223370 + 32 * 207410}m"},
                    {"name": "memory", "nominalQuota": f"{32 * 956356 + 32 * 442554}Mi"},
                ],
            }
        ],
    }
    assert w.get("ResourceFlavor", "", "1xv5p-256")["spec"]["nodeLabels"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "4x4x8",
    }
    assert w.get("LocalQueue", "default", "multislice-queue")["spec"]["clusterQueue"] == "cluster-queue"
    assert w.get("WorkloadPriorityClass", "", "high")["value"] == 750
    assert {p["metadata"]["name"]: p["value"] for p in w.items("PriorityClass", None)} == {
        "very-low": 100,
        "low": 250,
        "medium": 500,
        "high": 750,
        "very-high": 1000,
    }
    assert len(w.items("Node", None)) == 2 * 16 + 32


def test_bad_slices_and_priority_classes_are_refused():
    from olmo_ctl.core.errors import BadInput

    for bad in (["cpu-4=1"], ["tpu7x-128=0"], ["tpu7x-128=x"], ["tpu9-8=1"]):
        with pytest.raises(BadInput):
            parse_slices(bad)
    with pytest.raises(BadInput):
        parse_priority_classes(["High"])
    assert parse_priority_classes(["urgent=5000", "low"]) == {"urgent": 5000, "low": 250}


def test_applied_objects_take_part_in_admission_and_preemption():
    """Another team's high-priority JobSet, with a WorkloadPriorityClass applied through the API,
    preempts ours within the ClusterQueue; ours is suspended and requeued, not failed."""
    from kubernetes import client

    from olmo_ctl.backends.kube import make_api_client

    with Sandbox(slices={"tpu7x-128": 1}) as sb:
        api = client.CustomObjectsApi(make_api_client(host=sb.url))
        api.create_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", "default", "jobsets", tpu_jobset("ours")
        )
        c = sb.server.cluster
        assert kueue.is_admitted(c.workload("ours"))
        assert all(p["status"]["phase"] == "Running" for p in c.pods("ours")) and len(c.pods("ours")) == 16
        api.create_cluster_custom_object(
            "kueue.x-k8s.io",
            "v1beta1",
            "workloadpriorityclasses",
            {
                "apiVersion": "kueue.x-k8s.io/v1beta1",
                "kind": "WorkloadPriorityClass",
                "metadata": {"name": "urgent"},
                "value": 10000,
            },
        )
        api.create_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", "default", "jobsets", tpu_jobset("theirs", priority="urgent")
        )
        ours, theirs = c.workload("ours"), c.workload("theirs")
        assert kueue.find_cond(ours, "Evicted")["reason"] == "Preempted"
        assert kueue.find_cond(ours, "Requeued")["status"] == "True"
        assert c.jobset("ours")["spec"]["suspend"] is True
        assert kueue.is_admitted(theirs) and theirs["spec"]["priority"] == 10000
        assert len([p for p in c.pods("theirs") if p["status"]["phase"] == "Running"]) == 16


def test_a_jobset_readmitted_on_another_flavor_keeps_the_first_ones_selector_and_is_no_capacity_wait():
    """jobset#1294 on the test cluster's rules: admitted on a spot flavor, preempted, readmitted on the
    on-demand flavor once it has quota; JobSet's resumeJob merges the new flavor's labels into the
    suspended Jobs and keeps `cloud.google.com/gke-spot`, so the pods wait for spot nodes the preemptor
    holds. The classifier names the stale selector and gives no capacity wait (the admission timeout
    applies), where a plain Unschedulable pod is one; the attempt replaced by a fresh JobSet runs."""
    import copy

    from olmo_ctl.backends.gke_status import classify
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.sandbox.sandbox import flavor_labels
    from olmo_ctl.supervise.policy import waiting_for

    spot = {"cloud.google.com/gke-spot": "true"}
    dev = get_device("tpu7x-128")
    with Sandbox(slices={"tpu7x-128": 1}, priority_classes={"high": 750}) as sb:
        w, c = sb.world, sb.server.cluster
        with sb.server.store.lock:
            w.add_node_pool(dev, "tpu7x-128-spot")
            for node in w.items("Node", None):
                if node["metadata"]["labels"]["cloud.google.com/gke-nodepool"] == "tpu7x-128-spot":
                    node["metadata"]["labels"].update(spot)
                    w.save("Node", node)
            w.save(
                "ResourceFlavor",
                {"metadata": {"name": "spot"}, "spec": {"nodeLabels": {**flavor_labels(dev), **spot}}},
                new=True,
            )
            cq = copy.deepcopy(w.get("ClusterQueue", "", "cluster-queue"))
            group = cq["spec"]["resourceGroups"][0]
            group["flavors"][0]["resources"][0]["nominalQuota"] = "0"  # on-demand: none yet
            group["flavors"].insert(
                0, {"name": "spot", "resources": [{"name": "google.com/tpu", "nominalQuota": "64"}]}
            )
            w.save("ClusterQueue", cq)
        create = sb.server.api.create
        jobsets = sb.server.store.resources[("jobset.x-k8s.io", "jobsets")]
        create(jobsets, "v1alpha2", "default", tpu_jobset("ours"), {})
        w.reconcile()
        assert all(p["spec"]["nodeSelector"]["cloud.google.com/gke-spot"] == "true" for p in c.pods("ours"))
        create(jobsets, "v1alpha2", "default", tpu_jobset("theirs", priority="high"), {})
        w.reconcile()
        assert kueue.find_cond(c.workload("ours"), "Evicted")["reason"] == "Preempted"
        with sb.server.store.lock:  # on-demand capacity arrives
            cq = copy.deepcopy(w.get("ClusterQueue", "", "cluster-queue"))
            cq["spec"]["resourceGroups"][0]["flavors"][1]["resources"][0]["nominalQuota"] = "64"
            w.save("ClusterQueue", cq)
        for _ in range(3):
            w.reconcile()
        wl = c.workload("ours")
        assert kueue.is_admitted(wl)
        assert wl["status"]["admission"]["podSetAssignments"][0]["flavors"]["google.com/tpu"] == "1xtpu7x-128"
        pods = c.pods("ours")
        assert pods and all(p["spec"].get("nodeName") is None for p in pods)
        st = classify(c.jobset("ours"), wl, pods, [])
        assert st.hold is not None and st.hold.kind == "stale-selector", st
        assert "cloud.google.com/gke-spot=true" in st.reason and "jobset#1294" in st.reason
        assert st.wait_cause is None and waiting_for(st) is None
        # the same pods with the selector their template has now: a wait for capacity
        for p in pods:
            p["spec"]["nodeSelector"].pop("cloud.google.com/gke-spot")
        st = classify(c.jobset("ours"), wl, pods, [])
        assert st.hold.kind == "unschedulable" and waiting_for(st) is not None
        # The remedy, as the backend applies it when the admission timeout ends the attempt: the JobSet
        # deleted (Foreground) and a fresh one submitted; admitted on on-demand, its pods get nodes.
        sb.server.api.delete(
            jobsets, "v1alpha2", "default", "ours", {}, b'{"propagationPolicy": "Foreground"}'
        )
        for _ in range(3):
            w.reconcile()
        assert c.jobset("ours") is None and not c.pods("ours")
        create(jobsets, "v1alpha2", "default", tpu_jobset("ours-2"), {})
        for _ in range(3):
            w.reconcile()
        fresh = c.workload("ours-2")
        assert kueue.is_admitted(fresh)
        assert (
            fresh["status"]["admission"]["podSetAssignments"][0]["flavors"]["google.com/tpu"] == "1xtpu7x-128"
        )
        pods = c.pods("ours-2")
        assert len(pods) == 16 and all(p["spec"].get("nodeName") for p in pods)
        assert all("cloud.google.com/gke-spot" not in p["spec"]["nodeSelector"] for p in pods)
        assert classify(c.jobset("ours-2"), fresh, pods, []).hold is None


def test_a_pod_with_no_fitting_node_is_unschedulable():
    with Sandbox(slices={"tpu7x-128": 1}) as sb:
        sb.world.add_quota("cluster-queue", "1xtpu7x-128", "google.com/tpu", 64)  # quota without nodes
        sb.server.api.create(
            sb.server.store.resources[("jobset.x-k8s.io", "jobsets")],
            "v1alpha2",
            "default",
            tpu_jobset("a"),
            {},
        )
        sb.server.api.create(
            sb.server.store.resources[("jobset.x-k8s.io", "jobsets")],
            "v1alpha2",
            "default",
            tpu_jobset("b"),
            {},
        )
        sb.world.reconcile()
        pods = sb.server.cluster.pods("b")
        assert len(pods) == 16 and all(p["spec"].get("nodeName") is None for p in pods)
        cond = next(x for x in pods[0]["status"]["conditions"] if x["type"] == "PodScheduled")
        assert cond["reason"] == "Unschedulable" and "0/16 nodes are available" in cond["message"]


# ---------------------------------------------------------------- kubectl


KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl is not on the PATH (it ships with the Google "
    "Cloud CLI); the API features it needs are still served",
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("kubectl")
    kc = d / "kubeconfig"
    # The scripted kubelet: pods stay Running without a program (a stage-1 trainer cannot run here).
    p = start_subprocess(
        kc, "--slices", "tpu7x-128=1", "--no-run-pods", env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "KUBECONFIG": str(kc),
        "HOME": str(d),
        "XDG_CONFIG_HOME": str(d),
    }
    manifest = d / "jobset.yaml"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "olmo_ctl",
            "submit",
            "--stage",
            "1",
            "--device",
            "tpu7x-128",
            "--run",
            "kc",
            "--dry-run",
            "--run-root",
            "gs://b/runs",
            "--image",
            IMAGE,
            "--output-manifest",
            str(manifest),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    yield env, manifest
    stop_subprocess(p)


def kubectl(env: dict, *args: str, ok: bool = True) -> str:
    p = subprocess.run(
        [KUBECTL, "--request-timeout=20s", *args], env=env, capture_output=True, text=True, timeout=60
    )
    if ok:
        assert p.returncode == 0, f"kubectl {' '.join(args)}: {p.stderr}"
    return p.stdout + p.stderr


@needs_kubectl
def test_kubectl_applies_gets_describes_and_deletes_a_rendered_jobset(served):
    env, manifest = served
    assert "jobset.jobset.x-k8s.io/kc-a1 created" in kubectl(env, "apply", "-f", str(manifest))
    table = kubectl(env, "get", "jobsets")
    assert table.split("\n")[0].split() == [
        "NAME",
        "TERMINALSTATE",
        "RESTARTS",
        "COMPLETED",
        "SUSPENDED",
        "AGE",
    ]
    assert table.split("\n")[1].split()[:3] == ["kc-a1", "0", "false"]  # printer columns from the CRD
    wl = kubectl(env, "get", "workloads").split("\n")
    assert (
        wl[0].split()[:4] == ["NAME", "QUEUE", "RESERVED", "IN"]
        and "multislice-queue" in wl[1]
        and "True" in wl[1]
    )
    pods = [line.split() for line in kubectl(env, "get", "pods").strip().split("\n")[1:]]
    assert len(pods) == 16 and all(p[1:3] == ["1/1", "Running"] for p in pods)
    events = json.loads(
        kubectl(env, "get", "events", "--field-selector", "involvedObject.kind=JobSet", "-o", "json")
    )["items"]
    assert {e["reason"] for e in events} >= {"CreatedWorkload", "Started"}
    assert {e["involvedObject"]["kind"] for e in events} == {"JobSet"}
    assert "Created Workload: default/jobset-kc-a1-" in kubectl(env, "get", "events")
    described = kubectl(env, "describe", "jobset", "kc-a1")
    assert "Events:" in described and "CreatedWorkload" in described and "olmo-ctl/run=kc" in described
    assert "configured" in kubectl(env, "apply", "-f", str(manifest)) or "unchanged" in kubectl(
        env, "apply", "-f", str(manifest)
    )
    kubectl(env, "logs", pods[0][0])
    assert "yes" in kubectl(env, "auth", "can-i", "create", "jobsets.jobset.x-k8s.io")
    assert 'jobset.jobset.x-k8s.io "kc-a1" deleted' in kubectl(env, "delete", "jobset", "kc-a1")
    assert "No resources found" in kubectl(env, "get", "jobsets,pods,workloads,jobs")
