"""The sandbox runs pods as local processes: the pod's own command and environment plus what GKE's TPU
webhook injects, each TPU VM as host CPU devices; deletion is SIGTERM then SIGKILL after the grace
period; a lost node is SIGKILL; the container's exit code is the pod's. And the Done-when of the
multi-host work: `olmo-ctl sandbox --slices v5p-16=1` + `olmo-ctl smoke --backend gke --device v5p-16`
on a GCS emulator passes every check, the v5p-16 JobSet running as 2 trainer processes x 4 devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from olmo_ctl.testing.kube_server import tiny_jobset
from olmo_ctl.testing.pod_processes import ProcessRunner
from olmo_ctl.testing.sandbox import Sandbox, start_subprocess, stop_subprocess

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "us-docker.pkg.dev/p/r/olmo-ctl:0.1.0"


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


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


ENV_SCRIPT = (
    "import json, os, sys; keys = ['TPU_WORKER_ID', 'TPU_WORKER_HOSTNAMES', 'JAX_PLATFORMS', 'XLA_FLAGS', "
    "'OLMO_CTL_COORDINATOR_ADDRESS', 'FROM_MANIFEST', 'MY_NODE', 'SANDBOX_MARK']; "
    "print(json.dumps({k: os.environ.get(k) for k in keys})); "
    "sys.exit(int(os.environ['TPU_WORKER_ID']) * 7)"
)


def test_a_pod_runs_its_command_with_the_webhook_env_and_its_exit_code_is_the_pods(box, monkeypatch):
    sb, runner = box
    monkeypatch.setenv("SANDBOX_MARK", "inherited")  # the sandbox's own environment reaches the pods
    create(sb, v5p16_jobset("envs", ENV_SCRIPT))
    c = sb.server.cluster
    pods = wait_for(
        lambda: (p := c.pods("envs")) and all(exit_code(x) is not None for x in p) and p,
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


# ---------------------------------------------------------------- the Done-when, end to end


@pytest.mark.chaos
@pytest.mark.gcs
def test_gke_smoke_on_v5p_16_passes_against_the_sandbox_and_a_gcs_emulator(tmp_path, gcs):
    """`olmo-ctl sandbox --kubeconfig K --slices v5p-16=1 &` then `KUBECONFIG=K olmo-ctl smoke --backend gke
    --device v5p-16 --run-root gs://...`: the rendered JobSet, the upstream controller rules, two trainer
    processes of 4 CPU devices per attempt joined by jax.distributed, checkpoints and events on the
    emulator. Every check passes."""
    kc = tmp_path / "kubeconfig"
    base = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    base.update(PYTHONPATH=str(ROOT), XDG_CONFIG_HOME=str(tmp_path / "config"))
    box = start_subprocess(kc, "--slices", "v5p-16=1", env=base)
    try:
        junit = tmp_path / "smoke.xml"
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "olmo_ctl",
                "smoke",
                "--backend",
                "gke",
                "--device",
                "v5p-16",
                "--run-root",
                f"gs://{gcs.bucket}/smoke",
                "--junit",
                str(junit),
                "--json",
                "--timeout",
                "900",
            ],
            env={**base, "KUBECONFIG": str(kc), "OLMO_CTL_IMAGE": IMAGE},
            capture_output=True,
            text=True,
            timeout=960,
        )
    finally:
        rc, err = stop_subprocess(box)
    assert rc == 0, err[-3000:]
    assert p.returncode == 0, p.stderr[-4000:] + "\n--- sandbox ---\n" + err[-4000:]
    report = json.loads(p.stdout)
    assert report["failed"] == [] and [c["name"] for c in report["checks"]] == [
        "loss_fell",
        "checkpoint_committed",
        "forced_stop",
        "resume_exact",
        "events_readable",
    ]
    assert report["facts"]["per_device_batch"] == 1 and report["facts"]["global_batch"] == 8  # 8 devices
    assert "all 5 checks passed" in p.stderr
    # Each attempt ran as 2 pods (2 TPU VMs), each a trainer process of 4 devices that joined the other.
    starts = [ln for ln in err.splitlines() if "olmo_ctl.trainer" in ln and ": pid " in ln]
    assert len(starts) == 6, "\n".join(starts)  # attempt 1, attempt 2 and the twin, 2 pods each
    assert all("--device v5p-16" in ln for ln in starts)
    # Process 0 wrote every host's timings: two hosts joined in each run.
    from olmo_ctl.observe.reader import read_scalars

    for run_dir in report["run_dirs"]:
        tags = read_scalars(f"{run_dir}/tensorboard").tags()
        assert {"hosts/0/step_time_s", "hosts/1/step_time_s"} <= set(
            tags
        ) and "hosts/2/step_time_s" not in tags


def test_the_trainer_joins_an_emulated_slice_from_the_webhook_variables(monkeypatch):
    """JAX_PLATFORMS=cpu and a TPU device: process id and count from TPU_WORKER_ID / TPU_WORKER_HOSTNAMES
    (and the slice from MEGASCALE_*), the coordinator from the sandbox; anything missing is exit 3."""
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.trainer import multihost

    dev = get_device("v5p-16")
    for k in (
        "TPU_WORKER_ID",
        "TPU_WORKER_HOSTNAMES",
        "OLMO_CTL_COORDINATOR_ADDRESS",
        "MEGASCALE_NUM_SLICES",
        "MEGASCALE_SLICE_ID",
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
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "1")
    with pytest.raises(
        multihost.JoinFailed, match="has 2 hosts but TPU_WORKER_HOSTNAMES names 2 in each of 2"
    ):
        multihost._emulated_slice_params(dev)  # a v5p-16 trainer is one slice
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert not multihost.emulated_slice()  # a real TPU: JAX detects the slice itself
