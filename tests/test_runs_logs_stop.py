"""`olmo-ctl runs`, `logs` and `stop`: the runs under a run root, an attempt's log (local processes and
GKE pods through the Kubernetes test server), and stopping a supervised run at a checkpoint."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from helpers.attempts import attempt_of
from helpers.cli import invoke, spawn
from helpers.kube import write_kubeconfig
from helpers.runs import STEPS, copy_run
from helpers.trainer import scalars
from helpers.waiting import wait_for

from olmo_ctl.backends.local import LocalBackend, proc_start_time
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.rundir import RunDir
from olmo_ctl.supervise.attempts import submit_next


def cli(*args: str, env: dict | None = None):
    """`olmo-ctl ARGS` in this process, without the caller's OLMO_CTL_* settings or config file."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    base["XDG_CONFIG_HOME"] = "/nonexistent-olmo-ctl-config"
    return invoke(*args, env={**base, **(env or {})})


def new_run(root: Path, name: str, steps: int = 20, device: str = "cpu-1") -> RunDir:
    rd = RunDir.of(str(root), name)
    r = load_recipe("smoke", overrides=[f"train.max_steps={steps}"])
    rd.create_run(r.to_dict(), r.fingerprint(), "fp", device)
    return rd


def fake_python(tmp_path: Path, body: str) -> str:
    """An interpreter stand-in: a shell script that prints what a trainer would (with its host prefix)."""
    p = tmp_path / "python-fake"
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(0o755)
    return str(p)


def start_attempt(rd: RunDir, be: LocalBackend, device: str = "cpu-1"):
    req = attempt_of(rd, 0, device)
    return submit_next(rd, be, req, "first attempt")


# ---------------------------------------------------------------- runs


def test_runs_lists_every_run_with_its_state_step_and_last_loss(tmp_path, smoke_run):
    root = tmp_path / "runs"
    done = copy_run(smoke_run, root / "done")  # 40 steps trained, checkpoints 20 and 40
    r = load_recipe("smoke", overrides=[f"train.max_steps={STEPS}"])
    RunDir(str(done)).create_run(r.to_dict(), r.fingerprint(), "fp", "cpu-1", adopt=True)
    new_run(root, "fresh", steps=30, device="cpu-2x2")
    stopped = new_run(root, "halted", steps=50)
    stopped.append(
        "submitted", attempt=1, device="cpu-1", handle={"backend": "local", "name": "1", "attempt": 1}
    )
    stopped.append("running", attempt=1, device="cpu-1")
    stopped.append("stopped", attempt=1, device="cpu-1", reason="stopped on request (olmo-ctl stop)")
    looped = new_run(root, "looped", steps=50)
    for n in (1, 2):
        looped.append("submitted", attempt=n, device="cpu-1", slices=1)
        looped.append("failed", attempt=n, device="cpu-1", reason="failed-infra: exit -11 (SIGSEGV)")
    looped.append("gave_up", attempt=2, reason="crash loop: 2 attempts in a row")
    (root / "not-a-run").mkdir()

    p = cli("runs", "--run-root", str(root), "-o", "json")
    assert p.returncode == 0, p.stderr
    rows = {row["name"]: row for row in json.loads(p.stdout)["runs"]}
    assert sorted(rows) == ["done", "fresh", "halted", "looped"]
    want_loss = float(scalars(smoke_run)["train/CE loss"][STEPS])
    assert rows["done"]["state"] == "done" and (rows["done"]["step"], rows["done"]["final_step"]) == (40, 40)
    assert rows["done"]["last_loss"] == pytest.approx(want_loss, rel=1e-6)
    assert (rows["fresh"]["state"], rows["fresh"]["device"], rows["fresh"]["final_step"]) == (
        "new",
        "cpu-2x2",
        30,
    )
    assert rows["halted"]["state"] == "stopped" and rows["halted"]["step"] == 0
    assert rows["looped"]["state"] == "gave up" and "crash loop" in rows["looped"]["reason"]
    assert rows["looped"]["updated"] == looped.journal()[-1]["time"]

    t = cli("runs", "--run-root", str(root))
    assert t.returncode == 0, t.stderr
    lines = t.stdout.splitlines()
    assert lines[0].split() == ["RUN", "STAGE", "DEVICE", "STEP", "STATE", "LOSS", "UPDATED"]
    done_line = next(ln for ln in lines if ln.startswith("done "))
    assert "40/40" in done_line and f"{want_loss:.4f}" in done_line
    assert "gave up" in next(ln for ln in lines if ln.startswith("looped "))

    bad = cli("runs", "--run-root", str(tmp_path / "nowhere"))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: run root") and "does not exist" in bad.stderr
    assert len(bad.stderr.splitlines()) == 1


def test_runs_counts_the_runs_smoke_made_and_lists_them_with_all(tmp_path):
    from olmo_ctl.supervise.smoke import new_run_name

    root = tmp_path / "runs"
    new_run(root, "mine")
    new_run(root, "smoke-demo")  # a run of the smoke recipe someone named: theirs, listed
    name = new_run_name("v5p-16")  # what `olmo-ctl smoke` names its run and its twin
    for n in (name, f"{name}-twin"):
        rd = new_run(root, n, steps=2000, device="v5p-16")
        rd.append("submitted", attempt=1, device="v5p-16", handle={"backend": "gke", "name": n, "attempt": 1})
        rd.append("succeeded", attempt=1, device="v5p-16", reason="exit 0", committed_step=13)
    common = ("runs", "--run-root", str(root), "--no-backend-status")

    js = cli(*common, "-o", "json")
    assert js.returncode == 0, js.stderr
    got = json.loads(js.stdout)
    assert [(r["name"], r["smoke"]) for r in got["runs"]] == [("mine", False), ("smoke-demo", False)]
    assert got["smoke_runs_hidden"] == 2
    t = cli(*common)
    assert t.returncode == 0, t.stderr
    assert [ln.split()[0] for ln in t.stdout.splitlines()] == ["RUN", "mine", "smoke-demo"]
    assert t.stderr == "note: 2 smoke runs (made by `olmo-ctl smoke`) not listed; --all lists them\n"

    every = json.loads(cli(*common, "--all", "-o", "json").stdout)
    assert [(r["name"], r["smoke"], r["state"]) for r in every["runs"]] == [
        ("mine", False, "new"),
        ("smoke-demo", False, "new"),
        (name, True, "succeeded"),
        (f"{name}-twin", True, "succeeded"),
    ]
    assert every["smoke_runs_hidden"] == 0
    t_all = cli(*common, "--all")
    assert t_all.returncode == 0 and t_all.stderr == "" and f"{name}-twin" in t_all.stdout


# ---------------------------------------------------------------- logs (local)


def test_logs_of_a_local_multi_host_attempt_whole_per_host_and_followed(tmp_path):
    root = tmp_path / "runs"
    rd = new_run(root, "twin", device="cpu-2x2")
    py = fake_python(
        tmp_path,
        'for i in 1 2 3; do echo "${OLMO_CTL_LOG_PREFIX}step $i/20 loss 5.$i"; done',
    )
    be = LocalBackend(str(root), python=py)
    h = start_attempt(rd, be, "cpu-2x2")
    wait_for(lambda: not be.status(h).state.live, 30, "attempt 1 to end")

    p = cli("logs", "twin", "--run-root", str(root), "--backend", "local")
    assert p.returncode == 0, p.stderr
    head, *got = p.stdout.splitlines()
    assert head.startswith("=== attempt 1 on cpu-2x2 at ")  # the backend's line for each attempt
    assert sorted(got) == sorted(f"host {k}: step {i}/20 loss 5.{i}" for k in (0, 1) for i in (1, 2, 3))
    one = cli("logs", "twin", "--run-root", str(root), "--backend", "local", "--host", "1", "--attempt", "1")
    assert one.returncode == 0 and one.stdout.splitlines() == [f"step {i}/20 loss 5.{i}" for i in (1, 2, 3)]
    js = cli("logs", str(rd.path), "--host", "0", "--tail", "2", "-o", "json")
    assert js.returncode == 0, js.stderr
    assert json.loads(js.stdout)["lines"] == ["step 2/20 loss 5.2", "step 3/20 loss 5.3"]
    for args, says in (
        (("--host", "2"), "attempt 1 has 2 hosts (0..1), not host 2"),
        (("--attempt", "4"), "run `twin` has no attempt 4; its attempts: 1"),
    ):
        bad = cli("logs", "twin", "--run-root", str(root), "--backend", "local", *args)
        assert bad.returncode == 2 and says in bad.stderr and len(bad.stderr.splitlines()) == 1, bad.stderr
    nope = cli("logs", "ghost", "--run-root", str(root), "--backend", "local")
    assert nope.returncode == 2 and "does not exist" in nope.stderr
    new_run(root, "unborn")  # never submitted: neither command asks a backend (here the default, gke)
    none = cli("logs", "unborn", "--run-root", str(root))
    assert none.returncode == 2 and "run `unborn` has no submitted attempt yet" in none.stderr
    idle = cli("stop", "unborn", "--run-root", str(root))
    assert idle.returncode == 0 and "has no live attempt and no supervisor: nothing to stop" in idle.stdout
    assert not (root / "unborn" / "journal.jsonl").exists()  # nothing written

    # -f: the lines as they come, until the attempt ends (a second attempt that writes for ~1 s)
    be2 = LocalBackend(
        str(root),
        python=fake_python(
            tmp_path, 'for i in 1 2 3 4 5; do echo "${OLMO_CTL_LOG_PREFIX}tick $i"; sleep 0.2; done'
        ),
    )
    t0 = time.time()
    start_attempt(rd, be2, "cpu-1")
    f = cli("logs", "twin", "--run-root", str(root), "--backend", "local", "-f", "--interval", "0.1")
    assert f.returncode == 0, f.stderr
    head, *ticks = f.stdout.splitlines()
    assert head.startswith("=== attempt 2 on cpu-1 at ") and ticks == [f"tick {i}" for i in range(1, 6)]
    assert time.time() - t0 >= 0.8  # it waited for the attempt's later lines


# ---------------------------------------------------------------- logs and stop (GKE)


@pytest.fixture
def gke_run(tmp_path, srv, gcs):
    """Attempt 1 of a smoke run on tpu7x-16 (two TPU VMs: two pods) running in the test cluster."""
    from olmo_ctl.backends.gke import GKEBackend
    from olmo_ctl.core.config import Settings

    root = f"gs://{gcs.bucket}/runs"
    rd = new_run(root, "gk", device="tpu7x-16")  # type: ignore[arg-type]
    settings = Settings(image="img:1", run_root=root, queue="tpu-queue")
    be = GKEBackend(host=srv.url, settings=settings)
    h = be.send(be.render(attempt_of(rd, 1, "tpu7x-16")))
    rd.append("submitted", attempt=1, device="tpu7x-16", handle=h.to_dict(), backend="gke")
    srv.cluster.admit(h.name)
    srv.cluster.run_pods(h.name)
    env = {"KUBECONFIG": write_kubeconfig(tmp_path / "kubeconfig", srv.url)}
    args = ("--run-root", root, "--backend", "gke")
    return rd, h, env, args


def test_logs_of_a_gke_attempt_read_each_pod_and_the_journal_once_pods_are_gone(gke_run, srv):
    rd, h, env, args = gke_run
    srv.cluster.log(h.name, 0, ["host0 step 1/20 loss 5.5", "host0 step 2/20 loss 5.1"])
    srv.cluster.log(h.name, 1, ["host1 step 1/20 loss 5.5"])
    p = cli("logs", "gk", *args, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["host0 step 1/20 loss 5.5", "host0 step 2/20 loss 5.1"]
    one = cli("logs", "gk", *args, "--host", "1", "-o", "json", env=env)
    assert one.returncode == 0, one.stderr
    got = json.loads(one.stdout)
    assert got["lines"] == ["host1 step 1/20 loss 5.5"] and got["source"].startswith("pod " + h.name)
    bad = cli("logs", "gk", *args, "--host", "2", env=env)
    assert bad.returncode == 2 and "has 2 pod(s) now (hosts 0..1), not host 2" in bad.stderr
    # The failed pod is the one shown by default.
    srv.cluster.pod_exit(h.name, 1, 1, log_lines=["ValueError: loss is NaN"])
    failed = cli("logs", "gk", *args, env=env)
    assert failed.returncode == 0 and failed.stdout.splitlines()[-1] == "ValueError: loss is NaN", (
        failed.stdout
    )
    # Once the JobSet and its pods are gone, the lines the supervisor journaled.
    rd.append("failed", attempt=1, reason="failed-user: exit 1", last_log_lines=["ValueError: loss is NaN"])
    stopped = cli("stop", "gk", *args, env=env)  # nothing live (a failed JobSet): nothing to stop
    assert stopped.returncode == 0 and "nothing to stop" in stopped.stdout, stopped.stdout + stopped.stderr
    from olmo_ctl.backends.base import Handle
    from olmo_ctl.backends.gke import GKEBackend

    GKEBackend(host=srv.url).stop(Handle.from_dict(rd.last_attempt()["handle"]))
    wait_for(lambda: h.name not in srv.cluster.jobset_names(), 10, "the JobSet deleted")
    gone = cli("logs", "gk", *args, env=env)
    assert gone.returncode == 0 and gone.stdout.splitlines() == ["ValueError: loss is NaN"]
    assert "log is gone" in gone.stderr and "as the supervisor journaled them" in gone.stderr


def test_logs_follow_a_gke_pod_until_its_jobset_completes(gke_run, srv):
    import threading

    rd, h, env, args = gke_run
    srv.cluster.log(h.name, 1, ["step 1/20"])

    def later() -> None:
        time.sleep(0.6)
        srv.cluster.log(h.name, 1, ["step 2/20", "committed step 20"])
        time.sleep(0.4)
        srv.cluster.complete(h.name)

    t = threading.Thread(target=later)
    t0 = time.time()
    t.start()
    try:
        f = cli("logs", "gk", *args, "--host", "1", "-f", "--interval", "0.1", env=env)
    finally:
        t.join()
    assert f.returncode == 0, f.stderr
    assert f.stdout.splitlines() == ["step 1/20", "step 2/20", "committed step 20"]
    assert time.time() - t0 >= 1.0  # it followed until the JobSet completed


def test_ctrl_c_while_following_a_gke_pod_is_one_interrupted_line_and_130_at_any_moment(
    gke_run, srv, tmp_path
):
    """Ctrl-C lands wherever `logs -f` happens to be (in a status call, a pod log response being read
    or closed, the sleep between reads): several followers, each interrupted at a random moment after
    its first line, each ends with the same one line and 130, and the attempt goes on."""
    import random
    import signal

    from helpers.cli import clean_env

    rd, h, env, args = gke_run
    srv.cluster.log(h.name, 0, [f"step {i}/20 " + "x" * 200 for i in range(1, 1501)])  # a long response
    e = {**clean_env(tmp_path / "config"), **env}
    rng = random.Random(35)
    followers = [
        spawn("logs", "gk", *args, "-f", "--interval", "0.01", env=e) for _ in range(4)
    ]  # fmt: skip
    want = (
        "interrupted: stopped following attempt 1 of run `gk` (nothing was stopped: the attempt goes on); "
        "follow it again with: olmo-ctl logs gk -f"
    )
    try:
        for p in followers:
            assert p.stdout is not None
            assert p.stdout.readline().startswith("step 1/20 ")  # following: its first line is out
        for p in followers:
            time.sleep(rng.uniform(0, 0.3))
            p.send_signal(signal.SIGINT)
        for p in followers:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 130, err
            assert err.splitlines() == [want], err  # nothing else: no traceback, no "Exception ignored"
    finally:
        for p in followers:
            if p.poll() is None:
                p.kill()
    assert h.name in srv.cluster.jobset_names()  # the attempt goes on


def test_stop_deletes_a_running_gke_attempt_and_runs_shows_it_stopped(gke_run, srv):
    rd, h, env, args = gke_run
    p = cli("stop", "gk", *args, "-o", "json", env=env)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["action"] == "stopped" and res["attempts_stopped"] == [1] and res["supervisor"] is None
    assert h.name not in srv.cluster.jobset_names()
    events = [r["event"] for r in rd.journal()]
    assert events[-2:] == ["stop_requested", "stopped"] and rd.pending_stop() is None
    rows = json.loads(cli("runs", *args, "--no-backend-status", "-o", "json", env=env).stdout)["runs"]
    assert [(r["name"], r["state"]) for r in rows] == [("gk", "stopped")]
    again = cli("stop", "gk", *args, env=env)
    assert again.returncode == 0 and "nothing to stop" in again.stdout
    assert [r["event"] for r in rd.journal()] == events  # the second stop wrote nothing


# ---------------------------------------------------------------- stop (local)


def test_stop_ends_a_supervisor_that_backs_off_between_attempts(tmp_path):
    import io
    import threading

    from olmo_ctl.supervise.policy import RetryPolicy
    from olmo_ctl.supervise.supervisor import Printer, Supervisor

    rd = new_run(tmp_path, "crash")
    be = LocalBackend(
        str(tmp_path),
        python=fake_python(tmp_path, 'echo "Fatal Python error: Segmentation fault"\nkill -SEGV $$'),
    )
    out = io.StringIO()
    sup = Supervisor(
        rd, be, RetryPolicy(backoff_base_s=60, max_retries=5), device=get_device("cpu-1"), poll_s=0.05,
        printer=Printer(rd.name, stream=out),
    )  # fmt: skip
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", sup.run()))
    t0 = time.time()
    t.start()
    try:
        wait_for(lambda: any(r["event"] == "backoff" for r in rd.journal()), 30, "the supervisor backing off")
        p = cli("stop", "crash", "--run-root", str(tmp_path), "--backend", "local", "--poll", "0.05")
    finally:
        t.join(30)
    assert p.returncode == 0, p.stdout + p.stderr
    assert result["rc"] == 130 and time.time() - t0 < 30  # it did not sit out its 60 s backoff
    assert "stopped on request at committed step 0/20" in out.getvalue()
    ev = [r["event"] for r in rd.journal()]
    assert ev.count("submitted") == 1 and ev[-1] == "stopped" and "supervisor_stopped" in ev
    assert "no attempt was live; its supervisor ended" in p.stdout
    assert rd.pending_stop() is None


# ---------------------------------------------------------------- stop (local, a real trainer and supervisor)


@pytest.mark.chaos
def test_stop_checkpoints_ends_the_supervisor_and_a_later_submit_continues(tmp_path):
    root = tmp_path / "runs"
    rdir = root / "halt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    common = ["--run-root", str(root), "--backend", "local"]
    recipe_set = [
        "--set",
        "train.max_steps=20000",
        "--set",
        "checkpoint.interval=1000",
        "--set",
        "eval.interval=1000",
    ]
    sup = spawn(
        "resume-until-done", "--recipe", "smoke", "--device", "cpu-1", "--run", "halt", *common,
        "--poll", "0.2", *recipe_set, env=env,
    )  # fmt: skip
    try:
        log = rdir / "logs" / "attempt-1.log"
        wait_for(lambda: log.exists() and "step " in log.read_text(), 180, "attempt 1 training")
        pid = json.loads((rdir / "attempts" / "1.json").read_text())["pid"]
        p = cli("stop", "halt", *common)
        assert p.returncode == 0, p.stdout + p.stderr
        out, err = sup.communicate(timeout=60)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sup.returncode == 130, out + err
    assert "stopped on request" in out and "resume-until-done halt" in out
    assert proc_start_time(pid) is None
    rd = RunDir(str(rdir))
    committed = rd.committed_step()
    assert committed > 0  # the SIGTERM checkpoint (none was scheduled before step 1000)
    j = rd.journal()
    ev = [r["event"] for r in j]
    assert ev.count("submitted") == 1 and "stop_requested" in ev and "supervisor_stopped" in ev
    assert ev[-1] == "stopped" and j[-1]["committed_step"] == committed and j[-1]["attempt"] == 1
    assert not any(e in ev for e in ("preempted", "backoff", "failed")), ev
    assert p.stdout == (
        f"stopped run `halt` at committed step {committed}/20000 (attempt 1; its supervisor ended); "
        f"continue with: olmo-ctl resume-until-done halt --run-root {root} --backend local\n"
    )
    rows = json.loads(cli("runs", *common, "-o", "json").stdout)["runs"]
    assert [(r["name"], r["state"], r["step"]) for r in rows] == [("halt", "stopped", committed)]
    mon = json.loads(cli("monitor", str(rdir), "-o", "json").stdout)
    assert mon["attempt"]["state"] == "stopped"
    # A later submit continues the run on purpose (a new attempt from the stop's checkpoint) ...
    sub = cli("submit", "--run", "halt", "--recipe", "smoke", *recipe_set, *common)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    assert [r["attempt"] for r in rd.journal() if r["event"] == "submitted"] == [1, 2]
    wait_for(lambda: (rdir / "logs" / "attempt-2.log").exists(), 30, "attempt 2 started")
    assert cli("runs", *common, "-o", "json").stdout.count('"state": "stopped"') == 0
    # ... and stopping it again stops attempt 2 (no supervisor this time).
    again = cli("stop", "halt", *common, "-o", "json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["attempts_stopped"] == [2]


# ---------------------------------------------------------------- notifications and -o jsonl

# A webhook URL's secrets: Slack-style in the path, a token in the query, a password in the userinfo.
SECRETS = ("T0SECRET", "B0SECRET", "XSECRET", "QSECRET", "hunter2", "hunter%32")


def _no_secret(text: str) -> None:
    assert not [s for s in SECRETS if s in text], text


@pytest.mark.parametrize(
    "url, shown",
    [
        ("https://hooks.slack.com/services/T0SECRET/B0SECRET/XSECRET", "https://hooks.slack.com/services/***"),
        ("https://bot:hunter2@hooks.example.com:8443/v1/T0SECRET?QSECRET#x", "https://bot:***@hooks.example.com:8443/v1/***"),
        ("https://hunter2@ntfy.example.com/T0SECRET", "https://***@ntfy.example.com/***"),
        ("https://:hunter2@h.example.com/?token=QSECRET", "https://***@h.example.com/***"),
        ("https://hooks.example.com/olmo/", "https://hooks.example.com/olmo/"),
        ("https://hooks.example.com", "https://hooks.example.com"),
        ("hooks.slack.com/services/T0SECRET/B0SECRET", "hooks.slack.com/services/***"),  # not a URL
    ],
)  # fmt: skip
def test_a_webhook_url_is_masked_to_its_scheme_host_and_first_path_segment(url, shown):
    from olmo_ctl.core.config import mask_url, scrub_url

    assert mask_url(url) == shown
    said = scrub_url(f"cannot POST to {url}: {url.rpartition('/')[2]}", url)  # as an exception may say
    assert said.startswith(f"cannot POST to {shown}: ")
    _no_secret(said)


def test_a_webhook_with_a_password_posts_it_as_basic_auth_never_in_the_url():
    import base64

    from olmo_ctl.supervise.notify import Notifier

    hook = _Hook()
    said: list[str] = []
    url = f"http://bot%40ci:hunter%32%3A%2F@127.0.0.1:{hook.port}/services/T0SECRET/XSECRET?token=QSECRET"
    try:
        Notifier(url, log=said.append, sleep=lambda s: None)({"event": "finished", "text": "run x finished"})
    finally:
        hook.close()
    assert said == []
    assert hook.bodies == [{"event": "finished", "text": "run x finished"}]
    # urllib sends no userinfo itself: the header carries it, percent-decoded; the path is untouched
    basic = "Basic " + base64.b64encode(b"bot@ci:hunter2:/").decode()
    assert hook.seen == [("/services/T0SECRET/XSECRET?token=QSECRET", basic)]


def test_a_failing_webhook_never_shows_its_secret():
    import socket

    from olmo_ctl.supervise.notify import Notifier

    secret_path = "/services/T0SECRET/B0SECRET/XSECRET?token=QSECRET"
    hook = _Hook(status=500)
    said: list[str] = []
    try:  # the server answers 500 three times
        url = f"http://bot:hunter2@127.0.0.1:{hook.port}{secret_path}"
        Notifier(url, log=said.append, sleep=lambda s: None)({"event": "failed"})
    finally:
        hook.close()
    assert len(hook.seen) == 3 and {a for _, a in hook.seen} == {"Basic Ym90Omh1bnRlcjI="}
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    Notifier(f"http://bot:hunter%32@127.0.0.1:{closed}{secret_path}", log=said.append, sleep=lambda s: None)(
        {"event": "failed"}
    )
    # a URL urllib refuses (http.client.InvalidURL quotes it): reported, never raised
    Notifier(f"http://127.0.0.1:notaport{secret_path}", log=said.append, sleep=lambda s: None)(
        {"event": "failed"}
    )
    assert said[:2] == [
        f"notification `failed` to http://bot:***@127.0.0.1:{hook.port}/services/*** failed: "
        "HTTP 500 Internal Server Error",
        f"notification `failed` to http://bot:***@127.0.0.1:{closed}/services/*** failed: "
        "[Errno 111] Connection refused",
    ]
    assert len(said) == 3 and said[2].startswith(
        "notification `failed` to http://127.0.0.1:notaport/services/*** failed: nonnumeric port"
    )
    _no_secret("\n".join(said))


def test_config_show_masks_the_webhook_in_every_output_format(tmp_path):
    url = "https://bot:hunter2@hooks.slack.com/services/T0SECRET/B0SECRET/XSECRET?token=QSECRET"
    shown = "https://bot:***@hooks.slack.com/services/***"
    env = {"OLMO_CTL_NOTIFY_WEBHOOK": url}
    table = cli("config", "show", env=env)
    assert table.returncode == 0, table.stderr
    row = ["notify_webhook", shown, "(env", "OLMO_CTL_NOTIFY_WEBHOOK)"]
    assert row in [ln.split() for ln in table.stdout.splitlines()]
    got = json.loads(cli("config", "show", "-o", "json", env=env).stdout)
    assert got["settings"]["notify_webhook"] == shown
    assert got["sources"]["notify_webhook"] == "env OLMO_CTL_NOTIFY_WEBHOOK"
    yaml_out = cli("config", "show", "-o", "yaml", env=env)
    assert f"notify_webhook: {shown}" in yaml_out.stdout
    for p in (table, yaml_out):
        _no_secret(p.stdout + p.stderr)
    # from the config file too, and a value refused there shows no secret either
    home = tmp_path / "cfg"
    (home / "olmo-ctl").mkdir(parents=True)
    config = home / "olmo-ctl" / "config.yaml"
    config.write_text(f"notify_webhook: {url}\n")
    from_file = cli("config", "show", "-o", "json", env={"XDG_CONFIG_HOME": str(home)})
    assert json.loads(from_file.stdout)["settings"]["notify_webhook"] == shown
    for bad in (url.replace("https", "ftp"), f"[{url}]"):
        config.write_text(f"notify_webhook: {bad}\n")
        refused = cli("config", "show", env={"XDG_CONFIG_HOME": str(home)})
        assert refused.returncode == 2 and "notify_webhook" in refused.stderr
        _no_secret(refused.stdout + refused.stderr)


class _Hook:
    """A real HTTP server on localhost that records each POST (and answers `status`): its body, and
    the path and Authorization header it came with (`seen`)."""

    def __init__(self, status: int = 200):
        import http.server
        import threading

        self.bodies: list[dict] = []
        self.seen: list[tuple[str, str | None]] = []
        hook = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                hook.bodies.append(json.loads(self.rfile.read(n)))
                hook.seen.append((self.path, self.headers.get("Authorization")))
                self.send_response(status)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}/hook"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_finished_run_notifies_the_webhook_and_the_command_and_jsonl_is_one_object_a_line(
    tmp_path, smoke_run
):
    root = tmp_path / "runs"
    run = copy_run(smoke_run, root / "fin")
    r = load_recipe("smoke", overrides=[f"train.max_steps={STEPS}"])
    RunDir(str(run)).create_run(r.to_dict(), r.fingerprint(), "fp", "cpu-1", adopt=True)
    got = tmp_path / "notified.json"
    hook = _Hook()
    try:
        p = cli(
            "resume-until-done", "fin", "--run-root", str(root), "--backend", "local", "-o", "jsonl",
            env={
                "OLMO_CTL_NOTIFY_WEBHOOK": hook.url,
                "OLMO_CTL_NOTIFY_COMMAND": f'cat > {got} && echo "$OLMO_CTL_NOTIFY_EVENT $OLMO_CTL_NOTIFY_RUN" > {got}.env',
            },
        )  # fmt: skip
    finally:
        hook.close()
    assert p.returncode == 0, p.stdout + p.stderr
    objs = [json.loads(ln) for ln in p.stdout.splitlines()]  # every line is one JSON object
    done = [o for o in objs if o["event"] == "done"]
    assert len(done) == 1 and done[0]["committed_step"] == STEPS and done[0]["run"] == "fin"
    assert done[0]["text"].startswith("done: final step 40/40 committed")
    assert {o["event"] for o in objs} >= {"message", "supervisor_started", "done"}
    want_loss = f"{float(scalars(smoke_run)['train/CE loss'][STEPS]):.4f}"
    assert len(hook.bodies) == 1
    msg = hook.bodies[0]
    assert (msg["event"], msg["run"], msg["committed_step"], msg["final_step"]) == ("finished", "fin", 40, 40)
    assert msg["text"].startswith("run fin finished at step 40/40") and want_loss in msg["text"]
    assert json.loads(got.read_text()) == msg  # the command read the same message on its stdin
    assert Path(f"{got}.env").read_text().split() == ["finished", "fin"]


def test_a_failed_run_notifies_and_a_failing_notifier_changes_nothing(tmp_path):
    import io

    from olmo_ctl.supervise.notify import Notifier
    from olmo_ctl.supervise.policy import RetryPolicy
    from olmo_ctl.supervise.supervisor import JsonlPrinter, Supervisor

    rd = new_run(tmp_path, "nan")
    be = LocalBackend(
        str(tmp_path), python=fake_python(tmp_path, 'echo "ValueError: loss is NaN at step 2"\nexit 1')
    )
    hook = _Hook(status=500)
    said: list[str] = []
    out = io.StringIO()
    notifier = Notifier(hook.url, "echo nope >&2; exit 3", log=said.append, sleep=lambda s: None)
    try:
        sup = Supervisor(
            rd, be, RetryPolicy(backoff_base_s=0), device=get_device("cpu-1"), poll_s=0.05,
            printer=JsonlPrinter(rd.name, stream=out), notify=notifier,
        )  # fmt: skip
        rc = sup.run()
    finally:
        hook.close()
    assert rc == 1  # the run's own outcome, whatever the notifier did
    assert len(hook.bodies) == 3  # a 5xx answer is tried three times
    assert {b["event"] for b in hook.bodies} == {"failed"} and hook.bodies[0]["exit_code"] == 1
    assert hook.bodies[0]["text"].startswith("run nan failed at step 0/20: failed-user")
    assert said == [
        f"notification `failed` to http://127.0.0.1:{hook.port}/*** failed: HTTP 500 Internal Server Error",
        "notification command for `failed` exited 3: nope",
    ]
    # -o jsonl: the submission and the failure as their journal records, the log lines as one object
    objs = {o["event"]: o for o in map(json.loads, out.getvalue().splitlines())}
    assert objs["submitted"]["attempt"] == 1 and objs["submitted"]["handle"]["backend"] == "local"
    assert objs["failed"]["exit_code"] == 1 and objs["failed"]["run"] == "nan"
    assert objs["log_lines"]["lines"][-1] == "ValueError: loss is NaN at step 2"


def test_a_notify_webhook_that_is_not_a_url_is_refused_in_one_line(tmp_path):
    p = cli("config", "show", env={"OLMO_CTL_NOTIFY_WEBHOOK": "ftp://hooks.example.com/x"})
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == (
        "error: setting `notify_webhook` (env OLMO_CTL_NOTIFY_WEBHOOK): `ftp://hooks.example.com/***` is not an "
        "http:// or https:// URL; e.g. https://hooks.example.com/olmo\n"
    )
    ok = cli("config", "show", "-o", "json", env={"OLMO_CTL_NOTIFY_COMMAND": "notify-send olmo"})
    assert json.loads(ok.stdout)["settings"]["notify_command"] == "notify-send olmo"
