"""One storage interface for run directories on gs:// or a local path.

Everything the CLI and the trainer persist goes through `Store`: whole-object reads and writes
(GCS has no append), ranged reads (tailing event files), listings with a delimiter (checkpoint
discovery in one or two calls), and writes conditioned on the object's generation (the lease's
compare-and-swap). The GCS client is imported only when a gs:// path is used. With
`STORAGE_EMULATOR_HOST` set, the client talks to that emulator with anonymous credentials.

Every GCS request has a deadline (`set_deadline`; the trainer sets `runtime.storage_timeout_s`): each
try waits at most a quarter of it for an answer, and the client's retries of 429, 5xx and connection
errors stop once it has passed, so an endpoint that accepts and never answers is an `Unreachable`
(exit 3) after about 1.25 x the deadline, never a silent wait. `create` writes an object only if it
does not exist yet (the epoch order's header, the packing of a source group): one writer wins, the
others learn that it exists.
"""

from __future__ import annotations

import abc
import builtins
import fcntl
import os
import posixpath
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from olmo_ctl.core.errors import BadInput, OlmoCtlError, Unreachable
from olmo_ctl.core.recipe import RuntimeConfig
from olmo_ctl.core.transient import is_transient

_UMASK = os.umask(0)
os.umask(_UMASK)


class PreconditionFailed(OlmoCtlError):
    """A conditional write lost the race: the object's generation was not the expected one."""

    def __init__(self, path: str):
        super().__init__(f"`{path}` changed under us (generation mismatch)", exit_code=2)


class PermissionDenied(OlmoCtlError):
    """GCS refused an identity an operation (403): deterministic, so exit 2, naming who lacked what where."""

    def __init__(self, identity: str | None, permission: str | None, bucket: str | None, detail: str = ""):
        who = (
            identity or "this process's identity (unknown: no service-account email in the error or metadata)"
        )
        what = permission or "the needed permission"
        where = f"bucket gs://{bucket}" if bucket else "the bucket"
        super().__init__(
            f"GCS denied {what} on {where} to {who}" + (f" ({detail})" if detail else ""),
            f"grant {who if identity else 'that identity'} a role with {what} on {where} (e.g. roles/storage.objectUser); "
            "pods on hostNetwork run as the node's service account, not through Workload Identity",
            2,
        )
        self.identity, self.permission, self.bucket = identity, permission, bucket

    @classmethod
    def of(cls, exc: BaseException, url: str | None = None) -> PermissionDenied:
        return describe_permission_error(exc, url) or cls(None, None, split_gcs(url)[0] if url else None)


_WHO_LACKS = re.compile(r"([\w.+-]+@[\w.-]+) does not have ([\w.]+) access", re.IGNORECASE)
_PERMISSION = re.compile(r"Permission '?([a-z]+\.[a-zA-Z]+\.[a-zA-Z]+)'? denied", re.IGNORECASE)
_BUCKET = re.compile(
    r"gs://([a-z0-9][a-z0-9._-]*)|/b/([a-z0-9][a-z0-9._-]*)(?:/|\b)|\bbucket[ \"':]+([a-z0-9][a-z0-9._-]*)",
    re.IGNORECASE,
)
_FORBIDDEN = re.compile(
    r"\b403\b|PERMISSION_DENIED|Forbidden|AccessDenied|does not have storage\.", re.IGNORECASE
)


def describe_permission_error(exc: BaseException, url: str | None = None) -> PermissionDenied | None:
    """A GCS 403 anywhere in `exc`'s chain (google-cloud-storage, gcsfs, tensorstore under Orbax), as
    a PermissionDenied naming the identity, the permission and the bucket GCS reported; None otherwise.
    GCS's own message names the principal (`x@p.iam.gserviceaccount.com does not have
    storage.objects.create access ...`); when it does not, the metadata server's default account."""
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(seen) < 8:
        seen.append(e)
        e = e.__cause__ or e.__context__
    text = " | ".join(f"{type(x).__name__}: {getattr(x, 'message', None) or x}" for x in seen)
    if not _FORBIDDEN.search(text):
        return None
    m = _WHO_LACKS.search(text)
    identity, permission = (m.group(1), m.group(2)) if m else (None, None)
    if permission is None and (p := _PERMISSION.search(text)):
        permission = p.group(1)
    bucket = split_gcs(url)[0] if url and is_gcs(url) else None
    if bucket is None and (b := _BUCKET.search(text)):
        bucket = next(g for g in b.groups() if g)
    return PermissionDenied(identity or _metadata_identity(), permission, bucket)


def _metadata_identity() -> str | None:
    """The default service account the GCE/GKE metadata server reports (Workload Identity: the mapped
    account; hostNetwork: the node's), or None off Google Cloud or with the emulator."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return None
    import urllib.request

    req = urllib.request.Request(
        "http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/email",
        headers={"Metadata-Flavor": "Google"},
    )
    try:
        with urllib.request.urlopen(req, timeout=1.0) as r:  # noqa: S310 - a fixed http URL on the VM
            return r.read().decode().strip() or None
    except Exception:  # noqa: BLE001 - not on Google Cloud
        return None


_deadline = {"s": float(RuntimeConfig.storage_timeout_s)}


def set_deadline(seconds: float) -> None:
    """How long one storage operation may take, its retries included (`runtime.storage_timeout_s`)."""
    _deadline["s"] = float(seconds)


def deadline_s() -> float:
    return _deadline["s"]


def try_timeout_s() -> float:
    """How long one try of a storage request waits for an answer: a quarter of the deadline, so that
    the retries that fit in it have room."""
    return max(1.0, _deadline["s"] / 4)


class NotFound(OlmoCtlError):
    def __init__(self, path: str):
        super().__init__(f"`{path}` does not exist", exit_code=2)


@dataclass(frozen=True)
class ObjectInfo:
    path: str  # full path or URL
    size: int
    generation: int


def is_gcs(path: str) -> bool:
    return str(path).startswith("gs://")


def join(base: str, *parts: str) -> str:
    base = str(base)
    if is_gcs(base):
        return posixpath.join(base.rstrip("/") if base != "gs://" else base, *parts)
    return os.path.join(base, *parts)


class Store(abc.ABC):
    """Interface; `store_for(path)` returns the implementation for a path."""

    @abc.abstractmethod
    def read_bytes(self, path: str) -> bytes: ...
    @abc.abstractmethod
    def read_range(self, path: str, start: int, end: int | None = None) -> bytes: ...
    @abc.abstractmethod
    def write_bytes(self, path: str, data: bytes, if_generation_match: int | None = None) -> int: ...
    @abc.abstractmethod
    def stat(self, path: str) -> ObjectInfo | None: ...
    @abc.abstractmethod
    def list(self, prefix: str, recursive: bool = False) -> tuple[list[ObjectInfo], list[str]]: ...
    @abc.abstractmethod
    def delete(self, path: str) -> None: ...

    # (`list` is a method here: the built-in is spelled builtins.list below it)
    def find(
        self, prefix: str, match_glob: str | None = None, start_offset: str = ""
    ) -> builtins.list[ObjectInfo]:
        """Every object below directory `prefix` whose name relative to it matches `match_glob`
        (`*` stops at `/`, `**` does not) and sorts at or after `start_offset`. On GCS both
        filters are applied by the server (one listing, however many other objects there are)."""
        files, _ = self.list(prefix, recursive=True)
        base = str(prefix).rstrip("/") + "/"
        pattern = _glob_regex(match_glob) if match_glob else None
        return [
            o
            for o in files
            if o.path[len(base) :] >= start_offset
            and (pattern is None or pattern.fullmatch(o.path[len(base) :]))
        ]

    def exists(self, path: str) -> bool:
        return self.stat(path) is not None

    def read_text(self, path: str) -> str:
        return self.read_bytes(path).decode()

    def write_text(self, path: str, text: str, if_generation_match: int | None = None) -> int:
        return self.write_bytes(path, text.encode(), if_generation_match)

    def create(self, path: str, data: bytes) -> bool:
        """Write `path` only if it does not exist (a does-not-exist precondition): True when this call
        wrote it, False when it was there already. A retried try whose first try landed reads as there
        already, which is right for what this writes: bytes every writer computes alike."""
        try:
            self.write_bytes(path, data, if_generation_match=0)
        except PreconditionFailed:
            return False
        return True


def _glob_regex(glob: str) -> re.Pattern:
    """GCS `matchGlob` semantics for the filters we use: `**` any characters, `*` and `?` not `/`."""
    out = re.escape(glob).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
    return re.compile(out.replace("\0", ".*"))


LOCK_WAIT_S = 10.0  # a conditional write waits this long for the lock, then reads as "changed under us"


def _flock_within(lock, path: str, seconds: float) -> None:
    """The exclusive lock of a conditional write, or PreconditionFailed after `seconds`: its holder is
    stopped mid-write (SIGSTOP, a suspended laptop) and may resume and write, so the write it guards
    must not go ahead as if nobody else were writing."""
    end = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= end:
                raise PreconditionFailed(path) from None
            time.sleep(0.02)


class LocalStore(Store):
    """Local files. Generations are nanosecond mtimes; conditional writes hold an flock (for at most
    LOCK_WAIT_S when another writer holds it)."""

    def read_bytes(self, path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            raise NotFound(path) from None

    def read_range(self, path: str, start: int, end: int | None = None) -> bytes:
        try:
            with open(path, "rb") as f:
                f.seek(start)
                return f.read() if end is None else f.read(max(0, end - start))
        except FileNotFoundError:
            raise NotFound(path) from None

    def _gen(self, path: str) -> int:
        try:
            return os.stat(path).st_mtime_ns
        except FileNotFoundError:
            return 0

    def write_bytes(self, path: str, data: bytes, if_generation_match: int | None = None) -> int:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        lock = open(str(p) + ".lock", "a+") if if_generation_match is not None else None
        try:
            if lock:
                _flock_within(lock, path, LOCK_WAIT_S)
                if self._gen(path) != if_generation_match:
                    raise PreconditionFailed(path)
            fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file ordinary permissions
            os.replace(tmp, p)
            gen = self._gen(path)
            if lock and gen == if_generation_match:  # same-ns rewrite: make the generation move
                os.utime(p, ns=(gen + 1, gen + 1))
                gen += 1
            return gen
        finally:
            if lock:
                fcntl.flock(lock, fcntl.LOCK_UN)
                lock.close()

    def stat(self, path: str) -> ObjectInfo | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return ObjectInfo(str(path), st.st_size, st.st_mtime_ns)

    def list(self, prefix: str, recursive: bool = False) -> tuple[list[ObjectInfo], list[str]]:
        """Objects directly under directory `prefix` and its sub-directories (with a trailing /)."""
        root = Path(prefix)
        files: list[ObjectInfo] = []
        dirs: list[str] = []
        if not root.is_dir():
            return files, dirs
        if recursive:
            for dp, _, fns in os.walk(root):
                for fn in fns:
                    full = os.path.join(dp, fn)
                    try:
                        st = os.stat(full)
                    except FileNotFoundError:  # a dangling symlink, or gone since the listing: no object
                        continue
                    files.append(ObjectInfo(full, st.st_size, st.st_mtime_ns))
            return sorted(files, key=lambda o: o.path), dirs
        with os.scandir(root) as it:
            for e in it:
                if e.is_dir():
                    dirs.append(os.path.join(str(root), e.name) + "/")
                else:
                    try:
                        st = e.stat()
                    except FileNotFoundError:  # a dangling symlink, or gone since the listing: no object
                        continue
                    files.append(ObjectInfo(os.path.join(str(root), e.name), st.st_size, st.st_mtime_ns))
        return sorted(files, key=lambda o: o.path), sorted(dirs)

    def delete(self, path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def split_gcs(url: str) -> tuple[str, str]:
    rest = url[len("gs://") :]
    bucket, _, name = rest.partition("/")
    if not bucket:
        raise BadInput(f"`{url}` has no bucket", "write gs://BUCKET/path")
    return bucket, name


class GCSStore(Store):
    """google-cloud-storage, honouring STORAGE_EMULATOR_HOST for the local emulator."""

    def __init__(self):
        from google.api_core import exceptions as gexc
        from google.cloud import storage

        self._exc = gexc
        from google.cloud.storage.retry import DEFAULT_RETRY

        self._default_retry = DEFAULT_RETRY
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            from google.auth.credentials import AnonymousCredentials

            self._client = storage.Client(project="emulator", credentials=AnonymousCredentials())
        else:
            from google.auth.exceptions import DefaultCredentialsError

            try:
                self._client = storage.Client()
            except DefaultCredentialsError:
                raise OlmoCtlError(
                    "no Google Cloud credentials for gs:// paths",
                    "run `gcloud auth application-default login`, use Workload Identity, or set STORAGE_EMULATOR_HOST",
                ) from None

    def _blob(self, url: str):
        bucket, name = split_gcs(url)
        return self._client.bucket(bucket).blob(name)

    def _bounded(self) -> dict:
        """The timeout of one try and the retry policy, both within the deadline (`set_deadline`)."""
        return {"timeout": try_timeout_s(), "retry": self._default_retry.with_timeout(deadline_s())}

    def _call(self, url: str, fn):
        exc = self._exc
        try:
            return fn()
        except exc.NotFound:
            raise NotFound(url) from None
        except exc.PreconditionFailed:
            raise PreconditionFailed(url) from None
        except exc.Forbidden as e:
            raise PermissionDenied.of(e, url) from None
        except Exception as e:  # 5xx, 429, the client's retry deadline, connection refused: core/transient.py
            if is_transient(e):
                raise Unreachable(f"storage unreachable for `{url}`: {e}") from None
            raise

    def read_bytes(self, path: str) -> bytes:
        return self._call(path, lambda: self._blob(path).download_as_bytes(**self._bounded()))

    def read_range(self, path: str, start: int, end: int | None = None) -> bytes:
        if end is not None and end <= start:
            return b""
        # download_as_bytes' `end` is inclusive.
        return self._call(
            path,
            lambda: self._blob(path).download_as_bytes(
                start=start, end=None if end is None else end - 1, **self._bounded()
            ),
        )

    def write_bytes(self, path: str, data: bytes, if_generation_match: int | None = None) -> int:
        blob = self._blob(path)

        def up():
            blob.upload_from_string(data, if_generation_match=if_generation_match, **self._bounded())
            return int(blob.generation or 0)

        return self._call(path, up)

    def stat(self, path: str) -> ObjectInfo | None:
        bucket, name = split_gcs(path)

        def get():
            b = self._client.bucket(bucket).get_blob(name, **self._bounded())
            return None if b is None else ObjectInfo(path, int(b.size or 0), int(b.generation or 0))

        return self._call(path, get)

    def list(self, prefix: str, recursive: bool = False) -> tuple[list[ObjectInfo], list[str]]:
        bucket, name = split_gcs(prefix)
        if name and not name.endswith("/"):
            name += "/"

        def ls():
            it = self._client.list_blobs(
                bucket, prefix=name, delimiter=None if recursive else "/", **self._bounded()
            )
            files = [
                ObjectInfo(f"gs://{bucket}/{b.name}", int(b.size or 0), int(b.generation or 0)) for b in it
            ]
            dirs = sorted(f"gs://{bucket}/{p}" for p in it.prefixes)
            return files, dirs

        return self._call(prefix, ls)

    def find(
        self, prefix: str, match_glob: str | None = None, start_offset: str = ""
    ) -> builtins.list[ObjectInfo]:
        bucket, name = split_gcs(prefix)
        if name and not name.endswith("/"):
            name += "/"

        def ls():
            kw = {"match_glob": name + match_glob} if match_glob else {}
            if start_offset:
                kw["start_offset"] = name + start_offset
            return [
                ObjectInfo(f"gs://{bucket}/{b.name}", int(b.size or 0), int(b.generation or 0))
                for b in self._client.list_blobs(bucket, prefix=name, **kw, **self._bounded())
            ]

        found = self._call(prefix, ls)
        # Applied here as well: an emulator may ignore matchGlob.
        pattern = _glob_regex(match_glob) if match_glob else None
        base = f"gs://{bucket}/{name}"
        return [
            o
            for o in found
            if o.path[len(base) :] >= start_offset
            and (pattern is None or pattern.fullmatch(o.path[len(base) :]))
        ]

    def delete(self, path: str) -> None:
        try:
            self._call(path, lambda: self._blob(path).delete(**self._bounded()))
        except NotFound:
            pass


_gcs: GCSStore | None = None
_local = LocalStore()


def store_for(path: str) -> Store:
    global _gcs
    if is_gcs(path):
        if _gcs is None:
            _gcs = GCSStore()
        return _gcs
    return _local


def reset_clients() -> None:
    """Drop the cached GCS client: the next `store_for` builds one from the environment as it is then
    (after STORAGE_EMULATOR_HOST is pointed at another emulator, or unset)."""
    global _gcs
    _gcs = None
