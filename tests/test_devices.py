"""Device catalog: rows pinned from the GKE TPU tables, name parsing, and `olmo-ctl devices`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from olmo_ctl.core.devices import get_device, gpu_catalog, local_catalog, tpu_catalog
from olmo_ctl.core.errors import BadInput

ROOT = Path(__file__).resolve().parent.parent

# suffix -> (topology, chips, VMs): the GKE TPU slice table (Google Cloud's TPU docs), same for both
# generations.
REFERENCE = {
    8: ("2x2x1", 4, 1),
    16: ("2x2x2", 8, 2),
    32: ("2x2x4", 16, 4),
    64: ("2x4x4", 32, 8),
    128: ("4x4x4", 64, 16),
    256: ("4x4x8", 128, 32),
    512: ("4x8x8", 256, 64),
    1024: ("8x8x8", 512, 128),
    2048: ("8x8x16", 1024, 256),
    4096: ("8x16x16", 2048, 512),
    8192: ("16x16x16", 4096, 1024),
}


# generation -> {name: (topology, chips, VMs)}: XPK's v6e (ct6e-standard-4t) and v5litepod rows
# (src/xpk/core/system_characteristics.py: one TensorCore per chip, so the name counts chips; 4 chips
# per VM).
REFERENCE_2D = {
    "v6e": {
        "v6e-4": ("2x2", 4, 1),
        "v6e-8": ("2x4", 8, 2),
        "v6e-16": ("4x4", 16, 4),
        "v6e-32": ("4x8", 32, 8),
        "v6e-64": ("8x8", 64, 16),
        "v6e-128": ("8x16", 128, 32),
        "v6e-256": ("16x16", 256, 64),
    },
    "v5e": {
        "v5litepod-8": ("2x4", 8, 2),
        "v5litepod-16": ("4x4", 16, 4),
        "v5litepod-32": ("4x8", 32, 8),
        "v5litepod-64": ("8x8", 64, 16),
        "v5litepod-128": ("8x16", 128, 32),
        "v5litepod-256": ("16x16", 256, 64),
    },
}


@pytest.mark.parametrize(
    "generation,label,machine,peak,hbm",
    [
        ("v6e", "tpu-v6e-slice", "ct6e-standard-4t", 918.0, 32.0),
        ("v5e", "tpu-v5-lite-podslice", "ct5lp-hightpu-4t", 197.0, 16.0),
    ],
)
def test_v6e_and_v5e_match_xpks_rows(generation, label, machine, peak, hbm):
    rows = tpu_catalog(generation)
    assert {d.name: (d.topology, d.chips, d.vms) for d in rows} == REFERENCE_2D[generation]
    for d in rows:
        assert (d.generation, d.chips_per_vm, d.devices) == (generation, 4, d.chips)  # one device a chip
        assert (d.accelerator_label, d.machine_type) == (label, machine)
        assert (d.peak_tflops_per_device, d.hbm_gib_per_device) == (peak, hbm)
        assert d.topology_name == f"{generation}:{d.topology}"  # libtpu's name: `v5e:4x4`
        assert get_device(d.name) == d
        prefix = d.name.rpartition("-")[0]
        assert get_device(f"{prefix}-{d.topology}") == d  # XPK's topology name is the same slice


def test_pinned_rows():
    d = get_device("tpu7x-128")
    assert (d.topology, d.chips, d.vms, d.devices) == ("4x4x4", 64, 16, 128)
    d = get_device("tpu7x-512")
    assert (d.topology, d.devices) == ("4x8x8", 512)
    d = get_device("v5p-256")
    assert (d.topology, d.chips, d.vms, d.devices) == ("4x4x8", 128, 32, 128)
    d = get_device("v5p-8")
    assert (d.topology, d.vms, d.devices) == ("2x2x1", 1, 4)


@pytest.mark.parametrize(
    "generation,devices_per_chip,label,machine",
    [("tpu7x", 2, "tpu7x", "tpu7x-standard-4t"), ("v5p", 1, "tpu-v5p-slice", "ct5p-hightpu-4t")],
)
def test_catalog_matches_reference_table(generation, devices_per_chip, label, machine):
    rows = tpu_catalog(generation)
    assert [d.name for d in rows] == [f"{generation}-{n}" for n in REFERENCE]
    for d in rows:
        topology, chips, vms = REFERENCE[int(d.name.rsplit("-", 1)[1])]
        assert (d.topology, d.chips, d.vms, d.chips_per_vm) == (topology, chips, vms, 4)
        assert d.devices == chips * devices_per_chip
        assert (d.accelerator_label, d.machine_type) == (label, machine)
        assert get_device(d.name) == d


def test_peak_and_hbm_per_device():
    assert get_device("tpu7x-128").peak_tflops_per_device == pytest.approx(2307 / 2)
    assert get_device("tpu7x-128").hbm_gib_per_device == pytest.approx(96)
    assert get_device("v5p-256").peak_tflops_per_device == pytest.approx(459)
    assert get_device("v5p-256").hbm_gib_per_device == pytest.approx(95)


@pytest.mark.parametrize(
    "name",
    [
        "v5p-9",
        "v5p-12",
        "v5p-4",
        "tpu7x-16384",
        "v6e-2",
        "v6e-512",
        "v6e-2x2x1",
        "v5litepod-4",
        "v5litepod-4x4x4",
        "tpu7x",
        "v5p-08",
        "cpu-0",
        "cpu-65",
        "gpu-x",
        "",
        "V5P-8",
    ],
)
def test_unknown_devices_are_bad_input(name):
    with pytest.raises(BadInput) as e:
        get_device(name)
    assert "olmo-ctl devices" in e.value.one_line()


@pytest.mark.parametrize(
    "name, meant",
    [
        ("TPU7X-128", "tpu7x-128"),
        ("V5P-8", "v5p-8"),
        ("tpu-v5p-256", "v5p-256"),
        ("tpuv5p-256", "v5p-256"),
        ("tpu-tpu7x-128", "tpu7x-128"),
        ("TPU-v5p-4X4X12", "v5p-4x4x12"),
        ("CPU-4", "cpu-4"),
        ("V6E-8", "v6e-8"),
        ("v5e-16", "v5litepod-16"),
        ("tpu-v5e-4x8", "v5litepod-32"),
    ],
)
def test_a_name_off_by_case_or_a_tpu_prefix_gets_did_you_mean(name, meant):
    with pytest.raises(BadInput) as e:
        get_device(name)
    assert e.value.exit_code == 2
    assert e.value.one_line() == (
        f"`{name}` is not a device type; did you mean `{meant}`? (device names are lowercase, with no tpu- "
        "prefix; `olmo-ctl devices` lists them)"
    )
    from helpers.cli import invoke

    p = invoke("plan", "--stage", "1", "--device", name)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == f"error: {e.value.one_line()}\n"


def test_local_devices():
    d = get_device("cpu-4")
    assert (d.platform, d.devices, d.vms, d.topology) == ("cpu", 4, 1, None)
    assert not d.is_tpu
    assert {x.name for x in local_catalog()} >= {"cpu-1", "cpu-4", "gpu-8"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    return subprocess.run(
        [sys.executable, "-m", "olmo_ctl", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )


def test_devices_json_contract():
    p = _cli("devices", "-o", "json")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    keys = {
        "name",
        "generation",
        "topology",
        "chips",
        "vms",
        "chips_per_vm",
        "devices",
        "peak_tflops_per_device",
        "hbm_gib_per_device",
    }
    assert all(keys <= set(r) for r in rows)
    by_name = {r["name"]: r for r in rows}
    assert by_name["tpu7x-128"]["devices"] == 128 and by_name["v5p-256"]["vms"] == 32
    assert len(rows) == 2 * len(REFERENCE) + len(REFERENCE_2D["v6e"]) + len(REFERENCE_2D["v5e"]) + len(
        gpu_catalog()
    ) + len(local_catalog())


def test_devices_table_fits_80_columns():
    p = _cli("devices")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    row = next(line for line in lines if line.startswith("v5p-256 "))
    assert row.split() == ["v5p-256", "4x4x8", "128", "32", "4", "128", "459", "95"]
    p = _cli("devices", "--generation", "tpu7x", "-o", "json")
    assert {r["generation"] for r in json.loads(p.stdout)} == {"tpu7x"}


def test_devices_lists_v6e_and_v5e():
    p = _cli("devices")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "v6e: GKE accelerator tpu-v6e-slice, machine type ct6e-standard-4t" in lines
    assert "v5e: GKE accelerator tpu-v5-lite-podslice, machine type ct5lp-hightpu-4t" in lines
    row = next(line for line in lines if line.startswith("v6e-256 "))
    assert row.split() == ["v6e-256", "16x16", "256", "64", "4", "256", "918", "32"]
    row = next(line for line in lines if line.startswith("v5litepod-16 "))
    assert row.split() == ["v5litepod-16", "4x4", "16", "4", "4", "16", "197", "16"]
    for generation in ("v5e", "v5litepod"):  # the generation, or its device-name prefix
        p = _cli("devices", "--generation", generation, "-o", "json")
        assert p.returncode == 0, p.stderr
        assert [r["name"] for r in json.loads(p.stdout)] == list(REFERENCE_2D["v5e"])
