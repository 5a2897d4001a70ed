"""Reading speed: `olmo-ctl monitor -o json` against TensorBoard's EventAccumulator on a stage-1-length log.

Generates (once, cached under ~/.cache/olmo-ctl/bench/) a run directory whose `tensorboard/` holds a
full-length stage-1 log (1,413,814 steps x 8 tags by default) written by TensorBoard's own
`EventFileWriter`, one event per tag per step like OLMo-core. Then it times:

1. `olmo-ctl monitor RUN -o json` end to end (a fresh process: start-up, listing, reading, report);
2. `EventAccumulator(size_guidance={SCALARS: 0}).Reload()` on the same files;
3. an incremental refresh of the monitor's reader after a new segment with 1,000 more steps lands.

    python benchmarks/monitor_read.py                 # full length (generation takes several minutes once)
    python benchmarks/monitor_read.py --steps 100000  # quicker
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

FULL_STEPS = 1_413_814
TAGS = [
    "train/CE loss",
    "train/PPL",
    "train/Z loss",
    "optim/total grad norm",
    "optim/LR (group 0)",
    "optim/step skipped",
    "throughput/total tokens",
    "throughput/device/TPS",
]
TOKENS_PER_STEP = 4_194_304
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def _values(step: int) -> list[float]:
    loss = 2.2 + 8.5 * math.exp(-step / 3000.0) + 0.02 * math.sin(step * 0.37)
    lr = 3e-4 * min(1.0, step / 2000) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / FULL_STEPS)))
    return [
        loss,
        math.exp(loss),
        1e-5 * 11.0**2,
        0.3 + 0.05 * math.cos(step),
        lr,
        0.0,
        float(step * TOKENS_PER_STEP),
        10_700.0 + 50 * math.sin(step * 0.01),
    ]


def write_segment(tb_dir: Path, first: int, last: int, attempt: int, segment: int) -> None:
    """Steps first..last (inclusive) as one immutable segment, with the real TensorBoard writer."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    w = EventFileWriter(
        str(tb_dir), max_queue_size=1000, flush_secs=30, filename_suffix=f".a{attempt:04d}.s{segment:05d}"
    )
    ev = event_pb2.Event(
        summary=summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag="", simple_value=0.0)])
    )
    val = ev.summary.value[0]
    for step in range(first, last + 1):
        ev.step = step
        ev.wall_time = T0 + 3.05 * step  # add_event serialises at once: reusing the proto is safe
        for tag, x in zip(TAGS, _values(step), strict=True):
            val.tag = tag
            val.simple_value = x
            w.add_event(ev)
    w.close()


def generate(run_dir: Path, steps: int) -> None:
    marker = run_dir / "complete"
    if marker.exists():
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    tb = run_dir / "tensorboard"
    tb.mkdir(parents=True)
    t = time.time()
    print(
        f"generating {steps:,} steps x {len(TAGS)} tags in {run_dir} (cached for later runs)...", flush=True
    )
    write_segment(tb, 1, steps, attempt=1, segment=0)
    marker.write_text(f"{steps}\n")
    print(f"  generated in {time.time() - t:.0f} s", flush=True)


def time_monitor(run_dir: Path) -> tuple[float, dict]:
    t = time.perf_counter()
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            "from olmo_ctl.cli import entry; entry()",
            "monitor",
            str(run_dir),
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
    )
    dt = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"monitor failed ({p.returncode}): {p.stderr.strip()}")
    return dt, json.loads(p.stdout)


def time_accumulator(tb_dir: Path) -> tuple[float, int]:
    from tensorboard.backend.event_processing import event_accumulator as ea

    t = time.perf_counter()
    acc = ea.EventAccumulator(str(tb_dir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    n = len(acc.Scalars("train/CE loss"))
    return time.perf_counter() - t, n


def time_incremental(run_dir: Path, steps: int) -> tuple[float, float, int]:
    """Read everything with a reader, land a new 1,000-step segment, time the refresh that picks it up."""
    from olmo_ctl.observe.reader import EventReader

    work = run_dir.parent / (run_dir.name + "-tail")
    shutil.rmtree(work, ignore_errors=True)
    (work / "tensorboard").mkdir(parents=True)
    for f in (run_dir / "tensorboard").iterdir():
        os.symlink(f, work / "tensorboard" / f.name)
    try:
        r = EventReader(str(work / "tensorboard"))
        full = r.refresh().seconds
        write_segment(work / "tensorboard", steps + 1, steps + 1000, attempt=1, segment=1)
        st = r.refresh()
        assert r.series("train/CE loss").steps[-1] == steps + 1000
        return full, st.seconds, st.records
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=FULL_STEPS)
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/olmo-ctl/bench"))
    ap.add_argument("--skip-accumulator", action="store_true", help="time only olmo-ctl")
    args = ap.parse_args()
    run_dir = Path(args.cache) / f"stage1-{args.steps}"
    generate(run_dir, args.steps)
    size = sum(f.stat().st_size for f in (run_dir / "tensorboard").iterdir())
    print(f"log: {args.steps:,} steps x {len(TAGS)} tags, {size / 1e6:,.0f} MB")

    dt_mon, rep = time_monitor(run_dir)
    assert rep["step"] == args.steps, rep["step"]
    print(f"olmo-ctl monitor -o json      {dt_mon:8.2f} s  (whole process; step {rep['step']:,})")
    if not args.skip_accumulator:
        dt_acc, n = time_accumulator(run_dir / "tensorboard")
        assert n == args.steps, n
        print(f"EventAccumulator.Reload       {dt_acc:8.2f} s  (size_guidance 0; {n:,} CE-loss points)")
        print(f"speed-up                      {dt_acc / dt_mon:8.1f} x")
    full, inc, recs = time_incremental(run_dir, args.steps)
    print(f"EventReader full read         {full:8.2f} s")
    print(f"incremental refresh (+1,000 steps, {recs:,} records) {inc * 1000:.1f} ms")


if __name__ == "__main__":
    main()
