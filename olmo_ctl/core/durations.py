"""Durations as people write them on a command line or in a timeline: `90s`, `30m`, `2h`, `1h30m`.

One parser for every option and file that takes a duration (`sandbox fault --for`, a fault timeline's
`at`, and the supervisor's limits that follow), so `90s` means the same everywhere. A bare number is
seconds. Pure: text in, seconds out, `BadInput` for anything else.
"""

from __future__ import annotations

import re

from olmo_ctl.core.errors import BadInput

_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_WHOLE = re.compile(r"^(?:\d+(?:\.\d+)?[smhd])+$")


def parse_duration(text: object, what: str = "duration") -> float:
    """Seconds in `text` (`90s`, `30m`, `2h`, `1h30m`, `1d`, or a bare number of seconds); `what`
    names the option or key in the one-line error."""
    s = str(text).strip().lower() if text is not None else ""
    if isinstance(text, int | float) and not isinstance(text, bool) and text >= 0:
        return float(text)
    if re.fullmatch(r"\d+(?:\.\d+)?", s):
        return float(s)
    if not s or not _WHOLE.match(s):
        raise BadInput(f"{what} `{text}` is not a duration", "write it as 90s, 30m, 2h or 1h30m")
    return sum(float(n) * _UNIT_S[u] for n, u in _PART.findall(s))


def format_duration(seconds: float) -> str:
    """The short form `parse_duration` reads back: 5400 -> `1h30m`, 90 -> `1m30s`."""
    s = int(round(max(0.0, seconds)))
    out = ""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            out += f"{s // size}{unit}"
            s %= size
    return out + (f"{s}s" if s or not out else "")
