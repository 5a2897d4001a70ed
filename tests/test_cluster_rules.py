"""The test cluster's rules, one row per upstream rule (JobSet v0.10.1, Kueue v0.17.1, batch/v1 Jobs).

Each row names the upstream file and function it mirrors, scripts only causes (capacity, a
container's exit, a lost node, a higher-priority workload) and checks what the rules computed.
No HTTP: the World is driven directly, so the whole table runs in seconds.
"""

from __future__ import annotations

import copy

import pytest

from olmo_ctl.sandbox.cluster import jobs as jobctl
from olmo_ctl.sandbox.cluster import jobset as jobsetctl
from olmo_ctl.sandbox.cluster.objects import find_cond, is_true
from olmo_ctl.sandbox.kube_server import KubeServer, tiny_jobset

RENDERED_POLICY = {  # the first two rules olmo-ctl renders (tests/test_failure_policy.py has all four)
    "podFailurePolicy": {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [1, 2]},
            },
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]
    },
}
FAIL_ON_USER_ERROR = {
    "name": "FailOnUserError",
    "action": "FailJobSet",
    "onJobFailureReasons": ["PodFailurePolicy"],
}


@pytest.fixture
def srv():
    s = KubeServer()  # not started: the rules run on the store
    yield s


def make(
    srv,
    name="r-a1",
    workers=2,
    replicas=1,
    rendered=True,
    max_restarts=3,
    rules=None,
    queue="user-queue",
    labels=None,
    success=None,
    grace=5,
):
    js = tiny_jobset(name, run=name.split("-")[0], queue=queue, workers=workers, max_restarts=max_restarts)
    rj = js["spec"]["replicatedJobs"][0]
    rj["replicas"] = replicas
    if rendered:
        rj["template"]["spec"].update(copy.deepcopy(RENDERED_POLICY))
        js["spec"]["failurePolicy"]["rules"] = [FAIL_ON_USER_ERROR] if rules is None else rules
    elif rules is not None:
        js["spec"]["failurePolicy"]["rules"] = rules
    if success:
        js["spec"]["successPolicy"] = success
    rj["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = grace
    js["metadata"]["labels"].update(labels or {})
    res = srv.api.route("/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets")[0]
    with srv.store.lock:
        srv.api.create(res, "v1alpha2", "default", js, {})
        srv.world.written()
    return name


def running(srv, name="r-a1", **kw):
    make(srv, name, **kw)
    srv.cluster.admit(name)
    srv.cluster.run_pods(name)
    return name


def cond(obj, t):
    c = find_cond(obj, t) or {}
    return c.get("status"), c.get("reason"), c.get("message")


def events(srv, kind=None):
    return [
        (e["involvedObject"]["kind"], e["reason"], e["message"])
        for e in srv.cluster.events()
        if kind is None or e["involvedObject"]["kind"] == kind
    ]


def jobs(srv, name):
    return [
        j
        for j in srv.world.items("Job", "default")
        if j["metadata"]["labels"].get("jobset.sigs.k8s.io/jobset-name") == name
    ]


# ---------------------------------------------------------------- batch/v1 Jobs


def test_pod_failure_policy_failjob_on_exit_code(srv):
    """pkg/controller/job/pod_failure_policy.go matchPodFailurePolicy (onExitCodes In, FailJob) and
    job_controller.go: Failed with reason PodFailurePolicy; jobset failure_policy.go
    failJobSetActionApplier: FailJobSetFailurePolicyAction with "(first failed job: X)"."""
    n = running(srv)
    srv.cluster.pod_exit(n, 0, 1)
    (job,) = jobs(srv, n)
    st, reason, msg = cond(job, "Failed")
    assert (st, reason) == ("True", "PodFailurePolicy")
    assert msg.startswith("Container trainer for pod default/r-a1-slice-0-0-") and msg.endswith(
        "failed with exit code 1 matching FailJob rule at index 0"
    )
    assert cond(srv.cluster.jobset(n), "Failed") == (
        "True",
        "FailJobSetFailurePolicyAction",
        "applying FailJobSet failure policy action (first failed job: r-a1-slice-0)",
    )
    assert srv.cluster.jobset(n)["status"]["terminalState"] == "Failed"
    assert (
        "JobSet",
        "FailJobSetFailurePolicyAction",
        "applying FailJobSet failure policy action (first failed job: r-a1-slice-0)",
    ) in events(srv)


def test_failed_waits_until_no_pod_is_terminating(srv):
    """job_controller.go (Kubernetes >= 1.31, delayTerminalCondition: JobManagedBy or
    JobPodReplacementPolicy on): syncJob adds FailureTarget and deletes the remaining pods;
    enactJobFinished adds Failed, with FailureTarget's reason and message, only once none is
    terminating (recordJobFinished's event then). The JobSet, which reads Failed, waits as long."""
    n = running(srv, grace=300)
    srv.cluster.hold_deletions = True  # the other worker uses its whole grace period (a checkpoint)
    srv.cluster.pod_exit(n, 0, 1)
    (job,) = jobs(srv, n)
    st, reason, msg = cond(job, "FailureTarget")
    assert (st, reason) == ("True", "PodFailurePolicy") and "exit code 1" in msg
    assert find_cond(job, "Failed") is None and job["status"]["terminating"] == 1
    assert not is_true(srv.cluster.jobset(n), "Failed")
    assert not [e for e in events(srv, "Job") if e[1] == "PodFailurePolicy"]
    srv.world.advance(299)
    assert find_cond(jobs(srv, n)[0], "Failed") is None and srv.cluster.pods(n)
    srv.world.advance(2)  # the grace period ends: SIGKILL, the last pod is terminal
    (job,) = jobs(srv, n)
    assert cond(job, "Failed") == ("True", "PodFailurePolicy", msg)
    assert job["status"]["terminating"] == 0
    assert ("Job", "PodFailurePolicy", msg) in events(srv)
    assert cond(srv.cluster.jobset(n), "Failed")[:2] == ("True", "FailJobSetFailurePolicyAction")


def test_pod_failure_policy_ignore_on_disruption_target_recreates_the_pod(srv):
    """pod_failure_policy.go (onPodConditions DisruptionTarget, Ignore): a lost node's pod does not
    count against backoffLimit; the Job replaces it and nothing fails."""
    n = running(srv)
    lost = srv.cluster.node_lost(n, 1)
    pods = srv.cluster.pods(n)
    assert lost not in [p["metadata"]["name"] for p in pods] and len(pods) == 2
    (job,) = jobs(srv, n)
    assert find_cond(job, "Failed") is None and job["status"]["failed"] == 0
    assert not is_true(srv.cluster.jobset(n), "Failed") and srv.cluster.jobset(n)["status"]["restarts"] == 0


@pytest.mark.parametrize("rendered,restarts", [(True, 0), (False, 1)])
def test_node_maintenance_is_ignored_only_with_the_disruption_rule(srv, rendered, restarts):
    """pod_failure_policy.go: a pod ended by graceful node shutdown (DisruptionTarget
    TerminationByKubelet, exit 143) matches Ignore and is replaced; without the rule it counts,
    the Job fails and the JobSet restarts (RestartJobSet)."""
    n = running(srv, rendered=rendered, max_restarts=3)
    gone = srv.cluster.node_maintenance(n, 0)
    js = srv.cluster.jobset(n)
    assert js["status"]["restarts"] == restarts and not is_true(js, "Failed")
    if rendered:
        pods = srv.cluster.pods(n)
        assert len(pods) == 3 and [p["metadata"]["name"] for p in pods].count(gone) == 1  # kept, and replaced
        (job,) = jobs(srv, n)
        assert job["status"]["failed"] == 0


def test_backoff_limit_exceeded_then_restart_jobset_counts_towards_max(srv):
    """job_controller.go: failed > backoffLimit → Failed BackoffLimitExceeded; jobset
    failure_policy.go restartJobSetActionApplier (no matching rule → default RestartJobSet):
    restarts and restartsCountTowardsMax + 1, event RestartJobSetFailurePolicyAction."""
    n = running(srv, max_restarts=2)
    srv.cluster.pod_exit(n, 0, 3)  # exit 3: not a FailJob code, counted
    js = srv.cluster.jobset(n)
    assert (js["status"]["restarts"], js["status"]["restartsCountTowardsMax"]) == (1, 1)
    assert (
        "JobSet",
        "RestartJobSetFailurePolicyAction",
        "applying RestartJobSet failure policy action (first failed job: r-a1-slice-0)",
    ) in events(srv)
    (job,) = jobs(srv, n)  # the previous attempt's Job is gone and its successor carries restart-attempt 1
    assert job["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"] == "1"
    assert not find_cond(job, "Failed")


def test_reached_max_restarts(srv):
    """failure_policy.go restartJobSetActionApplier: restartsCountTowardsMax >= maxRestarts →
    Failed ReachedMaxRestarts "(first failed job: X)"."""
    n = running(srv, max_restarts=1)
    srv.cluster.pod_exit(n, 0, 3)
    srv.cluster.run_pods(n)
    srv.cluster.pod_exit(n, 0, 3)
    assert cond(srv.cluster.jobset(n), "Failed") == (
        "True",
        "ReachedMaxRestarts",
        "jobset failed due to reaching max number of restarts (first failed job: r-a1-slice-0)",
    )


def test_restart_and_ignore_max_restarts_does_not_count(srv):
    """failure_policy.go restartJobSetAndIgnoreMaxRestartsActionApplier: restarts + 1,
    restartsCountTowardsMax unchanged, so maxRestarts 0 does not stop it."""
    rule = {
        "name": "infra",
        "action": "RestartJobSetAndIgnoreMaxRestarts",
        "onJobFailureReasons": ["BackoffLimitExceeded"],
    }
    n = running(srv, max_restarts=0, rules=[FAIL_ON_USER_ERROR, rule])
    for _ in range(3):
        srv.cluster.pod_exit(n, 0, 3)
        srv.cluster.run_pods(n)
    js = srv.cluster.jobset(n)
    assert (js["status"]["restarts"], js["status"].get("restartsCountTowardsMax", 0)) == (3, 0)
    assert not is_true(js, "Failed")
    assert (
        "JobSet",
        "RestartJobSetAndIgnoreMaxRestartsFailurePolicyAction",
        "applying RestartJobSetAndIgnoreMaxRestarts failure policy action (first failed job: r-a1-slice-0)",
    ) in events(srv)


def test_failed_jobs_without_a_failure_policy(srv):
    """failure_policy.go executeFailurePolicy: no failurePolicy → FailedJobs."""
    make(srv, rendered=False)
    js = srv.world.get("JobSet", "default", "r-a1")
    del js["spec"]["failurePolicy"]
    srv.cluster.admit("r-a1")
    srv.cluster.run_pods("r-a1")
    srv.cluster.pod_exit("r-a1", 0, 1)
    assert cond(srv.cluster.jobset("r-a1"), "Failed") == (
        "True",
        "FailedJobs",
        "jobset failed due to one or more job failures (first failed job: r-a1-slice-0)",
    )


def test_restart_deletes_jobs_and_waits_for_pods_through_their_grace_period(srv):
    """jobset_controller.go reconcile: previous-attempt Jobs deleted with Foreground propagation and
    (constructJobsFromTemplate/shouldCreateJob) recreated only once gone; pods get SIGTERM and run
    out their grace period."""
    n = running(srv, max_restarts=2, grace=300)
    srv.cluster.hold_deletions = True  # containers take their whole grace period (a checkpoint)
    srv.cluster.pod_exit(n, 0, 3)
    (old,) = jobs(srv, n)
    terminating = [p for p in srv.cluster.pods(n) if p["metadata"].get("deletionTimestamp")]
    assert len(terminating) == 1 and terminating[0]["metadata"]["deletionGracePeriodSeconds"] == 300
    srv.world.advance(290)  # the Job is not Failed while its pod terminates: the JobSet has no reason yet
    assert len(jobs(srv, n)) == 1 and jobs(srv, n)[0]["metadata"]["uid"] == old["metadata"]["uid"]
    srv.world.held = True  # the kubelet alone; the controllers wait for settle()
    srv.world.advance(15)  # the grace period ends: SIGKILL
    with srv.store.lock:  # step the controllers: the Job fails, then the JobSet's restart deletes it
        jobctl.reconcile(srv.world, old)
        assert cond(old, "Failed")[:2] == ("True", "BackoffLimitExceeded")
        for _ in range(2):  # executeFailurePolicy (restarts + 1), then deleteJobs of the old attempt
            jobsetctl.reconcile(srv.world, srv.world.get("JobSet", "default", n))
        assert (
            old["metadata"].get("deletionTimestamp") and "foregroundDeletion" in old["metadata"]["finalizers"]
        )
    srv.world.settle()
    (new,) = jobs(srv, n)
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    assert new["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"] == "1"


def test_success_policy_all_and_workload_finished(srv):
    """jobset_controller.go executeSuccessPolicy + success_policy.go (operator All): Completed
    AllJobsCompleted, terminalState; kueue reconciler.go (job finished → Finish, FinishedWorkload)."""
    n = running(srv, replicas=2, workers=1)
    srv.cluster.pod_exit(n, 0, 0)
    assert not is_true(srv.cluster.jobset(n), "Completed")  # 1 of 2 Jobs
    srv.cluster.pod_exit(n, 1, 0)
    js = srv.cluster.jobset(n)
    assert cond(js, "Completed") == ("True", "AllJobsCompleted", "jobset completed successfully")
    assert js["status"]["terminalState"] == "Completed"
    assert cond(srv.cluster.workload(n), "Finished") == ("True", "Succeeded", "jobset completed successfully")
    assert any(r == "FinishedWorkload" for _, r, _ in events(srv, "JobSet"))


def test_success_policy_any(srv):
    """success_policy.go numJobsExpectedToSucceed: operator Any needs one Job."""
    n = running(srv, replicas=2, workers=1, success={"operator": "Any", "targetReplicatedJobs": ["slice"]})
    srv.cluster.pod_exit(n, 1, 0)
    assert is_true(srv.cluster.jobset(n), "Completed")


# ---------------------------------------------------------------- Kueue


def test_workload_created_with_owner_and_job_uid(srv):
    """jobframework reconciler.go handleJobWithNoWorkload/ConstructWorkload: controller owner
    reference, job-uid label, event CreatedWorkload; the webhook suspends the JobSet."""
    n = make(srv)
    js, wl = srv.cluster.jobset(n), srv.cluster.workload(n)
    assert js["spec"]["suspend"] is True and is_true(js, "Suspended")
    assert wl["metadata"]["labels"]["kueue.x-k8s.io/job-uid"] == js["metadata"]["uid"]
    assert wl["metadata"]["ownerReferences"][0]["uid"] == js["metadata"]["uid"]
    assert ("JobSet", "CreatedWorkload", f"Created Workload: default/{wl['metadata']['name']}") in events(srv)


def test_missing_workload_priority_class_builds_no_workload(srv):
    """reconciler.go ExtractPriority / priority.go GetPriorityFromWorkloadPriorityClass: a missing
    class fails the reconcile: no Workload, the JobSet stays suspended (issue 12, break 4)."""
    n = make(srv, labels={"kueue.x-k8s.io/priority-class": "high"})
    assert srv.cluster.workload(n) is None and srv.cluster.jobset(n)["spec"]["suspend"] is True
    assert (
        srv.world.reconcile_errors[srv.cluster.jobset(n)["metadata"]["uid"]]
        == 'workloadpriorityclasses.kueue.x-k8s.io "high" not found'
    )
    with srv.store.lock:
        srv.world.save("WorkloadPriorityClass", {"metadata": {"name": "high"}, "value": 1000}, new=True)
        srv.world.reconcile()
    wl = srv.cluster.workload(n)
    assert wl["spec"]["priority"] == 1000 and wl["spec"]["priorityClassName"] == "high"


def test_missing_local_queue_is_inadmissible(srv):
    """workload_controller.go Reconcile: QuotaReserved=False Inadmissible "LocalQueue X doesn't exist"."""
    n = make(srv, queue="multislice-queue-nope")
    assert cond(srv.cluster.workload(n), "QuotaReserved") == (
        "False",
        "Inadmissible",
        "LocalQueue multislice-queue-nope doesn't exist",
    )


def test_a_missing_resource_flavor_makes_the_cluster_queue_inactive(srv):
    """clusterqueue.go inactiveReason (FlavorNotFound) and workload_controller.go: the workload is
    Inadmissible "ClusterQueue X is inactive" until the flavor exists."""
    with srv.store.lock:
        srv.world.ensure_queue("other-queue", "other-cq", "missing-flavor", {"cpu": 8, "memory": "1Gi"})
        srv.store.delete(
            srv.store.resources[("kueue.x-k8s.io", "resourceflavors")],
            srv.world.get("ResourceFlavor", "", "missing-flavor"),
        )
        srv.world.reconcile()
    assert cond(srv.world.get("ClusterQueue", "", "other-cq"), "Active") == (
        "False",
        "FlavorNotFound",
        "Can't admit new workloads: references missing ResourceFlavor(s): missing-flavor.",
    )
    n = make(srv, queue="other-queue")
    assert cond(srv.cluster.workload(n), "QuotaReserved") == (
        "False",
        "Inadmissible",
        "ClusterQueue other-cq is inactive",
    )
    with srv.store.lock:
        srv.world.save("ResourceFlavor", {"metadata": {"name": "missing-flavor"}, "spec": {}}, new=True)
        srv.world.reconcile()
    assert is_true(srv.cluster.workload(n), "Admitted")  # the quota suffices: it fits


def test_a_resource_the_cluster_queue_does_not_cover(srv):
    """flavorassigner.go: "resource R unavailable in ClusterQueue"."""
    with srv.store.lock:
        srv.world.ensure_queue("cpu-queue", "cpu-cq", "cpu-flavor", {"cpu": 8})
    n = make(srv, queue="cpu-queue")
    assert cond(srv.cluster.workload(n), "QuotaReserved") == (
        "False",
        "Pending",
        "couldn't assign flavors to pod set slice: resource memory unavailable in ClusterQueue",
    )


def test_insufficient_quota_is_pending_with_the_flavor_assigners_message(srv):
    """flavorassigner.go: "insufficient unused quota for R in flavor F, N more needed"; event Pending."""
    n = make(srv)
    msg = (
        "couldn't assign flavors to pod set slice: insufficient unused quota for cpu in flavor tpu-flavor, "
        "200m more needed"
    )
    assert cond(srv.cluster.workload(n), "QuotaReserved") == ("False", "Pending", msg)
    assert ("Workload", "Pending", msg) in events(srv)


def test_admission_resumes_the_jobset(srv):
    """scheduler SetQuotaReservation + admissionchecks.go SyncAdmittedCondition + reconciler.go
    startJob: QuotaReserved, Admitted, events QuotaReserved/Admitted/Started, JobSet resumed."""
    n = running(srv)
    wl, js = srv.cluster.workload(n), srv.cluster.jobset(n)
    assert cond(wl, "QuotaReserved")[:2] == ("True", "QuotaReserved")
    assert cond(wl, "Admitted") == ("True", "Admitted", "The workload is admitted")
    assert js["spec"]["suspend"] is False and cond(js, "Suspended")[:2] == ("False", "ResumeJobs")
    reasons = {r for _, r, _ in events(srv)}
    assert {"QuotaReserved", "Admitted", "Started"} <= reasons


def test_preemption_by_priority_suspends_requeues_and_resumes_the_same_jobset(srv):
    """preemption.go IssuePreemptions + workload.go Evict (event EvictedDueToPreempted) + reconciler.go
    eviction: stopJob (suspend, event Stopped), and once the pods are gone Requeued=True (only for
    Preempted and NodeFailures) and QuotaReserved=False; on new capacity the same JobSet resumes."""
    n = running(srv)
    uid = srv.cluster.jobset(n)["metadata"]["uid"]
    srv.cluster.hold_deletions = True  # the pods checkpoint through their grace period
    srv.cluster.evict(n)
    wl = srv.cluster.workload(n)
    assert cond(wl, "Evicted")[:2] == ("True", "Preempted") and cond(wl, "Preempted")[:2] == (
        "True",
        "InClusterQueue",
    )
    assert cond(wl, "Evicted")[2].startswith("Preempted to accommodate a workload (UID: ")
    assert srv.cluster.jobset(n)["spec"]["suspend"] is True
    # The Jobs' `active` leaves out terminating pods, so the JobSet is no longer active and Kueue requeues
    # it (and frees its quota) while its pods are still writing their checkpoint.
    assert all(p["metadata"].get("deletionTimestamp") for p in srv.cluster.pods(n)) and srv.cluster.pods(n)
    assert cond(wl, "Requeued")[:2] == ("True", "Preempted") and cond(wl, "QuotaReserved")[:2] == (
        "False",
        "Pending",
    )
    assert ("Workload", "EvictedDueToPreempted", cond(wl, "Evicted")[2]) in events(srv)
    assert ("JobSet", "Stopped", cond(wl, "Evicted")[2]) in events(srv)
    assert srv.cluster.finish_deletions() == []  # nothing was deleting the JobSet; its pods now exit
    assert srv.cluster.pods(n) == []
    srv.cluster.admit(n)  # capacity comes back
    js = srv.cluster.jobset(n)
    assert js["metadata"]["uid"] == uid and js["spec"]["suspend"] is False
    assert cond(srv.cluster.workload(n), "Evicted")[:2] == ("False", "QuotaReserved")


def pod_template(obj):
    """The pod template of a JobSet's first replicated job, or of a Job."""
    spec = (
        obj["spec"]["replicatedJobs"][0]["template"]["spec"]
        if "replicatedJobs" in obj["spec"]
        else obj["spec"]
    )
    return spec["template"]


def test_admission_merges_the_flavors_tolerations_and_eviction_restores_the_template(srv):
    """podset.go FromAssignment + Merge (reconciler.go startJob, the JobSet integration's
    RunWithPodSetsInfo): the flavor's nodeLabels join the nodeSelector and its tolerations the
    tolerations, with the pod-set label; jobset_controller.go resumeJob carries them into the Jobs, so
    the pods tolerate the flavor's taint. stopJob's RestorePodSetsInfo (podset.go RestorePodSpec)
    sets the template back to the Workload's pod set."""
    tol = {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}
    with srv.store.lock:
        rf = srv.world.get("ResourceFlavor", "", "tpu-flavor")
        rf["spec"].update(nodeLabels={"cloud.google.com/gke-nodepool": "pool-a"}, tolerations=[tol])
        srv.world.save("ResourceFlavor", rf)
    n = make(srv)
    original = copy.deepcopy(pod_template(srv.cluster.jobset(n)))
    srv.cluster.admit(n)
    srv.cluster.run_pods(n)
    tmpl = pod_template(srv.cluster.jobset(n))
    assert tmpl["spec"]["tolerations"] == [tol]
    assert tmpl["spec"]["nodeSelector"] == {"cloud.google.com/gke-nodepool": "pool-a"}
    assert tmpl["metadata"]["labels"]["kueue.x-k8s.io/podset"] == "slice"
    (job,) = jobs(srv, n)
    assert pod_template(job)["spec"]["tolerations"] == [tol]
    pods = srv.cluster.pods(n)
    assert len(pods) == 2 and all(p["spec"]["tolerations"] == [tol] for p in pods)
    srv.cluster.evict(n)  # preempted: stopJob
    js = srv.cluster.jobset(n)
    assert js["spec"]["suspend"] is True
    assert pod_template(js) == original == srv.cluster.workload(n)["spec"]["podSets"][0]["template"]


def test_a_conflicting_pod_set_label_is_a_permanent_start_failure(srv):
    """podset.go Merge (utilmaps.HaveConflict): a key the template already holds with another
    value is BadPodSetsUpdateError, a permanent error: reconciler.go finishes the Workload
    (FailedToStart) and the JobSet stays suspended, its template unchanged."""
    js = tiny_jobset("p-a1", run="p")
    pod_template(js)["metadata"]["labels"]["kueue.x-k8s.io/podset"] = "other"  # Kueue's own label
    n = submit(srv, js)
    before = copy.deepcopy(pod_template(srv.cluster.jobset(n)))
    with srv.store.lock:
        srv.world.add_quota("cluster-queue", "tpu-flavor", "cpu", 8)
        srv.world.add_quota("cluster-queue", "tpu-flavor", "memory", 2**33)
        srv.world.reconcile()
    assert cond(srv.cluster.workload(n), "Finished") == (
        "True",
        "FailedToStart",
        "invalid admission check PodSetUpdate: conflict for labels: conflict for "
        "key=kueue.x-k8s.io/podset, value1=other, value2=slice",
    )
    js = srv.cluster.jobset(n)
    assert js["spec"]["suspend"] is True and pod_template(js) == before


def test_readmission_on_another_flavor_restores_then_merges(srv):
    """reconciler.go stopJob (RestorePodSetsInfo) then startJob (FromAssignment + Merge) on the new
    assignment: the JobSet's template holds only the second flavor's labels and toleration. Its
    Jobs, suspended rather than deleted, are merged into by jobset_controller.go resumeJob
    (collections.MergeMaps/MergeSlices, JobSet v0.10.1), which removes nothing: they keep the
    first flavor's toleration and node label too (jobset#1294, open upstream)."""
    tol_a = {"key": "pool", "operator": "Equal", "value": "a", "effect": "NoSchedule"}
    tol_b = {"key": "pool", "operator": "Equal", "value": "b", "effect": "NoSchedule"}
    with srv.store.lock:
        for f, tol, label in (("flavor-a", tol_a, "zone-a"), ("flavor-b", tol_b, "zone-b")):
            srv.world.save(
                "ResourceFlavor",
                {"metadata": {"name": f}, "spec": {"nodeLabels": {label: "true"}, "tolerations": [tol]}},
                new=True,
            )
        quota = {"flavor-a": {"cpu": "1", "memory": "1Gi"}, "flavor-b": {"cpu": "0", "memory": "0"}}
        srv.world.save(
            "ClusterQueue",
            {
                "metadata": {"name": "two-cq"},
                "spec": {
                    "namespaceSelector": {},
                    "resourceGroups": [
                        {
                            "coveredResources": ["cpu", "memory"],
                            "flavors": [
                                {
                                    "name": f,
                                    "resources": [{"name": r, "nominalQuota": q} for r, q in qs.items()],
                                }
                                for f, qs in quota.items()
                            ],
                        }
                    ],
                },
            },
            new=True,
        )
        srv.world.save(
            "LocalQueue",
            {"metadata": {"name": "two-queue", "namespace": "default"}, "spec": {"clusterQueue": "two-cq"}},
            new=True,
        )
    n = make(srv, queue="two-queue")  # admitted on flavor-a, the first with quota
    assert srv.cluster.workload(n)["status"]["admission"]["podSetAssignments"][0]["flavors"] == {
        "cpu": "flavor-a",
        "memory": "flavor-a",
    }
    with srv.store.lock:  # flavor-a's capacity goes to flavor-b; the running workload keeps its own
        for res, q in (("cpu", 1), ("memory", 2**30)):
            srv.world.add_quota("two-cq", "flavor-a", res, -q)
            srv.world.add_quota("two-cq", "flavor-b", res, q)
    srv.cluster.evict(n, reason="NodeFailures", preempted_reason=None)  # requeued at once, readmitted
    wl, js = srv.cluster.workload(n), srv.cluster.jobset(n)
    assert wl["status"]["admission"]["podSetAssignments"][0]["flavors"] == {
        "cpu": "flavor-b",
        "memory": "flavor-b",
    }
    assert js["spec"]["suspend"] is False
    tmpl = pod_template(js)
    assert tmpl["spec"]["tolerations"] == [tol_b] and tmpl["spec"]["nodeSelector"] == {"zone-b": "true"}
    recorded = wl["spec"]["podSets"][0]["template"]  # what RestorePodSetsInfo went back to
    assert tmpl["metadata"]["labels"] == {**recorded["metadata"]["labels"], "kueue.x-k8s.io/podset": "slice"}
    assert "tolerations" not in recorded["spec"] and "nodeSelector" not in recorded["spec"]
    (job,) = jobs(srv, n)
    assert pod_template(job)["spec"]["tolerations"] == [tol_a, tol_b]
    assert pod_template(job)["spec"]["nodeSelector"] == {"zone-a": "true", "zone-b": "true"}


@pytest.mark.parametrize(
    "reason,requeued", [("NodeFailures", "True"), ("PodsReadyTimeout", "False"), ("AdmissionCheck", "False")]
)
def test_requeued_as_upstream_sets_it(srv, reason, requeued):
    """reconciler.go: SetRequeuedCondition(status = reason in {Preempted, NodeFailures}); PodsReadyTimeout
    and AdmissionCheck come with a requeueState backoff (workload.go UpdateRequeueState) after which
    workload_controller.go sets Requeued=True BackoffFinished."""
    n = running(srv)
    srv.cluster.evict(n, reason=reason, preempted_reason=None)
    wl = srv.cluster.workload(n)
    assert cond(wl, "Requeued")[:2] == (requeued, reason)
    assert (wl["status"].get("requeueState") is not None) == (reason != "NodeFailures")
    assert any(r == f"EvictedDueTo{reason}" for _, r, _ in events(srv, "Workload"))


def test_deactivation_evicts_without_requeue(srv):
    """workload_controller.go: spec.active=false → Evict(Deactivated); no Requeued=True."""
    n = running(srv)
    srv.cluster.evict(n, reason="Deactivated", preempted_reason=None)
    wl = srv.cluster.workload(n)
    assert cond(wl, "Evicted")[:2] == ("True", "Deactivated") and cond(wl, "Requeued")[:2] == (
        "False",
        "Deactivated",
    )


def test_pods_ready_timeout_evicts_with_a_backoff_then_requeues(srv):
    """workload_controller.go (waitForPodsReady): admitted pods not ready within the timeout →
    Evict(PodsReadyTimeout) + UpdateRequeueState (60 s · 2^(n-1)); reconciler.go: Requeued=False;
    once requeueAt passes, Requeued=True BackoffFinished and the workload queues again."""
    srv.world.pods_ready_timeout_s = 600
    n = make(srv)
    srv.cluster.admit(n)  # pods created, never scheduled
    srv.world.advance(601)
    wl = srv.cluster.workload(n)
    assert cond(wl, "Evicted") == (
        "True",
        "PodsReadyTimeout",
        f"Exceeded the PodsReady timeout default/{wl['metadata']['name']}",
    )
    assert (
        cond(wl, "Requeued")[:2] == ("False", "PodsReadyTimeout")
        and wl["status"]["requeueState"]["count"] == 1
    )
    assert srv.cluster.jobset(n)["spec"]["suspend"] is True
    srv.world.advance(61)
    wl = srv.cluster.workload(n)
    assert cond(wl, "Requeued") == ("True", "BackoffFinished", "The workload backoff was finished")
    assert "requeueAt" not in wl["status"]["requeueState"]
    assert is_true(wl, "QuotaReserved")  # the quota it had is free again: readmitted


def golden(name="g-a1", host_network=True):
    """The rendered v5p-8 smoke JobSet (tests/goldens), in namespace default."""
    import pathlib

    import yaml

    js = yaml.safe_load((pathlib.Path(__file__).parent / "goldens" / "v5p-8-smoke.yaml").read_text())
    js["metadata"].update(name=name, namespace="default")
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["serviceAccountName"] = "olmo-ctl"  # the test server's account (the goldens name another)
    if host_network:  # the site setting host_network (off in the goldens)
        pod.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    else:
        pod.pop("hostNetwork", None)
    return js


def enforce_baseline(srv):
    with srv.store.lock:
        ns = srv.world.get("Namespace", "", "default")
        ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] = "baseline"
        srv.world.save("Namespace", ns)


def submit(srv, js):
    res = srv.api.route("/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets")[0]
    with srv.store.lock:
        srv.api.create(res, "v1alpha2", "default", js, {})
        srv.world.written()
    return js["metadata"]["name"]


def test_pod_security_refuses_host_network_pods_with_failed_create(srv):
    """Pod Security admission (baseline: host namespaces) refuses the Job's pods; job_controller.go
    records a FailedCreate event and retries. The workload stays admitted, holding its quota."""
    enforce_baseline(srv)
    n = submit(srv, golden())
    srv.cluster.admit(n)
    assert srv.cluster.pods(n) == [] and is_true(srv.cluster.workload(n), "Admitted")
    (fc,) = [m for k, r, m in events(srv, "Job") if r == "FailedCreate"]
    assert (
        fc == 'Error creating: pods "g-a1-slice-0-0-" is forbidden: violates PodSecurity "baseline:latest": '
        "host namespaces (hostNetwork=true)"
    )
    n2 = submit(srv, golden("h-a1", host_network=False))  # without hostNetwork the same pods are admitted
    srv.cluster.admit(n2)
    assert len(srv.cluster.pods(n2)) == 1


# ---------------------------------------------------------------- what the faithful cluster exposes


def test_a_missing_workload_priority_class_is_named_by_the_backend():
    from olmo_ctl.backends.gke import GKEBackend
    from olmo_ctl.backends.kube import KubeRetryPolicy

    fast = KubeRetryPolicy(base_s=0.01, max_s=0.05, budget_s=3.0, connect_timeout_s=1.0, read_timeout_s=5.0)
    with KubeServer() as srv:
        b = GKEBackend(namespace="default", host=srv.url, retry=fast)
        js = tiny_jobset("w-a1", run="w")
        js["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] = "high"
        h = b.send(js)
        assert srv.cluster.workload(h.name) is None  # upstream: no Workload without its priority class
        st = b.status(h)
        assert st.state.terminal or "high" in st.reason, st
        assert st.config_error == (
            'Kueue cannot create the Workload: WorkloadPriorityClass "high" does '
            "not exist (label kueue.x-k8s.io/priority-class)"
        )
        with srv.store.lock:  # once the class exists Kueue builds the Workload: only a wait again
            srv.world.save("WorkloadPriorityClass", {"metadata": {"name": "high"}, "value": 1000}, new=True)
            srv.world.reconcile()
        st = b.status(h)
        assert srv.cluster.workload(h.name) is not None and st.config_error is None, st


@pytest.mark.parametrize("case", ["no-local-queue", "no-cluster-queue", "no-flavor-for-the-slice"])
def test_a_queue_set_up_that_can_never_admit_is_named_by_the_backend(case):
    """workload_controller.go: Inadmissible "LocalQueue X doesn't exist" / "ClusterQueue X doesn't
    exist"; flavorassigner.go: "flavor X doesn't match node affinity" for every flavor of the group."""
    from olmo_ctl.backends.gke import GKEBackend
    from olmo_ctl.backends.kube import KubeRetryPolicy

    fast = KubeRetryPolicy(base_s=0.01, max_s=0.05, budget_s=3.0, connect_timeout_s=1.0, read_timeout_s=5.0)
    with KubeServer() as srv:
        b = GKEBackend(namespace="default", host=srv.url, retry=fast)
        js = golden("q-a1", host_network=False)
        want = {
            "no-local-queue": "LocalQueue nope doesn't exist",
            "no-cluster-queue": "ClusterQueue cq2 doesn't exist",
            "no-flavor-for-the-slice": "couldn't assign flavors to pod set slice: flavor v5p-flavor doesn't "
            "match node affinity",
        }[case]
        with srv.store.lock:
            if case == "no-local-queue":
                js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = "nope"
            elif case == "no-cluster-queue":
                srv.world.save(
                    "LocalQueue",
                    {"metadata": {"name": "lq2", "namespace": "default"}, "spec": {"clusterQueue": "cq2"}},
                    new=True,
                )
                js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = "lq2"
            else:
                srv.world.ensure_queue(
                    "lq3",
                    "cq3",
                    "v5p-flavor",
                    {"google.com/tpu": 4096, "cpu": 100000, "memory": 2**50},
                    node_labels={"cloud.google.com/gke-tpu-accelerator": "tpu7x"},
                )
                js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = "lq3"
        st = b.status(b.send(js))
        assert st.state.live and st.config_error == want, st
        assert want in st.reason


def test_waiting_for_capacity_is_not_a_configuration_error():
    from olmo_ctl.backends.gke import GKEBackend
    from olmo_ctl.backends.kube import KubeRetryPolicy

    fast = KubeRetryPolicy(base_s=0.01, max_s=0.05, budget_s=3.0, connect_timeout_s=1.0, read_timeout_s=5.0)
    with KubeServer() as srv:
        b = GKEBackend(namespace="default", host=srv.url, retry=fast)
        st = b.status(b.send(golden("c-a1", host_network=False)))
        assert "insufficient unused quota" in st.reason and st.config_error is None, st


def test_pods_refused_at_creation_are_reported_with_the_cause():
    from olmo_ctl.backends.gke import GKEBackend
    from olmo_ctl.backends.kube import KubeRetryPolicy

    fast = KubeRetryPolicy(base_s=0.01, max_s=0.05, budget_s=3.0, connect_timeout_s=1.0, read_timeout_s=5.0)
    with KubeServer() as srv:
        enforce_baseline(srv)
        b = GKEBackend(namespace="default", host=srv.url, retry=fast)
        h = b.send(golden("p-a1"))
        srv.cluster.admit(h.name)
        st = b.status(h)
        assert "hostNetwork" in st.reason or "FailedCreate" in st.reason, st
        assert st.state.live and st.pods_refused is True
        assert st.reason == (
            '0/1 pods created; FailedCreate: Job p-a1-slice-0: Error creating: pods "p-a1-slice-0-0-" '
            'is forbidden: violates PodSecurity "baseline:latest": host namespaces (hostNetwork=true)'
        )


def test_queue_status_counts_pending_and_admitted_workloads_for_kubectl_get(srv):
    """localqueue_controller.go / clusterqueue_controller.go status: pendingWorkloads,
    reservingWorkloads, admittedWorkloads, which `kubectl get localqueue,clusterqueue` prints through
    the CRDs' printer columns (PENDING WORKLOADS, ADMITTED WORKLOADS); a finished workload counts in none."""
    a = running(srv, "qa-a1", replicas=1, workers=1)
    make(srv, "qb-a1")  # no capacity for it: pending

    def counts(kind, ns, name):
        path = {
            "LocalQueue": f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{ns}/localqueues",
            "ClusterQueue": "/apis/kueue.x-k8s.io/v1beta2/clusterqueues",
        }[kind]
        with srv.store.lock:
            items = srv.world.items(kind, ns or None)
            table = srv.api.as_table(path, {"kind": f"{kind}List", "items": items})
        names = [c["name"] for c in table["columnDefinitions"]]
        (row,) = [r["cells"] for r in table["rows"] if r["cells"][0] == name]
        return {k: row[names.index(k)] for k in ("Pending Workloads", "Admitted Workloads")}

    assert counts("LocalQueue", "default", "user-queue") == {"Pending Workloads": 1, "Admitted Workloads": 1}
    assert counts("ClusterQueue", "", "cluster-queue") == {"Pending Workloads": 1, "Admitted Workloads": 1}
    srv.cluster.pod_exit(a, 0, 0)  # qa finishes
    assert cond(srv.cluster.workload(a), "Finished")[0] == "True"
    assert counts("LocalQueue", "default", "user-queue") == {"Pending Workloads": 1, "Admitted Workloads": 0}
    srv.cluster.admit("qb-a1")  # capacity for qb appears
    assert counts("LocalQueue", "default", "user-queue") == {"Pending Workloads": 0, "Admitted Workloads": 1}
    assert counts("ClusterQueue", "", "cluster-queue") == {"Pending Workloads": 0, "Admitted Workloads": 1}
