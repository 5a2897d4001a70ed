"""Which host of a slice is slow, and at what: one rule for the trainer, the supervisor and `monitor`.

Every host times each logging window of steps: its step time, the part spent waiting for data, and
the rest (compute, collectives included). A synchronous slice steps at the pace of its slowest host,
so step times agree; what tells the slow host apart is its own data wait or compute against the
other hosts'. A host is named when, over its recent windows (the median, so one hiccup is not
enough; at least MIN_WINDOWS of them), one of them exceeds `FACTOR` x the other hosts' median by more
than `FLOOR_S`. The first window of an attempt (compile, and the wait for host 0's epoch order) is
never timed.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

FACTOR = 3.0
FLOOR_S = 0.02  # below 20 ms a difference is noise on any machine
RECENT = 10  # windows per host judged
MIN_WINDOWS = 2  # ... once every host has at least this many
PARTS = (("data_wait_s", "data wait"), ("compute_s", "compute"))


@dataclass(frozen=True)
class SlowHost:
    host: int
    part: str  # "data wait" | "compute"
    value_s: float
    median_s: float  # the other hosts' median

    def message(self) -> str:
        return f"host {self.host}: {self.part} {self.value_s * 1e3:.0f} ms vs {self.median_s * 1e3:.0f} ms median"


def slow_hosts(windows: dict[int, list[dict[str, float]]]) -> list[SlowHost]:
    """`windows`: host -> its recent windows (dicts with `data_wait_s`, `compute_s`), oldest first."""
    if len(windows) < 2:
        return []
    recent = {h: ws[-RECENT:] for h, ws in windows.items() if ws}
    if any(len(ws) < MIN_WINDOWS for ws in recent.values()):
        return []  # too few windows for a median to mean anything
    out = []
    for key, name in PARTS:
        level = {h: statistics.median(w[key] for w in ws) for h, ws in recent.items()}
        for h, v in sorted(level.items()):
            others = [x for g, x in level.items() if g != h]
            if not others:
                continue
            m = statistics.median(others)
            if v > FACTOR * m and v - m > FLOOR_S:
                out.append(SlowHost(h, name, v, m))
    # The other hosts wait for a host slow at its data inside the step's collectives, which they time
    # as compute: that compute is the data-slow host's, not theirs.
    data_slow = {s.host for s in out if s.part == "data wait"}
    if data_slow:
        out = [s for s in out if s.part == "data wait" or s.host in data_slow]
    return out


_LINE = re.compile(r"host (\d+): (data wait|compute) (\d+) ms vs (\d+) ms median")


def slow_host_line(s: SlowHost) -> str:
    """What the trainer logs (once per host and part per attempt) and the supervisor journals."""
    return f"warning: slow {s.message()}"


def parse_slow_host_line(line: str) -> SlowHost | None:
    m = _LINE.search(line)
    if not m:
        return None
    return SlowHost(int(m.group(1)), m.group(2), int(m.group(3)) / 1e3, int(m.group(4)) / 1e3)
