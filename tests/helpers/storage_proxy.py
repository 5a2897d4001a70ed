"""A proxy in front of the GCS emulator that can stop answering: storage that stalls, for tests.

    with StallingProxy(emulator_url) as proxy:
        env = emulator_env(proxy.url)            # the clients of a trainer process talk to the proxy
        proxy.hold_when(lambda r: r.client == "tensorstore")   # from the first such request on ...
        ...                                      # ... no request is forwarded and none is answered
        proxy.fail_next(1, 503, lambda r: r.method == "POST")  # or: answer the next such one 503

It relays TCP connections byte for byte and reads just enough HTTP/1.1 of the client's side (the
request line, the headers, a Content-Length or chunked body) to know where each request starts: so
it can log every request (`requests`: method, path, which client sent it, the first bytes of its
body) and, once held, keep each connection open while forwarding nothing, which is what a storage
endpoint that accepts and never answers looks like to google-cloud-storage, gcsfs and tensorstore.
`fail_next` answers matching requests itself with an error status (a 429 or 503 of GCS's), without
forwarding them.
The client is told apart by its User-Agent (`gcsfs`, `tensorstore`, else `gcloud`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

BODY_HEAD = 4096  # bytes of each request body kept in the log


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    client: str  # gcsfs, tensorstore or gcloud (google-cloud-storage)
    t: float = field(default_factory=time.monotonic)
    body_head: bytes = b""
    failed_with: int | None = None  # the status fail_next answered it with (it was not forwarded)


def _client_of(headers: dict[str, str]) -> str:
    ua = headers.get("user-agent", "").lower()
    if "gcsfs" in ua:
        return "gcsfs"
    if "tensorstore" in ua:
        return "tensorstore"
    return "gcloud"


class StallingProxy:
    """See the module docstring. `held_since` is when the first held request arrived (monotonic)."""

    def __init__(self, upstream_url: str):
        u = urllib.parse.urlsplit(upstream_url)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listen.getsockname()[1]}"
        self.requests: list[Request] = []
        self.held_since: float | None = None
        self._hold_when: Callable[[Request], bool] | None = None
        self._fail: list = []  # [count left, status, predicate]
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []

    # -- control

    def hold_when(self, predicate: Callable[[Request], bool]) -> None:
        """From the first request for which `predicate` is true on, hold every request (and stop
        relaying answers)."""
        with self._lock:
            self._hold_when = predicate

    def hold(self) -> None:
        self.hold_when(lambda r: True)
        with self._lock:
            self.held_since = self.held_since or time.monotonic()

    def fail_next(self, n: int, status: int, predicate: Callable[[Request], bool]) -> None:
        """Answer the next `n` requests for which `predicate` is true with `status` (not forwarded)."""
        with self._lock:
            self._fail = [n, status, predicate]

    def _fail_armed(self) -> bool:
        with self._lock:
            return bool(self._fail) and self._fail[0] > 0

    def _failing(self, req: Request) -> int | None:
        with self._lock:
            if self._fail and self._fail[0] > 0 and self._fail[2](req):
                self._fail[0] -= 1
                return int(self._fail[1])
        return None

    def held(self) -> bool:
        return self.held_since is not None

    def seen(self, predicate: Callable[[Request], bool]) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if predicate(r)]

    # -- life

    def __enter__(self) -> StallingProxy:
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listen.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    # -- one connection

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        with self._lock:
            self._socks += [client, upstream]
        threading.Thread(target=self._answers, args=(upstream, client), daemon=True).start()
        reader = _Reader(client)
        try:
            while True:
                head = reader.until(b"\r\n\r\n")
                if head is None:
                    return
                req = _parse(head)
                if self._should_hold(req):
                    self._closed.wait()  # accepted, never forwarded, never answered
                    return
                if self._fail_armed() and "chunked" not in req.headers.get("transfer-encoding", "").lower():
                    # A rule may look at the body: read it whole before deciding (only while one is armed).
                    body = reader.exactly(int(req.headers.get("content-length", "0") or 0))
                    req.body_head = body[:BODY_HEAD]
                    status = self._failing(req)
                    if status is not None:
                        self._answer_error(req, client, status)
                        return
                    upstream.sendall(head + body)
                    with self._lock:
                        self.requests.append(req)
                    continue
                # Recorded before its body goes on, its body's head as it is relayed: the answer (and
                # whatever the client does next) cannot come before the request is on the list.
                with self._lock:
                    self.requests.append(req)
                upstream.sendall(head)
                self._relay_body(reader, req, upstream)
        except OSError:
            return
        finally:
            for s in (client, upstream):
                with contextlib.suppress(OSError):
                    s.close()

    def _answer_error(self, req: Request, client: socket.socket, status: int) -> None:
        """Answer `status` as GCS would, and close the connection."""
        req.failed_with = status
        with self._lock:
            self.requests.append(req)
        body = b'{"error": {"code": %d, "message": "injected by the storage proxy"}}' % status
        client.sendall(
            b"HTTP/1.1 %d Injected\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n" % (status, len(body)) + body
        )

    def _should_hold(self, req: Request) -> bool:
        with self._lock:
            if self.held_since is None and self._hold_when is not None and self._hold_when(req):
                self.held_since = time.monotonic()
            if self.held_since is not None:
                self.requests.append(req)
                return True
            return False

    def _relay_body(self, reader: _Reader, req: Request, upstream: socket.socket) -> bytes:
        """The request's body to upstream; `req.body_head` holds its first bytes before they are sent."""
        kept = bytearray()
        headers = req.headers

        def send(data: bytes) -> None:
            if len(kept) < BODY_HEAD:
                kept.extend(data[: BODY_HEAD - len(kept)])
                req.body_head = bytes(kept)
            upstream.sendall(data)

        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                line = reader.until(b"\r\n")
                if line is None:
                    raise OSError("connection closed inside a chunked body")
                upstream.sendall(line)
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:  # trailers end with an empty line
                    while (t := reader.until(b"\r\n")) not in (None, b"\r\n"):
                        upstream.sendall(t)
                    upstream.sendall(b"\r\n")
                    return bytes(kept)
                reader.copy(size, send)
                upstream.sendall(reader.exactly(2))  # the CRLF after each chunk
        n = int(headers.get("content-length", "0") or 0)
        reader.copy(n, send)
        return bytes(kept)

    def _answers(self, upstream: socket.socket, client: socket.socket) -> None:
        """Upstream's bytes to the client, until held."""
        try:
            while True:
                data = upstream.recv(65536)
                if not data:
                    break
                if self.held():
                    self._closed.wait()
                    return
                client.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_WR)


def _parse(head: bytes) -> Request:
    lines = head.decode("latin-1").split("\r\n")
    method, _, rest = lines[0].partition(" ")
    path = rest.rpartition(" ")[0]
    headers = {}
    for ln in lines[1:]:
        k, sep, v = ln.partition(":")
        if sep:
            headers[k.strip().lower()] = v.strip()
    return Request(method, path, headers, _client_of(headers))


class _Reader:
    """Buffered reads of a socket: up to a delimiter, or a number of bytes."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def _more(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def until(self, delim: bytes) -> bytes | None:
        """Bytes up to and including `delim`; None when the peer closed first."""
        while delim not in self.buf:
            if not self._more():
                return None
        i = self.buf.index(delim) + len(delim)
        out, self.buf = self.buf[:i], self.buf[i:]
        return out

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._more():
                raise OSError("connection closed inside a body")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def copy(self, n: int, send: Callable[[bytes], None]) -> None:
        """Hand `n` bytes to `send` as they arrive (a body waiting on `Expect: 100-continue` flows)."""
        while n > 0:
            if not self.buf and not self._more():
                raise OSError("connection closed inside a body")
            take, self.buf = self.buf[:n], self.buf[n:]
            n -= len(take)
            send(take)
