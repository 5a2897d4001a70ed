"""Run directory: run.yaml create-once, journal, committed-checkpoint discovery, lease CAS — local and gs://."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from olmo_ctl.core.errors import BadInput
from olmo_ctl.rundir import COMMIT_MARKER, LeaseHeld, LeaseLost, RunDir


@pytest.fixture(params=["local", pytest.param("gcs", marks=pytest.mark.gcs)])
def rd(request, tmp_path):
    if request.param == "local":
        return RunDir.of(str(tmp_path / "runs"), "r1")
    request.getfixturevalue("gcs").new_bucket("olmo-runs")
    return RunDir.of(f"gs://olmo-runs/{tmp_path.name}", "r1")


def _write(rd: RunDir, rel: str, data: bytes = b"x") -> None:
    rd.store.write_bytes(rd.p(rel), data)


def test_run_yaml_written_once_and_compared(rd):
    assert not rd.exists()
    with pytest.raises(BadInput, match="does not exist"):
        rd.read_run()
    rd.create_run({"name": "smoke"}, "fp1", "data1", "cpu-1")
    assert rd.read_run()["recipe_fingerprint"] == "fp1"
    with pytest.raises(BadInput, match="created concurrently"):
        rd.create_run({"name": "other"}, "fp2", "data1", "cpu-1")
    assert rd.read_run()["recipe"] == {"name": "smoke"}
    rd.check_matches("fp1", "data1")
    with pytest.raises(BadInput, match="another recipe"):
        rd.check_matches("fp2", "data1")
    with pytest.raises(BadInput, match="data changed"):
        rd.check_matches("fp1", "data2")


def test_a_run_resumes_with_other_evaluation_settings_only(rd):
    """Evaluation is not what a run trains: a recipe that differs from run.yaml's in `eval` or
    `data.eval` alone continues the run; anything else is another recipe."""
    from olmo_ctl.core.recipe import load_recipe

    r = load_recipe("smoke")
    rd.create_run(r.to_dict(), r.fingerprint(), "data1", "cpu-1")
    rd.check_matches(r.fingerprint(), "data1", r)
    evals = load_recipe("smoke", overrides=["eval.interval=7", "eval.batches=1", "data.eval=[]"])
    assert evals.fingerprint() != r.fingerprint()
    rd.check_matches(evals.fingerprint(), "data1", evals)
    with pytest.raises(BadInput, match="another recipe"):
        rd.check_matches(evals.fingerprint(), "data1")  # without the recipe: the fingerprint alone
    trains = load_recipe("smoke", overrides=["eval.interval=7", "optimizer.lr=1e-3"])
    with pytest.raises(BadInput, match="another recipe"):
        rd.check_matches(trains.fingerprint(), "data1", trains)
    with pytest.raises(BadInput, match="data changed"):
        rd.check_matches(evals.fingerprint(), "data2", evals)


def test_journal_holds_the_whole_history(rd):
    for i in range(5):
        rd.append("submitted", attempt=i + 1, device="cpu-1", reason=f"r{i}", committed_step=i * 10)
    j = rd.journal()
    assert [r["attempt"] for r in j] == [1, 2, 3, 4, 5]
    assert j[2]["committed_step"] == 20 and j[2]["event"] == "submitted" and j[2]["time"].endswith("Z")
    assert rd.next_attempt_number() == 6
    assert rd.last_attempt()["reason"] == "r4"
    text = rd.store.read_text(rd.p("journal.jsonl"))
    assert len(text.splitlines()) == 5


def test_concurrent_journal_appends_lose_nothing(rd):
    def writer(k):
        for i in range(6):
            rd.append("running", attempt=k, reason=str(i))

    ts = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    j = rd.journal()
    assert sorted((r["attempt"], r["reason"]) for r in j) == sorted(
        (k, str(i)) for k in range(3) for i in range(6)
    )


def test_committed_steps_ignore_tmp_and_partial(rd):
    assert rd.committed_steps() == [] and rd.committed_step() == 0
    for s in (20, 40, 100, 120):
        _write(rd, f"checkpoints/{s}/state/array.zarr/0.0")
        _write(rd, f"checkpoints/{s}/{COMMIT_MARKER}")
    _write(rd, "checkpoints/140/state/array.zarr/0.0")  # partial: no commit marker
    _write(rd, "checkpoints/160.orbax-checkpoint-tmp-1234/state/x")
    _write(rd, f"checkpoints/160.orbax-checkpoint-tmp-1234/{COMMIT_MARKER}")  # never a final name
    _write(rd, f"checkpoints/notastep/{COMMIT_MARKER}")
    assert rd.committed_steps() == [20, 40, 100, 120]
    assert rd.committed_step() == 120


def test_a_directory_that_lost_its_run_yaml_is_never_a_new_run(rd):
    """run.yaml gone while the run's journal and checkpoints remain: no run.yaml is written there again
    (a new one would resume the checkpoints under whatever recipe it came with); the refusal names the
    directory and how to restore it. Checkpoint 0 alone is a seeded start (`surgery warm-adam`, an
    ingredient's --start-from): a new run. An eval job's directory is not a run either."""
    _write(rd, f"checkpoints/0/{COMMIT_MARKER}")
    rd.append("submitted", attempt=1, device="cpu-1", reason="first attempt", committed_step=0)
    _write(rd, f"checkpoints/40/{COMMIT_MARKER}")
    with pytest.raises(BadInput) as e:
        rd.create_run({"name": "smoke"}, "fp2", "data1", "cpu-1")
    assert e.value.exit_code == 2
    assert e.value.one_line() == (
        f"run `r1` has no run.yaml, but {rd.path} still holds its journal (1 record) and checkpoints up to "
        "step 40, which a new run.yaml would continue under whatever recipe it was given; copy the run's "
        f"run.yaml back to {rd.p('run.yaml')} (from a backup) to continue it, or move the directory aside "
        "to start a new run of that name"
    )
    assert not rd.exists()
    seeded = RunDir.of(rd.path.rsplit("/", 1)[0], "r2")
    seeded.store.write_bytes(seeded.p(f"checkpoints/0/{COMMIT_MARKER}"), b"x")
    seeded.create_run({"name": "smoke"}, "fp1", "data1", "cpu-1")
    assert seeded.read_run()["recipe_fingerprint"] == "fp1"
    from olmo_ctl.rundir import EVAL_JOB_REASON

    ev = RunDir.of(rd.path.rsplit("/", 1)[0], "r3")
    ev.append("submitted", attempt=0, device="v5p-8", reason=EVAL_JOB_REASON, committed_step=0)
    with pytest.raises(BadInput, match="is an eval job's output directory"):
        ev.create_run({"name": "smoke"}, "fp1", "data1", "cpu-1")
    assert not ev.exists()


@pytest.mark.gcs
def test_gcs_discovery_of_hundreds_in_one_list_call(gcs, tmp_path):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage as gcs_lib

    gcs.new_bucket("olmo-runs")
    rd = RunDir.of(f"gs://olmo-runs/{tmp_path.name}", "many")
    client = gcs_lib.Client(project="local", credentials=AnonymousCredentials())
    bucket = client.bucket("olmo-runs")
    base = f"{tmp_path.name}/many/checkpoints"
    for s in range(1, 301):
        bucket.blob(f"{base}/{s * 10}/{COMMIT_MARKER}").upload_from_string(b"ok")
    bucket.blob(f"{base}/3010/state/x").upload_from_string(b"partial")
    calls = []
    real = rd.store._client.list_blobs

    def counting(*a, **k):
        calls.append(k)
        return real(*a, **k)

    rd.store._client.list_blobs = counting
    try:
        steps = rd.committed_steps()
    finally:
        rd.store._client.list_blobs = real
    assert steps == [s * 10 for s in range(1, 301)]
    assert len(calls) <= 2


@pytest.mark.gcs
def test_listing_errors_are_not_step_zero(gcs):
    rd = RunDir("gs://no-such-bucket-olmo/r")
    with pytest.raises(Exception) as ei:  # never [] (which would restart the run from step 0)
        rd.committed_steps()
    assert getattr(ei.value, "exit_code", None) in (2, 3)


def test_lease_one_holder_and_takeover_after_expiry(rd):
    lease = rd.acquire_lease(ttl_s=60, now=1000.0)
    rd.heartbeat(lease, now=1010.0)
    # A second supervisor in another (live) process: refused, naming the holder.
    held = dict(rd.read_lease())
    held["process"] = {"host": "another-host", "pid": 1}
    rd.store.write_text(rd.p("lease.json"), json.dumps(held))
    with pytest.raises(LeaseHeld, match="supervised by") as ei:
        rd.acquire_lease(ttl_s=60, now=1030.0)
    assert ei.value.exit_code == 2 and lease.holder.split(" ")[0] in ei.value.message
    # Our own lease object changed under us (the write above): the next heartbeat notices.
    with pytest.raises(LeaseLost):
        rd.heartbeat(lease, now=1040.0)
    # Past the TTL since the last heartbeat (by our clock), the lease is watched for a whole TTL of our
    # own monotonic clock before it is taken: its generation must not change meanwhile.
    clock = [0.0]
    new = rd.acquire_lease(
        ttl_s=60, now=1100.0, monotonic=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s)
    )
    assert clock[0] >= 60 and new.epoch == 2
    rd.heartbeat(new, now=1101.0)
    rd.release_lease(new, now=1102.0)
    assert rd.read_lease()["released"] is True
    rd.acquire_lease(ttl_s=60, now=1103.0)  # a released lease is free


def test_a_lease_write_whose_answer_was_lost_is_still_ours(rd):
    """Ctrl-C between a heartbeat's write and its answer leaves the lease object one generation behind
    its own write: the next heartbeat (the journal line of the Ctrl-C) must not read it as a takeover."""
    import copy

    lease = rd.acquire_lease(ttl_s=60, now=1000.0)
    rd.heartbeat(copy.copy(lease), now=1010.0)  # written, but the new generation never reached `lease`
    rd.heartbeat(lease, now=1020.0)
    assert rd.read_lease()["heartbeat_unix"] == 1020.0
    rd.append("supervisor_detached", reason="interrupted", fence=lease)
    assert rd.journal()[-1]["event"] == "supervisor_detached"
    # Another holder's write (its own token) is still a takeover.
    held = dict(rd.read_lease())
    held["process"] = {**held["process"], "token": "someone-else"}
    rd.store.write_text(rd.p("lease.json"), json.dumps(held))
    with pytest.raises(LeaseLost):
        rd.heartbeat(lease, now=1030.0)


def test_lease_of_a_dead_local_process_is_free(tmp_path):
    rd = RunDir.of(str(tmp_path), "r2")
    code = (
        "import sys; from olmo_ctl.rundir import RunDir; "
        f"RunDir.of({str(tmp_path)!r}, 'r2').acquire_lease(ttl_s=3600)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    lease = rd.acquire_lease(ttl_s=3600)  # its holder exited: no need to wait an hour
    assert str(os.getpid()) in lease.holder


def test_racing_acquirers_one_wins(rd):
    results = []

    def go():
        try:
            results.append(rd.acquire_lease(ttl_s=60))
        except LeaseHeld as e:
            results.append(e)

    ts = [threading.Thread(target=go) for _ in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    wins = [r for r in results if not isinstance(r, Exception)]
    assert len(wins) == 1, results


def test_progress_signature_lists_only_newer_segments(rd):
    assert rd.progress_signature() == ()
    old = "events.out.tfevents.1700000000.host.a0001.s00000"
    new = "events.out.tfevents.1800000000.host.a0002.s00000"
    _write(rd, f"tensorboard/{old}", b"x" * 10)
    _write(rd, f"tensorboard/{new}", b"x" * 20)
    assert [n.rsplit("/", 1)[-1] for n, _ in rd.progress_signature(since_unix=1750000000)] == [new]
    before = rd.progress_signature(since_unix=1750000000)
    _write(rd, f"tensorboard/{new}", b"x" * 30)
    assert rd.progress_signature(since_unix=1750000000) != before
    assert len(rd.progress_signature()) == 2


def test_resize_request_round_trip(rd):
    assert rd.pending_resize() is None
    doc = rd.request_resize("cpu-2", "more devices")
    assert rd.pending_resize()["device"] == "cpu-2" and rd.pending_resize()["id"] == doc["id"]
    assert rd.journal()[-1]["event"] == "resize_requested"
    rd.clear_resize()
    assert rd.pending_resize() is None


def test_run_name_is_checked(tmp_path):
    with pytest.raises(BadInput, match="not a valid run name"):
        RunDir.of(str(tmp_path), "Bad_Name")


@pytest.mark.parametrize(
    "content", [b"\x00\xff\xfe binary", b"recipe: [unclosed\n", b"- a list\n", b"recipe: 3\n"]
)
def test_a_garbage_run_yaml_is_bad_input_naming_the_file(tmp_path, content):
    rd = RunDir(str(tmp_path / "r"))
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "run.yaml").write_bytes(content)
    with pytest.raises(BadInput, match="run.yaml` is not a run description"):
        rd.read_run()
    with pytest.raises(BadInput):
        rd.recipe()


def test_an_expired_looking_lease_whose_holder_still_heartbeats_is_not_taken(rd):
    """Clocks are not trusted: a holder whose heartbeats look old by our clock (its clock is behind)
    but which keeps renewing is still alive, and the lease stays its own."""
    holder = rd.acquire_lease(ttl_s=60, now=1000.0)
    doc = dict(rd.read_lease())
    doc["process"] = {"host": "another-host", "pid": 1}
    rd.store.write_text(rd.p("lease.json"), json.dumps(doc))
    holder.generation = rd.store.stat(rd.p("lease.json")).generation
    clock = [0.0]

    def sleep(s):
        clock[0] += s
        if clock[0] > 20:  # the holder renews, with its (behind) clock
            rd.heartbeat(holder, now=1001.0)

    with pytest.raises(LeaseHeld):
        rd.acquire_lease(ttl_s=60, now=5000.0, monotonic=lambda: clock[0], sleep=sleep)
    assert 20 < clock[0] < 60


def test_the_dead_holder_shortcut_needs_the_same_boot(tmp_path):
    """Same hostname and a pid that is gone is not enough: another machine (or boot) with our hostname
    could hold it; the shortcut applies only under the same boot id."""
    from olmo_ctl.rundir import _holder_process_dead, boot_id

    gone = {"process": {"host": socket.gethostname(), "pid": 2**22 + 12345, "boot_id": boot_id()}}
    assert _holder_process_dead(gone)
    assert not _holder_process_dead({"process": {**gone["process"], "boot_id": "another-boot"}})
    assert not _holder_process_dead({"process": {**gone["process"], "boot_id": None}})


def test_reserved_attempt_numbers_survive_a_takeover_and_fence_the_old_holder(rd):
    a = rd.acquire_lease(ttl_s=60)
    assert rd.reserve_attempt(a, 1) == 1 and rd.reserve_attempt(a, 1) == 2
    rd.release_lease(a)
    b = rd.acquire_lease(ttl_s=60)
    assert b.epoch == a.epoch + 1
    assert rd.reserve_attempt(b, 1) == 3  # never 1 or 2 again, whatever the journal says
    with pytest.raises(LeaseLost):
        rd.reserve_attempt(a, 1)  # the old holder can neither reserve ...
    with pytest.raises(LeaseLost):
        rd.append("submitted", attempt=2, fence=a)  # ... nor journal
    assert [r["event"] for r in rd.journal()] == []
    rd.append("submitted", attempt=3, fence=b)
    assert rd.journal()[-1]["attempt"] == 3
