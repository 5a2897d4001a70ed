"""The hang watchdog: a step that takes far longer than the steps before it is a hang, not a slow step.

A host stuck in a collective whose peer is wedged, a storage read that never returns, a deadlock:
the process is alive, so nothing outside it notices, and the slice idles at full price. The loop
calls `beat()` whenever it sees progress (a step dispatched, metrics fetched) and tells the watchdog
how many steps it is waiting for; a thread checks that the time since the last beat stays below
`max(min_s, factor x median step time x steps waited for)`. Past it, the trainer writes every thread's
stack (faulthandler) to its log and exits 3, so the attempt is restarted from its last checkpoint.

It is disarmed while nothing can be judged: before the first window of steps has been timed (the
compile), and inside `paused()` (restore, evaluation, a checkpoint write).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque

from olmo_ctl.core import faults
from olmo_ctl.core.contracts import EXIT_RESTART


class Watchdog:
    def __init__(self, factor: float, min_s: float, on_hang=None, poll_s: float = 0.25):
        self.factor, self.min_s, self.poll_s = float(factor), float(min_s), poll_s
        self.on_hang = on_hang or _dump_and_exit
        self._times: deque[float] = deque(maxlen=64)  # per-step seconds of recent windows
        self._last = time.monotonic()
        self._waiting_for = 1
        self._paused = 0
        self._step = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def step_times(self, per_step_s: float, n: int = 1) -> None:
        """A timed window of `n` steps, `per_step_s` each: arms the watchdog."""
        with self._lock:
            self._times.extend([per_step_s] * min(n, self._times.maxlen or n))

    def beat(self, step: int, waiting_for: int = 1) -> None:
        with self._lock:
            self._last = time.monotonic()
            self._step = step
            self._waiting_for = max(1, waiting_for)

    @contextlib.contextmanager
    def paused(self):
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._last = time.monotonic()

    def allowance(self) -> float | None:
        """Seconds the current wait may take, or None while disarmed."""
        with self._lock:
            if self._paused or not self._times:
                return None
            return max(self.min_s, self.factor * statistics.median(self._times) * self._waiting_for)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            allowed = self.allowance()
            if allowed is None:
                continue
            with self._lock:
                waited, step = time.monotonic() - self._last, self._step
                median = statistics.median(self._times) if self._times else 0.0
            if waited > allowed:
                self.on_hang(
                    f"watchdog: no progress for {waited:.1f} s after step {step} (allowed {allowed:.1f} s: "
                    f"{self.factor:g} x the median step time {median:.3f} s, at least {self.min_s:g} s); "
                    "the stacks of every thread follow, then exit 3 so that the attempt is restarted"
                )
                return


def _dump_and_exit(message: str) -> None:
    from olmo_ctl.trainer import multihost

    try:
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        multihost.drain_output(2.0)
    finally:
        os._exit(EXIT_RESTART)


def maybe_hang(step: int, host: int) -> None:
    """The fault knob `OLMO_CTL_FAULT_HANG_AT_STEP=N[:H]` (core/faults.py): hang host H (default every host)
    before step N, sleeping forever on the host loop."""
    if faults.hangs(os.environ, step, host):
        print(f"FAULT INJECTION: hanging before step {step} ({faults.HANG_AT_STEP.name})", flush=True)
        while True:
            time.sleep(3600)
