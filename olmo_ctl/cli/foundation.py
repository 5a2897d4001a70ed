"""Foundation commands: devices, plan, config, submit --dry-run."""

from __future__ import annotations

from typing import Annotated

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, print_json


@app.command()
def devices(
    generation: Annotated[str | None, typer.Option("--generation", help="tpu7x or v5p.")] = None,
    output: OutputOpt = Output.table,
) -> None:
    """List TPU slice types (and the local backend's cpu-N / gpu-N)."""
    from olmo_ctl import devices as dev
    from olmo_ctl.errors import BadInput

    if generation is not None and generation not in dev.GENERATIONS:
        raise BadInput(f"--generation `{generation}` is not a TPU generation", "use tpu7x or v5p")
    rows = dev.tpu_catalog(generation) + ([] if generation else dev.local_catalog())
    if output == Output.json:
        print_json([d.to_dict() for d in rows])
        return
    from rich.table import Table

    from olmo_ctl.cli.app import console

    t = Table(show_edge=False)
    for col in ("name", "topology", "chips", "VMs", "chips/VM", "devices", "TFLOP/s/dev", "HBM GiB/dev", "label",
                "machine type"):
        t.add_column(col)
    for d in rows:
        t.add_row(d.name, d.topology or "-", str(d.chips), str(d.vms), str(d.chips_per_vm), str(d.devices),
                  f"{d.peak_tflops_per_device:g}", f"{d.hbm_gib_per_device:g}", d.accelerator_label or "-",
                  d.machine_type or "-")
    console().print(t)
