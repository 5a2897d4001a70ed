"""`olmo-ctl verify RUN --reference REF`: does a run converge like its reference, landmark by landmark?

The case study's proof of a faithful reproduction, on four surfaces at every step both have a
checkpoint of (a landmark):

- held-out loss: Δ per domain of the LM evaluator's CE loss (run - reference), moved when any |Δ|
  passes `lm_tolerance` nats;
- downstream: Δ per task of its own metric, and Δ of the macro accuracy (the mean over the accuracy
  tasks: `acc`, `len_norm`) with σ, the per-task standard errors of both sides combined in quadrature
  (σ = sqrt(Σ_t se_run,t² + se_ref,t²) / n); moved when |Δ macro| > `sigmas` σ;
- token-level KL(reference || run) on identical held-out tokens, moved above `kl_tolerance`.

A landmark is within noise when no surface moved; its verdict names the ones that did. The numbers
come from `olmo-ctl eval` results (the contract of `-o json`), computed by the caller and cached in
the run directory (`eval/verify/`), so a second `verify` evaluates nothing.

Pure: no jax here (the caller evaluates); matplotlib only for the plot.
"""

from __future__ import annotations

import hashlib
import json
import math
import re

from olmo_ctl import storage
from olmo_ctl.core.errors import BadInput

ACCURACY_KEYS = ("acc_v1", "len_norm_v1")  # the own metric of an accuracy task (ICLMetric's keys)
STEP_NAME = re.compile(r"^(?:.*step[-_]?)?(\d+)$")  # 10000, step-10000, stage1-step10000
CACHE_DIR = "eval/verify"


def primary_key(metrics: dict) -> str:
    """The task's own metric: the first key `icl_metrics` returns (its metric type's `_v1`)."""
    return next(k for k in metrics if k != "stderr")


def checkpoints_of(path: str) -> dict[int, str]:
    """{step: checkpoint} of a run directory (its committed checkpoints) or of a directory of
    checkpoints named by step (`stage1-step10000`, `step-10000`, `10000`: the trailing number)."""
    from olmo_ctl.rundir import RunDir

    store = storage.store_for(path)
    base = path.rstrip("/")
    if store.exists(storage.join(base, "run.yaml")) or store.list(storage.join(base, "checkpoints") + "/")[1]:
        return {s: storage.join(base, "checkpoints", str(s)) for s in RunDir(base).committed_steps()}
    if not store.exists(base) and not store.list(base + "/")[1]:
        raise BadInput(
            f"`{path}` does not exist", "a run directory or a directory of checkpoints named by step"
        )
    out: dict[int, str] = {}
    for sub in store.list(base + "/")[1]:
        name = sub.rstrip("/").rsplit("/", 1)[-1]
        m = STEP_NAME.search(name)
        if m:
            out[int(m.group(1))] = storage.join(base, name)
    return out


def landmarks(
    run: dict[int, str], ref: dict[int, str], wanted: list[int] | None, run_path: str, ref_path: str
):
    """The steps both have (or those of `wanted`, each of which both must have), ascending."""
    common = sorted(set(run) & set(ref))
    if wanted:
        missing = [s for s in wanted if s not in run or s not in ref]
        if missing:
            raise BadInput(
                f"step {missing[0]} is not a checkpoint of both the run and the reference",
                f"steps both have: {', '.join(map(str, common)) or 'none'}",
            )
        return sorted(set(wanted))
    if not common:
        raise BadInput(
            f"the run `{run_path}` and the reference `{ref_path}` have no checkpoint step in common",
            f"the run has {_some(run)}; the reference has {_some(ref)}",
        )
    return common


def _some(steps: dict[int, str]) -> str:
    s = sorted(steps)
    if not s:
        return "none"
    return ", ".join(map(str, s[:6])) + (f", ... ({len(s)} in all)" if len(s) > 6 else "")


def macro(downstream: dict[str, dict]) -> tuple[float, list[str]]:
    """(mean own metric over the accuracy tasks, those tasks)."""
    tasks = [t for t, m in sorted(downstream.items()) if primary_key(m) in ACCURACY_KEYS]
    if not tasks:
        return math.nan, []
    return sum(downstream[t][primary_key(downstream[t])] for t in tasks) / len(tasks), tasks


def _se(m: dict) -> float:
    se = m.get("stderr")
    return 0.0 if se is None or (isinstance(se, float) and math.isnan(se)) else float(se)


def landmark(
    step: int,
    run: dict,
    ref: dict,
    kl: float | None,
    *,
    lm_tolerance: float = 0.02,
    sigmas: float = 2.0,
    kl_tolerance: float = 0.05,
) -> dict:
    """One landmark from both sides' `eval` results (and the KL): deltas (run - reference) and a verdict."""
    lm = {
        label: run["lm"][label]["ce_loss"] - ref["lm"][label]["ce_loss"]
        for label in sorted(set(run.get("lm", {})) & set(ref.get("lm", {})))
    }
    rd, fd = run.get("downstream", {}), ref.get("downstream", {})
    common = {t: rd[t] for t in sorted(set(rd) & set(fd))}
    ds: dict[str, float] = {}
    for t in common:
        k = primary_key(rd[t])
        ds[t] = rd[t][k] - fd[t][k]
    run_macro, tasks = macro(common)
    ref_macro, _ = macro({t: fd[t] for t in common})
    sigma = (
        math.sqrt(sum(_se(rd[t]) ** 2 + _se(fd[t]) ** 2 for t in tasks)) / len(tasks) if tasks else math.nan
    )
    d_macro = run_macro - ref_macro if tasks else math.nan
    moved = []
    worst = max(lm.items(), key=lambda kv: abs(kv[1]), default=None)
    if worst is not None and abs(worst[1]) > lm_tolerance:
        moved.append(f"held-out loss ({worst[0]} {worst[1]:+.4f} nats, tolerance {lm_tolerance:g})")
    if tasks and abs(d_macro) > sigmas * sigma:
        moved.append(f"downstream (macro accuracy {d_macro:+.4f}, {sigmas:g}σ = {sigmas * sigma:.4f})")
    if kl is not None and kl > kl_tolerance:
        moved.append(f"KL ({kl:.4g} nats/token, tolerance {kl_tolerance:g})")
    return {
        "step": step,
        "lm": lm,
        "downstream": {**ds, "macro": d_macro, "sigma": sigma},
        "kl": kl,
        "run_macro": run_macro,
        "reference_macro": ref_macro,
        "within_noise": not moved,
        "verdict": "within noise" if not moved else "moved: " + "; ".join(moved),
    }


def summary(marks: list[dict]) -> str:
    moved = [m for m in marks if not m["within_noise"]]
    if not moved:
        return f"within noise at all {len(marks)} landmark(s)"
    return f"moved at {len(moved)} of {len(marks)} landmark(s), first at step {moved[0]['step']}: {moved[0]['verdict']}"


# ---------------------------------------------------------------- the cache in the run directory


def settings_digest(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def cache_path(run_dir: str, what: str, checkpoint: str, settings: dict) -> str:
    """Where one evaluation (or KL) of `checkpoint` with `settings` is kept in the run directory."""
    key = settings_digest({"checkpoint": checkpoint.rstrip("/"), **settings})
    step = STEP_NAME.search(checkpoint.rstrip("/").rsplit("/", 1)[-1])
    name = f"{what}-{step.group(1) if step else 'x'}-{key}.json"
    return storage.join(run_dir.rstrip("/"), CACHE_DIR, name)


def cached(path: str, compute) -> tuple[dict, bool]:
    """(the result kept at `path`, True), or (compute(), False) after keeping it there."""
    store = storage.store_for(path)
    if store.exists(path):
        return json.loads(store.read_text(path)), True
    out = compute()
    store.write_text(path, json.dumps(out, sort_keys=True))  # a local store makes the directories
    return out, False


# ---------------------------------------------------------------- the plot


def plot(marks: list[dict], path: str, sigmas: float = 2.0) -> None:
    """Both runs' macro accuracy per landmark and the reference's ±`sigmas`σ band, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in marks]
    run = [m["run_macro"] for m in marks]
    ref = [m["reference_macro"] for m in marks]
    band = [sigmas * m["downstream"]["sigma"] for m in marks]
    fig, ax = plt.subplots(figsize=(9, 5))
    ax.plot(steps, ref, "o-", label="reference")
    ax.plot(steps, run, "s-", label="run")
    lo = [r - b for r, b in zip(ref, band, strict=True)]
    hi = [r + b for r, b in zip(ref, band, strict=True)]
    ax.fill_between(steps, lo, hi, alpha=0.2, label=f"reference ± {sigmas:g}σ (Δ band)")
    for m in marks:
        if not m["within_noise"]:
            ax.axvline(m["step"], color="red", lw=0.8, alpha=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("macro downstream accuracy")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    data = _png(fig)
    plt.close(fig)
    store = storage.store_for(path)
    store.write_bytes(path, data)


def _png(fig) -> bytes:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()
