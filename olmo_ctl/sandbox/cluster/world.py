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
import re
import secrets
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from olmo_ctl.core.errors import BadInput
from olmo_ctl.sandbox.cluster import jobs as jobctl
from olmo_ctl.sandbox.cluster import jobset as jobsetctl
from olmo_ctl.sandbox.cluster import kueue
from olmo_ctl.sandbox.cluster.objects import (
    JOBSET_NAME_LABEL,
    QUEUE_LABEL,
    controlled_by,
    deleting,
    labels,
    pod_requests,
    pod_terminal,
    quantity,
)
from olmo_ctl.sandbox.kube_api import KIND_TO_RESOURCE, Hooks, Store, schema_errors

SIGTERM_EXIT, SIGKILL_EXIT = 143, 137
WORKLOAD_IDENTITY_ANNOTATION = "iam.gke.io/gcp-service-account"
# The service account a cluster set up for olmo-ctl has (docs/running-on-gke.md), and its GCP binding.
OLMO_CTL_SERVICE_ACCOUNT = "olmo-ctl"
SANDBOX_GCP_ACCOUNT = "olmo-ctl@sandbox-project.iam.gserviceaccount.com"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
# kubelet.go: imageBackOff := flowcontrol.NewBackOff(backOffPeriod, MaxContainerBackOff): the first
# retry of a failed pull after 10 s, doubling, at most every 300 s.
IMAGE_BACKOFF_S, IMAGE_BACKOFF_MAX_S = 10.0, 300.0
IMAGE_PULL_KINDS = ("transient", "permanent")
# What containerd (and Artifact Registry behind it) answers for each cause of a failed pull.
PULL_ERRORS = {
    "too-many-requests": 'rpc error: code = Unknown desc = failed to pull and unpack image "{ref}": failed to copy: '
    "httpReadSeeker: failed open: unexpected status code https://{host}/v2/{path}/manifests/{tag}: "
    "429 Too Many Requests",
    "not-found": 'rpc error: code = NotFound desc = failed to pull and unpack image "{ref}": failed to resolve '
    'reference "{ref}": {ref}: not found',
    "denied": 'rpc error: code = Unknown desc = failed to pull and unpack image "{ref}": failed to resolve '
    'reference "{ref}": failed to authorize: failed to fetch oauth token: unexpected status from GET request '
    "to https://{host}/v2/token: 403 Forbidden",
    "unauthorized": 'rpc error: code = Unknown desc = failed to pull and unpack image "{ref}": failed to '
    'resolve reference "{ref}": pulling from host {host} failed with status code [manifests {tag}]: '
    "401 Unauthorized",
}
PERMANENT_CAUSES = ("not-found", "denied", "unauthorized")
# distribution/reference's grammar, enough to tell a reference the kubelet can parse from one it cannot.
_IMAGE_REF = re.compile(
    r"^(?:[a-zA-Z0-9](?:[a-zA-Z0-9.-]*[a-zA-Z0-9])?(?::[0-9]+)?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
    r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*(?::[\w][\w.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"
)


def _image_parts(ref: str) -> dict[str, str]:
    name, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", "latest")
    first = name.split("/", 1)[0]
    registry = "/" in name and ("." in first or ":" in first or first == "localhost")
    host, _, path = (
        name.partition("/")
        if registry
        else (
            "registry-1.docker.io",
            "",
            name,
        )
    )
    return {"ref": ref, "host": host, "path": path, "tag": tag}


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
        # JobSet v0.10.1's pod webhooks for exclusive placement (followers refused until their
        # leader is scheduled, then pinned to its node pool). Off in the bare test cluster, whose
        # pods get nodes only when a test says so; the sandbox, which schedules, turns them on.
        self.exclusive_placement_webhook = False
        self.image_faults: list[dict] = []  # see image_pull_fault
        self._pulls: dict[str, dict] = {}  # pod uid -> its failed pull: cause, backoff, when to retry
        self.kubelets_down: list[dict] = []  # see kubelet_down
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
        # An object keeps the served version it was written in (a Workload applied as v1beta2)
        version = (obj.get("apiVersion") or "").rpartition("/")[2]
        version = version if version in res.versions else res.versions[0]
        if res.crd:
            errs = schema_errors(
                {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}, res.crd, version
            )
            if errs:
                raise AssertionError(f"the test cluster wrote an invalid {kind}: {errs}")
        obj["apiVersion"], obj["kind"] = res.api_version(version), res.kind
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
        """Kueue's JobSet webhook: a JobSet with a queue label is created suspended. A pod created
        through the API (not by a Job) starts with the status a Job's pod starts with: Pending, each
        container waiting, as the kubelet reports it until it starts them."""
        if res.kind == "JobSet" and QUEUE_LABEL in labels(obj):
            obj.setdefault("spec", {})["suspend"] = True
        if res.kind == "Pod":
            obj["status"] = {**jobctl.pending_status(obj["spec"]), **obj["status"]}

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
        # The ServiceAccount admission plugin (plugin/pkg/admission/serviceaccount/admission.go): a pod
        # naming a service account that does not exist is forbidden. `default` exists in every namespace
        # (the ServiceAccount controller creates it).
        account = pod["spec"].get("serviceAccountName") or "default"
        if account != "default" and self.get("ServiceAccount", pod["metadata"]["namespace"], account) is None:
            return (
                f"error looking up service account {pod['metadata']['namespace']}/{account}: "
                f'serviceaccount "{account}" not found'
            )
        level = labels(ns or {"metadata": {}}).get("pod-security.kubernetes.io/enforce", "privileged")
        if level in ("baseline", "restricted"):
            why = pod_security_baseline(pod)
            if why:
                return f'violates PodSecurity "{level}:latest": {why}'
        why = self._exclusive_placement(pod)
        if why:
            return why
        for check in self.pod_admission:
            why = check(pod)
            if why:
                return why
        return None

    def _exclusive_placement(self, pod: dict) -> str | None:
        """JobSet v0.10.1 pkg/webhooks: for a pod annotated `alpha.jobset.sigs.k8s.io/exclusive-
        topology`, the mutating webhook (pod_mutating_webhook.go setNodeSelector) gives a follower
        (completion index != 0) a nodeSelector for its leader's topology, read from the leader's node
        labels, "" when that node is not found (topologyFromPod ignores NotFound: jobset#1088, fixed
        in v0.11.0 by #1089); the validating one (pod_admission_webhook.go ValidateCreate) refuses a
        follower while its Job has no single live leader, or the leader has no node yet."""
        key = ((pod["metadata"].get("annotations")) or {}).get("alpha.jobset.sigs.k8s.io/exclusive-topology")
        if not self.exclusive_placement_webhook or not key:
            return None
        idx = (pod["metadata"].get("annotations") or {}).get("batch.kubernetes.io/job-completion-index")
        if idx in (None, "0"):
            return None
        owner: dict = next(
            (r for r in pod["metadata"].get("ownerReferences") or [] if r.get("kind") == "Job"), {}
        )
        leader_name = f"{owner.get('name')}-0"  # genLeaderPodName: <jobset>-<replicated job>-<job index>-0
        leaders = [
            p
            for p in self.items("Pod", pod["metadata"]["namespace"])
            if any(r.get("uid") == owner.get("uid") for r in p["metadata"].get("ownerReferences") or [])
            and labels(p).get("batch.kubernetes.io/job-completion-index") == "0"
            and not deleting(p)
        ]
        deny = 'admission webhook "vpod.kb.io" denied the request: '
        if len(leaders) != 1:
            return deny + (
                f"expected 1 leader pod ({leader_name}), but got {len(leaders)}. this is an expected, transient error"
            )
        node = leaders[0]["spec"].get("nodeName")
        if not node:
            return (
                deny
                + "leader pod not yet scheduled, not creating follower pod. this is an expected, transient error"
            )
        node_obj = self.get("Node", "", node)
        pod["spec"].setdefault("nodeSelector", {})[key] = labels(node_obj).get(key, "") if node_obj else ""
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

    def killing(self, pod: dict, now: float) -> None:
        """The kubelet starts stopping a deleted pod's container (SIGTERM now): its `Killing` event,
        as kuberuntime_container.go's killContainer records it before it signals."""
        self._sigterm[pod["metadata"]["uid"]] = now
        self.event(pod, "Killing", f"Stopping container {pod['spec']['containers'][0]['name']}")

    def _kubelet(self) -> bool:
        """Deleting pods: SIGTERM, then the container exits after its `sigterm_exit_s`, or is killed
        (137) when the grace period ends. Nothing of this happens on a node whose kubelet is down
        (`kubelet_down`): its pods stay Terminating until it returns. Failed image pulls are retried
        when their backoff ends."""
        changed = self._kubelets_return() | self._retry_pulls()
        now = self.store.clock()
        for pod in self.items("Pod", None):
            if self.node_down(pod["spec"].get("nodeName")):
                continue
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
                self.killing(pod, now)
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
        # KEP-753: once the regular containers have exited the kubelet stops the sidecars (SIGTERM);
        # they stop on it. Their exit never decides the pod's phase.
        lost = reason == "ContainerStatusUnknown"  # the host went down with every container
        for cs in st.get("initContainerStatuses") or []:
            if "terminated" in (cs.get("state") or {}):
                continue
            started = ((cs.get("state") or {}).get("running") or {}).get("startedAt") or self.now()
            cs.update(
                ready=False,
                started=False,
                state={
                    "terminated": {
                        "exitCode": code if lost else 0,
                        "reason": reason if lost else "Completed",
                        "startedAt": started,
                        "finishedAt": self.now(),
                        "containerID": f"containerd://{secrets.token_hex(16)}",
                    }
                },
            )
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
        # Sidecars first (KEP-753: each started before the next container), then the regular ones.
        for cs in (st.get("initContainerStatuses") or []) + st["containerStatuses"]:
            cs.update(ready=True, started=True, state={"running": {"startedAt": self.now()}})
        self.save("Pod", pod)
        self.event(
            pod,
            "Scheduled",
            f"Successfully assigned {pod['metadata']['namespace']}/{pod['metadata']['name']} to {node}",
            source="default-scheduler",
        )
        # the kubelet's event per container (kuberuntime_container.go)
        for cs in (st.get("initContainerStatuses") or []) + st["containerStatuses"]:
            self.event(pod, "Started", f"Started container {cs['name']}", source="kubelet")

    # -- causes: the nodes
    def node_pool(self, node: str | None) -> str | None:
        obj = self.get("Node", "", node) if node else None
        return labels(obj).get(NODEPOOL_LABEL) if obj else None

    def in_pool(self, node: str | None, pool: str | None) -> bool:
        """Whether `node` is in `pool`: a node pool's name, or a device type meaning all of its pools
        (the sandbox names them `<device>-np-<slice>`); None: every node."""
        if pool is None:
            return True
        have = self.node_pool(node)
        return have is not None and (have == pool or have.startswith(f"{pool}-np-"))

    def _pool_names(self) -> set[str]:
        """The node pools of the nodes there are (the sandbox's world adds those a fault removed)."""
        return {self.node_pool(n["metadata"]["name"]) or "" for n in self.items("Node", None)} - {""}

    def _pools_exist(self, pool: str | None) -> None:
        pools = sorted(self._pool_names())
        if pool is not None and not any(have == pool or have.startswith(f"{pool}-np-") for have in pools):
            raise BadInput(
                f"no node pool `{pool}` in this cluster",
                f"pools: {', '.join(pools) or 'none'}; a device type given to --slices means all of its pools",
            )

    def image_pull_fault(
        self, pool: str | None, kind: str, for_s: float | None = None, cause: str | None = None
    ) -> None:
        """Pulls of any image on `pool`'s nodes (None: every node) fail from now, for `for_s` seconds
        (None: until `clear_image_pull_faults`). `transient`: the registry answers 429 Too Many
        Requests (cause `too-many-requests`); `permanent`: it answers `not-found` (the default),
        `denied` or `unauthorized`. Outcomes are the kubelet's: a pod bound to such a node waits
        with ErrImagePull, then ImagePullBackOff, retried after 10 s, doubling to 300 s; it starts at
        the first retry after the fault ends. A container with imagePullPolicy Never gets
        ErrImageNeverPull (the image is not on the node), and an image reference the kubelet cannot
        parse is InvalidImageName whatever the registry does (neither is retried)."""
        if kind not in IMAGE_PULL_KINDS:
            raise BadInput(f"image pull fault `{kind}` is not one of {', '.join(IMAGE_PULL_KINDS)}")
        cause = cause or ("too-many-requests" if kind == "transient" else "not-found")
        allowed = ("too-many-requests",) if kind == "transient" else PERMANENT_CAUSES
        if cause not in allowed:
            raise BadInput(f"a {kind} image pull fault is {' or '.join(allowed)}, not `{cause}`")
        if for_s is not None and for_s <= 0:
            raise BadInput(f"an image pull fault lasts a positive time, not {for_s} s")
        with self.store.lock:
            self._pools_exist(pool)
            until = None if for_s is None else self.store.clock() + for_s
            self.image_faults.append({"pool": pool, "kind": kind, "cause": cause, "until": until})
            self.reconcile()

    def clear_image_pull_faults(self, pool: str | None = None) -> None:
        """The registry answers again (on `pool`'s nodes; None: everywhere): the next retry pulls."""
        with self.store.lock:
            self.image_faults = [f for f in self.image_faults if pool is not None and f["pool"] != pool]
            self.reconcile()

    def _image_fault(self, node: str) -> dict | None:
        now = self.store.clock()
        self.image_faults = [f for f in self.image_faults if f["until"] is None or now < f["until"]]
        return next((f for f in reversed(self.image_faults) if self.in_pool(node, f["pool"])), None)

    def _bind(self, pod: dict, node: str) -> None:
        """The scheduler binds the pod; its containers wait for their image."""
        pod["spec"]["nodeName"] = node
        pod["status"]["conditions"] = [
            c for c in pod["status"].get("conditions") or [] if c["type"] != "PodScheduled"
        ] + [{"type": "PodScheduled", "status": "True", "lastTransitionTime": self.now()}]
        self.event(
            pod,
            "Scheduled",
            f"Successfully assigned {pod['metadata']['namespace']}/{pod['metadata']['name']} to {node}",
            source="default-scheduler",
        )

    def _waiting(self, pod: dict, reason: str, message: str) -> None:
        for cs in pod["status"].get("containerStatuses") or []:
            cs.update(ready=False, started=False, state={"waiting": {"reason": reason, "message": message}})
        self.save("Pod", pod)

    def pull_image(self, pod: dict, node: str) -> bool:
        """The kubelet of `node` pulls the pod's image: True when its containers can start; else the
        pod is bound to `node` and waits as the kubelet reports it (container waiting reason,
        message and events)."""
        c = (pod["spec"].get("containers") or [{}])[0]
        image, uid = str(c.get("image") or ""), pod["metadata"]["uid"]
        now = self.store.clock()
        valid = bool(_IMAGE_REF.match(image))
        fault = self._image_fault(node) if valid else None
        if valid and fault is None:
            self._pulls.pop(uid, None)
            return True
        if not pod["spec"].get("nodeName"):
            self._bind(pod, node)
        if not valid:
            msg = f'Failed to apply default image tag "{image}": couldn\'t parse image reference "{image}": invalid reference format'
            self._pulls[uid] = {"permanent": True}
            self.event(pod, "InspectFailed", msg, "Warning")
            self.event(pod, "Failed", "Error: InvalidImageName", "Warning")
            self._waiting(pod, "InvalidImageName", msg)
            return False
        assert fault is not None
        if c.get("imagePullPolicy") == "Never":
            msg = f'Container image "{image}" is not present with pull policy of Never'
            self._pulls[uid] = {"permanent": True}
            self.event(pod, "ErrImageNeverPull", msg, "Warning")
            self.event(pod, "Failed", "Error: ErrImageNeverPull", "Warning")
            self._waiting(pod, "ErrImageNeverPull", msg)
            return False
        prev = self._pulls.get(uid) or {}
        backoff = min(IMAGE_BACKOFF_MAX_S, prev["backoff"] * 2) if "backoff" in prev else IMAGE_BACKOFF_S
        self._pulls[uid] = {"backoff": backoff, "failed_at": now, "next": now + backoff, "node": node}
        msg = PULL_ERRORS[fault["cause"]].format(**_image_parts(image))
        self.event(pod, "Pulling", f'Pulling image "{image}"')
        self.event(pod, "Failed", f'Failed to pull image "{image}": {msg}', "Warning")
        self.event(pod, "Failed", "Error: ErrImagePull", "Warning")
        self._waiting(pod, "ErrImagePull", msg)
        return False

    def start_containers(self, pod: dict, node: str) -> None:
        """The kubelet starts the pod's containers (the sandbox's runner runs them as processes)."""
        self.start_pod(pod, node)

    def _retry_pulls(self) -> bool:
        """kuberuntime: within the backoff a failed pull is ImagePullBackOff; after it, pulled again."""
        changed = False
        now = self.store.clock()
        for pod in self.items("Pod", None):
            uid = pod["metadata"]["uid"]
            pull = self._pulls.get(uid)
            node = pod["spec"].get("nodeName")
            if pull is None or pull.get("permanent") or not node:
                continue
            if pod_terminal(pod) or deleting(pod):
                self._pulls.pop(uid, None)
                continue
            if self.node_down(node):
                continue
            if now >= pull["next"]:
                if self.pull_image(pod, node):
                    self.start_containers(pod, node)
                changed = True
            elif not pull.get("backing_off") and now - pull["failed_at"] >= 1.0:  # the pod's next sync
                pull["backing_off"] = True
                image = (pod["spec"].get("containers") or [{}])[0].get("image")
                self.event(pod, "BackOff", f'Back-off pulling image "{image}"')
                self.event(pod, "Failed", "Error: ImagePullBackOff", "Warning")
                self._waiting(pod, "ImagePullBackOff", f'Back-off pulling image "{image}"')
                changed = True
        return changed

    def kubelet_down(self, pool: str | None, for_s: float | None = None) -> None:
        """The kubelets of `pool`'s nodes (None: every node) stop answering for `for_s` seconds
        (None: until `kubelet_back`): the node lifecycle controller marks them NotReady (Ready
        Unknown, NodeStatusUnknown) and tainted unreachable:NoSchedule, nothing new is scheduled
        there, and nothing on them is carried out: a pod deleted meanwhile stays Terminating (its
        container runs on) until the node returns, when its kubelet sends SIGTERM, or SIGKILL if
        the grace period is over. The NoExecute eviction after 300 s is not part of this cause."""
        if for_s is not None and for_s <= 0:
            raise BadInput(f"a node outage lasts a positive time, not {for_s} s")
        with self.store.lock:
            self._pools_exist(pool)
            until = None if for_s is None else self.store.clock() + for_s
            self.kubelets_down.append({"pool": pool, "until": until})
            self._mark_nodes()
            self.reconcile()

    def kubelet_back(self, pool: str | None = None) -> None:
        """The kubelets of `pool` (None: all) answer again."""
        with self.store.lock:
            self.kubelets_down = [d for d in self.kubelets_down if pool is not None and d["pool"] != pool]
            self._mark_nodes()
            self.reconcile()

    def node_down(self, node: str | None) -> bool:
        if not node or not self.kubelets_down:
            return False
        now = self.store.clock()
        return any(
            (d["until"] is None or now < d["until"]) and self.in_pool(node, d["pool"])
            for d in self.kubelets_down
        )

    def _kubelets_return(self) -> bool:
        now = self.store.clock()
        gone = [d for d in self.kubelets_down if d["until"] is not None and now >= d["until"]]
        if not gone:
            return False
        self.kubelets_down = [d for d in self.kubelets_down if d not in gone]
        return self._mark_nodes()

    def _mark_nodes(self) -> bool:
        """Node conditions and taints as the node lifecycle controller keeps them."""
        changed = False
        taint = {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"}
        for n in self.items("Node", None):
            down = self.node_down(n["metadata"]["name"])
            ready = next(
                (c for c in (n.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), None
            )
            if ready is None:
                continue
            want = (
                ("Unknown", "NodeStatusUnknown", "Kubelet stopped posting node status.")
                if down
                else (
                    "True",
                    "KubeletReady",
                    "kubelet is posting ready status",
                )
            )
            if (ready["status"], ready.get("reason")) == want[:2]:
                continue
            ready.update(status=want[0], reason=want[1], message=want[2], lastTransitionTime=self.now())
            taints = [t for t in (n.get("spec") or {}).get("taints") or [] if t.get("key") != taint["key"]]
            n.setdefault("spec", {})["taints"] = taints + (
                [dict(taint, timeAdded=self.now())] if down else []
            )
            self.save("Node", n)
            changed = True
        return changed

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

    def ensure_service_account(
        self, name: str, namespace: str | None = None, gcp_account: str | None = None
    ) -> None:
        """A Kubernetes service account, bound to a GCP one for Workload Identity when `gcp_account` is
        given (the `iam.gke.io/gcp-service-account` annotation GKE reads)."""
        ns = namespace or self.namespace
        if self.get("ServiceAccount", ns, name) is None:
            meta: dict[str, Any] = {"name": name, "namespace": ns}
            if gcp_account:
                meta["annotations"] = {WORKLOAD_IDENTITY_ANNOTATION: gcp_account}
            self.save("ServiceAccount", {"metadata": meta}, new=True)

    def add_quota(self, cluster_queue: str, flavor: str, resource: str, amount: float) -> None:
        """Capacity appears (amount > 0) or is withdrawn (< 0) in a ClusterQueue's flavor."""
        cq = self.get("ClusterQueue", "", cluster_queue)
        if cq is None:
            raise KeyError(f"no ClusterQueue {cluster_queue!r}")
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
                from olmo_ctl.sandbox.cluster.objects import format_quantity

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
