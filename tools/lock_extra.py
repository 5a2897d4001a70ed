"""`make lock` for the extras `make install` leaves out: their exact versions, resolved beside the lock file
without installing them, merged into it.

The `gpu` extra is JAX's CUDA 12 build (`jax[cuda12]`: the CUDA plugin and the NVIDIA wheels it bundles,
a few GB that a machine without a GPU has no use for), so `.venv` never holds it and `make lock`'s list of
`.venv` cannot pin it. pip resolves it instead (`pip install --dry-run --ignore-installed --report`) under
the versions just listed from `.venv` (`-c`), for this machine's platform and Python, the image's; the
distributions it adds (jax-cuda12-plugin, jax-cuda12-pjrt, nvidia-*) are merged into the file in pip's
order, so the GPU image installs exactly these too (`make image-test VARIANT=gpu` compares them).

    python -m tools.lock_extra FILE EXTRA...

Exit codes: 0 merged, 2 it could not be (pip failed to resolve, or resolved a version other than a pin).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from olmo_ctl.core.errors import BadInput, OlmoCtlError

LEFT_OUT = ("gpu",)  # the extras `make install` does not install


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(text: str) -> dict[str, str]:
    """{canonical name: version} of a lock file's `NAME==VERSION` lines."""
    out = {}
    for line in text.splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            out[canonical(name)] = version.strip()
    return out


def merge(text: str, extra_pins: dict[str, str]) -> str:
    """The lock file `text` with `extra_pins` ({name as its distribution spells it: version}) added: its
    comment lines first, then every pin in pip's order (`pip list` sorts by canonical name). A pin the
    file already holds must be the same version."""
    header = [ln for ln in text.splitlines() if ln.startswith("#")]
    lines = {canonical(ln.partition("==")[0]): ln for ln in text.splitlines() if "==" in ln and ln[0] != "#"}
    current = pinned(text)
    for name, version in extra_pins.items():
        key, version = (
            canonical(name),
            version.split("+", 1)[0],
        )  # a local label (+cpu), as make lock drops it
        if key in current and current[key] != version:
            raise BadInput(f"the extras resolve {name}=={version}, the lock file pins {current[key]}")
        lines.setdefault(key, f"{name}=={version}")
    return "\n".join(header + [lines[k] for k in sorted(lines)]) + "\n"


def requirements(pyproject: dict, extras: tuple[str, ...]) -> list[str]:
    optional = pyproject["project"]["optional-dependencies"]
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise BadInput(f"pyproject.toml has no extra {', '.join(unknown)}", f"one of {', '.join(optional)}")
    return [spec for e in extras for spec in optional[e]]


def resolve(specs: list[str], constraints: Path) -> dict[str, str]:
    """{name: version} of everything pip would install for `specs` under `constraints`, nothing installed."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        p = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
            + ["--report", str(report), "-c", str(constraints), *specs],
            capture_output=True,
            text=True,
        )
        if p.returncode != 0:
            last = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")][-1:]
            raise BadInput(f"pip could not resolve {' '.join(specs)}: {' '.join(last) or p.returncode}")
        installs = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"]: i["metadata"]["version"] for i in installs}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m tools.lock_extra FILE EXTRA...", file=sys.stderr)
        return 2
    lock, extras = Path(args[0]), tuple(args[1:])
    try:
        pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
        resolved = resolve(requirements(pyproject, extras), lock)
        text = lock.read_text()
        merged = merge(text, resolved)
        added = sorted(set(pinned(merged)) - set(pinned(text)))
        lock.write_text(merged)
    except OlmoCtlError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        return e.exit_code
    print(f"{lock}: [{','.join(extras)}] adds {len(added)} pins: {', '.join(added)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
