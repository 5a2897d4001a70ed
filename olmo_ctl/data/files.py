"""Which token files a recipe trains on, what they are called, and whether they changed.

A recipe names its data as a shipped mix (`data.mix`, AI2's ordered file lists, see data/mixes.py)
under a base directory, or as paths and globs (`{root}/**/*.npy`) on a local disk or gs://. This
module turns them into an ordered list of `TokenFile`s (path, logical name, size), computes the
dataset fingerprint that the checkpointed loader state carries, and writes token files: the
`olmo-ctl data prepare` conversion (text through data/tokenizer.py's byte-level or Hugging Face
tokenizer) and the built-in smoke dataset (`builtin://smoke`), which is made on first use from
source files that ship with Python itself.

Token files use OLMo-core's layout: raw little-endian uint32 tokens, no header, documents already
separated by EOS, usually named `*.npy`. numpy only: no jax here.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from olmo_ctl import storage
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.mixes import AI2_DATA_ROOT, DATA_ROOT_HINT
from olmo_ctl.data.tokenizer import BYTE_EOS as BYTE_EOS  # the byte-level tokenizer's EOS, for readers
from olmo_ctl.data.tokenizer import BYTES_TOKENIZER, document_tokenizer

# uint32 whatever the tokenizer: the bytes' 258 ids and dolma2's 100,278 alike (OLMo-core's dolma2 files).
TOKEN_DTYPE = np.dtype("<u4")
TOKEN_BYTES = 4
NUMPY_MAGIC = b"\x93NUMPY"

SMOKE_ROOT = "builtin://smoke"
SMOKE_VERSION = "v1"
# Fixed, ordered stdlib modules: text every Python install has (content fixed for a Python version).
SMOKE_TRAIN_MODULES = (
    "argparse",
    "dataclasses",
    "enum",
    "functools",
    "heapq",
    "statistics",
    "fractions",
    "csv",
    "string",
    "threading",
)
SMOKE_EVAL_MODULES = ("textwrap", "calendar")
SMOKE_TRAIN_PARTS = 4
SMOKE_MIN_TRAIN_TOKENS = 300 * 8 * 128  # ~300 global batches of the smoke recipe in one epoch

DEFAULT_PART_TOKENS = 1 << 26  # 256 MiB per output file


@dataclass(frozen=True)
class TokenFile:
    path: str  # where to read it (local path or gs:// URL)
    name: str  # logical name for the fingerprint: the path relative to `data.root` when under it
    size: int  # bytes

    @property
    def tokens(self) -> int:
        return self.size // TOKEN_BYTES


# ---------------------------------------------------------------- resolving a recipe's files


def _has_glob(p: str) -> bool:
    return any(c in p for c in "*?[")


def glob_to_regex(pattern: str) -> re.Pattern:
    """Shell-style glob: `*`/`?`/`[..]` stay within one path segment, `**/` matches zero or more directories."""
    i, out = 0, []
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
                i += 1
            else:
                body = pattern[i + 1 : j]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _expand(pattern: str) -> list[storage.ObjectInfo]:
    """Files matching `pattern` (sorted by path), or the one file it names."""
    gcs = storage.is_gcs(pattern)
    if not _has_glob(pattern):
        if not gcs:
            return (
                [storage.ObjectInfo(pattern, os.path.getsize(pattern), 0)] if os.path.isfile(pattern) else []
            )
        info = storage.store_for(pattern).stat(pattern)
        return [] if info is None else [info]
    # List under the longest directory prefix without glob characters; recursively only when the
    # glob spans directories.
    head = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
    base = head[: head.rfind("/") + 1]
    if not base and not gcs:
        base, pattern = "./", "./" + pattern
    recursive = "/" in pattern[len(base) :]
    rx = glob_to_regex(pattern)
    if gcs:
        files, _ = storage.store_for(pattern).list(base, recursive=recursive)
        return sorted((f for f in files if rx.match(f.path)), key=lambda f: f.path)
    hits = []
    for dp, dirs, fns in os.walk(base, followlinks=True):  # data directories are often symlinked
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if recursive else []
        for fn in fns:
            full = os.path.join(dp, fn)
            if not fn.startswith(".") and rx.match(full.replace(os.sep, "/")):  # hidden: temp files
                hits.append(storage.ObjectInfo(full, os.path.getsize(full), 0))
    return sorted(hits, key=lambda f: f.path)


def _expand_checked(pattern: str) -> list[storage.ObjectInfo]:
    try:
        return _expand(pattern)
    except Exception as e:
        if type(e).__name__ == "DefaultCredentialsError":  # google.auth: no credentials on this machine
            raise BadInput(
                f"no Google Cloud credentials to list `{pattern}`",
                "run `gcloud auth application-default login`, or set STORAGE_EMULATOR_HOST for an emulator",
            ) from None
        raise


def _logical_name(path: str, root: str) -> str:
    root = root.rstrip("/")
    if root and path.startswith(root + "/"):
        return path[len(root) + 1 :]
    return path


def resolve_paths(
    patterns: list[str] | tuple[str, ...], root: str = "", what: str = "data"
) -> list[TokenFile]:
    """Expand `{root}` and globs; keep the recipe's order (each glob sorted), drop repeats, check sizes."""
    root = root.rstrip("/")
    physical_root = root
    if root == SMOKE_ROOT or root.startswith(SMOKE_ROOT + "/"):
        physical_root = str(ensure_smoke_data()) + root[len(SMOKE_ROOT) :]
    out: list[TokenFile] = []
    seen: set[str] = set()
    for raw in patterns:
        pattern = raw.replace("{root}", physical_root)
        if pattern.startswith(SMOKE_ROOT):
            pattern = str(ensure_smoke_data()) + pattern[len(SMOKE_ROOT) :]
        hits = _expand_checked(pattern)
        if not hits:
            hint = "check data.root (--set data.root=...) and the path; `olmo-ctl data prepare` makes token files from text"
            raise BadInput(f"{what}: `{raw}` matches no file (looked for `{pattern}`)", hint)
        for h in hits:
            if h.path in seen:
                continue
            seen.add(h.path)
            if h.size % TOKEN_BYTES:
                raise BadInput(
                    f"{what}: `{h.path}` is {h.size} bytes, not a whole number of uint32 tokens",
                    "token files are raw little-endian uint32 (OLMo-core layout)",
                )
            out.append(TokenFile(h.path, _logical_name(h.path, physical_root), h.size))
    _check_raw(out, what)
    return out


def _common_dir(paths: list[str]) -> str:
    """The longest directory prefix (ending in /) shared by all `paths`."""
    prefix = os.path.commonprefix(paths)
    return prefix[: prefix.rfind("/") + 1]


def resolve_mix(name: str, root: str, what: str = "data.mix") -> list[TokenFile]:
    """The files of a shipped data mix under the base directory `root`, in the manifest's order.

    Every file must exist: a missing one is a BadInput naming it (and how many others are missing).
    Local files are stat-ed one by one; on gs:// the mix's common prefix is listed once.
    """
    from olmo_ctl.data.mixes import load_mix, mix_paths

    root = root.rstrip("/")
    if not root:
        raise BadInput(
            f"{what} `{name}` needs data.root: the base directory holding its `preprocessed/...` files",
            "for example --set data.root=gs://my-bucket (OLMo-core's mix_base_dir)",
        )
    entries = load_mix(name)
    paths = mix_paths(name, root)
    if storage.is_gcs(root):
        listed = {o.path: o.size for o in _listing(_common_dir(paths))}
        sizes = [listed.get(p) for p in paths]
    else:
        sizes = [os.path.getsize(p) if os.path.isfile(p) else None for p in paths]
    missing = [p for p, n in zip(paths, sizes, strict=True) if n is None]
    if missing:
        more = f" (and {len(missing) - 1} more of its {len(paths)} files)" if len(missing) > 1 else ""
        ai2 = (
            f" ({AI2_DATA_ROOT} is AI2's bucket, the shipped recipes' data.root)"
            if root == AI2_DATA_ROOT
            else ""
        )
        raise BadInput(
            f"{what} `{name}`: `{missing[0]}` does not exist{more}",
            f"point data.root at the directory holding your copy's `preprocessed/`{ai2}: {DATA_ROOT_HINT}; "
            "or download the mix under data.root keeping its paths",
        )
    out = []
    for e, p, n in zip(entries, paths, sizes, strict=True):
        assert n is not None  # a missing file was refused above
        if n % TOKEN_BYTES:
            raise BadInput(
                f"{what}: `{p}` is {n} bytes, not a whole number of uint32 tokens",
                "token files are raw little-endian uint32 (OLMo-core layout)",
            )
        out.append(TokenFile(p, e.path, n))
    _check_raw(out, what)
    return out


def _listing(prefix: str) -> list[storage.ObjectInfo]:
    try:
        files, _ = storage.store_for(prefix).list(prefix, recursive=True)
        return files
    except Exception as e:
        if type(e).__name__ == "DefaultCredentialsError":
            raise BadInput(
                f"no Google Cloud credentials to list `{prefix}`",
                "run `gcloud auth application-default login`, or set STORAGE_EMULATOR_HOST for an emulator",
            ) from None
        raise


def _check_raw(out: list[TokenFile], what: str) -> None:
    """One cheap header check: a NumPy-format .npy (with a header) is not the raw layout."""
    if out and out[0].size >= len(NUMPY_MAGIC):
        head = storage.store_for(out[0].path).read_range(out[0].path, 0, len(NUMPY_MAGIC))
        if head == NUMPY_MAGIC:
            raise BadInput(
                f"{what}: `{out[0].path}` is a NumPy .npy file with a header, not raw uint32 tokens",
                "convert it with `olmo-ctl data prepare FILE --out DIR`",
            )


def resolve_files(recipe, split: str = "train") -> list[TokenFile]:
    """The token files of a recipe's `train` or `eval` split, in order (`data.mix` for train when set)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be train or eval, not {split!r}")
    if split == "train" and recipe.data.mix:
        files = resolve_mix(recipe.data.mix, recipe.data.root)
    else:
        patterns = recipe.data.train if split == "train" else recipe.data.eval
        if not patterns:
            raise BadInput(
                f"recipe `{recipe.name}` lists no data.{split} files", f"add data.{split} paths to the recipe"
            )
        files = resolve_paths(patterns, recipe.data.root, what=f"data.{split}")
    if split == "train":
        files = permute_sources(files, recipe.data.source_permutation_seed)
    return files


def permute_sources(items: list, seed: int | None) -> list:
    """OLMo-core's `source_permutation_seed` (numpy_dataset.py:2465-2473 at fa6c5014):
    `random.Random(seed)` shuffles `range(len(items))` and the items are taken in that order.
    None keeps the order."""
    if seed is None:
        return list(items)
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in order]


# ---------------------------------------------------------------- fingerprint


def dataset_fingerprint(files_with_sizes, seq_len: int, seed: int) -> str:
    """A self-describing fingerprint: `v1:seq=<T>:seed=<S>:files=<F>:tokens=<N>:<sha256 prefix>`.

    `files_with_sizes` is a list of `TokenFile`s or `(name, size)` pairs; the hash covers the
    ordered logical names and byte sizes, `seq_len` and `seed` (what defines the data order).
    The readable fields let `check_fingerprint` say what changed.
    """
    items = []
    for f in files_with_sizes:
        if isinstance(f, TokenFile):
            items.append((f.name, int(f.size)))
        else:
            name, size = f
            items.append((str(name), int(size)))
    blob = json.dumps({"files": items, "seq_len": int(seq_len), "seed": int(seed)}, separators=(",", ":"))
    digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
    tokens = sum(s for _, s in items) // TOKEN_BYTES
    return f"v1:seq={int(seq_len)}:seed={int(seed)}:files={len(items)}:tokens={tokens}:{digest}"


def _fields(fp: str) -> dict[str, str]:
    parts = str(fp).split(":")
    out = {}
    for p in parts[1:-1]:
        k, _, v = p.partition("=")
        out[k] = v
    return out


def describe_fingerprint_change(saved: str, current: str) -> str:
    a, b = _fields(saved), _fields(current)
    labels = {
        "seq": "train.seq_len",
        "seed": "data.seed",
        "files": "number of token files",
        "tokens": "total tokens",
    }
    changed = [f"{labels[k]} {a[k]} -> {b[k]}" for k in labels if k in a and k in b and a[k] != b[k]]
    if not changed:
        if a and b:
            changed = ["same file count and total size, but file names, order or sizes differ"]
        else:
            changed = [f"fingerprint {saved} -> {current}"]
    return "; ".join(changed)


def check_fingerprint(saved: str | None, current: str, allow_change: bool = False) -> str | None:
    """None when the data is the one the checkpoint was trained on; raise BadInput when it changed.

    With `allow_change` the change is accepted and the returned message says what changed (log it).
    """
    if not saved or saved == current:
        return None
    what = describe_fingerprint_change(saved, current)
    msg = f"the training data changed since the checkpoint was written ({what})"
    if allow_change:
        return msg + "; continuing because of --allow-data-change (the data order is not the original one)"
    raise BadInput(
        msg, "restore the original files and settings, or pass --allow-data-change to continue with this data"
    )


# ---------------------------------------------------------------- writing token files


def held_out_indices(n: int, fraction: float) -> list[int]:
    """Which of `n` units (documents or files) are held out: round(n*fraction), evenly spaced, never all."""
    if fraction <= 0 or n < 2:
        return []
    k = min(n - 1, round(n * fraction))
    return sorted({int((j + 0.5) * n / k) for j in range(k)}) if k else []


def _read_input(path: str) -> bytes:
    try:
        return storage.store_for(path).read_bytes(path)
    except (IsADirectoryError, PermissionError) as e:
        raise BadInput(f"cannot read `{path}`: {e.strerror}", "pass files, not directories") from None


def _check_vocab(path: str, data: bytes, model_vocab_size: int) -> None:
    """A copied token file's ids are below the recipe's model.vocab_size."""
    if not data:
        return
    top = int(np.frombuffer(data, dtype=TOKEN_DTYPE).max())
    if top >= model_vocab_size:
        raise BadInput(
            f"`{path}` holds id {top}, beyond the recipe's model.vocab_size {model_vocab_size}",
            "these token files are not this model's; pass the recipe the data is for",
        )


def _raw_tokens_from_npy(path: str, data: bytes) -> bytes:
    """A token file's bytes as raw uint32: raw files as they are, NumPy-format .npy converted."""
    if not data.startswith(NUMPY_MAGIC):
        if len(data) % TOKEN_BYTES:
            raise BadInput(
                f"`{path}` is {len(data)} bytes, not a whole number of uint32 tokens",
                "pass raw uint32 token files (OLMo-core layout) or text files",
            )
        return data
    import io

    arr = np.load(io.BytesIO(data), allow_pickle=False)
    if arr.dtype.kind not in "iu":
        raise BadInput(f"`{path}` holds {arr.dtype} values, not token ids")
    if arr.size and (arr.min() < 0 or int(arr.max()) >= 2**32):
        raise BadInput(f"`{path}` holds values outside uint32")
    return np.ascontiguousarray(arr.reshape(-1), dtype=TOKEN_DTYPE).tobytes()


def _check_out_dir(out: str) -> None:
    """A local --out is a directory or can become one: neither it nor a parent is a file."""
    if storage.is_gcs(out):
        return
    p = os.path.abspath(out)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        what = f"--out `{out}` is a file" if p == os.path.abspath(out) else f"--out `{out}`: `{p}` is a file"
        raise BadInput(
            f"{what}, not a directory", "choose a directory (created if missing), e.g. --out data/mine"
        )


def _split_dir_is_empty(out: str, split: str) -> bool:
    store = storage.store_for(out)
    files, dirs = store.list(storage.join(out, split), recursive=True)
    return not files and not dirs


def _write(path: str, data: bytes) -> None:
    storage.store_for(path).write_bytes(path, data)
    if not storage.is_gcs(path):  # the store writes private temp files; data files are for everyone to read
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(path, 0o666 & ~umask)


def _write_stream(out: str, split: str, stream: np.ndarray, part_tokens: int) -> list[dict]:
    entries = []
    for i, start in enumerate(range(0, len(stream), part_tokens)):
        part = stream[start : start + part_tokens]
        rel = f"{split}/part-{i:05d}.npy"
        _write(storage.join(out, rel), part.astype(TOKEN_DTYPE, copy=False).tobytes())
        entries.append({"path": rel, "tokens": int(len(part))})
    return entries


def prepare(
    inputs: list[str],
    out: str,
    held_out_fraction: float = 0.05,
    seq_len: int = 0,
    part_tokens: int = DEFAULT_PART_TOKENS,
    held_out: list[str] | None = None,
    tokenizer: str = BYTES_TOKENIZER,
    eos_token_id: int | None = None,
    model=None,
) -> dict:
    """Make token files from text (a tokenizer) or copy raw uint32 token files; returns the manifest.

    Text inputs: each file is one document, tokenized by `tokenizer` (`builtin://bytes`, or a Hugging
    Face tokenizer.json or directory: data/tokenizer.py) with EOS after it (`eos_token_id`, else
    `model.eos_token_id`; `model`, the recipe's ModelConfig, also bounds every id by its vocab_size,
    token files' ids too); whole documents are held out,
    evenly spaced (with too few documents for that, the tail of the token stream is held out
    instead, a multiple of `seq_len` when given); the rest are concatenated into
    `train/part-NNNNN.npy` of at most `part_tokens` tokens (a multiple of `seq_len` when given, so
    only the last part has a remainder). `.npy` inputs are token files and are copied as they are
    (NumPy-format ones converted to raw uint32), whole files held out. `held_out` names inputs to
    hold out explicitly instead of `held_out_fraction`. Writes `manifest.json` last.
    """
    if not inputs:
        raise BadInput("no input files given", "pass text files or .npy token files")
    if not 0 <= held_out_fraction < 1:
        raise BadInput(f"--held-out-fraction must be in [0, 1), got {held_out_fraction}")
    if seq_len < 0:
        raise BadInput(f"--seq-len must be >= 0, got {seq_len}")
    if seq_len > 1:
        part_tokens = max(seq_len, part_tokens // seq_len * seq_len)
    npy = [p for p in inputs if p.endswith(".npy")]
    text = [p for p in inputs if not p.endswith(".npy")]
    if npy and text:
        raise BadInput(
            "both text files and .npy token files given",
            "their vocabularies differ (bytes vs the files' tokenizer); prepare them separately",
        )
    if npy and (tokenizer != BYTES_TOKENIZER or eos_token_id is not None):
        raise BadInput(
            "--tokenizer and --eos-id are for text; .npy token files are copied as they are",
            "leave them out, or prepare text files",
        )
    # Resolved before anything is written: a missing tokenizer or a wrong EOS changes nothing.
    tok = document_tokenizer(tokenizer, eos_token_id, model) if text else None
    _check_out_dir(out)
    for split in ("train", "eval"):
        if not _split_dir_is_empty(out, split):
            raise BadInput(
                f"`{storage.join(out, split)}` already holds files",
                "choose an empty --out directory (old part files would be mixed in)",
            )
    if held_out is not None:
        missing = [h for h in held_out if h not in inputs]
        if missing:
            raise ValueError(f"held_out names files that are not inputs: {missing}")
        eval_idx = [i for i, p in enumerate(inputs) if p in held_out]
    else:
        eval_idx = held_out_indices(len(inputs), held_out_fraction)
        if npy and held_out_fraction > 0 and not eval_idx:
            n = len(inputs)
            hint = (
                f"hold out one whole file with --held-out-fraction {1 / n:.2f}, or none with 0"
                if n > 1
                else "pass more files, or --held-out-fraction 0"
            )
            raise BadInput(
                f"{n} token file{'s' if n > 1 else ''} cannot be split {1 - held_out_fraction:.0%} / "
                f"{held_out_fraction:.0%} by whole files (token files are copied as they are)",
                hint,
            )
    manifest: dict = {
        "format": "raw little-endian uint32 tokens, no header (OLMo-core numpy layout)",
        "held_out_fraction": held_out_fraction,
        "seq_len": seq_len,
        "sources": {"train": [], "eval": []},
    }
    if tok is not None:
        manifest.update(
            {
                "tokenizer": "bytes" if tok.spec == BYTES_TOKENIZER else tok.spec,
                "vocab_size": tok.vocab_size,
                "eos_token_id": tok.eos_token_id,
                "pad_token_id": tok.pad_token_id,
            }
        )
        docs = list(tok.encode(((p, _read_input(p)) for p in inputs), TOKEN_DTYPE))
        if not eval_idx and held_out_fraction > 0:
            # Too few documents to hold out whole ones: hold out the tail of the token stream.
            stream = np.concatenate(docs)
            n_eval = max(1, round(len(stream) * held_out_fraction))
            if seq_len > 1:
                n_eval = -(-n_eval // seq_len) * seq_len
            if n_eval >= len(stream):
                raise BadInput(
                    f"{len(stream)} tokens are too few for a held-out split",
                    "give more text, a smaller --seq-len or --held-out-fraction 0",
                )
            train_stream, eval_stream = stream[:-n_eval], stream[-n_eval:]
            ends = np.cumsum([len(d) for d in docs])
            first_eval = int(np.searchsorted(ends, len(stream) - n_eval, side="right"))
            manifest["sources"] = {"train": list(inputs[: first_eval + 1]), "eval": list(inputs[first_eval:])}
            manifest["held_out"] = f"the last {n_eval} tokens"
        else:
            train_docs = [d for i, d in enumerate(docs) if i not in eval_idx]
            eval_docs = [docs[i] for i in eval_idx]
            empty = np.zeros(0, TOKEN_DTYPE)
            train_stream = np.concatenate(train_docs) if train_docs else empty
            eval_stream = np.concatenate(eval_docs) if eval_docs else empty
            manifest["sources"] = {
                "train": [p for i, p in enumerate(inputs) if i not in eval_idx],
                "eval": [inputs[i] for i in eval_idx],
            }
        if seq_len > 1:
            for split, s in (("train", train_stream), ("eval", eval_stream)):
                if len(s) and len(s) < seq_len:
                    raise BadInput(
                        f"the {split} split has {len(s)} tokens, fewer than one instance of {seq_len}",
                        "give more text, a smaller --seq-len or another --held-out-fraction",
                    )
        manifest["train"] = _write_stream(out, "train", train_stream, part_tokens)
        manifest["eval"] = _write_stream(out, "eval", eval_stream, part_tokens)
    else:
        manifest["tokenizer"] = "as given (pre-tokenized files copied as they are)"
        manifest["train"], manifest["eval"] = [], []
        counters = {"train": 0, "eval": 0}
        model_vocab = model.vocab_size if model is not None else None
        if model_vocab is not None:  # every file checked before the first is written
            for p in inputs:
                _check_vocab(p, _raw_tokens_from_npy(p, _read_input(p)), model_vocab)
        for i, p in enumerate(inputs):
            split = "eval" if i in eval_idx else "train"
            data = _raw_tokens_from_npy(p, _read_input(p))
            rel = f"{split}/part-{counters[split]:05d}.npy"
            counters[split] += 1
            _write(storage.join(out, rel), data)
            manifest[split].append({"path": rel, "tokens": len(data) // TOKEN_BYTES})
            manifest["sources"][split].append(p)
    for split in ("train", "eval"):
        manifest[f"{split}_tokens"] = sum(e["tokens"] for e in manifest[split])
        if seq_len > 1:
            manifest[f"{split}_instances"] = sum(e["tokens"] // seq_len for e in manifest[split])
    _write(storage.join(out, "manifest.json"), (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


# ---------------------------------------------------------------- the built-in smoke dataset


def smoke_cache_dir() -> Path:
    """`$OLMO_CTL_CACHE/smoke-data/<version>` or `~/.cache/olmo-ctl/smoke-data/<version>`.

    The version names the Python minor version too: the text is that Python's own stdlib.
    """
    base = os.environ.get("OLMO_CTL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "olmo-ctl")
    v = f"{SMOKE_VERSION}-py{sys.version_info.major}.{sys.version_info.minor}"
    return Path(base) / "smoke-data" / v


def smoke_source_files() -> tuple[list[str], list[str]]:
    """The stdlib files the smoke dataset is made of: (train, eval), in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])

    def find(mod: str) -> str | None:
        for cand in (stdlib / f"{mod}.py", stdlib / mod / "__init__.py"):
            if cand.is_file():
                return str(cand)
        return None

    train = [p for p in (find(m) for m in SMOKE_TRAIN_MODULES) if p]
    evals = [p for p in (find(m) for m in SMOKE_EVAL_MODULES) if p]
    return train, evals


def ensure_smoke_data() -> Path:
    """Make the smoke dataset once (atomically: build in a temp dir, rename into place)."""
    final = smoke_cache_dir()
    if (final / "manifest.json").is_file():
        return final
    train, evals = smoke_source_files()
    if not evals:
        raise BadInput(
            "cannot make the smoke dataset: this Python has none of its held-out stdlib files",
            f"expected {', '.join(m + '.py' for m in SMOKE_EVAL_MODULES)} in {sysconfig.get_paths()['stdlib']}",
        )
    total = sum(os.path.getsize(p) for p in train)
    if total < SMOKE_MIN_TRAIN_TOKENS:
        raise BadInput(
            f"cannot make the smoke dataset: only {total} bytes of stdlib text found",
            f"this Python's stdlib ({sysconfig.get_paths()['stdlib']}) looks stripped",
        )
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-")
    except OSError as e:
        raise BadInput(
            f"cannot make the smoke dataset in `{final.parent}`: {e.strerror}",
            "set OLMO_CTL_CACHE to a writable directory",
        ) from None
    try:
        os.chmod(tmp, 0o755)
        part_tokens = -(-(total + len(train)) // SMOKE_TRAIN_PARTS)
        prepare(train + evals, tmp, held_out=evals, part_tokens=part_tokens)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "manifest.json").is_file():  # not another process's finished copy
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final
