"""A generic Kubernetes API server for tests: the REST protocol, nothing of any controller.

No kube-apiserver can run here, so this threaded `http.server` speaks the REST paths the
`kubernetes` client and `kubectl` use, with the real CRD schemas (`crds/`: JobSet v0.10.1, Kueue
v0.17.1, GKE's networking.gke.io Network and GKENetworkParamSet) deciding what a valid custom object is:

  /apis/GROUP/VERSION[/namespaces/NS]/PLURAL[/NAME[/status]]   custom and batch resources
  /api/v1[/namespaces/NS]/PLURAL[/NAME[/status|/log]]          core resources
  /api, /apis, /apis/GROUP, /api/v1, /apis/GROUP/VERSION       discovery
  /openapi/v3[/apis/GROUP/VERSION]                              OpenAPI v3 (what `kubectl apply` reads)
  /apis/authorization.k8s.io/v1/selfsubjectaccessreviews        RBAC answers (JSON or kubectl's protobuf)
  /version, /healthz, /readyz, /livez

`Accept: application/json;as=Table` (what `kubectl get` asks for) turns a GET into a Table with the
columns a real server prints; `srv.forbid(verb, resource, group)` makes RBAC say no (403, and in
SelfSubjectAccessReview). See `kube_views`.

Who may ask: `srv.token = "..."` makes every request need `Authorization: Bearer <token>` (401
Unauthorized without it, as kube-apiserver answers a request it cannot authenticate); the Host header
must name the server as its clients reach it (`127.0.0.1:PORT`, `localhost:PORT`, `[::1]:PORT`; any
other is 421, so a web page's DNS rebinding reaches nothing); a POST or PUT body is JSON or YAML (no
Content-Type means JSON, as kube-apiserver takes it) and a PATCH body one of the patch types: anything
else, `text/plain` or a form's type (what a web page can send without a CORS preflight), is 415.

Verbs: POST (create; no Content-Type required, as `CustomObjectsApi` sends none; `generateName`),
GET (read; list with `labelSelector` =, ==, !=, in, notin, exists, !exists and `fieldSelector` on
any dotted path such as metadata.name, status.phase, involvedObject.name; `watch=true` streams
ADDED/MODIFIED/DELETED from `resourceVersion` until `timeoutSeconds`), PUT (replace,
resourceVersion checked), PATCH (application/merge-patch+json, strategic merge treated as merge
for built-in kinds, json-patch), DELETE.

Object semantics as kube-apiserver and the garbage collector give them: `uid`, `generation` (bumped
on a spec change, never on a status write), a global `resourceVersion`, the `status` subresource
(ignored on create and on main-resource writes of custom resources), `preconditions.uid` and
`preconditions.resourceVersion` on delete, `finalizers` (an object with finalizers only gets a
`deletionTimestamp`), `propagationPolicy` Foreground (the owner waits with the `foregroundDeletion`
finalizer until its dependents are gone), Background (dependents collected after) and Orphan
(ownerReferences stripped), a pod deletion's grace period (the pod lingers, terminating, until
whatever plays the kubelet says its containers stopped). Errors are `Status` objects: 400
BadRequest, 404 NotFound, 409 AlreadyExists/Conflict, 415, 422 Invalid. `fieldValidation=Strict`
turns unknown fields into 400 "strict decoding error: unknown field ..." and the default (Warn)
drops them with a `Warning` header; schema violations are 422 with the field path.

Controllers plug in through `ApiServer(hooks=...)` (see `Hooks`): they may mutate an object on
create (an admission webhook), learn of every write, and say when a deleting pod is done.

    with ApiServer() as srv:           # starts on 127.0.0.1:<free port>
        srv.url                        # "http://127.0.0.1:PORT": Configuration().host for the client
        srv.fail_next(3, status=429, retry_after_s=1)   # next 3 requests answer 429 + Retry-After
        srv.fail_next(2, status=500, match="GET ")      # only requests whose "METHOD PATH" contains match
        srv.fail_next(1, status="drop")                 # close the connection without an answer
        srv.fail_next(1, status="lost", match="POST ")  # do the request, then close without an answer
        srv.fail_next(1, status=0, delay_s=2.0)         # a correct answer, 2 s late (client read timeouts)
        srv.go_down(); srv.come_back()                  # refuse connections, then listen again (same port)
        srv.outage("refuse", for_s=600)                 # a control-plane outage: connections refused for 600 s;
        srv.outage("unavailable", 600)                  #   every request answers 503 (Retry-After: 5);
        srv.outage("hang", 600); srv.end_outage()       #   requests accepted and never answered; over now
        srv.token = secrets.token_urlsafe(24)  # from now on every request needs it (Bearer)
        srv.tls = ssl_context              # set before start(): served over HTTPS (srv.url https://...)
        srv.requests                   # [(method, path, query dict, content type)] in arrival order
        srv.received                   # [(method, path, JSON body)] of each POST/PUT/PATCH/DELETE, as sent
"""

from __future__ import annotations

import builtins
import copy
import functools
import hmac
import json
import re
import secrets
import socket
import ssl
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from olmo_ctl.sandbox import kube_shapes as shapes
from olmo_ctl.sandbox import kube_views as views
from olmo_ctl.sandbox.kube_common import (
    ADMISSIONCHECK_CRD,
    CLUSTERQUEUE_CRD,
    GKE_NETWORK_PARAMSET_CRD,
    JOBSET_CRD,
    LOCALQUEUE_CRD,
    NETWORK_CRD,
    RESOURCEFLAVOR_CRD,
    WORKLOAD_CRD,
    WPC_CRD,
    ApiError,
    _python_patterns,
    crd_versions,
)

OBJECT_META_FIELDS = frozenset(
    {
        "name",
        "generateName",
        "namespace",
        "labels",
        "annotations",
        "ownerReferences",
        "finalizers",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "managedFields",
        "selfLink",
    }
)
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUB = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def meta_type_errors(md: dict) -> list[str]:
    """ObjectMeta fields of the wrong type (what kube-apiserver could not even decode)."""
    out = []
    for key in ("name", "generateName", "namespace", "resourceVersion", "uid"):
        if md.get(key) is not None and not isinstance(md[key], str):
            out.append(f"metadata.{key}: Invalid value: must be a string")
    for key in ("labels", "annotations"):
        v = md.get(key)
        if v is not None and not (isinstance(v, dict) and all(isinstance(k, str) for k in v)):
            out.append(f"metadata.{key}: Invalid value: must be a map of strings")
    fins = md.get("finalizers")
    if fins is not None and not (isinstance(fins, list) and all(isinstance(f, str) for f in fins)):
        out.append("metadata.finalizers: Invalid value: must be a list of strings")
    refs = md.get("ownerReferences")
    if refs is not None and not isinstance(refs, list):
        out.append("metadata.ownerReferences: Invalid value: must be a list")
    for i, ref in enumerate(refs if isinstance(refs, list) else []):
        if not isinstance(ref, dict):
            out.append(f"metadata.ownerReferences[{i}]: Invalid value: must be an object")
            continue
        for key in ("apiVersion", "kind", "name", "uid"):
            if not isinstance(ref.get(key), str) or not ref[key]:
                out.append(f"metadata.ownerReferences[{i}].{key}: Invalid value: must not be empty")
    return out


def now_iso(offset_s: float = 0.0) -> str:
    return datetime.fromtimestamp(time.time() + offset_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------- schemas


@functools.cache
def _validator(filename: str, version: str):
    import jsonschema

    schema = _python_patterns(copy.deepcopy(crd_versions(filename)[version]))
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
    for e in sorted(
        v.iter_errors({k: x for k, x in obj.items() if k != "metadata"}), key=lambda e: list(e.path)
    ):
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
    namespaced: bool = True
    short_names: tuple[str, ...] = ()

    def api_version(self, version: str | None = None) -> str:
        version = version or self.versions[0]
        return f"{self.group}/{version}" if self.group else version

    @property
    def qualified(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)


KUEUE = "kueue.x-k8s.io"
KUEUE_VERSIONS = ("v1beta1", "v1beta2")
BUILTIN = (
    Resource("jobset.x-k8s.io", ("v1alpha2",), "jobsets", "JobSet", JOBSET_CRD, short_names=("js",)),
    Resource(KUEUE, KUEUE_VERSIONS, "workloads", "Workload", WORKLOAD_CRD, short_names=("wl",)),
    Resource(KUEUE, KUEUE_VERSIONS, "localqueues", "LocalQueue", LOCALQUEUE_CRD, short_names=("lq", "queue")),
    Resource(
        KUEUE,
        KUEUE_VERSIONS,
        "clusterqueues",
        "ClusterQueue",
        CLUSTERQUEUE_CRD,
        namespaced=False,
        short_names=("cq",),
    ),
    Resource(
        KUEUE,
        KUEUE_VERSIONS,
        "resourceflavors",
        "ResourceFlavor",
        RESOURCEFLAVOR_CRD,
        namespaced=False,
        short_names=("rf", "flavor"),
    ),
    Resource(
        KUEUE,
        KUEUE_VERSIONS,
        "workloadpriorityclasses",
        "WorkloadPriorityClass",
        WPC_CRD,
        has_status=False,
        namespaced=False,
    ),
    Resource(
        KUEUE,
        KUEUE_VERSIONS,
        "admissionchecks",
        "AdmissionCheck",
        ADMISSIONCHECK_CRD,
        namespaced=False,
    ),
    Resource("batch", ("v1",), "jobs", "Job"),
    Resource("apps", ("v1",), "deployments", "Deployment", short_names=("deploy",)),
    Resource("apps", ("v1",), "daemonsets", "DaemonSet", short_names=("ds",)),
    # GKE multi-networking (a GPU pod's extra interfaces): served as GKE serves them, cluster-scoped.
    Resource("networking.gke.io", ("v1",), "networks", "Network", NETWORK_CRD, namespaced=False),
    Resource(
        "networking.gke.io",
        ("v1",),
        "gkenetworkparamsets",
        "GKENetworkParamSet",
        GKE_NETWORK_PARAMSET_CRD,
        namespaced=False,
    ),
    Resource(
        "scheduling.k8s.io",
        ("v1",),
        "priorityclasses",
        "PriorityClass",
        has_status=False,
        namespaced=False,
        short_names=("pc",),
    ),
    Resource("", ("v1",), "pods", "Pod", short_names=("po",)),
    Resource("", ("v1",), "events", "Event", has_status=False, short_names=("ev",)),
    Resource("", ("v1",), "namespaces", "Namespace", namespaced=False, short_names=("ns",)),
    Resource("", ("v1",), "serviceaccounts", "ServiceAccount", has_status=False, short_names=("sa",)),
    Resource("", ("v1",), "nodes", "Node", namespaced=False, short_names=("no",)),
)
RESOURCES = {r.key: r for r in BUILTIN}
KIND_TO_RESOURCE = {r.kind: r for r in BUILTIN}


def not_found(res: Resource, name: str) -> ApiError:
    return ApiError(
        404,
        "NotFound",
        f'{res.qualified} "{name}" not found',
        {"name": name, "group": res.group, "kind": res.plural},
    )


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


# One requirement of a selector each, built in a function so that each binds its own key and value.
def _label_in(key: str, values: set[str]) -> Callable[[dict], bool]:
    return lambda lab: lab.get(key) in values


def _label_not_in(key: str, values: set[str]) -> Callable[[dict], bool]:
    return lambda lab: lab.get(key) not in values


def _label_equal(key: str, value: str) -> Callable[[dict], bool]:
    return lambda lab: key in lab and lab[key] == value


def _label_not_equal(key: str, value: str) -> Callable[[dict], bool]:
    return lambda lab: lab.get(key) != value


def _label_exists(key: str, negated: bool) -> Callable[[dict], bool]:
    return lambda lab: (key in lab) != negated


def parse_label_selector(sel: str) -> Callable[[dict], bool]:
    """A predicate over a labels dict; raises ApiError(400) on a malformed selector."""
    reqs: list[Callable[[dict], bool]] = []
    for term in _split_top(sel or ""):
        m = re.fullmatch(r"([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)", term)
        if m:
            vals = {v.strip() for v in m.group(3).split(",") if v.strip()}
            key, op = m.group(1), m.group(2)
            reqs.append(_label_in(key, vals) if op == "in" else _label_not_in(key, vals))
            continue
        m = re.fullmatch(r"([^\s!=]+)\s*(==|=|!=)\s*([^\s,]*)", term)
        if m:
            key, op, val = m.groups()
            reqs.append(_label_not_equal(key, val) if op == "!=" else _label_equal(key, val))
            continue
        m = re.fullmatch(r"(!?)([^\s!=()]+)", term)
        if m:
            neg, key = m.groups()
            reqs.append(_label_exists(key, negated=bool(neg)))
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


def _field_equal(path: str, value: str) -> Callable[[dict], bool]:
    return lambda obj: str(_field(obj, path) or "") == value


def _field_not_equal(path: str, value: str) -> Callable[[dict], bool]:
    return lambda obj: str(_field(obj, path) or "") != value


def parse_field_selector(sel: str) -> Callable[[dict], bool]:
    reqs: list[Callable[[dict], bool]] = []
    for term in _split_top(sel or ""):
        m = re.fullmatch(r"([\w.]+)\s*(==|=|!=)\s*(.*)", term)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid field selector: {term!r}")
        path, op, val = m.groups()
        reqs.append(_field_not_equal(path, val) if op == "!=" else _field_equal(path, val))
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


# ---------------------------------------------------------------- store and garbage collector


FOREGROUND = "foregroundDeletion"
HISTORY = 5000  # watch events kept for `resourceVersion` resumption


class Store:
    """Objects by (resource key, namespace, name); one lock; a global resourceVersion counter; the
    deletion rules (finalizers, propagation, grace periods) and the garbage collector."""

    def __init__(
        self, resources: dict[tuple[str, str], Resource] | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.resources = dict(resources or RESOURCES)
        self.objects: dict[tuple[tuple[str, str], str, str], dict] = {}
        self.logs: dict[tuple[str, ...], list[str]] = {}  # (ns, pod) or (ns, pod, container) -> lines
        self.history: list[tuple[int, str, tuple[str, str], dict]] = []
        self.clock = clock
        self._rv = 1000
        # Whether a deleting pod's containers have stopped (the kubelet's part); without a kubelet
        # a deleted pod goes at once.
        self.pod_stopped: Callable[[dict], bool] = lambda pod: True

    def now_iso(self, offset_s: float = 0.0) -> str:
        return datetime.fromtimestamp(self.clock() + offset_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    @property
    def rv(self) -> str:
        return str(self._rv)

    def next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    @staticmethod
    def key(res: Resource, ns: str, name: str):
        return (res.key, ns if res.namespaced else "", name)

    def resource_of(self, obj: dict) -> Resource:
        return next(
            r
            for r in self.resources.values()
            if r.kind == obj.get("kind") and r.group == (obj.get("apiVersion") or "").rpartition("/")[0]
        )

    def get(self, res: Resource, ns: str, name: str) -> dict | None:
        return self.objects.get(self.key(res, ns, name))

    def _record(self, kind: str, res: Resource, obj: dict) -> None:
        self.history.append((self._rv, kind, res.key, copy.deepcopy(obj)))
        del self.history[:-HISTORY]
        with self.changed:
            self.changed.notify_all()

    def put(self, res: Resource, obj: dict) -> dict:
        md = obj["metadata"]
        key = self.key(res, md.get("namespace", ""), md["name"])
        kind = "MODIFIED" if key in self.objects else "ADDED"
        md["resourceVersion"] = self.next_rv()
        self.objects[key] = obj
        self._record(kind, res, obj)
        return obj

    def items(self, res: Resource, ns: str | None = None) -> list[dict]:
        return [
            o
            for (rk, ons, _), o in sorted(self.objects.items(), key=lambda kv: kv[0])
            if rk == res.key and (ns is None or not res.namespaced or ons == ns)
        ]

    def all(self) -> Iterable[tuple[Resource, dict]]:
        for (rk, _, _), o in sorted(self.objects.items(), key=lambda kv: kv[0]):
            yield self.resources[rk], o

    def dependents(self, obj: dict) -> list[tuple[Resource, dict]]:
        uid, ns = obj["metadata"].get("uid"), obj["metadata"].get("namespace", "")
        return [
            (r, o)
            for r, o in self.all()
            if o is not obj
            and any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences") or [])
            and (not r.namespaced or o["metadata"].get("namespace", "") == ns or not ns)
        ]

    # -- deletion, as kube-apiserver and the garbage collector do it
    def delete(
        self,
        res: Resource,
        obj: dict,
        policy: str = "Background",
        grace_s: int | None = None,
        collect: bool = True,
    ) -> None:
        """Ask for `obj` to go: it gets a deletionTimestamp; it is removed once its finalizers are
        gone (and, for a pod, once its containers stopped). Foreground: the owner keeps the
        `foregroundDeletion` finalizer until its dependents are gone; Orphan: they lose the reference."""
        md = obj["metadata"]
        if res.plural == "pods":
            if grace_s is None:
                grace_s = int((obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30))
            if md.get("deletionTimestamp") is None or grace_s < int(
                md.get("deletionGracePeriodSeconds") or 0
            ):
                md["deletionGracePeriodSeconds"] = grace_s
                md["deletionTimestamp"] = self.now_iso(grace_s)
                self.put(res, obj)
            if collect:
                self.collect()
            return
        if md.get("deletionTimestamp") is None:
            md["deletionTimestamp"] = self.now_iso()
            md["deletionGracePeriodSeconds"] = 0
            if policy == "Orphan":
                for dres, dep in self.dependents(obj):
                    dep["metadata"]["ownerReferences"] = [
                        r for r in dep["metadata"]["ownerReferences"] if r.get("uid") != md.get("uid")
                    ]
                    self.put(dres, dep)
            elif policy == "Foreground" and self.dependents(obj):
                md["finalizers"] = list(md.get("finalizers") or []) + [FOREGROUND]
            self.put(res, obj)
        if collect:
            self.collect()

    def _remove(self, res: Resource, obj: dict) -> None:
        md = obj["metadata"]
        self.objects.pop(self.key(res, md.get("namespace", ""), md["name"]), None)
        if res.plural == "pods":
            where = (md.get("namespace", ""), md["name"])
            for key in [k for k in self.logs if k[:2] == where]:
                del self.logs[key]
        self.next_rv()
        self._record("DELETED", res, obj)

    def collect(self) -> None:
        """The garbage collector, to a fixed point: foreground owners wait for their dependents,
        dependents whose owners are all gone are deleted, finalizer-free deleting objects go."""
        for _ in range(1000):
            changed = False
            uids = {o["metadata"].get("uid") for _, o in self.all()}
            for res, obj in list(self.all()):
                md = obj["metadata"]
                if self.objects.get(self.key(res, md.get("namespace", ""), md["name"])) is not obj:
                    continue  # removed on the way
                refs = md.get("ownerReferences") or []
                if md.get("deletionTimestamp") is None:
                    if refs and not any(r.get("uid") in uids for r in refs):
                        self.delete(res, obj, "Background", collect=False)
                        changed = True
                    continue
                fins = list(md.get("finalizers") or [])
                if FOREGROUND in fins:
                    deps = self.dependents(obj)
                    for dres, dep in deps:
                        if dep["metadata"].get("deletionTimestamp") is None:
                            self.delete(dres, dep, "Foreground", collect=False)
                            changed = True
                    if not deps:
                        md["finalizers"] = [f for f in fins if f != FOREGROUND]
                        self.put(res, obj)
                        changed = True
                    continue
                if fins:
                    continue
                if res.plural == "pods" and not (
                    int(md.get("deletionGracePeriodSeconds") or 0) == 0 or self.pod_stopped(obj)
                ):
                    continue
                self._remove(res, obj)
                changed = True
            if not changed:
                return
        raise RuntimeError("the garbage collector does not converge")


# ---------------------------------------------------------------- the HTTP side


# Paths no Kubernetes API has: a server's own control requests (`ApiServer.control`).
CONTROL_PREFIX = "/olmo-ctl/"

# The bodies kube-apiserver decodes, by verb (k8s.io/apiserver handlers: NegotiateInputSerializer for
# create and update, the patch types for PATCH). No Content-Type on a POST or PUT is its first
# serializer's, JSON. Protobuf is decoded only where this server speaks it (SelfSubjectAccessReview).
JSON, YAML, PROTOBUF = "application/json", "application/yaml", "application/vnd.kubernetes.protobuf"
BODY_MEDIA_TYPES = (JSON, YAML, PROTOBUF)
PATCH_MEDIA_TYPES = (
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
    "application/apply-patch+yaml",
)


def media_type(ctype: str) -> str:
    """`application/json; charset=utf-8` -> `application/json`."""
    return ctype.split(";")[0].strip().lower()


def unsupported_media_type(accepted: tuple[str, ...]) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        "the body of the request was in an unknown format - accepted media types include: "
        + ", ".join(accepted),
    )


def local_hosts(port: int) -> frozenset[str]:
    """The Host headers of a request addressed to this machine's server on `port`."""
    return frozenset({f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"})


def refusal(method: str, headers: Any, port: int, token: str | None) -> ApiError | None:
    """Why a request is refused before anything reads it, or None: a Host that is not this server's
    (421), no or another bearer token when the server has one (401), a body of a type no API server
    decodes (415)."""
    host = (headers.get("Host") or "").strip()
    if host.lower() not in local_hosts(port):
        return ApiError(
            421,
            "MisdirectedRequest",
            f"the request's Host {host or '(none)'!r} is not this server's address "
            f"(127.0.0.1:{port}, localhost:{port} or [::1]:{port})",
        )
    if token is not None:
        scheme, _, given = (headers.get("Authorization") or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode("utf-8", "replace"), token.encode()
        ):
            return ApiError(401, "Unauthorized", "Unauthorized")
    mt = media_type(headers.get("Content-Type") or "")
    if method == "PATCH" and mt not in PATCH_MEDIA_TYPES:
        return unsupported_media_type(PATCH_MEDIA_TYPES)
    if method in ("POST", "PUT") and mt and mt not in BODY_MEDIA_TYPES:
        return unsupported_media_type(BODY_MEDIA_TYPES)
    return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that goes away or never speaks TLS (plain HTTP to an HTTPS port, a port scan) is
        not the server's error; anything else is, loudly."""
        if isinstance(sys.exc_info()[1], ssl.SSLError | ConnectionError | TimeoutError):
            return
        super().handle_error(request, client_address)


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
        srv: ApiServer = self.server.kube  # type: ignore[attr-defined]
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        body = self._body()
        ctype = self.headers.get("Content-Type", "")
        accept = self.headers.get("Accept", "")
        refused = refusal(method, self.headers, srv.port, srv.token)
        if refused is not None:  # before anything else: no control path, fault or object for it
            self._send(refused.code, refused.status(), refused.headers)
            return
        if srv.control is not None and parts.path.startswith(CONTROL_PREFIX):
            # Served by whoever set `control` (the sandbox: its faults), before any injected fault.
            code, answer = srv.control(method, parts.path, dict(self.headers.items()), body)
            self._send(code, answer)
            return
        srv._record(method, parts.path, query, ctype, body)
        mode = srv.outage_mode()
        if mode == "hang":  # accepted, never answered: the client's read timeout ends it
            srv._outage_over.wait()
            self._hang_up()
            return
        if mode == "unavailable":
            err = ApiError(503, "ServiceUnavailable", "the server is currently unable to handle the request")
            self._send(503, err.status(), {"Retry-After": "5"})
            return
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
                err = ApiError(
                    fault.status,
                    "TooManyRequests" if fault.status == 429 else "InternalError",
                    "the server has received too many requests and has asked us to try again later"
                    if fault.status == 429
                    else 'an error on the server ("injected") has prevented the request from succeeding',
                )
                headers = {"Retry-After": str(fault.retry_after_s)} if fault.retry_after_s is not None else {}
                self._send(fault.status, err.status(), headers)
                return
        try:
            code, payload, headers, text = srv.api.dispatch(method, parts.path, query, body, ctype)
            if method == "GET" and code == 200 and text is False and views.wants_table(accept):
                payload = srv.api.as_table(parts.path, payload)
        except ApiError as e:
            code, payload, headers, text = e.code, e.status(), e.headers, False
        except Exception as e:  # a bug in the test server: say so loudly
            self._send(
                500, ApiError(500, "InternalError", f"test server bug: {type(e).__name__}: {e}").status()
            )
            raise
        if fault is not None and fault.status == "lost":  # done, but the answer never arrives
            self._hang_up()
            return
        if text == "watch":
            self._stream(payload)
            return
        self._send(code, payload, headers, text)

    def _stream(self, lines) -> None:
        """A watch: JSON lines until the stream ends, then the connection closes (HTTP/1.0)."""
        self.close_connection = True
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.flush()
            for chunk in lines:
                self.wfile.write(chunk)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass

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


class Hooks:
    """What controllers plug into the API server; every method is optional to override."""

    def tick(self) -> None:
        """Before each request: let time-driven work (grace periods, backoffs) happen."""

    def admit(self, res: Resource, obj: dict) -> None:
        """A mutating admission webhook on create: change `obj`, or raise ApiError to refuse it."""

    def written(self) -> None:
        """After each write request: the controllers react."""


class Api:
    """The REST semantics over a Store."""

    def __init__(self, store: Store, hooks: Hooks | None = None):
        self.store, self.hooks = store, hooks or Hooks()
        self.deleted: list[tuple[str, str, str]] = []  # (kind, name, propagationPolicy) of API deletions
        # (verb, group, resource) the caller may not use ("*" matches any); see ApiServer.forbid
        self.forbidden: set[tuple[str, str, str]] = set()

    def allowed(self, verb: str, group: str, resource: str, subresource: str | None = None) -> bool:
        what = f"{resource}/{subresource}" if subresource else resource
        return not any(
            v in (verb, "*") and g in (group, "*") and r in (what, "*") for v, g, r in self.forbidden
        )

    # -- routing and discovery
    def resource(self, group: str, plural: str, version: str) -> Resource:
        res = self.store.resources.get((group, plural))
        if res is None or version not in res.versions:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return res

    def route(self, path: str) -> tuple[Resource, str, str | None, str | None, str | None]:
        m = re.fullmatch(r"/api/v1(?:/namespaces/([^/]+))?/([^/]+)(?:/([^/]+))?(?:/([^/]+))?", path)
        group, version = "", "v1"
        if not m:
            m2 = re.fullmatch(
                r"/apis/([^/]+)/([^/]+)(?:/namespaces/([^/]+))?/([^/]+)(?:/([^/]+))?(?:/([^/]+))?", path
            )
            if not m2:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            group, version = m2.group(1), m2.group(2)
            ns, plural, name, sub = m2.group(3), m2.group(4), m2.group(5), m2.group(6)
        else:
            ns, plural, name, sub = m.groups()
        res = self.resource(group, plural, version)
        if (
            sub not in (None, "status", "log")
            or (sub == "log" and plural != "pods")
            or (sub == "status" and not res.has_status)
        ):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if not res.namespaced:
            if ns is not None:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            ns = ""
        return res, version, ns, name, sub

    def discovery(self, path: str) -> dict | None:
        path = path.rstrip("/")
        by_gv: dict[tuple[str, str], list[Resource]] = {}
        for r in self.store.resources.values():
            for v in r.versions:
                by_gv.setdefault((r.group, v), []).append(r)
        if path == "/api":
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}],
            }
        if path == "/apis":
            groups: dict[str, list[str]] = {views.AUTHZ_GROUP: [views.AUTHZ_VERSION]}
            for g, v in by_gv:
                if g:
                    groups.setdefault(g, []).append(v)
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": g,
                        "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                        "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]},
                    }
                    for g, vs in sorted(groups.items())
                ],
            }
        if path == f"/apis/{views.AUTHZ_GROUP}/{views.AUTHZ_VERSION}":
            return views.authz_discovery()
        m = re.fullmatch(r"/apis/([^/]+)", path)
        if m:  # one group (APIGroup)
            vs = [v for g, v in by_gv if g == m.group(1)] or (
                [views.AUTHZ_VERSION] if m.group(1) == views.AUTHZ_GROUP else []
            )
            if not vs:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return {
                "kind": "APIGroup",
                "apiVersion": "v1",
                "name": m.group(1),
                "versions": [{"groupVersion": f"{m.group(1)}/{v}", "version": v} for v in vs],
                "preferredVersion": {"groupVersion": f"{m.group(1)}/{vs[0]}", "version": vs[0]},
            }
        m = re.fullmatch(r"/api/(v1)|/apis/([^/]+)/([^/]+)", path)
        if not m:
            return None
        gv = ("", "v1") if m.group(1) else (m.group(2), m.group(3))
        if gv not in by_gv:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
        out = []
        for r in by_gv[gv]:
            out.append(
                {
                    "name": r.plural,
                    "singularName": r.kind.lower(),
                    "namespaced": r.namespaced,
                    "kind": r.kind,
                    "verbs": verbs,
                    "shortNames": list(r.short_names),
                }
            )
            if r.has_status:
                out.append(
                    {
                        "name": f"{r.plural}/status",
                        "singularName": "",
                        "namespaced": r.namespaced,
                        "kind": r.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
            if r.plural == "pods":
                out.append(
                    {
                        "name": "pods/log",
                        "singularName": "",
                        "namespaced": True,
                        "kind": "Pod",
                        "verbs": ["get"],
                    }
                )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{gv[0]}/{gv[1]}" if gv[0] else "v1",
            "resources": out,
        }

    def dispatch(self, method: str, path: str, query: dict, body: bytes, ctype: str):
        if path in ("/version", "/version/"):
            return (
                200,
                {
                    "major": "1",
                    "minor": "33",
                    "gitVersion": "v1.33.0-olmo-ctl-test",
                    "platform": "linux/amd64",
                },
                {},
                False,
            )
        if path in ("/healthz", "/readyz", "/livez"):
            return 200, "ok", {}, True
        if method == "GET" and path.startswith("/openapi/v3"):
            doc = views.openapi_v3(self.store.resources, path)
            if doc is None:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return 200, doc, {}, False
        if (
            path.rstrip("/") == f"/apis/{views.AUTHZ_GROUP}/{views.AUTHZ_VERSION}/{views.SSAR}"
            and method == "POST"
        ):
            if ctype.startswith("application/vnd.kubernetes.protobuf"):
                try:
                    review = views.decode_access_review(body)
                except (ValueError, IndexError, UnicodeDecodeError) as e:
                    raise ApiError(400, "BadRequest", f"cannot decode the protobuf body: {e}") from None
            else:
                review = self._decode(body, ctype)
            return 201, views.access_review(review, self.allowed), {}, False
        with self.store.lock:
            self.hooks.tick()
            if method == "GET":
                disc = self.discovery(path)
                if disc is not None:
                    return 200, disc, {}, False
            res, version, ns, name, sub = self.route(path)
            verb = views.verb_of(method, name, query)
            if not self.allowed(verb, res.group, res.plural, sub):
                raise ApiError(
                    403,
                    "Forbidden",
                    views.forbidden_message(verb, res.group, res.plural, sub, ns or None, name),
                    {"name": name or "", "group": res.group, "kind": res.plural},
                )
            if method == "GET" and name is None and query.get("watch") in ("true", "1"):
                return 200, self.watch(res, version, ns, query), {}, "watch"
            if method == "GET" and name is None:
                return 200, self.list(res, version, ns, query), {}, False
            if ns is None:
                raise ApiError(405, "MethodNotAllowed", "namespaced resource needs a namespace")
            if method == "GET" and name is not None:
                if sub == "log":
                    return 200, self.pod_log(ns, name, query), {}, True
                obj = self.store.get(res, ns, name)
                if obj is None:
                    raise not_found(res, name)
                return 200, self.out(res, version, obj), {}, False
            try:
                if method == "POST" and name is None:
                    obj, warnings = self.create(res, version, ns, self._decode(body, ctype), query)
                    return 201, self.out(res, version, obj), self._warn(warnings), False
                if method == "DELETE" and name is None:
                    return 200, self.delete_collection(res, version, ns, query, body), {}, False
                if name is None:
                    raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on a collection here")
                if method == "DELETE":
                    return 200, self.delete(res, version, ns, name, query, body), {}, False
                if method == "PATCH":
                    obj = self.patch(res, version, ns, name, sub, body, ctype)
                    return 200, self.out(res, version, obj), {}, False
                if method == "PUT":
                    obj, warnings = self.replace(
                        res, version, ns, name, sub, self._decode(body, ctype), query
                    )
                    return 200, self.out(res, version, obj), self._warn(warnings), False
            finally:
                self.hooks.written()
        raise ApiError(405, "MethodNotAllowed", f"{method} {path} is not supported")

    def as_table(self, path: str, payload: Any) -> Any:
        """A GET's object or list as the Table `kubectl get` asks for (Accept: ...;as=Table); anything
        else (discovery, OpenAPI) as it is."""
        try:
            res, version, *_ = self.route(path)
        except ApiError:
            return payload
        if not isinstance(payload, dict) or payload.get("kind") not in (res.kind, f"{res.kind}List"):
            return payload
        return views.table(res, version, payload, self.store.clock())

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

    @classmethod
    def _decode(cls, body: bytes, ctype: str) -> Any:
        """A POST or PUT body as its Content-Type says (none: JSON, as kube-apiserver reads it)."""
        mt = media_type(ctype)
        if mt == YAML:
            import yaml

            try:
                return yaml.safe_load(body or b"null")
            except yaml.YAMLError as e:
                why = " ".join(str(e).split())
                raise ApiError(400, "BadRequest", f"the request body is not valid YAML: {why}") from None
        if mt == PROTOBUF:  # accepted at the door, decoded only for SelfSubjectAccessReview
            raise unsupported_media_type((JSON, YAML))
        return cls._json(body)

    @staticmethod
    def out(res: Resource, version: str, obj: dict) -> dict:
        o = copy.deepcopy(obj)
        o["apiVersion"] = res.api_version(version)
        o["kind"] = res.kind
        return o

    def _selected(self, query: dict) -> Callable[[dict], bool]:
        lsel = parse_label_selector(query.get("labelSelector", ""))
        fsel = parse_field_selector(query.get("fieldSelector", ""))
        return lambda o: lsel(o["metadata"].get("labels") or {}) and fsel(o)

    def list(self, res: Resource, version: str, ns: str | None, query: dict) -> dict:
        sel = self._selected(query)
        items = [self.out(res, version, o) for o in self.store.items(res, ns) if sel(o)]
        return {
            "apiVersion": res.api_version(version),
            "kind": f"{res.kind}List",
            "metadata": {"resourceVersion": self.store.rv},
            "items": items,
        }

    def watch(self, res: Resource, version: str, ns: str | None, query: dict):
        """A generator of watch lines: ADDED/MODIFIED/DELETED after `resourceVersion` (all objects as
        ADDED first when none is given or it is "0"), until `timeoutSeconds` (at most 300)."""
        sel = self._selected(query)
        rv = query.get("resourceVersion") or "0"
        first: list[dict] = []
        if rv == "0":
            first = [self.out(res, version, o) for o in self.store.items(res, ns) if sel(o)]
            last = self.store._rv
        else:
            last = int(rv)
            if self.store.history and last < self.store.history[0][0] - 1:
                raise ApiError(410, "Expired", f"too old resource version: {rv} ({self.store.history[0][0]})")
        deadline = time.monotonic() + min(float(query.get("timeoutSeconds") or 300), 300)

        def line(kind: str, obj: dict) -> bytes:
            return (json.dumps({"type": kind, "object": obj}) + "\n").encode()

        def stream():
            nonlocal last
            for o in first:
                yield line("ADDED", o)
            while True:
                with self.store.changed:
                    evs = [h for h in self.store.history if h[0] > last and h[2] == res.key]
                    if not evs:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            return
                        self.store.changed.wait(min(remaining, 0.25))
                        continue
                    last = evs[-1][0]
                    out = [
                        (k, self.out(res, version, o))
                        for _, k, _, o in evs
                        if (ns is None or not res.namespaced or o["metadata"].get("namespace") == ns)
                        and sel(o)
                    ]
                for k, o in out:
                    yield line(k, o)

        return stream()

    # -- validation
    def validate(
        self, res: Resource, version: str, obj: Any, query: dict, name_hint: str = ""
    ) -> builtins.list[str]:
        if not isinstance(obj, dict):
            raise ApiError(400, "BadRequest", "the request body is not a JSON object")
        md = obj.get("metadata")
        if not isinstance(md, dict):
            raise ApiError(
                422, "Invalid", f'{res.kind}.{res.group} "{name_hint}" is invalid: metadata: Required value'
            )
        name = md.get("name") or name_hint
        errors: list[str] = meta_type_errors(md)
        if errors:
            raise self._invalid(res, name, errors)
        warnings: list[str] = []
        mode = query.get("fieldValidation", "Warn")
        unknown = [f"metadata.{k}" for k in md if k not in OBJECT_META_FIELDS]
        if res.crd:
            schema = crd_versions(res.crd)[version]
            body_schema = dict(schema)
            body_schema["properties"] = {
                k: v for k, v in schema.get("properties", {}).items() if k != "metadata"
            }
            unknown += [
                p for p in unknown_fields({k: v for k, v in obj.items() if k != "metadata"}, body_schema)
            ]
        if unknown:
            if mode == "Strict":
                raise ApiError(
                    400,
                    "BadRequest",
                    f'{res.kind} in version "{version}" cannot be handled as a '
                    f"{res.kind}: strict decoding error: "
                    + ", ".join(f'unknown field "{u}"' for u in unknown),
                )
            if mode != "Ignore":
                warnings += [f'unknown field "{u}"' for u in unknown]
            _drop_paths(obj, unknown)
        if not isinstance(name, str) or not name:
            errors.append("metadata.name: Required value: name or generateName is required")
        elif res.plural == "jobsets":
            if not _DNS1035.match(name) or len(name) > 63:
                errors.append(
                    f'metadata.name: Invalid value: "{name}": a lowercase RFC 1035 label must consist of '
                    "lower case alphanumeric characters or '-', start with an alphabetic character, "
                    "and end with an alphanumeric character (at most 63 characters)"
                )
        elif not _DNS1123_SUB.match(name) or len(name) > 253:
            errors.append(
                f'metadata.name: Invalid value: "{name}": a lowercase RFC 1123 subdomain is required'
            )
        for k, v in (md.get("labels") or {}).items():
            key_name = k.rsplit("/", 1)[-1]
            if not _LABEL_NAME.match(key_name) or len(key_name) > 63:
                errors.append(f'metadata.labels: Invalid value: "{k}": name part must be a valid label key')
            if not isinstance(v, str) or not _LABEL_VALUE.match(v) or len(v) > 63:
                errors.append(
                    f'metadata.labels: Invalid value: "{v}": a valid label must be an empty string or '
                    "consist of alphanumeric characters, '-', '_' or '.', at most 63 characters"
                )
        for k, v in (md.get("annotations") or {}).items():
            if not isinstance(v, str):
                errors.append(f"metadata.annotations.{k}: Invalid value: must be a string")
        if res.crd:
            errors += schema_errors(obj, res.crd, version)
            if obj.get("apiVersion") not in (None, res.api_version(version)) or obj.get("kind") not in (
                None,
                res.kind,
            ):
                errors.append(
                    f"apiVersion/kind: Invalid value: expected {res.api_version(version)} {res.kind}"
                )
        if errors:
            raise self._invalid(res, name, errors)
        return warnings

    @staticmethod
    def _invalid(res: Resource, name: Any, errors: builtins.list[str]) -> ApiError:
        return ApiError(
            422,
            "Invalid",
            f'{res.kind}.{res.group or "core"} "{name}" is invalid: ' + "; ".join(errors),
            {
                "name": name,
                "group": res.group,
                "kind": res.kind,
                "causes": [{"message": e} for e in errors],
            },
        )

    def check_shape(self, res: Resource, obj: dict, before: dict | None = None) -> None:
        """What kube-apiserver defaults and requires of the object as it will be stored, beyond its
        metadata and schema (`kube_shapes`): 422 Invalid for what the controllers could not read."""
        if res.kind == "Pod":
            shapes.default_pod_status(obj, before)
        elif before is not None and res.has_status and not res.crd and obj.get("status") is None:
            if before.get("status") is not None:  # a write without the status leaves it as it was
                obj["status"] = copy.deepcopy(before["status"])
        errors = shapes.shape_errors(res.kind, obj)
        if errors:
            raise self._invalid(res, obj["metadata"].get("name"), errors)

    # -- verbs
    def create(
        self, res: Resource, version: str, ns: str, obj: Any, query: dict
    ) -> tuple[dict, builtins.list[str]]:
        obj = copy.deepcopy(obj)
        if isinstance(obj, dict) and isinstance(obj.get("metadata"), dict):
            md = obj["metadata"]
            if res.namespaced and md.get("namespace") not in (None, ns):
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on the request",
                )
            if not md.get("name") and md.get("generateName"):
                md["name"] = md["generateName"] + secrets.token_hex(3)[:5]
        warnings = self.validate(res, version, obj, query)
        md = obj["metadata"]
        if self.store.get(res, ns, md["name"]) is not None:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{res.qualified} "{md["name"]}" already exists',
                {"name": md["name"], "group": res.group, "kind": res.plural},
            )
        md.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=self.store.now_iso())
        if res.namespaced:
            md["namespace"] = ns
        else:
            md.pop("namespace", None)
        for k in ("deletionTimestamp", "resourceVersion", "deletionGracePeriodSeconds"):
            md.pop(k, None)
        if res.has_status and res.crd:
            obj.pop("status", None)  # the status subresource: ignored on create
        self.check_shape(res, obj)
        obj["apiVersion"], obj["kind"] = res.api_version(version), res.kind
        self.hooks.admit(res, obj)
        self.store.put(res, obj)
        return obj, warnings

    def replace(
        self, res: Resource, version: str, ns: str, name: str, sub: str | None, new: Any, query: dict
    ) -> tuple[dict, builtins.list[str]]:
        cur = self.store.get(res, ns, name)
        if cur is None:
            raise not_found(res, name)
        new = copy.deepcopy(new)
        warnings = self.validate(res, version, new, query, name)
        rv = new["metadata"].get("resourceVersion")
        if rv and rv != cur["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {res.qualified} "{name}": the object '
                "has been modified; please apply your changes to the latest version and try again",
            )
        return self._commit(res, cur, new, sub), warnings

    def patch(
        self, res: Resource, version: str, ns: str, name: str, sub: str | None, body: bytes, ctype: str
    ) -> dict:
        cur = self.store.get(res, ns, name)
        if cur is None:
            raise not_found(res, name)
        ct = media_type(ctype)
        if ct == "application/apply-patch+yaml":
            raise ApiError(
                415,
                "UnsupportedMediaType",
                "server-side apply is not served here: apply without --server-side "
                "(accepted patch types: application/json-patch+json, application/merge-patch+json)",
            )
        doc = self._json(body)
        if ct in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            if ct.startswith("application/strategic") and res.crd:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    "strategic merge patch is not supported for custom resources; use merge-patch",
                )
            new = merge_patch(cur, doc)
        elif ct == "application/json-patch+json":
            new = json_patch(cur, doc)
        else:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - "
                f"accepted media types include: application/json-patch+json, "
                f"application/merge-patch+json (got {ct!r})",
            )
        new["metadata"]["name"] = name
        if res.namespaced:
            new["metadata"]["namespace"] = ns
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
            if {k: v for k, v in merged.items() if k not in ("metadata", "status")} != {
                k: v for k, v in cur.items() if k not in ("metadata", "status")
            }:
                merged["metadata"]["generation"] = int(md.get("generation") or 1) + 1
        if merged.get("status") is None:
            merged.pop("status", None)
        self.check_shape(res, merged, cur)
        for k in ("deletionTimestamp", "deletionGracePeriodSeconds"):  # only a deletion sets these
            if md.get(k) is None:
                merged["metadata"].pop(k, None)
            else:
                merged["metadata"][k] = md[k]
        out = self.store.put(res, merged)
        if md.get("deletionTimestamp"):
            self.store.collect()  # a finalizer removed: the object may go now
        return out

    def delete(self, res: Resource, version: str, ns: str, name: str, query: dict, body: bytes) -> dict:
        opts = self._json(body) if body else {}
        opts = opts if isinstance(opts, dict) else {}
        policy = query.get("propagationPolicy") or opts.get("propagationPolicy") or "Background"
        if policy not in ("Foreground", "Background", "Orphan"):
            raise ApiError(
                400,
                "BadRequest",
                f"propagationPolicy {policy!r} is not one of Foreground, Background, Orphan",
            )
        grace = query.get("gracePeriodSeconds", opts.get("gracePeriodSeconds"))
        cur = self.store.get(res, ns, name)
        if cur is None:
            raise not_found(res, name)
        pre = opts.get("preconditions") or {}
        for field in ("uid", "resourceVersion"):
            want = pre.get(field)
            if want and want != cur["metadata"].get(field):
                what = "UID" if field == "uid" else "ResourceVersion"
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {res.qualified} "{name}": '
                    f"Precondition failed: {what} in precondition: {want}, {what} in object meta: "
                    f"{cur['metadata'].get(field)}",
                )
        self.deleted.append((res.kind, name, policy))
        self.store.delete(res, cur, policy, None if grace is None else int(grace))
        out = self.out(res, version, cur)
        if self.store.get(res, ns, name) is None:
            out["metadata"].setdefault("deletionTimestamp", self.store.now_iso())
        return out

    def delete_collection(self, res: Resource, version: str, ns: str, query: dict, body: bytes) -> dict:
        gone = self.list(res, version, ns, query)
        for o in gone["items"]:
            self.delete(
                res,
                version,
                ns,
                o["metadata"]["name"],
                {k: v for k, v in query.items() if k in ("propagationPolicy", "gracePeriodSeconds")},
                body,
            )
        return gone

    def pod_log(self, ns: str, name: str, query: dict) -> str:
        pod = self.store.get(RESOURCES[("", "pods")], ns, name)
        if pod is None:
            raise not_found(RESOURCES[("", "pods")], name)
        containers = [c["name"] for c in (pod.get("spec") or {}).get("containers") or []]
        inits = [c["name"] for c in (pod.get("spec") or {}).get("initContainers") or []]
        cname = query.get("container") or (containers[0] if len(containers) == 1 else None)
        if cname is None:
            raise ApiError(
                400,
                "BadRequest",
                f"a container name must be specified for pod {name}, choose one of: {containers}"
                + (f" or one of the init containers: {inits}" if inits else ""),
            )
        if cname not in containers + inits:
            raise ApiError(400, "BadRequest", f"container {cname} is not valid for pod {name}")
        status = pod.get("status") or {}
        for cs in (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or []):
            w = (cs.get("state") or {}).get("waiting")
            if cs.get("name") == cname and w:
                raise ApiError(
                    400,
                    "BadRequest",
                    f'container "{cname}" in pod "{name}" is waiting to start: '
                    f"{w.get('reason', 'ContainerCreating')}",
                )
        # The first regular container's log is the pod's (ns, name); another container's is keyed by its name.
        key = (ns, name) if cname == containers[0] else (ns, name, cname)
        lines = list(self.store.logs.get(key, []))
        if "tailLines" in query:
            n = int(query["tailLines"])
            lines = lines[-n:] if n > 0 else []
        return "".join(line + "\n" for line in lines)


# ---------------------------------------------------------------- the server object


class ApiServer:
    """`with ApiServer() as srv:` a Kubernetes API on 127.0.0.1, with `hooks` for controllers."""

    def __init__(
        self,
        namespace: str = "default",
        port: int = 0,
        hooks: Hooks | None = None,
        clock: Callable[[], float] = time.time,
        token: str | None = None,
    ):
        self.store = Store(clock=clock)
        self.api = Api(self.store, hooks)
        self.namespace = namespace
        self._port = port
        # The bearer token every request must carry (None: none asked for, a test's own server).
        self.token = token
        # Serve HTTPS with this context (None: HTTP). A kubeconfig's token is sent only over TLS.
        self.tls: ssl.SSLContext | None = None
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._faults: list[Fault] = []
        self._fault_lock = threading.Lock()
        self.requests: list[tuple[str, str, dict, str]] = []
        # (method, path, headers, body) -> (code, JSON answer) for paths under CONTROL_PREFIX; None: 404s
        self.control: Callable[[str, str, dict, bytes], tuple[int, Any]] | None = None
        self.received: list[tuple[str, str, Any]] = []  # (method, path, JSON body) of each write, as sent
        self._outage: tuple[str, float | None] | None = None  # (mode, until on time.monotonic)
        self._outage_over = threading.Event()
        self._outage_over.set()
        self._outage_timer: threading.Timer | None = None
        with self.store.lock:
            for ns in dict.fromkeys((namespace, "default", "kube-system")):
                self.store.put(
                    RESOURCES[("", "namespaces")],
                    {
                        "apiVersion": "v1",
                        "kind": "Namespace",
                        "metadata": {
                            "name": ns,
                            "uid": str(uuid.uuid4()),
                            "creationTimestamp": self.store.now_iso(),
                            "labels": {"kubernetes.io/metadata.name": ns},
                        },
                        "spec": {"finalizers": ["kubernetes"]},
                        "status": {"phase": "Active"},
                    },
                )

    # -- lifecycle
    def start(self) -> ApiServer:
        httpd = _Server(("127.0.0.1", self._port), _Handler)
        httpd.kube = self  # type: ignore[attr-defined]
        if self.tls is not None:  # the handshake happens in the request's thread, at its first read
            httpd.socket = self.tls.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
        self._port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def go_down(self) -> None:
        """Stop listening: connections are refused until `come_back()` (the objects are kept)."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def come_back(self) -> None:
        if self._httpd is None:
            self.start()

    def stop(self) -> None:
        timer, self._outage_timer = self._outage_timer, None
        if timer is not None:
            timer.cancel()
        self._outage = None
        self._outage_over.set()
        self.go_down()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"{'https' if self.tls is not None else 'http'}://127.0.0.1:{self._port}"

    # -- faults
    def fail_next(
        self,
        count: int,
        status: int | str = 500,
        retry_after_s: int | None = None,
        match: str | None = None,
        delay_s: float = 0.0,
    ) -> None:
        """The next `count` requests (whose "METHOD /path" contains `match`, if given) answer `status`
        (an HTTP code; "drop": the connection closes unanswered; "lost": the request is carried out,
        then the connection closes unanswered), after `delay_s`."""
        with self._fault_lock:
            self._faults.append(Fault(status, count, retry_after_s, match, delay_s))

    OUTAGE_MODES = ("refuse", "unavailable", "hang")

    def outage(self, mode: str, for_s: float | None = None) -> None:
        """The control plane is out for `for_s` seconds of wall time (None: until `end_outage`), as in a
        zonal cluster's upgrade: `refuse`: connections are refused (nothing listens on the port);
        `unavailable`: every request answers 503 ServiceUnavailable (Retry-After 5); `hang`: every
        request is accepted and never answered (the client's read timeout ends it; the connection
        closes when the outage ends). The objects and the world behind them are kept."""
        from olmo_ctl.core.errors import BadInput

        if mode not in self.OUTAGE_MODES:
            raise BadInput(f"API outage `{mode}` is not one of {', '.join(self.OUTAGE_MODES)}")
        if for_s is not None and for_s <= 0:
            raise BadInput(f"an API outage lasts a positive time, not {for_s} s")
        self.end_outage()
        self._outage = (mode, None if for_s is None else time.monotonic() + for_s)
        self._outage_over.clear()
        if mode == "refuse":
            self.go_down()
        if for_s is not None:
            self._outage_timer = threading.Timer(for_s, self.end_outage)
            self._outage_timer.daemon = True
            self._outage_timer.start()

    def outage_mode(self) -> str | None:
        """The outage now in force, or None."""
        out = self._outage
        if out is None:
            return None
        if out[1] is not None and time.monotonic() >= out[1]:
            self.end_outage()
            return None
        return out[0]

    def end_outage(self) -> None:
        """The control plane answers again (on the same port)."""
        timer, self._outage_timer = self._outage_timer, None
        if timer is not None and timer is not threading.current_thread():
            timer.cancel()
        was, self._outage = self._outage, None
        self._outage_over.set()
        if was is not None and was[0] == "refuse":
            self.come_back()

    def forbid(self, verb: str, resource: str, group: str = "") -> None:
        """RBAC says no: `verb` ("get", "list", ..., or "*") on `resource` (a plural such as "nodes",
        "pods/log", or "*") of API `group` is forbidden (403), and SelfSubjectAccessReview says so."""
        self.api.forbidden.add((verb, group, resource))

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

    def _record(self, method: str, path: str, query: dict, ctype: str, body: bytes = b"") -> None:
        with self._fault_lock:
            self.requests.append((method, path, query, ctype))
            if body and method in ("POST", "PUT", "PATCH", "DELETE"):
                try:
                    self.received.append((method, path, json.loads(body)))
                except ValueError:
                    self.received.append((method, path, body))

    def count(self, method: str, contains: str = "") -> int:
        """How many requests with this method (and path containing `contains`) arrived."""
        return sum(1 for m, p, _, _ in list(self.requests) if m == method and contains in p)
