"""`olmo-ctl data prepare`: byte-tokenized text and copied token files, a held-out split, local and gs://."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from olmo_ctl import storage
from olmo_ctl.cli import main
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.data.files import BYTE_EOS, resolve_files
from olmo_ctl.trainer.data import make_train_loader


def _texts(tmp_path, n=10, size=3000):
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        words = rng.choice(["alpha", "beta", "gamma", "delta", "\n", "é"], size=size // 5)
        p = tmp_path / "in" / f"doc-{i:02d}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"document {i}\n" + " ".join(words))
        paths.append(str(p))
    return paths


def _tokens(path: str) -> np.ndarray:
    return np.frombuffer(storage.store_for(path).read_bytes(path), dtype="<u4")


def test_text_becomes_byte_tokens_with_whole_documents_held_out(tmp_path, capsys):
    docs = _texts(tmp_path)
    out = tmp_path / "out"
    rc = main(["data", "prepare", *docs, "--out", str(out), "--held-out-fraction", "0.2", "--seq-len", "64"])
    assert rc == 0
    printed = capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        manifest["tokenizer"] == "bytes" and manifest["vocab_size"] == 258 and manifest["eos_token_id"] == 256
    )
    # 2 of 10 documents held out, evenly spaced; the rest in train, in order.
    assert manifest["sources"]["eval"] == [docs[2], docs[7]]
    assert manifest["sources"]["train"] == [d for i, d in enumerate(docs) if i not in (2, 7)]
    for split in ("train", "eval"):
        stream = np.concatenate([_tokens(str(out / e["path"])) for e in manifest[split]])
        want = b"".join(open(d, "rb").read() + b"\x00" for d in manifest["sources"][split])
        want_tokens = np.frombuffer(want, np.uint8).astype(np.uint32)
        want_tokens[np.cumsum([os.path.getsize(d) + 1 for d in manifest["sources"][split]]) - 1] = BYTE_EOS
        assert (stream == want_tokens).all()
        assert manifest[f"{split}_tokens"] == len(stream)
        assert manifest[f"{split}_instances"] == sum(e["tokens"] // 64 for e in manifest[split])
        assert f"{split}: {len(stream):,} tokens" in printed


def test_parts_are_cut_at_multiples_of_seq_len(tmp_path):
    from olmo_ctl.data.files import prepare

    docs = _texts(tmp_path, n=3, size=5000)
    m = prepare(docs, str(tmp_path / "out"), held_out_fraction=0, seq_len=100, part_tokens=1050)
    sizes = [e["tokens"] for e in m["train"]]
    assert all(s == 1000 for s in sizes[:-1]) and 0 < sizes[-1] <= 1000
    assert m["eval"] == [] and m["train_instances"] == sum(sizes) // 100


def test_few_documents_hold_out_the_stream_tail(tmp_path):
    docs = _texts(tmp_path, n=2, size=4000)
    out = tmp_path / "out"
    assert (
        main(["data", "prepare", *docs, "--out", str(out), "--held-out-fraction", "0.05", "--seq-len", "128"])
        == 0
    )
    m = json.loads((out / "manifest.json").read_text())
    total = m["train_tokens"] + m["eval_tokens"]
    assert m["eval_tokens"] % 128 == 0 and m["eval_tokens"] >= 0.05 * total
    assert m["eval_tokens"] < 0.05 * total + 128
    assert m["sources"]["eval"] == [docs[1]]


def test_token_files_are_copied_as_they_are(tmp_path):
    raw = []
    for i in range(4):
        p = tmp_path / "tok" / f"shard-{i}.npy"
        p.parent.mkdir(parents=True, exist_ok=True)
        np.arange(i * 1000, i * 1000 + 300 + i, dtype="<u4").tofile(p)
        raw.append(str(p))
    header = tmp_path / "tok" / "with-header.npy"
    np.save(header, np.arange(50, dtype=np.int64).reshape(5, 10))
    out = tmp_path / "out"
    assert main(["data", "prepare", *raw, str(header), "--out", str(out), "--held-out-fraction", "0.2"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["sources"]["eval"] == [raw[2]]
    assert [e["path"] for e in m["train"]] == [f"train/part-0000{i}.npy" for i in range(4)]
    for src, entry in zip(m["sources"]["train"], m["train"], strict=True):
        got = (out / entry["path"]).read_bytes()
        if src.endswith("with-header.npy"):
            assert (np.frombuffer(got, "<u4") == np.arange(50)).all()  # converted to raw uint32
        else:
            assert got == open(src, "rb").read()  # byte for byte
    assert (out / "eval" / "part-00000.npy").read_bytes() == open(raw[2], "rb").read()


def test_mistakes_exit_2_with_one_line(tmp_path):
    docs = _texts(tmp_path, n=2)
    tok = tmp_path / "t.npy"
    np.arange(10, dtype="<u4").tofile(tok)
    env = dict(os.environ)
    cases = [
        ([*docs, str(tok)], "both text files and .npy token files"),
        ([str(tmp_path / "missing.txt")], "does not exist"),
        ([str(tok)], "1 token file cannot be split 95% / 5% by whole files"),
        ([str(tok), str(tok), str(tok)], "hold out one whole file with --held-out-fraction 0.33"),
        ([*docs, "--held-out-fraction", "1.5"], "--held-out-fraction must be in [0, 1)"),
    ]
    for args, msg in cases:
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                "from olmo_ctl.cli import entry; entry()",
                "data",
                "prepare",
                *args,
                "--out",
                str(tmp_path / "o"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith("error: ") and msg in r.stderr and r.stderr.count("\n") == 1
        assert "Traceback" not in r.stderr
    # An output directory that already holds data is refused (stale parts would be mixed in).
    assert main(["data", "prepare", *docs, "--out", str(tmp_path / "full")]) == 0
    assert main(["data", "prepare", docs[0], "--out", str(tmp_path / "full")]) == 2


@pytest.mark.gcs
def test_gs_out_is_trainable(tmp_path, gcs):
    gcs.new_bucket("olmo-data")
    docs = _texts(tmp_path, n=20, size=4000)
    assert main(["data", "prepare", *docs, "--out", "gs://olmo-data/text", "--seq-len", "128"]) == 0
    m = json.loads(storage.store_for("gs://olmo-data/x").read_text("gs://olmo-data/text/manifest.json"))
    assert len(m["sources"]["eval"]) == 1
    r = load_recipe("smoke", overrides=["data.root=gs://olmo-data/text"])
    assert [f.name for f in resolve_files(r, "eval")] == ["eval/part-00000.npy"]
    with make_train_loader(r) as loader:
        b = loader.next()
    assert b["input_ids"].shape == (8, 128)
    local = tmp_path / "local"
    assert main(["data", "prepare", *docs, "--out", str(local), "--seq-len", "128"]) == 0
    r2 = load_recipe("smoke", overrides=[f"data.root={local}"])
    with make_train_loader(r2) as loader2:
        assert loader2.fingerprint == loader.fingerprint
        assert (loader2.next()["input_ids"] == b["input_ids"]).all()


def test_data_info_reports_what_the_trainer_will_read(tmp_path, capsys):
    docs = _texts(tmp_path, n=20, size=4000)
    out = tmp_path / "out"
    assert main(["data", "prepare", *docs, "--out", str(out), "--seq-len", "128"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    capsys.readouterr()
    assert main(["data", "info", "--recipe", "smoke", "--set", f"data.root={out}", "-o", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["train_instances"] == m["train_instances"] and d["eval_instances"] == m["eval_instances"]
    assert d["batches_per_epoch"] == m["train_instances"] // 8
    with make_train_loader(load_recipe("smoke", overrides=[f"data.root={out}"])) as loader:
        assert d["fingerprint"] == loader.fingerprint and d["batches_per_epoch"] == loader.batches_per_epoch
    assert main(["data", "info", "--recipe", "smoke", "--set", f"data.root={tmp_path / 'nothing'}"]) == 2
