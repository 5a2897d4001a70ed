"""A sandbox cluster: the test cluster served on localhost, configured as XPK configures a GKE cluster.

`olmo-ctl sandbox` runs one of these until SIGTERM or Ctrl-C. What it holds, after
XPK's `src/xpk/templates/kueue_config.yaml.j2` and `core/kueue_manager.py` (which users run on):

- for each TPU `DEVICE=N` a ResourceFlavor `<N>x<DEVICE>` with the node labels of the device
  (`cloud.google.com/gke-tpu-accelerator`, `cloud.google.com/gke-tpu-topology`) and N slices' worth
  of nodes carrying them (one node pool per slice, `google.com/tpu` allocatable per VM);
- for each GPU machine type `MACHINE=N` (`h100-mega-80gb-8=2`; `h100-mega-80gb-8x2=1` is the same two
  nodes) the GPU cluster `xpk cluster create --device-type MACHINE --num-nodes N` makes: a
  ResourceFlavor `1x<MACHINE>` with the accelerator label, one node pool of N nodes with GKE's GPU
  labels, taint and `nvidia.com/gpu` allocatable, the interconnect's NCCL installer DaemonSet and the
  multi-network objects its pods' interfaces name (`olmo_ctl.sandbox.cluster.gke_gpu`);
- ClusterQueue `cluster-queue`: `namespaceSelector: {}`, one resource group per accelerator resource
  (`google.com/tpu`, `nvidia.com/gpu`) with each flavor's nominal quota (N x chips of the slice, N x
  GPUs of the node), `preemption: withinClusterQueue: LowerPriority, reclaimWithinCohort: Never`
  (lower priorities are preempted within the queue, never across the cohort);
- LocalQueue `multislice-queue` (or `--queue`) in the namespace, pointing at it;
- XPK's scheduling.k8s.io PriorityClasses very-low (100), low (250), medium (500), high (750) and
  very-high (1000), and the Kueue WorkloadPriorityClasses asked for (`NAME` or `NAME=VALUE`; a name of
  XPK's table takes its value).

Everything else is the test cluster's rules (Jobs, JobSet v0.10.1, Kueue v0.17.1), so a JobSet or
Kueue object anyone applies through the API takes part in admission and preemption like ours. Pods
that Kueue admits are bound to a free node matching their nodeSelector (and tolerating its taints) by
`SandboxWorld.schedule`, and
their containers are started and stopped by a `PodRunner`: the scripted one here keeps them running
until a cause of the world ends them (the tests of the cluster rules); `olmo_ctl.sandbox.pod_processes.
ProcessRunner` runs each pod as a local process (`olmo-ctl sandbox` by default).
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import shlex
import tempfile
from pathlib import Path
from typing import Any

from olmo_ctl import __version__
from olmo_ctl.backends import gke_gpu
from olmo_ctl.backends.base import Target
from olmo_ctl.backends.doctor import JOBSET_CONTROLLER
from olmo_ctl.core.devices import Device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.sandbox.cluster import gke_gpu as gpu_rules
from olmo_ctl.sandbox.cluster.nodes import NodeCauses
from olmo_ctl.sandbox.cluster.objects import (
    JOB_TRACKING_FINALIZER,
    RESOURCE_IN_USE_FINALIZER,
    deleting,
    format_quantity,
    labels,
    node_allocatable,
    node_capacity,
    pod_requests,
    pod_terminal,
    quantity,
)
from olmo_ctl.sandbox.cluster.world import OLMO_CTL_SERVICE_ACCOUNT, SANDBOX_GCP_ACCOUNT
from olmo_ctl.sandbox.kube_server import KubeServer, ScriptedWorld
from olmo_ctl.sandbox.kubeconfig import CONTEXT

TPU = "google.com/tpu"
GPU = gke_gpu.GPU
ACCELERATOR_RESOURCES = (TPU, GPU)
# What the scheduler counts per node (NodeResourcesFit): the accelerators and the trainer's CPU and memory.
SCHEDULED_RESOURCES = (*ACCELERATOR_RESOURCES, "cpu", "memory")
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
CLUSTER_QUEUE = "cluster-queue"  # XPK's CLUSTER_QUEUE_NAME
CPU_MEMORY_FLAVOR = "cpu-memory"  # the flavor of the trainers' CPU and memory quota
LOCAL_QUEUE = "multislice-queue"  # XPK's LOCAL_QUEUE_NAME
# XPK's kueue_config.yaml.j2 PriorityClasses (scheduling.k8s.io), also the default values of the
# WorkloadPriorityClasses the sandbox is asked for by name.
XPK_PRIORITIES = {"very-low": 100, "low": 250, "medium": 500, "high": 750, "very-high": 1000}
# What the pods' image is set to: pinned (doctor accepts it) and never pulled (pods run this checkout).
IMAGE = f"localhost/olmo-ctl:{__version__}"
# The JobSet release whose rules the test cluster follows, as its controller Deployment names it.
JOBSET_IMAGE = "registry.k8s.io/jobset/jobset:v0.10.1"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9_.-]{1,61}[a-z0-9]$")


def parse_slices(items: list[str] | tuple[str, ...]) -> dict[str, int]:
    """`DEVICE=N` (N >= 1; `DEVICE` alone is one) -> {device name: N}: N slices of a TPU device, or
    N nodes of a GPU machine type, keyed by the machine type (`h100-mega-80gb-8x2=3` is 6 nodes of
    `h100-mega-80gb-8`)."""
    out: dict[str, int] = {}
    for item in items:
        name, _, n = item.partition("=")
        dev = Target.parse(name.strip()).device
        if not dev.is_tpu and not dev.is_gpu_nodes:
            raise BadInput(
                f"--slices {item}: `{dev.name}` is neither a TPU slice nor GPU nodes",
                "e.g. --slices tpu7x-128=2 or --slices h100-mega-80gb-8=2",
            )
        try:
            count = int(n) if n else 1
        except ValueError:
            count = 0
        if count < 1:
            raise BadInput(
                f"--slices {item}: the number of {'nodes' if dev.is_gpu_nodes else 'slices'} must be a"
                " positive integer",
                "e.g. h100-mega-80gb-8=2" if dev.is_gpu_nodes else "e.g. tpu7x-128=2",
            )
        key, count = (dev.generation, count * dev.vms) if dev.is_gpu_nodes else (dev.name, count)
        out[key] = out.get(key, 0) + count
    return out


def parse_priority_classes(items: list[str] | tuple[str, ...]) -> dict[str, int]:
    """`NAME` or `NAME=VALUE` -> {name: value}; a name of XPK's table without a value takes its value."""
    out: dict[str, int] = {}
    for item in items:
        name, eq, value = item.partition("=")
        name = name.strip()
        if (
            not name
            or name != name.lower()
            or any(c not in "abcdefghijklmnopqrstuvwxyz0123456789-." for c in name)
        ):
            raise BadInput(
                f"--priority-class {item}: `{name}` is not a valid object name",
                "use lowercase letters, digits, '-' and '.', e.g. --priority-class high=750",
            )
        try:
            out[name] = int(value) if eq else XPK_PRIORITIES.get(name, 0)
        except ValueError:
            raise BadInput(
                f"--priority-class {item}: the value must be an integer", "e.g. high=750"
            ) from None
    return out


def check_bucket_name(name: str) -> str:
    """A GCS bucket name: 3-63 lowercase letters, digits, '-', '_' and '.', starting and ending alphanumeric."""
    if not _BUCKET.match(name) or ".." in name:
        raise BadInput(
            f"--gcs-bucket `{name}` is not a bucket name",
            "use 3-63 lowercase letters, digits, '-', '_' or '.', e.g. --gcs-bucket sandbox",
        )
    return name


def gke_mode_env(
    kubeconfig: Path, namespace: str, queue: str, gcs_url: str | None = None, bucket: str | None = None
) -> dict[str, str]:
    """The environment in which olmo-ctl's commands use the sandbox as their GKE cluster: its
    kubeconfig, the GKE backend, its namespace and queue, an image doctor accepts, and with a GCS
    emulator its bucket as the run root plus the variables every storage client needs."""
    from olmo_ctl.core.config import ENV_PREFIX

    env = {
        "KUBECONFIG": str(Path(kubeconfig).resolve()),
        f"{ENV_PREFIX}BACKEND": "gke",
        f"{ENV_PREFIX}NAMESPACE": namespace,
        f"{ENV_PREFIX}QUEUE": queue,
        f"{ENV_PREFIX}IMAGE": IMAGE,
    }
    if gcs_url is not None and bucket is not None:
        from olmo_ctl.sandbox.gcs_emulator import emulator_env

        env[f"{ENV_PREFIX}RUN_ROOT"] = f"gs://{bucket}/runs"
        env.update(emulator_env(gcs_url))
    return env


def export_lines(env: dict[str, str]) -> str:
    """`export NAME=value` lines a POSIX shell evaluates."""
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


def parse_exports(text: str) -> dict[str, str]:
    """The variables of `export_lines`' text (what `eval` would set)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("export "):
            k, _, v = line[len("export ") :].partition("=")
            out[k] = shlex.split(v)[0] if v else ""
    return out


def env_file_for(kubeconfig: Path) -> Path:
    """Where the sandbox writes its `export` lines, beside its kubeconfig (removed with it)."""
    return kubeconfig.with_name(kubeconfig.name + ".env")


def log_file_for(kubeconfig: Path) -> Path:
    """Where a detached sandbox writes what it says (kept after it stops)."""
    return kubeconfig.with_name(kubeconfig.name + ".log")


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def flavor_name(device: Device, slices: int) -> str:
    """XPK's main flavor name: `<num_slices>x<device type>` (a GPU cluster is one "slice" of its
    machine type, however many nodes: `1xh100-mega-80gb-8`)."""
    if device.is_gpu_nodes:
        return f"1x{device.generation}"
    return f"{slices}x{device.name}"


def flavor_labels(device: Device) -> dict[str, str]:
    """XPK's flavor node labels: for a TPU the accelerator label and the machine (topology) label, for
    GPU nodes the accelerator label."""
    if device.is_gpu_nodes:
        return gke_gpu.flavor_labels(device)
    if device.accelerator_label is None or device.topology is None:
        raise ValueError(f"`{device.name}` is not a TPU slice: it has no flavor labels")
    return {ACCELERATOR_LABEL: device.accelerator_label, TOPOLOGY_LABEL: device.topology}


class PodRunner:
    """Where a pod's containers start and stop. This one is scripted: `start` binds the pod and its
    containers run (Ready) until a cause of the world ends them; `stop` (SIGTERM on deletion) leaves
    the exit to the world's kubelet (`World.sigterm_exit_s`, then SIGKILL at the grace period's end).
    The tests of the cluster rules use it; `olmo-ctl sandbox` runs pods as processes with
    `olmo_ctl.sandbox.pod_processes.ProcessRunner` (unless `--no-run-pods`)."""

    def attach(self, world: SandboxWorld) -> None:
        """The world this runner serves (called once, by SandboxWorld)."""

    def admit(self, world: SandboxWorld, jobset: dict) -> None:
        """A JobSet is being created; raise `kube_api.ApiError` to refuse it (no program runs here: none)."""

    def start(self, world: SandboxWorld, pod: dict, node: str) -> None:
        world.start_pod(pod, node)

    def stop(self, world: SandboxWorld, pod: dict) -> None:
        """The pod is being deleted: its containers got SIGTERM."""

    def shutdown(self, world: SandboxWorld, pod: dict) -> None:
        """Graceful node shutdown: the kubelet sends SIGTERM without a deletion; here the container
        exits at once with the world's SIGTERM exit code."""
        world.container_exit(pod, world.sigterm_exit_code)

    def kill(self, world: SandboxWorld, pod: dict) -> None:
        """The host went down with the container; nobody reports it until the kubelet is back (no
        process here: nothing to kill)."""

    def sync(self, world: SandboxWorld) -> bool:
        """One kubelet pass; True when it changed the world."""
        return False

    def close(self) -> None:
        """The sandbox stops."""


class SandboxWorld(ScriptedWorld):
    """The test cluster's world plus a scheduler: admitted pods go to free nodes that fit them."""

    api_server: KubeServer  # set by the Sandbox that serves this world: `sandbox fault api-outage` acts on it
    nodes: NodeCauses  # what happens to the machines: `olmo-ctl sandbox fault`

    def __init__(self, *a: Any, runner: PodRunner | None = None, **kw: Any):
        super().__init__(*a, **kw)
        self.runner = runner or PodRunner()
        self._stopping: set[str] = set()
        self.exclusive_placement_webhook = True  # the sandbox schedules: JobSet's pod webhooks apply
        self.nodes = NodeCauses(self)
        self.runner.attach(self)

    def admit(self, res: Any, obj: dict) -> None:
        if res.kind == "JobSet":
            self.runner.admit(self, obj)
        super().admit(res, obj)

    def refuse_pod(self, pod: dict) -> str | None:
        """GKE's admission before the test cluster's: ExtendedResourceToleration (mutating), then the
        multi-network check of the pod's interfaces."""
        gpu_rules.tolerate_extended_resources(pod)
        return gpu_rules.refuse_unknown_networks(self, pod) or super().refuse_pod(pod)

    def reconcile(self) -> None:
        with self.store.lock:
            for _ in range(50):
                super().reconcile()
                if not (
                    self.nodes.reconcile()
                    | self.release_orphans()
                    | self.schedule()
                    | gpu_rules.reconcile_daemonsets(self)
                    | gpu_rules.reconcile_networks(self)
                ):
                    return

    def _pool_names(self) -> set[str]:
        return set(self.nodes.pools())  # a pool whose nodes a repair or a stockout removed is still one

    def release_orphans(self) -> bool:
        """Finalizers nobody else would remove once an owner went without waiting (a Background delete,
        what `kubectl delete` does):
        - job_controller.go (trackJobStatusAndRemoveFinalizers for orphan pods): a pod whose Job is gone
          loses the `batch.kubernetes.io/job-tracking` finalizer;
        - kueue jobframework/reconciler.go ReconcileGenericJob: when the job is not found, its Workloads
          lose `kueue.x-k8s.io/resource-in-use` (workload.RemoveFinalizer)."""
        changed = False
        uids = {o["metadata"]["uid"] for kind in ("Job", "JobSet") for o in self.items(kind, None)}
        for kind, fin, owner_kind in (
            ("Pod", JOB_TRACKING_FINALIZER, "Job"),
            ("Workload", RESOURCE_IN_USE_FINALIZER, "JobSet"),
        ):
            for o in self.items(kind, None):
                refs = [
                    r
                    for r in o["metadata"].get("ownerReferences") or []
                    if r.get("kind") == owner_kind and r.get("controller")
                ]
                if (
                    refs
                    and fin in (o["metadata"].get("finalizers") or [])
                    and not any(r.get("uid") in uids for r in refs)
                ):
                    o["metadata"]["finalizers"] = [f for f in o["metadata"]["finalizers"] if f != fin]
                    self.save(kind, o)
                    changed = True
        if changed:
            self.store.collect()
        return changed

    def node_unreachable(self, pod: dict) -> bool:
        return self.nodes.unreachable(pod["spec"].get("nodeName"))

    def _kubelet(self) -> bool:
        for pod in self.items("Pod", None):
            uid = pod["metadata"]["uid"]
            if self.node_unreachable(pod):
                continue
            if (
                deleting(pod)
                and uid not in self._stopping
                and not self._pod_stopped(pod)
                and not self.node_down(pod["spec"].get("nodeName"))
            ):
                self._stopping.add(uid)
                if uid not in self._sigterm:  # recorded as it signals: a process may exit at once
                    self.killing(pod, self.store.clock())
                self.runner.stop(self, pod)
        return self.runner.sync(self) | super()._kubelet()

    def start_containers(self, pod: dict, node: str) -> None:
        self.runner.start(self, pod, node)

    def _free(self) -> dict[str, dict[str, float]]:
        """Unrequested accelerators (google.com/tpu, nvidia.com/gpu), CPU and memory per node."""
        free = {
            n["metadata"]["name"]: {
                r: quantity(((n.get("status") or {}).get("allocatable") or {}).get(r, 0))
                for r in SCHEDULED_RESOURCES
            }
            for n in self.items("Node", None)
        }
        for p in self.items("Pod", None):
            node = p["spec"].get("nodeName")
            if node in free and not pod_terminal(p):
                asks = pod_requests({"spec": p["spec"]})
                for r in SCHEDULED_RESOURCES:
                    free[node][r] -= asks.get(r, 0.0)
        return free

    def _exclusive_domain_free(self, pod: dict, node: dict, nodes: dict[str, dict]) -> bool:
        """The required pod anti-affinity JobSet v0.10.1 gives a leader pod under exclusive placement
        (pod_mutating_webhook.go setExclusiveAffinities), as the scheduler evaluates it: no node of the
        node's topology domain (its `alpha.jobset.sigs.k8s.io/exclusive-topology` label, e.g. the node
        pool) holds a pod of another Job of a JobSet (`jobset.sigs.k8s.io/job-key`). Followers are pinned
        to their leader's domain by the webhook."""
        ann = pod["metadata"].get("annotations") or {}
        key = ann.get("alpha.jobset.sigs.k8s.io/exclusive-topology")
        if (
            not self.exclusive_placement_webhook
            or not key
            or ann.get("batch.kubernetes.io/job-completion-index") != "0"
        ):
            return True
        own = labels(pod).get("jobset.sigs.k8s.io/job-key")
        domain = labels(node).get(key)
        for other in self.items("Pod", None):
            where = other["spec"].get("nodeName")
            theirs = labels(other).get("jobset.sigs.k8s.io/job-key")
            if not where or pod_terminal(other) or theirs is None or theirs == own:
                continue
            if labels(nodes.get(where) or {}).get(key) == domain:
                return False
        return True

    def schedule(self) -> bool:
        """The default scheduler, for what a training pod asks: a node whose labels match the pod's
        nodeSelector, whose taints it tolerates, with enough unrequested google.com/tpu and
        nvidia.com/gpu. A pod that fits nowhere gets PodScheduled=False (Unschedulable) and a
        FailedScheduling event, once."""
        pending = [
            p
            for p in self.items("Pod", None)
            if not p["spec"].get("nodeName") and not pod_terminal(p) and not deleting(p)
        ]
        if not pending:
            return False
        nodes = {n["metadata"]["name"]: n for n in self.items("Node", None)}
        free = self._free()
        changed = False
        for pod in sorted(pending, key=lambda p: (p["metadata"]["creationTimestamp"], p["metadata"]["name"])):
            sel = pod["spec"].get("nodeSelector") or {}
            asks = pod_requests({"spec": pod["spec"]})
            need = {r: asks.get(r, 0.0) for r in SCHEDULED_RESOURCES}
            fits = [
                name
                for name, n in sorted(nodes.items())
                if all((n["metadata"].get("labels") or {}).get(k) == v for k, v in sel.items())
                and name in free
                and all(free[name][r] >= q - 1e-9 for r, q in need.items())
                and not self.node_down(name)  # NotReady: tainted unreachable:NoSchedule
                and self.nodes.schedulable(n, pod)
                and self._exclusive_domain_free(pod, n, nodes)
            ]
            if fits:
                for r, q in need.items():
                    free[fits[0]][r] -= q
                if self.nodes.refuses(fits[0]):
                    self.nodes.bind(pod, fits[0])  # its kubelet decides at its next pod sync
                elif self.pull_image(pod, fits[0]):  # else it waits on the node for its image
                    self.runner.start(self, pod, fits[0])
                changed = True
                continue
            cond = next(
                (c for c in pod["status"].get("conditions") or [] if c["type"] == "PodScheduled"), None
            )
            if cond is None or cond.get("status") != "False":
                total = len(nodes)
                short = [
                    r
                    for r in SCHEDULED_RESOURCES
                    if need[r] and not any(f.get(r, 0.0) >= need[r] - 1e-9 for f in free.values())
                ]
                resource = short[0] if short else next((r for r in (GPU, TPU) if need[r]), TPU)
                msg = (
                    f"0/{total} nodes are available: {total} node(s) didn't match Pod's node affinity/selector "
                    f"or had insufficient {resource}. preemption: 0/{total} nodes are available: {total} Preemption "
                    "is not helpful for scheduling."
                )
                pod["status"]["conditions"] = [
                    c for c in pod["status"].get("conditions") or [] if c["type"] != "PodScheduled"
                ]
                pod["status"]["conditions"].append(
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": msg,
                        "lastTransitionTime": self.now(),
                    }
                )
                self.save("Pod", pod)
                self.event(pod, "FailedScheduling", msg, "Warning", source="default-scheduler")
                changed = True
        return changed

    def add_gpu_node_pool(self, device: Device, pool: str, nodes: int) -> None:
        """A GPU node pool of `nodes` nodes of `device`'s machine type (`gke_gpu.gpu_node`)."""
        for i in range(nodes):
            self.save("Node", gpu_rules.gpu_node(device, pool, i, self.now()), new=True)
        self._cpu_memory_quota(device, nodes)

    def _cpu_memory_quota(self, device: Device, nodes: int) -> None:
        """A node pool added after set-up brings its nodes' CPU and memory to the trainers' quota."""
        cq = self.get("ClusterQueue", "", CLUSTER_QUEUE)
        groups = ((cq or {}).get("spec") or {}).get("resourceGroups") or []
        if not any(f["name"] == CPU_MEMORY_FLAVOR for g in groups for f in g.get("flavors") or []):
            return
        for r, q in node_allocatable(device).items():
            self.add_quota(CLUSTER_QUEUE, CPU_MEMORY_FLAVOR, r, quantity(q) * nodes)

    def add_node_pool(self, device: Device, pool: str) -> None:
        """A TPU node pool for one slice of `device`: `vms` nodes with its labels (and, where its node
        pools need one, the placement policy `xpk cluster create` makes them with)."""
        from olmo_ctl.backends.jobset import placement_policy_for
        from olmo_ctl.core.config import Settings

        policy = placement_policy_for(device, Settings())
        placement = {"cloud.google.com/placement-policy-name": policy} if policy else {}
        for i in range(device.vms):
            name = f"gke-{pool}-{i:04d}"
            self.save(
                "Node",
                {
                    "metadata": {
                        "name": name,
                        "labels": {
                            **flavor_labels(device),
                            **placement,
                            NODEPOOL_LABEL: pool,
                            "kubernetes.io/hostname": name,
                            "cloud.google.com/machine-family": device.generation,
                            "node.kubernetes.io/instance-type": device.machine_type or "",
                        },
                    },
                    "spec": {"taints": [{"key": TPU, "value": "present", "effect": "NoSchedule"}]},
                    "status": {
                        "capacity": {TPU: str(device.chips_per_vm), **node_capacity(device)},
                        "allocatable": {TPU: str(device.chips_per_vm), **node_allocatable(device)},
                        "conditions": [
                            {
                                "type": "Ready",
                                "status": "True",
                                "reason": "KubeletReady",
                                "lastTransitionTime": self.now(),
                            }
                        ],
                        "nodeInfo": {"kubeletVersion": "v1.33.0-gke"},
                    },
                },
                new=True,
            )
        self._cpu_memory_quota(device, device.vms)


class Sandbox:
    """The sandbox cluster. `with Sandbox(slices={"tpu7x-128": 2}) as sb:` serves it on 127.0.0.1;
    `sb.write_kubeconfig(path)` points a kubeconfig's current context at it.

    Each sandbox draws a bearer token (`sb.token`, the kubeconfig user's `token`). Its control path
    (`sandbox fault`) always asks for it; with `require_token=True` (what `olmo-ctl sandbox` serves)
    so does every request to its API, as a real API server asks for credentials: whoever can reach
    127.0.0.1 but cannot read the kubeconfig (another local user, a web page) gets 401. Such a sandbox
    serves HTTPS (`sandbox.tls`: clients send a kubeconfig's token only over TLS), its certificate in
    the kubeconfig. Without it, the API of an in-process sandbox answers anyone on this machine over
    HTTP for as long as it lives (a test's).
    """

    def __init__(
        self,
        namespace: str = "default",
        queue: str = LOCAL_QUEUE,
        slices: dict[str, int] | None = None,
        priority_classes: dict[str, int] | None = None,
        port: int = 0,
        runner: PodRunner | None = None,
        require_token: bool = False,
    ):
        self.server = KubeServer(namespace=namespace, port=port, queues=())
        world = SandboxWorld(self.server.store, namespace, runner=runner)
        world.callbacks = self.server.world.callbacks
        self.server.world = self.server.cluster.world = world
        self.server.api.hooks = world
        self.world = world
        # The bearer token of this sandbox's kubeconfig: its control path (`sandbox fault`) asks for it,
        # and with require_token every request to its API.
        self.token = secrets.token_urlsafe(32)
        self.server.token = self.token if require_token else None
        # kubectl sends a kubeconfig's token only over TLS: a sandbox that asks for it serves HTTPS with a
        # certificate of its own, which its kubeconfig names as the cluster's authority.
        self.certificate: bytes | None = None
        if require_token:
            from olmo_ctl.sandbox import tls

            self.certificate, key = tls.self_signed()
            self.server.tls = tls.server_context(self.certificate, key)
        self.server.control = self._control
        world.api_server = self.server
        self.namespace, self.queue = namespace, queue
        self.slices = dict(slices or {})
        self.priority_classes = dict(priority_classes or {})
        with self.server.store.lock:
            self._configure()
            world.reconcile()

    def _configure(self) -> None:
        w = self.world
        quota: dict[str, list[dict]] = {TPU: [], GPU: []}
        gpu_nodes: dict[str, int] = {}  # machine type -> nodes (`h100-mega-80gb-8x2: 1` is 2 nodes)
        for name, n in self.slices.items():
            dev = Target.parse(name).device
            if dev.is_gpu_nodes:
                gpu_nodes[dev.generation] = gpu_nodes.get(dev.generation, 0) + n * dev.vms
                continue
            fname = flavor_name(dev, n)
            w.save(
                "ResourceFlavor",
                {"metadata": {"name": fname}, "spec": {"nodeLabels": flavor_labels(dev)}},
                new=True,
            )
            quota[TPU].append(
                {"name": fname, "resources": [{"name": TPU, "nominalQuota": str(n * dev.chips)}]}
            )
            for s in range(n):
                w.add_node_pool(dev, f"{dev.name}-np-{s}")
        gpu_devices = [Target.parse(machine).device for machine in gpu_nodes]
        for dev in gpu_devices:  # the nodes of a machine type in one node pool, as XPK makes them
            nodes, fname = gpu_nodes[dev.generation], flavor_name(dev, 1)
            w.save(
                "ResourceFlavor",
                {"metadata": {"name": fname}, "spec": {"nodeLabels": flavor_labels(dev)}},
                new=True,
            )
            quota[GPU].append(
                {"name": fname, "resources": [{"name": GPU, "nominalQuota": str(nodes * dev.chips_per_vm)}]}
            )
            w.add_gpu_node_pool(dev, f"{dev.generation}-np-0", nodes)
        gpu_rules.make_gpu_cluster(w, gpu_devices)
        # No slices: no resource group (one must name at least one flavor), so nothing is admitted.
        groups = [{"coveredResources": [r], "flavors": fl} for r, fl in quota.items() if fl]
        # The trainer's CPU and memory (core/node_resources.py), in a resource group of their own whose
        # one flavor holds every node's allocatable: Kueue admits no pod set requesting a resource its
        # ClusterQueue does not cover. (`xpk cluster create --cpu-limit --memory-limit` adds them to the
        # accelerator's group instead; a resource belongs to one group, so with TPU and GPU pools side
        # by side here they get their own.)
        all_nodes = list(w.items("Node", None))
        if groups and all_nodes:
            w.save("ResourceFlavor", {"metadata": {"name": CPU_MEMORY_FLAVOR}, "spec": {}}, new=True)
            total = {
                r: sum(
                    quantity(((n.get("status") or {}).get("allocatable") or {}).get(r, 0)) for n in all_nodes
                )
                for r in ("cpu", "memory")
            }
            groups.append(
                {
                    "coveredResources": ["cpu", "memory"],
                    "flavors": [
                        {
                            "name": CPU_MEMORY_FLAVOR,
                            "resources": [
                                {"name": "cpu", "nominalQuota": format_quantity("cpu", total["cpu"])},
                                {
                                    "name": "memory",
                                    "nominalQuota": format_quantity("memory", total["memory"]),
                                },
                            ],
                        }
                    ],
                }
            )
        w.save(
            "ClusterQueue",
            {
                "metadata": {"name": CLUSTER_QUEUE},
                "spec": {
                    "namespaceSelector": {},
                    "queueingStrategy": "BestEffortFIFO",
                    "preemption": {"reclaimWithinCohort": "Never", "withinClusterQueue": "LowerPriority"},
                    "resourceGroups": groups,
                },
            },
            new=True,
        )
        w.save(
            "LocalQueue",
            {
                "metadata": {"name": self.queue, "namespace": self.namespace},
                "spec": {"clusterQueue": CLUSTER_QUEUE},
            },
            new=True,
        )
        # The service account docs/running-on-gke.md has a cluster create, bound for Workload Identity.
        w.ensure_service_account(OLMO_CTL_SERVICE_ACCOUNT, self.namespace, gcp_account=SANDBOX_GCP_ACCOUNT)
        # JobSet's controller as its release manifests install it (doctor reads the version here).
        ns, dep = JOBSET_CONTROLLER
        w.save(
            "Namespace",
            {"metadata": {"name": ns}, "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}},
            new=True,
        )
        w.save(
            "Deployment",
            {
                "metadata": {"name": dep, "namespace": ns, "labels": {"control-plane": "controller-manager"}},
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": {"control-plane": "controller-manager"}},
                    "template": {
                        "metadata": {"labels": {"control-plane": "controller-manager"}},
                        "spec": {"containers": [{"name": "manager", "image": JOBSET_IMAGE}]},
                    },
                },
                "status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1},
            },
            new=True,
        )
        for name, value in XPK_PRIORITIES.items():
            w.save(
                "PriorityClass",
                {
                    "metadata": {"name": name},
                    "value": value,
                    "globalDefault": False,
                    "description": name.replace("-", " ").capitalize(),
                },
                new=True,
            )
        for name, value in self.priority_classes.items():
            w.save(
                "WorkloadPriorityClass",
                {"metadata": {"name": name}, "value": value, "description": f"{name} (olmo-ctl sandbox)"},
                new=True,
            )

    # -- faults
    def _control(self, method: str, path: str, headers: dict, body: bytes) -> tuple[int, dict]:
        from olmo_ctl.sandbox.faults import CONTROL_PATH, control

        if path.rstrip("/") != CONTROL_PATH:
            return 404, {"message": f"no control path {path}; faults are POSTed to {CONTROL_PATH}"}
        return control(self.world, self.token, method, headers, body)

    def fault(self, fault: Any) -> str:
        """Apply one `sandbox.faults.Fault` now (what `olmo-ctl sandbox fault` asks for)."""
        from olmo_ctl.sandbox.faults import apply

        return apply(self.world, fault)

    def tick(self) -> None:
        """Let what is due happen without a request (a fault's --for ending, a toleration running out)."""
        with self.server.store.lock:
            self.world.reconcile()

    # -- lifecycle
    def start(self) -> Sandbox:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()
        self.world.runner.close()

    def __enter__(self) -> Sandbox:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return self.server.url

    def kubeconfig(self) -> dict:
        cluster: dict[str, str] = {"server": self.url}
        if self.certificate is not None:
            cluster["certificate-authority-data"] = base64.b64encode(self.certificate).decode()
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "preferences": {},
            "clusters": [{"name": CONTEXT, "cluster": cluster}],
            "users": [{"name": CONTEXT, "user": {"token": self.token}}],
            "contexts": [
                {
                    "name": CONTEXT,
                    "context": {"cluster": CONTEXT, "user": CONTEXT, "namespace": self.namespace},
                }
            ],
            "current-context": CONTEXT,
        }

    def write_kubeconfig(self, path: str | os.PathLike) -> Path:
        """Write the kubeconfig atomically (it appears complete or not at all)."""
        import yaml

        path = Path(path)
        check_kubeconfig_path(path)
        fd, tmp = tempfile.mkstemp(prefix=".olmo-ctl-sandbox-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(self.kubeconfig(), f, sort_keys=False)
        os.replace(tmp, path)
        return path


def check_kubeconfig_path(path: Path) -> None:
    """A sandbox kubeconfig never replaces someone's real one: the file must not exist, or be a
    sandbox kubeconfig itself."""
    import yaml

    if path.is_dir():
        raise BadInput(
            f"--kubeconfig `{path}` is a directory", "give a file name, e.g. /tmp/sandbox.kubeconfig"
        )
    if not path.parent.is_dir():
        raise BadInput(f"--kubeconfig: directory `{path.parent}` does not exist", "create it first")
    if path.exists():
        try:
            cfg = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            cfg = None
        names = (
            {c.get("name") for c in (cfg or {}).get("contexts") or [] if isinstance(c, dict)}
            if isinstance(cfg, dict)
            else {None}
        )
        if names and names != {CONTEXT}:
            raise BadInput(
                f"--kubeconfig `{path}` exists and is not a sandbox kubeconfig",
                "give a new file; the sandbox never overwrites a real kubeconfig",
            )


def start_subprocess(kubeconfig: Path, *args: str, env: dict | None = None, timeout_s: float = 60.0):
    """`olmo-ctl sandbox --kubeconfig FILE ARGS...` as a subprocess; returns the Popen once the kubeconfig
    exists (the sandbox serves)."""
    import subprocess
    import sys
    import time

    p = subprocess.Popen(
        [sys.executable, "-m", "olmo_ctl", "sandbox", "--kubeconfig", str(kubeconfig), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + timeout_s
    while not Path(kubeconfig).exists():
        if p.poll() is not None:
            _out, err = p.communicate()
            raise AssertionError(f"the sandbox exited {p.returncode}: {err}")
        if time.monotonic() > deadline:
            p.kill()
            p.communicate()
            raise AssertionError(f"the sandbox wrote no kubeconfig within {timeout_s:g} s")
        time.sleep(0.05)
    return p


def stop_subprocess(p, timeout_s: float = 30.0) -> tuple[int, str]:
    """SIGTERM, then wait: (exit code, stderr)."""
    import signal
    import subprocess

    p.send_signal(signal.SIGTERM)
    try:
        _, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    return p.returncode, err
