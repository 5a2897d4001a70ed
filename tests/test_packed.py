"""OLMo-core's packed FSL dataset: packing, source grouping and permutation, labels, segment ids.

The expected instances are OLMo-core's own (src/test/data/numpy_dataset_test.py and utils_test.py at
fa6c5014: `test_instance_packer`, `test_pack_documents_into_instances`,
`test_numpy_packed_fsl_dataset`, `test_numpy_packed_fsl_dataset_with_source_grouping`), on the same
token files written as our uint32 files.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from olmo_ctl.core.errors import BadInput
from olmo_ctl.data.files import TokenFile, permute_sources
from olmo_ctl.trainer.data import BatchLoader, epoch_order
from olmo_ctl.trainer.packed import InstancePacker, PackedDataset, document_spans, pack_group, segment_ids


def _file(tmp_path, name, tokens) -> TokenFile:
    p = tmp_path / name
    np.asarray(tokens, dtype="<u4").tofile(p)
    return TokenFile(str(p), name, p.stat().st_size)


def test_instance_packer_follows_the_paper_example():
    # utils_test.py:242-253: appendix B of arXiv 2404.10830, extended
    packer = InstancePacker(8)
    assert [packer.pack_document(i, n) for i, n in enumerate([8, 6, 6, 4, 3, 2, 3])] == [0, 1, 2, 3, 3, 1, 4]


def test_pack_one_file():
    # utils_test.py:256-270
    data = np.array([1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2, 0])
    spans, offsets = pack_group([data], 8, 0)
    assert offsets.tolist() == [0, 1, 2, 3, 5]
    assert spans[0].tolist() == [0, 8]
    assert int((spans[:, 1] - spans[:, 0]).sum()) == len(data)


def test_documents_end_at_eos_are_truncated_and_a_tail_without_eos_is_dropped():
    toks = np.array([5, 5, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 7, 7])
    assert document_spans(toks, 0, 4).tolist() == [[0, 3], [3, 7]]


def test_packed_instances_are_olmo_cores(tmp_path):
    # numpy_dataset_test.py:265-308 (truncate), pad -1
    f1 = _file(
        tmp_path, "a.npy", [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2, 0]
    )
    f2 = _file(tmp_path, "b.npy", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 2, 0])
    ds = PackedDataset([f1, f2], 8, eos_token_id=0, pad_token_id=-1)
    assert len(ds) == 6
    ids, labels, seg = ds.instance(0)
    assert ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    ids, labels, seg = ds.instance(1)
    assert ids.tolist() == [1, 2, 3, 4, 5, 0, -1, -1]
    # get_labels: shifted left, -100 where the target is padding and at the end
    assert labels.tolist() == [2, 3, 4, 5, 0, -100, -100, -100]
    assert seg.tolist() == [0, 0, 0, 0, 0, 0, 1, 1]  # get_document_lengths: [6, 2]
    ids, labels, seg = ds.instance(3)
    assert ids.tolist() == [1, 2, 3, 0, 1, 2, 0, -1]
    # the label across the boundary (EOS -> the next document's first token) is kept, as in OLMo-core
    assert labels.tolist() == [2, 3, 0, 1, 2, 0, -100, -100]
    assert seg.tolist() == [0, 0, 0, 0, 1, 1, 1, 2]
    assert ds.instance(5)[0].tolist() == [1, 2, 0, -1, -1, -1, -1, -1]


def test_source_grouping_is_olmo_cores(tmp_path):
    # numpy_dataset_test.py:370-415: four files in groups of two, hard-coded instances
    fs = [
        _file(
            tmp_path,
            "1.npy",
            [1, 2, 3, 0, 11, 12, 13, 14, 15, 0, 21, 22, 23, 24, 25, 0, 31, 32, 33, 0, 41, 42, 0],
        ),
        _file(tmp_path, "2.npy", [51, 52, 0, 61, 62, 63, 64, 65, 66, 67, 0]),
        _file(tmp_path, "3.npy", [71, 72, 73, 74, 75, 76, 77, 78, 79, 0, 81, 82, 0]),
        _file(tmp_path, "4.npy", [91, 92, 93, 94, 0]),
    ]
    ds = PackedDataset(fs, 8, eos_token_id=0, pad_token_id=-1, source_group_size=2)
    assert len(ds) == 7
    assert [ds.instance(i)[0].tolist() for i in range(7)] == [
        [61, 62, 63, 64, 65, 66, 67, 0],
        [11, 12, 13, 14, 15, 0, -1, -1],
        [21, 22, 23, 24, 25, 0, -1, -1],
        [1, 2, 3, 0, 31, 32, 33, 0],
        [41, 42, 0, 51, 52, 0, -1, -1],  # a bin holds documents of both files of its group
        [71, 72, 73, 74, 75, 76, 77, 78],
        [91, 92, 93, 94, 0, 81, 82, 0],
    ]


def test_source_permutation_is_python_random_over_the_file_indices():
    files = [f"f{i}" for i in range(10)]
    order = list(range(10))
    random.Random(123).shuffle(order)  # numpy_dataset.py:2465-2473
    assert permute_sources(files, 123) == [f"f{i}" for i in order]
    assert permute_sources(files, None) == files
    assert permute_sources(files, 123) != files


def test_epoch_order_over_packed_instances(tmp_path):
    """The loader permutes the packed instance numbering with the usual PCG64(seed + epoch) rule."""
    rng = np.random.default_rng(0)
    fs = []
    for j in range(5):
        docs = [np.append(rng.integers(1, 50, int(n)), 0) for n in rng.integers(1, 40, 30)]
        fs.append(_file(tmp_path, f"{j}.npy", np.concatenate(docs)))
    fs = permute_sources(fs, 123)
    ds = PackedDataset(fs, 64, eos_token_id=0, pad_token_id=99, source_group_size=2)
    loader = BatchLoader(ds, 4, seed=7)
    b = loader.next()
    want = epoch_order(len(ds), 7, 1, 4)[:4]
    assert b["instance_ids"].tolist() == want.tolist()
    assert b["input_ids"].tolist() == [ds.instance(int(i))[0].tolist() for i in want]
    # every real token of every document appears once per epoch (no doc longer than 64 here)
    total = sum(int((ds.instance(i)[0] != 99).sum()) for i in range(len(ds)))
    assert total == sum(f.tokens for f in fs)


def test_segment_ids_cut_like_get_document_lengths():
    ids = np.array([[3, 0, 4, 4, 0, 9, 9], [0, 0, 1, 2, 3, 4, 0]])
    assert segment_ids(ids, 0).tolist() == [[0, 0, 1, 1, 1, 2, 2], [0, 1, 2, 2, 2, 2, 2]]


def test_packing_is_cached_and_read_back(tmp_path):
    fs = [_file(tmp_path, "a.npy", [1, 2, 3, 0, 4, 0, 5, 6, 7, 8, 9, 0])]
    cache = str(tmp_path / "cache")
    a = PackedDataset(fs, 8, eos_token_id=0, pad_token_id=-1, cache_dir=cache)
    stored = list((tmp_path / "cache").glob("*.npy"))  # (a local create-only write keeps a .lock beside)
    assert len(stored) == 1
    b = PackedDataset(fs, 8, eos_token_id=0, pad_token_id=-1, cache_dir=cache)
    assert [b.instance(i)[0].tolist() for i in range(len(b))] == [
        a.instance(i)[0].tolist() for i in range(len(a))
    ]


def test_packed_needs_a_power_of_two_and_fingerprint_names_packing(tmp_path):
    fs = [_file(tmp_path, "a.npy", [1, 2, 0])]
    with pytest.raises(BadInput, match="power of two"):
        PackedDataset(fs, 12, eos_token_id=0, pad_token_id=-1)
    fp = PackedDataset(fs, 8, eos_token_id=0, pad_token_id=-1, source_group_size=8).fingerprint(1)
    assert ":packed=g8:" in fp
    assert fp != PackedDataset(fs, 8, eos_token_id=0, pad_token_id=-1).fingerprint(1)


def test_only_the_builder_packs_and_the_others_wait_and_read(tmp_path):
    """Host 0 (`build=True`) packs and stores each group with a create-only write; another host
    (`build=False`) waits for the objects and reads them, never the source files; a second builder
    finds them stored and rewrites nothing."""
    import threading
    import time

    rng = np.random.default_rng(1)
    fs = []
    for j in range(4):
        docs = [np.append(rng.integers(1, 50, int(n)), 0) for n in rng.integers(1, 40, 20)]
        fs.append(_file(tmp_path, f"{j}.npy", np.concatenate(docs)))
    cache = tmp_path / "packing"
    got: dict = {}
    beats: list[float] = []

    def other_host():
        got["ds"] = PackedDataset(
            fs,
            64,
            eos_token_id=0,
            pad_token_id=99,
            source_group_size=2,
            cache_dir=str(cache),
            build=False,
            progress=lambda: beats.append(time.monotonic()),
            poll_s=0.05,
        )

    t = threading.Thread(target=other_host)
    t.start()
    time.sleep(0.3)  # the other host waits: nothing is stored yet
    assert "ds" not in got and beats
    host0 = PackedDataset(fs, 64, eos_token_id=0, pad_token_id=99, source_group_size=2, cache_dir=str(cache))
    t.join(10)
    other = got["ds"]
    stored = sorted(cache.glob("*.npy"))
    assert len(stored) == 2  # one object per group
    assert host0.bytes_read == sum(f.size for f in fs)  # the builder read every source file once
    assert other.bytes_read == sum(p.stat().st_size for p in stored)  # the other: only the packing
    assert [other.instance(i)[0].tolist() for i in range(len(other))] == [
        host0.instance(i)[0].tolist() for i in range(len(host0))
    ]
    mtimes = [p.stat().st_mtime_ns for p in stored]
    again = PackedDataset(fs, 64, eos_token_id=0, pad_token_id=99, source_group_size=2, cache_dir=str(cache))
    assert again.bytes_read == other.bytes_read and [p.stat().st_mtime_ns for p in stored] == mtimes


def test_a_host_waiting_for_a_packing_that_never_comes_exits_3(tmp_path):
    from olmo_ctl.core.errors import OlmoCtlError

    fs = [_file(tmp_path, "a.npy", [1, 2, 3, 0, 4, 0])]
    with pytest.raises(OlmoCtlError) as e:
        PackedDataset(
            fs,
            8,
            eos_token_id=0,
            pad_token_id=-1,
            cache_dir=str(tmp_path / "c"),
            build=False,
            wait_s=0.2,
            poll_s=0.05,
        )
    assert e.value.exit_code == 3 and "host 0 stored no packing of source group 0" in str(e.value)
