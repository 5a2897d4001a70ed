"""The Kubernetes API test server with a cluster behind it: `KubeServer`.

`olmo_ctl.sandbox.kube_api` is the generic API server (REST, discovery, watch, CRD schemas, deletion
and garbage collection); `olmo_ctl.sandbox.cluster` is the world behind it, where the controllers'
rules (batch/v1 Jobs, JobSet v0.10.1, Kueue v0.17.1) decide every outcome from causes. A JobSet with
the label `kueue.x-k8s.io/queue-name` is created suspended; Kueue builds its Workload
`jobset-<name>-<5 hex>` (controller ownerReference, label `kueue.x-k8s.io/job-uid`), which waits
for quota. The server starts with LocalQueues `user-queue`, `tpu-queue` and `multislice-queue` in
its namespace, backed by ClusterQueue `cluster-queue` whose flavor `tpu-flavor` has no quota yet
(so everything queues until capacity appears), preempting lower priorities within itself.

    with KubeServer() as srv:          # the API on 127.0.0.1:<free port> (faults: see kube_api)
        c = srv.cluster                # the scripted causes, by JobSet name:
        c.admit(name)                  capacity for exactly this workload appears: Kueue admits it,
                                       the JobSet resumes, its Jobs create pods (Pending)
        c.keep_pending(name[, message]) no capacity: returns Kueue's Pending message (checks `message`)
        c.run_pods(name)               nodes come up: pods bound, containers running and Ready
        c.log(name, index, lines)      pod `index` (0-based over the JobSet's pods) writes lines
        c.pod_exit(name, index, code, log_lines=(), reason=None, disruption=None)
                                       that pod's container exits with `code`; the rules decide the rest
        c.unschedulable(name, message) no node fits: PodScheduled=False + FailedScheduling events
        c.image_pull_error(name, index=0, reason="ErrImagePull", message=...)
        c.node_lost(name, index)       the pod's node goes away: DisruptionTarget, deleted, Failed
        c.node_maintenance(name, index) graceful node shutdown: DisruptionTarget, SIGTERM, exit 143
        c.evict(name, reason="Preempted", preempted_reason="InClusterQueue")
                                       Preempted: a higher-priority workload arrives in the same
                                       ClusterQueue; other reasons: Kueue evicts with that reason
        c.restart(name)                pod 0's container exits 143; the failure policy decides
        c.complete(name)               every container exits 0
        c.fail(name, reason=None, message=None, exit_code=143)
                                       containers exit with `exit_code` until the JobSet fails; checks
                                       that upstream's reason (and message) is the one given
        c.on_create(callback)          callback(name) after each JobSet create (inside the request)
        c.hold_deletions = True        containers use their whole grace period on SIGTERM ...
        c.finish_deletions()           ... until they exit now; returns the JobSets that went
        c.jobset(name), c.workload(name), c.pods(name), c.events(), c.jobset_names(), c.deleted
        c.world                        the World (more causes: add_quota, arrive, advance, held/settle,
                                       pod_admission, pods_ready_timeout_s; Pod Security from the
                                       namespace's pod-security.kubernetes.io/enforce label; the
                                       faults image_pull_fault, kubelet_down: docs/test-cluster.md)
        srv.outage(mode, for_s)        the API server refuses, answers 503 or hangs (kube_api)
"""

from __future__ import annotations

import copy
import secrets
import time
from collections.abc import Callable
from typing import Any

from olmo_ctl.sandbox.cluster import kueue
from olmo_ctl.sandbox.cluster.objects import QUEUE_LABEL, deleting, pod_terminal
from olmo_ctl.sandbox.cluster.world import OLMO_CTL_SERVICE_ACCOUNT, SANDBOX_GCP_ACCOUNT, World
from olmo_ctl.sandbox.kube_api import (  # noqa: F401  (re-exported: tests and tools import them from here)
    JOBSET_CRD,
    WORKLOAD_CRD,
    ApiError,
    ApiServer,
    Resource,
    crd_versions,
    schema_errors,
    unknown_fields,
)

JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
DEFAULT_QUEUES = ("user-queue", "tpu-queue", "multislice-queue")
DISRUPTION_MESSAGES = {
    "PreemptionByScheduler": "default-scheduler: preempting to accommodate a higher priority pod",
    "DeletionByTaintManager": "Taint manager: deleting due to NoExecute taint",
    "TerminationByKubelet": "Pod was terminated in response to imminent node shutdown.",
}


class ScriptedWorld(World):
    """The World, plus callbacks after each JobSet create."""

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.callbacks: list[Callable[[str], None]] = []
        self._created: list[str] = []

    def admit(self, res, obj: dict) -> None:
        super().admit(res, obj)
        if res.kind == "JobSet":
            self._created.append(obj["metadata"]["name"])

    def written(self) -> None:
        super().written()
        created, self._created = self._created, []
        for name in created:
            for cb in list(self.callbacks):
                cb(name)


class Cluster:
    """The scripted causes of the old test cluster, each now the cause that produces its outcome."""

    def __init__(
        self,
        world: ScriptedWorld,
        server: ApiServer,
        cluster_queue: str = "cluster-queue",
        flavor: str = "tpu-flavor",
    ):
        self.world, self.server = world, server
        self.store = world.store
        self.namespace = world.namespace
        self.cluster_queue, self.flavor = cluster_queue, flavor

    # -- lookups
    @property
    def deleted(self) -> list[tuple[str, str, str]]:
        """(kind, name, propagationPolicy) of every deletion asked through the API."""
        return self.server.api.deleted

    def _js(self, name: str, ns: str | None = None) -> dict:
        o = self.world.get("JobSet", ns or self.namespace, name)
        if o is None:
            raise KeyError(f"no JobSet {name!r}")
        return o

    def jobset(self, name: str, ns: str | None = None) -> dict | None:
        with self.store.lock:
            return copy.deepcopy(self.world.get("JobSet", ns or self.namespace, name))

    def jobset_names(self, ns: str | None = None) -> list[str]:
        with self.store.lock:
            return [o["metadata"]["name"] for o in self.world.items("JobSet", ns or self.namespace)]

    def _wl(self, name: str, ns: str | None = None) -> dict | None:
        js = self.world.get("JobSet", ns or self.namespace, name)
        return None if js is None else self.world.workload_of(js)

    def workload(self, name: str, ns: str | None = None) -> dict | None:
        with self.store.lock:
            return copy.deepcopy(self._wl(name, ns))

    def pods(self, name: str, ns: str | None = None) -> list[dict]:
        with self.store.lock:
            return copy.deepcopy(self.world.jobset_pods(name, ns))

    def events(self, ns: str | None = None) -> list[dict]:
        with self.store.lock:
            return copy.deepcopy(self.world.items("Event", ns or self.namespace))

    def on_create(self, callback: Callable[[str], None]) -> None:
        self.world.callbacks.append(callback)

    # -- deletions and grace periods
    @property
    def hold_deletions(self) -> bool:
        return self.world.sigterm_exit_s is None

    @hold_deletions.setter
    def hold_deletions(self, hold: bool) -> None:
        self.world.sigterm_exit_s = None if hold else 0.0

    def finish_deletions(self) -> list[str]:
        """The containers of every terminating pod exit now (143); returns the deleting JobSets that
        are then gone."""
        with self.store.lock:
            going = [o["metadata"]["name"] for o in self.world.items("JobSet", None) if deleting(o)]
            for pod in self.world.items("Pod", None):
                if deleting(pod) and not self.world._pod_stopped(pod):
                    self.world.container_exit(pod, self.world.sigterm_exit_code)
            self.world.reconcile()
            left = {o["metadata"]["name"] for o in self.world.items("JobSet", None)}
            return [n for n in going if n not in left]

    # -- Kueue's side
    def keep_pending(self, name: str, message: str | None = None) -> str:
        """No capacity arrives: the workload stays Pending with the scheduler's own message, which
        is returned (and must equal `message` when one is given)."""
        with self.store.lock:
            self.world.reconcile()
            wl = self._wl(name)
            if wl is None:
                raise KeyError(f"JobSet {name!r} has no Workload: {self.world.reconcile_errors}")
            c = kueue.find_cond(wl, "QuotaReserved") or {}
            if c.get("status") == "True":
                raise AssertionError(f"{name} already holds quota")
            got = c.get("message", "")
            if message is not None and got != message:
                raise AssertionError(f"Kueue's message for {name} is {got!r}, not {message!r}")
            return got

    def admit(self, name: str) -> None:
        """Capacity for exactly this workload appears in its ClusterQueue: Kueue admits it."""
        with self.store.lock:
            js = self._js(name)
            if QUEUE_LABEL not in (js["metadata"].get("labels") or {}):
                return  # not queued: never suspended
            self.world.reconcile()
            wl = self._built_workload(name, js)
            for _ in range(5):
                if kueue.has_quota_reservation(wl):
                    break
                _lq, cq = kueue.cluster_queue_for(self.world, wl)
                if cq is None:
                    raise AssertionError(
                        f"{name} cannot be admitted: "
                        + (kueue.find_cond(wl, "QuotaReserved") or {}).get("message", "")
                    )
                used = kueue.usage(self.world, cq["metadata"]["name"])
                for _ps, need in self.world.requests_of(wl):
                    for res, q in need.items():
                        flavor = self._flavor_for(cq, res)
                        short = q - (self._nominal(cq, flavor, res) - used.get((flavor, res), 0.0))
                        if short > 0:
                            self.world.add_quota(cq["metadata"]["name"], flavor, res, short)
                            used[(flavor, res)] = used.get((flavor, res), 0.0) + q
                self.world.reconcile()
                wl = self._built_workload(name, js)
            if not kueue.is_admitted(wl):
                raise AssertionError(f"{name} was not admitted: {kueue.find_cond(wl, 'QuotaReserved')}")

    def _built_workload(self, name: str, js: dict) -> dict:
        wl = self._wl(name)
        if wl is None:
            raise AssertionError(
                f"Kueue built no Workload for {name}: {self.world.reconcile_errors.get(js['metadata']['uid'])}"
            )
        return wl

    @staticmethod
    def _flavor_for(cq: dict, res: str) -> str:
        for g in cq["spec"]["resourceGroups"]:
            if res in g["coveredResources"]:
                return g["flavors"][0]["name"]
        return cq["spec"]["resourceGroups"][0]["flavors"][0]["name"]

    @staticmethod
    def _nominal(cq: dict, flavor: str, res: str) -> float:
        for g in cq["spec"]["resourceGroups"]:
            for f in g["flavors"]:
                if f["name"] == flavor:
                    for r in f["resources"]:
                        if r["name"] == res:
                            return kueue.quantity(r["nominalQuota"])
        return 0.0

    def evict(
        self,
        name: str,
        reason: str = "Preempted",
        preempted_reason: str | None = "InClusterQueue",
        message: str | None = None,
    ) -> None:
        """Preempted (InClusterQueue): a workload of higher priority that needs this one's quota
        arrives in the same ClusterQueue. Another reason: Kueue evicts with it (Deactivated: the
        workload is deactivated)."""
        with self.store.lock:
            wl = self._wl(name)
            if wl is None:
                raise KeyError(f"JobSet {name!r} has no Workload (no queue label?)")
            if reason == "Preempted":
                if preempted_reason not in ("InClusterQueue", None) or message is not None:
                    raise AssertionError(
                        "only preemption within the ClusterQueue is modelled; Kueue writes the message itself"
                    )
                pre = self.world.arrive(
                    f"high-priority-{secrets.token_hex(3)}",
                    wl["spec"]["queueName"],
                    kueue.priority(wl) + 1000,
                    wl["spec"]["podSets"][0]["template"],
                    wl["spec"]["podSets"][0]["count"],
                    wl["metadata"]["namespace"],
                )
                pre["spec"]["podSets"] = copy.deepcopy(wl["spec"]["podSets"])
                self.world.save("Workload", pre)
            elif reason.startswith("Deactivated"):
                wl["spec"]["active"] = False
                self.world.save("Workload", wl)
            else:
                if reason in ("PodsReadyTimeout", "AdmissionCheck"):
                    kueue.update_requeue_state(self.world, wl)
                kueue.evict(
                    self.world,
                    wl,
                    reason,
                    message
                    or {
                        "PodsReadyTimeout": f"Exceeded the PodsReady timeout {wl['metadata']['namespace']}/"
                        f"{wl['metadata']['name']}",
                        "NodeFailures": "Workload was evicted as there was no replacement for a failed node",
                    }.get(reason, f"The workload was evicted: {reason}"),
                )
            self.world.reconcile()

    # -- the nodes and the containers
    def run_pods(self, name: str) -> None:
        """Nodes come up: every pod not yet bound gets one and its containers start."""
        with self.store.lock:
            for k, pod in enumerate(self.world.jobset_pods(name)):
                if not pod["spec"].get("nodeName") and not pod_terminal(pod) and not deleting(pod):
                    if self.world.pull_image(pod, f"gke-tpu-{k:04d}"):  # an image pull fault may hold it
                        self.world.start_pod(pod, f"gke-tpu-{k:04d}")
            self.world.reconcile()

    def log(self, name: str, index: int, lines: list[str] | tuple[str, ...]) -> None:
        with self.store.lock:
            pod = self.world.jobset_pods(name)[index]
            self.store.logs.setdefault((pod["metadata"]["namespace"], pod["metadata"]["name"]), []).extend(
                lines
            )

    def pod_exit(
        self,
        name: str,
        index: int,
        code: int,
        log_lines: list[str] | tuple[str, ...] = (),
        reason: str | None = None,
        disruption: str | None = None,
    ) -> str:
        """Pod `index`'s container exits with `code` (started first if it had not); returns its name.
        `disruption` adds a DisruptionTarget condition with that reason."""
        with self.store.lock:
            pod = self.world.jobset_pods(name)[index]
            if not pod["spec"].get("nodeName"):
                self.world.start_pod(pod, f"gke-tpu-{index:04d}")
            self.world.container_exit(
                pod,
                code,
                log_lines,
                reason,
                (disruption, DISRUPTION_MESSAGES.get(disruption, disruption)) if disruption else None,
            )
            self.world.reconcile()
            return pod["metadata"]["name"]

    def unschedulable(
        self,
        name: str,
        message: str = "0/16 nodes are available: 16 Insufficient google.com/tpu. "
        "preemption: 0/16 nodes are available: 16 No preemption "
        "victims found for incoming pod.",
    ) -> None:
        with self.store.lock:
            for pod in self.world.jobset_pods(name, live_only=True):
                pod["status"]["phase"] = "Pending"
                pod["status"]["conditions"] = [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": message,
                        "lastTransitionTime": self.world.now(),
                    }
                ]
                self.world.save("Pod", pod)
                self.world.event(pod, "FailedScheduling", message, "Warning", source="default-scheduler")
            self.world.reconcile()

    def image_pull_error(
        self,
        name: str,
        index: int = 0,
        reason: str = "ErrImagePull",
        message: str = 'failed to pull and unpack image "us-docker.pkg.dev/p/r/olmo:missing": not found',
    ) -> None:
        with self.store.lock:
            pod = self.world.jobset_pods(name)[index]
            for cs in pod["status"]["containerStatuses"]:
                cs.update(
                    ready=False, started=False, state={"waiting": {"reason": reason, "message": message}}
                )
            self.world.save("Pod", pod)
            self.world.event(pod, "Failed", f"Failed to pull image: {message}", "Warning")
            self.world.reconcile()

    def node_lost(self, name: str, index: int) -> str:
        """The node under pod `index` goes away: the taint manager marks the pod (DisruptionTarget
        DeletionByTaintManager) and deletes it; with the node gone, pod GC marks it Failed and
        removes it once the Job controller has counted it. Returns its name."""
        with self.store.lock:
            pod = self.world.jobset_pods(name)[index]
            self.world.event(
                pod,
                "TaintManagerEviction",
                f"Marking for deletion Pod {pod['metadata']['namespace']}/{pod['metadata']['name']}",
                source="taint-eviction-controller",
            )
            self.world.add_disruption(
                pod, "DeletionByTaintManager", DISRUPTION_MESSAGES["DeletionByTaintManager"]
            )
            pod["status"]["phase"] = "Failed"
            for c in pod["status"].get("conditions") or []:
                if c["type"] in ("Ready", "ContainersReady"):
                    c.update(status="False", reason="PodFailed")
            self.world.save("Pod", pod)
            self.world.delete("Pod", pod, grace_s=0)
            self.world.reconcile()
            return pod["metadata"]["name"]

    def node_maintenance(self, name: str, index: int) -> str:
        """The node under pod `index` shuts down for maintenance: the kubelet's graceful node
        shutdown marks the pod (DisruptionTarget TerminationByKubelet), its container gets SIGTERM
        and exits 143, and the pod ends Failed with reason Terminated. Returns its name."""
        with self.store.lock:
            pod = self.world.jobset_pods(name)[index]
            self.world.add_disruption(
                pod, "TerminationByKubelet", DISRUPTION_MESSAGES["TerminationByKubelet"]
            )
            self.world.container_exit(pod, self.world.sigterm_exit_code)
            pod["status"].update(
                reason="Terminated", message="Pod was terminated in response to imminent node shutdown."
            )
            self.world.save("Pod", pod)
            self.world.reconcile()
            return pod["metadata"]["name"]

    def _first_live_pod(self, name: str) -> dict:
        self.world.reconcile()
        pods = self.world.jobset_pods(name, live_only=True)
        if not pods:
            raise AssertionError(f"{name} has no live pod (admitted? finished?)")
        return pods[0]

    def restart(self, name: str) -> None:
        """Pod 0's container exits 143 (killed from outside); the JobSet's failure policy decides."""
        with self.store.lock:
            pod = self._first_live_pod(name)
            if not pod["spec"].get("nodeName"):
                self.world.start_pod(pod, "gke-tpu-0000")
            self.world.container_exit(pod, 143)
            self.world.reconcile()

    def complete(self, name: str) -> None:
        """Every container exits 0."""
        with self.store.lock:
            for _ in range(10):
                js = self._js(name)
                if kueue.is_true(js, "Completed") or kueue.is_true(js, "Failed"):
                    return
                for pod in self.world.jobset_pods(name, live_only=True):
                    if not pod["spec"].get("nodeName"):
                        self.world.start_pod(pod, "gke-tpu-done")
                    self.world.container_exit(pod, 0)
                self.world.reconcile()
            raise AssertionError(f"{name} did not complete: {self._js(name).get('status')}")

    def fail(
        self, name: str, reason: str | None = None, message: str | None = None, exit_code: int = 143
    ) -> None:
        """Containers exit with `exit_code`, one at a time, until the JobSet has failed (restarts may
        come first, as its failure policy says). `reason`/`message`: what upstream must have written."""
        with self.store.lock:
            for _ in range(50):
                js = self._js(name)
                if kueue.is_true(js, "Failed"):
                    break
                pod = self._first_live_pod(name)
                if not pod["spec"].get("nodeName"):
                    self.world.start_pod(pod, "gke-tpu-fail")
                self.world.container_exit(pod, exit_code)
                self.world.reconcile()
            c = kueue.find_cond(self._js(name), "Failed")
            if not c or c["status"] != "True":
                raise AssertionError(f"{name} did not fail")
            if reason is not None and c["reason"] != reason:
                raise AssertionError(
                    f"under upstream's rules {name} failed with {c['reason']}: {c['message']!r}, not {reason}"
                )
            if message is not None and c["message"] != message:
                raise AssertionError(
                    f"under upstream's rules {name} failed with {c['message']!r}, not {message!r}"
                )


class KubeServer(ApiServer):
    """`with KubeServer() as srv:` a Kubernetes API on 127.0.0.1 with a cluster behind it."""

    def __init__(
        self,
        namespace: str = "default",
        port: int = 0,
        clock: Callable[[], float] = time.time,
        queues: tuple[str, ...] = DEFAULT_QUEUES,
    ):
        super().__init__(namespace, port, clock=clock)
        self.world = ScriptedWorld(self.store, namespace)
        self.api.hooks = self.world
        with self.store.lock:
            for q in queues:
                self.world.ensure_queue(
                    q, "cluster-queue", "tpu-flavor", {"google.com/tpu": 0, "cpu": 0, "memory": 0}
                )
            self.world.ensure_service_account(OLMO_CTL_SERVICE_ACCOUNT, gcp_account=SANDBOX_GCP_ACCOUNT)
        self.cluster = Cluster(self.world, self)


def tiny_jobset(
    name: str,
    run: str = "test-run",
    attempt: int = 1,
    namespace: str = "default",
    queue: str | None = "user-queue",
    workers: int = 2,
    image: str = "python:3.12-slim",
    script: str = "print('step 1/1 loss 1.0')",
    max_restarts: int = 0,
) -> dict:
    """A small JobSet shaped like olmo-ctl's (labels, one `slice` replicated job, a `trainer`
    container) that any cluster can run: `workers` CPU pods running `python -c script`."""
    labels = {"olmo-ctl/run": run, "olmo-ctl/attempt": str(attempt)}
    if queue:
        labels[QUEUE_LABEL] = queue
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "failurePolicy": {"maxRestarts": max_restarts},
            "replicatedJobs": [
                {
                    "name": "slice",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "parallelism": workers,
                            "completions": workers,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "template": {
                                "metadata": {
                                    "labels": {"olmo-ctl/run": run, "olmo-ctl/attempt": str(attempt)}
                                },
                                "spec": {
                                    "restartPolicy": "Never",
                                    "terminationGracePeriodSeconds": 5,
                                    "containers": [
                                        {
                                            "name": "trainer",
                                            "image": image,
                                            "command": ["python", "-c", script],
                                            "terminationMessagePolicy": "FallbackToLogsOnError",
                                            "resources": {
                                                "requests": {"cpu": "100m", "memory": "64Mi"},
                                                "limits": {"cpu": "500m", "memory": "256Mi"},
                                            },
                                        }
                                    ],
                                },
                            },
                        }
                    },
                }
            ],
        },
    }
