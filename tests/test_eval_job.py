"""`olmo-ctl eval --backend gke`: a checkpoint's evaluation as a job of its own on a single-host slice.

Everyday: the refusals, each one line and exit 2 before anything is read or submitted, and the JobSet
`--dry-run` prints, against the real JobSet CRD schema. Chaos: the trainer's eval mode (`python -m
olmo_ctl.trainer --eval SPEC`, what the job's pod runs) as a real process, and the whole loop against
the sandbox cluster, whose v5p-8 pod runs the trainer as a local process on 4 CPU devices over a GCS
emulator bucket: queued without a node past --timeout (124, the job goes on), waited for again by the
same command, its result equal to `eval --device cpu-4` here, read back the third time with nothing
submitted; a job whose JobSet is deleted under it is submitted again (attempt 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers.cli import ROOT, clean_env, invoke

from olmo_ctl.checkpoints.evaluate import RESULT_FILE, EvalSpec
from olmo_ctl.core.batching import read_launch_record
from olmo_ctl.trainer import downstream as D

pytest.importorskip("olmo_eval", reason="the eval extra (ai2-olmo-eval) is not installed")

TASK = "copycolors_10way"
LM_FILES = "{root}/eval/*.npy"  # the smoke held-out files (data.root builtin://smoke)
ARGS = ["--recipe", "smoke", "--tasks", TASK, "--tokenizer", D.BYTES_TOKENIZER]
ARGS += ["--lm", f"smoke_eval={LM_FILES}", "--limit", "4"]


@pytest.fixture
def env(tmp_path):
    return clean_env(tmp_path / "xdg")


def upload(local: Path, url: str) -> str:
    """A copy of the local directory `local` at gs:// `url` (every file, as Orbax wrote it)."""
    from olmo_ctl.storage import store_for

    store = store_for(url)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            store.write_bytes(f"{url}/{path.relative_to(local).as_posix()}", path.read_bytes())
    return url


def gcs_checkpoint(smoke_run: Path, bucket: str, step: int = 40) -> str:
    return upload(smoke_run / "checkpoints" / str(step), f"gs://{bucket}/runs/smoke/checkpoints/{step}")


def local_report(ckpt: str, device: str, env) -> dict:
    p = invoke("eval", ckpt, *ARGS, "--device", device, "-o", "json", env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


# ---------------------------------------------------------------- the trainer's eval mode


@pytest.mark.chaos
def test_the_trainer_evaluates_a_spec_into_result_json_as_eval_does(smoke_run, tmp_path, env):
    """What the job's pod runs, as a process: `--eval SPEC --run-dir OUT --device cpu-2` writes
    OUT/result.json with the spec, the devices and the report `eval --device cpu-2` prints here; a
    malformed spec is one line and exit 2, and nothing is written."""
    from olmo_ctl.cli.evaluate import parse_lm

    ckpt = str(smoke_run / "checkpoints" / "40")
    spec = EvalSpec(ckpt, "smoke", (TASK,), parse_lm(f"smoke_eval={LM_FILES}"), D.BYTES_TOKENIZER, limit=4)
    assert EvalSpec.from_json(spec.to_json()) == spec
    out = tmp_path / "out"
    trainer = [sys.executable, "-m", "olmo_ctl.trainer", "--device", "cpu-2", "--attempt", "0"]
    p = subprocess.run(
        [*trainer, "--run-dir", str(out), "--eval", spec.to_json()],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().endswith(f"eval: wrote {out}/result.json (2 cpu devices)"), p.stdout
    record = json.loads((out / RESULT_FILE).read_text())
    assert record["spec"] == spec.to_dict()
    assert record["devices"] == {"platform": "cpu", "kind": "cpu", "count": 2}
    assert record["report"] == local_report(ckpt, "cpu-2", env)

    bad = subprocess.run(
        [*trainer, "--run-dir", str(tmp_path / "bad"), "--eval", '{"tasks": 3}'],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith("error: --eval: not an eval spec (KeyError: 'checkpoint')")
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "cpu-2"], "`cpu-2` is a local device; an eval job runs on a TPU slice"),
        ([], "an eval job needs a slice; --device v5p-8 or tpu7x-8"),
    ],
)
def test_an_eval_job_runs_on_a_tpu_slice(args, message, smoke_run, env):
    p = invoke("eval", "gs://b/runs/x/checkpoints/1", "--backend", "gke", *args, env=env)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"error: {message}"), p.stderr


def test_what_the_pods_cannot_see_is_refused_before_anything_is_submitted(smoke_run, tmp_path, gcs, env):
    """A local checkpoint, tokenizer, LM file, recipe file or output directory, or an unknown task: one
    line, exit 2, nothing written."""
    env = {**env, "OLMO_CTL_RUN_ROOT": f"gs://{gcs.bucket}/runs", "OLMO_CTL_IMAGE": "registry.example/o:1"}
    local_ckpt = str(smoke_run / "checkpoints" / "40")
    ckpt = gcs_checkpoint(smoke_run, gcs.bucket)
    tok = D.tokenizer_path(D.BYTES_TOKENIZER, str(tmp_path / "tok"))
    lm_file = str(tmp_path / "held-out.npy")
    np.asarray([5, 6, 7, 256], "<u4").tofile(lm_file)
    cases = [
        ([local_ckpt, *ARGS], f"checkpoint `{local_ckpt}` is on this machine, which the pods cannot see"),
        ([ckpt, *ARGS, "--tokenizer", tok], f"tokenizer `{tok}` is on this machine"),
        ([ckpt, *ARGS, "--lm", f"x={lm_file}"], f"LM file `{lm_file}` is on this machine"),
        ([ckpt, *ARGS, "--out", str(tmp_path / "o")], f"the eval job's output directory `{tmp_path}/o`"),
        ([ckpt, *ARGS, "--tasks", "no_such_task"], "unknown downstream task 'no_such_task'"),
        ([ckpt, *ARGS, "--recipe", "./mine.yaml"], "--recipe `./mine.yaml` is not a shipped recipe"),
    ]
    for args, message in cases:
        p = invoke("eval", *args, "--backend", "gke", "--device", "v5p-8", env=env)
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert p.stderr.startswith(f"error: {message}"), p.stderr
    from olmo_ctl.storage import store_for

    objects, _ = store_for(f"gs://{gcs.bucket}").list(f"gs://{gcs.bucket}/runs", recursive=True)
    assert all("/checkpoints/40/" in o.path for o in objects)  # only the uploaded checkpoint
    assert not (tmp_path / "o").exists()


def test_an_eval_job_never_writes_into_a_run_directory(smoke_run, gcs, env):
    """`--out` naming a run's own directory (its checkpoints, run.yaml, a run's journal, ingredients.yaml)
    is one line and exit 2, with or without --dry-run, and nothing is written there: the job journals its
    attempts in its output directory, where the run would take them for its own (its next attempt on the
    eval's slice, no resize recorded). verify's jobs are refused the same way; an eval job's own directory
    is still its own."""
    from olmo_ctl.backends import resolve_settings
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.core.errors import BadInput
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.storage import store_for
    from olmo_ctl.supervise import evaljob as J

    root = f"gs://{gcs.bucket}/runs"
    env = {**env, "OLMO_CTL_RUN_ROOT": root, "OLMO_CTL_IMAGE": "registry.example/o:1"}
    ckpt = gcs_checkpoint(smoke_run, gcs.bucket)  # gs://.../runs/smoke/checkpoints/40: a run's directory
    store = store_for(root)
    store.write_text(f"{root}/a/run.yaml", "run: a\n")
    RunDir(f"{root}/b").append("submitted", attempt=1, device="cpu-1", reason="first attempt")
    store.write_text(f"{root}/c/ingredients.yaml", "ingredients: []\n")
    cases = {
        f"{root}/smoke": "checkpoints up to step 40",
        f"{root}/a/": "run.yaml",
        f"{root}/b": "journal (1 record)",
        f"{root}/c": "ingredients.yaml",
    }
    before = sorted(o.path for o in store.list(root, recursive=True)[0])
    for out, holds in cases.items():
        for dry in ([], ["--dry-run"]):
            p = invoke(
                "eval", ckpt, *ARGS, "--backend", "gke", "--device", "v5p-8", "--out", out, *dry, env=env
            )
            assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
            assert p.stderr.startswith(f"error: --out {out.rstrip('/')} is a run directory (it holds "), (
                p.stderr
            )
            assert holds in p.stderr and "--out gs://BUCKET/evals/NAME" in p.stderr, p.stderr
    assert sorted(o.path for o in store.list(root, recursive=True)[0]) == before
    spec = EvalSpec(ckpt, "smoke", (TASK,), None, D.BYTES_TOKENIZER, limit=4)
    settings = resolve_settings(run_root=root, image="registry.example/o:1")
    with pytest.raises(BadInput, match="is a run directory"):
        J.resolve(spec, get_device("v5p-8"), settings, out=f"{root}/smoke")
    from olmo_ctl.rundir import EVAL_JOB_REASON

    mine = f"gs://{gcs.bucket}/evals/mine"  # an eval job's own directory, asked again: still its own
    RunDir(mine).append("submitted", attempt=0, device="v5p-8", reason=EVAL_JOB_REASON)
    J.check_out(mine)


@pytest.mark.parametrize("flag", ["--out", "--dry-run"])
def test_job_options_without_the_gke_backend_are_refused(flag, smoke_run, env):
    extra = [flag, "gs://b/o"] if flag == "--out" else [flag]
    p = invoke("eval", str(smoke_run / "checkpoints" / "40"), *ARGS, *extra, env=env)
    assert (
        p.returncode == 2
        and p.stderr
        == f"error: {flag} is for an eval job (--backend gke); leave {flag} out, or add --backend gke\n"
    )


def test_dry_run_prints_the_eval_jobs_jobset(smoke_run, gcs, env):
    """The trainer image's entry point with `--eval SPEC` on one v5p-8 VM, named for the spec, valid
    against the JobSet v0.10.1 CRD schema; asked again, the same name; another spec, another."""
    from test_manifest import schema_errors

    env = {**env, "OLMO_CTL_RUN_ROOT": f"gs://{gcs.bucket}/runs", "OLMO_CTL_IMAGE": "registry.example/o:1"}
    ckpt = gcs_checkpoint(smoke_run, gcs.bucket)
    cmd = ["eval", ckpt, *ARGS, "--backend", "gke", "--device", "v5p-8", "--dry-run"]
    p = invoke(*cmd, env=env)
    assert p.returncode == 0, p.stderr
    js = yaml.safe_load(p.stdout)
    assert schema_errors(js) == []
    name = js["metadata"]["name"]
    run = js["metadata"]["labels"]["olmo-ctl/run"]
    assert name == f"{run}-a0" and run.startswith("eval-") and len(run) == 15
    out = f"gs://{gcs.bucket}/runs/eval-jobs/{run}"
    assert js["metadata"]["annotations"]["olmo-ctl/run-dir"] == out
    (rj,) = js["spec"]["replicatedJobs"]
    assert rj["replicas"] == 1 and rj["template"]["spec"]["parallelism"] == 1
    (c,) = rj["template"]["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "registry.example/o:1"
    assert c["command"][:-4] == [
        "python",
        "-m",
        "olmo_ctl.trainer",
        "--run-dir",
        out,
        "--device",
        "v5p-8",
        "--attempt",
        "0",
    ]
    assert c["command"][-4] == "--plan" and read_launch_record(c["command"][-3])[0].name == "v5p-8"
    assert c["command"][-2] == "--eval" and EvalSpec.from_json(c["command"][-1]).checkpoint == ckpt
    assert invoke(*cmd, env=env).stdout == p.stdout
    other = invoke(*cmd, "--limit", "5", env=env)
    assert yaml.safe_load(other.stdout)["metadata"]["name"] != name
    from olmo_ctl.storage import store_for

    objects, _ = store_for(out).list(out, recursive=True)
    assert objects == []  # a dry run writes nothing


# ---------------------------------------------------------------- on the sandbox cluster


@pytest.mark.chaos
@pytest.mark.gcs
def test_an_eval_job_waits_for_capacity_is_waited_for_again_and_equals_eval_here(smoke_run, tmp_path, gcs):
    """The sandbox with one v5p-8 node pool whose node is gone: the eval job queues, and `--timeout 20`
    ends the command with 124 while the job goes on. The node comes back; the same command waits for
    the same JobSet (nothing submitted again), whose pod (the trainer, 4 CPU devices) writes the
    report `eval --device cpu-4` gives here. Asked a third time, the result is read back and nothing
    is submitted. A fourth evaluation whose JobSet is deleted under it is submitted again."""
    from olmo_ctl.sandbox.faults import parse_fault
    from olmo_ctl.sandbox.pod_processes import ProcessRunner
    from olmo_ctl.sandbox.sandbox import Sandbox, gke_mode_env

    ckpt = gcs_checkpoint(smoke_run, gcs.bucket)
    runner = ProcessRunner(poll_s=0.05)
    with Sandbox(slices={"v5p-8": 1}, runner=runner) as sb:
        kc = sb.write_kubeconfig(tmp_path / "kubeconfig")
        env = clean_env(tmp_path / "xdg")
        env.update(gke_mode_env(kc, sb.namespace, sb.queue, gcs.url, gcs.bucket))
        env["PYTHONPATH"] = str(ROOT)
        sb.fault(parse_fault({"kind": "capacity", "pool": "v5p-8", "nodes": 0}))
        cmd = ["eval", ckpt, *ARGS, "--backend", "gke", "--device", "v5p-8", "-o", "json"]
        first = invoke(*cmd, "--timeout", "20", env=env)
        assert first.returncode == 124, first.stderr
        assert "submitted (v5p-8)" in first.stderr
        assert (
            first.stderr.rstrip().splitlines()[-1].startswith("error: timed out waiting for eval job eval-")
        )
        (name,) = sb.server.cluster.jobset_names()
        sb.fault(parse_fault({"kind": "capacity", "pool": "v5p-8", "nodes": 1}))
        second = invoke(*cmd, env=env)
        assert second.returncode == 0, second.stderr
        assert f"eval job {name}: waiting for it again" in second.stderr
        assert "submitted" not in second.stderr
        assert sb.server.cluster.jobset_names() == [name]
        assert json.loads(second.stdout) == local_report(ckpt, "cpu-4", env)
        third = invoke(*cmd, env=env)
        assert third.returncode == 0 and third.stdout == second.stdout
        assert "note: kept by eval job " in third.stderr and "on 4 cpu devices" in third.stderr
        assert sb.server.cluster.jobset_names() == [name]

        # Another evaluation (--limit 3), whose JobSet is deleted as soon as it is submitted (a
        # person's `kubectl delete`): that attempt is missing, so attempt 1 is submitted and gives it.
        lines, deleted, record = _deleted_once(sb, ckpt, gcs.bucket)
        assert deleted == [f"{record['job']}-a0"]
        assert f"eval job {record['job']}-a0 missing" in "\n".join(lines), lines
        assert any(ln.endswith("submitting it again in 0 s") for ln in lines), lines
        assert any(ln.startswith(f"eval job {record['job']}-a1 submitted (v5p-8)") for ln in lines), lines
        assert [r["attempt"] for r in record["journal"]] == [0, 1]
        assert record["report"]["downstream"][TASK]["acc_v1"] is not None


def _deleted_once(sb, ckpt: str, bucket: str):
    """`supervise.evaljob.run_job` with no backoff, deleting the first JobSet it submits."""
    from kubernetes import client

    from olmo_ctl.backends.gke import GKEBackend
    from olmo_ctl.backends.kube import make_api_client
    from olmo_ctl.checkpoints.evaluate import check, open_checkpoint
    from olmo_ctl.core.config import Settings
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.sandbox.sandbox import IMAGE
    from olmo_ctl.supervise import evaljob as J

    spec = EvalSpec(ckpt, "smoke", (TASK,), None, D.BYTES_TOKENIZER, limit=3)
    settings = Settings(image=IMAGE, run_root=f"gs://{bucket}/runs", queue=sb.queue, namespace=sb.namespace)
    recipe = check(open_checkpoint(ckpt, "smoke"), devices=4, **spec.options())
    name = J.job_name(spec, "v5p-8", None, settings.run_root)
    job = J.EvalJob(
        name, spec, recipe, get_device("v5p-8"), J.out_dir(name, None, settings.run_root), settings
    )
    api = client.CustomObjectsApi(make_api_client(host=sb.url))
    lines: list[str] = []
    deleted: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if " submitted " in line and not deleted:
            js = line.split()[2]
            api.delete_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", sb.namespace, "jobsets", js)
            deleted.append(js)

    be = GKEBackend(namespace=sb.namespace, host=sb.url, settings=settings)
    record, kept = J.run_job(be, job, timeout_s=600, poll_s=0.2, backoff_s=0, log=log)
    assert not kept
    journal = [r for r in RunDir(job.out).journal() if r["event"] == J.SUBMITTED]
    return lines, deleted, {**record, "job": name, "journal": journal}
