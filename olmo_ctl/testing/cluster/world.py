"""The world behind the test API server: causes in, the controllers' rules out.

The scripted side offers only what happens in the world: capacity appears or is withdrawn, a
higher-priority workload arrives, a node is lost, pods get nodes, a container exits with a code,
a container takes its time on SIGTERM. After each cause and each API write the controllers
(kubelet, Job, JobSet, Kueue) run to a fixed point, so what a client reads is what the upstream
rules compute. Time is `clock` (real time by default; a test may pass a fake one and call
`advance`), used for grace periods and requeue backoffs.
"""

from __future__ import annotations

import copy
import secrets
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from olmo_ctl.testing.cluster import jobs as jobctl
from olmo_ctl.testing.cluster import jobset as jobsetctl
from olmo_ctl.testing.cluster import kueue
from olmo_ctl.testing.cluster.objects import (
    JOBSET_NAME_LABEL,
    QUEUE_LABEL,
    controlled_by,
    deleting,
    labels,
    pod_requests,
    pod_terminal,
    quantity,
)
from olmo_ctl.testing.kube_api import KIND_TO_RESOURCE, Hooks, Store, schema_errors

SIGTERM_EXIT, SIGKILL_EXIT = 143, 137


def pod_security_baseline(pod: dict) -> str | None:
    """The Pod Security Standards' baseline checks that a training pod can trip (host namespaces,
    privileged containers, hostPath volumes), worded as the admission plugin words them."""
    spec = pod.get("spec") or {}
    out = []
    host = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    if host:
        out.append(f"host namespaces ({', '.join(host)})")
    priv = [
        c["name"] for c in spec.get("containers") or [] if (c.get("securityContext") or {}).get("privileged")
    ]
    if priv:
        out.append(
            f"privileged ({', '.join(f'container {n!r}' for n in priv)} must not set "
            "securityContext.privileged=true)".replace("'", '"')
        )
    paths = [v["name"] for v in spec.get("volumes") or [] if "hostPath" in v]
    if paths:
        out.append(f"hostPath volumes (volumes {', '.join(repr(n) for n in paths)})".replace("'", '"'))
    return "; ".join(out) or None


def _parse(ts: str) -> float:
    return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


class World(Hooks):
    """Kueue, the JobSet and Job controllers, the scheduler and the kubelet over a Store."""

    def __init__(self, store: Store, namespace: str = "default"):
        self.store = store
        self.namespace = namespace
        self.counted: dict[str, dict[str, str]] = {}  # Job uid -> {pod uid: how it was counted}
        self.removed_by_suspend: set[str] = set()
        self.reconcile_errors: dict[str, str] = {}  # JobSet uid -> why Kueue could not build its Workload
        self.pods_ready_timeout_s: float | None = None  # Kueue waitForPodsReady (off by default, as in XPK)
        # waitForPodsReady.requeuingStrategy.backoffLimitCount (None: requeued without end, Kueue's default)
        self.requeuing_backoff_limit_count: int | None = None
        self.deactivation_causes: dict[str, tuple[str, str]] = {}  # Workload uid -> (reason, why) by Kueue
        # Seconds a container takes to exit after SIGTERM (None: it uses its whole grace period).
        self.sigterm_exit_s: float | None = 0.0
        self.sigterm_exit_code = SIGTERM_EXIT
        self.auto_run = False  # True: pods get nodes and start as soon as they are created
        self.held = False  # True: the controllers do not react until `settle()`
        self._sigterm: dict[str, float] = {}  # pod uid -> when its container got SIGTERM
        self._exit_s: dict[str, float | None] = {}  # pod uid -> its own sigterm_exit_s
        # Admission of new pods: callables returning why a pod is refused (None: admitted), after Pod
        # Security (the namespace's pod-security.kubernetes.io/enforce label).
        self.pod_admission: list[Callable[[dict], str | None]] = []
        self.failed_creates: set[tuple] = set()
        self._offset = 0.0
        base = store.clock
        store.clock = lambda: base() + self._offset
        store.pod_stopped = self._pod_stopped

    # -- store access
    def now(self, offset_s: float = 0.0) -> str:
        return self.store.now_iso(offset_s)

    def seconds_since(self, ts: str) -> float:
        return self.store.clock() - _parse(ts)

    @staticmethod
    def copy(obj: Any) -> Any:
        return copy.deepcopy(obj)

    quantity = staticmethod(quantity)

    def get(self, kind: str, ns: str, name: str) -> dict | None:
        return self.store.get(KIND_TO_RESOURCE[kind], ns, name)

    def items(self, kind: str, ns: str | None) -> list[dict]:
        return self.store.items(KIND_TO_RESOURCE[kind], ns)

    def save(self, kind: str, obj: dict, new: bool = False) -> dict:
        res = KIND_TO_RESOURCE[kind]
        if new:
            obj["metadata"].setdefault("uid", str(uuid.uuid4()))
            obj["metadata"].setdefault("creationTimestamp", self.now())
            obj["metadata"].setdefault("generation", 1)
        if res.crd:
            errs = schema_errors(
                {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}, res.crd, res.versions[0]
            )
            if errs:
                raise AssertionError(f"the test cluster wrote an invalid {kind}: {errs}")
        obj["apiVersion"], obj["kind"] = res.api_version(), res.kind
        return self.store.put(res, obj)

    @staticmethod
    def snapshot(obj: dict) -> Any:
        return copy.deepcopy({k: v for k, v in obj.items() if k != "metadata"})

    def commit(self, kind: str, obj: dict, before: Any) -> bool:
        if self.snapshot(obj) == before:
            return False
        self.save(kind, obj)
        return True

    def delete(self, kind: str, obj: dict, policy: str = "Background", grace_s: int | None = None) -> None:
        self.store.delete(KIND_TO_RESOURCE[kind], obj, policy, grace_s, collect=False)

    def event(self, obj: dict, reason: str, message: str, type_: str = "Normal", source: str = "") -> None:
        md = obj["metadata"]
        ns = md.get("namespace") or self.namespace
        ev = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{md['name']}.{secrets.token_hex(8)}",
                "namespace": ns,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": self.now(),
            },
            "involvedObject": {
                "kind": obj.get("kind"),
                "name": md["name"],
                "namespace": ns,
                "uid": md.get("uid"),
                "apiVersion": obj.get("apiVersion"),
            },
            "reason": reason,
            "message": message,
            "type": type_,
            "count": 1,
            "firstTimestamp": self.now(),
            "lastTimestamp": self.now(),
            "source": {"component": source or "kubelet"},
            "reportingComponent": source or "kubelet",
        }
        self.store.put(KIND_TO_RESOURCE["Event"], ev)

    def owner_jobset(self, wl: dict) -> dict | None:
        for ref in wl["metadata"].get("ownerReferences") or []:
            if ref.get("kind") == "JobSet":
                js = self.get("JobSet", wl["metadata"]["namespace"], ref["name"])
                if js is not None and js["metadata"]["uid"] == ref.get("uid"):
                    return js
        return None

    # -- hooks of the API server
    def tick(self) -> None:
        self.reconcile()

    def admit(self, res, obj: dict) -> None:
        """Kueue's JobSet webhook: a JobSet with a queue label is created suspended."""
        if res.kind == "JobSet" and QUEUE_LABEL in labels(obj):
            obj.setdefault("spec", {})["suspend"] = True

    def written(self) -> None:
        self.reconcile()

    # -- the loop
    def reconcile(self) -> None:
        """Run the kubelet and every controller until nothing changes."""
        with self.store.lock:
            for _ in range(200):
                changed = self._kubelet()
                if not self.held:
                    for cq in self.items("ClusterQueue", None):
                        changed |= kueue.reconcile_cluster_queue(self, cq)
                    for js in self.items("JobSet", None):
                        changed |= kueue.reconcile_job(self, js)
                    for wl in self.items("Workload", None):
                        changed |= kueue.reconcile_workload(self, wl)
                    changed |= kueue.schedule(self)
                    for lq in self.items("LocalQueue", None):
                        changed |= kueue.reconcile_local_queue(self, lq)
                    for js in self.items("JobSet", None):
                        changed |= jobsetctl.reconcile(self, js)
                    for job in self.items("Job", None):
                        changed |= jobctl.reconcile(self, job)
                rv = self.store._rv
                self.store.collect()
                changed |= self.store._rv != rv
                if not changed:
                    return
            raise RuntimeError("the test cluster's controllers do not settle")

    def settle(self) -> None:
        """Let held controllers react now."""
        self.held = False
        self.reconcile()

    def advance(self, seconds: float) -> None:
        """Move the world's clock on by `seconds` and let what was due happen (grace periods end,
        requeue backoffs finish, waitForPodsReady times out)."""
        with self.store.lock:
            self._offset += seconds
            self.reconcile()

    # -- pod admission
    def refuse_pod(self, pod: dict) -> str | None:
        """Why the API server would refuse to create `pod` (Pod Security admission, then any
        scripted refusal such as an exceeded ResourceQuota), or None."""
        ns = self.get("Namespace", "", pod["metadata"]["namespace"])
        level = labels(ns or {"metadata": {}}).get("pod-security.kubernetes.io/enforce", "privileged")
        if level in ("baseline", "restricted"):
            why = pod_security_baseline(pod)
            if why:
                return f'violates PodSecurity "{level}:latest": {why}'
        for check in self.pod_admission:
            why = check(pod)
            if why:
                return why
        return None

    # -- the kubelet
    def node_unreachable(self, pod: dict) -> bool:
        """The kubelet of the pod's node posts nothing (a world with nodes says; this one has none)."""
        return False

    def _pod_stopped(self, pod: dict) -> bool:
        if pod_terminal(pod) or not pod["spec"].get("nodeName"):
            return True
        return not any(
            "running" in (cs.get("state") or {}) for cs in pod["status"].get("containerStatuses") or []
        )

    def _kubelet(self) -> bool:
        """Deleting pods: SIGTERM, then the container exits after its `sigterm_exit_s`, or is killed
        (137) when the grace period ends."""
        changed = False
        now = self.store.clock()
        for pod in self.items("Pod", None):
            if deleting(pod) and not pod_terminal(pod) and not pod["spec"].get("nodeName"):
                # pod GC (gcUnscheduledTerminating): an unscheduled terminating pod is marked Failed
                pod["status"]["phase"] = "Failed"
                self.add_disruption(pod, "DeletionByPodGC", "PodGC: node no longer exists")
                self.save("Pod", pod)
                changed = True
                continue
            if not deleting(pod) or self._pod_stopped(pod) or self.node_unreachable(pod):
                continue  # an unreachable node's kubelet learns of the deletion when it is back
            uid = pod["metadata"]["uid"]
            if uid not in self._sigterm:
                self._sigterm[uid] = now
                self.event(pod, "Killing", f"Stopping container {pod['spec']['containers'][0]['name']}")
                changed = True
            exit_s = self._exit_s.get(uid, self.sigterm_exit_s)
            if exit_s is not None and now - self._sigterm[uid] >= exit_s:
                self.container_exit(pod, self.sigterm_exit_code)
                changed = True
            elif now >= _parse(pod["metadata"]["deletionTimestamp"]):
                self.container_exit(pod, SIGKILL_EXIT)
                changed = True
        return changed

    def container_exit(
        self,
        pod: dict,
        code: int,
        log_lines=(),
        reason: str | None = None,
        disruption: tuple[str, str] | None = None,
    ) -> None:
        """Every container of `pod` terminates with `code` (restartPolicy Never: the pod is done)."""
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        self.store.logs.setdefault(key, []).extend(log_lines)
        st = pod["status"]
        st["phase"] = "Succeeded" if code == 0 else "Failed"
        reason = reason or ("Completed" if code == 0 else "Error")
        policy = {c["name"]: c.get("terminationMessagePolicy") for c in pod["spec"].get("containers") or []}
        for cs in st.get("containerStatuses") or []:
            started = ((cs.get("state") or {}).get("running") or {}).get("startedAt") or self.now()
            term = {
                "exitCode": code,
                "reason": reason,
                "startedAt": started,
                "finishedAt": self.now(),
                "containerID": f"containerd://{secrets.token_hex(16)}",
            }
            if code != 0 and policy.get(cs["name"]) == "FallbackToLogsOnError":
                term["message"] = "\n".join(self.store.logs.get(key, [])[-80:])
            cs.update(ready=False, started=False, state={"terminated": term})
        for c in st.get("conditions") or []:
            if c["type"] in ("Ready", "ContainersReady"):
                c.update(status="False", reason="PodFailed" if code else "PodCompleted")
        if disruption:
            self.add_disruption(pod, *disruption)
        self.save("Pod", pod)

    def add_disruption(self, pod: dict, reason: str, message: str) -> None:
        conds = pod["status"].setdefault("conditions", [])
        if not any(c["type"] == "DisruptionTarget" for c in conds):
            conds.append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": self.now(),
                }
            )

    def start_pod(self, pod: dict, node: str) -> None:
        """The scheduler binds the pod to `node`; the kubelet starts its containers."""
        pod["spec"]["nodeName"] = node
        st = pod["status"]
        ip = f"10.0.{len(node) % 200}.{(sum(map(ord, node)) % 250) + 2}"
        st.update(phase="Running", hostIP=ip, podIP=ip, startTime=self.now())
        st["conditions"] = [
            {"type": t, "status": "True", "lastTransitionTime": self.now()}
            for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
        ]
        for cs in st["containerStatuses"]:
            cs.update(ready=True, started=True, state={"running": {"startedAt": self.now()}})
        self.save("Pod", pod)
        self.event(
            pod,
            "Scheduled",
            f"Successfully assigned {pod['metadata']['namespace']}/{pod['metadata']['name']} to {node}",
            source="default-scheduler",
        )

    # -- queries
    def jobset_pods(self, name: str, ns: str | None = None, live_only: bool = False) -> list[dict]:
        pods = [
            p
            for p in self.items("Pod", ns or self.namespace)
            if labels(p).get(JOBSET_NAME_LABEL) == name
            and not (live_only and (pod_terminal(p) or deleting(p)))
        ]
        return sorted(
            pods,
            key=lambda p: (
                int(labels(p).get("jobset.sigs.k8s.io/job-index", 0)),
                int(labels(p).get("batch.kubernetes.io/job-completion-index", 0)),
                p["metadata"]["creationTimestamp"],
            ),
        )

    def workload_of(self, js: dict) -> dict | None:
        wls = [w for w in self.items("Workload", js["metadata"]["namespace"]) if controlled_by(w, js)]
        return max(wls, key=lambda w: w["metadata"]["creationTimestamp"]) if wls else None

    # -- causes: Kueue's world
    def ensure_queue(
        self,
        local_queue: str,
        cluster_queue: str,
        flavor: str,
        resources: dict[str, Any],
        node_labels: dict[str, str] | None = None,
        preemption: str = "LowerPriority",
        namespace: str | None = None,
    ) -> None:
        """A LocalQueue -> ClusterQueue -> ResourceFlavor chain as XPK configures it (preemption within
        the ClusterQueue of lower priorities, never across the cohort)."""
        ns = namespace or self.namespace
        if self.get("ResourceFlavor", "", flavor) is None:
            self.save(
                "ResourceFlavor",
                {"metadata": {"name": flavor}, "spec": {"nodeLabels": dict(node_labels or {})}},
                new=True,
            )
        if self.get("ClusterQueue", "", cluster_queue) is None:
            self.save(
                "ClusterQueue",
                {
                    "metadata": {"name": cluster_queue},
                    "spec": {
                        "namespaceSelector": {},
                        "queueingStrategy": "BestEffortFIFO",
                        "preemption": {"withinClusterQueue": preemption, "reclaimWithinCohort": "Never"},
                        "resourceGroups": [
                            {
                                "coveredResources": sorted(resources),
                                "flavors": [
                                    {
                                        "name": flavor,
                                        "resources": [
                                            {"name": r, "nominalQuota": str(q)}
                                            for r, q in sorted(resources.items())
                                        ],
                                    }
                                ],
                            }
                        ],
                    },
                },
                new=True,
            )
        if self.get("LocalQueue", ns, local_queue) is None:
            self.save(
                "LocalQueue",
                {"metadata": {"name": local_queue, "namespace": ns}, "spec": {"clusterQueue": cluster_queue}},
                new=True,
            )

    def add_quota(self, cluster_queue: str, flavor: str, resource: str, amount: float) -> None:
        """Capacity appears (amount > 0) or is withdrawn (< 0) in a ClusterQueue's flavor."""
        cq = self.get("ClusterQueue", "", cluster_queue)
        for g in cq["spec"]["resourceGroups"]:
            for f in g["flavors"]:
                if f["name"] != flavor:
                    continue
                if resource not in g["coveredResources"]:
                    g["coveredResources"].append(resource)
                row = next((r for r in f["resources"] if r["name"] == resource), None)
                if row is None:
                    row = {"name": resource, "nominalQuota": "0"}
                    f["resources"].append(row)
                from olmo_ctl.testing.cluster.objects import format_quantity

                row["nominalQuota"] = format_quantity(
                    resource, max(0.0, quantity(row["nominalQuota"]) + amount)
                )
        self.save("ClusterQueue", cq)

    def arrive(
        self,
        name: str,
        queue: str,
        priority: int,
        template: dict,
        count: int = 1,
        namespace: str | None = None,
    ) -> dict:
        """Another team's workload arrives in `queue` with `priority` (a bare Workload: its pods run
        elsewhere); Kueue admits it, preempting lower priorities if it must."""
        wl = {
            "metadata": {"name": name, "namespace": namespace or self.namespace},
            "spec": {
                "queueName": queue,
                "priority": priority,
                "active": True,
                "podSets": [{"name": "main", "count": count, "template": copy.deepcopy(template)}],
            },
        }
        return self.save("Workload", wl, new=True)

    def requests_of(self, wl: dict) -> list[tuple[dict, dict[str, float]]]:
        return [
            (ps, {r: q * int(ps["count"]) for r, q in pod_requests(ps["template"]).items()})
            for ps in wl["spec"]["podSets"]
        ]
