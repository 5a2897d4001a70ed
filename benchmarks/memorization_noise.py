"""The memorization alarm measured on real smoke runs: the noise of the held-out loss between adjacent
evaluations, the false alarms of the rule (`observe/memorization.py`) between two faithful runs, and how
many evaluations after the onset of a planted repeat it fires.

Three local runs of the smoke recipe on cpu-1, `train.max_steps` steps, held-out loss (`eval/lm_loss`,
`eval.batches` x `eval.batch_size` fixed instances) every `--eval-every` steps and training loss at every
step:

* `ref`: the reference;
* `twin`: a faithful run that differs only in its initialisation (`train.seed` + 1; same data order):
  whatever the rule flags between it and `ref` is a false alarm;
* `repeat`: `ref` to `--onset`, then resumed `--shift` batches back (the trainer's DATA_SHIFT fault knob),
  so its next `--shift` steps re-read batches it trained on `--shift` steps earlier: the case study's
  loader re-reading part of the corpus, with a known onset. (The double-sharding knob's repeats fall
  within one batch, on instances the model has not trained on yet, so its training loss cannot show
  them; this one's can.)

The noise of one run's held-out curve after the fast descent (steps past `--settle`, a fraction of the
run) is sigma_eval = sd(second differences) / sqrt(6): for independent noise e on a smooth curve,
e[i+1] - 2 e[i] + e[i-1] has variance 6 sigma^2, and the curve's own curvature hardly enters. The rule
itself reads the gap, train_delta - heldout_delta: a flagged evaluation has gap < -T/2, so a faithful
run (gap zero-mean noise of sigma between adjacent evaluations, `memorization.gap_sigma`) raises the
alarm at an evaluation with probability Q(T / (2 sigma))^2, Q the normal tail. Both are reported for the
fixed 0.02 and for the threshold the monitor derives (`memorization.derived_threshold`), with the flags
the twin actually got and the evaluations the repeat took to raise the alarm.

    PYTHONPATH=. python benchmarks/memorization_noise.py [--steps 440] [--onset 220] [--shift 200]
        [--eval-every 5] [--settle 0.25] [--dir DIR [--reuse]]

`--reuse` reads the runs a previous call left in `--dir` instead of training them again. The last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from olmo_ctl.core import faults  # noqa: E402
from olmo_ctl.core.recipe import load_recipe  # noqa: E402
from olmo_ctl.observe.memorization import DEFAULT_MIN_POINTS, DEFAULT_THRESHOLD, memorization  # noqa: E402
from olmo_ctl.observe.reader import read_scalars  # noqa: E402


def train(
    run: str, sets: list[str], attempt: int, stop_at: int | None = None, env: dict | None = None
) -> float:
    cmd = [
        sys.executable,
        "-m",
        "olmo_ctl.trainer",
        "--recipe",
        "smoke",
        "--run-dir",
        run,
        "--device",
        "cpu-1",
    ]
    cmd += ["--attempt", str(attempt)]
    for s in sets:
        cmd += ["--set", s]
    if stop_at is not None:
        cmd += ["--stop-at-step", str(stop_at)]
    t0 = time.perf_counter()
    p = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
        capture_output=True,
        text=True,
    )
    if p.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return time.perf_counter() - t0


def curves(run: str) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    r = read_scalars(os.path.join(run, "tensorboard"))
    t, h = r.series("train/CE loss"), r.series("eval/lm_loss")
    return (t.steps, t.values), (h.steps, h.values)


def q(x: float) -> float:
    """The standard normal's upper tail."""
    return 0.5 * math.erfc(x / math.sqrt(2))


def sigma_eval(held: tuple[np.ndarray, np.ndarray], after: int) -> dict:
    v = held[1][held[0] > after]
    d1, d2 = np.diff(v), np.diff(v, 2)
    return {
        "evaluations": len(v),
        "sigma_eval": float(np.std(d2, ddof=1) / math.sqrt(6)),
        "adjacent_change_sd": float(np.std(d1, ddof=1)),
        "adjacent_change_abs_p95": float(np.percentile(np.abs(d1), 95)),
    }


def fire_step(m: dict) -> int | None:
    """The evaluation at which the alarm first stands: the `min_points`-th consecutive flagged one."""
    run = 0
    for p in m.get("points", []):
        run = run + 1 if p["flagged"] else 0
        if run >= m["min_points"]:
            return p["step"]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=440)
    ap.add_argument("--onset", type=int, default=220)
    ap.add_argument("--shift", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-batches", type=int, default=10)
    ap.add_argument("--eval-batch-size", type=int, default=32)
    ap.add_argument(
        "--settle", type=float, default=0.25, help="fraction of the run left out as the fast descent"
    )
    ap.add_argument("--dir", help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--reuse", action="store_true", help="read the runs already in --dir")
    a = ap.parse_args()
    if not 0 < a.onset < a.steps or a.onset % a.eval_every or not 0 < a.shift <= a.onset:
        sys.exit("need 0 < --shift <= --onset < --steps, --onset a multiple of --eval-every")
    base = a.dir or tempfile.mkdtemp(prefix="memo-noise-")
    os.makedirs(base, exist_ok=True)
    sets = [
        f"train.max_steps={a.steps}",
        f"eval.interval={a.eval_every}",
        f"eval.batches={a.eval_batches}",
        f"eval.batch_size={a.eval_batch_size}",
        f"checkpoint.interval={a.onset}",
        "logging.metrics_every=1",
    ]
    ref, twin, rep = (os.path.join(base, n) for n in ("ref", "twin", "repeat"))
    wall = {}
    if not (a.reuse and a.dir):
        for d in (ref, twin, rep):
            shutil.rmtree(d, ignore_errors=True)
        wall["ref_to_onset"] = train(ref, sets, 1, stop_at=a.onset)
        shutil.copytree(ref, rep)
        wall["ref_rest"] = train(ref, sets, 2)
        wall["repeat_rest"] = train(rep, sets, 2, env={faults.DATA_SHIFT.name: str(-a.shift)})
        seed = load_recipe("smoke").train.seed
        wall["twin"] = train(twin, [*sets, f"train.seed={seed + 1}"], 1)

    (rt, rh), (tt, th), (pt, ph) = curves(ref), curves(twin), curves(rep)
    settle = int(a.settle * a.steps)
    noise = {name: sigma_eval(h, settle) for name, h in (("ref", rh), ("twin", th))}

    # twin against ref: every flag is a false alarm
    derived = memorization(tt, th, rt, rh)
    fixed = memorization(tt, th, rt, rh, threshold=DEFAULT_THRESHOLD)
    pts = [p for p in derived["points"] if p["step"] > settle]
    dts = np.array([p["train_delta"] for p in pts])
    dhs = np.array([p["heldout_delta"] for p in pts])
    gaps = dts - dhs
    s_gap = derived["gap_sigma"]

    def false_rate(t: float) -> float:
        """Two evaluations in a row flagged by a zero-mean gap of noise `s_gap`: Q(T / (2 sigma))^2."""
        return q(t / (2 * s_gap)) ** DEFAULT_MIN_POINTS

    def pairs(m: dict) -> int:
        f = [p["flagged"] for p in m["points"] if p["step"] > settle]
        return sum(x and y for x, y in zip(f, f[1:], strict=False))

    repeat = {}
    for label, t in (("fixed", DEFAULT_THRESHOLD), ("derived", None)):
        m = memorization(pt, ph, rt, rh, threshold=t)
        fired = fire_step(m)
        repeat[label] = {
            "threshold": m["threshold"],
            "gap_sigma": m["gap_sigma"],
            "first_flagged_step": next((p["step"] for p in m["points"] if p["flagged"]), None),
            "fires_at_step": fired,
            "latency_steps": None if fired is None else fired - a.onset,
            "latency_evaluations": None if fired is None else (fired - a.onset) // a.eval_every,
        }
    in_repeat = [
        p for p in memorization(pt, ph, rt, rh)["points"] if a.onset < p["step"] <= a.onset + a.shift
    ]
    out = {
        "steps": a.steps,
        "eval_every": a.eval_every,
        "heldout_instances": a.eval_batches * a.eval_batch_size,
        "settle_step": settle,
        "onset": a.onset,
        "shift": a.shift,
        "heldout_noise": noise,
        "faithful": {
            "evaluations": len(pts),
            "train_delta_mean": float(dts.mean()),
            "train_delta_sd": float(np.std(dts, ddof=1)),
            "heldout_delta_mean": float(dhs.mean()),
            "heldout_delta_sd": float(np.std(dhs, ddof=1)),
            "gap_mean": float(gaps.mean()),
            "gap_sd": float(np.std(gaps, ddof=1)),
            "gap_sigma": s_gap,
            "fixed": {
                "threshold": DEFAULT_THRESHOLD,
                "flagged": sum(p["flagged"] for p in fixed["points"] if p["step"] > settle),
                "flagged_pairs": pairs(fixed),
                "alarm": fixed["alarm"],
                "false_alarm_rate": false_rate(DEFAULT_THRESHOLD),
            },
            "derived": {
                "threshold": derived["threshold"],
                "flagged": sum(p["flagged"] for p in derived["points"] if p["step"] > settle),
                "flagged_pairs": pairs(derived),
                "alarm": derived["alarm"],
                "false_alarm_rate": false_rate(derived["threshold"]),
            },
        },
        "repeat": {
            "train_delta_mean": float(np.mean([p["train_delta"] for p in in_repeat])),
            "heldout_delta_mean": float(np.mean([p["heldout_delta"] for p in in_repeat])),
            **repeat,
        },
        "wall_s": {k: round(v, 1) for k, v in wall.items()},
        "dir": base,
    }
    print(
        f"runs under {base}: {a.steps} steps, held-out loss every {a.eval_every} steps on "
        f"{out['heldout_instances']} instances; after step {settle}:"
    )
    for name, n in noise.items():
        print(
            f"  {name} held-out loss, {n['evaluations']} evaluations: sigma_eval {n['sigma_eval']:.4f} nats "
            f"(sd of adjacent changes {n['adjacent_change_sd']:.4f}, |change| p95 {n['adjacent_change_abs_p95']:.4f})"
        )
    f = out["faithful"]
    print(
        f"  twin - ref: training delta {f['train_delta_mean']:+.4f} +- {f['train_delta_sd']:.4f}, held-out delta "
        f"{f['heldout_delta_mean']:+.4f} +- {f['heldout_delta_sd']:.4f}, gap {f['gap_mean']:+.4f} +- "
        f"{f['gap_sd']:.4f} (sigma between adjacent evaluations {s_gap:.4f})"
    )
    for label in ("fixed", "derived"):
        x = f[label]
        print(
            f"    T={x['threshold']:.4f} ({label}): {x['flagged']} flagged, {x['flagged_pairs']} flagged pairs, "
            f"alarm {x['alarm']}; model false-alarm rate {x['false_alarm_rate']:.1e} per evaluation"
        )
    r = out["repeat"]
    print(
        f"  repeat from step {a.onset}: training delta {r['train_delta_mean']:+.4f}, held-out delta "
        f"{r['heldout_delta_mean']:+.4f} while it re-reads"
    )
    for label in ("fixed", "derived"):
        x = r[label]
        print(
            f"    T={x['threshold']:.4f} ({label}): first flagged at {x['first_flagged_step']}, fires at "
            f"{x['fires_at_step']} ({x['latency_steps']} steps, {x['latency_evaluations']} evaluations after onset)"
        )
    print(json.dumps(out))
    if not a.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
