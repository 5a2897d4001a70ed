"""The memorization alarm: training loss below a reference run's while held-out loss is not.

The OLMo 3 case study's reproduction looked like it beat AI2's from step ~0.9M on training loss; its
held-out C4 loss did not follow, because a loader bug re-read a quarter of the corpus: the model was
fitting instances it had seen before. That signature, the run's training loss below the reference by
more than a threshold over a window while its held-out loss does not run below the reference, is what
this looks for. A faithful run that is better is better on both; one that is worse is worse on both.

At each held-out evaluation step `e` both runs have: the training delta is the mean of (run - reference)
training loss over the common steps since the previous evaluation, the held-out delta is run - reference
held-out loss at `e`. `e` is flagged when the training delta is at most `-threshold` and the held-out
delta is above `-threshold / 2`; `min_points` consecutive flagged evaluations make an alarm, reported as
the step range they cover.

The threshold, unless given, is derived from the two runs' own evaluations: a flagged evaluation has
`gap = train_delta - heldout_delta < -threshold / 2`, and between a faithful run and its reference the gap
is noise around zero (both losses move together). Its noise between adjacent evaluations, sigma, is read
from the gap's second differences (a robust standard deviation: the median absolute one x 1.4826 /
sqrt(6), so an onset's jump and slow drifts hardly enter it); the threshold is
`max(DEFAULT_THRESHOLD, 2 z sigma)`, z the normal quantile at which `min_points` consecutive noise-only
flags have probability FALSE_ALARM_RATE. With fewer than NOISE_MIN_POINTS evaluations it is the floor.
Measured on smoke runs by `benchmarks/memorization_noise.py` (docs/benchmarks.md).

A recorded `data audit` (its instances read twice) raises the alarm too, whatever the losses say:
`with_audit`. Pure: arrays in, a dict out.
"""

from __future__ import annotations

from statistics import NormalDist

import numpy as np

from olmo_ctl.core.contracts import EVAL_LOSS_TAG, lm_eval_tags, primary_loss_tag

TRAIN_TAG = primary_loss_tag()  # every recipe trains the `lm` objective today
# The held-out loss a run logs: OLMo-core's C4 evaluator's name first (`c4_en-validation`, its label in
# v3-small-ppl-validation; `c4_en` in older runs), then the trainer's own held-out set.
HELDOUT_TAGS = (lm_eval_tags("c4_en-validation")[0], lm_eval_tags("c4_en")[0], EVAL_LOSS_TAG)
# nats: the threshold's floor. At stage 1 the C4 loss comes every 10,000 steps on a fixed held-out set;
# the gap's noise there is well under 0.01 nats (docs/monitoring-and-compare.md), so the floor rules.
DEFAULT_THRESHOLD = 0.02
DEFAULT_MIN_POINTS = 2
FALSE_ALARM_RATE = 1e-3  # per evaluation: a faithful run's chance of an alarm from noise alone
# evaluations before the gap's noise is read: one spike spoils 3 of their 10 second differences
NOISE_MIN_POINTS = 12

Curve = tuple[np.ndarray, np.ndarray]  # (steps int64, values float64), steps ascending


def _at(curve: Curve, steps: np.ndarray) -> np.ndarray:
    """The curve's values at `steps` (which it holds)."""
    idx = np.searchsorted(curve[0], steps)
    return np.asarray(curve[1], np.float64)[idx]


def gap_sigma(gaps: np.ndarray) -> float | None:
    """The noise of `train_delta - heldout_delta` between adjacent evaluations: a robust standard deviation
    of its second differences / sqrt(6); None with fewer than NOISE_MIN_POINTS evaluations."""
    if len(gaps) < NOISE_MIN_POINTS:
        return None
    d2 = np.diff(np.asarray(gaps, np.float64), 2)
    return float(1.4826 * np.median(np.abs(d2 - np.median(d2))) / np.sqrt(6))


def derived_threshold(sigma: float | None, min_points: int = DEFAULT_MIN_POINTS) -> float:
    """`max(DEFAULT_THRESHOLD, 2 z sigma)`: a faithful run (gap ~ N(0, sigma)) flagged `min_points`
    evaluations in a row, each `gap < -threshold / 2`, with probability FALSE_ALARM_RATE."""
    if sigma is None:
        return DEFAULT_THRESHOLD
    z = NormalDist().inv_cdf(1 - FALSE_ALARM_RATE ** (1 / min_points))
    return max(DEFAULT_THRESHOLD, 2 * z * sigma)


def memorization(
    train: Curve,
    heldout: Curve | None,
    ref_train: Curve,
    ref_heldout: Curve | None,
    threshold: float | None = None,
    min_points: int = DEFAULT_MIN_POINTS,
) -> dict:
    """`{judged, alarm, threshold, threshold_rule, gap_sigma, points, ranges: [{start, end, train_delta,
    heldout_delta}], reason}`; `threshold` None derives it (`derived_threshold`)."""
    out: dict = {
        "threshold": DEFAULT_THRESHOLD if threshold is None else threshold,
        "threshold_rule": "derived" if threshold is None else "given",
        "gap_sigma": None,
        "min_points": min_points,
        "judged": False,
        "alarm": False,
        "ranges": [],
    }
    if heldout is None or ref_heldout is None:
        out["reason"] = "no held-out loss on " + ("the run" if heldout is None else "the reference")
        return out
    evals = np.intersect1d(heldout[0], ref_heldout[0])
    common = np.intersect1d(train[0], ref_train[0])
    if not len(evals) or not len(common):
        out["reason"] = "no common held-out evaluation and training steps"
        return out
    d_train_all = _at(train, common) - _at(ref_train, common)
    d_held = _at(heldout, evals) - _at(ref_heldout, evals)
    points = []
    prev = 0
    for e, dh in zip(evals.tolist(), d_held.tolist(), strict=True):
        sel = (common > prev) & (common <= e)
        if sel.any():
            dt = float(d_train_all[sel].mean())
            first = int(common[sel][0])
            points.append(
                {
                    "step": int(e),
                    "from_step": first,
                    "train_delta": dt,
                    "heldout_delta": float(dh),
                }
            )
        prev = e
    sigma = gap_sigma(np.array([p["train_delta"] - p["heldout_delta"] for p in points]))
    if threshold is None:
        threshold = derived_threshold(sigma, min_points)
    out["threshold"], out["gap_sigma"] = threshold, sigma
    for point in points:
        point["flagged"] = point["train_delta"] <= -threshold and point["heldout_delta"] > -threshold / 2
    out["judged"] = True
    out["points"] = points
    run: list[dict] = []
    for p in [*points, None]:
        if p is not None and p["flagged"]:
            run.append(p)
            continue
        if len(run) >= min_points:
            out["ranges"].append(
                {
                    "start": run[0]["from_step"],
                    "end": run[-1]["step"],
                    "train_delta": float(np.mean([q["train_delta"] for q in run])),
                    "heldout_delta": float(np.mean([q["heldout_delta"] for q in run])),
                }
            )
        run = []
    out["alarm"] = bool(out["ranges"])
    return out


def with_audit(m: dict | None, audit: dict | None) -> dict | None:
    """`m` (None without a reference) with the run's recorded `data audit` (`checkpoints/data_audit.py`
    `read_result`) as `audit`: instances read twice raise the alarm whatever the losses say."""
    if audit is None:
        return m
    out = (
        dict(m)
        if m is not None
        else {"reference": None, "judged": False, "alarm": False, "ranges": [], "reason": "no reference"}
    )
    repeated = int(audit.get("repeated") or 0)
    out["audit"] = {
        "repeated": repeated,
        "committed_step": audit.get("committed_step"),
        "first_repeat": audit.get("first_repeat"),
        "audited_at": audit.get("audited_at"),
    }
    out["alarm"] = bool(out["alarm"]) or repeated > 0
    return out


def warning_lines(m: dict | None) -> list[str]:
    """The monitor warning for an alarm: the recorded audit's repeats, then one line per flagged range."""
    if not m or not m.get("alarm"):
        return []
    a = m.get("audit") or {}
    lines = []
    if a.get("repeated"):
        r = a.get("first_repeat") or {}
        first = f", the first at step {r['step']} (read at step {r['first_read_step']})" if r else ""
        lines.append(
            f"memorization: `olmo-ctl data audit` of steps 1-{a.get('committed_step')} "
            f"({a.get('audited_at')}) found {a['repeated']:,} instances read twice{first}: the run trains on "
            "data it has seen"
        )
    return lines + [
        f"memorization? steps {r['start']}-{r['end']}: training loss {r['train_delta']:+.3f} against the "
        f"reference while held-out loss is {r['heldout_delta']:+.3f}: a loader reading instances again "
        "shows this way; run `olmo-ctl data audit`"
        for r in m["ranges"]
    ]
