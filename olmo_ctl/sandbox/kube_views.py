"""What the test API server serves to clients beyond plain objects, as kube-apiserver serves it:

- **Table output** (`Accept: application/json;as=Table;g=meta.k8s.io;v=v1`, what `kubectl get`
  asks for): the columns a real server prints: a CRD's `additionalPrinterColumns` (JSONPath), and
  for built-in kinds the columns of kubernetes/pkg/printers/internalversion/printers.go (pods,
  events, Jobs, namespaces, nodes, priority classes); rows carry the object's metadata
  (PartialObjectMetadata), as with the default `includeObject=Metadata`.
- **OpenAPI v3** (`/openapi/v3`, `/openapi/v3/apis/GROUP/VERSION`, `/openapi/v3/api/v1`): one
  document per group version with a path per resource whose operations carry
  `x-kubernetes-group-version-kind` and the `fieldValidation` parameter, so that `kubectl apply`
  leaves validation to the server (`fieldValidation=Strict`), and the CRD schemas as components.
- **SelfSubjectAccessReview** (`POST /apis/authorization.k8s.io/v1/selfsubjectaccessreviews`, what
  `kubectl auth can-i` and `olmo-ctl doctor` send): allowed unless the server was told to forbid the
  verb on the resource (`ApiServer.forbid`), which then also answers the requests themselves with 403.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from olmo_ctl.sandbox.kube_common import CRD_DIR, ApiError, crd_versions

if TYPE_CHECKING:
    from olmo_ctl.sandbox.kube_api import Resource

AUTHZ_GROUP, AUTHZ_VERSION, SSAR = "authorization.k8s.io", "v1", "selfsubjectaccessreviews"
USER = "system:anonymous"

# ---------------------------------------------------------------- access


def verb_of(method: str, name: str | None, query: dict) -> str:
    """The RBAC verb of a request (kube-apiserver's RequestInfo)."""
    if method == "GET":
        if name is None:
            return "watch" if query.get("watch") in ("true", "1") else "list"
        return "get"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(
        method, "deletecollection" if name is None else "delete"
    )


def forbidden_message(
    verb: str, group: str, plural: str, sub: str | None, ns: str | None, name: str | None
) -> str:
    """kube-apiserver's Forbidden message (endpoints/handlers/responsewriters.forbiddenMessage)."""
    resource = f"{plural}/{sub}" if sub else plural
    what = f"{plural}.{group}" if group else plural
    if name:
        what += f' "{name}"'
    where = f' in the namespace "{ns}"' if ns else " at the cluster scope"
    return (
        f'{what} is forbidden: User "{USER}" cannot {verb} resource "{resource}" in API group "{group}"'
        f"{where}"
    )


def access_review(body: Any, allowed) -> dict:
    """The SelfSubjectAccessReview, answered: `allowed(verb, group, resource, subresource)`."""
    if not isinstance(body, dict) or not isinstance((body.get("spec") or {}).get("resourceAttributes"), dict):
        raise ApiError(
            422,
            "Invalid",
            'SelfSubjectAccessReview.authorization.k8s.io "" is invalid: '
            "spec.resourceAttributes: Required value (this server answers resource attributes only)",
        )
    ra = body["spec"]["resourceAttributes"]
    ok = allowed(
        ra.get("verb", ""), ra.get("group", ""), ra.get("resource", ""), ra.get("subresource") or None
    )
    status: dict[str, Any] = {"allowed": ok}
    if not ok:
        status["reason"] = "forbidden by the test server's policy"
    return {
        "kind": "SelfSubjectAccessReview",
        "apiVersion": f"{AUTHZ_GROUP}/{AUTHZ_VERSION}",
        "metadata": {"creationTimestamp": None},
        "spec": body["spec"],
        "status": status,
    }


def _pb_fields(buf: bytes):
    """(field number, value) of a protobuf message: bytes for length-delimited fields, ints for varints."""
    i = 0

    def varint() -> int:
        nonlocal i
        out = shift = 0
        while True:
            b = buf[i]
            i += 1
            out |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return out

    while i < len(buf):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 2:
            n = varint()
            yield number, buf[i : i + n]
            i += n
        elif wire == 0:
            yield number, varint()
        else:
            raise ValueError(f"protobuf wire type {wire} not expected here")


def decode_access_review(body: bytes) -> dict:
    """A SelfSubjectAccessReview sent as protobuf (what kubectl sends for built-in types): the
    `k8s\\0` envelope (runtime.Unknown: raw = field 2), then the review's spec.resourceAttributes
    (k8s.io/api/authorization/v1 generated.proto: namespace 1, verb 2, group 3, version 4,
    resource 5, subresource 6, name 7)."""
    if not body.startswith(b"k8s\x00"):
        raise ValueError("not a Kubernetes protobuf envelope")
    raw = next((v for n, v in _pb_fields(body[4:]) if n == 2), b"")
    spec = next((v for n, v in _pb_fields(raw) if n == 2), b"")
    attrs_pb = next((v for n, v in _pb_fields(spec) if n == 1), b"")
    names = {1: "namespace", 2: "verb", 3: "group", 4: "version", 5: "resource", 6: "subresource", 7: "name"}
    attrs = {names[n]: v.decode() for n, v in _pb_fields(attrs_pb) if n in names and isinstance(v, bytes)}
    return {
        "apiVersion": f"{AUTHZ_GROUP}/{AUTHZ_VERSION}",
        "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": attrs},
    }


def authz_discovery() -> dict:
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{AUTHZ_GROUP}/{AUTHZ_VERSION}",
        "resources": [
            {
                "name": SSAR,
                "singularName": "selfsubjectaccessreview",
                "namespaced": False,
                "kind": "SelfSubjectAccessReview",
                "verbs": ["create"],
            }
        ],
    }


# ---------------------------------------------------------------- JSONPath (the subset printer columns use)


def jsonpath(obj: Any, path: str) -> list[Any]:
    """Values at a printer column's JSONPath: `.a.b`, `[N]`, `[*]`, `[?(@.k=="v")]` (k may be dotted)."""
    nodes = [obj]
    for tok in re.findall(r"\.[^.\[]+|\[\?\(@\.[^)]*\)\]|\[\*\]|\[\d+\]", path):
        nxt: list[Any] = []
        for n in nodes:
            if tok.startswith("[?"):
                m = re.fullmatch(r"\[\?\(@\.([\w.]+)\s*==\s*['\"]([^'\"]*)['\"]\)\]", tok)
                if m and isinstance(n, list):
                    nxt += [x for x in n if isinstance(x, dict) and str(_dotted(x, m.group(1))) == m.group(2)]
            elif tok == "[*]":
                nxt += n if isinstance(n, list) else []
            elif tok.startswith("["):
                i = int(tok[1:-1])
                if isinstance(n, list) and i < len(n):
                    nxt.append(n[i])
            elif isinstance(n, dict) and tok[1:] in n:
                nxt.append(n[tok[1:]])
        nodes = nxt
    return nodes


def _dotted(obj: dict, path: str) -> Any:
    node: Any = obj
    for p in path.split("."):
        node = node.get(p) if isinstance(node, dict) else None
    return node


# ---------------------------------------------------------------- tables


@functools.cache
def printer_columns(crd_file: str, version: str) -> tuple[dict, ...]:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(CRD_DIR / crd_file) as f:
        crd = yaml.load(f, Loader=loader)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return tuple(v.get("additionalPrinterColumns") or ())
    return ()


def age(ts: str | None, now: float | None = None) -> str:
    """kubectl's duration (apimachinery duration.HumanDuration, short form)."""
    if not ts:
        return "<unknown>"
    s = int(
        (now or time.time()) - datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    )
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    h = m // 60
    if h < 48:
        return f"{h}h{m % 60}m" if h < 8 and m % 60 else f"{h}h"
    d = h // 24
    return f"{d}d{h % 24}h" if d < 8 and h % 24 else f"{d}d"


def _col(name: str, type_: str = "string", description: str = "", priority: int = 0, fmt: str = "") -> dict:
    return {
        "name": name,
        "type": type_,
        "format": fmt or ("name" if name == "Name" else ""),
        "description": description,
        "priority": priority,
    }


def _pod_cells(o: dict, now: float) -> list:
    st = o.get("status") or {}
    css = st.get("containerStatuses") or []
    ready = sum(1 for c in css if c.get("ready"))
    reason = st.get("reason") or st.get("phase") or "Unknown"
    for c in css:  # printPod: a waiting or terminated container's reason wins over the phase
        state = c.get("state") or {}
        if (
            state.get("waiting", {}).get("reason")
            and state["waiting"]["reason"] != "ContainerCreating"
            or (state.get("waiting") and reason == "Pending")
        ):
            reason = state["waiting"].get("reason") or reason
        elif state.get("terminated"):
            t = state["terminated"]
            reason = t.get("reason") or (
                f"Signal:{t['signal']}" if t.get("signal") else f"ExitCode:{t.get('exitCode')}"
            )
    if o["metadata"].get("deletionTimestamp") and reason not in ("Completed", "Error", "Succeeded", "Failed"):
        reason = "Terminating"
    restarts = sum(int(c.get("restartCount") or 0) for c in css)
    spec = o.get("spec") or {}
    # printPod counts sidecars (restartable init containers) among the containers, ready ones as ready.
    sidecars = [c for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"]
    names = {c["name"] for c in sidecars}
    ready += sum(
        1 for c in st.get("initContainerStatuses") or [] if c.get("name") in names and c.get("ready")
    )
    return [
        o["metadata"]["name"],
        f"{ready}/{len(spec.get('containers') or css) + len(sidecars)}",
        reason,
        restarts,
        age(o["metadata"].get("creationTimestamp"), now),
        st.get("podIP") or "<none>",
        spec.get("nodeName") or "<none>",
    ]


def _event_cells(o: dict, now: float) -> list:
    io = o.get("involvedObject") or {}
    last = o.get("lastTimestamp") or o.get("eventTime") or o["metadata"].get("creationTimestamp")
    return [
        age(last, now),
        o.get("type", ""),
        o.get("reason", ""),
        f"{(io.get('kind') or '').lower()}/{io.get('name')}",
        o.get("message", "").strip(),
        o["metadata"]["name"],
    ]


def _job_cells(o: dict, now: float) -> list:
    st, spec = o.get("status") or {}, o.get("spec") or {}
    conds = {c["type"]: c for c in st.get("conditions") or [] if c.get("status") == "True"}
    status = next((t for t in ("Failed", "Complete", "Suspended", "FailureTarget") if t in conds), None) or (
        "Terminating" if o["metadata"].get("deletionTimestamp") else "Running"
    )
    return [
        o["metadata"]["name"],
        status,
        f"{st.get('succeeded', 0)}/{spec.get('completions', 1)}",
        "",
        age(o["metadata"].get("creationTimestamp"), now),
    ]


def _node_cells(o: dict, now: float) -> list:
    ready = next(
        (c.get("status") for c in (o.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"),
        "Unknown",
    )
    return [
        o["metadata"]["name"],
        "Ready" if ready == "True" else "NotReady",
        "<none>",
        age(o["metadata"].get("creationTimestamp"), now),
        ((o.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion", ""),
    ]


BUILTIN_COLUMNS: dict[str, tuple[list[dict], Any]] = {
    "pods": (
        [
            _col("Name"),
            _col("Ready"),
            _col("Status"),
            _col("Restarts", "string"),
            _col("Age"),
            _col("IP", priority=1),
            _col("Node", priority=1),
        ],
        _pod_cells,
    ),
    "events": (
        [
            _col("Last Seen"),
            _col("Type"),
            _col("Reason"),
            _col("Object"),
            _col("Message"),
            _col("Name", priority=1),
        ],
        _event_cells,
    ),
    "jobs": ([_col("Name"), _col("Status"), _col("Completions"), _col("Duration"), _col("Age")], _job_cells),
    "nodes": ([_col("Name"), _col("Status"), _col("Roles"), _col("Age"), _col("Version")], _node_cells),
    "namespaces": (
        [_col("Name"), _col("Status"), _col("Age")],
        lambda o, now: [
            o["metadata"]["name"],
            (o.get("status") or {}).get("phase", "Active"),
            age(o["metadata"].get("creationTimestamp"), now),
        ],
    ),
    "priorityclasses": (
        [_col("Name"), _col("Value", "integer"), _col("Global-Default", "boolean"), _col("Age")],
        lambda o, now: [
            o["metadata"]["name"],
            o.get("value", 0),
            bool(o.get("globalDefault")),
            age(o["metadata"].get("creationTimestamp"), now),
        ],
    ),
}


def _cell(values: list[Any], type_: str) -> Any:
    if not values:
        return None
    v = values[0] if len(values) == 1 else ",".join(str(x) for x in values)
    if type_ == "string" and not isinstance(v, str):
        return (
            json.dumps(v) if isinstance(v, dict | list) else str(v).lower() if isinstance(v, bool) else str(v)
        )
    return v


def table(res: Resource, version: str, payload: dict, now: float | None = None) -> dict:
    """A list (or one object) as a meta.k8s.io/v1 Table."""
    now = now or time.time()
    items = payload["items"] if payload.get("kind", "").endswith("List") and "items" in payload else [payload]
    if res.crd:
        cols = [c for c in printer_columns(res.crd, version)]
        defs = [_col("Name", description="Name must be unique within a namespace.")]
        defs += [
            _col(
                c["name"],
                c.get("type", "string"),
                c.get("description", ""),
                int(c.get("priority", 0)),
                c.get("format", ""),
            )
            for c in cols
        ]

        def cells(o: dict, now: float) -> list:
            out: list[Any] = [o["metadata"]["name"]]
            for c in cols:
                vals = jsonpath(o, c["jsonPath"])
                if c.get("type") == "date":
                    out.append(age(vals[0], now) if vals else "<unknown>")
                else:
                    out.append(_cell(vals, c.get("type", "string")))
            return out

        if not cols:
            defs.append(_col("Age", description="CreationTimestamp"))

            def cells(o: dict, now: float) -> list:  # noqa: F811
                return [o["metadata"]["name"], age(o["metadata"].get("creationTimestamp"), now)]
    elif res.plural in BUILTIN_COLUMNS:
        defs, cells = BUILTIN_COLUMNS[res.plural]
    else:
        defs = [_col("Name"), _col("Age")]

        def cells(o: dict, now: float) -> list:
            return [o["metadata"]["name"], age(o["metadata"].get("creationTimestamp"), now)]

    rows = [
        {
            "cells": cells(o, now),
            "object": {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": o["metadata"],
            },
        }
        for o in items
    ]
    meta = {"resourceVersion": (payload.get("metadata") or {}).get("resourceVersion", "")}
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": meta,
        "columnDefinitions": defs,
        "rows": rows,
    }


def wants_table(accept: str) -> bool:
    return any("as=Table" in part for part in accept.split(","))


# ---------------------------------------------------------------- OpenAPI v3


def _gv_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def _schema_name(res: Resource, version: str) -> str:
    parts = res.group.split(".")[::-1] if res.group else ["io", "k8s", "api", "core"]
    return ".".join([*parts, version, res.kind])


def openapi_v3(resources: dict, path: str) -> dict | None:
    """The OpenAPI v3 discovery root or one group version's document; None for an unknown path."""
    by_gv: dict[tuple[str, str], list[Resource]] = {}
    for r in resources.values():
        for v in r.versions:
            by_gv.setdefault((r.group, v), []).append(r)
    rest = path[len("/openapi/v3") :].strip("/")
    if not rest:
        paths = {}
        for (g, v), rs in sorted(by_gv.items()):
            doc = json.dumps(_gv_doc(g, v, tuple(rs)), sort_keys=True).encode()
            paths[_gv_path(g, v)] = {
                "serverRelativeURL": f"/openapi/v3/{_gv_path(g, v)}?hash="
                f"{hashlib.sha512(doc).hexdigest()[:64].upper()}"
            }
        return {"paths": paths}
    for (g, v), rs in by_gv.items():
        if rest == _gv_path(g, v):
            return _gv_doc(g, v, tuple(rs))
    return None


def _param(name: str, where: str = "query", required: bool = False) -> dict:
    return {
        "name": name,
        "in": where,
        "required": required,
        "schema": {"type": "string"},
        "uniqueItems": True,
    }


@functools.cache
def _gv_doc(group: str, version: str, rs: tuple) -> dict:
    paths: dict[str, dict] = {}
    schemas: dict[str, dict] = {}
    for r in rs:
        gvk = {"group": r.group, "version": version, "kind": r.kind}
        name = _schema_name(r, version)
        ref = {"$ref": f"#/components/schemas/{name}"}
        body = {"content": {"application/json": {"schema": ref}}}
        ok = {"200": {"description": "OK", "content": {"application/json": {"schema": ref}}}}
        base = (
            f"/{_gv_path(group, version)}"
            + ("/namespaces/{namespace}" if r.namespaced else "")
            + f"/{r.plural}"
        )
        ns_param = [_param("namespace", "path", True)] if r.namespaced else []
        ext = {"x-kubernetes-group-version-kind": gvk}
        write_params = [_param("dryRun"), _param("fieldManager"), _param("fieldValidation")]
        paths[base] = {
            "get": {"operationId": f"list{r.kind}", "responses": ok, **ext, "x-kubernetes-action": "list"},
            "post": {
                "operationId": f"create{r.kind}",
                "requestBody": body,
                "responses": ok,
                **ext,
                "x-kubernetes-action": "post",
                "parameters": write_params,
            },
            "parameters": ns_param,
        }
        paths[base + "/{name}"] = {
            "get": {"operationId": f"read{r.kind}", "responses": ok, **ext, "x-kubernetes-action": "get"},
            "put": {
                "operationId": f"replace{r.kind}",
                "requestBody": body,
                "responses": ok,
                **ext,
                "x-kubernetes-action": "put",
                "parameters": write_params,
            },
            "patch": {
                "operationId": f"patch{r.kind}",
                "requestBody": {
                    "content": {
                        "application/merge-patch+json": {"schema": {"type": "object"}},
                        "application/json-patch+json": {"schema": {"type": "object"}},
                    }
                },
                "responses": ok,
                **ext,
                "x-kubernetes-action": "patch",
                "parameters": [*write_params, _param("force")],
            },
            "delete": {
                "operationId": f"delete{r.kind}",
                "responses": ok,
                **ext,
                "x-kubernetes-action": "delete",
            },
            "parameters": [_param("name", "path", True), *ns_param],
        }
        schema: dict[str, Any] = {"type": "object"}
        if r.crd:
            schema = json.loads(json.dumps(crd_versions(r.crd)[version]))
            schema.setdefault("properties", {})["metadata"] = {"type": "object"}
        else:
            schema["x-kubernetes-preserve-unknown-fields"] = True
        schema["x-kubernetes-group-version-kind"] = [gvk]
        schemas[name] = schema
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.33.0"},
        "paths": paths,
        "components": {"schemas": schemas},
    }
