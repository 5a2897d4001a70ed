"""resume-until-done with the GKE backend against the Kubernetes API test server, on a fake clock.

The scripted cluster plays Kueue, JobSet and the pods; the test plays the trainer by committing
checkpoints into the run directory. Every supervisor sleep advances the fake clock and lets the
script act, so hours of queueing take milliseconds.
"""

from __future__ import annotations

import io

import pytest
from helpers.attempts import attempt_of

from olmo_ctl.backends.gke import GKEBackend
from olmo_ctl.backends.kube import KubeRetryPolicy
from olmo_ctl.core.batching import read_launch_record
from olmo_ctl.core.config import Settings
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.errors import OlmoCtlError
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.rundir import COMMIT_MARKER, RunDir, parse_iso
from olmo_ctl.sandbox.kube_server import KubeServer
from olmo_ctl.supervise.policy import RetryPolicy
from olmo_ctl.supervise.supervisor import Printer, Supervisor

FAST = KubeRetryPolicy(base_s=0.01, max_s=0.05, budget_s=3.0, connect_timeout_s=1.0, read_timeout_s=5.0)
T0 = 1_800_000_000.0


class Script:
    """A fake clock whose sleeps run the cluster's script: {attempt: [(seconds after submit, action)]}."""

    def __init__(self, srv: KubeServer, rd: RunDir, plan: dict):
        self.srv, self.rd, self.plan = srv, rd, plan
        self.t = T0
        self.seen: dict[int, float] = {}
        self.done: set = set()
        self.names_at_submit: dict[int, list[str]] = {}

    def time(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s
        last = self.rd.last_attempt()
        if last is None:
            return
        n, name = last["attempt"], last["handle"]["name"]
        if n not in self.seen:
            self.seen[n] = self.t
            self.names_at_submit[n] = self.srv.cluster.jobset_names()
        for i, (after, action) in enumerate(self.plan.get(n, [])):
            if (n, i) not in self.done and self.t - self.seen[n] >= after:
                self.done.add((n, i))
                action(self, name)

    def commit(self, step: int) -> None:
        self.rd.store.write_bytes(self.rd.p("checkpoints", str(step), "state", "x"), b"x")
        self.rd.store.write_bytes(self.rd.p("checkpoints", str(step), COMMIT_MARKER), b"ok")


def admit_run(s: Script, name: str) -> None:
    s.srv.cluster.admit(name)
    s.srv.cluster.run_pods(name)


def setup(tmp_path, srv, bucket, steps=20):
    rd = RunDir.of(f"gs://{bucket}/{tmp_path.name}", "gk")
    r = load_recipe("smoke", overrides=[f"train.max_steps={steps}"])
    rd.create_run(r.to_dict(), r.fingerprint(), "fp", "tpu7x-8")
    settings = Settings(
        image="registry.example.com/olmo-ctl:test", run_root=f"gs://{bucket}", queue="user-queue"
    )
    return rd, GKEBackend(namespace="default", host=srv.url, retry=FAST, settings=settings)


def supervise(rd, be, script, **policy):
    buf = io.StringIO()
    sup = Supervisor(
        rd,
        be,
        RetryPolicy(**policy),
        poll_s=30,
        clock=script.time,
        sleep=script.sleep,
        printer=Printer(rd.name, stream=buf, clock=script.time),
    )
    rc = sup.run()
    return rc, buf.getvalue()


def events(rd, attempt=None):
    """The journal of `attempt` (all: None), without the waits for capacity (tests of their own)."""
    return [
        r
        for r in rd.journal()
        if (attempt is None or r.get("attempt") == attempt) and r["event"] not in ("waiting", "waited")
    ]


@pytest.mark.chaos
def test_long_queue_spends_nothing_and_a_preemption_requeues_the_same_attempt(tmp_path, srv, gcs):
    rd, be = setup(tmp_path, srv, gcs.bucket)
    t_pre = 3 * 3600 + 600
    script = Script(
        srv,
        rd,
        {
            1: [
                (3 * 3600, admit_run),
                (3 * 3600 + 300, lambda s, n: s.commit(10)),
                (t_pre, lambda s, n: s.srv.cluster.evict(n, reason="Preempted")),
                (t_pre + 1200, admit_run),
                (t_pre + 1600, lambda s, n: s.commit(20)),
                (t_pre + 1700, lambda s, n: s.srv.cluster.complete(n)),
            ],
        },
    )
    # max_retries=1: a queue wait or a preemption that spent a retry would give up.
    rc, out = supervise(rd, be, script, backoff_base_s=600, max_retries=1)
    assert rc == 0, out
    j = rd.journal()
    a1 = [r["event"] for r in events(rd, 1)]
    assert a1[:2] == ["submitted", "queued"]
    assert a1[a1.index("running") :] == ["running", "preempted", "running", "succeeded"], a1
    queued = next(r for r in j if r["event"] == "queued")
    running = next(r for r in j if r["event"] == "running" and r["attempt"] == 1)
    assert parse_iso(running["time"]) - parse_iso(queued["time"]) >= 3 * 3600  # three hours queued: waiting
    pre = next(r for r in j if r["event"] == "preempted")
    assert (
        pre["reason"].startswith("Preempted (InClusterQueue): Preempted to accommodate")
        and pre["committed_step"] == 10
    )
    assert not [r for r in j if r["event"] in ("backoff", "failed", "gave_up")]
    # Kueue requeued and resumed the same JobSet; nothing was deleted, nothing submitted again.
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]
    assert not [d for d in srv.cluster.deleted if d[0] in ("JobSet", "Pod")]
    assert j[-1]["event"] == "done" and j[-1]["committed_step"] == 20


def test_deterministic_failure_exits_1_with_the_pods_last_lines(tmp_path, srv, gcs):
    rd, be = setup(tmp_path, srv, gcs.bucket)

    def crash(s, n):
        s.srv.cluster.pod_exit(n, 0, 1, log_lines=["step 3/20 loss 5.1", "FloatingPointError: loss is NaN"])
        # Upstream: exit 1 matches the Job's FailJob rule (reason PodFailurePolicy), which the JobSet's
        # FailOnUserError rule turns into FailJobSet; FailedJobs is only for JobSets without a failurePolicy.
        s.srv.cluster.fail(
            n,
            reason="FailJobSetFailurePolicyAction",
            message=f"applying FailJobSet failure policy action (first failed job: {n}-slice-0)",
        )

    script = Script(srv, rd, {1: [(60, admit_run), (200, crash)]})
    rc, out = supervise(rd, be, script, backoff_base_s=1, max_retries=5)
    assert rc == 1, out
    assert "FloatingPointError: loss is NaN" in out
    failed = [r for r in rd.journal() if r["event"] == "failed"]
    assert len(failed) == 1 and "FloatingPointError: loss is NaN" in failed[0]["last_log_lines"]
    assert [r["attempt"] for r in rd.journal() if r["event"] == "submitted"] == [1]


def test_api_error_bursts_are_retried_and_a_lost_create_is_not_doubled(tmp_path, srv, gcs):
    rd, be = setup(tmp_path, srv, gcs.bucket)

    def burst(status):
        def act(s, n):
            s.srv.fail_next(3, status=status, retry_after_s=0) if status == 429 else s.srv.fail_next(
                3, status=status
            )

        return act

    srv.fail_next(1, status="lost", match="POST ")  # the create goes through, its answer is lost
    script = Script(
        srv,
        rd,
        {
            1: [
                (30, burst(429)),
                (60, admit_run),
                (90, burst(500)),
                (120, lambda s, n: s.commit(20)),
                (150, lambda s, n: s.srv.cluster.complete(n)),
            ]
        },
    )
    rc, out = supervise(rd, be, script, backoff_base_s=1, max_retries=1)
    assert rc == 0, out
    assert [r["attempt"] for r in rd.journal() if r["event"] == "submitted"] == [1]
    assert len(srv.cluster.jobset_names()) == 1


def test_preemption_lets_kueue_resume_the_same_jobset(tmp_path, srv, gcs):
    """Issue 12, break 1: a preemption at step 10 + 5 resumes from 15 (the checkpoint the pods wrote
    on SIGTERM through their grace period), not from 10; preemptions spend no retry budget."""
    rd, be = setup(tmp_path, srv, gcs.bucket)

    def preempt(s, n):
        s.srv.cluster.hold_deletions = True  # the pods write their checkpoint through the grace period
        s.srv.cluster.evict(n)

    def checkpoint_on_sigterm(s, n):
        # The trainer commits its last step on SIGTERM only if its pods live through the grace period
        # (force-deleted with grace 0 they are gone, and so is the checkpoint).
        alive = [
            p
            for p in s.srv.cluster.pods(n)
            if p["metadata"].get("deletionTimestamp")
            and p["status"].get("phase") not in ("Succeeded", "Failed")
        ]
        if alive:
            s.commit(15)
        s.srv.cluster.finish_deletions()

    def preempt_now(s, n):  # another preemption, before any new checkpoint
        s.srv.cluster.hold_deletions = False
        s.srv.cluster.evict(n)

    def finish(s, n):
        s.commit(20)
        s.srv.cluster.complete(n)

    script = Script(
        srv,
        rd,
        {
            1: [
                (60, admit_run),
                (100, lambda s, n: s.commit(10)),
                (200, preempt),
                (230, checkpoint_on_sigterm),
                (400, admit_run),
                (460, preempt_now),
                (520, admit_run),
                (580, preempt_now),
                (640, admit_run),
                (700, preempt_now),
                (760, admit_run),
                (900, finish),
            ],
            2: [(60, admit_run), (120, finish)],
        },
    )
    # max_retries=1: a single preemption that spent a retry without progress would end the run (exit 4).
    rc, out = supervise(rd, be, script, backoff_base_s=60, max_retries=1)
    assert rc == 0, out
    j = rd.journal()
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]  # the same JobSet resumed
    assert not [
        d for d in srv.cluster.deleted if d[0] in ("JobSet", "Pod")
    ]  # nothing deleted while terminating
    pre = [r for r in j if r["event"] == "preempted"]
    assert [r["committed_step"] for r in pre] == [10, 15, 15, 15]
    running = [r["committed_step"] for r in j if r["event"] == "running"]
    assert running == [0, 15, 15, 15, 15]  # every resumption starts from the SIGTERM checkpoint, 15, not 10
    assert not [r for r in j if r["event"] in ("backoff", "failed", "gave_up")]
    assert j[-1]["event"] == "done" and j[-1]["committed_step"] == 20


QUOTA = "exceeded quota: tpu-quota, requested: google.com/tpu=4, used: google.com/tpu=0, limited: google.com/tpu=0"


def test_pods_the_api_server_refuses_exit_2_naming_why_after_the_admission_timeout(tmp_path, srv, gcs):
    """Issue 12, break 5, and issue 19: a ResourceQuota refuses the pods (Job FailedCreate), a
    configuration no retry changes. The attempt holds its quota, admitted, until --admission-timeout;
    then it is stopped with its grace period and the supervisor exits 2 naming the refusal: no second
    attempt, no retry budget spent on it."""
    rd, be = setup(tmp_path, srv, gcs.bucket)
    srv.world.pod_admission.append(lambda pod: QUOTA)
    script = Script(srv, rd, {1: [(60, lambda s, n: s.srv.cluster.admit(n))]})
    with pytest.raises(OlmoCtlError) as e:
        supervise(rd, be, script, backoff_base_s=60, max_retries=2, admission_timeout_s=600)
    assert e.value.exit_code == 2
    line = e.value.one_line()
    assert "pods refused: admitted but not running after" in line and "(--admission-timeout 600 s)" in line
    assert QUOTA in line and "ResourceQuota" in line, line
    j = rd.journal()
    adm = next(r for r in j if r["event"] == "admitted" and r["attempt"] == 1)
    assert adm["reason"].startswith(
        "0/1 pods created; FailedCreate: Job gk-a1-slice-0: Error creating: pods "
        '"gk-a1-slice-0-0-" is forbidden: exceeded quota: tpu-quota'
    ), adm
    (failed,) = [r for r in j if r["event"] == "failed"]
    assert failed["attempt"] == 1 and failed["reason"].startswith("configuration error: pods refused")
    assert 600 <= parse_iso(failed["time"]) - parse_iso(adm["time"]) <= 700
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]
    assert not [r for r in j if r["event"] in ("backoff", "gave_up")]
    # Queued for a minute is a wait; refused pods are not (it ends when admitted)
    waits = [(r["event"], r["cause"]) for r in j if r["event"] in ("waiting", "waited")]
    assert waits == [("waiting", "queued"), ("waited", "queued")]
    # Stopped through the API with the grace period: the JobSet (Foreground), never its pods at grace 0.
    assert ("JobSet", "gk-a1", "Foreground") in srv.cluster.deleted
    assert not [d for d in srv.cluster.deleted if d[0] == "Pod"]


def test_the_admission_timeout_submit_recorded_is_the_attempts_own(tmp_path, srv, gcs):
    from olmo_ctl.supervise.attempts import submit_next

    rd, be = setup(tmp_path, srv, gcs.bucket)
    srv.world.pod_admission.append(lambda pod: QUOTA)
    submit_next(
        rd,
        be,
        attempt_of(rd, 1, "tpu7x-8"),
        "submitted by hand",
        admission_timeout_s=300,
        t=T0,
    )
    script = Script(srv, rd, {1: [(30, lambda s, n: s.srv.cluster.admit(n))]})
    with pytest.raises(OlmoCtlError) as e:
        supervise(rd, be, script, backoff_base_s=60, max_retries=1)
    assert e.value.exit_code == 2 and "(--admission-timeout 300 s)" in e.value.one_line()


@pytest.mark.parametrize(
    "setting,missing",
    [
        ({"priority_class": "high"}, 'WorkloadPriorityClass "high" does not exist'),
        ({"queue": "no-such-queue"}, "LocalQueue no-such-queue doesn't exist"),
    ],
)
def test_a_queue_set_up_kueue_can_never_admit_stops_with_exit_2(tmp_path, srv, gcs, setting, missing):
    """Issue 12, break 4: not `queued` forever: one line naming the missing object, exit 2."""
    rd, be = setup(tmp_path, srv, gcs.bucket)
    be.settings = Settings(
        **{
            "image": "registry.example.com/olmo-ctl:test",
            "run_root": f"gs://{gcs.bucket}",
            "queue": "user-queue",
            **setting,
        }
    )
    script = Script(srv, rd, {})
    with pytest.raises(OlmoCtlError) as ei:
        supervise(rd, be, script, backoff_base_s=60, max_retries=5)
    assert ei.value.exit_code == 2 and missing in ei.value.message and "\n" not in ei.value.message
    assert ei.value.hint
    j = rd.journal()
    (failed,) = [r for r in j if r["event"] == "failed"]
    assert failed["reason"].startswith("configuration error: ") and missing in failed["reason"]
    assert script.t - T0 < 120  # at the first look, not after a wait
    assert srv.cluster.jobset_names() == []  # the attempt that could never run is gone
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]
    assert rd.read_lease()["released"] is True


def test_a_multislice_run_keeps_its_slice_count_across_attempts(tmp_path, srv, gcs):
    """A run created on 2 x tpu7x-16 records `slices: 2` (run.yaml, every `submitted`); the attempt after
    a restartable failure is again two replicas of the slice; asking for another count is a resize."""
    from olmo_ctl.supervise.attempts import ensure_run, run_target

    rd = RunDir.of(f"gs://{gcs.bucket}/{tmp_path.name}", "ms")
    r = load_recipe("smoke", overrides=["train.max_steps=20", "train.global_batch=32"])
    ensure_run(rd, r, "tpu7x-16", 2)
    assert rd.read_run()["slices"] == 2 and rd.read_run()["device"] == "tpu7x-16"
    be = setup(tmp_path, srv, gcs.bucket)[1]

    def lost(s, n):  # crashes (OOM kills) past maxRestarts: the supervisor resubmits
        s.srv.cluster.fail(n, reason="ReachedMaxRestarts", exit_code=137)

    script = Script(
        srv,
        rd,
        {
            1: [(60, admit_run), (120, lambda s, n: s.commit(10)), (180, lost)],
            2: [
                (60, admit_run),
                (120, lambda s, n: s.commit(20)),
                (180, lambda s, n: s.srv.cluster.complete(n)),
            ],
        },
    )
    rc, out = supervise(rd, be, script, backoff_base_s=1, max_retries=5)
    assert rc == 0, out
    subs = [r for r in rd.journal() if r["event"] == "submitted"]
    assert [(r["attempt"], r["device"], r["slices"]) for r in subs] == [
        (1, "tpu7x-16", 2),
        (2, "tpu7x-16", 2),
    ]
    assert "submitted attempt 2 on 2 x tpu7x-16" in out
    for name in srv.cluster.jobset_names():
        js = srv.cluster.jobset(name)
        assert js["spec"]["replicatedJobs"][0]["replicas"] == 2
        command = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
            "command"
        ]
        assert command[-4:-2] == ["--slices", "2"] and command[-2] == "--plan"
        target, plan = read_launch_record(command[-1])
        assert target.slices == 2 and plan.slices == 2 and plan.devices == 2 * target.device.devices
    assert run_target(rd, None, None).slices == 2 and run_target(rd, None, 2).slices == 2
    assert run_target(rd, get_device("tpu7x-16"), None) == rd.target()
    with pytest.raises(OlmoCtlError, match=r"runs on 2 x tpu7x-16, not 1"):
        run_target(rd, None, 1)
    with pytest.raises(OlmoCtlError, match=r"runs on tpu7x-16, not v5p-16"):
        run_target(rd, get_device("v5p-16"), None)


def test_restarts_that_spend_no_max_restarts_are_bounded_by_progress(tmp_path, srv, gcs):
    """Exit 3 again and again (the launch template's RestartOnLostPeer: no maxRestarts spent) with no
    new checkpoint: after `restart_loop_limit` restarts that followed a run the supervisor stops the
    attempt as a restart loop and starts another; restarts between checkpoints never add up."""

    def lost_peer(s: Script, n: str) -> None:
        s.srv.cluster.pod_exit(n, 0, 3)

    def rerun(s: Script, n: str) -> None:
        s.srv.cluster.run_pods(n)

    cycle = []
    for k in range(2):  # two restarts, a checkpoint after each: progress, no loop
        t = 300 + 600 * k
        cycle += [(t, lost_peer), (t + 60, rerun), (t + 300, lambda s, n, k=k: s.commit(2 * (k + 1)))]
    for k in range(6):  # then six with nothing committed: a loop
        t = 1500 + 300 * k
        cycle += [(t, lost_peer), (t + 60, rerun)]
    rd, be = setup(tmp_path, srv, gcs.bucket)
    script = Script(
        srv,
        rd,
        {
            1: [(60, admit_run), *cycle],
            2: [
                (60, admit_run),
                (300, lambda s, n: s.commit(20)),
                (400, lambda s, n: s.srv.cluster.complete(n)),
            ],
        },
    )
    rc, out = supervise(rd, be, script, backoff_base_s=60, max_retries=2, stall_min_s=3600)
    assert rc == 0, out
    stalled = [r for r in events(rd, 1) if r["event"] == "stalled"]
    assert len(stalled) == 1, out
    assert stalled[0]["reason"] == (
        "the JobSet restarted 6 times after its trainers ran with no new checkpoint since step 4 "
        "(a restart loop; limit 6)"
    )
    assert srv.cluster.jobset(f"{rd.name}-a2") is not None
    js1 = srv.cluster.jobset(f"{rd.name}-a1")
    assert js1 is None or js1["status"].get("restartsCountTowardsMax", 0) == 0
