"""The sandbox runs pods as local processes: the pod's own command and environment plus what GKE's TPU
webhook injects, each TPU VM as host CPU devices; deletion is SIGTERM then SIGKILL after the grace
period; a lost node is SIGKILL; the container's exit code is the pod's. And the Done-when of the
multi-host work: `olmo-ctl sandbox --slices v5p-16=1` + `olmo-ctl smoke --backend gke --device v5p-16`
on a GCS emulator passes every check, the v5p-16 JobSet running as 2 trainer processes x 4 devices;
and of multislice: with `--slices v5p-16=2` and `smoke --slices 2`, 2 x 2 processes in one world."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.waiting import alive

from olmo_ctl.sandbox.kube_server import tiny_jobset
from olmo_ctl.sandbox.pod_processes import ProcessRunner
from olmo_ctl.sandbox.sandbox import Sandbox, parse_exports, start_subprocess, stop_subprocess

ROOT = Path(__file__).resolve().parent.parent


def v5p16_jobset(name: str, script: str, grace_s: int = 5, env: list[dict] | None = None) -> dict:
    """A one-slice v5p-16 JobSet shaped like the rendered one: 2 pods (one per VM) x 4 chips."""
    js = tiny_jobset(name, queue="multislice-queue", workers=2, script=script)
    js["spec"]["network"] = {"enableDNSHostnames": True}
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["terminationGracePeriodSeconds"] = grace_s
    pod["nodeSelector"] = {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "2x2x2",
    }
    c = pod["containers"][0]
    c["resources"] = {"requests": {"google.com/tpu": "4"}, "limits": {"google.com/tpu": "4"}}
    c["env"] = [
        {"name": "JAX_PLATFORMS", "value": "tpu"},
        {"name": "FROM_MANIFEST", "value": "yes"},
        {"name": "MY_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ] + (env or [])
    return js


@pytest.fixture
def box():
    runner = ProcessRunner(poll_s=0.05)
    with Sandbox(slices={"v5p-16": 1}, runner=runner) as sb:
        yield sb, runner


def create(sb, js: dict) -> None:
    from kubernetes import client

    from olmo_ctl.backends.kube import make_api_client

    client.CustomObjectsApi(make_api_client(host=sb.url)).create_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", "default", "jobsets", js
    )


def core(sb):
    from kubernetes import client

    from olmo_ctl.backends.kube import make_api_client

    return client.CoreV1Api(make_api_client(host=sb.url))


def wait_for(cond, timeout_s: float = 30.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def exit_code(pod: dict) -> int | None:
    for cs in pod["status"].get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            return term["exitCode"]
    return None


def pod_log(sb, name: str) -> str:
    return core(sb).read_namespaced_pod_log(name, "default")


def env_script(api: str) -> str:
    """Print the pod's environment and exit with 7 x its worker id. Worker 1 exits only once the cluster
    (the sandbox's API at `api`) has recorded worker 0's success: a Job whose backoffLimit is 0 fails on
    its first failed pod and deletes the rest, so worker 0 must be terminal first. A file worker 0 wrote
    before exiting was not enough: under load worker 1's exit could be recorded first, and the Job then
    deleted worker 0 before its exit was."""
    return (
        "import json, os, sys, time, urllib.request; keys = ['TPU_WORKER_ID', 'TPU_WORKER_HOSTNAMES', "
        "'JAX_PLATFORMS', 'XLA_FLAGS', 'OLMO_CTL_COORDINATOR_ADDRESS', 'FROM_MANIFEST', 'MY_NODE', "
        "'SANDBOX_MARK']; print(json.dumps({k: os.environ.get(k) for k in keys}), flush=True); "
        "i = int(os.environ['TPU_WORKER_ID']); "
        "get = urllib.request.build_opener(urllib.request.ProxyHandler({})).open; "
        f"url = {api + '/api/v1/namespaces/default/pods'!r}; "
        "index = lambda p: (p['metadata'].get('annotations') or {}).get('batch.kubernetes.io/job-completion-index'); "
        "done = lambda: any(index(p) == '0' and p['status'].get('phase') == 'Succeeded' "
        "for p in json.load(get(url))['items']); "
        "[time.sleep(0.05) for _ in range(1200 if i else 0) if not done()]; "
        "sys.exit(i * 7)"
    )


def test_a_pod_runs_its_command_with_the_webhook_env_and_its_exit_code_is_the_pods(box, monkeypatch):
    sb, runner = box
    monkeypatch.setenv("SANDBOX_MARK", "inherited")  # the sandbox's own environment reaches the pods
    create(sb, v5p16_jobset("envs", env_script(sb.url)))
    c = sb.server.cluster
    pods = wait_for(
        lambda: (p := c.pods("envs")) and len(p) == 2 and all(exit_code(x) is not None for x in p) and p,
        timeout_s=90,
        what="both pods to exit",
    )
    assert [exit_code(p) for p in pods] == [0, 7]
    assert [p["status"]["phase"] for p in pods] == ["Succeeded", "Failed"]
    seen = [json.loads(pod_log(sb, p["metadata"]["name"]).splitlines()[0]) for p in pods]
    job = "envs-slice-0"
    for i, env in enumerate(seen):
        assert env["TPU_WORKER_ID"] == str(i)
        assert env["TPU_WORKER_HOSTNAMES"] == f"{job}-0.envs,{job}-1.envs"
        assert env["JAX_PLATFORMS"] == "cpu"  # the emulated VM, whatever the manifest says
        assert env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=4")  # 4 v5p chips, megacore
        assert env["FROM_MANIFEST"] == "yes" and env["SANDBOX_MARK"] == "inherited"
        assert env["MY_NODE"] == pods[i]["spec"]["nodeName"]
    assert seen[0]["OLMO_CTL_COORDINATOR_ADDRESS"] == seen[1]["OLMO_CTL_COORDINATOR_ADDRESS"]
    assert seen[0]["OLMO_CTL_COORDINATOR_ADDRESS"].startswith("127.0.0.1:")
    assert {p["spec"]["nodeName"] for p in pods} == {"gke-v5p-16-np-0-0000", "gke-v5p-16-np-0-0001"}
    # Exit 7 is not a user error of this JobSet (no podFailurePolicy): the upstream rules fail the Job,
    # and with maxRestarts 0 the JobSet.
    js = wait_for(
        lambda: (
            (j := c.jobset("envs"))
            and any(
                x["type"] == "Failed" and x["status"] == "True" for x in j["status"].get("conditions") or []
            )
            and j
        ),
        what="the JobSet to fail",
    )
    assert js["status"]["conditions"]


SIGTERM_SCRIPT = (
    "import os, signal, sys, time\n"
    "def term(*_):\n"
    "    open(os.environ['MARK'], 'a').write('got SIGTERM\\n')\n"
    "    if os.environ['MODE'] == 'exit': sys.exit(143)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "print('pid', os.getpid(), flush=True)\n"
    "while True: time.sleep(0.05)\n"
)


@pytest.mark.parametrize("mode, code", [("hang", 137), ("exit", 143)])
def test_deleting_a_pod_is_sigterm_then_sigkill_after_its_grace_period(box, mode, code, tmp_path):
    sb, runner = box
    mark = tmp_path / "mark"
    create(
        sb,
        v5p16_jobset(
            "term",
            SIGTERM_SCRIPT,
            grace_s=3,
            env=[{"name": "MODE", "value": mode}, {"name": "MARK", "value": str(mark)}],
        ),
    )
    c = sb.server.cluster
    name = wait_for(
        lambda: (
            (p := c.pods("term"))
            and "pid" in pod_log(sb, p[0]["metadata"]["name"])
            and p[0]["metadata"]["name"]
        ),
        what="pod 0 to start",
    )
    pid = runner.pid("default", name)
    assert pid and alive(pid)
    t0 = time.monotonic()
    core(sb).delete_namespaced_pod(name, "default")  # its own grace period: 3 s
    wait_for(lambda: mark.exists() and "got SIGTERM" in mark.read_text(), 10, "SIGTERM to reach the process")
    assert time.monotonic() - t0 < 2.0
    wait_for(lambda: not alive(pid), 15, "the process to end")
    took = time.monotonic() - t0
    if mode == "hang":
        assert 2.0 <= took < 6.0, took  # killed at the grace period's end (timestamps have 1 s resolution)
    else:
        assert took < 2.0, took
    wait_for(lambda: all(p["metadata"]["name"] != name for p in c.pods("term")), 10, "the pod to go")
    assert any(e["involvedObject"]["name"] == name and e["reason"] == "Killing" for e in c.events())
    wait_for(lambda: f"pod {name}: pid {pid} exited {code}" in runner.lines, 5, f"exit {code} to be reported")


def test_a_lost_node_kills_the_process(box):
    sb, runner = box
    create(
        sb,
        v5p16_jobset(
            "lost",
            SIGTERM_SCRIPT,
            grace_s=30,
            env=[{"name": "MODE", "value": "hang"}, {"name": "MARK", "value": "/dev/null"}],
        ),
    )
    c = sb.server.cluster
    name = wait_for(
        lambda: (
            (p := c.pods("lost"))
            and "pid" in pod_log(sb, p[1]["metadata"]["name"])
            and p[1]["metadata"]["name"]
        ),
        what="pod 1 to start",
    )
    pid = runner.pid("default", name)
    t0 = time.monotonic()
    assert c.node_lost("lost", 1) == name
    wait_for(lambda: not alive(pid), 5, "the process to be killed")
    assert time.monotonic() - t0 < 2.0  # SIGKILL, no grace period


def test_a_command_that_cannot_start_fails_the_pod_with_128(box):
    sb, _runner = box
    js = v5p16_jobset("nostart", "")
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["command"] = [
        "/nonexistent/trainer"
    ]
    create(sb, js)
    pods = wait_for(
        lambda: (p := sb.server.cluster.pods("nostart")) and all(exit_code(x) is not None for x in p) and p,
        10,
        "the pods to fail",
    )
    term = pods[0]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (term["exitCode"], term["reason"]) == (128, "StartError")
    assert "/nonexistent/trainer" in term["message"]  # FallbackToLogsOnError: the line is the message


def test_the_sandbox_command_runs_pods_as_processes(tmp_path):
    kc = tmp_path / "kubeconfig"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = start_subprocess(kc, "--slices", "v5p-16=1", env=env)
    try:
        from kubernetes import client

        from olmo_ctl.backends.kube import make_api_client

        api = make_api_client(kubeconfig=str(kc))
        client.CustomObjectsApi(api).create_namespaced_custom_object(
            "jobset.x-k8s.io",
            "v1alpha2",
            "default",
            "jobsets",
            v5p16_jobset("cli", "print('hello from', __import__('os').environ['TPU_WORKER_ID'])"),
        )
        v1 = client.CoreV1Api(api)

        def done():
            pods = v1.list_namespaced_pod(
                "default", label_selector="jobset.sigs.k8s.io/jobset-name=cli"
            ).items
            return len(pods) == 2 and all(x.status.phase == "Succeeded" for x in pods) and pods

        pods = wait_for(done, 30, "both pods to succeed")
        logs = sorted(v1.read_namespaced_pod_log(x.metadata.name, "default") for x in pods)
        assert logs == ["hello from 0\n", "hello from 1\n"]
    finally:
        rc, err = stop_subprocess(p)
    assert rc == 0, err
    assert "pods run as local processes" in err and "exited 0" in err


# ---------------------------------------------------------------- a JobSet this machine cannot hold


def golden(name: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / "tests" / "goldens" / name).read_text())


def test_a_jobset_whose_model_cannot_fit_this_machine_is_refused_when_created():
    """`submit --stage 1 --device tpu7x-128 --dry-run -o yaml | kubectl apply` would start 16 7B trainers
    here: the sandbox refuses the JobSet at creation, naming the model, the need, and what to use."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from olmo_ctl.backends.kube import make_api_client

    runner = ProcessRunner(poll_s=0.05, memory_bytes=64 * 1024**3)
    js = golden("tpu7x-128-stage1.yaml")  # the rendered manifest, as `submit --dry-run` prints it
    with Sandbox(namespace="olmo", queue="tpu-queue", slices={"tpu7x-128": 1}, runner=runner) as sb:
        api = client.CustomObjectsApi(make_api_client(host=sb.url))
        with pytest.raises(ApiException) as e:
            api.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", "olmo", "jobsets", js)
        assert e.value.status == 400
        msg = json.loads(e.value.body)["message"]
        assert msg.startswith('admission webhook "pods-as-processes.sandbox.olmo-ctl" denied the request: ')
        assert "JobSet olmo3-7b-stage1-a1 trains olmo3-7b-stage1 (model olmo3-7b, 7.3 B parameters)" in msg
        assert "as 16 trainer processes on this machine: they need at least " in msg
        assert "and it has 64 GiB" in msg
        assert "--recipe smoke" in msg and "--no-run-pods" in msg
        assert sb.server.cluster.jobset("olmo3-7b-stage1-a1") is None
        assert not sb.world.items("Pod", None)
        assert not runner.procs


def test_the_fit_rule_counts_the_model_its_copies_per_slice_a_micro_batch_and_the_processes():
    from olmo_ctl.core.batching import STATE_BYTES_PER_PARAM, activation_bytes_per_instance, param_count
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.sandbox.pod_processes import GIB, refuse_unfit, trainer_need

    r = load_recipe("olmo3-7b-stage1")
    one, two = golden("tpu7x-128-stage1.yaml"), golden("2xtpu7x-128-stage1.yaml")
    n1, n2 = trainer_need(one), trainer_need(two)
    assert n1 is not None and n2 is not None
    assert (n1.processes, n2.processes) == (16, 32)  # a tpu7x-128 slice is 16 VMs
    assert n1.params == param_count(r.model) and n2.state_bytes == 2 * n1.state_bytes
    assert n1.state_bytes == n1.params * STATE_BYTES_PER_PARAM
    # the plan annotation's micro-batch: global_batch / grad_accum instances in flight
    assert n1.activation_bytes == 512 * activation_bytes_per_instance(r.model, r.train.seq_len)
    assert n1.bytes == n1.state_bytes + n1.activation_bytes + 16 * GIB
    assert refuse_unfit(one, n1.bytes) is None and refuse_unfit(one, n1.bytes - 1) is not None
    smoke = golden("tpu7x-128-smoke.yaml")
    assert refuse_unfit(smoke, 20 * GIB) is None  # the smoke model fits a laptop
    assert trainer_need(v5p16_jobset("other", "print(1)")) is None  # not olmo-ctl's trainer: not judged


# ---------------------------------------------------------------- GKE mode on one machine


_exports = parse_exports  # test_image.py imports it from here


def _gone(pid: int, timeout_s: float = 30.0) -> None:
    wait_for(lambda: not alive(pid), timeout_s, f"pid {pid} to exit")


def _clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    env.update(PYTHONPATH=str(ROOT), XDG_CONFIG_HOME=str(tmp_path / "config"))
    for k in ("KUBECONFIG", "STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"):
        env.pop(k, None)
    return env


@pytest.mark.gcs
def test_a_detached_sandbox_prints_the_environment_of_gke_mode_and_doctor_passes_with_it(tmp_path):
    import urllib.request

    from helpers.cli import invoke

    kc = tmp_path / "sb.kubeconfig"
    env = _clean_env(tmp_path)
    p = subprocess.run(
        [sys.executable, "-m", "olmo_ctl", "sandbox", "--kubeconfig", str(kc), "--slices", "v5p-8=1"]
        + ["--gcs-bucket", "bkt", "--no-run-pods", "--detach"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    ex = _exports(p.stdout)
    pid = int(ex["OLMO_CTL_SANDBOX_PID"])
    try:
        assert ex["KUBECONFIG"] == str(kc.resolve()) and kc.exists()
        assert ex["OLMO_CTL_BACKEND"] == "gke" and ex["OLMO_CTL_RUN_ROOT"] == "gs://bkt/runs"
        assert ex["OLMO_CTL_IMAGE"] == "localhost/olmo-ctl:0.1.0"
        assert ex["STORAGE_EMULATOR_HOST"] == ex["TENSORSTORE_GCS_HTTP_URL"]
        with urllib.request.urlopen(f"{ex['STORAGE_EMULATOR_HOST']}/storage/v1/b/bkt", timeout=5) as r:
            assert json.loads(r.read())["name"] == "bkt"  # the bucket exists on the sandbox's emulator
        assert (tmp_path / "sb.kubeconfig.env").read_text() in p.stdout  # `. FILE` in another shell
        d = invoke("doctor", "--device", "v5p-8", "-o", "json", env={**env, **ex})
        assert d.returncode == 0, d.stdout + d.stderr
        checks = {c["name"]: c for c in json.loads(d.stdout)["checks"]}
        assert checks["image"]["ok"] and not checks["image"]["message"].startswith("warning")
    finally:
        os.kill(pid, signal.SIGTERM)
        _gone(pid)
    assert not kc.exists() and not (tmp_path / "sb.kubeconfig.env").exists()
    assert "sandbox stopped" in (tmp_path / "sb.kubeconfig.log").read_text()


def test_a_bad_bucket_name_is_one_line_exit_2_and_nothing_written(tmp_path):
    from helpers.cli import invoke

    kc = tmp_path / "k"
    r = invoke("sandbox", "--kubeconfig", str(kc), "--gcs-bucket", "No_Such!", "--detach")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: --gcs-bucket `No_Such!` is not a bucket name")
    assert list(tmp_path.iterdir()) == []


def doc_commands() -> list[str]:
    """The lines docs/sandbox-and-doctor.md shows under its `gke-mode-on-one-machine` marker."""
    text = (ROOT / "docs" / "sandbox-and-doctor.md").read_text().splitlines()
    i = next(n for n, ln in enumerate(text) if "gke-mode-on-one-machine" in ln)
    assert text[i + 1].startswith("```")
    end = next(n for n in range(i + 2, len(text)) if text[n].startswith("```"))
    return [ln for ln in text[i + 2 : end] if ln.strip()]


@pytest.mark.chaos
@pytest.mark.gcs
def test_gke_mode_on_one_machine_is_the_three_commands_the_docs_show(tmp_path):
    """The Done-when of GKE mode on one machine: the doc's lines, as they stand, in a shell, from an empty
    directory: the sandbox with a v5p-16 slice and a GCS emulator bucket, doctor, and `smoke --backend
    gke --device v5p-16`, whose attempts each run as 2 trainer processes of 4 CPU devices joined by
    jax.distributed. Every doctor and every smoke check passes."""
    lines = doc_commands()
    assert len(lines) <= 3 and "--detach" in lines[0], lines
    bin_dir = tmp_path / "bin"  # `olmo-ctl` on the PATH, as `pip install -e .` puts it there
    bin_dir.mkdir()
    shim = bin_dir / "olmo-ctl"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m olmo_ctl "$@"\n')
    shim.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = _clean_env(tmp_path)
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    script = "set -e\n" + "\n".join(lines) + '\necho "sandbox pid: $OLMO_CTL_SANDBOX_PID"\n'
    p = subprocess.run(
        ["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=1200
    )
    pid = next((int(ln.split()[-1]) for ln in p.stdout.splitlines() if ln.startswith("sandbox pid: ")), None)
    ex = _exports((work / "sandbox.kubeconfig.env").read_text()) if pid else {}
    log = (work / "sandbox.kubeconfig.log").read_text() if (work / "sandbox.kubeconfig.log").exists() else ""
    try:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:] + "\n--- sandbox ---\n" + log[-4000:]
        assert pid is not None
        assert "FAIL" not in p.stdout  # doctor: every check passed
        assert "all 5 checks passed" in p.stderr
        # Each attempt ran as 2 pods (2 TPU VMs), each a trainer process of 4 devices that joined the other.
        starts = [ln for ln in log.splitlines() if "olmo_ctl.trainer" in ln and ": pid " in ln]
        assert len(starts) == 6, "\n".join(starts)  # attempt 1, attempt 2 and the twin, 2 pods each
        assert all("--device v5p-16" in ln for ln in starts)
        # Process 0 wrote every host's timings in the emulator's bucket: two hosts joined in each run.
        from olmo_ctl import storage
        from olmo_ctl.observe.reader import read_scalars
        from olmo_ctl.sandbox.gcs_emulator import use_emulator

        with use_emulator(ex["STORAGE_EMULATOR_HOST"]):
            _, dirs = storage.store_for("gs://sandbox/runs").list("gs://sandbox/runs")
            runs = sorted(d.rstrip("/").rsplit("/", 1)[1] for d in dirs)
            assert len(runs) == 2 and runs[1] == runs[0] + "-twin", runs
            for run in runs:
                tags = read_scalars(f"gs://sandbox/runs/{run}/tensorboard").tags()
                assert {"hosts/0/step_time_s", "hosts/1/step_time_s"} <= set(tags)
                assert "hosts/2/step_time_s" not in tags
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            _gone(pid)
    assert not (work / "sandbox.kubeconfig").exists()


@pytest.mark.chaos
@pytest.mark.gcs
def test_smoke_on_two_slices_runs_each_attempt_as_one_world_of_four_hosts(tmp_path):
    """The Done-when of multislice: `olmo-ctl smoke --backend gke --device v5p-16 --slices 2` against
    `olmo-ctl sandbox --slices v5p-16=2` and a GCS emulator bucket passes every check. Each attempt's
    JobSet is 2 slices x 2 pods; the webhook gives every pod MEGASCALE_NUM_SLICES / MEGASCALE_SLICE_ID,
    and the 4 trainer processes (4 CPU devices each) join one jax.distributed world. The smoke batch of
    8 over 16 devices shards each sequence 2 ways, within one host."""
    from helpers.cli import invoke

    kc = tmp_path / "sb.kubeconfig"
    env = _clean_env(tmp_path)
    p = subprocess.run(
        [sys.executable, "-m", "olmo_ctl", "sandbox", "--kubeconfig", str(kc), "--slices", "v5p-16=2"]
        + ["--gcs-bucket", "sandbox", "--detach"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    ex = _exports(p.stdout)
    pid = int(ex["OLMO_CTL_SANDBOX_PID"])
    log_file = tmp_path / "sb.kubeconfig.log"
    try:
        r = invoke(
            "smoke",
            "--backend",
            "gke",
            "--device",
            "v5p-16",
            "--slices",
            "2",
            "--timeout",
            "1500",
            "-o",
            "json",
            env={**env, **ex},
        )
        log = log_file.read_text() if log_file.exists() else ""
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:] + "\n--- sandbox ---\n" + log[-4000:]
        report = json.loads(r.stdout)
        assert [c["passed"] for c in report["checks"]] == [True] * 5
        assert report["facts"]["slices"] == 2 and report["facts"]["seq_shards"] == 2
        assert "smoke on 2 x v5p-16 (gke): all 5 checks passed" in r.stderr
        # Attempt 1, attempt 2 and the twin, each on both slices' nodes, 2 pods per slice.
        starts = [ln for ln in log.splitlines() if "olmo_ctl.trainer" in ln and ": pid " in ln]
        assert len(starts) == 12, "\n".join(starts)
        assert all("--device v5p-16" in ln and "--slices 2" in ln for ln in starts)
        nodes = {ln.split(" on ", 1)[1].split(":", 1)[0] for ln in starts}
        assert nodes == {f"gke-v5p-16-np-{s}-000{v}" for s in (0, 1) for v in (0, 1)}
        # Process 0 wrote every host's timings in the emulator's bucket: four hosts joined in each run.
        from olmo_ctl.observe.reader import read_scalars
        from olmo_ctl.sandbox.gcs_emulator import use_emulator

        with use_emulator(ex["STORAGE_EMULATOR_HOST"]):
            for run_dir in report["run_dirs"]:
                tags = set(read_scalars(f"{run_dir}/tensorboard").tags())
                assert {f"hosts/{h}/step_time_s" for h in range(4)} <= tags, run_dir
                assert "hosts/4/step_time_s" not in tags
    finally:
        os.kill(pid, signal.SIGTERM)
        _gone(pid)
    assert not kc.exists()


def test_the_trainer_joins_an_emulated_slice_from_the_webhook_variables(monkeypatch):
    """JAX_PLATFORMS=cpu and a TPU device: process id and count from TPU_WORKER_ID / TPU_WORKER_HOSTNAMES
    and, for several slices, MEGASCALE_NUM_SLICES / MEGASCALE_SLICE_ID; the coordinator from the
    sandbox; anything missing or inconsistent with --slices is exit 3."""
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.trainer import multihost

    dev = get_device("v5p-16")
    for k in (
        "TPU_WORKER_ID",
        "TPU_WORKER_HOSTNAMES",
        "OLMO_CTL_COORDINATOR_ADDRESS",
        "MEGASCALE_NUM_SLICES",
        "MEGASCALE_SLICE_ID",
        "MEGASCALE_COORDINATOR_ADDRESS",
    ):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert multihost.emulated_slice()
    with pytest.raises(multihost.JoinFailed) as e:
        multihost._emulated_slice_params(dev)
    assert (
        e.value.exit_code == 3
        and "TPU_WORKER_ID, TPU_WORKER_HOSTNAMES, OLMO_CTL_COORDINATOR_ADDRESS" in str(e.value)
    )
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "j-slice-0-0.j,j-slice-0-1.j")
    monkeypatch.setenv("OLMO_CTL_COORDINATOR_ADDRESS", "127.0.0.1:4000")
    assert multihost._emulated_slice_params(dev) == {
        "coordinator_address": "127.0.0.1:4000",
        "num_processes": 2,
        "process_id": 1,
    }
    # Two slices: one world of 4 processes, numbered slice by slice as JAX numbers them on GKE.
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "1")
    monkeypatch.setenv("MEGASCALE_COORDINATOR_ADDRESS", "j-slice-0-0.j")
    assert multihost._emulated_slice_params(dev, slices=2) == {
        "coordinator_address": "127.0.0.1:4000",  # the sandbox's, one for every slice of the JobSet
        "num_processes": 4,
        "process_id": 3,
    }
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "0")
    assert multihost._emulated_slice_params(dev, slices=2)["process_id"] == 1
    # --slices that is not the JobSet's slice count, or a pod outside it: exit 3, naming the variable
    with pytest.raises(multihost.JoinFailed, match="v5p-16 is 1 slice but MEGASCALE_NUM_SLICES=2"):
        multihost._emulated_slice_params(dev)
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "2")
    with pytest.raises(multihost.JoinFailed, match="MEGASCALE_SLICE_ID=2 is outside 2 x v5p-16"):
        multihost._emulated_slice_params(dev, slices=2)
    monkeypatch.delenv("MEGASCALE_SLICE_ID")
    with pytest.raises(multihost.JoinFailed, match="MEGASCALE_SLICE_ID is not set"):
        multihost._emulated_slice_params(dev, slices=2)
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "1")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "j-slice-1-0.j")
    with pytest.raises(
        multihost.JoinFailed, match="has 2 hosts but TPU_WORKER_HOSTNAMES names 1 in each of 2 slices"
    ):
        multihost._emulated_slice_params(dev, slices=2)
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert not multihost.emulated_slice()  # a real TPU: JAX detects the slice itself


def test_a_spot_reclaim_gives_the_pods_gkes_15_s_then_sigkill(box, tmp_path):
    """GKE's graceful node shutdown on a spot VM: SIGTERM at the notice, SIGKILL when the 15 s the
    kubelet leaves non-system pods are over, whatever the pod's grace period (here 300 s)."""
    from olmo_ctl.sandbox.cluster.nodes import SPOT_POD_SHUTDOWN_S

    sb, runner = box
    mark = tmp_path / "mark"
    create(
        sb,
        v5p16_jobset(
            "spot",
            SIGTERM_SCRIPT,
            grace_s=300,
            env=[{"name": "MODE", "value": "hang"}, {"name": "MARK", "value": str(mark)}],
        ),
    )
    c = sb.server.cluster
    name = wait_for(
        lambda: (
            (p := c.pods("spot"))
            and "pid" in pod_log(sb, p[0]["metadata"]["name"])
            and p[0]["metadata"]["name"]
        ),
        what="pod 0 to start",
    )
    pid = runner.pid("default", name)
    node = next(p for p in c.pods("spot") if p["metadata"]["name"] == name)["spec"]["nodeName"]
    with sb.world.store.lock:
        sb.world.nodes.spot_reclaim([node], 3600)
        sb.world.reconcile()
    wait_for(lambda: mark.exists() and "got SIGTERM" in mark.read_text(), 10, "SIGTERM to reach the process")
    assert alive(pid)
    sb.world.advance(SPOT_POD_SHUTDOWN_S - 1)
    assert alive(pid)  # still within the shutdown
    sb.world.advance(1.5)
    wait_for(lambda: not alive(pid), 5, "the process to be killed")
    assert any("the node's graceful shutdown ended" in ln for ln in runner.lines)
