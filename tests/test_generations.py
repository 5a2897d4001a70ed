"""An accelerator generation is one profile: the shipped profiles, and a new generation added with a
profile and a launch template alone.

`tpu9z` is made up: registered for one test (monkeypatch of `core.generations.GENERATIONS`) with its
template in a temporary directory. The catalog, `plan`, `submit --dry-run`, the pods' and preflight's
XLA flags, preflight's HBM verdict and the trainer's splash blocks and device-kind match all take
it, with no other file touched.
"""

from __future__ import annotations

import json

import pytest
import yaml
from helpers.cli import clean_env, invoke

from olmo_ctl.backends.jobset import launch_template, template_path
from olmo_ctl.core.devices import get_device, tpu_catalog
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.generations import (
    DEFAULT_SPLASH_BLOCKS,
    GENERATIONS,
    GIB,
    Generation,
    generation_of_device_kind,
    splash_blocks_of,
)
from olmo_ctl.core.xla_flags import libtpu_init_args, xla_flag_sources, xla_flags_for

SITE = [
    "--namespace",
    "olmo",
    "--queue",
    "tpu-queue",
    "--image",
    "us-docker.pkg.dev/example-project/olmo-ctl/olmo-ctl:0.1.0",
    "--run-root",
    "gs://example-bucket/runs",
    "--placement-policy",
    "olmo-{topology}",
]
TPU9Z_FLAGS = ("--xla_tpu_enable_async_collective_fusion=true", "--xla_tpu_scoped_vmem_limit_kib=65536")


@pytest.fixture
def tpu9z(monkeypatch, tmp_path):
    """A made-up generation: 4 chips per VM, 2 devices per chip, at most 8 cubes, its own flags,
    blocks and compiler HBM, and a launch template of its own outside launch_templates/."""
    template = tmp_path / "launch-templates" / "tpu9z.yaml"
    template.parent.mkdir()
    template.write_text(
        "# tpu9z: multi-host node pools carry a placement policy.\nvars:\n  placement_policy: multi-host\n"
    )
    gen = Generation(
        name="tpu9z",
        devices_per_chip=2,
        max_cubes=8,
        accelerator_label="tpu9z-accel",
        machine_type="tpu9z-standard-4t",
        peak_tflops_per_chip=3000.0,
        hbm_gib_per_chip=256.0,
        compiler_hbm_gib=120.0,
        device_kinds=("TPU9z",),
        xla_flags=TPU9Z_FLAGS,
        splash_blocks=(4096, 4096, 1024),
        template=str(template),
    )
    monkeypatch.setitem(GENERATIONS, "tpu9z", gen)
    return gen


@pytest.fixture
def env(tmp_path):
    return clean_env(tmp_path / "xdg")


def test_shipped_profiles_name_their_templates_and_keep_their_numbers():
    assert sorted(GENERATIONS) == ["tpu7x", "v5e", "v5p", "v6e"]
    for gen in GENERATIONS.values():
        assert template_path(gen.name).name == f"{gen.name}.yaml" and template_path(gen.name).exists()
        assert "xla_flags" not in launch_template(gen.name)["vars"]  # the profile's, not the template's
    t, v = GENERATIONS["tpu7x"], GENERATIONS["v5p"]
    assert (t.splash_blocks, v.splash_blocks) == ((2048, 2048, 512), (1024, 1024, 512))
    assert (t.compiler_hbm_bytes, v.compiler_hbm_bytes) == (int(94.75 * GIB), int(95.74 * GIB))
    assert (t.peak_tflops_per_chip, v.peak_tflops_per_chip, t.hbm_gib_per_chip, v.hbm_gib_per_chip) == (
        2307.0,
        459.0,
        192.0,
        95.0,
    )


def test_v6e_and_v5e_profiles_keep_xpks_facts_and_their_numbers():
    """XPK's src/xpk/core/system_characteristics.py: `v6e` on tpu-v6e-slice / ct6e-standard-4t and
    `v5litepod` on tpu-v5-lite-podslice / ct5lp-hightpu-4t, one TensorCore per chip, 2D topologies."""
    v6e, v5e = GENERATIONS["v6e"], GENERATIONS["v5e"]
    assert (v6e.device_prefix, v6e.accelerator_label, v6e.machine_type) == (
        "v6e",
        "tpu-v6e-slice",
        "ct6e-standard-4t",
    )
    assert (v5e.device_prefix, v5e.accelerator_label, v5e.machine_type) == (
        "v5litepod",
        "tpu-v5-lite-podslice",
        "ct5lp-hightpu-4t",
    )
    assert v6e.topologies == ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
    assert v5e.topologies == ("2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
    assert (
        v6e.tensorcores_per_chip,
        v5e.tensorcores_per_chip,
        v6e.devices_per_chip,
        v5e.devices_per_chip,
    ) == (
        1,
        1,
        1,
        1,
    )
    assert (
        v6e.peak_tflops_per_chip,
        v6e.hbm_gib_per_chip,
        v5e.peak_tflops_per_chip,
        v5e.hbm_gib_per_chip,
    ) == (
        918.0,
        32.0,
        197.0,
        16.0,
    )
    assert v6e.xla_flags[0] == "--xla_tpu_scoped_vmem_limit_kib=98304"
    assert v5e.xla_flags == GENERATIONS["v5p"].xla_flags


@pytest.mark.parametrize(
    ("device", "accelerator", "topology", "vms"),
    [("v6e-256", "tpu-v6e-slice", "16x16", 64), ("v5litepod-16", "tpu-v5-lite-podslice", "4x4", 4)],
)
def test_v6e_and_v5e_are_planned_and_rendered_like_v5p(env, device, accelerator, topology, vms):
    batch = ["--set", "train.global_batch=256", "--set", "eval.batch_size=256"]  # a share for every host
    p = invoke("plan", "--recipe", "smoke", "--device", device, *batch, "-o", "json", env=env)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["devices"] == vms * 4
    p = invoke("submit", "--recipe", "smoke", "--device", device, *batch, *SITE, "--dry-run", env=env)
    assert p.returncode == 0, p.stderr
    js = yaml.safe_load(p.stdout)
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {  # no placement policy: the template's `never`, as v5p's
        "cloud.google.com/gke-tpu-accelerator": accelerator,
        "cloud.google.com/gke-tpu-topology": topology,
    }
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["google.com/tpu"] == 4
    assert (job["parallelism"], job["completions"]) == (vms, vms)
    env_vars = {e["name"]: e["value"] for e in container["env"]}
    gen = get_device(device).generation
    assert env_vars["LIBTPU_INIT_ARGS"] == " ".join(GENERATIONS[gen].xla_flags)


@pytest.mark.parametrize(
    ("kind", "generation"),
    [
        ("TPU7x", "tpu7x"),
        ("TPU v5", "v5p"),
        ("TPU v5p", "v5p"),
        ("TPU v5 lite", "v5e"),
        ("TPU v6 lite", "v6e"),
        ("TPU v4", None),
    ],
)
def test_a_device_kind_is_the_generation_whose_profile_names_it(kind, generation):
    assert generation_of_device_kind(kind) == generation
    expected = GENERATIONS[generation].splash_blocks if generation else DEFAULT_SPLASH_BLOCKS
    assert splash_blocks_of(generation or "") == expected


def test_a_new_generation_is_in_the_catalog(tpu9z, env):
    names = [d.name for d in tpu_catalog("tpu9z")]
    assert names[0] == "tpu9z-8" and "tpu9z-8192" in names
    dev = get_device("tpu9z-16")
    assert (dev.topology, dev.chips, dev.vms, dev.devices) == ("2x2x2", 8, 2, 16)
    assert (dev.peak_tflops_per_device, dev.hbm_gib_per_device, dev.accelerator_label) == (
        1500.0,
        128.0,
        "tpu9z-accel",
    )
    assert get_device("tpu9z-4x4x8").name == "tpu9z-256"  # the doubling rule's shape has one name
    with pytest.raises(BadInput, match="at most 8 4x4x4 cubes"):
        get_device("tpu9z-8x8x12")

    p = invoke("devices", "--generation", "tpu9z", "-o", "json", env=env)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)[1]["name"] == "tpu9z-16"
    p = invoke("devices", env=env)
    assert p.returncode == 0, p.stderr
    assert "tpu9z: GKE accelerator tpu9z-accel, machine type tpu9z-standard-4t" in p.stdout
    assert "at most 8 cubes of 4x4x4" in p.stdout
    p = invoke("devices", "--generation", "tpu9y", env=env)
    assert p.returncode == 2 and "use tpu7x, v5p, v6e, v5e, tpu9z, cpu or gpu" in p.stderr


def test_a_new_generation_is_planned(tpu9z, env):
    p = invoke("plan", "--recipe", "smoke", "--device", "tpu9z-16", "-o", "json", env=env)
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert plan["device"] == "tpu9z-16" and plan["devices"] == 16


def test_a_new_generation_is_rendered_from_its_own_template(tpu9z, env):
    p = invoke("submit", "--recipe", "smoke", "--device", "tpu9z-16", *SITE, "--dry-run", env=env)
    assert p.returncode == 0, p.stderr
    js = yaml.safe_load(p.stdout)
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu9z-accel",
        "cloud.google.com/gke-tpu-topology": "2x2x2",
        "cloud.google.com/placement-policy-name": "olmo-2x2x2",  # the template's multi-host policy
    }
    (container,) = pod["containers"]
    env_vars = {e["name"]: e["value"] for e in container["env"]}
    assert env_vars["LIBTPU_INIT_ARGS"] == " ".join(TPU9Z_FLAGS)
    assert container["resources"]["limits"]["google.com/tpu"] == 4
    assert js["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 2


def test_preflight_takes_a_new_generations_flags_and_hbm(tpu9z, monkeypatch):
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.preflight import compile as pf
    from olmo_ctl.preflight import flags as flags_lib

    dev = get_device("tpu9z-16")
    recipe = load_recipe(recipe="smoke")
    assert (
        xla_flags_for(dev, recipe, None) == list(TPU9Z_FLAGS) == libtpu_init_args(dev, recipe, None).split()
    )
    assert xla_flag_sources(dev, None, None)["xla_tpu_scoped_vmem_limit_kib"] == (
        "65536",
        "generation tpu9z (core/generations.py)",
    )
    seen = []

    def check(libtpu_args, topology):  # libtpu's verdict, without libtpu: every flag per compile
        seen.append((libtpu_args, topology))
        return tuple(f[2:].split("=")[0] for f in libtpu_args.split()), ()

    monkeypatch.setattr(flags_lib, "check", check)
    flags, options = pf.pod_xla_flags(recipe, dev, None)
    assert flags == list(TPU9Z_FLAGS) and seen == [(" ".join(TPU9Z_FLAGS), "tpu9z:2x2x2")]
    assert options == {
        "xla_tpu_enable_async_collective_fusion": "true",
        "xla_tpu_scoped_vmem_limit_kib": "65536",
    }
    assert pf.usable_hbm_bytes(dev) == 120 * GIB  # the compiler's, below the catalog's 128 GiB


def test_the_trainer_knows_a_new_generation_by_its_device_kind(tpu9z):
    from olmo_ctl.trainer import attention as A

    assert generation_of_device_kind("TPU9z") == "tpu9z"

    assert A.splash_blocks("tpu9z", 8192) == ((4096, 4096, 1024), 8192)
