"""The preflight cache: compiled results as JSON, keyed by what can change them.

One file per (recipe fingerprint, device, remat, micro-batch, trainer version, XLA flags) under
`~/.cache/olmo-ctl/preflight/` ($OLMO_CTL_CACHE_DIR overrides the root); the trainer version is the
package version plus a hash of the trainer sources, so any change to the step recompiles. A cache that
cannot be read or written only costs a recompile.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from olmo_ctl.core.devices import Device
from olmo_ctl.core.recipe import Recipe

TRAINER_SOURCES = ("model.py", "attention.py", "sharding.py", "optim.py", "train.py")
CACHE_SCHEMA = 1


def trainer_version() -> str:
    from olmo_ctl import __version__

    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1] / "trainer"
    for name in TRAINER_SOURCES:
        p = root / name
        h.update(name.encode())
        h.update(p.read_bytes() if p.exists() else b"")
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
