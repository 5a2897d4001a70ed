"""Per-generation XLA flags: the generation profiles' sets, recipe and site overrides, LIBTPU_INIT_ARGS.

Pure (no libtpu): preflight's check of the flags with libtpu is in tests/test_preflight.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from olmo_ctl.backends import resolve_settings
from olmo_ctl.backends.jobset import render_jobset
from olmo_ctl.core.batching import make_plan
from olmo_ctl.core.config import Settings
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.generations import GENERATIONS
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.core.xla_flags import libtpu_init_args, xla_flag_sources, xla_flags_for

SPARSECORE = ("all_gather", "2d_all_gather", "reduce_scatter", "all_reduce")


def _env(js) -> dict[str, str]:
    c = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in c["env"]}


def test_each_generation_has_its_documented_set():
    tpu7x = xla_flags_for(get_device("tpu7x-128"), None, None)
    for c in SPARSECORE:  # Ironwood: SparseCore offload of every FSDP collective
        assert f"--xla_tpu_enable_sparse_core_collective_offload_{c}=true" in tpu7x
    v5p = xla_flags_for(get_device("v5p-256"), None, None)
    assert "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true" in v5p
    assert not any("sparse_core" in f for f in v5p)
    assert xla_flags_for(get_device("cpu-4"), None, None) == []
    docs = (Path(__file__).resolve().parents[1] / "docs" / "attention-and-xla-flags.md").read_text()
    for flag in tpu7x + v5p:  # every flag is documented, by name
        assert f"`{flag.split('=')[0][2:]}`" in docs, flag
    for name in GENERATIONS:  # and every generation has its section
        assert f"\n### {name}" in docs, name
    v6e = xla_flags_for(get_device("v6e-256"), None, None)
    assert v6e[0] == "--xla_tpu_scoped_vmem_limit_kib=98304" and f"`{v6e[0].split('=')[0][2:]}`" in docs
    assert xla_flags_for(get_device("v5litepod-256"), None, None) == v5p  # MaxText's v5e set is v5p's


def test_recipe_then_site_override_by_name_and_pods_get_exactly_that():
    dev = get_device("tpu7x-128")
    recipe = load_recipe(
        stage=1,
        overrides=[
            "xla_flags=[--xla_tpu_enable_sparse_core_collective_offload_all_reduce=false, --xla_tpu_scoped_vmem_limit_kib=65536]"
        ],
    )
    settings = Settings(run_root="gs://b/r", xla_flags="--xla_tpu_scoped_vmem_limit_kib=98304")
    flags = xla_flags_for(dev, recipe, settings)
    assert "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=false" in flags
    assert "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true" not in flags
    assert [f for f in flags if "vmem" in f] == ["--xla_tpu_scoped_vmem_limit_kib=98304"]  # the site wins
    src = xla_flag_sources(dev, recipe, settings)
    assert (
        src["xla_tpu_enable_sparse_core_collective_offload_all_reduce"][1]
        == "recipe olmo3-7b-stage1 (xla_flags)"
    )
    assert (
        src["xla_tpu_enable_sparse_core_collective_offload_all_gather"][1]
        == "generation tpu7x (core/generations.py)"
    )
    js = render_jobset(recipe, make_plan(recipe, dev), dev, settings, "r1", 1, "gs://b/r/r1")
    assert _env(js)["LIBTPU_INIT_ARGS"] == " ".join(flags) == libtpu_init_args(dev, recipe, settings)


def test_flags_do_not_change_the_recipe_fingerprint():
    plain = load_recipe(stage=1)
    flagged = load_recipe(stage=1, overrides=["xla_flags=[--xla_tpu_scoped_vmem_limit_kib=65536]"])
    assert flagged.xla_flags == ("--xla_tpu_scoped_vmem_limit_kib=65536",)
    assert flagged.fingerprint() == plain.fingerprint()  # performance only: an attempt may change them
    assert yaml.safe_load(flagged.to_yaml())["xla_flags"] == ["--xla_tpu_scoped_vmem_limit_kib=65536"]


@pytest.mark.parametrize("bad", ["xla_tpu_x=true", "--xla_tpu_x", "--xla tpu=1", "--x=a b"])
def test_malformed_flags_are_bad_input_naming_them(bad):
    with pytest.raises(BadInput, match="is not of the form --name=value") as e:
        xla_flags_for(get_device("v5p-8"), None, Settings(xla_flags=bad))
    assert "site setting xla_flags" in str(e.value)


def test_site_setting_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("OLMO_CTL_XLA_FLAGS", " --xla_tpu_scoped_vmem_limit_kib=65536 ")
    s = resolve_settings()
    assert (
        s.xla_flags == "--xla_tpu_scoped_vmem_limit_kib=65536"
        and s.sources["xla_flags"] == "env OLMO_CTL_XLA_FLAGS"
    )
    assert xla_flags_for(get_device("v5p-8"), None, s)[-1] == "--xla_tpu_scoped_vmem_limit_kib=65536"
    monkeypatch.setenv("OLMO_CTL_XLA_FLAGS", "")
    assert resolve_settings().xla_flags is None
