"""`olmo-ctl plan`: split a recipe's global batch over a device and estimate its compute."""

import sys
from typing import Annotated

import typer

from olmo_ctl.cli.app import DeviceOpt, Output, OutputOpt, RecipeOpt, SetOpt, StageOpt, app, print_json
from olmo_ctl.core.batching import plan_report
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.2f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    h = s / 3600
    return f"{h:,.0f} h ({h / 24:,.1f} days)" if h >= 48 else f"{h:,.2f} h"


def _print_plan(r: dict) -> None:
    gib = 1024**3
    lines = [
        f"{r['recipe']} on {r['device']}: {r['chips']} chips, {r['vms']} VM{'s' if r['vms'] != 1 else ''},"
        f" {r['devices']} devices",
        f"  global batch      {r['global_batch']} x {r['seq_len']} tokens = {r['tokens_per_step']:,} tokens/step",
        f"  per device        batch {r['per_device_batch']} x {r['grad_accum']} accumulation step(s)"
        f" = {r['global_batch'] // r['devices']} instances per step",
        f"  memory estimate   {r['estimated_bytes_per_device'] / gib:.1f} GiB of {r['hbm_bytes_per_device'] / gib:.0f}"
        f" GiB HBM per device (remat {r['remat']})",
        f"  steps             {r['steps']:,} ({r['tokens']:,} tokens)",
        f"  parameters        {r['params']:,}",
        "",
        f"compute estimate at {r['mfu'] * 100:g}% MFU ({r['peak_tflops_per_device']:g} TFLOP/s peak per device)",
        f"  {'':16}{'OLMo-core formula':>26}{'MaxText formula':>26}",
    ]
    e, f = r["estimate"], r["flops_per_token"]

    def row(label: str, a: str, b: str) -> str:
        return f"  {label:16}{a:>26}{b:>26}"

    lines.append(row("FLOPs per token", f"{f['olmo_core']:.3e}", f"{f['maxtext']:.3e}"))
    lines.append(row("step time", _duration(e["olmo_core"]["step_time_s"]), _duration(e["maxtext"]["step_time_s"])))
    lines.append(row("wall-clock", _duration(e["olmo_core"]["wall_clock_s"]),
                     _duration(e["maxtext"]["wall_clock_s"])))
    if r["chips"]:
        lines.append(row("chip-hours", f"{e['olmo_core']['chip_hours']:,.0f}", f"{e['maxtext']['chip_hours']:,.0f}"))
    else:
        lines.append(row("device-hours", f"{e['olmo_core']['device_hours']:.3g}",
                         f"{e['maxtext']['device_hours']:.3g}"))
    sys.stdout.write("\n".join(lines) + "\n")


@app.command()
def plan(
    device: DeviceOpt,
    stage: StageOpt = None,
    recipe: RecipeOpt = None,
    set_: SetOpt = None,
    mfu: Annotated[float, typer.Option("--mfu", help="Assumed MFU as a fraction (0.4 = 40%).")] = 0.4,
    output: OutputOpt = Output.table,
) -> None:
    """Split the recipe's global batch over a device and estimate the compute it needs."""
    if not 0 < mfu <= 1:
        raise BadInput(f"--mfu {mfu:g} is not a fraction in (0, 1]", "for 40% pass --mfu 0.4")
    r = load_recipe(recipe, stage, set_ or ())
    report = plan_report(r, get_device(device), mfu)
    if output == Output.json:
        print_json(report)
    else:
        _print_plan(report)
