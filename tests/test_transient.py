"""One transient-error classifier (core/transient.py) for storage, monitor and the trainer: the table of
exception -> transient (retrying may succeed: exit 3, named as storage/network/peer trouble) or not."""

from __future__ import annotations

import pytest

from olmo_ctl.core.errors import BadInput, Unreachable
from olmo_ctl.core.transient import is_transient


class ClientConnectorError(OSError):  # aiohttp's name, as gcsfs raises it
    pass


class XlaRuntimeError(RuntimeError):
    pass


class ReadTimeoutError(Exception):  # urllib3's name, outside urllib3
    pass


def _from_module(module: str, name: str = "SomeError") -> Exception:
    return type(name, (Exception,), {"__module__": module})("boom")


def _wrapped(inner: BaseException, how: str) -> BaseException:
    outer = RuntimeError("restore failed")
    setattr(outer, how, inner)
    return outer


def _google(name: str) -> Exception:
    from google.api_core import exceptions

    if name == "RetryError":
        return exceptions.RetryError("retry deadline passed", cause=None)
    return getattr(exceptions, name)("boom")


TABLE = [
    # ours and the standard library
    (Unreachable("storage unreachable"), True),
    (ClientConnectorError("Cannot connect to host"), True),
    (TimeoutError(), True),
    (ConnectionResetError(), True),
    (ConnectionRefusedError(), True),
    (OSError("[Errno 113] No route to host"), True),
    (BadInput("bad recipe"), False),
    (ValueError("shape mismatch"), False),
    (KeyError("params"), False),
    (RuntimeError("restore failed"), False),
    # by the class's name (clients we do not import)
    (ReadTimeoutError("read timed out"), True),
    (type("ServiceUnavailable", (Exception,), {})("503"), True),
    (type("TooManyRequests", (Exception,), {})("429"), True),
    (type("GatewayTimeout", (Exception,), {})("504"), True),
    (type("DeadlineExceeded", (Exception,), {})("deadline"), True),
    # by the class's module: a storage or HTTP client
    (_from_module("requests.exceptions"), True),
    (_from_module("urllib3.exceptions"), True),
    (_from_module("http.client", "RemoteDisconnected"), True),
    (_from_module("google.auth.exceptions", "TransportError"), True),
    (_from_module("tensorstore"), False),
    (_from_module("httpx_like"), False),
    # a lost peer host (XLA's runtime errors) against a bug in the program
    (XlaRuntimeError("UNAVAILABLE: task /job:jax_worker/replica:0/task:3 heartbeat timeout"), True),
    (XlaRuntimeError("DEADLINE_EXCEEDED: Barrier timed out. Barrier_id: sync_global"), True),
    (XlaRuntimeError("INTERNAL: gloo all-reduce failed: connection reset by peer"), True),
    (XlaRuntimeError("INVALID_ARGUMENT: Incompatible shapes [4,8] and [4,9]"), False),
    (ValueError("UNAVAILABLE"), False),  # not a runtime error: a bug in our code
    # the cause or the context
    (_wrapped(ConnectionResetError(), "__cause__"), True),
    (_wrapped(TimeoutError(), "__context__"), True),
    (_wrapped(KeyError("params"), "__cause__"), False),
]


@pytest.mark.parametrize(
    "exc, transient", TABLE, ids=[f"{type(e).__name__}-{i}" for i, (e, _) in enumerate(TABLE)]
)
def test_transient_or_not(exc, transient):
    assert is_transient(exc) is transient


@pytest.mark.parametrize(
    "name, transient",
    [
        ("ServiceUnavailable", True),
        ("InternalServerError", True),
        ("GatewayTimeout", True),
        ("TooManyRequests", True),
        ("RetryError", True),
        ("BadRequest", True),  # every google.* client error
    ],
)
def test_google_api_core_errors(name, transient):
    assert is_transient(_google(name)) is transient


def test_storage_and_monitor_turn_transient_errors_into_unreachable(tmp_path):
    """The two places that turn a client error into exit 3 use the same predicate."""
    from olmo_ctl.observe.monitor import storage_guard

    def refused():
        raise ConnectionRefusedError("connection refused")

    with pytest.raises(Unreachable):
        storage_guard(str(tmp_path), refused)

    def bug():
        raise KeyError("params")

    with pytest.raises(KeyError):
        storage_guard(str(tmp_path), bug)
