"""The tokenizers text becomes tokens with: the smoke model's byte-level one, or a Hugging Face one by path.

One loading rule (`tokenizer_path`) serves `olmo-ctl data prepare` and the evaluators that tokenize
text (`data.tokenizer`, trainer/downstream.py): `builtin://bytes`, a `tokenizer.json`, or a directory
holding one, local or gs://. Documents are tokenized as Dolma's `dolma tokens` and OLMo-core's
pre-training data are: each document on its own, without the tokenizer's own special tokens (no BOS),
then the EOS id appended. The `tokenizers` package (the `eval` extra) is imported only for a Hugging
Face tokenizer, so the byte-level path needs numpy alone; numpy itself only when documents are
encoded, so the CLI names `BYTES_TOKENIZER` without it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from olmo_ctl.core.errors import BadInput

if TYPE_CHECKING:
    import numpy as np

BYTES_TOKENIZER = "builtin://bytes"

# Byte-level tokenizer: token = byte value, then EOS after each document; 257 is padding.
BYTE_EOS = 256
BYTE_PAD = 257
BYTE_VOCAB = 258

# encode_batch runs its documents on the tokenizer's thread pool: a batch is this many documents, or
# this much text, whichever comes first (a corpus is never one call per document, nor one call in all).
BATCH_DOCS = 1024
BATCH_BYTES = 64 << 20


def _tokenizers(why: str):
    try:
        import tokenizers
    except ImportError as e:
        raise BadInput(
            f"{why} needs the `tokenizers` package, which is not installed ({e})",
            "install the eval extra: pip install -c constraints.txt -e '.[eval]' (docs/install.md#the-eval-extra)",
        ) from None
    return tokenizers


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the `tokenizers` ByteLevel pre-tokenizer uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def bytes_tokenizer_json(eos_token_id: int = BYTE_EOS, pad_token_id: int = BYTE_PAD) -> str:
    """The smoke model's byte-level tokenizer (token = byte, EOS 256, pad 257) as a Hugging Face
    `tokenizer.json`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = {eos_token_id: "<|endoftext|>", pad_token_id: "<|pad|>"}
    tok.add_special_tokens([AddedToken(specials[i], special=True) for i in sorted(specials)])
    return tok.to_str()


def tokenizer_path(spec: str, cache_dir: str | None = None) -> str:
    """A local `tokenizer.json` for `data.tokenizer`: `builtin://bytes`, a tokenizer file, or a Hugging
    Face model or tokenizer directory holding `tokenizer.json`; local or gs:// (copied to `cache_dir`)."""
    import tempfile

    from olmo_ctl import storage

    if not spec:
        raise BadInput(
            "eval.downstream needs the run's tokenizer, and data.tokenizer is not set",
            "--set data.tokenizer=PATH (a Hugging Face tokenizer directory or tokenizer.json, local or gs://)",
        )
    cache = cache_dir or os.path.join(tempfile.gettempdir(), "olmo-ctl-tokenizers")
    if spec == BYTES_TOKENIZER:
        os.makedirs(cache, exist_ok=True)
        path = os.path.join(cache, "bytes-tokenizer.json")
        text = bytes_tokenizer_json()
        if not os.path.exists(path) or open(path).read() != text:
            tmp = f"{path}.{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        return path
    candidates = [spec] if spec.endswith(".json") else [spec.rstrip("/") + "/tokenizer.json"]
    for c in candidates:
        if storage.is_gcs(c):
            store = storage.store_for(c)
            if store.exists(c):
                os.makedirs(cache, exist_ok=True)
                local = os.path.join(cache, c[len("gs://") :].replace("/", "_"))
                tmp = f"{local}.{os.getpid()}"
                with open(tmp, "wb") as f:
                    f.write(store.read_bytes(c))
                os.replace(tmp, local)
                return local
        elif os.path.isfile(c):
            return c
    raise BadInput(
        f"tokenizer {spec!r}: no {candidates[0]}",
        "data.tokenizer is a Hugging Face tokenizer directory (with tokenizer.json) or a tokenizer.json,"
        f" local or gs://, or {BYTES_TOKENIZER} for the smoke model",
    )


# ---------------------------------------------------------------- documents to tokens


@dataclass(frozen=True)
class DocumentTokenizer:
    """A tokenizer with the ids its token files are made with: EOS after each document, the padding id
    and vocabulary the manifest records, and the model's vocabulary every id must fall below."""

    spec: str  # `builtin://bytes` or the --tokenizer given
    eos_token_id: int
    pad_token_id: int | None
    vocab_size: int  # the tokenizer's, special tokens included
    model_vocab_size: int | None  # the recipe's model.vocab_size, when a recipe was named
    hf: Any = None  # a tokenizers.Tokenizer; None for bytes

    def encode(self, docs: Iterable[tuple[str, bytes]], dtype: np.dtype) -> Iterator[np.ndarray]:
        """Each (name, content) document's ids followed by EOS, in order, batched for the tokenizer."""
        batch: list[tuple[str, bytes]] = []
        size = 0
        for doc in docs:
            batch.append(doc)
            size += len(doc[1])
            if len(batch) >= BATCH_DOCS or size >= BATCH_BYTES:
                yield from self._encode_batch(batch, dtype)
                batch, size = [], 0
        if batch:
            yield from self._encode_batch(batch, dtype)

    def _encode_batch(self, batch: list[tuple[str, bytes]], dtype: np.dtype) -> list[np.ndarray]:
        import numpy as np

        if self.hf is None:
            ids = [np.frombuffer(data, dtype=np.uint8) for _, data in batch]
        else:
            texts = []
            for name, data in batch:
                try:
                    texts.append(data.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise BadInput(
                        f"`{name}` is not UTF-8 text (byte {e.start})",
                        f"a Hugging Face tokenizer reads text; {BYTES_TOKENIZER} takes any bytes",
                    ) from None
            encoded = self.hf.encode_batch(texts, add_special_tokens=False)
            ids = [np.asarray(e.ids, dtype=np.int64) for e in encoded]
        out = []
        for (name, _), doc in zip(batch, ids, strict=True):
            arr = np.empty(len(doc) + 1, dtype=dtype)
            arr[:-1] = doc
            arr[-1] = self.eos_token_id
            if self.model_vocab_size is not None and len(doc) and int(doc.max()) >= self.model_vocab_size:
                bad = int(doc.max())
                raise BadInput(
                    f"`{name}` tokenizes to id {bad}, beyond the recipe's model.vocab_size {self.model_vocab_size}",
                    f"the tokenizer ({self.spec}, vocabulary {self.vocab_size}) is not this model's; "
                    "pass the model's tokenizer, or the recipe the data is for",
                )
            out.append(arr)
        return out


def document_tokenizer(
    spec: str = BYTES_TOKENIZER, eos_token_id: int | None = None, model: Any = None
) -> DocumentTokenizer:
    """The tokenizer `data prepare --tokenizer SPEC` names, with its EOS.

    The EOS is `eos_token_id` (--eos-id), else the recipe's `model.eos_token_id` (`model`: the
    recipe's ModelConfig, whose vocab_size also bounds every id), else 256 for `builtin://bytes`; the
    two given together must agree. A Hugging Face tokenizer.json does not say which of its tokens ends
    a document (its tokenizer_config.json does, for transformers), so with one, one of them is needed.
    """
    model_eos = model.eos_token_id if model is not None else None
    model_vocab = model.vocab_size if model is not None else None
    if eos_token_id is not None and model_eos is not None and eos_token_id != model_eos:
        raise BadInput(
            f"--eos-id {eos_token_id} differs from the recipe's model.eos_token_id {model_eos}",
            "leave --eos-id out: the recipe's model names its EOS",
        )
    eos = eos_token_id if eos_token_id is not None else model_eos
    if eos is not None and eos < 0:
        raise BadInput(f"--eos-id must be a token id (>= 0), got {eos}")
    if spec == BYTES_TOKENIZER:
        if eos is not None and eos != BYTE_EOS:
            raise BadInput(
                f"{BYTES_TOKENIZER} ends each document with {BYTE_EOS}, not {eos}"
                + (" (the recipe's model.eos_token_id)" if eos_token_id is None else ""),
                "pass the model's tokenizer with --tokenizer PATH, or a byte-level recipe (--recipe smoke)",
            )
        if model_vocab is not None and model_vocab < BYTE_VOCAB:
            raise BadInput(
                f"{BYTES_TOKENIZER} has {BYTE_VOCAB} tokens, beyond the recipe's model.vocab_size {model_vocab}"
            )
        return DocumentTokenizer(spec, BYTE_EOS, BYTE_PAD, BYTE_VOCAB, model_vocab)
    if not spec:
        raise BadInput(
            "--tokenizer is empty", f"pass a tokenizer.json or a directory holding one, or {BYTES_TOKENIZER}"
        )
    tokenizers = _tokenizers("data prepare --tokenizer")
    try:
        path = tokenizer_path(spec)
    except BadInput as err:
        raise BadInput(
            err.message,
            "--tokenizer is a Hugging Face tokenizer directory (with tokenizer.json) or a tokenizer.json,"
            f" local or gs://, or {BYTES_TOKENIZER} for the smoke model",
        ) from None
    try:
        hf = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises a bare Exception for any malformed file
        raise BadInput(
            f"tokenizer {spec!r}: `{path}` is not a Hugging Face tokenizer.json ({str(e).splitlines()[0]})",
            "pass a tokenizer.json, or a Hugging Face tokenizer directory holding one",
        ) from None
    vocab = hf.get_vocab_size(with_added_tokens=True)
    if eos is None:
        raise BadInput(
            f"which token ends a document? tokenizer {spec!r} does not say",
            "pass --eos-id N (dolma2: 100257), or the recipe the data is for (--stage N or --recipe NAME) "
            "to use its model.eos_token_id",
        )
    if hf.id_to_token(eos) is None:
        raise BadInput(f"EOS {eos} is not a token of tokenizer {spec!r} (vocabulary {vocab})")
    if model_vocab is not None and eos >= model_vocab:
        raise BadInput(f"--eos-id {eos} is beyond the recipe's model.vocab_size {model_vocab}")
    return DocumentTokenizer(
        spec, eos, model.pad_token_id if model is not None else None, vocab, model_vocab, hf
    )
