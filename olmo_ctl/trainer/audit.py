"""The data-coverage record: which instances each host trained on at each step, kept in the run directory.

A loader that reads some instances twice and skips others trains on, and its training loss even looks
good (the case study's bug re-read 26% of its corpus); only the instance ids say so. Every host keeps,
for each step it trains, the loader's position (epoch, batch in the epoch) and the ids of the instances
its rows hold, and writes what it holds when a checkpoint is saved, one file per host per checkpoint:

    <run-dir>/data_audit/a<attempt>-r<restored step>-p<process>of<processes>-s<first>-<last>.npz

`a<attempt>-r<restored step>` names one launch of the trainer (every host of it restored the same step);
a step recorded by two launches is the later launch's (the higher attempt, then the later restore: the
earlier one's training of that step was never committed). `checkpoints/data_audit.py` replays the epoch order
against these records (`olmo-ctl data audit`). numpy only.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import numpy as np

from olmo_ctl import storage

AUDIT_DIR = "data_audit"
_NAME = re.compile(r"^a(\d+)-r(\d+)-p(\d+)of(\d+)-s(\d+)-(\d+)\.npz$")


@dataclass(frozen=True)
class Record:
    """One host's record of the steps `first..last` of one launch."""

    attempt: int
    restored: int  # the step the launch restored (0: a fresh start)
    process: int
    processes: int
    steps: np.ndarray  # int64[n]
    epochs: np.ndarray  # int64[n]
    batches: np.ndarray  # int64[n]: the batch of the epoch each step read
    ids: np.ndarray  # int64[n, local batch]: the instances of this host's rows
    global_batch: int
    seed: int
    instances: int  # instances in one epoch of the dataset
    fingerprint: str

    @property
    def launch(self) -> tuple[int, int]:
        return (self.attempt, self.restored)


def record_name(attempt: int, restored: int, process: int, processes: int, first: int, last: int) -> str:
    return f"a{attempt:04d}-r{restored:09d}-p{process:04d}of{processes:04d}-s{first:09d}-{last:09d}.npz"


class RecordedLoader:
    """The training loader, recording what each `next()` hands out: one step's batch. `first_step` is the
    step the next batch is for (the trainer sets it once it has restored); `write_record()` stores what
    this host trained since its last write, before the checkpoint of those steps is saved."""

    def __init__(self, loader, run_dir: str, attempt: int, process: int, processes: int):
        self.loader, self.run_dir, self.attempt = loader, run_dir, int(attempt)
        self.process, self.processes = int(process), int(processes)
        self.first_step = 1
        self.rows: list[tuple[int, int, int, np.ndarray]] = []  # (step, epoch, batch, ids)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)  # state, restore, close, fingerprint, ...

    def next(self) -> dict:
        st = self.loader.state()
        batch = self.loader.next()
        step = self.first_step + len(self.rows) + self._written
        ids = np.asarray(batch["instance_ids"], np.int64).reshape(-1).copy()
        self.rows.append((step, int(st["epoch"]), int(st["batch_in_epoch"]), ids))
        return batch

    __next__ = next

    def __iter__(self):
        return self

    _written = 0  # steps of this launch already written

    def write_record(self) -> str | None:
        """Store the steps held (the caller saves their checkpoint next); the path, or None if none."""
        if not self.rows:
            return None
        steps = np.array([r[0] for r in self.rows], np.int64)
        buf = io.BytesIO()
        np.savez(
            buf,
            steps=steps,
            epochs=np.array([r[1] for r in self.rows], np.int64),
            batches=np.array([r[2] for r in self.rows], np.int64),
            ids=np.stack([r[3] for r in self.rows]),
            global_batch=np.int64(self.loader.global_batch),
            seed=np.int64(self.loader.seed),
            instances=np.int64(len(self.loader.dataset)),
            fingerprint=np.array(self.loader.fingerprint),
        )
        name = record_name(
            self.attempt, self.first_step - 1, self.process, self.processes, int(steps[0]), int(steps[-1])
        )
        path = storage.join(self.run_dir, AUDIT_DIR, name)
        storage.store_for(path).write_bytes(path, buf.getvalue())
        self._written += len(self.rows)
        self.rows = []
        return path


def recorded(loader, run_dir: str, attempt: int, process: int, processes: int) -> RecordedLoader:
    return RecordedLoader(loader, run_dir, attempt, process, processes)


def read_records(run_dir: str) -> list[Record]:
    """Every record of the run, in no particular order."""
    base = storage.join(run_dir, AUDIT_DIR)
    store = storage.store_for(base)
    objects, _ = store.list(base)
    out = []
    for o in objects:
        m = _NAME.match(o.path.rstrip("/").rsplit("/", 1)[-1])
        if not m:
            continue
        z = np.load(io.BytesIO(store.read_bytes(o.path)), allow_pickle=False)
        a, r, p, n = (int(m.group(i)) for i in range(1, 5))
        out.append(
            Record(
                a,
                r,
                p,
                n,
                z["steps"],
                z["epochs"],
                z["batches"],
                z["ids"],
                int(z["global_batch"]),
                int(z["seed"]),
                int(z["instances"]),
                str(z["fingerprint"]),
            )
        )
    return out
