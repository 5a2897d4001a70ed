"""The batch/v1 Job controller's rules, for Indexed Jobs as JobSet creates them.

Ported from kubernetes/kubernetes `pkg/controller/job/job_controller.go` (syncJob: counting
terminated pods through the `batch.kubernetes.io/job-tracking` finalizer, `backoffLimit`,
suspension, replacement pods, the FailureTarget → Failed and SuccessCriteriaMet → Complete
conditions, the terminal one delayed until no pod is terminating: delayTerminalCondition and
enactJobFinished, Kubernetes ≥ 1.31) and `pkg/controller/job/pod_failure_policy.go`
(matchPodFailurePolicy: rules in order, `onExitCodes` In/NotIn over non-zero exit codes,
`onPodConditions`, actions FailJob/Ignore/Count).
"""

from __future__ import annotations

import secrets
import uuid
from typing import TYPE_CHECKING

from olmo_ctl.sandbox.cluster.objects import (
    COMPLETION_INDEX,
    JOB_TRACKING_FINALIZER,
    controlled_by,
    deleting,
    find_cond,
    is_true,
    labels,
    owner_ref,
    pod_terminal,
    sidecars,
)

if TYPE_CHECKING:
    from olmo_ctl.sandbox.cluster.world import World

# pkg/controller/job/job_controller.go: the reasons and messages of the Job's terminal conditions.
BACKOFF_LIMIT_EXCEEDED = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
COMPLETIONS_REACHED = ("CompletionsReached", "Reached expected number of succeeded pods")
POD_FAILURE_POLICY = "PodFailurePolicy"


def match_pod_failure_policy(job: dict, pod: dict) -> tuple[str | None, str]:
    """pod_failure_policy.go matchPodFailurePolicy: the action of the first rule matching a failed
    pod (None: no rule matched, the failure counts) and, for FailJob, the Job's failure message."""
    rules = ((job["spec"].get("podFailurePolicy") or {}).get("rules")) or []
    ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    statuses = list((pod.get("status") or {}).get("initContainerStatuses") or []) + list(
        (pod.get("status") or {}).get("containerStatuses") or []
    )
    for i, rule in enumerate(rules):
        action = rule["action"]
        on_codes = rule.get("onExitCodes")
        if on_codes:
            for cs in statuses:
                term = (cs.get("state") or {}).get("terminated")
                if not term or (
                    on_codes.get("containerName") and on_codes["containerName"] != cs.get("name")
                ):
                    continue
                code = int(term.get("exitCode", 0))
                if code == 0:
                    continue  # matchOnExitCodes: a zero exit code never matches
                values = {int(v) for v in on_codes.get("values") or []}
                if (code in values) == (on_codes.get("operator", "In") == "In"):
                    msg = (
                        f"Container {cs.get('name')} for pod {ns}/{name} failed with exit code {code} "
                        f"matching {action} rule at index {i}"
                    )
                    return action, msg
        for pat in rule.get("onPodConditions") or []:
            c = find_cond(pod, pat["type"])
            if c and c.get("status") == pat.get("status", "True"):
                return (
                    action,
                    f"Pod {ns}/{name} has condition {pat['type']} matching {action} rule at index {i}",
                )
    return None, ""


def _set_job_condition(w: World, job: dict, ctype: str, status: str, reason: str, message: str) -> bool:
    conds = job.setdefault("status", {}).setdefault("conditions", [])
    c = next((c for c in conds if c["type"] == ctype), None)
    if c and (c["status"], c.get("reason"), c.get("message")) == (status, reason, message):
        return False
    if c is None:
        c = {"type": ctype}
        conds.append(c)
    if c.get("status") != status:
        c["lastTransitionTime"] = w.now()
    c.update(status=status, reason=reason, message=message, lastProbeTime=w.now())
    c.setdefault("lastTransitionTime", w.now())
    return True


def job_finished(job: dict) -> str | None:
    """`Complete` or `Failed` when that condition is True (JobSet's JobFinished)."""
    for t in ("Complete", "Failed"):
        if is_true(job, t):
            return t
    return None


def reconcile(w: World, job: dict) -> bool:
    """syncJob for one Job; returns whether anything changed."""
    changed = False
    pods = [p for p in w.items("Pod", job["metadata"]["namespace"]) if controlled_by(p, job)]
    spec, st = job["spec"], job.setdefault("status", {})
    counted = w.counted.setdefault(job["metadata"]["uid"], {})
    # Count terminated pods once, then let them go (the job-tracking finalizer).
    failure_target: tuple[str, str] | None = None
    for pod in pods:
        fins = pod["metadata"].get("finalizers") or []
        if JOB_TRACKING_FINALIZER not in fins or not (pod_terminal(pod) or deleting(job)):
            continue
        uid = pod["metadata"]["uid"]
        if uid not in counted and pod_terminal(pod) and not job_finished(job):
            if pod["status"]["phase"] == "Succeeded":
                counted[uid] = "succeeded:" + labels(pod).get(COMPLETION_INDEX, "0")
            elif uid in w.removed_by_suspend:
                counted[uid] = "suspended"  # pods deleted on suspension are not failures
            else:
                action, msg = match_pod_failure_policy(job, pod)
                if action == "FailJob" and failure_target is None:
                    failure_target = (POD_FAILURE_POLICY, msg)
                counted[uid] = "ignored" if action == "Ignore" else "failed"
        pod["metadata"]["finalizers"] = [f for f in fins if f != JOB_TRACKING_FINALIZER]
        w.save("Pod", pod)
        changed = True
    done_idx = {v.split(":", 1)[1] for v in counted.values() if v.startswith("succeeded:")}
    completions = int(spec.get("completions") or spec.get("parallelism") or 1)
    if deleting(job):
        return changed
    end: tuple[str, str, str] | None = None
    if not job_finished(job):
        # syncJob: an interim condition already set decides (SuccessCriteriaMet first, then
        # FailureTarget: newFailedConditionForFailureTarget keeps its reason and message).
        end = next(
            (
                (kind, c.get("reason") or "", c.get("message") or "")
                for interim, kind in (("SuccessCriteriaMet", "Complete"), ("FailureTarget", "Failed"))
                if (c := find_cond(job, interim)) and c.get("status") == "True"
            ),
            None,
        )
        failed = sum(1 for v in counted.values() if v == "failed")
        if end is None:
            if failure_target:
                end = ("Failed",) + failure_target
            elif failed > int(spec.get("backoffLimit", 6)):
                end = ("Failed",) + BACKOFF_LIMIT_EXCEEDED
            elif len(done_idx) >= completions:
                end = ("Complete",) + COMPLETIONS_REACHED
            if end:
                kind, reason, message = end
                interim = "FailureTarget" if kind == "Failed" else "SuccessCriteriaMet"
                changed |= _set_job_condition(w, job, interim, "True", reason, message)
        if end:
            changed |= _finish(w, job, pods, counted, *end)
    live = [p for p in pods if not pod_terminal(p) and not deleting(p)]
    if job_finished(job) or end:  # a finishing Job creates no pod; its remaining pods are deleted
        for pod in live:
            w.delete("Pod", pod)
            changed = True
    elif spec.get("suspend"):
        for pod in live:
            w.removed_by_suspend.add(pod["metadata"]["uid"])
            w.delete("Pod", pod)
            changed = True
        if _set_job_condition(w, job, "Suspended", "True", "JobSuspended", "Job suspended"):
            st.pop("startTime", None)
            w.event(job, "Suspended", "Job suspended", source="job-controller")
            changed = True
    else:
        c = find_cond(job, "Suspended")
        if c and c["status"] == "True":
            _set_job_condition(w, job, "Suspended", "False", "JobResumed", "Job resumed")
            w.event(job, "Resumed", "Job resumed", source="job-controller")
            changed = True
        if "startTime" not in st:
            st["startTime"] = w.now()
            changed = True
        # Replacement pods: with a podFailurePolicy only once the old pod is terminal (podReplacementPolicy
        # Failed); without, as soon as it is terminating (TerminatingOrFailed).
        wait_terminal = bool(spec.get("podFailurePolicy")) or spec.get("podReplacementPolicy") == "Failed"
        for i in range(completions):
            if str(i) in done_idx:
                continue
            mine = [p for p in pods if labels(p).get(COMPLETION_INDEX) == str(i) and not pod_terminal(p)]
            if any(not deleting(p) or wait_terminal for p in mine):
                continue
            pod = new_pod(w, job, i)
            refused = w.refuse_pod(pod)
            if refused:  # the pod's admission said no: job_controller.go records FailedCreate and retries
                key = (job["metadata"]["uid"], i, refused)
                if key not in w.failed_creates:
                    w.failed_creates.add(key)
                    w.event(
                        job,
                        "FailedCreate",
                        f"Error creating: {refused}"
                        if refused.startswith("admission webhook ")
                        else f'Error creating: pods "{job["metadata"]["name"]}-{i}-" is forbidden: {refused}',
                        "Warning",
                        source="job-controller",
                    )
                continue
            w.save("Pod", pod, new=True)
            changed = True
    pods = [p for p in w.items("Pod", job["metadata"]["namespace"]) if controlled_by(p, job)]
    failed = sum(1 for v in counted.values() if v == "failed")
    counts = {
        "active": sum(1 for p in pods if not pod_terminal(p) and not deleting(p)),
        "ready": sum(1 for p in pods if not pod_terminal(p) and not deleting(p) and is_true(p, "Ready")),
        "terminating": sum(1 for p in pods if not pod_terminal(p) and deleting(p)),
        "failed": failed,
        "succeeded": len(done_idx),
    }
    if any(st.get(k, 0) != v for k, v in counts.items()):
        st.update(counts)
        changed = True
    if changed:
        w.save("Job", job)
    return changed


def _finish(
    w: World, job: dict, pods: list[dict], counted: dict, kind: str, reason: str, message: str
) -> bool:
    """The Job meets its end (FailureTarget or SuccessCriteriaMet is set): syncJob deletes the active
    pods (deleteActivePods), trackJobStatusAndRemoveFinalizers lets every pod's tracking finalizer go
    (canRemoveFinalizer: the Job has a finished condition), counting a not-yet-terminal pod as failed
    when the Job fails; enactJobFinished adds Failed/Complete only once no pod is terminating, since
    delayTerminalCondition() holds (JobManagedBy || JobPodReplacementPolicy, on by default: the
    latter is beta from 1.29, and the delay itself came with 1.31). recordJobFinished: the event."""
    changed = False
    for pod in pods:
        if not pod_terminal(pod) and not deleting(pod):
            w.delete("Pod", pod)
            changed = True
        fins = pod["metadata"].get("finalizers") or []
        if JOB_TRACKING_FINALIZER not in fins:
            continue
        uid = pod["metadata"]["uid"]
        if uid not in counted and kind == "Failed" and not pod_terminal(pod):
            action, _ = match_pod_failure_policy(job, pod)
            counted[uid] = "ignored" if action == "Ignore" else "failed"
        pod["metadata"]["finalizers"] = [f for f in fins if f != JOB_TRACKING_FINALIZER]
        w.save("Pod", pod)
        changed = True
    # controller.CountTerminatingPods: a deletionTimestamp and a phase neither Succeeded nor Failed.
    if any(deleting(p) and not pod_terminal(p) for p in pods):
        return changed
    _set_job_condition(w, job, kind, "True", reason, message)
    if kind == "Complete":
        job["status"]["completionTime"] = w.now()
    w.event(
        job,
        reason if kind == "Failed" else "Completed",
        message if kind == "Failed" else "Job completed",
        "Warning" if kind == "Failed" else "Normal",
        source="job-controller",
    )
    return True


def _waiting(c: dict, reason: str) -> dict:
    """A container's status before it starts: waiting for `reason`."""
    return {
        "name": c["name"],
        "image": c.get("image", ""),
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "started": False,
        "state": {"waiting": {"reason": reason}},
    }


def new_pod(w: World, job: dict, index: int) -> dict:
    """A pod of an Indexed Job: `<job>-<index>-<5 random>`, the Job's labels, the tracking finalizer."""
    tmpl = job["spec"]["template"]
    jname = job["metadata"]["name"]
    lab = dict((tmpl.get("metadata") or {}).get("labels") or {})
    lab.update(
        {
            "batch.kubernetes.io/controller-uid": job["metadata"]["uid"],
            "controller-uid": job["metadata"]["uid"],
            "batch.kubernetes.io/job-name": jname,
            "job-name": jname,
            COMPLETION_INDEX: str(index),
        }
    )
    ann = dict((tmpl.get("metadata") or {}).get("annotations") or {})
    ann[COMPLETION_INDEX] = str(index)
    spec = w.copy(tmpl.get("spec") or {})
    spec.setdefault("hostname", f"{jname}-{index}")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{jname}-{index}-{secrets.token_hex(3)[:5]}",
            "namespace": job["metadata"]["namespace"],
            "uid": str(uuid.uuid4()),
            "creationTimestamp": w.now(),
            "labels": lab,
            "annotations": ann,
            "finalizers": [JOB_TRACKING_FINALIZER],
            "ownerReferences": [owner_ref(job, "batch/v1", "Job")],
        },
        "spec": spec,
        "status": pending_status(spec),
    }


def pending_status(spec: dict) -> dict:
    """A new pod's status until the kubelet starts it: Pending, each container waiting."""
    return {
        "phase": "Pending",
        "conditions": [],
        "containerStatuses": [_waiting(c, "ContainerCreating") for c in spec.get("containers") or []],
        **(
            {"initContainerStatuses": [_waiting(c, "PodInitializing") for c in sidecars(spec)]}
            if sidecars(spec)
            else {}
        ),
    }
