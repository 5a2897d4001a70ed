"""The packed fixed-length dataset of OLMo-core (`NumpyPackedFSLDataset`), as stage 3 uses it.

Ported from OLMo-core at commit fa6c5014, `src/olmo_core/data/numpy_dataset.py` and
`src/olmo_core/data/utils.py`:

- Source order: with `data.source_permutation_seed` the resolved file list is shuffled first with
  Python's `random.Random(seed).shuffle` over `range(n_files)` (`NumpyDatasetConfig.
  _resolve_paths_metadata`, numpy_dataset.py:2465-2473). That happens in
  `olmo_ctl.data.files.resolve_files`, so `data info` lists the files in this order.
- Source groups: consecutive files in that order are grouped `data.source_group_size` at a time
  (`chunked(paths, source_group_size)`, numpy_dataset.py:1038); a group is packed as if its files
  were one concatenated file (`pack_documents_into_instances`, utils.py:885-941).
- Documents: every EOS ends a document (the EOS belongs to it); tokens after a file's last EOS are
  not a document (`iter_document_indices`, utils.py:170-250, the local-array path with no BOS). A
  document longer than `seq_len` is truncated to its first `seq_len` tokens (`LongDocStrategy.
  truncate`, the default; `iter_document_indices_with_max_sequence_length`, utils.py:253-285).
- Packing: Optimized Best-Fit Decreasing (`InstancePacker.pack_documents`, utils.py:806-882):
  documents sorted by length, decreasing, with `np.argsort(-lengths)` (numpy's default, unstable
  sort: documents of equal length keep the order this exact call gives), each placed in the bin
  with the least space left that still fits it (the segment tree of utils.py:745-803, kept here in
  an array), the first such bin when several tie, or a new bin. A bin is an instance; its
  documents are concatenated in the order they were placed. `seq_len` must be a power of two (the
  segment tree's assertion).
- Instance numbering: group 0's instances, then group 1's, ... (`source_instance_offsets`,
  numpy_dataset.py:1083-1099). The epoch order over these indices is the trainer's usual one
  (`data.epoch_order`), exactly as OLMo-core's data loader permutes any FSL dataset.
- An instance (`NumpyPackedFSLDataset.__getitem__`, numpy_dataset.py:1126-1240): the documents'
  tokens, padded to `seq_len` with the pad token; `label_mask` is False on padding. Labels are OLMo-
  core's `get_labels` (utils.py:590-605): the inputs shifted left by one, -100 where the target is
  padding and at the last position. A label that crosses a document boundary (the EOS predicting
  the next document's first token) is kept, as in OLMo-core.
- Document masking (`generate_doc_lengths=True`): `doc_lens` is `get_document_lengths(input_ids,
  eos)` (utils.py:339-377): a document ends at each EOS, and what follows the last EOS (the padding)
  is one more document. We hand the same boundaries to the model as `segment_ids` (the number of
  EOS tokens before each position), so attention never crosses a document.

RoPE positions stay the instance's positions 0..seq_len-1 (not restarted per document). That is
what AI2's stage 3 ran: intra-document RoPE entered OLMo-core in May 2026 (commit 60d2487a), after
OLMo 3, and its context-parallel path still uses the instance positions.

Packing a group reads its files once; with `cache_dir` (the trainer passes `<run-dir>/data_order/
packing`), each group's packing is stored as one `.npy` (document spans in packed order and
instance offsets) and read back by later attempts and other hosts. Built once, as the epoch order
is: only the builder (`build=True`, host 0) packs and writes, with a create-only precondition (a
second writer, a retried try, learns the object exists: the bytes are the same); the other hosts
(`build=False`) wait for each group's object and read it, so they never download the source files
whole. A builder that dies meanwhile is a lost peer (the others exit 3); one that never writes is
waited for at most `WAIT_FOR_PACKER_S` (exit 3).

numpy only: no jax import here.
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
from collections import OrderedDict, defaultdict, deque

import numpy as np

from olmo_ctl import storage
from olmo_ctl.core.errors import BadInput
from olmo_ctl.data.files import TOKEN_DTYPE, TokenFile, dataset_fingerprint
from olmo_ctl.trainer.repetition import has_repetition
from olmo_ctl.trainer.token_files import TokenFiles

IGNORE_INDEX = -100
PACKING_FORMAT = "olmo-ctl-packing-v1"
CACHED_GROUPS = 16
WAIT_FOR_PACKER_S = 3600.0  # how long a host waits for host 0 to store a group's packing


def chunked(items: list, n: int) -> list[list]:
    """Consecutive groups of `n` (the last may be shorter), as OLMo-core's `chunked` (utils.py:730)."""
    return [list(items[i : i + n]) for i in range(0, len(items), n)]


def document_spans(tokens: np.ndarray, eos_token_id: int, seq_len: int) -> np.ndarray:
    """[n_docs, 2] (start, end) of the documents of one token array, each truncated to `seq_len`.

    `iter_document_indices_with_max_sequence_length` with `LongDocStrategy.truncate` and no BOS
    (utils.py:170-285): a document ends just after each EOS; tokens after the last EOS are dropped.
    """
    ends = np.flatnonzero(np.asarray(tokens) == eos_token_id).astype(np.int64) + 1
    starts = np.concatenate([np.zeros(1, np.int64), ends[:-1]])
    return np.stack([starts, np.minimum(ends, starts + seq_len)], axis=1)


class InstancePacker:
    """OBFD packing (`InstancePacker`, utils.py:806-882) with the segment tree as an array.

    Leaf `c - 1` of the tree holds `c` when some bin has exactly `c` tokens of space left (leaf
    `N - 1` always holds `N`: a new bin), else 0; an inner node holds the max of its children.
    `query(w)` walks down to the leftmost leaf whose weight is >= w: the best fit.
    """

    def __init__(self, max_sequence_length: int):
        n = int(max_sequence_length)
        if n < 1 or n & (n - 1):
            raise ValueError(f"the packing length must be a power of two, got {n}")
        self.n = n
        self.tree = np.zeros(2 * n, dtype=np.int64)
        self._set(n - 1, n)
        self.instance_bins: list[list[int]] = []
        self.space_to_bins: dict[int, deque[int]] = defaultdict(deque)

    def _set(self, leaf: int, weight: int) -> None:  # SegmentTreeNode.update (utils.py:760-767)
        t, i = self.tree, self.n + leaf
        t[i] = weight
        i //= 2
        while i:
            t[i] = max(t[2 * i], t[2 * i + 1])
            i //= 2

    def _query(self, weight: int) -> int:  # SegmentTree.query (utils.py:792-803)
        t, i = self.tree, 1
        while i < self.n:
            i = 2 * i if weight <= t[2 * i] else 2 * i + 1
        return i - self.n

    def pack_document(self, document_id: int, document_length: int) -> int:
        """`InstancePacker._pack_document` (utils.py:823-855): the bin the document went to."""
        capacity = self._query(document_length) + 1
        if capacity == self.n:
            self.instance_bins.append([])
            bin_id = len(self.instance_bins) - 1
        else:
            bins = self.space_to_bins[capacity]
            bin_id = bins.popleft()
            if not bins:
                self._set(capacity - 1, 0)
        self.instance_bins[bin_id].append(document_id)
        space = capacity - document_length
        if space > 0:
            bins = self.space_to_bins[space]
            if not bins:
                self._set(space - 1, space)
            bins.append(bin_id)
        return bin_id

    def pack_documents(self, spans: np.ndarray) -> tuple[list[list[int]], np.ndarray]:
        """(bins of document ids, spans sorted as the ids number them) (utils.py:857-876)."""
        spans = np.asarray(spans).reshape(-1, 2)
        lengths = spans[:, 1] - spans[:, 0]
        sorted_index = np.argsort(-1 * lengths.astype(np.int64))  # the same call as OLMo-core's
        spans = np.take(spans, sorted_index, axis=0)
        for doc_id, (s, e) in enumerate(spans):
            self.pack_document(doc_id, int(e - s))
        return self.instance_bins, spans


def pack_group(
    token_arrays: list[np.ndarray], seq_len: int, eos_token_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Pack the files of one source group as one concatenated file.

    Returns (spans [n_docs, 2] int64 of document (start, end) in the group's concatenated token
    coordinates, listed instance by instance in placement order; offsets [n_instances + 1] int64:
    instance k holds spans[offsets[k]:offsets[k+1]]).
    """
    parts, base = [], 0
    for toks in token_arrays:
        parts.append(document_spans(toks, eos_token_id, seq_len) + base)
        base += len(toks)
    spans = np.concatenate(parts) if parts else np.zeros((0, 2), np.int64)
    bins, sorted_spans = InstancePacker(seq_len).pack_documents(spans)
    order = np.fromiter((d for b in bins for d in b), dtype=np.int64, count=sum(len(b) for b in bins))
    offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(b) for b in bins])
    return sorted_spans[order].astype(np.int64).reshape(-1, 2), offsets


def segment_ids(input_ids: np.ndarray, eos_token_id: int) -> np.ndarray:
    """The document of each position, as OLMo-core's `get_document_lengths` (utils.py:339-377) cuts
    an instance: the number of EOS tokens strictly before it (an EOS belongs to the document it ends;
    padding after the last EOS is one more document)."""
    ids = np.asarray(input_ids)
    is_eos = (ids == eos_token_id).astype(np.int32)
    seg = np.zeros(ids.shape, np.int32)
    seg[..., 1:] = np.cumsum(is_eos[..., :-1], axis=-1)
    return seg


class PackedDataset:
    """OLMo-core's packed FSL dataset over raw uint32 token files (already in source order)."""

    def __init__(
        self,
        files: list[TokenFile],
        seq_len: int,
        *,
        eos_token_id: int,
        pad_token_id: int,
        source_group_size: int = 1,
        ngram_filter: bool = False,
        vocab_size: int | None = None,
        cache_dir: str | None = None,
        source_permutation_seed: int | None = None,
        build: bool = True,
        progress=None,
        wait_s: float = WAIT_FOR_PACKER_S,
        poll_s: float = 1.0,
    ):
        if seq_len < 2 or seq_len & (seq_len - 1):
            raise BadInput(
                f"a packed dataset needs train.seq_len to be a power of two, got {seq_len}",
                "OLMo-core's packer (a segment tree over the lengths) requires it",
            )
        if source_group_size < 1:
            raise BadInput(f"data.source_group_size must be >= 1, got {source_group_size}")
        self.files = list(files)
        self.seq_len = int(seq_len)
        self.eos, self.pad = int(eos_token_id), int(pad_token_id)
        self.source_group_size = int(source_group_size)
        self.source_permutation_seed = source_permutation_seed
        self.ngram_filter = bool(ngram_filter)
        self.vocab_size = vocab_size
        self.cache_dir = cache_dir
        self.build = bool(build) or not cache_dir  # without a store to wait on, every host packs
        self.progress = progress  # called after each group packed or read, and each wait answered
        self.wait_s, self.poll_s = float(wait_s), float(poll_s)
        self.bytes_read = 0  # of source files and stored packings, for the start-up figures
        self.groups = chunked(list(range(len(self.files))), self.source_group_size)
        self._lock = threading.Lock()
        self.token_files = TokenFiles(self.files)  # local maps and gs:// files, a bounded number kept open
        self._packed: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        counts = [self._group(g)[1].shape[0] - 1 for g in range(len(self.groups))]
        self._ends = np.cumsum(np.asarray(counts, dtype=np.int64))

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __repr__(self) -> str:
        return (
            f"PackedDataset({len(self.files)} files in {len(self.groups)} groups, seq_len={self.seq_len}, "
            f"instances={len(self)})"
        )

    @property
    def tokens_per_epoch(self) -> int:
        return len(self) * self.seq_len

    def fingerprint(self, seed: int) -> str:
        base = dataset_fingerprint(self.files, self.seq_len, seed)
        extra = f"packed:g={self.source_group_size}:perm={self.source_permutation_seed}"
        digest = hashlib.sha256(f"{base}|{extra}".encode()).hexdigest()[:16]
        head = base.rsplit(":", 1)[0]
        return f"{head}:packed=g{self.source_group_size}:{digest}"

    # -- reading

    def _file_tokens(self, fi: int) -> np.ndarray:
        toks = self.token_files.tokens(fi)
        self.bytes_read += toks.nbytes
        return toks

    def _read(self, fi: int, start: int, end: int) -> np.ndarray:
        return self.token_files.read(fi, start, end)

    # -- packing (per group, cached)

    def _cache_path(self, g: int) -> str | None:
        if not self.cache_dir:
            return None
        key = json.dumps(
            {
                "format": PACKING_FORMAT,
                "seq_len": self.seq_len,
                "eos": self.eos,
                "files": [(self.files[i].name, int(self.files[i].size)) for i in self.groups[g]],
            }
        )
        return storage.join(self.cache_dir, hashlib.sha256(key.encode()).hexdigest()[:24] + ".npy")

    def _group(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            hit = self._packed.get(g)
            if hit is not None:
                self._packed.move_to_end(g)
                return hit
        path = self._cache_path(g)
        packed = None if path is None else self._load(path)
        if packed is None and path is not None and not self.build:
            packed = self._wait_for(path, g)
        if packed is None:
            arrays = [self._file_tokens(fi) for fi in self.groups[g]]
            packed = pack_group(arrays, self.seq_len, self.eos)
            if path is not None:
                buf = io.BytesIO()
                np.save(
                    buf, np.concatenate([[len(packed[0])], packed[0].reshape(-1), packed[1]]).astype(np.int64)
                )
                storage.store_for(path).create(path, buf.getvalue())  # created once: the bytes are the same
        if self.progress is not None:
            self.progress()
        with self._lock:
            self._packed[g] = packed
            while len(self._packed) > CACHED_GROUPS:
                self._packed.popitem(last=False)
        return packed

    def _load(self, path: str) -> tuple[np.ndarray, np.ndarray] | None:
        """A stored packing, or None when it is not there (yet)."""
        try:
            raw = storage.store_for(path).read_bytes(path)
        except storage.NotFound:
            return None
        self.bytes_read += len(raw)
        flat = np.load(io.BytesIO(raw))
        n_spans = int(flat[0])
        return flat[1 : 1 + 2 * n_spans].reshape(-1, 2), flat[1 + 2 * n_spans :]

    def _wait_for(self, path: str, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Host 0's packing of group `g`, polled for until it is stored."""
        import time

        from olmo_ctl.core.errors import OlmoCtlError

        if g == 0:
            print(
                f"waiting for host 0 to store the packing of {len(self.groups)} groups in {self.cache_dir}",
                flush=True,
            )
        end = time.monotonic() + self.wait_s
        while True:
            packed = self._load(path)
            if packed is not None:
                return packed
            if self.progress is not None:
                self.progress()  # storage answered: the wait is alive (host 0's own watchdog judges it)
            if time.monotonic() >= end:
                raise OlmoCtlError(
                    f"host 0 stored no packing of source group {g} in `{path}` within {self.wait_s:.0f} s",
                    "the attempt can be retried",
                    exit_code=3,
                )
            time.sleep(self.poll_s)

    # -- instances

    def locate(self, i: int) -> tuple[int, int]:
        """(source group, instance within the group) of instance `i`."""
        if not 0 <= i < len(self):
            raise IndexError(f"instance {i} out of range [0, {len(self)})")
        g = int(np.searchsorted(self._ends, i, side="right"))
        return g, i - (int(self._ends[g - 1]) if g else 0)

    def documents(self, i: int) -> list[np.ndarray]:
        """The token arrays of the documents of instance `i`, in order."""
        g, k = self.locate(int(i))
        spans, offsets = self._group(g)
        files = self.groups[g]
        sizes = np.asarray([self.files[fi].tokens for fi in files], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        out = []
        for s, e in spans[offsets[k] : offsets[k + 1]]:
            j = int(np.searchsorted(starts, s, side="right")) - 1  # the file the document starts in
            out.append(self._read(files[j], int(s - starts[j]), int(e - starts[j])))
        return out

    def tokens(self, i: int) -> tuple[np.ndarray, int]:
        """(the instance's `seq_len` tokens, padded; how many are real)."""
        docs = self.documents(i)
        toks = np.concatenate(docs) if docs else np.zeros(0, TOKEN_DTYPE)
        out = np.full(self.seq_len, self.pad, dtype=np.int64)
        out[: len(toks)] = toks
        return out, len(toks)

    def _instance(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        toks, n_real = self.tokens(i)
        if self.vocab_size is not None and n_real and int(toks[:n_real].max()) >= self.vocab_size:
            raise BadInput(
                f"instance {i} holds token id {int(toks[:n_real].max())}, outside the model's vocab "
                f"({self.vocab_size})",
                "the data was made with another tokenizer than the recipe's model",
            )
        input_ids = toks.astype(np.int32)
        labels = np.full_like(input_ids, IGNORE_INDEX)
        if n_real > 1:
            labels[: n_real - 1] = input_ids[1:n_real]  # -100 where the target is padding, and at the end
        kept = not (self.ngram_filter and has_repetition(input_ids))
        if not kept:
            labels[:] = IGNORE_INDEX
        return input_ids, labels, segment_ids(input_ids, self.eos), kept

    def instance(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids, labels, segment_ids), each int32[seq_len]."""
        a, b, c, _ = self._instance(i)
        return a, b, c

    def batch(self, indices) -> dict[str, np.ndarray]:
        """Rows for `indices`: input_ids, labels, segment_ids, instance_ids, instance_mask."""
        idx = np.asarray(indices, dtype=np.int64)
        T = self.seq_len
        out = {k: np.empty((len(idx), T), dtype=np.int32) for k in ("input_ids", "labels", "segment_ids")}
        kept = np.ones(len(idx), dtype=bool)
        for r, i in enumerate(idx):
            out["input_ids"][r], out["labels"][r], out["segment_ids"][r], kept[r] = self._instance(int(i))
        return {**out, "instance_ids": idx, "instance_mask": kept}
