"""Is this cluster ready for olmo-ctl? The checks of `olmo-ctl doctor`, and the cheap ones `submit` runs.

Each check reads what the GKE backend will rely on and says, in one line, what is wrong and what to
do. Kueue's own rules decide what "ready" means: a JobSet whose LocalQueue, ClusterQueue or
WorkloadPriorityClass is missing, or whose ClusterQueue has no ResourceFlavor whose node labels agree
with the slice's nodeSelector, stays suspended forever (reconciler.go ExtractPriority fails, the
workload controller marks it Inadmissible, or the flavor assigner finds no flavor), and olmo-ctl
would report `queued` forever.

  run_checks(client, settings, device, slices)   every check -> [Check]; `Unreachable` when the API
                                                  does not answer at all (exit 3)
  submit_checks(client, settings, device, slices) the cheap ones (queue, priority class, flavor): the
                                                  first failure as `BadInput`, before anything is created

For GPU nodes (`h100-mega-80gb-8x2`) the flavor, quota and node checks are those of `nvidia.com/gpu`
and GKE's GPU labels, and two more say what a GPU pod needs of the cluster beyond its nodes
(`olmo_ctl.backends.gke_gpu` states each): the interconnect's NCCL installer DaemonSet, and the
multi-network objects (Network, GKENetworkParamSet) its interfaces name.

A read the account may not do (403) never fails a check: it becomes a warning (ok, the message says
what could not be read).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from olmo_ctl.backends import gke_gpu
from olmo_ctl.backends.apis import (
    JOBSET_GROUP,
    JOBSET_VERSION,
    JOBSETS,
    KUEUE_GROUP,
    KUEUE_VERSIONS,
    WORKLOADS,
)
from olmo_ctl.backends.jobset import host_network, launch_template, pod_node_selector
from olmo_ctl.backends.kube import (
    KubeRetryPolicy,
    api_status,
    call,
    parse_quantity,
    status_message,
    tolerates,
)
from olmo_ctl.core.config import PLACEHOLDER_IMAGE
from olmo_ctl.core.devices import Device
from olmo_ctl.core.errors import BadInput, Unreachable
from olmo_ctl.core.node_resources import check_shm_fits, trainer_resources_for

TPU = "google.com/tpu"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
KUEUE_KINDS = ("workloads", "localqueues", "clusterqueues", "resourceflavors", "workloadpriorityclasses")
JOBSET_INSTALL = (
    "install JobSet v0.10.1: kubectl apply --server-side -f "
    "https://github.com/kubernetes-sigs/jobset/releases/download/v0.10.1/manifests.yaml"
)
KUEUE_INSTALL = (
    "install Kueue v0.17.1: kubectl apply --server-side -f "
    "https://github.com/kubernetes-sigs/kueue/releases/download/v0.17.1/manifests.yaml"
)
# Every (verb, group, resource, subresource) the GKE backend uses (backends/gke.py).
TOOL_ACCESS: tuple[tuple[str, str, str, str], ...] = (
    ("create", JOBSET_GROUP, JOBSETS, ""),
    ("get", JOBSET_GROUP, JOBSETS, ""),
    ("list", JOBSET_GROUP, JOBSETS, ""),
    ("delete", JOBSET_GROUP, JOBSETS, ""),
    ("list", KUEUE_GROUP, WORKLOADS, ""),
    ("list", "", "pods", ""),
    ("deletecollection", "", "pods", ""),
    ("get", "", "pods", "log"),
    ("list", "", "events", ""),
    ("get", KUEUE_GROUP, "workloadpriorityclasses", ""),  # cluster-scoped: asked without a namespace
)
CLUSTER_SCOPED = frozenset({"workloadpriorityclasses"})
# One probe of the API before the checks: a cluster that does not answer is exit 3, quickly.
PROBE = KubeRetryPolicy(
    base_s=0.5, max_s=2.0, budget_s=8.0, max_attempts=3, connect_timeout_s=5.0, read_timeout_s=10.0
)
QUICK = KubeRetryPolicy(
    base_s=0.5, max_s=5.0, budget_s=30.0, max_attempts=4, connect_timeout_s=5.0, read_timeout_s=15.0
)
_IMAGE = re.compile(
    r"^(?:(?P<registry>[a-zA-Z0-9.-]+(?::\d+)?)/)?(?P<path>[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
    r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)(?::(?P<tag>[\w][\w.-]{0,127}))?"
    r"(?:@(?P<digest>[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}))?$"
)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "message": self.message}


def _warn(name: str, message: str) -> Check:
    return Check(name, True, f"warning: {message}")


class Forbidden(Exception):
    """The account may not read this (403)."""


# Doctor only reads (and dry-runs): nothing of its own is left on the cluster to find again.
DOCTOR_UNREACHABLE_HINT = (
    "check the kube context (`--kube-context`, `kubectl config current-context`) and "
    "`kubectl cluster-info`, then run `olmo-ctl doctor` again"
)


class Cluster:
    """Raw GETs and POSTs through the one retry policy (`kube.call`); 404 -> None, 403 -> Forbidden."""

    def __init__(self, api_client: Any, policy: KubeRetryPolicy = QUICK):
        self.api, self.policy = api_client, policy
        self.host = getattr(getattr(api_client, "configuration", None), "host", "") or ""

    def _once(self, method: str, path: str, body: Any = None, query: dict | None = None) -> Any:
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        m, url, hdrs, data, post = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self.api.call_api(m, url, hdrs, data, post, _request_timeout=self.policy.request_timeout)
        resp.read()
        if not 200 <= resp.status < 300:
            raise ApiException(http_resp=resp)
        return json.loads(resp.data or b"null")

    def request(
        self,
        method: str,
        path: str,
        what: str,
        body: Any = None,
        query: dict | None = None,
        policy: KubeRetryPolicy | None = None,
    ) -> Any:
        try:
            return call(
                self._once,
                method,
                path,
                body,
                query,
                policy=policy or self.policy,
                what=what,
                host=self.host,
                hint=DOCTOR_UNREACHABLE_HINT,
            )
        except Unreachable:
            raise
        except Exception as e:
            status = api_status(e)
            if status == 404:
                return None
            if status == 403:
                raise Forbidden(status_message(e)) from None
            if status == 401:
                raise BadInput(
                    f"{what}: the Kubernetes API refused our credentials ({status_message(e)})",
                    "refresh them: gcloud container clusters get-credentials CLUSTER --region REGION",
                ) from None
            if status:
                raise BadInput(f"{what}: HTTP {status}: {status_message(e)}") from None
            raise

    def get(self, path: str, what: str, query: dict | None = None) -> Any:
        return self.request("GET", path, what, query=query)


def _kueue(kube: Cluster, version: str, plural: str, name: str, ns: str | None = None) -> dict | None:
    where = f"/namespaces/{ns}" if ns else ""
    return kube.get(f"/apis/{KUEUE_GROUP}/{version}{where}/{plural}/{name}", f"read {plural} {name}")


def kueue_version(kube: Cluster) -> str | None:
    """The newest Kueue API version the cluster serves that olmo-ctl reads (None: no Kueue)."""
    group = kube.get(f"/apis/{KUEUE_GROUP}", "discover the Kueue API")
    served = {v.get("version") for v in (group or {}).get("versions") or []}
    return next((v for v in KUEUE_VERSIONS if v in served), None)


def device_labels(device: Device) -> dict[str, str]:
    """The node labels of the device's ResourceFlavor as XPK makes it: a TPU slice's accelerator and
    topology; GPU nodes' accelerator."""
    if device.is_gpu_nodes:
        return gke_gpu.flavor_labels(device)
    return {ACCELERATOR_LABEL: device.accelerator_label or "", TOPOLOGY_LABEL: device.topology or ""}


def accelerator_resource(device: Device) -> str:
    """The resource Kueue's quota and the nodes count the device in: google.com/tpu or nvidia.com/gpu."""
    return gke_gpu.GPU if device.is_gpu_nodes else TPU


def _flavor_fits(rf: dict, device: Device) -> tuple[bool, bool]:
    """(Kueue would assign it to the slice's pods, it carries both device labels). The flavor assigner
    rejects a flavor whose nodeLabels disagree with the pods' nodeSelector; missing labels agree."""
    nl = (rf.get("spec") or {}).get("nodeLabels") or {}
    want = device_labels(device)
    agrees = all(nl.get(k, v) == v for k, v in want.items())
    return agrees, agrees and all(k in nl for k in want)


def quantity(v: Any) -> float:
    """A Kubernetes resource quantity as a number (0 when unreadable)."""
    try:
        return parse_quantity(v)
    except ValueError:
        return 0.0


# ---------------------------------------------------------------- the checks


def check_apis(kube: Cluster) -> tuple[list[Check], str | None]:
    out = []
    js = kube.get(f"/apis/{JOBSET_GROUP}/{JOBSET_VERSION}", "discover the JobSet API")
    have = {r.get("name") for r in (js or {}).get("resources") or []}
    if js is None or JOBSETS not in have:
        out.append(
            Check(
                "jobset-crd",
                False,
                f"the cluster does not serve {JOBSET_GROUP}/{JOBSET_VERSION} "
                f"jobsets, which olmo-ctl renders; {JOBSET_INSTALL}",
            )
        )
    else:
        out.append(Check("jobset-crd", True, f"{JOBSET_GROUP}/{JOBSET_VERSION} jobsets served"))
    version = kueue_version(kube)
    if version is None:
        out.append(
            Check(
                "kueue-crds",
                False,
                f"the cluster serves no {KUEUE_GROUP} API in {' or '.join(KUEUE_VERSIONS)}; {KUEUE_INSTALL}",
            )
        )
        return out, None
    gv = kube.get(f"/apis/{KUEUE_GROUP}/{version}", "discover the Kueue API") or {}
    missing = [k for k in KUEUE_KINDS if k not in {r.get("name") for r in gv.get("resources") or []}]
    if missing:
        out.append(
            Check("kueue-crds", False, f"{KUEUE_GROUP}/{version} lacks {', '.join(missing)}; {KUEUE_INSTALL}")
        )
    else:
        out.append(Check("kueue-crds", True, f"{KUEUE_GROUP}/{version} serves {', '.join(KUEUE_KINDS)}"))
    return out, version


def check_namespace(kube: Cluster, ns: str) -> Check:
    try:
        obj = kube.get(f"/api/v1/namespaces/{ns}", f"read namespace {ns}")
    except Forbidden:
        return _warn(
            "namespace",
            f"cannot read namespace {ns} (forbidden); the RBAC check below says what olmo-ctl may do there",
        )
    if obj is None:
        return Check(
            "namespace",
            False,
            f"namespace {ns} does not exist; create it (kubectl create namespace {ns}) or set --namespace",
        )
    phase = (obj.get("status") or {}).get("phase", "Active")
    if phase != "Active":
        return Check("namespace", False, f"namespace {ns} is {phase}; use another one (--namespace)")
    return Check("namespace", True, f"namespace {ns} exists")


def check_queues(kube: Cluster, version: str, ns: str, queue: str) -> tuple[list[Check], dict | None]:
    """The LocalQueue and the ClusterQueue behind it (workload_controller.go: a missing or stopped one
    leaves the workload Inadmissible)."""
    try:
        lq = _kueue(kube, version, "localqueues", queue, ns)
    except Forbidden:
        return [_warn("local-queue", f"cannot read LocalQueue {ns}/{queue} (forbidden)")], None
    if lq is None:
        return [
            Check(
                "local-queue",
                False,
                f"LocalQueue {ns}/{queue} does not exist: Kueue would leave the JobSet "
                f"Inadmissible; create it, or set --queue to one that exists "
                f"(kubectl get localqueues -n {ns})",
            )
        ], None
    if (lq.get("spec") or {}).get("stopPolicy", "None") != "None":
        return [
            Check(
                "local-queue",
                False,
                f"LocalQueue {ns}/{queue} is stopped (stopPolicy "
                f"{lq['spec']['stopPolicy']}); ask its owner to resume it",
            )
        ], None
    cq_name = (lq.get("spec") or {}).get("clusterQueue", "")
    out = [Check("local-queue", True, f"LocalQueue {ns}/{queue} -> ClusterQueue {cq_name}")]
    try:
        cq = _kueue(kube, version, "clusterqueues", cq_name)
    except Forbidden:
        out.append(_warn("cluster-queue", f"cannot read ClusterQueue {cq_name} (forbidden)"))
        return out, None
    if cq is None:
        out.append(
            Check(
                "cluster-queue",
                False,
                f"ClusterQueue {cq_name} (of LocalQueue {ns}/{queue}) does not "
                "exist: workloads stay Inadmissible; create it or point the "
                "LocalQueue at one that exists",
            )
        )
        return out, None
    spec = cq.get("spec") or {}
    if spec.get("stopPolicy", "None") != "None":
        out.append(
            Check(
                "cluster-queue",
                False,
                f"ClusterQueue {cq_name} is stopped (stopPolicy "
                f"{spec['stopPolicy']}); ask its owner to resume it",
            )
        )
        return out, cq
    missing = []
    for g in spec.get("resourceGroups") or []:
        for f in g.get("flavors") or []:
            try:
                if _kueue(kube, version, "resourceflavors", f["name"]) is None:
                    missing.append(f["name"])
            except Forbidden:
                pass
    if missing:
        out.append(
            Check(
                "cluster-queue",
                False,
                f"ClusterQueue {cq_name} is inactive: ResourceFlavor "
                f"{', '.join(sorted(set(missing)))} does not exist; create it or "
                "remove it from the ClusterQueue",
            )
        )
        return out, cq
    out.append(Check("cluster-queue", True, f"ClusterQueue {cq_name} is active"))
    return out, cq


def flavors_for(
    kube: Cluster, version: str, cq: dict, device: Device
) -> list[tuple[str, dict | None, float]]:
    """(flavor name, ResourceFlavor or None if unreadable, nominal quota) of the ClusterQueue's flavors
    covering the device's resource (google.com/tpu, nvidia.com/gpu) that Kueue would assign to its pods."""
    out: list[tuple[str, dict | None, float]] = []
    resource = accelerator_resource(device)
    for g in (cq.get("spec") or {}).get("resourceGroups") or []:
        if resource not in (g.get("coveredResources") or []):
            continue
        for f in g.get("flavors") or []:
            nominal = next(
                (
                    quantity(r.get("nominalQuota", 0))
                    for r in f.get("resources") or []
                    if r.get("name") == resource
                ),
                0.0,
            )
            try:
                rf = _kueue(kube, version, "resourceflavors", f["name"])
            except Forbidden:
                out.append((f["name"], None, nominal))
                continue
            if rf is not None and _flavor_fits(rf, device)[0]:
                out.append((f["name"], rf, nominal))
    return out


# JobSet's resumeJob merges the readmitted JobSet's pod template node selector into each suspended Job's
# (collections.MergeMaps in pkg/controllers/jobset_controller.go) and never removes a key: v0.10.1 and
# every release since (kubernetes-sigs/jobset#1294, the fix, unmerged). A JobSet evicted from one
# flavor and readmitted on another keeps the first flavor's node labels beside the second's.
JOBSET_1294 = "https://github.com/kubernetes-sigs/jobset/pull/1294"


def flavor_merge_hazard(fits: list[tuple[str, dict | None, float]]) -> tuple[str, str, list[str]] | None:
    """(flavor A, flavor B, A's node-label keys B lacks) for two of the device's flavors whose node
    labels a Job readmitted from A onto B would keep and B's nodes need not carry; None if none."""
    labels = [(n, (rf.get("spec") or {}).get("nodeLabels") or {}) for n, rf, _ in fits if rf is not None]
    for a, la in labels:
        for b, lb in labels:
            extra = sorted(set(la) - set(lb))
            if a != b and extra:
                return a, b, extra
    return None


def check_flavor(kube: Cluster, version: str, cq: dict, device: Device, slices: int) -> Check:
    cq_name = cq["metadata"]["name"]
    labels = ", ".join(f"{k}={v}" for k, v in device_labels(device).items())
    res = accelerator_resource(device)
    fits = flavors_for(kube, version, cq, device)
    if not fits:
        return Check(
            "resource-flavor",
            False,
            f"ClusterQueue {cq_name} has no ResourceFlavor for {device.name} "
            f"covering {res} ({labels}): Kueue cannot admit the "
            f"{'nodes' if device.is_gpu_nodes else 'slice'}; add a flavor with these node labels and {res} "
            "quota (as `xpk cluster create` does)",
        )
    need = slices * (device.chips or 0)
    unread = [n for n, rf, _ in fits if rf is None]
    best_name, best_rf, best_q = max(fits, key=lambda t: t[2])
    what = f"{slices} x {device.name}" if slices > 1 else device.name
    if best_q + 1e-9 < need:
        cohort = (cq.get("spec") or {}).get("cohort") or (cq.get("spec") or {}).get("cohortName")
        msg = (
            f"ResourceFlavor {best_name} has a nominal quota of {best_q:g} {res} in ClusterQueue {cq_name}; "
            f"{what} needs {need}"
        )
        if cohort:
            return _warn("resource-flavor", f"{msg}: admitted only if it can borrow from cohort {cohort}")
        return Check("resource-flavor", False, f"{msg}: raise its nominalQuota")
    if best_rf is not None and not _flavor_fits(best_rf, device)[1]:
        return _warn(
            "resource-flavor",
            f"ResourceFlavor {best_name} has no {labels} node labels: Kueue admits "
            f"{'GPU workloads of any machine type' if device.is_gpu_nodes else 'TPU workloads of any shape'}"
            f" into its {best_q:g} {res}",
        )
    if unread and best_rf is None:
        return _warn(
            "resource-flavor",
            f"cannot read ResourceFlavor {best_name} (forbidden); its quota ({best_q:g} {res}) covers {what}",
        )
    hazard = flavor_merge_hazard(fits)
    if hazard is not None:
        a, b, keys = hazard
        return _warn(
            "resource-flavor",
            f"ClusterQueue {cq_name} can admit {what} on ResourceFlavor {a} or {b}, and {a}'s node labels "
            f"{', '.join(keys)} are not {b}'s: JobSet keeps a readmitted Job's old node selector beside the "
            f"new flavor's ({JOBSET_1294}, unmerged), so a JobSet evicted from {a} and readmitted on {b} has "
            "pods no node takes; give the device's flavors the same node-label keys, or each flavor a "
            "ClusterQueue of its own",
        )
    return Check(
        "resource-flavor",
        True,
        f"ResourceFlavor {best_name} ({labels}) with {best_q:g} {res} covers {what} ({need})",
    )


def check_priority_class(kube: Cluster, version: str, name: str | None) -> Check:
    if not name:
        return Check("priority-class", True, "no priority class configured")
    try:
        wpc = _kueue(kube, version, "workloadpriorityclasses", name)
    except Forbidden:
        return _warn("priority-class", f"cannot read WorkloadPriorityClass {name} (forbidden)")
    if wpc is not None:
        return Check("priority-class", True, f"WorkloadPriorityClass {name} (value {wpc.get('value', 0)})")
    also = ""
    try:
        if kube.get(f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}", f"read PriorityClass {name}"):
            also = (
                f" (a scheduling.k8s.io PriorityClass {name} exists, as XPK creates, but Kueue's label needs "
                "a WorkloadPriorityClass)"
            )
    except Forbidden:
        pass
    return Check(
        "priority-class",
        False,
        f"WorkloadPriorityClass {name} does not exist{also}: Kueue would never "
        f"build the Workload; create it (kind WorkloadPriorityClass, "
        f"{KUEUE_GROUP}) or unset the priority class",
    )


def check_rbac(kube: Cluster, ns: str) -> Check:
    denied = []
    for verb, group, resource, sub in TOOL_ACCESS:
        attrs = {"verb": verb, "group": group, "resource": resource}
        if resource not in CLUSTER_SCOPED:
            attrs["namespace"] = ns
        if sub:
            attrs["subresource"] = sub
        body = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attrs},
        }
        try:
            ans = kube.request(
                "POST",
                "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                "SelfSubjectAccessReview",
                body=body,
            )
        except Forbidden:
            return _warn(
                "rbac",
                f"cannot ask SelfSubjectAccessReview (forbidden); run `kubectl auth can-i --list -n {ns}`",
            )
        if ans is None:
            return _warn("rbac", "the cluster does not answer SelfSubjectAccessReview")
        if not (ans.get("status") or {}).get("allowed"):
            full = resource + (f"/{sub}" if sub else "") + (f".{group}" if group else "")
            denied.append(f"{verb} {full}")
    if denied:
        return Check(
            "rbac",
            False,
            f"in namespace {ns} this account may not {', '.join(denied)}; ask for a Role "
            "granting them (see docs/sandbox-and-doctor.md)",
        )
    return Check("rbac", True, f"may {len(TOOL_ACCESS)} verbs olmo-ctl uses in namespace {ns}")


def check_nodes(kube: Cluster, device: Device, slices: int, selector: dict[str, str] | None = None) -> Check:
    """Node pools with the slice's labels and the site's extra node selector (capacity type included)."""
    labels = {**device_labels(device), **(selector or {})}
    sel = ",".join(f"{k}={v}" for k, v in labels.items())
    try:
        nodes = kube.get("/api/v1/nodes", "list nodes", query={"labelSelector": sel}) or {}
    except Forbidden:
        return _warn(
            "node-pools",
            f"cannot list nodes (forbidden); check with your admin that node pools with {sel} exist",
        )
    pools: dict[str, int] = {}
    for n in nodes.get("items") or []:
        pool = (n["metadata"].get("labels") or {}).get(NODEPOOL_LABEL, n["metadata"]["name"])
        pools[pool] = pools.get(pool, 0) + 1
    whole = sorted(p for p, c in pools.items() if c >= device.vms)
    if len(whole) >= slices:
        return Check(
            "node-pools", True, f"{len(whole)} node pool(s) with {sel} and {device.vms} node(s) each"
        )
    if not pools:
        return Check(
            "node-pools",
            False,
            f"no nodes with {sel}: create {slices} node pool(s) for {device.name} "
            f"({device.vms} x {device.machine_type}), e.g. with xpk cluster create",
        )
    return Check(
        "node-pools",
        False,
        f"{len(whole)} complete node pool(s) with {sel} ({device.vms} nodes each); "
        f"{slices} needed: add node pools or wait for repairs",
    )


def check_gpu_nodes(
    kube: Cluster,
    device: Device,
    slices: int,
    selector: dict[str, str] | None = None,
    tolerations: list[dict] | None = None,
) -> Check:
    """GPU nodes the pods can run on: GKE's GPU labels and the site's selector, `nvidia.com/gpu`
    allocatable (the driver installed), no taint the pods do not tolerate, and enough of them (in any
    node pools: N nodes are not one slice)."""
    res, per_node = gke_gpu.GPU, device.chips_per_vm
    sel = ",".join(f"{k}={v}" for k, v in {**gke_gpu.node_labels(device), **(selector or {})}.items())
    need = device.vms * slices
    try:
        nodes = (kube.get("/api/v1/nodes", "list nodes", query={"labelSelector": sel}) or {}).get(
            "items"
        ) or []
    except Forbidden:
        return _warn(
            "node-pools",
            f"cannot list nodes (forbidden); check with your admin that {need} node(s) with {sel} exist",
        )
    create = (
        f"--machine-type {device.machine_type} --accelerator type={device.accelerator_label},count={per_node},"
        "gpu-driver-version=latest"
    )
    if not nodes:
        return Check(
            "node-pools",
            False,
            f"no nodes with {sel}: create a node pool of {need} x {device.machine_type} (as `xpk cluster create "
            f"--device-type {device.generation} --num-nodes {need}` does; gcloud container node-pools create "
            f"... {create})",
        )
    usable: list[dict] = []
    driverless: list[dict] = []
    tainted: dict[str, dict] = {}  # `key=value:effect` -> the taint
    for n in nodes:
        spec = n.get("spec") or {}
        alloc = quantity(((n.get("status") or {}).get("allocatable") or {}).get(res, 0))
        bad = [
            t
            for t in spec.get("taints") or []
            if t.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations or [], t)
        ]
        if alloc + 1e-9 < per_node:
            driverless.append(n)
        elif bad or spec.get("unschedulable"):
            for t in bad:
                if not t["key"].startswith("node.kubernetes.io/"):  # a node's condition, not its setup
                    tainted.setdefault(
                        f"{t['key']}{'=' + t['value'] if t.get('value') else ''}:{t['effect']}", t
                    )
        else:
            usable.append(n)
    pools = sorted({(n["metadata"].get("labels") or {}).get(NODEPOOL_LABEL, "?") for n in usable})
    if len(usable) >= need:
        return Check(
            "node-pools",
            True,
            f"{len(usable)} node(s) with {sel} and {per_node} {res} each (node pool {', '.join(pools)}); "
            f"{device.name} needs {need}",
        )
    if driverless:
        return Check(
            "node-pools",
            False,
            f"{len(driverless)} node(s) with {sel} have less than {per_node} allocatable {res}: the NVIDIA "
            "driver is not installed; create the node pool with gpu-driver-version=latest or install it: "
            f"kubectl apply -f {gke_gpu.GPU_DRIVER_INSTALLER}",
        )
    if tainted:
        taint, t = next(iter(tainted.items()))
        return Check(
            "node-pools",
            False,
            f"node(s) with {sel} are tainted {taint}, which the pods do not tolerate: remove the taint "
            f"(kubectl taint nodes -l {sel} {t['key']}:{t['effect']}-) or tolerate it (the site setting "
            "`tolerations`)",
        )
    return Check(
        "node-pools",
        False,
        f"{len(usable)} schedulable node(s) with {sel} (of {len(nodes)}); {device.name} needs {need}: add nodes "
        "(gcloud container clusters resize CLUSTER --node-pool POOL --num-nodes N) or wait for repairs",
    )


def check_nccl_installer(kube: Cluster, device: Device) -> Check:
    """The interconnect's NCCL installer DaemonSet selects the device's nodes and runs on them: without
    it the GPUs' collectives have no GPUDirect plugin (TCPXO's FasTrak, RDMA's gIB) to run over."""
    inst = gke_gpu.nccl_installer(device)
    ns, name, accel = inst.namespace, inst.name, device.accelerator_label or ""
    fix = f"kubectl apply -f {inst.manifest}"
    try:
        ds = kube.get(f"/apis/apps/v1/namespaces/{ns}/daemonsets/{name}", f"read DaemonSet {ns}/{name}")
    except Forbidden:
        return _warn(
            "nccl-installer", f"cannot read DaemonSet {ns}/{name} (forbidden): NCCL's plugin not checked"
        )
    if ds is None:
        return Check(
            "nccl-installer",
            False,
            f"no DaemonSet {ns}/{name}: NCCL's {gke_gpu.interconnect(device)} plugin is not installed on the "
            f"GPU nodes, so their collectives cannot use GPUDirect; install it: {fix}",
        )
    pod_spec = ((ds.get("spec") or {}).get("template") or {}).get("spec") or {}
    if not gke_gpu.daemon_should_run(pod_spec, gke_gpu.node_labels(device), [gke_gpu.GPU_TAINT]):
        return Check(
            "nccl-installer",
            False,
            f"DaemonSet {ns}/{name} does not select {gke_gpu.ACCELERATOR_LABEL}={accel} nodes: add {accel} to "
            f"its node affinity, or apply the installer for {device.machine_type}: {fix}",
        )
    st = ds.get("status") or {}
    desired, ready = int(st.get("desiredNumberScheduled") or 0), int(st.get("numberReady") or 0)
    if ready < desired:
        return Check(
            "nccl-installer",
            False,
            f"DaemonSet {ns}/{name}: {ready} of {desired} installer pods ready, so the plugin is missing on "
            f"{desired - ready} node(s); see kubectl -n {ns} describe daemonset {name}",
        )
    return Check(
        "nccl-installer", True, f"DaemonSet {ns}/{name} selects {accel} nodes ({ready}/{desired} ready)"
    )


NETWORKS_DOC = "docs/sandbox-and-doctor.md#gpu-clusters"


def check_gpu_networks(kube: Cluster, device: Device, settings: Any = None) -> Check:
    """Every network the pods' `networking.gke.io/interfaces` names is a Network (GKE refuses the pods
    otherwise) whose GKENetworkParamSet exists with the interconnect's device mode, and is Ready."""
    nets = gke_gpu.pod_networks(device, settings)
    group, version = gke_gpu.NETWORK_GROUP, gke_gpu.NETWORK_VERSION
    if not nets:
        return Check("gpu-networks", True, "the pods name no networks beyond the cluster's own")
    names = ", ".join(n.name for n in nets)
    try:
        served = kube.get(f"/apis/{group}/{version}", f"discover {group}/{version}")
        if served is None:
            return Check(
                "gpu-networks",
                False,
                f"the cluster does not serve {group}/{version} Networks, so the pods' interfaces ({names}) "
                "cannot be given: GKE multi-networking is off; create the cluster with --enable-dataplane-v2 "
                f"--enable-multi-networking (as `xpk cluster create` does for {device.machine_type})",
            )
        missing, no_params, wrong_mode, not_ready = [], [], [], []
        for net in nets:
            obj = kube.get(f"/apis/{group}/{version}/networks/{net.name}", f"read Network {net.name}")
            if obj is None:
                missing.append(net)
                continue
            ref = ((obj.get("spec") or {}).get("parametersRef") or {}).get("name") or ""
            gnp = (
                kube.get(
                    f"/apis/{group}/{version}/gkenetworkparamsets/{ref}", f"read GKENetworkParamSet {ref}"
                )
                if ref
                else None
            )
            mode = ((gnp or {}).get("spec") or {}).get("deviceMode")
            ready = next(
                (c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"),
                None,
            )
            if gnp is None:
                no_params.append((net, ref))
            elif mode != net.device_mode:
                wrong_mode.append((net, ref, mode))
            elif ready is not None and ready.get("status") != "True":
                not_ready.append((net, ready))
    except Forbidden:
        return _warn("gpu-networks", f"cannot read {group} objects (forbidden): networks {names} not checked")
    if missing:
        modes = sorted({n.device_mode for n in missing})
        return Check(
            "gpu-networks",
            False,
            f"no Network {', '.join(n.name for n in missing)}: GKE refuses the pods, whose interfaces name "
            f"them; create each with its GKENetworkParamSet (deviceMode {' / '.join(modes)}, on the node "
            f"pool's additional VPC subnets) as {NETWORKS_DOC} shows",
        )
    if no_params:
        net, ref = no_params[0]
        return Check(
            "gpu-networks",
            False,
            f"Network {net.name} refers to GKENetworkParamSet {ref or '(none)'}, which does not exist: create "
            f"it (vpc, vpcSubnet of the node pool's network, deviceMode {net.device_mode}) as {NETWORKS_DOC} shows",
        )
    if wrong_mode:
        net, ref, mode = wrong_mode[0]
        return Check(
            "gpu-networks",
            False,
            f"GKENetworkParamSet {ref} (of Network {net.name}) has deviceMode {mode}; "
            f"{gke_gpu.interconnect(device)} needs {net.device_mode}: recreate it with deviceMode {net.device_mode}",
        )
    if not_ready:
        net, cond = not_ready[0]
        return Check(
            "gpu-networks",
            False,
            f"Network {net.name} is not Ready ({cond.get('reason')}: {cond.get('message')}); see kubectl "
            f"describe network {net.name}",
        )
    return Check("gpu-networks", True, f"Networks {names} with their GKENetworkParamSets")


WORKLOAD_IDENTITY_ANNOTATION = "iam.gke.io/gcp-service-account"
# Kueue's ProvisioningRequest admission check (pkg/controller/admissionchecks/provisioning): what
# `xpk cluster create --flex` puts on the ClusterQueue (AdmissionCheck `dws-prov`,
# src/xpk/templates/kueue_config.yaml.j2) so flex-start slices are provisioned before admission.
PROVISIONING_CONTROLLER = "kueue.x-k8s.io/provisioning-request"


def check_service_account(kube: Cluster, ns: str, name: str, host_network: bool = False) -> Check:
    """The pods' service account exists (the ServiceAccount admission plugin refuses every pod naming a
    missing one: the Job controller retries FailedCreate forever while the slice's quota is held), and
    is bound to a GCP service account for Workload Identity (else GCS refuses the trainer)."""
    try:
        sa = kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/{name}", f"read service account {ns}/{name}")
    except Forbidden:
        return _warn("service-account", f"cannot read service account {ns}/{name} (forbidden)")
    if sa is None:
        return Check(
            "service-account",
            False,
            f"service account {ns}/{name} does not exist: every pod would be refused; create it "
            f"(kubectl create serviceaccount {name} -n {ns}) and bind it for Workload Identity, or set "
            "--service-account to one that exists (kubectl get serviceaccounts)",
        )
    gcp = ((sa.get("metadata") or {}).get("annotations") or {}).get(WORKLOAD_IDENTITY_ANNOTATION)
    if host_network:
        return _warn(
            "service-account",
            f"{ns}/{name} exists, but host_network is on: pods reach GCS as the node pool's service account",
        )
    if not gcp:
        return _warn(
            "service-account",
            f"service account {ns}/{name} has no {WORKLOAD_IDENTITY_ANNOTATION} annotation: without Workload "
            "Identity the trainer reaches GCS as the node's service account; annotate it with a GCP "
            "service account that may read and write the run root",
        )
    return Check("service-account", True, f"{ns}/{name} -> {gcp} (Workload Identity)")


def check_capacity(kube: Cluster, version: str, cq: dict | None, capacity: str) -> Check:
    """What the capacity type needs of the cluster beyond node pools of the right kind (which
    `node-pools` checks with the capacity's node selector): flex-start needs Kueue's ProvisioningRequest
    admission check on the ClusterQueue, or its slices are never provisioned."""
    if capacity != "flex-start":
        return Check("capacity", True, f"{capacity}: node pools checked with its node selector")
    if cq is None:
        return _warn("capacity", "flex-start: no readable ClusterQueue to check its admission checks")
    spec = cq.get("spec") or {}
    names = list(spec.get("admissionChecks") or []) + [
        r.get("name") for r in (spec.get("admissionChecksStrategy") or {}).get("admissionChecks") or []
    ]
    for name in names:
        try:
            ac = _kueue(kube, version, "admissionchecks", name)
        except Forbidden:
            return _warn("capacity", f"flex-start: cannot read AdmissionCheck {name} (forbidden)")
        if ac and (ac.get("spec") or {}).get("controllerName") == PROVISIONING_CONTROLLER:
            active = next(
                (c for c in (ac.get("status") or {}).get("conditions") or [] if c.get("type") == "Active"),
                None,
            )
            if active is not None and active.get("status") != "True":
                return Check(
                    "capacity",
                    False,
                    f"flex-start: AdmissionCheck {name} is not active ({active.get('message') or active.get('reason')})",
                )
            return Check(
                "capacity",
                True,
                f"flex-start: ClusterQueue {cq['metadata']['name']} has AdmissionCheck {name}",
            )
    return Check(
        "capacity",
        False,
        f"flex-start: ClusterQueue {cq['metadata']['name']} has no {PROVISIONING_CONTROLLER} admission check, so "
        "no slice is ever provisioned; add one as `xpk cluster create --flex` does (AdmissionCheck dws-prov with "
        "a ProvisioningRequestConfig of class queued-provisioning.gke.io)",
    )


# The remedy for a ClusterQueue without the trainer's CPU and memory (XPK's --cpu-limit and
# --memory-limit are set to one machine's size, `_autocorrect_cpu_limit`, too little for a slice of
# several VMs): a resource group of their own, with a flavor without node labels.
CPU_MEMORY_REMEDY = (
    "kubectl apply a ResourceFlavor cpu-memory with no nodeLabels, then kubectl patch clusterqueue {cq} --type=json "
    '-p \'[{{"op": "add", "path": "/spec/resourceGroups/-", "value": {{"coveredResources": ["cpu", "memory"], '
    '"flavors": [{{"name": "cpu-memory", "resources": [{{"name": "cpu", "nominalQuota": "{cpu}"}}, '
    '{{"name": "memory", "nominalQuota": "{memory}"}}]}}]}}}}]\''
)


def _fmt(resource: str, q: float) -> str:
    return f"{q:g} cores" if resource == "cpu" else f"{q / 2**30:.1f}Gi"


def check_trainer_resources(
    kube: Cluster,
    version: str | None,
    cq: dict | None,
    device: Device,
    setting: str,
    slices: int = 1,
    nodes: bool = True,
    shm_size: str | None = None,
) -> Check:
    """The trainer's CPU and memory (site setting trainer_resources) against the cluster: Kueue admits a
    pod set only when some resource group of the ClusterQueue covers each resource it requests
    ("resource cpu unavailable in ClusterQueue", flavorassigner.go) with a flavor whose quota holds
    every pod's; the scheduler places a pod only on a node whose allocatable CPU and memory hold its
    requests; /dev/shm must leave the trainer half its memory limit."""
    try:
        res = trainer_resources_for(device.generation, setting)
        check_shm_fits(shm_size, res)
    except BadInput as e:
        return Check("trainer-resources", False, e.one_line())
    if res is None:
        return Check("trainer-resources", True, "off: the trainer requests no CPU or memory (BestEffort)")
    asks = f"cpu {res['cpu']}, memory {res['memory']} per pod"
    pods = slices * device.vms
    need = {r: quantity(res[r]) * pods for r in ("cpu", "memory")}
    if cq is not None:
        name = cq["metadata"]["name"]
        remedy = CPU_MEMORY_REMEDY.format(
            cq=name, cpu=math.ceil(need["cpu"]), memory=f"{math.ceil(need['memory'] / 2**30)}Gi"
        )
        groups = (cq.get("spec") or {}).get("resourceGroups") or []
        covered = {r for g in groups for r in g.get("coveredResources") or []}
        missing = [r for r in ("cpu", "memory") if r not in covered]
        if missing:
            return Check(
                "trainer-resources",
                False,
                f"ClusterQueue {name} covers no {' or '.join(missing)}, so Kueue never admits the trainer's pods "
                f"({asks}): {remedy}; or set trainer_resources: off",
            )
        for r in ("cpu", "memory") if nodes else ():  # submit: coverage only (a queue may borrow quota)
            best = 0.0
            for g in groups:
                if r not in (g.get("coveredResources") or []):
                    continue
                for fq in g.get("flavors") or []:
                    rf = _kueue(kube, version, "resourceflavors", fq["name"]) if version else None
                    if rf is not None and not _flavor_fits(rf, device)[0]:
                        continue
                    for row in fq.get("resources") or []:
                        if row.get("name") == r:
                            best = max(best, quantity(row.get("nominalQuota", 0)))
            if best < need[r]:
                return Check(
                    "trainer-resources",
                    False,
                    f"ClusterQueue {name} has a nominal quota of {_fmt(r, best)} {r} for {device.name}; its "
                    f"{pods} pod(s) need {_fmt(r, need[r])} ({asks}), so Kueue never admits them (xpk cluster "
                    f"create --cpu-limit and --memory-limit are one machine's size): raise it, e.g. {remedy}; or "
                    "set trainer_resources: off",
                )
    if not nodes:
        return Check("trainer-resources", True, f"{asks}: the ClusterQueue covers cpu and memory")
    labels = device_labels(device)
    sel = ",".join(f"{k}={v}" for k, v in labels.items())
    try:
        items = (kube.get("/api/v1/nodes", "list nodes", query={"labelSelector": sel}) or {}).get(
            "items"
        ) or []
    except Forbidden:
        return _warn(
            "trainer-resources", f"{asks}; cannot list nodes (forbidden) to compare their allocatable"
        )
    for n in items:
        alloc = (n.get("status") or {}).get("allocatable") or {}
        for r in ("cpu", "memory"):
            if r in alloc and quantity(alloc[r]) < quantity(res[r]):
                return Check(
                    "trainer-resources",
                    False,
                    f"node {n['metadata']['name']} has {_fmt(r, quantity(alloc[r]))} of {r} allocatable, under "
                    f"the trainer's {_fmt(r, quantity(res[r]))}: its pods never schedule; set trainer_resources: "
                    "cpu=N,memory=Q within the nodes' allocatable, less what GKE's DaemonSets request",
                )
    return Check(
        "trainer-resources",
        True,
        f"{asks}, requests equal to limits (Guaranteed); quota for {pods} pod(s)",
    )


def check_image(image: str) -> Check:
    if image == PLACEHOLDER_IMAGE:
        return Check(
            "image",
            False,
            f"the image is the placeholder {image}; set --image, OLMO_CTL_IMAGE or "
            "`image:` in the config file (see docs/install.md)",
        )
    m = _IMAGE.match(image)
    if not m:
        return Check(
            "image",
            False,
            f"`{image}` is not an image reference; e.g. us-docker.pkg.dev/PROJECT/REPO/olmo-ctl:0.1.0",
        )
    if not m.group("digest") and m.group("tag") in (None, "latest"):
        return _warn(
            "image",
            f"{image} is not pinned (no tag or :latest): attempts of one run may start different "
            "code; use a version tag or a digest",
        )
    return Check("image", True, f"{image}")


# JobSet's release manifests install its controller as this Deployment (config/default: namespace
# jobset-system, namePrefix jobset-); the image tag is the release.
JOBSET_CONTROLLER = ("jobset-system", "jobset-controller-manager")
# kubernetes-sigs/jobset#1088: with exclusive placement, a follower pod created while its leader's node
# is gone gets the node selector `cloud.google.com/gke-nodepool: ""` and never schedules (v0.10.1
# pod_mutating_webhook.go topologyFromPod ignores NotFound). Fixed by #1089 (commit d189133f), first
# released in v0.11.0.
JOBSET_1088_FIXED = (0, 11, 0)
# The launch template's failure policy tells a user error from a lost peer by the Job's failure message
# (`onJobFailureMessagePatterns`), first in v0.10.0 (api/jobset/v1alpha2/jobset_types.go). An older
# API server prunes the field, and FailOnUserError would then fail the JobSet on every exit 3.
JOBSET_MESSAGE_PATTERNS = (0, 10, 0)
_RELEASE = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)")


def jobset_release(image: str) -> tuple[int, int, int] | None:
    """The release in a JobSet controller image's tag (`registry.k8s.io/jobset/jobset:v0.10.1`), or None."""
    tag = image.split("@", 1)[0].rsplit("/", 1)[-1].partition(":")[2]
    m = _RELEASE.match(tag)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def check_jobset_controller(kube: Cluster) -> Check:
    """The JobSet controller's version, from its Deployment's image tag: a failure before v0.10.0 (the
    failure policy's message patterns), a warning before the jobset#1088 fix (v0.11.0) or when it
    cannot be read."""
    ns, name = JOBSET_CONTROLLER
    try:
        dep = kube.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}", f"read Deployment {ns}/{name}")
    except Forbidden:
        return _warn(
            "jobset-version", f"cannot read Deployment {ns}/{name} (forbidden): JobSet's version unknown"
        )
    if dep is None:
        return _warn(
            "jobset-version",
            f"no Deployment {ns}/{name}: JobSet's version unknown (installed another way?); "
            "v0.11.0 or later has the fix for jobset#1088",
        )
    images = [
        c.get("image") or ""
        for c in ((dep.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers") or []
    ]
    image = next((i for i in images if "jobset" in i), images[0] if images else "")
    release = jobset_release(image)
    if release is None:
        return _warn("jobset-version", f"JobSet controller image {image or '?'} names no release")
    version = "v" + ".".join(map(str, release))
    if release < JOBSET_MESSAGE_PATTERNS:
        need = "v" + ".".join(map(str, JOBSET_MESSAGE_PATTERNS))
        return Check(
            "jobset-version",
            False,
            f"JobSet controller {version} ({image}) predates {need}: the launch template's failure policy "
            "needs onJobFailureMessagePatterns (without it every exit 3, a lost peer, would fail the JobSet); "
            f"upgrade JobSet to {need} or later (v0.11.0 or later also has the fix for jobset#1088)",
        )
    if release < JOBSET_1088_FIXED:
        fixed = "v" + ".".join(map(str, JOBSET_1088_FIXED))
        return _warn(
            "jobset-version",
            f"JobSet controller {version} ({image}) predates {fixed}, the first release with the fix for "
            'jobset#1088: a follower pod created while its leader\'s node is gone gets gke-nodepool="" and never '
            f"schedules (the slice stays admitted, not running, until --admission-timeout); upgrade JobSet to {fixed} or later",
        )
    return Check("jobset-version", True, f"JobSet controller {version} ({image})")


def probe(kube: Cluster) -> None:
    """Unreachable (exit 3) when the API does not answer /version."""
    kube.request("GET", "/version", "reach the Kubernetes API", policy=PROBE)


def run_checks(api_client: Any, settings: Any, device: Device | None, slices: int = 1) -> list[Check]:
    kube = Cluster(api_client)
    probe(kube)
    checks, version = check_apis(kube)
    if checks and checks[0].name == "jobset-crd" and checks[0].ok:
        checks.insert(1, check_jobset_controller(kube))
    ns = settings.namespace
    checks.append(check_namespace(kube, ns))
    cq = None
    if version is not None:
        qs, cq = check_queues(kube, version, ns, settings.queue)
        checks += qs
        if device is not None and cq is not None:
            checks.append(check_flavor(kube, version, cq, device, slices))
        elif device is not None:
            checks.append(_warn("resource-flavor", "not checked: no readable ClusterQueue (see above)"))
        checks.append(check_priority_class(kube, version, settings.priority_class))
        checks.append(check_capacity(kube, version, cq, settings.capacity))
        if device is not None:
            checks.append(
                check_trainer_resources(
                    kube,
                    version,
                    cq,
                    device,
                    settings.trainer_resources,
                    slices,
                    shm_size=launch_template(device.generation)["vars"].get("shm_size"),
                )
            )
    if device is None:
        checks.append(Check("resource-flavor", True, "skipped: pass --device to check flavor and quota"))
    checks.append(check_rbac(kube, ns))
    checks.append(check_service_account(kube, ns, settings.service_account, host_network(settings)))
    if device is not None and device.is_gpu_nodes:
        tolerations = gke_gpu.pod_tolerations(device, settings)
        checks.append(check_gpu_nodes(kube, device, slices, pod_node_selector(settings, device), tolerations))
        checks.append(check_nccl_installer(kube, device))
        checks.append(check_gpu_networks(kube, device, settings))
    elif device is not None:
        checks.append(check_nodes(kube, device, slices, pod_node_selector(settings, device)))
    checks.append(check_image(settings.image))
    return checks


def submit_checks(api_client: Any, settings: Any, device: Device, slices: int = 1) -> None:
    """What `submit` checks before creating anything (the queue, the priority class, a flavor for the
    device): the first failure as BadInput (exit 2). Reads the account may not do are skipped; quota
    and node pools are left to `doctor` (a ClusterQueue may borrow, node pools may scale)."""
    kube = Cluster(api_client)
    version = kueue_version(kube)
    if version is None:
        raise BadInput(f"the cluster serves no {KUEUE_GROUP} API", KUEUE_INSTALL)
    qs, cq = check_queues(kube, version, settings.namespace, settings.queue)
    checks = [
        *qs,
        check_priority_class(kube, version, settings.priority_class),
        check_service_account(kube, settings.namespace, settings.service_account, host_network(settings)),
    ]
    if cq is not None and not [c for c in qs if not c.ok]:
        fits = flavors_for(kube, version, cq, device)
        if not fits:
            checks.append(check_flavor(kube, version, cq, device, slices))
        checks.append(
            check_trainer_resources(
                kube, version, cq, device, settings.trainer_resources, slices, nodes=False
            )
        )
    for c in checks:
        if not c.ok:
            raise BadInput(c.message, "`olmo-ctl doctor` checks the whole cluster")
