"""`olmo-ctl smoke`: run the smoke recipe briefly on a device and check it."""

import os
from pathlib import Path
from typing import Annotated

import typer

from olmo_ctl.cli.app import DeviceOpt, Output, OutputOpt, app, print_data
from olmo_ctl.cli.options import SiteFlags, TimeoutOpt, _echo, note, site_options
from olmo_ctl.core.errors import BadInput, Interrupted


@app.command(example="olmo-ctl smoke --backend local --device cpu-1 --junit smoke.xml")
@site_options()
def smoke(
    device: DeviceOpt,
    slices: Annotated[
        int,
        typer.Option(
            "--slices",
            min=1,
            help="Slices of --device each attempt runs on (multislice, GKE TPU multi-host slices).",
        ),
    ] = 1,
    timeout: TimeoutOpt = 1800.0,
    junit: Annotated[
        Path | None, typer.Option("--junit", help="Write JUnit XML (one test case per check).")
    ] = None,
    keep: Annotated[
        bool, typer.Option("--keep", help="Keep the smoke run directories after a pass.")
    ] = False,
    output: OutputOpt = Output.table,
    json_out: Annotated[bool, typer.Option("--json", hidden=True, help="The same as -o json.")] = False,
    *,
    site: SiteFlags,
) -> None:
    """Run the smoke recipe briefly on a device through a backend and check it.

    Checks that the loss fell, a checkpoint committed, a forced stop/resume replays exactly and the
    events are readable; the summary goes to stderr, -o json|yaml prints the report on stdout.
    Exit codes: 0 every check passed, 1 a check failed (named), 2 bad input, 124 timed out, 130 Ctrl-C
    (its attempts stopped, its scratch run directories removed unless --keep).
    """
    import shutil
    import tempfile

    from olmo_ctl.backends import backend_class, make_backend
    from olmo_ctl.backends.base import Target
    from olmo_ctl.storage import join
    from olmo_ctl.supervise.smoke import FAULT_ENV, SmokeConfig, junit_xml, new_run_name, run_smoke

    settings = site.resolve()
    if junit is not None and (junit.is_dir() or not junit.parent.is_dir()):
        raise BadInput(f"--junit `{junit}`: not a file in an existing directory", "e.g. --junit smoke.xml")
    kind = backend_class(settings.backend)
    target = Target.parse(device, slices)  # the command line's, parsed once: one line, exit 2
    dev = target.device
    name = new_run_name(dev.name)
    temp_root = None
    if kind.trains_here and site.run_root is None:  # runs on this machine: a scratch root of their own
        temp_root = tempfile.mkdtemp(prefix="olmo-ctl-smoke-")
        root = temp_root
    else:
        root = settings.run_root
    be = make_backend(settings, root)
    cfg = SmokeConfig(
        target,
        max_steps=kind.smoke.max_steps,
        poll_s=kind.smoke.poll_s,
        fault=os.environ.get(FAULT_ENV) or None,
    )
    try:
        report = run_smoke(be, root, cfg, timeout, log=_echo, run_name=name)
    except KeyboardInterrupt:  # run_smoke stopped its attempts on the way out
        if temp_root and not keep:
            shutil.rmtree(temp_root, ignore_errors=True)
            raise Interrupted(
                f"smoke stopped its attempts and removed its run directories ({temp_root})"
            ) from None
        dirs = ", ".join(join(root, n) for n in (name, f"{name}-twin"))
        raise Interrupted(f"smoke stopped its attempts; its run directories are kept: {dirs}") from None
    for line in report.summary_lines():
        _echo(line)
    if json_out:
        output = Output.json
    if output != Output.table:
        print_data(report.to_dict(), output)
    if junit is not None:
        junit.write_text(junit_xml(report))
        note(f"wrote {junit}")
    if report.exit_code == 0 and temp_root and not keep:
        shutil.rmtree(temp_root, ignore_errors=True)
    elif report.exit_code != 0 or keep:
        note(f"run directories kept: {', '.join(report.run_dirs)}")
    raise typer.Exit(report.exit_code)
