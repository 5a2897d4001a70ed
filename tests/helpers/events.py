"""Run directories' event files written with TensorBoard's own writer, holding known values.

`write_segment(tb_dir, steps, attempt=, segment=, ...)` writes one contract-named segment
(`events.out.tfevents.<start>.host-0.a<attempt>.s<segment>`) of classic simple_value scalars;
`value(tag, step, desync=)` is the deterministic value it writes unless told otherwise.
"""

from __future__ import annotations

import os
import shutil

import numpy as np

TAGS = [
    "train/CE loss",
    "train/PPL",
    "optim/LR (group 0)",
    "optim/LR (group 1)",
    "optim/step skipped",
    "throughput/total tokens",
    "throughput/device/TPS",
    "perf/step_time_s",
]
T0 = 1_767_225_600.0


def value(tag: str, step: int, attempt: int = 1, desync: int | None = None) -> float:
    """A deterministic value per (tag, step); `desync` perturbs every step from that one on."""
    base = (TAGS.index(tag) + 1 if tag in TAGS else 9) * 0.5 + 10.0 / (1 + step) + 0.001 * (step % 7)
    if desync is not None and step >= desync:
        base += 0.01
    return float(np.float32(base))


def write_segment(
    tb_dir,
    steps,
    *,
    attempt: int = 1,
    segment: int = 0,
    tags=TAGS,
    wall0: float = T0,
    step_s: float = 1.0,
    values=None,
    start_time: int = 1767225600,
    extra_events=(),
):
    """One contract-named segment written with EventFileWriter (classic simple_value scalars).
    Returns its path. `values(tag, step)` overrides the default values."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    os.makedirs(tb_dir, exist_ok=True)
    tmp = os.path.join(str(tb_dir), f".tmp-{attempt}-{segment}")
    w = EventFileWriter(tmp)
    for ev in extra_events:
        w.add_event(ev)
    for step in steps:
        for tag in tags:
            x = values(tag, step) if values else value(tag, step, attempt)
            w.add_event(
                event_pb2.Event(
                    wall_time=wall0 + step * step_s,
                    step=step,
                    summary=summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=x)]),
                )
            )
    w.close()
    (src,) = [os.path.join(tmp, f) for f in os.listdir(tmp)]
    dst = os.path.join(
        str(tb_dir), f"events.out.tfevents.{start_time:010d}.host-0.a{attempt:04d}.s{segment:05d}"
    )
    os.replace(src, dst)
    shutil.rmtree(tmp)
    return dst
