"""Step-aligned comparison of two loss curves: run directories or reference curve files.

A side is a run directory (local or gs://, its TensorBoard scalars de-duplicated as the monitor reads
them) or a CSV/TSV file of `step,value` rows (a header row is allowed), e.g. a published reference
curve. Only steps present on both sides are compared: deltas are `B - A`. The first step where |delta|
exceeds the threshold names where two runs part ways: comparing a resumed run with its uninterrupted
twin, an exact resume gives max |delta| = 0 on the training loss (`DEFAULT_TAGS`). From the first
step two run directories computed on different device layouts (their journals' targets), a delta
within the layout-rounding bound (`observe/rounding.py`) is rounding, not a divergence.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from olmo_ctl import storage
from olmo_ctl.core.contracts import primary_loss_tag
from olmo_ctl.core.errors import BadInput
from olmo_ctl.observe.memorization import HELDOUT_TAGS, TRAIN_TAG
from olmo_ctl.observe.rounding import RoundingModel, layout_of_attempts, rounding_model, step_layouts

if TYPE_CHECKING:
    from olmo_ctl.observe.reader import EventReader

CURVE_SUFFIXES = (".csv", ".tsv", ".txt")
DEFAULT_TAGS = (primary_loss_tag(),)  # every recipe trains the `lm` objective today


def is_curve_file(src: str) -> bool:
    return str(src).lower().endswith(CURVE_SUFFIXES)


def read_curve(src: str) -> tuple[np.ndarray, np.ndarray]:
    """`step,value` rows (comma, tab or spaces); a non-numeric first row is a header."""
    try:
        text = storage.store_for(src).read_text(src)
    except storage.NotFound:
        raise BadInput(f"curve file `{src}` does not exist") from None
    steps, vals = [], []
    for i, line in enumerate(text.splitlines()):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p for p in line.replace("\t", ",").replace(" ", ",").split(",") if p]
        try:
            if len(parts) < 2:
                raise ValueError
            steps.append(int(float(parts[0])))
            vals.append(float(parts[1]))
        except ValueError:
            if i == 0 or not steps:
                continue  # header
            raise BadInput(f"`{src}` line {i + 1} is not `step,value`: {line[:60]!r}") from None
    if not steps:
        raise BadInput(f"`{src}` holds no `step,value` rows")
    s = np.array(steps, dtype=np.int64)
    v = np.array(vals, dtype=np.float64)
    order = np.argsort(s, kind="stable")
    s, v = s[order], v[order]
    last = np.ones(len(s), dtype=bool)
    last[:-1] = s[1:] != s[:-1]  # a repeated step: the later row wins
    return s[last], v[last]


class Side:
    def __init__(self, src: str):
        self.src = src
        self.curve: tuple[np.ndarray, np.ndarray] | None = None
        self.reader: EventReader | None = None
        # attempt -> the device layout it computed on; None where the side records none (a curve file)
        self.layout_of: Callable[[int], str | None] | None = None
        self.rounding: RoundingModel | None = None
        if is_curve_file(src):
            self.curve = read_curve(src)
        else:
            from olmo_ctl.observe.monitor import _recipe, load

            sources = load(src)
            self.reader = sources.reader
            if sources.journal or (sources.run_doc or {}).get("device"):
                self.layout_of = layout_of_attempts(sources.journal, sources.run_doc)
            self.rounding = rounding_model(_recipe(sources.run_doc))

    def tags(self) -> list[str]:
        return [] if self.reader is None else self.reader.tags()

    def get(self, tag: str) -> tuple[np.ndarray, np.ndarray] | None:
        if self.curve is not None:
            return self.curve
        s = self.reader.series(tag) if self.reader is not None else None
        return None if s is None or not len(s) else (s.steps, s.values)

    def layouts(self, tag: str) -> list[str | None] | None:
        """The device layout that computed each point of `get(tag)`; None where the side records none."""
        s = self.reader.series(tag) if self.reader is not None and self.layout_of is not None else None
        return None if s is None else step_layouts(s.attempts, self.layout_of)


def reference_curves(src: str, heldout_src: str | None = None, threshold: float | None = None) -> dict:
    """The reference of the memorization alarm: a run directory (its training and held-out loss) or a
    curve file of its training loss, with `heldout_src` a run directory or curve of its held-out loss."""
    side = Side(src)
    held_side = Side(heldout_src) if heldout_src else side
    held = None
    if held_side.curve is not None and heldout_src:
        held = held_side.curve
    elif held_side.reader is not None:
        held = next((c for c in (held_side.get(t) for t in HELDOUT_TAGS) if c is not None), None)
    train = side.get(TRAIN_TAG)
    if train is None:
        raise BadInput(
            f"reference `{src}` has no {TRAIN_TAG} curve", "give a run directory or a step,value file"
        )
    return {
        "src": src,
        "heldout_src": heldout_src or (src if held is not None else None),
        "train": train,
        "heldout": held,
        "threshold": threshold,  # None: derived from the runs' own evaluations (memorization.py)
    }


def _f(x) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def compare_series(
    a: tuple[np.ndarray, np.ndarray],
    b: tuple[np.ndarray, np.ndarray],
    *,
    bin_steps: int = 2000,
    threshold: float = 0.0,
    per_step: bool = False,
    layouts: tuple[list | None, list | None] | None = None,
    rounding: RoundingModel | None = None,
) -> dict:
    """`layouts`: the device layout of each point of `a` and of `b` (None: unknown); from the first
    common step where both are known and differ, |Δ| up to `rounding`'s bound is layout rounding."""
    sa, va = a
    sb, vb = b
    common, ia, ib = np.intersect1d(sa, sb, assume_unique=True, return_indices=True)
    out: dict[str, Any] = {
        "common_steps": int(len(common)),
        "only_a": int(len(sa) - len(common)),
        "only_b": int(len(sb) - len(common)),
        "first_step": int(common[0]) if len(common) else None,
        "last_step": int(common[-1]) if len(common) else None,
        "max_abs_delta": None,
        "max_abs_delta_step": None,
        "mean_abs_delta": None,
        "mean_delta": None,
        "first_exceed_step": None,
        "first_exceed_delta": None,
        "threshold": threshold,
        "layout_changed": False,
        "layout_change_step": None,  # the first common step computed on different device layouts
        "layouts": None,  # {"a", "b"}: the two layouts at that step
        "rounding_tolerance": None,  # the bound from that step on (observe/rounding.py)
        "bins": [],
    }
    if not len(common):
        out["verdict"] = "no common steps to compare"
        return out
    xa, xb = va[ia], vb[ib]
    d = xb - xa
    both_nan = np.isnan(xa) & np.isnan(xb)
    absd = np.where(both_nan, 0.0, np.abs(d))
    absd = np.where(np.isnan(absd), np.inf, absd)  # NaN on one side only: maximally different
    k = int(np.argmax(absd))
    out["max_abs_delta"] = float(absd[k]) if math.isfinite(absd[k]) else None
    out["max_abs_delta_step"] = int(common[k])
    fin = np.isfinite(d)
    out["mean_abs_delta"] = _f(np.abs(d[fin]).mean()) if fin.any() else None
    out["mean_delta"] = _f(d[fin].mean()) if fin.any() else None
    bound = np.full(len(common), float(threshold))
    parted = _parted_at(common, ia, ib, layouts)
    if parted is not None and rounding is not None:
        step0, layout_a, layout_b = parted
        n = np.where(common >= step0, common - step0 + 1, 0)
        tol = rounding.tolerance(xa, xb, n)
        bound = np.fmax(bound, tol)
        out.update(
            layout_changed=True,
            layout_change_step=step0,
            layouts={"a": layout_a, "b": layout_b},
            rounding_tolerance={**rounding.to_dict(), "at_max_abs_delta_step": _f(tol[k])},
        )
    over = np.flatnonzero(absd > bound)
    if over.size:
        out["first_exceed_step"] = int(common[over[0]])
        out["first_exceed_delta"] = _f(d[over[0]])
        if out["rounding_tolerance"] is not None:
            out["rounding_tolerance"]["at_first_exceed_step"] = _f(bound[over[0]])
    bin_steps = max(1, int(bin_steps))
    b_idx = (common - 1) // bin_steps if common[0] >= 1 else common // bin_steps
    uniq, inv, cnt = np.unique(b_idx, return_inverse=True, return_counts=True)
    okf = np.isfinite(xa) & np.isfinite(xb)
    sum_a = np.bincount(inv, weights=np.where(okf, xa, 0.0))
    sum_b = np.bincount(inv, weights=np.where(okf, xb, 0.0))
    n_ok = np.bincount(inv, weights=okf.astype(float))
    max_b = np.zeros(len(uniq))
    np.maximum.at(max_b, inv, absd)
    for j, u in enumerate(uniq):
        lo = int(u) * bin_steps + (1 if common[0] >= 1 else 0)
        n = n_ok[j]
        out["bins"].append(
            {  # the steps the bin covers, within the common ones (a 100-step run's bin is 1-100)
                "start": max(lo, int(common[0])),
                "end": min(lo + bin_steps - 1, int(common[-1])),
                "points": int(cnt[j]),
                "mean_a": _f(sum_a[j] / n) if n else None,
                "mean_b": _f(sum_b[j] / n) if n else None,
                "mean_delta": _f((sum_b[j] - sum_a[j]) / n) if n else None,
                "max_abs_delta": _f(max_b[j]),
            }
        )
    if per_step:
        out["steps"] = [[int(st), _f(x), _f(y), _f(y - x)] for st, x, y in zip(common, xa, xb, strict=True)]
    out["verdict"] = _verdict(out)
    return out


def _parted_at(common, ia, ib, layouts) -> tuple[int, str, str] | None:
    """The first common step whose two points were computed on known, different device layouts, and
    those layouts (A's, B's)."""
    if not layouts or layouts[0] is None or layouts[1] is None:
        return None
    la, lb = layouts
    for j, step in enumerate(common.tolist()):
        x, y = la[ia[j]], lb[ib[j]]
        if x is not None and y is not None and x != y:
            return int(step), x, y
    return None


def _g(x) -> str:
    return "non-finite" if x is None else f"{x:.4g}"


def _verdict(o: dict) -> str:
    n = o["common_steps"]
    span = f"steps {o['first_step']}..{o['last_step']}"
    mx = o["max_abs_delta"]
    if mx == 0.0:
        return f"identical: max |Δ| = 0 on {n} common steps ({span})"
    mxs = _g(mx)
    rt = o.get("rounding_tolerance")
    parted = (
        f"layouts differ from step {o['layout_change_step']}: {o['layouts']['a']} vs {o['layouts']['b']}"
        if rt
        else ""
    )
    if o["first_exceed_step"] is None:
        if rt and mx is not None and mx > o["threshold"]:
            return (
                f"equal up to layout rounding: max |Δ| = {mxs} at step {o['max_abs_delta_step']}, within the "
                f"rounding bound {_g(rt['at_max_abs_delta_step'])} there ({parted}; {n} common steps, {span})"
            )
        return f"within {o['threshold']:g}: max |Δ| = {mxs} at step {o['max_abs_delta_step']} on {n} common steps"
    bound = f"; layout-rounding bound {_g(rt['at_first_exceed_step'])} there, {parted}" if rt else ""
    return (
        f"diverge at step {o['first_exceed_step']} (Δ = {_g(o['first_exceed_delta'])}, threshold "
        f"{o['threshold']:g}{bound}); max |Δ| = {mxs} at step {o['max_abs_delta_step']} ({n} common steps, "
        f"{span})"
    )


def _coarser(x: RoundingModel | None, y: RoundingModel | None) -> RoundingModel | None:
    """The looser of two runs' rounding bounds (each run's own recipe says how it rounds)."""
    models = [m for m in (x, y) if m is not None]
    return max(models, key=lambda m: m.k * m.eps) if models else None


def compare(
    a: str,
    b: str,
    tags: list[str] | None = None,
    *,
    bin_steps: int = 2000,
    threshold: float | None = None,
    per_step: bool = False,
) -> dict:
    if bin_steps < 1:
        raise BadInput(f"--bin {bin_steps} must be at least 1")
    for src in (a, b):
        if is_curve_file(src) and not storage.is_gcs(src) and not os.path.exists(src):
            raise BadInput(f"curve file `{src}` does not exist")
    side_a, side_b = Side(a), Side(b)
    if threshold is None:
        threshold = 0.05 if (side_a.curve is not None or side_b.curve is not None) else 0.0
    if tags:
        want = list(tags)
    elif side_a.curve is not None or side_b.curve is not None:
        want = list(DEFAULT_TAGS)
    else:
        common = sorted(set(side_a.tags()) & set(side_b.tags()))
        want = list(DEFAULT_TAGS) if set(DEFAULT_TAGS) & set(common) else common[:1]
    results: dict[str, dict[str, Any]] = {}
    for tag in want:
        ca, cb = side_a.get(tag), side_b.get(tag)
        if ca is None or cb is None:
            where = a if ca is None else b
            results[tag] = {"common_steps": 0, "verdict": f"`{tag}` not found in {where}"}
            continue
        results[tag] = compare_series(
            ca,
            cb,
            bin_steps=bin_steps,
            threshold=threshold,
            per_step=per_step,
            layouts=(side_a.layouts(tag), side_b.layouts(tag)),
            rounding=_coarser(side_a.rounding, side_b.rounding),
        )
    if not results:
        raise BadInput("no tag to compare", f"pass --tags '{DEFAULT_TAGS[0]}'")
    # one line over all tags: the earliest divergence wins
    diverged = [
        (r["first_exceed_step"], t) for t, r in results.items() if r.get("first_exceed_step") is not None
    ]
    missing = [t for t, r in results.items() if r.get("common_steps", 0) == 0]
    if diverged:
        step, tag = min(diverged)
        verdict = f"{tag}: {results[tag]['verdict']}"
    elif missing and len(missing) == len(results):
        verdict = "; ".join(results[t]["verdict"] for t in missing)
    else:
        verdict = "; ".join(f"{t}: {r['verdict']}" for t, r in results.items())
    return {"a": a, "b": b, "bin": bin_steps, "threshold": threshold, "tags": results, "verdict": verdict}
