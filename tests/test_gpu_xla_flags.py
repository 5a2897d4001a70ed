"""Each GPU machine type's XLA flags parse: JAX starts with them in XLA_FLAGS (an unknown flag aborts
the process with "Unknown flags in XLA_FLAGS", so a set copied from an older release fails here).

XLA's flag table is one for every backend: the CPU jaxlib installed here parses the GPU flags as the
CUDA plugin's would at the same XLA version."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from olmo_ctl.core.devices import get_device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.generations import GPU_MACHINES
from olmo_ctl.core.xla_flags import xla_flag_sources, xla_flags_for


def _start_jax(flags: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    code = "import jax.numpy as jnp; print(float(jnp.arange(4.0).sum()))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_every_machine_types_flags_parse_when_jax_starts():
    flags = sorted({f for m in GPU_MACHINES.values() for f in m.xla_flags})
    assert len(flags) >= 10
    p = _start_jax(flags)
    assert p.returncode == 0 and p.stdout.strip() == "6.0", p.stderr[-2000:]


def test_a_flag_xla_no_longer_knows_aborts_jax_at_start():
    """The check above can fail: MaxText's A3 spelling of the pipelined collectives."""
    p = _start_jax(["--xla_gpu_enable_latency_hiding_scheduler=true", "--xla_gpu_pipeline_all_gather=on"])
    assert p.returncode != 0
    assert "in XLA_FLAGS: --xla_gpu_pipeline_all_gather=on" in p.stderr  # "Unknown flag(s)"


@pytest.mark.parametrize("machine", sorted(GPU_MACHINES))
def test_gpu_nodes_get_their_machine_types_flags_and_the_sites_over_them(machine):
    device = get_device(f"{machine}x2")
    assert xla_flags_for(device, None, None) == list(GPU_MACHINES[machine].xla_flags)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in xla_flags_for(device, None, None)
    sources = xla_flag_sources(device, None, None)
    assert {w for _, w in sources.values()} == {f"machine type {machine} (core/generations.py)"}


def test_a_tpu_flag_on_gpu_nodes_is_bad_input_and_local_devices_get_none():
    from olmo_ctl.core.config import Settings

    settings = Settings(xla_flags="--xla_tpu_enable_async_collective_fusion=true")
    with pytest.raises(BadInput, match="not one of XLA's GPU flags"):
        xla_flags_for(get_device("h100-mega-80gb-8x2"), None, settings)
    assert xla_flags_for(get_device("gpu-8"), None, settings) == []
    site = Settings(xla_flags="--xla_gpu_enable_triton_gemm=true")
    flags = xla_flags_for(get_device("b200-8x4"), None, site)
    assert flags[-1] == "--xla_gpu_enable_triton_gemm=true"
    assert flags.count("--xla_gpu_enable_triton_gemm=false") == 0


def test_the_trainer_on_a_gpu_turns_deterministic_ops_on_where_the_attention_runs_blocked(capsys):
    """Measured on an H200 (docs/benchmarks.md): without the flag, `smoke --device gpu-1` fails its
    bit-exact resume check from step 1; with it, it passes; with cuDNN attention the step aborts."""
    from olmo_ctl.core.devices import Target
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.trainer.__main__ import GPU_DETERMINISM_FLAG, _gpu_determinism

    smoke = load_recipe("smoke").model  # float32 compute: cuDNN does not take it, blocked runs
    seven_b = load_recipe(stage=1).model  # bf16 on cuDNN
    assert smoke.compute_dtype == "float32" and seven_b.compute_dtype == "bfloat16"
    for device in ("gpu-1", "h100-mega-80gb-8x2"):
        env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true"}
        assert "bit for bit" in _gpu_determinism(Target.parse(device), smoke, env)
        assert env["XLA_FLAGS"].split() == [
            "--xla_gpu_enable_latency_hiding_scheduler=true",
            GPU_DETERMINISM_FLAG,
        ]
        env = {}
        assert "not bit for bit" in _gpu_determinism(Target.parse(device), seven_b, env)
        assert "XLA_FLAGS" not in env
    env = {"XLA_FLAGS": "--xla_gpu_deterministic_ops=false"}
    assert "kept" in _gpu_determinism(Target.parse("gpu-1"), smoke, env)
    assert env["XLA_FLAGS"] == "--xla_gpu_deterministic_ops=false"
    env = {}
    assert _gpu_determinism(Target.parse("cpu-2"), smoke, env) is None and env == {}
    assert _gpu_determinism(None, smoke, env) is None
    # The flag itself parses (it reaches XLA_FLAGS beside the machine type's).
    p = _start_jax([GPU_DETERMINISM_FLAG, *GPU_MACHINES["h100-mega-80gb-8"].xla_flags])
    assert p.returncode == 0, p.stderr[-1000:]
