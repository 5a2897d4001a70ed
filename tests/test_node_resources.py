"""The trainer container's CPU and memory: GKE's allocatable rule, the sizes per node type (and the docs'
table of them), the site setting, the rendered pods (Guaranteed: requests equal to limits) and /dev/shm
counted in the memory limit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from helpers.cli import clean_env, invoke

from olmo_ctl.backends.jobset import render_jobset
from olmo_ctl.core.batching import make_plan
from olmo_ctl.core.config import Settings
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.generations import GENERATIONS, GPU_MACHINES
from olmo_ctl.core.node_resources import (
    default_trainer_resources,
    gke_allocatable,
    parse_setting,
    trainer_resources_for,
)
from olmo_ctl.core.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent


def test_gke_allocatable_follows_the_published_reservations():
    # GKE's bands on a 150 GiB machine reserve 9.76 GiB, plus the 100 MiB eviction threshold: 140.1423
    # GiB allocatable (the worked example of hatemosphere/gke-node-allocatable-memory-calculator).
    _, mem_mib = gke_allocatable(8, 150)
    assert abs(mem_mib / 1024 - 140.1423) < 0.001
    # A 4-vCPU node keeps 6% + 1% + 2 x 0.5% of a core: 3920m allocatable (e2-standard-4 on GKE).
    cpu_m, _ = gke_allocatable(4, 16)
    assert cpu_m == 3920
    assert gke_allocatable(1, 0.6)[1] == int(0.6 * 1024 - 255 - 100)  # under 1 GiB: 255 MiB reserved
    # Each band counts: 208 vCPU and 448 GiB (ct5p-hightpu-4t)
    cpu_m, mem_mib = gke_allocatable(208, 448)
    assert cpu_m == 208_000 - (60 + 10 + 10 + 204 * 2.5)
    assert mem_mib == int(448 * 1024 - (4 * 0.25 + 4 * 0.2 + 8 * 0.1 + 112 * 0.06 + 320 * 0.02) * 1024 - 100)


def _docs_table() -> dict[str, tuple[int, int, str, str]]:
    """docs/running-on-gke.md's table: machine -> (vCPU, memory GiB, trainer cpu, trainer memory)."""
    text = (ROOT / "docs" / "running-on-gke.md").read_text()
    section = text.split("## Guaranteed CPU and memory", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\| `([^`]+)` \| `([^`]+)` \| (\d+) \| (\d+) \| (\d+) \| (\d+)Gi \|$", line)
        if m:
            rows[m.group(1)] = (int(m.group(3)), int(m.group(4)), m.group(5), m.group(6) + "Gi")
    return rows


def test_every_profile_has_a_machine_size_and_the_docs_table_is_the_code():
    profiles = {**GENERATIONS, **GPU_MACHINES}
    table = _docs_table()
    assert set(table) == set(profiles)
    for name, prof in profiles.items():
        assert prof.vm_vcpus > 0 and prof.vm_memory_gib > 0, name
        want = default_trainer_resources(prof.vm_vcpus, prof.vm_memory_gib)
        assert table[name] == (prof.vm_vcpus, prof.vm_memory_gib, want["cpu"], want["memory"]), name
        cpu_m, mem_mib = gke_allocatable(prof.vm_vcpus, prof.vm_memory_gib)
        assert int(want["cpu"]) * 1000 <= cpu_m and int(want["memory"][:-2]) * 1024 <= mem_mib


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("auto", "auto"),
        ("OFF", "off"),
        ("cpu=200,memory=400Gi", {"cpu": "200", "memory": "400Gi"}),
        ("cpu=1500m, memory=2Gi", {"cpu": "1500m", "memory": "2Gi"}),
        ("memory=4Gi,cpu=2", {"cpu": "2", "memory": "4Gi"}),
    ],
)
def test_the_setting_parses(value, want):
    assert parse_setting(value, "here") == want


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("lots", "is not a trainer resources setting"),
        ("cpu=200", "is not a trainer resources setting"),
        ("cpu=2,cpu=3", "is not a trainer resources setting"),
        ("cpu=2,memory=4Gi,gpu=1", "is not a trainer resources setting"),
        ("cpu=x,memory=4Gi", "cpu `x` is not a positive Kubernetes quantity"),
        ("cpu=0,memory=4Gi", "cpu `0` is not a positive Kubernetes quantity"),
        ("cpu=2,memory=512Mi", "under 1Gi"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it(value, says):
    with pytest.raises(BadInput, match=re.escape(says)):
        parse_setting(value, "setting `trainer_resources`")


@pytest.mark.parametrize(
    ("quantity", "value"),
    [
        ("1E", 10**18),
        ("100Ti", 100 * 2**40),
        ("2Pi", 2 * 2**50),
        ("1Ei", 2**60),
        ("1e3", 1000),
        ("1E3", 1000),
    ],
)
def test_any_valid_quantity_parses_whatever_its_magnitude(quantity, value):
    from olmo_ctl.core.node_resources import parse_quantity

    assert parse_quantity(quantity) == value
    # Valid: checked against what a node offers, not called "not a quantity".
    assert parse_setting(f"cpu={quantity},memory=100Pi", "here") == {"cpu": quantity, "memory": "100Pi"}
    with pytest.raises(BadInput, match="is more than one tpu7x-standard-4t node offers"):
        trainer_resources_for("tpu7x", f"cpu={quantity},memory=4Gi")  # 223.37 cores allocatable


def test_a_quantity_too_large_for_a_number_says_so():
    with pytest.raises(BadInput, match=re.escape("memory `1e400` is too large for a number")):
        parse_setting("cpu=2,memory=1e400", "setting `trainer_resources`")


def _trainer(js: dict) -> dict:
    return js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][-1]


def _render(device: str, **settings) -> dict:
    recipe, dev = load_recipe("olmo3-7b-stage1"), get_device(device)
    s = Settings(run_root="gs://b/r", **settings)
    return render_jobset(recipe, make_plan(recipe, dev), dev, s, "r", 1, "gs://b/r/r")


def test_tpu_pods_request_what_they_limit_sized_from_the_node_type():
    for device in ("tpu7x-128", "v5p-256", "v6e-256", "v5litepod-256"):
        res = _trainer(_render(device))["resources"]
        want = trainer_resources_for(get_device(device).generation, "auto")
        assert want is not None
        assert res["requests"] == res["limits"] == {"google.com/tpu": 4, **want}, device
    off = _trainer(_render("tpu7x-128", trainer_resources="off"))["resources"]
    assert off == {"requests": {"google.com/tpu": 4}, "limits": {"google.com/tpu": 4}}
    mine = _trainer(_render("tpu7x-128", trainer_resources="cpu=100,memory=500Gi"))["resources"]
    assert mine["requests"] == mine["limits"] == {"google.com/tpu": 4, "cpu": "100", "memory": "500Gi"}


def test_gpu_pods_limit_cpu_and_memory_and_their_requests_follow():
    """As XPK, GPU pods set limits only; Kubernetes defaults each request to its limit."""
    for device in ("h100-mega-80gb-8x2", "h200-141gb-8x2", "b200-8x2"):
        res = _trainer(_render(device))["resources"]
        want = trainer_resources_for(get_device(device).generation, "auto")
        assert "requests" not in res and res["limits"] == {"nvidia.com/gpu": 8, **(want or {})}, device


def test_a_request_larger_than_the_node_offers_is_refused_before_anything_is_rendered():
    with pytest.raises(
        BadInput, match=r"cpu 300 is more than one ct5p-hightpu-4t node offers its pods \(207.41 cores"
    ):
        trainer_resources_for("v5p", "cpu=300,memory=100Gi")
    with pytest.raises(
        BadInput, match=r"memory 2000Gi is more than one a3-megagpu-8g node offers its pods \(1827.7Gi"
    ):
        trainer_resources_for("h100-mega-80gb-8", "cpu=100,memory=2000Gi")
    assert trainer_resources_for("v5p", "cpu=207,memory=432Gi") == {"cpu": "207", "memory": "432Gi"}


def test_a_shm_that_would_take_most_of_the_memory_limit_is_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(
        BadInput, match=r"/dev/shm of 32Gi is more than half the trainer's memory limit of 40Gi"
    ):
        _render("tpu7x-128", trainer_resources="cpu=8,memory=40Gi")
    env = {**clean_env(tmp_path), "OLMO_CTL_TRAINER_RESOURCES": "cpu=8,memory=40Gi"}
    out = tmp_path / "jobset.yaml"
    r = invoke(
        "submit", "--stage", "1", "--device", "v5p-16", "--dry-run", "--run-root", "gs://b/r",
        "--output-manifest", str(out), env=env,
    )  # fmt: skip
    assert r.returncode == 2 and not out.exists()
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "/dev/shm of 32Gi" in errors[0]


def test_the_config_file_takes_off_unquoted(tmp_path):
    (tmp_path / "olmo-ctl").mkdir()
    (tmp_path / "olmo-ctl" / "config.yaml").write_text("trainer_resources: off\n")
    r = invoke("config", "show", "-o", "json", env=clean_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["settings"]["trainer_resources"] == "off"
    (tmp_path / "olmo-ctl" / "config.yaml").write_text(
        "trainer_resources: on\n"
    )  # YAML's true: no meaning here
    r = invoke("config", "show", env=clean_env(tmp_path))
    assert r.returncode == 2 and "`True` is not a trainer resources setting" in r.stderr
