"""Classification table: realistic JobSet / Workload / pod / event objects -> state + reason.

The JobSet and Workload objects are checked against the real CRD schemas first, so the table
cannot drift into shapes a cluster never produces.
"""

from __future__ import annotations

import copy

import pytest

from olmo_ctl.backends.base import State
from olmo_ctl.backends.gke_status import classify, container_exits
from olmo_ctl.sandbox.kube_server import JOBSET_CRD, WORKLOAD_CRD, schema_errors

T0 = "2026-11-30T01:00:00Z"
T1 = "2026-11-30T01:00:01Z"
T2 = "2026-11-30T01:00:05Z"


def cond(type_, status, reason, message="", t=T0):
    return {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": t}


def jobset(suspend=False, conditions=(), restarts=0, workers=2):
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "run-a1", "namespace": "default", "uid": "js-uid"},
        "spec": {
            "suspend": suspend,
            "replicatedJobs": [
                {
                    "name": "slice",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "parallelism": workers,
                            "completions": workers,
                            "backoffLimit": 0,
                            "template": {
                                "spec": {
                                    "restartPolicy": "Never",
                                    "containers": [{"name": "trainer", "image": "i"}],
                                }
                            },
                        }
                    },
                }
            ],
        },
        "status": {
            "restarts": restarts,
            "conditions": list(conditions),
            "replicatedJobsStatus": [
                {
                    "name": "slice",
                    "ready": 0,
                    "succeeded": 0,
                    "failed": 0,
                    "active": 0 if suspend else 1,
                    "suspended": 1 if suspend else 0,
                }
            ],
        },
    }


def workload(conditions=(), active=True, admission=False, checks=()):
    wl = {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "Workload",
        "metadata": {
            "name": "jobset-run-a1-3f2a1",
            "namespace": "default",
            "ownerReferences": [
                {
                    "apiVersion": "jobset.x-k8s.io/v1alpha2",
                    "kind": "JobSet",
                    "name": "run-a1",
                    "uid": "js-uid",
                    "controller": True,
                }
            ],
        },
        "spec": {
            "active": active,
            "queueName": "tpu-queue",
            "podSets": [
                {
                    "name": "slice",
                    "count": 2,
                    "template": {"spec": {"containers": [{"name": "trainer", "image": "i"}]}},
                }
            ],
        },
        "status": {"conditions": list(conditions)},
    }
    if admission:
        wl["status"]["admission"] = {
            "clusterQueue": "cq",
            "podSetAssignments": [{"name": "slice", "count": 2, "flavors": {"google.com/tpu": "tpu7x"}}],
        }
    if checks:
        wl["status"]["admissionChecks"] = list(checks)
    return wl


def pod(
    i,
    phase="Running",
    exit_code=None,
    reason=None,
    message="",
    finished=T1,
    waiting=None,
    disruption=None,
    scheduled=None,
    pod_reason=None,
):
    cs = {"name": "trainer", "image": "i", "ready": phase == "Running", "restartCount": 0}
    if exit_code is not None:
        cs["state"] = {
            "terminated": {
                "exitCode": exit_code,
                "reason": reason or ("Completed" if exit_code == 0 else "Error"),
                "message": message,
                "finishedAt": finished,
                "startedAt": T0,
            }
        }
    elif waiting:
        cs["state"] = {"waiting": {"reason": waiting[0], "message": waiting[1]}}
    else:
        cs["state"] = {"running": {"startedAt": T0}}
    conds = []
    if disruption:
        conds.append(cond("DisruptionTarget", "True", disruption, "", T1))
    if scheduled:
        conds.append(cond("PodScheduled", "False", "Unschedulable", scheduled))
    st = {"phase": phase, "conditions": conds, "containerStatuses": [cs]}
    if pod_reason:
        st["reason"] = pod_reason
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"run-a1-slice-0-{i}-abcde",
            "namespace": "default",
            "labels": {"jobset.sigs.k8s.io/jobset-name": "run-a1"},
        },
        "spec": {"containers": [{"name": "trainer", "image": "i"}]},
        "status": st,
    }


def event(kind, name, reason, message, type_="Warning", t=T1):
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{name}.1", "namespace": "default"},
        "involvedObject": {"kind": kind, "name": name, "namespace": "default"},
        "reason": reason,
        "message": message,
        "type": type_,
        "lastTimestamp": t,
    }


ADMITTED_WL = workload(
    [
        cond("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
        cond("Admitted", "True", "Admitted", "The workload is admitted"),
    ],
    admission=True,
)
FAILED_JS = jobset(
    conditions=[cond("Failed", "True", "FailedJobs", "jobset failed due to one or more job failures")]
)
PENDING_MSG = (
    "couldn't assign flavors to pod set slice: insufficient unused quota for google.com/tpu in flavor "
    "tpu7x-4x4x4, 64 more needed"
)
PREEMPT_MSG = (
    "Preempted to accommodate a workload (UID: 5e5a, JobUID: 77c1) due to prioritization in the ClusterQueue"
)
TRACEBACK = (
    'Traceback (most recent call last):\n  File "train.py", line 3\nValueError: loss is NaN at step 1200'
)

# (id, jobset, workload, pods, events, state, reason, source)
CASES = [
    ("missing", None, None, [], [], State.MISSING, "the JobSet does not exist", "JobSet"),
    (
        "workload-not-created-yet",
        jobset(suspend=True, conditions=[cond("Suspended", "True", "SuspendedJobs", "jobset is suspended")]),
        None,
        [],
        [],
        State.QUEUED,
        "the JobSet is suspended (SuspendedJobs: jobset is suspended); no Kueue Workload owns it yet",
        "JobSet spec.suspend",
    ),
    (
        "workload-fresh",
        jobset(suspend=True),
        workload(),
        [],
        [],
        State.QUEUED,
        "waiting for Kueue to reserve quota",
        "Workload condition QuotaReserved",
    ),
    (
        "pending-no-quota",
        jobset(suspend=True),
        workload([cond("QuotaReserved", "False", "Pending", PENDING_MSG)]),
        [],
        [],
        State.QUEUED,
        f"Pending: {PENDING_MSG}",
        "Workload condition QuotaReserved",
    ),
    (
        "admission-check-pending",
        jobset(suspend=True),
        workload(
            [
                cond("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
                cond("Admitted", "False", "NoChecks", ""),
            ],
            admission=True,
            checks=[
                {
                    "name": "dws-prov",
                    "state": "Pending",
                    "message": "Waiting for resources",
                    "lastTransitionTime": T0,
                }
            ],
        ),
        [],
        [],
        State.QUEUED,
        "quota reserved, waiting for admission checks: dws-prov: Pending (Waiting for resources)",
        "Workload condition Admitted",
    ),
    (
        "evicted-preempted",
        jobset(suspend=True),
        workload(
            [
                cond("Evicted", "True", "Preempted", PREEMPT_MSG),
                cond("Preempted", "True", "InClusterQueue", PREEMPT_MSG),
                cond("QuotaReserved", "False", "Pending", PREEMPT_MSG),
                cond("Requeued", "True", "Preempted", ""),
            ]
        ),
        [],
        [],
        State.QUEUED,
        f"Preempted (InClusterQueue): {PREEMPT_MSG}; requeued by Kueue",
        "Workload condition Evicted",
    ),
    (
        "evicted-preempted-pods-checkpointing",
        jobset(suspend=True),
        workload(
            [
                cond("Evicted", "True", "Preempted", PREEMPT_MSG),
                cond("Preempted", "True", "InClusterQueue", PREEMPT_MSG),
                cond("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
            ],
            admission=True,
        ),
        [pod(0), pod(1)],
        [],
        State.QUEUED,
        f"Preempted (InClusterQueue): {PREEMPT_MSG}; 2 pod(s) terminating (checkpointing on SIGTERM)",
        "Workload condition Evicted",
    ),
    (
        "evicted-node-failures",
        jobset(),
        workload([cond("Evicted", "True", "NodeFailures", "Workload was evicted due to node failures")]),
        [],
        [],
        State.QUEUED,
        "NodeFailures: Workload was evicted due to node failures; requeued by Kueue",
        "Workload condition Evicted",
    ),
    (
        "evicted-pods-ready-timeout",
        jobset(),
        workload(
            [
                cond(
                    "Evicted",
                    "True",
                    "PodsReadyTimeout",
                    "Exceeded the PodsReady timeout default/jobset-run-a1",
                )
            ]
        ),
        [],
        [],
        State.QUEUED,  # Kueue requeues the same Workload (after a backoff): a wait, not a failure
        "PodsReadyTimeout: Exceeded the PodsReady timeout default/jobset-run-a1; requeued by Kueue",
        "Workload condition Evicted",
    ),
    (
        "deactivated-requeue-limit",
        jobset(suspend=True),
        workload(
            [
                cond(
                    "Evicted",
                    "True",
                    "DeactivatedDueToRequeuingLimitExceeded",
                    "The workload is deactivated due to exceeding the maximum number of re-queuing retries",
                )
            ],
            active=False,
        ),
        [],
        [],
        State.QUEUED,  # kept by Kueue until someone reactivates it; `deactivated` says who
        "DeactivatedDueToRequeuingLimitExceeded: The workload is deactivated due to "
        "exceeding the maximum number of re-queuing retries",
        "Workload condition Evicted",
    ),
    (
        "evicted-then-readmitted",
        jobset(),
        workload(
            [
                cond("Evicted", "False", "QuotaReserved", f"Previously: {PREEMPT_MSG}"),
                cond("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
                cond("Admitted", "True", "Admitted", "The workload is admitted"),
            ],
            admission=True,
        ),
        [pod(0), pod(1)],
        [],
        State.RUNNING,
        "2/2 pods running",
        "pods",
    ),
    (
        "admitted-pods-pending",
        jobset(),
        ADMITTED_WL,
        [pod(0, "Pending", waiting=("ContainerCreating", "")), pod(1)],
        [],
        State.ADMITTED,
        "1/2 pods running",
        "pods",
    ),
    (
        "unschedulable-condition",
        jobset(),
        ADMITTED_WL,
        [pod(0, "Pending", scheduled="0/4 nodes are available: 4 Insufficient google.com/tpu.")],
        [],
        State.ADMITTED,
        "Unschedulable: pod run-a1-slice-0-0-abcde: 0/4 nodes are available: 4 Insufficient google.com/tpu.",
        "pod run-a1-slice-0-0-abcde condition PodScheduled",
    ),
    (
        "unschedulable-event",
        jobset(),
        ADMITTED_WL,
        [pod(0, "Pending")],
        [
            event(
                "Pod",
                "run-a1-slice-0-0-abcde",
                "FailedScheduling",
                "0/16 nodes are available: 16 node(s) didn't match Pod's node affinity/selector.",
            )
        ],
        State.ADMITTED,
        "Unschedulable: pod run-a1-slice-0-0-abcde: 0/16 nodes are available: 16 node(s) didn't match "
        "Pod's node affinity/selector.",
        "pod events FailedScheduling",
    ),
    (
        "image-pull",
        jobset(),
        ADMITTED_WL,
        [pod(0, "Pending", waiting=("ErrImagePull", 'rpc error: pull access denied for "olmo:bad"')), pod(1)],
        [],
        State.ADMITTED,  # live: the supervisor reads `config_error` (a permanent pull error)
        "pod run-a1-slice-0-0-abcde container trainer: ErrImagePull: rpc error: pull access denied "
        'for "olmo:bad"',
        "pod run-a1-slice-0-0-abcde container status",
    ),
    ("running-no-kueue", jobset(), None, [pod(0), pod(1)], [], State.RUNNING, "2/2 pods running", "pods"),
    (
        "running-one-exited-jobset-restarting",
        jobset(restarts=1),
        ADMITTED_WL,
        [pod(0), pod(1, "Failed", exit_code=143)],
        [],
        State.ADMITTED,
        "1/2 pods running; pod run-a1-slice-0-1-abcde container trainer exited 143 (SIGTERM) (the JobSet has not "
        "failed: it may restart); JobSet restarts: 1",
        "pods",
    ),
    (
        "completed",
        jobset(conditions=[cond("Completed", "True", "AllJobsCompleted", "jobset completed successfully")]),
        workload([cond("Finished", "True", "Succeeded", "jobset completed successfully")]),
        [pod(0, "Succeeded", exit_code=0), pod(1, "Succeeded", exit_code=0)],
        [],
        State.SUCCEEDED,
        "AllJobsCompleted: jobset completed successfully",
        "JobSet condition Completed",
    ),
    (
        "workload-finished-before-jobset-status",
        jobset(),
        workload([cond("Finished", "True", "Succeeded", "Job finished successfully")]),
        [],
        [],
        State.SUCCEEDED,
        "Succeeded: Job finished successfully",
        "Workload condition Finished",
    ),
    (
        "user-exit-1",
        FAILED_JS,
        ADMITTED_WL,
        [
            pod(0, "Failed", exit_code=1, message=TRACEBACK, finished=T1),
            pod(1, "Failed", exit_code=143, finished=T2),
        ],
        [],
        State.FAILED_USER,
        "pod run-a1-slice-0-0-abcde container trainer exited 1: ValueError: loss is NaN at step 1200",
        "JobSet Failed; pod run-a1-slice-0-0-abcde container trainer",
    ),
    (
        "user-exit-2-same-second-as-the-kill",
        FAILED_JS,
        ADMITTED_WL,
        [
            pod(0, "Failed", exit_code=143, finished=T1),
            pod(1, "Failed", exit_code=2, finished=T1, message="error: data fingerprint mismatch"),
        ],
        [],
        State.FAILED_USER,
        "pod run-a1-slice-0-1-abcde container trainer exited 2: error: data fingerprint mismatch",
        "JobSet Failed; pod run-a1-slice-0-1-abcde container trainer",
    ),
    (
        "sigterm-first-then-collective-errors",
        FAILED_JS,
        ADMITTED_WL,
        [
            pod(0, "Failed", exit_code=143, finished=T1),
            pod(
                1, "Failed", exit_code=1, finished=T2, message="jax.errors.JaxRuntimeError: DEADLINE_EXCEEDED"
            ),
        ],
        [],
        State.PREEMPTED,
        "pod run-a1-slice-0-0-abcde container trainer exited 143 (SIGTERM)",
        "JobSet Failed; pod run-a1-slice-0-0-abcde container trainer",
    ),
    (
        "disruption-target",
        FAILED_JS,
        ADMITTED_WL,
        [
            pod(0, "Failed", exit_code=1, finished=T1),
            pod(1, "Failed", exit_code=137, finished=T1, disruption="PreemptionByScheduler"),
        ],
        [],
        State.PREEMPTED,
        "pod run-a1-slice-0-1-abcde container trainer exited 137 (SIGKILL) after DisruptionTarget "
        "PreemptionByScheduler",
        "JobSet Failed; pod run-a1-slice-0-1-abcde container trainer",
    ),
    (
        "node-lost-event",
        FAILED_JS,
        ADMITTED_WL,
        [pod(0, "Failed", exit_code=137, finished=T1)],
        [
            event(
                "Pod", "run-a1-slice-0-0-abcde", "TaintManagerEviction", "Marking for deletion Pod default/x"
            )
        ],
        State.PREEMPTED,
        "pod run-a1-slice-0-0-abcde container trainer exited 137 (SIGKILL) after event TaintManagerEviction",
        "JobSet Failed; pod run-a1-slice-0-0-abcde container trainer",
    ),
    (
        "oom",
        FAILED_JS,
        ADMITTED_WL,
        [pod(0, "Failed", exit_code=137, reason="OOMKilled")],
        [],
        State.FAILED_INFRA,
        "pod run-a1-slice-0-0-abcde container trainer exited 137 (SIGKILL) [OOMKilled]",
        "JobSet Failed; pod run-a1-slice-0-0-abcde container trainer",
    ),
    (
        "segfault",
        FAILED_JS,
        ADMITTED_WL,
        [pod(0, "Failed", exit_code=139, message="Fatal Python error: Segmentation fault")],
        [],
        State.FAILED_INFRA,
        "pod run-a1-slice-0-0-abcde container trainer exited 139: Fatal Python error: Segmentation fault",
        "JobSet Failed; pod run-a1-slice-0-0-abcde container trainer",
    ),
    (
        "failed-no-pods",
        jobset(
            conditions=[
                cond(
                    "Failed",
                    "True",
                    "ReachedMaxRestarts",
                    "jobset failed due to reaching max number of restarts",
                )
            ]
        ),
        ADMITTED_WL,
        [],
        [],
        State.FAILED_INFRA,
        "JobSet failed (ReachedMaxRestarts: jobset failed due to reaching max number of restarts); no pod left to tell "
        "why",
        "JobSet condition Failed",
    ),
    (
        "failed-pod-evicted-by-kubelet",
        FAILED_JS,
        ADMITTED_WL,
        [pod(0, "Failed", pod_reason="Evicted")],
        [],
        State.PREEMPTED,
        "JobSet failed (FailedJobs: jobset failed due to one or more job failures); pod Evicted",
        "JobSet condition Failed",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_classify(case):
    _, js, wl, pods, events, state, reason, source = case
    for obj, crd in ((js, JOBSET_CRD), (wl, WORKLOAD_CRD)):
        if obj is not None:
            assert schema_errors(obj, crd, obj["apiVersion"].split("/")[1]) == []
    st = classify(copy.deepcopy(js), copy.deepcopy(wl), copy.deepcopy(pods), copy.deepcopy(events))
    assert (st.state, st.reason, st.source) == (state, reason, source)


def test_user_failure_carries_the_termination_message_as_last_lines():
    st = classify(FAILED_JS, ADMITTED_WL, [pod(0, "Failed", exit_code=1, message=TRACEBACK)])
    assert st.last_log_lines == tuple(TRACEBACK.splitlines())
    assert st.exit_code == 1 and st.details["pod"] == "run-a1-slice-0-0-abcde"


def test_logs_from_the_api_replace_the_termination_message():
    lines = [f"step {i}/10 loss 2.0" for i in range(1, 8)] + ["RuntimeError: checkpoint 7 is corrupt"]
    st = classify(
        FAILED_JS, ADMITTED_WL, [pod(0, "Failed", exit_code=1)], logs={"run-a1-slice-0-0-abcde": lines}
    )
    assert st.state == State.FAILED_USER
    assert st.last_log_lines == tuple(lines)
    assert st.reason.endswith("exited 1: RuntimeError: checkpoint 7 is corrupt")


def test_an_inadmissible_workload_is_queued_and_flagged():
    msg = "LocalQueue tpu-queue doesn't exist"
    st = classify(jobset(suspend=True), workload([cond("QuotaReserved", "False", "Inadmissible", msg)]))
    assert (st.state, st.reason, st.details["queue_reason"]) == (
        State.QUEUED,
        f"Inadmissible: {msg}",
        "Inadmissible",
    )


@pytest.mark.parametrize(
    "reason,msg,config",
    [
        ("Inadmissible", "LocalQueue tpu-queue doesn't exist", True),
        ("Inadmissible", "ClusterQueue cq doesn't exist", True),
        ("Inadmissible", "LocalQueue tpu-queue is inactive", False),  # stopped by an admin: it may resume
        (
            "Pending",
            "couldn't assign flavors to pod set slice: flavor tpu-v5p doesn't match node affinity",
            True,
        ),
        (
            "Pending",
            "couldn't assign flavors to pod set slice: resource google.com/tpu unavailable in ClusterQueue",
            True,
        ),
        (
            "Pending",
            "couldn't assign flavors to pod set slice: flavor a doesn't match node affinity, insufficient "
            "unused quota for google.com/tpu in flavor b, 64 more needed",
            False,
        ),
        (
            "Pending",
            "couldn't assign flavors to pod set slice: insufficient quota for google.com/tpu in flavor b, "
            "previously considered podsets requests (0) + current podset request (256) > maximum capacity (128)",
            True,
        ),
        ("Pending", PENDING_MSG, False),
    ],
)
def test_a_queue_set_up_that_can_never_admit_is_a_configuration_error(reason, msg, config):
    st = classify(jobset(suspend=True), workload([cond("QuotaReserved", "False", reason, msg)]))
    assert st.state == State.QUEUED and st.config_error == (msg if config else None)


def test_no_workload_for_a_missing_priority_class_is_a_configuration_error():
    st = classify(jobset(suspend=True), None, missing=('WorkloadPriorityClass "high" does not exist',))
    assert st.state == State.QUEUED and "high" in st.reason
    assert st.config_error == 'Kueue cannot create the Workload: WorkloadPriorityClass "high" does not exist'


def test_pods_refused_at_creation_are_named_from_the_jobs_failed_create_event():
    ev = event(
        "Job",
        "run-a1-slice-0",
        "FailedCreate",
        'Error creating: pods "run-a1-slice-0-0-" is forbidden: '
        "exceeded quota: q, requested: google.com/tpu=4, used: google.com/tpu=0, limited: google.com/tpu=0",
    )
    st = classify(jobset(), ADMITTED_WL, [pod(0)], [ev])
    assert st.state == State.ADMITTED and st.pods_refused is True
    assert st.reason == f"1/2 pods created; FailedCreate: Job run-a1-slice-0: {ev['message']}"
    assert classify(jobset(), ADMITTED_WL, [pod(0), pod(1)], [ev]).state == State.RUNNING  # created after all


def test_states_live_and_terminal():
    assert {s for s in State if s.live} == {State.QUEUED, State.ADMITTED, State.RUNNING}


def test_unknown_finish_time_sorts_after_a_known_one():
    exits = container_exits([pod(0, "Failed", exit_code=1, finished=""), pod(1, "Failed", exit_code=143)])
    assert [e.exit_code for e in exits] == [143, 1]
