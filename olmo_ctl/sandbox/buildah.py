"""OCI images and containers without a Docker daemon: the few `buildah` calls olmo-ctl makes.

`make image` builds with it where `docker info` finds no daemon, `make image-test` and the sandbox's
image runtime run commands in its images. Runs go through `buildah run --isolation chroot` (a chroot
with the image's mounts and this machine's network, process IDs and host name), not `podman run`: a machine
without user-namespace rights refuses crun's setrlimit. Every call is a subprocess; a failure is
`BuildahError` with buildah's last line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence

from olmo_ctl.core.errors import OlmoCtlError

BUILDAH = "buildah"
ISOLATION = "chroot"


class BuildahError(OlmoCtlError):
    """A buildah call failed: its last line of stderr."""


def available() -> str | None:
    """Why buildah cannot be used here, or None when it can (installed, and its storage answers)."""
    if shutil.which(BUILDAH) is None:
        return "buildah is not installed (apt-get install -y buildah podman debootstrap)"
    p = subprocess.run([BUILDAH, "images", "--quiet"], capture_output=True, text=True)
    if p.returncode != 0:
        return f"buildah cannot read its image storage: {last_line(p.stderr)}"
    return None


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def _call(args: Sequence[str], what: str) -> str:
    p = subprocess.run([BUILDAH, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise BuildahError(f"{what}: {last_line(p.stderr)}")
    return p.stdout


def image_exists(image: str) -> bool:
    """Whether `image` is in local storage (a short name resolves to localhost/ as buildah does)."""
    p = subprocess.run(
        [BUILDAH, "inspect", "--type", "image", "--format", "{{.FromImageID}}", image],
        capture_output=True,
        text=True,
    )
    return p.returncode == 0


def image_facts(image: str) -> dict[str, object]:
    """The local image's id, digest, size in bytes, user, working directory and environment."""
    info = json.loads(_call(["inspect", "--type", "image", image], f"cannot inspect image {image}"))
    config = (info.get("OCIv1") or {}).get("config") or {}
    size = 0
    p = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Size}}", image], capture_output=True, text=True
    )
    if p.returncode == 0 and p.stdout.strip().isdigit():
        size = int(p.stdout.strip())
    return {
        "id": info.get("FromImageID", ""),
        "digest": info.get("FromImageDigest", ""),
        "size_bytes": size,
        "user": config.get("User", ""),
        "working_dir": config.get("WorkingDir", ""),
        "env": list(config.get("Env") or []),
    }


def from_image(image: str, name: str | None = None) -> str:
    """A working container of the local `image` (never pulled: an image not here is an error)."""
    args = ["from", "--pull-never", "--quiet"]
    args += ["--name", name] if name else []
    return _call([*args, image], f"image {image} not found in local storage").strip()


def run_argv(
    container: str,
    command: Sequence[str],
    *,
    user: str | None = None,
    working_dir: str | None = None,
    env: Mapping[str, str] | None = None,
    volumes: Sequence[tuple[str, str]] = (),
) -> list[str]:
    """The `buildah run` command line that runs `command` in `container`: as `user` (default the image's),
    in `working_dir` (default the image's), with `env` on top of the image's, host paths mounted."""
    # This machine's host name too, not the container's id: a name that resolves (its /etc/hosts),
    # which JAX's CPU collectives (gloo) look up, as a hostNetwork pod has its node's.
    argv = [BUILDAH, "run", "--isolation", ISOLATION, "--terminal=false", "--uts", "host"]
    argv += ["--user", user] if user else []
    argv += ["--workingdir", working_dir] if working_dir else []
    for k, v in (env or {}).items():
        argv += ["--env", f"{k}={v}"]
    for host, inside in volumes:
        argv += ["--volume", f"{host}:{inside}"]
    return [*argv, container, "--", *command]


def run(
    container: str, command: Sequence[str], timeout_s: float | None = None, **kw
) -> subprocess.CompletedProcess:
    """Run `command` in `container` to its end, stdout and stderr captured; past `timeout_s` its whole
    process group (buildah and the container's processes) is killed and BuildahError raised."""
    argv = run_argv(container, command, **kw)
    p = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise BuildahError(f"`{' '.join(command)}` did not finish within {timeout_s:.0f} s") from None
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def remove_container(container: str) -> None:
    """Remove a working container (what it wrote goes with it); one already gone is no error."""
    subprocess.run([BUILDAH, "rm", container], capture_output=True, text=True)


def remove_image(image: str) -> None:
    subprocess.run([BUILDAH, "rmi", "--force", image], capture_output=True, text=True)
