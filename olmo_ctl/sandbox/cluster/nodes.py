"""Nodes and what happens to them: the node lifecycle, taint eviction, pod GC and the kubelet's side.

The causes (`NodeCauses`, used by the sandbox's world, whose pods run on Node objects) only say what
happens to machines: a node pool loses or regains nodes, a slice's hosts go down for a while, a
kubelet stops answering, a repair drains and recreates nodes, a just-repaired kubelet refuses pods, a
spot VM is reclaimed. What follows for the pods comes from the controllers' rules, ported from
kubernetes/kubernetes (v1.33):

- node lifecycle (`pkg/controller/nodelifecycle/node_lifecycle_controller.go`): a node whose kubelet
  stops posting status gets Ready=Unknown (`NodeStatusUnknown`, "Kubelet stopped posting node
  status.") and the taints `node.kubernetes.io/unreachable` with effects NoSchedule (taint nodes by
  condition) and NoExecute (`doNoExecuteTaintingPass`); its pods get Ready=False and a `NodeNotReady`
  event (`pkg/controller/util/node/controller_utils.go` MarkPodsNotReady). When the kubelet posts
  again the taints go and Ready is True;
- taint eviction (`pkg/controller/tainteviction/taint_eviction.go`): a pod on a node with a NoExecute
  taint it tolerates for `tolerationSeconds` is deleted that long after the taint was added, with
  the DisruptionTarget condition `DeletionByTaintManager` and a `TaintManagerEviction` event. Every
  pod tolerates `not-ready` and `unreachable` for 300 s unless it says otherwise: the
  DefaultTolerationSeconds admission plugin (`plugin/pkg/admission/defaulttolerationseconds`) adds
  those tolerations at creation;
- the kubelet of an unreachable node does nothing: a pod deleted meanwhile stays Terminating until
  the node comes back, and then finishes its grace period; containers that died with the host are
  reported, once the kubelet is back, as terminated `ContainerStatusUnknown` with exit code 137
  (`pkg/kubelet/status/status_manager.go` TerminatePod: "The container could not be located when the
  pod was terminated");
- pod GC (`pkg/controller/podgc/gc_controller.go` gcOrphaned): a pod bound to a node that no longer
  exists is marked Failed with DisruptionTarget `DeletionByPodGC` ("PodGC: node no longer exists")
  and deleted at once;
- kubelet admission (`pkg/kubelet/lifecycle/predicate.go`, the device manager's Allocate): a pod
  bound to a node whose device plugin has not registered its devices yet is rejected: phase Failed,
  reason `UnexpectedAdmissionError`, no DisruptionTarget (what a just-repaired TPU node does). The
  kubelet admits a pod at its pod sync after the bind (`HandlePodAdditions`), `KUBELET_SYNC_S` later,
  not at the bind itself;
- graceful node shutdown (`pkg/kubelet/nodeshutdown/nodeshutdown_manager_linux.go`): on a spot VM's
  reclaim notice the kubelet marks each pod DisruptionTarget `TerminationByKubelet`, sends SIGTERM,
  and the pod ends Failed with reason `Terminated`; the VM goes away 30 s later (GCE's notice);
- a node drain (GKE auto-repair, through the Eviction API): DisruptionTarget `EvictionByEvictionAPI`
  and a deletion with the pod's grace period; the node is cordoned (`node.kubernetes.io/unschedulable`
  NoSchedule) and removed once its pods are gone, then recreated after the repair.
The Job, JobSet and Kueue rules then take over (a pod Ignored or counted by the podFailurePolicy, a
restart of the JobSet, pods re-created and left Unschedulable while no node fits).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from olmo_ctl.backends.kube import tolerates, toleration_matches
from olmo_ctl.core.contracts import SPOT_STOP_BUDGET_S
from olmo_ctl.sandbox.cluster.objects import deleting, labels, pod_terminal, set_status_condition

if TYPE_CHECKING:
    from olmo_ctl.sandbox.sandbox import SandboxWorld

NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
TPU, GPU = "google.com/tpu", "nvidia.com/gpu"  # the accelerators: resources, and the pools' taint keys
DEFAULT_TOLERATION_S = 300  # DefaultTolerationSeconds: not-ready and unreachable, NoExecute
KUBELET_SYNC_S = 1.0  # from a pod's bind to its kubelet's admission decision (the pod sync)
SPOT_NOTICE_S = 30.0  # GCE's preemption notice: the VM stops this long after it
# GKE's graceful node shutdown on spot VMs: of the notice's 30 s (shutdownGracePeriod), the last 15 s
# are the system pods' (shutdownGracePeriodCriticalPods), so other pods get 15 s from SIGTERM to
# SIGKILL: the trainer's stop budget on spot capacity.
SPOT_POD_SHUTDOWN_S = float(SPOT_STOP_BUDGET_S)
SPOT_NODE_SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."
DEVICE_ADMISSION_MESSAGE = (
    "Allocate failed due to requested number of devices unavailable for {resource}. "
    "Requested: {n}, Available: 0, which is unexpected"
)
CONTAINER_UNKNOWN_MESSAGE = "The container could not be located when the pod was terminated"


@dataclass
class NodeState:
    """What the world did to one node (by name); absent: a healthy node."""

    unreachable_until: float | None = None  # the kubelet posts no status until then (inf: until restored)
    containers_dead: bool = False  # the host went down with its containers (a host event)
    refuse_pods_until: float | None = None  # the kubelet rejects new pods (UnexpectedAdmissionError)
    drain: bool = False  # cordoned and drained (a repair); removed once its pods are gone
    remove_at: float | None = None  # the VM goes away then (a spot reclaim's notice)
    away_for_s: float = math.inf  # once removed, how long until it is recreated


@dataclass
class NodeCauses:
    """The node side of the sandbox's world: causes in, the rules above applied in `reconcile`."""

    world: SandboxWorld
    states: dict[str, NodeState] = field(default_factory=dict)
    removed: dict[str, tuple[dict, float]] = field(default_factory=dict)  # name -> (node, recreate at)
    _dead_pods: set[str] = field(default_factory=set)  # uids of pods whose containers died with a host
    _admitting: dict[str, float] = field(default_factory=dict)  # pod uid -> when its kubelet decides
    # kube-apiserver's --default-not-ready-toleration-seconds / --default-unreachable-toleration-seconds
    # (the DefaultTolerationSeconds plugin's tolerationSeconds; both 300 by default).
    default_toleration_s: float = DEFAULT_TOLERATION_S

    # -- where
    def pools(self) -> dict[str, list[str]]:
        """Node pool -> its node names (present and removed), in order."""
        out: dict[str, list[str]] = {}
        for n in self.world.items("Node", None):
            out.setdefault(labels(n).get(NODEPOOL_LABEL, ""), []).append(n["metadata"]["name"])
        for name, (n, _) in self.removed.items():
            out.setdefault(labels(n).get(NODEPOOL_LABEL, ""), []).append(name)
        return {p: sorted(set(ns)) for p, ns in sorted(out.items()) if p}

    def _node(self, name: str) -> dict | None:
        return self.world.get("Node", "", name)

    def _pods_on(self, name: str) -> list[dict]:
        return [p for p in self.world.items("Pod", None) if p["spec"].get("nodeName") == name]

    def unreachable(self, node_name: str | None) -> bool:
        st = self.states.get(node_name or "")
        return st is not None and st.unreachable_until is not None

    # -- causes
    def set_capacity(self, nodes: list[str], left: int, for_s: float | None) -> None:
        """The pool keeps its first `left` nodes; the others are deleted (a stockout, a shrink). A
        pool given more than it has gets its removed nodes back. `for_s`: the removal ends then."""
        now = self.world.store.clock()
        back_at = now + for_s if for_s is not None else math.inf
        for i, name in enumerate(nodes):
            if i < left:
                self.restore([name])  # the pool has this node back, healthy
            elif name not in self.removed:
                self._remove(name, back_at)
            else:
                node, _ = self.removed[name]
                self.removed[name] = (node, back_at)

    def host_event(self, nodes: list[str], for_s: float | None) -> None:
        """Every host goes down with its containers; the nodes answer again after `for_s`."""
        now = self.world.store.clock()
        for name in nodes:
            if self._node(name) is None:
                continue
            st = self.states.setdefault(name, NodeState())
            st.unreachable_until = now + for_s if for_s is not None else math.inf
            st.containers_dead = True
            for pod in self._pods_on(name):
                if not pod_terminal(pod):
                    self._dead_pods.add(pod["metadata"]["uid"])
                    self.world.runner.kill(self.world, pod)

    def not_ready(self, nodes: list[str], for_s: float | None) -> None:
        """The kubelets stop posting status (a partition, a wedged kubelet); their containers run on."""
        now = self.world.store.clock()
        for name in nodes:
            if self._node(name) is not None:
                self.states.setdefault(name, NodeState()).unreachable_until = (
                    now + for_s if for_s is not None else math.inf
                )

    def repair(self, nodes: list[str], for_s: float | None) -> None:
        """GKE auto-repair: cordon and drain each node; once drained it is removed for `for_s`."""
        for name in nodes:
            node = self._node(name)
            if node is None:
                continue
            st = self.states.setdefault(name, NodeState())
            st.drain, st.away_for_s = True, (for_s if for_s is not None else math.inf)
            node["spec"]["unschedulable"] = True
            self._taint(node, UNSCHEDULABLE_TAINT, "NoSchedule")
            self.world.save("Node", node)
            for pod in self._pods_on(name):
                if not pod_terminal(pod) and not deleting(pod):
                    self.world.add_disruption(pod, "EvictionByEvictionAPI", "Eviction API: evicting")
                    self.world.save("Pod", pod)
                    self.world.event(pod, "Evicted", "Evicted by the node's repair", "Normal", "node-repair")
                    self.world.delete("Pod", pod)

    def admission_error(self, nodes: list[str], for_s: float | None) -> None:
        """The kubelets (of just-repaired nodes) reject the pods bound to them until `for_s` ends."""
        now = self.world.store.clock()
        for name in nodes:
            self.states.setdefault(name, NodeState()).refuse_pods_until = (
                now + for_s if for_s is not None else math.inf
            )

    def spot_reclaim(self, nodes: list[str], for_s: float | None) -> None:
        """GCE reclaims the spot VMs: graceful node shutdown now, the VMs gone after the notice, back
        after `for_s` (default: when capacity is restored)."""
        now = self.world.store.clock()
        for name in nodes:
            if self._node(name) is None:
                continue
            st = self.states.setdefault(name, NodeState())
            st.remove_at, st.away_for_s = now + SPOT_NOTICE_S, (for_s if for_s is not None else math.inf)
            for pod in self._pods_on(name):
                if not pod_terminal(pod):
                    self.world.add_disruption(pod, "TerminationByKubelet", SPOT_NODE_SHUTDOWN_MESSAGE)
                    pod["status"].update(reason="Terminated", message=SPOT_NODE_SHUTDOWN_MESSAGE)
                    self.world.save("Pod", pod)
                    self.world.runner.shutdown(self.world, pod)

    def restore(self, nodes: list[str]) -> None:
        """Every fault on these nodes ends now: removed nodes come back, kubelets answer again."""
        for name in nodes:
            if name in self.removed:
                self._recreate(name)
            st = self.states.get(name)
            if st is not None:
                if st.unreachable_until is not None:
                    st.unreachable_until = self.world.store.clock()
                st.refuse_pods_until = None
                st.remove_at = None
                if st.drain:
                    st.drain = False
                    node = self._node(name)
                    if node is not None:
                        node["spec"].pop("unschedulable", None)
                        self._untaint(node, UNSCHEDULABLE_TAINT)
                        self.world.save("Node", node)

    # -- the rules
    def reconcile(self) -> bool:
        w = self.world
        now = w.store.clock()
        changed = False
        for name, (_, at) in list(self.removed.items()):
            if now >= at:
                self._recreate(name)
                changed = True
        for name, st in list(self.states.items()):
            node = self._node(name)
            if node is None:
                continue
            if st.remove_at is not None and now >= st.remove_at:
                self._remove(name, now + st.away_for_s)
                changed = True
                continue
            if st.drain and not [p for p in self._pods_on(name) if not pod_terminal(p)]:
                self._remove(name, now + st.away_for_s)
                changed = True
                continue
            if st.unreachable_until is not None and now >= st.unreachable_until:
                changed |= self._kubelet_back(node, st)
            elif st.unreachable_until is not None:
                changed |= self._unreachable(node)
        changed |= self._admit(now)
        changed |= self._taint_eviction(now)
        changed |= self._pod_gc()
        if not self._admitting and not any(
            s.unreachable_until or s.refuse_pods_until or s.drain or s.remove_at for s in self.states.values()
        ):
            self.states = {k: s for k, s in self.states.items() if s.containers_dead}
        return changed

    def refuses(self, node_name: str) -> bool:
        """The kubelet of this node rejects a pod bound to it now (kubelet admission)."""
        st = self.states.get(node_name)
        return (
            st is not None
            and st.refuse_pods_until is not None
            and self.world.store.clock() < st.refuse_pods_until
        )

    def bind(self, pod: dict, node_name: str) -> None:
        """The scheduler bound `pod` to a node whose kubelet refuses pods now: the kubelet decides at
        its next pod sync (`_admit`), when it may be ready again."""
        self.world._bind(pod, node_name)
        self.world.save("Pod", pod)
        self._admitting[pod["metadata"]["uid"]] = self.world.store.clock() + KUBELET_SYNC_S

    def _admit(self, now: float) -> bool:
        """The kubelet's pod sync for the pods `bind` left it: rejected while it still refuses pods,
        else its containers start (after their image) as the scheduler's path starts them."""
        due = [uid for uid, at in self._admitting.items() if now >= at]
        if not due:
            return False
        by_uid = {p["metadata"]["uid"]: p for p in self.world.items("Pod", None)}
        for uid in due:
            del self._admitting[uid]
            pod = by_uid.get(uid)
            if pod is None or deleting(pod) or pod_terminal(pod):
                continue
            node = pod["spec"]["nodeName"]
            if self.refuses(node):
                self.reject(pod, node)
            elif self.world.pull_image(pod, node):
                self.world.runner.start(self.world, pod, node)
        return True

    def reject(self, pod: dict, node_name: str) -> None:
        """Kubelet admission refuses the pod on `node_name`: bound, then Failed UnexpectedAdmissionError."""
        from olmo_ctl.sandbox.cluster.objects import pod_requests

        w = self.world
        asks = pod_requests({"spec": pod["spec"]})
        resource = GPU if asks.get(GPU) else TPU
        msg = DEVICE_ADMISSION_MESSAGE.format(resource=resource, n=int(asks.get(resource, 0)))
        pod["spec"]["nodeName"] = node_name
        pod["status"].update(
            phase="Failed", reason="UnexpectedAdmissionError", message=msg, startTime=w.now()
        )
        w.save("Pod", pod)
        w.event(pod, "UnexpectedAdmissionError", msg, "Warning")

    def schedulable(self, node: dict, pod: dict) -> bool:
        """The scheduler's TaintToleration and NodeUnschedulable filters: every NoSchedule or NoExecute
        taint (those causes add, GKE's GPU taint `nvidia.com/gpu`, any a client puts on a node) but the
        TPU pools' `google.com/tpu`, which pods that request no TPU (the test cluster's small CPU
        JobSets) are let past."""
        if node["spec"].get("unschedulable"):
            return False
        tol = pod["spec"].get("tolerations") or []
        for t in node["spec"].get("taints") or []:
            if t["key"] == TPU:
                continue
            if t.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tol, t):
                return False
        return True

    # -- pieces
    def _remove(self, name: str, back_at: float) -> None:
        node = self._node(name)
        if node is None:
            return
        self.removed[name] = (copy.deepcopy(node), back_at)
        self.states.pop(name, None)
        self.world.store.delete(self.world.store.resource_of(node), node, grace_s=0)
        self.world.store.collect()

    def _recreate(self, name: str) -> None:
        node, _ = self.removed.pop(name)
        node = copy.deepcopy(node)
        md = node["metadata"]
        for k in ("uid", "creationTimestamp", "resourceVersion", "deletionTimestamp", "generation"):
            md.pop(k, None)
        node["spec"] = {k: v for k, v in node["spec"].items() if k != "unschedulable"}
        node["spec"]["taints"] = [
            t for t in node["spec"].get("taints") or [] if not t["key"].startswith("node.kubernetes.io/")
        ]
        node["status"]["conditions"] = [
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "lastTransitionTime": self.world.now(),
            }
        ]
        self.world.save("Node", node, new=True)

    @staticmethod
    def _taint(node: dict, key: str, effect: str, now: str | None = None) -> bool:
        taints = node["spec"].setdefault("taints", [])
        if any(t["key"] == key and t.get("effect") == effect for t in taints):
            return False
        t = {"key": key, "effect": effect}
        if effect == "NoExecute" and now:
            t["timeAdded"] = now
        taints.append(t)
        return True

    @staticmethod
    def _untaint(node: dict, key: str) -> bool:
        taints = node["spec"].get("taints") or []
        kept = [t for t in taints if t["key"] != key]
        node["spec"]["taints"] = kept
        return len(kept) != len(taints)

    def _unreachable(self, node: dict) -> bool:
        w = self.world
        before = w.snapshot(node)
        set_status_condition(
            node,
            "Ready",
            "Unknown",
            "NodeStatusUnknown",
            "Kubelet stopped posting node status.",
            w.now(),
            observed_generation=False,
        )
        self._taint(node, UNREACHABLE_TAINT, "NoSchedule")
        self._taint(node, UNREACHABLE_TAINT, "NoExecute", w.now())
        changed = w.commit("Node", node, before)
        if changed:
            w.event(
                node,
                "NodeNotReady",
                f"Node {node['metadata']['name']} status is now: NodeNotReady",
                "Normal",
                "node-controller",
            )
            for pod in self._pods_on(node["metadata"]["name"]):
                if pod_terminal(pod):
                    continue
                for c in pod["status"].get("conditions") or []:
                    if c["type"] == "Ready" and c.get("status") != "False":
                        c.update(status="False", lastTransitionTime=w.now())
                w.save("Pod", pod)
                w.event(pod, "NodeNotReady", "Node is not ready", "Warning", "node-controller")
        return changed

    def _kubelet_back(self, node: dict, st: NodeState) -> bool:
        w = self.world
        st.unreachable_until = None
        self._untaint(node, UNREACHABLE_TAINT)
        set_status_condition(
            node,
            "Ready",
            "True",
            "KubeletReady",
            "kubelet is posting ready status",
            w.now(),
            observed_generation=False,
        )
        w.save("Node", node)
        for pod in self._pods_on(node["metadata"]["name"]):
            uid = pod["metadata"]["uid"]
            if pod_terminal(pod):
                continue
            if uid in self._dead_pods:
                self._dead_pods.discard(uid)
                w.container_exit(pod, 137, reason="ContainerStatusUnknown")
                for cs in pod["status"].get("containerStatuses") or []:
                    cs["state"]["terminated"]["message"] = CONTAINER_UNKNOWN_MESSAGE
                w.save("Pod", pod)
            else:
                for c in pod["status"].get("conditions") or []:
                    if c["type"] == "Ready":
                        c.update(status="True", lastTransitionTime=w.now())
                w.save("Pod", pod)
        st.containers_dead = False
        return True

    def _taint_eviction(self, now: float) -> bool:
        w = self.world
        changed = False
        nodes = {n["metadata"]["name"]: n for n in w.items("Node", None)}
        for pod in w.items("Pod", None):
            node = nodes.get(pod["spec"].get("nodeName") or "")
            if node is None or pod_terminal(pod) or deleting(pod):
                continue
            for t in node["spec"].get("taints") or []:
                if t.get("effect") != "NoExecute" or "timeAdded" not in t:
                    continue
                secs = _toleration_seconds(pod["spec"].get("tolerations") or [], t, self.default_toleration_s)
                if secs is None or w.seconds_since(t["timeAdded"]) >= secs:
                    w.add_disruption(
                        pod, "DeletionByTaintManager", "Taint manager: deleting due to NoExecute taint"
                    )
                    w.save("Pod", pod)
                    w.event(
                        pod,
                        "TaintManagerEviction",
                        f"Marking for deletion Pod {pod['metadata']['namespace']}/{pod['metadata']['name']}",
                        source="taint-eviction-controller",
                    )
                    w.delete("Pod", pod)
                    changed = True
                    break
        return changed

    def _pod_gc(self) -> bool:
        w = self.world
        names = {n["metadata"]["name"] for n in w.items("Node", None)}
        changed = False
        for pod in w.items("Pod", None):
            node = pod["spec"].get("nodeName")
            if not node or node in names or (pod_terminal(pod) and deleting(pod)):
                continue
            if not pod_terminal(pod):
                pod["status"]["phase"] = "Failed"
                w.add_disruption(pod, "DeletionByPodGC", "PodGC: node no longer exists")
                w.save("Pod", pod)
            w.delete("Pod", pod, grace_s=0)
            changed = True
        return changed


def _toleration_seconds(tolerations: list[dict], taint: dict, default_s: float) -> float | None:
    """taint_eviction.go getMinTolerationTime over the matching tolerations (None: not tolerated,
    evicted at once; inf: tolerated forever). Pods without their own not-ready/unreachable
    toleration have DefaultTolerationSeconds' (`default_s`, 300 s unless the API server says else)."""
    matching = [t for t in tolerations if toleration_matches(t, taint)]
    if not matching and taint["key"] in (UNREACHABLE_TAINT, NOT_READY_TAINT):
        return float(default_s)
    if not matching:
        return None
    secs = [t.get("tolerationSeconds") for t in matching]
    if any(s is None for s in secs):
        return math.inf
    return float(min(s for s in secs if s is not None))
