"""TPU and local device catalog, derived from each generation's rules rather than typed row by row.

A device name is `{prefix}-{N}` (the prefix is the generation's name unless XPK names it otherwise:
`v5litepod` for v5e). For TPUs N counts TensorCores (chips x 2 on tpu7x and v5p, chips on v6e and
v5e). On a 3D-torus generation the topology follows from the chip count by doubling the axes in the
order z, y, x starting from 2x2x1 (the single-host slice), hosts have 4 chips; slices of other shapes
(XPK's `4x4x12`, `4x8x12`, ...) are named by their topology, `{generation}-{AxBxC}`, under XPK's rule
for what a generation offers. A 2D-torus generation (v6e, v5e) lists its shapes (`v6e-2x4` is
`v6e-8`). A generation's rule (devices per chip, chips per VM, TensorCores per chip, most cubes,
sub-cube shapes or its 2D shapes) is its profile's (`core/generations.py`). Local devices (`cpu-N`,
`gpu-N`) are the local backend's; `cpu-PxD` is the multi-host twin: P trainer processes with D host
devices each (`cpu-N` is 1 x N).

GPU nodes on GKE are named by XPK's machine type and a node count in one token, `{type}x{N}`:
`h100-mega-80gb-8x160` is 160 a3-megagpu-8g nodes of 8 H100s (1,280 GPUs; XPK's name alone is one
node). One trainer process per node, its GPUs that process's devices. `plan`, `devices` and the GKE
backend take them (`launch_templates/gpu-*.yaml`); what runs only on TPU slices or this machine refuses
them (`Device.check_launchable`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.generations import GENERATIONS, GIB, GPU_MACHINES, Generation, GpuMachine
from olmo_ctl.core.text import closest

# XPK's largest axis (`generate_tpu_topologies`: A, B, C in 4..256).
MAX_TOPOLOGY_AXIS = 256

# Smallest and largest slice (in TensorCores) the catalog lists.
MIN_TPU_CORES = 8
MAX_TPU_CORES = 8192


@dataclass(frozen=True)
class Device:
    name: str
    generation: str  # a TPU generation's profile name (core/generations.py), cpu or gpu
    topology: str | None
    chips: int
    vms: int
    chips_per_vm: int
    devices: int  # JAX devices in the slice
    peak_tflops_per_device: float
    hbm_gib_per_device: float
    accelerator_label: str | None = None
    machine_type: str | None = None
    platform: str = "tpu"  # tpu | cpu | gpu

    @property
    def is_tpu(self) -> bool:
        return self.platform == "tpu"

    @property
    def is_gpu_nodes(self) -> bool:
        """GPU nodes of a GKE machine type (`h100-mega-80gb-8x20`), not the local backend's `gpu-N`."""
        return self.generation in GPU_MACHINES

    def check_launchable(self, by: str = "this command") -> None:
        """BadInput for GPU nodes where `by` (what asks: `doctor`, `an eval job`) runs only on TPU slices
        or this machine: of the launchers, only the GKE backend renders GPU nodes' pods."""
        if self.is_gpu_nodes:
            raise BadInput(
                f"`{self.name}` is GPU nodes ({self.vms} x {self.machine_type}): {by} does not run on GPU"
                " node pools",
                "`olmo-ctl submit --backend gke` runs them (`plan` and `devices` take them too); here use a"
                " TPU slice (e.g. tpu7x-128) or a local device",
            )

    @property
    def peak_note(self) -> str:
        """What an MFU against this device's peak is against, where that is not the hardware's own
        figure: a local device's peak is nominal (a round number, for an MFU to compare runs on
        this machine by). Empty for a TPU slice and GPU nodes."""
        return "" if self.is_tpu or self.is_gpu_nodes else f"nominal {self.platform.upper()} peak"

    @property
    def hbm_bytes_per_device(self) -> int:
        return int(self.hbm_gib_per_device * GIB)

    @property
    def topology_name(self) -> str:
        """The name `jax.experimental.topologies.get_topology_desc` takes (e.g. `v5p:4x4x8`)."""
        return f"{self.generation}:{self.topology}"

    @property
    def processes(self) -> int:
        """Trainer processes of one slice: one per TPU VM; P for the local `cpu-PxD`."""
        return self.vms

    @property
    def devices_per_process(self) -> int:
        return self.devices // self.vms

    def to_dict(self) -> dict:
        return {**asdict(self), "processes": self.processes, "devices_per_process": self.devices_per_process}


def tpu_topology(chips: int) -> str:
    """2x2x1 for 4 chips; each doubling grows the smallest axis, z first (2x2x2, 2x2x4, 2x4x4, 4x4x4, ...)."""
    if chips < 4 or chips & (chips - 1):
        raise ValueError(f"no TPU topology for {chips} chips")
    dims = [2, 2, 1]
    while dims[0] * dims[1] * dims[2] < chips:
        # Grow the smallest axis; ties go to the last axis so the order is x<=y<=z.
        i = max(range(3), key=lambda k: (-dims[k], k))
        dims[i] *= 2
    return "x".join(str(d) for d in dims)


def topology_problem(gen: Generation, topology: str) -> str | None:
    """Why `topology` is not a slice `gen` offers (None when it is), by XPK's rule: one of a 2D
    generation's shapes; else one of the sub-cube shapes, or A x B x C with each axis a multiple of 4
    (at most 256), A <= B <= C, and at most `gen.max_cubes` 4x4x4 cubes."""
    if gen.topologies:
        return None if topology in gen.topologies else f"{gen.name} slices are {', '.join(gen.topologies)}"
    if topology in gen.sub_cube_topologies:
        return None
    parts = topology.split("x")
    if len(parts) != 3 or not all(p.isdigit() and not p.startswith("0") for p in parts):
        return "a topology is AxBxC"
    a, b, c = (int(p) for p in parts)
    if any(d % 4 or d > MAX_TOPOLOGY_AXIS for d in (a, b, c)):
        return f"each axis is a multiple of 4 up to {MAX_TOPOLOGY_AXIS} (or one of {', '.join(gen.sub_cube_topologies)})"
    if not a <= b <= c:
        return f"axes go from smallest to largest ({'x'.join(map(str, sorted((a, b, c))))})"
    if (a // 4) * (b // 4) * (c // 4) > gen.max_cubes:
        return f"{gen.name} slices hold at most {gen.max_cubes} 4x4x4 cubes"
    return None


def topologies_of(gen: Generation, chips: int) -> list[str]:
    """Every topology of `chips` chips that `gen` offers, the most cube-like (shortest longest axis) first."""
    if gen.topologies:
        return [t for t in gen.topologies if _chips(t) == chips]
    if chips % 64:
        return [t for t in gen.sub_cube_topologies if _chips(t) == chips]
    out = []
    for a in range(4, MAX_TOPOLOGY_AXIS + 1, 4):
        for b in range(a, MAX_TOPOLOGY_AXIS + 1, 4):
            c, rest = divmod(chips, a * b)
            if c < b:
                break
            t = f"{a}x{b}x{c}"
            if not rest and topology_problem(gen, t) is None:
                out.append(t)
    return sorted(out, key=lambda t: int(t.rsplit("x", 1)[1]))


def _chips(topology: str) -> int:
    return math.prod(int(p) for p in topology.split("x"))


def _tpu_device(gen: Generation, cores: int, topology: str | None = None) -> Device:
    """The slice of `cores` TensorCores; `topology` names a shape other than the doubling rule's,
    and then names the device too (`v5p-4x4x12`). A 2D generation's shapes each have one chip count,
    so each is named by its count (`v6e-2x4` is `v6e-8`)."""
    chips = cores // gen.tensorcores_per_chip
    devices = chips * gen.devices_per_chip
    if gen.topologies:
        (shape,) = topologies_of(gen, chips)
        name, topology = f"{gen.device_prefix}-{cores}", shape
    elif topology is None or (chips >= 4 and not chips & (chips - 1) and topology == tpu_topology(chips)):
        name, topology = f"{gen.device_prefix}-{cores}", tpu_topology(chips)
    else:
        name = f"{gen.device_prefix}-{topology}"
    return Device(
        name=name,
        generation=gen.name,
        topology=topology,
        chips=chips,
        vms=max(1, chips // gen.chips_per_vm),
        chips_per_vm=min(chips, gen.chips_per_vm),
        devices=devices,
        peak_tflops_per_device=gen.peak_tflops_per_chip / gen.devices_per_chip,
        hbm_gib_per_device=gen.hbm_gib_per_chip / gen.devices_per_chip,
        accelerator_label=gen.accelerator_label,
        machine_type=gen.machine_type,
        platform="tpu",
    )


def tpu_catalog(generation: str | None = None) -> list[Device]:
    gens = [GENERATIONS[generation]] if generation else list(GENERATIONS.values())
    out = []
    for gen in gens:
        if gen.topologies:
            out += [_tpu_device(gen, _chips(t) * gen.tensorcores_per_chip) for t in gen.topologies]
            continue
        cores = MIN_TPU_CORES
        while cores <= MAX_TPU_CORES:
            out.append(_tpu_device(gen, cores))
            cores *= 2
    return out


# Most GPU nodes of one device (8,192 GPUs of 8 a node): only keeps a typo (x16000) out of the plan.
MAX_GPU_NODES = 1024
# The node counts `olmo-ctl devices` lists; any 1 <= N <= MAX_GPU_NODES is a device.
LISTED_GPU_NODES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _gpu_nodes_device(machine: GpuMachine, nodes: int) -> Device:
    """`nodes` nodes of `machine`: one trainer process per node, each node's GPUs its devices."""
    gpus = nodes * machine.gpus_per_node
    return Device(
        name=machine.name if nodes == 1 else f"{machine.name}x{nodes}",
        generation=machine.name,
        topology=None,
        chips=gpus,
        vms=nodes,
        chips_per_vm=machine.gpus_per_node,
        devices=gpus,
        peak_tflops_per_device=machine.peak_tflops_per_gpu,
        hbm_gib_per_device=machine.hbm_gib_per_gpu,
        accelerator_label=machine.accelerator_label,
        machine_type=machine.machine_type,
        platform="gpu",
    )


def gpu_catalog(machine: str | None = None) -> list[Device]:
    """GPU nodes of each machine type (or of `machine`) at the listed node counts."""
    machines = [GPU_MACHINES[machine]] if machine else list(GPU_MACHINES.values())
    return [_gpu_nodes_device(m, n) for m in machines for n in LISTED_GPU_NODES]


def _parse_gpu_nodes(name: str, machine: GpuMachine, hint: str) -> Device:
    """`h100-mega-80gb-8` (one node) or `h100-mega-80gb-8xN` (N nodes)."""
    count = name[len(machine.name) :]
    n = count[1:] if count.startswith("x") else ""
    if count and not (n.isdigit() and not n.startswith("0") and 1 <= int(n) <= MAX_GPU_NODES):
        raise BadInput(
            f"`{name}` is not a device type: GPU nodes are {machine.name}xN, N nodes from 1 to {MAX_GPU_NODES}",
            f"e.g. {machine.name}x16 (16 nodes, {16 * machine.gpus_per_node} GPUs); {hint}",
        )
    return _gpu_nodes_device(machine, int(n) if n else 1)


# Local devices: peak numbers are nominal (used only to print an MFU on the local backend).
CPU_PEAK_TFLOPS = 0.1
CPU_MEM_GIB = 8.0
GPU_PEAK_TFLOPS = 989.5  # H100/H200 dense bf16
GPU_HBM_GIB = 80.0
MAX_LOCAL = 64


def _local_device(kind: str, n: int, processes: int = 0) -> Device:
    """`cpu-N` (one process), `cpu-PxD` (`processes` = P trainer processes of n = D devices each)."""
    if kind == "cpu" and processes:
        return Device(
            f"cpu-{processes}x{n}",
            "cpu",
            None,
            0,
            processes,
            0,
            processes * n,
            CPU_PEAK_TFLOPS,
            CPU_MEM_GIB,
            platform="cpu",
        )
    if kind == "cpu":
        return Device(f"cpu-{n}", "cpu", None, 0, 1, 0, n, CPU_PEAK_TFLOPS, CPU_MEM_GIB, platform="cpu")
    return Device(f"gpu-{n}", "gpu", None, 0, 1, 0, n, GPU_PEAK_TFLOPS, GPU_HBM_GIB, platform="gpu")


def peak_note(name: str | None) -> str:
    """`Device.peak_note` of the device named `name` ("" for no name, or one that is not a device)."""
    try:
        return get_device(name).peak_note if name else ""
    except BadInput:
        return ""


def cpu_device(n: int) -> Device:
    """`cpu-N`: N host CPU devices in one process (what an evaluation on this machine runs on)."""
    if not 1 <= n <= MAX_LOCAL:
        raise BadInput(f"cpu-{n} is not a device type: cpu-N takes 1 <= N <= {MAX_LOCAL}")
    return _local_device("cpu", n)


def local_catalog() -> list[Device]:
    return (
        [_local_device("cpu", n) for n in (1, 2, 4, 8)]
        + [_local_device("cpu", d, p) for p, d in ((2, 1), (2, 2), (1, 4), (4, 1))]
        + [_local_device("gpu", n) for n in (1, 8)]
    )


def get_device(name: str) -> Device:
    """Parse and validate a device name; unknown names raise BadInput with a hint (and the name meant,
    when it differs from one only by case or a `tpu-`/`tpu` prefix: `TPU7X-128`, `tpu-v5p-256`)."""
    try:
        return _parse_device(name)
    except _NotAName as e:  # not of any family's form: the catalog's closest name, if one is close
        meant = _meant(name)
        if meant is None:
            close = closest(str(name).strip().lower(), _catalog_names())
            if close is None:
                raise
            raise BadInput(e.message, f"did you mean `{close}`? {e.hint}") from None
        raise _said_in_another_case(name, meant) from None
    except BadInput:
        meant = _meant(name)
        if meant is None:
            raise
        raise _said_in_another_case(name, meant) from None


def _said_in_another_case(name: str, meant: str) -> BadInput:
    return BadInput(
        f"`{name}` is not a device type",
        f"did you mean `{meant}`? (device names are lowercase, with no tpu- prefix; "
        "`olmo-ctl devices` lists them)",
    )


class _NotAName(BadInput):
    """A device name of no family's form (`cpu1`, `h200-141gb`, `tpu8-16`): `get_device` adds the
    catalog's closest name."""


def _catalog_names() -> list[str]:
    return [d.name for d in (*tpu_catalog(), *gpu_catalog(), *local_catalog())]


def _meant(name: str) -> str | None:
    """The catalog's name for `name` written in another case, or a TPU slice's with a `tpu-` or `tpu`
    prefix, or with the generation's name where XPK's prefix differs (`v5e-16`: `v5litepod-16`); None
    when there is none."""
    if not isinstance(name, str):
        return None
    lower = name.strip().lower()
    for prefix in ("", "tpu-", "tpu"):
        rest = lower[len(prefix) :]
        for gen in GENERATIONS.values():
            if gen.device_prefix != gen.name and rest.startswith(f"{gen.name}-"):
                rest = gen.device_prefix + rest[len(gen.name) :]
        if not lower.startswith(prefix) or rest == name:
            continue
        try:
            dev = _parse_device(rest)
        except BadInput:
            continue
        if dev.is_tpu or not prefix:
            return dev.name
    return None


def _parse_device(name: str) -> Device:
    hint = "try `olmo-ctl devices` for the list"
    if not isinstance(name, str) or "-" not in name:
        raise _NotAName(f"`{name}` is not a device type", hint)
    machine = next((m for m in GPU_MACHINES.values() if name.startswith(m.name)), None)
    if machine is not None:
        return _parse_gpu_nodes(name, machine, hint)
    gen, _, count = name.rpartition("-")
    if gen == "cpu" and "x" in count:
        return _multi_host_cpu(name, count, hint)
    profile = _profile_of(gen)
    if profile is not None and "x" in count:
        return _topology_device(name, profile, count, hint)
    if not count.isdigit() or count.startswith("0"):
        raise _NotAName(f"`{name}` is not a device type", hint)
    n = int(count)
    if gen in ("cpu", "gpu"):
        if not 1 <= n <= MAX_LOCAL:
            raise BadInput(f"`{name}` is not a device type: {gen}-N takes 1 <= N <= {MAX_LOCAL}", hint)
        return _local_device(gen, n)
    if profile is None:
        raise _NotAName(
            f"`{name}` is not a device type: unknown generation `{gen}` ({_prefix_names()}, cpu, gpu;"
            f" GPU nodes {', '.join(f'{m}xN' for m in GPU_MACHINES)})",
            hint,
        )
    if profile.topologies:
        sizes = [_chips(t) * profile.tensorcores_per_chip for t in profile.topologies]
        if n not in sizes:
            raise BadInput(
                f"`{name}` is not a device type: {gen} sizes are {', '.join(f'-{s}' for s in sizes)}", hint
            )
        return _tpu_device(profile, n)
    if n < MIN_TPU_CORES or n > MAX_TPU_CORES or n & (n - 1):
        shapes = topologies_of(profile, n // 2) if n % 2 == 0 else []
        raise BadInput(
            f"`{name}` is not a device type: {gen} sizes are powers of two from -{MIN_TPU_CORES} to -{MAX_TPU_CORES}",
            f"{n} TensorCores is {' or '.join(f'{gen}-{t}' for t in shapes[:3])}; {hint}"
            if shapes
            else f"name other shapes by their topology, e.g. {gen}-4x4x12; {hint}",
        )
    return _tpu_device(profile, n)


def _profile_of(prefix: str) -> Generation | None:
    """The generation whose devices are named `prefix-...` (`v5litepod` -> v5e), None for none."""
    return next((g for g in GENERATIONS.values() if g.device_prefix == prefix), None)


def _prefix_names() -> str:
    """`tpu7x, v5p, v6e, v5litepod (v5e)`: the TPU device-name prefixes, for messages."""
    return ", ".join(
        g.name if g.device_prefix == g.name else f"{g.device_prefix} ({g.name})" for g in GENERATIONS.values()
    )


# Most slices of one multislice run. GKE's own limit is the node pools a cluster can hold; this bound
# only keeps a typo (--slices 400) from reaching the plan.
MAX_SLICES = 64


def check_slices(device: Device, slices: int) -> int:
    """The slice count of a run on `device`: 1, or N > 1 identical TPU slices joined over the data-center
    network (multislice). GKE runs multislice on multi-host TPU node pools only; bad input otherwise."""
    if isinstance(slices, bool) or not isinstance(slices, int) or not 1 <= slices <= MAX_SLICES:
        raise BadInput(f"--slices {slices!r} is not a slice count: 1 <= N <= {MAX_SLICES}", "e.g. --slices 2")
    if slices == 1:
        return 1
    if device.is_gpu_nodes:
        machine = device.generation
        raise BadInput(
            f"--slices {slices}: `{device.name}` is GPU nodes; its name counts them, --slices joins TPU slices",
            f"name the nodes instead: {machine}x{device.vms * slices}",
        )
    if not device.is_tpu:
        raise BadInput(
            f"--slices {slices}: `{device.name}` is a local device; multislice joins TPU slices on GKE",
            "use a TPU device such as tpu7x-128 (--backend gke), or --slices 1",
        )
    if device.vms < 2:
        raise BadInput(
            f"--slices {slices}: `{device.name}` is a single-host slice; GKE runs multislice only on "
            "multi-host TPU node pools",
            f"use a multi-host slice ({device.name.rpartition('-')[0]}-16 or larger), or --slices 1",
        )
    return slices


def _topology_device(name: str, gen: Generation, topology: str, hint: str) -> Device:
    """`v5p-4x4x12`: a slice named by its topology; a shape the doubling rule gives has one name,
    `v5p-4x4x8` is `v5p-256`."""
    problem = topology_problem(gen, topology)
    if problem:
        example = f"{gen.device_prefix}-{gen.topologies[-1] if gen.topologies else '4x4x12'}"
        raise BadInput(f"`{name}` is not a device type: {problem}", f"e.g. {example}; {hint}")
    return _tpu_device(gen, _chips(topology) * gen.tensorcores_per_chip, topology)


def _multi_host_cpu(name: str, count: str, hint: str) -> Device:
    p, _, d = count.partition("x")
    if not (p.isdigit() and d.isdigit()) or p.startswith("0") or d.startswith("0"):
        raise BadInput(
            f"`{name}` is not a device type: the multi-host twin is cpu-PxD (P processes x D devices)",
            "e.g. cpu-2x2",
        )
    if not 1 <= int(p) * int(d) <= MAX_LOCAL:
        raise BadInput(f"`{name}` is not a device type: cpu-PxD takes 1 <= P x D <= {MAX_LOCAL}", hint)
    return _local_device("cpu", int(d), int(p))


@dataclass(frozen=True)
class Target:
    """Where an attempt runs: the catalog device and how many slices of it (multislice when > 1).
    Parsed once from a name (`Target.parse`: the command line, the journal, run.yaml) and passed by
    every layer as it is; nothing below reads a device name again."""

    device: Device
    slices: int = 1

    @classmethod
    def parse(cls, device: str, slices: int | None = 1) -> Target:
        """The target `device` x `slices`; BadInput (with a hint) for a name the catalog does not know,
        or a slice count the device cannot take."""
        return cls.of(get_device(device), slices)

    @classmethod
    def of(cls, device: Device, slices: int | None = 1) -> Target:
        """The target `slices` x an already parsed `device` (None: one slice); BadInput for a slice count
        the device cannot take."""
        return cls(device, check_slices(device, 1 if slices is None else slices))

    def to_dict(self) -> dict:
        """The record a backend hands the trainer (`--plan`): the catalog entry itself, not its name."""
        return {"device": asdict(self.device), "slices": self.slices}

    @classmethod
    def from_dict(cls, record: dict) -> Target:
        """The target of a `to_dict` record as it was rendered (a record of another version's fields,
        or a slice count the device cannot take: BadInput)."""
        try:
            dev = Device(**record["device"])
            slices = record.get("slices", 1)
        except (KeyError, TypeError) as e:
            raise BadInput(
                f"the target record is not one this version renders ({type(e).__name__}: {e})",
                "render the attempt with the olmo-ctl of the trainer image",
            ) from None
        return cls(dev, check_slices(dev, slices))

    @property
    def name(self) -> str:
        return self.device.name

    @property
    def on(self) -> str:
        """How a person reads it: `v5p-16`, or `2 x v5p-16` for two slices."""
        return self.name if self.slices == 1 else f"{self.slices} x {self.name}"
