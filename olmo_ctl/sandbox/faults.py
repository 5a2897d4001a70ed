"""The faults a running sandbox takes (`olmo-ctl sandbox fault`, `olmo-ctl sandbox --faults FILE`).

One table, `KINDS`: each kind's name, what it does to the world, and which keys it takes. A fault is
a cause (machines lost or back, a kubelet silent, a repair); the test cluster's rules decide what the
pods, Jobs, JobSets and Workloads do (`olmo_ctl.sandbox.cluster.nodes`). `parse_fault` checks one
fault as given (on the command line or in a timeline) and `apply` acts on a `SandboxWorld`, under its
store's lock. The command reaches a sandbox running in another process through its API server:
`POST /olmo-ctl/sandbox/v1/faults` (CONTROL_PATH), a path only the sandbox serves, with the bearer
token of the sandbox's kubeconfig (a token each sandbox draws when it starts).

`image-pull` acts through the world's image-pull causes (`World.image_pull_fault`) and `api-outage`
through its API server (`ApiServer.outage`, every request answered 503 for `--for`; the control path
itself keeps answering, so a later fault is still heard).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from olmo_ctl.core.durations import parse_duration
from olmo_ctl.core.errors import BadInput

if TYPE_CHECKING:
    from olmo_ctl.sandbox.sandbox import SandboxWorld

CONTROL_PATH = "/olmo-ctl/sandbox/v1/faults"
IMAGE_ERRORS = ("transient", "permanent")
KEYS = ("kind", "pool", "for", "nodes", "image-error")  # a timeline's keys besides `at`


@dataclass(frozen=True)
class Kind:
    name: str
    does: str  # one line: the docs table says the same
    needs_nodes: bool = False  # --nodes is required (capacity: nodes left in the pool)
    takes_nodes: bool = False  # --nodes N: that many nodes of the pool (default: all of them)


KINDS = {
    k.name: k
    for k in (
        Kind(
            "capacity", "the pool keeps its first N nodes (--nodes); the others are deleted", needs_nodes=True
        ),
        Kind("host-event", "every host of the pool goes down with its pods; the nodes are NotReady --for"),
        Kind(
            "node-not-ready",
            "N nodes (default 1) stop posting status; taint eviction after 300 s",
            takes_nodes=True,
        ),
        Kind("repair", "the pool's nodes are drained, removed, and recreated after --for", takes_nodes=True),
        Kind(
            "admission-error",
            "the pool's kubelets reject new pods (UnexpectedAdmissionError) for --for",
            takes_nodes=True,
        ),
        Kind("image-pull", "image pulls fail (--image-error transient|permanent)"),
        Kind("api-outage", "the API server refuses every request (503) for --for"),
        Kind("spot-reclaim", "the pool's spot VMs are reclaimed (graceful shutdown, then gone for --for)"),
    )
}


@dataclass(frozen=True)
class Fault:
    kind: str
    pool: str | None = None  # a node pool, or a device type meaning all of its pools; None: every pool
    for_s: float | None = None  # None: until another fault restores it
    nodes: int | None = None
    image_error: str | None = None
    at_s: float = 0.0  # in a timeline: seconds after the sandbox started

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.pool is not None:
            out["pool"] = self.pool
        if self.for_s is not None:
            out["for"] = f"{self.for_s:g}s"
        if self.nodes is not None:
            out["nodes"] = self.nodes
        if self.image_error is not None:
            out["image-error"] = self.image_error
        return out


def parse_fault(raw: Mapping[str, Any], where: str = "fault") -> Fault:
    """One fault from its keys (`kind`, `pool`, `for`, `nodes`, `image-error`; `at` in a timeline)."""
    unknown = sorted(set(raw) - set(KEYS) - {"at"})
    if unknown:
        raise BadInput(f"{where}: unknown key `{unknown[0]}`", f"keys: at, {', '.join(KEYS)}")
    kind = str(raw.get("kind") or "")
    if kind not in KINDS:
        raise BadInput(f"{where}: `{kind}` is not a fault kind", f"one of {', '.join(KINDS)}")
    k = KINDS[kind]
    for_s = parse_duration(raw["for"], f"{where}: --for") if raw.get("for") is not None else None
    if for_s is not None and for_s <= 0:
        raise BadInput(f"{where}: --for must be longer than 0 s", "e.g. --for 30m")
    nodes = raw.get("nodes")
    if nodes is not None:
        if isinstance(nodes, bool) or not str(nodes).isdigit():
            raise BadInput(f"{where}: --nodes `{nodes}` is not a number of nodes", "e.g. --nodes 0")
        nodes = int(nodes)
        if not (k.needs_nodes or k.takes_nodes):
            raise BadInput(f"{where}: {kind} takes no --nodes", "it acts on every node of the pool")
    elif k.needs_nodes:
        raise BadInput(f"{where}: {kind} needs --nodes (the nodes left in the pool)", "e.g. --nodes 0")
    image_error = raw.get("image-error")
    if image_error is not None and kind != "image-pull":
        raise BadInput(f"{where}: --image-error is for image-pull only")
    if kind == "image-pull" and image_error not in IMAGE_ERRORS:
        raise BadInput(f"{where}: image-pull needs --image-error transient|permanent")
    at = raw.get("at")
    at_s = parse_duration(at, f"{where}: at") if at is not None else 0.0
    pool = raw.get("pool")
    return Fault(kind, str(pool) if pool is not None else None, for_s, nodes, image_error, at_s)


def parse_timeline(text: str, source: str) -> list[Fault]:
    """A YAML list of `{at: DURATION, kind, ...}`, in time order."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise BadInput(f"--faults {source}: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise BadInput(f"--faults {source}: must be a list of faults", "e.g. - {at: 10m, kind: host-event}")
    out = []
    for i, d in enumerate(data):
        if "at" not in d:
            raise BadInput(f"--faults {source}: fault {i + 1} has no `at`", "e.g. at: 10m")
        out.append(parse_fault(d, f"--faults {source}: fault {i + 1}"))
    return sorted(out, key=lambda f: f.at_s)


def pool_nodes(world: SandboxWorld, pool: str | None) -> list[str]:
    """The nodes of a pool, of every pool of a device type, or (None) of every pool."""
    pools = world.nodes.pools()
    if pool is None:
        return [n for ns in pools.values() for n in ns]
    if pool in pools:
        return pools[pool]
    of_device = [n for p, ns in pools.items() if p.startswith(f"{pool}-np-") for n in ns]
    if of_device:
        return of_device
    raise BadInput(
        f"--pool `{pool}` is not a node pool of this sandbox", f"pools: {', '.join(pools) or 'none'}"
    )


def check(world: SandboxWorld, fault: Fault) -> list[str]:
    """The nodes the fault acts on; `BadInput` when this sandbox cannot take it."""
    nodes = pool_nodes(world, fault.pool)
    k = KINDS[fault.kind]
    if k.takes_nodes:
        default = 1 if fault.kind == "node-not-ready" else len(nodes)
        nodes = nodes[: fault.nodes if fault.nodes is not None else default]
    return nodes


def _capacity(w: SandboxWorld, f: Fault, nodes: list[str]) -> None:
    """--nodes is per pool: a device type's pools each keep that many."""
    for pool_nodes_ in w.nodes.pools().values():
        mine = [n for n in pool_nodes_ if n in nodes]
        if mine:
            w.nodes.set_capacity(mine, int(f.nodes or 0), f.for_s)


# The one place a kind meets the world.
_APPLY: dict[str, Callable[[SandboxWorld, Fault, list[str]], None]] = {
    "image-pull": lambda w, f, ns: w.image_pull_fault(f.pool, str(f.image_error), f.for_s),
    "api-outage": lambda w, f, ns: w.api_server.outage("unavailable", f.for_s),
    "capacity": _capacity,
    "host-event": lambda w, f, ns: w.nodes.host_event(ns, f.for_s),
    "node-not-ready": lambda w, f, ns: w.nodes.not_ready(ns, f.for_s),
    "repair": lambda w, f, ns: w.nodes.repair(ns, f.for_s),
    "admission-error": lambda w, f, ns: w.nodes.admission_error(ns, f.for_s),
    "spot-reclaim": lambda w, f, ns: w.nodes.spot_reclaim(ns, f.for_s),
}


def apply(world: SandboxWorld, fault: Fault) -> str:
    """Apply one fault now; returns what it did, one line."""
    with world.store.lock:
        nodes = check(world, fault)
        _APPLY[fault.kind](world, fault, nodes)
        world.reconcile()
    until = f" for {fault.for_s:g} s" if fault.for_s is not None and not math.isinf(fault.for_s) else ""
    where = fault.pool or "every pool"
    n = f", {fault.nodes} node(s)" if fault.nodes is not None else ""
    return f"{fault.kind} on {where}{n}{until} ({len(nodes)} node(s): {', '.join(nodes[:4])}{'...' if len(nodes) > 4 else ''})"


def control(
    world: SandboxWorld, token: str, method: str, headers: Mapping[str, str], body: bytes
) -> tuple[int, dict]:
    """The sandbox's control path: (HTTP code, JSON answer) for `POST CONTROL_PATH`."""
    import hmac
    import json

    auth = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
    if not hmac.compare_digest(auth.encode("utf-8", "replace"), f"Bearer {token}".encode()):
        return 401, {"message": "the sandbox's control path needs the token of its kubeconfig"}
    if method != "POST":
        return 405, {"message": f"{method} is not allowed; POST a fault"}
    try:
        raw = json.loads(body or b"{}")
        if not isinstance(raw, dict):
            raise ValueError
    except ValueError:
        return 400, {"message": "the body must be a JSON object of a fault's keys"}
    try:
        return 200, {"applied": apply(world, parse_fault(raw))}
    except BadInput as e:
        return 400, {"message": e.one_line()}


def send(kubeconfig: str | Any, raw: Mapping[str, Any], timeout_s: float = 30.0) -> str:
    """Ask the sandbox whose kubeconfig this is to apply a fault; returns its one-line answer.
    Bad input (the sandbox's or ours) is `BadInput`; no sandbox serving there is `Unreachable`."""
    import json
    import ssl
    import urllib.error
    import urllib.request
    from pathlib import Path

    import yaml

    from olmo_ctl.core.errors import Unreachable
    from olmo_ctl.sandbox.kubeconfig import CONTEXT
    from olmo_ctl.sandbox.tls import client_context

    path = Path(kubeconfig)
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise BadInput(
            f"--kubeconfig `{path}` does not exist", "give the file a running `olmo-ctl sandbox` wrote"
        ) from None
    except (OSError, yaml.YAMLError) as e:
        raise BadInput(f"--kubeconfig `{path}` cannot be read: {e}") from None
    ctx = next(
        (c for c in (cfg.get("contexts") or []) if isinstance(c, dict) and c.get("name") == CONTEXT), None
    )
    cluster = next((c for c in cfg.get("clusters") or [] if c.get("name") == CONTEXT), None)
    user = next((u for u in cfg.get("users") or [] if u.get("name") == CONTEXT), None)
    if ctx is None or cluster is None or user is None or not user.get("user", {}).get("token"):
        raise BadInput(
            f"--kubeconfig `{path}` is not a sandbox kubeconfig",
            "faults go to a sandbox, never a real cluster",
        )
    url = cluster["cluster"]["server"].rstrip("/") + CONTROL_PATH
    req = urllib.request.Request(
        url,
        data=json.dumps(dict(raw)).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {user['user']['token']}"},
    )
    ca = cluster["cluster"].get("certificate-authority-data")
    try:
        context = client_context(ca) if ca else None  # the sandbox's own certificate
    except (ValueError, ssl.SSLError) as e:
        raise BadInput(f"--kubeconfig `{path}`: its certificate-authority-data cannot be read: {e}") from None
    server = cluster["cluster"]["server"]
    not_this = (
        "use the kubeconfig the running sandbox wrote: each sandbox draws its own token and certificate"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=context) as r:
            return str(json.loads(r.read()).get("applied", ""))
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise BadInput(
                f"the sandbox at {server} refused the token of `{path}` (401 Unauthorized)", not_this
            ) from None
        try:
            msg = json.loads(e.read()).get("message") or str(e)
        except ValueError:
            msg = str(e)
        raise BadInput(msg) from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, ssl.SSLCertVerificationError):  # another sandbox now serves there
            raise BadInput(
                f"the server at {server} is not the sandbox that wrote `{path}` (its certificate differs)",
                not_this,
            ) from None
        raise Unreachable(
            f"no sandbox serves at {server} ({e.reason})",
            "start it with `olmo-ctl sandbox --kubeconfig FILE ...`",
        ) from None
    except OSError as e:
        raise Unreachable(
            f"no sandbox serves at {server} ({e})",
            "start it with `olmo-ctl sandbox --kubeconfig FILE ...`",
        ) from None
