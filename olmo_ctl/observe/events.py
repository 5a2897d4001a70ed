"""Fast TensorBoard event reader and tailer (local or gs://), without TensorFlow or TensorBoard.

Why not `EventAccumulator`: it parses every record with protobuf in Python (~9 us a record) and a
stage-1 run logs ~1.4M steps x 8-18 tags. This reader:

* walks the TFRecord framing (`u64 length, u32 masked crc32c(length), data, u32 masked crc32c(data)`)
  speculatively: a trainer writes the same tags in the same order every step, so record sizes repeat
  with a short period; a block of repetitions is verified at once on a 2-D numpy view of the buffer
  (each header is 12 known bytes) and the plain loop only runs where the pattern changes;
* decodes by *template*: records that share every byte except the wall time, the step varint and the
  scalar value(s) have one layout (one column of a block; else records grouped by length). The
  first record is parsed by a small
  hand-written proto decoder that notes where those fields lie; every record of the group is then
  CRC-checked *against that layout* at once (CRC32C is affine in the message bytes, so a record's
  CRC is the template's CRC xor table lookups for the bytes that differ). A record whose CRC matches
  has exactly the template's structure (bar a 2^-32 collision) and its fields are gathered with
  numpy. The rest fall back to the per-record decoder with a real `google_crc32c` check.

Both scalar forms are read: classic `simple_value` and tensor scalars (`tensorboard.summary.Writer`:
`float_val`, `double_val`, `tensor_content`, integer and half types).

Tailing: `EventReader.refresh()` lists the directory and reads only the bytes past each file's
offset; a truncated last record is left for the next refresh. Files are ordered by attempt, start
time and segment (`events.out.tfevents.<time>.<host>.a<attempt>.s<segment>`, see docs/CONTRACTS.md;
other names by their start time); when a step appears again (replayed after a resume) the later record wins and, if its value
differs, the pair is kept in `mismatches` (except for tags that measure time or speed, which a replay
legitimately changes: `VOLATILE_TAG_PREFIXES`).

Measured (benchmarks/monitor_read.py, 1,413,814 steps x 8 tags, 643 MB, a loaded 2-core machine):
`olmo-ctl monitor -o json` 4-7 s end to end against 266-342 s for EventAccumulator; a refresh after
1,000 new steps ~5 ms.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from olmo_ctl import storage
from olmo_ctl.core.contracts import is_event_file, parse_segment_name
from olmo_ctl.core.errors import BadInput

CHUNK_BYTES = 64 << 20  # read files in chunks this large (bounded memory on multi-GB logs)
_MAX_TEMPLATE_LEN = 4096  # records longer than this (graphs, hparams) take the slow path
_MAX_TEMPLATES_PER_LENGTH = 64

# ---------------------------------------------------------------------------------------------
# CRC32C (Castagnoli), reflected polynomial 0x82F63B78, as TFRecord uses it.

_POLY = 0x82F63B78


def _make_table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> np.uint32(1)) ^ np.uint32(_POLY), t >> np.uint32(1)).astype(np.uint32)
    return t


_T = _make_table()
_MASK_DELTA = 0xA282EAD8


def _crc32c_py(data: bytes) -> int:
    try:
        import google_crc32c

        return google_crc32c.value(bytes(data))
    except ImportError:  # pragma: no cover - google-crc32c is a dependency
        r = 0xFFFFFFFF
        for b in data:
            r = int(_T[(r ^ b) & 0xFF]) ^ (r >> 8)
        return r ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    c = _crc32c_py(data)
    return (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _mask_np(c: np.ndarray) -> np.ndarray:
    c = c.astype(np.uint32)
    return ((c >> np.uint32(15)) | (c << np.uint32(17))) + np.uint32(_MASK_DELTA)


_pos_tables: dict[int, np.ndarray] = {}


def _position_tables(length: int) -> np.ndarray:
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


# ---------------------------------------------------------------------------------------------
# Minimal protobuf decoding of Event / Summary / Value / TensorProto.

_DT_FLOAT, _DT_DOUBLE, _DT_INT32, _DT_INT64, _DT_BOOL, _DT_BF16, _DT_HALF = 1, 2, 3, 9, 10, 14, 19
_UNPACK_F4 = struct.Struct("<f").unpack_from
_UNPACK_F8 = struct.Struct("<d").unpack_from
_UNPACK_U64 = struct.Struct("<Q").unpack_from
_UNPACK_HDR = struct.Struct("<QI").unpack_from
_UNPACK_U32 = struct.Struct("<I").unpack_from


class _ProtoError(ValueError):
    pass


def _varint(b, i: int, end: int) -> tuple[int, int]:
    shift = 0
    v = 0
    while True:
        if i >= end or shift > 63:
            raise _ProtoError("bad varint")
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        if not c & 0x80:
            return v, i
        shift += 7


def _fields(b, i: int, end: int):
    """Yield (field number, wire type, value or (start, end), offset of the value)."""
    while i < end:
        key, i = _varint(b, i, end)
        fn, wt = key >> 3, key & 7
        if wt == 0:
            start = i
            v, i = _varint(b, i, end)
            yield fn, wt, v, start, i - start
        elif wt == 1:
            if i + 8 > end:
                raise _ProtoError("short fixed64")
            yield fn, wt, None, i, 8
            i += 8
        elif wt == 2:
            n, i = _varint(b, i, end)
            if i + n > end:
                raise _ProtoError("short bytes")
            yield fn, wt, None, i, n
            i += n
        elif wt == 5:
            if i + 4 > end:
                raise _ProtoError("short fixed32")
            yield fn, wt, None, i, 4
            i += 4
        else:
            raise _ProtoError(f"wire type {wt}")


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _tensor_scalar(b, i: int, end: int):
    """(value, kind, offset) of a scalar TensorProto; kind 'f4'/'f8' when the value sits at a fixed offset
    (template-able), 'x' otherwise; None when the tensor is not a single number."""
    dtype = 0
    n_elems = 1
    content = None
    fvals: list = []
    for fn, wt, v, off, n in _fields(b, i, end):
        if fn == 1 and wt == 0:
            dtype = v
        elif fn == 2 and wt == 2:  # TensorShapeProto: dims (field 2) each with size (field 1)
            for dfn, dwt, _dv, doff, dn in _fields(b, off, off + n):
                if dfn == 2 and dwt == 2:
                    size = 1
                    for sfn, swt, sv, _o, _n in _fields(b, doff, doff + dn):
                        if sfn == 1 and swt == 0:
                            size = _signed64(sv)
                    n_elems *= size
        elif fn == 4 and wt == 2:
            content = (off, n)
        elif fn == 5:  # float_val
            if wt == 2:
                fvals += [(_UNPACK_F4(b, off + 4 * k)[0], "f4", off + 4 * k) for k in range(n // 4)]
            elif wt == 5:
                fvals.append((_UNPACK_F4(b, off)[0], "f4", off))
        elif fn == 6:  # double_val
            if wt == 2:
                fvals += [(_UNPACK_F8(b, off + 8 * k)[0], "f8", off + 8 * k) for k in range(n // 8)]
            elif wt == 1:
                fvals.append((_UNPACK_F8(b, off)[0], "f8", off))
        elif fn in (7, 10, 11, 13):  # int_val, int64_val, bool_val, half_val
            if wt == 2:
                j = off
                while j < off + n:
                    x, j = _varint(b, j, off + n)
                    fvals.append((x, fn, None))
            elif wt == 0:
                fvals.append((v, fn, None))
    if n_elems != 1:
        return None
    if content is not None and content[1] > 0:
        off, n = content
        if dtype == _DT_FLOAT and n == 4:
            return _UNPACK_F4(b, off)[0], "f4", off
        if dtype == _DT_DOUBLE and n == 8:
            return _UNPACK_F8(b, off)[0], "f8", off
        raw = bytes(b[off : off + n])
        if dtype == _DT_INT32 and n == 4:
            return float(struct.unpack("<i", raw)[0]), "x", None
        if dtype == _DT_INT64 and n == 8:
            return float(struct.unpack("<q", raw)[0]), "x", None
        if dtype == _DT_HALF and n == 2:
            return float(np.frombuffer(raw, "<f2")[0]), "x", None
        if dtype == _DT_BF16 and n == 2:
            return float(np.frombuffer(b"\0\0" + raw, "<f4")[0]), "x", None
        if dtype == _DT_BOOL and n == 1:
            return float(raw[0] != 0), "x", None
        return None
    if len(fvals) != 1:
        return None
    x, kind, off = fvals[0]
    if kind in ("f4", "f8"):
        return float(x), kind, off
    if kind == 13:  # half_val holds the raw 16 bits (of a half or a bfloat16)
        bits = x & 0xFFFF
        if dtype == _DT_BF16:
            return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0]), "x", None
        return float(np.array([bits], dtype=np.uint16).view(np.float16)[0]), "x", None
    if kind in (7, 10):  # int_val / int64_val: negative values are sign-extended to 64 bits
        return float(_signed64(x)), "x", None
    return float(x), "x", None


@dataclass
class _Decoded:
    wall_time: float
    step: int
    values: list  # [(tag, value, kind, offset)]
    wall_off: int | None
    step_off: int | None
    step_len: int


def _decode_event(b, start: int, end: int) -> _Decoded:
    """Decode the scalar content of one Event record (positions relative to `b`)."""
    wall = 0.0
    step = 0
    wall_off = None
    step_off = None
    step_len = 0
    values = []
    for fn, wt, v, off, n in _fields(b, start, end):
        if fn == 1 and wt == 1:
            wall = _UNPACK_F8(b, off)[0]
            wall_off = off
        elif fn == 2 and wt == 0:
            step = _signed64(v)
            step_off, step_len = off, n
        elif fn == 5 and wt == 2:  # Summary
            for sfn, swt, _sv, voff, vn in _fields(b, off, off + n):
                if sfn != 1 or swt != 2:
                    continue
                tag = None
                val = None
                for vfn, vwt, _vv, xoff, xn in _fields(b, voff, voff + vn):
                    if vfn == 1 and vwt == 2:
                        tag = bytes(b[xoff : xoff + xn]).decode("utf-8", "replace")
                    elif vfn == 7 and vwt == 2 and tag is None:
                        tag = bytes(b[xoff : xoff + xn]).decode("utf-8", "replace")
                    elif vfn == 2 and vwt == 5:
                        val = (_UNPACK_F4(b, xoff)[0], "f4", xoff)
                    elif vfn == 8 and vwt == 2:
                        val = _tensor_scalar(b, xoff, xoff + xn)
                if tag is not None and val is not None:
                    values.append((tag, float(val[0]), val[1], val[2]))
    return _Decoded(wall, step, values, wall_off, step_off, step_len)


# ---------------------------------------------------------------------------------------------
# Framing


@dataclass
class _Frame:
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


def _frame(buf: bytes, arr: np.ndarray) -> _Frame:
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
        period = next((p for p in range(1, min(24, len(sizes) // 3) + 1)
                       if sizes[-p:] == sizes[-2 * p : -p] == sizes[-3 * p : -2 * p]), 0)
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
    return _Frame(segments, records, pos, need, corrupt)


# ---------------------------------------------------------------------------------------------
# Decoding many records


@dataclass
class _Batch:
    """Scalars decoded from one chunk, per tag, in record order."""

    tags: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    bad_records: int = 0
    records: int = 0


class _Unusable(Exception):
    """The template record cannot serve as a template (corrupt, or not fixed-layout)."""

    def __init__(self, corrupt: bool, dec=None):
        self.corrupt = corrupt
        self.dec = dec


def _template(rec: bytes, stored_crc: int) -> _Decoded | None:
    """Parse a record as a template. None: a valid record with no scalars (file_version, graphs...)."""
    if masked_crc(rec) != stored_crc:
        raise _Unusable(True)
    try:
        dec = _decode_event(rec, 0, len(rec))
    except _ProtoError:
        raise _Unusable(True) from None
    if not dec.values:
        return None
    if any(kind not in ("f4", "f8") for _t, _v, kind, _o in dec.values):
        raise _Unusable(False, dec)
    return dec


def _apply_template(dec: _Decoded, rec: bytes, col, stored_crc: np.ndarray):
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
    ptab = _position_tables(L)
    crc = np.full(len(stored_crc), _crc32c_py(rec), dtype=np.uint32)
    cols = {}
    for j in var:
        c = col(j)
        cols[j] = c
        crc ^= ptab[j][c ^ tpl[j]]
    ok = _mask_np(crc) == stored_crc
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


def _decode(buf: bytes, arr: np.ndarray, fr: _Frame) -> _Batch:
    out = _Batch(records=fr.records)
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


def _decode_scattered(buf: bytes, arr: np.ndarray, offs: np.ndarray, lens: np.ndarray, out: _Batch, emit) -> None:
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
            ok, s, w, vals = _apply_template(dec, rec, lambda j, base=base: arr[base + j], stored_all[remaining])
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
            dec = _decode_event(rec, 0, L)
        except _ProtoError:
            out.bad_records += 1
            continue
        one = np.array([offs[i]])
        emit(one, np.array([dec.step], dtype=np.int64), np.array([dec.wall_time]),
             [(tag, np.array([val])) for tag, val, _k, _o in dec.values])


# ---------------------------------------------------------------------------------------------
# Per-tag series with incremental de-duplication


class _Grow:
    __slots__ = ("a", "n")

    def __init__(self, dtype):
        self.a = np.empty(1024, dtype=dtype)
        self.n = 0

    def extend(self, x: np.ndarray) -> None:
        need = self.n + len(x)
        if need > len(self.a):
            cap = max(need, 2 * len(self.a))
            b = np.empty(cap, dtype=self.a.dtype)
            b[: self.n] = self.a[: self.n]
            self.a = b
        self.a[self.n : need] = x
        self.n = need

    @property
    def view(self) -> np.ndarray:
        return self.a[: self.n]

    def replace(self, x: np.ndarray) -> None:
        self.a = np.array(x, dtype=self.a.dtype)
        self.n = len(x)


@dataclass(frozen=True)
class Series:
    """One tag's scalars, sorted by step, one value per step (the latest record of that step)."""

    tag: str
    steps: np.ndarray  # int64
    wall_times: np.ndarray  # float64, seconds since the epoch
    values: np.ndarray  # float64
    attempts: np.ndarray  # int32, the attempt (from the file name; 0 if unknown) that wrote each point

    def __len__(self) -> int:
        return len(self.steps)

    def last(self) -> tuple[int, float] | None:
        return (int(self.steps[-1]), float(self.values[-1])) if len(self.steps) else None


@dataclass(frozen=True)
class Mismatch:
    """A step written twice with different values (an exact resume never produces one)."""

    tag: str
    step: int
    earlier: float
    later: float
    earlier_attempt: int
    later_attempt: int


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a == b) | (np.isnan(a) & np.isnan(b))


def _dedup_last(s, w, v, a):
    """Keep the last record of each step, sorted by step. Returns kept arrays and (dropped, replacement) indices."""
    order = np.argsort(s, kind="stable")
    ss = s[order]
    last = np.ones(len(ss), dtype=bool)
    last[:-1] = ss[1:] != ss[:-1]
    keep = order[last]
    dropped = order[~last]
    repl = keep[np.searchsorted(ss[last], s[dropped])] if dropped.size else dropped
    return keep, dropped, repl


# Tags that measure time or speed: a replayed step legitimately logs another value for them.
VOLATILE_TAG_PREFIXES = ("throughput/device/", "perf/step_time", "checkpoint/", "timing/", "time/", "system/")


def is_volatile(tag: str) -> bool:
    return tag.startswith(VOLATILE_TAG_PREFIXES)


class _TagSeries:
    def __init__(self, tag: str):
        self.tag = tag
        self.volatile = is_volatile(tag)
        self.s = _Grow(np.int64)
        self.w = _Grow(np.float64)
        self.v = _Grow(np.float64)
        self.a = _Grow(np.int32)
        self.replays = 0  # records that were superseded by a later record of the same step
        self.replayed_by_attempt: dict[int, int] = {}
        self.mismatches: list[Mismatch] = []

    def _note_replays(self, old_v, new_v, old_a, new_a, steps):
        self.replays += len(steps)
        for att, cnt in zip(*np.unique(old_a, return_counts=True), strict=True):
            self.replayed_by_attempt[int(att)] = self.replayed_by_attempt.get(int(att), 0) + int(cnt)
        if self.volatile:
            return
        diff = np.flatnonzero(~_same(old_v, new_v))
        for i in diff[: 1000 - len(self.mismatches)]:
            self.mismatches.append(
                Mismatch(self.tag, int(steps[i]), float(old_v[i]), float(new_v[i]), int(old_a[i]), int(new_a[i]))
            )

    def add(self, s, w, v, attempt: int) -> None:
        a = np.full(len(s), attempt, dtype=np.int32)
        if len(s) > 1 and not np.all(s[1:] > s[:-1]):
            keep, dropped, repl = _dedup_last(s, w, v, a)
            if dropped.size:
                self._note_replays(v[dropped], v[repl], a[dropped], a[repl], s[dropped])
            s, w, v, a = s[keep], w[keep], v[keep], a[keep]
        n = self.s.n
        if n == 0 or s[0] > self.s.a[n - 1]:
            self._append(s, w, v, a)
            return
        k = int(np.searchsorted(s, self.s.a[n - 1], side="right"))
        old_s = self.s.view
        pos = np.searchsorted(old_s, s[:k])
        exists = (pos < n) & (old_s[np.minimum(pos, n - 1)] == s[:k])
        if exists.all():
            self._note_replays(self.v.a[pos], v[:k], self.a.a[pos], a[:k], s[:k])
            self.w.a[pos] = w[:k]
            self.v.a[pos] = v[:k]
            self.a.a[pos] = a[:k]
        else:  # steps that fill gaps: merge the slow way
            cs = np.concatenate([old_s, s[:k]])
            cw = np.concatenate([self.w.view, w[:k]])
            cv = np.concatenate([self.v.view, v[:k]])
            ca = np.concatenate([self.a.view, a[:k]])
            keep, dropped, repl = _dedup_last(cs, cw, cv, ca)
            if dropped.size:
                self._note_replays(cv[dropped], cv[repl], ca[dropped], ca[repl], cs[dropped])
            self.s.replace(cs[keep])
            self.w.replace(cw[keep])
            self.v.replace(cv[keep])
            self.a.replace(ca[keep])
        self._append(s[k:], w[k:], v[k:], a[k:])

    def _append(self, s, w, v, a):
        if len(s):
            self.s.extend(s)
            self.w.extend(w)
            self.v.extend(v)
            self.a.extend(a)

    def series(self) -> Series:
        return Series(self.tag, self.s.view, self.w.view, self.v.view, self.a.view)


# ---------------------------------------------------------------------------------------------
# Files and the reader

def file_order_key(path: str) -> tuple:
    """Attempt, segment, start time: later attempts win when steps repeat."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    parsed = parse_segment_name(name)
    if parsed is None:
        return (0, 0, 0, name)
    ts, _host, att, seg = parsed
    return (att or 0, ts, seg or 0, name)


def attempt_of(path: str) -> int:
    return file_order_key(path)[0]


@dataclass
class FileState:
    path: str
    offset: int = 0  # bytes consumed (whole records)
    size: int = 0  # size at the last listing
    records: int = 0
    bad_records: int = 0
    pending_bytes: int = 0  # an incomplete record at the end (still being written, or truncated)
    corrupt: str | None = None
    attempt: int = 0
    generation: int = 0


@dataclass
class RefreshStats:
    files: int = 0
    new_files: int = 0
    bytes_read: int = 0
    records: int = 0
    seconds: float = 0.0


class EventReader:
    """Reads every `*tfevents*` file under a directory, then only what was appended since.

    `refresh()` returns what it read; `series(tag)`, `tags()`, `last()` give the de-duplicated scalars.
    """

    def __init__(self, logdir: str, chunk_bytes: int = CHUNK_BYTES):
        self.logdir = str(logdir).rstrip("/") if str(logdir) != "/" else "/"
        self.store = storage.store_for(self.logdir)
        self.chunk_bytes = chunk_bytes
        self.files: dict[str, FileState] = {}
        self._tags: dict[str, _TagSeries] = {}
        self._max_key: tuple | None = None

    def _reset(self) -> None:
        self.files = {}
        self._tags = {}
        self._max_key = None

    def _list(self) -> list:
        infos, _dirs = self.store.list(self.logdir, recursive=True)
        return sorted((i for i in infos if is_event_file(i.path.rsplit("/", 1)[-1])), key=lambda i: file_order_key(i.path))

    def refresh(self) -> RefreshStats:
        import time

        t0 = time.perf_counter()
        st = RefreshStats()
        infos = self._list()
        new = [i for i in infos if i.path not in self.files]
        replaced = any(self._replaced(self.files[i.path], i) for i in infos if i.path in self.files)
        if replaced or (new and self._max_key is not None
                        and min(file_order_key(i.path) for i in new) < self._max_key):
            # a file that sorts before ones already read, or one rewritten under its name: rebuild, so
            # that "the later record wins" and what we hold still matches the files
            self._reset()
            new = infos
        st.files = len(infos)
        st.new_files = len(new)
        todo: list[FileState] = []
        for info in infos:
            fs = self.files.get(info.path)
            if fs is None:
                fs = self.files[info.path] = FileState(info.path, attempt=attempt_of(info.path))
                key = file_order_key(info.path)
                self._max_key = key if self._max_key is None or key > self._max_key else self._max_key
            fs.size = info.size
            fs.generation = info.generation
            if fs.corrupt or info.size <= fs.offset:
                continue
            todo.append(fs)
        if storage.is_gcs(self.logdir) and len(todo) > 1:
            self._read_many(todo, st)
        else:
            for fs in todo:
                self._read_file(fs, st)
        st.seconds = time.perf_counter() - t0
        return st

    def _read_many(self, todo: list[FileState], st: RefreshStats) -> None:
        """Many objects on GCS (a long run uploads a segment a minute): fetch their new bytes in parallel,
        a window at a time, and decode them in file order."""
        from concurrent.futures import ThreadPoolExecutor

        def fetch(fs: FileState):
            if fs.size - fs.offset > self.chunk_bytes:
                return None  # a big file is read in chunks by _read_file itself
            return self.store.read_range(fs.path, fs.offset, fs.size)

        with ThreadPoolExecutor(max_workers=16) as ex:
            for i in range(0, len(todo), 64):
                window = todo[i : i + 64]
                for fs, buf in zip(window, ex.map(fetch, window), strict=True):
                    self._read_file(fs, st, first=buf)

    @staticmethod
    def _replaced(fs: FileState, info) -> bool:
        if info.size < fs.offset:
            return True  # shrank: not the file we read
        # GCS objects are immutable: a new generation is new content (local generations are mtimes,
        # which an append changes too)
        return storage.is_gcs(info.path) and fs.generation != 0 and info.generation != fs.generation

    def _read_file(self, fs: FileState, st: RefreshStats, first: bytes | None = None) -> None:
        want = self.chunk_bytes
        while fs.offset < fs.size:
            end = min(fs.size, fs.offset + want)
            if first is not None:  # prefetched: the bytes from fs.offset to fs.size
                buf, first, end = first, None, fs.offset + len(first)
            else:
                buf = self.store.read_range(fs.path, fs.offset, end)
            st.bytes_read += len(buf)
            if not buf:
                break
            arr = np.frombuffer(buf, dtype=np.uint8)
            fr = _frame(buf, arr)
            if fr.records:
                batch = _decode(buf, arr, fr)
                fs.records += batch.records
                fs.bad_records += batch.bad_records
                st.records += batch.records
                for tag, (s, w, v) in batch.tags.items():
                    ts = self._tags.get(tag)
                    if ts is None:
                        ts = self._tags[tag] = _TagSeries(tag)
                    ts.add(s, w, v, fs.attempt)
            fs.offset += fr.end
            fs.pending_bytes = 0
            if fr.corrupt:
                fs.corrupt = fr.corrupt
                break
            if fr.need:
                if end >= fs.size:  # an incomplete record at the end: wait for the writer (or it is truncated)
                    fs.pending_bytes = fs.size - fs.offset
                    break
                # a record crosses the chunk boundary: the next read starts at it and holds all of it
                want = max(self.chunk_bytes, (len(buf) - fr.end) + fr.need)
            elif fr.end == 0:
                break
            else:
                want = self.chunk_bytes

    # -- results --------------------------------------------------------------------------------

    def tags(self) -> list[str]:
        return sorted(self._tags)

    def series(self, tag: str) -> Series | None:
        ts = self._tags.get(tag)
        return ts.series() if ts else None

    def last(self) -> dict[str, float]:
        out = {}
        for tag, ts in sorted(self._tags.items()):
            if ts.s.n:
                out[tag] = float(ts.v.a[ts.s.n - 1])
        return out

    def max_step(self) -> int | None:
        steps = [int(ts.s.a[ts.s.n - 1]) for ts in self._tags.values() if ts.s.n]
        return max(steps) if steps else None

    def mismatches(self) -> list[Mismatch]:
        return [m for ts in self._tags.values() for m in ts.mismatches]

    def replays(self, tag: str) -> int:
        ts = self._tags.get(tag)
        return ts.replays if ts else 0

    def replayed_by_attempt(self, tag: str) -> dict[int, int]:
        ts = self._tags.get(tag)
        return dict(ts.replayed_by_attempt) if ts else {}

    def problems(self) -> list[str]:
        """Human-readable notes on truncated or corrupt files."""
        out = []
        for fs in self.files.values():
            name = fs.path.rsplit("/", 1)[-1]
            if fs.corrupt:
                out.append(f"{name}: {fs.corrupt}; the rest of this file is skipped")
            if fs.bad_records:
                out.append(f"{name}: {fs.bad_records} record(s) failed their checksum and were skipped")
            if fs.pending_bytes:
                out.append(f"{name}: last record incomplete ({fs.pending_bytes} bytes; truncated or still being written)")
        return out


def read_scalars(logdir: str) -> EventReader:
    """Read everything once (convenience for tests and `compare`)."""
    if not logdir:
        raise BadInput("no event directory given")
    r = EventReader(logdir)
    r.refresh()
    return r
