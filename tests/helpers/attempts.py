"""`attempt` and `attempt_of`: attempt requests built as `supervise.attempts.prepare` builds them (the
target parsed once, the recipe resolved, its plan made), for tests that hand an attempt to a backend
directly, without the backend's validation."""

from __future__ import annotations

from olmo_ctl.backends.base import Attempt, Target
from olmo_ctl.core.batching import make_plan
from olmo_ctl.core.recipe import Recipe, load_recipe


def attempt(
    run: str,
    run_dir: str,
    n: int = 1,
    device: str = "cpu-1",
    *,
    recipe: Recipe | str = "smoke",
    recipe_path: str | None = None,
    slices: int = 1,
    settings=None,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Attempt:
    """Attempt `n` of `run` on `slices` x `device`: `recipe` a shipped name or a Recipe; `recipe_path`
    is what the trainer reads (None: the run's run.yaml)."""
    r = load_recipe(recipe) if isinstance(recipe, str) else recipe
    target = Target.parse(device, slices)
    return Attempt(
        run,
        run_dir,
        n,
        target,
        r,
        make_plan(r, target.device, target.slices),
        settings=settings,
        recipe_path=recipe_path,
        extra_args=tuple(extra_args),
        env=tuple((env or {}).items()),
    )


def attempt_of(rundir, n: int, device: str, *, slices: int = 1, **kw) -> Attempt:
    """Attempt `n` of the existing run in `rundir` (its recipe from run.yaml)."""
    return attempt(rundir.name, rundir.path, n, device, recipe=rundir.recipe(), slices=slices, **kw)
