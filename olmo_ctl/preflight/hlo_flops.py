"""Matmul FLOPs of a compiled XLA program, read from its HLO text, with loop trip counts.

XLA's `cost_analysis()` counts the body of every while loop once (the grad-accumulation scan, the
layer-group scan and the blocked attention's loops). `hlo_flops` walks the compiled HLO, infers each
loop's trip count from its condition (`i < N`, or XLA's `known_trip_count`) and adds the matmul FLOPs
(dot/convolution, counted as XLA counts them) of every repeated iteration. A conditional counts its
most expensive branch, as XLA does. Element-wise FLOPs are not counted here. Each matmul is also
classified as a weight matmul, an attention einsum or a rematerialised recompute (`matmul_kind`).
Custom calls (Pallas kernels such as splash attention) carry no FLOPs in XLA's count; a caller may
count them (`kernel_flops`), with trip counts, in a separate total (`HloFlops.kernel`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_COMP_HEAD = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"^\(?([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclass
class _Instr:
    name: str
    shape: tuple[int, ...] | None
    op: str
    operands: list[str]
    attrs: str
    args: str  # the raw text between the parentheses (a constant's value)


def _split_operands(rest: str) -> tuple[str, str]:
    depth = 1
    for i, ch in enumerate(rest):
        if ch in "({":
            depth += 1
        elif ch in ")}":
            depth -= 1
            if depth == 0:
                return rest[:i], rest[i + 1 :]
    return rest, ""


def parse_hlo(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    comps: dict[str, list[_Instr]] = {}
    entry = None
    cur: list[_Instr] | None = None
    for line in text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            m = _COMP_HEAD.match(line.strip())
            if m:
                cur = comps.setdefault(m.group(1), [])
                if line.startswith("ENTRY"):
                    entry = m.group(1)
            continue
        if cur is None:
            continue
        m = _INSTR.match(line)
        if not m:
            if cur and cur[-1].op == "custom-call" and line.strip() not in ("}", ""):
                cur[-1].attrs += "\n" + line  # a custom call's metadata spans several lines
            continue
        name, shape_txt, op, rest = m.groups()
        ops_txt, attrs = _split_operands(rest)
        a = _ARRAY.match(shape_txt)
        shape = (
            tuple(int(x) for x in a.group(2).split(",") if x) if a and not shape_txt.startswith("(") else None
        )
        cur.append(_Instr(name, shape, op, re.findall(r"%([\w.\-]+)", ops_txt), attrs, ops_txt))
    return comps, entry


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=(\{{[^}}]*\}}|[^,\s]+)", attrs)
    return m.group(1) if m else None


def _dims(txt: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", txt or "")]


def _valid_taps(
    out: int, size: int, stride: int, pad_lo: int, in_size: int, lhs_dil: int, rhs_dil: int
) -> int:
    """Sum over output positions of the kernel taps that land on a real input element."""
    import numpy as np

    o = np.arange(out, dtype=np.int64)[:, None]
    k = np.arange(size, dtype=np.int64)[None, :]
    p = o * stride + k * rhs_dil - pad_lo
    dilated = (in_size - 1) * lhs_dil + 1
    ok = (p >= 0) & (p < dilated) & (p % lhs_dil == 0)
    return int(ok.sum())


def _conv_flops(ins: _Instr, shapes: dict[str, tuple[int, ...] | None]) -> float:
    labels = _attr(ins.attrs, "dim_labels")
    if not labels or ins.shape is None or len(ins.operands) < 2:
        return 0.0
    lhs_l, rest = labels.split("_", 1)
    rhs_l, out_l = rest.split("->")
    lhs, rhs, out = shapes.get(ins.operands[0]), shapes.get(ins.operands[1]), ins.shape
    if lhs is None or rhs is None:
        return 0.0
    in_feat = rhs[rhs_l.index("i")]
    spatial = sorted(c for c in out_l if c.isdigit())
    win = _attr(ins.attrs, "window") or ""

    def per_dim(key: str, default: int) -> list[int]:
        m = re.search(rf"\b{key}=([0-9_x]+)", win)
        if not m:
            return [default] * len(spatial)
        return [int(v.split("_")[0]) for v in m.group(1).split("x")]

    sizes = per_dim("size", 1)
    strides = per_dim("stride", 1)
    lhs_d = per_dim("lhs_dilate", 1)
    rhs_d = per_dim("rhs_dilate", 1)
    pm = re.search(r"\bpad=([0-9_x\-]+)", win)
    pads = [int(v.split("_")[0]) for v in pm.group(1).split("x")] if pm else [0] * len(spatial)
    taps = 1
    for i, c in enumerate(spatial):
        taps *= _valid_taps(
            out[out_l.index(c)], sizes[i], strides[i], pads[i], lhs[lhs_l.index(c)], lhs_d[i], rhs_d[i]
        )
    non_spatial = out[out_l.index("b")] * out[out_l.index("f")]
    return 2.0 * non_spatial * in_feat * taps


def _dot_flops(ins: _Instr, shapes: dict[str, tuple[int, ...] | None]) -> float:
    lhs = shapes.get(ins.operands[0]) if ins.operands else None
    if lhs is None or ins.shape is None:
        return 0.0
    contracted = math.prod(lhs[d] for d in _dims(_attr(ins.attrs, "lhs_contracting_dims")))
    return 2.0 * math.prod(ins.shape) * contracted


def _trip_count(ins: _Instr, comps: dict[str, list[_Instr]]) -> int | None:
    known = re.search(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)', ins.attrs)
    if known:
        return int(known.group(1))
    cond = comps.get((_attr(ins.attrs, "condition") or "").lstrip("%"))
    if not cond:
        return None
    # JAX loops (scan, map, fori_loop) count an s32 index up from 0 while `index < N`.
    consts = {
        c.name: int(c.args) for c in cond if c.op == "constant" and re.fullmatch(r"-?\d+", c.args.strip())
    }
    root = cond[-1]
    if root.op != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
        return None
    return consts.get(root.operands[1])


_SPEC = re.compile(r"([a-z]+),([a-z]+)->([a-z]+)")


def matmul_kind(ins: _Instr) -> str:
    """`recompute` (a rematerialised forward op), `attention` (scores or values), or `dense`.

    Read from the op name JAX writes into the HLO metadata: recomputed ops sit under
    `rematted_computation`; the attention einsums are the ones whose spec has both a query (q) and
    a key (k) axis (`bhqd,bhkd->bhqk`, `bhqk,bhkd->bhqd`, ...), while every weight matmul is
    `btd,df->btf`-like (see trainer/model.py and trainer/attention.py).
    """
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    name = m.group(1) if m else ""
    if "rematted_computation" in name:
        return "recompute"
    for spec in _SPEC.findall(name):
        if "q" in "".join(spec) and "k" in "".join(spec):
            return "attention"
    return "dense"


_KINDS = ("dense", "attention", "recompute", "kernel")


@dataclass
class HloFlops:
    """Matmul FLOPs of one device's compiled program."""

    with_trip_counts: float  # loop bodies times their trip counts
    body_once: float  # every loop body counted once (how cost_analysis() counts)
    dense: float  # with trip counts: weight matmuls (forward and backward, LM head included)
    attention: float  # with trip counts: attention scores/values (forward and backward)
    recompute: float  # with trip counts: the forward ops rematerialisation runs again
    loops: int
    unresolved_loops: int
    kernel: float = 0.0  # with trip counts: custom calls counted by `kernel_flops` (not in the totals above)


def hlo_flops(text: str, kernel_flops=None) -> HloFlops:
    """Matmul FLOPs of a compiled HLO module, with and without loop trip counts (see module doc).

    `kernel_flops(instr)` -> FLOPs of a custom call (or 0): counted into `HloFlops.kernel` only.
    """
    comps, entry = parse_hlo(text)
    shapes = {i.name: i.shape for instrs in comps.values() for i in instrs}
    memo: dict[tuple[str, bool], tuple[float, ...]] = {}
    stats = {"loops": 0, "unresolved": 0}
    seen_loops: set[str] = set()

    def add(a, b, k=1.0):
        return tuple(x + k * y for x, y in zip(a, b, strict=True))

    def comp(name: str, trips: bool) -> tuple[float, ...]:
        key = (name, trips)
        if key in memo:
            return memo[key]
        memo[key] = (0.0, 0.0, 0.0, 0.0)  # guards against cycles
        total = (0.0, 0.0, 0.0, 0.0)
        for ins in comps.get(name, []):
            if ins.op in ("convolution", "dot"):
                f = _conv_flops(ins, shapes) if ins.op == "convolution" else _dot_flops(ins, shapes)
                one = [0.0, 0.0, 0.0, 0.0]
                one[_KINDS.index(matmul_kind(ins))] = f
                total = add(total, one)
            elif ins.op == "custom-call" and kernel_flops is not None:
                total = add(total, (0.0, 0.0, 0.0, float(kernel_flops(ins) or 0.0)))
            elif ins.op == "while":
                body = (_attr(ins.attrs, "body") or "").lstrip("%")
                n = 1
                if trips:
                    tc = _trip_count(ins, comps)
                    if ins.name not in seen_loops:
                        seen_loops.add(ins.name)
                        stats["loops"] += 1
                        stats["unresolved"] += tc is None
                    n = 1 if tc is None else tc
                total = add(total, comp(body, trips), n)
            elif ins.op == "conditional":
                branches = re.findall(r"%([\w.\-]+)", _attr(ins.attrs, "branch_computations") or "")
                for k in ("true_computation", "false_computation"):
                    v = _attr(ins.attrs, k)
                    if v:
                        branches.append(v.lstrip("%"))
                costs = [comp(b, trips) for b in branches]
                if costs:
                    total = add(total, max(costs, key=lambda c: sum(c[:3])))
            else:
                for k in ("calls", "to_apply"):
                    v = _attr(ins.attrs, k)
                    if v and (k == "calls" or ins.op == "call"):
                        for c in re.findall(r"%?([\w.\-]+)", v):
                            total = add(total, comp(c, trips))
        memo[key] = total
        return total

    if entry is None:
        return HloFlops(0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
    dense, attention, recompute, kernel = comp(entry, True)
    once = sum(comp(entry, False)[:3])
    return HloFlops(
        dense + attention + recompute,
        once,
        dense,
        attention,
        recompute,
        kernel=kernel,
        loops=stats["loops"],
        unresolved_loops=stats["unresolved"],
    )
