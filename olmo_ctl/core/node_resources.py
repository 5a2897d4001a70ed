"""The trainer container's CPU and memory: requests equal to limits (Kubernetes' Guaranteed QoS class),
sized from the node's machine type so the trainer is the last process the kernel OOM-kills and the
kubelet evicts, not the first.

GKE keeps part of each node for the kubelet, the container runtime and the OS; what is left is the
node's allocatable CPU and memory. `gke_allocatable` applies GKE's published rule ("Memory and CPU
reservations", cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes):

- memory: 255 MiB on a machine under 1 GiB; else 25% of the first 4 GiB, 20% of the next 4 GiB, 10% of
  the next 8 GiB, 6% of the next 112 GiB and 2% of any above 128 GiB; plus the kubelet's 100 MiB
  eviction threshold;
- CPU: 6% of the first core, 1% of the next, 0.5% of the next 2 and 0.25% of any above 4.

Of the allocatable, the trainer takes TRAINER_SHARE (whole cores, whole GiB) and leaves the rest to the
DaemonSets GKE runs on every node (kube-proxy, logging, the metadata server, the device plugin).
The memory-backed `/dev/shm` is charged to the trainer's memory cgroup, so it is part of the limit,
not added to it. A site overrides the sizes (`trainer_resources: cpu=N,memory=Q`) or turns them off
(`trainer_resources: off`: no CPU or memory requested, the BestEffort pod of before).
"""

from __future__ import annotations

import math
import re

from olmo_ctl.core.errors import BadInput

MIB, GIB = 2**20, 2**30
TRAINER_SHARE = 0.95
EVICTION_THRESHOLD_MIB = 100

# Kubernetes' quantity suffixes (apimachinery's resource.Quantity): binary SI, decimal SI.
QUANTITY_SUFFIX = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": 10**-9,
    "u": 10**-6,
    "m": 10**-3,
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
# <quantity> ::= <signedNumber><suffix>, the suffix binary SI, decimal SI or a decimal exponent
# (e3, E-2): `1E` is an exa, `1E3` a thousand.
_QUANTITY = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])|[eE]([+-]?\d+))?$")


def parse_quantity(v) -> float:
    """A Kubernetes resource quantity ("256", "100m", "64Mi", "1E", "1e3", 4) as a number, of any
    magnitude (float('inf') beyond a float's); ValueError when it is none."""
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    m = _QUANTITY.match(str(v).strip())
    if m is None:
        raise ValueError(f"{v!r} is not a Kubernetes quantity")
    number, suffix, exponent = m.groups()
    try:
        if exponent is not None:
            return float(f"{number}e{exponent}")
        return float(number) * QUANTITY_SUFFIX[suffix or ""]
    except OverflowError:
        return math.inf


# (upper bound in GiB or cores, share of the band below it), GKE's bands.
_MEMORY_BANDS = ((4, 0.25), (8, 0.20), (16, 0.10), (128, 0.06), (math.inf, 0.02))
_CPU_BANDS = ((1, 0.06), (2, 0.01), (4, 0.005), (math.inf, 0.0025))


def _banded(total: float, bands: tuple[tuple[float, float], ...]) -> float:
    reserved, low = 0.0, 0.0
    for high, share in bands:
        if total <= low:
            break
        reserved += (min(total, high) - low) * share
        low = high
    return reserved


def gke_allocatable(vcpus: int, memory_gib: float) -> tuple[int, int]:
    """(CPU in millicores, memory in MiB) a GKE node of `vcpus` and `memory_gib` offers its pods."""
    if memory_gib < 1:
        mem_reserved_mib = 255.0
    else:
        mem_reserved_mib = _banded(memory_gib, _MEMORY_BANDS) * 1024
    memory_mib = memory_gib * 1024 - mem_reserved_mib - EVICTION_THRESHOLD_MIB
    cpu_m = vcpus * 1000 - _banded(vcpus, _CPU_BANDS) * 1000
    return math.floor(cpu_m), math.floor(memory_mib)


def default_trainer_resources(vcpus: int, memory_gib: float) -> dict[str, str]:
    """The trainer's share of a node's allocatable: {"cpu": "N", "memory": "NGi"} (whole cores, GiB)."""
    cpu_m, mem_mib = gke_allocatable(vcpus, memory_gib)
    cores = math.floor(cpu_m / 1000 * TRAINER_SHARE)
    gib = math.floor(mem_mib / 1024 * TRAINER_SHARE)
    return {"cpu": str(cores), "memory": f"{gib}Gi"}


_PART = re.compile(r"^(cpu|memory)=(\S+)$")


def parse_setting(value: str, where: str) -> dict[str, str] | str:
    """The site setting `trainer_resources`: "auto", "off", or "cpu=N,memory=Q" (Kubernetes quantities,
    both positive) as {"cpu": ..., "memory": ...}. BadInput for anything else."""
    v = value.strip()
    if v.lower() in ("auto", "off"):
        return v.lower()
    hint = "use auto (sized from the node type), off (none), or cpu=N,memory=Q such as cpu=200,memory=400Gi"
    parts = [_PART.match(p.strip()) for p in v.split(",")]
    if len(parts) != 2 or not all(parts) or {p.group(1) for p in parts if p} != {"cpu", "memory"}:
        raise BadInput(f"{where}: `{value}` is not a trainer resources setting", hint)
    got = {p.group(1): p.group(2) for p in parts if p}
    cpu, memory = got["cpu"], got["memory"]
    for what, q in (("cpu", cpu), ("memory", memory)):
        try:
            ok = parse_quantity(q) > 0
        except ValueError:
            ok = False
        if not ok:
            raise BadInput(f"{where}: {what} `{q}` is not a positive Kubernetes quantity", hint)
        if not math.isfinite(parse_quantity(q)):
            raise BadInput(f"{where}: {what} `{q}` is too large for a number", hint)
    if parse_quantity(memory) < GIB:
        raise BadInput(f"{where}: memory `{memory}` is under 1Gi; the trainer would be OOM-killed", hint)
    return {"cpu": cpu, "memory": memory}


def machine_of(generation: str):
    """The profile (TPU generation or GPU machine type) whose machine size is known, else None."""
    from olmo_ctl.core.generations import GENERATIONS, GPU_MACHINES

    profile = GENERATIONS.get(generation) or GPU_MACHINES.get(generation)
    return profile if profile is not None and profile.vm_vcpus else None


def trainer_resources_for(generation: str, setting: str) -> dict[str, str] | None:
    """The trainer container's {"cpu", "memory"} (requests and limits) on `generation`'s nodes under
    the site setting `trainer_resources`; None when off, or for a generation without a machine profile."""
    parsed = parse_setting(setting, "setting `trainer_resources`")
    if parsed == "off":
        return None
    profile = machine_of(generation)
    if isinstance(parsed, dict):
        if profile is not None:
            cpu_m, mem_mib = gke_allocatable(profile.vm_vcpus, profile.vm_memory_gib)
            room = {"cpu": cpu_m / 1000, "memory": mem_mib * MIB}
            shown = {"cpu": f"{cpu_m / 1000:g} cores", "memory": f"{mem_mib / 1024:.1f}Gi"}
            for r in ("cpu", "memory"):
                if parse_quantity(parsed[r]) > room[r]:
                    raise BadInput(
                        f"setting `trainer_resources`: {r} {parsed[r]} is more than one {profile.machine_type} node "
                        f"offers its pods ({shown[r]} allocatable of {profile.vm_vcpus} vCPU, "
                        f"{profile.vm_memory_gib} GiB): its pods would never schedule",
                        "ask for less, or auto to size it from the node type",
                    )
        return parsed
    if profile is None:
        return None
    return default_trainer_resources(profile.vm_vcpus, profile.vm_memory_gib)


def check_shm_fits(shm_size: str | None, resources: dict[str, str] | None) -> None:
    """The memory-backed /dev/shm is charged to the trainer's memory limit: it must leave room for the
    trainer itself (at least half the limit). BadInput otherwise."""
    if not shm_size or not resources:
        return
    shm, limit = parse_quantity(shm_size), parse_quantity(resources["memory"])
    if shm > limit / 2:
        raise BadInput(
            f"/dev/shm of {shm_size} is more than half the trainer's memory limit of {resources['memory']}; "
            "its pages count against that limit",
            "raise the memory in the site setting trainer_resources (cpu=N,memory=Q), or set it to auto",
        )
