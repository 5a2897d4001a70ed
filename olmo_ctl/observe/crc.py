"""CRC32C (Castagnoli), reflected polynomial 0x82F63B78, as TFRecord uses it.

`masked_crc` is the checksum a TFRecord header and footer hold. The numpy helpers check many records
of one layout at once: CRC32C is affine in the message bytes, so a record's CRC is a template's CRC xor
the `position_tables` contributions of the bytes that differ (see `olmo_ctl.observe.codec`).
"""

from __future__ import annotations

import numpy as np

_POLY = 0x82F63B78


def _make_table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> np.uint32(1)) ^ np.uint32(_POLY), t >> np.uint32(1)).astype(np.uint32)
    return t


_T = _make_table()
_MASK_DELTA = 0xA282EAD8


def crc32c(data: bytes) -> int:
    try:
        import google_crc32c

        return google_crc32c.value(bytes(data))
    except ImportError:  # pragma: no cover - google-crc32c is a dependency
        r = 0xFFFFFFFF
        for b in data:
            r = int(_T[(r ^ b) & 0xFF]) ^ (r >> 8)
        return r ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def masked_crc_np(c: np.ndarray) -> np.ndarray:
    c = c.astype(np.uint32)
    return ((c >> np.uint32(15)) | (c << np.uint32(17))) + np.uint32(_MASK_DELTA)


_pos_tables: dict[int, np.ndarray] = {}


def position_tables(length: int) -> np.ndarray:
    """(length, 256) uint32: the raw CRC contribution of byte value b at position j of a `length`-byte
    message (zero register, zero bytes elsewhere). Two messages of one length differ in CRC by the xor
    of these contributions over the bytes where they differ."""
    tab = _pos_tables.get(length)
    if tab is None:
        tab = np.empty((length, 256), dtype=np.uint32)
        r = _T.copy()
        tab[length - 1] = r
        for j in range(length - 2, -1, -1):
            r = _T[r & np.uint32(0xFF)] ^ (r >> np.uint32(8))
            tab[j] = r
        _pos_tables[length] = tab
    return tab
