"""`olmo-ctl preflight`: compile the real train step for a TPU slice here and check that it fits in HBM."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from olmo_ctl.cli.app import (
    ModelOpt,
    Output,
    OutputOpt,
    RecipeOpt,
    SetOpt,
    StageOpt,
    app,
    plural,
    print_data,
)
from olmo_ctl.core.errors import EXIT_RUN_FAILED, OlmoCtlError

GIB = 1024**3


class DoesNotFit(OlmoCtlError):
    """The compiled step needs more HBM than the device has. Exit 1."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message, hint, exit_code=EXIT_RUN_FAILED)


def _row(r) -> dict:
    keys = (
        "device",
        "topology",
        "devices",
        "per_device_batch",
        "grad_accum",
        "seq_shards",
        "slices",
        "remat",
        "attention",
        "head_dim",
        "n_layers",
        "hbm_bytes_per_device",
        "peak_bytes_per_device",
        "eval_peak_bytes_per_device",
        "eval_micro_batch",
        "fits",
        "shortfall_bytes_per_device",
        "argument_bytes_per_device",
        "temp_bytes_per_device",
        "xla_flops_per_step",
        "formula_flops_per_step",
        "xla_vs_formula",
        "xla_dense_flops_per_step",
        "formula_dense_flops_per_step",
        "dense_xla_vs_formula",
        "xla_attention_flops_per_step",
        "formula_attention_flops_per_step",
        "xla_recompute_flops_per_step",
        "formula_olmo_core_flops_per_step",
        "compile_s",
        "cached",
        "shipped",
        "param_count",
        "recipe",
        "recipe_fingerprint",
        "trainer_version",
        "error",
        "notes",
        "largest_buffers",
        "kernel_flops_per_step",
        "xla_flags",
    )
    d = r.to_dict()
    return {k: d[k] for k in keys}


def _tflop(x) -> str:
    return "-" if x is None else f"{x / 1e12:,.0f}"


def _print_table(results, recommended=None) -> None:
    from rich.table import Table

    from olmo_ctl.cli.app import console

    # Narrow enough for an 80-column terminal: the HBM (one figure for the slice) is in the title line,
    # adjacent cells share their padding, and the TFLOP pair wraps at its " / " when a row is wider.
    t = Table(show_edge=False, collapse_padding=True, pad_edge=False)
    for col in ("remat", "batch", "peak GiB", "eval GiB", "fits", "TFLOP/step", "compile s"):
        t.add_column(col, no_wrap=col != "TFLOP/step", min_width=len(col))
    for r in results:
        fits = "yes" if r.fits else f"no (+{r.shortfall_gib:.2f})"
        flops = (
            "-"
            if r.xla_flops_per_step is None
            else f"{_tflop(r.xla_flops_per_step)} / {_tflop(r.formula_flops_per_step)}"
        )
        t.add_row(
            r.remat,
            f"{r.per_device_batch}x{r.grad_accum}",
            f"{r.peak_gib:.2f}",
            "-" if r.eval_peak_gib is None else f"{r.eval_peak_gib:.2f}",
            fits,
            flops,
            f"{r.compile_s:.0f}" + ("+" if r.shipped else "*" if r.cached else ""),
        )
    c = console()
    first = results[0]
    c.print(
        f"{first.recipe} on {first.device} ({first.topology}, {plural(first.devices, 'device')}), "
        f"{first.n_layers} layers, head dim {first.head_dim}, {first.attention} attention, "
        f"{len(first.xla_flags)} XLA flags, "
        f"{first.hbm_bytes_per_device / GIB:.2f} GiB HBM per device",
        highlight=False,
    )
    c.print(t)
    c.print(
        "batch = micro-batch per device x accumulation; no (+X) = X GiB over the HBM; TFLOP/step = XLA (loops counted) / MaxText formula;"
        " peak = arguments + temporaries + outputs - donated; eval = the eval step's peak, in micro-batches"
        f" of {first.eval_micro_batch} instances"
        + ("; * from the cache" if any(r.cached and not r.shipped for r in results) else "")
        + (
            "; + shipped with olmo-ctl (compiled when it was built)"
            if any(r.shipped for r in results)
            else ""
        ),
        highlight=False,
    )
    for r in results:
        for note in r.notes:
            c.print(f"note ({r.remat}): {note}")
        if r.largest_buffers and (not r.fits or len(results) == 1):
            c.print(f"largest allocations per device (remat={r.remat}):", highlight=False)
            for b in r.largest_buffers:
                c.print(f"  {b}", highlight=False, markup=False)
    if recommended is not None:
        c.print(f"recommended: --remat {recommended.remat} (the cheapest recompute that fits)")


def _progress(line: str) -> None:
    """What a compile is doing, on stderr (stdout stays the table or the JSON)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _gpu_estimate(recipe, dev, slices: int, output) -> None:
    """GPU nodes: no compile here (preflight compiles for TPU slices); the plan's memory estimate,
    labelled as one. A step the estimate cannot fit is refused by the plan itself (exit 2)."""
    from olmo_ctl.core.batching import make_plan
    from olmo_ctl.preflight.compile import gpu_estimate_note

    plan = make_plan(recipe, dev, slices)
    note = gpu_estimate_note(dev, plan)
    if output == Output.table:
        print(note)
        return
    print_data(
        {
            "device": dev.name,
            "compiled": False,
            "estimated_bytes_per_device": plan.estimated_bytes_per_device,
            "hbm_bytes_per_device": plan.hbm_bytes_per_device,
            "per_device_batch": plan.per_device_batch,
            "grad_accum": plan.grad_accum,
            "note": note,
        },
        output,
    )


@app.command(example="olmo-ctl preflight --stage 1 --device tpu7x-128 --search")
def preflight(
    device: Annotated[str, typer.Option("--device", help="A TPU slice, e.g. tpu7x-128, v5p-256, v6e-8.")],
    stage: StageOpt = None,
    model: ModelOpt = None,
    recipe: RecipeOpt = None,
    slices: Annotated[
        int,
        typer.Option(
            "--slices",
            min=1,
            help="Compile for N slices of --device (multislice: the slices on the outer data-parallel axis).",
        ),
    ] = 1,
    remat: Annotated[
        str | None,
        typer.Option("--remat", help="none | mlp | save_proj | budget | full (default: the recipe's)."),
    ] = None,
    head_dim: Annotated[
        int | None, typer.Option("--head-dim", help="128 or 256 (same parameters, fewer wider heads).")
    ] = None,
    search: Annotated[
        bool,
        typer.Option(
            "--search", help="Try none, mlp, save_proj, budget, full; recommend the first that fits."
        ),
    ] = False,
    per_device_batch: Annotated[
        int | None,
        typer.Option("--per-device-batch", help="Force the micro-batch per device (default: the plan's)."),
    ] = None,
    layers: Annotated[
        int | None,
        typer.Option(
            "--layers", help="Compile a shallower model (quick checks; memory and FLOPs scale with depth)."
        ),
    ] = None,
    hbm_gib: Annotated[
        float | None,
        typer.Option("--hbm-gib", help="Judge the fit against this HBM per device instead of the device's."),
    ] = None,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Recompile even when a cached result exists.")
    ] = False,
    overrides: SetOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """Compile the real train step for a TPU slice on this machine and check that it fits in HBM.

    Reports per-device memory against HBM, FLOPs and compile time, for the recipe given by --stage
    or --recipe. GPU nodes compile nothing: the plan's memory estimate, labelled as one. Exit codes: 0
    it fits, 1 it does not (by how many GiB), 2 bad input.
    """
    from olmo_ctl.backends import resolve_settings
    from olmo_ctl.backends.base import Target
    from olmo_ctl.core.errors import BadInput
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.preflight import compile as pf

    r = load_recipe(recipe, stage, overrides or [], model=model)
    dev = Target.parse(device).device
    if dev.is_gpu_nodes:
        _gpu_estimate(r, dev, slices, output)
        return
    if not dev.is_tpu:
        raise BadInput(
            f"preflight compiles for TPU slices; `{dev.name}` is a local device",
            "pass a TPU device such as tpu7x-128 or v5p-256",
        )
    if search and remat is not None:
        raise BadInput("--search and --remat are exclusive", "--search tries every remat policy")
    if hbm_gib is not None and hbm_gib <= 0:
        raise BadInput("--hbm-gib must be positive")
    kw = pf.PreflightOptions(
        head_dim=head_dim,
        n_layers=layers,
        per_device_batch=per_device_batch,
        slices=slices,
        hbm_bytes=None if hbm_gib is None else int(hbm_gib * GIB),
        use_cache=not no_cache,
        settings=resolve_settings(),
        log=_progress,
    )
    if search:
        tried, best = pf.search(r, dev, **kw)
        if output != Output.table:
            print_data(
                {"results": [_row(x) for x in tried], "recommended_remat": best.remat if best else None},
                output,
            )
        else:
            _print_table(tried, best)
        if best is None:
            last = tried[-1]
            raise DoesNotFit(
                f"no remat policy fits {last.recipe} on {dev.name}: even remat=full needs "
                f"{last.peak_gib:.2f} GiB per device, {last.shortfall_gib:.2f} GiB over",
                f"use a smaller micro-batch (--per-device-batch {max(1, last.per_device_batch // 2)};"
                " in the recipe train.max_per_device_batch) or a larger slice",
            )
        return
    res = pf.run_preflight(r, dev, remat=remat, **kw)
    if output != Output.table:
        print_data(_row(res), output)
    else:
        _print_table([res])
    if not res.fits:
        raise DoesNotFit(
            res.verdict(),
            "try `--search` for a remat policy that fits, a smaller micro-batch"
            f" (--per-device-batch {max(1, res.per_device_batch // 2)}; in the recipe"
            " train.max_per_device_batch), or a larger slice",
        )
