"""The XLA flags a slice's pods get: the generation's (or GPU machine type's), the recipe's, the site's.

On a TPU slice they are the pods' LIBTPU_INIT_ARGS; on GPU nodes, their XLA_FLAGS. The JobSet renderer
puts them in every trainer container; preflight compiles with exactly them. Both read this module, so
what preflight checked is what the pods run with. Pure.
"""

from __future__ import annotations

import re

from olmo_ctl.core.config import Settings
from olmo_ctl.core.devices import Device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.generations import GENERATIONS, GPU_MACHINES
from olmo_ctl.core.recipe import Recipe

_XLA_FLAG = re.compile(r"^--([A-Za-z0-9_]+)=(\S+)$")


def parse_xla_flags(flags, where: str) -> dict[str, str]:
    """`--name=value` strings -> {name: value}; anything else is bad input naming the flag and its source."""
    out: dict[str, str] = {}
    for flag in flags:
        m = _XLA_FLAG.match(str(flag).strip())
        if not m:
            raise BadInput(
                f"{where}: XLA flag `{flag}` is not of the form --name=value",
                "for example --xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
            )
        out[m.group(1)] = m.group(2)
    return out


def xla_flag_sources(
    device: Device, recipe: Recipe | None, settings: Settings | None
) -> dict[str, tuple[str, str]]:
    """{name: (value, where it came from)}: the generation's (a GPU machine type's) profile flags, then
    the recipe's `xla_flags`, then the site setting `xla_flags`, each merged over the last by flag name.
    None for a local device: the local backend passes no flags."""
    merged: dict[str, tuple[str, str]] = {}
    if device.is_tpu:
        base = (
            GENERATIONS[device.generation].xla_flags,
            f"generation {device.generation} (core/generations.py)",
        )
    elif device.is_gpu_nodes:
        base = (
            GPU_MACHINES[device.generation].xla_flags,
            f"machine type {device.generation} (core/generations.py)",
        )
    else:
        return merged
    layers = [base]
    if recipe is not None and recipe.xla_flags:
        layers.append((recipe.xla_flags, f"recipe {recipe.name} (xla_flags)"))
    if settings is not None and settings.xla_flags:
        src = settings.sources.get("xla_flags", "site setting") if settings.sources else "site setting"
        layers.append((tuple(settings.xla_flags.split()), f"site setting xla_flags ({src})"))
    for flags, where in layers:
        for name, value in parse_xla_flags(flags, where).items():
            if device.is_gpu_nodes and not (name.startswith("xla_") and not name.startswith("xla_tpu_")):
                raise BadInput(
                    f"{where}: `--{name}` is not one of XLA's GPU flags, and {device.name} runs on GPUs:"
                    " XLA_FLAGS with a flag XLA does not know aborts every pod at start",
                    "give TPU (libtpu) flags only to TPU slices; GPU flags are --xla_gpu_... and XLA's own --xla_...",
                )
            merged.pop(name, None)  # a later layer's flag moves to the end, where XLA reads it last
            merged[name] = (value, where)
    return merged


def xla_flags_for(device: Device, recipe: Recipe | None, settings: Settings | None) -> list[str]:
    """The XLA flags a slice's trainer gets, as `--name=value` strings (what preflight compiles with)."""
    return [f"--{k}={v}" for k, (v, _) in xla_flag_sources(device, recipe, settings).items()]


def libtpu_init_args(device: Device, recipe: Recipe | None, settings: Settings | None) -> str:
    """The pod's LIBTPU_INIT_ARGS: `xla_flags_for` joined by spaces ("" when there are none)."""
    return " ".join(xla_flags_for(device, recipe, settings))
