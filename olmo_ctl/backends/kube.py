"""Kubernetes API access: client construction and the one retry policy every call goes through.

Retried (tenacity): connection errors (refused, reset, timed out, TLS), 429 (waiting at least the
server's Retry-After) and 5xx, with capped exponential backoff, full jitter and a total time budget.
Never retried: other 4xx (a 404, 409 or 422 is an answer, not a hiccup). When the budget is spent
the call raises `ApiUnreachable` (an `Unreachable`, exit 3) and nothing else is attempted: a running
job is left alone. `resume-until-done` does not exit on it: it waits for the API to answer again.

The `kubernetes` package is imported only inside functions, so importing this module is cheap.
urllib3's own retries are switched off so that this policy is the only one and its budget is honest.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from olmo_ctl.core.errors import BadInput, Unreachable
from olmo_ctl.core.node_resources import QUANTITY_SUFFIX, parse_quantity  # noqa: F401  (re-exported)
from olmo_ctl.core.transient import is_transient

T = TypeVar("T")


@dataclass(frozen=True)
class KubeRetryPolicy:
    """How Kubernetes calls are retried. Waits are `min(max_s, base_s * 2**n)` with full jitter,
    never shorter than a 429's Retry-After; the call gives up once `budget_s` would be exceeded."""

    base_s: float = 0.5
    max_s: float = 30.0
    budget_s: float = 300.0
    max_attempts: int = 50
    jitter: bool = True
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0

    @property
    def request_timeout(self) -> tuple[float, float]:
        return (self.connect_timeout_s, self.read_timeout_s)

    def backoff_s(self, attempt: int) -> float:
        """Wait after the `attempt`-th failure (1-based), before Retry-After is considered."""
        cap = min(self.max_s, self.base_s * (2 ** (attempt - 1)))
        return random.uniform(cap / 2, cap) if self.jitter else cap


DEFAULT_POLICY = KubeRetryPolicy()


def api_status(exc: BaseException) -> int | None:
    """The HTTP status of a kubernetes ApiException (0 for client-side transport errors), else None."""
    try:
        from kubernetes.client.exceptions import ApiException
    except ImportError:  # pragma: no cover
        return None
    return int(exc.status or 0) if isinstance(exc, ApiException) else None


def is_connection_error(exc: BaseException) -> bool:
    """Network trouble by core/transient.py's rule (connection errors, timeouts, urllib3's errors), less
    a local file that is missing or unreadable (a kubeconfig or certificate: no retry reads it), or a
    transport error the client wraps as status 0 (TLS)."""
    if isinstance(exc, FileNotFoundError | PermissionError):
        return False
    return is_transient(exc) or api_status(exc) == 0


def is_retryable(exc: BaseException) -> bool:
    """Connection errors, 429 and 5xx: yes. Any other 4xx, or a bug: no."""
    status = api_status(exc)
    if status is not None and status != 0:
        return status == 429 or status >= 500
    return is_connection_error(exc)


def retry_after_s(exc: BaseException) -> float | None:
    headers = getattr(exc, "headers", None)
    if not headers:
        return None
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:  # an HTTP date: rare from kube-apiserver; fall back to our own backoff
        return None


def describe_error(exc: BaseException) -> str:
    status = api_status(exc)
    if status:
        msg = status_message(exc)
        return f"HTTP {status}" + (f" {msg}" if msg else "")
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def status_message(exc: BaseException) -> str:
    """The `message` of the Status object an API server error carries (or its reason)."""
    body = getattr(exc, "body", None)
    if body:
        try:
            data = json.loads(body)
            if isinstance(data, dict) and data.get("message"):
                return str(data["message"])
        except (ValueError, TypeError):
            pass
    return str(getattr(exc, "reason", "") or "")


class ApiUnreachable(Unreachable):
    """The Kubernetes API gave no usable answer within the retry budget (exit 3 for a command that
    makes one call; the supervisor waits it out instead: `supervise.supervisor.PatientBackend`)."""


# What a command that submits and supervises attempts says when the API stays unreachable.
UNREACHABLE_HINT = (
    "jobs on the cluster were left as they are; check `kubectl cluster-info`, then run the command again "
    "(it finds the attempt it submitted)"
)


def call(
    fn: Callable[..., T],
    *args: Any,
    policy: KubeRetryPolicy = DEFAULT_POLICY,
    what: str = "Kubernetes call",
    host: str = "",
    hint: str = UNREACHABLE_HINT,
    **kwargs: Any,
) -> T:
    """Run `fn(*args, **kwargs)` under `policy`. Non-retryable errors propagate unchanged;
    a retryable one that outlives the budget becomes `Unreachable` (with `hint`: what to do)."""
    import tenacity

    start = time.monotonic()

    def wait(rs: tenacity.RetryCallState) -> float:
        exc = rs.outcome.exception() if rs.outcome else None
        w = policy.backoff_s(rs.attempt_number)
        ra = retry_after_s(exc) if exc is not None else None
        if ra is not None:
            w = max(w, ra)
        return w

    def stop(rs: tenacity.RetryCallState) -> bool:
        if rs.attempt_number >= policy.max_attempts:
            return True
        return (time.monotonic() - start) + rs.upcoming_sleep > policy.budget_s

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_retryable),
        wait=wait,
        stop=stop,
        reraise=True,
    )
    try:
        return retrying(fn, *args, **kwargs)
    except Exception as exc:
        if not is_retryable(exc):
            raise
        elapsed = time.monotonic() - start
        attempts = retrying.statistics.get("attempt_number", 1)
        where = f" at {host}" if host else ""
        tries = f"{attempts} attempt" + ("s" if attempts != 1 else "")
        raise ApiUnreachable(
            f"{what}: no usable answer from the Kubernetes API{where} after {tries} over {elapsed:.1f} s "
            f"(last: {describe_error(exc)})",
            hint,
        ) from exc


def make_api_client(
    host: str | None = None,
    context: str | None = None,
    kubeconfig: str | None = None,
    token: str | None = None,
    verify_ssl: bool | None = None,
):
    """A `kubernetes.client.ApiClient`: an explicit `host` (tests, proxies; no auth unless `token`),
    else the kubeconfig (`kubeconfig` or $KUBECONFIG or ~/.kube/config, `context` or its current one),
    else the in-cluster service account."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    if host:
        cfg = client.Configuration()
        cfg.host = host.rstrip("/")
        if token:
            cfg.api_key = {"authorization": f"Bearer {token}"}
        if verify_ssl is not None:
            cfg.verify_ssl = verify_ssl
    else:
        cfg = client.Configuration()
        path, origin = kubeconfig_path(kubeconfig)
        try:
            if os.path.exists(path):
                check_kubeconfig(path, origin)
                try:
                    config.load_kube_config(config_file=path, context=context, client_configuration=cfg)
                except (TypeError, AttributeError, KeyError, ValueError, IndexError) as e:
                    # the client reads a mapping of the wrong shape as far as it can, then fails
                    # somewhere inside: the file is what is wrong
                    raise _malformed(
                        path, origin, f"is not a kubeconfig the client can read ({type(e).__name__}: {e})"
                    ) from None
            elif os.environ.get("KUBERNETES_SERVICE_HOST") and not context:
                config.load_incluster_config(client_configuration=cfg)
            else:
                raise BadInput(
                    f"no kubeconfig at `{path}`{origin} and not running inside a cluster",
                    "run `gcloud container clusters get-credentials CLUSTER --region REGION`",
                )
        except ConfigException as e:
            raise BadInput(
                f"cannot load Kubernetes credentials from kubeconfig `{path}`{origin}: "
                f"{' '.join(str(e).split())}",
                "check `kubectl config get-contexts`",
            ) from e
    cfg.retries = False  # our policy retries; urllib3 must not multiply it
    return client.ApiClient(cfg)


def kubeconfig_path(kubeconfig: str | None = None) -> tuple[str, str]:
    """The kubeconfig the client loads (`kubeconfig`, else the first file of $KUBECONFIG, else
    ~/.kube/config) and where that choice came from, as a message says it (" (from $KUBECONFIG)")."""
    if kubeconfig:
        return kubeconfig, ""
    env = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    if env:
        return env, " (from $KUBECONFIG)"
    return os.path.expanduser("~/.kube/config"), ""


# What to do about a kubeconfig that cannot be read: the same for every way it can be broken.
KUBECONFIG_HINT = (
    "fix the file, point KUBECONFIG at a good one, or write a new one with "
    "`gcloud container clusters get-credentials CLUSTER --region REGION`"
)


def _malformed(path: str, origin: str, problem: str) -> BadInput:
    return BadInput(f"kubeconfig `{path}`{origin} {' '.join(problem.split())}", KUBECONFIG_HINT)


def check_kubeconfig(path: str, origin: str = "") -> None:
    """BadInput (one line: what is wrong, which file, what to do) for a kubeconfig that cannot be read,
    is not YAML, or is not a mapping with lists of named entries, before the Kubernetes client reads it
    (which would fail with its parser's or its own traceback)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except UnicodeDecodeError as e:
        raise _malformed(path, origin, f"is not a text file ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise _malformed(path, origin, f"cannot be read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise _malformed(path, origin, f"is not valid YAML: {_yaml_problem(e)}") from None
    if doc is None:
        raise _malformed(path, origin, "is empty")
    if not isinstance(doc, dict):
        raise _malformed(path, origin, f"is not a kubeconfig: its top level is a {_kind(doc)}, not a mapping")
    for key in ("clusters", "contexts", "users"):
        entries = doc.get(key)
        if entries is None:
            continue
        if not isinstance(entries, list) or not all(isinstance(x, dict) for x in entries):
            raise _malformed(path, origin, f"is not a kubeconfig: `{key}` is not a list of named entries")


def _yaml_problem(e) -> str:
    """A YAML parser error in one phrase: what it found, and where (1-based line and column)."""
    what = ", ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x)
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return (what or type(e).__name__) + where


def _kind(doc: object) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(doc), type(doc).__name__
    )


def toleration_matches(toleration: dict, taint: dict) -> bool:
    """Whether one toleration tolerates one taint (k8s.io/api core/v1 Toleration.ToleratesTaint): the
    effect matches or is empty; `Exists` matches any value (and, without a key, any taint); `Equal`
    (the default operator) needs the same key and value."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("operator") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint["key"]
    return toleration.get("key") == taint["key"] and (toleration.get("value") or "") == (
        taint.get("value") or ""
    )


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    """Whether a pod with `tolerations` tolerates `taint`."""
    return any(toleration_matches(t, taint) for t in tolerations)
