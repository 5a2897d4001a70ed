"""Training data pipeline: FSL instances, PCG64 order, one-place sharding, exact resume, fingerprint, gs://."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from olmo_ctl import storage
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.data import files as datafiles
from olmo_ctl.data.files import check_fingerprint, dataset_fingerprint, resolve_paths
from olmo_ctl.trainer.data import (
    IGNORE_INDEX,
    BatchLoader,
    TokenDataset,
    epoch_order,
    eval_batches,
    make_train_loader,
)
from olmo_ctl.trainer.repetition import has_repetition

T = 16


def _write_tokens(path, tokens) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.asarray(tokens, dtype="<u4").tofile(path)
    return str(path)


def _corpus(tmp_path, lengths=(35, 16, 47, 200, 161)):
    """Token files whose token values encode (file, position): file f holds f*10000 + arange(len)."""
    paths = []
    for f, n in enumerate(lengths):
        paths.append(_write_tokens(tmp_path / "data" / f"part-{f}.npy", f * 10000 + np.arange(n)))
    return paths


# ---------------------------------------------------------------- instances


def test_each_file_cut_alone_and_remainder_dropped(tmp_path):
    paths = _corpus(tmp_path)
    ds = TokenDataset(paths, T)
    assert ds.instances_per_file.tolist() == [2, 1, 2, 12, 10]
    assert len(ds) == 27
    # Instance 2 is the first of file 1 (file 0's 3 leftover tokens are not glued to it).
    assert ds.tokens(2).tolist() == (10000 + np.arange(T)).tolist()
    assert ds.tokens(4).tolist() == (20000 + np.arange(T, 2 * T)).tolist()
    # No instance ever holds a token from a file's dropped remainder.
    seen = np.concatenate([ds.tokens(i) for i in range(len(ds))])
    for f, n in enumerate((35, 16, 47, 200, 161)):
        pos = seen[(seen >= f * 10000) & (seen < f * 10000 + 10000)] - f * 10000
        assert pos.max() == n // T * T - 1
        assert sorted(pos.tolist()) == list(range(n // T * T))


def test_labels_are_inputs_shifted_left_last_ignored(tmp_path):
    ds = TokenDataset(_corpus(tmp_path), T)
    for i in (0, 3, 26):
        ids, labels = ds.instance(i)
        assert ids.dtype == np.int32 and labels.dtype == np.int32 and ids.shape == labels.shape == (T,)
        assert (labels[:-1] == ids[1:]).all()
        assert labels[-1] == IGNORE_INDEX
        assert (ids == ds.tokens(i)).all()


def test_token_ids_outside_the_vocab_are_refused(tmp_path):
    ds = TokenDataset(_corpus(tmp_path), T, vocab_size=100)
    assert ds.instance(0)[0].max() == T - 1  # file 0 holds ids below 100
    with pytest.raises(BadInput, match="holds token id 10015, outside the model's vocab"):
        ds.instance(2)


# ---------------------------------------------------------------- order and sharding


@pytest.mark.parametrize("n,seed,epoch", [(1, 0, 1), (27, 7, 1), (1000, 34521, 3)])
def test_order_is_pcg64_of_seed_plus_epoch(n, seed, epoch):
    # Reconstructed here from the documented rule, independently of the implementation.
    expected = np.random.Generator(np.random.PCG64(seed + epoch)).permutation(n)
    olmo_core = np.arange(n)
    np.random.Generator(np.random.PCG64(seed + epoch)).shuffle(olmo_core)
    assert (expected == olmo_core).all()
    got = epoch_order(n, seed, epoch, global_batch=4)
    assert got.tolist() == expected[: n // 4 * 4].tolist()


def test_loader_order_matches_rule_across_epochs(tmp_path):
    ds = TokenDataset(_corpus(tmp_path), T)
    seed, gb = 11, 4
    loader = BatchLoader(ds, gb, seed)
    bpe = len(ds) // gb  # 6 batches; 3 instances of each epoch are never used
    got = [loader.next()["instance_ids"].tolist() for _ in range(2 * bpe + 1)]
    for e in (1, 2):
        perm = np.random.Generator(np.random.PCG64(seed + e)).permutation(len(ds))
        for b in range(bpe):
            assert got[(e - 1) * bpe + b] == perm[b * gb : (b + 1) * gb].tolist()
    perm3 = np.random.Generator(np.random.PCG64(seed + 3)).permutation(len(ds))
    assert got[-1] == perm3[:gb].tolist()
    assert loader.state()["epoch"] == 3 and loader.state()["batch_in_epoch"] == 1


def test_four_shards_read_every_instance_exactly_once_per_epoch(tmp_path):
    ds = TokenDataset(_corpus(tmp_path, lengths=(35, 16, 47, 200, 161, 1000)), T)
    gb, seed, shards = 8, 5, 4
    loaders = [BatchLoader(ds, gb, seed, p, shards) for p in range(shards)]
    single = BatchLoader(ds, gb, seed)
    bpe = single.batches_per_epoch
    ids = []
    for _ in range(bpe):
        parts = [ld.next() for ld in loaders]
        whole = single.next()
        for p, part in enumerate(parts):
            assert part["input_ids"].shape == (gb // shards, T)
            # Process p's rows are rows p*2..p*2+1 of the global batch: same ids, same tokens.
            rows = slice(p * gb // shards, (p + 1) * gb // shards)
            assert (part["instance_ids"] == whole["instance_ids"][rows]).all()
            assert (part["input_ids"] == whole["input_ids"][rows]).all()
            ids.extend(part["instance_ids"].tolist())
    counts = np.bincount(ids, minlength=len(ds))
    used = len(ds) // gb * gb
    assert len(ids) == used and counts.max() == 1  # nothing twice
    perm = np.random.Generator(np.random.PCG64(seed + 1)).permutation(len(ds))
    assert sorted(np.flatnonzero(counts == 0).tolist()) == sorted(
        perm[used:].tolist()
    )  # only the trimmed tail
    for ld in loaders:
        assert ld.state() == single.state() and ld.state()["epoch"] == 2


def test_global_batch_must_split_over_processes(tmp_path):
    ds = TokenDataset(_corpus(tmp_path), T)
    with pytest.raises(BadInput, match="multiple"):
        BatchLoader(ds, 6, 0, 0, 4)
    with pytest.raises(BadInput, match="fewer than one global batch"):
        BatchLoader(ds, 64, 0)


# ---------------------------------------------------------------- state and exact resume


@pytest.mark.parametrize("workers,buffer", [(0, 1), (2, 3)])
def test_restore_gives_identical_batches(tmp_path, workers, buffer):
    ds = TokenDataset(_corpus(tmp_path), T)
    ref = BatchLoader(ds, 4, 3, prefetch_workers=workers, prefetch_buffer=buffer)
    for _ in range(4):
        ref.next()
    saved = json.loads(json.dumps(ref.state()))  # what goes into the checkpoint
    assert saved["batches_seen"] == 4 and saved["batch_in_epoch"] == 4 and saved["tokens_seen"] == 4 * 4 * T
    expected = [ref.next() for _ in range(9)]  # crosses into epoch 2
    ref.close()
    for w, b in ((0, 1), (3, 2)):  # resume with other prefetch settings
        with BatchLoader(
            TokenDataset(_corpus(tmp_path), T), 4, 3, prefetch_workers=w, prefetch_buffer=b
        ) as ld:
            ld.next()  # a loader that already prefetched ahead must drop it on restore
            assert ld.restore(saved) is None
            assert ld.state() == saved
            for want in expected:
                got = ld.next()
                for k in want:
                    assert (got[k] == want[k]).all()


def test_state_counts_what_was_handed_out_not_prefetched(tmp_path):
    ds = TokenDataset(_corpus(tmp_path), T)
    with BatchLoader(ds, 4, 3, prefetch_workers=2, prefetch_buffer=4) as ld:
        ld.next()
        ld.next()
        st = ld.state()
        assert (st["epoch"], st["batch_in_epoch"], st["batches_seen"]) == (1, 2, 2)


# ---------------------------------------------------------------- fingerprint guard


def test_fingerprint_guard_names_what_changed(tmp_path):
    paths = _corpus(tmp_path)
    ld = BatchLoader(TokenDataset(paths, T), 4, 3)
    ld.next()
    saved = ld.state()
    extra = _write_tokens(tmp_path / "data" / "part-9.npy", np.arange(64))
    with pytest.raises(BadInput, match=r"number of token files 5 -> 6") as e:
        BatchLoader(TokenDataset(paths + [extra], T), 4, 3).restore(saved)
    assert "--allow-data-change" in e.value.one_line()
    with pytest.raises(BadInput, match=r"train.seq_len 16 -> 32"):
        BatchLoader(TokenDataset(paths, 2 * T), 4, 3).restore(saved)
    with pytest.raises(BadInput, match=r"data.seed 3 -> 4"):
        BatchLoader(TokenDataset(paths, T), 4, 4).restore(saved)
    # Same count and size, other file: still a change.
    swapped = [paths[1], paths[0]] + paths[2:]
    with pytest.raises(BadInput, match="names, order or sizes differ"):
        BatchLoader(TokenDataset(swapped, T), 4, 3).restore(saved)
    # Allowed: a message comes back and the loader continues from the saved position.
    changed = BatchLoader(TokenDataset(paths + [extra], T), 4, 3)
    note = changed.restore(saved, allow_data_change=True)
    assert "number of token files 5 -> 6" in note
    assert changed.state()["batches_seen"] == 1 and changed.state()["batch_in_epoch"] == 1
    assert check_fingerprint(saved["fingerprint"], ld.fingerprint) is None


def test_fingerprint_covers_names_sizes_seq_len_and_seed():
    base = dataset_fingerprint([("a.npy", 400), ("b.npy", 800)], 16, 1)
    assert base.startswith("v1:seq=16:seed=1:files=2:tokens=300:")
    assert base == dataset_fingerprint([("a.npy", 400), ("b.npy", 800)], 16, 1)
    others = [
        dataset_fingerprint([("a.npy", 400), ("b.npy", 804)], 16, 1),
        dataset_fingerprint([("a.npy", 400), ("c.npy", 800)], 16, 1),
        dataset_fingerprint([("b.npy", 800), ("a.npy", 400)], 16, 1),
        dataset_fingerprint([("a.npy", 400), ("b.npy", 800)], 32, 1),
        dataset_fingerprint([("a.npy", 400), ("b.npy", 800)], 16, 2),
    ]
    assert len({base, *others}) == 6


# ---------------------------------------------------------------- n-gram repetition filter


def test_repetition_detector_periods_and_threshold():
    rng = np.random.default_rng(0)
    noise = rng.integers(1000, 2000, size=600)
    for period in (1, 2, 7, 13):
        pattern = rng.integers(0, 50, size=period)
        for repeats, hit in ((32, True), (31, False)):
            x = noise.copy()
            x[100 : 100 + period * repeats] = np.tile(pattern, repeats)
            assert has_repetition(x) is hit, (period, repeats)
    x = rng.integers(1000, 2000, size=700)
    x[50 : 50 + 14 * 40] = np.arange(14).repeat(1)[np.arange(14 * 40) % 14]  # period 14 is beyond the filter
    assert not has_repetition(x)
    assert has_repetition(x, max_period=14)


def test_ngram_filter_masks_all_labels_and_is_off_by_default(tmp_path):
    rng = np.random.default_rng(1)
    clean = rng.integers(0, 200, size=256)
    rep = clean.copy()
    rep[10 : 10 + 3 * 32] = np.tile([5, 6, 7], 32)  # inside the first 128 tokens
    path = _write_tokens(tmp_path / "d" / "x.npy", np.concatenate([clean[:128], rep[:128], clean[128:]]))
    on = TokenDataset([path], 128, ngram_filter=True)
    b = on.batch([0, 1, 2])
    assert b["instance_mask"].tolist() == [True, False, True]
    assert (b["labels"][1] == IGNORE_INDEX).all() and (b["labels"][0] != IGNORE_INDEX).sum() == 127
    assert (b["input_ids"][1] == rep[:128]).all()  # inputs are kept; only the loss ignores them
    off = TokenDataset([path], 128)
    assert off.batch([1])["instance_mask"].tolist() == [True]
    assert (off.instance(1)[1] != IGNORE_INDEX).sum() == 127
    assert load_recipe("smoke").data.ngram_filter is False


# ---------------------------------------------------------------- files, globs, gs://


def test_globs_and_root_substitution(tmp_path):
    root = tmp_path / "mix"
    for rel in ("a/x-0.npy", "a/x-1.npy", "b/c/y-0.npy", "top.npy", "a/notes.txt"):
        _write_tokens(root / rel, np.arange(32))
    got = resolve_paths(["{root}/**/*.npy"], str(root))
    assert [f.name for f in got] == ["a/x-0.npy", "a/x-1.npy", "b/c/y-0.npy", "top.npy"]
    assert [f.name for f in resolve_paths(["{root}/*/*.npy"], str(root))] == ["a/x-0.npy", "a/x-1.npy"]
    # The recipe's order of entries is kept; repeats are dropped.
    got = resolve_paths(["{root}/top.npy", "{root}/a/*.npy", "{root}/top.npy"], str(root))
    assert [f.name for f in got] == ["top.npy", "a/x-0.npy", "a/x-1.npy"]
    with pytest.raises(BadInput, match="matches no file"):
        resolve_paths(["{root}/nothing/*.npy"], str(root))
    os.symlink(root / "b", root / "linked")  # symlinked data directories are followed
    assert [f.name for f in resolve_paths(["{root}/linked/**/*.npy"], str(root))] == ["linked/c/y-0.npy"]
    _write_tokens(root / "bad" / "odd.npy", np.arange(3))
    with open(root / "bad" / "odd.npy", "ab") as f:
        f.write(b"\x00")
    with pytest.raises(BadInput, match="not a whole number of uint32"):
        resolve_paths(["{root}/bad/*.npy"], str(root))


@pytest.mark.gcs
def test_gcs_files_read_like_local_ones(gcs, tmp_path):
    gcs.new_bucket("olmo-data")
    paths = _corpus(tmp_path)
    store = storage.store_for("gs://olmo-data/x")
    for i, p in enumerate(paths):
        with open(p, "rb") as f:
            store.write_bytes(f"gs://olmo-data/mix/src{i % 2}/{os.path.basename(p)}", f.read())
    remote = resolve_paths(["{root}/**/*.npy"], "gs://olmo-data/mix")
    assert [f.name for f in remote] == [
        "src0/part-0.npy",
        "src0/part-2.npy",
        "src0/part-4.npy",
        "src1/part-1.npy",
        "src1/part-3.npy",
    ]
    local_root = tmp_path / "copy"
    for f in remote:
        _write_tokens(local_root / f.name, np.frombuffer(store.read_bytes(f.path), "<u4"))
    local = resolve_paths(["{root}/**/*.npy"], str(local_root))
    # Names are relative to the root, so moving the data keeps the fingerprint.
    assert dataset_fingerprint(remote, T, 1) == dataset_fingerprint(local, T, 1)
    with BatchLoader(TokenDataset(remote, T), 4, 1, 1, 2, prefetch_workers=2) as r:
        lo = BatchLoader(TokenDataset(local, T), 4, 1, 1, 2)
        for _ in range(8):
            a, b = r.next(), lo.next()
            assert (a["input_ids"] == b["input_ids"]).all() and (a["labels"] == b["labels"]).all()


# ---------------------------------------------------------------- the built-in smoke data


def test_smoke_data_made_once_concurrently_and_deterministic(tmp_path):
    code = (
        "from olmo_ctl.data import files as d; import hashlib, pathlib; p = d.ensure_smoke_data(); "
        "print(hashlib.sha256(b''.join(f.read_bytes() for f in sorted(p.rglob('*.npy')))).hexdigest())"
    )
    digests = []
    for cache in ("c1", "c2"):
        env = dict(os.environ, OLMO_CTL_CACHE=str(tmp_path / cache))
        procs = [
            subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(3)
        ]
        outs = [p.communicate(timeout=60)[0].strip() for p in procs]
        assert all(p.returncode == 0 for p in procs)
        digests += outs
        leftovers = [n for n in os.listdir(tmp_path / cache / "smoke-data") if n.startswith(".")]
        assert leftovers == []
    assert len(set(digests)) == 1 and len(digests[0]) == 64


def test_smoke_recipe_data_is_big_enough_and_eval_is_fixed(tmp_path, monkeypatch):
    monkeypatch.setenv("OLMO_CTL_CACHE", str(tmp_path))
    r = load_recipe("smoke")
    loader = make_train_loader(r)
    assert loader.batches_per_epoch >= 300  # ~300 steps of 8 x 128 without repeating data
    b = loader.next()
    assert b["input_ids"].shape == (8, 128) and b["input_ids"].max() <= datafiles.BYTE_EOS
    assert (b["input_ids"] == datafiles.BYTE_EOS).sum() <= 8  # mostly text, a few document ends
    assert loader.fingerprint.startswith("v1:seq=128:seed=42:files=4:")
    assert [f.name for f in datafiles.resolve_files(r, "train")][0] == "train/part-00000.npy"
    e1, e2 = eval_batches(r, 2, 8), eval_batches(r, 2, 8)
    assert len(e1) == 2 and e1[0]["input_ids"].shape == (8, 128)
    assert all((x[k] == y[k]).all() for x, y in zip(e1, e2, strict=True) for k in x)
    train_ids = {bytes(loader.dataset.tokens(i)) for i in range(0, len(loader.dataset), 7)}
    assert not train_ids & {bytes(row.astype("<u4")) for b in e1 for row in b["input_ids"]}  # held out
    halves = [eval_batches(r, 2, 8, p, 2) for p in range(2)]
    for i in range(2):
        assert (
            np.concatenate([halves[0][i]["input_ids"], halves[1][i]["input_ids"]]) == e1[i]["input_ids"]
        ).all()


def test_resume_with_another_global_batch_continues_at_the_same_instance(tmp_path):
    ds = TokenDataset(_corpus(tmp_path, lengths=(35, 16, 47, 200, 161, 1000)), T)
    ld = BatchLoader(ds, 4, 9)
    for _ in range(3):
        ld.next()
    saved = ld.state()
    assert saved["global_batch"] == 4
    cont = ld.next()["instance_ids"].tolist()
    half = BatchLoader(ds, 2, 9)
    assert half.restore(saved) is None and half.state()["batch_in_epoch"] == 6
    assert half.next()["instance_ids"].tolist() + half.next()["instance_ids"].tolist() == cont
    double = BatchLoader(ds, 8, 9)
    with pytest.raises(BadInput, match="global batch changed from 4 to 8 at instance 12"):
        double.restore(saved)
    double.restore(saved, allow_data_change=True)
    assert double.state()["batch_in_epoch"] == 2  # skips ahead, never repeats


def test_many_files_with_few_open_maps(tmp_path, monkeypatch):
    from olmo_ctl.trainer import token_files

    monkeypatch.setattr(token_files, "MAX_OPEN_MAPS", 3)
    lengths = tuple(32 + f for f in range(12))
    ds = TokenDataset(_corpus(tmp_path, lengths=lengths), T)
    with BatchLoader(ds, 4, 0, prefetch_workers=3) as ld:
        for _ in range(ld.batches_per_epoch):
            b = ld.next()
            for i, row in zip(b["instance_ids"], b["input_ids"], strict=True):
                f, j = divmod(int(i), 2)
                assert (row == f * 10000 + np.arange(j * T, (j + 1) * T)).all()
    assert len(ds.token_files) <= 3


def test_a_failed_read_can_be_retried_from_the_same_batch(tmp_path):
    paths = _corpus(tmp_path)
    ds = TokenDataset(paths, T, vocab_size=10)  # every instance holds ids >= 10: reads fail
    with BatchLoader(ds, 4, 3, prefetch_workers=2) as ld:
        with pytest.raises(BadInput, match="outside the model's vocab"):
            while True:
                ld.next()
        before = ld.state()
        ds.vocab_size = None
        b = ld.next()
        ref = BatchLoader(TokenDataset(paths, T), 4, 3)
        ref.restore(before)
        assert (ref.next()["input_ids"] == b["input_ids"]).all()
