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
the step range they cover. Pure: arrays in, a dict out.
"""

from __future__ import annotations

import numpy as np

TRAIN_TAG = "train/CE loss"
# The held-out loss a run logs: OLMo-core's C4 evaluator's name first (`c4_en-validation`, its label in
# v3-small-ppl-validation; `c4_en` in older runs), then the trainer's own held-out set.
HELDOUT_TAGS = ("eval/lm/c4_en-validation/CE loss", "eval/lm/c4_en/CE loss", "eval/lm_loss")
DEFAULT_THRESHOLD = 0.02  # nats: well above step-to-step noise of a 1000-step window mean
DEFAULT_MIN_POINTS = 2

Curve = tuple[np.ndarray, np.ndarray]  # (steps int64, values float64), steps ascending


def _at(curve: Curve, steps: np.ndarray) -> np.ndarray:
    """The curve's values at `steps` (which it holds)."""
    idx = np.searchsorted(curve[0], steps)
    return np.asarray(curve[1], np.float64)[idx]


def memorization(
    train: Curve,
    heldout: Curve | None,
    ref_train: Curve,
    ref_heldout: Curve | None,
    threshold: float = DEFAULT_THRESHOLD,
    min_points: int = DEFAULT_MIN_POINTS,
) -> dict:
    """`{judged, alarm, threshold, points, ranges: [{start, end, train_delta, heldout_delta}], reason}`."""
    out: dict = {
        "threshold": threshold,
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
                    "flagged": dt <= -threshold and dh > -threshold / 2,
                }
            )
        prev = e
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


def warning_lines(m: dict | None) -> list[str]:
    """The monitor warning for an alarm, one line per flagged range."""
    if not m or not m.get("alarm"):
        return []
    return [
        f"memorization? steps {r['start']}-{r['end']}: training loss {r['train_delta']:+.3f} against the "
        f"reference while held-out loss is {r['heldout_delta']:+.3f}: a loader reading instances again "
        "shows this way; run `olmo-ctl data audit`"
        for r in m["ranges"]
    ]
