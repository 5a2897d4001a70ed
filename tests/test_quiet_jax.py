"""Commands that compute on this machine's CPU print no TPU runtime noise: where libtpu is installed,
`surgery soup` and `preflight`, run as a user runs them (no JAX_PLATFORMS set), print none of libtpu's
`E0000 ... unexpected worker hostname`, `Failed to find host bounds` or Orbax's absl warnings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from olmo_ctl.preflight.compile import libtpu_available

ROOT = Path(__file__).resolve().parent.parent
NOISE = (
    "E0000",
    "INVALID_ARGUMENT",
    "unexpected worker hostname",
    "Failed to find host bounds",
    "Metadata file does not exist",
    "WARNING:absl",
)

pytestmark = pytest.mark.skipif(not libtpu_available(), reason="the noise comes from libtpu, not installed")


def olmo_ctl(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OLMO_CTL_", "JAX_PLATFORMS", "TPU_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        XDG_CONFIG_HOME=str(tmp_path / "config"),
        OLMO_CTL_CACHE_DIR=str(tmp_path / "cache"),
    )
    return subprocess.run(
        [sys.executable, "-m", "olmo_ctl", *args], capture_output=True, text=True, env=env, timeout=600
    )


def noise(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if any(n in ln for n in NOISE)]


def test_surgery_soup_prints_only_its_result(smoke_run, tmp_path):
    p = olmo_ctl(
        "surgery",
        "soup",
        str(smoke_run / "checkpoints" / "20"),
        str(smoke_run / "checkpoints" / "40"),
        "--out",
        str(tmp_path / "soup"),
        "--recipe",
        "smoke",
        tmp_path=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    assert noise(p.stdout + p.stderr) == [], p.stderr
    assert p.stdout == (
        f"wrote {tmp_path / 'soup'}: float32 mean of 2 checkpoints of olmo3-smoke (weights 0.5, 0.5),"
        " 14 tensors, 250,944 parameters, float32\n"
    )


@pytest.mark.tpu_compile
def test_preflight_prints_its_progress_and_report_and_no_tpu_errors(tmp_path, monkeypatch):
    # Twice, with JAX's persistent compilation cache on (as a user's JAX_COMPILATION_CACHE_DIR turns it
    # on): a compile for a slice that is not here is never stored, so the second run reads no entry it
    # cannot load (JAX warned "PjRtCompiler must be constructed with a Client" on each such read).
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax-cache"))
    for _ in range(2):
        p = olmo_ctl(
            "preflight",
            "--recipe",
            "smoke",
            "--device",
            "v5p-8",
            "--no-cache",
            "-o",
            "json",
            tmp_path=tmp_path,
        )
        assert p.returncode == 0, p.stderr
        assert noise(p.stdout + p.stderr) == [], p.stderr
        assert all(ln.startswith("preflight: ") for ln in p.stderr.splitlines()), p.stderr
