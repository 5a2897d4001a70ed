"""Commands that compute on this machine's CPU print no TPU runtime noise: where libtpu is installed,
`surgery soup`, the soup `resume-until-done` writes for a run of ingredients and `preflight`, run as a
user runs them (no JAX_PLATFORMS set), print none of libtpu's
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


def test_the_soup_of_a_run_of_ingredients_prints_no_tpu_errors(smoke_run, tmp_path):
    """`resume-until-done NAME` of a run of ingredients whose ingredients are all done writes the soup
    in the supervisor's own process, where nothing else has started JAX: as quiet as `surgery soup`.
    The ingredients are copies of the session's smoke run (its committed step 20 is the `smoke-soup`
    ingredients' final step), each adopted as the ingredient's run."""
    from helpers.runs import copy_run

    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.rundir import Composite, RunDir
    from olmo_ctl.supervise.attempts import data_fingerprint

    root = tmp_path / "runs"
    recipe = load_recipe("smoke-soup")
    whole = Composite(str(root), "q")
    whole.create(recipe, None, "cpu-1", None)
    for k, rd in enumerate(whole.runs()):
        sub = recipe.ingredient_recipe(k)
        copy_run(smoke_run, Path(rd.path))
        RunDir(rd.path).create_run(
            sub.to_dict(), sub.fingerprint(), data_fingerprint(sub), "cpu-1", adopt=True
        )
    p = olmo_ctl("resume-until-done", "q", "--run-root", str(root), "--backend", "local", tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    assert noise(p.stdout + p.stderr) == [], p.stderr
    assert (root / "q" / "soup" / "soup.json").exists(), p.stderr
    assert p.stderr.splitlines() == [
        f"note: souping 3 ingredients into {root / 'q' / 'soup'}",
        f"note: run of ingredients `q` is done: soup of 3 in {root / 'q' / 'soup'}",
    ]


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
