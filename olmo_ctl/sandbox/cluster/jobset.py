"""The JobSet controller's rules (kubernetes-sigs/jobset v0.10.1, pkg/controllers/).

Each function names the upstream function it mirrors. Restarts work as upstream: `status.restarts`
goes up, the Jobs of the previous attempt (label `jobset.sigs.k8s.io/restart-attempt` below it)
are deleted with Foreground propagation, so their pods terminate through their grace period, and
Jobs of the same names are created again only once the old ones are gone. A Job reads as finished
only by its Failed/Complete condition (JobFinished; the Job controller delays them until its pods
are terminal). Resuming merges the JobSet's pod templates into the suspended Jobs (resumeJob).
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING

from olmo_ctl.sandbox.cluster import jobs as jobctl
from olmo_ctl.sandbox.cluster.objects import (
    JOB_INDEX_LABEL,
    JOBSET_API,
    JOBSET_NAME_LABEL,
    RESTARTS_LABEL,
    RJOB_LABEL,
    controlled_by,
    deleting,
    find_cond,
    is_true,
    labels,
    owner_ref,
)

if TYPE_CHECKING:
    from olmo_ctl.sandbox.cluster.world import World

# pkg/constants/constants.go
REACHED_MAX_RESTARTS = ("ReachedMaxRestarts", "jobset failed due to reaching max number of restarts")
FAILED_JOBS = ("FailedJobs", "jobset failed due to one or more job failures")
ALL_JOBS_COMPLETED = ("AllJobsCompleted", "jobset completed successfully")
SUSPENDED = ("SuspendedJobs", "jobset is suspended")
RESUMED = ("ResumeJobs", "jobset is resumed")
FAIL_JOBSET_ACTION = ("FailJobSetFailurePolicyAction", "applying FailJobSet failure policy action")
RESTART_ACTION = ("RestartJobSetFailurePolicyAction", "applying RestartJobSet failure policy action")
RESTART_IGNORE_MAX_ACTION = (
    "RestartJobSetAndIgnoreMaxRestartsFailurePolicyAction",
    "applying RestartJobSetAndIgnoreMaxRestarts failure policy action",
)


def message_with_first_failed_job(msg: str, job: str) -> str:
    """failure_policy.go messageWithFirstFailedJob."""
    return f"{msg} (first failed job: {job})"


def update_condition(
    w: World, js: dict, ctype: str, status: str, reason: str, message: str, event_type: str = "Normal"
) -> bool:
    """jobset_controller.go updateCondition + setCondition: an existing condition changes only when
    its status does; a False condition is never added; each change emits an event with the
    condition's reason and message."""
    conds = js.setdefault("status", {}).setdefault("conditions", [])
    c = next((c for c in conds if c["type"] == ctype), None)
    if c is not None and c["status"] == status:
        return False
    if c is None and status != "True":
        return False
    new = {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": w.now(),
    }
    if c is None:
        conds.append(new)
    else:
        c.clear()
        c.update(new)
    w.event(js, reason, message, event_type, source="jobset-controller")
    return True


def failure_time(job: dict) -> str:
    c = find_cond(job, "Failed")
    return (c or {}).get("lastTransitionTime") or ""


def find_first_failed_job(failed: list[dict]) -> dict:
    """failure_policy.go findFirstFailedJob: the one whose Failed condition is oldest. Every caller
    holds at least one failed Job (upstream's nil for none is never asked for)."""
    return min(failed, key=failure_time)


def rule_is_applicable(rule: dict, job: dict) -> bool:
    """failure_policy.go ruleIsApplicable: reasons, message patterns, target replicated jobs."""
    c = find_cond(job, "Failed") or {}
    reasons = rule.get("onJobFailureReasons") or []
    if reasons and c.get("reason") not in reasons:
        return False
    patterns = rule.get("onJobFailureMessagePatterns") or []
    if patterns and not any(re.search(p, c.get("message") or "") for p in patterns):
        return False
    parent = labels(job).get(RJOB_LABEL)
    if not parent:
        return False
    targets = rule.get("targetReplicatedJobs") or []
    return not targets or parent in targets


def find_first_failed_policy_rule_and_job(rules: list[dict], failed: list[dict]) -> tuple[dict, dict] | None:
    """failure_policy.go findFirstFailedPolicyRuleAndJob: the first rule matching any failed Job,
    with the earliest-failed Job it matches; None when no rule matches."""
    for rule in rules:
        matched = [j for j in failed if rule_is_applicable(rule, j)]
        if matched:
            return rule, find_first_failed_job(matched)
    return None


def set_failed(w: World, js: dict, reason: str, message: str) -> None:
    """failure_policy.go setJobSetFailedCondition: the Failed condition and terminalState."""
    update_condition(w, js, "Failed", "True", reason, message, "Warning")
    js["status"]["terminalState"] = "Failed"


def execute_failure_policy(w: World, js: dict, failed: list[dict]) -> None:
    """failure_policy.go executeFailurePolicy and its action appliers."""
    policy = js["spec"].get("failurePolicy")
    if policy is None:
        first = find_first_failed_job(failed)
        set_failed(
            w, js, FAILED_JOBS[0], message_with_first_failed_job(FAILED_JOBS[1], first["metadata"]["name"])
        )
        return
    matched = find_first_failed_policy_rule_and_job(policy.get("rules") or [], failed)
    if matched is None:
        action, job = "RestartJobSet", find_first_failed_job(failed)  # defaultFailurePolicyRuleAction
    else:
        rule, job = matched
        action = rule["action"]
    name = job["metadata"]["name"]
    st = js["status"]
    if action == "FailJobSet":  # failJobSetActionApplier
        set_failed(w, js, FAIL_JOBSET_ACTION[0], message_with_first_failed_job(FAIL_JOBSET_ACTION[1], name))
    elif action == "RestartJobSet":  # restartJobSetActionApplier
        if int(st.get("restartsCountTowardsMax") or 0) >= int(policy.get("maxRestarts") or 0):
            set_failed(
                w, js, REACHED_MAX_RESTARTS[0], message_with_first_failed_job(REACHED_MAX_RESTARTS[1], name)
            )
        else:
            recreate_all(
                w, js, True, RESTART_ACTION[0], message_with_first_failed_job(RESTART_ACTION[1], name)
            )
    elif action == "RestartJobSetAndIgnoreMaxRestarts":  # restartJobSetAndIgnoreMaxRestartsActionApplier
        recreate_all(
            w,
            js,
            False,
            RESTART_IGNORE_MAX_ACTION[0],
            message_with_first_failed_job(RESTART_IGNORE_MAX_ACTION[1], name),
        )


def recreate_all(w: World, js: dict, counts_towards_max: bool, reason: str, message: str) -> None:
    """failure_policy.go failurePolicyRecreateAll: restarts + 1 (and restartsCountTowardsMax when the
    action counts); the next reconcile deletes the previous attempt's Jobs."""
    st = js["status"]
    st["restarts"] = int(st.get("restarts") or 0) + 1
    if counts_towards_max:
        st["restartsCountTowardsMax"] = int(st.get("restartsCountTowardsMax") or 0) + 1
    w.event(js, reason, message, "Warning", source="jobset-controller")


def num_jobs_expected_to_succeed(js: dict) -> int:
    """success_policy.go numJobsExpectedToSucceed (operator All by default, as the webhook sets it)."""
    sp = js["spec"].get("successPolicy") or {}
    targets = sp.get("targetReplicatedJobs") or []
    if sp.get("operator", "All") == "Any":
        return 1
    return sum(
        int(rj.get("replicas", 1))
        for rj in js["spec"]["replicatedJobs"]
        if not targets or rj["name"] in targets
    )


def execute_success_policy(w: World, js: dict, successful: list[dict]) -> bool:
    """jobset_controller.go executeSuccessPolicy + success_policy.go numJobsMatchingSuccessPolicy."""
    targets = (js["spec"].get("successPolicy") or {}).get("targetReplicatedJobs") or []
    matching = [j for j in successful if not targets or labels(j).get(RJOB_LABEL) in targets]
    if len(matching) >= num_jobs_expected_to_succeed(js):
        update_condition(w, js, "Completed", "True", *ALL_JOBS_COMPLETED)
        js["status"]["terminalState"] = "Completed"
        return True
    return False


def child_jobs(w: World, js: dict) -> dict[str, list[dict]]:
    """jobset_controller.go getChildJobs: previous (restart-attempt below status.restarts), active,
    successful, failed."""
    out: dict[str, list[dict]] = {"previous": [], "active": [], "successful": [], "failed": []}
    restarts = int(js["status"].get("restarts") or 0)
    for job in w.items("Job", js["metadata"]["namespace"]):
        if not controlled_by(job, js):
            continue
        if int(labels(job).get(RESTARTS_LABEL, 0)) < restarts:
            out["previous"].append(job)
            continue
        fin = jobctl.job_finished(job)
        out["active" if fin is None else "successful" if fin == "Complete" else "failed"].append(job)
    return out


def replicated_job_statuses(js: dict, owned: dict[str, list[dict]]) -> list[dict]:
    """jobset_controller.go calculateReplicatedJobStatuses."""
    out = {
        rj["name"]: {"name": rj["name"], "ready": 0, "succeeded": 0, "failed": 0, "active": 0, "suspended": 0}
        for rj in js["spec"]["replicatedJobs"]
    }
    for job in owned["active"]:
        s, spec = job.get("status") or {}, job["spec"]
        pods = int(spec.get("parallelism", 1))
        if spec.get("completions") is not None:
            pods = min(pods, int(spec["completions"]))
        row = out[labels(job)[RJOB_LABEL]]
        if int(s.get("succeeded", 0)) + int(s.get("ready", 0)) >= pods:
            row["ready"] += 1
        if int(s.get("active", 0)) > 0:
            row["active"] += 1
        if spec.get("suspend"):
            row["suspended"] += 1
    for job in owned["successful"]:
        out[labels(job)[RJOB_LABEL]]["succeeded"] += 1
    for job in owned["failed"]:
        out[labels(job)[RJOB_LABEL]]["failed"] += 1
    return list(out.values())


def finished(js: dict) -> bool:
    """jobset_controller.go jobSetFinished."""
    return is_true(js, "Completed") or is_true(js, "Failed")


def construct_job(w: World, js: dict, rj: dict, idx: int) -> dict:
    """jobset_controller.go constructJob + labelAndAnnotateObject."""
    name = f"{js['metadata']['name']}-{rj['name']}-{idx}"  # placement.GenJobName
    ns = js["metadata"]["namespace"]
    total = sum(int(r.get("replicas", 1)) for r in js["spec"]["replicatedJobs"])
    before = 0
    for r in js["spec"]["replicatedJobs"]:
        if r["name"] == rj["name"]:
            break
        before += int(r.get("replicas", 1))
    group = rj.get("groupName", "default")
    tags = {
        JOBSET_NAME_LABEL: js["metadata"]["name"],
        "jobset.sigs.k8s.io/jobset-uid": js["metadata"]["uid"],
        RJOB_LABEL: rj["name"],
        RESTARTS_LABEL: str(int(js["status"].get("restarts") or 0)),
        "jobset.sigs.k8s.io/replicatedjob-replicas": str(int(rj.get("replicas", 1))),
        "jobset.sigs.k8s.io/global-replicas": str(total),
        JOB_INDEX_LABEL: str(idx),
        "jobset.sigs.k8s.io/job-key": hashlib.sha1(f"{ns}/{name}".encode()).hexdigest(),
        "jobset.sigs.k8s.io/job-global-index": str(before + idx),
        "jobset.sigs.k8s.io/group-name": group,
        "jobset.sigs.k8s.io/group-replicas": str(total),
        "jobset.sigs.k8s.io/job-group-index": str(before + idx),
    }
    tmpl = w.copy(rj["template"])
    spec = tmpl.get("spec") or {}
    pod_tmpl = spec.setdefault("template", {})
    pod_md = pod_tmpl.setdefault("metadata", {})
    pod_md["labels"] = {**(pod_md.get("labels") or {}), **tags}
    ann = {**(pod_md.get("annotations") or {}), **tags}
    excl = (js["metadata"].get("annotations") or {}).get("alpha.jobset.sigs.k8s.io/exclusive-topology")
    if excl:
        ann["alpha.jobset.sigs.k8s.io/exclusive-topology"] = excl
    pod_md["annotations"] = ann
    if (js["spec"].get("network") or {}).get("enableDNSHostnames"):
        pod_tmpl.setdefault("spec", {})["subdomain"] = (js["spec"].get("network") or {}).get(
            "subdomain"
        ) or js["metadata"]["name"]
    spec["suspend"] = bool(js["spec"].get("suspend"))
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("backoffLimit", 6)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {**((tmpl.get("metadata") or {}).get("labels") or {}), **tags},
            "annotations": {**((tmpl.get("metadata") or {}).get("annotations") or {}), **tags},
            "ownerReferences": [owner_ref(js, JOBSET_API, "JobSet")],
        },
        "spec": spec,
        "status": {},
    }


def reconcile(w: World, js: dict) -> bool:
    """jobset_controller.go Reconcile/reconcile for one JobSet; returns whether anything changed."""
    if deleting(js):
        return False  # jobSetMarkedForDeletion
    manager = js["spec"].get("managedBy")
    if manager and manager != "jobset.sigs.k8s.io/jobset-controller":
        return False  # managedByExternalController
    before = w.snapshot(js)
    st = js.setdefault("status", {})
    st.setdefault("restarts", 0)
    owned = child_jobs(w, js)
    st["replicatedJobsStatus"] = replicated_job_statuses(js, owned)
    changed = False
    if finished(js):
        for job in owned["active"]:
            if not deleting(job):
                w.delete("Job", job, "Foreground")
                changed = True
        return w.commit("JobSet", js, before) or changed
    for job in owned["previous"]:
        if not deleting(job):
            w.delete("Job", job, "Foreground")
            changed = True
    if owned["failed"]:
        execute_failure_policy(w, js, owned["failed"])
        return w.commit("JobSet", js, before) or changed
    if owned["successful"] and execute_success_policy(w, js, owned["successful"]):
        return w.commit("JobSet", js, before) or changed
    # reconcileReplicatedJobs: create the Jobs that do not exist (a previous attempt's Job of the same
    # name blocks its successor until it is gone).
    existing = {j["metadata"]["name"] for k in owned for j in owned[k]}
    for rj in js["spec"]["replicatedJobs"]:
        for idx in range(int(rj.get("replicas", 1))):
            job = construct_job(w, js, rj, idx)
            if job["metadata"]["name"] not in existing:
                w.save("Job", job, new=True)
                changed = True
    if js["spec"].get("suspend"):  # suspendJobs
        for job in owned["active"]:
            if not job["spec"].get("suspend"):
                job["spec"]["suspend"] = True
                w.save("Job", job)
                changed = True
        update_condition(w, js, "Suspended", "True", *SUSPENDED)
    else:  # resumeJobsIfNecessary + resumeJob: labels, annotations, node selector merged (MergeMaps),
        # tolerations and scheduling gates (MergeSlices) from the replicated job's pod template
        templates = {rj["name"]: rj["template"]["spec"]["template"] for rj in js["spec"]["replicatedJobs"]}
        for job in owned["active"]:
            if job["spec"].get("suspend"):
                src = templates[labels(job)[RJOB_LABEL]]
                jt = job["spec"]["template"]
                jt.setdefault("metadata", {})
                for k in ("labels", "annotations"):
                    jt["metadata"][k] = {
                        **(jt["metadata"].get(k) or {}),
                        **((src.get("metadata") or {}).get(k) or {}),
                    }
                jspec = jt.setdefault("spec", {})
                jspec["nodeSelector"] = {
                    **(jspec.get("nodeSelector") or {}),
                    **((src.get("spec") or {}).get("nodeSelector") or {}),
                }
                if not jspec["nodeSelector"]:
                    jspec.pop("nodeSelector")
                # collections.MergeSlices: the union, nothing removed, so what an earlier admission
                # added to a Job that outlived its suspension stays (jobset#1294, open upstream).
                for field in ("tolerations", "schedulingGates"):
                    merged = list(jspec.get(field) or [])
                    merged += [x for x in (src.get("spec") or {}).get(field) or [] if x not in merged]
                    if merged:
                        jspec[field] = w.copy(merged)
                job["spec"]["suspend"] = False
                job.setdefault("status", {}).pop("startTime", None)
                w.save("Job", job)
                changed = True
        update_condition(w, js, "Suspended", "False", *RESUMED)
    return w.commit("JobSet", js, before) or changed
