"""GPU nodes on GKE: the JobSet of each machine type, pod by pod against the one XPK renders for it.

Every expectation below is ported from XPK's source (AI-Hypercomputer/xpk at 367c8382), by file and
function, and each test names what it follows:

- src/xpk/core/system_characteristics.py: the GPU rows (`device_type`, `gce_machine_type`,
  `gke_accelerator`, `chips_per_vm`, `GpuConfig.gpu_direct_name` and its decorator), and
  AcceleratorTypeToAcceleratorCharacteristics (resource `nvidia.com/gpu`, label keys);
- src/xpk/commands/workload.py: A3_GPU_WORKLOAD_CREATE_YAML (the JobSet of A3 Mega, A3 Ultra and A4:
  XPK's cluster_gcluster.supported_device_types) and the Kueue topology request `workload_create` adds;
- src/xpk/commands/common.py is_GPU_TAS_possible: where that request is added;
- src/xpk/core/docker_resources.py: get_gpu_env, get_main_container_resources, add_container_ports;
- src/xpk/core/kueue_manager.py __build_template_context: the flavor's node labels;
- src/xpk/core/workload_decorators/tcpxo_decorator.py and rdma_decorator.py: add_annotations,
  add_volumes, add_tolerations, add_tcpxo_daemon_container, update_gpu_containers.

Where the JobSet differs from XPK's on purpose, `test_where_it_differs_from_xpk_on_purpose` says how
and why. The goldens are `make goldens`' (tests/test_manifest.py renders them with the CLI and
validates them against the JobSet v0.10.1 CRD).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml
from test_manifest import GOLDENS, GPU_NODES, ROOT, golden_cases, metadata_errors, schema_errors

from olmo_ctl.backends.jobset import identity_note, render_jobset, template_path
from olmo_ctl.core.batching import make_plan
from olmo_ctl.core.config import Settings
from olmo_ctl.core.contracts import USER_EXIT_CODES
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.generations import GPU_MACHINES
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.core.xla_flags import xla_flags_for
from olmo_ctl.ports import free_port
from olmo_ctl.trainer.multihost import JoinFailed, gpu_nodes_params

# system_characteristics.py, UserFacingNameToSystemCharacteristics: device type -> (gce_machine_type,
# gke_accelerator, chips_per_vm, gpu_direct_name).
XPK_ROWS = {
    "h100-mega-80gb-8": ("a3-megagpu-8g", "nvidia-h100-mega-80gb", 8, "tcpxo"),
    "h200-141gb-8": ("a3-ultragpu-8g", "nvidia-h200-141gb", 8, "rdma"),
    "b200-8": ("a4-highgpu-8g", "nvidia-b200", 8, "rdma"),
}

# tcpxo_decorator.py get_tcpxo_deamon_entry: the devices GKE gives the daemon container.
XPK_TCPXO_DEVICES = [
    *(f"/dev/nvidia{i}" for i in range(8)),
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/dmabuf_import_helper",
]
# tcpxo_decorator.py add_volumes, in its order.
XPK_TCPXO_VOLUMES = [
    {"name": "libraries", "hostPath": {"path": "/home/kubernetes/bin/nvidia"}},
    {"name": "sys", "hostPath": {"path": "/sys"}},
    {"name": "proc-sys", "hostPath": {"path": "/proc/sys"}},
    {"name": "aperture-devices", "hostPath": {"path": "/dev/aperture_devices"}},
    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "128Gi"}},
]
# tcpxo_decorator.py add_tcpxo_daemon_container (rxdm v1.0.12).
XPK_TCPXO_DAEMON = {
    "name": "tcpxo-daemon",
    "image": "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.12",
    "imagePullPolicy": "Always",
    "restartPolicy": "Always",
    "command": ["/bin/sh", "-c"],
    "args": [
        "set -ex\nchmod 755 /fts/entrypoint_rxdm_container.sh\n/fts/entrypoint_rxdm_container.sh"
        " --num_hops=2 --num_nics=8 --uid= --alsologtostderr"
    ],
    "securityContext": {"capabilities": {"add": ["NET_ADMIN", "NET_BIND_SERVICE"]}},
    "volumeMounts": [
        {"name": "libraries", "mountPath": "/usr/local/nvidia"},
        {"name": "sys", "mountPath": "/hostsysfs"},
        {"name": "proc-sys", "mountPath": "/hostprocsysfs"},
    ],
    "env": [{"name": "LD_LIBRARY_PATH", "value": "/usr/local/nvidia/lib64"}],
}
# tcpxo_decorator.py update_gpu_containers: what the container asking for nvidia.com/gpu gets.
XPK_TCPXO_ENV = {
    "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
    "NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY": "/dev/aperture_devices",
}
XPK_TCPXO_MOUNTS = [
    {"name": "aperture-devices", "mountPath": "/dev/aperture_devices"},
    {"name": "libraries", "mountPath": "/usr/local/nvidia"},
    {"name": "dshm", "mountPath": "/dev/shm"},
]
# rdma_decorator.py add_volumes and update_gpu_containers.
XPK_RDMA_VOLUMES = [
    {"name": "library-dir-host", "hostPath": {"path": "/home/kubernetes/bin/nvidia"}},
    {"name": "gib", "hostPath": {"path": "/home/kubernetes/bin/gib"}},
    {"name": "dshm", "emptyDir": {"medium": "Memory"}},
]
XPK_RDMA_ENV = {"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"}
XPK_RDMA_MOUNTS = [
    {"name": "library-dir-host", "mountPath": "/usr/local/nvidia"},
    {"name": "gib", "mountPath": "/usr/local/gib"},
    {"name": "dshm", "mountPath": "/dev/shm"},
]
# Both decorators' add_tolerations, after A3_GPU_WORKLOAD_CREATE_YAML's own GPU toleration.
XPK_USER_WORKLOAD_TOLERATION = {
    "key": "user-workload",
    "operator": "Equal",
    "value": "true",
    "effect": "NoSchedule",
}


def golden(device: str) -> dict:
    return yaml.safe_load((GOLDENS / f"{device}-stage1.yaml").read_text())


def _job(js: dict) -> dict:
    return js["spec"]["replicatedJobs"][0]["template"]["spec"]


def _pod_template(js: dict) -> dict:
    return _job(js)["template"]


def _pod(js: dict) -> dict:
    return _pod_template(js)["spec"]


def _trainer(js: dict) -> dict:
    (c,) = _pod(js)["containers"]
    return c


def _env(js: dict) -> dict[str, dict]:
    return {e["name"]: e for e in _trainer(js)["env"]}


def _value(js: dict, name: str) -> str:
    return _env(js)[name]["value"]


def _machine(device: str) -> str:
    return get_device(device).generation


def _render(device: str, **settings) -> dict:
    recipe, dev = load_recipe(stage=1), get_device(device)
    s = Settings(run_root="gs://b/runs", **settings)
    return render_jobset(recipe, make_plan(recipe, dev), dev, s, "r", 1, "gs://b/runs/r")


# ---------------------------------------------------------------- the goldens


def test_there_is_a_golden_per_machine_type_and_each_is_schema_valid():
    """One golden per machine type of the catalog, made by `make goldens` from the CLI's dry run."""
    assert {_machine(d) for d in GPU_NODES} == set(GPU_MACHINES) == set(XPK_ROWS)
    for dev in GPU_NODES:
        assert f"{dev}-stage1" in golden_cases()
        js = golden(dev)
        assert schema_errors(js) == [] and metadata_errors(js) == []
        assert js["metadata"]["labels"]["olmo-ctl/device"] == dev


@pytest.mark.parametrize("device", GPU_NODES)
def test_the_machine_types_interconnect_names_its_template(device):
    """system_characteristics.py: the row's GpuConfig.gpu_direct_name (tcpxo for A3 Mega, rdma for A3
    Ultra and A4) is the machine type's `gpu_direct`, which names its launch template."""
    machine = _machine(device)
    assert GPU_MACHINES[machine].gpu_direct == XPK_ROWS[machine][3]
    assert (
        template_path(machine).name == f"gpu-{XPK_ROWS[machine][3]}.yaml" and template_path(machine).exists()
    )
    assert _value(golden(device), "USE_GPUDIRECT") == XPK_ROWS[machine][3]  # get_gpu_env


# ---------------------------------------------------------------- A3_GPU_WORKLOAD_CREATE_YAML


@pytest.mark.parametrize("device", GPU_NODES)
def test_the_job_is_xpks_a3_gpu_workload(device):
    """workload.py A3_GPU_WORKLOAD_CREATE_YAML: one replicated job of one replica, parallelism =
    completions = the node count, backoffLimit 0, restartPolicy Never, dnsPolicy ClusterFirstWithHostNet
    without hostNetwork, a toleration of `nvidia.com/gpu`, no placement-policy selector (XPK's
    is_placement_policy_supported is false for the GPU rows' topology `N/A`)."""
    js, dev = golden(device), get_device(device)
    (rj,) = js["spec"]["replicatedJobs"]
    job, pod = _job(js), _pod(js)
    assert rj["replicas"] == 1
    assert job["parallelism"] == job["completions"] == dev.vms == 2
    assert job["backoffLimit"] == 0 and job["completionMode"] == "Indexed"
    assert pod["restartPolicy"] == "Never"
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet" and "hostNetwork" not in pod
    gpu = [t for t in pod["tolerations"] if t["key"] == "nvidia.com/gpu"]
    assert [(t["operator"]) for t in gpu] == ["Exists"]
    # GKE's taint on GPU node pools, nvidia.com/gpu=present:NoSchedule, is tolerated.
    assert gpu[0].get("effect") in (None, "NoSchedule")
    assert "cloud.google.com/placement-policy-name" not in pod["nodeSelector"]


@pytest.mark.parametrize("device", GPU_NODES)
def test_selectors_are_the_machine_types_gke_labels(device):
    """system_characteristics.py: AcceleratorTypeToAcceleratorCharacteristics[GPU] (accelerator label
    `cloud.google.com/gke-accelerator`) with the row's gke_accelerator; kueue_manager.py
    __build_template_context puts the accelerator label on XPK's flavor (create_accelerator_label),
    which Kueue adds to the pods on admission. create_machine_label returns '' for GPUs, so XPK selects
    no machine type (`cloud.google.com/gce-machine-type` is only its name for the GPU machine label),
    and neither does this JobSet. No TPU selector is left."""
    _machine_type, accelerator, _, _ = XPK_ROWS[_machine(device)]
    assert _pod(golden(device))["nodeSelector"] == {"cloud.google.com/gke-accelerator": accelerator}


@pytest.mark.parametrize("device", GPU_NODES)
def test_resources_and_port_follow_docker_resources(device):
    """docker_resources.py get_main_container_resources: limits `nvidia.com/gpu: chips_per_vm` (no
    requests: they follow the limits), and beside them the trainer's CPU and memory, sized from the
    machine type (core/node_resources.py); add_container_ports: the coordinator's port 6002."""
    from olmo_ctl.core.node_resources import trainer_resources_for

    c = _trainer(golden(device))
    own = trainer_resources_for(_machine(device), "auto")
    assert own is not None
    assert c["resources"] == {"limits": {"nvidia.com/gpu": XPK_ROWS[_machine(device)][2], **own}}
    assert c["ports"] == [{"containerPort": 6002}]


@pytest.mark.parametrize("device", GPU_NODES)
def test_the_coordinator_environment_is_get_gpu_envs(device):
    """docker_resources.py get_gpu_env: REPLICATED_JOB_NAME and JOBSET_NAME from the pod's JobSet
    annotations, NNODES, NODE_RANK from the completion index, USE_GPUDIRECT, GPUS_PER_NODE,
    JAX_COORDINATOR_PORT 6002 and JAX_COORDINATOR_ADDRESS, pod 0 of the replicated job by its JobSet DNS
    name. Kubernetes expands `$(NAME)` only from variables listed before it."""
    js = golden(device)
    env = _env(js)
    names = [e["name"] for e in _trainer(js)["env"]]

    def field(path):
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    assert {k: v for k, v in env["REPLICATED_JOB_NAME"].items() if k != "name"} == field(
        "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']"
    )
    assert {k: v for k, v in env["JOBSET_NAME"].items() if k != "name"} == field(
        "metadata.annotations['jobset.sigs.k8s.io/jobset-name']"
    )
    assert {k: v for k, v in env["NODE_RANK"].items() if k != "name"} == field(
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert (_value(js, "NNODES"), _value(js, "GPUS_PER_NODE"), _value(js, "JAX_COORDINATOR_PORT")) == (
        "2",
        "8",
        "6002",
    )
    address = _value(js, "JAX_COORDINATOR_ADDRESS")
    assert address == "$(JOBSET_NAME)-$(REPLICATED_JOB_NAME)-0-0.$(JOBSET_NAME)"
    for ref in re.findall(r"\$\((\w+)\)", address):
        assert names.index(ref) < names.index("JAX_COORDINATOR_ADDRESS")
    # Expanded in this JobSet it is pod 0's hostname and subdomain (DNS hostnames are on).
    name = js["metadata"]["name"]
    resolved = address.replace("$(JOBSET_NAME)", name).replace("$(REPLICATED_JOB_NAME)", "slice")
    assert resolved == f"{name}-slice-0-0.{name}" and js["spec"]["network"]["enableDNSHostnames"] is True
    # The flags of the machine type as core/xla_flags.py merges them, in XLA_FLAGS, not LIBTPU_INIT_ARGS.
    assert _value(js, "XLA_FLAGS") == " ".join(xla_flags_for(get_device(device), load_recipe(stage=1), None))
    assert "LIBTPU_INIT_ARGS" not in env and _value(js, "JAX_PLATFORMS") == "cuda"
    assert len(names) == len(set(names))


# ---------------------------------------------------------------- the decorators


def test_the_a3_mega_pod_is_the_tcpxo_decorators():
    """tcpxo_decorator.py: add_annotations (the daemon's devices, default interface eth0, eth0..eth8 on
    the cluster's networks), add_volumes, add_tolerations, add_tcpxo_daemon_container (a sidecar: an
    init container with restartPolicy Always) and update_gpu_containers (LD_LIBRARY_PATH,
    NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY, the mounts), on `h100-mega-80gb-8x2`."""
    js = golden("h100-mega-80gb-8x2")
    meta, pod, c = _pod_template(js)["metadata"], _pod(js), _trainer(js)
    ann = meta["annotations"]
    devices = yaml.safe_load(ann["devices.gke.io/container.tcpxo-daemon"])
    assert devices == [{"path": p} for p in XPK_TCPXO_DEVICES]
    assert ann["networking.gke.io/default-interface"] == "eth0"
    interfaces = json.loads(ann["networking.gke.io/interfaces"])
    assert [i["interfaceName"] for i in interfaces] == [f"eth{i}" for i in range(9)]
    assert [i["network"] for i in interfaces] == ["default", *(f"vpc{i}" for i in range(1, 9))]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert [volumes[v["name"]] for v in XPK_TCPXO_VOLUMES] == XPK_TCPXO_VOLUMES
    assert XPK_USER_WORKLOAD_TOLERATION in pod["tolerations"]
    assert pod["initContainers"] == [XPK_TCPXO_DAEMON]
    for name, value in XPK_TCPXO_ENV.items():
        assert _value(js, name) == value
    assert all(m in c["volumeMounts"] for m in XPK_TCPXO_MOUNTS)
    assert {m["name"] for m in c["volumeMounts"]} == {v["name"] for v in XPK_TCPXO_MOUNTS}
    # MaxText's FasTrak environment (tools/orchestration/gpu_multi_process_run.sh): the GPU NICs.
    assert _value(js, "NCCL_FASTRAK_IFNAME") == ",".join(f"eth{i}" for i in range(1, 9))
    assert _value(js, "NCCL_FASTRAK_CTRL_DEV") == "eth0"


@pytest.mark.parametrize("device", ["h200-141gb-8x2", "b200-8x2"])
def test_the_a3_ultra_and_a4_pods_are_the_rdma_decorators(device):
    """rdma_decorator.py: add_annotations (default interface eth0, interfaces on the cluster's networks:
    two gVNICs and eight RDMA subnets), add_volumes (/home/kubernetes/bin/nvidia and gib, a memory-backed
    /dev/shm with no size limit), add_tolerations and update_gpu_containers; no sidecar. NCCL goes over
    the gIB plugin the installer DaemonSet puts in /usr/local/gib."""
    js = golden(device)
    ann, pod, c = _pod_template(js)["metadata"]["annotations"], _pod(js), _trainer(js)
    assert "devices.gke.io/container.tcpxo-daemon" not in ann and "initContainers" not in pod
    assert ann["networking.gke.io/default-interface"] == "eth0"
    interfaces = json.loads(ann["networking.gke.io/interfaces"])
    assert [i["interfaceName"] for i in interfaces] == [f"eth{i}" for i in range(10)]
    assert [i["network"] for i in interfaces] == ["default", "gvnic-1", *(f"rdma-{i}" for i in range(8))]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert [volumes[v["name"]] for v in XPK_RDMA_VOLUMES] == XPK_RDMA_VOLUMES
    assert set(volumes) == {v["name"] for v in XPK_RDMA_VOLUMES}
    assert XPK_USER_WORKLOAD_TOLERATION in pod["tolerations"]
    for name, value in XPK_RDMA_ENV.items():
        assert _value(js, name) == value
    assert sorted(c["volumeMounts"], key=lambda m: m["name"]) == sorted(
        XPK_RDMA_MOUNTS, key=lambda m: m["name"]
    )
    assert _value(js, "NCCL_NET") == "gIB"


# ---------------------------------------------------------------- Kueue's topology request


@pytest.mark.parametrize(
    "device,capacity,requested",
    [
        ("h100-mega-80gb-8x2", "on-demand", False),
        ("h100-mega-80gb-8x2", "spot", False),
        ("h100-mega-80gb-8x2", "reservation:a3-block", True),
        ("h100-mega-80gb-8x2", "flex-start", True),
        ("h200-141gb-8x2", "on-demand", True),
        ("b200-8x2", "spot", True),
        ("b200-8x2", "flex-start", True),
    ],
)
def test_the_topology_request_is_where_xpk_adds_it(device, capacity, requested):
    """workload.py workload_create adds `kueue.x-k8s.io/podset-preferred-topology: kubernetes.io/hostname`
    when common.py is_GPU_TAS_possible: for A3 Mega only on flex-start or a reservation; for A3 Ultra
    and A4 on any capacity (XPK makes their node pools with COMPACT placement, and its GPU flavor names
    the Topology `gke-default`, kueue_manager.py __get_topology_name_and_yaml). Never on TPU."""
    ann = _pod_template(_render(device, capacity=capacity))["metadata"].get("annotations", {})
    assert ann.get("kueue.x-k8s.io/podset-preferred-topology") == (
        "kubernetes.io/hostname" if requested else None
    )
    tpu = yaml.safe_load((GOLDENS / "tpu7x-128-stage1.yaml").read_text())
    assert "annotations" not in _pod_template(tpu)["metadata"]


# ---------------------------------------------------------------- what stays the TPU templates'


@pytest.mark.parametrize("device", GPU_NODES)
def test_failure_policy_exit_codes_and_labels_are_the_tpu_templates(device):
    """The exit-code contract is the TPU JobSets' (launch_templates/common.yaml): the same JobSet rules
    and maxRestarts, the same pod failure policy on the `trainer` container (exit 1 and 2 fail the
    attempt, 3 and 143 restart uncounted, any other exit is counted); the same olmo-ctl labels and
    annotations and Kueue's queue label."""
    gpu, tpu = golden(device), yaml.safe_load((GOLDENS / "tpu7x-128-stage1.yaml").read_text())
    assert gpu["spec"]["failurePolicy"] == tpu["spec"]["failurePolicy"]
    assert _job(gpu)["podFailurePolicy"] == _job(tpu)["podFailurePolicy"]
    assert _job(gpu)["podFailurePolicy"]["rules"][1]["onExitCodes"]["values"] == sorted(USER_EXIT_CODES)
    assert set(gpu["metadata"]["labels"]) == set(tpu["metadata"]["labels"]) - {
        "kueue.x-k8s.io/priority-class"
    }
    assert gpu["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert set(gpu["metadata"]["annotations"]) == set(tpu["metadata"]["annotations"]) - {
        "alpha.jobset.sigs.k8s.io/exclusive-topology"
    }
    assert _pod_template(gpu)["metadata"]["labels"].keys() == _pod_template(tpu)["metadata"]["labels"].keys()
    g, t = _trainer(gpu), _trainer(tpu)
    for key in ("name", "image", "terminationMessagePolicy", "securityContext"):
        assert g[key] == t[key], key
    assert g["command"][:3] == t["command"][:3] == ["python", "-m", "olmo_ctl.trainer"]
    assert _pod(gpu)["terminationGracePeriodSeconds"] == _pod(tpu)["terminationGracePeriodSeconds"]
    assert _pod(gpu)["serviceAccountName"] == _pod(tpu)["serviceAccountName"]


def test_where_it_differs_from_xpk_on_purpose():
    """Against A3_GPU_WORKLOAD_CREATE_YAML and docker_container.py get_main_container:
    - the container is unprivileged (XPK: `privileged: true`): GKE's device plugin hands the GPUs to the
      container that asks for them and the aperture devices are a host-path mount, as gpu-recipes'
      a3mega JobSet (src/helm-charts/a3mega/jobset) runs its workload off the host network;
    - it is named `trainer` (XPK: `gpu-image`), the name the pod failure policy's exit codes are read
      from, runs the trainer itself (XPK: a bash wrapper that echoes EXIT_CODE and writes a file for a
      sidecar it does not add here) and keeps the image's pull policy (XPK: Always);
    - the replicated job is `slice` (XPK: `slice-job`), as on TPU; the coordinator's address follows it
      through $(REPLICATED_JOB_NAME);
    - no JobSet exclusive-topology annotation (neither has XPK's GPU JobSet): N nodes may span node pools."""
    js = golden("h100-mega-80gb-8x2")
    c = _trainer(js)
    assert c["securityContext"] == {"privileged": False, "allowPrivilegeEscalation": False}
    assert c["name"] == "trainer" and "imagePullPolicy" not in c
    assert [r["name"] for r in js["spec"]["replicatedJobs"]] == ["slice"]
    assert "alpha.jobset.sigs.k8s.io/exclusive-topology" not in js["metadata"]["annotations"]


# ---------------------------------------------------------------- site settings


def test_a_site_names_its_networks_and_host_network_stays_off():
    """The networks are the cluster's (XPK reads its GKENetworkParamSets, core/network.py
    get_cluster_subnetworks): `pod_annotations` replaces the template's interfaces annotation. The site
    setting host_network is for TPU slices: GPU pods stay off the host network, and `submit` says so."""
    own = '[{"interfaceName":"eth0","network":"default"},{"interfaceName":"eth1","network":"a3-net-1"}]'
    js = _render("h100-mega-80gb-8x2", pod_annotations={"networking.gke.io/interfaces": own})
    assert _pod_template(js)["metadata"]["annotations"]["networking.gke.io/interfaces"] == own
    s = Settings(run_root="gs://b/runs", host_network=True)
    js = _render("b200-8x2", host_network=True)
    assert "hostNetwork" not in _pod(js) and _pod(js)["dnsPolicy"] == "ClusterFirstWithHostNet"
    note = identity_note(s, get_device("b200-8x2"))
    assert note is not None and "not used" in note and "Workload Identity applies" in note


def test_dry_run_prints_the_gpu_jobset_and_the_local_backend_refuses_gpu_nodes(tmp_path):
    """`submit --dry-run` prints GPU nodes' JobSet; the local backend refuses them in one line, exit 2."""
    from helpers.cli import clean_env, invoke

    env = clean_env(tmp_path / "cfg")
    p = invoke("submit", "--stage", "1", "--device", "h100-mega-80gb-8x2", "--dry-run", env=env)
    assert p.returncode == 0, p.stderr
    js = yaml.safe_load(p.stdout)
    limits = _trainer(js)["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": 8, "cpu": "197", "memory": "1736Gi"} and schema_errors(js) == []
    env["OLMO_CTL_RUN_ROOT"] = str(tmp_path / "runs")
    p = invoke(
        "submit", "--stage", "1", "--device", "h100-mega-80gb-8x2", "--backend", "local", "--dry-run", env=env
    )
    assert (p.returncode, p.stdout) == (2, "")
    assert p.stderr == (
        "error: `h100-mega-80gb-8x2` is GPU nodes on GKE (2 x a3-megagpu-8g); the local backend runs cpu-N"
        " or gpu-N (this machine's GPUs); use --backend gke, or a local device such as gpu-8\n"
    )


# ---------------------------------------------------------------- the trainer joins from it


def _pod_env(js: dict, index: int) -> dict[str, str]:
    """The trainer's environment in pod `index` of the golden, as the kubelet makes it: field
    references from the pod's JobSet annotations, then `$(NAME)` expanded from earlier variables."""
    name = js["metadata"]["name"]
    fields = {
        "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']": "slice",
        "metadata.annotations['jobset.sigs.k8s.io/jobset-name']": name,
        "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(index),
    }
    out: dict[str, str] = {}
    for e in _trainer(js)["env"]:
        value = fields[e["valueFrom"]["fieldRef"]["fieldPath"]] if "valueFrom" in e else e["value"]
        out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), value)
    return out


@pytest.mark.parametrize("device", GPU_NODES)
def test_the_trainer_reads_what_the_jobset_sets(device):
    """trainer/multihost.py gpu_nodes_params turns each pod's environment into jax.distributed's
    coordinator, process count and process id (MaxText's initialize_jax_for_gpu reads the same names);
    a missing or inconsistent variable is JoinFailed (exit 3), naming it."""
    js, dev = golden(device), get_device(device)
    name = js["metadata"]["name"]
    for rank in range(dev.vms):
        assert gpu_nodes_params(dev, _pod_env(js, rank)) == {
            "coordinator_address": f"{name}-slice-0-0.{name}:6002",
            "num_processes": 2,
            "process_id": rank,
        }
    env = _pod_env(js, 1)
    with pytest.raises(JoinFailed, match="NODE_RANK is not set"):
        gpu_nodes_params(dev, {k: v for k, v in env.items() if k != "NODE_RANK"})
    with pytest.raises(JoinFailed, match="is 2 nodes but NNODES=4"):
        gpu_nodes_params(dev, {**env, "NNODES": "4"})
    with pytest.raises(JoinFailed, match="NODE_RANK=2 is outside"):
        gpu_nodes_params(dev, {**env, "NODE_RANK": "2"})
    with pytest.raises(JoinFailed, match="JAX_COORDINATOR_PORT='x' is not a number"):
        gpu_nodes_params(dev, {**env, "JAX_COORDINATOR_PORT": "x"})


JOIN = """
import sys, types
import jax
from olmo_ctl.core.devices import get_device
from olmo_ctl.trainer import multihost
multihost.join(get_device(sys.argv[1]), types.SimpleNamespace(init_timeout_s=60, peer_timeout_s=30))
print("process", jax.process_index(), "of", jax.process_count(), flush=True)
"""


def test_two_nodes_join_from_the_golden_environment(tmp_path):
    """The 2 pods of `h100-mega-80gb-8x2` as two processes on this machine's CPU (JAX_PLATFORMS=cpu, gloo),
    each with its pod's environment from the golden; only the coordinator's DNS name, which a cluster
    resolves, is this machine's address."""
    js = golden("h100-mega-80gb-8x2")
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
        env.update(
            _pod_env(js, rank),
            JAX_PLATFORMS="cpu",
            JAX_COORDINATOR_ADDRESS="127.0.0.1",
            JAX_COORDINATOR_PORT=port,
        )
        env.pop("XLA_FLAGS")  # the GPU flags; this is XLA's CPU backend
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", JOIN, "h100-mega-80gb-8x2"],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for rank, out in enumerate(outs):
        assert f"joined 2 hosts as process {rank}" in out and f"process {rank} of 2" in out, out
