"""Polling helpers shared by the tests that drive real processes."""

from __future__ import annotations

import os
import signal
import time


def wait_for(pred, timeout: float, what: str, every: float = 0.05):
    """`pred()`'s first truthy value within `timeout` seconds, else AssertionError naming `what`."""
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def kill_stopped_or_running(*procs) -> None:
    """Kill the processes a test started that are still there, stopped (SIGSTOP) ones included."""
    for p in procs:
        if p is not None and p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (a zombie counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
