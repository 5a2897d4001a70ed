"""`olmo-ctl smoke`: the smoke recipe run for real on the local backend (trainer processes, Orbax
checkpoints, TensorBoard files), its JUnit XML, its exit codes, and faults it must catch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from olmo_ctl.supervise.smoke import CHECKS, CheckResult, SmokeReport, junit_xml

REPO = Path(__file__).resolve().parent.parent


def _smoke(tmp_path: Path, *args: str, fault: str | None = None, timeout: int = 400):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")  # no site config file leaks in
    if fault:
        env["OLMO_CTL_SMOKE_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "olmo_ctl", "smoke", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
    )


def _cases(path: Path) -> dict[str, ET.Element]:
    suite = ET.parse(path).getroot()
    assert suite.tag == "testsuite"
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert list(cases) == list(CHECKS)
    assert int(suite.get("tests")) == len(CHECKS)
    return cases


def _failed(case: ET.Element) -> bool:
    return case.find("failure") is not None or case.find("error") is not None


def test_smoke_local_passes_and_writes_one_junit_case_per_check(tmp_path):
    junit = tmp_path / "smoke.xml"
    root = tmp_path / "runs"
    p = _smoke(
        tmp_path,
        "--backend",
        "local",
        "--device",
        "cpu-1",
        "--junit",
        str(junit),
        "-o",
        "json",
        "--run-root",
        str(root),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    cases = _cases(junit)
    assert not [n for n, c in cases.items() if _failed(c)]
    report = json.loads(p.stdout)
    facts = report["facts"]
    assert report["exit_code"] == 0 and report["failed"] == []
    assert facts["global_batch"] == 8 and facts["tokens_per_step"] == 8 * 128
    n, f = facts["stopped_at_step"], facts["final_step"]
    assert 5 <= n < f == n + 6
    for line in (
        "PASS loss_fell",
        "PASS checkpoint_committed",
        "PASS forced_stop",
        "PASS resume_exact",
        "PASS events_readable",
        "all 5 checks passed",
    ):
        assert line in p.stderr
    # The run directories hold what the report claims: the forced-stop and final checkpoints, and a
    # journal whose attempt 1 was preempted and attempt 2 succeeded.
    main = Path(report["run_dirs"][0])
    steps = sorted(int(d.name) for d in (main / "checkpoints").iterdir() if d.name.isdigit())
    assert steps == [n, f]
    journal = [json.loads(ln) for ln in (main / "journal.jsonl").read_text().splitlines()]
    ends = [(r["event"], r["attempt"]) for r in journal if r["event"] in ("preempted", "succeeded", "failed")]
    assert ends == [("preempted", 1), ("succeeded", 2)]


@pytest.mark.chaos
def test_broken_trainer_and_inexact_resume_fail_the_named_checks(tmp_path):
    """A learning rate of 1e-9 (the loss cannot fall) and a resume one batch off: exit 1 naming both."""
    junit = tmp_path / "smoke.xml"
    p = _smoke(
        tmp_path, "--backend", "local", "--device", "cpu-1", "--junit", str(junit), fault="lr,data-shift"
    )
    assert p.returncode == 1, p.stderr[-3000:]
    assert "FAIL loss_fell" in p.stderr and "FAIL resume_exact" in p.stderr
    assert "FAILED loss_fell, resume_exact" in p.stderr
    cases = _cases(junit)
    assert {n for n, c in cases.items() if _failed(c)} == {"loss_fell", "resume_exact"}
    assert "fell less than 5%" in cases["loss_fell"].find("failure").get("message")
    assert "first difference after the resume" in cases["resume_exact"].find("failure").get("message")


def test_timeout_exits_124_and_leaves_no_trainer_running(tmp_path):
    junit = tmp_path / "smoke.xml"
    root = tmp_path / "runs"
    p = _smoke(
        tmp_path,
        "--backend",
        "local",
        "--device",
        "cpu-1",
        "--timeout",
        "1",
        "--junit",
        str(junit),
        "--run-root",
        str(root),
        timeout=120,
    )
    assert p.returncode == 124, p.stderr[-3000:]
    assert "TIMED OUT" in p.stderr
    cases = _cases(junit)
    assert all(c.find("error") is not None for c in cases.values())
    attempt_files = list(root.glob("*/attempts/*.json"))
    assert attempt_files
    for af in attempt_files:
        pid = json.loads(af.read_text())["pid"]
        assert (
            not Path(f"/proc/{pid}").exists()
            or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]
        )


@pytest.mark.parametrize(
    "args, text",
    [
        (("--backend", "local", "--device", "cpu-3"), "cannot be split exactly over the 3 devices"),
        (("--backend", "local", "--device", "v5p-8"), "is a TPU slice"),
        (("--backend", "gke", "--device", "cpu-1"), "is a local device"),
        (("--backend", "local", "--device", "cpu-2x2", "--slices", "2"), "multislice joins TPU slices"),
        (("--backend", "gke", "--device", "v5p-8", "--slices", "2"), "is a single-host slice"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, args, text):
    p = _smoke(tmp_path, *args, timeout=60)
    assert p.returncode == 2, p.stderr
    assert text in p.stderr and "Traceback" not in p.stderr
    assert p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1


def test_junit_marks_failures_and_timeouts():
    rep = SmokeReport(
        "cpu-1", "local", ["/r"], [CheckResult(c, c != "resume_exact", f"msg {c}") for c in CHECKS]
    )
    suite = ET.fromstring(junit_xml(rep).split("\n", 1)[1])
    assert suite.get("failures") == "1" and suite.get("errors") == "0"
    bad = [c for c in suite.findall("testcase") if c.find("failure") is not None]
    assert [c.get("name") for c in bad] == ["resume_exact"]
    assert bad[0].find("failure").get("message") == "msg resume_exact"
    rep = SmokeReport(
        "cpu-1",
        "local",
        ["/r"],
        [CheckResult(c, False, "timed out after 3 s") for c in CHECKS],
        timed_out=True,
    )
    suite = ET.fromstring(junit_xml(rep).split("\n", 1)[1])
    assert suite.get("errors") == str(len(CHECKS)) and suite.get("failures") == "0"
    assert rep.exit_code == 124


# ---------------------------------------------------------------- the GKE path, end to end


class _Kubelet:
    """Plays the node for the test cluster: each admitted JobSet's pod runs its container command (the
    real trainer, on CPU devices standing in for the slice's chips), its output becomes the pod log,
    its exit ends the pod; deleting the JobSet sends SIGTERM and lets the deletion finish on exit."""

    def __init__(self, srv, chips: int):
        self.srv, self.chips = srv, chips
        self.procs: dict = {}
        self.stop = threading.Event()
        srv.cluster.hold_deletions = True
        srv.cluster.on_create(
            lambda name: threading.Thread(target=self._run, args=(name,), daemon=True).start()
        )
        threading.Thread(target=self._watch_deletions, daemon=True).start()

    def _run(self, name: str) -> None:
        c = self.srv.cluster
        c.admit(name)
        c.run_pods(name)
        pod = c.jobset(name)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        cmd = [sys.executable if a == "python" else a for a in pod["containers"][0]["command"]]
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            PYTHONUNBUFFERED="1",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={self.chips}",
        )
        p = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO
        )
        self.procs[name] = p
        for line in p.stdout:
            c.log(name, 0, [line.rstrip("\n")])
        code = p.wait()
        if c.jobset(name) and c.jobset(name)["metadata"].get("deletionTimestamp"):
            c.finish_deletions()  # the pods have used their grace period: the JobSet goes
        elif code == 0:
            c.complete(name)
        else:
            c.pod_exit(name, 0, code)

    def _watch_deletions(self) -> None:
        signalled = set()
        while not self.stop.is_set():
            for name, p in list(self.procs.items()):
                js = self.srv.cluster.jobset(name)
                if (
                    name not in signalled
                    and js
                    and js["metadata"].get("deletionTimestamp")
                    and p.poll() is None
                ):
                    p.send_signal(signal.SIGTERM)
                    signalled.add(name)
            time.sleep(0.1)

    def close(self) -> None:
        self.stop.set()
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.chaos
@pytest.mark.gcs
def test_gke_smoke_on_v5p_8_against_the_test_cluster_and_gcs(tmp_path, srv, gcs, monkeypatch):
    """The GKE path as the TPU workflow runs it: JobSets through the Kubernetes API, progress from the pod
    log, the stop by JobSet deletion (the trainer gets SIGTERM), checkpoints and events on gs://; a wait
    says what it waits for (every PROGRESS_S, made short here)."""
    from olmo_ctl.backends.gke import GKEBackend
    from olmo_ctl.backends.kube import KubeRetryPolicy
    from olmo_ctl.core.config import Settings
    from olmo_ctl.core.devices import Target
    from olmo_ctl.supervise import smoke
    from olmo_ctl.supervise.smoke import SmokeConfig, run_smoke

    bucket = gcs.bucket
    kubelet = _Kubelet(srv, chips=4)
    try:
        root = f"gs://{bucket}/smoke"
        settings = Settings(image="img:1", run_root=root, queue="tpu-queue")
        fast = KubeRetryPolicy(
            base_s=0.01, max_s=0.05, budget_s=5.0, connect_timeout_s=1.0, read_timeout_s=5.0
        )
        be = GKEBackend(host=srv.url, settings=settings, retry=fast)
        monkeypatch.setattr(smoke, "PROGRESS_S", 0.5)
        said: list[str] = []
        report = run_smoke(
            be, root, SmokeConfig(Target.parse("v5p-8"), poll_s=0.2), timeout_s=400, log=said.append
        )
    finally:
        kubelet.close()
    print("\n".join(said))
    assert any(": waiting for step " in line and line.endswith(" s)") for line in said), said
    print("\n".join(report.summary_lines()))
    assert report.exit_code == 0, report.summary_lines()
    assert report.facts["per_device_batch"] == 2 and report.facts["global_batch"] == 8
    assert [(n, p) for k, n, p in srv.cluster.deleted if k == "JobSet"] == [
        (report.run_dirs[0].rsplit("/", 1)[1] + "-a1", "Foreground")
    ]  # only the forced stop deleted
