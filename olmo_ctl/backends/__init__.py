"""Backends: where an attempt runs. `local` (processes on this machine) and `gke` (JobSet + Kueue).

`REGISTRY` maps a backend's name (the `backend` site setting, a journal handle's `backend`) to the
module and class that implement it; each module loads only when its backend is chosen, so a command
never pays for the other's imports (torchx's `schedulers/__init__.py` is the model). Nothing else
branches on a backend's name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from olmo_ctl.core.errors import BadInput

if TYPE_CHECKING:
    from olmo_ctl.backends.base import Backend, Handle
    from olmo_ctl.core.config import Settings

REGISTRY: dict[str, str] = {
    "gke": "olmo_ctl.backends.gke:GKEBackend",
    "local": "olmo_ctl.backends.local:LocalBackend",
}


def backend_class(name: str) -> type[Backend]:
    """The class of backend `name` (imported now)."""
    try:
        target = REGISTRY[name]
    except KeyError:
        raise BadInput(f"`{name}` is not a backend", f"use one of {', '.join(sorted(REGISTRY))}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def make_backend(settings: Settings, run_root: str | None = None) -> Backend:
    """The backend of `settings.backend`, made from the site settings."""
    return backend_class(settings.backend).from_settings(settings, run_root)


def backend_for_status(handle: Handle, run_dir: str) -> Backend | None:
    """A backend that can answer `status` for a journal's `handle` (None: no backend of that name, or
    one that cannot read an attempt back)."""
    if handle.backend not in REGISTRY:
        return None
    try:
        return backend_class(handle.backend).for_status(handle, run_dir)
    except NotImplementedError:
        return None
