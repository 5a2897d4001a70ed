"""The preflight cache: compiled results as JSON, keyed by what can change them.

One file per (recipe fingerprint, device, remat, micro-batch, trainer version, XLA flags) under
`~/.cache/olmo-ctl/preflight/` ($OLMO_CTL_CACHE_DIR overrides the root); the trainer version is the
package version plus a hash of every trainer source, the preflight compiler and the jax / jaxlib /
libtpu versions, so any change to the step or to the compilers recompiles. A cache that
cannot be read or written only costs a recompile.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from olmo_ctl.core.devices import Device
from olmo_ctl.core.recipe import Recipe

# What a compiled step depends on: every source of the trainer package (the model, attention, the step,
# sharding, the optimizer and whatever they import from it), the preflight compiler that builds the step
# around them, and the versions of the compilers. A file added to the trainer is covered by the glob.
PREFLIGHT_SOURCES = ("preflight/compile.py", "core/batching.py")
COMPILER_PACKAGES = ("jax", "jaxlib", "libtpu")
CACHE_SCHEMA = 2


def _package_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def trainer_version(package_root: Path | None = None) -> str:
    """`VERSION+HASH`: the package version and a hash of the sources and compiler versions above
    (`package_root`: the `olmo_ctl` directory to read, this installation's by default)."""
    from olmo_ctl import __version__

    root = package_root or Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    files = sorted((root / "trainer").glob("*.py")) + [root / name for name in PREFLIGHT_SOURCES]
    for p in files:
        h.update(p.relative_to(root).as_posix().encode())
        h.update(p.read_bytes() if p.exists() else b"")
    for name in COMPILER_PACKAGES:
        h.update(f"{name}=={_package_version(name)}".encode())
    return f"{__version__}+{h.hexdigest()[:12]}"


def cache_dir() -> Path:
    root = os.environ.get("OLMO_CTL_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "olmo-ctl"
    return base / "preflight"


def cache_key(
    recipe: Recipe,
    device: Device,
    per_device_batch: int,
    version: str,
    xla_flags: list[str] | tuple[str, ...] = (),
    slices: int = 1,
) -> str:
    blob = json.dumps(
        {
            "schema": CACHE_SCHEMA,
            "recipe": recipe.fingerprint(),
            "device": device.name,
            "remat": recipe.model.remat,
            "batch": per_device_batch,
            "trainer": version,
            **({"xla_flags": list(xla_flags)} if xla_flags else {}),
            **({"slices": slices} if slices > 1 else {}),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _cache_path(key: str) -> Path:
    return cache_dir() / f"{key}.json"


def load_cached(key: str) -> dict | None:
    try:
        return json.loads(_cache_path(key).read_text())
    except (OSError, ValueError):
        return None


def store_cached(key: str, result: dict) -> None:
    path = _cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a cache that cannot be written only costs a recompile
