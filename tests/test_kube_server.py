"""The Kubernetes API test server, driven by the real `kubernetes` client (and raw HTTP where the
client hides a detail): REST semantics, CRD-schema validation, faults, and the scripted cluster."""

from __future__ import annotations

import http.client
import json
import re

import pytest

from olmo_ctl.sandbox.kube_server import JOBSET_CRD, WORKLOAD_CRD, schema_errors, tiny_jobset

G, V, P = "jobset.x-k8s.io", "v1alpha2", "jobsets"


@pytest.fixture
def apis(srv):
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = srv.url
    cfg.retries = False
    api = client.ApiClient(cfg)
    return client.CustomObjectsApi(api), client.CoreV1Api(api)


def _err(fn, *a, **kw):
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as ei:
        fn(*a, **kw)
    return ei.value.status, json.loads(ei.value.body), ei.value.headers


def _raw(srv, method, path, body=None, ctype=None):
    """One request with exactly these headers (no Content-Type unless given)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
    headers = {"Content-Type": ctype} if ctype else {}
    conn.request(method, path, body=json.dumps(body).encode() if body is not None else None, headers=headers)
    r = conn.getresponse()
    out = r.status, json.loads(r.read()), dict(r.getheaders())
    conn.close()
    return out


def test_create_get_list_and_conflicts(srv, apis):
    co, _ = apis
    made = co.create_namespaced_custom_object(G, V, "default", P, tiny_jobset("a-a1", run="a"))
    assert re.fullmatch(r"[0-9a-f-]{36}", made["metadata"]["uid"]) and made["metadata"]["generation"] == 1
    assert made["spec"]["suspend"] is True  # queued through Kueue: suspended on creation
    co.create_namespaced_custom_object(G, V, "default", P, tiny_jobset("b-a1", run="b", queue=None))
    got = co.get_namespaced_custom_object(G, V, "default", P, "a-a1")
    assert got["metadata"]["uid"] == made["metadata"]["uid"] and got["kind"] == "JobSet"

    def names(sel):
        return [
            o["metadata"]["name"]
            for o in co.list_namespaced_custom_object(G, V, "default", P, label_selector=sel)["items"]
        ]

    assert names("olmo-ctl/run=a") == ["a-a1"]
    assert names("olmo-ctl/run!=a") == ["b-a1"]
    assert names("olmo-ctl/run in (a, b)") == ["a-a1", "b-a1"]
    assert names("olmo-ctl/run notin (a),olmo-ctl/attempt=1") == ["b-a1"]
    assert names("kueue.x-k8s.io/queue-name") == ["a-a1"]
    assert names("!kueue.x-k8s.io/queue-name") == ["b-a1"]
    assert co.list_namespaced_custom_object(G, V, "other", P)["items"] == []

    code, status, _ = _err(
        co.create_namespaced_custom_object, G, V, "default", P, tiny_jobset("a-a1", run="a")
    )
    assert (code, status["kind"], status["reason"], status["message"]) == (
        409,
        "Status",
        "AlreadyExists",
        'jobsets.jobset.x-k8s.io "a-a1" already exists',
    )
    code, status, _ = _err(co.get_namespaced_custom_object, G, V, "default", P, "nope")
    assert (code, status["reason"], status["details"]["name"]) == (404, "NotFound", "nope")
    code, status, _ = _err(co.list_namespaced_custom_object, G, "v9", "default", P)
    assert code == 404


def test_post_without_content_type_is_accepted(srv):
    code, obj, _ = _raw(
        srv,
        "POST",
        "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets",
        tiny_jobset("raw-a1", run="raw"),
    )
    assert code == 201 and obj["metadata"]["name"] == "raw-a1"
    assert srv.requests[-1][3] == ""


def test_schema_validation(srv, apis):
    co, _ = apis
    js = tiny_jobset("v-a1", run="v")
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] = "four"
    code, status, _ = _err(co.create_namespaced_custom_object, G, V, "default", P, js)
    assert (code, status["reason"]) == (422, "Invalid")
    assert (
        "spec.replicatedJobs[0].template.spec.parallelism: Invalid value: 'four' is not of type 'integer'"
        in status["message"]
    )
    bad_name = tiny_jobset("Bad_Name", run="v")
    code, status, _ = _err(co.create_namespaced_custom_object, G, V, "default", P, bad_name)
    assert code == 422 and "RFC 1035" in status["message"]
    long_label = tiny_jobset("l-a1", run="x" * 64)
    code, status, _ = _err(co.create_namespaced_custom_object, G, V, "default", P, long_label)
    assert code == 422 and "at most 63 characters" in status["message"]


def test_unknown_fields_strict_is_400_default_warns_and_drops(srv, apis):
    co, _ = apis
    js = tiny_jobset("u-a1", run="u")
    js["spec"]["replicatedJobs"][0]["replicaz"] = 2
    code, status, _ = _err(
        co.create_namespaced_custom_object, G, V, "default", P, js, field_validation="Strict"
    )
    assert code == 400 and status["message"].endswith(
        'strict decoding error: unknown field "spec.replicatedJobs[0].replicaz"'
    )
    code, obj, headers = _raw(srv, "POST", "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets", js)
    assert code == 201 and "replicaz" not in obj["spec"]["replicatedJobs"][0]
    assert headers["Warning"] == r'299 - "unknown field \"spec.replicatedJobs[0].replicaz\""'


def test_workload_is_owned_and_served_in_both_kueue_versions(srv, apis):
    co, _ = apis
    js = co.create_namespaced_custom_object(G, V, "default", P, tiny_jobset("w-a1", run="w", workers=3))
    uid = js["metadata"]["uid"]
    for version in ("v1beta1", "v1beta2"):
        items = co.list_namespaced_custom_object(
            "kueue.x-k8s.io", version, "default", "workloads", label_selector=f"kueue.x-k8s.io/job-uid={uid}"
        )["items"]
        assert len(items) == 1
        wl = items[0]
        assert wl["apiVersion"] == f"kueue.x-k8s.io/{version}"
        assert re.fullmatch(r"jobset-w-a1-[0-9a-f]{5}", wl["metadata"]["name"])
        ref = wl["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("JobSet", uid, True)
        assert wl["spec"]["podSets"][0]["count"] == 3 and wl["spec"]["queueName"] == "user-queue"
        assert schema_errors(wl, WORKLOAD_CRD, version) == []


def test_cluster_objects_follow_the_schemas_through_a_lifecycle(srv):
    c = srv.cluster
    srv.api.create(
        srv.api.route("/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets")[0],
        "v1alpha2",
        "default",
        tiny_jobset("c-a1", run="c"),
        {},
    )
    # Kueue's own message: tiny_jobset asks for 2 x 100m CPU and the ClusterQueue has none yet.
    pending = (
        "couldn't assign flavors to pod set slice: insufficient unused quota for cpu in flavor tpu-flavor, "
        "200m more needed"
    )
    steps = [
        lambda: c.keep_pending("c-a1", pending),
        lambda: c.admit("c-a1"),
        lambda: c.run_pods("c-a1"),
        lambda: c.evict("c-a1"),
        lambda: c.admit("c-a1"),
        lambda: c.run_pods("c-a1"),
        lambda: c.pod_exit("c-a1", 0, 1, ["boom"]),
        lambda: c.fail("c-a1"),
    ]
    for step in steps:
        step()
        assert schema_errors(c.jobset("c-a1"), JOBSET_CRD, "v1alpha2") == []
        for version in ("v1beta1", "v1beta2"):
            assert schema_errors(c.workload("c-a1"), WORKLOAD_CRD, version) == []
    conds = {x["type"]: (x["status"], x["reason"]) for x in c.workload("c-a1")["status"]["conditions"]}
    assert conds["Evicted"] == ("False", "QuotaReserved")  # readmitted after the eviction
    assert conds["Finished"] == ("True", "Failed")
    exits = sorted(
        p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] for p in c.pods("c-a1")
    )
    # The Job controller deleted the other pod: it got SIGTERM, exited 143 and is gone; the failed one stays.
    assert exits == [1]
    # SIGTERM: both pods on the eviction, the surviving one on the failure.
    assert [e["reason"] for e in c.events() if e["involvedObject"]["kind"] == "Pod"].count("Killing") == 3


def test_delete_propagation_and_preconditions(srv, apis):
    co, core = apis
    for name in ("f-a1", "o-a1"):
        co.create_namespaced_custom_object(G, V, "default", P, tiny_jobset(name, run=name[0]))
        srv.cluster.admit(name)
    assert len(srv.cluster.pods("f-a1")) == 2
    code, status, _ = _err(
        co.delete_namespaced_custom_object,
        G,
        V,
        "default",
        P,
        "f-a1",
        body={"preconditions": {"uid": "not-it"}},
    )
    assert code == 409 and "Precondition failed" in status["message"]
    out = co.delete_namespaced_custom_object(G, V, "default", P, "f-a1", propagation_policy="Foreground")
    assert out["metadata"]["finalizers"] == ["foregroundDeletion"] and out["metadata"]["deletionTimestamp"]
    assert srv.cluster.jobset("f-a1") is None and srv.cluster.pods("f-a1") == []
    co.delete_namespaced_custom_object(G, V, "default", P, "o-a1", propagation_policy="Orphan")
    # The JobSet's dependents (its Job and Workload) lose their reference; the pods stay the Job's.
    jobs = co.list_namespaced_custom_object(
        "batch", "v1", "default", "jobs", label_selector="jobset.sigs.k8s.io/jobset-name=o-a1"
    )["items"]
    assert len(jobs) == 1 and jobs[0]["metadata"]["ownerReferences"] == []
    orphans = srv.cluster.pods("o-a1")
    assert len(orphans) == 2 and all(p["metadata"]["ownerReferences"][0]["kind"] == "Job" for p in orphans)
    wls = co.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta1", "default", "workloads")["items"]
    assert [w["metadata"]["ownerReferences"] for w in wls] == [[]]
    core.delete_collection_namespaced_pod("default", label_selector="jobset.sigs.k8s.io/jobset-name=o-a1")
    assert srv.cluster.pods("o-a1") == []
    # The orphaned Job counted its deleted pods as failures (backoffLimit 0): it failed, nothing replaces them.
    job = co.get_namespaced_custom_object("batch", "v1", "default", "jobs", jobs[0]["metadata"]["name"])
    assert [(c["type"], c["reason"]) for c in job["status"]["conditions"] if c["type"] == "Failed"] == [
        ("Failed", "BackoffLimitExceeded")
    ]
    assert srv.cluster.deleted[:2] == [("JobSet", "f-a1", "Foreground"), ("JobSet", "o-a1", "Orphan")]


def test_patch_replace_and_status(srv, apis):
    co, _ = apis
    co.create_namespaced_custom_object(G, V, "default", P, tiny_jobset("p-a1", run="p"))
    out = co.patch_namespaced_custom_object(
        G, V, "default", P, "p-a1", {"metadata": {"labels": {"x": "y"}}, "spec": {"suspend": False}}
    )
    assert srv.requests[-1][3] == "application/merge-patch+json"
    assert out["metadata"]["labels"]["x"] == "y" and out["spec"]["suspend"] is False
    assert out["metadata"]["generation"] == 2
    out = co.patch_namespaced_custom_object(
        G, V, "default", P, "p-a1", {"metadata": {"labels": {"x": None}}, "status": {"restarts": 9}}
    )
    assert (
        "x" not in out["metadata"]["labels"] and out["status"].get("restarts") == 0
    )  # status: subresource only
    out = co.patch_namespaced_custom_object_status(G, V, "default", P, "p-a1", {"status": {"restarts": 2}})
    assert out["status"]["restarts"] == 2
    code, status, _ = _raw(
        srv,
        "PATCH",
        "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets/p-a1",
        [{"op": "replace", "path": "/spec/suspend", "value": True}],
        "application/json-patch+json",
    )
    assert code == 200 and status["spec"]["suspend"] is True
    code, status, _ = _raw(
        srv,
        "PATCH",
        "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets/p-a1",
        {"spec": {}},
        "application/strategic-merge-patch+json",
    )
    assert code == 415
    code, status, _ = _raw(
        srv,
        "PATCH",
        "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets/p-a1",
        {"spec": {"replicatedJobs": "x"}},
        "application/merge-patch+json",
    )
    assert code == 422
    stale = co.get_namespaced_custom_object(G, V, "default", P, "p-a1")
    co.patch_namespaced_custom_object(G, V, "default", P, "p-a1", {"metadata": {"labels": {"z": "1"}}})
    code, status, _ = _err(co.replace_namespaced_custom_object, G, V, "default", P, "p-a1", stale)
    assert code == 409 and status["reason"] == "Conflict"


def test_pods_logs_and_events(srv, apis):
    co, core = apis
    co.create_namespaced_custom_object(G, V, "default", P, tiny_jobset("g-a1", run="g"))
    srv.cluster.admit("g-a1")
    pods = json.loads(
        core.list_namespaced_pod(
            "default", label_selector="jobset.sigs.k8s.io/jobset-name=g-a1", _preload_content=False
        ).data
    )["items"]
    assert [p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] for p in pods] == ["0", "1"]
    name = pods[0]["metadata"]["name"]
    code, status, _ = _err(core.read_namespaced_pod_log, name, "default")
    assert code == 400 and "is waiting to start: ContainerCreating" in status["message"]
    srv.cluster.run_pods("g-a1")
    srv.cluster.log("g-a1", 0, [f"step {i}" for i in range(1, 6)])
    assert core.read_namespaced_pod_log(name, "default", tail_lines=2) == "step 4\nstep 5\n"
    assert core.read_namespaced_pod_log(name, "default", container="trainer").count("\n") == 5
    code, _, _ = _err(core.read_namespaced_pod_log, name, "default", container="sidecar")
    assert code == 400
    evs = json.loads(
        core.list_namespaced_event(
            "default", field_selector=f"involvedObject.name={name}", _preload_content=False
        ).data
    )["items"]
    assert sorted(e["reason"] for e in evs) == ["Scheduled", "Started"]  # the scheduler's, the kubelet's
    assert {e["involvedObject"]["kind"] for e in evs} == {"Pod"}
    running = core.list_namespaced_pod("default", field_selector="status.phase=Running")
    assert len(running.items) == 2


def test_faults(srv, apis):
    import urllib3

    co, _ = apis
    srv.fail_next(2, status=429, retry_after_s=3)
    for _ in range(2):
        code, status, headers = _err(co.list_namespaced_custom_object, G, V, "default", P)
        assert (code, status["reason"], headers["Retry-After"]) == (429, "TooManyRequests", "3")
    assert co.list_namespaced_custom_object(G, V, "default", P)["items"] == []
    srv.fail_next(1, status=500, match="POST ")
    assert co.list_namespaced_custom_object(G, V, "default", P)["items"] == []  # a GET is not matched
    code, status, _ = _err(
        co.create_namespaced_custom_object, G, V, "default", P, tiny_jobset("x-a1", run="x")
    )
    assert (code, status["reason"]) == (500, "InternalError")
    srv.fail_next(1, status="drop")
    with pytest.raises(urllib3.exceptions.ProtocolError):
        co.list_namespaced_custom_object(G, V, "default", P)
    srv.fail_next(1, status="lost")
    with pytest.raises(urllib3.exceptions.ProtocolError):
        co.create_namespaced_custom_object(G, V, "default", P, tiny_jobset("y-a1", run="y"))
    assert srv.cluster.jobset_names() == ["y-a1"]  # carried out, answer lost
    port = srv.port
    srv.go_down()
    with pytest.raises(urllib3.exceptions.NewConnectionError):
        co.list_namespaced_custom_object(G, V, "default", P)
    srv.come_back()
    assert srv.port == port
    assert [o["metadata"]["name"] for o in co.list_namespaced_custom_object(G, V, "default", P)["items"]] == [
        "y-a1"
    ]


def test_on_create_callback_scripts_the_cluster(srv, apis):
    co, _ = apis
    srv.cluster.on_create(lambda name: srv.cluster.admit(name))
    co.create_namespaced_custom_object(G, V, "default", P, tiny_jobset("cb-a1", run="cb"))
    wl = srv.cluster.workload("cb-a1")
    assert {c["type"]: c["status"] for c in wl["status"]["conditions"]} == {
        "QuotaReserved": "True",
        "Admitted": "True",
    }
    assert co.get_namespaced_custom_object(G, V, "default", P, "cb-a1")["spec"]["suspend"] is False


def test_discovery_cluster_scoped_resources_and_watch(srv, apis):
    co, core = apis
    _, groups, _ = _raw(srv, "GET", "/apis")
    assert {g["name"] for g in groups["groups"]} >= {"jobset.x-k8s.io", "kueue.x-k8s.io", "batch"}
    _, rl, _ = _raw(srv, "GET", "/apis/kueue.x-k8s.io/v1beta1")
    scope = {r["name"]: r["namespaced"] for r in rl["resources"]}
    assert scope["workloads"] is True and scope["clusterqueues"] is False and "workloads/status" in scope
    # Cluster-scoped Kueue objects through the client; the schema applies to them too.
    co.create_cluster_custom_object(
        "kueue.x-k8s.io",
        "v1beta1",
        "workloadpriorityclasses",
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "WorkloadPriorityClass",
            "metadata": {"name": "high"},
            "value": 1000,
        },
    )
    got = co.get_cluster_custom_object("kueue.x-k8s.io", "v1beta1", "workloadpriorityclasses", "high")
    assert got["value"] == 1000 and "namespace" not in got["metadata"]
    code, _, _ = _err(
        co.create_cluster_custom_object,
        "kueue.x-k8s.io",
        "v1beta1",
        "workloadpriorityclasses",
        {"metadata": {"name": "bad"}, "value": "not a number"},
    )
    assert code == 422
    cqs = co.list_cluster_custom_object("kueue.x-k8s.io", "v1beta1", "clusterqueues")["items"]
    assert [c["metadata"]["name"] for c in cqs] == ["cluster-queue"]
    # A watch from a resourceVersion sees what happened after it, then ends at timeoutSeconds.
    from kubernetes import watch

    rv = core.list_namespaced_pod("default").metadata.resource_version
    co.create_namespaced_custom_object(G, V, "default", P, tiny_jobset("wa-a1", run="wa"))
    srv.cluster.admit("wa-a1")
    seen = [
        (e["type"], e["object"].metadata.name)
        for e in watch.Watch().stream(
            core.list_namespaced_pod, "default", resource_version=rv, timeout_seconds=1
        )
    ]
    names = {p["metadata"]["name"] for p in srv.cluster.pods("wa-a1")}
    assert {n for t, n in seen if t == "ADDED"} == names


def test_the_body_a_client_sent_is_kept_as_sent(srv, apis):
    co, _ = apis
    js = tiny_jobset("rb-a1", run="rb")
    co.create_namespaced_custom_object(G, V, "default", P, js)
    ((method, path, body),) = [r for r in srv.received if r[1].endswith("/jobsets")]
    assert (method, body) == ("POST", js)  # the stored object differs (suspended by Kueue's webhook)
    assert srv.cluster.jobset("rb-a1")["spec"]["suspend"] is True and "suspend" not in js["spec"]
