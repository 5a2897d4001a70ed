"""Capacity and placement as XPK offers them: capacity types, the site's extra pod fields, slices named
by topology, and doctor's checks of the service account and the capacity type's prerequisites.

XPK's facts are ported here with their source (XPK at v1.9+, `src/xpk/core/capacity.py`
`get_capacity_node_selectors_from_capacity_type`; `src/xpk/core/system_characteristics.py`
`generate_tpu_topologies`; `src/xpk/templates/kueue_config.yaml.j2` for flex-start's admission check).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import yaml
from helpers.cli import clean_env, invoke

from olmo_ctl.backends.doctor import run_checks, submit_checks
from olmo_ctl.backends.kube import make_api_client
from olmo_ctl.core.config import Settings
from olmo_ctl.core.devices import GENERATIONS, get_device, topology_problem
from olmo_ctl.core.errors import BadInput
from olmo_ctl.sandbox.sandbox import Sandbox

GOLDENS = Path(__file__).resolve().parent / "goldens"
IMAGE = "us-docker.pkg.dev/p/r/olmo-ctl:0.1.0"
DEVICE_KEYS = ("cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology")


# XPK's `get_capacity_node_selectors_from_capacity_type`: the node selector text per capacity type
# (ON_DEMAND: none; a reservation in the cluster's own project: its name).
def xpk_capacity_node_selector(capacity_type: str, reservation: str | None = None) -> dict[str, str]:
    text = {
        "ON_DEMAND": "",
        "FLEX_START": 'cloud.google.com/gke-queued: "true"',
        "SPOT": 'cloud.google.com/gke-spot: "true"',
        "RESERVATION": f"cloud.google.com/reservation-name: {reservation}",
    }[capacity_type]
    return yaml.safe_load(text) or {}


# XPK's `generate_tpu_topologies(max_cubes)`.
def xpk_topologies(max_cubes: int) -> set[str]:
    out = {"2x2x1", "2x2x2", "2x2x4", "2x4x4"}
    for x in range(4, 257, 4):
        for y in range(x, 257, 4):
            for z in range(y, 257, 4):
                if (x // 4) * (y // 4) * (z // 4) <= max_cubes:
                    out.add(f"{x}x{y}x{z}")
    return out


def _pod(js: dict) -> dict:
    return js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    "golden,xpk",
    [
        ("tpu7x-128-stage1", ("ON_DEMAND", None)),
        ("v5p-256-stage1", ("ON_DEMAND", None)),
        ("tpu7x-128-stage1-spot", ("SPOT", None)),
        ("tpu7x-128-stage1-flex-start", ("FLEX_START", None)),
        ("v5p-256-stage1-reservation", ("RESERVATION", "olmo-v5p")),
    ],
)
def test_capacity_goldens_select_the_nodes_xpk_selects(golden, xpk):
    pod = _pod(yaml.safe_load((GOLDENS / f"{golden}.yaml").read_text()))
    selector = {k: v for k, v in pod["nodeSelector"].items() if k not in DEVICE_KEYS}
    selector.pop("cloud.google.com/placement-policy-name", None)
    assert selector == xpk_capacity_node_selector(*xpk)
    assert pod["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]


# XPK's 2D shapes (src/xpk/core/system_characteristics.py): v6e's on ct6e-standard-4t are `2x2` plus
# its SUB_SLICING_TOPOLOGIES; v5litepod's are listed by hand there.
XPK_2D = {
    "v6e": {"2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"},
    "v5e": {"2x4", "4x4", "4x8", "8x8", "8x16", "16x16"},
}


@pytest.mark.parametrize("generation", sorted(XPK_2D))
def test_2d_slices_are_exactly_xpks(generation):
    gen = GENERATIONS[generation]
    axes = [1, 2, *range(4, 33, 4)]
    ours = {f"{x}x{y}" for x in axes for y in axes if topology_problem(gen, f"{x}x{y}") is None}
    assert ours == XPK_2D[generation] and topology_problem(gen, "2x2x1") is not None
    for t in ours:  # each shape is one slice, named by its chips (one TensorCore each)
        d = get_device(f"{gen.device_prefix}-{t}")
        chips = math.prod(int(a) for a in t.split("x"))
        assert (d.name, d.topology, d.chips, d.vms, d.chips_per_vm) == (
            f"{gen.device_prefix}-{chips}",
            t,
            chips,
            chips // 4,
            4,
        )


@pytest.mark.parametrize("generation", sorted(g for g in GENERATIONS if not GENERATIONS[g].topologies))
def test_slices_named_by_topology_are_exactly_xpks(generation):
    gen = GENERATIONS[generation]
    xpk = xpk_topologies(gen.max_cubes)
    ours = set()
    for x in [1, 2, *range(4, 257, 4)]:
        for y in [1, 2, *range(4, 257, 4)]:
            for z in [1, 2, *range(4, 257, 4)]:
                if (x // 4 or 1) * (y // 4 or 1) * (z // 4 or 1) <= gen.max_cubes + 4:
                    t = f"{x}x{y}x{z}"
                    if topology_problem(gen, t) is None:
                        ours.add(t)
    assert ours == xpk
    for t in ("4x4x12", "4x8x12"):
        d = get_device(f"{generation}-{t}")
        chips = math.prod(int(a) for a in t.split("x"))
        assert (d.name, d.topology, d.chips, d.vms, d.chips_per_vm) == (
            f"{generation}-{t}",
            t,
            chips,
            chips // 4,
            4,
        )
        assert d.devices == chips * gen.devices_per_chip
    # one name per slice: a shape the doubling rule gives is its size name
    assert get_device(f"{generation}-4x4x8").name == f"{generation}-256"


def test_the_topology_named_golden_is_the_slice_xpk_renders():
    js = yaml.safe_load((GOLDENS / "v5p-4x4x12-smoke.yaml").read_text())
    job, pod = js["spec"]["replicatedJobs"][0]["template"]["spec"], _pod(js)
    # XPK: v5p-4x4x12 -> tpu-v5p-slice, 4x4x12, 48 VMs of 4 chips
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5p-slice"
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4x12"
    assert (job["parallelism"], job["completions"]) == (48, 48)
    assert pod["containers"][0]["resources"]["limits"]["google.com/tpu"] == 4
    assert js["metadata"]["labels"]["olmo-ctl/device"] == "v5p-4x4x12"


def test_a_size_that_is_no_power_of_two_names_its_shapes():
    with pytest.raises(BadInput) as e:
        get_device("v5p-384")
    assert "384 TensorCores is v5p-4x4x12" in e.value.one_line()
    with pytest.raises(BadInput) as e:
        get_device("tpu7x-768")
    assert "tpu7x-4x8x12 or tpu7x-4x4x24" in e.value.one_line()  # the most cube-like first
    with pytest.raises(BadInput, match="axes go from smallest to largest"):
        get_device("v5p-4x12x4")
    with pytest.raises(BadInput, match="at most 140 4x4x4 cubes"):
        get_device("v5p-24x24x24")


# ---------------------------------------------------------------- the site's extra pod fields


def _dry_run(tmp_path: Path, *args: str, **env: str):
    e = {**clean_env(tmp_path), "OLMO_CTL_IMAGE": IMAGE, **env}
    return invoke(
        "submit",
        "--stage",
        "1",
        "--device",
        "v5p-256",
        "--run-root",
        "gs://b/runs",
        "--dry-run",
        *args,
        env=e,
    )


def test_site_pod_fields_are_rendered(tmp_path):
    (tmp_path / "olmo-ctl").mkdir()
    (tmp_path / "olmo-ctl" / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "capacity": "spot",
                "node_selectors": {"cloud.google.com/gke-nodepool": "tpu-a"},
                "tolerations": [
                    {
                        "key": "cloud.google.com/gke-spot",
                        "operator": "Equal",
                        "value": "true",
                        "effect": "NoSchedule",
                    }
                ],
                "pod_annotations": {"example.com/team": "pretraining"},
                "image_pull_secrets": ["regcred"],
                "pod_priority_class": "high",
                "ttl_seconds_after_finished": 3600,
            }
        )
    )
    p = _dry_run(tmp_path)
    assert p.returncode == 0, p.stderr
    js = yaml.safe_load(p.stdout)
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    spec = pod["spec"]
    assert spec["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "4x4x8",
        "cloud.google.com/gke-spot": "true",
        "cloud.google.com/gke-nodepool": "tpu-a",
    }
    assert spec["tolerations"][1] == {
        "key": "cloud.google.com/gke-spot",
        "operator": "Equal",
        "value": "true",
        "effect": "NoSchedule",
    }
    assert pod["metadata"]["annotations"] == {"example.com/team": "pretraining"}
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["priorityClassName"] == "high"
    assert js["spec"]["ttlSecondsAfterFinished"] == 3600
    # the flag wins over the file, and the capacity type is the run's: recorded with each attempt
    p = _dry_run(tmp_path, "--capacity", "reservation:v5p-block")
    sel = yaml.safe_load(p.stdout)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert sel["nodeSelector"]["cloud.google.com/reservation-name"] == "v5p-block"
    assert "cloud.google.com/gke-spot" not in sel["nodeSelector"]


@pytest.mark.parametrize(
    "args,env,message",
    [
        (("--capacity", "preemptible"), {}, "`preemptible` is not a capacity type"),
        (("--capacity", "reservation:"), {}, "`reservation:` does not name a reservation"),
        ((), {"OLMO_CTL_NODE_SELECTORS": "{cloud.google.com/gke-spot: 'true'}"}, "is set by olmo-ctl"),
        (
            (),
            {"OLMO_CTL_TOLERATIONS": "[{key: a, operator: Exists, value: b}]"},
            "operator Exists takes no value",
        ),
        ((), {"OLMO_CTL_TOLERATIONS": "{key: a}"}, "must be a list"),
        ((), {"OLMO_CTL_TTL_SECONDS_AFTER_FINISHED": "60"}, "is not a number of seconds >= 600"),
        ((), {"OLMO_CTL_IMAGE_PULL_SECRETS": "[Reg_Cred]"}, "is not a valid Secret name"),
        ((), {"OLMO_CTL_POD_ANNOTATIONS": "[a]"}, "must be a mapping"),
    ],
)
def test_bad_site_fields_are_one_line_and_exit_2(tmp_path, args, env, message):
    p = _dry_run(tmp_path, *args, **env)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stdout == ""


# ---------------------------------------------------------------- doctor


@pytest.fixture
def box():
    with Sandbox(slices={"tpu7x-128": 1}, priority_classes={"high": 750}) as sb:
        yield sb


def _checks(box, **kw) -> dict:
    settings = Settings(image=IMAGE, **kw)
    return {c.name: c for c in run_checks(make_api_client(host=box.url), settings, get_device("tpu7x-128"))}


def test_doctor_checks_the_service_account_and_its_workload_identity(box):
    checks = _checks(box)
    assert checks["service-account"].ok
    assert (
        "default/olmo-ctl -> olmo-ctl@sandbox-project.iam.gserviceaccount.com"
        in checks["service-account"].message
    )
    # XPK's clusters have no `olmo-ctl` account: every pod would be refused, so doctor fails and submit
    # refuses before anything is created
    checks = _checks(box, service_account="trainer")
    assert not checks["service-account"].ok
    assert "service account default/trainer does not exist" in checks["service-account"].message
    with pytest.raises(BadInput, match="service account default/trainer does not exist"):
        submit_checks(
            make_api_client(host=box.url),
            Settings(image=IMAGE, service_account="trainer"),
            get_device("tpu7x-128"),
        )
    assert box.server.count("POST", "/jobsets") == 0
    # an account without the Workload Identity annotation is a warning
    with box.server.store.lock:
        box.world.ensure_service_account("plain")
    checks = _checks(box, service_account="plain")
    assert checks["service-account"].ok and checks["service-account"].message.startswith("warning: ")
    assert "iam.gke.io/gcp-service-account" in checks["service-account"].message


def test_the_test_cluster_refuses_pods_of_a_missing_service_account(box):
    """The ServiceAccount admission rule the doctor check guards against, as the Job controller meets it."""
    pod = {"metadata": {"name": "p", "namespace": "default"}, "spec": {"serviceAccountName": "trainer"}}
    assert box.world.refuse_pod(pod) == (
        'error looking up service account default/trainer: serviceaccount "trainer" not found'
    )
    assert box.world.refuse_pod({**pod, "spec": {"serviceAccountName": "olmo-ctl"}}) is None
    assert box.world.refuse_pod({**pod, "spec": {}}) is None  # `default` exists in every namespace


def test_doctor_checks_what_the_capacity_type_needs(box):
    # spot: the node pools must be spot ones (the sandbox's are on-demand)
    checks = _checks(box, capacity="spot")
    assert not checks["node-pools"].ok
    assert "cloud.google.com/gke-spot=true" in checks["node-pools"].message
    # flex-start: Kueue's ProvisioningRequest admission check on the ClusterQueue, as XPK sets it up
    checks = _checks(box, capacity="flex-start")
    assert not checks["capacity"].ok
    assert "has no kueue.x-k8s.io/provisioning-request admission check" in checks["capacity"].message
    with box.server.store.lock:
        box.world.save(
            "AdmissionCheck",
            {
                "metadata": {"name": "dws-prov"},
                "spec": {
                    "controllerName": "kueue.x-k8s.io/provisioning-request",
                    "parameters": {
                        "apiGroup": "kueue.x-k8s.io",
                        "kind": "ProvisioningRequestConfig",
                        "name": "dws-config",
                    },
                },
            },
            new=True,
        )
        cq = box.world.get("ClusterQueue", "", "cluster-queue")
        cq["spec"]["admissionChecks"] = ["dws-prov"]
        box.world.save("ClusterQueue", cq)
    checks = _checks(box, capacity="flex-start")
    assert checks["capacity"].ok, checks["capacity"].message
    assert "AdmissionCheck dws-prov" in checks["capacity"].message
    assert _checks(box)["capacity"].ok  # on-demand needs nothing more


def test_doctor_warns_of_two_flavors_whose_node_labels_a_readmitted_jobset_would_both_keep(box):
    """JobSet's resumeJob merges node selectors and never removes one (jobset#1294): a second flavor
    for the same slice with a node-label key the first lacks (spot beside on-demand) is a warning
    naming both flavors and the key; a second flavor with the same keys is not."""
    from olmo_ctl.sandbox.sandbox import CLUSTER_QUEUE, flavor_labels

    dev = get_device("tpu7x-128")

    def add_flavor(name: str, labels: dict) -> None:
        with box.server.store.lock:
            box.world.save(
                "ResourceFlavor", {"metadata": {"name": name}, "spec": {"nodeLabels": labels}}, new=True
            )
            cq = copy.deepcopy(box.world.get("ClusterQueue", "", CLUSTER_QUEUE))
            cq["spec"]["resourceGroups"][0]["flavors"].append(
                {"name": name, "resources": [{"name": "google.com/tpu", "nominalQuota": "64"}]}
            )
            box.world.save("ClusterQueue", cq)

    assert _checks(box)["resource-flavor"].message.startswith("ResourceFlavor 1xtpu7x-128 ")
    add_flavor("tpu7x-128-same-keys", flavor_labels(dev))
    check = _checks(box)["resource-flavor"]
    assert check.ok and not check.message.startswith("warning"), check.message
    add_flavor("tpu7x-128-spot", {**flavor_labels(dev), "cloud.google.com/gke-spot": "true"})
    check = _checks(box)["resource-flavor"]
    assert check.ok and check.message.startswith("warning: "), check.message
    assert "ResourceFlavor tpu7x-128-spot or 1xtpu7x-128" in check.message
    assert "cloud.google.com/gke-spot are not 1xtpu7x-128's" in check.message
    assert "jobset/pull/1294" in check.message
