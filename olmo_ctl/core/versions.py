"""The versions a run trains with: olmo-ctl itself and the packages that decide its numerics and its
checkpoint format. Pure: read from installed package metadata, never by importing the packages.

`run.yaml` records them (`versions:`, set by the trainer's first attempt). A later attempt whose versions
differ says so in one line; it refuses to restore a checkpoint when the checkpoint format may not read
(`blocking`), unless the user allows it (`--allow-version-change`).

The rule for "may not read": Orbax writes the checkpoints, and its releases are 0.x, where a minor
release may change the on-disk layout or metadata; a patch release does not. So a change of
orbax-checkpoint's major or minor version (or Orbax appearing or disappearing) blocks a restore. Other
changes (jax, jaxlib, libtpu, the JAX CUDA plugin, optax, olmo-ctl) change numerics or speed, not what a checkpoint holds:
they are reported, not refused.
"""

from __future__ import annotations

from importlib import metadata

PACKAGES = ("olmo-ctl", "jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "orbax-checkpoint", "optax")
FORMAT_PACKAGE = "orbax-checkpoint"


def installed(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """{package: version or None when not installed}, in PACKAGES order."""
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def changes(recorded: dict, current: dict) -> list[tuple[str, str | None, str | None]]:
    """(package, recorded, current) for each package whose version differs; packages the record does not
    name are not compared (a record written before a package was tracked)."""
    return [
        (name, recorded.get(name), current.get(name))
        for name in current
        if name in recorded and recorded.get(name) != current.get(name)
    ]


def _major_minor(v: str | None) -> tuple[str, ...] | None:
    return None if v is None else tuple(v.split(".")[:2])


def blocking(diff: list[tuple[str, str | None, str | None]]) -> list[tuple[str, str | None, str | None]]:
    """The changes under which a checkpoint written with the recorded versions may not read."""
    return [c for c in diff if c[0] == FORMAT_PACKAGE and _major_minor(c[1]) != _major_minor(c[2])]


def describe(diff: list[tuple[str, str | None, str | None]]) -> str:
    """`jax 0.6.0 -> 0.7.1, orbax-checkpoint 0.11.0 -> 0.12.8` (`none` for a package not installed)."""
    return ", ".join(f"{name} {old or 'none'} -> {new or 'none'}" for name, old, new in diff)
