"""`olmo-ctl devices`: the TPU slice catalog, GPU nodes of GKE machine types and the local backend's devices."""

import sys
from typing import Annotated

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, print_data
from olmo_ctl.core import devices as dev
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.generations import GPU_MACHINES, generation_names


def _fmt_num(x: float) -> str:
    return f"{x:g}"


@app.command(example="olmo-ctl devices --generation v5p")
def devices(
    generation: Annotated[
        str | None,
        typer.Option(
            "--generation",
            help=f"{generation_names()}, a GPU machine type ({', '.join(GPU_MACHINES)}), cpu or gpu.",
        ),
    ] = None,
    output: OutputOpt = Output.table,
) -> None:
    """List TPU slice types, GPU nodes (XPK's machine types x N nodes) and the local backend's devices
    (cpu-N, cpu-PxD, gpu-N).

    Exit codes: 0 listed, 2 an unknown --generation.
    """
    local = dev.local_catalog()
    # A generation named by its device-name prefix (`v5litepod`) is that generation (v5e).
    generation = next((g.name for g in dev.GENERATIONS.values() if g.device_prefix == generation), generation)
    if generation is None:
        rows = dev.tpu_catalog() + dev.gpu_catalog() + local
    elif generation in dev.GENERATIONS:
        rows = dev.tpu_catalog(generation)
    elif generation in GPU_MACHINES:
        rows = dev.gpu_catalog(generation)
    elif generation in ("cpu", "gpu"):
        rows = [d for d in local if d.generation == generation]
    else:
        raise BadInput(
            f"--generation `{generation}` is not a device generation",
            f"use {generation_names()}, cpu or gpu, or a GPU machine type ({', '.join(GPU_MACHINES)})",
        )
    if output != Output.table:
        print_data([d.to_dict() for d in rows], output)
        return
    # Fits an 80-column terminal; the GKE label and machine type go in each generation's heading.
    cols = ("NAME", "TOPOLOGY", "CHIPS", "VMS", "CHIPS/VM", "DEVICES", "TFLOPS/DEV", "HBM GIB/DEV")
    widths = (13, 8, 5, 4, 8, 7, 10, 11)
    line = "  ".join(f"{{:{'<' if i < 2 else '>'}{w}}}" for i, w in enumerate(widths))
    out: list[str] = []
    heading: str | None = None
    for d in rows:
        if d.generation != heading:
            if heading is not None and heading in dev.GENERATIONS:
                out.append(_by_topology(dev.GENERATIONS[heading]))
            if heading in GPU_MACHINES:
                out.append(_by_nodes(GPU_MACHINES[heading]))
            heading = d.generation
            if out:
                out.append("")
            if d.is_gpu_nodes:
                out += _gpu_heading(GPU_MACHINES[d.generation])
            elif d.is_tpu:
                out.append(
                    f"{d.generation}: GKE accelerator {d.accelerator_label}, machine type {d.machine_type}"
                )
            else:
                out.append(f"{d.generation}: local backend, nominal peak (for MFU only)")
            if not d.is_gpu_nodes:
                out.append(line.format(*cols).rstrip())
        if d.is_gpu_nodes:
            out.append(
                GPU_LINE.format(
                    d.name,
                    d.vms,
                    d.devices,
                    _fmt_num(d.peak_tflops_per_device),
                    _fmt_num(d.hbm_gib_per_device),
                )
            )
            continue
        out.append(
            line.format(
                d.name,
                d.topology or "-",
                d.chips or "-",
                d.vms,
                d.chips_per_vm or "-",
                d.devices,
                _fmt_num(d.peak_tflops_per_device),
                _fmt_num(d.hbm_gib_per_device),
            ).rstrip()
        )
    if heading in dev.GENERATIONS:
        out.append(_by_topology(dev.GENERATIONS[heading]))
    if heading in GPU_MACHINES:
        out.append(_by_nodes(GPU_MACHINES[heading]))
    sys.stdout.write("\n".join(out) + "\n")


# GPU nodes have no topology: a node count instead, and the GPU is the device.
GPU_COLS = ("NAME", "NODES", "GPUS", "TFLOPS/GPU", "HBM GIB/GPU")
GPU_LINE = "{:<21}  {:>5}  {:>5}  {:>10}  {:>11}"


def _gpu_heading(m: dev.GpuMachine) -> list[str]:
    """A GPU machine type's heading: what a node is, its GKE labels and interconnect, and the columns."""
    return [
        f"{m.name}: machine type {m.machine_type}, {m.gpus_per_node} x {m.gpu} a node",
        f"  GKE accelerator {m.accelerator_label}, nvidia.com/gpu, {m.interconnect}",
        f"  GKE backend: launch_templates/{m.template_file} (not the local backend)",
        GPU_LINE.format(*GPU_COLS).rstrip(),
    ]


def _by_nodes(m: dev.GpuMachine) -> str:
    """The line under a GPU machine type's rows: any node count."""
    return f"and {m.name}xN for any N nodes up to {dev.MAX_GPU_NODES} ({m.name}: one node)"


def _by_topology(gen: dev.Generation) -> str:
    """The line under a generation's rows: the other slice shapes it offers, named by topology."""
    if gen.topologies:
        first = gen.topologies[1] if len(gen.topologies) > 1 else gen.topologies[0]
        one = dev.Target.parse(f"{gen.device_prefix}-{first}").name
        return f"and {gen.device_prefix}-AxB by topology ({gen.device_prefix}-{first} is {one})"
    return (
        f"and {gen.name}-AxBxC for other shapes (e.g. {gen.name}-4x4x12, {gen.name}-4x8x12):\n"
        f"  axes multiples of 4, A <= B <= C, at most {gen.max_cubes} cubes of 4x4x4"
    )
