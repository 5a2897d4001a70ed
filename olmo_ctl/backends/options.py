"""Site options as backends declare them (torchx's `runopts`): each backend names the site settings
its command line may set in a typed dataclass of its own, each field with its help and its role, and
the CLI's site flags are generated from those declarations (`cli/options.py`).

A role says which commands take an option:

  runs     where the runs live and which backend runs them (`--backend`, `--run-root`): every command
           that touches a run
  cluster  how to reach the backend's world (`--kube-context`, `--namespace`): commands that read or
           stop a live attempt
  render   what an attempt is rendered with (`--queue`, `--image`, ...): commands that submit one

Pure declarations: importing this module (or a backend's options module) loads no backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

ROLES = ("runs", "cluster", "render")


def option(help: str, role: str = "render") -> Any:
    """A field of a backend's options dataclass: the `core.config.Settings` field of the same name,
    as a flag (None: not given on this command line)."""
    assert role in ROLES, role
    return field(default=None, metadata={"help": help, "role": role})


@dataclass(frozen=True)
class SiteOption:
    """One site setting a command line may set."""

    name: str  # the `core.config.Settings` field it sets
    help: str
    role: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def declared(options_class: type) -> tuple[SiteOption, ...]:
    """The site options an options dataclass declares, in its field order."""
    return tuple(SiteOption(f.name, f.metadata["help"], f.metadata["role"]) for f in fields(options_class))


@dataclass(frozen=True)
class RunOptions:
    """What every backend takes: which backend, and where the runs live."""

    backend: str | None = option("gke or local.", "runs")
    run_root: str | None = option("Where run directories live (gs://...).", "runs")


@dataclass(frozen=True)
class NoOptions:
    """A backend whose attempts need no site setting beyond `RunOptions` (processes on this machine)."""
