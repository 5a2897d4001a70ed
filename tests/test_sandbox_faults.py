"""`olmo-ctl sandbox fault` against a sandbox running as its own process, `sandbox --faults FILE`, and
the node rules the faults set off (`olmo_ctl.sandbox.cluster.nodes`), read back through the API."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import pytest
import yaml
from helpers.cli import invoke

from olmo_ctl.core.durations import format_duration, parse_duration
from olmo_ctl.core.errors import BadInput
from olmo_ctl.sandbox.cluster.objects import find_cond
from olmo_ctl.sandbox.faults import CONTROL_PATH, KINDS, parse_fault
from olmo_ctl.sandbox.sandbox import Sandbox, start_subprocess, stop_subprocess
from olmo_ctl.sandbox.tls import client_context


def served(kc_path) -> tuple[str, str, ssl.SSLContext]:
    """The served sandbox's address, token and a TLS context trusting its certificate (its kubeconfig's)."""
    cluster = yaml.safe_load(kc_path.read_text())["clusters"][0]["cluster"]
    user = yaml.safe_load(kc_path.read_text())["users"][0]["user"]
    return cluster["server"], user["token"], client_context(cluster["certificate-authority-data"])


def get(kc_path, path: str) -> dict:
    """GET through the API with the kubeconfig's token, as every client of the sandbox must."""
    server, token, tls = served(kc_path)
    req = urllib.request.Request(server + path, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10, context=tls) as r:
        return json.loads(r.read())


def nodes(kc_path) -> dict[str, dict]:
    return {n["metadata"]["name"]: n for n in get(kc_path, "/api/v1/nodes")["items"]}


@pytest.fixture
def running(tmp_path):
    """`olmo-ctl sandbox` with two v5p-8 slices (one node each), no programs, as a subprocess."""
    kc = tmp_path / "sb.kubeconfig"
    p = start_subprocess(kc, "--slices", "v5p-8=2", "--no-run-pods")
    try:
        yield kc
    finally:
        stop_subprocess(p)


def fault(kc, *args: str):
    return invoke("sandbox", "fault", *args, "--kubeconfig", str(kc))


def test_sandbox_fault_changes_what_the_running_sandboxs_api_reports(running):
    kc = running
    assert sorted(nodes(kc)) == ["gke-v5p-8-np-0-0000", "gke-v5p-8-np-1-0000"]
    r = fault(kc, "capacity", "--pool", "v5p-8-np-1", "--nodes", "0")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith("applied capacity on v5p-8-np-1, 0 node(s) (1 node(s): gke-v5p-8-np-1-0000)")
    assert sorted(nodes(kc)) == ["gke-v5p-8-np-0-0000"]  # returned at once, already applied
    r = fault(kc, "host-event", "--pool", "v5p-8", "--for", "2h")  # a device type: all of its pools
    assert r.returncode == 0, r.stderr
    (node,) = nodes(kc).values()
    assert find_cond(node, "Ready")["status"] == "Unknown"
    assert find_cond(node, "Ready")["reason"] == "NodeStatusUnknown"
    assert {(t["key"], t["effect"]) for t in node["spec"]["taints"]} >= {
        ("node.kubernetes.io/unreachable", "NoSchedule"),
        ("node.kubernetes.io/unreachable", "NoExecute"),
    }
    r = fault(kc, "capacity", "--pool", "v5p-8", "--nodes", "1")  # capacity back: healthy nodes again
    assert r.returncode == 0, r.stderr
    got = nodes(kc)
    assert sorted(got) == ["gke-v5p-8-np-0-0000", "gke-v5p-8-np-1-0000"]
    assert all(find_cond(n, "Ready")["status"] == "True" for n in got.values())
    assert not [
        t for n in got.values() for t in n["spec"].get("taints") or [] if "node.kubernetes.io" in t["key"]
    ]


@pytest.mark.parametrize(
    "args,line",
    [
        (["meteor"], "error: sandbox fault: `meteor` is not a fault kind; one of capacity, host-event,"),
        (["repair", "--for", "ten minutes"], "error: sandbox fault: --for `ten minutes` is not a duration"),
        (["capacity", "--pool", "v5p-8"], "error: sandbox fault: capacity needs --nodes"),
        (
            ["capacity", "--pool", "tpu7x-8", "--nodes", "0"],
            "error: --pool `tpu7x-8` is not a node pool of this sandbox; pools: v5p-8-np-0, v5p-8-np-1",
        ),
        (["image-pull"], "error: sandbox fault: image-pull needs --image-error transient|permanent"),
        (
            ["image-pull", "--image-error", "transient", "--pool", "v6e-8"],
            "error: --pool `v6e-8` is not a node pool",
        ),
    ],
)
def test_bad_input_to_sandbox_fault_is_one_line_exit_2_and_changes_nothing(running, args, line):
    before = nodes(running)
    r = fault(running, *args)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.startswith(line) and r.stderr.count("\n") == 1, r.stderr
    after = nodes(running)
    assert {k: v["metadata"]["resourceVersion"] for k, v in after.items()} == {
        k: v["metadata"]["resourceVersion"] for k, v in before.items()
    }


def test_the_control_path_needs_the_kubeconfigs_token(running):
    server, _, tls = served(running)
    body = json.dumps({"kind": "capacity", "nodes": 0}).encode()
    for headers in ({}, {"Authorization": "Bearer not-the-token"}):
        headers["Content-Type"] = "application/json"
        req = urllib.request.Request(server + CONTROL_PATH, data=body, method="POST", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10, context=tls)
        assert e.value.code == 401
    assert len(nodes(running)) == 2


def test_the_served_api_needs_the_kubeconfigs_token_and_its_own_address(running):
    """`olmo-ctl sandbox` serves nobody but the holder of its kubeconfig: HTTPS with the certificate
    its kubeconfig names (kubectl sends a token over TLS only); no token or another one is 401,
    another Host (a rebound DNS name) 421, a text/plain body 415; nothing is created."""
    server, token, tls = served(running)
    assert server.startswith("https://127.0.0.1:")
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(server + "/version", timeout=10)  # not a certificate anyone vouches for
    jobs = server + "/apis/batch/v1/namespaces/default/jobs"
    body = json.dumps({"metadata": {"name": "x"}, "spec": {}}).encode()
    for method, url, data, headers, code in (
        ("GET", server + "/api/v1/nodes", None, {}, 401),
        ("GET", server + "/api/v1/nodes", None, {"Authorization": "Bearer not-the-token"}, 401),
        ("POST", jobs, body, {"Content-Type": "application/json"}, 401),
        (
            "GET",
            server + "/api/v1/nodes",
            None,
            {"Authorization": f"Bearer {token}", "Host": "evil.example"},
            421,
        ),
        ("POST", jobs, body, {"Authorization": f"Bearer {token}", "Content-Type": "text/plain"}, 415),
    ):
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10, context=tls)
        assert e.value.code == code, (method, headers)
        assert json.loads(e.value.read())["kind"] == "Status"
    assert get(running, "/apis/batch/v1/jobs")["items"] == []
    assert len(nodes(running)) == 2


def test_a_kubeconfig_of_another_sandbox_is_exit_2_and_changes_nothing(tmp_path):
    """A stale kubeconfig (another sandbox's token, or its certificate while another now serves on the
    port) is refused as bad input, naming the file; the sandbox's nodes are as they were."""
    with Sandbox(slices={"v5p-8": 1}, require_token=True) as sb, Sandbox(require_token=True) as other:
        kc = sb.write_kubeconfig(tmp_path / "sb.kubeconfig")
        cfg = yaml.safe_load(kc.read_text())
        cfg["users"][0]["user"]["token"] = other.token
        stale = tmp_path / "stale-token.kubeconfig"
        stale.write_text(yaml.safe_dump(cfg))
        r = fault(stale, "host-event")
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith(f"error: the sandbox at {sb.url} refused the token of `{stale}`"), r.stderr
        cfg = yaml.safe_load(kc.read_text())
        cfg["clusters"][0]["cluster"]["certificate-authority-data"] = yaml.safe_load(
            other.write_kubeconfig(tmp_path / "other.kubeconfig").read_text()
        )["clusters"][0]["cluster"]["certificate-authority-data"]
        stale = tmp_path / "stale-certificate.kubeconfig"
        stale.write_text(yaml.safe_dump(cfg))
        r = fault(stale, "host-event")
        assert r.returncode == 2, r.stderr
        assert "is not the sandbox that wrote" in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert all(find_cond(n, "Ready")["status"] == "True" for n in sb.world.items("Node", None))
        assert fault(kc, "host-event").returncode == 0  # its own kubeconfig still drives it


def test_no_sandbox_serving_is_exit_3_and_a_real_kubeconfig_is_refused(tmp_path):
    with Sandbox(slices={"v5p-8": 1}) as sb:
        kc = sb.write_kubeconfig(tmp_path / "gone.kubeconfig")
    r = fault(kc, "host-event")
    assert r.returncode == 3 and r.stderr.startswith("error: no sandbox serves at http://127.0.0.1:"), (
        r.stderr
    )
    real = tmp_path / "real.kubeconfig"
    real.write_text(yaml.safe_dump({"contexts": [{"name": "gke_prod"}], "clusters": [], "users": []}))
    r = fault(real, "host-event")
    assert r.returncode == 2 and "is not a sandbox kubeconfig" in r.stderr


def test_a_fault_timeline_runs_from_the_sandboxs_start(tmp_path):
    timeline = tmp_path / "faults.yaml"
    timeline.write_text("- {at: 0s, kind: capacity, pool: v5p-8-np-0, nodes: 0}\n")
    kc = tmp_path / "sb.kubeconfig"
    p = start_subprocess(kc, "--slices", "v5p-8=2", "--no-run-pods", "--faults", str(timeline))
    try:
        import time

        deadline = time.monotonic() + 30
        while len(nodes(kc)) != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sorted(nodes(kc)) == ["gke-v5p-8-np-1-0000"]
    finally:
        code, err = stop_subprocess(p)
    assert code == 0 and "sandbox: fault at 0 s: capacity on v5p-8-np-0, 0 node(s)" in err, err


@pytest.mark.parametrize(
    "text,line",
    [
        ("- {kind: host-event}\n", "error: --faults {f}: fault 1 has no `at`"),
        ("- {at: soon, kind: host-event}\n", "error: --faults {f}: fault 1: at `soon` is not a duration"),
        (
            "- {at: 1m, kind: host-event, pool: nope}\n",
            "error: --pool `nope` is not a node pool of this sandbox; pools: v5p-8-np-0",
        ),
        ("kind: host-event\n", "error: --faults {f}: must be a list of faults"),
    ],
)
def test_a_bad_timeline_is_one_line_exit_2_before_the_sandbox_serves(tmp_path, text, line):
    f = tmp_path / "faults.yaml"
    f.write_text(text)
    kc = tmp_path / "sb.kubeconfig"
    r = invoke("sandbox", "--kubeconfig", str(kc), "--slices", "v5p-8=1", "--no-run-pods", "--faults", str(f))
    assert r.returncode == 2 and r.stderr.startswith(line.format(f=f)), r.stderr
    assert r.stderr.count("\n") == 1 and not kc.exists()


def test_image_pull_and_api_outage_reach_the_running_sandbox(running):
    """An image-pull fault is the world's (the kubelet's outcomes follow from it); an API outage answers
    503 to every request for --for while the control path still hears faults."""
    import time

    r = fault(running, "image-pull", "--image-error", "permanent", "--pool", "v5p-8-np-0")
    assert r.returncode == 0, r.stderr
    assert "image-pull on v5p-8-np-0" in r.stdout
    r = fault(running, "api-outage", "--for", "3s")
    assert r.returncode == 0, r.stderr
    with pytest.raises(urllib.error.HTTPError) as e:
        get(running, "/api/v1/nodes")
    assert e.value.code == 503
    time.sleep(3.5)
    assert len(nodes(running)) == 2  # answering again


def test_every_kind_is_in_the_table():
    assert list(KINDS) == [
        "capacity",
        "host-event",
        "node-not-ready",
        "repair",
        "admission-error",
        "image-pull",
        "api-outage",
        "spot-reclaim",
    ]
    assert parse_fault({"kind": "repair", "for": "1h30m"}).for_s == 5400
    with pytest.raises(BadInput, match="takes no --nodes"):
        parse_fault({"kind": "host-event", "nodes": 1})


@pytest.mark.parametrize(
    "text,seconds", [("90s", 90), ("30m", 1800), ("2h", 7200), ("1h30m", 5400), ("45", 45)]
)
def test_durations_are_read_one_way(text, seconds):
    assert parse_duration(text) == seconds
    assert parse_duration(format_duration(seconds)) == seconds


def test_a_node_not_ready_past_its_toleration_evicts_and_a_repair_drains_and_removes():
    """Taint eviction after the 300 s DefaultTolerationSeconds; a repair cordons, evicts through the
    Eviction API, removes the node once drained, and recreates it after --for."""
    from olmo_ctl.sandbox.kube_server import tiny_jobset

    with Sandbox(slices={"v5p-8": 1}) as sb:
        w = sb.world
        js = tiny_jobset("t", queue="multislice-queue", workers=1)
        pod_spec = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        pod_spec["containers"][0]["resources"] = {
            "requests": {"google.com/tpu": "4"},
            "limits": {"google.com/tpu": "4"},
        }
        pod_spec["nodeSelector"] = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice"}
        pod_spec["tolerations"] = [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
        # As the launch template has it: a disrupted pod is replaced, not counted.
        js["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"] = {
            "rules": [
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
            ]
        }
        with sb.server.store.lock:
            w.save("JobSet", js, new=True)
            w.reconcile()
        (pod,) = w.jobset_pods("t", live_only=True)
        assert pod["status"]["phase"] == "Running", pod["status"]
        sb.fault(parse_fault({"kind": "node-not-ready", "pool": "v5p-8"}))
        w.advance(299)
        (pod,) = w.jobset_pods("t")
        assert not pod["metadata"].get("deletionTimestamp") and find_cond(pod, "Ready")["status"] == "False"
        w.advance(2)
        (pod,) = w.jobset_pods("t")
        # Evicted, and Terminating while the kubelet is away; with a podFailurePolicy the Job replaces
        # a pod only once it is terminal (podReplacementPolicy Failed).
        assert pod["metadata"].get("deletionTimestamp") and pod["status"]["phase"] == "Running"
        assert find_cond(pod, "DisruptionTarget")["reason"] == "DeletionByTaintManager"
        sb.fault(parse_fault({"kind": "capacity", "pool": "v5p-8", "nodes": 1}))  # the kubelet is back
        (new,) = w.jobset_pods("t")
        assert new["metadata"]["uid"] != pod["metadata"]["uid"] and new["status"]["phase"] == "Running"

        sb.fault(parse_fault({"kind": "repair", "pool": "v5p-8", "for": "1h"}))
        assert w.items("Node", None) == []  # drained (the scripted container exits on SIGTERM), removed
        (pending,) = w.jobset_pods("t", live_only=True)
        assert find_cond(pending, "PodScheduled")["reason"] == "Unschedulable"
        # The nodes come back from their repair with a kubelet whose device plugin is not ready yet.
        sb.fault(parse_fault({"kind": "admission-error", "pool": "v5p-8", "for": "2h"}))
        w.advance(3601)
        assert len(w.items("Node", None)) == 1
        (bound,) = w.jobset_pods("t", live_only=True)  # bound; its kubelet decides at its next pod sync
        assert bound["spec"]["nodeName"] and bound["status"]["phase"] == "Pending"
        w.advance(1)
        (refused,) = [
            p for p in w.jobset_pods("t") if p["status"].get("reason") == "UnexpectedAdmissionError"
        ]
        assert refused["status"]["phase"] == "Failed" and refused["spec"]["nodeName"] == "gke-v5p-8-np-0-0000"
        assert refused["status"]["message"].startswith("Allocate failed due to requested number of devices")
        assert find_cond(refused, "DisruptionTarget") is None  # counts towards the Job's backoffLimit


def _one_pod_jobset(sb: Sandbox) -> None:
    from olmo_ctl.sandbox.kube_server import tiny_jobset

    js = tiny_jobset("t", queue="multislice-queue", workers=1)
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    spec = job["template"]["spec"]
    spec["containers"][0]["resources"] = {
        "requests": {"google.com/tpu": "4"},
        "limits": {"google.com/tpu": "4"},
    }
    spec["nodeSelector"] = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice"}
    spec["tolerations"] = [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
    job["podFailurePolicy"] = {
        "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
    }
    with sb.server.store.lock:
        sb.world.save("JobSet", js, new=True)
        sb.world.reconcile()


def test_a_spot_reclaim_shuts_the_node_down_gracefully_then_the_vm_is_gone_until_it_returns():
    with Sandbox(slices={"v5p-8": 1}) as sb:
        w = sb.world
        _one_pod_jobset(sb)
        (pod,) = w.jobset_pods("t", live_only=True)
        sb.fault(parse_fault({"kind": "spot-reclaim", "pool": "v5p-8", "for": "1h"}))
        (old,) = [p for p in w.jobset_pods("t") if p["metadata"]["uid"] == pod["metadata"]["uid"]]
        assert old["status"]["phase"] == "Failed" and old["status"]["reason"] == "Terminated"
        assert find_cond(old, "DisruptionTarget")["reason"] == "TerminationByKubelet"
        assert old["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 143
        assert len(w.items("Node", None)) == 1  # GCE's notice: the VM is there for 30 s
        w.advance(31)
        assert w.items("Node", None) == []
        (pending,) = w.jobset_pods("t", live_only=True)  # replaced (Ignore), waiting for a node
        assert find_cond(pending, "PodScheduled")["reason"] == "Unschedulable"
        w.advance(3600)
        (node,) = w.items("Node", None)
        assert find_cond(node, "Ready")["status"] == "True"
        (running,) = w.jobset_pods("t", live_only=True)
        assert (
            running["status"]["phase"] == "Running"
            and running["spec"]["nodeName"] == node["metadata"]["name"]
        )


def test_the_status_names_each_wait_for_capacity_and_the_policy_calls_them_waits():
    """gke_status: a pod on a NotReady node and a pod the kubelet refused are waits (`wait_cause`), a
    pod the API server refused is not (a configuration); policy.waiting_for reads them."""
    from test_state import ADMITTED_WL, jobset, pod

    from olmo_ctl.backends.base import AttemptStatus, State
    from olmo_ctl.backends.gke_status import classify
    from olmo_ctl.supervise.policy import waiting_for

    with Sandbox(slices={"v5p-8": 1}) as sb:
        w = sb.world
        _one_pod_jobset(sb)
        sb.fault(parse_fault({"kind": "node-not-ready", "pool": "v5p-8", "for": "5m"}))
        js = w.get("JobSet", "default", "t")
        st = classify(js, w.workload_of(js), w.jobset_pods("t"), w.items("Event", "default"))
        assert st.state == State.ADMITTED and st.wait_cause == "node-not-ready", st
        assert st.reason.startswith("0/1 pods running; 1 pod(s) on NotReady nodes (pod t-slice-0-0-")
        assert waiting_for(st) == ("node-not-ready", st.reason)
    refused = pod(0, "Failed", pod_reason="UnexpectedAdmissionError")
    refused["status"]["message"] = (
        "Allocate failed due to requested number of devices unavailable for google.com/tpu"
    )
    st = classify(jobset(), ADMITTED_WL, [refused, pod(1)], [])
    assert st.state == State.ADMITTED and st.wait_cause == "kubelet-admission"
    assert st.reason == (
        "1/2 pods running; the kubelet refused pod run-a1-slice-0-0-abcde: UnexpectedAdmissionError: "
        "Allocate failed due to requested number of devices unavailable for google.com/tpu"
    )
    assert waiting_for(st) == ("kubelet-admission", st.reason)
    assert waiting_for(AttemptStatus(State.ADMITTED, pods_refused=True, cause="FailedCreate: ...")) is None
    assert waiting_for(AttemptStatus(State.QUEUED, deactivated="someone")) is None
    assert waiting_for(AttemptStatus(State.QUEUED, "x", evicted="PodsReadyTimeout")) == ("requeued", "x")


def test_with_pods_as_processes_a_host_event_kills_them_and_a_silent_kubelet_lets_them_run():
    """ProcessRunner: a host event kills the pod's process at once, but the pod reads Running until
    the kubelet is back and reports ContainerStatusUnknown 137; a node-not-ready pod's process runs
    on through its taint eviction and gets SIGTERM only when its kubelet is back."""
    import time

    from helpers.waiting import alive

    from olmo_ctl.sandbox.pod_processes import ProcessRunner

    script = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); print('up', flush=True); time.sleep(600)"
    runner = ProcessRunner(poll_s=0.05)
    with Sandbox(slices={"v5p-8": 1}, runner=runner) as sb:
        w = sb.world

        def started(name: str) -> int:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with sb.server.store.lock:
                    pods = w.jobset_pods(name, live_only=True)
                    pid = runner.pid("default", pods[0]["metadata"]["name"]) if pods else None
                if pid:
                    return pid
                time.sleep(0.05)
            raise AssertionError(f"{name}'s pod did not start")

        def create(name: str) -> None:
            from olmo_ctl.sandbox.kube_server import tiny_jobset

            js = tiny_jobset(name, queue="multislice-queue", workers=1, script=script)
            spec = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
            spec["containers"][0]["command"] = ["python", "-c", script]
            spec["containers"][0]["resources"] = {
                "requests": {"google.com/tpu": "4"},
                "limits": {"google.com/tpu": "4"},
            }
            spec["nodeSelector"] = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice"}
            with sb.server.store.lock:
                w.save("JobSet", js, new=True)
                w.reconcile()

        create("a")
        pid = started("a")
        sb.fault(parse_fault({"kind": "host-event", "pool": "v5p-8", "for": "1h"}))
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)
        time.sleep(0.3)  # a few kubelet passes: none reports the exit while the node is away
        with sb.server.store.lock:
            (pod,) = w.jobset_pods("a")
            assert pod["status"]["phase"] == "Running"
        sb.fault(parse_fault({"kind": "capacity", "pool": "v5p-8", "nodes": 1}))
        with sb.server.store.lock:
            old = next(p for p in w.jobset_pods("a") if p["metadata"]["uid"] == pod["metadata"]["uid"])
            term = old["status"]["containerStatuses"][0]["state"]["terminated"]
            assert (term["exitCode"], term["reason"]) == (137, "ContainerStatusUnknown")
            for o in w.items("JobSet", "default"):
                w.delete("JobSet", o, policy="Foreground", grace_s=0)
            w.reconcile()

        create("b")
        pid = started("b")
        sb.fault(parse_fault({"kind": "node-not-ready", "pool": "v5p-8", "for": "1h"}))
        w.advance(301)  # past the toleration: evicted, Terminating
        time.sleep(0.3)
        with sb.server.store.lock:
            (pod,) = [p for p in w.jobset_pods("b") if p["metadata"].get("deletionTimestamp")]
            assert pod["status"]["phase"] == "Running"
        assert alive(pid)  # its kubelet never heard of the deletion
        sb.fault(parse_fault({"kind": "capacity", "pool": "v5p-8", "nodes": 1}))  # back
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)
        assert any(f"SIGTERM to pid {pid}" in ln or f"SIGKILL to pid {pid}" in ln for ln in runner.lines), (
            runner.lines
        )


def test_a_shell_whose_sandbox_stopped_is_told_at_once(tmp_path):
    """The environment file names the serving process (OLMO_CTL_SANDBOX_PID, as the docs use it); once
    the sandbox has stopped, a command in a shell that sourced it says so at once (exit 2), where its
    API and emulator would be waited on; `config show` still shows the settings."""
    import os
    import time

    from helpers.cli import clean_env

    from olmo_ctl.sandbox.sandbox import env_file_for, parse_exports

    kc = tmp_path / "sb.kubeconfig"
    p = start_subprocess(kc, "--slices", "v5p-8=1", "--no-run-pods")
    try:
        exports = parse_exports(env_file_for(kc).read_text())
    finally:
        stop_subprocess(p)
    assert exports["OLMO_CTL_SANDBOX_PID"] == str(p.pid)
    env = {**clean_env(tmp_path / "xdg"), **exports}
    t0 = time.monotonic()
    r = invoke("runs", env=env)
    assert r.returncode == 2 and time.monotonic() - t0 < 5, r.stderr
    assert f"(OLMO_CTL_SANDBOX_PID={p.pid}) has stopped" in r.stderr and "unset KUBECONFIG" in r.stderr
    assert invoke("config", "show", env=env).returncode == 0
    env["OLMO_CTL_SANDBOX_PID"] = str(os.getpid())  # a sandbox still serving: nothing said
    assert "has stopped" not in invoke("runs", env=env).stderr
