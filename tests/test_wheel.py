"""The package as a user installs it: a built wheel in a fresh virtual environment.

The wheel is built from a copy of the repository (nothing written into the checkout), installed without
its dependencies into a virtual environment that does not see this one's site-packages, and run from a
directory outside the repository with no PYTHONPATH. The dependencies (jax, typer, ...) are made visible
by a path line appended after the fresh environment's own site-packages, so the olmo_ctl that runs is
the wheel's (asserted). Recipes and launch templates must come from the wheel's package data: a
`submit --dry-run` of stage 1 renders the JobSet, and a 5-step local `resume-until-done` of the smoke
recipe trains to its final committed step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(
    ".git",
    ".venv",
    "__pycache__",
    "*.pyc",
    "build",
    "dist",
    "*.egg-info",
    "runs",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    ".cache",
    "tmp",
    "shared",
)


def _build_backend_available() -> bool:
    """Build without isolation (offline, seconds) when this environment has the build backend."""
    try:
        from importlib.metadata import version

        import setuptools  # noqa: F401
        import wheel  # noqa: F401
    except ImportError:
        return False
    return int(version("setuptools").split(".")[0]) >= 68


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=SKIP)
    dist = tmp / "dist"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--disable-pip-version-check",
        "-q",
        "-w",
        str(dist),
        str(src),
    ]
    if _build_backend_available():
        cmd.insert(4, "--no-build-isolation")
    subprocess.run(cmd, check=True, timeout=300, cwd=tmp)
    (whl,) = dist.glob("olmo_ctl-*.whl")

    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            "-q",
            str(whl),
        ],
        check=True,
        timeout=300,
        cwd=tmp,
    )
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # This environment's packages, after the fresh one's own: a plain path line, so their .pth files
    # (an editable olmo_ctl among them) are not processed.
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "zz_dependencies.pth").write_text("".join(f"{p}\n" for p in ours))

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OLMO_CTL_", "PYTHON", "JAX_", "XLA_"))}
    env["XDG_CONFIG_HOME"] = str(tmp / "config")
    work = tmp / "work"
    work.mkdir()
    return {"wheel": whl, "venv": venv, "python": py, "site": site, "env": env, "work": work}


def run(inst: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(inst["venv"] / "bin" / "olmo-ctl"), *args],
        capture_output=True,
        text=True,
        env=inst["env"],
        cwd=inst["work"],
        timeout=timeout,
    )


def test_wheel_carries_recipes_and_templates(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    for name in ("smoke", "olmo3-7b-stage1", "olmo3-7b-stage1-cosine", "olmo3-7b-stage2", "olmo3-7b-stage3"):
        assert f"olmo_ctl/recipes/{name}.yaml" in names
    for name in ("smoke", "olmo3-7b"):  # the model files the recipes name
        assert f"olmo_ctl/recipes/models/{name}.yaml" in names
    for name in ("common", "tpu7x", "v5p"):
        assert f"olmo_ctl/launch_templates/{name}.yaml" in names
    assert "olmo_ctl/sandbox/crds/jobset.x-k8s.io_jobsets.v0.10.1.yaml" in names
    assert "olmo_ctl/py.typed" in names  # the package's annotations are for type checkers of its users too
    assert not any(n.endswith("Dockerfile") for n in names)
    assert not any(n.startswith(("tools/", "tests/")) for n in names)  # release tooling, test doubles


def test_installed_copy_is_what_runs(installed):
    out = subprocess.run(
        [
            str(installed["python"]),
            "-c",
            "import olmo_ctl, olmo_ctl.core.recipe as r, olmo_ctl.backends.jobset as j;"
            "print(olmo_ctl.__file__); print(r.RECIPES_DIR); print(j.TEMPLATES_DIR)",
        ],
        capture_output=True,
        text=True,
        env=installed["env"],
        cwd=installed["work"],
        check=True,
    )
    for line in out.stdout.split():
        assert Path(line).resolve().is_relative_to(installed["site"].resolve()), line
        assert not Path(line).resolve().is_relative_to(REPO), line


def test_dry_run_from_the_wheel(installed):
    p = run(installed, "submit", "--stage", "1", "--device", "tpu7x-128", "--dry-run")
    assert p.returncode == 0, p.stderr
    js = yaml.safe_load(p.stdout)
    assert js["kind"] == "JobSet"
    assert js["metadata"]["name"].startswith("olmo3-7b-stage1")
    (slice_job,) = js["spec"]["replicatedJobs"]
    pod = slice_job["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu7x"


def test_user_delta_recipes_from_the_wheel(installed):
    """A user file naming the wheel's shipped base and model, and one beside it with a relative `base:`."""
    work = installed["work"]
    (work / "mine.yaml").write_text(
        "name: mine\nbase: olmo3-7b-stage2\nmodel: olmo3-7b\ntrain: {max_steps: 1000}\n"
    )
    (work / "deltas").mkdir()
    (work / "deltas" / "mine-remat.yaml").write_text(
        "name: mine-remat\nbase: ../mine.yaml\nmodel: {remat: save_proj}\n"
    )
    p = run(installed, "plan", "--recipe", "deltas/mine-remat.yaml", "--device", "tpu7x-128", "-o", "json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert (plan["recipe"], plan["global_batch"], plan["max_steps"], plan["remat"], plan["params"]) == (
        "mine-remat",
        256,
        1000,
        "save_proj",
        7_298_617_344,
    )


@pytest.mark.chaos
def test_resume_until_done_from_the_wheel(installed):
    pytest.importorskip("jax")
    root = installed["work"] / "runs"
    p = run(
        installed,
        "resume-until-done",
        "--recipe",
        "smoke",
        "--device",
        "cpu-1",
        "--backend",
        "local",
        "--run",
        "wheel-smoke",
        "--run-root",
        str(root),
        "--poll",
        "0.5",
        "--set",
        "train.max_steps=5",
        "--set",
        "schedule.warmup_steps=1",
        "--set",
        "eval.interval=1000",
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    status = run(installed, "monitor", str(root / "wheel-smoke"), "-o", "json", "--no-backend")
    assert status.returncode == 0, status.stderr
    rep = json.loads(status.stdout)
    assert rep["step"] == rep["final_step"] == 5, rep
    assert rep["checkpoint"]["committed_step"] == 5, rep
