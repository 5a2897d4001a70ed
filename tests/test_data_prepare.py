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


# ---------------------------------------------------------------- a Hugging Face tokenizer (--tokenizer)

WORDS = ["the cat sat on the mat", "a dog ate the log by the mat", "hello world, said the cat"]


def _bpe_tokenizer(path):
    """A small real BPE tokenizer trained here, saved as tokenizer.json with `<|endoftext|>` among its
    special tokens and a post-processor that would add a BOS (which pre-training data leaves out)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]", "<|bos|>", "<|endoftext|>"]
    tok.train_from_iterator(
        WORDS * 3, trainers.BpeTrainer(vocab_size=80, special_tokens=specials, show_progress=False)
    )
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", bos)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


def _docs(tmp_path, texts):
    paths = []
    for i, t in enumerate(texts):
        p = tmp_path / "docs" / f"doc-{i}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(t)
        paths.append(str(p))
    return paths


def test_a_hugging_face_tokenizer_writes_each_documents_ids_then_eos(tmp_path, capsys, monkeypatch):
    import olmo_ctl.data.tokenizer as T

    monkeypatch.setattr(T, "BATCH_DOCS", 2)  # several encode_batch calls: the order is kept across them
    tok = _bpe_tokenizer(tmp_path / "tok" / "tokenizer.json")
    eos = tok.token_to_id("<|endoftext|>")
    texts = [*WORDS, "the mat sat on the cat", "a log by the dog"]
    docs = _docs(tmp_path, texts)
    out = tmp_path / "out"
    args = ["data", "prepare", *docs, "--out", str(out), "--held-out-fraction", "0"]
    assert main([*args, "--tokenizer", str(tmp_path / "tok" / "tokenizer.json"), "--eos-id", str(eos)]) == 0
    assert f"(EOS {eos})" in capsys.readouterr().out
    want = [i for t in texts for i in [*tok.encode(t, add_special_tokens=False).ids, eos]]
    assert tok.encode(texts[0]).ids[0] == tok.token_to_id("<|bos|>")  # the post-processor is left out
    m = json.loads((out / "manifest.json").read_text())
    assert [e["path"] for e in m["train"]] == ["train/part-00000.npy"] and m["eval"] == []
    assert _tokens(str(out / "train" / "part-00000.npy")).tolist() == want
    assert m["tokenizer"] == str(tmp_path / "tok" / "tokenizer.json")
    assert (m["eos_token_id"], m["vocab_size"], m["train_tokens"]) == (eos, tok.get_vocab_size(), len(want))
    # A directory holding tokenizer.json, the EOS and vocabulary from the recipe (smoke: EOS 256, vocab
    # 258), whole documents held out: the same ids, split by document.
    capsys.readouterr()
    tok2 = _bpe_tokenizer(tmp_path / "tok2" / "tokenizer.json")
    tok2.add_special_tokens([f"<|x{i}|>" for i in range(tok2.get_vocab_size(), 257)])
    assert tok2.token_to_id("<|x256|>") == 256
    tok2.save(str(tmp_path / "tok2" / "tokenizer.json"))
    out2 = tmp_path / "out2"
    rc = main(
        [
            "data",
            "prepare",
            *docs,
            "--out",
            str(out2),
            "--tokenizer",
            str(tmp_path / "tok2"),
            "--recipe",
            "smoke",
            "--held-out-fraction",
            "0.2",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    m2 = json.loads((out2 / "manifest.json").read_text())
    assert (m2["eos_token_id"], m2["pad_token_id"]) == (256, 257)
    assert m2["sources"]["eval"] == [docs[2]]
    for split in ("train", "eval"):
        got = np.concatenate([_tokens(str(out2 / e["path"])) for e in m2[split]]).tolist()
        srcs = m2["sources"][split]
        assert got == [
            i for d in srcs for i in [*tok2.encode(open(d).read(), add_special_tokens=False).ids, 256]
        ]


def test_the_byte_level_tokenizer_stays_the_default(tmp_path):
    docs = _texts(tmp_path, n=4, size=500)
    m1 = tmp_path / "default"
    m2 = tmp_path / "named"
    assert main(["data", "prepare", *docs, "--out", str(m1), "--held-out-fraction", "0"]) == 0
    args = ["--tokenizer", "builtin://bytes", "--recipe", "smoke"]
    assert main(["data", "prepare", *docs, "--out", str(m2), "--held-out-fraction", "0", *args]) == 0
    want = b"".join(open(d, "rb").read() + b"\x00" for d in docs)
    want_tokens = np.frombuffer(want, np.uint8).astype(np.uint32)
    want_tokens[np.cumsum([os.path.getsize(d) + 1 for d in docs]) - 1] = BYTE_EOS
    for out in (m1, m2):
        assert (_tokens(str(out / "train" / "part-00000.npy")) == want_tokens).all()
        m = json.loads((out / "manifest.json").read_text())
        assert (m["tokenizer"], m["vocab_size"], m["eos_token_id"], m["pad_token_id"]) == (
            "bytes",
            258,
            256,
            257,
        )


def test_tokenizer_mistakes_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, monkeypatch):
    tok = _bpe_tokenizer(tmp_path / "tok" / "tokenizer.json")
    tok_file = str(tmp_path / "tok" / "tokenizer.json")
    eos = str(tok.token_to_id("<|endoftext|>"))
    big = tmp_path / "big" / "tokenizer.json"  # EOS at 256, as the smoke model's, and a word at 300
    big.parent.mkdir()
    wl = {"[UNK]": 0, "the": 1, "cat": 2, "<|endoftext|>": 256, "mat": 300}
    from tokenizers import Tokenizer, models, pre_tokenizers

    t = Tokenizer(models.WordLevel(wl, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(big))
    docs = _docs(tmp_path, ["the cat", "the mat"])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "broken.json").write_text("{not json")
    cases = [
        (
            ["--tokenizer", str(tmp_path / "missing.json"), "--eos-id", eos],
            "no " + str(tmp_path / "missing.json"),
        ),
        (["--tokenizer", str(tmp_path / "nodir"), "--eos-id", eos], "nodir/tokenizer.json"),
        (
            ["--tokenizer", str(tmp_path / "broken.json"), "--eos-id", eos],
            "is not a Hugging Face tokenizer.json",
        ),
        (["--tokenizer", tok_file], "which token ends a document?"),
        (["--tokenizer", tok_file, "--eos-id", "5000"], "EOS 5000 is not a token of tokenizer"),
        (
            ["--tokenizer", str(big), "--recipe", "smoke"],
            "tokenizes to id 300, beyond the recipe's model.vocab_size 258",
        ),
        (["--tokenizer", str(big), "--recipe", "smoke", "--eos-id", "1"], "--eos-id 1 differs"),
        (["--stage", "1"], "builtin://bytes ends each document with 256, not 100257"),
        (
            ["--tokenizer", tok_file, "--eos-id", eos, str(tmp_path / "latin1.txt")],
            "latin1.txt` is not UTF-8 text",
        ),
    ]
    out = tmp_path / "out"
    for args, msg in cases:
        rc = main(["data", "prepare", *docs, "--out", str(out), "--held-out-fraction", "0", *args])
        err = capsys.readouterr().err
        assert rc == 2, (args, err)
        assert err.startswith("error: ") and msg in err and err.count("\n") == 1, (args, err)
        assert not out.exists(), args
    # Token files whose ids the recipe's model cannot embed are refused too.
    npy = tmp_path / "ids.npy"
    np.array([1, 2, 300], dtype="<u4").tofile(npy)
    assert (
        main(
            [
                "data",
                "prepare",
                str(npy),
                str(npy),
                "--out",
                str(out),
                "--recipe",
                "smoke",
                "--held-out-fraction",
                "0",
            ]
        )
        == 2
    )
    assert "holds id 300, beyond the recipe's model.vocab_size 258" in capsys.readouterr().err
    assert not out.exists()
    # Without the `tokenizers` package (the eval extra), one line says what to install.
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert main(["data", "prepare", *docs, "--out", str(out), "--tokenizer", tok_file, "--eos-id", eos]) == 2
    err = capsys.readouterr().err
    assert "needs the `tokenizers` package" in err and "'.[eval]'" in err and err.count("\n") == 1
    assert not out.exists()
