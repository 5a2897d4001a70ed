"""Backends: where an attempt runs. `local` (processes on this machine) and `gke` (JobSet + Kueue).

`REGISTRY` maps a backend's name (the `backend` site setting, a journal handle's `backend`) to the
module and class that implement it; each module loads only when its backend is chosen, so a command
never pays for the other's imports (torchx's `schedulers/__init__.py` is the model). Nothing else
branches on a backend's name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from olmo_ctl.core.errors import BadInput

if TYPE_CHECKING:
    from olmo_ctl.backends.base import Backend, Handle
    from olmo_ctl.backends.options import SiteOption
    from olmo_ctl.core.config import Settings

REGISTRY: dict[str, str] = {
    "gke": "olmo_ctl.backends.gke:GKEBackend",
    "local": "olmo_ctl.backends.local:LocalBackend",
}
# Where each backend's runs live when no flag, environment variable or config file says: a path on
# this machine for a backend whose trainer runs here (made absolute); None: the placeholder run root,
# which a submit refuses (`Backend.placeholders`). Declared beside the registry, so that resolving
# the site settings loads no backend module.
DEFAULT_RUN_ROOTS: dict[str, str | None] = {"gke": None, "local": "runs"}
# The backend whose trainer runs in processes of this machine: where `eval` evaluates by default.
THIS_MACHINE = "local"
# Each backend's site options (`backends/options.py`): a light module and its options dataclass,
# loaded to build the command line's flags without loading the backend.
OPTIONS: dict[str, str] = {
    "gke": "olmo_ctl.backends.gke_options:GKEOptions",
    "local": "olmo_ctl.backends.options:NoOptions",
}


def options_class(name: str) -> type:
    """The options dataclass backend `name` declares."""
    module, _, cls = OPTIONS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def site_options() -> tuple[SiteOption, ...]:
    """Every site option a command line may set: `RunOptions`, then each backend's own, once each."""
    from olmo_ctl.backends.options import RunOptions, declared

    out: dict[str, SiteOption] = {o.name: o for o in declared(RunOptions)}
    for name in REGISTRY:
        for o in declared(options_class(name)):
            out.setdefault(o.name, o)
    return tuple(out.values())


def resolve_settings(**flag_values: str | None) -> Settings:
    """The site settings of a command (`core.config.resolve_settings`), with the backends' declarations."""
    from olmo_ctl.core.config import resolve_settings as resolve

    return resolve(DEFAULT_RUN_ROOTS, **flag_values)


def existing_runs(settings: Settings) -> Settings:
    """`settings` for finding runs that already exist (`runs`, `logs`, `stop`, `monitor NAME`, `data
    audit`, `resume-until-done NAME`): while the run root is the placeholder no flag, environment
    variable or config file replaced, the run root of the backend that runs on this machine (`runs/`,
    where `make demo` trains), and that backend unless one is chosen. No run can live under a
    placeholder; a run found there still brings its own backend (`supervise.attempts.run_settings`), and
    a new run on GKE still needs a gs:// run root."""
    import dataclasses
    import os

    from olmo_ctl.core.config import PLACEHOLDER_RUN_ROOT

    local = DEFAULT_RUN_ROOTS[THIS_MACHINE]
    if (
        settings.run_root != PLACEHOLDER_RUN_ROOT
        or settings.sources.get("run_root") != "default"
        or not local
    ):
        return settings
    why = f"default for runs on this machine (no run root set; the {THIS_MACHINE} backend's)"
    values: dict[str, Any] = {"run_root": os.path.abspath(local)}
    if settings.sources.get("backend") == "default":
        values["backend"] = THIS_MACHINE
    return dataclasses.replace(settings, **values, sources={**settings.sources, **dict.fromkeys(values, why)})


def placeholders(settings: Settings) -> list[str]:
    """The settings still holding placeholders that `settings.backend` cannot submit with."""
    return backend_class(settings.backend).placeholders(settings)


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
