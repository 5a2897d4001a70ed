"""Human output laid out to a width: lines broken at spaces, tables whose free-text columns wrap.

Pure: the width is the caller's (`cli.app.output_width`: $COLUMNS, the terminal's, or None for a pipe,
where nothing is broken). A word longer than the width (a path, a URL) is kept whole: copied, it still
works.
"""

from __future__ import annotations

import difflib
import re
import textwrap
from collections.abc import Sequence


def wrap(text: str, width: int | None, indent: int | str = 2) -> list[str]:
    """`text` (one line) as lines of at most `width` columns, broken at spaces only, the continuation
    lines indented by `indent` (columns, or the prefix itself), less where a long word would not fit
    beside it; `width` None: `[text]`."""
    if width is None or len(text) <= width:
        return [text]
    first, *rest = textwrap.wrap(
        text,
        width,
        subsequent_indent=indent if isinstance(indent, str) else " " * indent,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [text]
    return [first] + [
        line if len(line) <= width else " " * max(0, width - len(line.lstrip())) + line.lstrip()
        for line in rest
    ]


def fit(lines: list[str] | str, width: int | None, indent: int = 2, *, align: bool = False) -> list[str]:
    """Each line wrapped to `width` (`wrap`), its continuation indented `indent` columns past the
    line's own indentation; `align`: under the line's second column (`label   value...`), where that
    starts in the left half."""
    out: list[str] = []
    for line in lines.splitlines() if isinstance(lines, str) else lines:
        lead = len(line) - len(line.lstrip(" "))
        hang = lead + indent
        if align and width is not None:
            m = _SECOND_COLUMN.match(line)
            if m and m.end() <= width // 2:
                hang = m.end()
        out += wrap(line, width, hang)
    return out


_SECOND_COLUMN = re.compile(r"^ *\S.*?\S {2,}(?=\S)")


def table_lines(
    head: Sequence[str] | None,
    rows: Sequence[Sequence[str]],
    *,
    right: tuple[str, ...] | set[str] = (),
    flex: tuple[str, ...] = (),
    under: str | None = None,
    width: int | None = None,
    prefix: str = "",
    after: list[list[str]] | None = None,
) -> list[str]:
    """A table as lines: columns two spaces apart, `right` ones right-aligned, each line `prefix` +
    cells, trailing blanks stripped. Wider than `width`, the `flex` columns (free text) wrap within
    their cells, down to their longest word; if that is not enough, the `under` column leaves the
    table and is written under its row, indented; then the columns close up to one space. `head`
    None: no header row (columns are then named by position, "0", "1", ...). `after[i]`: lines
    written under data row i, as given."""
    names = tuple(head) if head is not None else tuple(str(i) for i in range(len(rows[0]) if rows else 0))
    cols = list(range(len(names)))
    below: list[str] | None = None
    if width is not None and under is not None and under in names:
        k = names.index(under)
        if not _fits(names, rows, cols, flex, width - len(prefix), 2, head is not None):
            below = [row[k] for row in rows]
            cols = [c for c in cols if c != k]
    gap = 2
    if width is not None and not _fits(names, rows, cols, flex, width - len(prefix), 2, head is not None):
        gap = 1
    widths = _widths(names, rows, cols, flex, None if width is None else width - len(prefix), gap, head)
    out: list[str] = []
    for r, row in enumerate([*([head] if head is not None else []), *rows]):
        cells = [wrap(row[c], widths[c], 0) if names[c] in flex else [row[c]] for c in cols]
        for i in range(max(len(cell) for cell in cells) if cells else 0):
            parts = []
            for c, cell in zip(cols, cells, strict=True):
                text = cell[i] if i < len(cell) else ""
                parts.append(f"{text:>{widths[c]}}" if names[c] in right else f"{text:<{widths[c]}}")
            out.append((prefix + (" " * gap).join(parts)).rstrip())
        data_row = r - (1 if head is not None else 0)
        if below is not None and data_row >= 0 and below[data_row]:
            indent = prefix + "  "
            out += wrap(indent + below[data_row], width, indent)
        if after is not None and data_row >= 0:
            out += after[data_row]
    return out


def _natural(names, rows, c, head) -> int:
    return max([len(names[c])] * (head is not None) + [len(row[c]) for row in rows] + [0])


FLEX_MIN = 16  # a free-text column narrower than this leaves the table (`under`) or wraps no further


def _least(names, rows, c, head) -> int:
    """A flex column's narrowest: its header, its longest word, and FLEX_MIN (or its natural width)."""
    words = [len(w) for row in rows for w in row[c].split()]
    return max([len(names[c])] * (head is not None) + words + [min(FLEX_MIN, _natural(names, rows, c, head))])


def _fits(names, rows, cols, flex, width, gap, has_head) -> bool:
    head = names if has_head else None
    least = sum(
        _least(names, rows, c, head) if names[c] in flex else _natural(names, rows, c, head) for c in cols
    )
    return least + gap * (len(cols) - 1) <= width


def _widths(names, rows, cols, flex, width, gap, head) -> dict[int, int]:
    """Each column's width: its natural one, the `flex` ones narrowed (widest first) until the table
    fits `width` or each is at its least."""
    w = {c: _natural(names, rows, c, head) for c in cols}
    if width is None:
        return w
    least = {c: _least(names, rows, c, head) for c in cols if names[c] in flex}
    over = sum(w.values()) + gap * (len(cols) - 1) - width
    while over > 0:
        c = max((c for c in least if w[c] > least[c]), key=lambda c: w[c] - least[c], default=None)
        if c is None:
            break
        w[c] -= 1
        over -= 1
    return w


def closest(name: str, names: list[str] | set[str], cutoff: float = 0.75) -> str | None:
    """The one name of `names` closest to `name` (difflib's ratio at least `cutoff`); None when none
    is, or when two are equally close (`cpu-l`: cpu-1 or cpu-8?)."""
    best = difflib.get_close_matches(name, sorted(set(names)), n=2, cutoff=cutoff)
    if not best:
        return None
    if len(best) == 2:
        score = [difflib.SequenceMatcher(None, name, b).ratio() for b in best]
        if score[0] == score[1]:
            return None
    return best[0]
