"""Is this exception transient (storage, network, a lost peer host), so that trying again may succeed?

One predicate for the storage layer (which turns a transient client error into `Unreachable`, exit
3), `monitor` (the same, for errors the storage layer did not see) and the trainer (which names the
cause in its exit-3 line). The clients we talk through raise many unrelated types (google-api-core,
requests, urllib3, aiohttp under gcsfs, tensorstore, XLA's runtime errors), most of which we cannot
import without importing the client, so the rules look at the class's name and module. Pure: no
imports of any client.

Transient, looking at the exception, its `__cause__` and its `__context__`:
  - our `Unreachable`, and any `OSError` (connection refused or reset, timeouts, DNS);
  - a class whose name says so: `Connect` (aiohttp's ClientConnectorError, requests' ConnectionError),
    `Timeout`, `ServiceUnavailable`, `TooManyRequests`, `InternalServerError`, `GatewayTimeout`,
    `DeadlineExceeded`, `RetryError` (google-api-core's retry deadline);
  - a class from a storage or HTTP client's module (`google.`, `requests`, `urllib3`, `http.`);
  - a runtime error (XLA's `XlaRuntimeError`, ...) saying another host or the coordination service
    went away (`UNAVAILABLE`, `DEADLINE_EXCEEDED`, a heartbeat, a barrier timing out, ...).
Anything else (ValueError, KeyError, a shape mismatch) is not: a bug, or a deterministic failure.
"""

from __future__ import annotations

import re

from olmo_ctl.core.errors import Unreachable

TRANSIENT_NAME_PARTS = (
    "Connect",
    "Timeout",
    "ServiceUnavailable",
    "TooManyRequests",
    "InternalServerError",
    "GatewayTimeout",
    "DeadlineExceeded",
    "RetryError",
)
CLIENT_MODULES = ("google.", "requests", "urllib3", "http.")

# A multi-host runtime error that means another host (or the coordination service) went away: a
# preempted or failed peer, not a bug here.
PEER_LOST = re.compile(
    r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|ABORTED)\b|coordination service|heartbeat|"
    r"barrier timed out|connection reset|socket closed|task .* (?:failed|disconnected)",
    re.IGNORECASE,
)


def is_transient(e: BaseException) -> bool:
    """True when `e` (or its direct cause or context) is storage, network or peer trouble."""
    return any(_transient_itself(x) for x in (e, e.__cause__, e.__context__) if x is not None)


def _transient_itself(e: BaseException) -> bool:
    if isinstance(e, Unreachable | OSError):
        return True
    cls = type(e)
    if any(part in cls.__name__ for part in TRANSIENT_NAME_PARTS):
        return True
    if (cls.__module__ or "").startswith(CLIENT_MODULES):
        return True
    return "RuntimeError" in cls.__name__ and bool(PEER_LOST.search(str(e)))
