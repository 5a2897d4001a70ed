"""A stage run as ingredients, supervised as one (docs/ingredients.md).

AI2 finished OLMo 2 32B's mid-training with several anneals of one stage-1 checkpoint on different
data orders and mixes ("ingredients"), averaged into the final model (OLMo-core
src/scripts/official/OLMo2/README.md; the OLMo 3 32B release did the same with two). A recipe whose
`ingredients:` lists them is run here as:

  <run-root>/NAME/ingredients.yaml   the run of ingredients: its recipe (with the list), its start,
                                     its device, and the run name of each ingredient
  <run-root>/NAME/journal.jsonl      what happened to it as a whole (`ingredient_done`, `souped`)
  <run-root>/NAME/soup/              the soup of the ingredients' final checkpoints (`surgery soup`'s
                                     output, with soup.json)
  <run-root>/NAME-i1/ ... NAME-iN/   each ingredient: an ordinary run (run.yaml, attempts, checkpoints),
                                     which `monitor`, `logs`, `stop` and `resume-until-done` also take alone

`resume-until-done NAME` supervises the ingredients one after another (each exactly as one run is
supervised, its own attempts, retries and lease), skipping those whose final step is committed, and
souping them last. Everything it decides is read back from storage, so a second `resume-until-done`
after a Ctrl-C or a SIGKILL goes on where the first stopped and redoes nothing committed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from olmo_ctl import storage
from olmo_ctl.core.errors import EXIT_INTERRUPTED, BadInput
from olmo_ctl.core.names import MAX_RUN_NAME, validate_run_name
from olmo_ctl.core.recipe import Recipe
from olmo_ctl.rundir import Composite, RunDir, ingredient_run


def check_new(run_root: str, name: str, recipe: Recipe) -> None:
    """A new run of ingredients: its name, and every ingredient's, free (bad input, nothing written)."""
    validate_run_name(name)
    longest = ingredient_run(name, len(recipe.ingredients) - 1)
    if len(longest) > MAX_RUN_NAME:
        raise BadInput(
            f"run name `{name}` is too long for its ingredients' runs (`{longest}`: {len(longest)} characters,"
            f" at most {MAX_RUN_NAME})",
            "choose a shorter run name",
        )
    if RunDir.of(run_root, name).exists():
        raise BadInput(
            f"`{name}` is already a run of one recipe, not of ingredients",
            "choose another run name for the ingredients",
        )
    for k in range(len(recipe.ingredients)):
        rd = RunDir.of(run_root, ingredient_run(name, k))
        if rd.exists():
            raise BadInput(
                f"run `{rd.name}` already exists and is not one of `{name}`'s ingredients",
                "choose another run name, or move that run aside",
            )


def seed_start(rundir: RunDir, start_from: str, log: Callable[[str], None]) -> None:
    """Checkpoint 0 of an ingredient that has none: the start's parameters and Adam moments
    (`surgery warm-adam`), so every ingredient anneals from the same state."""
    if rundir.committed_steps():
        return
    from olmo_ctl.checkpoints.surgery import warm_adam

    res = warm_adam(start_from, rundir.path)
    log(f"{rundir.name}: starts from {start_from} (step {res['source_step']}, Adam moments kept)")


def soup_of(composite: Composite, log: Callable[[str], None]) -> dict:
    """The soup of every ingredient's final checkpoint in NAME/soup (once: a whole one is kept)."""
    done = composite.souped()
    if done is not None:
        return done
    sources = []
    for rd in composite.runs():
        final = int(rd.recipe().train.max_steps)
        sources.append(rd.p("checkpoints", str(final)))
    store = storage.store_for(composite.soup_path)
    files, _ = store.list(composite.soup_path, recursive=True)
    for f in files:  # a soup cut short (no soup.json yet) is written again from the start
        store.delete(f.path)
    if not storage.is_gcs(composite.soup_path):
        import shutil

        shutil.rmtree(composite.soup_path, ignore_errors=True)
    from olmo_ctl.checkpoints.soup import soup

    log(f"souping {len(sources)} ingredients into {composite.soup_path}")
    res = soup(sources, composite.soup_path)
    composite.dir.append("souped", reason=f"mean of {len(sources)} ingredients", out=composite.soup_path)
    return composite.souped() or res


def supervise(
    composite: Composite,
    recipe: Recipe | None,
    *,
    device: str | None,
    slices: int | None,
    start_from: str | None,
    supervise_one: Callable[[str, Recipe | None, str | None, int | None, Callable[[str], None]], int],
    log: Callable[[str], None],
) -> int:
    """Every ingredient to its final step, one after another, then the soup: 0 when the soup is
    written; else the exit code of the ingredient's supervision that ended early (130 for Ctrl-C or
    `olmo-ctl stop`, 4 gave up, ...), with the ingredients after it left as they are.

    `recipe`: a new run's (with its ingredients), or None to go on with the run of ingredients that
    exists; `supervise_one(run, recipe or None, device, slices, log)` supervises one ingredient as
    `resume-until-done` supervises one run (a new ingredient on the device the run of ingredients was
    created with; one that exists on its own)."""
    if composite.exists():
        have = composite.recipe()
        if recipe is not None and recipe.fingerprint() != have.fingerprint():
            raise BadInput(
                f"run `{composite.name}` is a run of ingredients of another recipe ({have.name})",
                f"continue it with `olmo-ctl resume-until-done {composite.name}`, or choose another run name",
            )
        spec = composite.spec()
        recipe = have
        start_from = spec.get("start_from") if start_from is None else start_from
        if device is None:
            device, slices = spec.get("device"), spec.get("slices")
        if start_from != spec.get("start_from"):
            raise BadInput(
                f"--start-from {start_from}: run `{composite.name}` started its ingredients from"
                f" {spec.get('start_from')}",
                "drop --start-from to go on",
            )
    else:
        if recipe is None:
            raise BadInput(f"run `{composite.name}` does not exist", "pass --recipe/--stage and --device")
        if device is None:
            raise BadInput(f"a new run of ingredients needs --device (run `{composite.name}`)")
        check_new(composite.run_root, composite.name, recipe)
        if start_from is not None:
            from olmo_ctl.checkpoints.surgery import check_committed

            check_committed(start_from)  # a committed training checkpoint, or bad input now
        composite.create(recipe, start_from, device, slices)
        log(
            f"run of ingredients `{composite.name}`: {len(recipe.ingredients)} runs "
            + ", ".join(ingredient_run(composite.name, k) for k in range(len(recipe.ingredients)))
            + f", then their soup in {composite.soup_path}"
        )
    if composite.dir.pending_stop() is not None:  # this supervisor was started to go on
        composite.dir.clear_stop()
    for k, rd in enumerate(composite.runs()):
        if composite.dir.pending_stop() is not None:  # `olmo-ctl stop NAME` between two ingredients
            composite.dir.clear_stop()
            composite.dir.append("stopped", reason="stopped on request (olmo-ctl stop)")
            log(f"run of ingredients `{composite.name}` stopped before {rd.name}")
            return EXIT_INTERRUPTED
        new = not rd.exists()
        sub = recipe.ingredient_recipe(k) if new else None
        if not new and rd.committed_step() >= int(rd.recipe().train.max_steps):
            continue
        if start_from is not None:
            seed_start(rd, start_from, log)
        log(f"ingredient {k + 1} of {len(recipe.ingredients)}: {rd.name}")
        rc = supervise_one(rd.name, sub, device if new else None, slices if new else None, log)
        if rc != 0:
            if composite.dir.pending_stop() is not None:
                composite.dir.clear_stop()
                composite.dir.append("stopped", reason=f"stopped on request (olmo-ctl stop) in {rd.name}")
            return rc
        composite.dir.append("ingredient_done", reason=rd.name, committed_step=rd.committed_step())
    res = soup_of(composite, log)
    log(
        f"run of ingredients `{composite.name}` is done: soup of {len(res.get('sources', []))} in {composite.soup_path}"
    )
    return 0


T = TypeVar("T")


def stop(composite: Composite, stop_one: Callable[[RunDir], T]) -> list[T]:
    """`olmo-ctl stop NAME` of a run of ingredients: its supervisor ends before the next ingredient
    (stop.json in NAME/), and every ingredient that has a live attempt or supervisor is stopped as one
    run is (`stop_one`); the results, in order. A run whose soup is written is complete: nothing."""
    if composite.souped() is not None:
        return []
    composite.dir.request_stop("stopped on request (olmo-ctl stop)")
    return [stop_one(rd) for rd in composite.runs() if rd.exists()]
