"""Minimal protobuf decoding of TensorBoard's Event / Summary / Value / TensorProto (scalars only).

A hand-written decoder, no generated classes: `decode_event` returns the wall time, the step and every
scalar value of one record together with the byte offsets where they lie, so that
`olmo_ctl.observe.codec` can use the record as a template for others of the same layout.

Both scalar forms are read: classic `simple_value` and tensor scalars (`tensorboard.summary.Writer`:
`float_val`, `double_val`, `tensor_content`, integer and half types).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_DT_FLOAT, _DT_DOUBLE, _DT_INT32, _DT_INT64, _DT_BOOL, _DT_BF16, _DT_HALF = 1, 2, 3, 9, 10, 14, 19
_UNPACK_F4 = struct.Struct("<f").unpack_from
_UNPACK_F8 = struct.Struct("<d").unpack_from


class ProtoError(ValueError):
    pass


def _varint(b, i: int, end: int) -> tuple[int, int]:
    shift = 0
    v = 0
    while True:
        if i >= end or shift > 63:
            raise ProtoError("bad varint")
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
                raise ProtoError("short fixed64")
            yield fn, wt, None, i, 8
            i += 8
        elif wt == 2:
            n, i = _varint(b, i, end)
            if i + n > end:
                raise ProtoError("short bytes")
            yield fn, wt, None, i, n
            i += n
        elif wt == 5:
            if i + 4 > end:
                raise ProtoError("short fixed32")
            yield fn, wt, None, i, 4
            i += 4
        else:
            raise ProtoError(f"wire type {wt}")


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
class Decoded:
    wall_time: float
    step: int
    values: list  # [(tag, value, kind, offset)]
    wall_off: int | None
    step_off: int | None
    step_len: int


def decode_event(b, start: int, end: int) -> Decoded:
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
    return Decoded(wall, step, values, wall_off, step_off, step_len)
