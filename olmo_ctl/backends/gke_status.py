"""Classification of a GKE attempt: JobSet + Kueue Workload + pods + events -> one `AttemptStatus`.

Pure: takes the objects as the API server returns them (plain dicts, camelCase) and returns a value.
The backend reads; this module decides. Every reason is copied from its source (a condition's
reason and message, a container's exit code and termination message, an event's message) so a user
can search for it.

Precedence, first match wins:
 1. no JobSet                                            -> MISSING
 2. JobSet condition Completed=True                      -> SUCCEEDED ("jobset completed successfully")
 3. JobSet condition Failed=True                         -> decided by the pods (the earliest failed
    container is the cause; the others were usually killed because of it):
      exit 1 or 2 (a deterministic Python error, bad input)  -> FAILED_USER, with its last lines
      143 (SIGTERM), 137 with a DisruptionTarget, node loss,
      pod evicted by the kubelet                              -> PREEMPTED
      137 OOMKilled, any other code                           -> FAILED_INFRA
      no pod left to tell                                     -> FAILED_INFRA with the JobSet's reason
 4. Workload condition Finished=True (JobSet not yet marked) -> SUCCEEDED / FAILED_INFRA by its reason
 5. Workload deactivated (spec.active=false, or Evicted reason Deactivated*) -> QUEUED with
    details["deactivated"] naming who deactivated it and why (`deactivated_by`): Kueue keeps the
    Workload and runs it again only once spec.active is true; the supervisor stops, the attempt kept
 6. Workload condition Evicted=True, any other reason (Preempted, NodeFailures, PodsReadyTimeout,
    AdmissionCheck, ClusterQueueStopped, LocalQueueStopped, ...) -> QUEUED with details["evicted"]
    (the reason, e.g. "Preempted (InClusterQueue)"): Kueue suspended the JobSet, its pods checkpoint
    through their grace period, and Kueue requeues this very Workload and resumes its JobSet on
    readmission (upstream reconciler.go, "handle eviction"; PodsReadyTimeout and AdmissionCheck after
    workload.go UpdateRequeueState's backoff, and past requeuingStrategy.backoffLimitCount Kueue
    deactivates it instead: row 5); the reason says how many pods are still terminating, then that it
    is requeued
 7. Workload without QuotaReserved=True, or reserved but not yet Admitted (admission checks),
    or the JobSet suspended                               -> QUEUED with Kueue's own message:
    waiting for capacity is never a failure. Except a queue set-up no capacity will ever change,
    which is QUEUED with details["config_error"] naming the missing object: a LocalQueue or
    ClusterQueue that does not exist (Inadmissible), a ClusterQueue with no flavor for the pod
    set (the flavor assigner's "doesn't match node affinity", "unavailable in ClusterQueue",
    "untolerated taint", "> maximum capacity"), and no Workload at all because an object Kueue
    needs to build it is missing (`missing`, e.g. the WorkloadPriorityClass: the backend looks)
 8. Admitted and not finished: the pods decide
      a container that cannot get its image (`image_pull_error`):
        permanent (InvalidImageName, ErrImageNeverPull, the registry says not found / denied /
        unauthorized)                             -> ADMITTED with details["config_error"] naming the
                                                     image (the supervisor exits 2 at once)
        anything else (ErrImagePull / ImagePullBackOff after a 429, a timeout, a reset)
                                                  -> ADMITTED with details["waiting"] = "image-pull" and
                                                     details["image"]: the kubelet retries with its
                                                     backoff; the supervisor waits (bounded)
      fewer pods than expected and a Job FailedCreate event (Pod Security, a ResourceQuota, an
        admission webhook refused them)                                          -> ADMITTED, with
        the event's message and details["not_created"] = True; except JobSet's own exclusive-
        placement refusals of follower pods until their leader is scheduled ("this is an expected,
        transient error", pod_admission_webhook.go v0.10.1), which are not a cause: the leader's
        own state (Unschedulable, Pending) is
      a pod Unschedulable (PodScheduled=False or a FailedScheduling event)       -> ADMITTED, with the
        scheduler's message, details["unschedulable"] = True, details["wait_cause"] "unschedulable";
        except when its node selector keeps a key its JobSet's template no longer has (an earlier
        admission's flavor, jobset#1294: stale_node_selector): no wait cause (no capacity fixes it;
        the supervisor's --admission-timeout replaces the attempt), the hold `stale-selector`
      a pod on a NotReady node (Ready=False and NodeNotReady, or Terminating after taint eviction)
                                                          -> ADMITTED, details["wait_cause"] "node-not-ready"
      a pod the kubelet refused (UnexpectedAdmissionError) -> ADMITTED, "kubelet-admission"
      (a wait_cause is waiting for capacity: the supervisor waits, no --admission-timeout)
      (the supervisor stops an attempt admitted but not running past --admission-timeout)
      every expected pod Running                                                -> RUNNING
      otherwise                                                                 -> ADMITTED ("k/n pods running")
    A pod that already failed while the JobSet has not (it may still restart the slice) is named
    in the reason; the state stays live.

`last_log_lines` comes from the container's termination message (with
`terminationMessagePolicy: FallbackToLogsOnError` that is the log tail) or from `logs`, a
{pod name: [lines]} map the backend fills for the pod named in `details["pod"]`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from olmo_ctl.backends.base import AttemptStatus, Hold, State
from olmo_ctl.core.contracts import EXIT_SIGKILL, EXIT_SIGTERM, exit_state

IMAGE_ERRORS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
# Waiting reasons the kubelet never retries past: the image reference or the pull policy is wrong.
PERMANENT_IMAGE_ERRORS = frozenset({"InvalidImageName", "ErrImageNeverPull"})
# A registry's answers that no retry changes (the tag or repository does not exist, the node's
# account may not read it), as containerd and Artifact Registry word them. A 429, a timeout or a
# reset is none of these: the kubelet's next pull may succeed.
_PERMANENT_PULL = re.compile(
    r"\bnot found\b|manifest unknown|name unknown|repository does not exist|pull access denied"
    r"|\bdenied\b|\bunauthorized\b|\b401\b|\b403 Forbidden\b",
    re.IGNORECASE,
)
# JobSet v0.10.1 pkg/webhooks/pod_admission_webhook.go: follower pods are refused until the leader
# pod of their Job is scheduled (or while it is being replaced); the Job controller retries them.
TRANSIENT_REFUSALS = ("this is an expected, transient error",)
# Kueue `Evicted` reasons after which Kueue requeues the same workload at once (Requeued=True). The
# others (PodsReadyTimeout, AdmissionCheck) requeue it too, after a backoff.
NO_BLAME_EVICTIONS = frozenset(
    {"Preempted", "NodeFailures", "ClusterQueueStopped", "LocalQueueStopped", "WorkloadSliceReplaced"}
)
# Pod-level signals that the node or the scheduler took the pod away.
NODE_LOSS_POD_REASONS = frozenset(
    {"NodeLost", "Evicted", "Shutdown", "Terminated", "NodeShutdown", "UnexpectedAdmissionError"}
)
NODE_LOSS_EVENT_REASONS = frozenset(
    {"NodeNotReady", "NodeLost", "TaintManagerEviction", "Preempted", "Preempting", "Evicted", "NodeShutdown"}
)


# The flavor assigner's reasons (kueue v0.17.1 pkg/scheduler/flavorassigner/flavorassigner.go) that
# no capacity will change: the ClusterQueue has no flavor this pod set can use.
_NEVER_FITS = re.compile(
    r"flavor \S+ not found|flavor \S+ doesn't match node affinity|untolerated taint .*? in flavor \S+"
    r"|resource \S+ unavailable in ClusterQueue"
    r"|insufficient quota for \S+ in flavor \S+, previously considered podsets requests \([^)]*\) \+ "
    r"current podset request \([^)]*\) > maximum capacity \([^)]*\)"
)
# workload_controller.go: the LocalQueue or ClusterQueue a Workload names does not exist.
_NO_QUEUE = re.compile(r"^(LocalQueue|ClusterQueue) \S+ doesn't exist$")


def queue_config_error(qr: Mapping | None) -> str | None:
    """Kueue's message when the Workload can never be admitted as the queues are set up, else None."""
    if not qr or qr.get("status") == "True":
        return None
    reason, msg = qr.get("reason") or "", (qr.get("message") or "").strip()
    if reason == "Inadmissible" and _NO_QUEUE.match(msg):
        return msg
    if reason == "Pending" and msg.startswith("couldn't assign flavors to pod set "):
        for part in msg.split("; "):
            body = part.split(": ", 1)[1] if ": " in part else ""
            if not body or _NEVER_FITS.sub("", body).replace(",", "").strip():
                return None  # some pod set only waits for capacity (or says something we do not know)
        return msg
    return None


# workload_controller.go / workload.go: the Evicted reasons of a deactivation Kueue itself decided.
KUEUE_DEACTIVATIONS = {
    "DeactivatedDueToRequeuingLimitExceeded": "Kueue (requeuingStrategy.backoffLimitCount exceeded)",
    "DeactivatedDueToMaximumExecutionTimeExceeded": "Kueue (maximumExecutionTimeSeconds exceeded)",
}


def deactivated_by(workload: Mapping, ev: Mapping | None) -> str:
    """Who set spec.active=false on this Workload, and why: Kueue with its reason, else whoever wrote
    it (the field manager of spec.active in managedFields, when the server records them: kubectl,
    an admin's tool), an admin hold."""
    reason = (ev or {}).get("reason") or ""
    msg = ((ev or {}).get("message") or "").strip()
    if reason in KUEUE_DEACTIVATIONS:
        return f"{KUEUE_DEACTIVATIONS[reason]}: {msg or reason}"
    manager = ""
    for mf in (workload.get("metadata") or {}).get("managedFields") or []:
        spec = ((mf.get("fieldsV1") or {}).get("f:spec")) or {}
        if "f:active" in spec and mf.get("manager"):
            manager = str(mf["manager"])
    who = f"`{manager}`" if manager else "someone outside Kueue"
    return f"{who} set spec.active=false on Workload {(workload.get('metadata') or {}).get('name')} (a hold)"


def condition(obj: Mapping | None, ctype: str) -> dict | None:
    """The status condition of type `ctype`, or None."""
    if not obj:
        return None
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c
    return None


def true_condition(obj: Mapping | None, ctype: str) -> dict | None:
    """The status condition of type `ctype` when its status is "True", else None."""
    c = condition(obj, ctype)
    return c if c and c.get("status") == "True" else None


def is_true(obj: Mapping | None, ctype: str) -> bool:
    return true_condition(obj, ctype) is not None


def _cond_text(c: Mapping) -> str:
    reason, msg = c.get("reason") or "", (c.get("message") or "").strip()
    return f"{reason}: {msg}" if reason and msg else (reason or msg)


@dataclass(frozen=True)
class ContainerExit:
    pod: str
    container: str
    exit_code: int
    reason: str  # the container's terminated.reason (Error, OOMKilled, Completed, ...)
    message: str  # terminated.message: the log tail with FallbackToLogsOnError
    finished_at: str
    disrupted: str  # the pod's DisruptionTarget reason, or a node-loss pod reason, or ""

    @property
    def verdict(self) -> State:
        """The trainer's exit code decides (`contracts.exit_state`), except that a pod the node or the
        control plane took away is preempted whatever it exited with, and an OOM-kill is infrastructure."""
        if self.disrupted:
            return State.PREEMPTED
        if self.exit_code == EXIT_SIGKILL and self.reason == "OOMKilled":
            return State.FAILED_INFRA
        state = exit_state(self.exit_code)[0]
        return State.FAILED_INFRA if state == State.SUCCEEDED else state

    def describe(self) -> str:
        text = f"pod {self.pod} container {self.container} exited {self.exit_code}"
        if self.exit_code == EXIT_SIGTERM:
            text += " (SIGTERM)"
        elif self.exit_code == EXIT_SIGKILL:
            text += " (SIGKILL)"
        if self.reason and self.reason not in ("Error", "Completed"):
            text += f" [{self.reason}]"
        if self.disrupted:
            text += f" after {self.disrupted}"
        last = _last_line(self.message)
        if last:
            text += f": {last}"
        return text


def _last_line(text: str) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def pod_disruption(pod: Mapping, events: Sequence[Mapping] = ()) -> str:
    """Why the node or the control plane took this pod away ("" if nothing says so)."""
    st = pod.get("status") or {}
    for c in st.get("conditions") or []:
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            return f"DisruptionTarget {c.get('reason') or ''}".strip()
    if st.get("reason") in NODE_LOSS_POD_REASONS:
        return f"pod {st['reason']}" + (f" ({st['message']})" if st.get("message") else "")
    name = (pod.get("metadata") or {}).get("name")
    for ev in events:
        io = ev.get("involvedObject") or {}
        if io.get("kind") == "Pod" and io.get("name") == name and ev.get("reason") in NODE_LOSS_EVENT_REASONS:
            return f"event {ev['reason']}"
    return ""


def container_exits(pods: Sequence[Mapping], events: Sequence[Mapping] = ()) -> list[ContainerExit]:
    """Every non-zero container exit, the likeliest cause first."""
    out = []
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "?")
        st = pod.get("status") or {}
        disrupted = pod_disruption(pod, events)
        for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
            for key in ("state", "lastState"):
                term = (cs.get(key) or {}).get("terminated")
                if term and int(term.get("exitCode") or 0) != 0:
                    out.append(
                        ContainerExit(
                            name,
                            cs.get("name", "?"),
                            int(term["exitCode"]),
                            term.get("reason") or "",
                            term.get("message") or "",
                            term.get("finishedAt") or "",
                            disrupted,
                        )
                    )
                    break

    # Timestamps have 1 s resolution, and the JobSet kills the other pods within the same second as
    # the first failure, so ties are broken by evidence: a disruption the control plane recorded,
    # then a deterministic user exit, then a bare SIGTERM/SIGKILL (usually the JobSet's own kill).
    def evidence(e: ContainerExit) -> int:
        if e.disrupted:
            return 0
        if e.verdict == State.FAILED_USER:
            return 1
        if e.exit_code in (EXIT_SIGTERM, EXIT_SIGKILL):
            return 2
        return 3

    # An unknown finish time sorts last: it cannot be shown to be the first failure.
    return sorted(out, key=lambda e: (e.finished_at or "~", evidence(e), e.pod))


@dataclass(frozen=True)
class ImagePullError:
    pod: str
    container: str
    image: str
    reason: str  # the container's waiting reason (ErrImagePull, ImagePullBackOff, InvalidImageName, ...)
    message: str  # its waiting message; a bare "Back-off pulling image" with the last pull failure event
    permanent: bool

    def describe(self) -> str:
        return f"pod {self.pod} container {self.container}: {self.reason}" + (
            f": {self.message}" if self.message else ""
        )


def image_pull_error(pod: Mapping, events: Sequence[Mapping] = ()) -> ImagePullError | None:
    """The first container of `pod` waiting for an image it cannot get, or None. Permanent: the
    kubelet's InvalidImageName / ErrImageNeverPull, or a registry answer no retry changes
    (`_PERMANENT_PULL`) in the waiting message or the pod's latest pull failure event (an
    ImagePullBackOff message may only say "Back-off pulling image")."""
    md = pod.get("metadata") or {}
    name = md.get("name", "?")
    st = pod.get("status") or {}
    images = {c.get("name"): c.get("image") for c in (pod.get("spec") or {}).get("containers") or []}
    images.update(
        {c.get("name"): c.get("image") for c in (pod.get("spec") or {}).get("initContainers") or []}
    )
    for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
        w = (cs.get("state") or {}).get("waiting") or {}
        reason = w.get("reason")
        if reason not in IMAGE_ERRORS:
            continue
        msg = (w.get("message") or "").strip()
        pulls = [
            e
            for e in _events_about(events, "Pod", name)
            if e.get("reason") == "Failed" and (e.get("message") or "").startswith("Failed to pull image")
        ]
        last = (pulls[-1].get("message") or "").strip() if pulls else ""
        told = (
            f"{msg} ({last})"
            if msg.startswith("Back-off") and last and last not in msg and msg not in last
            else (msg or last)
        )
        permanent = reason in PERMANENT_IMAGE_ERRORS or bool(_PERMANENT_PULL.search(told))
        return ImagePullError(
            name,
            cs.get("name", "?"),
            images.get(cs.get("name")) or cs.get("image") or "?",
            reason,
            told,
            permanent,
        )
    return None


def current_failed_creates(events: Sequence[Mapping], jobs: Sequence[Mapping]) -> list[Mapping]:
    """The FailedCreate events of the Jobs that exist now. A JobSet restart recreates its Jobs
    under the same names (new uids): an event about an earlier Job of the same name is history.
    An event that names no uid counts when its Job name exists now."""
    uids = {(j.get("metadata") or {}).get("uid") for j in jobs}
    names = {(j.get("metadata") or {}).get("name") for j in jobs}
    out = []
    for e in events:
        io = e.get("involvedObject") or {}
        if io.get("kind") != "Job" or e.get("reason") != "FailedCreate":
            continue
        if (io.get("uid") in uids) if io.get("uid") else (io.get("name") in names):
            out.append(e)
    return out


def transient_refusal(message: str) -> bool:
    """A pod refusal its source calls transient (JobSet's exclusive placement before the leader is
    scheduled): the Job controller retries it, nothing needs fixing."""
    return any(t in (message or "") for t in TRANSIENT_REFUSALS)


def _pod_done(pod: Mapping) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def expected_pods(jobset: Mapping) -> int:
    n = 0
    for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []:
        spec = (rj.get("template") or {}).get("spec") or {}
        par = spec.get("parallelism", 1)
        comp = spec.get("completions")
        n += int(rj.get("replicas", 1)) * int(min(par, comp) if comp is not None else par)
    return n


# JobSet's pod webhook gives a follower pod its leader's topology as a node selector (exclusive placement).
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
# JobSet's controller adds this one to a Job of the node-selector exclusive-placement strategy
# (addNamespacedJobNodeSelector; api/jobset/v1alpha2 NamespacedJobKey): not in the JobSet's template.
NAMESPACED_JOB = "alpha.jobset.sigs.k8s.io/namespaced-job"
REPLICATED_JOB_NAME = "jobset.sigs.k8s.io/replicatedjob-name"
JOBSET_1294 = "jobset#1294"


def stale_node_selector(jobset: Mapping, pod: Mapping) -> dict[str, str]:
    """The pod's node-selector entries its JobSet's pod template no longer has: left by an earlier
    admission on another flavor. JobSet's resumeJob merges the readmitted template's node selector
    into the suspended Job's and never removes a key (pkg/controllers/jobset_controller.go, v0.10.1
    and every release since; kubernetes-sigs/jobset#1294 unmerged), while Kueue puts only the current
    flavor's labels in the template. The exclusive-placement selectors JobSet itself adds are not."""
    meta = pod.get("metadata") or {}
    rj = ((meta.get("labels") or {}).get(REPLICATED_JOB_NAME)) or (meta.get("annotations") or {}).get(
        REPLICATED_JOB_NAME
    )
    templates = [
        ((r.get("template") or {}).get("spec") or {}).get("template") or {}
        for r in (jobset.get("spec") or {}).get("replicatedJobs") or []
        if rj is None or r.get("name") == rj
    ]
    if len(templates) != 1:
        return {}
    want = (templates[0].get("spec") or {}).get("nodeSelector") or {}
    own = (meta.get("annotations") or {}).get(EXCLUSIVE_TOPOLOGY)
    have = (pod.get("spec") or {}).get("nodeSelector") or {}
    return {k: v for k, v in have.items() if k not in want and k not in (own, NAMESPACED_JOB)}


def _events_about(events: Sequence[Mapping], kind: str, name: str) -> list[Mapping]:
    def when(ev):
        return ev.get("lastTimestamp") or ev.get("eventTime") or ev.get("firstTimestamp") or ""

    return sorted(
        (
            e
            for e in events
            if (e.get("involvedObject") or {}).get("kind") == kind
            and (e.get("involvedObject") or {}).get("name") == name
        ),
        key=when,
    )


def _exit_status(
    ex: ContainerExit, source_prefix: str, logs: Mapping[str, list[str]] | None, extra: dict
) -> AttemptStatus:
    lines = tuple((logs or {}).get(ex.pod) or [ln for ln in ex.message.splitlines() if ln.strip()])
    reason = ex.describe()
    if not _last_line(ex.message) and lines:
        reason += f": {lines[-1].strip()}"
    return AttemptStatus(
        ex.verdict,
        reason,
        f"{source_prefix}pod {ex.pod} container {ex.container}",
        exit_code=ex.exit_code,
        last_log_lines=lines[-50:],
        details={"pod": ex.pod, "container": ex.container, **extra},
    )


def classify(
    jobset: Mapping | None,
    workload: Mapping | None,
    pods: Sequence[Mapping] = (),
    events: Sequence[Mapping] = (),
    logs: Mapping[str, list[str]] | None = None,
    missing: tuple[str, ...] = (),
) -> AttemptStatus:
    """Normalise one attempt's objects into an `AttemptStatus` (precedence in the module docstring).
    A JobSet being deleted keeps its state (its pods may still be writing a checkpoint); the
    reason says so and `details["deleting"]` is set. `missing`: objects Kueue needs to build the
    Workload that the backend found missing (e.g. 'WorkloadPriorityClass "high" does not exist')."""
    st = _classify(jobset, workload, pods, events, logs, tuple(missing))
    if jobset and (jobset.get("metadata") or {}).get("deletionTimestamp"):
        st = replace(st, reason=f"being deleted; {st.reason}", details={**st.details, "deleting": True})
    return typed(st)


def typed(st: AttemptStatus) -> AttemptStatus:
    """The classifier's working vocabulary (`details`) as the contract's typed fields, which are what
    the supervisor, the policy and the eval job read."""
    d = st.details
    return replace(
        st,
        wait_cause=str(d["wait_cause"]) if d.get("wait_cause") else None,
        config_error=str(d["config_error"]) if d.get("config_error") else None,
        deactivated=str(d["deactivated"]) if d.get("deactivated") else None,
        evicted=str(d["evicted"]) if d.get("evicted") else None,
        preempted=bool(d.get("evicted")) and d.get("eviction_reason") == "Preempted",
        image_pull=str(d.get("image") or "") if d.get("waiting") == "image-pull" else None,
        pods_refused=bool(d.get("not_created")),
        cause=str(d["cause"]) if d.get("cause") else None,
        restarts=int(d.get("restarts") or 0),
        workload=str(d["workload"]) if d.get("workload") else None,
        hold=Hold(**d["hold"]) if st.state.live and d.get("hold") else None,
    )


def _hold(details: dict, kind: str, message: str, by: str) -> None:
    """Record what holds the attempt (the typed `AttemptStatus.hold`), in its source's words."""
    details["hold"] = {"kind": kind, "message": message.strip(), "by": by}


# Kueue's prefix of each pod set's part of a pending message (flavorassigner.go)
_POD_SET_PREFIX = re.compile(r"couldn't assign flavors to pod set \S+: ")


def _queue_hold(details: dict, qr: Mapping | None, msg: str, config_error: str | None) -> None:
    """Why Kueue has not reserved quota: too little quota left, no flavor or queue that could ever
    fit, or a wait its message says no more about."""
    text = ((qr or {}).get("message") or "").strip() or msg
    if config_error:
        kind = "no-queue" if _NO_QUEUE.match(config_error) else "no-flavor"
    elif re.search(r"insufficient (unused )?quota", text):
        kind = "quota"
    else:
        kind = "queued"
    _hold(details, kind, _POD_SET_PREFIX.sub("", text), "Kueue")


def _classify(
    jobset: Mapping | None,
    workload: Mapping | None,
    pods: Sequence[Mapping],
    events: Sequence[Mapping],
    logs: Mapping[str, list[str]] | None,
    missing: tuple[str, ...] = (),
) -> AttemptStatus:
    pods, events = list(pods or []), list(events or [])
    if not jobset:
        return AttemptStatus(State.MISSING, "the JobSet does not exist", "JobSet")
    js_name = (jobset.get("metadata") or {}).get("name", "")
    js_status = jobset.get("status") or {}
    details: dict = {"jobset": js_name, "restarts": int(js_status.get("restarts") or 0)}
    if workload:
        details["workload"] = (workload.get("metadata") or {}).get("name")

    # 2. success
    c = true_condition(jobset, "Completed")
    if c is not None:
        return AttemptStatus(
            State.SUCCEEDED,
            _cond_text(c) or "jobset completed successfully",
            "JobSet condition Completed",
            exit_code=0,
            details=details,
        )

    # 3. JobSet failure: the pods say why
    c = true_condition(jobset, "Failed")
    if c is not None:
        details["jobset_reason"] = _cond_text(c)
        exits = container_exits(pods, events)
        if exits:
            return _exit_status(exits[0], "JobSet Failed; ", logs, details)
        # No container evidence: the JobSet reason is all there is.
        for pod in pods:
            d = pod_disruption(pod, events)
            if d:
                return AttemptStatus(
                    State.PREEMPTED,
                    f"JobSet failed ({_cond_text(c)}); {d}",
                    "JobSet condition Failed",
                    details=details,
                )
        return AttemptStatus(
            State.FAILED_INFRA,
            f"JobSet failed ({_cond_text(c)}); no pod left to tell why",
            "JobSet condition Failed",
            details=details,
        )

    if workload:
        # 4. Kueue saw it finish before the JobSet status did
        fin = true_condition(workload, "Finished")
        if fin is not None:
            ok = fin.get("reason") == "Succeeded"
            return AttemptStatus(
                State.SUCCEEDED if ok else State.FAILED_INFRA,
                _cond_text(fin),
                "Workload condition Finished",
                exit_code=0 if ok else None,
                details=details,
            )
        ev = true_condition(workload, "Evicted")
        # 5. deactivated: Kueue runs it again only once someone sets spec.active=true
        active = (workload.get("spec") or {}).get("active", True)
        if active is False or (ev is not None and (ev.get("reason") or "").startswith("Deactivated")):
            text = _cond_text(ev) if ev is not None else "the Workload was deactivated (spec.active=false)"
            details["deactivated"] = deactivated_by(workload, ev)
            _hold(details, "deactivated", details["deactivated"], "Kueue")
            return AttemptStatus(
                State.QUEUED,
                text,
                "Workload condition Evicted" if ev is not None else "Workload spec",
                details=details,
            )
        # 6. eviction: every reason but deactivation is a requeue of this same Workload
        if ev is not None:
            reason = ev.get("reason") or ""
            pre = true_condition(workload, "Preempted")
            text = reason
            if pre and pre.get("reason"):
                text += f" ({pre['reason']})"
            if ev.get("message"):
                text += f": {ev['message']}"
            details["eviction_reason"] = reason
            details["requeued"] = is_true(workload, "Requeued")
            # Kueue suspended the JobSet (JobSet v0.10.1 suspendJobs suspends its Jobs, whose pods are
            # deleted and checkpoint through their grace period) and requeues this same JobSet once
            # they are gone: still live.
            details["evicted"] = reason + (f" ({pre['reason']})" if pre and pre.get("reason") else "")
            terminating = sum(1 for p in pods if not _pod_done(p))
            details["pods_terminating"] = terminating
            qr = condition(workload, "QuotaReserved")
            requeue = (workload.get("status") or {}).get("requeueState") or {}
            if terminating:
                text += f"; {terminating} pod(s) terminating (checkpointing on SIGTERM)"
            elif reason not in NO_BLAME_EVICTIONS and not details["requeued"] and requeue.get("requeueAt"):
                # PodsReadyTimeout, AdmissionCheck: workload.go UpdateRequeueState's backoff first
                text += f"; requeued by Kueue after its backoff (at {requeue['requeueAt']})"
            elif not (qr and qr.get("status") == "True"):
                text += "; requeued by Kueue" + (
                    f", {_cond_text(qr)}"
                    if qr and qr.get("message") and qr.get("message") != ev.get("message")
                    else ""
                )
            _hold(details, "requeued", text, "Kueue")
            return AttemptStatus(State.QUEUED, text, "Workload condition Evicted", details=details)
        # 7. waiting for capacity
        qr = condition(workload, "QuotaReserved")
        if not (qr and qr.get("status") == "True"):
            msg = _cond_text(qr) if qr else "waiting for Kueue to reserve quota"
            details["queue_reason"] = (qr or {}).get("reason") or ""
            # A missing LocalQueue or a ClusterQueue without a flavor for the slice waits forever.
            bad = queue_config_error(qr)
            if bad:
                details["config_error"] = bad
            _queue_hold(details, qr, msg, bad)
            return AttemptStatus(State.QUEUED, msg, "Workload condition QuotaReserved", details=details)
        adm = condition(workload, "Admitted")
        if not (adm and adm.get("status") == "True"):
            checks = [
                f"{a.get('name')}: {a.get('state')}" + (f" ({a['message']})" if a.get("message") else "")
                for a in (workload.get("status") or {}).get("admissionChecks") or []
            ]
            msg = "quota reserved, waiting for admission checks" + (
                ": " + "; ".join(checks) if checks else ""
            )
            _hold(details, "admission-check", "; ".join(checks) or "quota reserved, checks pending", "Kueue")
            return AttemptStatus(State.QUEUED, msg, "Workload condition Admitted", details=details)
        details["cluster_queue"] = ((workload.get("status") or {}).get("admission") or {}).get("clusterQueue")
    if (jobset.get("spec") or {}).get("suspend"):
        sus = condition(jobset, "Suspended")
        msg = "the JobSet is suspended" + (f" ({_cond_text(sus)})" if sus else "")
        if not workload:
            msg += "; no Kueue Workload owns it yet"
            if missing:  # upstream only logs why it cannot build the Workload; the backend looked
                details["config_error"] = "Kueue cannot create the Workload: " + "; ".join(missing)
                msg += f" ({'; '.join(missing)})"
        _hold(details, "no-workload" if details.get("config_error") else "queued", msg, "Kueue")
        return AttemptStatus(State.QUEUED, msg, "JobSet spec.suspend", details=details)

    # 8. admitted: the pods decide
    return _classify_pods(jobset, pods, events, logs, details)


def _on_not_ready_node(pod: Mapping, events: Sequence[Mapping], any_ready: bool = False) -> bool:
    """The node lifecycle controller marked this pod not ready because its node is (MarkPodsNotReady:
    Ready=False and a NodeNotReady event); `any_ready`: whatever its Ready condition says now (a pod
    deleted by taint eviction)."""
    st = pod.get("status") or {}
    if not any_ready:
        if st.get("phase") != "Running":
            return False
        ready = next((c for c in st.get("conditions") or [] if c.get("type") == "Ready"), None)
        if not ready or ready.get("status") == "True":
            return False
    name = (pod.get("metadata") or {}).get("name")
    return any(
        e.get("reason") == "NodeNotReady"
        and (e.get("involvedObject") or {}).get("kind") == "Pod"
        and (e.get("involvedObject") or {}).get("name") == name
        for e in events
    )


def _current_rejection(events: Sequence[Mapping], jobset_name: str) -> Mapping | None:
    """The kubelet's latest `UnexpectedAdmissionError` about a pod of this JobSet when no container of
    its pods started after it. The refused pod itself is usually gone already: the Job failed on it
    and the JobSet's restart deleted it (the launch template's RestartOnPodNotStarted), and the new
    pods wait for the kubelet's next decision."""

    def when(ev: Mapping) -> str:
        return ev.get("lastTimestamp") or ev.get("eventTime") or ev.get("firstTimestamp") or ""

    ours = [
        e
        for e in events
        if (e.get("involvedObject") or {}).get("kind") == "Pod"
        and str((e.get("involvedObject") or {}).get("name") or "").startswith(f"{jobset_name}-")
        and e.get("reason") in ("UnexpectedAdmissionError", "Started")
    ]
    if not ours:
        return None
    last = max(ours, key=lambda e: (when(e), e.get("reason") == "Started"))
    return last if last.get("reason") == "UnexpectedAdmissionError" else None


def _classify_pods(
    jobset: Mapping,
    pods: Sequence[Mapping],
    events: Sequence[Mapping],
    logs: Mapping[str, list[str]] | None,
    details: dict,
) -> AttemptStatus:
    want = expected_pods(jobset)
    # Terminating pods of a JobSet that lives on are being replaced (a restart): they do not count.
    # While the JobSet itself is deleted they are all there is, still running their grace period.
    deleting = bool((jobset.get("metadata") or {}).get("deletionTimestamp"))
    live = [p for p in pods if deleting or not (p.get("metadata") or {}).get("deletionTimestamp")]
    # On a NotReady node (node lifecycle: Ready=False, a NodeNotReady event) a pod's phase stays
    # Running while nothing of it is known to run: not counted as running.
    on_not_ready = [p for p in live if _on_not_ready_node(p, events)]
    running = sum(
        1 for p in live if (p.get("status") or {}).get("phase") == "Running" and p not in on_not_ready
    )
    details.update(pods_expected=want, pods_running=running, pods_seen=len(live))
    pulls = [e for e in (image_pull_error(p, events) for p in live) if e is not None]
    # One pod that can never get its image decides, whatever the others wait for.
    for pull in sorted(pulls, key=lambda e: not e.permanent)[:1]:
        details.update(pod=pull.pod, container=pull.container, image=pull.image)
        if pull.permanent:
            details["config_error"] = f"image {pull.image} cannot be pulled: {pull.reason}" + (
                f": {pull.message}" if pull.message else ""
            )
            _hold(details, "bad-image", f"{pull.image}: {pull.reason}", "kubelet")
        else:
            details.update(waiting="image-pull", cause=f"image {pull.image}: {pull.reason}: {pull.message}")
            _hold(details, "image-pull", pull.image, "kubelet")
        return AttemptStatus(
            State.ADMITTED, pull.describe(), f"pod {pull.pod} container status", details=details
        )
    if len(live) < want:
        # Pods the API server refused: the Job controller records FailedCreate and retries forever.
        refused = [
            e
            for e in events
            if (e.get("involvedObject") or {}).get("kind") == "Job"
            and e.get("reason") == "FailedCreate"
            and not transient_refusal(e.get("message") or "")
        ]
        if refused:
            ev = max(refused, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
            job = (ev.get("involvedObject") or {}).get("name", "?")
            details.update(not_created=True, cause=f"FailedCreate: Job {job}: {ev.get('message') or ''}")
            _hold(details, "pods-refused", f"Job {job}: {ev.get('message') or ''}", "API server")
            return AttemptStatus(
                State.ADMITTED,
                f"{len(live)}/{want} pods created; {details['cause']}",
                f"Job {job} events FailedCreate",
                details=details,
            )
    for pod in live:
        name = pod["metadata"]["name"]
        st = pod.get("status") or {}
        if st.get("phase") not in (None, "Pending"):
            continue
        sched = next((c for c in st.get("conditions") or [] if c.get("type") == "PodScheduled"), None)
        fs = [e for e in _events_about(events, "Pod", name) if e.get("reason") == "FailedScheduling"]
        if (sched and sched.get("status") == "False" and sched.get("reason") == "Unschedulable") or fs:
            msg = (fs[-1].get("message") if fs else None) or (sched or {}).get("message") or ""
            reason = f"Unschedulable: pod {name}: {msg}".rstrip(": ")
            hold, by, cause = msg or f"pod {name}", "scheduler", reason
            stale = stale_node_selector(jobset, pod)
            if stale:
                # Not capacity: no node will ever carry both flavors' labels. No wait cause, so the
                # supervisor's --admission-timeout replaces the attempt with a fresh JobSet.
                keys = ", ".join(f"{k}={v}" for k, v in sorted(stale.items()))
                hold = (
                    f"pod {name} keeps node selector {keys} from an earlier admission on another flavor "
                    f"({JOBSET_1294}: JobSet never removes a readmitted Job's old node selector)"
                )
                reason, by, cause = f"Unschedulable: {hold}", "JobSet", f"{hold}: {msg}".rstrip(": ")
            else:
                details["wait_cause"] = "unschedulable"
            details.update(unschedulable=True, pod=name, cause=cause)
            _hold(details, "stale-selector" if stale else "unschedulable", hold, by)
            return AttemptStatus(
                State.ADMITTED,
                reason,
                "pod events FailedScheduling" if fs else f"pod {name} condition PodScheduled",
                details=details,
            )
    # Node health: pods on NotReady nodes (taint eviction after the 300 s toleration leaves them
    # Terminating until the kubelet is back), or refused by the kubelet of a just-repaired node.
    stuck = on_not_ready + [
        p
        for p in pods
        if not deleting
        and (p.get("metadata") or {}).get("deletionTimestamp")
        and not _pod_done(p)
        and _on_not_ready_node(p, events, any_ready=True)
    ]
    if stuck:
        name = stuck[0]["metadata"]["name"]
        details.update(
            pod=name, wait_cause="node-not-ready", cause=f"NodeNotReady: pod {name}: Node is not ready"
        )
        _hold(details, "node-not-ready", f"pod {name}: Node is not ready", "node lifecycle")
        return AttemptStatus(
            State.ADMITTED,
            f"{running}/{want} pods running; {len(stuck)} pod(s) on NotReady nodes (pod {name}: Node is not ready)",
            f"pod {name} events NodeNotReady",
            details=details,
        )
    refused = [p for p in live if (p.get("status") or {}).get("reason") == "UnexpectedAdmissionError"]
    rejection = None if refused or running >= want else _current_rejection(events, details["jobset"])
    if refused or rejection is not None:
        if refused:
            p0 = refused[0]
            name, msg = p0["metadata"]["name"], (p0.get("status") or {}).get("message") or ""
        else:
            assert rejection is not None
            name, msg = (
                (rejection.get("involvedObject") or {}).get("name", "?"),
                rejection.get("message") or "",
            )
        details.update(
            pod=name, wait_cause="kubelet-admission", cause=f"UnexpectedAdmissionError: pod {name}: {msg}"
        )
        _hold(details, "kubelet-admission", f"pod {name}: UnexpectedAdmissionError: {msg}", "kubelet")
        return AttemptStatus(
            State.ADMITTED,
            f"{running}/{want} pods running; the kubelet refused pod {name}: UnexpectedAdmissionError: {msg}",
            f"pod {name} status" if refused else f"pod {name} events UnexpectedAdmissionError",
            details=details,
        )
    exits = container_exits(live, events)
    note = ""
    if exits:
        note = f"; {exits[0].describe()} (the JobSet has not failed: it may restart)"
        details.update(pod=exits[0].pod, failed_exit_code=exits[0].exit_code)
    if details["restarts"]:
        note += f"; JobSet restarts: {details['restarts']}"
    if len(live) < want and any(
        (e.get("involvedObject") or {}).get("kind") == "Job"
        and e.get("reason") == "FailedCreate"
        and transient_refusal(e.get("message") or "")
        for e in events
    ):
        note += "; follower pods wait for their leader pod to be scheduled (JobSet exclusive placement)"
    if want and running >= want:
        return AttemptStatus(State.RUNNING, f"{running}/{want} pods running{note}", "pods", details=details)
    return AttemptStatus(State.ADMITTED, f"{running}/{want} pods running{note}", "pods", details=details)


def child_jobs(jobset: Mapping) -> int:
    """How many Jobs the JobSet runs at once: the sum of its replicated jobs' replicas."""
    return sum(int(r.get("replicas") or 1) for r in (jobset.get("spec") or {}).get("replicatedJobs") or [])


def counted_job_failures(jobset: Mapping, jobs: Sequence[Mapping]) -> tuple[tuple[str, str, str], ...]:
    """The child Jobs that failed on a rule of the JobSet's failure policy that counts (action
    RestartJobSet: a crash), as (name, uid, message), whatever rule JobSet applied to the restart.

    JobSet v0.10.1 (failure_policy.go) acts on the Jobs that are Failed when it looks. A crashed slice's
    Job is Failed only once its last pod has terminated (Kubernetes >= 1.31 sets FailureTarget first and
    Failed when no pod is left), so the Job of a peer slice whose hosts exited 3 on the lost peer can be
    Failed first: RestartOnLostPeer matches and nothing is counted. The crashed Job outlives that restart
    while it is deleted (JobSet deletes with Foreground propagation, `deleteJobs`), and its FailureTarget
    or Failed condition names the pod rule that ended it: matched here against the counting rules'
    reasons and message patterns."""
    rules = [
        r
        for r in ((jobset.get("spec") or {}).get("failurePolicy") or {}).get("rules") or []
        if r.get("action") == "RestartJobSet"
    ]
    out = []
    for job in jobs:
        for c in (job.get("status") or {}).get("conditions") or []:
            if c.get("type") not in ("FailureTarget", "Failed") or c.get("status") != "True":
                continue
            reason, msg = c.get("reason") or "", c.get("message") or ""
            for rule in rules:
                reasons = rule.get("onJobFailureReasons") or []
                patterns = rule.get("onJobFailureMessagePatterns") or []
                if (not reasons or reason in reasons) and (
                    not patterns or any(re.search(p, msg) for p in patterns)
                ):
                    md = job.get("metadata") or {}
                    out.append((str(md.get("name") or ""), str(md.get("uid") or ""), msg))
                    break
            else:
                continue
            break
    return tuple(out)
