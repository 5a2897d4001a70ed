"""`olmo-ctl verify`: evaluate a run and its reference at their common steps, with the KL between them.

The evaluations are `olmo-ctl eval`'s (`checkpoints/evaluate.py`) with the run's evaluators for both sides
(its recipe's `eval.downstream.tasks`, `eval.lm`, `data.tokenizer`, `train.seq_len`, `data.root`; or
`tasks` when given), so the two sides are scored on the same instances; the arithmetic and the cache
are observe/verify.py's. Everything that can be refused (no common step, a missing tokenizer, an
unknown task) is refused before the first checkpoint is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import tokenizer_spec
from olmo_ctl.observe import verify as V

# The case study's KL: 16M held-out tokens (2^24), or every one the held-out data holds when fewer.
DEFAULT_KL_TOKENS = 2**24
PRECISIONS = ("float32", "bfloat16")

# `verify --backend gke`: each evaluation (and KL) an eval job: {cache key: spec} -> {cache key: report}
Remote = Callable[[dict[str, Any]], dict[str, dict]]


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
    lm_tolerance: float | None = None,
    sigmas: float = 2.0,
    kl_tolerance: float | None = None,
    recipe_name: str | None = None,
    precision: str = "float32",
    floor: bool = True,
    remote: Remote | None = None,
    log=None,
) -> dict:
    """The landmark report: `{run, reference, precision, landmarks: [...], floor, level, verdict,
    evaluated, cached}`. Both sides are evaluated in `precision` (matmuls; logits are float32); with
    `floor`, the reference at the first landmark also in the other precision: the framework noise
    floor an `identical` landmark must stay within. `remote`: every evaluation and KL not yet kept is
    an eval job's (`verify --backend gke`), else each is computed here on `devices` host CPU devices."""
    from olmo_ctl import storage
    from olmo_ctl.rundir import RunDir

    if kl_tokens < 0:
        raise BadInput(f"--kl-tokens {kl_tokens} is negative", "0 skips the KL")
    if precision not in PRECISIONS:
        raise BadInput(f"--precision {precision}: not one of {', '.join(PRECISIONS)}")
    other = next(p for p in PRECISIONS if p != precision)
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

    run_ck, ref_ck = V.checkpoints_of(run_path), V.checkpoints_of(ref_path, steps)
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
        "precision": precision,
        "per_instance": True,
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
        "precision": precision,
    }
    jobs: dict[str, Any] = {}  # side -> a prepared job (tasks built once per side)
    counts = {"evaluated": 0, "cached": 0}
    seen_remote: set[str] = set()  # evaluated by eval jobs (counted when they came back)
    seen: dict[str, dict] = {}

    def opened(checkpoint: str, dtype: str):
        """The checkpoint, its matmuls in `dtype` (both sides in one precision)."""
        from olmo_ctl.checkpoints import evaluate as E

        ck = E.open_checkpoint(checkpoint, recipe_of(checkpoint))
        return dataclasses.replace(ck, model=dataclasses.replace(ck.model, compute_dtype=cast(Any, dtype)))

    def evaluation(side: str, checkpoint: str, dtype: str = precision) -> dict:
        from olmo_ctl.checkpoints import evaluate as E

        def compute():
            ckpt = opened(checkpoint, dtype)
            job = jobs.get(side)
            if job is None or job.checkpoint.model != ckpt.model:
                job = jobs[side] = prepare(ckpt)
            else:
                job = dataclasses.replace(job, checkpoint=ckpt)
            if log:
                log(f"verify: evaluating {checkpoint} ({dtype})")
            return E.run(job, per_instance=True)

        key = eval_key(side, checkpoint, dtype)
        if key not in seen:  # each evaluation counted once, however often the report reads it
            out, hit = V.cached(key, compute)
            if key not in seen_remote:
                counts["cached" if hit else "evaluated"] += 1
            seen[key] = out
        return seen[key]

    def eval_spec(checkpoint: str, dtype: str):
        """The evaluation as an eval job's spec: the same choices `prepare` gets here."""
        from olmo_ctl.checkpoints.evaluate import EvalSpec

        return EvalSpec(
            checkpoint,
            recipe_of(checkpoint),
            chosen_tasks,
            lm_cfg,
            tokenizer,
            recipe.train.seq_len,
            recipe.data.root,
            limit,
            precision=dtype,
            per_instance=True,
        )

    def kl_spec(rows_of: str, ref_at: tuple[str, str], run_at: tuple[str, str]):
        """KL(ref_at || run_at) over held-out rows of `rows_of`'s run (a run checkpoint: the run's
        recipe, its eval.lm as verify chose it, else its data.eval)."""
        from olmo_ctl.checkpoints.evaluate import EvalSpec

        return EvalSpec(
            rows_of,
            recipe_of(rows_of),
            (),
            lm_cfg,
            tokenizer,
            recipe.train.seq_len,
            recipe.data.root,
            kl={"reference": list(ref_at), "run": list(run_at), "tokens": kl_tokens},
        )

    def kl_between(key: str, spec, what: str) -> float:
        def compute():
            from olmo_ctl.checkpoints import evaluate as E

            if log:
                log(f"verify: KL {what} over up to {kl_tokens} held-out tokens")
            return E.run_kl(spec, E.open_checkpoint(spec.checkpoint, spec.recipe), devices)

        out, hit = V.cached(key, compute)
        if key not in seen_remote:
            counts["cached" if hit else "evaluated"] += 1
        return float(out["kl"])

    def kl_at(step: int) -> float | None:
        if not kl_tokens:
            return None
        return kl_between(kl_key(step), kl_spec_at(step), f"at step {step}")

    def kl_spec_at(step: int):
        return kl_spec(run_ck[step], (ref_ck[step], precision), (run_ck[step], precision))

    def floor_kl_spec(step: int):
        return kl_spec(run_ck[step], (ref_ck[step], precision), (ref_ck[step], other))

    def eval_key(side: str, checkpoint: str, dtype: str = precision) -> str:
        return V.cache_path(run_path, f"eval-{side}", checkpoint, {**settings, "precision": dtype})

    def kl_key(step: int) -> str:
        return V.cache_path(run_path, "kl", ref_ck[step], {**kl_settings, "run": run_ck[step]})

    def floor_kl_key(step: int) -> str:
        return V.cache_path(run_path, "kl-floor", ref_ck[step], {**kl_settings, "other": other})

    specs = {eval_key("run", run_ck[s]): eval_spec(run_ck[s], precision) for s in marks_at}
    specs |= {eval_key("reference", ref_ck[s]): eval_spec(ref_ck[s], precision) for s in marks_at}
    specs |= {kl_key(s): kl_spec_at(s) for s in marks_at} if kl_tokens else {}
    if floor and marks_at:
        first = marks_at[0]
        specs[eval_key("reference", ref_ck[first], other)] = eval_spec(ref_ck[first], other)
        specs |= {floor_kl_key(first): floor_kl_spec(first)} if kl_tokens else {}
    store = storage.store_for(run_path)
    missing = {k: spec for k, spec in specs.items() if not store.exists(k)}
    all_kept = not missing
    # Refuse what can be refused before the first checkpoint is read: the run's own evaluators (not
    # asked again when every evaluation is kept: the second verify reads them and is done).
    if not all_kept and chosen_tasks:
        from olmo_ctl.checkpoints import evaluate as E

        E.check_tasks(chosen_tasks, tokenizer)
    if not chosen_tasks and not lm_cfg.enabled:
        from olmo_ctl.checkpoints.evaluate import what_to_evaluate

        raise BadInput(
            "the run evaluates nothing to compare: its recipe has no eval.downstream tasks and no eval.lm",
            what_to_evaluate(recipe),
        )
    if remote is not None and missing:
        for key, report in remote(missing).items():  # kept as this machine's evaluations are
            V.cached(key, lambda report=report: report)
            counts["evaluated"] += 1
            seen_remote.add(key)
    noise = None
    if floor and marks_at:
        first = marks_at[0]
        ref_other = evaluation("reference", ref_ck[first], other)
        floor_kl = (
            kl_between(floor_kl_key(first), floor_kl_spec(first), f"floor at step {first}")
            if kl_tokens
            else None
        )
        noise = V.floor_of(evaluation("reference", ref_ck[first]), ref_other, floor_kl)
        noise["step"], noise["between"] = first, [precision, other]
    tps = {"run": recipe.train.global_batch * recipe.train.seq_len, **_ref_tokens_per_step(ref_path)}
    audit = _audit(run_path)
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
                floor=noise,
                tokens_per_step=tps,
                audit=audit,
            )
        )
    return {
        "run": run_path,
        "reference": ref_path,
        "precision": precision,
        "floor": noise,
        "audit": audit,
        "landmarks": marks,
        "level": V.overall_level(marks),
        "verdict": V.summary(marks),
        **counts,
    }


def _ref_tokens_per_step(ref_path: str) -> dict:
    """{reference, tolerance} of a reference that says its tokens per step: a run directory (its
    recipe's batch × sequence, exactly) or AI2's revision names (`stage1-step{N}-tokens{T}B`: T
    rounded to whole billions, so within 1e9 / N); {} when it does not say."""
    from olmo_ctl import storage
    from olmo_ctl.observe import hf_revisions
    from olmo_ctl.rundir import RunDir

    if ref_path.startswith(hf_revisions.PREFIX):
        revs = hf_revisions.revisions(ref_path)
        tps = hf_revisions.tokens_per_step(revs)
        if tps is None:
            return {}
        last = max(r.step for r in revs.values() if r.tokens_b is not None and r.step > 0)
        return {"reference": tps, "tolerance": 1e9 / last}
    if not storage.store_for(ref_path).exists(storage.join(ref_path, "run.yaml")):
        return {}
    r = RunDir(ref_path).recipe()
    return {"reference": int(r.train.global_batch * r.train.seq_len)}


def _audit(run_path: str) -> dict | None:
    """The run's data audit ({departs_at, reason, repeated, skipped, committed_step}), or None when
    the run recorded nothing to audit."""
    from olmo_ctl.checkpoints.data_audit import audit_run

    try:
        rep = audit_run(run_path)
    except BadInput:
        return None
    d = rep.first_departure or {}
    return {
        "committed_step": rep.committed_step,
        "departs_at": d.get("step"),
        "reason": d.get("reason", ""),
        "repeated": rep.repeated,
        "skipped": rep.skipped,
    }
