"""`olmo-ctl verify`: evaluate a run and its reference at their common steps, with the KL between them.

The evaluations are `olmo-ctl eval`'s (`checkpoints/evaluate.py`) with the run's evaluators for both sides
(its recipe's `eval.downstream.tasks`, `eval.lm`, `data.tokenizer`, `train.seq_len`, `data.root`; or
`tasks` when given), so the two sides are scored on the same instances; the arithmetic and the cache
are observe/verify.py's. Everything that can be refused (no common step, a missing tokenizer, an
unknown task) is refused before the first checkpoint is read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import tokenizer_spec
from olmo_ctl.observe import verify as V

DEFAULT_KL_TOKENS = 8192


def verify(
    run_path: str,
    ref_path: str,
    *,
    steps: list[int] | None = None,
    tasks: tuple[str, ...] | None = None,
    lm=None,
    limit: int = 0,
    kl_tokens: int = DEFAULT_KL_TOKENS,
    devices: int = 1,
    lm_tolerance: float = 0.02,
    sigmas: float = 2.0,
    kl_tolerance: float = 0.05,
    recipe_name: str | None = None,
    log=None,
) -> dict:
    """The landmark report: `{run, reference, landmarks: [...], verdict, evaluated, cached}`."""
    from olmo_ctl import storage
    from olmo_ctl.rundir import RunDir

    if kl_tokens < 0:
        raise BadInput(f"--kl-tokens {kl_tokens} is negative", "0 skips the KL")
    run_path = run_path.rstrip("/")

    def has_run_yaml(path: str) -> bool:
        return storage.store_for(path).exists(storage.join(path, "run.yaml"))

    if has_run_yaml(run_path):
        recipe = RunDir(run_path).recipe()
    elif recipe_name is not None:
        from olmo_ctl.core.recipe import load_recipe

        recipe = load_recipe(recipe_name)
    else:
        raise BadInput(
            f"`{run_path}` is not a run directory (no run.yaml)",
            "pass the run's directory (local or gs://), or --recipe NAME for one trained without run.yaml",
        )

    def recipe_of(checkpoint: str) -> str | None:
        """--recipe for a run's step directory whose run has no run.yaml (open_checkpoint's rule)."""
        parent, _, _ = checkpoint.rstrip("/").rpartition("/")
        run_dir, _, leaf = parent.rpartition("/")
        return recipe_name if leaf == "checkpoints" and not has_run_yaml(run_dir) else None

    run_ck, ref_ck = V.checkpoints_of(run_path), V.checkpoints_of(ref_path)
    marks_at = V.landmarks(run_ck, ref_ck, steps, run_path, ref_path)
    chosen = recipe.eval.downstream.tasks if tasks is None else tasks
    lm_cfg = recipe.eval.lm if lm is None else lm
    chosen_tasks, tokenizer = tuple(chosen), tokenizer_spec(recipe)
    settings = {
        "tasks": list(chosen_tasks),
        "lm": dataclasses.asdict(lm_cfg),
        "tokenizer": tokenizer,
        "seq_len": recipe.train.seq_len,
        "data_root": recipe.data.root,
        "limit": limit,
    }

    def prepare(ckpt):
        from olmo_ctl.checkpoints import evaluate as E

        return E.prepare(
            ckpt,
            tasks=chosen_tasks,
            lm=lm_cfg,
            tokenizer=tokenizer,
            seq_len=recipe.train.seq_len,
            data_root=recipe.data.root,
            devices=devices,
            limit=limit,
        )

    kl_settings = {
        "kl_tokens": kl_tokens,
        "lm": settings["lm"],
        "data_eval": list(recipe.data.eval),
        "root": recipe.data.root,
    }
    kl_recipe = dataclasses.replace(recipe, eval=dataclasses.replace(recipe.eval, lm=lm_cfg))
    jobs: dict[str, Any] = {}  # side -> a prepared job (tasks built once per side)
    counts = {"evaluated": 0, "cached": 0}

    def evaluation(side: str, checkpoint: str) -> dict:
        from olmo_ctl.checkpoints import evaluate as E

        def compute():
            ckpt = E.open_checkpoint(checkpoint, recipe_of(checkpoint))
            job = jobs.get(side)
            if job is None or job.checkpoint.model != ckpt.model:
                job = jobs[side] = prepare(ckpt)
            else:
                job = dataclasses.replace(job, checkpoint=ckpt)
            if log:
                log(f"verify: evaluating {checkpoint}")
            return E.run(job)

        out, hit = V.cached(eval_key(side, checkpoint), compute)
        counts["cached" if hit else "evaluated"] += 1
        return out

    def kl_at(step: int) -> float | None:
        if not kl_tokens:
            return None

        def compute():
            from olmo_ctl.checkpoints import evaluate as E
            from olmo_ctl.checkpoints import kl

            if log:
                log(f"verify: KL at step {step} over {kl_tokens} held-out tokens")
            ref = E.open_checkpoint(ref_ck[step], recipe_of(ref_ck[step]))
            run = E.open_checkpoint(run_ck[step], recipe_of(run_ck[step]))
            rows = kl.heldout_rows(kl_recipe, kl_tokens)
            value, n = kl.mean_token_kl(E.load_params(ref), ref.model, E.load_params(run), run.model, rows)
            return {"kl": value, "tokens": n}

        out, hit = V.cached(kl_key(step), compute)
        counts["cached" if hit else "evaluated"] += 1
        return float(out["kl"])

    def eval_key(side: str, checkpoint: str) -> str:
        return V.cache_path(run_path, f"eval-{side}", checkpoint, settings)

    def kl_key(step: int) -> str:
        return V.cache_path(run_path, "kl", ref_ck[step], {**kl_settings, "run": run_ck[step]})

    keys = [eval_key("run", run_ck[s]) for s in marks_at] + [
        eval_key("reference", ref_ck[s]) for s in marks_at
    ]
    keys += [kl_key(s) for s in marks_at] if kl_tokens else []
    store = storage.store_for(run_path)
    all_kept = all(store.exists(k) for k in keys)
    # Refuse what can be refused before the first checkpoint is read: the run's own evaluators (not
    # asked again when every evaluation is kept: the second verify reads them and is done).
    if not all_kept and chosen_tasks:
        from olmo_ctl.checkpoints import evaluate as E

        E.check_tasks(chosen_tasks, tokenizer)
    if not chosen_tasks and not lm_cfg.enabled:
        raise BadInput(
            "the run evaluates nothing to compare: its recipe has no eval.downstream tasks and no eval.lm",
            "--tasks LABEL,... (e.g. --tasks olmo3) or --lm MIX|LABEL=PATH,...",
        )
    marks = []
    for step in marks_at:
        run_res, ref_res = evaluation("run", run_ck[step]), evaluation("reference", ref_ck[step])
        marks.append(
            V.landmark(
                step,
                run_res,
                ref_res,
                kl_at(step),
                lm_tolerance=lm_tolerance,
                sigmas=sigmas,
                kl_tolerance=kl_tolerance,
            )
        )
    return {
        "run": run_path,
        "reference": ref_path,
        "landmarks": marks,
        "verdict": V.summary(marks),
        **counts,
    }
