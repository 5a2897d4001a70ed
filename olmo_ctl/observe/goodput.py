"""Goodput as a partition of a run's wall time: every second between the run's start and its end is
put in exactly one bucket, so productive time plus the buckets is the wall time by construction.

The buckets follow Google's ml-goodput-measurement (`ml_goodput_measurement/src/goodput_utils.py`
`BadputType`, computed in `ml_goodput_measurement/src/goodput.py`), with the waits before a slice
is there that a Kueue queue adds:

* `queueing`: submitted (or requeued) until admitted, from the journal;
* `waiting_for_capacity`: the supervisor's `waiting` .. `waited` records outside the queue (admitted
  but unschedulable, an image pull, an unreachable API) while nothing trains, unless a disruption
  came before it (then it is recovery: a host event's node-not-ready);
* `program_startup`: from the trainer process's start (`timing/since_start_s`; the journal's
  `admitted`/`running` without it) to its first step, less the two below; the first step's extra time
  over a steady step (its compilation) is here, as upstream's PROGRAM_STARTUP;
* `data_loading`: the trainer's data set-up (`timing/data_setup_s`) and the data wait inside steps
  (`throughput/device/data loading (s)`, synchronous: it is part of the step time);
* `checkpoint_restore`: `checkpoint/restore_duration_s`;
* `checkpoint_save`: `checkpoint/save_duration_s`, each ending at its record's wall time;
* `wasted_progress`: an attempt's time after its last step that counts, until its disruption is
  recorded (steps a later attempt ran again);
* `infrastructure_recovery`: from a disruption (preempted, failed, a JobSet restarted in place: an
  `admitted` after `running`, ...) until the next trainer process starts, less the waits above;
* `other`: the rest (before the first submission, after the last step while nothing failed).

Productive time is the kept training loss points' steps (`core.contracts.primary_loss_tag`): from
each incarnation's first step start (its first fetch's wall time less its steps at the median step
time) to its last kept point. An incarnation ends where the attempt changes or the journal records
the attempt's disruption between two points, so an outage inside one attempt is never productive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from olmo_ctl.core.contracts import (
    DATA_SETUP_TAG,
    DATA_WAIT_TAG,
    RESTORE_DURATION_TAG,
    SAVE_DURATION_TAG,
    SINCE_START_TAG,
)
from olmo_ctl.observe.series import Series

BUCKETS = (
    "queueing",
    "waiting_for_capacity",
    "program_startup",
    "data_loading",
    "checkpoint_restore",
    "checkpoint_save",
    "wasted_progress",
    "infrastructure_recovery",
    "other",
)
SAVE_TAG = SAVE_DURATION_TAG
RESTORE_TAG = RESTORE_DURATION_TAG

# Where intervals overlap, the higher one wins (index = priority); `other` is what nothing covers.
_LAYERS = (
    "other",
    "program_startup",  # admitted -> the trainer process's start, on a first start
    "waiting_for_capacity",  # the supervisor's waits, but after a disruption: recovery
    "infrastructure_recovery",
    "wasted_progress",
    "program_startup",
    "queueing",
    "productive",
    "data_loading",
    "checkpoint_restore",
    "checkpoint_save",
)
_P = {name: i for i, name in enumerate(_LAYERS)}  # a name's highest layer
_LAUNCH = 1  # the lower `program_startup` layer

_WAIT = frozenset({"submitted", "queued", "requeued", "deactivated"})
_START = frozenset({"admitted", "running"})
_DOWN = frozenset(
    {"preempted", "failed", "exited", "stopped", "succeeded", "stalled", "restarted", "resized"}
)


@dataclass
class _Attempt:
    """What the journal says of one attempt: its waits, its (re)starts and its ends."""

    waits: list[tuple[float, float | None]] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)  # a wait ended, or a restart in place began
    running: list[float] = field(default_factory=list)
    downs: list[tuple[float, bool]] = field(default_factory=list)  # (time, a disruption?)


def _attempts(journal: list[tuple[float, dict]]) -> dict[int, _Attempt]:
    """Each attempt's records read as a small state machine (time order)."""
    out: dict[int, _Attempt] = {}
    state: dict[int, str] = {}
    for t, r in journal:
        a, ev = r.get("attempt"), r.get("event")
        if a is None or ev is None:
            continue
        info = out.setdefault(int(a), _Attempt())
        st = state.get(int(a))
        if ev in _WAIT:
            if st in ("running", "starting"):
                info.downs.append((t, True))  # evicted and requeued
            if st != "waiting":
                info.waits.append((t, None))
            state[int(a)] = "waiting"
        elif ev in _START:
            if st == "waiting":
                info.waits[-1] = (info.waits[-1][0], t)
                info.starts.append(t)
            elif st == "running" and ev == "admitted":  # the JobSet restarted in place
                info.downs.append((t, True))
                info.starts.append(t)
            elif st in (None, "down"):
                info.starts.append(t)
            if ev == "running":
                info.running.append(t)
            state[int(a)] = "running" if ev == "running" else "starting"
        elif ev in _DOWN:
            if st != "down":
                code = r.get("exit_code")
                clean = ev in ("succeeded", "stopped", "restarted", "resized") or (
                    ev == "exited" and code in (0, None)
                )
                info.downs.append((t, not clean))
            if st == "waiting":
                info.waits[-1] = (info.waits[-1][0], t)
            state[int(a)] = "down"
    return out


def _capacity_waits(journal: list[tuple[float, dict]]) -> list[tuple[float, float | None]]:
    """The supervisor's `waiting` .. `waited` spans (open: None)."""
    spans: list[tuple[float, float | None]] = []
    open_at: float | None = None
    for t, r in journal:
        ev = r.get("event")
        if ev == "waiting" and open_at is None:
            open_at = t
        elif ev == "waited" and open_at is not None:
            spans.append((open_at, t))
            open_at = None
    if open_at is not None:
        spans.append((open_at, None))
    return spans


def _incarnations(loss: Series, downs: dict[int, list[float]]) -> list[tuple[int, int, int]]:
    """(attempt, first index, last index) of the kept loss points, split where the attempt changes or
    one of its disruptions is recorded between two points."""
    if not len(loss):
        return []
    a = loss.attempts
    wm = np.maximum.accumulate(loss.wall_times)  # sorted, for the search (kept walls rise with steps)
    cut = np.zeros(len(loss), dtype=bool)  # a new incarnation starts at this point
    cut[1:] = a[1:] != a[:-1]
    for att, times in downs.items():
        t = np.asarray(times, dtype=float)
        i = np.searchsorted(wm, t, side="right")  # the first point after each record
        ok = (i > 0) & (i < len(loss))
        t, i = t[ok], i[ok]
        cut[i[(wm[i - 1] < t) & (a[i] == att) & (a[i - 1] == att)]] = True
    starts = [0, *np.flatnonzero(cut[1:]) + 1]
    ends = [*(x - 1 for x in starts[1:]), len(loss) - 1]
    return [(int(a[lo]), int(lo), int(hi)) for lo, hi in zip(starts, ends, strict=True)]


def _of_attempt(s: Series | None, attempt: int, lo: float, hi: float) -> list[tuple[float, float]]:
    """(wall time, value) of `s`'s kept points of `attempt` with lo < wall <= hi."""
    if s is None or not len(s):
        return []
    m = (s.attempts == attempt) & (s.wall_times > lo) & (s.wall_times <= hi)
    return list(zip(s.wall_times[m].tolist(), s.values[m].tolist(), strict=True))


def partition(
    journal: list[tuple[float, dict]],
    loss: Series,
    step_s: float,
    series,
    start: float,
    end: float,
) -> tuple[float, dict[str, float]]:
    """(productive seconds, seconds per bucket) of the wall time [start, end]: they add up to
    end - start exactly. `journal`: (time, record) in time order; `series(tag)`: the kept points of a
    tag; `step_s`: the median step time."""
    atts = _attempts(journal)
    iv: list[tuple[float, float, int]] = []  # (from, to, layer)

    def add(t0: float | None, t1: float | None, layer: int) -> None:
        if t0 is not None and t1 is not None and t1 > t0:
            iv.append((t0, t1, layer))

    for info in atts.values():
        for t0, t1 in info.waits:
            add(t0, end if t1 is None else t1, _P["queueing"])
    for t0, t1 in _capacity_waits(journal):
        add(t0, end if t1 is None else t1, _P["waiting_for_capacity"])
    ck = series(SAVE_TAG)
    if ck is not None and len(ck):
        for w, secs in zip(ck.wall_times.tolist(), ck.values.tolist(), strict=True):
            if np.isfinite(secs):
                add(w - secs, w, _P["checkpoint_save"])
    since, restore, setup = series(SINCE_START_TAG), series(RESTORE_TAG), series(DATA_SETUP_TAG)
    w, st = loss.wall_times, loss.steps
    incs = _incarnations(loss, {a: [t for t, _ in i.downs] for a, i in atts.items()})

    wm = np.maximum.accumulate(w) if len(w) else w

    def next_step_after(t: float) -> float:
        i = int(np.searchsorted(wm, t, side="right"))
        return float(wm[i]) if i < len(wm) else end

    for info in atts.values():
        for t, bad in info.downs:  # recovery from a disruption until the next step that counts
            if bad:
                add(t, next_step_after(t), _P["infrastructure_recovery"])
        for t in info.starts:  # admitted: its pods start, until its first step (or the attempt ends)
            add(t, min([next_step_after(t), *(d for d, _ in info.downs if d > t)]), _LAUNCH)
    prev_end = start
    for k, (a, lo, hi) in enumerate(incs):
        info = atts.get(a, _Attempt())
        n_fetch = int(np.count_nonzero(w[lo : hi + 1] == w[lo]))
        t1 = float(w[lo])
        t0 = t1 - (int(st[lo + n_fetch - 1] - st[lo]) + 1) * step_s  # its first step's start
        t_last = float(w[hi])
        add(t0, t_last, _P["productive"])
        # the trainer process's start by its own clock, else the journal's `running` (or `admitted`)
        t_proc = None
        for wall, v in _of_attempt(since, a, prev_end, t1):
            t_proc = wall - v
        if t_proc is None:
            t_proc = max((t for t in info.running if prev_end <= t <= t1), default=None)
        if t_proc is None:
            t_proc = max((t for t in info.starts if prev_end <= t <= t1), default=None)
        if t_proc is not None:
            add(t_proc, t0, _P["program_startup"])
        for wall, v in _of_attempt(restore, a, prev_end, t1):
            add(wall - v, wall, _P["checkpoint_restore"])
        for wall, v in _of_attempt(setup, a, prev_end, t1):
            add(wall - v, wall, _P["data_loading"])
        t_next = float(w[incs[k + 1][1]]) if k + 1 < len(incs) else end
        down = next(((t, bad) for t, bad in info.downs if t_last < t <= t_next), None)
        if down is not None and down[1]:  # its steps past the last that counts, until the disruption
            add(t_last, down[0], _P["wasted_progress"])
        prev_end = t_last
    # an attempt whose trainer runs but has no step yet (or never had one)
    last = float(w[-1]) if len(w) else start
    for info in atts.values():
        for t in info.running:
            if t > last:
                add(t, min((d for d, _ in info.downs if d > t), default=end), _P["program_startup"])

    productive, buckets = _sweep(iv, start, end)
    # the steps' synchronous data wait (one value a step; points every k steps stand for k steps)
    dw = series(DATA_WAIT_TAG)
    if dw is not None and len(dw) and productive > 0:
        every = max(1, int(np.median(np.diff(dw.steps)))) if len(dw) > 1 else 1
        wait_s = min(productive, float(np.nansum(np.clip(dw.values, 0, None))) * every)
        productive -= wait_s
        buckets["data_loading"] += wait_s
    return productive, buckets


def _sweep(iv: list[tuple[float, float, int]], start: float, end: float) -> tuple[float, dict[str, float]]:
    """Seconds of [start, end] under each layer's name, the highest layer winning where they overlap."""
    clipped = [(max(t0, start), min(t1, end), p) for t0, t1, p in iv if min(t1, end) > max(t0, start)]
    bounds = np.unique(np.array([start, end, *[t for t0, t1, _ in clipped for t in (t0, t1)]], dtype=float))
    top = np.zeros(max(len(bounds) - 1, 0), dtype=np.int64)
    for t0, t1, p in clipped:
        i0, i1 = np.searchsorted(bounds, t0), np.searchsorted(bounds, t1)
        np.maximum(top[i0:i1], p, out=top[i0:i1])
    widths = np.diff(bounds)
    buckets = dict.fromkeys(BUCKETS, 0.0)
    productive = 0.0
    for p, name in enumerate(_LAYERS):
        secs = float(widths[top == p].sum())
        if name == "productive":
            productive += secs
        else:
            buckets[name] += secs
    return productive, buckets
