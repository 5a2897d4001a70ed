"""The trainer on gs:// (fake-gcs-server): checkpoints and event segments in the bucket, a second
process resumes from them, and TensorBoard's EventAccumulator reads every step back exactly once."""

from __future__ import annotations

import re

import pytest
from helpers.trainer import train

pytestmark = pytest.mark.gcs


def test_run_on_gcs_resumes_and_events_read_back_without_gap_or_duplicate(tmp_path, gcs):
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    from olmo_ctl.storage import store_for

    bucket = gcs.bucket
    run = f"gs://{bucket}/runs/smoke"
    first = train(
        run,
        "--attempt",
        "1",
        "--stop-at-step",
        "10",
        "--set",
        "checkpoint.interval=5",
        "--set",
        "logging.upload_every_s=0",
        "--set",
        "eval.interval=10",
    )
    assert "committed step 10" in first.stdout
    second = train(
        run,
        "--attempt",
        "2",
        "--stop-at-step",
        "15",
        "--set",
        "checkpoint.interval=5",
        "--set",
        "eval.interval=10",
    )
    assert "restored checkpoint 10 from gs://" in second.stdout

    store = store_for(run)
    _, dirs = store.list(f"{run}/checkpoints")
    assert [d.rstrip("/").rsplit("/", 1)[1] for d in dirs] == ["10", "15", "5"]
    files, _ = store.list(f"{run}/tensorboard")
    names = [f.path.rsplit("/", 1)[1] for f in files]
    assert all(
        re.fullmatch(r"events\.out\.tfevents\.\d{10}\.[A-Za-z0-9_-]+\.a000[12]\.s\d{5}", n) for n in names
    )
    assert len([n for n in names if ".a0001." in n]) >= 2  # several immutable segments, no append

    acc = EventAccumulator(f"{run}/tensorboard", size_guidance={SCALARS: 0})
    acc.Reload()
    for tag in ("train/CE loss", "optim/total grad norm", "perf/total_tokens"):
        steps = [e.step for e in acc.Scalars(tag)]
        assert steps == list(range(1, 16)), (tag, steps)
    assert [e.step for e in acc.Scalars("eval/lm_loss")] == [10]
