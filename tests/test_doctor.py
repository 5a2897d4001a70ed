"""`olmo-ctl doctor` against `olmo-ctl sandbox` run as a real subprocess, and the checks `submit` runs.

The sandbox serves 1 x tpu7x-128 (flavor 1xtpu7x-128, 64 google.com/tpu, one node pool of 16 nodes),
LocalQueue default/multislice-queue and the WorkloadPriorityClass `high`, as XPK configures a cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from olmo_ctl.backends.doctor import run_checks, submit_checks
from olmo_ctl.backends.kube import make_api_client
from olmo_ctl.core.config import Settings
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.sandbox.sandbox import Sandbox, start_subprocess, stop_subprocess

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "us-docker.pkg.dev/p/r/olmo-ctl:0.1.0"


def start_sandbox(kubeconfig: Path, *args: str):
    return start_subprocess(kubeconfig, *args, env={**os.environ, "PYTHONPATH": str(ROOT)})


def stop_sandbox(p) -> tuple[int, str]:
    return stop_subprocess(p)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    d = tmp_path_factory.mktemp("sandbox")
    kc = d / "kubeconfig"
    p = start_sandbox(kc, "--slices", "tpu7x-128=1", "--priority-class", "high")
    yield kc
    rc, err = stop_sandbox(p)
    assert rc == 0, err
    assert "sandbox stopped" in err
    assert not kc.exists()  # the kubeconfig exists only while the sandbox serves


def doctor(kubeconfig: Path, *args: str, tmp: Path) -> tuple[int, dict, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "KUBECONFIG": str(kubeconfig),
        "OLMO_CTL_IMAGE": IMAGE,
        "XDG_CONFIG_HOME": str(tmp),
    }
    for k in ("OLMO_CTL_QUEUE", "OLMO_CTL_PRIORITY_CLASS", "OLMO_CTL_NAMESPACE", "OLMO_CTL_KUBE_CONTEXT"):
        env.pop(k, None)
    p = subprocess.run(
        [sys.executable, "-m", "olmo_ctl", "doctor", *args, "-o", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode, json.loads(p.stdout) if p.stdout.strip() else {}, p.stderr


def failed(report: dict) -> dict[str, str]:
    return {c["name"]: c["message"] for c in report["checks"] if not c["ok"]}


def test_the_sandbox_kubeconfig_points_at_it(sandbox):
    cfg = yaml.safe_load(sandbox.read_text())
    assert cfg["current-context"] == "olmo-ctl-sandbox"
    cluster = cfg["clusters"][0]["cluster"]
    # HTTPS with its own certificate, and a token: kubectl sends a token only over HTTPS
    assert cluster["server"].startswith("https://127.0.0.1:") and cluster["certificate-authority-data"]
    assert cfg["users"][0]["user"]["token"]


def test_all_checks_pass_for_a_configured_queue_and_device(sandbox, tmp_path):
    rc, report, err = doctor(sandbox, "--device", "tpu7x-128", "--priority-class", "high", tmp=tmp_path)
    assert rc == 0, (report, err)
    assert report["ok"] is True
    names = [c["name"] for c in report["checks"]]
    assert names == [
        "jobset-crd",
        "jobset-version",
        "kueue-crds",
        "namespace",
        "local-queue",
        "cluster-queue",
        "resource-flavor",
        "priority-class",
        "capacity",
        "trainer-resources",
        "rbac",
        "service-account",
        "node-pools",
        "image",
    ]
    # The sandbox runs JobSet v0.10.1, as the test cluster's rules do: warned about (jobset#1088).
    assert all(
        c["ok"] and (c["name"] == "jobset-version") == c["message"].startswith("warning")
        for c in report["checks"]
    ), report
    flavor = next(c for c in report["checks"] if c["name"] == "resource-flavor")["message"]
    assert "1xtpu7x-128" in flavor and "64 google.com/tpu" in flavor
    # 95% of a tpu7x-standard-4t's allocatable (223.37 cores, 956356 MiB) in whole cores and GiB
    resources = next(c for c in report["checks"] if c["name"] == "trainer-resources")["message"]
    assert resources == (
        "cpu 212, memory 887Gi per pod, requests equal to limits (Guaranteed); quota for 16 pod(s)"
    )


def test_a_trainer_larger_than_a_node_offers_fails(sandbox, tmp_path):
    (tmp_path / "olmo-ctl").mkdir()
    (tmp_path / "olmo-ctl" / "config.yaml").write_text("trainer_resources: cpu=224,memory=800Gi\n")
    rc, report, _ = doctor(sandbox, "--device", "tpu7x-128", tmp=tmp_path)
    assert rc == 2 and list(failed(report)) == ["trainer-resources"]
    msg = failed(report)["trainer-resources"]
    assert "cpu 224 is more than one tpu7x-standard-4t node offers its pods (223.37 cores allocatable" in msg
    (tmp_path / "olmo-ctl" / "config.yaml").write_text("trainer_resources: off\n")  # YAML's false
    rc, report, _ = doctor(sandbox, "--device", "tpu7x-128", tmp=tmp_path)
    assert rc == 0
    off = next(c for c in report["checks"] if c["name"] == "trainer-resources")["message"]
    assert off.startswith("off: the trainer requests no CPU or memory")


def test_a_missing_local_queue_exits_2_naming_it(sandbox, tmp_path):
    rc, report, _ = doctor(sandbox, "--device", "tpu7x-128", "--queue", "team-queue", tmp=tmp_path)
    assert rc == 2 and report["ok"] is False
    assert list(failed(report)) == ["local-queue"]
    assert "LocalQueue default/team-queue does not exist" in failed(report)["local-queue"]


def test_a_missing_workload_priority_class_exits_2_naming_it(sandbox, tmp_path):
    rc, report, _ = doctor(sandbox, "--device", "tpu7x-128", "--priority-class", "low", tmp=tmp_path)
    assert rc == 2
    assert list(failed(report)) == ["priority-class"]
    msg = failed(report)["priority-class"]
    assert "WorkloadPriorityClass low does not exist" in msg
    assert "scheduling.k8s.io PriorityClass low exists" in msg  # XPK's PriorityClass is not Kueue's


def test_a_device_with_no_flavor_exits_2_naming_it(sandbox, tmp_path):
    rc, report, _ = doctor(sandbox, "--device", "v5p-256", tmp=tmp_path)
    assert rc == 2
    # and the CPU quota, every tpu7x node's, is less than a v5p-256's 32 trainers ask for
    assert set(failed(report)) == {"resource-flavor", "node-pools", "trainer-resources"}
    msg = failed(report)["resource-flavor"]
    assert "ClusterQueue cluster-queue has no ResourceFlavor for v5p-256" in msg
    assert "cloud.google.com/gke-tpu-accelerator=tpu-v5p-slice" in msg


def test_too_little_quota_for_the_slices_fails(sandbox, tmp_path):
    rc, report, _ = doctor(sandbox, "--device", "tpu7x-128", "--slices", "2", tmp=tmp_path)
    assert rc == 2
    assert "nominal quota of 64 google.com/tpu" in failed(report)["resource-flavor"]
    assert "needs 128" in failed(report)["resource-flavor"]
    assert "1 complete node pool" in failed(report)["node-pools"]


def test_node_pools_without_the_placement_policy_the_pods_select_fail_naming_it(sandbox, tmp_path):
    """Multi-host Ironwood pods select XPK's placement policy by default; node pools made without it
    never take them: node-pools fails naming the selector, and `--placement-policy none` passes."""
    rc, report, _ = doctor(
        sandbox, "--device", "tpu7x-128", "--placement-policy", "other-policy", tmp=tmp_path
    )
    assert rc == 2 and list(failed(report)) == ["node-pools"]
    assert "cloud.google.com/placement-policy-name=other-policy" in failed(report)["node-pools"]
    rc, report, _ = doctor(sandbox, "--device", "tpu7x-128", tmp=tmp_path)
    nodes = next(c for c in report["checks"] if c["name"] == "node-pools")["message"]
    assert rc == 0 and "placement-policy-name=tpu7x-128-4x4x4-placement-policy" in nodes


def test_an_unreachable_cluster_exits_3(sandbox, tmp_path):
    cfg = yaml.safe_load(sandbox.read_text())
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg["clusters"][0]["cluster"]["server"] = f"http://127.0.0.1:{port}"
    kc = tmp_path / "dead.kubeconfig"
    kc.write_text(yaml.safe_dump(cfg))
    t = time.monotonic()
    rc, report, _ = doctor(kc, "--device", "tpu7x-128", tmp=tmp_path)
    assert rc == 3
    assert report["ok"] is False and report["checks"][0]["name"] == "cluster"
    message = report["checks"][0]["message"]
    assert "no usable answer from the Kubernetes API" in message
    # Doctor submits nothing: what to do is about the cluster and doctor itself.
    assert "then run `olmo-ctl doctor` again" in message and "submitted" not in message
    assert time.monotonic() - t < 30


def test_the_sandbox_refuses_to_overwrite_a_real_kubeconfig(tmp_path):
    kc = tmp_path / "config"
    kc.write_text(yaml.safe_dump({"contexts": [{"name": "gke_prod", "context": {}}]}))
    p = subprocess.run(
        [sys.executable, "-m", "olmo_ctl", "sandbox", "--kubeconfig", str(kc)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    assert "exists and is not a sandbox kubeconfig" in p.stderr
    assert "gke_prod" in kc.read_text()


# ---------------------------------------------------------------- in-process: RBAC, forbidden reads, submit


@pytest.fixture
def box():
    with Sandbox(slices={"tpu7x-128": 1}, priority_classes={"high": 750}) as sb:
        yield sb


def _settings(**kw) -> Settings:
    return Settings(image=IMAGE, **kw)


def test_rbac_names_each_verb_the_account_lacks(box):
    box.server.forbid("delete", "jobsets", "jobset.x-k8s.io")
    box.server.forbid("get", "pods/log")
    checks = {
        c.name: c for c in run_checks(make_api_client(host=box.url), _settings(), get_device("tpu7x-128"))
    }
    assert not checks["rbac"].ok
    assert "may not delete jobsets.jobset.x-k8s.io, get pods/log" in checks["rbac"].message
    # and the server itself refuses what it said was forbidden
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as e:
        client.CustomObjectsApi(make_api_client(host=box.url)).delete_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", "default", "jobsets", "x"
        )
    assert e.value.status == 403


def test_nodes_that_may_not_be_listed_are_a_warning(box):
    box.server.forbid("list", "nodes")
    checks = {
        c.name: c for c in run_checks(make_api_client(host=box.url), _settings(), get_device("tpu7x-128"))
    }
    assert checks["node-pools"].ok
    assert checks["node-pools"].message.startswith("warning: cannot list nodes (forbidden)")
    assert all(c.ok for c in checks.values())


def test_submit_checks_name_the_missing_objects(box):
    api = make_api_client(host=box.url)
    submit_checks(api, _settings(priority_class="high"), get_device("tpu7x-128"))  # all there: no error
    with pytest.raises(BadInput, match="WorkloadPriorityClass low does not exist"):
        submit_checks(api, _settings(priority_class="low"), get_device("tpu7x-128"))
    with pytest.raises(BadInput, match="LocalQueue default/user-queue does not exist"):
        submit_checks(api, _settings(queue="user-queue"), get_device("tpu7x-128"))
    with pytest.raises(BadInput, match="no ResourceFlavor for v5p-256"):
        submit_checks(api, _settings(), get_device("v5p-256"))
    assert box.server.count("POST", "/jobsets") == 0


def test_a_cluster_queue_that_does_not_cover_cpu_and_memory_fails_doctor_and_submit(box):
    """Kueue admits no pod set requesting a resource its ClusterQueue does not cover (an XPK cluster
    made without --cpu-limit and --memory-limit covers only the accelerator): doctor and submit name
    it with the remedy; `trainer_resources: off` needs neither."""
    import copy

    api, dev = make_api_client(host=box.url), get_device("tpu7x-128")
    w = box.world
    with box.server.store.lock:
        cq = copy.deepcopy(w.get("ClusterQueue", "", "cluster-queue"))
        cq["spec"]["resourceGroups"] = cq["spec"]["resourceGroups"][:1]  # the TPU group alone
        w.save("ClusterQueue", cq)
    checks = {c.name: c for c in run_checks(api, _settings(), dev)}
    assert not checks["trainer-resources"].ok
    msg = checks["trainer-resources"].message
    assert "ClusterQueue cluster-queue covers no cpu or memory" in msg
    assert "kubectl patch clusterqueue cluster-queue" in msg and "trainer_resources: off" in msg
    with pytest.raises(BadInput, match="covers no cpu or memory"):
        submit_checks(api, _settings(), dev)
    assert box.server.count("POST", "/jobsets") == 0
    submit_checks(api, _settings(trainer_resources="off"), dev)
    checks = {c.name: c for c in run_checks(api, _settings(trainer_resources="off"), dev)}
    assert checks["trainer-resources"].ok


def test_nodes_with_less_allocatable_and_a_quota_under_the_slices_fail_naming_them(box):
    """The nodes of a cluster may offer less than their machine type's GKE allocatable (other machine
    sizes, reservations); XPK's --cpu-limit makes the quota one machine's size. doctor names both;
    submit checks coverage only (a ClusterQueue may borrow quota)."""
    import copy

    api, dev = make_api_client(host=box.url), get_device("tpu7x-128")
    w = box.world
    with box.server.store.lock:
        node = copy.deepcopy(w.get("Node", "", "gke-tpu7x-128-np-0-0003"))
        node["status"]["allocatable"]["cpu"] = "200"
        w.save("Node", node)
    checks = {c.name: c for c in run_checks(api, _settings(), dev)}
    msg = checks["trainer-resources"].message
    assert not checks["trainer-resources"].ok
    assert msg.startswith(
        "node gke-tpu7x-128-np-0-0003 has 200 cores of cpu allocatable, under the trainer's 212 cores"
    )
    with box.server.store.lock:
        node["status"]["allocatable"]["cpu"] = "223370m"
        w.save("Node", node)
        cq = copy.deepcopy(w.get("ClusterQueue", "", "cluster-queue"))
        cq["spec"]["resourceGroups"][1]["flavors"][0]["resources"][0]["nominalQuota"] = "224"  # one machine
        w.save("ClusterQueue", cq)
    checks = {c.name: c for c in run_checks(api, _settings(), dev)}
    msg = checks["trainer-resources"].message
    assert not checks["trainer-resources"].ok
    assert "has a nominal quota of 224 cores cpu for tpu7x-128; its 16 pod(s) need 3392 cores" in msg
    assert '"nominalQuota": "3392"' in msg and "kubectl patch clusterqueue cluster-queue" in msg
    submit_checks(api, _settings(), dev)  # coverage only: no error
    assert run_checks(api, _settings(trainer_resources="off"), dev)


def test_submit_checks_accept_a_flavor_without_labels(kube_server):
    """The test server's `tpu-flavor` has no node labels and no quota yet: Kueue would admit a slice
    into it once capacity appears, so submit does not refuse it (doctor warns)."""
    submit_checks(make_api_client(host=kube_server.url), _settings(), get_device("tpu7x-128"))


def test_submit_refuses_a_missing_priority_class_before_creating_anything(gcs, tmp_path, monkeypatch, capsys):
    """Break 4 through the command: `submit` names the missing WorkloadPriorityClass (exit 2) before the
    run directory or the JobSet exist; with the class there it submits."""
    from olmo_ctl.cli import main
    from olmo_ctl.rundir import RunDir

    with Sandbox(slices={"tpu7x-8": 1}, priority_classes={"high": 750}) as box:
        monkeypatch.setenv("KUBECONFIG", str(box.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
        root = f"gs://{gcs.bucket}/runs"
        args = [
            "submit",
            "--recipe",
            "smoke",
            "--device",
            "tpu7x-8",
            "--run",
            "wpc",
            "--run-root",
            root,
            "--image",
            IMAGE,
            "--no-preflight",
            "--priority-class",
        ]
        assert main([*args, "low"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: WorkloadPriorityClass low does not exist") and err.count("\n") == 1
        assert box.server.count("POST", "/jobsets") == 0
        assert not RunDir.of(root, "wpc").exists()  # nothing created: no run.yaml either
        assert main([*args, "high"]) == 0, capsys.readouterr().err
        assert box.server.count("POST", "/jobsets") == 1


# ---------------------------------------------------------------- a kubeconfig that cannot be read

BROKEN_KUBECONFIGS = {
    "a YAML syntax error": (
        'apiVersion: v1\nclusters:\n- cluster: {server: "https://1.2.3.4\n  name: c\n',
        "is not valid YAML: while scanning a quoted scalar, found unexpected end of stream at line 5, column 1",
    ),
    "a list": ("- a\n- b\n", "is not a kubeconfig: its top level is a list, not a mapping"),
    "contexts that are no list": (
        "current-context: c\ncontexts: 5\n",
        "is not a kubeconfig: `contexts` is not a list of named entries",
    ),
    "not text": (b"\xff\xfe\x00kube", "is not a text file"),
    "empty": ("", "is empty"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_KUBECONFIGS))
def test_a_kubeconfig_that_cannot_be_read_is_one_line_and_exit_2_for_every_command(case, tmp_path, gcs):
    """Each command that loads the kubeconfig (doctor, submit, resume-until-done, logs, logs -f, stop)
    says what is wrong with which file and what to do, in one line, exit 2, and changes nothing."""
    from helpers.cli import clean_env, invoke

    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.rundir import RunDir

    text, says = BROKEN_KUBECONFIGS[case]
    kc = tmp_path / "bad.kubeconfig"
    kc.write_bytes(text if isinstance(text, bytes) else text.encode())
    root = f"gs://{gcs.bucket}/runs"
    rd = RunDir.of(root, "gk")
    r = load_recipe("smoke", overrides=["train.max_steps=20"])
    rd.create_run(r.to_dict(), r.fingerprint(), "fp", "tpu7x-8")
    rd.append(
        "submitted", attempt=1, device="tpu7x-8", handle={"backend": "gke", "name": "gk-a1", "attempt": 1}
    )
    journal = rd.journal()
    env = {**clean_env(tmp_path / "config"), "KUBECONFIG": str(kc)}
    site = ("--run-root", root, "--backend", "gke", "--image", IMAGE)
    commands = {
        "doctor": ("doctor", "--device", "tpu7x-8", "--image", IMAGE),
        "submit": (
            "submit",
            "--recipe",
            "smoke",
            "--device",
            "tpu7x-8",
            "--run",
            "new",
            "--no-preflight",
            *site,
        ),
        "resume-until-done": ("resume-until-done", "new2", "--recipe", "smoke", "--device", "tpu7x-8", *site),
        "logs": ("logs", "gk", *site[:4]),
        "logs -f": ("logs", "gk", "-f", *site[:4]),
        "stop": ("stop", "gk", *site[:4]),
    }
    want = f"error: kubeconfig `{kc}` (from $KUBECONFIG) {says}"
    for name, args in commands.items():
        p = invoke(*args, env=env)
        assert (p.returncode, p.stdout) == (2, ""), (name, p.stdout, p.stderr)
        assert p.stderr.startswith(want) and p.stderr.count("\n") == 1, (name, p.stderr)
        assert p.stderr.endswith(
            "; fix the file, point KUBECONFIG at a good one, or write a new one with "
            "`gcloud container clusters get-credentials CLUSTER --region REGION`\n"
        ), (name, p.stderr)
    assert rd.journal() == journal  # nothing written
    assert not RunDir.of(root, "new").exists() and not RunDir.of(root, "new2").exists()
