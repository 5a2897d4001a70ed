"""`olmo-ctl plan`: split a recipe's global batch over a device and estimate its compute."""

import sys
from typing import Annotated

import typer

from olmo_ctl.backends.base import Target
from olmo_ctl.cli.app import (
    DeviceOpt,
    ModelOpt,
    Output,
    OutputOpt,
    RecipeOpt,
    SetOpt,
    StageOpt,
    app,
    output_width,
    plural,
    print_data,
)
from olmo_ctl.core import schedule
from olmo_ctl.core.batching import plan_report
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe, start_note
from olmo_ctl.core.text import fit


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.2f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    h = s / 3600
    return f"{h:,.0f} h ({h / 24:,.1f} days)" if h >= 48 else f"{h:,.2f} h"


def _print_plan(r: dict, peak_note: str = "", machine_type: str | None = None) -> None:
    """The plan as a table; `machine_type`: the plan is on GPU nodes of that machine type (a chip is
    a GPU, a VM a node)."""
    gib = 1024**3
    peak = f"{r['peak_tflops_per_device']:g} TFLOP/s " + (
        f"{peak_note} per device" if peak_note else "peak per device"
    )
    chip = "GPU" if machine_type else "chip"
    size = (
        f"{plural(r['chips'], 'GPU')} on {plural(r['vms'], 'node')} ({machine_type})"
        if machine_type
        else f"{plural(r['chips'], 'chip')}, {plural(r['vms'], 'VM')}, {plural(r['devices'], 'device')}"
    )
    lines = [
        f"{r['recipe']} on {r['device'] if r['slices'] == 1 else str(r['slices']) + ' x ' + r['device']}: {size}",
        f"  global batch      {r['global_batch']} x {r['seq_len']} tokens = {r['tokens_per_step']:,} tokens/step",
        f"  per device        batch {r['per_device_batch']} x {r['grad_accum']} accumulation step(s)"
        + (
            f" = {r['global_batch'] // r['devices']} instances per step"
            if r.get("seq_shards", 1) == 1
            else f" of 1/{r['seq_shards']} instance\n  seq_shards        {r['seq_shards']} (each sequence split over"
            f" {r['seq_shards']} devices, {r['data_parallel']} groups)"
        ),
        f"  sharding          state over {plural(r['shard_group'], 'device')}"
        + (
            ""
            if r["shard_group"] * r["slices"] >= r["devices"]
            else f", {r['devices'] // r['slices'] // r['shard_group']} replicas per slice (hybrid)"
        ),
        f"  memory estimate   {r['estimated_bytes_per_device'] / gib:.1f} GiB of {r['hbm_bytes_per_device'] / gib:.0f}"
        f" GiB HBM per device (remat {r['remat']}{' ' + str(r['remat_budget']) if r['remat'] == 'budget' else ''})",
        f"  steps             {r['steps']:,} ({r['tokens']:,} tokens)",
        f"  parameters        {r['params']:,}",
        "",
        f"compute estimate at {r['mfu'] * 100:g}% MFU ({peak})",
        f"  {'':16}{'OLMo-core formula':>26}{'MaxText formula':>26}",
    ]
    e, f = r["estimate"], r["flops_per_token"]

    def row(label: str, a: str, b: str) -> str:
        return f"  {label:16}{a:>26}{b:>26}"

    lines.append(row("FLOPs per token", f"{f['olmo_core']:.3e}", f"{f['maxtext']:.3e}"))
    lines.append(
        row("step time", _duration(e["olmo_core"]["step_time_s"]), _duration(e["maxtext"]["step_time_s"]))
    )
    lines.append(
        row("wall-clock", _duration(e["olmo_core"]["wall_clock_s"]), _duration(e["maxtext"]["wall_clock_s"]))
    )
    if machine_type:
        tps = [f"{e[f]['tokens_per_s_per_device']:,.0f}" for f in ("olmo_core", "maxtext")]
        lines.append(row("tokens/s per GPU", *tps))
    if r["chips"]:
        lines.append(
            row(f"{chip}-hours", f"{e['olmo_core']['chip_hours']:,.0f}", f"{e['maxtext']['chip_hours']:,.0f}")
        )
        for kind in r.get("usd_per_chip_hour") or {}:
            label = f"USD {kind.replace('_', ' ')}"
            lines.append(
                row(label, f"${e['olmo_core']['usd'][kind]:,.0f}", f"${e['maxtext']['usd'][kind]:,.0f}")
            )
        if r.get("usd_per_chip_hour"):
            lines.append(
                f"  at your prices per {chip}-hour: "
                + ", ".join(f"{k.replace('_', ' ')} ${v:g}" for k, v in r["usd_per_chip_hour"].items())
                + " (site setting `prices`)"
            )
        elif machine_type:
            # olmo-ctl knows no prices; a GPU plan says so, with where the user's own go.
            lines.append(
                f"  USD{'':13}price unknown: set yours per GPU-hour for {r['generation']} (site setting `prices`)"
            )
    else:
        lines.append(
            row(
                "device-hours", f"{e['olmo_core']['device_hours']:.3g}", f"{e['maxtext']['device_hours']:.3g}"
            )
        )
    sys.stdout.write("\n".join(fit("\n".join(lines), output_width(), align=True)) + "\n")


@app.command(example="olmo-ctl plan --stage 1 --device tpu7x-128")
def plan(
    device: DeviceOpt,
    slices: Annotated[
        int,
        typer.Option(
            "--slices", min=1, help="N slices of --device (multislice): the batch over all of their devices."
        ),
    ] = 1,
    stage: StageOpt = None,
    model: ModelOpt = None,
    recipe: RecipeOpt = None,
    set_: SetOpt = None,
    mfu: Annotated[float, typer.Option("--mfu", help="Assumed MFU as a fraction (0.4 = 40%).")] = 0.4,
    lr_at: Annotated[
        str | None,
        typer.Option(
            "--lr-at", help="Comma-separated 1-based steps: print the learning rate each trains with."
        ),
    ] = None,
    plot_lr: Annotated[
        str | None,
        typer.Option("--plot-lr", help="Write the learning-rate curve over the whole run to this .png file."),
    ] = None,
    output: OutputOpt = Output.table,
) -> None:
    """Split a recipe's global batch over a device and estimate the compute it needs.

    Prints the per-device batch and gradient accumulation, a memory estimate, and step time,
    wall-clock and chip-hours at --mfu by two FLOPs formulas; with your prices per chip-hour in the
    site settings (`prices`), the dollars on demand and spot. Exit codes: 0 planned, 2 bad input (an
    unknown device or recipe, a batch that cannot be split, a model that does not fit).
    """
    if not 0 < mfu <= 1:
        raise BadInput(f"--mfu {mfu:g} is not a fraction in (0, 1]", "for 40% pass --mfu 0.4")
    steps = None
    if lr_at is not None:
        try:
            steps = schedule.parse_steps(lr_at)
        except ValueError as e:
            raise BadInput(f"--lr-at: {e}", "for example --lr-at 1,2000,596048") from None
    if plot_lr is not None and not plot_lr.lower().endswith(".png"):
        raise BadInput(f"--plot-lr `{plot_lr}` must name a .png file")
    from olmo_ctl.backends import resolve_settings

    r = load_recipe(recipe, stage, set_ or (), model=model)
    target = Target.parse(device, slices)
    report = plan_report(r, target.device, mfu, target.slices, prices=resolve_settings().prices)
    if steps is not None:
        report["lr_at"] = {str(s): schedule.lr_at(r, s) for s in steps}
    if plot_lr is not None:
        _plot_lr(r, plot_lr)
    if (start := start_note(r)) is not None:  # a stage that starts from another's checkpoint
        from olmo_ctl.cli.options import note

        note(start)
    if output != Output.table:
        print_data(report, output)
    else:
        d = target.device
        _print_plan(report, d.peak_note, d.machine_type if d.is_gpu_nodes else None)
        if steps is not None:
            sys.stdout.write("\nlearning rate (step: LR)\n")
            sys.stdout.write("".join(f"  {int(s):>10,}  {lr:.10g}\n" for s, lr in report["lr_at"].items()))
        if plot_lr is not None:
            sys.stdout.write(f"\nlearning-rate curve written to {plot_lr}\n")


def _plot_lr(recipe, path: str) -> None:
    """The LR over steps 1..max_steps (part boundaries sampled exactly), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from olmo_ctl.core import schedule
    from olmo_ctl.core.errors import BadInput

    xs, ys = schedule.lr_curve(recipe)
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    ax.plot(xs, ys, lw=1.5)
    for p in schedule.parts(recipe.schedule)[:-1]:
        ax.axvline(p.last_step, color="grey", ls=":", lw=1)
        ax.annotate(
            f"part ends at step {p.last_step:,}", (p.last_step, max(ys)), fontsize=8, ha="left", va="top"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title(
        f"{recipe.name}: {recipe.schedule.kind} schedule, peak {recipe.optimizer.lr:g},"
        f" {recipe.train.max_steps:,} steps"
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise BadInput(f"cannot write --plot-lr `{path}`: {e.strerror}") from None
    finally:
        plt.close(fig)
