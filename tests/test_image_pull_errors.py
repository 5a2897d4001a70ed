"""Container errors by cause: an image pull the kubelet backs off is a wait (bounded by
--image-pull-timeout), a pull no retry fixes is exit 2 at once naming the image.

The test cluster computes the kubelet's outcomes from the cause (`World.image_pull_fault`): ErrImagePull,
then ImagePullBackOff, retried after 10 s doubling to 300 s, started at the first retry after the
fault ends. The supervisor runs on a fake clock that also moves the world's clock (`WorldScript`).
"""

from __future__ import annotations

import pytest
from test_supervisor_gke import Script, admit_run, setup, supervise

from olmo_ctl.backends.gke_status import classify, image_pull_error
from olmo_ctl.backends.kube import KubeRetryPolicy
from olmo_ctl.core.contracts import State
from olmo_ctl.core.errors import BadInput, OlmoCtlError
from olmo_ctl.sandbox.kube_server import tiny_jobset

IMAGE = "registry.example.com/olmo-ctl:test"  # the image test_supervisor_gke.setup renders


class WorldScript(Script):
    """The supervisor's fake sleeps move the test cluster's clock too (kubelet backoffs, fault ends)."""

    def sleep(self, s: float) -> None:
        self.srv.world.advance(s)
        super().sleep(s)


def _pods(srv, name):
    return srv.cluster.pods(name)


def _waiting(pod):
    return pod["status"]["containerStatuses"][0]["state"].get("waiting", {})


def test_the_kubelet_backs_off_a_failing_pull_and_starts_the_pod_once_the_registry_answers(srv):
    srv.world.image_pull_fault(None, "transient", for_s=100)
    from olmo_ctl.backends.gke import GKEBackend

    be = GKEBackend(namespace="default", host=srv.url, retry=KubeRetryPolicy(budget_s=2.0))
    h = be.send(tiny_jobset("p1-a1", run="p1", workers=1))
    srv.cluster.admit(h.name)
    srv.cluster.run_pods(h.name)
    pod = _pods(srv, h.name)[0]
    assert _waiting(pod)["reason"] == "ErrImagePull"
    assert "429 Too Many Requests" in _waiting(pod)["message"]
    seen = []
    for t in range(1, 200):
        srv.world.advance(1)
        pod = _pods(srv, h.name)[0]
        reason = _waiting(pod).get("reason") or pod["status"]["phase"]
        if not seen or seen[-1][1] != reason:
            seen.append((t, reason))
        if pod["status"]["phase"] == "Running":
            break
    # Pulls at 0, 10, 30, 70 fail (backoff 10, 20, 40, 80 s); the one at 150 is after the fault's end.
    assert seen == [
        (1, "ImagePullBackOff"),
        (10, "ErrImagePull"),
        (11, "ImagePullBackOff"),
        (30, "ErrImagePull"),
        (31, "ImagePullBackOff"),
        (70, "ErrImagePull"),
        (71, "ImagePullBackOff"),
        (150, "Running"),
    ], seen
    pulls = [e for e in srv.cluster.events() if e["reason"] == "Pulling"]
    assert len(pulls) == 4
    st = be.status(h)
    assert st.state == State.RUNNING


@pytest.mark.parametrize(
    "cause, text",
    [("not-found", ": not found"), ("denied", "403 Forbidden"), ("unauthorized", "401 Unauthorized")],
)
def test_a_permanent_pull_error_is_a_configuration_error_naming_the_image(srv, cause, text):
    from olmo_ctl.backends.gke import GKEBackend

    srv.world.image_pull_fault(None, "permanent", cause=cause)
    be = GKEBackend(namespace="default", host=srv.url, retry=KubeRetryPolicy(budget_s=2.0))
    h = be.send(tiny_jobset(f"q-{cause}-a1", run=f"q-{cause}", workers=2))
    srv.cluster.admit(h.name)
    srv.cluster.run_pods(h.name)
    srv.world.advance(5)  # within the first backoff: ImagePullBackOff says only "Back-off pulling image"
    pods = _pods(srv, h.name)
    assert _waiting(pods[0]) == {
        "reason": "ImagePullBackOff",
        "message": 'Back-off pulling image "python:3.12-slim"',
    }
    st = be.status(h)  # the cause is in the pod's events
    assert st.state == State.ADMITTED
    err = st.config_error
    assert err.startswith("image python:3.12-slim cannot be pulled: ImagePullBackOff: ") and text in err, err


def test_an_image_reference_the_kubelet_cannot_parse_or_never_pulls_is_permanent(srv):
    from olmo_ctl.backends.gke import GKEBackend

    be = GKEBackend(namespace="default", host=srv.url, retry=KubeRetryPolicy(budget_s=2.0))
    h = be.send(tiny_jobset("bad-a1", run="bad", workers=1, image="Olmo Ctl:1"))
    srv.cluster.admit(h.name)
    srv.cluster.run_pods(h.name)  # no fault: the reference alone decides
    pod = _pods(srv, h.name)[0]
    assert _waiting(pod)["reason"] == "InvalidImageName"
    st = be.status(h)
    assert st.config_error.startswith("image Olmo Ctl:1 cannot be pulled: InvalidImageName: ")
    srv.world.advance(600)
    assert _waiting(_pods(srv, h.name)[0])["reason"] == "InvalidImageName"  # never retried

    js = tiny_jobset("never-a1", run="never", workers=1)
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "imagePullPolicy"
    ] = "Never"
    h = be.send(js)
    srv.world.image_pull_fault(None, "transient")  # the image is not on the node
    srv.cluster.admit(h.name)
    srv.cluster.run_pods(h.name)
    assert _waiting(_pods(srv, h.name)[0])["reason"] == "ErrImageNeverPull"
    assert "ErrImageNeverPull" in be.status(h).config_error


def test_pull_errors_are_read_by_cause():
    def pod(reason, message, image="us-docker.pkg.dev/p/r/olmo:1"):
        return {
            "metadata": {"name": "p0"},
            "spec": {"containers": [{"name": "trainer", "image": image}]},
            "status": {
                "phase": "Pending",
                "containerStatuses": [
                    {"name": "trainer", "state": {"waiting": {"reason": reason, "message": message}}}
                ],
            },
        }

    def ev(message):
        return {
            "involvedObject": {"kind": "Pod", "name": "p0"},
            "reason": "Failed",
            "message": message,
            "lastTimestamp": "2026-01-01T00:00:00Z",
        }

    backoff = 'Back-off pulling image "us-docker.pkg.dev/p/r/olmo:1"'
    cases = [
        (pod("ErrImagePull", "unexpected status code ...: 429 Too Many Requests"), [], False),
        (pod("ImagePullBackOff", backoff), [ev("Failed to pull image: dial tcp: i/o timeout")], False),
        (
            pod("ImagePullBackOff", backoff),
            [ev('Failed to pull image "x": failed to resolve reference: not found')],
            True,
        ),
        (
            pod(
                "ErrImagePull", 'denied: Permission "artifactregistry.repositories.downloadArtifacts" denied'
            ),
            [],
            True,
        ),
        (pod("InvalidImageName", "couldn't parse image reference"), [], True),
        (pod("ErrImageNeverPull", "is not present with pull policy of Never"), [], True),
    ]
    for p, events, permanent in cases:
        got = image_pull_error(p, events)
        assert got is not None and got.permanent is permanent, (p, events)
        assert got.image == "us-docker.pkg.dev/p/r/olmo:1"
    running = pod("ContainerCreating", "")
    assert image_pull_error(running) is None
    assert classify(None, None).state == State.MISSING  # unchanged precedence above the pods


def test_a_transient_pull_error_is_waited_out_and_the_run_finishes(tmp_path, srv, gcs):
    rd, be = setup(tmp_path, srv, gcs.bucket)
    script = WorldScript(
        srv,
        rd,
        {
            1: [
                # 16-64 hosts pull after a repair and the registry answers 429 for 40 minutes.
                (60, lambda s, n: s.srv.world.image_pull_fault(None, "transient", for_s=2400)),
                (90, admit_run),
                (3000, lambda s, n: s.commit(20)),
                (3030, lambda s, n: s.srv.cluster.complete(n)),
            ]
        },
    )
    # Longer than --admission-timeout (1800 s), which must not apply to a pull backoff; max_retries=1: a
    # failed attempt would give up.
    rc, out = supervise(rd, be, script, backoff_base_s=1, max_retries=1)
    assert rc == 0, out
    j = rd.journal()
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]
    assert not [r for r in j if r["event"] in ("failed", "preempted", "gave_up")]
    # (the queue before admission is a wait for capacity of its own)
    waits = [r for r in j if r["event"] in ("waiting", "waited") and r["cause"] == "image-pull"]
    assert [(r["event"], r["cause"]) for r in waits] == [("waiting", "image-pull"), ("waited", "image-pull")]
    assert 2400 - 90 <= waits[1]["seconds"] <= 2400 - 90 + 300 + 30  # until the first retry after the fault
    assert "ErrImagePull" in waits[0]["reason"] or "ImagePullBackOff" in waits[0]["reason"]


def test_a_permanent_pull_error_exits_2_at_once_naming_the_image(tmp_path, srv, gcs):
    rd, be = setup(tmp_path, srv, gcs.bucket)
    script = WorldScript(
        srv,
        rd,
        {1: [(30, lambda s, n: s.srv.world.image_pull_fault(None, "permanent")), (60, admit_run)]},
    )
    with pytest.raises(BadInput) as ei:
        supervise(rd, be, script, backoff_base_s=1, max_retries=5)
    assert ei.value.exit_code == 2
    assert f"image {IMAGE} cannot be pulled" in ei.value.message and ": not found" in ei.value.message
    assert "--image" in (ei.value.hint or "")
    j = rd.journal()
    assert [r["attempt"] for r in j if r["event"] == "submitted"] == [1]  # not deleted and retried five times
    failed = [r for r in j if r["event"] == "failed"]
    assert len(failed) == 1 and IMAGE in failed[0]["reason"]
    assert script.t - script.seen[1] < 200  # at once, not after a backoff or a timeout


def test_a_pull_backoff_past_the_image_pull_timeout_exits_2_naming_the_image(tmp_path, srv, gcs):
    rd, be = setup(tmp_path, srv, gcs.bucket)
    script = WorldScript(
        srv, rd, {1: [(30, lambda s, n: s.srv.world.image_pull_fault(None, "transient")), (60, admit_run)]}
    )
    with pytest.raises(OlmoCtlError) as ei:
        supervise(rd, be, script, backoff_base_s=1, max_retries=5, image_pull_timeout_s=1200)
    assert ei.value.exit_code == 2
    assert f"image {IMAGE} not pulled after 20m30s (--image-pull-timeout 1200 s)" in ei.value.message
    j = rd.journal()
    assert [r["event"] for r in j if r["event"] == "failed" or r.get("cause") == "image-pull"] == [
        "waiting",
        "failed",
    ]
