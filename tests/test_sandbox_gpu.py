"""GPU nodes in the sandbox, and doctor's GPU checks.

`olmo-ctl sandbox --slices h100-mega-80gb-8=2` holds what `xpk cluster create --device-type
h100-mega-80gb-8 --num-nodes 2` and GKE's GPUDirect-TCPXO guide leave a cluster: 2 nodes with GKE's
GPU labels, taint and `nvidia.com/gpu`, XPK's GPU flavor and quota, the NCCL TCPXO installer
DaemonSet, and the Network / GKENetworkParamSet objects of the pods' interfaces. Doctor passes every
check on it, and each GPU check fails, naming its fix, once its piece is removed through the API. The
A3 Mega JobSet the GKE backend renders (its golden) is admitted and runs one pod per node, the
`tcpxo-daemon` sidecar started before the trainer and stopped after it, and a pod's process gets the
GPU JobSet's coordinator as this machine reaches it. And the Done-when, in the chaos lane: `smoke
--backend gke --device h100-mega-80gb-8x2` on that sandbox passes every check, each attempt 2
trainer processes of 8 CPU devices joined from NNODES / NODE_RANK / JAX_COORDINATOR_*.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.cli import invoke
from test_sandbox_pods import _clean_env, _exports, _gone, create, wait_for

from olmo_ctl.backends.gke_gpu import GPU_TAINT, NCCL_INSTALLERS
from olmo_ctl.core.errors import BadInput
from olmo_ctl.sandbox.pod_processes import ProcessRunner, expand, pod_by_dns_name
from olmo_ctl.sandbox.sandbox import Sandbox, parse_slices

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "goldens" / "h100-mega-80gb-8x2-stage1.yaml"
DEVICE = "h100-mega-80gb-8x2"
SELECTOR = "cloud.google.com/gke-accelerator=nvidia-h100-mega-80gb"
NODES = ["gke-h100-mega-80gb-8-np-0-0000", "gke-h100-mega-80gb-8-np-0-0001"]
NETWORKS = [f"vpc{i}" for i in range(1, 9)]
IMAGE = "us-docker.pkg.dev/p/r/olmo-ctl:0.1.0"


@pytest.fixture
def box():
    with Sandbox(slices=parse_slices(["h100-mega-80gb-8=2"])) as sb:
        yield sb


def apis(sb):
    from kubernetes import client

    from olmo_ctl.backends.kube import make_api_client

    api = make_api_client(host=sb.url)
    return client.CoreV1Api(api), client.AppsV1Api(api), client.CustomObjectsApi(api)


def doctor(sb, tmp_path: Path, *args: str) -> tuple[int, dict[str, dict]]:
    """`olmo-ctl doctor --device h100-mega-80gb-8x2 -o json` against the sandbox: (exit code, checks)."""
    kc = sb.write_kubeconfig(tmp_path / "sb.kubeconfig")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    env.update(KUBECONFIG=str(kc), OLMO_CTL_IMAGE=IMAGE, XDG_CONFIG_HOME=str(tmp_path / "config"))
    r = invoke("doctor", "--device", DEVICE, *args, "-o", "json", env=env)
    assert r.stdout.strip(), r.stderr
    return r.returncode, {c["name"]: c for c in json.loads(r.stdout)["checks"]}


def failed(checks: dict[str, dict]) -> dict[str, str]:
    return {n: c["message"] for n, c in checks.items() if not c["ok"]}


# ---------------------------------------------------------------- what the sandbox holds


def test_gpu_slices_are_nodes_of_a_machine_type():
    assert parse_slices(["h100-mega-80gb-8=2"]) == {"h100-mega-80gb-8": 2}
    assert parse_slices(["h100-mega-80gb-8x2=3", "h100-mega-80gb-8"]) == {"h100-mega-80gb-8": 7}
    assert parse_slices(["b200-8x4", "v5p-16=2"]) == {"b200-8": 4, "v5p-16": 2}
    with pytest.raises(BadInput, match="`cpu-4` is neither a TPU slice nor GPU nodes"):
        parse_slices(["cpu-4=1"])
    with pytest.raises(BadInput, match="the number of nodes must be a positive integer"):
        parse_slices(["h100-mega-80gb-8=0"])


def test_the_gpu_cluster_is_what_xpk_and_gkes_gpudirect_guide_make(box):
    w = box.world
    nodes = sorted(w.items("Node", None), key=lambda n: n["metadata"]["name"])
    assert [n["metadata"]["name"] for n in nodes] == NODES
    for n in nodes:
        lab = n["metadata"]["labels"]
        assert lab["cloud.google.com/gke-accelerator"] == "nvidia-h100-mega-80gb"
        assert (
            lab["cloud.google.com/gce-machine-type"]
            == lab["node.kubernetes.io/instance-type"]
            == "a3-megagpu-8g"
        )
        assert lab["cloud.google.com/gke-nodepool"] == "h100-mega-80gb-8-np-0"
        assert n["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
        # 208 vCPU and 1872 GiB less GKE's reservations (core/node_resources.gke_allocatable)
        assert n["status"]["allocatable"] == {"nvidia.com/gpu": "8", "cpu": "207410m", "memory": "1871567Mi"}
    rf = w.get("ResourceFlavor", "", "1xh100-mega-80gb-8")
    assert rf["spec"]["nodeLabels"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-mega-80gb"}
    group, cpu_memory = w.get("ClusterQueue", "", "cluster-queue")["spec"]["resourceGroups"]
    assert cpu_memory["coveredResources"] == ["cpu", "memory"]
    assert cpu_memory["flavors"][0]["resources"] == [
        {"name": "cpu", "nominalQuota": "414820m"},
        {"name": "memory", "nominalQuota": "3743134Mi"},
    ]
    assert group == {
        "coveredResources": ["nvidia.com/gpu"],
        "flavors": [
            {"name": "1xh100-mega-80gb-8", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "16"}]}
        ],
    }
    ds = w.get("DaemonSet", "kube-system", "nccl-tcpxo-installer")
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["nvidia-h100-mega-80gb"]
    assert ds["status"]["desiredNumberScheduled"] == ds["status"]["numberReady"] == 2
    assert w.get("Network", "", "default")["spec"] == {"type": "L3"}
    for name in NETWORKS:
        net, gnp = w.get("Network", "", name), w.get("GKENetworkParamSet", "", name)
        assert net["spec"]["parametersRef"] == {
            "group": "networking.gke.io",
            "kind": "GKENetworkParamSet",
            "name": name,
        }
        assert gnp["spec"] == {
            "vpc": f"sandbox-net-{name[3:]}",
            "vpcSubnet": f"sandbox-sub-{name[3:]}",
            "deviceMode": "NetDevice",
        }
        assert {c["type"]: c["status"] for c in net["status"]["conditions"]} == {
            "ParamsReady": "True",
            "Ready": "True",
        }


def test_an_rdma_machine_type_gets_its_installer_and_rdma_networks():
    with Sandbox(slices=parse_slices(["h200-141gb-8=2", "b200-8=2"])) as sb:
        ds = sb.world.get("DaemonSet", "kube-system", "nccl-rdma-installer")
        values = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
        assert values == ["nvidia-b200", "nvidia-h200-141gb"] and ds["status"]["numberReady"] == 4
        modes = {
            g["metadata"]["name"]: g["spec"]["deviceMode"] for g in sb.world.items("GKENetworkParamSet", None)
        }
        assert modes == {"gvnic-1": "NetDevice", **{f"rdma-{i}": "RDMA" for i in range(8)}}


# ---------------------------------------------------------------- doctor


def test_doctor_passes_every_gpu_check_on_a_complete_sandbox(box, tmp_path):
    rc, checks = doctor(box, tmp_path)
    assert rc == 0, checks
    assert list(checks) == [
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
        "nccl-installer",
        "gpu-networks",
        "image",
    ]
    assert not failed(checks)
    assert (
        "1xh100-mega-80gb-8" in checks["resource-flavor"]["message"]
        and "16 nvidia.com/gpu" in checks["resource-flavor"]["message"]
    )
    assert checks["node-pools"]["message"].startswith(f"2 node(s) with {SELECTOR} and 8 nvidia.com/gpu each")
    assert checks["nccl-installer"]["message"] == (
        "DaemonSet kube-system/nccl-tcpxo-installer selects nvidia-h100-mega-80gb nodes (2/2 ready)"
    )
    assert checks["gpu-networks"]["message"].startswith("Networks vpc1, vpc2, vpc3")


def _no_nodes(sb):
    core, _, _ = apis(sb)
    for n in NODES:
        core.delete_node(n, _preload_content=False)


def _no_driver(sb):
    core, _, _ = apis(sb)
    for n in NODES:  # the device plugin has no GPUs to offer until the driver is installed
        core.patch_node_status(
            n, {"status": {"allocatable": {"nvidia.com/gpu": "0"}}}, _preload_content=False
        )


def _tainted(sb):
    core, _, _ = apis(sb)
    for n in NODES:
        taints = [dict(GPU_TAINT), {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]
        core.patch_node(n, {"spec": {"taints": taints}}, _preload_content=False)


def _cpu_memory_group(sb) -> list[dict]:
    """The ClusterQueue's group of the trainers' CPU and memory, kept when the GPU group is changed."""
    cq = sb.world.get("ClusterQueue", "", "cluster-queue")
    return [g for g in cq["spec"]["resourceGroups"] if "cpu" in g["coveredResources"]]


def _no_flavor(sb):
    _, _, custom = apis(sb)
    custom.patch_cluster_custom_object(
        "kueue.x-k8s.io",
        "v1beta1",
        "clusterqueues",
        "cluster-queue",
        {"spec": {"resourceGroups": _cpu_memory_group(sb)}},
    )


def _small_quota(sb):
    _, _, custom = apis(sb)
    flavors = [{"name": "1xh100-mega-80gb-8", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "8"}]}]
    groups = [{"coveredResources": ["nvidia.com/gpu"], "flavors": flavors}, *_cpu_memory_group(sb)]
    custom.patch_cluster_custom_object(
        "kueue.x-k8s.io", "v1beta1", "clusterqueues", "cluster-queue", {"spec": {"resourceGroups": groups}}
    )


def _no_installer(sb):
    _, apps, _ = apis(sb)
    apps.delete_namespaced_daemon_set("nccl-tcpxo-installer", "kube-system")


def _installer_for_other_nodes(sb):
    _, apps, _ = apis(sb)
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {
                                "key": "cloud.google.com/gke-accelerator",
                                "operator": "In",
                                "values": ["nvidia-h200-141gb"],
                            }
                        ]
                    }
                ]
            }
        }
    }
    apps.patch_namespaced_daemon_set(
        "nccl-tcpxo-installer", "kube-system", {"spec": {"template": {"spec": {"affinity": affinity}}}}
    )


def _no_network(sb):
    _, _, custom = apis(sb)
    custom.delete_cluster_custom_object("networking.gke.io", "v1", "networks", "vpc3")


def _no_paramset(sb):
    _, _, custom = apis(sb)
    custom.delete_cluster_custom_object("networking.gke.io", "v1", "gkenetworkparamsets", "vpc5")


def _wrong_device_mode(sb):
    _, _, custom = apis(sb)
    custom.patch_cluster_custom_object(
        "networking.gke.io", "v1", "gkenetworkparamsets", "vpc2", {"spec": {"deviceMode": "RDMA"}}
    )


INSTALLER = NCCL_INSTALLERS["tcpxo"].manifest


@pytest.mark.parametrize(
    "remove, check, says",
    [
        (
            _no_nodes,
            "node-pools",
            [
                f"no nodes with {SELECTOR}: create a node pool of 2 x a3-megagpu-8g (as `xpk cluster create "
                "--device-type h100-mega-80gb-8 --num-nodes 2` does",
                "--accelerator type=nvidia-h100-mega-80gb,count=8,gpu-driver-version=latest",
            ],
        ),
        (
            _no_driver,
            "node-pools",
            [
                "2 node(s) with",
                "have less than 8 allocatable nvidia.com/gpu: the NVIDIA driver is not installed",
                "kubectl apply -f https://raw.githubusercontent.com/GoogleCloudPlatform/container-engine-accelerators/master/nvidia-driver-installer/cos/daemonset-preloaded-latest.yaml",
            ],
        ),
        (
            _tainted,
            "node-pools",
            [
                "are tainted dedicated=ml:NoSchedule, which the pods do not tolerate",
                f"(kubectl taint nodes -l {SELECTOR} dedicated:NoSchedule-)",
                "the site setting `tolerations`",
            ],
        ),
        (
            _no_flavor,
            "resource-flavor",
            [
                "ClusterQueue cluster-queue has no ResourceFlavor for h100-mega-80gb-8x2 covering nvidia.com/gpu "
                "(cloud.google.com/gke-accelerator=nvidia-h100-mega-80gb)",
                "add a flavor with these node labels and nvidia.com/gpu quota",
            ],
        ),
        (
            _small_quota,
            "resource-flavor",
            [
                "nominal quota of 8 nvidia.com/gpu in ClusterQueue cluster-queue; h100-mega-80gb-8x2 needs 16: raise its nominalQuota"
            ],
        ),
        (
            _no_installer,
            "nccl-installer",
            [
                "no DaemonSet kube-system/nccl-tcpxo-installer: NCCL's tcpxo plugin is not installed on the GPU nodes",
                f"install it: kubectl apply -f {INSTALLER}",
            ],
        ),
        (
            _installer_for_other_nodes,
            "nccl-installer",
            [
                "DaemonSet kube-system/nccl-tcpxo-installer does not select "
                "cloud.google.com/gke-accelerator=nvidia-h100-mega-80gb nodes",
                f"add nvidia-h100-mega-80gb to its node affinity, or apply the installer for a3-megagpu-8g: kubectl apply -f {INSTALLER}",
            ],
        ),
        (
            _no_network,
            "gpu-networks",
            [
                "no Network vpc3: GKE refuses the pods, whose interfaces name them",
                "create each with its GKENetworkParamSet (deviceMode NetDevice",
                "docs/sandbox-and-doctor.md#gpu-clusters",
            ],
        ),
        (
            _no_paramset,
            "gpu-networks",
            [
                "Network vpc5 refers to GKENetworkParamSet vpc5, which does not exist: create it",
                "deviceMode NetDevice",
            ],
        ),
        (
            _wrong_device_mode,
            "gpu-networks",
            [
                "GKENetworkParamSet vpc2 (of Network vpc2) has deviceMode RDMA; tcpxo needs NetDevice: recreate it"
            ],
        ),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else None,
)
def test_each_gpu_check_fails_naming_its_fix_when_its_piece_is_removed(box, tmp_path, remove, check, says):
    remove(box)
    rc, checks = doctor(box, tmp_path)
    assert rc == 2
    bad = failed(checks)
    assert list(bad) == [check], bad
    for text in says:
        assert text in bad[check], bad[check]


def test_a_taint_the_site_tolerates_passes(box, tmp_path):
    _tainted(box)
    cfg = tmp_path / "config" / "olmo-ctl"
    cfg.mkdir(parents=True)
    (cfg / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "tolerations": [
                    {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
                ]
            }
        )
    )
    rc, checks = doctor(box, tmp_path)
    assert rc == 0, failed(checks)


def test_doctor_refuses_a_local_device_in_one_line(tmp_path):
    r = invoke("doctor", "--device", "cpu-4", env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path)})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "doctor checks a cluster for TPU slices and GPU nodes" in r.stderr


# ---------------------------------------------------------------- the rendered A3 Mega JobSet


def a3_mega_jobset(name: str = "gpu-a1") -> dict:
    """The GKE backend's A3 Mega JobSet (its golden), in the sandbox's namespace, queue and account."""
    js = copy.deepcopy(yaml.safe_load(GOLDEN.read_text()))
    js["metadata"].update(name=name, namespace="default")
    js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = "multislice-queue"
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["serviceAccountName"] = "olmo-ctl"
    return js


def test_the_rendered_a3_mega_jobset_runs_one_pod_per_gpu_node_with_its_sidecar(box):
    create(box, a3_mega_jobset())
    c = box.server.cluster
    pods = wait_for(
        lambda: (p := c.pods("gpu-a1")) and len(p) == 2 and all(x["spec"].get("nodeName") for x in p) and p
    )
    wl = c.workload("gpu-a1")
    (psa,) = wl["status"]["admission"]["podSetAssignments"]
    # the trainer's CPU and memory (an a3-megagpu-8g's share) from the flavor of their own
    assert psa["flavors"] == {
        "nvidia.com/gpu": "1xh100-mega-80gb-8",
        "cpu": "cpu-memory",
        "memory": "cpu-memory",
    }
    assert psa["resourceUsage"] == {"nvidia.com/gpu": "16", "cpu": "394", "memory": "3472Gi"}
    assert sorted(p["spec"]["nodeName"] for p in pods) == NODES
    for p in pods:
        (sidecar,) = p["status"]["initContainerStatuses"]
        assert sidecar["name"] == "tcpxo-daemon" and "running" in sidecar["state"] and sidecar["started"]
        assert "running" in p["status"]["containerStatuses"][0]["state"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in p["spec"][
            "tolerations"
        ]

    # What each pod's process would get: the GPU JobSet's coordinator as this machine reaches it.
    runner = ProcessRunner()
    envs = {}
    for p in pods:
        env = runner.environment(box.world, p, p["spec"]["containers"][0])
        envs[env["NODE_RANK"]] = env
    assert sorted(envs) == ["0", "1"]
    ports = {e["JAX_COORDINATOR_PORT"] for e in envs.values()}
    assert len(ports) == 1 and ports != {"6002"}  # one free port for the JobSet, not the manifest's
    for env in envs.values():
        assert env["NNODES"] == "2" and env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1"
        assert env["JAX_PLATFORMS"] == "cpu" and env["GPUS_PER_NODE"] == "8"
        flags = env["XLA_FLAGS"].split()
        assert flags[-1] == "--xla_force_host_platform_device_count=8"
        assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags  # the manifest's flags kept
        assert env["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
        assert "TPU_WORKER_ID" not in env  # GKE's TPU webhook leaves GPU pods alone
    # The name the manifest spells is pod 0's DNS name; a name no pod answers to is not resolved.
    assert pod_by_dns_name(box.world, "default", "gpu-a1-slice-0-0.gpu-a1")["spec"]["nodeName"] in NODES
    assert pod_by_dns_name(box.world, "default", "gpu-a1-slice-0-7.gpu-a1") is None

    # The trainers exit: the sidecars stop after them and never decide the pods' phase.
    with box.server.store.lock:
        for p in c.pods("gpu-a1"):
            box.world.container_exit(p, 0)
        box.world.reconcile()
    for p in c.pods("gpu-a1"):
        assert p["status"]["phase"] == "Succeeded"
        assert p["status"]["initContainerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"


def test_a_pod_naming_a_missing_network_is_refused_until_it_exists(box):
    _no_network(box)
    create(box, a3_mega_jobset())
    c = box.server.cluster
    ev = wait_for(
        lambda: [
            e
            for e in box.world.items("Event", "default")
            if e["reason"] == "FailedCreate" and "vpc3" in e["message"]
        ]
    )
    assert (
        "annotation networking.gke.io/interfaces names network(s) vpc3 that do not exist" in ev[0]["message"]
    )
    assert c.pods("gpu-a1") == []
    _, _, custom = apis(box)
    net = {
        "apiVersion": "networking.gke.io/v1",
        "kind": "Network",
        "metadata": {"name": "vpc3"},
        "spec": {
            "type": "Device",
            "parametersRef": {"group": "networking.gke.io", "kind": "GKENetworkParamSet", "name": "vpc3"},
        },
    }
    custom.create_cluster_custom_object("networking.gke.io", "v1", "networks", net)
    wait_for(lambda: len(c.pods("gpu-a1")) == 2)


def test_env_values_expand_as_the_kubelet_expands_them():
    assert expand("$(A)-$(B)-0-0.$(A)", {"A": "js", "B": "slice"}) == "js-slice-0-0.js"
    assert expand("$(C) $$(A) $$ x$", {"A": "js"}) == "$(C) $(A) $ x$"


# ---------------------------------------------------------------- the Done-when, end to end


@pytest.mark.chaos
@pytest.mark.gcs
def test_smoke_on_two_a3_mega_nodes_passes_every_check(tmp_path):
    """`olmo-ctl sandbox --slices h100-mega-80gb-8=2 --gcs-bucket sandbox`, then doctor and `smoke
    --backend gke --device h100-mega-80gb-8x2`: doctor passes every check; each of smoke's three
    attempts is the rendered A3 Mega JobSet, run as 2 trainer processes (one per node, 8 CPU devices
    each) that join one world from the JobSet's environment; all five checks pass."""
    kc = tmp_path / "sb.kubeconfig"
    env = _clean_env(tmp_path)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "olmo_ctl",
            "sandbox",
            "--kubeconfig",
            str(kc),
            "--slices",
            "h100-mega-80gb-8=2",
        ]
        + ["--gcs-bucket", "sandbox", "--detach"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    ex = _exports(p.stdout)
    pid = int(ex["OLMO_CTL_SANDBOX_PID"])
    log_file = tmp_path / "sb.kubeconfig.log"
    try:
        d = invoke("doctor", "--device", DEVICE, "-o", "json", env={**env, **ex})
        assert d.returncode == 0, d.stdout + d.stderr
        assert {c["name"] for c in json.loads(d.stdout)["checks"]} >= {"nccl-installer", "gpu-networks"}
        r = invoke(
            "smoke",
            "--backend",
            "gke",
            "--device",
            DEVICE,
            "--timeout",
            "900",
            "-o",
            "json",
            env={**env, **ex},
        )
        log = log_file.read_text() if log_file.exists() else ""
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:] + "\n--- sandbox ---\n" + log[-4000:]
        report = json.loads(r.stdout)
        assert [c["passed"] for c in report["checks"]] == [True] * 5
        assert f"smoke on {DEVICE} (gke): all 5 checks passed" in r.stderr
        # Attempt 1, attempt 2 and the twin, each one trainer process on each of the 2 nodes.
        starts = [ln for ln in log.splitlines() if "olmo_ctl.trainer" in ln and ": pid " in ln]
        assert len(starts) == 6, "\n".join(starts)
        assert all(f"--device {DEVICE}" in ln for ln in starts)
        assert {ln.split(" on ", 1)[1].split(":", 1)[0] for ln in starts} == set(NODES)
        # Process 0 wrote both hosts' timings: the two joined one world in every run.
        from olmo_ctl.observe.reader import read_scalars
        from olmo_ctl.sandbox.gcs_emulator import use_emulator

        with use_emulator(ex["STORAGE_EMULATOR_HOST"]):
            for run_dir in report["run_dirs"]:
                tags = set(read_scalars(f"{run_dir}/tensorboard").tags())
                assert {"hosts/0/step_time_s", "hosts/1/step_time_s"} <= tags, run_dir
                assert "hosts/2/step_time_s" not in tags
    finally:
        os.kill(pid, signal.SIGTERM)
        _gone(pid)
    assert not kc.exists()
