"""GKE's side of GPU node pools in the sandbox: the objects a GPU cluster holds and the rules around them.

What `olmo-ctl sandbox --slices h100-mega-80gb-8=N` makes, as `xpk cluster create --device-type
h100-mega-80gb-8 --num-nodes N` and GKE's GPUDirect guides leave a cluster (the facts themselves are
`olmo_ctl.backends.gke_gpu`'s, which doctor checks):

- one node pool of N nodes: GKE's GPU labels (`cloud.google.com/gke-accelerator`, the machine type),
  the taint `nvidia.com/gpu=present:NoSchedule` and `nvidia.com/gpu` allocatable per node (the
  driver installed, as `gpu-driver-version=latest` does);
- the NCCL installer DaemonSet of each interconnect in kube-system, selecting its accelerators' nodes;
- GKE multi-networking: the cluster's `default` Network and, for each network the pods' interfaces
  name, a GKENetworkParamSet and a Network of type Device referring to it.

And the rules, ported where they are public:

- the DaemonSet controller's status (pkg/controller/daemon, v1.33): desiredNumberScheduled counts the
  nodes the pod template's node selector, required node affinity and tolerations admit. Its pods do not
  run here: the sandbox's GPU nodes come with what the installer installs, so every scheduled one counts
  as ready and available;
- GKE's network controller as its API states it (gke-networking-api v0.3.0, apis/network/v1): a
  GKENetworkParamSet is Ready (`GNPReady`) once it names a VPC and subnet and a device mode or a
  secondary range (else `SecondaryRangeAndDeviceModeUnspecified`); a Network's ParamsReady is True
  (`GNPParamsReady`) while the GKENetworkParamSet it refers to exists (`GNPDeleted` once it does not)
  and, for a Device network, has a device mode (`DeviceModeMissing`); Ready follows ParamsReady
  (`NetworkReady` / `ParamsNotReady`). The VPCs themselves are taken as present;
- admission of a pod that names networks in `networking.gke.io/interfaces`: refused while one of them
  is not a Network of the cluster (GKE's multi-network admission; the text is the sandbox's own);
- ExtendedResourceToleration (plugin/pkg/admission/extendedresourcetoleration, which GKE enables): a
  pod requesting an extended resource such as `nvidia.com/gpu` gets a toleration {key: the resource,
  operator: Exists, effect: NoSchedule}.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from olmo_ctl.backends.gke_gpu import (
    ACCELERATOR_LABEL,
    DEFAULT_NETWORKS,
    GPU,
    GPU_TAINT,
    INSTANCE_TYPE_LABEL,
    INTERFACES_ANNOTATION,
    MACHINE_LABEL,
    NCCL_INSTALLERS,
    NETWORK_GROUP,
    PodNetwork,
    daemon_should_run,
    interconnect,
    interface_networks,
    nccl_installer,
    node_labels,
    pod_networks,
)
from olmo_ctl.core.devices import Device
from olmo_ctl.sandbox.cluster.objects import labels, node_allocatable, node_capacity, set_status_condition

if TYPE_CHECKING:
    from olmo_ctl.sandbox.sandbox import SandboxWorld

NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
CLUSTER_NAME = "sandbox"  # what the VPCs of the GKENetworkParamSets are named after
# The NCCL installer's pod template (container-engine-accelerators gpudirect-*/nccl-*-installer.yaml):
# what the DaemonSet controller reads; its containers never run here.
_INSTALLER_IMAGES = {
    "tcpxo": "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/nccl-plugin-gpudirecttcpx-dev:v1.0.16",
    "rdma": "us-docker.pkg.dev/gce-ai-infra/gpudirect-gib/nccl-plugin-gib:v1.0.3",
}
PAUSE_IMAGE = "gke.gcr.io/pause:3.8"
# Kubernetes' extended resources: a domain-prefixed name outside kubernetes.io (v1helper.IsExtendedResourceName).
_NATIVE_PREFIX = "kubernetes.io/"


# ---------------------------------------------------------------- what the sandbox makes


def gpu_node(device: Device, pool: str, index: int, now: str) -> dict:
    """Node `index` of a GPU node pool of `device`'s machine type."""
    name = f"gke-{pool}-{index:04d}"
    machine = device.machine_type or ""
    return {
        "metadata": {
            "name": name,
            "labels": {
                ACCELERATOR_LABEL: device.accelerator_label or "",
                MACHINE_LABEL: machine,
                **node_labels(device),  # whatever else the pods select
                NODEPOOL_LABEL: pool,
                "kubernetes.io/hostname": name,
                "cloud.google.com/machine-family": machine.split("-", 1)[0],
                INSTANCE_TYPE_LABEL: machine,
            },
        },
        "spec": {"taints": [dict(GPU_TAINT)]},
        "status": {
            "capacity": {GPU: str(device.chips_per_vm), **node_capacity(device)},
            "allocatable": {GPU: str(device.chips_per_vm), **node_allocatable(device)},
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastTransitionTime": now}
            ],
            "nodeInfo": {"kubeletVersion": "v1.33.0-gke"},
        },
    }


def installer_daemonset(kind: str, accelerators: list[str]) -> dict:
    """The NCCL installer DaemonSet of interconnect `kind` (`tcpxo`, `rdma`), on `accelerators`' nodes."""
    inst = NCCL_INSTALLERS[kind]
    match = {"k8s-app": inst.name}
    return {
        "metadata": {"name": inst.name, "namespace": inst.namespace, "labels": dict(match)},
        "spec": {
            "selector": {"matchLabels": dict(match)},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {"labels": {"name": inst.name, **match}},
                "spec": {
                    "priorityClassName": "system-node-critical",
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {
                                        "matchExpressions": [
                                            {
                                                "key": ACCELERATOR_LABEL,
                                                "operator": "In",
                                                "values": sorted(accelerators),
                                            }
                                        ]
                                    }
                                ]
                            }
                        }
                    },
                    "tolerations": [{"operator": "Exists"}],
                    "hostNetwork": True,
                    "hostPID": True,
                    "initContainers": [
                        {
                            "name": inst.name,
                            "image": _INSTALLER_IMAGES[kind],
                            "securityContext": {"privileged": True},
                        }
                    ],
                    "containers": [{"name": "pause", "image": PAUSE_IMAGE}],
                },
            },
        },
        "status": {},
    }


def network_objects(net: PodNetwork, index: int) -> tuple[dict, dict]:
    """(GKENetworkParamSet, Network) for one GPU network, on VPCs named as GKE's guides name them."""
    if net.name.startswith("rdma-"):
        vpc, subnet = f"{CLUSTER_NAME}-rdma-net", f"{CLUSTER_NAME}-rdma-sub-{net.name.split('-', 1)[1]}"
    elif net.name.startswith("gvnic-"):
        vpc, subnet = f"{CLUSTER_NAME}-gvnic-net", f"{CLUSTER_NAME}-gvnic-sub"
    else:
        vpc, subnet = f"{CLUSTER_NAME}-net-{index}", f"{CLUSTER_NAME}-sub-{index}"
    gnp = {
        "metadata": {"name": net.name},
        "spec": {"vpc": vpc, "vpcSubnet": subnet, "deviceMode": net.device_mode},
    }
    network = {
        "metadata": {"name": net.name},
        "spec": {
            "type": "Device",
            "parametersRef": {"group": NETWORK_GROUP, "kind": "GKENetworkParamSet", "name": net.name},
        },
    }
    return gnp, network


def make_gpu_cluster(world: SandboxWorld, devices: list[Device]) -> None:
    """The installer DaemonSets and the multi-network objects the GPU node pools of `devices` need."""
    if not devices:
        return
    by_kind: dict[str, list[str]] = {}
    for dev in devices:
        by_kind.setdefault(interconnect(dev), []).append(dev.accelerator_label or "")
    ns = nccl_installer(devices[0]).namespace
    if world.get("Namespace", "", ns) is None:
        world.save(
            "Namespace",
            {"metadata": {"name": ns}, "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}},
            new=True,
        )
    for kind, accelerators in sorted(by_kind.items()):
        world.save("DaemonSet", installer_daemonset(kind, sorted(set(accelerators))), new=True)
    # GKE's own network, present once multi-networking is on (the pods' eth0).
    world.save("Network", {"metadata": {"name": DEFAULT_NETWORKS[0]}, "spec": {"type": "L3"}}, new=True)
    seen: set[str] = set()
    for dev in devices:
        for i, net in enumerate(pod_networks(dev), start=1):
            if net.name in seen:
                continue
            seen.add(net.name)
            gnp, network = network_objects(net, i)
            world.save("GKENetworkParamSet", gnp, new=True)
            world.save("Network", network, new=True)


# ---------------------------------------------------------------- the rules


def reconcile_daemonsets(world: SandboxWorld) -> bool:
    """Each DaemonSet's status over the nodes there are (its pods not run: see the module's note)."""
    changed = False
    nodes = world.items("Node", None)
    for ds in world.items("DaemonSet", None):
        spec = ((ds.get("spec") or {}).get("template") or {}).get("spec") or {}
        n = sum(
            1
            for node in nodes
            if daemon_should_run(spec, labels(node), (node.get("spec") or {}).get("taints") or [])
        )
        want = {
            "currentNumberScheduled": n,
            "desiredNumberScheduled": n,
            "numberMisscheduled": 0,
            "numberReady": n,
            "numberAvailable": n,
            "updatedNumberScheduled": n,
            "observedGeneration": int(ds["metadata"].get("generation") or 1),
        }
        st = ds.setdefault("status", {})
        if any(st.get(k) != v for k, v in want.items()):
            st.update(want)
            world.save("DaemonSet", ds)
            changed = True
    return changed


def reconcile_networks(world: SandboxWorld) -> bool:
    """GKE's network controller: the conditions of GKENetworkParamSets and Networks (module note)."""
    changed = False
    now = world.now()
    gnps = {g["metadata"]["name"]: g for g in world.items("GKENetworkParamSet", None)}
    for gnp in gnps.values():
        spec = gnp.get("spec") or {}
        before = world.snapshot(gnp)
        if not spec.get("deviceMode") and not spec.get("podIPv4Ranges"):
            ready = (
                "False",
                "SecondaryRangeAndDeviceModeUnspecified",
                "neither a device mode nor a secondary range is set",
            )
        else:
            ready = ("True", "GNPReady", "GKENetworkParamSet resource was validated successfully")
        set_status_condition(gnp, "Ready", *ready, now, observed_generation=False)
        changed |= world.commit("GKENetworkParamSet", gnp, before)
    for net in world.items("Network", None):
        spec = net.get("spec") or {}
        ref = spec.get("parametersRef") or {}
        if not ref:
            continue  # the cluster's own networks: nothing to validate against
        before = world.snapshot(net)
        params_of = gnps.get(ref.get("name", "")) if ref.get("kind") == "GKENetworkParamSet" else None
        if params_of is None:
            params = ("False", "GNPDeleted", f"GKENetworkParamSet {ref.get('name')} does not exist")
        elif spec.get("type") == "Device" and not (params_of.get("spec") or {}).get("deviceMode"):
            params = ("False", "DeviceModeMissing", f"GKENetworkParamSet {ref.get('name')} has no deviceMode")
        else:
            params = (
                "True",
                "GNPParamsReady",
                f"GKENetworkParamSet {ref.get('name')} is ready for this network",
            )
        set_status_condition(net, "ParamsReady", *params, now, observed_generation=False)
        ready = (
            ("True", "NetworkReady", "Network resource is ready")
            if params[0] == "True"
            else ("False", "ParamsNotReady", params[2])
        )
        set_status_condition(net, "Ready", *ready, now, observed_generation=False)
        changed |= world.commit("Network", net, before)
    return changed


def refuse_unknown_networks(world: SandboxWorld, pod: dict) -> str | None:
    """Why GKE's multi-network admission refuses `pod` (a network of its interfaces that is not a
    Network of the cluster), or None."""
    ann = (pod["metadata"].get("annotations") or {}).get(INTERFACES_ANNOTATION)
    if not ann:
        return None
    missing = [
        n
        for n in interface_networks(ann)
        if world.get("Network", "", n) is None and n not in DEFAULT_NETWORKS[1:]
    ]
    if missing:
        return (
            f"annotation {INTERFACES_ANNOTATION} names network(s) {', '.join(missing)} that do not exist: "
            "create each Network (and its GKENetworkParamSet) before the pods"
        )
    return None


def tolerate_extended_resources(pod: dict) -> None:
    """ExtendedResourceToleration: a toleration for each extended resource the pod's containers ask for."""
    spec = pod["spec"]
    names: set[str] = set()
    for c in list(spec.get("containers") or []) + list(spec.get("initContainers") or []):
        res = c.get("resources") or {}
        for k in list(res.get("requests") or {}) + list(res.get("limits") or {}):
            if "/" in k and not k.startswith(_NATIVE_PREFIX) and ".kubernetes.io/" not in k:
                names.add(k)
    tol = spec.setdefault("tolerations", [])
    for name in sorted(names):
        want = {"key": name, "operator": "Exists", "effect": "NoSchedule"}
        if want not in tol:
            tol.append(want)
