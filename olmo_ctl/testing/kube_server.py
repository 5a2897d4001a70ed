"""A Kubernetes API test server for the GKE backend, with a scripted cluster.

No kube-apiserver can run here, so this threaded `http.server` speaks the REST paths the
`kubernetes` client uses for the resources olmo-ctl touches, with the real CRD schemas
(`crds/`, JobSet v0.10.1 and Kueue v0.17.1) deciding what a valid object is:

  /apis/jobset.x-k8s.io/v1alpha2/namespaces/NS/jobsets[/NAME[/status]]
  /apis/kueue.x-k8s.io/{v1beta1,v1beta2}/namespaces/NS/workloads[/NAME[/status]]   (both served)
  /api/v1/namespaces/NS/pods[/NAME[/status|/log]]       /api/v1/namespaces/NS/events[/NAME]
  /apis/GROUP/VERSION/PLURAL and /api/v1/PLURAL          (lists across namespaces)
  /version, /healthz

Verbs: POST (create; no Content-Type required, as `CustomObjectsApi` sends none), GET (read; list
with `labelSelector` =, ==, !=, in, notin, exists, !exists and `fieldSelector` on metadata.name,
metadata.namespace, status.phase, involvedObject.*), PUT (replace, resourceVersion checked), PATCH
(application/merge-patch+json, strategic merge treated as merge, json-patch), DELETE
(`propagationPolicy` Foreground/Background cascades through ownerReferences, Orphan strips them;
`preconditions.uid` honoured; a collection DELETE takes a labelSelector). Errors are `Status` objects: 400 BadRequest, 404 NotFound,
409 AlreadyExists/Conflict, 415, 422 Invalid. Like a real API server, `fieldValidation=Strict`
turns unknown fields into 400 "strict decoding error: unknown field ..." and the default (Warn)
drops them with a `Warning` header; schema violations are 422 with the field path.

    with KubeServer() as srv:          # starts on 127.0.0.1:<free port>
        srv.url                        # "http://127.0.0.1:PORT": Configuration().host for the client
        srv.cluster                    # the scripted cluster (below)
        srv.fail_next(3, status=429, retry_after_s=1)   # next 3 requests answer 429 + Retry-After
        srv.fail_next(2, status=500, match="GET ")      # only requests whose "METHOD PATH" contains match
        srv.fail_next(1, status="drop")                 # close the connection without an answer
        srv.fail_next(1, status="lost", match="POST ")  # do the request, then close without an answer
        srv.fail_next(1, status=0, delay_s=2.0)         # a correct answer, 2 s late (client read timeouts)
        srv.go_down(); srv.come_back()                  # refuse connections, then listen again (same port)
        srv.requests                   # [(method, path, query dict, content type)] in arrival order

`srv.cluster` (a `Cluster`) plays Kueue, the JobSet and Job controllers and the kubelet. Creating a
JobSet with the label `kueue.x-k8s.io/queue-name` suspends it and creates its Workload
`jobset-<name>-<5 hex>` (controller ownerReference, label `kueue.x-k8s.io/job-uid`), pending.
Objects it writes validate against the CRD schemas.

    c.keep_pending(name, message)          Workload QuotaReserved=False (Pending) with Kueue's message
    c.admit(name)                          QuotaReserved + Admitted; JobSet resumed; pods created (Pending)
    c.run_pods(name)                       pods Running and Ready; JobSet replicatedJobsStatus ready
    c.log(name, index, lines)              append lines to pod `index`'s log
    c.pod_exit(name, index, code, log_lines=(), reason=None, disruption=None)
                                           pod `index` (0-based over all pods) terminates with `code`
    c.unschedulable(name, message)         pods PodScheduled=False Unschedulable + FailedScheduling events
    c.image_pull_error(name, index=0, reason="ErrImagePull", message=...)
    c.node_lost(name, index)               DisruptionTarget (taint manager) and exit 143
    c.evict(name, reason="Preempted", preempted_reason="InClusterQueue", message=None)
                                           Kueue eviction: Evicted(+Preempted), JobSet suspended, pods gone,
                                           workload requeued (QuotaReserved=False, Requeued=True)
    c.restart(name)                        the JobSet restarts itself (failurePolicy): new pods, restarts + 1
    c.complete(name)                       pods exit 0; JobSet Completed; Workload Finished(Succeeded)
    c.fail(name, reason="FailedJobs", message=None)
                                           JobSet Failed; still-running pods killed (143); Finished(Failed)
    c.on_create(callback)                  callback(name) after each JobSet create (script a cluster);
                                           it runs inside the create request: keep it quick, use a
                                           threading.Timer for anything later
    c.hold_deletions = True; c.finish_deletions()
                                           deleted JobSets linger with a deletionTimestamp until finished
    c.jobset(name), c.workload(name), c.pods(name), c.events(), c.jobset_names()
"""

from __future__ import annotations

import copy
import functools
import json
import re
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

CRD_DIR = Path(__file__).resolve().parent / "crds"
JOBSET_CRD = "jobset.x-k8s.io_jobsets.v0.10.1.yaml"
WORKLOAD_CRD = "kueue.x-k8s.io_workloads.v0.17.1.yaml"

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"

OBJECT_META_FIELDS = frozenset({
    "name", "generateName", "namespace", "labels", "annotations", "ownerReferences", "finalizers", "uid",
    "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds",
    "managedFields", "selfLink",
})
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUB = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def now_iso(offset_s: float = 0.0) -> str:
    return datetime.fromtimestamp(time.time() + offset_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------- schemas


@functools.cache
def crd_versions(filename: str) -> dict[str, dict]:
    """{version: openAPIV3Schema} of the served versions of one CRD file."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(CRD_DIR / filename) as f:
        crd = yaml.load(f, Loader=loader)
    return {v["name"]: v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v.get("served")}


@functools.cache
def _validator(filename: str, version: str):
    import jsonschema

    schema = copy.deepcopy(crd_versions(filename)[version])
    # ObjectMeta is validated by the server itself, as kube-apiserver does.
    schema.get("properties", {}).pop("metadata", None)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def unknown_fields(obj: Any, schema: dict, path: str = "") -> list[str]:
    """Paths of fields the structural schema does not declare (what pruning would drop)."""
    out: list[str] = []
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return out
    if isinstance(obj, dict):
        props = schema.get("properties")
        addl = schema.get("additionalProperties")
        for k, v in obj.items():
            sub = f"{path}.{k}" if path else k
            if props is not None and k in props:
                out += unknown_fields(v, props[k], sub)
            elif isinstance(addl, dict):
                out += unknown_fields(v, addl, sub)
            elif props is not None or addl is False:
                out.append(sub)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(obj):
            out += unknown_fields(v, schema["items"], f"{path}[{i}]")
    return out


def _drop_paths(obj: dict, paths: list[str]) -> None:
    for p in paths:
        parts = re.findall(r"[^.\[\]]+|\[\d+\]", p)
        node: Any = obj
        for part in parts[:-1]:
            node = node[int(part[1:-1])] if part.startswith("[") else node[part]
        last = parts[-1]
        if isinstance(node, dict):
            node.pop(last, None)


def schema_errors(obj: dict, filename: str, version: str) -> list[str]:
    v = _validator(filename, version)
    out = []
    for e in sorted(v.iter_errors({k: x for k, x in obj.items() if k != "metadata"}), key=lambda e: list(e.path)):
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path).lstrip(".")
        out.append(f"{path or '<root>'}: Invalid value: {e.message}")
    return out


# ---------------------------------------------------------------- resources


@dataclass(frozen=True)
class Resource:
    group: str  # "" for core
    versions: tuple[str, ...]
    plural: str
    kind: str
    crd: str | None = None  # schema file
    has_status: bool = True

    def api_version(self, version: str) -> str:
        return f"{self.group}/{version}" if self.group else version

    @property
    def qualified(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


RESOURCES = {
    ("jobset.x-k8s.io", "jobsets"): Resource("jobset.x-k8s.io", ("v1alpha2",), "jobsets", "JobSet", JOBSET_CRD),
    ("kueue.x-k8s.io", "workloads"): Resource("kueue.x-k8s.io", ("v1beta1", "v1beta2"), "workloads", "Workload",
                                              WORKLOAD_CRD),
    ("", "pods"): Resource("", ("v1",), "pods", "Pod"),
    ("", "events"): Resource("", ("v1",), "events", "Event", has_status=False),
}
KIND_TO_RESOURCE = {r.kind: r for r in RESOURCES.values()}


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}
        self.headers = headers or {}

    def status(self) -> dict:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message,
                "reason": self.reason, "details": self.details, "code": self.code}


def not_found(res: Resource, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{res.qualified} "{name}" not found',
                    {"name": name, "group": res.group, "kind": res.plural})


# ---------------------------------------------------------------- selectors


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def parse_label_selector(sel: str) -> Callable[[dict], bool]:
    """A predicate over a labels dict; raises ApiError(400) on a malformed selector."""
    reqs = []
    for term in _split_top(sel or ""):
        m = re.fullmatch(r"([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)", term)
        if m:
            vals = {v.strip() for v in m.group(3).split(",") if v.strip()}
            key, op = m.group(1), m.group(2)
            reqs.append(lambda lab, k=key, o=op, vs=vals: (lab.get(k) in vs) if o == "in" else (lab.get(k) not in vs))
            continue
        m = re.fullmatch(r"([^\s!=]+)\s*(==|=|!=)\s*([^\s,]*)", term)
        if m:
            key, op, val = m.groups()
            if op == "!=":
                reqs.append(lambda lab, k=key, v=val: lab.get(k) != v)
            else:
                reqs.append(lambda lab, k=key, v=val: k in lab and lab[k] == v)
            continue
        m = re.fullmatch(r"(!?)([^\s!=()]+)", term)
        if m:
            neg, key = m.groups()
            reqs.append(lambda lab, k=key, n=bool(neg): (k in lab) != n)
            continue
        raise ApiError(400, "BadRequest", f"unable to parse requirement: invalid label selector: {term!r}")
    return lambda labels: all(r(labels or {}) for r in reqs)


def _field(obj: dict, path: str) -> Any:
    node: Any = obj
    for part in path.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def parse_field_selector(sel: str) -> Callable[[dict], bool]:
    reqs = []
    for term in _split_top(sel or ""):
        m = re.fullmatch(r"([\w.]+)\s*(==|=|!=)\s*(.*)", term)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid field selector: {term!r}")
        path, op, val = m.groups()
        if op == "!=":
            reqs.append(lambda o, p=path, v=val: str(_field(o, p) or "") != v)
        else:
            reqs.append(lambda o, p=path, v=val: str(_field(o, p) or "") == v)
    return lambda obj: all(r(obj) for r in reqs)


# ---------------------------------------------------------------- patches


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def json_patch(target: Any, ops: list[dict]) -> Any:
    """RFC 6902 (add, remove, replace, test)."""
    doc = copy.deepcopy(target)

    def walk(path: str):
        parts = [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]
        node = doc
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node[p]
        return node, parts[-1]

    for op in ops:
        try:
            parent, key = walk(op["path"])
            if isinstance(parent, list):
                idx = len(parent) if key == "-" else int(key)
            kind = op["op"]
            if kind == "add":
                if isinstance(parent, list):
                    parent.insert(idx, op["value"])
                else:
                    parent[key] = op["value"]
            elif kind == "remove":
                del parent[idx if isinstance(parent, list) else key]
            elif kind == "replace":
                if isinstance(parent, list):
                    parent[idx] = op["value"]
                else:
                    if key not in parent:
                        raise KeyError(key)
                    parent[key] = op["value"]
            elif kind == "test":
                cur = parent[idx] if isinstance(parent, list) else parent[key]
                if cur != op["value"]:
                    raise ApiError(422, "Invalid", f"the test operation at {op['path']} failed")
            else:
                raise ApiError(422, "Invalid", f"unsupported json-patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(422, "Invalid", f"json-patch {op!r} cannot be applied: {e}") from None
    return doc


# ---------------------------------------------------------------- store


class Store:
    """Objects by (resource key, namespace, name); one lock; a global resourceVersion counter."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.objects: dict[tuple[tuple[str, str], str, str], dict] = {}
        self.logs: dict[tuple[str, str], list[str]] = {}
        self._rv = 1000

    def next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def key(self, res: Resource, ns: str, name: str):
        return ((res.group, res.plural), ns, name)

    def get(self, res: Resource, ns: str, name: str) -> dict | None:
        return self.objects.get(self.key(res, ns, name))

    def put(self, res: Resource, obj: dict) -> dict:
        md = obj["metadata"]
        md["resourceVersion"] = self.next_rv()
        self.objects[self.key(res, md.get("namespace", ""), md["name"])] = obj
        return obj

    def items(self, res: Resource, ns: str | None) -> list[dict]:
        return [o for (rk, ons, _), o in sorted(self.objects.items(), key=lambda kv: kv[0])
                if rk == (res.group, res.plural) and (ns is None or ons == ns)]

    def remove(self, res: Resource, ns: str, name: str, policy: str) -> dict | None:
        obj = self.objects.pop(self.key(res, ns, name), None)
        if obj is None:
            return None
        uid = obj["metadata"].get("uid")
        if res.plural == "pods":
            self.logs.pop((ns, obj["metadata"]["name"]), None)
        for (rk, ons, oname), dep in list(self.objects.items()):
            refs = dep["metadata"].get("ownerReferences") or []
            if ons != ns or not any(r.get("uid") == uid for r in refs):
                continue
            if policy == "Orphan":
                dep["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != uid]
            else:
                dep_res = next(r for r in RESOURCES.values() if (r.group, r.plural) == rk)
                self.remove(dep_res, ns, oname, policy)
        return obj


# ---------------------------------------------------------------- the HTTP side


class _Handler(BaseHTTPRequestHandler):
    server_version = "olmo-ctl-kube-test/1"
    protocol_version = "HTTP/1.0"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, code: int, payload: Any, headers: dict | None = None, text: bool = False) -> None:
        data = payload.encode() if text else json.dumps(payload).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "text/plain" if text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up waiting (its read timeout)

    def _handle(self, method: str) -> None:
        srv: KubeServer = self.server.kube  # type: ignore[attr-defined]
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        body = self._body()
        ctype = self.headers.get("Content-Type", "")
        srv._record(method, parts.path, query, ctype)
        fault = srv._take_fault(f"{method} {parts.path}")
        if fault is not None:
            if fault.status == "drop":
                self._hang_up()
                return
            if fault.status == "lost":
                pass
            elif fault.delay_s:
                time.sleep(fault.delay_s)
            if isinstance(fault.status, int) and fault.status:
                err = ApiError(fault.status, "TooManyRequests" if fault.status == 429 else "InternalError",
                               "the server has received too many requests and has asked us to try again later"
                               if fault.status == 429 else "an error on the server (\"injected\") has prevented "
                               "the request from succeeding")
                headers = {"Retry-After": str(fault.retry_after_s)} if fault.retry_after_s is not None else {}
                self._send(fault.status, err.status(), headers)
                return
        try:
            code, payload, headers, text = srv.api.dispatch(method, parts.path, query, body, ctype)
        except ApiError as e:
            code, payload, headers, text = e.code, e.status(), e.headers, False
        except Exception as e:  # a bug in the test server: say so loudly
            self._send(500, ApiError(500, "InternalError", f"test server bug: {type(e).__name__}: {e}").status())
            raise
        if fault is not None and fault.status == "lost":  # done, but the answer never arrives
            self._hang_up()
            return
        self._send(code, payload, headers, text)

    def _hang_up(self) -> None:
        """Close the connection without an answer (a dropped request or a lost response)."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")


@dataclass
class Fault:
    status: int | str  # an HTTP status, "drop" (close unanswered) or "lost" (carry out, close unanswered)
    remaining: int
    retry_after_s: int | None = None
    match: str | None = None
    delay_s: float = 0.0


class Api:
    """The REST semantics over a Store; `cluster` hooks in on JobSet creation."""

    def __init__(self, store: Store, cluster: Cluster):
        self.store, self.cluster = store, cluster

    def route(self, path: str) -> tuple[Resource, str, str | None, str | None, str | None]:
        m = re.fullmatch(r"/api/v1(?:/namespaces/([^/]+))?/([^/]+)(?:/([^/]+))?(?:/([^/]+))?", path)
        group, version = "", "v1"
        if not m:
            m2 = re.fullmatch(r"/apis/([^/]+)/([^/]+)(?:/namespaces/([^/]+))?/([^/]+)(?:/([^/]+))?(?:/([^/]+))?",
                              path)
            if not m2:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            group, version = m2.group(1), m2.group(2)
            ns, plural, name, sub = m2.group(3), m2.group(4), m2.group(5), m2.group(6)
        else:
            ns, plural, name, sub = m.groups()
        res = RESOURCES.get((group, plural))
        if res is None or version not in res.versions:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if sub not in (None, "status", "log") or (sub == "log" and plural != "pods"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return res, version, ns, name, sub

    def dispatch(self, method: str, path: str, query: dict, body: bytes, ctype: str):
        if path in ("/version", "/version/"):
            return 200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0-olmo-ctl-test"}, {}, False
        if path in ("/healthz", "/readyz", "/livez"):
            return 200, "ok", {}, True
        res, version, ns, name, sub = self.route(path)
        with self.store.lock:
            if method == "GET" and name is None:
                return 200, self.list(res, version, ns, query), {}, False
            if ns is None:
                raise ApiError(405, "MethodNotAllowed", "namespaced resource needs a namespace")
            if method == "POST" and name is None:
                obj, warnings = self.create(res, version, ns, self._json(body), query)
                return 201, self.out(res, version, obj), self._warn(warnings), False
            if method == "DELETE" and name is None:
                return 200, self.delete_collection(res, version, ns, query, body), {}, False
            if name is None:
                raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on a collection here")
            if method == "GET" and sub == "log":
                return 200, self.pod_log(ns, name, query), {}, True
            if method == "GET":
                obj = self.store.get(res, ns, name)
                if obj is None:
                    raise not_found(res, name)
                return 200, self.out(res, version, obj), {}, False
            if method == "DELETE":
                return 200, self.delete(res, version, ns, name, query, body), {}, False
            if method == "PATCH":
                obj = self.patch(res, version, ns, name, sub, body, ctype)
                return 200, self.out(res, version, obj), {}, False
            if method == "PUT":
                obj, warnings = self.replace(res, version, ns, name, sub, self._json(body), query)
                return 200, self.out(res, version, obj), self._warn(warnings), False
        raise ApiError(405, "MethodNotAllowed", f"{method} {path} is not supported")

    @staticmethod
    def _warn(warnings: list[str]) -> dict:
        def quoted(w: str) -> str:
            return '"' + w.replace("\\", "\\\\").replace('"', '\\"') + '"'

        return {"Warning": ", ".join(f"299 - {quoted(w)}" for w in warnings)} if warnings else {}

    @staticmethod
    def _json(body: bytes) -> Any:
        try:
            return json.loads(body or b"null")
        except ValueError as e:
            raise ApiError(400, "BadRequest", f"the request body is not valid JSON: {e}") from None

    @staticmethod
    def out(res: Resource, version: str, obj: dict) -> dict:
        o = copy.deepcopy(obj)
        o["apiVersion"] = res.api_version(version)
        o["kind"] = res.kind
        return o

    def list(self, res: Resource, version: str, ns: str | None, query: dict) -> dict:
        lsel = parse_label_selector(query.get("labelSelector", ""))
        fsel = parse_field_selector(query.get("fieldSelector", ""))
        items = [self.out(res, version, o) for o in self.store.items(res, ns)
                 if lsel(o["metadata"].get("labels") or {}) and fsel(o)]
        return {"apiVersion": res.api_version(version), "kind": f"{res.kind}List",
                "metadata": {"resourceVersion": str(self.store._rv)}, "items": items}

    # -- validation
    def validate(self, res: Resource, version: str, obj: Any, query: dict, name_hint: str = "") -> list[str]:
        if not isinstance(obj, dict):
            raise ApiError(400, "BadRequest", "the request body is not a JSON object")
        md = obj.get("metadata")
        if not isinstance(md, dict):
            raise ApiError(422, "Invalid", f'{res.kind}.{res.group} "{name_hint}" is invalid: metadata: Required value')
        name = md.get("name") or name_hint
        errors: list[str] = []
        warnings: list[str] = []
        mode = query.get("fieldValidation", "Warn")
        unknown = [f"metadata.{k}" for k in md if k not in OBJECT_META_FIELDS]
        if res.crd:
            schema = crd_versions(res.crd)[version]
            body_schema = dict(schema)
            body_schema["properties"] = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
            unknown += [p for p in unknown_fields({k: v for k, v in obj.items() if k != "metadata"}, body_schema)]
        if unknown:
            if mode == "Strict":
                raise ApiError(400, "BadRequest", f'{res.kind} in version "{version}" cannot be handled as a '
                               f'{res.kind}: strict decoding error: '
                               + ", ".join(f'unknown field "{u}"' for u in unknown))
            if mode != "Ignore":
                warnings += [f'unknown field "{u}"' for u in unknown]
            _drop_paths(obj, unknown)
        if not isinstance(name, str) or not name:
            errors.append("metadata.name: Required value: name or generateName is required")
        elif res.plural == "jobsets":
            if not _DNS1035.match(name) or len(name) > 63:
                errors.append(f'metadata.name: Invalid value: "{name}": a lowercase RFC 1035 label must consist of '
                              "lower case alphanumeric characters or '-', start with an alphabetic character, "
                              "and end with an alphanumeric character (at most 63 characters)")
        elif not _DNS1123_SUB.match(name) or len(name) > 253:
            errors.append(f'metadata.name: Invalid value: "{name}": a lowercase RFC 1123 subdomain is required')
        for k, v in (md.get("labels") or {}).items():
            key_name = k.rsplit("/", 1)[-1]
            if not _LABEL_NAME.match(key_name) or len(key_name) > 63:
                errors.append(f'metadata.labels: Invalid value: "{k}": name part must be a valid label key')
            if not isinstance(v, str) or not _LABEL_VALUE.match(v) or len(v) > 63:
                errors.append(f'metadata.labels: Invalid value: "{v}": a valid label must be an empty string or '
                              "consist of alphanumeric characters, '-', '_' or '.', at most 63 characters")
        for k, v in (md.get("annotations") or {}).items():
            if not isinstance(v, str):
                errors.append(f"metadata.annotations.{k}: Invalid value: must be a string")
        if res.crd:
            errors += schema_errors(obj, res.crd, version)
            if obj.get("apiVersion") not in (None, res.api_version(version)) or obj.get("kind") not in (None, res.kind):
                errors.append(f"apiVersion/kind: Invalid value: expected {res.api_version(version)} {res.kind}")
        if errors:
            raise ApiError(422, "Invalid", f'{res.kind}.{res.group or "core"} "{name}" is invalid: ' + "; ".join(errors),
                           {"name": name, "group": res.group, "kind": res.kind,
                            "causes": [{"message": e} for e in errors]})
        return warnings

    # -- verbs
    def create(self, res: Resource, version: str, ns: str, obj: Any, query: dict) -> tuple[dict, list[str]]:
        obj = copy.deepcopy(obj)
        if isinstance(obj, dict) and isinstance(obj.get("metadata"), dict):
            md = obj["metadata"]
            if md.get("namespace") not in (None, ns):
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the "
                                                  "namespace sent on the request")
            if not md.get("name") and md.get("generateName"):
                md["name"] = md["generateName"] + secrets.token_hex(3)[:5]
        warnings = self.validate(res, version, obj, query)
        md = obj["metadata"]
        if self.store.get(res, ns, md["name"]) is not None:
            raise ApiError(409, "AlreadyExists", f'{res.qualified} "{md["name"]}" already exists',
                           {"name": md["name"], "group": res.group, "kind": res.plural})
        md.update(namespace=ns, uid=str(uuid.uuid4()), generation=1, creationTimestamp=now_iso())
        for k in ("deletionTimestamp", "resourceVersion"):
            md.pop(k, None)
        if res.has_status and res.crd:
            obj.pop("status", None)  # the status subresource: ignored on create
        obj["apiVersion"], obj["kind"] = res.api_version(version), res.kind
        self.store.put(res, obj)
        if res.plural == "jobsets":
            self.cluster._on_jobset_created(obj)
        return obj, warnings

    def replace(self, res: Resource, version: str, ns: str, name: str, sub: str | None, new: Any,
                query: dict) -> tuple[dict, list[str]]:
        cur = self.store.get(res, ns, name)
        if cur is None:
            raise not_found(res, name)
        new = copy.deepcopy(new)
        warnings = self.validate(res, version, new, query, name)
        rv = new["metadata"].get("resourceVersion")
        if rv and rv != cur["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {res.qualified} "{name}": the object '
                           "has been modified; please apply your changes to the latest version and try again")
        return self._commit(res, cur, new, sub), warnings

    def patch(self, res: Resource, version: str, ns: str, name: str, sub: str | None, body: bytes,
              ctype: str) -> dict:
        cur = self.store.get(res, ns, name)
        if cur is None:
            raise not_found(res, name)
        ct = ctype.split(";")[0].strip()
        doc = self._json(body)
        if ct in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            if ct.startswith("application/strategic") and res.crd:
                raise ApiError(415, "UnsupportedMediaType", "strategic merge patch is not supported for "
                                                            "custom resources; use merge-patch")
            new = merge_patch(cur, doc)
        elif ct == "application/json-patch+json":
            new = json_patch(cur, doc)
        else:
            raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                                                        f"accepted media types include: application/json-patch+json, "
                                                        f"application/merge-patch+json (got {ct!r})")
        new["metadata"]["name"], new["metadata"]["namespace"] = name, ns
        self.validate(res, version, new, {"fieldValidation": "Ignore"}, name)
        return self._commit(res, cur, new, sub)

    def _commit(self, res: Resource, cur: dict, new: dict, sub: str | None) -> dict:
        md = cur["metadata"]
        if sub == "status":
            merged = copy.deepcopy(cur)
            merged["status"] = new.get("status")
        else:
            merged = copy.deepcopy(new)
            if res.has_status and res.crd:
                merged["status"] = copy.deepcopy(cur.get("status"))
            for k in ("uid", "creationTimestamp", "generation", "namespace", "name"):
                merged["metadata"][k] = md.get(k)
            if {k: v for k, v in merged.items() if k not in ("metadata", "status")} != \
                    {k: v for k, v in cur.items() if k not in ("metadata", "status")}:
                merged["metadata"]["generation"] = int(md.get("generation") or 1) + 1
        if merged.get("status") is None:
            merged.pop("status", None)
        return self.store.put(res, merged)

    def delete(self, res: Resource, version: str, ns: str, name: str, query: dict, body: bytes) -> dict:
        opts = self._json(body) if body else {}
        opts = opts if isinstance(opts, dict) else {}
        policy = query.get("propagationPolicy") or opts.get("propagationPolicy") or "Background"
        if policy not in ("Foreground", "Background", "Orphan"):
            raise ApiError(400, "BadRequest", f"propagationPolicy {policy!r} is not one of Foreground, "
                                              "Background, Orphan")
        cur = self.store.get(res, ns, name)
        if cur is None:
            raise not_found(res, name)
        want_uid = (opts.get("preconditions") or {}).get("uid")
        if want_uid and want_uid != cur["metadata"]["uid"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {res.qualified} "{name}": '
                           f"Precondition failed: UID in precondition: {want_uid}, UID in object meta: "
                           f"{cur['metadata']['uid']}")
        self.cluster.deleted.append((res.kind, name, policy))
        if self.cluster.hold_deletions and res.plural == "jobsets":
            # Like a real foreground deletion while pods use their grace period: the object stays,
            # marked, until `cluster.finish_deletions()`.
            md = cur["metadata"]
            md.setdefault("deletionTimestamp", now_iso())
            if policy == "Foreground":
                md["finalizers"] = sorted(set(md.get("finalizers") or []) | {"foregroundDeletion"})
            self.cluster._pending_deletions[(ns, name)] = policy
            for pod in self.cluster._pods(name, ns):
                pod["metadata"].setdefault("deletionTimestamp", now_iso())
            self.store.put(res, cur)
            return self.out(res, version, cur)
        obj = self.store.remove(res, ns, name, policy)
        out = self.out(res, version, obj)
        out["metadata"]["deletionTimestamp"] = now_iso()
        if policy == "Foreground":
            out["metadata"]["finalizers"] = ["foregroundDeletion"]
        return out

    def delete_collection(self, res: Resource, version: str, ns: str, query: dict, body: bytes) -> dict:
        gone = self.list(res, version, ns, query)
        for o in gone["items"]:
            self.delete(res, version, ns, o["metadata"]["name"], {k: v for k, v in query.items()
                                                                   if k == "propagationPolicy"}, body)
        return gone

    def pod_log(self, ns: str, name: str, query: dict) -> str:
        pod = self.store.get(RESOURCES[("", "pods")], ns, name)
        if pod is None:
            raise not_found(RESOURCES[("", "pods")], name)
        containers = [c["name"] for c in (pod.get("spec") or {}).get("containers") or []]
        cname = query.get("container") or (containers[0] if len(containers) == 1 else None)
        if cname is None:
            raise ApiError(400, "BadRequest", f"a container name must be specified for pod {name}, choose one of: "
                                              f"{containers}")
        if cname not in containers:
            raise ApiError(400, "BadRequest", f"container {cname} is not valid for pod {name}")
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            w = (cs.get("state") or {}).get("waiting")
            if cs.get("name") == cname and w:
                raise ApiError(400, "BadRequest", f'container "{cname}" in pod "{name}" is waiting to start: '
                                                  f"{w.get('reason', 'ContainerCreating')}")
        lines = list(self.store.logs.get((ns, name), []))
        if "tailLines" in query:
            n = int(query["tailLines"])
            lines = lines[-n:] if n > 0 else []
        return "".join(line + "\n" for line in lines)


# ---------------------------------------------------------------- the cluster's part


class Cluster:
    """Plays Kueue, the JobSet/Job controllers and the kubelet on the server's objects."""

    def __init__(self, store: Store, namespace: str = "default", cluster_queue: str = "cluster-queue",
                 flavor: str = "tpu-flavor"):
        self.store = store
        self.namespace = namespace
        self.cluster_queue = cluster_queue
        self.flavor = flavor
        self.deleted: list[tuple[str, str, str]] = []  # (kind, name, propagationPolicy) of API deletions
        self.hold_deletions = False  # True: a deleted JobSet lingers (deletionTimestamp) until finish_deletions()
        self._pending_deletions: dict[tuple[str, str], str] = {}
        self._callbacks: list[Callable[[str], None]] = []

    # -- lookups
    def _res(self, kind: str) -> Resource:
        return KIND_TO_RESOURCE[kind]

    def jobset(self, name: str, ns: str | None = None) -> dict | None:
        with self.store.lock:
            o = self.store.get(self._res("JobSet"), ns or self.namespace, name)
            return copy.deepcopy(o)

    def _js(self, name: str, ns: str | None = None) -> dict:
        o = self.store.get(self._res("JobSet"), ns or self.namespace, name)
        if o is None:
            raise KeyError(f"no JobSet {name!r}")
        return o

    def jobset_names(self, ns: str | None = None) -> list[str]:
        with self.store.lock:
            return [o["metadata"]["name"] for o in self.store.items(self._res("JobSet"), ns or self.namespace)]

    def _wl(self, name: str, ns: str | None = None) -> dict | None:
        js = self.store.get(self._res("JobSet"), ns or self.namespace, name)
        if js is None:
            return None
        uid = js["metadata"]["uid"]
        for o in self.store.items(self._res("Workload"), ns or self.namespace):
            if any(r.get("uid") == uid and r.get("controller") for r in o["metadata"].get("ownerReferences") or []):
                return o
        return None

    def workload(self, name: str, ns: str | None = None) -> dict | None:
        with self.store.lock:
            return copy.deepcopy(self._wl(name, ns))

    def _pods(self, name: str, ns: str | None = None) -> list[dict]:
        return sorted((p for p in self.store.items(self._res("Pod"), ns or self.namespace)
                       if (p["metadata"].get("labels") or {}).get(JOBSET_NAME_LABEL) == name),
                      key=lambda p: (int(p["metadata"]["labels"].get("jobset.sigs.k8s.io/job-index", 0)),
                                     int(p["metadata"]["labels"].get("batch.kubernetes.io/job-completion-index", 0))))

    def pods(self, name: str, ns: str | None = None) -> list[dict]:
        with self.store.lock:
            return copy.deepcopy(self._pods(name, ns))

    def events(self, ns: str | None = None) -> list[dict]:
        with self.store.lock:
            return copy.deepcopy(self.store.items(self._res("Event"), ns or self.namespace))

    def finish_deletions(self) -> list[str]:
        """Complete the deletions held by `hold_deletions` (dependents first); returns the JobSet names."""
        with self.store.lock:
            done = []
            for (ns, name), policy in list(self._pending_deletions.items()):
                self.store.remove(self._res("JobSet"), ns, name, policy)
                done.append(name)
            self._pending_deletions.clear()
            return done

    def on_create(self, callback: Callable[[str], None]) -> None:
        self._callbacks.append(callback)

    # -- writing helpers
    def _save(self, kind: str, obj: dict) -> None:
        self.store.put(self._res(kind), obj)

    def event(self, obj: dict, reason: str, message: str, type_: str = "Normal", source: str = "") -> None:
        md = obj["metadata"]
        ev = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{md['name']}.{secrets.token_hex(8)}", "namespace": md["namespace"],
                         "uid": str(uuid.uuid4()), "creationTimestamp": now_iso()},
            "involvedObject": {"kind": obj["kind"], "name": md["name"], "namespace": md["namespace"],
                               "uid": md.get("uid"), "apiVersion": obj.get("apiVersion")},
            "reason": reason, "message": message, "type": type_, "count": 1,
            "firstTimestamp": now_iso(), "lastTimestamp": now_iso(),
            "source": {"component": source or "kubelet"}, "reportingComponent": source or "kubelet",
        }
        self._save("Event", ev)

    @staticmethod
    def _set_cond(obj: dict, ctype: str, status: str, reason: str, message: str = "",
                  observed_generation: bool = True) -> None:
        st = obj.setdefault("status", {})
        conds = st.setdefault("conditions", [])
        c = next((c for c in conds if c["type"] == ctype), None)
        if c is None:
            c = {"type": ctype}
            conds.append(c)
        if c.get("status") != status:
            c["lastTransitionTime"] = now_iso()
        c.update(status=status, reason=reason, message=message)
        c.setdefault("lastTransitionTime", now_iso())
        if observed_generation:
            c["observedGeneration"] = int(obj["metadata"].get("generation") or 1)

    def _check_schema(self, kind: str, obj: dict) -> None:
        res = self._res(kind)
        if res.crd:
            errs = schema_errors(obj, res.crd, res.versions[0])
            if errs:
                raise AssertionError(f"test cluster wrote an invalid {kind}: {errs}")

    # -- Kueue
    def _on_jobset_created(self, js: dict) -> None:
        labels = js["metadata"].get("labels") or {}
        if QUEUE_LABEL in labels:
            js.setdefault("spec", {})["suspend"] = True  # Kueue's webhook suspends a queued job
            self._set_cond(js, "Suspended", "True", "SuspendedJobs", "jobset is suspended")
            self._create_workload(js, labels[QUEUE_LABEL])
        else:
            self._init_jobset_status(js)
        self._save("JobSet", js)
        for cb in list(self._callbacks):
            cb(js["metadata"]["name"])

    def _init_jobset_status(self, js: dict) -> None:
        st = js.setdefault("status", {})
        st.setdefault("restarts", 0)
        st["replicatedJobsStatus"] = [
            {"name": rj["name"], "ready": 0, "succeeded": 0, "failed": 0,
             "active": 0 if js["spec"].get("suspend") else int(rj.get("replicas", 1)),
             "suspended": int(rj.get("replicas", 1)) if js["spec"].get("suspend") else 0}
            for rj in js["spec"].get("replicatedJobs") or []]

    def _create_workload(self, js: dict, queue: str) -> None:
        md = js["metadata"]
        name = f"jobset-{md['name']}"[:57] + "-" + secrets.token_hex(3)[:5]
        pod_sets = []
        for rj in js["spec"].get("replicatedJobs") or []:
            jspec = rj["template"]["spec"]
            count = int(rj.get("replicas", 1)) * int(jspec.get("parallelism", 1))
            pod_sets.append({"name": rj["name"], "count": count, "template": copy.deepcopy(jspec["template"])})
        wl = {
            "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
            "metadata": {"name": name, "namespace": md["namespace"], "uid": str(uuid.uuid4()), "generation": 1,
                         "creationTimestamp": now_iso(),
                         "labels": {"kueue.x-k8s.io/job-uid": md["uid"]},
                         "ownerReferences": [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                                              "name": md["name"], "uid": md["uid"], "controller": True,
                                              "blockOwnerDeletion": True}]},
            "spec": {"queueName": queue, "podSets": pod_sets, "priority": 0, "active": True},
        }
        self._init_jobset_status(js)
        self._check_schema("Workload", wl)
        self._save("Workload", wl)
        self.event(js, "CreatedWorkload", f"Created Workload: {md['namespace']}/{name}", source="jobset-kueue-controller")

    def keep_pending(self, name: str, message: str = "couldn't assign flavors to pod set slice: insufficient "
                                                        "unused quota for google.com/tpu in flavor tpu-flavor, "
                                                        "256 more needed") -> None:
        with self.store.lock:
            wl = self._wl(name)
            self._set_cond(wl, "QuotaReserved", "False", "Pending", message)
            self._check_schema("Workload", wl)
            self._save("Workload", wl)
            self.event(wl, "Pending", message, source="kueue-admission")

    def admit(self, name: str) -> None:
        """Kueue reserves quota and admits; the JobSet is resumed and its pods created (Pending)."""
        with self.store.lock:
            js = self._js(name)
            wl = self._wl(name)
            if wl is not None:
                for ctype in ("Evicted", "Preempted"):
                    old = next((c for c in (wl.get("status") or {}).get("conditions") or []
                                if c["type"] == ctype and c["status"] == "True"), None)
                    if old:
                        self._set_cond(wl, ctype, "False", "QuotaReserved", f"Previously: {old.get('message', '')}")
                self._set_cond(wl, "QuotaReserved", "True", "QuotaReserved",
                               f"Quota reserved in ClusterQueue {self.cluster_queue}, wait time since queued was 1s")
                self._set_cond(wl, "Admitted", "True", "Admitted", "The workload is admitted")
                for c in wl["status"]["conditions"]:
                    if c["type"] == "Requeued":
                        c.update(status="False", reason="Admitted", message="")
                wl["status"]["admission"] = {
                    "clusterQueue": self.cluster_queue,
                    "podSetAssignments": [
                        {"name": ps["name"], "count": ps["count"], "flavors": {"google.com/tpu": self.flavor},
                         "resourceUsage": {"google.com/tpu": str(ps["count"] * self._chips(ps["template"]))}}
                        for ps in wl["spec"]["podSets"]]}
                wl["metadata"]["finalizers"] = ["kueue.x-k8s.io/resource-in-use"]
                self._check_schema("Workload", wl)
                self._save("Workload", wl)
                self.event(wl, "QuotaReserved", f"Quota reserved in ClusterQueue {self.cluster_queue}",
                           source="kueue-admission")
                self.event(wl, "Admitted", f"Admitted by ClusterQueue {self.cluster_queue}", source="kueue-admission")
            js["spec"]["suspend"] = False
            self._set_cond(js, "Suspended", "False", "ResumeJobs", "jobset is resumed")
            self._init_jobset_status(js)
            self._check_schema("JobSet", js)
            self._save("JobSet", js)
            self._create_pods(js)

    @staticmethod
    def _chips(template: dict) -> int:
        n = 0
        for c in (template.get("spec") or {}).get("containers") or []:
            v = ((c.get("resources") or {}).get("limits") or {}).get("google.com/tpu")
            n += int(v or 0)
        return n

    def _create_pods(self, js: dict) -> None:
        md = js["metadata"]
        for rj in js["spec"].get("replicatedJobs") or []:
            jspec = rj["template"]["spec"]
            for j in range(int(rj.get("replicas", 1))):
                for i in range(int(jspec.get("parallelism", 1))):
                    tmpl = copy.deepcopy(jspec["template"])
                    job = f"{md['name']}-{rj['name']}-{j}"
                    labels = dict((tmpl.get("metadata") or {}).get("labels") or {})
                    labels.update({JOBSET_NAME_LABEL: md["name"], "jobset.sigs.k8s.io/replicatedjob-name": rj["name"],
                                   "jobset.sigs.k8s.io/job-index": str(j), "job-name": job,
                                   "batch.kubernetes.io/job-completion-index": str(i)})
                    pod = {
                        "apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": f"{job}-{i}-{secrets.token_hex(3)[:5]}", "namespace": md["namespace"],
                                     "uid": str(uuid.uuid4()), "creationTimestamp": now_iso(), "labels": labels,
                                     "annotations": dict((tmpl.get("metadata") or {}).get("annotations") or {}),
                                     "ownerReferences": [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                                                          "name": md["name"], "uid": md["uid"],
                                                          "controller": False}]},
                        "spec": tmpl.get("spec") or {},
                        "status": {"phase": "Pending", "conditions": [], "containerStatuses": [
                            {"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": False, "restartCount": 0,
                             "started": False, "state": {"waiting": {"reason": "ContainerCreating"}}}
                            for c in (tmpl.get("spec") or {}).get("containers") or []]},
                    }
                    self._save("Pod", pod)
                    self.store.logs[(md["namespace"], pod["metadata"]["name"])] = []

    def run_pods(self, name: str) -> None:
        with self.store.lock:
            pods = self._pods(name)
            for k, pod in enumerate(pods):
                node = f"gke-tpu-{k:04d}"
                pod["spec"]["nodeName"] = node
                st = pod["status"]
                st.update(phase="Running", hostIP=f"10.0.0.{k + 2}", podIP=f"10.0.0.{k + 2}",
                          startTime=now_iso())
                st["conditions"] = [{"type": t, "status": "True", "lastTransitionTime": now_iso()}
                                    for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
                for cs in st["containerStatuses"]:
                    cs.update(ready=True, started=True, state={"running": {"startedAt": now_iso()}})
                self._save("Pod", pod)
                self.event(pod, "Scheduled", f"Successfully assigned {pod['metadata']['namespace']}/"
                           f"{pod['metadata']['name']} to {node}", source="default-scheduler")
            js = self._js(name)
            for rjs in js["status"].get("replicatedJobsStatus") or []:
                rjs["ready"] = rjs["active"]
            self._save("JobSet", js)

    def log(self, name: str, index: int, lines: list[str] | tuple[str, ...]) -> None:
        with self.store.lock:
            pod = self._pods(name)[index]
            self.store.logs.setdefault((pod["metadata"]["namespace"], pod["metadata"]["name"]), []).extend(lines)

    def pod_exit(self, name: str, index: int, code: int, log_lines: list[str] | tuple[str, ...] = (),
                 reason: str | None = None, disruption: str | None = None) -> str:
        """Pod `index` terminates with `code`; returns its name. `disruption` adds a DisruptionTarget
        condition with that reason (PreemptionByScheduler, DeletionByTaintManager, TerminationByKubelet...)."""
        with self.store.lock:
            pod = self._pods(name)[index]
            self._terminate(pod, code, log_lines, reason, disruption)
            return pod["metadata"]["name"]

    def _terminate(self, pod: dict, code: int, log_lines=(), reason: str | None = None,
                   disruption: str | None = None) -> None:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        self.store.logs.setdefault(key, []).extend(log_lines)
        st = pod["status"]
        st["phase"] = "Succeeded" if code == 0 else "Failed"
        reason = reason or ("Completed" if code == 0 else "Error")
        policy = {c["name"]: c.get("terminationMessagePolicy") for c in pod["spec"].get("containers") or []}
        for cs in st.get("containerStatuses") or []:
            started = ((cs.get("state") or {}).get("running") or {}).get("startedAt") or now_iso()
            term = {"exitCode": code, "reason": reason, "startedAt": started, "finishedAt": now_iso(),
                    "containerID": f"containerd://{secrets.token_hex(16)}"}
            if code != 0 and policy.get(cs["name"]) == "FallbackToLogsOnError":
                term["message"] = "\n".join(self.store.logs.get(key, [])[-80:])
            cs.update(ready=False, started=False, state={"terminated": term})
        for c in st.get("conditions") or []:
            if c["type"] in ("Ready", "ContainersReady"):
                c.update(status="False", reason="PodFailed" if code else "PodCompleted")
        if disruption:
            st.setdefault("conditions", []).append(
                {"type": "DisruptionTarget", "status": "True", "reason": disruption, "lastTransitionTime": now_iso(),
                 "message": {"PreemptionByScheduler": "default-scheduler: preempting to accommodate a higher "
                                                      "priority pod",
                             "DeletionByTaintManager": "Taint manager: deleting due to NoExecute taint",
                             "TerminationByKubelet": "Pod was terminated in response to imminent node shutdown."
                             }.get(disruption, disruption)})
        self._save("Pod", pod)

    def unschedulable(self, name: str, message: str = "0/16 nodes are available: 16 Insufficient google.com/tpu. "
                                                      "preemption: 0/16 nodes are available: 16 No preemption "
                                                      "victims found for incoming pod.") -> None:
        with self.store.lock:
            for pod in self._pods(name):
                pod["status"]["phase"] = "Pending"
                pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                                "message": message, "lastTransitionTime": now_iso()}]
                self._save("Pod", pod)
                self.event(pod, "FailedScheduling", message, "Warning", source="default-scheduler")

    def image_pull_error(self, name: str, index: int = 0, reason: str = "ErrImagePull",
                         message: str = 'failed to pull and unpack image "us-docker.pkg.dev/p/r/olmo:missing": '
                                        "not found") -> None:
        with self.store.lock:
            pod = self._pods(name)[index]
            for cs in pod["status"]["containerStatuses"]:
                cs.update(ready=False, started=False, state={"waiting": {"reason": reason, "message": message}})
            self._save("Pod", pod)
            self.event(pod, "Failed", f"Failed to pull image: {message}", "Warning")

    def node_lost(self, name: str, index: int) -> str:
        with self.store.lock:
            pod = self._pods(name)[index]
            self.event(pod, "TaintManagerEviction", f"Marking for deletion Pod {pod['metadata']['namespace']}/"
                       f"{pod['metadata']['name']}", source="taint-eviction-controller")
            self._terminate(pod, 143, disruption="DeletionByTaintManager")
            return pod["metadata"]["name"]

    def evict(self, name: str, reason: str = "Preempted", preempted_reason: str | None = "InClusterQueue",
              message: str | None = None) -> None:
        """Kueue evicts the workload: the JobSet is suspended, its pods deleted, the workload requeued."""
        with self.store.lock:
            js = self._js(name)
            wl = self._wl(name)
            if wl is None:
                raise KeyError(f"JobSet {name!r} has no Workload (no queue label?)")
            if message is None:
                message = (f"Preempted to accommodate a workload (UID: {uuid.uuid4()}, JobUID: {uuid.uuid4()}) "
                           "due to prioritization in the ClusterQueue") if reason == "Preempted" else \
                          f"The workload was evicted: {reason}"
            self._set_cond(wl, "Evicted", "True", reason, message)
            if reason == "Preempted" and preempted_reason:
                self._set_cond(wl, "Preempted", "True", preempted_reason, message)
            self.event(wl, f"EvictedDue{reason}" if not reason.startswith("Evicted") else reason, message,
                       source="kueue-admission")
            js["spec"]["suspend"] = True
            self._set_cond(js, "Suspended", "True", "SuspendedJobs", "jobset is suspended")
            self._init_jobset_status(js)
            self._save("JobSet", js)
            for pod in self._pods(name):
                self.event(pod, "Killing", f"Stopping container {pod['spec']['containers'][0]['name']}")
                self.store.remove(self._res("Pod"), pod["metadata"]["namespace"], pod["metadata"]["name"],
                                  "Background")
            # Kueue requeues it: quota released, waiting again.
            self._set_cond(wl, "QuotaReserved", "False", "Pending", message)
            self._set_cond(wl, "Admitted", "False", "NoReservation", "The workload has no reservation")
            self._set_cond(wl, "Requeued", "True", reason, message)
            wl["status"].pop("admission", None)
            wl["metadata"].pop("finalizers", None)
            self._check_schema("Workload", wl)
            self._save("Workload", wl)

    def complete(self, name: str) -> None:
        with self.store.lock:
            js = self._js(name)
            for pod in self._pods(name):
                if pod["status"].get("phase") not in ("Succeeded", "Failed"):
                    self._terminate(pod, 0)
            self._set_cond(js, "Completed", "True", "AllJobsCompleted", "jobset completed successfully")
            js["status"]["terminalState"] = "Completed"
            for rjs in js["status"].get("replicatedJobsStatus") or []:
                rjs.update(succeeded=rjs["active"] or rjs["succeeded"], active=0, ready=0)
            self._check_schema("JobSet", js)
            self._save("JobSet", js)
            wl = self._wl(name)
            if wl is not None:
                self._set_cond(wl, "Finished", "True", "Succeeded", "jobset completed successfully")
                wl["metadata"].pop("finalizers", None)
                self._save("Workload", wl)

    def restart(self, name: str) -> None:
        """The JobSet controller restarts the whole JobSet (failurePolicy): pods recreated, restarts + 1."""
        with self.store.lock:
            js = self._js(name)
            for pod in self._pods(name):
                self.store.remove(self._res("Pod"), pod["metadata"]["namespace"], pod["metadata"]["name"],
                                  "Background")
            js["status"]["restarts"] = int(js["status"].get("restarts") or 0) + 1
            js["status"]["restartsCountTowardsMax"] = int(js["status"].get("restartsCountTowardsMax") or 0) + 1
            self._init_jobset_status(js)
            self._check_schema("JobSet", js)
            self._save("JobSet", js)
            self._create_pods(js)

    FAIL_MESSAGES = {
        "FailedJobs": "jobset failed due to one or more job failures",
        "ReachedMaxRestarts": "jobset failed due to reaching max number of restarts",
        "FailJobSetFailurePolicyAction": "The JobSet failed due to the failure policy action",
    }

    def fail(self, name: str, reason: str = "FailedJobs", message: str | None = None) -> None:
        with self.store.lock:
            js = self._js(name)
            message = message or self.FAIL_MESSAGES.get(reason, f"jobset failed: {reason}")
            for pod in self._pods(name):  # the Job controller kills what still runs
                if pod["status"].get("phase") not in ("Succeeded", "Failed"):
                    self._terminate(pod, 143)
            self._set_cond(js, "Failed", "True", reason, message)
            js["status"]["terminalState"] = "Failed"
            for rjs in js["status"].get("replicatedJobsStatus") or []:
                rjs.update(failed=rjs["failed"] + 1, active=0, ready=0)
            self._check_schema("JobSet", js)
            self._save("JobSet", js)
            wl = self._wl(name)
            if wl is not None:
                self._set_cond(wl, "Finished", "True", "Failed", message)
                wl["metadata"].pop("finalizers", None)
                self._save("Workload", wl)


# ---------------------------------------------------------------- the server object


class KubeServer:
    """`with KubeServer() as srv:` a Kubernetes API on 127.0.0.1 with a scripted `srv.cluster`."""

    def __init__(self, namespace: str = "default", port: int = 0):
        self.store = Store()
        self.cluster = Cluster(self.store, namespace)
        self.api = Api(self.store, self.cluster)
        self.namespace = namespace
        self._port = port
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._faults: list[Fault] = []
        self._fault_lock = threading.Lock()
        self.requests: list[tuple[str, str, dict, str]] = []

    # -- lifecycle
    def start(self) -> KubeServer:
        httpd = ThreadingHTTPServer(("127.0.0.1", self._port), _Handler)
        httpd.daemon_threads = True
        httpd.kube = self  # type: ignore[attr-defined]
        self._port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def go_down(self) -> None:
        """Stop listening: connections are refused until `come_back()` (the cluster state is kept)."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def come_back(self) -> None:
        if self._httpd is None:
            self.start()

    def stop(self) -> None:
        self.go_down()

    def __enter__(self) -> KubeServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    # -- faults
    def fail_next(self, count: int, status: int | str = 500, retry_after_s: int | None = None,
                  match: str | None = None, delay_s: float = 0.0) -> None:
        """The next `count` requests (whose "METHOD /path" contains `match`, if given) answer `status`
        (an HTTP code; "drop": the connection closes unanswered; "lost": the request is carried out,
        then the connection closes unanswered), after `delay_s`."""
        with self._fault_lock:
            self._faults.append(Fault(status, count, retry_after_s, match, delay_s))

    def clear_faults(self) -> None:
        with self._fault_lock:
            self._faults.clear()

    def _take_fault(self, what: str) -> Fault | None:
        with self._fault_lock:
            for f in self._faults:
                if f.remaining > 0 and (f.match is None or f.match in what):
                    f.remaining -= 1
                    return f
            return None

    def _record(self, method: str, path: str, query: dict, ctype: str) -> None:
        with self._fault_lock:
            self.requests.append((method, path, query, ctype))

    def count(self, method: str, contains: str = "") -> int:
        """How many requests with this method (and path containing `contains`) arrived."""
        return sum(1 for m, p, _, _ in list(self.requests) if m == method and contains in p)


def tiny_jobset(name: str, run: str = "test-run", attempt: int = 1, namespace: str = "default",
                queue: str | None = "user-queue", workers: int = 2, image: str = "python:3.12-slim",
                script: str = "print('step 1/1 loss 1.0')") -> dict:
    """A small JobSet shaped like olmo-ctl's (labels, one `slice` replicated job, a `trainer`
    container) that any cluster can run: `workers` CPU pods running `python -c script`."""
    labels = {"olmo-ctl/run": run, "olmo-ctl/attempt": str(attempt)}
    if queue:
        labels[QUEUE_LABEL] = queue
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "failurePolicy": {"maxRestarts": 0},
            "replicatedJobs": [{"name": "slice", "replicas": 1, "template": {"spec": {
                "parallelism": workers, "completions": workers, "completionMode": "Indexed", "backoffLimit": 0,
                "template": {"metadata": {"labels": {"olmo-ctl/run": run, "olmo-ctl/attempt": str(attempt)}},
                             "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 5,
                                      "containers": [{
                                          "name": "trainer", "image": image, "command": ["python", "-c", script],
                                          "terminationMessagePolicy": "FallbackToLogsOnError",
                                          "resources": {"requests": {"cpu": "100m", "memory": "64Mi"},
                                                        "limits": {"cpu": "500m", "memory": "256Mi"}}}]}}}}}],
        },
    }
