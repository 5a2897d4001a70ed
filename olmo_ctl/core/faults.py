"""Every fault-injection knob: its environment variable, how its value is read, and what it does.

Tests and demos break a run on purpose (a hung host, a slow host, a resume one batch off, a supervisor
paused at its worst moment) through environment variables, so the real processes (trainer,
supervisor) are the ones under test. They live in one table so that one place says which exist, and
docs/testing.md's table lists the same ones (tests/test_faults.py holds the two together). Never set
one in a real run. The parsers are pure: they take the environment as a mapping; acting on the value
(sleeping, stopping a process) is the caller's job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    name: str  # the environment variable
    value: str  # its syntax
    read_by: str  # the process that acts on it
    does: str  # what it does, one line (the docs table says the same)


HANG_AT_STEP = Knob(
    "OLMO_CTL_FAULT_HANG_AT_STEP",
    "N[:H]",
    "trainer",
    "host H (default every host) hangs before step N: the watchdog ends it with exit 3",
)
FAIL_AT_STEP = Knob(
    "OLMO_CTL_FAULT_FAIL_AT_STEP",
    "N[:H]",
    "trainer",
    "host H (default every host) fails to read its data before step N (an OSError, as a storage error "
    "raises): it exits 3 alone, and the others within runtime.peer_timeout_s",
)
SLOW_START = Knob(
    "OLMO_CTL_FAULT_SLOW_START",
    "S",
    "trainer",
    "every host's start-up (after the join, before the restore) takes S seconds longer: a slow restore",
)
SLOW_DATA = Knob(
    "OLMO_CTL_FAULT_SLOW_DATA",
    "H:MS",
    "trainer",
    "host H's data loading is MS milliseconds slower per step: a straggler",
)
DATA_SHIFT = Knob(
    "OLMO_CTL_TEST_DATA_SHIFT",
    "N",
    "trainer",
    "a restored run resumes its data N batches off (+ or -): the resume check must catch it",
)
DOUBLE_SHARD = Knob(
    "OLMO_CTL_FAULT_DOUBLE_SHARD",
    "1",
    "trainer",
    "each host strides its rows of each global batch (already its share) again by the host index and "
    "repeats them to fill the batch (the case study's loader bug): with 2+ hosts some instances are read "
    "twice and others never; `data audit` must catch it",
)
PAUSE_BEFORE_CREATE = Knob(
    "OLMO_CTL_FAULT_PAUSE_BEFORE_CREATE",
    "1",
    "supervisor",
    "the supervisor stops itself (SIGSTOP) after its last lease check, before it "
    "creates the attempt (once per process)",
)
KILL_IN_PRUNE = Knob(
    "OLMO_CTL_FAULT_KILL_IN_PRUNE",
    "S:I",
    "trainer",
    "the trainer kills itself (SIGKILL) in the prune before checkpoint S is saved (or, S being the last "
    "step, at the close after it), before deleting the I-th checkpoint a newer committed one made "
    "redundant (I = the count deleted: after the last deletion)",
)
SMOKE_FAULT = Knob(
    "OLMO_CTL_SMOKE_FAULT",
    "lr,data-shift",
    "olmo-ctl smoke",
    "`lr` trains with a learning rate of 1e-9 (the loss cannot fall); `data-shift` resumes "
    "attempt 2 one batch off (sets OLMO_CTL_TEST_DATA_SHIFT=1 for it)",
)
KNOBS = (
    HANG_AT_STEP,
    FAIL_AT_STEP,
    SLOW_START,
    SLOW_DATA,
    DATA_SHIFT,
    DOUBLE_SHARD,
    PAUSE_BEFORE_CREATE,
    KILL_IN_PRUNE,
    SMOKE_FAULT,
)


def hang_at_step(environ: Mapping[str, str], knob: Knob = HANG_AT_STEP) -> tuple[int, int | None] | None:
    """(step N, host H or None for every host) of `N[:H]` (HANG_AT_STEP's or FAIL_AT_STEP's); None when
    unset or malformed."""
    at, _, only = environ.get(knob.name, "").partition(":")
    if not at.isdigit() or (only and not only.isdigit()):
        return None
    return int(at), int(only) if only else None


def hangs(environ: Mapping[str, str], step: int, host: int) -> bool:
    """Whether host `host` must hang before step `step`."""
    knob = hang_at_step(environ)
    return knob is not None and knob[0] == step and knob[1] in (None, host)


def fails(environ: Mapping[str, str], step: int, host: int) -> bool:
    """Whether host `host`'s data read must fail before step `step`."""
    knob = hang_at_step(environ, FAIL_AT_STEP)
    return knob is not None and knob[0] == step and knob[1] in (None, host)


def slow_start_s(environ: Mapping[str, str]) -> float:
    """Seconds added to every host's start-up; 0 when unset or malformed."""
    v = environ.get(SLOW_START.name, "")
    return float(v) if v.replace(".", "", 1).isdigit() else 0.0


def slow_data_ms(environ: Mapping[str, str], host: int) -> float:
    """Milliseconds added to host `host`'s data loading per step (`H:MS`); 0 when unset, malformed or
    for another host."""
    h, _, ms = environ.get(SLOW_DATA.name, "").partition(":")
    if h.isdigit() and int(h) == host and ms.replace(".", "", 1).isdigit():
        return float(ms)
    return 0.0


def data_shift(environ: Mapping[str, str]) -> int:
    """Batches the restored data position is shifted by (0: none)."""
    return int(environ.get(DATA_SHIFT.name, "0") or 0)


def double_shard(environ: Mapping[str, str]) -> bool:
    """Whether the loader shards its share a second time (DOUBLE_SHARD)."""
    return environ.get(DOUBLE_SHARD.name, "") == "1"


def kill_in_prune(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(step S, deletion index I) of KILL_IN_PRUNE's `S:I`; None when unset or malformed."""
    step, _, index = environ.get(KILL_IN_PRUNE.name, "").partition(":")
    return (int(step), int(index)) if step.isdigit() and index.isdigit() else None


def smoke_faults(value: str | None) -> set[str]:
    """The comma-separated fault names of OLMO_CTL_SMOKE_FAULT."""
    return {f.strip() for f in (value or "").split(",") if f.strip()}
