"""`olmo-ctl doctor`: check a cluster before the first submit, one line per check with what to do."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, output_width, print_data
from olmo_ctl.cli.options import SiteFlags, site_options
from olmo_ctl.core.errors import EXIT_BAD_INPUT, EXIT_UNREACHABLE, Unreachable
from olmo_ctl.core.text import wrap


@app.command(example="olmo-ctl doctor --device tpu7x-128 --priority-class high")
@site_options(roles=("cluster", "render"))  # it checks a cluster, wherever the runs live
def doctor(
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            help="TPU slice or GPU nodes to check flavor, quota and node pools for, e.g. tpu7x-128 or"
            " h100-mega-80gb-8x2.",
        ),
    ] = None,
    slices: Annotated[int, typer.Option("--slices", min=1, help="Number of slices of --device.")] = 1,
    output: OutputOpt = Output.table,
    *,
    site: SiteFlags,
) -> None:
    """Check that a cluster can run olmo-ctl's JobSets, one line per check with what to do.

    Checks the CRDs, queues, flavor and quota, priority class, RBAC, node pools and image; for GPU nodes
    also the NCCL installer DaemonSet and the multi-network objects their pods name.
    Exit codes: 0 all passed, 2 a check failed, 3 the cluster is unreachable.
    """
    from olmo_ctl.backends.base import Target
    from olmo_ctl.backends.doctor import Check, run_checks
    from olmo_ctl.backends.kube import make_api_client
    from olmo_ctl.core.errors import BadInput

    settings = site.resolve()
    dev = Target.parse(device).device if device is not None else None
    if dev is not None and not dev.is_tpu and not dev.is_gpu_nodes:
        raise BadInput(
            f"`{dev.name}` is a local device; doctor checks a cluster for TPU slices and GPU nodes",
            "pass a TPU device such as tpu7x-128, or GPU nodes such as h100-mega-80gb-8x2",
        )
    client = make_api_client(context=settings.kube_context)
    try:
        checks = run_checks(client, settings, dev, slices)
        code = 0 if all(c.ok for c in checks) else EXIT_BAD_INPUT
    except Unreachable as e:
        checks = [Check("cluster", False, e.one_line())]
        code = EXIT_UNREACHABLE
    if output != Output.table:
        print_data({"ok": code == 0, "checks": [c.to_dict() for c in checks]}, output)
    else:
        width, columns = max(len(c.name) for c in checks), output_width()
        for c in checks:  # a long message wraps under itself, at spaces
            mark = "ok  " if c.ok and not c.message.startswith("warning:") else "warn" if c.ok else "FAIL"
            lines = wrap(f"{mark}  {c.name:<{width}}  {c.message}", columns, width + 8)
            sys.stdout.write("\n".join(lines) + "\n")
        where = client.configuration.host
        last = (
            f"{'all checks passed' if code == 0 else 'cluster unreachable' if code == 3 else 'a check failed'}"
            f" ({where}, namespace {settings.namespace})"
        )
        sys.stdout.write("\n".join(wrap(last, columns)) + "\n")
    if code:
        raise typer.Exit(code)
