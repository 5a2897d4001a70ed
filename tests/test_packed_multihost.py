"""Packed data built once on a slice: a stage-3-shaped start (packed, source groups, data and run
directory on gs://) on the 2 x 2 CPU twin (two real trainer processes joined by jax.distributed)
over the GCS emulator, every request seen by a proxy in front of it (tests/helpers/storage_proxy.py).

Host 0 writes each group's packing once, with a create-only precondition; host 1 waits for the
objects and reads them, and never downloads a source file whole (its instance reads are ranged). An
upload GCS answers 429 or 5xx is retried, and the object still lands once.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from helpers.attempts import attempt
from helpers.storage_proxy import Request, StallingProxy
from helpers.waiting import wait_for

from olmo_ctl.backends.base import State
from olmo_ctl.backends.local import LocalBackend
from olmo_ctl.data.files import TokenFile, ensure_smoke_data
from olmo_ctl.sandbox.gcs_emulator import emulator_env
from olmo_ctl.storage import store_for

pytestmark = pytest.mark.gcs

GROUPS = 2  # the smoke data's 4 train files, 2 to a group


def _upload_smoke_data(bucket: str) -> str:
    root = ensure_smoke_data()
    base = f"gs://{bucket}/smoke"
    for split in ("train", "eval"):
        for p in sorted((Path(root) / split).glob("*.npy")):
            url = f"{base}/{split}/{p.name}"
            store_for(url).write_bytes(url, p.read_bytes())
    return base


def _object(r: Request) -> str:
    """The object a media request reads (`/download/storage/v1/b/B/o/NAME?alt=media`), or ''."""
    path = urllib.parse.urlsplit(r.path).path
    head, sep, name = path.partition("/o/")
    return urllib.parse.unquote(name) if sep and "alt=media" in r.path else ""


@pytest.mark.chaos
def test_a_packed_start_on_the_twin_writes_each_packing_once_and_the_other_host_reads_it(tmp_path, gcs):
    data = _upload_smoke_data(gcs.bucket)
    run = f"gs://{gcs.bucket}/runs/packed"
    sets = [f"data.root={data}", "data.packed=true", "data.source_group_size=2"]
    sets += ["checkpoint.interval=1000", "eval.interval=1000", "logging.metrics_every=1"]
    with StallingProxy(gcs.url) as proxy:
        backend = LocalBackend(str(tmp_path), stop_grace_s=60)
        a = attempt(
            "packed",
            run,
            1,
            "cpu-2x2",
            recipe_path="smoke",
            extra_args=("--stop-at-step", "3", *(x for s in sets for x in ("--set", s))),
            env=emulator_env(proxy.url),
        )
        h = backend.send(backend.render(a))
        st = wait_for(
            lambda: (s := backend.status(h)).state != State.RUNNING and s, 600, "the attempt to end"
        )
        log = Path(h.data["log"]).read_text(errors="replace")
        assert st.state == State.SUCCEEDED, log[-4000:]

    writes = [r for r in proxy.requests if r.method == "POST" and b"/data_order/packing/" in r.body_head]
    assert len(writes) == GROUPS, [r.path for r in writes]  # once per group, by one host
    assert all("ifGenerationMatch=0" in r.path for r in writes)  # create-only
    stored = store_for(run).find(f"{run}/data_order/packing", "*.npy")
    assert len(stored) == GROUPS
    reads = [r for r in proxy.requests if "/data_order/packing/" in _object(r)]
    assert len(reads) >= GROUPS  # host 1 read them (host 0 keeps what it packed)
    assert "host 1: waiting for host 0 to store the packing of 2 groups" in log
    assert "host 0: waiting for host 0" not in log
    whole = [r for r in proxy.requests if _object(r).startswith("smoke/train/") and "range" not in r.headers]
    assert len(whole) == 4, [_object(r) for r in whole]  # host 0's packing read each source file once


@pytest.mark.parametrize("status", [429, 503])
def test_a_packing_upload_answered_429_or_5xx_is_retried_and_lands_once(gcs, tmp_path, status):
    from olmo_ctl import storage
    from olmo_ctl.sandbox.gcs_emulator import use_emulator
    from olmo_ctl.trainer.packed import PackedDataset

    files = []
    for j in range(2):
        p = tmp_path / f"{j}.npy"
        np.asarray([1, 2, 3, 0, 4, 5, 0, 6, 0] * (j + 1), dtype="<u4").tofile(p)
        files.append(TokenFile(str(p), p.name, p.stat().st_size))
    cache = f"gs://{gcs.bucket}/runs/retry/data_order/packing"
    with StallingProxy(gcs.url) as proxy, use_emulator(proxy.url):
        proxy.fail_next(1, status, lambda r: r.method == "POST" and b"/data_order/packing/" in r.body_head)
        ds = PackedDataset(files, 8, eos_token_id=0, pad_token_id=99, cache_dir=cache)
        posts = [r for r in proxy.requests if r.method == "POST" and b"/data_order/packing/" in r.body_head]
    assert [r.failed_with for r in posts] == [status, None, None]  # the refused try, its retry, group 1
    assert len(storage.store_for(cache).find(cache, "*.npy")) == 2
    again = PackedDataset(files, 8, eos_token_id=0, pad_token_id=99, cache_dir=cache)
    assert [again.instance(i)[0].tolist() for i in range(len(again))] == [
        ds.instance(i)[0].tolist() for i in range(len(ds))
    ]
