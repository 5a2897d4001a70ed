"""`make base-image` and `make image`: build launch_templates/Dockerfile with Docker, or without it.

With a Docker daemon (`docker info` answers) `docker build` builds it on the Dockerfile's base
(python:3.11-slim). Without one, buildah builds it (`buildah bud --isolation chroot --layers`, so a
rebuild after a code change reuses the dependency layer) on a local Debian base made once by
debootstrap (`localhost/olmo-ctl-base:bookworm`: Debian bookworm's Python 3.11 and its venv module),
its root file system kept as a tarball under the cache directory so a removed base is imported again in
seconds. Either way it prints the image's name, id, digest, size and the seconds it took.

Two variants of the one Dockerfile: `tpu` (the default: JAX with libtpu) and `gpu` (JAX's CUDA 12 wheels,
which bring the CUDA libraries, so it builds on the same base), each the trainer, its accelerator's extra
and the evaluator (VARIANTS); EXTRAS overrides what is installed, every name an extra of pyproject.toml.

    python -m tools.image_build base [--base-image NAME] [--cache DIR]
    python -m tools.image_build build --image NAME [--variant tpu|gpu] [--base-image NAME] [--extras E]
        [--builder docker|buildah]

Exit codes: 0 built, 2 it could not be (one line saying why).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from olmo_ctl.core.errors import BadInput, OlmoCtlError
from olmo_ctl.sandbox import buildah

DOCKERFILE = "launch_templates/Dockerfile"
IGNOREFILE = "launch_templates/Dockerfile.dockerignore"
LOCAL_BASE = "localhost/olmo-ctl-base:bookworm"
DEFAULT_CACHE = "/var/cache/olmo-ctl"
SUITE = "bookworm"
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
# What each variant installs: the trainer, JAX for the accelerator (the extra of the variant's name) and
# the evaluator. The Makefile's EXTRAS default is trainer,$(VARIANT),eval; the Dockerfile's is tpu's.
VARIANTS = {"tpu": "trainer,tpu,eval", "gpu": "trainer,gpu,eval"}
DEFAULT_VARIANT = "tpu"
DEFAULT_EXTRAS = VARIANTS[DEFAULT_VARIANT]


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def variant_extras(variant: str) -> str:
    """The extras `variant` installs; an unknown variant is bad input."""
    if variant not in VARIANTS:
        raise BadInput(f"`{variant}` is not an image variant", f"VARIANT={' or VARIANT='.join(VARIANTS)}")
    return VARIANTS[variant]


def check_extras(extras: str) -> None:
    """Every name in `extras` is an extra of pyproject.toml: pip only warns of one it does not know, and
    would build an image without it (EXTRAS=trainer,gup,eval: no JAX for any accelerator)."""
    known = tomllib.loads((repo_root() / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    unknown = [e for e in extras.split(",") if e.strip() not in known]
    if unknown:
        raise BadInput(
            f"EXTRAS={extras}: pyproject.toml has no extra {', '.join(unknown)}", f"one of {', '.join(known)}"
        )


def docker_works() -> bool:
    """A Docker daemon answers (the client binary alone is not enough)."""
    if shutil.which("docker") is None:
        return False
    p = subprocess.run(["docker", "info"], capture_output=True, text=True)
    return p.returncode == 0


def choose_builder(asked: str | None) -> str:
    if asked:
        if asked not in ("docker", "buildah"):
            raise BadInput(f"`{asked}` is not a builder", "BUILDER=docker or BUILDER=buildah")
        return asked
    return "docker" if docker_works() else "buildah"


PIP_SOURCE_KEYS = ("cert", "index-url", "extra-index-url", "find-links")
BUILD_CERT = "/run/olmo-ctl-build/cert.pem"


def pip_sources(config_list: str) -> dict[str, str]:
    """The build machine's pip sources from `pip config list` (its environment over its files): the CA
    bundle it trusts (a proxy's) and its package indexes and wheel directories."""
    found: dict[str, str] = {}
    for line in config_list.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        scope, _, name = key.rpartition(".")
        if name in PIP_SOURCE_KEYS and (scope == ":env:" or name not in found):
            found[name] = value.strip().strip("'\"")
    return found


def build_sources(sources: dict[str, str]) -> tuple[list[str], list[str]]:
    """buildah's --build-arg and --volume arguments that give the build's pip the machine's sources:
    pip's own variables (ARGs of the Dockerfile: in the build's RUN steps, not in the image), the CA
    bundle and every local directory mounted read-only. Versions stay constraints.txt's either way."""
    args: list[str] = []
    volumes: list[str] = []
    for name, value in sources.items():
        if name == "cert":
            if not Path(value).is_file():
                continue
            volumes.append(f"{value}:{BUILD_CERT}:ro")
            value = BUILD_CERT
        else:
            for item in value.split():
                path = item.removeprefix("file://").rstrip("/")
                if "://" in path or not Path(path).is_dir():
                    continue
                # A file:// index (`.../simple`) links to its files beside it: its parent goes too.
                if item.startswith("file://"):
                    path = str(Path(path).parent)
                if f"{path}:{path}:ro" not in volumes:
                    volumes.append(f"{path}:{path}:ro")
        args += ["--build-arg", f"PIP_{name.upper().replace('-', '_')}={value}"]
    return args, [a for v in volumes for a in ("--volume", v)]


def host_pip_sources() -> dict[str, str]:
    p = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    return pip_sources(p.stdout) if p.returncode == 0 else {}


def base_image(name: str = LOCAL_BASE, cache: str = DEFAULT_CACHE) -> str:
    """The local Debian base: made by debootstrap once, its tarball cached, imported with podman."""
    if buildah.image_exists(name):
        print(f"base image {name}: present", file=sys.stderr)
        return name
    tarball = Path(cache) / f"debian-{SUITE}-python3.tar"
    started = time.monotonic()
    if not tarball.exists():
        if shutil.which("debootstrap") is None:
            raise BadInput("debootstrap is not installed", "apt-get install -y debootstrap buildah podman")
        Path(cache).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix="rootfs-") as rootfs:
            print(f"debootstrap {SUITE} ({BASE_PACKAGES}) into {rootfs}", file=sys.stderr)
            p = subprocess.run(
                ["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", SUITE, rootfs],
                capture_output=True,
                text=True,
            )
            if p.returncode != 0:
                last = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()][-1:]
                raise OlmoCtlError(f"debootstrap failed: {' '.join(last)}")
            # apt's lists and caches are not part of an image.
            for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for entry in (Path(rootfs) / sub).glob("*"):
                    if entry.is_file():
                        entry.unlink()
            partial = tarball.with_suffix(".tar.partial")
            subprocess.run(["tar", "-C", rootfs, "-cf", str(partial), "."], check=True)
            partial.rename(tarball)
    p = subprocess.run(
        ["podman", "import", "--change", "CMD=/bin/bash", str(tarball), name], capture_output=True, text=True
    )
    if p.returncode != 0:
        raise OlmoCtlError(f"podman import of {tarball} failed: {buildah.last_line(p.stderr)}")
    print(f"base image {name}: made in {time.monotonic() - started:.0f} s ({tarball})", file=sys.stderr)
    return name


def build(
    image: str,
    base: str | None = None,
    extras: str = DEFAULT_EXTRAS,
    builder: str | None = None,
    cache: str = DEFAULT_CACHE,
) -> dict[str, object]:
    """Build the Dockerfile as `image`; the facts it prints."""
    check_extras(extras)
    which = choose_builder(builder)
    args = ["--build-arg", f"EXTRAS={extras}"]
    started = time.monotonic()
    if which == "docker":
        if base:
            args += ["--build-arg", f"BASE_IMAGE={base}"]
        cmd = ["docker", "build", "-f", DOCKERFILE, *args, "-t", image, "."]
    else:
        why = buildah.available()
        if why:
            raise BadInput(f"no Docker daemon answers `docker info` and {why}")
        base = base or base_image(cache=cache)
        args += ["--build-arg", f"BASE_IMAGE={base}"]
        pip_args, volumes = build_sources(host_pip_sources())
        cmd = [
            buildah.BUILDAH,
            "bud",
            "--isolation",
            buildah.ISOLATION,
            "--layers",
            "--force-rm",
            "--pull-never",
        ]
        cmd += ["--ignorefile", IGNOREFILE, "-f", DOCKERFILE, *args, *pip_args, *volumes, "-t", image, "."]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, cwd=repo_root())
    if p.returncode != 0:
        raise OlmoCtlError(f"{which} build of {image} failed (exit {p.returncode}); its output is above")
    seconds = time.monotonic() - started
    if which == "docker":
        out = subprocess.run(
            ["docker", "image", "inspect", "--format", "{{.Id}} {{.Size}}", image],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        facts: dict[str, object] = {"id": out[0], "digest": out[0], "size_bytes": int(out[1])}
    else:
        facts = buildah.image_facts(image)
    size = int(str(facts["size_bytes"]))
    print(
        f"image {image}: built by {which} in {seconds:.0f} s; id {facts['id']}; digest {facts['digest']}; "
        f"size {size / 1e9:.2f} GB ({size} bytes)"
    )
    return {**facts, "builder": which, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.image_build")
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("base", help="make the local Debian base image (debootstrap, cached)")
    b.add_argument("--base-image", default=LOCAL_BASE)
    b.add_argument("--cache", default=os.environ.get("OLMO_CTL_IMAGE_CACHE", DEFAULT_CACHE))
    i = sub.add_parser("build", help="build launch_templates/Dockerfile")
    i.add_argument("--image", required=True)
    i.add_argument("--variant", default=DEFAULT_VARIANT, help=f"one of {', '.join(VARIANTS)}")
    i.add_argument("--base-image", default="")
    i.add_argument("--extras", default="", help="the extras installed (default: the variant's)")
    i.add_argument("--builder", default="")
    i.add_argument("--cache", default=os.environ.get("OLMO_CTL_IMAGE_CACHE", DEFAULT_CACHE))
    a = ap.parse_args(argv)
    try:
        if a.what == "base":
            why = buildah.available()
            if why:
                raise BadInput(why)
            base_image(a.base_image, a.cache)
        else:
            extras = variant_extras(a.variant)
            build(a.image, a.base_image or None, a.extras or extras, a.builder or None, a.cache)
    except OlmoCtlError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
