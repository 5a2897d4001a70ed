"""`olmo-ctl data audit`: did the run read every instance of its data order exactly once, in order?

The trainer records, with each checkpoint, the instances each host trained on at each step
(`trainer/audit.py`). This replays the run's epoch order (`trainer/data.epoch_order`, or the order
stored in the run directory) over every committed step and compares: step `s` must read global batch
`s - 1` of the order (epochs one after the other, each batch split over the hosts in process order),
whatever the attempts, resizes and process counts in between. It reports the instances read, how many
were distinct, read twice within an epoch, or skipped (in the order of the batches the run covered, but
never read), and the first step whose record departs from the order.

`record_result` keeps the last audit's report in the run directory (`data_audit/result.json`), where
`monitor` reads it (`read_result`): instances read twice raise its memorization alarm.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np

from olmo_ctl import storage
from olmo_ctl.core.errors import BadInput
from olmo_ctl.rundir import RunDir
from olmo_ctl.trainer.audit import AUDIT_DIR, Record, read_records

RESULT_NAME = "result.json"  # under AUDIT_DIR; not a record's name, so `read_records` passes it by


@dataclass
class _Epoch:
    """Reads per instance of one epoch, and the first step that read each (for naming a repeat)."""

    reads: np.ndarray
    first_step: np.ndarray
    expected: np.ndarray  # bool: in a batch the run's order covered


@dataclass
class AuditReport:
    committed_step: int
    instances: int = 0
    distinct: int = 0
    repeated: int = 0
    skipped: int = 0
    first_departure: dict | None = None
    first_repeat: dict | None = None
    launches: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.first_departure is None

    def to_dict(self) -> dict:
        return {
            "committed_step": self.committed_step,
            "instances": self.instances,
            "distinct": self.distinct,
            "repeated": self.repeated,
            "skipped": self.skipped,
            "first_departure": self.first_departure,
            "first_repeat": self.first_repeat,
            "launches": self.launches,
            "ok": self.ok,
        }


class _Orders:
    """Epoch orders as the trainer reads them: stored in the run directory when there, else computed."""

    def __init__(self, run_dir: str, instances: int, seed: int, fingerprint: str):
        self.order_dir = RunDir(run_dir).p("data_order")
        self.instances, self.seed, self.fingerprint = instances, seed, fingerprint
        self._cache: dict[int, np.ndarray] = {}

    def rows(self, epoch: int, start: int, stop: int) -> np.ndarray:
        o = self._cache.get(epoch)
        if o is None:
            from olmo_ctl.trainer.epoch_order import OrderFile

            stored = OrderFile.open(self.order_dir, self.fingerprint, self.instances, self.seed, epoch)
            if stored is not None:
                o = np.asarray(stored.rows(0, len(stored)), np.int64)
            else:
                from olmo_ctl.trainer.data import epoch_order

                o = np.asarray(epoch_order(self.instances, self.seed, epoch, 1), np.int64)
            self._cache = {epoch: o}
        return o[start:stop]


def _step_records(records: list[Record], committed: int) -> dict[int, list[tuple[Record, int]]]:
    """For each committed step, the rows of the launch whose training of it was committed: the last
    launch that recorded it (higher attempt, then later restore)."""
    best: dict[int, tuple[tuple[int, int], list[tuple[Record, int]]]] = {}
    for r in records:
        for i, step in enumerate(r.steps.tolist()):
            if step > committed:
                continue
            have = best.get(step)
            if have is None or r.launch > have[0]:
                best[step] = (r.launch, [(r, i)])
            elif r.launch == have[0]:
                have[1].append((r, i))
    return {s: rows for s, (_, rows) in best.items()}


def audit_run(run_dir: str) -> AuditReport:
    """The audit of the run directory `run_dir` (local or gs://)."""
    rd = RunDir(run_dir)
    committed = rd.committed_step()
    if committed == 0:
        raise BadInput(f"`{run_dir}` holds no committed checkpoint", "audit a run that has trained")
    records = read_records(run_dir)
    if not records:
        raise BadInput(
            f"`{run_dir}` holds no data-coverage records (data_audit/)",
            "the trainer writes them with each checkpoint; runs from before olmo-ctl recorded them cannot be audited",
        )
    first = records[0]
    for r in records:
        if (r.seed, r.instances, r.fingerprint) != (first.seed, first.instances, first.fingerprint):
            raise BadInput(
                f"the records of `{run_dir}` name two datasets (fingerprint {first.fingerprint[:12]} and "
                f"{r.fingerprint[:12]})",
                "a run whose data changed (--allow-data-change) has no single order to audit against",
            )
    orders = _Orders(run_dir, first.instances, first.seed, first.fingerprint)
    by_step = _step_records(records, committed)
    rep = AuditReport(committed)
    launches: dict[tuple[int, int], dict] = {}
    epochs: dict[int, _Epoch] = {}
    n = first.instances
    position = (1, 0)  # the order's next global batch: (epoch, batch in the epoch)
    global_batch = None
    for step in range(1, committed + 1):
        rows = by_step.get(step)
        if not rows:
            rep.first_departure = rep.first_departure or {"step": step, "reason": "no record of this step"}
            continue
        rows.sort(key=lambda t: t[0].process)
        rec0 = rows[0][0]
        lk = rec0.launch
        info = launches.setdefault(
            lk,
            {"attempt": lk[0], "restored_step": lk[1], "processes": rec0.processes, "first_step": step},
        )
        info["last_step"] = step
        if global_batch is not None and rec0.global_batch != global_batch:
            # the loader's own rule for a new global batch: the same place in the order, rounded up
            position = (position[0], -(-position[1] * global_batch // rec0.global_batch))
        global_batch = rec0.global_batch
        batches_per_epoch = n // global_batch
        if position[1] >= batches_per_epoch:
            position = (position[0] + 1, 0)
        epoch, batch = position
        got = np.concatenate([r.ids[i] for r, i in rows])
        recorded = {(int(r.epochs[i]), int(r.batches[i])) for r, i in rows}
        expected = orders.rows(epoch, batch * global_batch, (batch + 1) * global_batch)
        if rep.first_departure is None:
            why = None
            if sorted(r.process for r, _ in rows) != list(range(rec0.processes)):
                why = f"records of {len(rows)} of its {rec0.processes} hosts"
            elif recorded != {position}:
                why = f"read batch {sorted(recorded)} of the order, expected epoch {epoch} batch {batch}"
            elif got.shape != expected.shape or not np.array_equal(got, expected):
                wrong = np.flatnonzero(got[: len(expected)] != expected[: len(got)])
                k = int(wrong[0]) if len(wrong) else min(len(got), len(expected))
                why = (
                    f"row {k} holds instance {int(got[k]) if k < len(got) else None}, the order has "
                    f"{int(expected[k]) if k < len(expected) else None}"
                )
            if why:
                rep.first_departure = {
                    "step": step,
                    "epoch": epoch,
                    "batch": batch,
                    "attempt": lk[0],
                    "processes": rec0.processes,
                    "reason": why,
                }
        e = epochs.get(epoch)
        if e is None:
            e = epochs[epoch] = _Epoch(np.zeros(n, np.int32), np.zeros(n, np.int64), np.zeros(n, bool))
        e.expected[expected] = True
        for inst in got.tolist():
            if e.reads[inst] and rep.first_repeat is None:
                rep.first_repeat = {
                    "instance": int(inst),
                    "epoch": epoch,
                    "step": step,
                    "first_read_step": int(e.first_step[inst]),
                }
            if not e.reads[inst]:
                e.first_step[inst] = step
            e.reads[inst] += 1
        rep.instances += len(got)
        position = (epoch, batch + 1)
    for e in epochs.values():
        rep.distinct += int(np.count_nonzero(e.reads))
        rep.skipped += int(np.count_nonzero(e.expected & (e.reads == 0)))
    rep.repeated = rep.instances - rep.distinct
    if rep.first_departure is None and rep.repeated:
        rep.first_departure = {
            "step": rep.first_repeat["step"] if rep.first_repeat else None,
            "reason": "repeats",
        }
    rep.launches = sorted(launches.values(), key=lambda d: d["first_step"])
    return rep


def result_path(run_dir: str) -> str:
    return storage.join(run_dir, AUDIT_DIR, RESULT_NAME)


def record_result(run_dir: str, rep: AuditReport, now: float | None = None) -> str:
    """Keep `rep` (with the time of the audit, `audited_at`) as the run's last audit; its path."""
    now = time.time() if now is None else now
    doc = {**rep.to_dict(), "audited_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))}
    path = result_path(run_dir)
    storage.store_for(path).write_text(path, json.dumps(doc, indent=1) + "\n")
    return path


def read_result(run_dir: str) -> dict | None:
    """The run's last recorded audit (`record_result`), or None when none was recorded (or it is
    unreadable: a damaged record must not hide the rest of a monitor report)."""
    path = result_path(run_dir)
    try:
        doc = json.loads(storage.store_for(path).read_text(path))
    except (storage.NotFound, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
