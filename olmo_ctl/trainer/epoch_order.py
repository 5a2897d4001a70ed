"""The epoch order, computed once and stored, so a restart reads its rows instead of recomputing it.

An epoch's order is a permutation of every instance (`data.epoch_order`: PCG64 of seed + epoch); for
the 7B mix that is ~724M entries, about a minute and 2.9 GB of memory per host to compute. It
depends only on (instance count, seed, epoch), all covered by the dataset fingerprint, so it is
computed once per (fingerprint, epoch) and stored under `<order-dir>/<digest>-e<epoch>/`:

    part-00000 ... part-NNNNN   the untrimmed permutation, little-endian uint32 (uint64 past 2**32
                                instances), PART_ENTRIES entries per object
    header.json                 written last: what the order is of (fingerprint, n, seed, epoch),
                                its layout, and a CRC32 of every CHUNK_ENTRIES-entry chunk

A reader fetches the header once, then reads only the chunks holding the rows it needs (ranged
reads on gs:// through `olmo_ctl.storage`, file reads locally) and checks each chunk's CRC. The
order is stored untrimmed, so another global batch reads the same file.

Writers: host 0 (any process that finds no header, where hosts do not wait for each other) computes
the permutation into a memory-mapped scratch file
(file-backed pages, not anonymous memory: the kernel can write them back under pressure), writes the
parts, then the header with a does-not-exist precondition. Parts are deterministic, so a part written
twice is the same bytes; the first complete header wins and a losing writer reads the winner's.
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
import zlib
from collections import OrderedDict

import numpy as np

from olmo_ctl import storage
from olmo_ctl.core.errors import BadInput

FORMAT = "olmo-ctl-epoch-order-v1"
CHUNK_ENTRIES = 1 << 16  # the unit of reads and checksums: 256 KiB of uint32
PART_ENTRIES = 1 << 24  # entries per stored object: 64 MiB of uint32
CACHED_CHUNKS = 8
_FILL_ENTRIES = 1 << 22  # arange written into the scratch map this many at a time


def order_key(fingerprint: str, epoch: int) -> str:
    """The directory name of an epoch's order: the fingerprint's digest and the epoch."""
    digest = str(fingerprint).rpartition(":")[2] or "nofp"
    return f"{digest}-e{int(epoch):05d}"


def _dtype(n: int) -> np.dtype:
    return np.dtype("<u4") if n < 2**32 else np.dtype("<u8")


def _part_name(k: int) -> str:
    return f"part-{k:05d}"


def compute_into(buf: np.ndarray, seed: int, epoch: int) -> None:
    """Write `Generator(PCG64(seed + epoch)).permutation(len(buf))` into `buf` (a plain uint32 or
    uint64 ndarray, e.g. over a memory map) in place.

    `Generator.shuffle` takes its fast in-place path only for a 1-d array whose type is exactly
    `np.ndarray` (a `np.memmap` would fall back to a Python loop), draws the same numbers whatever
    the dtype, and so gives the same permutation as `permutation(n)`.
    """
    if type(buf) is not np.ndarray or buf.ndim != 1:
        raise TypeError("compute_into needs a 1-d numpy.ndarray (not a subclass)")
    n = len(buf)
    for s in range(0, n, _FILL_ENTRIES):
        e = min(n, s + _FILL_ENTRIES)
        buf[s:e] = np.arange(s, e, dtype=buf.dtype)
    np.random.Generator(np.random.PCG64(seed + epoch)).shuffle(buf)


def _chunk_crcs(buf: np.ndarray) -> list[int]:
    mv = buf.data.cast("B")
    step = CHUNK_ENTRIES * buf.dtype.itemsize
    return [zlib.crc32(mv[s : s + step]) for s in range(0, len(mv), step)]


class OrderFile:
    """Rows of one stored epoch order (verified header; each chunk checked as it is read)."""

    def __init__(self, directory: str, header: dict):
        self.directory = directory
        self.header = header
        self.n = int(header["n"])
        self.dtype = np.dtype(header["dtype"])
        self._crcs = header["chunk_crc32"]
        self._chunks: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return self.n

    @classmethod
    def open(cls, directory: str, fingerprint: str, n: int, seed: int, epoch: int) -> OrderFile | None:
        """The stored order if its header is complete and describes this order; None when absent."""
        path = storage.join(directory, "header.json")
        try:
            text = storage.store_for(path).read_text(path)
        except storage.NotFound:
            return None
        try:
            header = json.loads(text)
        except ValueError:
            raise _corrupt(directory, "its header is not JSON") from None
        want = {
            "format": FORMAT,
            "fingerprint": fingerprint,
            "n": n,
            "seed": seed,
            "epoch": epoch,
            "dtype": _dtype(n).str,
            "chunk_entries": CHUNK_ENTRIES,
            "part_entries": PART_ENTRIES,
        }
        if not isinstance(header, dict):
            raise _corrupt(directory, "its header is not an object")
        bad = [k for k, v in want.items() if header.get(k) != v]
        crcs = header.get("chunk_crc32")
        if not bad and (not isinstance(crcs, list) or len(crcs) != -(-n // CHUNK_ENTRIES)):
            bad = ["chunk_crc32"]
        if bad:
            raise _corrupt(directory, f"its header differs in {', '.join(bad)}")
        return cls(directory, header)

    def _chunk(self, c: int) -> np.ndarray:
        got = self._chunks.get(c)
        if got is not None:
            self._chunks.move_to_end(c)
            return got
        first = c * CHUNK_ENTRIES
        count = min(CHUNK_ENTRIES, self.n - first)
        part, off = divmod(first, PART_ENTRIES)
        path = storage.join(self.directory, _part_name(part))
        size = self.dtype.itemsize
        try:
            raw = storage.store_for(path).read_range(path, off * size, (off + count) * size)
        except storage.NotFound:
            raise _corrupt(self.directory, f"{_part_name(part)} is missing") from None
        if len(raw) != count * size or zlib.crc32(raw) != self._crcs[c]:
            raise _corrupt(self.directory, f"chunk {c} of {_part_name(part)} fails its checksum")
        arr = np.frombuffer(raw, dtype=self.dtype)
        self._chunks[c] = arr
        while len(self._chunks) > CACHED_CHUNKS:
            self._chunks.popitem(last=False)
        return arr

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Entries `start:stop` of the order as int64, reading only the chunks that hold them."""
        start, stop = max(0, int(start)), min(self.n, int(stop))
        out = np.empty(max(0, stop - start), dtype=np.int64)
        i = start
        while i < stop:
            c, off = divmod(i, CHUNK_ENTRIES)
            chunk = self._chunk(c)
            take = min(stop - i, len(chunk) - off)
            out[i - start : i - start + take] = chunk[off : off + take]
            i += take
        return out

    def __getitem__(self, s: slice) -> np.ndarray:
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError("an OrderFile is read by contiguous slices")
        start, stop, _ = s.indices(self.n)
        return self.rows(start, stop)


def _corrupt(directory: str, why: str) -> BadInput:
    return BadInput(
        f"the stored epoch order `{directory}` is unusable: {why}",
        "delete that directory; the next start computes it again",
    )


def build_order(
    directory: str,
    fingerprint: str,
    n: int,
    seed: int,
    epoch: int,
    scratch_dir: str | None = None,
    progress=None,
) -> None:
    """Compute the order and store it under `directory` (no-op result if another writer won);
    `progress` is called after each part is stored (the watchdog's beat)."""
    dt = _dtype(n)
    nbytes = n * dt.itemsize
    if scratch_dir is None:
        scratch_dir = directory if not storage.is_gcs(directory) else tempfile.gettempdir()
    os.makedirs(scratch_dir, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=scratch_dir, prefix=".order-scratch-")
    try:
        os.ftruncate(fd, max(nbytes, 1))
        with mmap.mmap(fd, max(nbytes, 1)) as mm:
            buf = np.frombuffer(mm, dtype=dt, count=n)
            compute_into(buf, seed, epoch)
            crcs = _chunk_crcs(buf)
            raw = buf.data.cast("B")
            part_bytes = PART_ENTRIES * dt.itemsize
            for k, s in enumerate(range(0, max(nbytes, 1), part_bytes)):
                path = storage.join(directory, _part_name(k))
                storage.store_for(path).write_bytes(path, bytes(raw[s : s + part_bytes]))
                if progress is not None:
                    progress()
            del raw, buf
        header = {
            "format": FORMAT,
            "fingerprint": fingerprint,
            "n": n,
            "seed": seed,
            "epoch": epoch,
            "dtype": dt.str,
            "chunk_entries": CHUNK_ENTRIES,
            "part_entries": PART_ENTRIES,
            "chunk_crc32": crcs,
        }
        path = storage.join(directory, "header.json")
        # Create-only: another writer that finished first wins; its parts are the same bytes.
        storage.store_for(path).create(path, json.dumps(header, separators=(",", ":")).encode())
    finally:
        os.close(fd)
        os.unlink(scratch)


WAIT_FOR_BUILDER_S = 3600.0  # how long a host waits for host 0 to store an epoch's order


def stored_order(
    order_dir: str,
    fingerprint: str,
    n: int,
    seed: int,
    epoch: int,
    build: bool = True,
    wait_s: float = WAIT_FOR_BUILDER_S,
    poll_s: float = 1.0,
    progress=None,
) -> OrderFile:
    """The epoch's stored order under `order_dir`, computed and stored first if it is not there yet.

    With `build=False` (every host of a slice but host 0) this process does not compute it: it waits
    for the header host 0 writes last, then reads its rows, so a slice of P hosts computes and uploads
    the order once, not P times. A host 0 that dies meanwhile is a lost peer (the others exit 3).
    `progress` is called after each poll storage answered and each part stored (the watchdog's beat)."""
    import time

    directory = storage.join(order_dir, order_key(fingerprint, epoch))
    found = OrderFile.open(directory, fingerprint, n, seed, epoch)
    if found is None and not build:
        end = time.monotonic() + wait_s
        print(f"waiting for host 0 to store the epoch-{epoch} order in {directory}", flush=True)
        while found is None:
            if time.monotonic() >= end:
                from olmo_ctl.core.errors import OlmoCtlError

                raise OlmoCtlError(
                    f"host 0 stored no epoch-{epoch} order in `{directory}` within {wait_s:.0f} s",
                    "the attempt can be retried",
                    exit_code=3,
                )
            time.sleep(poll_s)
            found = OrderFile.open(directory, fingerprint, n, seed, epoch)
            if progress is not None:
                progress()
    if found is None:
        build_order(directory, fingerprint, n, seed, epoch, progress=progress)
        found = OrderFile.open(directory, fingerprint, n, seed, epoch)
        if found is None:
            raise BadInput(
                f"the epoch order written to `{directory}` cannot be read back",
                "check that the run directory is writable",
            )
    return found
