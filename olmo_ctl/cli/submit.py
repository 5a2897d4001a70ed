"""`olmo-ctl submit`: render one attempt of a run for a device and (without --dry-run) submit it."""

import sys
from pathlib import Path
from typing import Annotated

import typer

from olmo_ctl.backends.jobset import dump_json, dump_yaml
from olmo_ctl.cli.app import ManifestOutput, ModelOpt, RecipeOpt, SetOpt, StageOpt, app
from olmo_ctl.cli.options import (
    AdmissionTimeoutOpt,
    AllowVersionChangeOpt,
    SiteFlags,
    SlicesOpt,
    note,
    site_options,
)
from olmo_ctl.core.devices import Target
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.names import default_run_name, validate_run_name
from olmo_ctl.core.recipe import load_recipe, start_note


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


@app.command(example="olmo-ctl submit --stage 1 --device tpu7x-128 --dry-run")
@site_options()
def submit(
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            help="Device type of a new run, e.g. tpu7x-128, v5p-256, cpu-4 (an existing run: its own).",
        ),
    ] = None,
    slices: SlicesOpt = None,
    stage: StageOpt = None,
    model: ModelOpt = None,
    recipe: RecipeOpt = None,
    set_: SetOpt = None,
    run: Annotated[
        str | None, typer.Option("--run", help="Run name (default: from the recipe name).")
    ] = None,
    attempt: Annotated[
        int | None,
        typer.Option("--attempt", min=0, help="Attempt number (default: the next one)."),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the JobSet (local: the command line) this submit would send, after the same checks "
            "of the run and recipe (same refusals); submit nothing, write nothing.",
        ),
    ] = False,
    output: Annotated[
        ManifestOutput, typer.Option("--output", "-o", help="yaml or json.")
    ] = ManifestOutput.yaml,
    output_manifest: Annotated[
        Path | None, typer.Option("--output-manifest", help="Write the manifest to FILE instead of stdout.")
    ] = None,
    no_preflight: Annotated[
        bool, typer.Option("--no-preflight", help="Skip compiling the step for the slice before submitting.")
    ] = False,
    allow_version_change: AllowVersionChangeOpt = False,
    admission_timeout: AdmissionTimeoutOpt = None,
    *,
    site: SiteFlags,
) -> None:
    """Create a run or its next attempt and submit it; --dry-run prints exactly what is applied.

    On GKE an attempt is a JobSet queued by Kueue; locally, trainer processes. An existing run's
    next attempt takes its recipe, device and slice count from the run; a complete run submits
    nothing; a directory that lost its run.yaml but keeps a run's journal or checkpoints is refused.
    --dry-run makes the same checks of the run directory and recipe and prints the attempt with the
    number submit would give it. Exit codes: 0 submitted (or nothing to do), 2 bad input (nothing
    submitted), 3 cluster or storage unreachable.
    """
    from olmo_ctl.supervise.submit import dry_run as render_dry_run
    from olmo_ctl.supervise.submit import prepare_run, refuse_ingredients, submit_run

    # Every cheap check (names, site settings, run root, image, queue, plan) before any compile or cluster call.
    settings = site.resolve()
    r = (
        load_recipe(recipe, stage, set_ or (), model=model)
        if (recipe is not None or stage is not None or model is not None)
        else None
    )
    if r is None and set_:
        raise BadInput("--set needs --recipe or --stage", "an existing run keeps its recipe (run.yaml)")
    if r is not None and r.ingredients:
        raise BadInput(
            f"{r.name} is a run of {len(r.ingredients)} ingredients, souped at the end: `resume-until-done`"
            " runs it (docs/ingredients.md)",
            "or submit one ingredient's settings alone with --set ingredients=[] (plus its own --set)",
        )
    if run is None and r is None:
        raise BadInput("which run?", "pass --run NAME for an existing run, or --recipe/--stage with --device")
    run_name = validate_run_name(run) if run is not None else default_run_name(r)
    if output_manifest is not None:
        _check_manifest_path(output_manifest)

    def show(request) -> None:
        text = dump_yaml(request) if output == ManifestOutput.yaml else dump_json(request)
        if output_manifest is not None:
            _write_manifest(output_manifest, text)
            note(f"wrote {output_manifest}")
        else:
            sys.stdout.write(text)

    extra_args = ("--allow-version-change",) if allow_version_change else ()
    if dry_run:  # what this submit would do, its refusals included; nothing written
        shown = render_dry_run(
            settings,
            run_name,
            r,
            None if device is None else Target.parse(device, slices).device,
            slices,
            attempt,
            extra_args,
        )
        start = start_note(r) if r is not None else None  # it starts from another stage's checkpoint
        for line in shown.notes + ([start] if start is not None else []):
            note(line)
        if shown.request is None:
            assert shown.prepared is not None
            note(
                f"run `{run_name}` is complete (checkpoint {shown.prepared.committed_step} of "
                f"{shown.prepared.request.recipe.train.max_steps} committed): a submit sends nothing"
            )
            return
        show(shown.backend.printable(shown.backend.render(shown.request)))
        return
    prep = prepare_run(
        settings,
        run_name,
        recipe=r,
        device=None if device is None else Target.parse(device, slices).device,
        slices=slices,
        attempt=attempt,
        extra_args=extra_args,
    )
    refuse_ingredients(prep)  # after prepare_run's cheaper checks
    start = start_note(r) if r is not None else None  # it starts from another stage's checkpoint
    for line in prep.notes + ([start] if start is not None else []):
        note(line)
    done = submit_run(
        prep,
        preflight=not no_preflight,
        log=note,
        show=show if output_manifest is not None else None,
        admission_timeout_s=admission_timeout,
        numbered=attempt is not None,
    )
    rd = prep.rundir
    out = typer.echo
    out(f"run directory: {rd.path}")
    if done.handle is None:
        out(
            f"run `{rd.name}` is complete (checkpoint {prep.committed_step} of "
            f"{prep.request.recipe.train.max_steps} committed): nothing submitted"
        )
        out("next: read it with")
        out(f"  olmo-ctl monitor {rd.path}")
        return
    out(
        f"attempt {done.handle.attempt} of run `{rd.name}` submitted on {prep.on} "
        f"({prep.backend.name}: {done.handle.name})"
    )
    out("next: supervise it until the final step with")
    out(
        f"  olmo-ctl resume-until-done {rd.name} --run-root {prep.settings.run_root} --backend {prep.backend.name}"
    )
    out(f"  olmo-ctl monitor {rd.path}")
