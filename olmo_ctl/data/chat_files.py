"""`olmo-ctl data prepare --kind sft|preference|prompts`: JSONL conversations to open-instruct's numpy files.

Reads JSONL (or .jsonl.gz), local or gs://, one record a line, in AI2's datasets' layout: `messages` (a list
of {role, content}) for sft and prompts, `chosen` and `rejected` for preference pairs, `ground_truth` and
`dataset` beside the prompts' `messages` as the RLVR mixes hold them. Tokenizes with data/chat.py and writes,
under OUT (local or gs://), with `manifest.json` last:

- sft: open-instruct's `open_instruct/numpy_dataset_conversion.py` layout, the one OLMo-core's SFT reads:
  `token_ids_part_NNNN.npy` (raw token ids, no header, the smallest unsigned type holding the vocabulary:
  `_select_token_dtype`), `labels_mask_part_NNNN.npy` (raw bool, True = trained on) and
  `token_ids_part_NNNN.csv.gz` (each document's `start,end` within the part: OLMo-core's
  `iter_document_indices` reads it for a remote file). Documents follow one another; each begins with BOS
  (= EOS) when add_bos and ends with EOS unless truncated. A part holds at most 1 GiB of token ids
  (`max_size_gb=1`), cut between documents;
- preference: the same layout under `chosen/` and `rejected/`, document i of each side one pair;
- prompts: `prompts.jsonl`, one {"input_ids_prompt", "ground_truth", "dataset"} a line.

Every line is checked and tokenized before anything is written: a bad line is a BadInput naming FILE:LINE.
`read_chat_data` reads any of them back through the manifest.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from olmo_ctl import storage
from olmo_ctl.core.errors import BadInput
from olmo_ctl.data import chat
from olmo_ctl.data.tokenizer import BYTES_TOKENIZER

KINDS = ("sft", "preference", "prompts")
PART_BYTES = 1 << 30  # open-instruct's max_size_gb=1 per token_ids part
BATCH = 256  # conversations tokenized together
MANIFEST = "manifest.json"
PROGRESS_MIN_BYTES = 1 << 20  # inputs smaller than this finish before a bar would be worth drawing


# ---------------------------------------------------------------- a progress bar on stderr


class Progress:
    """`prepare: 42% |████      | 1,234 conversations, 12.0 MB of 28.6 MB` on a terminal's stderr, redrawn
    at most 5 times a second, then erased; nothing off a terminal or for a small input."""

    def __init__(self, total_bytes: int, what: str, stream: Any = None, force: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.on = force if force is not None else tty and total_bytes >= PROGRESS_MIN_BYTES
        self.total, self.what = max(total_bytes, 1), what
        self.done, self.count, self._last, self._width = 0, 0, 0.0, 0

    def update(self, nbytes: int, count: int) -> None:
        self.done += nbytes
        self.count += count
        now = time.monotonic()
        if self.on and (now - self._last >= 0.2 or self.done >= self.total):
            self._last = now
            frac = min(1.0, self.done / self.total)
            bar = "█" * int(frac * 20)
            line = (
                f"prepare: {frac:4.0%} |{bar:<20}| {self.count:,} {self.what}, "
                f"{self.done / 1e6:.1f} MB of {self.total / 1e6:.1f} MB"
            )
            self._width = max(self._width, len(line))
            self.stream.write("\r" + line.ljust(self._width))
            self.stream.flush()

    def close(self) -> None:
        if self.on and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()


# ---------------------------------------------------------------- reading JSONL


def _stat(path: str) -> int:
    if storage.is_gcs(path):
        info = storage.store_for(path).stat(path)
        if info is None:
            raise BadInput(f"`{path}` does not exist", "pass JSONL files of conversations")
        return info.size
    if os.path.isdir(path):
        raise BadInput(f"`{path}` is a directory", "pass JSONL files of conversations, not directories")
    if not os.path.isfile(path):
        raise BadInput(f"`{path}` does not exist", "pass JSONL files of conversations")
    return os.path.getsize(path)


def iter_lines(path: str) -> Iterator[tuple[int, int, Any]]:
    """(line number, bytes, parsed JSON object) of each non-blank line of a JSONL (.gz) file."""
    data = storage.store_for(path).read_bytes(path)
    if path.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise BadInput(f"{path}: not a gzip file ({e})") from None
    for n, raw in enumerate(io.BytesIO(data), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadInput(f"{path}:{n}: not JSON ({e})", "one JSON object a line (JSONL)") from None
        if not isinstance(obj, dict):
            raise BadInput(
                f"{path}:{n}: a JSON {type(obj).__name__}, not an object", "one JSON object a line"
            )
        yield n, len(raw), obj


def check_record(obj: dict, kind: str, template: str) -> None:
    """ValueError naming what a record of `kind` lacks."""
    if kind == "preference":
        for key in ("chosen", "rejected"):
            if key not in obj:
                raise ValueError(f"no `{key}` (a preference pair has `chosen` and `rejected` messages)")
            chat.check_messages(obj[key], template, key)
        return
    if "messages" not in obj:
        raise ValueError("no `messages`")
    chat.check_messages(obj["messages"], template)
    if kind == "prompts":
        for key in ("ground_truth", "dataset"):
            if key not in obj:
                raise ValueError(f"no `{key}` (RLVR prompts carry `ground_truth` and `dataset`)")


# ---------------------------------------------------------------- collecting documents


@dataclass
class _Side:
    """The documents of one output directory (sft, or one side of the pairs), in order."""

    ids: list[np.ndarray] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self.ids.append(ids)
        self.masks.append(mask)

    @property
    def tokens(self) -> int:
        return sum(len(a) for a in self.ids)

    @property
    def trainable(self) -> int:
        return sum(int(m.sum()) for m in self.masks)

    def max_id(self) -> int:
        return max((int(a.max()) for a in self.ids if len(a)), default=0)


def _part_ranges(lengths: list[int], part_tokens: int) -> list[tuple[int, int]]:
    """Documents [i, j) of each part: as many whole documents as fit in `part_tokens` (one at least)."""
    out, i, size = [], 0, 0
    for j, n in enumerate(lengths):
        if j > i and size + n > part_tokens:
            out.append((i, j))
            i, size = j, 0
        size += n
    if i < len(lengths):
        out.append((i, len(lengths)))
    return out


def _write(path: str, data: bytes) -> None:
    from olmo_ctl.data.files import _write as write_file

    write_file(path, data)


def _write_side(out: str, side: _Side, dtype: np.dtype, part_bytes: int) -> list[dict]:
    """token_ids_part_NNNN.npy, labels_mask_part_NNNN.npy and token_ids_part_NNNN.csv.gz under `out`."""
    parts = []
    lengths = [len(a) for a in side.ids]
    for k, (i, j) in enumerate(_part_ranges(lengths, max(1, part_bytes // dtype.itemsize))):
        ids = np.concatenate(side.ids[i:j]).astype(dtype) if j > i else np.zeros(0, dtype)
        mask = np.concatenate(side.masks[i:j]).astype(np.bool_) if j > i else np.zeros(0, np.bool_)
        ends = np.cumsum(lengths[i:j])
        starts = ends - np.asarray(lengths[i:j], dtype=np.int64)
        csv = "".join(f"{s},{e}\n" for s, e in zip(starts.tolist(), ends.tolist(), strict=True))
        names = {
            "token_ids": f"token_ids_part_{k:04d}.npy",
            "labels_mask": f"labels_mask_part_{k:04d}.npy",
            "boundaries": f"token_ids_part_{k:04d}.csv.gz",
        }
        _write(storage.join(out, names["token_ids"]), ids.tobytes())
        _write(storage.join(out, names["labels_mask"]), mask.tobytes())
        _write(storage.join(out, names["boundaries"]), gzip.compress(csv.encode(), mtime=0))
        parts.append(
            {**names, "tokens": int(len(ids)), "documents": j - i, "trainable_tokens": int(mask.sum())}
        )
    return parts


def _check_out(out: str) -> None:
    from olmo_ctl.data.files import _check_out_dir

    _check_out_dir(out)
    store = storage.store_for(out)
    files, dirs = (
        store.list(out, recursive=False) if (storage.is_gcs(out) or os.path.isdir(out)) else ([], [])
    )
    taken = [
        os.path.basename(f.path.rstrip("/"))
        for f in files
        if os.path.basename(f.path).startswith(
            ("token_ids_part_", "labels_mask_part_", "prompts.jsonl", MANIFEST)
        )
    ]
    taken += [
        d.rstrip("/").rsplit("/", 1)[-1]
        for d in dirs
        if d.rstrip("/").rsplit("/", 1)[-1] in ("chosen", "rejected")
    ]
    if taken:
        raise BadInput(
            f"`{out}` already holds {taken[0]}",
            "choose an empty --out directory (old part files would be mixed in)",
        )


# ---------------------------------------------------------------- prepare


def prepare_chat(
    inputs: list[str],
    out: str,
    kind: str = "sft",
    template: str = "tulu",
    max_seq_length: int = 4096,
    add_bos: bool | None = None,
    tokenizer: str = BYTES_TOKENIZER,
    eos_token_id: int | None = None,
    model: Any = None,
    part_bytes: int = PART_BYTES,
    progress: Progress | None = None,
) -> dict:
    """Tokenize JSONL conversations of `kind` and write them under `out`; returns the manifest.

    `max_seq_length` (0: none) truncates sft and preference sequences as open-instruct does, and drops
    prompts longer than it (rlvr_filter_v1's max_prompt_token_length). `add_bos` None: the template's
    AI2 default (tulu: BOS; olmo: none). Conversations left without a label (and pairs with a side without
    one) are dropped and counted, as open-instruct's filters do.
    """
    if kind not in KINDS:
        raise BadInput(f"--kind {kind!r}: one of text, {', '.join(KINDS)}")
    if template not in chat.TEMPLATES:
        raise BadInput(f"--chat-template {template!r}: one of {', '.join(chat.TEMPLATES)}")
    if max_seq_length < 0:
        raise BadInput(f"--max-seq-length must be >= 0, got {max_seq_length}")
    if not inputs:
        raise BadInput("no input files given", "pass JSONL files of conversations")
    if add_bos is None:
        add_bos = chat.DEFAULT_ADD_BOS[template]
    sizes = [_stat(p) for p in inputs]
    tok = chat.chat_tokenizer(tokenizer, eos_token_id, model)
    _check_out(out)
    max_len = max_seq_length or None
    dtype = chat.token_dtype(tok.vocab_size)
    prog = progress or Progress(sum(sizes), "prompts" if kind == "prompts" else "conversations")

    sides = {name: _Side() for name in (("chosen", "rejected") if kind == "preference" else ("sft",))}
    prompts: list[dict] = []
    counts = {"records": 0, "dropped_no_labels": 0, "dropped_too_long": 0, "truncated": 0}
    batch: list[tuple[str, dict]] = []

    def flush() -> None:
        if kind == "prompts":
            ids_list = chat.encode_prompt_batch([o["messages"] for _, o in batch], tok, add_bos, template)
            for (_, o), pids in zip(batch, ids_list, strict=True):
                if max_len and len(pids) > max_len:
                    counts["dropped_too_long"] += 1
                    continue
                prompts.append(
                    {"input_ids_prompt": pids, "ground_truth": o["ground_truth"], "dataset": o["dataset"]}
                )
        else:
            keys = ("chosen", "rejected") if kind == "preference" else ("messages",)
            convs = [o[k] for _, o in batch for k in keys]
            enc, full = chat.encode_sft_batch_with_lengths(convs, tok, max_len, add_bos, template)
            w = len(keys)
            for b in range(len(batch)):
                rows = enc[b * w : (b + 1) * w]
                if not all(chat.has_labels(m) for _, m in rows):
                    counts["dropped_no_labels"] += 1
                    continue
                counts["truncated"] += sum(1 for n in full[b * w : (b + 1) * w] if max_len and n > max_len)
                for side, (ids, mask) in zip(sides.values(), rows, strict=True):
                    side.add(ids.astype(dtype), mask)
        batch.clear()

    try:
        for path in inputs:
            for n, nbytes, obj in iter_lines(path):
                try:
                    check_record(obj, kind, template)
                except ValueError as e:
                    raise BadInput(f"{path}:{n}: {e}", _hint(kind)) from None
                batch.append((f"{path}:{n}", obj))
                counts["records"] += 1
                prog.update(nbytes, 1)
                if len(batch) >= BATCH:
                    flush()
        flush()
    finally:
        prog.close()

    kept = len(prompts) if kind == "prompts" else len(next(iter(sides.values())).ids)
    if not kept:  # nothing written: an empty data set is a mistake, not a result
        dropped = counts["dropped_no_labels"] + counts["dropped_too_long"]
        raise BadInput(
            f"nothing to write: {counts['records']} records read, {dropped} dropped"
            f" ({counts['dropped_no_labels']} with no assistant token left to train,"
            f" {counts['dropped_too_long']} longer than --max-seq-length)",
            "check the input files, --max-seq-length and --kind",
        )
    manifest: dict[str, Any] = {
        "kind": kind,
        "chat_template": template,
        "template_source": chat.TEMPLATE_SOURCES[template],
        "add_bos": add_bos,
        "max_seq_length": max_seq_length,
        "tokenizer": "bytes" if tokenizer == BYTES_TOKENIZER else tokenizer,
        "vocab_size": tok.vocab_size,
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.eos_token_id,
        "sources": list(inputs),
        "records": counts["records"],
    }
    top = max(
        [s.max_id() for s in sides.values()] + [max(p["input_ids_prompt"], default=0) for p in prompts] + [0]
    )
    if tok.model_vocab_size is not None and top >= tok.model_vocab_size:
        raise BadInput(
            f"the conversations tokenize to id {top}, beyond the recipe's model.vocab_size {tok.model_vocab_size}",
            "pass the model's tokenizer, or the recipe the data is for",
        )
    if kind == "prompts":
        body = "".join(json.dumps(p, separators=(",", ":")) + "\n" for p in prompts)
        _write(storage.join(out, "prompts.jsonl"), body.encode())
        manifest.update(
            {
                "format": "prompts.jsonl: one {input_ids_prompt, ground_truth, dataset} a line (rlvr_tokenize_v1)",
                "file": "prompts.jsonl",
                "prompts": len(prompts),
                "prompt_tokens": sum(len(p["input_ids_prompt"]) for p in prompts),
                "dropped_too_long": counts["dropped_too_long"],
            }
        )
    else:
        manifest.update(
            {
                "format": "open-instruct numpy (OLMo-core SFT): token_ids_part_NNNN.npy raw "
                f"{dtype.name}, labels_mask_part_NNNN.npy raw bool, token_ids_part_NNNN.csv.gz start,end",
                "token_dtype": dtype.name,
                "documents": len(next(iter(sides.values())).ids),
                "dropped_no_labels": counts["dropped_no_labels"],
                "truncated": counts["truncated"],
            }
        )
        for name, side in sides.items():
            where = out if kind == "sft" else storage.join(out, name)
            entry = {
                "dir": "" if kind == "sft" else name,
                "tokens": side.tokens,
                "trainable_tokens": side.trainable,
                "parts": _write_side(where, side, dtype, part_bytes),
            }
            if kind == "sft":
                manifest.update({k: v for k, v in entry.items() if k != "dir"})
            else:
                manifest[name] = entry
        if kind == "preference":
            manifest["pairs"] = manifest.pop("documents")
    _write(storage.join(out, MANIFEST), (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


def _hint(kind: str) -> str:
    if kind == "preference":
        return 'each line: {"chosen": [{"role": ..., "content": ...}, ...], "rejected": [...]}'
    if kind == "prompts":
        return (
            'each line: {"messages": [{"role": "user", "content": ...}], "ground_truth": ..., "dataset": ...}'
        )
    return 'each line: {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}'


# ---------------------------------------------------------------- reading back


def _read_side(base: str, parts: list[dict], dtype: np.dtype) -> list[tuple[np.ndarray, np.ndarray]]:
    store = storage.store_for(base)
    docs = []
    for p in parts:
        ids = np.frombuffer(store.read_bytes(storage.join(base, p["token_ids"])), dtype=dtype)
        mask = np.frombuffer(store.read_bytes(storage.join(base, p["labels_mask"])), dtype=np.bool_)
        if len(ids) != len(mask):
            raise BadInput(
                f"`{storage.join(base, p['token_ids'])}`: {len(ids)} tokens but {len(mask)} labels"
            )
        csv = gzip.decompress(store.read_bytes(storage.join(base, p["boundaries"]))).decode()
        for line in csv.splitlines():
            s, e = (int(x) for x in line.split(",")[:2])
            docs.append((ids[s:e], mask[s:e]))
    return docs


def read_chat_data(out: str) -> tuple[dict, list]:
    """(manifest, records) of what `prepare_chat` wrote: sft [(ids, mask)], preference [((ids, mask), (ids,
    mask))], prompts [{input_ids_prompt, ground_truth, dataset}]."""
    store = storage.store_for(out)
    manifest = json.loads(store.read_bytes(storage.join(out, MANIFEST)))
    kind = manifest.get("kind")
    if kind == "prompts":
        lines = store.read_bytes(storage.join(out, manifest["file"])).decode().splitlines()
        return manifest, [json.loads(x) for x in lines if x.strip()]
    dtype = np.dtype(manifest["token_dtype"])
    if kind == "sft":
        return manifest, _read_side(out, manifest["parts"], dtype)
    if kind == "preference":
        chosen = _read_side(storage.join(out, "chosen"), manifest["chosen"]["parts"], dtype)
        rejected = _read_side(storage.join(out, "rejected"), manifest["rejected"]["parts"], dtype)
        return manifest, list(zip(chosen, rejected, strict=True))
    raise BadInput(f"`{storage.join(out, MANIFEST)}` is not a chat data manifest (kind {kind!r})")
