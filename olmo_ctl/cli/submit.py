"""`olmo-ctl submit`: render one attempt of a run for a device and (without --dry-run) submit it."""

import sys
from pathlib import Path
from typing import Annotated

import typer

from olmo_ctl.backends.jobset import dump_json, dump_yaml, identity_note, placement_policy_for
from olmo_ctl.cli.app import DeviceOpt, ManifestOutput, RecipeOpt, SetOpt, StageOpt, app
from olmo_ctl.cli.options import (
    AdmissionTimeoutOpt,
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
    SlicesOpt,
    note,
)
from olmo_ctl.core.batching import make_plan
from olmo_ctl.core.config import resolve_settings
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.names import default_run_name, validate_run_name
from olmo_ctl.core.recipe import load_recipe


def _check_manifest_path(path: Path) -> None:
    if path.is_dir():
        raise BadInput(f"--output-manifest `{path}` is a directory", "give a file name, e.g. jobset.yaml")
    if not path.parent.is_dir():
        raise BadInput(f"--output-manifest: directory `{path.parent}` does not exist", "create it first")


def _write_manifest(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as e:
        raise BadInput(f"cannot write --output-manifest `{path}`: {e.strerror}") from None


@app.command()
def submit(
    device: DeviceOpt,
    slices: SlicesOpt = None,
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
    admission_timeout: AdmissionTimeoutOpt = None,
) -> None:
    """Submit one attempt of a run (a JobSet queued by Kueue); --dry-run prints exactly what is applied."""
    from olmo_ctl.supervise.attempts import make_backend, new_request, submit_attempt

    # Every cheap check (names, site settings, run root, image, queue, plan) before any compile or cluster call.
    settings = resolve_settings(kube_context=kube_context, namespace=namespace, queue=queue,
                                priority_class=priority_class, image=image, run_root=run_root,
                                service_account=service_account, placement_policy=placement_policy,
                                backend=backend)
    r = load_recipe(recipe, stage, set_ or ())
    dev = get_device(device)
    run_name = validate_run_name(run) if run is not None else default_run_name(r)
    be = make_backend(settings, dev, render_only=dry_run)
    plan = make_plan(r, dev, slices or 1)  # an existing run's own count is checked by submit_attempt
    if output_manifest is not None:
        _check_manifest_path(output_manifest)
    run_dir = f"{settings.run_root.rstrip('/')}/{run_name}"

    def show(request) -> None:
        text = dump_yaml(request) if output == ManifestOutput.yaml else dump_json(request)
        if output_manifest is not None:
            _write_manifest(output_manifest, text)
            note(f"wrote {output_manifest}")
        else:
            sys.stdout.write(text)

    extra_args = ("--allow-version-change",) if allow_version_change else ()
    if settings.backend == "gke" and identity_note(settings):
        note(identity_note(settings))
    if not dry_run:
        def preflight(n: int) -> None:  # TPU slices only, when libtpu is installed; cached per recipe/device/trainer
            if settings.backend == "gke":  # the queue, priority class and flavor Kueue needs, before anything
                from olmo_ctl.backends.doctor import submit_checks

                submit_checks(be.api_client, settings, dev, n)
            if not no_preflight:
                from olmo_ctl.preflight.compile import submit_check

                submit_check(r, dev, plan if n == plan.slices else make_plan(r, dev, n), log=note, settings=settings)

        submit_attempt(recipe=r, device=dev, settings=settings, run=run_name, run_dir=run_dir, attempt=attempt,
                       backend=be, before_create=preflight, show=show if output_manifest is not None else None,
                       extra_args=extra_args, admission_timeout_s=admission_timeout, slices=slices)
        return

    for name in settings.placeholders():
        note(f"`{name}` is the placeholder `{getattr(settings, name)}`; set --{name.replace('_', '-')}, "
             f"OLMO_CTL_{name.upper()} or `{name}:` in the config file (see `olmo-ctl config show`)")
    if settings.backend == "gke" and settings.placement_policy and placement_policy_for(dev, settings) is None:
        note(f"placement policy `{settings.placement_policy}` is not used: {dev.name} node pools carry none")
    att = new_request(run_name, run_dir, 1 if attempt is None else attempt, dev, r, settings, extra_args, plan=plan,
                      slices=plan.slices)
    show(be.printable(be.render(att)))
