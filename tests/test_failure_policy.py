"""The launch template's failure policy on the sandbox's world: restarts that do not run out.

The JobSet is the one olmo-ctl renders (smoke recipe, v5p-16: two hosts); the causes are physical
(a spot reclaim, a node lost past its toleration, a repair's drain, a just-repaired kubelet) plus
what the trainer does when a peer host is lost (it exits 3, `trainer/multihost.py`); the outcomes
come from the ported Job, JobSet and node rules. No trainer runs: the whole file takes seconds.
"""

from __future__ import annotations

import pytest

from olmo_ctl.backends.jobset import render_jobset
from olmo_ctl.core.batching import make_plan
from olmo_ctl.core.config import Settings
from olmo_ctl.core.contracts import EXIT_RESTART, EXIT_SIGTERM
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.sandbox.cluster.objects import find_cond, is_true, pod_terminal
from olmo_ctl.sandbox.faults import parse_fault
from olmo_ctl.sandbox.sandbox import LOCAL_QUEUE, Sandbox, SandboxWorld

NAME = "smoke-a1"


@pytest.fixture
def sb():
    with Sandbox(slices={"v5p-16": 1}) as sb:
        recipe, dev = load_recipe("smoke"), get_device("v5p-16")
        settings = Settings(run_root="gs://b/runs", queue=LOCAL_QUEUE, image="us-docker.pkg.dev/p/r/olmo:1")
        js = render_jobset(recipe, make_plan(recipe, dev), dev, settings, "smoke", 1, "gs://b/runs/smoke")
        assert js["metadata"]["name"] == NAME and js["spec"]["failurePolicy"]["maxRestarts"] == 3
        with sb.server.store.lock:
            sb.world.save("JobSet", js, new=True)
            sb.world.reconcile()
        assert len(running(sb.world)) == 2
        yield sb


def running(w: SandboxWorld) -> list[dict]:
    return [p for p in w.jobset_pods(NAME, live_only=True) if p["status"].get("phase") == "Running"]


def jobset(w: SandboxWorld) -> dict:
    return w.get("JobSet", "default", NAME)


def counts(w: SandboxWorld) -> tuple[int, int]:
    st = jobset(w)["status"]
    return int(st.get("restarts") or 0), int(st.get("restartsCountTowardsMax") or 0)


def survivors_exit_3(w: SandboxWorld) -> None:
    """The hosts whose peer is gone: the distributed runtime aborts them and the trainer exits 3."""
    with w.store.lock:
        for pod in running(w):
            w.container_exit(pod, EXIT_RESTART)
        w.reconcile()


def node_of(pod: dict) -> str:
    return pod["spec"]["nodeName"]


def test_preemptions_host_events_repairs_and_kubelet_refusals_never_spend_max_restarts(sb):
    """Five disruptions in a row on a JobSet with maxRestarts 3: each restarts it (RestartOnLostPeer or
    RestartOnPodNotStarted: RestartJobSetAndIgnoreMaxRestarts, jobset failure_policy.go), none counts,
    and it runs again on both hosts after each."""
    w = sb.world
    seen = 0

    def restarted(why: str) -> None:
        nonlocal seen
        r, counted = counts(w)
        assert r == seen + 1 and counted == 0, (why, jobset(w)["status"])
        assert not is_true(jobset(w), "Failed"), why
        seen = r

    # 1. A spot reclaim of one host: the kubelet's graceful shutdown (DisruptionTarget, exit 143) is
    # Ignored; the survivor exits 3. The VM is back an hour later.
    victim = node_of(running(w)[0])
    w.nodes.spot_reclaim([victim], 3600)
    w.reconcile()
    survivors_exit_3(w)
    restarted("spot reclaim")
    w.advance(31)  # GCE's notice ends: the VM is gone, for an hour
    assert len(running(w)) == 1
    w.advance(3600)
    assert len(running(w)) == 2

    # 2. One host's node stops answering (NotReady): the survivor exits 3 once the coordination service
    # has missed the lost host's heartbeats; the pod on the silent node is evicted after its 300 s
    # toleration (DeletionByTaintManager, Ignored) and stays Terminating until its kubelet is back.
    lost, survivor = running(w)
    w.nodes.not_ready([node_of(lost)], 600)
    w.advance(61)
    with w.store.lock:
        w.container_exit(survivor, EXIT_RESTART)
        w.reconcile()
    w.advance(600)
    restarted("node not ready")
    assert len(running(w)) == 2

    # 3. A repair of the slice: drained through the Eviction API (EvictionByEvictionAPI, Ignored), the
    # nodes removed for 20 minutes; 4. they come back with a kubelet whose device plugin is not ready:
    # the new pods are refused (UnexpectedAdmissionError, no exit code: RestartOnPodNotStarted).
    sb.fault(parse_fault({"kind": "repair", "pool": "v5p-16", "for": "20m"}))
    restarted_by_repair = counts(w)[0]
    sb.fault(parse_fault({"kind": "admission-error", "pool": "v5p-16", "for": "30m"}))
    w.advance(20 * 60 + 1)
    w.advance(1)  # the kubelets' pod sync: refused
    # The refused pods are gone with their Jobs by now (the restart deleted them): their events stay.
    refused = [e for e in sb.server.cluster.events() if e["reason"] == "UnexpectedAdmissionError"]
    assert refused and refused[0]["message"].startswith("Allocate failed due to requested number of devices")
    assert counts(w)[0] > restarted_by_repair and counts(w)[1] == 0
    seen = counts(w)[0]
    sb.fault(parse_fault({"kind": "capacity", "pool": "v5p-16", "nodes": 2}))  # the device plugins are up
    w.advance(2)
    assert len(running(w)) == 2 and counts(w)[1] == 0

    # 5. Another spot reclaim: still not counted, although the JobSet has restarted more than
    # maxRestarts times by now.
    w.nodes.spot_reclaim([node_of(running(w)[1])], 60)
    w.reconcile()
    survivors_exit_3(w)
    restarted("second spot reclaim")
    assert seen > 3
    w.advance(31)
    w.advance(60)
    assert len(running(w)) == 2 and not is_true(jobset(w), "Failed")


@pytest.mark.parametrize(
    "code,reason",
    [(137, "ReachedMaxRestarts"), (139, "ReachedMaxRestarts"), (1, "FailJobSetFailurePolicyAction")],
)
def test_a_crash_spends_max_restarts_and_a_user_error_fails_at_once(sb, code, reason):
    """Pod rule 3 (any other exit: an OOM kill, a segfault) is RestartOnCrash, counted: the fourth fails
    the JobSet ReachedMaxRestarts; exit 1 (pod rule 0) fails it at once."""
    w = sb.world
    for _ in range(5):
        if is_true(jobset(w), "Failed"):
            break
        with w.store.lock:
            w.container_exit(running(w)[0], code)
            w.reconcile()
        w.advance(60)  # the other host's pod finishes its grace period; the Jobs are recreated
    c = find_cond(jobset(w), "Failed")
    assert c is not None and c["reason"] == reason, jobset(w)["status"]
    restarts, counted = counts(w)
    assert (restarts, counted) == ((3, 3) if code != 1 else (0, 0))


def test_a_crash_then_its_survivors_exit_3_counts_once(sb):
    """The crashing host's pod fails first; the Job fails on it (pod rule 3, counted) and the survivors'
    exit 3 comes from pods the restart is already deleting: one counted restart, not an uncounted one."""
    w = sb.world
    with w.store.lock:
        crashed, survivor = running(w)
        w.container_exit(crashed, 137)
        w.reconcile()
        if not pod_terminal(survivor):
            w.container_exit(survivor, EXIT_RESTART)
        w.reconcile()
    assert counts(w) == (1, 1)


def survivors_stop_together(w: SandboxWorld) -> None:
    """The hosts whose peer was disrupted: the trainer's stop agreement (trainer/multihost.py, JAX's
    preemption sync) has every host checkpoint the agreed step and exit 143, the ones that received
    no SIGTERM of their own and have no DisruptionTarget too."""
    with w.store.lock:
        for pod in running(w):
            assert find_cond(pod, "DisruptionTarget") is None
            w.container_exit(pod, EXIT_SIGTERM)
        w.reconcile()


def test_four_single_host_repairs_in_one_attempt_never_count_and_it_finishes(sb):
    """A v5p-16 of two hosts; one node at a time repaired four times in one attempt (drained through the
    Eviction API: DisruptionTarget, pod rule 0 `Ignore`). The other host stops on the agreed step and
    exits 143 without a DisruptionTarget: pod rule 2 (`FailJob` `In [3, 143]`), `RestartOnAgreedStop`
    (`RestartJobSetAndIgnoreMaxRestarts`), not counted. Four restarts, none counted (maxRestarts is 3),
    and the same JobSet completes when its trainers finish."""
    w = sb.world
    for k in range(4):
        sb.fault(parse_fault({"kind": "repair", "pool": "v5p-16", "nodes": 1, "for": "15s"}))
        survivors_stop_together(w)
        assert counts(w) == (k + 1, 0) and not is_true(jobset(w), "Failed"), jobset(w)["status"]
        w.advance(16)  # the repaired node is back
        w.advance(2)
        assert len(running(w)) == 2, k
    with w.store.lock:
        for pod in running(w):
            w.container_exit(pod, 0)
        w.reconcile()
    assert is_true(jobset(w), "Completed") and counts(w) == (4, 0), jobset(w)["status"]


@pytest.mark.parametrize("code", [1, 2, 137])
def test_a_disrupted_pod_whose_trainer_fails_while_torn_down_is_still_a_disruption(sb, code):
    """Pod rule 0 is the disruption: a trainer that exits 1, 2 or 137 while its spot VM shuts down (a
    write cut off, the kill at the end of the grace period) is Ignored, not a user error that fails the
    JobSet or a crash that counts (Kubernetes applies the first matching rule, pod_failure_policy.go)."""
    w = sb.world
    victim = running(w)[0]
    w.nodes.spot_reclaim([node_of(victim)], 60)
    w.reconcile()
    with w.store.lock:
        victim = w.get("Pod", victim["metadata"]["namespace"], victim["metadata"]["name"])
        w.container_exit(victim, code)
        w.reconcile()
    survivors_stop_together(w)
    assert not is_true(jobset(w), "Failed") and counts(w) == (1, 0), jobset(w)["status"]


def test_a_crash_on_one_slice_counts_whatever_the_other_slice_failed_with():
    """Two slices: a host of slice 0 crashes (137) while every other host, its peer gone, exits 3; both
    Jobs are Failed when the JobSet controller looks. Its rules are tried in order against every failed
    Job (failure_policy.go findFirstFailedPolicyRuleAndJob): RestartOnCrash comes before RestartOnLostPeer,
    so the crash is counted."""
    with Sandbox(slices={"v5p-16": 2}) as box:
        recipe, dev = load_recipe("smoke"), get_device("v5p-16")
        settings = Settings(run_root="gs://b/runs", queue=LOCAL_QUEUE, image="us-docker.pkg.dev/p/r/olmo:1")
        plan = make_plan(recipe, dev, 2)
        js = render_jobset(recipe, plan, dev, settings, "smoke", 1, "gs://b/runs/smoke", slices=2)
        w = box.world
        with box.server.store.lock:
            w.save("JobSet", js, new=True)
            w.reconcile()
        pods = running(w)
        assert len(pods) == 4
        by_slice = sorted(pods, key=lambda p: p["metadata"]["name"])
        with w.store.lock:
            w.container_exit(by_slice[0], 137)  # slice 0, host 0
            for pod in by_slice[1:]:  # the other hosts, their peer gone (slice 0's Job is Failed once
                w.container_exit(pod, EXIT_RESTART)  # its last pod is terminal: Kubernetes >= 1.31)
            w.reconcile()
        assert counts(w) == (1, 1), jobset(w)["status"]


def test_a_crash_whose_job_fails_after_the_lost_peers_is_uncounted_by_jobset_and_counted_by_the_backend():
    """The race JobSet's rules cannot close: host 0 of slice 0 crashes (137); its Job gets FailureTarget
    and its other host is stopped (SIGTERM, still writing); the Job is Failed only once that host has
    terminated (Kubernetes >= 1.31). Slice 1's hosts, their peer gone, exit 3 at once: their Job is
    Failed first, RestartOnLostPeer matches, and JobSet restarts without counting. The crashed Job
    stays while it is deleted (JobSet deletes with Foreground propagation: jobset_controller.go
    deleteJobs, v0.10.1) and carries its FailureTarget message; the GKE backend's status counts it."""
    from olmo_ctl.backends.base import Handle
    from olmo_ctl.backends.gke import GKEBackend

    with Sandbox(slices={"v5p-16": 2}) as box:
        recipe, dev = load_recipe("smoke"), get_device("v5p-16")
        settings = Settings(run_root="gs://b/runs", queue=LOCAL_QUEUE, image="us-docker.pkg.dev/p/r/olmo:1")
        js = render_jobset(
            recipe, make_plan(recipe, dev, 2), dev, settings, "smoke", 1, "gs://b/runs/smoke", slices=2
        )
        w = box.world
        with box.server.store.lock:
            w.save("JobSet", js, new=True)
            w.reconcile()
        pods = sorted(running(w), key=lambda p: p["metadata"]["name"])
        assert len(pods) == 4
        backend = GKEBackend(namespace="default", host=box.url)
        handle = Handle(backend.name, NAME, 1, {"namespace": "default", "run": "smoke"})
        assert backend.status(handle).crashes == ()
        with w.store.lock:
            w.sigterm_exit_s = 30.0  # a stopped host writes its checkpoint before it exits
            w.container_exit(pods[0], 137)  # slice 0, host 0 crashes; host 1 is told to stop
            w.reconcile()
            for pod in pods[2:]:  # slice 1: the peer is gone
                w.container_exit(pod, EXIT_RESTART)
            w.reconcile()
        assert counts(w) == (1, 0), jobset(w)["status"]  # JobSet counted no crash
        st = backend.status(handle)
        assert st.details["max_restarts"] == 3
        (crash,) = st.crashes
        assert (
            crash[0] == "smoke-a1-slice-0"
            and "with exit code 137 matching FailJob rule at index 3" in crash[2]
        )
