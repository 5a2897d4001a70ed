"""The stored epoch order: the same order as computing it, read back by rows, concurrent writers, corruption."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from olmo_ctl import storage
from olmo_ctl.core.errors import BadInput
from olmo_ctl.trainer import epoch_order as eo
from olmo_ctl.trainer.data import BatchLoader, TokenDataset, epoch_order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def small_layout(monkeypatch):
    """Chunks of 64 entries and parts of 256, so a few hundred instances span several of each."""
    monkeypatch.setattr(eo, "CHUNK_ENTRIES", 64)
    monkeypatch.setattr(eo, "PART_ENTRIES", 256)


def _files(tmp_path, n_instances: int, seq_len: int):
    """Token files whose instance i starts with token i (three files, remainders dropped)."""
    paths, first = [], 0
    for f, count in enumerate((n_instances // 3, n_instances // 3, n_instances - 2 * (n_instances // 3))):
        toks = (first + np.arange(count))[:, None] * np.ones((1, seq_len), np.int64)
        p = tmp_path / "data" / f"part-{f}.npy"
        p.parent.mkdir(parents=True, exist_ok=True)
        np.concatenate([toks.ravel(), [7, 7]]).astype("<u4").tofile(p)
        paths.append(str(p))
        first += count
    return paths


@pytest.mark.parametrize("n", [1, 63, 64, 257, 1000])
def test_stored_order_is_the_computed_order(tmp_path, small_layout, n):
    order = eo.stored_order(str(tmp_path / "orders"), "v1:x:abcd", n, 11, 3)
    want = np.random.Generator(np.random.PCG64(11 + 3)).permutation(n)
    assert len(order) == n and (order[0:n] == want).all()
    for a, b in ((0, 1), (5, 200), (n - 1, n), (63, 65)):
        assert (order.rows(a, b) == want[a:b]).all()


def test_computed_in_place_as_the_rule_says(tmp_path):
    buf = np.empty(100_000, np.uint32)
    eo.compute_into(buf, 42, 1)
    assert (buf == epoch_order(100_000, 42, 1, 1)).all()
    # A numpy.memmap would take numpy's slow per-element shuffle: refused (build maps a plain ndarray).
    with pytest.raises(TypeError):
        eo.compute_into(np.memmap(tmp_path / "m", mode="w+", dtype=np.uint32, shape=(10,)), 1, 1)


def test_loader_with_a_stored_order_hands_out_the_same_batches(tmp_path, small_layout):
    ds = TokenDataset(_files(tmp_path, 600, 4), 4)
    odir = str(tmp_path / "orders")
    for p in range(4):
        plain = BatchLoader(ds, 8, 5, p, 4)
        stored = BatchLoader(ds, 8, 5, p, 4, order_dir=odir)
        for _ in range(2 * plain.batches_per_epoch + 3):  # across two epoch boundaries
            a, b = plain.next(), stored.next()
            assert (a["instance_ids"] == b["instance_ids"]).all() and (a["input_ids"] == b["input_ids"]).all()
    assert sorted(os.listdir(odir)) == [f"{ds.fingerprint(5).rpartition(':')[2]}-e{e:05d}" for e in (1, 2, 3)]


def test_a_reader_reads_only_the_parts_holding_its_rows(tmp_path, small_layout):
    d = tmp_path / "orders"
    eo.stored_order(str(d), "v1:x:abcd", 1000, 1, 1)
    want = np.random.Generator(np.random.PCG64(2)).permutation(1000)
    (sub,) = d.iterdir()
    for name in os.listdir(sub):
        if name.startswith("part-") and name != "part-00002":
            os.unlink(sub / name)
    again = eo.stored_order(str(d), "v1:x:abcd", 1000, 1, 1)  # found: nothing recomputed
    assert (again.rows(600, 700) == want[600:700]).all()  # part 2 holds entries 512..767
    with pytest.raises(BadInput, match="part-00000 is missing"):
        again.rows(0, 1)


def test_corruption_is_named_with_what_to_do(tmp_path, small_layout):
    d = tmp_path / "orders"
    eo.stored_order(str(d), "v1:x:abcd", 300, 1, 1)
    (sub,) = d.iterdir()
    raw = bytearray((sub / "part-00001").read_bytes())
    raw[5] ^= 1
    (sub / "part-00001").write_bytes(bytes(raw))
    order = eo.stored_order(str(d), "v1:x:abcd", 300, 1, 1)
    assert (order.rows(0, 256) == np.random.Generator(np.random.PCG64(2)).permutation(300)[:256]).all()
    with pytest.raises(BadInput, match="chunk 4 of part-00001 fails its checksum") as e:
        order.rows(256, 257)
    assert "delete that directory" in e.value.one_line()
    header = json.loads((sub / "header.json").read_text())
    (sub / "header.json").write_text(json.dumps(dict(header, n=299)))
    with pytest.raises(BadInput, match="header differs in n"):
        eo.stored_order(str(d), "v1:x:abcd", 300, 1, 1)


def test_the_first_complete_writer_wins(tmp_path, small_layout):
    d = tmp_path / "orders"
    order = eo.stored_order(str(d), "v1:x:abcd", 500, 9, 2)
    header = d / eo.order_key("v1:x:abcd", 2) / "header.json"
    before = header.stat().st_mtime_ns
    eo.build_order(str(header.parent), "v1:x:abcd", 500, 9, 2)  # a slower writer finishing later
    assert header.stat().st_mtime_ns == before
    assert (eo.stored_order(str(d), "v1:x:abcd", 500, 9, 2).rows(0, 500) == order.rows(0, 500)).all()
    assert not [n for n in os.listdir(header.parent) if n.startswith(".order-scratch")]


def test_concurrent_processes_agree(tmp_path):
    code = (
        "import sys, json; from olmo_ctl.trainer import epoch_order as eo; "
        "o = eo.stored_order(sys.argv[1], 'v1:x:beef', 300000, 4, 1); "
        "print(json.dumps(o.rows(1000, 1010).tolist()))"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "o")], stdout=subprocess.PIPE, text=True, env=env
        )
        for _ in range(3)
    ]
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] == outs[2] == epoch_order(300000, 4, 1, 1)[1000:1010].tolist()


@pytest.mark.gcs
def test_stored_on_gcs_and_read_by_ranges(tmp_path, small_layout):
    from olmo_ctl.sandbox.gcs_emulator import gcs_emulator

    with gcs_emulator() as (_url, bucket):
        base = f"gs://{bucket}/runs/r/data_order"
        order = eo.stored_order(base, "v1:x:abcd", 700, 3, 1)
        want = np.random.Generator(np.random.PCG64(4)).permutation(700)
        assert (order.rows(100, 650) == want[100:650]).all()
        sub = storage.join(base, eo.order_key("v1:x:abcd", 1))
        store = storage.store_for(base)
        assert [store.exists(storage.join(sub, n)) for n in ("header.json", "part-00002", "part-00003")] == [
            True,
            True,
            False,
        ]


def test_hosts_other_than_0_wait_for_host_0s_order(tmp_path):
    """Host 1 never computes the order: it waits for the header host 0 writes last, then reads its rows."""
    import threading
    import time

    from olmo_ctl.trainer.data import epoch_order

    got = {}

    def host1():
        got["o"] = eo.stored_order(str(tmp_path), "v1:x:abcd", 5000, 9, 1, build=False, poll_s=0.05)

    t = threading.Thread(target=host1)
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and not list(tmp_path.iterdir())  # waiting, and nothing written by host 1
    eo.stored_order(str(tmp_path), "v1:x:abcd", 5000, 9, 1, build=True)
    t.join(10)
    np.testing.assert_array_equal(
        got["o"].rows(0, 5000), eo.stored_order(str(tmp_path), "v1:x:abcd", 5000, 9, 1).rows(0, 5000)
    )
    assert len(epoch_order(5000, 9, 1, 8)) <= 5000
    with pytest.raises(Exception, match="stored no epoch-2 order"):
        eo.stored_order(str(tmp_path), "v1:x:abcd", 5000, 9, 2, build=False, wait_s=0.2, poll_s=0.05)
