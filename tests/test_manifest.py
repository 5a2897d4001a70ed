"""JobSet rendering: golden manifests (regenerate with `make goldens`), validation against the real
JobSet v0.10.1 CRD schema with unknown fields as errors, names, and the shape of every field."""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml
from helpers.cli import clean_env, invoke

from olmo_ctl.backends.jobset import jobset_name, render_jobset
from olmo_ctl.core.batching import make_plan, read_launch_record
from olmo_ctl.core.config import Settings
from olmo_ctl.core.devices import Target, get_device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.names import default_run_name, validate_run_name
from olmo_ctl.core.node_resources import trainer_resources_for
from olmo_ctl.core.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
GOLDENS = Path(__file__).resolve().parent / "goldens"
# The JobSet CRD the package ships for its Kubernetes test server (olmo_ctl/sandbox/crds/).
SCHEMA = Path(str(resources.files("olmo_ctl.sandbox") / "crds" / "jobset.x-k8s.io_jobsets.v0.10.1.yaml"))

# Site settings of the goldens, passed as flags so the goldens are exactly what the CLI prints.
SITE = [
    "--namespace",
    "olmo",
    "--queue",
    "tpu-queue",
    "--image",
    "us-docker.pkg.dev/example-project/olmo-ctl/olmo-ctl:0.1.0",
    "--run-root",
    "gs://example-bucket/runs",
    "--service-account",
    "olmo-trainer",
    "--placement-policy",
    "olmo-{topology}",
]
DEVICES = ("tpu7x-128", "tpu7x-512", "v5p-256", "v5p-8")
MULTISLICE = ("tpu7x-128", "v5p-256")  # 2 slices of each: `2x<device>-stage1`
# The 2D-torus generations (v6e, v5e): stage 1 on the largest slice, the smoke model on the smallest.
TWO_D = (("v6e-256", "v6e-8"), ("v5litepod-256", "v5litepod-8"))
CAPACITY_CASES = (("tpu7x-128", "spot"), ("tpu7x-128", "flex-start"), ("v5p-256", "reservation:olmo-v5p"))
# GPU nodes, 2 of each machine type (`tests/test_gpu_jobset.py` checks their pods against XPK's).
GPU_NODES = ("h100-mega-80gb-8x2", "h200-141gb-8x2", "b200-8x2")


def golden_cases() -> dict[str, list[str]]:
    cases = {}
    for dev in DEVICES:
        devices = get_device(dev).devices
        cases[f"{dev}-stage1"] = ["--stage", "1", "--device", dev, "--priority-class", "high"]
        stage2 = ["--stage", "2", "--device", dev, "--run", "olmo3-7b-s2", "--attempt", "4"]
        if devices > 256:
            # Stage 2's global batch (256) cannot split over 512 devices (that is refused, see
            # test_plan.py); the way to run it there is an explicit batch of 512 over half the steps.
            cases[f"{dev}-stage2-gb512"] = [
                *stage2,
                "--set",
                "train.global_batch=512",
                "--set",
                "train.max_steps=23842",
            ]
        else:
            cases[f"{dev}-stage2"] = stage2
        # The smoke model on a slice: one instance per device where its global batch of 8 cannot split.
        smoke = ["--recipe", "smoke", "--device", dev, "--run", f"smoke-{dev}"]
        # (and an eval batch every host can load its share of: the smoke recipe's is 8)
        big = ["--set", f"train.global_batch={devices}", "--set", f"eval.batch_size={devices}"]
        cases[f"{dev}-smoke"] = smoke + (big if devices > 8 else [])
    # Capacity types as XPK names them (test_capacity.py checks their node selectors against XPK's).
    for dev, capacity in CAPACITY_CASES:
        cases[f"{dev}-stage1-{capacity.partition(':')[0]}"] = [
            "--stage",
            "1",
            "--device",
            dev,
            "--capacity",
            capacity,
            "--run",
            f"olmo3-7b-s1-{capacity.partition(':')[0]}",
        ]
    # A slice XPK offers that the doubling rule does not (named by its topology): the smoke model,
    # one instance per device.
    cases["v5p-4x4x12-smoke"] = [
        "--recipe",
        "smoke",
        "--device",
        "v5p-4x4x12",
        "--run",
        "smoke-v5p-4x4x12",
        "--set",
        "train.global_batch=192",
        "--set",
        "eval.batch_size=192",
    ]
    for large, small in TWO_D:
        cases[f"{large}-stage1"] = ["--stage", "1", "--device", large, "--priority-class", "high"]
        cases[f"{small}-smoke"] = ["--recipe", "smoke", "--device", small, "--run", f"smoke-{small}"]
    for dev in MULTISLICE:
        cases[f"2x{dev}-stage1"] = [
            "--stage",
            "1",
            "--device",
            dev,
            "--slices",
            "2",
            "--run",
            f"olmo3-7b-s1-2x{dev}",
        ]
    for dev in GPU_NODES:
        machine = dev.rsplit("x", 1)[0]
        cases[f"{dev}-stage1"] = [
            "--stage",
            "1",
            "--device",
            dev,
            "--queue",
            "gpu-queue",
            "--run",
            f"olmo3-7b-s1-{machine}",
        ]
    return cases


def cli(args: list[str], env: dict[str, str]):
    """The command line's entry point in this process (the bytes `python -m olmo_ctl` prints)."""
    return invoke(*args, env=env)


def render_golden(args: list[str], env: dict[str, str]) -> str:
    p = cli(["submit", *SITE, *args, "--dry-run"], env)  # a case's own flag wins over the site's
    assert p.returncode == 0, p.stderr
    return p.stdout


@functools.lru_cache(maxsize=1)
def strict_schema() -> dict:
    """The JobSet schema with `additionalProperties: false` wherever it lists properties."""
    crd = yaml.load(SCHEMA.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2")
    schema = version["schema"]["openAPIV3Schema"]

    def strict(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for v in node.values():
                strict(v)
        elif isinstance(node, list):
            for v in node:
                strict(v)

    strict(schema)
    return schema


def schema_errors(obj: dict) -> list[str]:
    schema = strict_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


# Kubernetes rules the CRD schema leaves to the API server (metadata is untyped there).
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def metadata_errors(js: dict) -> list[str]:
    errs = []
    name = js["metadata"]["name"]
    if len(name) > 40 or not _DNS1035.match(name):
        errs.append(f"name {name!r} is not a DNS-1035 label of <= 40 characters")
    pod_meta = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]
    pod_spec = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    for where, labels in (
        ("jobset", js["metadata"]["labels"]),
        ("pod", pod_meta["labels"]),
        ("nodeSelector", pod_spec["nodeSelector"]),
    ):
        for k, v in labels.items():
            if not isinstance(v, str) or len(v) > 63 or not _LABEL_VALUE.match(v):
                errs.append(f"{where} label {k}={v!r} is not a valid label value")
            if not _LABEL_KEY.match(k):
                errs.append(f"{where} label key {k!r} is not valid")
    return errs


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return clean_env(tmp_path_factory.mktemp("xdg"))


def _pod(js: dict) -> dict:
    return js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def _job(js: dict) -> dict:
    return js["spec"]["replicatedJobs"][0]["template"]["spec"]


# ---------------------------------------------------------------- goldens


@pytest.mark.parametrize("case", sorted(golden_cases()))
def test_golden_matches_cli_and_validates(case, env):
    args = golden_cases()[case]
    text = render_golden(args, env)
    path = GOLDENS / f"{case}.yaml"
    assert path.exists(), f"missing golden {path.name}: run `make goldens`"
    assert text == path.read_text(), (
        f"{path.name} differs from the rendered manifest: run `make goldens`, review"
    )
    js = yaml.safe_load(text)
    assert schema_errors(js) == []
    assert metadata_errors(js) == []
    dev = get_device(args[args.index("--device") + 1])
    slices = int(args[args.index("--slices") + 1]) if "--slices" in args else 1
    job, pod = _job(js), _pod(js)
    assert js["spec"]["replicatedJobs"][0]["replicas"] == slices
    assert job["parallelism"] == job["completions"] == dev.vms
    if dev.is_gpu_nodes:
        assert pod["containers"][0]["resources"]["limits"] == {
            "nvidia.com/gpu": dev.chips_per_vm,
            **(trainer_resources_for(dev.generation, "auto") or {}),
        }
        assert pod["nodeSelector"]["cloud.google.com/gke-accelerator"] == dev.accelerator_label
        return
    assert pod["containers"][0]["resources"]["limits"]["google.com/tpu"] == dev.chips_per_vm
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == dev.topology
    # The placement policy is selected only on multi-host Ironwood slices.
    has_policy = "cloud.google.com/placement-policy-name" in pod["nodeSelector"]
    assert has_policy == (dev.generation == "tpu7x" and dev.vms > 1)
    if has_policy:
        assert pod["nodeSelector"]["cloud.google.com/placement-policy-name"] == f"olmo-{dev.topology}"
    assert ("kueue.x-k8s.io/priority-class" in js["metadata"]["labels"]) == ("--priority-class" in args)


def _golden_attempt(args: list[str]):
    """The recipe, device, run name, attempt number and slices a golden's command line asks for."""

    def opt(name, default=None):
        return args[args.index(name) + 1] if name in args else default

    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    recipe = load_recipe(opt("--recipe"), int(opt("--stage")) if opt("--stage") else None, sets)
    return (
        recipe,
        get_device(opt("--device")),
        opt("--run", default_run_name(recipe)),
        int(opt("--attempt", 1)),
        int(opt("--slices", 1)),
    )


def _site_settings(args: list[str]) -> Settings:
    flags = [*SITE, *args]
    kw = {
        flags[i][2:].replace("-", "_"): flags[i + 1]
        for i, f in enumerate(flags)
        if f
        in (
            "--namespace",
            "--queue",
            "--image",
            "--run-root",
            "--service-account",
            "--placement-policy",
            "--priority-class",
            "--capacity",
        )
    }
    return Settings(**kw)


@pytest.fixture(scope="module")
def example_bucket():
    from olmo_ctl import storage
    from olmo_ctl.sandbox.gcs_emulator import gcs_emulator

    with gcs_emulator("example-bucket") as (_url, bucket):
        storage._gcs = None  # a client made for another emulator must not be reused
        yield bucket
    storage._gcs = None


@pytest.mark.gcs
def test_dry_run_is_what_a_real_submit_sends(example_bucket):
    """For every golden, a real `submit` of the same attempt (run.yaml on GCS, the Kubernetes test
    server as the cluster) sends the very object `--dry-run` printed."""
    from olmo_ctl.backends.gke import GKEBackend
    from olmo_ctl.backends.kube import KubeRetryPolicy
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.sandbox.kube_server import KubeServer
    from olmo_ctl.supervise.submit import prepare_run, submit_run

    fast = KubeRetryPolicy(base_s=0.01, max_s=0.05, budget_s=5.0, connect_timeout_s=1.0, read_timeout_s=5.0)
    for case, args in sorted(golden_cases().items()):
        recipe, dev, run, attempt, slices = _golden_attempt(args)
        settings = _site_settings(args)
        rd = RunDir.of(settings.run_root, run)
        for name in ("run.yaml", "journal.jsonl", "lease.json"):  # the previous case's run of the same name
            if rd.store.exists(rd.p(name)):
                rd.store.delete(rd.p(name))
        rd.create_run(recipe.to_dict(), recipe.fingerprint(), "v1:test", dev.name, slices)
        with KubeServer(namespace=settings.namespace) as srv:
            received: list[dict] = []
            dispatch = srv.api.dispatch

            def spy(method, path, query, body, ctype, dispatch=dispatch, received=received):
                if method == "POST" and path.endswith("/jobsets"):
                    received.append(json.loads(body))
                return dispatch(method, path, query, body, ctype)

            srv.api.dispatch = spy
            backend = GKEBackend(namespace=settings.namespace, host=srv.url, retry=fast, settings=settings)
            prep = prepare_run(settings, run, device=dev, slices=slices, attempt=attempt, backend=backend)
            # No Kueue objects in this test server and no preflight: the rendering is what is checked.
            handle = submit_run(prep, checks=False, numbered=attempt is not None).handle
        assert handle.attempt == attempt
        assert received == [yaml.safe_load((GOLDENS / f"{case}.yaml").read_text())], case


def test_goldens_are_all_listed():
    on_disk = {p.stem for p in GOLDENS.glob("*.yaml")}
    assert on_disk == set(golden_cases()), "stale or missing goldens: run `make goldens`"


def test_schema_check_catches_unknown_and_mistyped_fields(env):
    js = yaml.safe_load((GOLDENS / "tpu7x-128-stage1.yaml").read_text())
    bad = copy.deepcopy(js)
    _pod(bad)["containers"][0]["privilegd"] = False
    assert any("privilegd" in e for e in schema_errors(bad))
    bad = copy.deepcopy(js)
    _job(bad)["completions"] = "16"
    assert any("completions" in e for e in schema_errors(bad))
    bad = copy.deepcopy(js)
    bad["spec"]["failurePolicy"]["rules"][0]["action"] = "Retry"
    assert schema_errors(bad)


# ---------------------------------------------------------------- what the manifest says


def test_host_network_is_a_site_setting_and_names_the_identity(tmp_path, monkeypatch):
    from olmo_ctl.backends import resolve_settings
    from olmo_ctl.backends.jobset import identity_note

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    for k in [k for k in os.environ if k.startswith("OLMO_CTL_")]:
        monkeypatch.delenv(k)
    assert resolve_settings().host_network is False and identity_note(resolve_settings()) is None
    monkeypatch.setenv("OLMO_CTL_HOST_NETWORK", "true")
    s = resolve_settings(run_root="gs://b/runs", service_account="trainer-sa")
    assert s.host_network is True and s.sources["host_network"] == "env OLMO_CTL_HOST_NETWORK"
    pod = _pod(_render(settings=s))
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert schema_errors(_render(settings=s)) == []
    note = identity_note(s)
    assert (
        "Workload Identity does not apply" in note
        and "`trainer-sa`" in note
        and "node pool's service account" in note
    )
    monkeypatch.setenv("OLMO_CTL_HOST_NETWORK", "sometimes")
    with pytest.raises(BadInput, match="host_network"):
        resolve_settings()
    monkeypatch.delenv("OLMO_CTL_HOST_NETWORK")
    (tmp_path / "olmo-ctl").mkdir()
    (tmp_path / "olmo-ctl" / "config.yaml").write_text("host_network: true\n")
    assert resolve_settings().host_network is True
    # submit says it in one line (stderr), and renders the pods on the host network
    env = {**clean_env(tmp_path / "x"), "OLMO_CTL_HOST_NETWORK": "true"}
    p = cli(["submit", "--recipe", "smoke", "--device", "v5p-8", *SITE, "--dry-run"], env)
    assert p.returncode == 0, p.stderr
    (line,) = [ln for ln in p.stderr.splitlines() if "Workload Identity does not apply" in ln]
    assert line.startswith("note: host_network is on") and "`olmo-trainer`" in line
    assert "hostNetwork: true" in p.stdout
    p = cli(
        ["submit", "--recipe", "smoke", "--device", "v5p-8", *SITE, "--dry-run"], clean_env(tmp_path / "x")
    )
    assert "Workload Identity does not apply" not in p.stderr and "hostNetwork" not in p.stdout


def test_the_plan_annotation_names_seq_shards_when_a_sequence_is_split(env):
    """Stage 3's 65,536-token sequences on tpu7x-128 are split over 2 devices each (64 instances on 128
    devices): the dry run's `olmo-ctl/plan` says so, as `plan` does; stage 1 splits none and says nothing."""
    p = cli(["submit", "--stage", "3", "--device", "tpu7x-128", *SITE, "--dry-run", "-o", "json"], env)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["metadata"]["annotations"]["olmo-ctl/plan"] == (
        "global_batch=64 per_device_batch=1 grad_accum=1 devices=128 seq_shards=2"
    )
    plan = json.loads(cli(["plan", "--stage", "3", "--device", "tpu7x-128", "-o", "json"], env).stdout)
    assert plan["seq_shards"] == 2
    assert "seq_shards" not in _render(stage=1)["metadata"]["annotations"]["olmo-ctl/plan"]


def _render(
    stage=1,
    device="tpu7x-128",
    settings=None,
    run="olmo3-7b-s1",
    attempt=1,
    run_dir=None,
    slices=1,
    overrides=(),
):
    recipe = load_recipe(stage=stage, overrides=overrides)
    dev = get_device(device)
    plan = make_plan(recipe, dev, slices)
    settings = settings or Settings(run_root="gs://b/runs")
    return render_jobset(recipe, plan, dev, settings, run, attempt, run_dir or f"gs://b/runs/{run}", slices)


def test_pod_shape_and_failure_policy():
    js = _render(
        settings=Settings(
            namespace="ml", queue="q1", image="img:1", service_account="trainer-sa", run_root="gs://b/runs"
        ),
        attempt=7,
    )
    md = js["metadata"]
    assert md["name"] == "olmo3-7b-s1-a7"
    assert md["namespace"] == "ml"
    assert md["labels"] == {
        "kueue.x-k8s.io/queue-name": "q1",
        "olmo-ctl/run": "olmo3-7b-s1",
        "olmo-ctl/attempt": "7",
        "olmo-ctl/device": "tpu7x-128",
    }
    assert md["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"
    assert md["annotations"]["olmo-ctl/run-dir"] == "gs://b/runs/olmo3-7b-s1"
    assert "suspend" not in js["spec"]  # Kueue suspends and admits
    assert js["spec"]["network"] == {"enableDNSHostnames": True}
    rj = js["spec"]["replicatedJobs"]
    assert [r["name"] for r in rj] == ["slice"] and rj[0]["replicas"] == 1
    job, pod = _job(js), _pod(js)
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    assert job["parallelism"] == job["completions"] == 16
    assert pod["restartPolicy"] == "Never"
    # No hostNetwork by default: Workload Identity applies, Pod Security baseline admits the pods.
    assert "hostNetwork" not in pod and "dnsPolicy" not in pod
    assert pod["serviceAccountName"] == "trainer-sa"
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu7x",
        "cloud.google.com/gke-tpu-topology": "4x4x4",
        # XPK's placement policy, on by default (src/xpk/core/scheduling.py get_placement_policy_name)
        "cloud.google.com/placement-policy-name": "tpu7x-128-4x4x4-placement-policy",
    }
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    (c,) = pod["containers"]
    assert c["image"] == "img:1"
    assert c["command"][:-1] == [
        "python",
        "-m",
        "olmo_ctl.trainer",
        "--run-dir",
        "gs://b/runs/olmo3-7b-s1",
        "--device",
        "tpu7x-128",
        "--attempt",
        "7",
        "--plan",
    ]
    # The attempt's target (the catalog entry itself) and its one plan: the trainer makes no other.
    recipe = load_recipe(stage=1)
    target, plan = read_launch_record(c["command"][-1])
    assert target == Target.parse("tpu7x-128")
    assert plan == make_plan(recipe, target.device)
    # Guaranteed: CPU and memory requested as limited, a tpu7x-standard-4t's share (core/node_resources.py)
    own = {"google.com/tpu": 4, "cpu": "212", "memory": "887Gi"}
    assert c["resources"] == {"requests": own, "limits": own}
    assert c["securityContext"]["privileged"] is False
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["JAX_PLATFORMS"] == "tpu"
    assert not any(k.startswith("MEGASCALE_") for k in env)
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # Disruptions are not counted, whatever the trainer's exit while torn down; user errors (trainer
    # exit 1/2) fail at once; exit 3, exit 143 (a stop with its step checkpointed, the agreed stop of
    # the hosts a disruption did not touch) and pods that never ran restart without spending
    # maxRestarts; any other exit spends one, on whichever slice, before any uncounted rule.
    from olmo_ctl.core.contracts import EXIT_RESTART, EXIT_SIGTERM, USER_EXIT_CODES

    def on_codes(op, values):
        return {
            "action": "FailJob",
            "onExitCodes": {"containerName": "trainer", "operator": op, "values": values},
        }

    assert job["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        on_codes("In", sorted(USER_EXIT_CODES)),
        on_codes("In", [EXIT_RESTART, EXIT_SIGTERM]),
        on_codes("NotIn", sorted({*USER_EXIT_CODES, EXIT_RESTART, EXIT_SIGTERM})),
    ]
    fp = js["spec"]["failurePolicy"]
    assert fp["maxRestarts"] >= 1
    assert [
        (r["name"], r["action"], r["onJobFailureReasons"], r.get("onJobFailureMessagePatterns"))
        for r in fp["rules"]
    ] == [
        ("FailOnUserError", "FailJobSet", ["PodFailurePolicy"], ["matching FailJob rule at index 1$"]),
        ("RestartOnCrash", "RestartJobSet", ["PodFailurePolicy"], ["matching FailJob rule at index 3$"]),
        (
            "RestartOnLostPeer",
            "RestartJobSetAndIgnoreMaxRestarts",
            ["PodFailurePolicy"],
            ["matching FailJob rule at index 2$"],
        ),
        ("RestartOnPodNotStarted", "RestartJobSetAndIgnoreMaxRestarts", ["BackoffLimitExceeded"], None),
    ]
    assert schema_errors(js) == [] and metadata_errors(js) == []


def test_the_placement_policy_is_xpks_by_default_and_none_turns_it_off():
    """XPK selects `<device>-<topology>-placement-policy` on multi-host Ironwood slices (and creates
    the node pools with it); `placement_policy: none` renders no selector; single-host slices and v5p
    never carry one."""
    key = "cloud.google.com/placement-policy-name"
    assert _pod(_render(device="tpu7x-512"))["nodeSelector"][key] == "tpu7x-512-4x8x8-placement-policy"
    off = Settings(run_root="gs://b/r", placement_policy="none")
    assert key not in _pod(_render(device="tpu7x-512", settings=off))["nodeSelector"]
    assert key not in _pod(_render(device="tpu7x-8"))["nodeSelector"]
    assert key not in _pod(_render(device="v5p-256"))["nodeSelector"]


def test_optional_priority_and_placement():
    s = Settings(run_root="gs://b/r", priority_class="low", placement_policy="pp-{generation}-{topology}")
    js = _render(device="tpu7x-512", settings=s)
    assert js["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "low"
    assert _pod(js)["nodeSelector"]["cloud.google.com/placement-policy-name"] == "pp-tpu7x-4x8x8"
    js = _render(device="v5p-256", settings=s)  # v5p node pools carry no placement policy
    assert "cloud.google.com/placement-policy-name" not in _pod(js)["nodeSelector"]
    js = _render(device="tpu7x-8", settings=s, overrides=["train.global_batch=8", "model.n_layers=2"])
    assert "cloud.google.com/placement-policy-name" not in _pod(js)["nodeSelector"]  # single host


def test_multislice_renders_n_replicas_and_sets_no_dcn_variable():
    """2 x v5p-256: two replicas of the slice, the plan over 256 devices, `--slices 2` for the trainer,
    and none of the variables GKE's TPU webhook injects (MEGASCALE_*, TPU_WORKER_*): each is set once."""
    from olmo_ctl.backends.jobset import INJECTED_ENV

    js = _render(device="v5p-256", slices=2, run="ms")
    assert js["spec"]["replicatedJobs"][0]["replicas"] == 2
    job, pod = _job(js), _pod(js)
    assert job["parallelism"] == job["completions"] == 32
    (c,) = pod["containers"]
    assert c["command"][-4:-2] == ["--slices", "2"]
    assert read_launch_record(c["command"][-1])[0] == Target.parse("v5p-256", 2)
    names = [e["name"] for e in c["env"]]
    assert len(names) == len(set(names))
    assert not set(names) & set(INJECTED_ENV) and not any(n.startswith("MEGASCALE_") for n in names)
    assert "devices=256 slices=2" in js["metadata"]["annotations"]["olmo-ctl/plan"]
    # slices of one JobSet never share a node pool
    assert (
        js["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"]
        == "cloud.google.com/gke-nodepool"
    )
    assert schema_errors(js) == [] and metadata_errors(js) == []
    # one slice: no --slices on the command line (the 12 single-slice goldens are unchanged)
    assert "--slices" not in _pod(_render(device="v5p-256", run="ms"))["containers"][0]["command"]


def test_multislice_plan_must_match_and_env_is_checked():
    from olmo_ctl.backends.jobset import check_env

    recipe, dev = load_recipe(stage=1), get_device("v5p-256")
    with pytest.raises(ValueError, match="does not match"):  # a one-slice plan for a two-slice JobSet
        render_jobset(
            recipe, make_plan(recipe, dev), dev, Settings(run_root="gs://b/r"), "ms", 1, "gs://b/r/ms", 2
        )
    with pytest.raises(BadInput, match="single-host"):
        _render(device="v5p-8", slices=2, overrides=["train.global_batch=8", "model.n_layers=2"])
    with pytest.raises(ValueError, match="set twice"):
        check_env([{"name": "A", "value": "1"}, {"name": "A", "value": "2"}])
    with pytest.raises(ValueError, match="TPU webhook"):
        check_env([{"name": "MEGASCALE_NUM_SLICES", "value": "2"}])


# What XPK renders for `xpk workload create --tpu-type <device> --num-slices 2`, derived from its source
# (AI-Hypercomputer/xpk at 367c8382):
#   src/xpk/core/system_characteristics.py: get_tpu_system_characteristics_map (device type
#     `<prefix>-<chips x tensorcores_per_chip>`, chips_per_vm = compute_chips_per_vm = 4 unless 1 chip,
#     vms_per_slice = compute_vms_per_slice = chips / chips_per_vm), generate_tpu_topologies (2x2x1,
#     2x2x2, 2x2x4, 2x4x4, then AxBxC with A <= B <= C multiples of 4 up to max_cubes cubes: 144 for
#     tpu7x-standard-4t, 140 for v5p), gke_accelerator `tpu7x` / `tpu-v5p-slice`, tensorcores_per_chip 2;
#   src/xpk/commands/workload.py WORKLOAD_CREATE_YAML: replicas = num_slices, parallelism = completions =
#     vms_per_slice, nodeSelector cloud.google.com/gke-tpu-accelerator and cloud.google.com/gke-tpu-topology;
#   src/xpk/core/docker_resources.py get_main_container_resources: google.com/tpu = chips_per_vm /
#     parallel_containers (1 unless --use-parallel-containers).
_XPK_TPU = {"tpu7x": ("tpu7x", 144), "v5p": ("tpu-v5p-slice", 140)}


def _xpk_topologies(max_cubes: int) -> list[str]:
    out = ["2x2x1", "2x2x2", "2x2x4", "2x4x4"]
    for x in range(4, 257, 4):
        for y in range(x, 257, 4):
            for z in range(y, 257, 4):
                if (x // 4) * (y // 4) * (z // 4) <= max_cubes:
                    out.append(f"{x}x{y}x{z}")
    return out


def xpk_num_slices(device_type: str, num_slices: int) -> dict:
    prefix, _, cores = device_type.rpartition("-")
    accelerator, max_cubes = _XPK_TPU[prefix]
    chips = int(cores) // 2
    (topology,) = [
        t
        for t in _xpk_topologies(max_cubes)  # exactly one topology has this many chips here
        if math.prod(int(d) for d in t.split("x")) == chips
    ]
    chips_per_vm = 1 if chips == 1 else 4
    vms = chips // chips_per_vm
    return {
        "accelerator": accelerator,
        "topology": topology,
        "parallelism": vms,
        "completions": vms,
        "replicas": num_slices,
        "tpus_per_pod": chips_per_vm,
    }


@pytest.mark.parametrize("device", MULTISLICE)
def test_two_slice_goldens_match_xpk(device):
    js = yaml.safe_load((GOLDENS / f"2x{device}-stage1.yaml").read_text())
    job, pod = _job(js), _pod(js)
    ours = {
        "accelerator": pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"],
        "topology": pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"],
        "parallelism": job["parallelism"],
        "completions": job["completions"],
        "replicas": js["spec"]["replicatedJobs"][0]["replicas"],
        "tpus_per_pod": pod["containers"][0]["resources"]["limits"]["google.com/tpu"],
    }
    assert ours == xpk_num_slices(device, 2)
    assert pod["containers"][0]["resources"]["requests"]["google.com/tpu"] == ours["tpus_per_pod"]


def test_xpk_port_agrees_with_its_own_examples():
    # XPK's recipes/Workload_create.md (--tpu-type=v5p-8 --num-slices=1): accelerator tpu-v5p-slice,
    # topology 2x2x1, parallelism 1, google.com/tpu 4.
    assert xpk_num_slices("v5p-8", 1) == {
        "accelerator": "tpu-v5p-slice",
        "topology": "2x2x1",
        "parallelism": 1,
        "completions": 1,
        "replicas": 1,
        "tpus_per_pod": 4,
    }
    assert xpk_num_slices("tpu7x-128", 2)["topology"] == "4x4x4"
    assert xpk_num_slices("v5p-256", 2)["topology"] == "4x4x8"


def test_dry_run_prints_the_multislice_jobset(env):
    p = cli(
        [
            "submit",
            "--stage",
            "1",
            "--device",
            "tpu7x-128",
            "--slices",
            "2",
            *SITE,
            "--dry-run",
            "-o",
            "yaml",
        ],
        env,
    )
    assert p.returncode == 0, p.stderr
    js = yaml.safe_load(p.stdout)
    assert js["spec"]["replicatedJobs"][0]["replicas"] == 2 and schema_errors(js) == []
    for bad, what in (
        (["--device", "v5p-8", "--slices", "2"], "single-host"),
        (["--device", "tpu7x-128", "--slices", "0"], "--slices"),
        (["--device", "v5p-256", "--slices", "3"], "cannot be split"),
    ):
        p = cli(["submit", "--stage", "1", *bad, *SITE, "--dry-run"], env)
        assert p.returncode == 2 and what in p.stderr and p.stdout == "", (bad, p.stderr)


def test_values_never_break_the_manifest(env):
    # Characters that would break a string-formatted YAML template land verbatim in the right field.
    root = "gs://b/we'ird: {x} #not-a-comment\" - injected: [true]"
    p = cli(
        [
            "submit",
            "--stage",
            "2",
            "--device",
            "v5p-256",
            "--dry-run",
            "--run-root",
            root,
            "--image",
            "img:tag@sha256:abc",
            "-o",
            "json",
        ],
        env,
    )
    assert p.returncode == 0, p.stderr
    js = json.loads(p.stdout)
    cmd = _pod(js)["containers"][0]["command"]
    assert cmd[cmd.index("--run-dir") + 1] == root + "/olmo3-7b-stage2"
    p = cli(
        [
            "submit",
            "--stage",
            "2",
            "--device",
            "v5p-256",
            "--dry-run",
            "--run-root",
            root,
            "--image",
            "img:tag@sha256:abc",
        ],
        env,
    )
    assert yaml.safe_load(p.stdout) == js  # YAML and JSON carry the same object


def test_output_manifest_file_and_placeholder_notes(env, tmp_path):
    out = tmp_path / "jobset.yaml"
    p = cli(
        ["submit", "--stage", "1", "--device", "tpu7x-128", "--dry-run", "--output-manifest", str(out)], env
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == ""
    js = yaml.safe_load(out.read_text())
    assert schema_errors(js) == []
    cmd = _pod(js)["containers"][0]["command"]
    assert cmd[cmd.index("--run-dir") + 1] == "gs://YOUR-BUCKET/runs/olmo3-7b-stage1"
    assert "placeholder" in p.stderr and "run_root" in p.stderr


def test_local_device_and_local_run_root_are_refused():
    smoke, cpu = load_recipe("smoke"), get_device("cpu-4")
    with pytest.raises(BadInput, match="local device"):
        render_jobset(smoke, make_plan(smoke, cpu), cpu, Settings(), "smoke", 1, "gs://b/r/smoke")
    with pytest.raises(BadInput, match="not on GCS"):
        _render(run_dir="/tmp/runs/x")


# ---------------------------------------------------------------- names


def test_jobset_name_short_and_long():
    assert jobset_name("olmo3-7b-s1", 3) == "olmo3-7b-s1-a3"
    long_a = "olmo3-7b-stage1-ironwood-tpu7x-512-resume-from-step-1000000"
    long_b = long_a.replace("1000000", "2000000")
    for run in (long_a, long_b, "a" * 63):
        for attempt in (1, 12, 12345):
            name = jobset_name(run, attempt)
            assert len(name) <= 40 and _DNS1035.match(name), name
            assert name.endswith(f"-a{attempt}")
    assert jobset_name(long_a, 1) != jobset_name(long_b, 1)  # same 30-character start, different runs
    assert jobset_name(long_a, 1)[:-3] == jobset_name(long_a, 2)[:-3]  # attempts of a run sort together
    assert len(jobset_name("r" * 35, 1)) == 38  # fits: not shortened
    assert jobset_name("r" * 35, 1) == "r" * 35 + "-a1"


@pytest.mark.parametrize("run", ["Olmo", "olmo_7b", "7b-olmo", "olmo-", "", "a" * 64, "olmo.7b", "olmo 7b"])
def test_invalid_run_names(run):
    with pytest.raises(BadInput):
        validate_run_name(run)
    with pytest.raises(BadInput):
        jobset_name(run, 1)


# ---------------------------------------------------------------- start-up cost


def test_dry_run_imports_nothing_heavy(tmp_path):
    code = (
        "import sys\n"
        "from olmo_ctl.cli import main\n"
        "rc = main(['submit', '--stage', '1', '--device', 'tpu7x-128', '--dry-run', '--output-manifest', "
        f"{str(tmp_path / 'm.yaml')!r}])\n"
        "heavy = [m for m in ('jax', 'kubernetes', 'google.cloud.storage', 'tensorboard', 'torch', 'jsonschema')"
        " if m in sys.modules]\n"
        "print(rc, heavy)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_env(tmp_path),
        timeout=60,
    )
    assert p.stdout.strip() == "0 []", p.stdout + p.stderr


# ---------------------------------------------------------------- `make goldens`


def regenerate() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        env = clean_env(Path(tmp))
        GOLDENS.mkdir(exist_ok=True)
        cases = golden_cases()
        for stale in GOLDENS.glob("*.yaml"):
            if stale.stem not in cases:
                stale.unlink()
        for case, args in sorted(cases.items()):
            text = render_golden(args, env)
            errs = schema_errors(yaml.safe_load(text)) + metadata_errors(yaml.safe_load(text))
            if errs:
                raise SystemExit(f"{case}: {len(errs)} schema errors, first: {errs[0]}")
            (GOLDENS / f"{case}.yaml").write_text(text)
            print(f"wrote tests/goldens/{case}.yaml (0 schema errors)")


if __name__ == "__main__":
    regenerate()
