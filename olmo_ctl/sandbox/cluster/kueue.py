"""Kueue's rules for JobSets (kubernetes-sigs/kueue v0.17.1).

- `reconcile_job` mirrors pkg/controller/jobframework/reconciler.go ReconcileGenericJob (creating
  the Workload, finishing it, stopping the job on eviction and requeueing it once its pods are gone,
  starting it when admitted);
- `reconcile_workload` mirrors pkg/controller/core/workload_controller.go Reconcile (LocalQueue /
  ClusterQueue lookups, deactivation, the requeue backoff, the Admitted condition);
- `schedule` mirrors pkg/scheduler (flavorassigner messages, quota reservation, preemption within
  the ClusterQueue by priority, pkg/scheduler/preemption/preemption.go IssuePreemptions);
- `start_job` / `stop_job` mirror reconciler.go startJob / stopJob with pkg/podset/podset.go
  (FromAssignment + Merge: the flavors' node labels and tolerations into the pod templates;
  RestorePodSpec: the templates back to the Workload's pod sets);
- condition helpers mirror pkg/workload/workload.go and admissionchecks.go.
"""

from __future__ import annotations

import copy
import hashlib
import uuid
from typing import TYPE_CHECKING

from olmo_ctl.sandbox.cluster.objects import (
    JOB_UID_LABEL,
    JOBSET_API,
    KUEUE_API,
    PODSET_LABEL,
    PRIORITY_LABEL,
    QUEUE_LABEL,
    RESOURCE_IN_USE_FINALIZER,
    controlled_by,
    deleting,
    find_cond,
    format_quantity,
    is_true,
    labels,
    owner_ref,
    pod_requests,
    quantity,
    set_status_condition,
)

if TYPE_CHECKING:
    from olmo_ctl.sandbox.cluster.world import World

NO_REQUEUE_BACKOFF = ("PodsReadyTimeout", "AdmissionCheck")
HUMAN_PREEMPTION_REASONS = {
    "InClusterQueue": "prioritization in the ClusterQueue",
    "InCohortReclamation": "reclamation within the cohort",
}


# ---------------------------------------------------------------- pkg/workload/workload.go
def has_quota_reservation(wl: dict) -> bool:
    return is_true(wl, "QuotaReserved")


def is_admitted(wl: dict) -> bool:
    return is_true(wl, "Admitted")


def is_finished(wl: dict) -> bool:
    return is_true(wl, "Finished")


def is_evicted(wl: dict) -> bool:
    return is_true(wl, "Evicted")


def sync_admitted_condition(w: World, wl: dict) -> bool:
    """admissionchecks.go SyncAdmittedCondition (no admission checks here)."""
    want = has_quota_reservation(wl)
    if is_admitted(wl) == want:
        return False
    if want:
        return set_status_condition(wl, "Admitted", "True", "Admitted", "The workload is admitted", w.now())
    return set_status_condition(
        wl, "Admitted", "False", "NoReservation", "The workload has no reservation", w.now()
    )


def unset_quota_reservation(w: World, wl: dict, reason: str, message: str) -> bool:
    """workload.go UnsetQuotaReservationWithCondition."""
    changed = set_status_condition(wl, "QuotaReserved", "False", reason, message, w.now())
    if wl["status"].pop("admission", None) is not None:
        changed = True
    return sync_admitted_condition(w, wl) or changed


def set_requeued(w: World, wl: dict, reason: str, message: str, status: bool) -> bool:
    """workload.go SetRequeuedCondition."""
    return set_status_condition(wl, "Requeued", "True" if status else "False", reason, message, w.now())


def reset_active_condition(w: World, wl: dict, ctype: str, reason: str) -> None:
    """workload.go resetActiveCondition: a True condition becomes False, "Previously: ..."."""
    c = find_cond(wl, ctype)
    if c and c["status"] == "True":
        set_status_condition(wl, ctype, "False", reason, "Previously: " + (c.get("message") or ""), w.now())


def set_quota_reservation(w: World, wl: dict, admission: dict) -> None:
    """workload.go SetQuotaReservation."""
    wl.setdefault("status", {})["admission"] = admission
    set_status_condition(
        wl,
        "QuotaReserved",
        "True",
        "QuotaReserved",
        f"Quota reserved in ClusterQueue {admission['clusterQueue']}",
        w.now(),
    )
    reset_active_condition(w, wl, "Evicted", "QuotaReserved")
    reset_active_condition(w, wl, "Preempted", "QuotaReserved")


def evict(w: World, wl: dict, reason: str, message: str, underlying_cause: str = "") -> None:
    """workload.go Evict + prepareForEviction + reportEvictedWorkload: Evicted=True and the event
    `EvictedDueTo<reason>` (Deactivated with a cause: `EvictedDueToDeactivatedDueTo<cause>`)."""
    ev_reason = (
        reason if not (reason == "Deactivated" and underlying_cause) else f"{reason}DueTo{underlying_cause}"
    )
    set_status_condition(wl, "Evicted", "True", ev_reason, message, w.now())
    counts = wl["status"].setdefault("schedulingStats", {}).setdefault("evictions", [])
    row = next(
        (r for r in counts if r["reason"] == reason and r.get("underlyingCause", "") == underlying_cause),
        None,
    )
    if row is None:
        counts.append({"reason": reason, "underlyingCause": underlying_cause, "count": 1})
    else:
        row["count"] += 1
    if wl["status"].get("admission"):
        event = f"EvictedDueTo{reason}" + (
            f"DueTo{underlying_cause}" if reason == "Deactivated" and underlying_cause else ""
        )
        w.event(wl, event, message, source="kueue-admission")
    w.save("Workload", wl)


def update_requeue_state(w: World, wl: dict, base_s: float = 60, max_s: float = 3600) -> None:
    """workload.go UpdateRequeueState: requeueAt = now + base * 2^(count-1), at most max."""
    rs = wl["status"].setdefault("requeueState", {})
    rs["count"] = int(rs.get("count") or 0) + 1
    rs["requeueAt"] = w.now(min(base_s * 2 ** (rs["count"] - 1), max_s))


def priority(wl: dict) -> int:
    return int(wl["spec"].get("priority") or 0)


# ---------------------------------------------------------------- jobframework/reconciler.go
def workload_name(js: dict) -> str:
    """GetWorkloadNameForOwnerWithGVK: jobset-<name>-<5 hex of a hash of name, uid and kind>."""
    h = hashlib.sha256(f"{js['metadata']['name']}{js['metadata']['uid']}JobSet.jobset.x-k8s.io".encode())
    return f"jobset-{js['metadata']['name']}"[:57] + "-" + h.hexdigest()[:5]


def extract_priority(w: World, js: dict) -> tuple[dict, int]:
    """reconciler.go ExtractPriority: the WorkloadPriorityClass named by the label, else a pod
    priorityClassName's PriorityClass, else the global default PriorityClass, else 0. A missing
    class is an error (the reconcile fails and retries; no Workload is created)."""
    name = labels(js).get(PRIORITY_LABEL)
    if name:
        wpc = w.get("WorkloadPriorityClass", "", name)
        if wpc is None:
            raise LookupError(f'workloadpriorityclasses.kueue.x-k8s.io "{name}" not found')
        return {
            "priorityClassName": name,
            "priorityClassSource": "kueue.x-k8s.io/workloadpriorityclass",
        }, int(wpc.get("value") or 0)
    pcs = [
        rj["template"]["spec"]["template"].get("spec", {}).get("priorityClassName")
        for rj in js["spec"]["replicatedJobs"]
    ]
    pc_name = next((p for p in pcs if p), None)
    if pc_name:
        pc = w.get("PriorityClass", "", pc_name)
        if pc is None:
            raise LookupError(f'priorityclasses.scheduling.k8s.io "{pc_name}" not found')
        return {"priorityClassName": pc_name, "priorityClassSource": "scheduling.k8s.io/priorityclass"}, int(
            pc.get("value") or 0
        )
    defaults = [pc for pc in w.items("PriorityClass", "") if pc.get("globalDefault")]
    if defaults:
        pc = min(defaults, key=lambda p: int(p.get("value") or 0))
        return {
            "priorityClassName": pc["metadata"]["name"],
            "priorityClassSource": "scheduling.k8s.io/priorityclass",
        }, int(pc.get("value") or 0)
    return {}, 0


def construct_workload(w: World, js: dict) -> dict:
    """reconciler.go ConstructWorkload + the JobSet integration's PodSets + prepareWorkload."""
    ref, prio = extract_priority(w, js)
    pod_sets = [
        {
            "name": rj["name"],
            "count": int(rj.get("replicas", 1)) * int(rj["template"]["spec"].get("parallelism", 1)),
            "template": w.copy(rj["template"]["spec"]["template"]),
        }
        for rj in js["spec"]["replicatedJobs"]
    ]
    return {
        "apiVersion": KUEUE_API,
        "kind": "Workload",
        "metadata": {
            "name": workload_name(js),
            "namespace": js["metadata"]["namespace"],
            "uid": str(uuid.uuid4()),
            "generation": 1,
            "creationTimestamp": w.now(),
            "labels": {JOB_UID_LABEL: js["metadata"]["uid"]},
            "ownerReferences": [owner_ref(js, JOBSET_API, "JobSet")],
        },
        "spec": {
            "queueName": labels(js)[QUEUE_LABEL],
            "podSets": pod_sets,
            "priority": prio,
            "active": True,
            **ref,
        },
    }


def job_active(js: dict) -> bool:
    """The JobSet integration's IsActive: some replicated job has active Jobs."""
    return any(
        int(r.get("active", 0)) > 0 for r in (js.get("status") or {}).get("replicatedJobsStatus") or []
    )


def finished_message(js: dict) -> tuple[str, bool, bool]:
    """The JobSet integration's Finished: (message, success, finished)."""
    for t, ok in (("Completed", True), ("Failed", False)):
        c = find_cond(js, t)
        if c and c["status"] == "True":
            return c.get("message") or "", ok, True
    return "", False, False


# ---------------------------------------------------------------- pkg/podset/podset.go
class PodSetUpdateConflict(ValueError):
    """podset.go BadPodSetsUpdateError (ErrInvalidPodSetUpdate, a permanent error)."""


POD_SET_MAPS = (("metadata", "annotations"), ("metadata", "labels"), ("spec", "nodeSelector"))
POD_SET_LISTS = (("spec", "tolerations"), ("spec", "schedulingGates"))


def pod_set_info_from_assignment(w: World, psa: dict) -> dict:
    """podset.go FromAssignment (each flavor once: its nodeLabels into the node selector, its
    tolerations appended) + reconciler.go getPodSetsInfoFromStatus (the pod-set label). No
    scheduling gate: that is TopologyAwareScheduling's, for a topology assignment only."""
    info: dict = {
        "annotations": {},
        "labels": {PODSET_LABEL: psa["name"]},
        "nodeSelector": {},
        "tolerations": [],
        "schedulingGates": [],
    }
    seen: set[str] = set()
    for flavor in (psa.get("flavors") or {}).values():
        if flavor in seen:
            continue
        seen.add(flavor)
        spec = (w.get("ResourceFlavor", "", flavor) or {}).get("spec") or {}
        info["nodeSelector"].update(spec.get("nodeLabels") or {})
        info["tolerations"].extend(w.copy(spec.get("tolerations") or []))
    return info


def merge_pod_set_info(tmpl: dict, info: dict) -> None:
    """podset.go Merge: annotations, labels and node selector added, a key already there with
    another value a conflict (utilmaps.HaveConflict, raised before anything changes); tolerations
    and scheduling gates appended unless an equal one is there."""
    for part, field in POD_SET_MAPS:
        have = (tmpl.get(part) or {}).get(field) or {}
        for k, v in have.items():
            if k in info[field] and info[field][k] != v:
                raise PodSetUpdateConflict(
                    f"invalid admission check PodSetUpdate: conflict for {field}: conflict for "
                    f"key={k}, value1={v}, value2={info[field][k]}"
                )
    for part, field in POD_SET_MAPS:
        if info[field]:
            dst = tmpl.setdefault(part, {})
            dst[field] = {**(dst.get(field) or {}), **info[field]}
    for part, field in POD_SET_LISTS:
        dst = tmpl.setdefault(part, {})
        merged = list(dst.get(field) or [])
        merged += [x for x in info[field] if x not in merged]
        if merged:
            dst[field] = merged


def restore_pod_spec(tmpl: dict, ps_template: dict) -> None:
    """podset.go FromPodSet + RestorePodSpec: annotations, labels, node selector, tolerations and
    scheduling gates set back to what the Workload's pod set recorded (an empty one removed)."""
    for part, field in POD_SET_MAPS + POD_SET_LISTS:
        want = copy.deepcopy((ps_template.get(part) or {}).get(field))
        if want:
            tmpl.setdefault(part, {})[field] = want
        else:
            (tmpl.get(part) or {}).pop(field, None)


# ---------------------------------------------------------------- jobframework/reconciler.go (start, stop)
def stop_job(w: World, js: dict, wl: dict | None, message: str) -> bool:
    """reconciler.go stopJob: suspend and RestorePodSetsInfo (the JobSet integration: each
    replicated job's pod template from the Workload's pod set); event Stopped."""
    if js["spec"].get("suspend"):
        return False
    js["spec"]["suspend"] = True
    if wl is not None:
        by_name = {ps["name"]: ps for ps in wl["spec"]["podSets"]}
        for rj in js["spec"]["replicatedJobs"]:
            ps = by_name.get(rj["name"])
            if ps:
                restore_pod_spec(rj["template"]["spec"]["template"], ps["template"])
    w.save("JobSet", js)
    w.event(js, "Stopped", message, source="jobset-kueue-controller")
    return True


def start_job(w: World, js: dict, wl: dict) -> None:
    """reconciler.go startJob + the JobSet integration's RunWithPodSetsInfo: podset.Merge of each
    assignment's info into its replicated job's pod template, unsuspended; event Started. A
    conflict raises PodSetUpdateConflict with the JobSet unchanged (the patch is not sent)."""
    adm = wl["status"]["admission"]
    merged = w.copy(js["spec"]["replicatedJobs"])
    for rj, psa in zip(merged, adm["podSetAssignments"], strict=False):
        merge_pod_set_info(rj["template"]["spec"]["template"], pod_set_info_from_assignment(w, psa))
    js["spec"]["replicatedJobs"] = merged
    js["spec"]["suspend"] = False
    w.save("JobSet", js)
    w.event(
        js, "Started", f"Admitted by clusterQueue {adm['clusterQueue']}", source="jobset-kueue-controller"
    )


def reconcile_job(w: World, js: dict) -> bool:
    """reconciler.go ReconcileGenericJob for one JobSet with a queue label."""
    if QUEUE_LABEL not in labels(js):
        return False
    ns = js["metadata"]["namespace"]
    wls = [x for x in w.items("Workload", ns) if controlled_by(x, js)]
    if deleting(js):  # dropFinalizers
        changed = False
        for x in wls:
            if RESOURCE_IN_USE_FINALIZER in (x["metadata"].get("finalizers") or []):
                x["metadata"]["finalizers"] = [
                    f for f in x["metadata"]["finalizers"] if f != RESOURCE_IN_USE_FINALIZER
                ]
                w.save("Workload", x)
                changed = True
        return changed
    wl = next((x for x in wls if not is_finished(x)), wls[0] if wls else None)
    if wl is not None and is_finished(wl):
        if RESOURCE_IN_USE_FINALIZER in (wl["metadata"].get("finalizers") or []):
            wl["metadata"]["finalizers"] = [
                f for f in wl["metadata"]["finalizers"] if f != RESOURCE_IN_USE_FINALIZER
            ]
            w.save("Workload", wl)
            return True
        return False
    message, success, done = finished_message(js)
    if done:
        if wl is not None:
            set_status_condition(
                wl, "Finished", "True", "Succeeded" if success else "Failed", message, w.now()
            )
            w.save("Workload", wl)
            w.event(
                js,
                "FinishedWorkload",
                f"Workload '{ns}/{wl['metadata']['name']}' is declared finished",
                source="jobset-kueue-controller",
            )
            return True
        return False
    if wl is None:  # handleJobWithNoWorkload
        if job_active(js):
            return False
        try:
            wl = construct_workload(w, js)
        except LookupError as e:
            w.reconcile_errors[js["metadata"]["uid"]] = str(e)
            return False
        w.reconcile_errors.pop(js["metadata"]["uid"], None)
        w.save("Workload", wl, new=True)
        w.event(
            js,
            "CreatedWorkload",
            f"Created Workload: {ns}/{wl['metadata']['name']}",
            source="jobset-kueue-controller",
        )
        return True
    ev = find_cond(wl, "Evicted")
    if ev and ev["status"] == "True":  # 6. handle eviction
        changed = stop_job(w, js, wl, ev.get("message") or "")
        if has_quota_reservation(wl) and not job_active(js):
            reason = ev["reason"]
            set_requeued(w, wl, reason, ev.get("message") or "", reason in ("Preempted", "NodeFailures"))
            unset_quota_reservation(w, wl, "Pending", ev.get("message") or "")
            w.save("Workload", wl)
            changed = True
        return changed
    if js["spec"].get("suspend"):  # 7. suspended: start once admitted
        if is_admitted(wl):
            try:
                start_job(w, js, wl)
            except PodSetUpdateConflict as e:  # IsPermanent: workload.Finish, no point in retrying
                set_status_condition(wl, "Finished", "True", "FailedToStart", str(e), w.now())
                w.save("Workload", wl)
            return True
        if wl["spec"].get("queueName") != labels(js)[QUEUE_LABEL]:
            wl["spec"]["queueName"] = labels(js)[QUEUE_LABEL]
            w.save("Workload", wl)
            return True
        return False
    if not is_admitted(wl):  # 8. running but not admitted
        return stop_job(w, js, wl, "Not admitted by cluster queue")
    return False


# ---------------------------------------------------------------- core/workload_controller.go
def cluster_queue_for(w: World, wl: dict) -> tuple[dict | None, dict | None]:
    lq = w.get("LocalQueue", wl["metadata"]["namespace"], wl["spec"].get("queueName") or "")
    cq = w.get("ClusterQueue", "", (lq.get("spec") or {}).get("clusterQueue", "")) if lq else None
    return lq, cq


def inactive_reason(w: World, cq: dict) -> tuple[str, str] | None:
    """cache/scheduler/clusterqueue.go inactiveReason: (reason, message) of an inactive
    ClusterQueue (stopped, or a ResourceFlavor it names does not exist), None when active."""
    reasons, messages = [], []
    if (cq.get("spec") or {}).get("stopPolicy", "None") != "None":
        reasons.append("Stopped")
        messages.append("is stopped")
    missing = sorted(
        {
            f["name"]
            for g in (cq.get("spec") or {}).get("resourceGroups") or []
            for f in g.get("flavors") or []
            if w.get("ResourceFlavor", "", f["name"]) is None
        }
    )
    if missing:
        reasons.append("FlavorNotFound")
        messages.append(f"references missing ResourceFlavor(s): {','.join(missing)}")
    if not reasons:
        return None
    return reasons[0], f"Can't admit new workloads: {', '.join(messages)}."


def queue_counts(wls: list[dict]) -> dict[str, int]:
    """The workload counts a queue's status reports (queue.Manager Pending, the cache's reserving
    and admitted workloads): what `kubectl get localqueue,clusterqueue` prints as PENDING WORKLOADS
    and ADMITTED WORKLOADS. Finished and deactivated workloads count in none."""
    live = [wl for wl in wls if not is_finished(wl) and not deleting(wl)]
    return {
        "pendingWorkloads": sum(
            1 for wl in live if not has_quota_reservation(wl) and wl["spec"].get("active") is not False
        ),
        "reservingWorkloads": sum(1 for wl in live if has_quota_reservation(wl)),
        "admittedWorkloads": sum(1 for wl in live if is_admitted(wl)),
    }


def reconcile_cluster_queue(w: World, cq: dict) -> bool:
    """clusterqueue_controller.go: the Active condition from the cache's view of the queue, and
    updateCqStatusIfChanged's workload counts."""
    before = w.snapshot(cq)
    why = inactive_reason(w, cq)
    if why is None:
        set_status_condition(cq, "Active", "True", "Ready", "Can admit new workloads", w.now())
    else:
        set_status_condition(cq, "Active", "False", why[0], why[1], w.now())
    name = cq["metadata"]["name"]
    mine = [
        wl
        for wl in w.items("Workload", None)
        if ((wl.get("status") or {}).get("admission") or {}).get("clusterQueue") == name
        or (cluster_queue_for(w, wl)[1] or {}).get("metadata", {}).get("name") == name
    ]
    cq.setdefault("status", {}).update(queue_counts(mine))
    return w.commit("ClusterQueue", cq, before)


def reconcile_local_queue(w: World, lq: dict) -> bool:
    """localqueue_controller.go: the workload counts of the queue (its Workloads' spec.queueName)."""
    before = w.snapshot(lq)
    ns, name = lq["metadata"]["namespace"], lq["metadata"]["name"]
    mine = [wl for wl in w.items("Workload", ns) if wl["spec"].get("queueName") == name]
    lq.setdefault("status", {}).update(queue_counts(mine))
    return w.commit("LocalQueue", lq, before)


def reconcile_workload(w: World, wl: dict) -> bool:
    """workload_controller.go Reconcile for one Workload; returns whether anything changed."""
    if is_finished(wl) or deleting(wl):
        return False
    before = w.snapshot(wl)
    if wl["spec"].get("active") is False:
        if not is_evicted(wl):
            cause, why = w.deactivation_causes.get(wl["metadata"]["uid"], ("", ""))
            msg = "The workload is deactivated" + (f" due to {why}" if why else "")
            evict(w, wl, "Deactivated", msg, underlying_cause=cause)
        return w.commit("Workload", wl, before)
    rq = find_cond(wl, "Requeued")
    if rq and rq["status"] == "False" and rq["reason"] in NO_REQUEUE_BACKOFF:
        at = (wl["status"].get("requeueState") or {}).get("requeueAt")
        if at is None or at <= w.now():
            wl["status"].get("requeueState", {}).pop("requeueAt", None)
            set_requeued(w, wl, "BackoffFinished", "The workload backoff was finished", True)
    if not is_admitted(wl) and sync_admitted_condition(w, wl) and is_admitted(wl):
        w.event(
            wl,
            "Admitted",
            f"Admitted by ClusterQueue {wl['status']['admission']['clusterQueue']}, "
            "wait time since reservation was 0s",
            source="kueue-admission",
        )
    if is_admitted(wl) and w.pods_ready_timeout_s is not None:
        check_pods_ready(w, wl, w.pods_ready_timeout_s)
    if not has_quota_reservation(wl):
        lq, cq = cluster_queue_for(w, wl)
        if lq is None:
            unset_quota_reservation(
                w, wl, "Inadmissible", f"LocalQueue {wl['spec'].get('queueName')} doesn't exist"
            )
        elif lq.get("spec", {}).get("stopPolicy", "None") != "None":
            unset_quota_reservation(
                w, wl, "Inadmissible", f"LocalQueue {wl['spec'].get('queueName')} is inactive"
            )
        elif cq is None:
            unset_quota_reservation(
                w, wl, "Inadmissible", f"ClusterQueue {lq['spec'].get('clusterQueue')} doesn't exist"
            )
        elif inactive_reason(w, cq) is not None:
            unset_quota_reservation(
                w, wl, "Inadmissible", f"ClusterQueue {cq['metadata']['name']} is inactive"
            )
    return w.commit("Workload", wl, before)


def check_pods_ready(w: World, wl: dict, timeout_s: float) -> None:
    """waitForPodsReady: PodsReady from the JobSet's ready replicas (the integration's PodsReady);
    past the timeout the workload is evicted with PodsReadyTimeout and a requeue backoff."""
    js = w.owner_jobset(wl)
    ready = js is not None and sum(
        int(r.get("ready", 0)) + int(r.get("succeeded", 0))
        for r in (js.get("status") or {}).get("replicatedJobsStatus") or []
    ) == sum(int(rj.get("replicas", 1)) for rj in js["spec"]["replicatedJobs"])
    if ready:
        set_status_condition(
            wl,
            "PodsReady",
            "True",
            "PodsReady",
            "All pods reached readiness and the workload is running",
            w.now(),
        )
        return
    set_status_condition(
        wl, "PodsReady", "False", "WaitForStart", "Not all pods are ready or succeeded", w.now()
    )
    adm = find_cond(wl, "Admitted")
    if adm and not is_evicted(wl) and w.seconds_since(adm["lastTransitionTime"]) >= timeout_s:
        # workload_controller.go triggerDeactivation: past requeuingStrategy's
        # backoffLimitCount the workload is deactivated (SetDeactivationTarget RequeuingLimitExceeded),
        # then evicted as Deactivated with that cause; otherwise UpdateRequeueState and a requeue.
        limit = w.requeuing_backoff_limit_count
        count = int((wl["status"].get("requeueState") or {}).get("count") or 0)
        if limit is not None and count + 1 > limit:
            wl["spec"]["active"] = False
            w.deactivation_causes[wl["metadata"]["uid"]] = (
                "RequeuingLimitExceeded",
                "exceeding the maximum number of re-queuing retries",
            )
            return
        update_requeue_state(w, wl)
        evict(
            w,
            wl,
            "PodsReadyTimeout",
            f"Exceeded the PodsReady timeout {wl['metadata']['namespace']}/{wl['metadata']['name']}",
        )


# ---------------------------------------------------------------- pkg/scheduler
def usage(w: World, cq_name: str, skip: set[str] | frozenset = frozenset()) -> dict[tuple[str, str], float]:
    """(flavor, resource) -> quantity reserved by the workloads holding quota in this ClusterQueue."""
    out: dict[tuple[str, str], float] = {}
    for wl in w.items("Workload", None):
        adm = (wl.get("status") or {}).get("admission")
        if not adm or adm.get("clusterQueue") != cq_name or wl["metadata"]["uid"] in skip or is_finished(wl):
            continue
        for psa in adm["podSetAssignments"]:
            for res, flavor in (psa.get("flavors") or {}).items():
                q = (psa.get("resourceUsage") or {}).get(res, 0)
                out[(flavor, res)] = out.get((flavor, res), 0.0) + quantity(q)
    return out


def assign_flavors(w: World, wl: dict, cq: dict, used: dict) -> tuple[dict | None, str]:
    """flavorassigner: for each pod set, the first flavor of the resource group covering each
    resource whose node labels agree with the pods' nodeSelector and whose unused quota suffices.
    Returns (admission, "") or (None, "couldn't assign flavors to pod set X: ...")."""
    cq_name = cq["metadata"]["name"]
    groups = (cq.get("spec") or {}).get("resourceGroups") or []
    assignments = []
    taken = dict(used)
    for ps in wl["spec"]["podSets"]:
        per_pod = pod_requests(ps["template"])
        selector = (ps["template"].get("spec") or {}).get("nodeSelector") or {}
        flavors: dict[str, str] = {}
        usage_out: dict[str, str] = {}
        for res, q in sorted(per_pod.items()):
            need = q * int(ps["count"])
            group = next((g for g in groups if res in (g.get("coveredResources") or [])), None)
            if group is None:
                if need:
                    return (
                        None,
                        f"couldn't assign flavors to pod set {ps['name']}: resource {res} unavailable in "
                        "ClusterQueue",
                    )
                continue
            reasons = []
            for fq in group.get("flavors") or []:
                fname = fq["name"]
                rf = w.get("ResourceFlavor", "", fname)
                node_labels = ((rf or {}).get("spec") or {}).get("nodeLabels") or {}
                if any(k in selector and selector[k] != v for k, v in node_labels.items()):
                    reasons.append(f"flavor {fname} doesn't match node affinity")
                    continue
                nominal = next(
                    (
                        quantity(r.get("nominalQuota", 0))
                        for r in fq.get("resources") or []
                        if r["name"] == res
                    ),
                    0.0,
                )
                free = nominal - taken.get((fname, res), 0.0)
                if need <= free + 1e-9:
                    flavors[res] = fname
                    usage_out[res] = format_quantity(res, need)
                    taken[(fname, res)] = taken.get((fname, res), 0.0) + need
                    break
                reasons.append(
                    f"insufficient unused quota for {res} in flavor {fname}, "
                    f"{format_quantity(res, need - max(free, 0.0))} more needed"
                )
            else:
                return None, f"couldn't assign flavors to pod set {ps['name']}: " + ", ".join(reasons)
        assignments.append(
            {"name": ps["name"], "flavors": flavors, "resourceUsage": usage_out, "count": ps["count"]}
        )
    return {"clusterQueue": cq_name, "podSetAssignments": assignments}, ""


def schedule(w: World) -> bool:
    """One scheduling cycle over the pending workloads, highest priority first, then oldest
    (BestEffortFIFO): reserve quota, or preempt lower-priority workloads in the same ClusterQueue
    (withinClusterQueue LowerPriority), or leave it Pending with the flavor assigner's message."""
    changed = False
    pending = []
    for wl in w.items("Workload", None):
        if is_finished(wl) or deleting(wl) or wl["spec"].get("active") is False or has_quota_reservation(wl):
            continue
        rq = find_cond(wl, "Requeued")
        if rq and rq["status"] == "False" and rq["reason"] in NO_REQUEUE_BACKOFF + ("Deactivated",):
            continue  # waiting for its backoff (or deactivated)
        lq, cq = cluster_queue_for(w, wl)
        if lq is None or cq is None or inactive_reason(w, cq) is not None:
            continue
        pending.append((wl, cq))
    pending.sort(
        key=lambda p: (-priority(p[0]), p[0]["metadata"]["creationTimestamp"], p[0]["metadata"]["name"])
    )
    for wl, cq in pending:
        before = w.snapshot(wl)
        cq_name = cq["metadata"]["name"]
        admission, msg = assign_flavors(w, wl, cq, usage(w, cq_name))
        if admission is not None:
            set_quota_reservation(w, wl, admission)
            fins = wl["metadata"].setdefault("finalizers", [])
            if RESOURCE_IN_USE_FINALIZER not in fins:
                fins.append(RESOURCE_IN_USE_FINALIZER)
            w.save("Workload", wl)
            w.event(
                wl,
                "QuotaReserved",
                f"Quota reserved in ClusterQueue {cq_name}, wait time since queued was "
                f"{max(0, round(w.seconds_since(wl['metadata']['creationTimestamp'])))}s",
                source="kueue-admission",
            )
            changed = True
            continue
        if preempt_for(w, wl, cq):
            changed = True
        old = find_cond(wl, "QuotaReserved")
        if set_status_condition(wl, "QuotaReserved", "False", "Pending", msg, w.now()):
            if not old or old.get("message") != msg:
                w.event(wl, "Pending", msg, "Warning", source="kueue-admission")
        sync_admitted_condition(w, wl)
        changed = w.commit("Workload", wl, before) or changed
    return changed


def preempt_for(w: World, preemptor: dict, cq: dict) -> bool:
    """preemption.go: the lowest-priority (then most recently admitted) workloads of the same
    ClusterQueue with a lower priority, as few as make the preemptor fit; IssuePreemptions evicts
    them (Evicted=Preempted, Preempted=InClusterQueue) with upstream's message and events."""
    policy = ((cq.get("spec") or {}).get("preemption") or {}).get("withinClusterQueue", "Never")
    if policy not in ("LowerPriority", "LowerOrNewerEqualPriority"):
        return False
    cq_name = cq["metadata"]["name"]
    candidates = [
        x
        for x in w.items("Workload", None)
        if has_quota_reservation(x)
        and not is_finished(x)
        and (x["status"].get("admission") or {}).get("clusterQueue") == cq_name
        and priority(x) < priority(preemptor)
    ]
    candidates.sort(key=lambda x: (priority(x), _newest_reservation_first(x)))
    chosen: list[dict] = []
    for cand in candidates:
        chosen.append(cand)
        skip = {c["metadata"]["uid"] for c in chosen}
        if assign_flavors(w, preemptor, cq, usage(w, cq_name, skip))[0] is not None:
            break
    else:
        return False
    changed = False
    path = f"/{cq_name}"
    for target in chosen:
        if is_evicted(target):
            continue  # preemption ongoing
        jl = labels(preemptor).get(JOB_UID_LABEL) or "UNKNOWN"
        message = (
            f"Preempted to accommodate a workload (UID: {preemptor['metadata']['uid']}, JobUID: {jl}) due to "
            f"{HUMAN_PREEMPTION_REASONS['InClusterQueue']}; preemptor path: {path}; preemptee path: {path}"
        )
        set_status_condition(
            target, "Preempted", "True", "InClusterQueue", message, w.now(), observed_generation=False
        )
        evict(w, target, "Preempted", message)
        prio = (
            f"; preemptor effective priority: {priority(preemptor)} (base: {priority(preemptor)}, boost: 0); "
            f"preemptee effective priority: {priority(target)} (base: {priority(target)}, boost: 0)"
        )
        w.event(target, "Preempted", message + prio, source="kueue-admission")
        w.event(
            preemptor,
            "PreemptedWorkload",
            f"Preempted workload {target['metadata']['namespace']}/"
            f"{target['metadata']['name']} (UID: {target['metadata']['uid']}) in ClusterQueue {cq_name}{prio}",
            source="kueue-admission",
        )
        changed = True
    return changed


def _newest_reservation_first(wl: dict) -> str:
    """Sort key: the most recently reserved workload first; one without a reservation before all."""
    reserved = find_cond(wl, "QuotaReserved")
    return _neg(reserved["lastTransitionTime"]) if reserved else ""


def _neg(ts: str) -> str:
    """Sort key: a later timestamp first."""
    return "".join(chr(0x10FFFF - ord(ch)) for ch in ts)
