"""TFRecord framing and batch decoding of event files: bytes in, per-tag (steps, wall times, values) out.

* Framing walks the records (`u64 length, u32 masked crc32c(length), data, u32 masked crc32c(data)`)
  speculatively: a trainer writes the same tags in the same order every step, so record sizes repeat
  with a short period; a block of repetitions is verified at once on a 2-D numpy view of the buffer
  (each header is 12 known bytes) and the plain loop only runs where the pattern changes.
* Decoding works by *template*: records that share every byte except the wall time, the step varint
  and the scalar value(s) have one layout (one column of a block; else records grouped by length). The
  first record is parsed by `olmo_ctl.observe.proto`, which notes where those fields lie; every record
  of the group is then CRC-checked *against that layout* at once (CRC32C is affine in the message
  bytes, so a record's CRC is the template's CRC xor table lookups for the bytes that differ). A record
  whose CRC matches has exactly the template's structure (bar a 2^-32 collision) and its fields are
  gathered with numpy. The rest fall back to the per-record decoder with a real `google_crc32c` check.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from olmo_ctl.observe.crc import crc32c, masked_crc, masked_crc_np, position_tables
from olmo_ctl.observe.proto import Decoded, ProtoError, decode_event

_MAX_TEMPLATE_LEN = 4096  # records longer than this (graphs, hparams) take the slow path
_MAX_TEMPLATES_PER_LENGTH = 64
_UNPACK_HDR = struct.Struct("<QI").unpack_from

# ---------------------------------------------------------------------------------------------
# Framing


@dataclass
class Frame:
    """Records found in a buffer, in file order: `seq` segments (offsets and data lengths) and `blk`
    segments (a run of `reps` repetitions of a fixed pattern of record lengths starting at `pos`)."""

    segments: list  # ("seq", offs, lens) | ("blk", pos, reps, pat)
    records: int
    end: int  # first byte not consumed (start of an incomplete or bad record, or len(buf))
    need: int  # bytes needed past `end` to complete the record there (0: nothing pending)
    corrupt: str | None  # a record whose length CRC is wrong: reading this file stops there


_len_crc_cache: dict[int, int] = {}


def _len_crc(n: int) -> int:
    c = _len_crc_cache.get(n)
    if c is None:
        c = masked_crc(struct.pack("<Q", n))
        _len_crc_cache[n] = c
    return c


def frame_records(buf: bytes, arr: np.ndarray) -> Frame:
    total = len(buf)
    segments: list = []
    records = 0
    seq_offs: list[int] = []
    seq_lens: list[int] = []
    pos = 0
    need = 0
    corrupt = None
    since_spec = 0
    spec_reps = 256

    def flush_seq():
        nonlocal seq_offs, seq_lens
        if seq_offs:
            segments.append(("seq", np.array(seq_offs, dtype=np.int64), np.array(seq_lens, dtype=np.int64)))
            seq_offs, seq_lens = [], []

    while True:
        # Plain loop: a few records (or until the end).
        if pos + 12 > total:
            need = 12 - (total - pos) if pos < total else 0
            break
        n, lcrc = _UNPACK_HDR(buf, pos)
        if lcrc != _len_crc(n):
            corrupt = f"bad length checksum at byte {pos}"
            break
        if pos + 16 + n > total:
            need = pos + 16 + n - total
            break
        seq_offs.append(pos)
        seq_lens.append(n)
        records += 1
        pos += 16 + n
        since_spec += 1
        if since_spec < 8:
            continue
        since_spec = 0
        # Speculate: the sizes of the last records repeat with a short period. Verify a block of
        # repetitions at once on a 2-D view (each header is 12 known bytes: the length and its CRC).
        sizes = seq_lens[-48:]
        period = next(
            (
                p
                for p in range(1, min(24, len(sizes) // 3) + 1)
                if sizes[-p:] == sizes[-2 * p : -p] == sizes[-3 * p : -2 * p]
            ),
            0,
        )
        if not period:
            continue
        pat = np.array(sizes[-period:], dtype=np.int64)
        step_bytes = int(pat.sum()) + 16 * period
        # grow the block while the pattern holds, so an early break (an eval record every N steps)
        # never costs a pass over the rest of the buffer
        reps = min((total - pos) // step_bytes, spec_reps)
        if reps < 4:
            continue
        blk = arr[pos : pos + reps * step_bytes].reshape(reps, step_bytes)
        ok = np.ones(reps, dtype=bool)
        c = 0
        for L in pat.tolist():
            hdr = np.frombuffer(struct.pack("<QI", L, _len_crc(L)), dtype=np.uint8)
            ok &= (blk[:, c : c + 12] == hdr).all(axis=1)
            c += L + 16
        m = int(np.argmin(ok)) if not ok.all() else reps  # whole repetitions that check out
        spec_reps = spec_reps * 4 if m == reps else 256
        if m:
            flush_seq()
            segments.append(("blk", pos, m, pat))
            records += m * period
            pos += m * step_bytes
    flush_seq()
    return Frame(segments, records, pos, need, corrupt)


# ---------------------------------------------------------------------------------------------
# Decoding many records


@dataclass
class Batch:
    """Scalars decoded from one chunk, per tag, in record order."""

    tags: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    bad_records: int = 0
    records: int = 0


class _Unusable(Exception):
    """The template record cannot serve as a template (corrupt, or not fixed-layout)."""

    def __init__(self, corrupt: bool, dec=None):
        self.corrupt = corrupt
        self.dec = dec


def _template(rec: bytes, stored_crc: int) -> Decoded | None:
    """Parse a record as a template. None: a valid record with no scalars (file_version, graphs...)."""
    if masked_crc(rec) != stored_crc:
        raise _Unusable(True)
    try:
        dec = decode_event(rec, 0, len(rec))
    except ProtoError:
        raise _Unusable(True) from None
    if not dec.values:
        return None
    if any(kind not in ("f4", "f8") for _t, _v, kind, _o in dec.values):
        raise _Unusable(False, dec)
    return dec


def _apply_template(dec: Decoded, rec: bytes, col, stored_crc: np.ndarray):
    """Check every record against the template's layout by CRC; decode the ones that match.
    `col(j)` gives byte j of every record. Returns (ok mask, steps, walls, [(tag, values)]) for ok rows."""
    L = len(rec)
    var: list[int] = []
    if dec.wall_off is not None:
        var += range(dec.wall_off, dec.wall_off + 8)
    if dec.step_off is not None:
        var += range(dec.step_off, dec.step_off + dec.step_len)
    for _t, _v, kind, o in dec.values:
        var += range(o, o + (4 if kind == "f4" else 8))
    tpl = np.frombuffer(rec, dtype=np.uint8)
    ptab = position_tables(L)
    crc = np.full(len(stored_crc), crc32c(rec), dtype=np.uint32)
    cols = {}
    for j in var:
        c = col(j)
        cols[j] = c
        crc ^= ptab[j][c ^ tpl[j]]
    ok = masked_crc_np(crc) == stored_crc
    if dec.step_off is not None:
        last = dec.step_off + dec.step_len - 1
        for j in range(dec.step_off, last):
            ok &= (cols[j] & 0x80) != 0
        ok &= (cols[last] & 0x80) == 0
    n_ok = int(ok.sum())
    all_ok = n_ok == len(ok)

    def take(j):
        return cols[j] if all_ok else cols[j][ok]

    def gather(o, n):
        m = np.empty((n_ok, n), dtype=np.uint8)
        for k in range(n):
            m[:, k] = take(o + k)
        return m

    w = gather(dec.wall_off, 8).view("<f8")[:, 0] if dec.wall_off is not None else np.zeros(n_ok)
    s = np.zeros(n_ok, dtype=np.int64)
    if dec.step_off is not None:
        for k in range(dec.step_len):
            s |= (take(dec.step_off + k).astype(np.int64) & 0x7F) << (7 * k)
    vals = []
    for tag, _v, kind, o in dec.values:
        n = 4 if kind == "f4" else 8
        vals.append((tag, gather(o, n).view("<f4" if n == 4 else "<f8")[:, 0].astype(np.float64)))
    return ok, s, w, vals


def decode_records(buf: bytes, arr: np.ndarray, fr: Frame) -> Batch:
    out = Batch(records=fr.records)
    pieces: dict[str, list] = {}  # tag -> [(order, step, wall, value)]
    left_offs: list[np.ndarray] = []
    left_lens: list[np.ndarray] = []

    def emit(order, s, w, vals):
        for tag, v in vals:
            pieces.setdefault(tag, []).append((order, s, w, v))

    for seg in fr.segments:
        if seg[0] == "seq":
            left_offs.append(seg[1])
            left_lens.append(seg[2])
            continue
        _k, pos, reps, pat = seg
        step_bytes = int(pat.sum()) + 16 * len(pat)
        blk = arr[pos : pos + reps * step_bytes].reshape(reps, step_bytes)
        rows = np.arange(reps, dtype=np.int64) * step_bytes + pos
        c = 0
        for L in pat.tolist():
            d = c + 12
            stored = np.ascontiguousarray(blk[:, d + L : d + L + 4]).view("<u4")[:, 0]
            rec = buf[pos + d : pos + d + L]
            dec: Decoded | Literal[False] | None  # False: no template fits these bytes
            try:
                dec = _template(rec, int(stored[0])) if 0 < L <= _MAX_TEMPLATE_LEN else False
            except _Unusable:
                dec = False
            if dec is None:  # value-less (file_version...): rows with another CRC get a closer look
                other = stored != stored[0]
                if other.any():
                    left_offs.append(rows[other] + c)
                    left_lens.append(np.full(int(other.sum()), L, dtype=np.int64))
            elif dec is False:
                left_offs.append(rows + c)
                left_lens.append(np.full(reps, L, dtype=np.int64))
            else:
                ok, s, w, vals = _apply_template(dec, rec, lambda j, d=d, blk=blk: blk[:, d + j], stored)
                emit(rows[ok] + c if not ok.all() else rows + c, s, w, vals)
                if not ok.all():
                    left_offs.append(rows[~ok] + c)
                    left_lens.append(np.full(int((~ok).sum()), L, dtype=np.int64))
            c += L + 16
    if left_offs:
        _decode_scattered(buf, arr, np.concatenate(left_offs), np.concatenate(left_lens), out, emit)
    for tag, parts in pieces.items():
        if len(parts) == 1:
            o, s, w, v = parts[0]
        else:
            o = np.concatenate([p[0] for p in parts])
            s = np.concatenate([p[1] for p in parts])
            w = np.concatenate([p[2] for p in parts])
            v = np.concatenate([p[3] for p in parts])
            if len(o) > 1 and not (o[1:] > o[:-1]).all():
                srt = np.argsort(o, kind="stable")  # timsort: merging a few sorted runs is linear
                s, w, v = s[srt], w[srt], v[srt]
        out.tags[tag] = (s, w, v)
    return out


def _decode_scattered(
    buf: bytes, arr: np.ndarray, offs: np.ndarray, lens: np.ndarray, out: Batch, emit
) -> None:
    """Records at arbitrary offsets: grouped by length, each group decoded by templates."""
    data_offs = offs + 12
    crc_pos = data_offs + lens
    stored_all = arr[crc_pos[:, None] + np.arange(4)].copy().view("<u4")[:, 0]
    slow: list[int] = []
    order = np.argsort(lens, kind="stable")
    bounds = np.flatnonzero(np.diff(lens[order])) + 1
    for grp in np.split(order, bounds):
        if not grp.size:
            continue
        L = int(lens[grp[0]])
        remaining = grp
        tries = 0
        while remaining.size:
            if L > _MAX_TEMPLATE_LEN or L == 0 or tries >= _MAX_TEMPLATES_PER_LENGTH:
                slow.extend(remaining.tolist())
                break
            tries += 1
            first = int(remaining[0])
            d0 = int(data_offs[first])
            rec = buf[d0 : d0 + L]
            try:
                dec = _template(rec, int(stored_all[first]))
            except _Unusable as e:
                if e.corrupt:
                    out.bad_records += 1
                else:
                    slow.append(first)
                remaining = remaining[1:]
                continue
            if dec is None:
                remaining = remaining[1:]
                continue
            base = data_offs[remaining]
            ok, s, w, vals = _apply_template(
                dec, rec, lambda j, base=base: arr[base + j], stored_all[remaining]
            )
            emit(offs[remaining[ok]], s, w, vals)
            remaining = remaining[~ok]
    for i in slow:
        d0 = int(data_offs[i])
        L = int(lens[i])
        rec = buf[d0 : d0 + L]
        if masked_crc(rec) != int(stored_all[i]):
            out.bad_records += 1
            continue
        try:
            dec = decode_event(rec, 0, L)
        except ProtoError:
            out.bad_records += 1
            continue
        one = np.array([offs[i]])
        emit(
            one,
            np.array([dec.step], dtype=np.int64),
            np.array([dec.wall_time]),
            [(tag, np.array([val])) for tag, val, _k, _o in dec.values],
        )
