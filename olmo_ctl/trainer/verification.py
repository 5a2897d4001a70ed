"""`olmo-ctl verify`: evaluate a run and its reference at their common steps, with the KL between them.

The evaluations are `olmo-ctl eval`'s (`trainer/evaluate.py`) with the run's evaluators for both sides
(its recipe's `eval.downstream.tasks`, `eval.lm`, `data.tokenizer`, `train.seq_len`, `data.root`; or
`tasks` when given), so the two sides are scored on the same instances; the arithmetic and the cache
are observe/verify.py's. Everything that can be refused (no common step, a missing tokenizer, an
unknown task) is refused before the first checkpoint is read.
"""

from __future__ import annotations

import dataclasses

from olmo_ctl.core.errors import BadInput
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
    log=None,
) -> dict:
    """The landmark report: `{run, reference, landmarks: [...], verdict, evaluated, cached}`."""
    from olmo_ctl import storage
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.trainer import downstream as D

    if kl_tokens < 0:
        raise BadInput(f"--kl-tokens {kl_tokens} is negative", "0 skips the KL")
    run_path = run_path.rstrip("/")
    if not storage.store_for(run_path).exists(storage.join(run_path, "run.yaml")):
        raise BadInput(f"`{run_path}` is not a run directory (no run.yaml)", "pass the run's directory, local or gs://")
    recipe = RunDir(run_path).recipe()
    run_ck, ref_ck = V.checkpoints_of(run_path), V.checkpoints_of(ref_path)
    marks_at = V.landmarks(run_ck, ref_ck, steps, run_path, ref_path)
    chosen = recipe.eval.downstream.tasks if tasks is None else tasks
    lm_cfg = recipe.eval.lm if lm is None else lm
    kw = dict(
        tasks=tuple(chosen),
        lm=lm_cfg,
        tokenizer=D.tokenizer_spec(recipe),
        seq_len=recipe.train.seq_len,
        data_root=recipe.data.root,
        devices=devices,
        limit=limit,
    )
    settings = {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in kw.items() if k != "devices"}
    kl_settings = {"kl_tokens": kl_tokens, "lm": settings["lm"], "data_eval": list(recipe.data.eval), "root": recipe.data.root}
    kl_recipe = dataclasses.replace(recipe, eval=dataclasses.replace(recipe.eval, lm=lm_cfg))
    jobs: dict[str, object] = {}  # side -> a prepared job (tasks built once per side)
    counts = {"evaluated": 0, "cached": 0}

    def evaluation(side: str, checkpoint: str) -> dict:
        from olmo_ctl.trainer import evaluate as E

        def compute():
            ckpt = E.open_checkpoint(checkpoint)
            job = jobs.get(side)
            if job is None or job.checkpoint.model != ckpt.model:  # type: ignore[attr-defined]
                job = jobs[side] = E.prepare(ckpt, **kw)
            else:
                job = dataclasses.replace(job, checkpoint=ckpt)  # type: ignore[type-var]
            if log:
                log(f"verify: evaluating {checkpoint}")
            return E.run(job)

        out, hit = V.cached(V.cache_path(run_path, f"eval-{side}", checkpoint, settings), compute)
        counts["cached" if hit else "evaluated"] += 1
        return out

    def kl_at(step: int) -> float | None:
        if not kl_tokens:
            return None

        def compute():
            from olmo_ctl.trainer import evaluate as E
            from olmo_ctl.trainer import kl

            if log:
                log(f"verify: KL at step {step} over {kl_tokens} held-out tokens")
            ref, run = E.open_checkpoint(ref_ck[step]), E.open_checkpoint(run_ck[step])
            rows = kl.heldout_rows(kl_recipe, kl_tokens)
            value, n = kl.mean_token_kl(E.load_params(ref), ref.model, E.load_params(run), run.model, rows)
            return {"kl": value, "tokens": n}

        key = V.cache_path(run_path, "kl", ref_ck[step], {**kl_settings, "run": run_ck[step]})
        out, hit = V.cached(key, compute)
        counts["cached" if hit else "evaluated"] += 1
        return float(out["kl"])

    # Refuse what can be refused before the first checkpoint is read: the run's own evaluators.
    if tasks is not None or recipe.eval.downstream.tasks:
        D.check_tasks(kw["tasks"])
        if kw["tasks"]:
            D.tokenizer_path(kw["tokenizer"])  # type: ignore[arg-type]
    if not kw["tasks"] and not lm_cfg.enabled:
        raise BadInput(
            "the run evaluates nothing to compare: its recipe has no eval.downstream tasks and no eval.lm",
            "--tasks LABEL,... (e.g. --tasks olmo3) or --lm MIX|LABEL=PATH,...",
        )
    marks = []
    for step in marks_at:
        run_res, ref_res = evaluation("run", run_ck[step]), evaluation("reference", ref_ck[step])
        marks.append(
            V.landmark(
                step, run_res, ref_res, kl_at(step), lm_tolerance=lm_tolerance, sigmas=sigmas, kl_tolerance=kl_tolerance
            )
        )
    return {
        "run": run_path,
        "reference": ref_path,
        "landmarks": marks,
        "verdict": V.summary(marks),
        **counts,
    }
