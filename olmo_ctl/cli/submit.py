"""`olmo-ctl submit`: render one attempt of a run for a device and (without --dry-run) submit it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from olmo_ctl.cli.app import DeviceOpt, ManifestOutput, RecipeOpt, SetOpt, StageOpt, app
from olmo_ctl.cli.options import (
    AllowVersionChangeOpt,
    BackendOpt,
    ImageOpt,
    KubeContextOpt,
    NamespaceOpt,
    PlacementPolicyOpt,
    PriorityClassOpt,
    QueueOpt,
    RunRootOpt,
    ServiceAccountOpt,
    note,
)


def run_dir_for(run_root: str, run: str) -> str:
    return f"{run_root.rstrip('/')}/{run}"


def _write_manifest(path: Path, text: str) -> None:
    from olmo_ctl.core.errors import BadInput

    if path.is_dir():
        raise BadInput(f"--output-manifest `{path}` is a directory", "give a file name, e.g. jobset.yaml")
    if not path.parent.is_dir():
        raise BadInput(f"--output-manifest: directory `{path.parent}` does not exist", "create it first")
    try:
        path.write_text(text)
    except OSError as e:
        raise BadInput(f"cannot write --output-manifest `{path}`: {e.strerror}") from None


@app.command()
def submit(
    device: DeviceOpt,
    stage: StageOpt = None,
    recipe: RecipeOpt = None,
    set_: SetOpt = None,
    run: Annotated[str | None, typer.Option("--run", help="Run name (default: from the recipe name).")] = None,
    attempt: Annotated[
        int | None,
        typer.Option("--attempt", min=0, help="Attempt number (default: the next one; 1 for --dry-run)."),
    ] = None,
    backend: BackendOpt = None,
    run_root: RunRootOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the JobSet (local: the command line); submit nothing.")
    ] = False,
    output: Annotated[ManifestOutput, typer.Option("--output", "-o", help="yaml or json.")] = ManifestOutput.yaml,
    output_manifest: Annotated[
        Path | None, typer.Option("--output-manifest", help="Write the manifest to FILE instead of stdout.")
    ] = None,
    kube_context: KubeContextOpt = None,
    namespace: NamespaceOpt = None,
    queue: QueueOpt = None,
    priority_class: PriorityClassOpt = None,
    image: ImageOpt = None,
    service_account: ServiceAccountOpt = None,
    placement_policy: PlacementPolicyOpt = None,
    no_preflight: Annotated[
        bool, typer.Option("--no-preflight", help="Skip compiling the step for the slice before submitting.")
    ] = False,
    allow_version_change: AllowVersionChangeOpt = False,
) -> None:
    """Submit one attempt of a run (a JobSet queued by Kueue); --dry-run prints exactly what is applied."""
    from olmo_ctl.backends.jobset import (
        default_run_name,
        dump_json,
        dump_yaml,
        placement_policy_for,
        render_jobset,
        validate_run_name,
    )
    from olmo_ctl.core.batching import make_plan
    from olmo_ctl.core.config import resolve_settings
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.core.errors import BadInput
    from olmo_ctl.core.recipe import load_recipe

    settings = resolve_settings(kube_context=kube_context, namespace=namespace, queue=queue,
                                priority_class=priority_class, image=image, run_root=run_root,
                                service_account=service_account, placement_policy=placement_policy,
                                backend=backend)
    r = load_recipe(recipe, stage, set_ or ())
    dev = get_device(device)
    if settings.backend == "gke" and not dev.is_tpu:
        raise BadInput(f"`{dev.name}` is a local device; the GKE backend runs on TPU slices",
                       "use --backend local, or a TPU device such as tpu7x-128")
    plan = make_plan(r, dev)
    run_name = validate_run_name(run) if run is not None else default_run_name(r)
    run_dir = run_dir_for(settings.run_root, run_name)

    if not dry_run:
        if settings.placeholders():
            names = ", ".join(settings.placeholders())
            raise BadInput(f"site settings still hold placeholders ({names})",
                           "see `olmo-ctl config show`; --dry-run works without them")
        try:
            from olmo_ctl.supervise.attempts import submit_attempt
        except ModuleNotFoundError as e:
            if e.name not in ("olmo_ctl.supervise", "olmo_ctl.supervise.attempts"):
                raise
            raise BadInput("submit without --dry-run needs the supervisor (olmo_ctl.supervise), which is missing",
                           "use --dry-run to render the manifest") from None
        if not no_preflight:  # TPU slices only, when libtpu is installed; cached per recipe/device/trainer
            from olmo_ctl.preflight.compile import submit_check

            submit_check(r, dev, plan, log=note)
        submit_attempt(recipe=r, device=dev, plan=plan, settings=settings, run=run_name, run_dir=run_dir,
                       attempt=attempt, output_manifest=output_manifest,
                       extra_args=("--allow-version-change",) if allow_version_change else ())
        return

    attempt = 1 if attempt is None else attempt
    if settings.backend == "local":
        # The local backend's request: the trainer's command line and environment on this machine.
        from olmo_ctl.backends.base import Attempt

        try:
            from olmo_ctl.backends.local import LocalBackend
        except ModuleNotFoundError as e:
            if e.name != "olmo_ctl.backends.local":
                raise
            raise BadInput("this installation has no local backend", "use --backend gke") from None

        request = LocalBackend(settings.run_root).render(
            Attempt(run=run_name, run_dir=run_dir, attempt=attempt, device=dev.name)).to_dict()
    else:
        request = render_jobset(r, plan, dev, settings, run_name, attempt, run_dir)
    text = dump_yaml(request) if output == ManifestOutput.yaml else dump_json(request)
    for name in settings.placeholders():
        note(f"`{name}` is the placeholder `{getattr(settings, name)}`; set --{name.replace('_', '-')}, "
             f"OLMO_CTL_{name.upper()} or `{name}:` in the config file (see `olmo-ctl config show`)")
    if settings.backend == "gke" and settings.placement_policy and placement_policy_for(dev, settings) is None:
        note(f"placement policy `{settings.placement_policy}` is not used: {dev.name} node pools carry none")
    if output_manifest is not None:
        _write_manifest(output_manifest, text)
        note(f"wrote {output_manifest}")
    else:
        sys.stdout.write(text)
