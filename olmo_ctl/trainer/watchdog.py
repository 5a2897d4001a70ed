"""The hang watchdog: a step that takes far longer than the steps before it is a hang, not a slow step.

A host stuck in a collective whose peer is wedged, a storage read that never returns, a deadlock:
the process is alive, so nothing outside it notices, and the slice idles at full price. The loop
calls `beat()` whenever it sees progress (a step dispatched, metrics fetched) and tells the watchdog
how many steps it is waiting for; a thread checks that the time since the last beat stays below
`max(min_s, factor x median step time x steps waited for)`. Past it, the trainer writes every thread's
stack (faulthandler) to its log and exits 3, so the attempt is restarted from its last checkpoint.

Where no step time can judge, absolute bounds do (so that no part of an attempt waits silently):

- start-up and storage phases, `judged(what, seconds)`: restore (the CheckpointManager's listing of
  the committed steps included), the data set-up (packing, or waiting for host 0's packing) and the
  epoch-order reads before the first step, every checkpoint write and the wait for its commit. Each
  storage request ends within `runtime.storage_timeout_s` (trainer/deadlines.py), so a phase that
  sees no progress for `storage_phase_s` (the watchdog factor x that, at least `watchdog_min_s`) is
  wedged below the clients. Progress inside a phase (a group packed, a poll answered) is a beat.
- the first window, `compiled(seconds)`: the first step's dispatch holds its compile and is not
  judged; what follows until the first timed window (the first collectives, where a bad chip or link
  wedges a host) may take `first_window_s`: the factor x the compile time, at least `watchdog_min_s`.

Inside `paused()` (an evaluation) nothing is judged.
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
        self._phase: tuple[str, float] | None = None  # (what, seconds without progress it may take)
        self._first_window_s: float | None = None  # set by compiled(), cleared by the first timed window
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
            self._first_window_s = None

    def beat(self, step: int, waiting_for: int = 1) -> None:
        with self._lock:
            self._last = time.monotonic()
            self._step = step
            self._waiting_for = max(1, waiting_for)

    def progress(self) -> None:
        """Progress that is not a step (a source group packed, a storage poll answered)."""
        with self._lock:
            self._last = time.monotonic()

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

    @contextlib.contextmanager
    def judged(self, what: str, seconds: float):
        """`what` (restore, a checkpoint write, ...) may go `seconds` without a beat; phases nest, the
        innermost judges."""
        with self._lock:
            outer = self._phase
            self._phase = (what, float(seconds))
            self._last = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._phase = outer
                self._last = time.monotonic()

    def first_batch(self, first: bool, seconds: float):
        """Around the loop's batch read: the attempt's first one (the epoch order's read, or the wait
        for host 0 to store it) is judged as a storage phase."""
        return (
            self.judged("the first batch (the epoch order)", seconds) if first else contextlib.nullcontext()
        )

    @contextlib.contextmanager
    def first_dispatch(self, first: bool):
        """Around the loop's step dispatch: the attempt's first one compiles, is not judged, and sizes
        the first window's bound (`compiled`)."""
        if not first:
            yield
            return
        t0 = time.monotonic()
        with self.paused():
            yield
        self.compiled(time.monotonic() - t0)

    def compiled(self, compile_s: float) -> float:
        """The first step was compiled in `compile_s`: until the first timed window, a wait may take the
        factor x that (at least min_s). Returns that allowance."""
        allowed = max(self.min_s, self.factor * float(compile_s))
        with self._lock:
            if not self._times:
                self._first_window_s = allowed
            self._last = time.monotonic()
        return allowed

    def allowance(self) -> float | None:
        """Seconds the current wait may take, or None while disarmed."""
        with self._lock:
            return self._allowance()

    def _allowance(self) -> float | None:
        if self._paused:
            return None
        if self._phase is not None:
            return self._phase[1]
        if self._times:
            return max(self.min_s, self.factor * statistics.median(self._times) * self._waiting_for)
        return self._first_window_s

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                allowed = self._allowance()
                waited, step, phase = time.monotonic() - self._last, self._step, self._phase
                median = statistics.median(self._times) if self._times else 0.0
            if allowed is None or waited <= allowed:
                continue
            if phase is not None:
                why = f"in {phase[0]} (allowed {allowed:.1f} s without progress)"
            elif median:
                why = (
                    f"after step {step} (allowed {allowed:.1f} s: {self.factor:g} x the median step time "
                    f"{median:.3f} s, at least {self.min_s:g} s)"
                )
            else:
                why = (
                    f"after step {step}, in the first window (allowed {allowed:.1f} s: {self.factor:g} x "
                    f"the compile time, at least {self.min_s:g} s)"
                )
            self.on_hang(
                f"watchdog: no progress for {waited:.1f} s {why}; "
                "the stacks of every thread follow, then exit 3 so that the attempt is restarted"
            )
            return


def storage_phase_s(runtime) -> float:
    """How long restore, the data set-up or a checkpoint write may go without progress: every storage
    request ends within runtime.storage_timeout_s, so the watchdog factor x that (at least
    watchdog_min_s) means a wait below the clients (a wedged collective, a client without a deadline)."""
    return max(
        float(runtime.watchdog_min_s), float(runtime.watchdog_factor) * float(runtime.storage_timeout_s)
    )


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
