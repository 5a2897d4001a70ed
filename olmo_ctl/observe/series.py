"""Per-tag scalar series and the replay rules: which record of a repeated step wins.

Event files are ordered by attempt, start time and segment (`file_order_key`; contract names
`events.out.tfevents.<time>.<host>.a<attempt>.s<segment>`, see docs/CONTRACTS.md; other names by their
start time). When a step appears again (replayed after a resume) the later record wins and, if its
value differs, the pair is kept as a `Mismatch` (except for tags that measure time or speed, which a
replay legitimately changes: `core.contracts.VOLATILE_TAG_PREFIXES`). `TagSeries` applies these
rules incrementally, chunk by chunk, as the reader decodes new bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from olmo_ctl.core.contracts import VOLATILE_TAG_PREFIXES, parse_segment_name


class _Grow:
    __slots__ = ("a", "n")

    def __init__(self, dtype):
        self.a = np.empty(1024, dtype=dtype)
        self.n = 0

    def extend(self, x: np.ndarray) -> None:
        need = self.n + len(x)
        if need > len(self.a):
            cap = max(need, 2 * len(self.a))
            b = np.empty(cap, dtype=self.a.dtype)
            b[: self.n] = self.a[: self.n]
            self.a = b
        self.a[self.n : need] = x
        self.n = need

    @property
    def view(self) -> np.ndarray:
        return self.a[: self.n]

    def replace(self, x: np.ndarray) -> None:
        self.a = np.array(x, dtype=self.a.dtype)
        self.n = len(x)


@dataclass(frozen=True)
class Series:
    """One tag's scalars, sorted by step, one value per step (the latest record of that step)."""

    tag: str
    steps: np.ndarray  # int64
    wall_times: np.ndarray  # float64, seconds since the epoch
    values: np.ndarray  # float64
    attempts: np.ndarray  # int32, the attempt (from the file name; 0 if unknown) that wrote each point

    def __len__(self) -> int:
        return len(self.steps)

    def last(self) -> tuple[int, float] | None:
        return (int(self.steps[-1]), float(self.values[-1])) if len(self.steps) else None


@dataclass(frozen=True)
class Mismatch:
    """A step written twice with different values (an exact resume never produces one)."""

    tag: str
    step: int
    earlier: float
    later: float
    earlier_attempt: int
    later_attempt: int


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a == b) | (np.isnan(a) & np.isnan(b))


def _dedup_last(s, w, v, a):
    """Keep the last record of each step, sorted by step. Returns kept arrays and (dropped, replacement) indices."""
    order = np.argsort(s, kind="stable")
    ss = s[order]
    last = np.ones(len(ss), dtype=bool)
    last[:-1] = ss[1:] != ss[:-1]
    keep = order[last]
    dropped = order[~last]
    repl = keep[np.searchsorted(ss[last], s[dropped])] if dropped.size else dropped
    return keep, dropped, repl


def is_volatile(tag: str) -> bool:
    return tag.startswith(VOLATILE_TAG_PREFIXES)


class TagSeries:
    def __init__(self, tag: str):
        self.tag = tag
        self.volatile = is_volatile(tag)
        self.s = _Grow(np.int64)
        self.w = _Grow(np.float64)
        self.v = _Grow(np.float64)
        self.a = _Grow(np.int32)
        self.replays = 0  # records that were superseded by a later record of the same step
        self.replayed_by_attempt: dict[int, int] = {}
        self.mismatches: list[Mismatch] = []

    def _note_replays(self, old_v, new_v, old_a, new_a, steps):
        self.replays += len(steps)
        for att, cnt in zip(*np.unique(old_a, return_counts=True), strict=True):
            self.replayed_by_attempt[int(att)] = self.replayed_by_attempt.get(int(att), 0) + int(cnt)
        if self.volatile:
            return
        diff = np.flatnonzero(~_same(old_v, new_v))
        for i in diff[: 1000 - len(self.mismatches)]:
            self.mismatches.append(
                Mismatch(
                    self.tag, int(steps[i]), float(old_v[i]), float(new_v[i]), int(old_a[i]), int(new_a[i])
                )
            )

    def add(self, s, w, v, attempt: int) -> None:
        a = np.full(len(s), attempt, dtype=np.int32)
        if len(s) > 1 and not np.all(s[1:] > s[:-1]):
            keep, dropped, repl = _dedup_last(s, w, v, a)
            if dropped.size:
                self._note_replays(v[dropped], v[repl], a[dropped], a[repl], s[dropped])
            s, w, v, a = s[keep], w[keep], v[keep], a[keep]
        n = self.s.n
        if n == 0 or s[0] > self.s.a[n - 1]:
            self._append(s, w, v, a)
            return
        k = int(np.searchsorted(s, self.s.a[n - 1], side="right"))
        old_s = self.s.view
        pos = np.searchsorted(old_s, s[:k])
        exists = (pos < n) & (old_s[np.minimum(pos, n - 1)] == s[:k])
        if exists.all():
            self._note_replays(self.v.a[pos], v[:k], self.a.a[pos], a[:k], s[:k])
            self.w.a[pos] = w[:k]
            self.v.a[pos] = v[:k]
            self.a.a[pos] = a[:k]
        else:  # steps that fill gaps: merge the slow way
            cs = np.concatenate([old_s, s[:k]])
            cw = np.concatenate([self.w.view, w[:k]])
            cv = np.concatenate([self.v.view, v[:k]])
            ca = np.concatenate([self.a.view, a[:k]])
            keep, dropped, repl = _dedup_last(cs, cw, cv, ca)
            if dropped.size:
                self._note_replays(cv[dropped], cv[repl], ca[dropped], ca[repl], cs[dropped])
            self.s.replace(cs[keep])
            self.w.replace(cw[keep])
            self.v.replace(cv[keep])
            self.a.replace(ca[keep])
        self._append(s[k:], w[k:], v[k:], a[k:])

    def _append(self, s, w, v, a):
        if len(s):
            self.s.extend(s)
            self.w.extend(w)
            self.v.extend(v)
            self.a.extend(a)

    def series(self) -> Series:
        return Series(self.tag, self.s.view, self.w.view, self.v.view, self.a.view)


def file_order_key(path: str) -> tuple:
    """Attempt, start time, segment: later attempts win when steps repeat."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    parsed = parse_segment_name(name)
    if parsed is None:
        return (0, 0, 0, name)
    ts, _host, att, seg = parsed
    return (att or 0, ts, seg or 0, name)


def attempt_of(path: str) -> int:
    return file_order_key(path)[0]
