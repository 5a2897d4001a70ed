"""What a GKE cluster gives the pods of GPU nodes, as GKE and XPK set one up.

`olmo-ctl doctor` checks a cluster for these and `olmo-ctl sandbox` makes them for its GPU node pools,
so each is stated once, here:

- the nodes: GKE labels a GPU node `cloud.google.com/gke-accelerator` (and the machine type), taints a
  GPU node pool `nvidia.com/gpu=present:NoSchedule` and, once the NVIDIA driver is installed, its
  device plugin makes the node's GPUs allocatable as `nvidia.com/gpu`. The pods select what the launch
  template's nodeSelector names (`launch_templates/gpu.yaml`: the accelerator and the machine type);
  GKE's ExtendedResourceToleration admission gives a pod that requests `nvidia.com/gpu` a toleration
  of the taint, and the template states one too;
- Kueue: XPK's GPU ResourceFlavor carries the accelerator label only (src/xpk/core/kueue_manager.py
  `__build_template_context`, `create_machine_label` is empty for GPUs), with a nominal quota in
  `nvidia.com/gpu`;
- the NCCL plugin: the installer DaemonSet of the machine type's interconnect in kube-system
  (XPK's `install_nccl_on_cluster`, src/xpk/core/cluster.py, applies GoogleCloudPlatform/
  container-engine-accelerators `gpudirect-tcpxo/nccl-tcpxo-installer.yaml` for A3 Mega and
  `gpudirect-rdma/nccl-rdma-installer.yaml` for A3 Ultra and A4), selecting the accelerators' nodes;
- GKE multi-networking: every network the pods' `networking.gke.io/interfaces` annotation names beyond
  the cluster's own (`default`, `pod-network`) is a `Network` of type Device whose `parametersRef`
  names a `GKENetworkParamSet` (deviceMode NetDevice for a GPUDirect-TCPXO VPC and A3 Ultra's second
  gVNIC, RDMA for the RDMA subnets), as GKE's GPUDirect guides create them (XPK's src/xpk/core/
  network.py for A3's `vpc1`..); GKE refuses a pod that names a Network that does not exist.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from olmo_ctl.backends.kube import tolerates
from olmo_ctl.core.devices import Device
from olmo_ctl.core.generations import GPU_MACHINES

GPU = "nvidia.com/gpu"
ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
MACHINE_LABEL = "cloud.google.com/gce-machine-type"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
GPU_TAINT = {"key": GPU, "value": "present", "effect": "NoSchedule"}
# What GKE's ExtendedResourceToleration admission adds to a pod requesting the resource.
GPU_TOLERATION = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}
INTERFACES_ANNOTATION = "networking.gke.io/interfaces"
NETWORK_GROUP, NETWORK_VERSION = "networking.gke.io", "v1"
# gke-networking-api apis/network/v1 IsDefaultNetwork: the cluster's own pod network, never created.
DEFAULT_NETWORKS = ("default", "pod-network")
NCCL_NAMESPACE = "kube-system"
_ACCELERATORS = "https://raw.githubusercontent.com/GoogleCloudPlatform/container-engine-accelerators/master"
GPU_DRIVER_INSTALLER = f"{_ACCELERATORS}/nvidia-driver-installer/cos/daemonset-preloaded-latest.yaml"


@dataclass(frozen=True)
class NcclInstaller:
    """The DaemonSet that installs an interconnect's NCCL plugin on its GPU nodes."""

    name: str  # in NCCL_NAMESPACE
    manifest: str  # what `kubectl apply -f` takes

    @property
    def namespace(self) -> str:
        return NCCL_NAMESPACE


# By `GpuMachine.gpu_direct` (XPK's `gpu_direct_name`; system_characteristics.py INSTALLER_NCCL_*).
NCCL_INSTALLERS = {
    "tcpxo": NcclInstaller(
        "nccl-tcpxo-installer", f"{_ACCELERATORS}/gpudirect-tcpxo/nccl-tcpxo-installer.yaml"
    ),
    "rdma": NcclInstaller("nccl-rdma-installer", f"{_ACCELERATORS}/gpudirect-rdma/nccl-rdma-installer.yaml"),
}


@dataclass(frozen=True)
class PodNetwork:
    """A network a GPU pod's interface is on: a `Network` and its `GKENetworkParamSet`, same name."""

    name: str
    device_mode: str  # GKENetworkParamSet.spec.deviceMode: NetDevice | RDMA


def interconnect(device: Device) -> str:
    """`tcpxo` or `rdma`: how the device's nodes' GPUs reach each other."""
    return GPU_MACHINES[device.generation].gpu_direct


def nccl_installer(device: Device) -> NcclInstaller:
    return NCCL_INSTALLERS[interconnect(device)]


def flavor_labels(device: Device) -> dict[str, str]:
    """XPK's GPU ResourceFlavor node labels: the accelerator."""
    return {ACCELERATOR_LABEL: device.accelerator_label or ""}


def node_labels(device: Device) -> dict[str, str]:
    """The node labels the device's pods select: the launch template's nodeSelector
    (`launch_templates/gpu.yaml`: the accelerator), filled for the device."""
    values = {"accelerator": device.accelerator_label or "", "machine_type": device.machine_type or ""}
    out = {}
    for key, value in (_pod_spec(device).get("nodeSelector") or {}).items():
        if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
            value = values.get(value[2:-1])
        if value is not None:
            out[key] = str(value)
    return out


def _pod_spec(device: Device) -> dict:
    """The pod spec of the device's launch template (placeholders unfilled)."""
    from olmo_ctl.backends.jobset import launch_template

    tmpl = launch_template(device.generation)["jobset"]
    return tmpl["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def interface_networks(annotation: str | None) -> list[str]:
    """The networks of a `networking.gke.io/interfaces` annotation, in interface order ([] when it is
    missing or is not a JSON list of {interfaceName, network})."""
    try:
        items = json.loads(annotation or "[]")
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    return [str(i["network"]) for i in items if isinstance(i, dict) and i.get("network")]


def device_mode(network: str) -> str:
    """The GKENetworkParamSet deviceMode GKE's guides give a GPU network: RDMA for the RDMA subnets
    (`rdma-0`..), NetDevice for a GPUDirect-TCPXO VPC (`vpc1`..) and A3 Ultra's second gVNIC."""
    return "RDMA" if network.startswith("rdma-") else "NetDevice"


def pod_networks(device: Device, settings: Any = None) -> list[PodNetwork]:
    """The networks beyond the cluster's own that the device's pods name: the site's
    `networking.gke.io/interfaces` pod annotation where it sets one, else the launch template's."""
    from olmo_ctl.backends.jobset import launch_template

    override = (getattr(settings, "pod_annotations", None) or {}).get(INTERFACES_ANNOTATION)
    names = (
        interface_networks(override)
        if override
        else list(launch_template(device.generation)["vars"].get("networks") or [])
    )
    return [PodNetwork(n, device_mode(n)) for n in names if n not in DEFAULT_NETWORKS]


def pod_tolerations(device: Device, settings: Any = None) -> list[dict]:
    """The tolerations the device's pods carry on GKE: the launch template's, the site's
    (`tolerations`), and what ExtendedResourceToleration adds for `nvidia.com/gpu`."""
    site = list(getattr(settings, "tolerations", None) or [])
    return [*(_pod_spec(device).get("tolerations") or []), *site, GPU_TOLERATION]


def _matches_term(node_labels_: dict, term: dict) -> bool:
    """One nodeSelectorTerm's matchExpressions (In, NotIn, Exists, DoesNotExist) over a node's labels."""
    for e in term.get("matchExpressions") or []:
        have, op, values = node_labels_.get(e["key"]), e.get("operator"), e.get("values") or []
        if op == "In" and have not in values:
            return False
        if op == "NotIn" and have in values:
            return False
        if op == "Exists" and e["key"] not in node_labels_:
            return False
        if op == "DoesNotExist" and e["key"] in node_labels_:
            return False
    return True


def daemon_should_run(pod_spec: dict, node_labels_: dict, taints: list[dict]) -> bool:
    """Whether a DaemonSet whose pod template is `pod_spec` runs a pod on a node with these labels and
    taints (pkg/controller/daemon NodeShouldRunDaemonPod): its nodeSelector and required node affinity
    match, and its tolerations tolerate the NoSchedule and NoExecute taints."""
    if any(node_labels_.get(k) != v for k, v in (pod_spec.get("nodeSelector") or {}).items()):
        return False
    req = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = req.get("nodeSelectorTerms") or []
    if terms and not any(_matches_term(node_labels_, t) for t in terms):
        return False
    tol = pod_spec.get("tolerations") or []
    return all(tolerates(tol, t) for t in taints if t.get("effect") in ("NoSchedule", "NoExecute"))
