"""`attempt`: an attempt request built as the supervisor builds one (the target parsed once, the
recipe resolved, its plan made), for tests that hand an attempt to a backend directly."""

from __future__ import annotations

from olmo_ctl.backends.base import Attempt, Target
from olmo_ctl.core.recipe import Recipe, load_recipe
from olmo_ctl.supervise.attempts import new_request


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
    env: dict[str, str] | tuple[tuple[str, str], ...] | None = None,
) -> Attempt:
    """Attempt `n` of `run` on `slices` x `device`: `recipe` a shipped name or a Recipe; `recipe_path`
    is what the trainer reads (None: the run's run.yaml)."""
    r = load_recipe(recipe) if isinstance(recipe, str) else recipe
    req = new_request(
        run, run_dir, n, Target.parse(device, slices), r, settings, tuple(extra_args), dict(env or {})
    )
    if recipe_path is None:
        return req
    from dataclasses import replace

    return replace(req, recipe_path=recipe_path)
