"""GKE backend against the Kubernetes API test server (and, opt-in, a real cluster).

The `env` fixture runs each lifecycle test twice: against `KubeServer` (the scripted cluster plays
Kueue, JobSet and the kubelet) and against the cluster of $OLMO_CTL_TEST_KUBECONFIG (JobSet and
Kueue installed; real controllers play their own part, the scripted steps are no-ops there).
Fault-injection tests run against the test server only.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
from helpers.attempts import attempt, attempt_of

from olmo_ctl.backends.base import Handle, State
from olmo_ctl.backends.gke import GKEBackend
from olmo_ctl.backends.kube import KubeRetryPolicy
from olmo_ctl.core.errors import EXIT_UNREACHABLE, BadInput, Unreachable
from olmo_ctl.sandbox.kube_server import KubeServer, tiny_jobset

FAST = KubeRetryPolicy(base_s=0.01, max_s=0.05, budget_s=5.0, connect_timeout_s=1.0, read_timeout_s=5.0)
REAL_KUBECONFIG = os.environ.get("OLMO_CTL_TEST_KUBECONFIG")


class Env:
    """One place to run a backend test: the test server, or a real cluster."""

    def __init__(self, backend: GKEBackend, server: KubeServer | None, queue: str | None, timeout_s: float):
        self.backend, self.server, self.queue, self.timeout_s = backend, server, queue, timeout_s
        self.namespace = backend.namespace

    @property
    def real(self) -> bool:
        return self.server is None

    def play(self, step) -> None:
        """A cluster step (admit, evict, a pod exits): scripted on the test server, real controllers elsewhere."""
        if self.server is not None:
            step(self.server.cluster)

    def jobset(self, run: str, attempt: int = 1, **kw) -> dict:
        name = f"{run}-a{attempt}"
        return tiny_jobset(name, run=run, attempt=attempt, namespace=self.namespace, queue=self.queue, **kw)

    def wait_for(self, handle: Handle, states: set[State]):
        deadline = time.monotonic() + self.timeout_s
        while True:
            st = self.backend.status(handle)
            if st.state in states or time.monotonic() > deadline:
                return st
            time.sleep(0.05 if self.server else 2.0)


def _run_name() -> str:
    return "t" + uuid.uuid4().hex[:8]


@pytest.fixture(params=["server", pytest.param("real", marks=pytest.mark.kube)])
def env(request):
    if request.param == "server":
        srv = request.getfixturevalue("kube_server")
        yield Env(GKEBackend(namespace="default", host=srv.url, retry=FAST), srv, "user-queue", 5.0)
        return
    if not REAL_KUBECONFIG:
        pytest.skip(
            "OLMO_CTL_TEST_KUBECONFIG is not set: no real cluster with JobSet and Kueue to run against"
        )
    backend = GKEBackend(
        namespace=os.environ.get("OLMO_CTL_TEST_NAMESPACE", "default"),
        kubeconfig=REAL_KUBECONFIG,
        context=os.environ.get("OLMO_CTL_TEST_CONTEXT"),
    )
    e = Env(backend, None, os.environ.get("OLMO_CTL_TEST_QUEUE") or None, 600.0)
    made: list[Handle] = []
    e.made = made
    yield e
    for h in made:
        backend.stop(h, graceful=False)


def _backend(srv: KubeServer, **kw) -> GKEBackend:
    return GKEBackend(namespace="default", host=srv.url, retry=kw.pop("retry", FAST), **kw)


def _submit(env: Env, js: dict) -> Handle:
    h = env.backend.send(js)
    if env.real:
        env.made.append(h)
    return h


# ---------------------------------------------------------------- lifecycle (server + real cluster)


def test_success_lifecycle(env):
    run = _run_name()
    h = _submit(env, env.jobset(run))
    assert (h.backend, h.name, h.attempt) == ("gke", f"{run}-a1", 1)
    assert h.data["uid"] and h.data["namespace"] == env.namespace
    if not env.real:
        st = env.backend.status(h)
        assert st.state == State.QUEUED, st
        assert st.source.startswith("Workload")
    env.play(lambda c: (c.admit(h.name), c.run_pods(h.name), c.log(h.name, 0, ["step 1/1 loss 1.0"])))
    if not env.real:
        st = env.backend.status(h)
        assert st.state == State.RUNNING and st.reason.startswith("2/2 pods running"), st
        assert env.backend.logs(h) == ["step 1/1 loss 1.0"]
    env.play(lambda c: c.complete(h.name))
    st = env.wait_for(h, {State.SUCCEEDED, State.FAILED_INFRA, State.FAILED_USER})
    assert st.state == State.SUCCEEDED, st
    assert st.reason == "AllJobsCompleted: jobset completed successfully"
    assert st.exit_code == 0


def test_user_failure_has_the_pods_last_lines(env):
    run = _run_name()
    script = (
        "import sys; print('step 1/10 loss 11.2'); print('Traceback (most recent call last):'); "
        "print('ValueError: global_batch 512 does not divide over 3 devices'); sys.exit(1)"
    )
    h = _submit(env, env.jobset(run, script=script, workers=1))
    lines = [
        "step 1/10 loss 11.2",
        "Traceback (most recent call last):",
        "ValueError: global_batch 512 does not divide over 3 devices",
    ]

    def cluster(c):
        c.admit(h.name)
        c.run_pods(h.name)
        c.pod_exit(h.name, 0, 1, lines)
        c.fail(h.name, "ReachedMaxRestarts")  # failurePolicy without rules: RestartJobSet, then the max

    env.play(cluster)
    st = env.wait_for(h, {State.FAILED_USER, State.FAILED_INFRA, State.SUCCEEDED, State.PREEMPTED})
    assert st.state == State.FAILED_USER, st
    assert st.exit_code == 1
    assert st.last_log_lines[-1] == "ValueError: global_batch 512 does not divide over 3 devices"
    assert "exited 1" in st.reason and st.reason.endswith("does not divide over 3 devices")
    assert env.backend.logs(h, tail=1) == ["ValueError: global_batch 512 does not divide over 3 devices"]


def test_submit_is_idempotent_and_refuses_a_stranger(env):
    run = _run_name()
    js = env.jobset(run)
    h1 = _submit(env, js)
    h2 = env.backend.send(js)  # a supervisor restarted mid-submit: the same JobSet is adopted
    assert h2 == h1
    stranger = env.jobset(run)
    stranger["metadata"]["labels"]["olmo-ctl/run"] = "someone-else"
    with pytest.raises(BadInput, match="already exists .* not this attempt"):
        env.backend.send(stranger)


def test_stop_deletes_everything_and_status_becomes_missing(env):
    run = _run_name()
    h = _submit(env, env.jobset(run))
    env.play(lambda c: (c.admit(h.name), c.run_pods(h.name)))
    env.backend.stop(h)
    assert env.backend.wait_gone(h, timeout_s=env.timeout_s, poll_s=0.05 if not env.real else 2.0)
    st = env.backend.status(h)
    assert st.state == State.MISSING
    env.backend.stop(h)  # stopping what is gone is fine
    if not env.real:
        assert env.server.cluster.deleted == [("JobSet", h.name, "Foreground")]
        assert env.server.cluster.pods(h.name) == [] and env.server.cluster.workload(h.name) is None


def test_find_live_returns_the_newest_live_attempt(env):
    run = _run_name()
    assert env.backend.find_live(run) is None
    h1 = _submit(env, env.jobset(run, attempt=1, script="import sys; sys.exit(1)", workers=1))
    env.play(lambda c: (c.admit(h1.name), c.run_pods(h1.name), c.pod_exit(h1.name, 0, 1), c.fail(h1.name)))
    env.wait_for(h1, {State.FAILED_USER, State.FAILED_INFRA})
    h2 = _submit(env, env.jobset(run, attempt=2, script="import time; time.sleep(600)"))
    found = env.backend.find_live(run)
    assert (
        found is not None
        and found.name == h2.name
        and found.attempt == 2
        and found.data["uid"] == h2.data["uid"]
    )
    env.backend.stop(h2)
    env.backend.wait_gone(h2, timeout_s=env.timeout_s, poll_s=0.05 if not env.real else 2.0)
    assert env.backend.find_live(run) is None


# ---------------------------------------------------------------- states (test server)


def test_a_long_queue_wait_stays_queued_with_kueues_message(srv):
    b = _backend(srv)
    h = b.send(tiny_jobset("q1-a1", run="q1"))
    # Kueue's own message (the test cluster's flavor has no quota yet; tiny_jobset asks for 2 x 100m CPU).
    msg = (
        "couldn't assign flavors to pod set slice: insufficient unused quota for cpu in flavor "
        "tpu-flavor, 200m more needed"
    )
    srv.cluster.keep_pending(h.name, msg)
    for _ in range(30):
        st = b.status(h)
        assert st.state == State.QUEUED and not st.state.terminal
        assert st.reason == f"Pending: {msg}"
    assert srv.count("DELETE") == 0 and srv.count("POST") == 1


def test_eviction_by_preemption_requeues_the_same_attempt_with_kueues_reason(srv):
    """Kueue suspends the JobSet and requeues the same one (reconciler.go, handle eviction): the
    attempt is queued again, not over."""
    b = _backend(srv)
    h = b.send(tiny_jobset("p1-a1", run="p1"))
    srv.cluster.admit(h.name)
    srv.cluster.run_pods(h.name)
    srv.cluster.evict(h.name, "Preempted", "InClusterQueue")
    st = b.status(h)
    assert st.state == State.QUEUED and st.evicted == "Preempted (InClusterQueue)"
    assert st.reason.startswith("Preempted (InClusterQueue): Preempted to accommodate a workload")
    assert (
        "; requeued by Kueue, Pending: couldn't assign flavors to pod set slice: insufficient unused quota"
        in st.reason
    )
    assert st.source == "Workload condition Evicted"
    assert st.details["requeued"] is True


def test_node_loss_then_jobset_failure_is_preemption(srv):
    b = _backend(srv)
    h = b.send(tiny_jobset("n1-a1", run="n1", workers=4))
    srv.cluster.admit(h.name)
    srv.cluster.run_pods(h.name)
    lost = srv.cluster.node_lost(h.name, 2)
    # Upstream, pod GC removes the lost pod once its Job counted it; without an Ignore rule on
    # DisruptionTarget (tiny_jobset has none, our rendered JobSets do) it counts against backoffLimit 0:
    # the Job fails, the JobSet restarts or, at maxRestarts 0, fails, and the other pods are deleted.
    srv.cluster.fail(h.name, "ReachedMaxRestarts")
    assert (
        lost not in [p["metadata"]["name"] for p in srv.cluster.pods(h.name)]
        and srv.cluster.pods(h.name) == []
    )
    st = b.status(h)
    assert st.state == State.FAILED_INFRA, st
    assert "(first failed job: n1-a1-slice-0))" in st.reason and "no pod left" in st.reason, st


def test_oom_kill_is_an_infrastructure_failure(srv):
    b = _backend(srv)
    h = b.send(tiny_jobset("o1-a1", run="o1", workers=1))
    srv.cluster.admit(h.name)
    srv.cluster.run_pods(h.name)
    srv.cluster.pod_exit(h.name, 0, 137, reason="OOMKilled")
    srv.cluster.fail(h.name)
    st = b.status(h)
    assert (st.state, st.exit_code) == (State.FAILED_INFRA, 137)
    assert "[OOMKilled]" in st.reason


def test_image_pull_backoff_is_a_wait_and_a_missing_image_a_configuration_error(srv):
    b = _backend(srv)
    h = b.send(tiny_jobset("i1-a1", run="i1"))
    srv.cluster.admit(h.name)
    srv.cluster.image_pull_error(h.name, 0, "ImagePullBackOff", 'Back-off pulling image "olmo:missing"')
    st = b.status(h)
    assert st.state == State.ADMITTED
    assert st.reason.endswith('ImagePullBackOff: Back-off pulling image "olmo:missing"')
    assert st.image_pull == "python:3.12-slim"
    assert "config_error" not in st.details
    assert b.logs(h) == []  # the container never started: no log, no error
    srv.cluster.image_pull_error(h.name, 1)  # the registry: not found
    st = b.status(h)
    assert st.config_error.startswith("image python:3.12-slim cannot be pulled: ErrImagePull: ")
    assert st.config_error.endswith(": not found")


def test_unschedulable_while_admitted_keeps_the_state_and_says_why(srv):
    b = _backend(srv)
    h = b.send(tiny_jobset("u1-a1", run="u1"))
    srv.cluster.admit(h.name)
    srv.cluster.unschedulable(
        h.name, "0/8 nodes are available: 8 node(s) didn't match Pod's node affinity/selector."
    )
    st = b.status(h)
    assert st.state == State.ADMITTED and st.details["unschedulable"] is True
    assert "Unschedulable" in st.reason and "didn't match Pod's node affinity" in st.reason


def test_status_of_a_jobset_replaced_under_the_same_name_is_missing(srv):
    b = _backend(srv)
    h = b.send(tiny_jobset("r1-a1", run="r1"))
    b.stop(h)
    b.send(tiny_jobset("r1-a1", run="r1"))  # someone recreated it
    assert b.status(h).state == State.MISSING
    b.stop(h)  # the uid precondition protects the newcomer
    assert srv.cluster.jobset("r1-a1") is not None


def test_unknown_field_is_refused_as_bad_input(srv):
    b = _backend(srv)
    js = tiny_jobset("f1-a1", run="f1")
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicyy"] = {}
    with pytest.raises(
        BadInput, match='unknown field "spec.replicatedJobs\\[0\\].template.spec.podFailurePolicyy"'
    ):
        b.send(js)
    assert srv.cluster.jobset_names() == []


# ---------------------------------------------------------------- retries (test server)


def test_bursts_of_429_and_500_are_retried_then_succeed(srv):
    b = _backend(srv)
    srv.fail_next(3, status=500)
    h = b.send(tiny_jobset("b1-a1", run="b1"))
    assert srv.count("POST") == 4 and srv.cluster.jobset_names() == ["b1-a1"]
    srv.fail_next(4, status=429, retry_after_s=0)
    srv.fail_next(2, status=503)
    assert b.status(h).state == State.QUEUED


def test_retry_after_is_honoured(srv):
    b = _backend(srv)
    srv.fail_next(1, status=429, retry_after_s=1)
    t0 = time.monotonic()
    assert b.find_live("nothing") is None
    assert time.monotonic() - t0 >= 1.0


def test_a_lost_create_response_adopts_the_created_jobset(srv):
    b = _backend(srv)
    srv.fail_next(1, status="lost", match="POST ")
    h = b.send(tiny_jobset("l1-a1", run="l1"))
    assert srv.count("POST") == 2 and srv.cluster.jobset_names() == ["l1-a1"]
    assert h.data["uid"] == srv.cluster.jobset("l1-a1")["metadata"]["uid"]


def test_other_4xx_are_never_retried(srv):
    b = _backend(srv)
    srv.fail_next(1, status=403)
    with pytest.raises(BadInput, match="forbidden"):
        b.send(tiny_jobset("x1-a1", run="x1"))
    assert srv.count("POST") == 1 and srv.cluster.jobset_names() == []


def test_unreachable_past_the_budget_is_exit_3_and_leaves_the_job_alone(srv):
    b = _backend(srv, retry=KubeRetryPolicy(base_s=0.05, max_s=0.2, budget_s=1.0, connect_timeout_s=0.5))
    h = b.send(tiny_jobset("d1-a1", run="d1"))
    srv.cluster.admit(h.name)
    srv.cluster.run_pods(h.name)
    srv.go_down()
    t0 = time.monotonic()
    with pytest.raises(Unreachable) as ei:
        b.status(h)
    assert ei.value.exit_code == EXIT_UNREACHABLE
    assert time.monotonic() - t0 < 3.0
    assert "no usable answer" in ei.value.message and "Connection refused" in ei.value.message, (
        ei.value.message
    )
    srv.come_back()
    assert srv.count("DELETE") == 0
    assert b.status(h).state == State.RUNNING


def test_server_errors_past_the_budget_are_unreachable(srv):
    b = _backend(srv, retry=KubeRetryPolicy(base_s=0.02, max_s=0.05, budget_s=0.5))
    srv.fail_next(10_000, status=500)
    with pytest.raises(Unreachable, match="HTTP 500"):
        b.find_live("r")


# ---------------------------------------------------------------- render


def test_rendered_attempt_is_accepted_by_the_crd_schema(srv):
    from olmo_ctl.core.config import Settings

    settings = Settings(
        image="us-docker.pkg.dev/p/r/olmo-ctl:1", run_root="gs://bucket/runs", queue="tpu-queue"
    )
    b = GKEBackend(namespace="default", host=srv.url, retry=FAST, settings=settings)
    from olmo_ctl.core.recipe import load_recipe

    att = attempt(
        "olmo3-7b-s1",
        "gs://bucket/runs/olmo3-7b-s1",
        3,
        "tpu7x-128",
        recipe=load_recipe("olmo3-7b-stage1"),
        extra_args=("--stop-at-step", "100"),
    )
    js = b.render(att)
    assert js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "command"
    ][-2:] == ["--stop-at-step", "100"]
    h = b.send(js)
    assert (h.name, h.attempt, h.data["run"]) == ("olmo3-7b-s1-a3", 3, "olmo3-7b-s1")
    wl = srv.cluster.workload(h.name)
    assert wl["spec"]["queueName"] == "tpu-queue" and wl["spec"]["podSets"][0]["count"] == 16
    assert b.status(h).state == State.QUEUED


# ---------------------------------------------------------------- the policy as data


def test_retry_policy_backoff_is_capped_and_jittered():
    from kubernetes.client.exceptions import ApiException

    from olmo_ctl.backends.kube import is_retryable

    p = KubeRetryPolicy(base_s=0.5, max_s=30.0, jitter=False)
    assert [p.backoff_s(n) for n in (1, 2, 3, 7, 8, 20)] == [0.5, 1.0, 2.0, 30.0, 30.0, 30.0]
    waits = [KubeRetryPolicy(base_s=4.0, max_s=30.0).backoff_s(2) for _ in range(200)]
    assert 4.0 <= min(waits) < max(waits) <= 8.0
    assert [
        is_retryable(ApiException(status=s)) for s in (429, 500, 502, 503, 504, 400, 401, 403, 404, 409, 422)
    ] == [True] * 5 + [False] * 6
    assert is_retryable(ConnectionRefusedError()) and not is_retryable(ValueError("bug"))


def test_a_jobset_being_deleted_keeps_its_state_and_is_not_live_for_reattach(srv):
    b = _backend(srv)
    h = b.send(tiny_jobset("h1-a1", run="h1"))
    srv.cluster.admit(h.name)
    srv.cluster.run_pods(h.name)
    srv.cluster.hold_deletions = True  # pods are using their grace period to checkpoint
    b.stop(h)
    st = b.status(h)
    assert st.state == State.RUNNING and st.details["deleting"] is True
    assert st.reason.startswith("being deleted; ")
    assert b.find_live("h1") is None
    assert not b.wait_gone(h, timeout_s=0.1, poll_s=0.02)
    assert srv.cluster.finish_deletions() == ["h1-a1"]
    assert b.wait_gone(h, timeout_s=1.0, poll_s=0.02)
    assert b.status(h).state == State.MISSING and srv.cluster.pods(h.name) == []


@pytest.mark.gcs
def test_the_attempt_request_reads_the_recipe_from_run_yaml_on_gcs(srv, gcs):
    from olmo_ctl.core.config import Settings
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.rundir import RunDir

    recipe = load_recipe("olmo3-7b-stage2")
    bucket = gcs.bucket
    run_dir = f"gs://{bucket}/runs/s2"
    RunDir(run_dir).create_run(recipe.to_dict(), recipe.fingerprint(), "v1:test", "v5p-256")
    settings = Settings(image="img:1", run_root=f"gs://{bucket}/runs")
    b = GKEBackend(namespace="default", host=srv.url, retry=FAST, settings=settings)
    js = b.render(attempt_of(RunDir(run_dir), 2, "v5p-256"))
    from olmo_ctl.backends.jobset import ANNOTATION_PLAN

    # The recipe comes from run.yaml: stage 2's global batch 256 over v5p-256's 128 devices.
    assert js["metadata"]["annotations"]["olmo-ctl/recipe"] == recipe.name
    assert (
        "global_batch=256 per_device_batch=2 grad_accum=1" in js["metadata"]["annotations"][ANNOTATION_PLAN]
    )
    h = b.send(js)
    assert srv.cluster.workload(h.name)["spec"]["podSets"][0]["count"] == 32


def test_a_same_named_attempt_of_another_run_directory_is_not_adopted(srv):
    b = _backend(srv)
    js = tiny_jobset("s1-a1", run="s1")
    js["metadata"]["annotations"] = {"olmo-ctl/run-dir": "gs://team-a/runs/s1"}
    b.send(js)
    other = tiny_jobset("s1-a1", run="s1")
    other["metadata"]["annotations"] = {"olmo-ctl/run-dir": "gs://team-b/runs/s1"}
    with pytest.raises(BadInput, match="gs://team-a/runs/s1"):
        b.send(other)
    assert srv.count("DELETE") == 0


def test_no_access_to_workloads_falls_back_to_the_jobset(srv):
    b = _backend(srv)
    h = b.send(tiny_jobset("k1-a1", run="k1"))
    srv.fail_next(5, status=403, match="/workloads")
    st = b.status(h)
    assert st.state == State.QUEUED and st.source == "JobSet spec.suspend"
    assert b.status(h).source == "JobSet spec.suspend"
    srv.clear_faults()
    assert b.status(h).source == "Workload condition QuotaReserved"


def test_a_hung_answer_times_out_and_is_retried(srv):
    b = _backend(srv, retry=KubeRetryPolicy(base_s=0.01, max_s=0.05, budget_s=5.0, read_timeout_s=0.2))
    h = b.send(tiny_jobset("t1-a1", run="t1"))
    srv.fail_next(1, status=0, delay_s=0.6, match="GET ")
    t0 = time.monotonic()
    assert b.status(h).state == State.QUEUED
    assert time.monotonic() - t0 >= 0.2
    assert srv.count("GET", "/jobsets/t1-a1") == 2  # the hung read, then its retry


def test_a_jobset_restarting_itself_stays_live(srv):
    b = _backend(srv)
    h = b.send(tiny_jobset("j1-a1", run="j1", max_restarts=1))
    srv.cluster.admit(h.name)
    srv.cluster.run_pods(h.name)
    srv.cluster.world.held = True  # look between the kubelet's report and the controllers' reaction
    srv.cluster.pod_exit(h.name, 1, 139)
    st = b.status(h)
    assert st.state == State.ADMITTED  # 1/2 running: the slice is not whole
    assert "exited 139" in st.reason and "it may restart" in st.reason
    srv.cluster.world.settle()  # the Job fails (backoffLimit 0), the JobSet restarts (maxRestarts 1)
    st = b.status(h)
    assert (st.state, st.restarts) == (State.ADMITTED, 1)
    assert st.reason == "0/2 pods running; JobSet restarts: 1"
    srv.cluster.run_pods(h.name)
    assert b.status(h).state == State.RUNNING


def test_a_stop_checks_the_handle_against_the_cluster_and_deletes_by_uid(srv):
    """Trust nothing read back: a handle without a uid (an old journal line) is checked against the
    JobSet's run and attempt labels and deleted with the uid it was checked against; a handle whose
    name is another run's JobSet deletes nothing."""
    from olmo_ctl.backends.base import Handle

    b = _backend(srv)
    mine = b.send(tiny_jobset("r7-a2", run="r7", attempt=2))
    bare = Handle(b.name, "r7-a2", 2, {"namespace": "default", "run": "r7"})  # no uid
    b.stop(bare)
    deletes = [body for m, p, body in srv.received if m == "DELETE" and p.endswith("/jobsets/r7-a2")]
    assert deletes and deletes[-1]["preconditions"] == {"uid": mine.data["uid"]}
    assert b.wait_gone(mine, timeout_s=5, poll_s=0.05)

    b.send(tiny_jobset("r8-a1", run="another-team", attempt=1))
    wrong = Handle(b.name, "r8-a1", 1, {"namespace": "default", "run": "r8"})
    with pytest.raises(BadInput, match="not attempt 1 of run `r8`"):
        b.stop(wrong)
    assert srv.cluster.jobset("r8-a1") is not None


def test_a_stale_node_selector_is_a_key_the_jobsets_template_lacks_and_not_one_jobset_adds_itself():
    """gke_status.stale_node_selector: what a readmission on another flavor left (jobset#1294), never
    the selectors JobSet's own exclusive placement adds (the leader's topology on a follower pod, the
    node-selector strategy's namespaced-job key)."""
    from olmo_ctl.backends.gke_status import NAMESPACED_JOB, stale_node_selector

    js = tiny_jobset("s1-a1", run="s1")
    tmpl = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    tmpl["spec"]["nodeSelector"] = {"cloud.google.com/gke-tpu-accelerator": "tpu7x"}
    topo = "cloud.google.com/gke-nodepool"

    def pod(selector: dict) -> dict:
        return {
            "metadata": {
                "labels": {"jobset.sigs.k8s.io/replicatedjob-name": "slice"},
                "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": topo},
            },
            "spec": {"nodeSelector": {"cloud.google.com/gke-tpu-accelerator": "tpu7x", **selector}},
        }

    assert stale_node_selector(js, pod({})) == {}
    assert stale_node_selector(js, pod({topo: "", NAMESPACED_JOB: "default_s1-a1-slice-0"})) == {}
    assert stale_node_selector(js, pod({"cloud.google.com/gke-spot": "true", topo: "np-0"})) == {
        "cloud.google.com/gke-spot": "true"
    }
