"""Foundation commands: devices, plan, config show (submit lives in `cli/submit.py`)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from olmo_ctl.cli.app import DeviceOpt, Output, OutputOpt, RecipeOpt, SetOpt, StageOpt, app, print_json

# Site settings as flags (each wins over OLMO_CTL_<NAME> and the config file); shared with submit.
KubeContextOpt = Annotated[str | None, typer.Option("--kube-context", help="kubeconfig context.")]
NamespaceOpt = Annotated[str | None, typer.Option("--namespace", help="Kubernetes namespace.")]
QueueOpt = Annotated[str | None, typer.Option("--queue", help="Kueue LocalQueue name.")]
PriorityClassOpt = Annotated[str | None, typer.Option("--priority-class", help="Kueue WorkloadPriorityClass.")]
ImageOpt = Annotated[str | None, typer.Option("--image", help="Container image with olmo-ctl.")]
RunRootOpt = Annotated[str | None, typer.Option("--run-root", help="Where run directories live (gs://...).")]
ServiceAccountOpt = Annotated[
    str | None, typer.Option("--service-account", help="Kubernetes service account (Workload Identity).")
]
PlacementPolicyOpt = Annotated[
    str | None,
    typer.Option("--placement-policy", help="Placement policy of multi-host Ironwood node pools ({topology} ok)."),
]
BackendOpt = Annotated[str | None, typer.Option("--backend", help="gke or local.")]


def note(text: str) -> None:
    """A remark for the person at the terminal; stderr, so stdout stays machine-readable."""
    sys.stderr.write(f"note: {text}\n")


# ---------------------------------------------------------------- devices


def _fmt_num(x: float) -> str:
    return f"{x:g}"


@app.command()
def devices(
    generation: Annotated[str | None, typer.Option("--generation", help="tpu7x, v5p, cpu or gpu.")] = None,
    output: OutputOpt = Output.table,
) -> None:
    """List TPU slice types (and the local backend's cpu-N / gpu-N)."""
    from olmo_ctl.core import devices as dev
    from olmo_ctl.core.errors import BadInput

    local = dev.local_catalog()
    if generation is None:
        rows = dev.tpu_catalog() + local
    elif generation in dev.GENERATIONS:
        rows = dev.tpu_catalog(generation)
    elif generation in ("cpu", "gpu"):
        rows = [d for d in local if d.generation == generation]
    else:
        raise BadInput(f"--generation `{generation}` is not a device generation", "use tpu7x, v5p, cpu or gpu")
    if output == Output.json:
        print_json([d.to_dict() for d in rows])
        return
    # Fits an 80-column terminal; the GKE label and machine type go in each generation's heading.
    cols = ("NAME", "TOPOLOGY", "CHIPS", "VMS", "CHIPS/VM", "DEVICES", "TFLOP/S/DEV", "HBM GIB/DEV")
    widths = (10, 8, 5, 4, 8, 7, 11, 11)
    line = "  ".join(f"{{:{'<' if i < 2 else '>'}{w}}}" for i, w in enumerate(widths))
    out = []
    heading = None
    for d in rows:
        if d.generation != heading:
            heading = d.generation
            if out:
                out.append("")
            if d.is_tpu:
                out.append(f"{d.generation}: GKE accelerator {d.accelerator_label}, machine type {d.machine_type}")
            else:
                out.append(f"{d.generation}: local backend, nominal peak (for MFU only)")
            out.append(line.format(*cols).rstrip())
        out.append(line.format(d.name, d.topology or "-", d.chips or "-", d.vms, d.chips_per_vm or "-",
                               d.devices, _fmt_num(d.peak_tflops_per_device),
                               _fmt_num(d.hbm_gib_per_device)).rstrip())
    sys.stdout.write("\n".join(out) + "\n")


# ---------------------------------------------------------------- plan


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
    from olmo_ctl.core.batching import plan_report
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.core.errors import BadInput
    from olmo_ctl.core.recipe import load_recipe

    if not 0 < mfu <= 1:
        raise BadInput(f"--mfu {mfu:g} is not a fraction in (0, 1]", "for 40% pass --mfu 0.4")
    r = load_recipe(recipe, stage, set_ or ())
    report = plan_report(r, get_device(device), mfu)
    if output == Output.json:
        print_json(report)
    else:
        _print_plan(report)


# ---------------------------------------------------------------- config

config_app = typer.Typer(help="Site settings: flags > OLMO_CTL_* environment > config file.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(
    kube_context: KubeContextOpt = None,
    namespace: NamespaceOpt = None,
    queue: QueueOpt = None,
    priority_class: PriorityClassOpt = None,
    image: ImageOpt = None,
    run_root: RunRootOpt = None,
    service_account: ServiceAccountOpt = None,
    placement_policy: PlacementPolicyOpt = None,
    backend: BackendOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """Show the resolved site settings and where each value came from."""
    from olmo_ctl.core.config import DESCRIPTIONS, config_path, resolve_settings, setting_names

    s = resolve_settings(kube_context=kube_context, namespace=namespace, queue=queue,
                         priority_class=priority_class, image=image, run_root=run_root,
                         service_account=service_account, placement_policy=placement_policy, backend=backend)
    path = config_path()
    if output == Output.json:
        print_json({
            "config_file": str(path),
            "config_file_exists": path.exists(),
            "settings": s.to_dict(),
            "sources": dict(s.sources),
            "descriptions": DESCRIPTIONS,
            "placeholders": s.placeholders(),
        })
        return
    lines = [f"config file: {path}{'' if path.exists() else ' (not present)'}", ""]
    for name in setting_names():
        value = getattr(s, name)
        lines.append(f"{name:16}  {'-' if value is None else value}  ({s.sources[name]})")
    sys.stdout.write("\n".join(lines) + "\n")
    for name in s.placeholders():
        note(f"`{name}` is a placeholder: set --{name.replace('_', '-')}, OLMO_CTL_{name.upper()} or "
             f"`{name}:` in {path} before submitting")
