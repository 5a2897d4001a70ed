"""`olmo-ctl resize` (continue a run on another device at the same global batch) and `olmo-ctl smoke`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from olmo_ctl.cli.app import DeviceOpt, app, print_json
from olmo_ctl.cli.foundation import (
    BackendOpt,
    ImageOpt,
    KubeContextOpt,
    NamespaceOpt,
    QueueOpt,
    RunRootOpt,
    note,
)

TimeoutOpt = Annotated[float, typer.Option("--timeout", min=1, help="Give up (exit 124) after this many seconds.")]


def _echo(text: str) -> None:
    sys.stderr.write(text + "\n")


def _make_backend(settings, run_root: str, device: str):
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.core.errors import BadInput

    dev = get_device(device)
    if settings.backend == "gke":
        if not dev.is_tpu:
            raise BadInput(f"`{dev.name}` is a local device; the GKE backend runs on TPU slices",
                           "use --backend local, or a TPU device such as v5p-8")
        if settings.placeholders():
            raise BadInput(f"site settings still hold placeholders ({', '.join(settings.placeholders())})",
                           "see `olmo-ctl config show`")
        from olmo_ctl.backends.gke import GKEBackend

        return GKEBackend(settings=settings)
    if dev.is_tpu:
        raise BadInput(f"`{dev.name}` is a TPU slice; the local backend runs cpu-N or gpu-N",
                       "use --backend gke, or a local device such as cpu-4")
    from olmo_ctl.backends.local import LocalBackend

    return LocalBackend(run_root)


# ---------------------------------------------------------------- smoke


@app.command()
def smoke(
    device: DeviceOpt,
    backend: BackendOpt = None,
    timeout: TimeoutOpt = 1800.0,
    junit: Annotated[Path | None, typer.Option("--junit", help="Write JUnit XML (one test case per check).")] = None,
    run_root: RunRootOpt = None,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the smoke run directories after a pass.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    kube_context: KubeContextOpt = None,
    namespace: NamespaceOpt = None,
    queue: QueueOpt = None,
    image: ImageOpt = None,
) -> None:
    """Run the smoke recipe briefly on DEVICE and check it: loss fell, checkpoint committed, a forced
    stop/resume replays exactly, events readable. Exit 0 / 1 (a check failed, named) / 124 (timeout)."""
    import shutil
    import tempfile

    from olmo_ctl.core.config import resolve_settings
    from olmo_ctl.core.errors import BadInput
    from olmo_ctl.supervise.smoke import FAULT_ENV, SmokeConfig, junit_xml, run_smoke

    settings = resolve_settings(kube_context=kube_context, namespace=namespace, queue=queue, image=image,
                                run_root=run_root, backend=backend)
    if junit is not None and (junit.is_dir() or not junit.parent.is_dir()):
        raise BadInput(f"--junit `{junit}`: not a file in an existing directory", "e.g. --junit smoke.xml")
    temp_root = None
    if settings.backend == "local" and run_root is None:
        temp_root = tempfile.mkdtemp(prefix="olmo-ctl-smoke-")
        root = temp_root
    else:
        root = settings.run_root
        if settings.backend == "gke" and not root.startswith("gs://"):
            raise BadInput(f"run root `{root}` is not on GCS; TPU pods cannot see this machine's files",
                           "set --run-root gs://BUCKET/PREFIX")
    be = _make_backend(settings, root, device)
    if settings.backend == "gke":
        cfg = SmokeConfig(device, max_steps=2000, poll_s=2.0, fault=os.environ.get(FAULT_ENV) or None)
    else:
        cfg = SmokeConfig(device, fault=os.environ.get(FAULT_ENV) or None)
    report = run_smoke(be, root, cfg, timeout, log=_echo)
    for line in report.summary_lines():
        _echo(line)
    if json_out:
        print_json(report.to_dict())
    if junit is not None:
        junit.write_text(junit_xml(report))
        note(f"wrote {junit}")
    if report.exit_code == 0 and temp_root and not keep:
        shutil.rmtree(temp_root, ignore_errors=True)
    elif report.exit_code != 0 or keep:
        note(f"run directories kept: {', '.join(report.run_dirs)}")
    raise typer.Exit(report.exit_code)


# ---------------------------------------------------------------- resize


@app.command()
def resize(
    run: Annotated[str, typer.Argument(metavar="RUN", help="The run to resize (its name under the run root).")],
    device: DeviceOpt,
    at_next_checkpoint: Annotated[bool, typer.Option(
        "--at-next-checkpoint", help="Wait for the next scheduled checkpoint to commit, then stop.")] = False,
    now: Annotated[bool, typer.Option(
        "--now", help="Stop at once: the trainer checkpoints its last completed step (the default).")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    timeout: TimeoutOpt = 3600.0,
    backend: BackendOpt = None,
    run_root: RunRootOpt = None,
    kube_context: KubeContextOpt = None,
    namespace: NamespaceOpt = None,
    queue: QueueOpt = None,
    image: ImageOpt = None,
) -> None:
    """Continue RUN on DEVICE at the same global batch: commit the latest state, stop the attempt,
    submit the next one on DEVICE. With a live supervisor, the request is recorded for it to carry out."""
    from olmo_ctl.core.config import resolve_settings
    from olmo_ctl.core.errors import BadInput
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.supervise.resize import prepare, resize_run, supervisor_alive

    if at_next_checkpoint and now:
        raise BadInput("--at-next-checkpoint and --now are exclusive", "give one of them")
    mode = "at-next-checkpoint" if at_next_checkpoint else "now"
    settings = resolve_settings(kube_context=kube_context, namespace=namespace, queue=queue, image=image,
                                run_root=run_root, backend=backend)
    rundir = RunDir.of(settings.run_root, run)
    if settings.sources.get("backend", "default") == "default":  # not chosen: the run's own backend
        last = rundir.last_attempt() or {}
        if last.get("backend") in ("gke", "local"):
            import dataclasses

            settings = dataclasses.replace(settings, backend=last["backend"])
    be = _make_backend(settings, settings.run_root, device)
    plan = prepare(rundir, be, device)
    lines = [f"resize run `{run}`: attempt {plan.from_attempt} on {plan.old.device} -> attempt {plan.to_attempt} "
             f"on {plan.new.device} ({mode})"] + ["  " + ln for ln in plan.plan_lines()]
    typer.echo("\n".join(lines))
    diff = plan.manifest_diff()
    if diff:
        typer.echo(diff)
    if supervisor_alive(rundir):
        typer.echo("a live supervisor drives this run: the resize is recorded for it to carry out")
    if not yes:
        if not sys.stdin.isatty():
            raise BadInput("resize needs a confirmation and there is no terminal to ask on", "pass -y to confirm")
        if not typer.confirm(f"Resize `{run}` to {plan.new.device}?", default=False):
            _echo("not resized; nothing changed")
            raise typer.Exit(130)
    res = resize_run(rundir, be, plan, mode, timeout, log=_echo)
    for n in res.notes:
        _echo(n)
    if res.action == "requested":
        typer.echo(f"resize request {res.request['id']} recorded for the supervisor of `{run}`")
    else:
        typer.echo(f"resized `{run}`: attempt {res.attempt} on {plan.new.device} from committed step "
                   f"{res.committed_step} (global batch {plan.new.global_batch}, per-device batch "
                   f"{plan.old.per_device_batch} -> {plan.new.per_device_batch}, accumulation "
                   f"{plan.old.grad_accum} -> {plan.new.grad_accum})")
