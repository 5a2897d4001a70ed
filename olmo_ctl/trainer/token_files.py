"""The token files a dataset reads, kept open: the least recently used closed past a bound.

Corpora have thousands of files and each memory map holds a file descriptor, so the fixed-length
dataset (`trainer/data.py`) and the packed one (`trainer/packed.py`) keep at most `MAX_OPEN_MAPS`
local maps, and at most `MAX_REMOTE_FILES` whole gs:// files in memory (the packer reads a group's
files whole). Reads of a few instances from gs:// are ranged reads and are not kept. Thread-safe:
the loader's prefetch workers share one cache; a reader still holding an evicted map keeps it alive.
numpy only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from olmo_ctl import storage
from olmo_ctl.core.errors import BadInput
from olmo_ctl.data.files import TOKEN_BYTES, TOKEN_DTYPE, TokenFile

MAX_OPEN_MAPS = 256  # local memory maps kept open
MAX_REMOTE_FILES = 2  # whole gs:// files kept in memory


class TokenFiles:
    """`files[fi]`'s tokens by index: whole (`tokens`) or a range (`read`)."""

    def __init__(self, files: list[TokenFile], max_open_maps: int | None = None):
        self.files = files
        self.max_open_maps = MAX_OPEN_MAPS if max_open_maps is None else max_open_maps
        self._open: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Files held open now."""
        return len(self._open)

    def tokens(self, fi: int) -> np.ndarray:
        """Every token of file `fi`: a read-only memory map (local) or the whole object (gs://)."""
        with self._lock:
            m = self._open.get(fi)
            if m is not None:
                self._open.move_to_end(fi)
                return m
        f = self.files[fi]
        remote = storage.is_gcs(f.path)
        if remote:
            m = np.frombuffer(storage.store_for(f.path).read_bytes(f.path), dtype=TOKEN_DTYPE)
        else:
            m = np.memmap(f.path, dtype=TOKEN_DTYPE, mode="r", shape=(f.tokens,))
        with self._lock:
            self._open[fi] = m
            while len(self._open) > (MAX_REMOTE_FILES if remote else self.max_open_maps):
                self._open.popitem(last=False)
        return m

    def read(self, fi: int, start: int, end: int) -> np.ndarray:
        """Tokens `start:end` of file `fi` (local: a view of its map; gs://: one ranged read)."""
        f = self.files[fi]
        if not storage.is_gcs(f.path):
            return np.asarray(self.tokens(fi)[start:end])
        out = np.frombuffer(
            storage.store_for(f.path).read_range(f.path, start * TOKEN_BYTES, end * TOKEN_BYTES),
            dtype=TOKEN_DTYPE,
        )
        if len(out) != end - start:
            raise BadInput(
                f"`{f.path}` is shorter than when the dataset was listed", "token files must not change"
            )
        return out
