"""Site settings (cluster, queue, image, run root, ...): flags > OLMO_CTL_* env > config file > defaults.

The config file is `$XDG_CONFIG_HOME/olmo-ctl/config.yaml` (`~/.config/olmo-ctl/config.yaml` when
XDG_CONFIG_HOME is unset): a YAML mapping of the keys below. Every command resolves its settings
through `resolve_settings(**flag_values)`, and `olmo-ctl config show` prints the result with the
source of each value. Unknown keys and malformed values are errors, never silently ignored.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from olmo_ctl.core.devices import GENERATIONS, GPU_MACHINES
from olmo_ctl.core.errors import BadInput

ENV_PREFIX = "OLMO_CTL_"

# Placeholders shown (and used by --dry-run) until a real value is configured.
PLACEHOLDER_RUN_ROOT = "gs://YOUR-BUCKET/runs"
PLACEHOLDER_IMAGE = "us-docker.pkg.dev/YOUR-PROJECT/olmo-ctl/olmo-ctl:latest"
PLACEHOLDERS = {"run_root": PLACEHOLDER_RUN_ROOT, "image": PLACEHOLDER_IMAGE}

# What each setting is, for `config show` and the docs.
DESCRIPTIONS = {
    "kube_context": "kubeconfig context (empty: the current context)",
    "namespace": "Kubernetes namespace of the JobSets",
    "queue": "Kueue LocalQueue (label kueue.x-k8s.io/queue-name)",
    "priority_class": "Kueue WorkloadPriorityClass (empty: none)",
    "image": "container image with olmo-ctl and its trainer",
    "run_root": "where run directories live (gs://bucket/prefix; local path: local backend)",
    "service_account": "Kubernetes service account with Workload Identity",
    "placement_policy": "placement policy of multi-host Ironwood node pools (default XPK's "
    "{device}-{topology}-placement-policy; none: no selector)",
    "backend": "where attempts run: a backend of `olmo_ctl.backends.REGISTRY` (gke, local)",
    "xla_flags": "XLA/libtpu flags merged over the generation's and the recipe's (space-separated --name=value)",
    "host_network": "pods on the host network (multislice DCN performance); Workload Identity then does not "
    "apply: the pods use the node's service account (true or false)",
    "notify_webhook": "URL that resume-until-done POSTs a JSON message to when a run finishes, fails, "
    "is resized (falls back) or gives up (empty: none); shown masked (path, query and password as ***); "
    "the user and password of a URL with them are sent as HTTP Basic auth",
    "notify_command": "shell command resume-until-done runs on the same events, the message as JSON on "
    "its stdin and OLMO_CTL_NOTIFY_* in its environment (empty: none)",
    "prices": "your USD per chip-hour by TPU generation (per GPU-hour by GPU machine type), on_demand and "
    "spot, for the dollar estimate of `plan` (a mapping; none ship with olmo-ctl)",
    "capacity": "the node pools' capacity type: on-demand, spot, reservation:NAME or flex-start (the node "
    "selector XPK renders for it)",
    "node_selectors": "extra pod node selectors (a mapping of label to value)",
    "tolerations": "extra pod tolerations (a list of {key, operator, value, effect})",
    "pod_annotations": "extra annotations on every pod (a mapping)",
    "image_pull_secrets": "names of Secrets the pods pull the image with (a list)",
    "pod_priority_class": "the pods' scheduling.k8s.io PriorityClass (priorityClassName; empty: none)",
    "trainer_resources": "the trainer container's CPU and memory, requests equal to limits: auto (sized from "
    "the node type), off (none requested), or cpu=N,memory=Q",
    "ttl_seconds_after_finished": "seconds JobSet keeps a finished attempt before deleting it (at least "
    "600; empty: kept until olmo-ctl retires it)",
}
PRICE_KINDS = ("on_demand", "spot")
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0", "")

# What an attempt is rendered with and a run keeps: recorded with each `submitted` journal line, and
# taken from there by a later command of the same run that does not choose them itself (the kube
# context and the run root are this machine's, the backend is recorded on its own).
RUN_SITE_SETTINGS = (
    "namespace",
    "queue",
    "priority_class",
    "image",
    "service_account",
    "placement_policy",
    "xla_flags",
    "host_network",
    "capacity",
    "node_selectors",
    "tolerations",
    "pod_annotations",
    "image_pull_secrets",
    "pod_priority_class",
    "ttl_seconds_after_finished",
    "trainer_resources",
)

# Settings that are YAML structures (a mapping or a list): from the environment (as YAML) or the
# config file, never a flag.
STRUCTURED = ("prices", "node_selectors", "tolerations", "pod_annotations", "image_pull_secrets")

# XPK's capacity types (src/xpk/core/capacity.py CapacityType) as `--capacity` spells them.
CAPACITY_TYPES = ("on-demand", "spot", "reservation:NAME", "flex-start")
# A JobSet finished attempt read by the supervisor must outlive one poll and a slow API server.
MIN_TTL_AFTER_FINISHED_S = 600


@dataclass(frozen=True)
class Settings:
    kube_context: str | None = None
    namespace: str = "default"
    queue: str = "multislice-queue"  # the LocalQueue XPK creates
    priority_class: str | None = None
    image: str = PLACEHOLDER_IMAGE
    run_root: str = PLACEHOLDER_RUN_ROOT
    service_account: str = "olmo-ctl"
    placement_policy: str | None = None
    backend: str = "gke"
    xla_flags: str | None = None
    host_network: bool = False
    notify_webhook: str | None = field(default=None, repr=False)  # a secret: shown through mask_url
    notify_command: str | None = None
    capacity: str = "on-demand"
    node_selectors: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, str]] = field(default_factory=list)
    pod_annotations: dict[str, str] = field(default_factory=dict)
    image_pull_secrets: list[str] = field(default_factory=list)
    pod_priority_class: str | None = None
    ttl_seconds_after_finished: int | None = None
    trainer_resources: str = "auto"
    # generation -> {"on_demand": USD, "spot": USD} per chip-hour: the user's own prices (file or
    # OLMO_CTL_PRICES as a YAML mapping; no flag). Not compared: it never changes what a run does.
    prices: dict[str, dict[str, float]] = field(default_factory=dict, compare=False)
    # Where each value came from: "flag", "env OLMO_CTL_X", "file <path>" or "default".
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in setting_names()}

    def placeholders(self, among: tuple[str, ...] = tuple(PLACEHOLDERS)) -> list[str]:
        """Settings of `among` still holding their placeholder value (rendering works; applying would
        not). Which of them matter is the backend's to say (`Backend.placeholders`)."""
        return [name for name in among if getattr(self, name) == PLACEHOLDERS[name]]


def setting_names() -> list[str]:
    return [f.name for f in fields(Settings) if f.name != "sources"]


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "olmo-ctl" / "config.yaml"


# ---------------------------------------------------------------- validation

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_PLACEHOLDERS = ("device", "topology", "generation")


def _check(name: str, value: str, src: str, backends: tuple[str, ...] = ()) -> None:
    where = f"setting `{name}` ({src})"
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise BadInput(f"{where}: the value contains control characters (a newline?)")
    if name == "namespace":
        if len(value) > 63 or not _DNS1123_LABEL.match(value):
            raise BadInput(
                f"{where}: `{value}` is not a valid namespace name",
                "use lowercase letters, digits and '-', at most 63 characters",
            )
    elif name == "capacity":
        kind, _, reservation = value.partition(":")
        if kind == "reservation":
            if len(reservation) > 63 or not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", reservation):
                raise BadInput(
                    f"{where}: `{value}` does not name a reservation",
                    "use reservation:NAME, NAME as gcloud lists it (lowercase letters, digits and '-'); for "
                    "a reservation shared from another project add node_selectors "
                    "{cloud.google.com/reservation-project: PROJECT}",
                )
        elif value not in CAPACITY_TYPES:
            raise BadInput(f"{where}: `{value}` is not a capacity type", f"use {', '.join(CAPACITY_TYPES)}")
    elif name == "trainer_resources":
        from olmo_ctl.core.node_resources import parse_setting

        parse_setting(value, where)
    elif name == "ttl_seconds_after_finished":
        if not value.isdigit() or int(value) < MIN_TTL_AFTER_FINISHED_S:
            raise BadInput(
                f"{where}: `{value}` is not a number of seconds >= {MIN_TTL_AFTER_FINISHED_S}",
                "the supervisor reads a finished attempt before JobSet may delete it; leave it unset to keep "
                "finished attempts until olmo-ctl retires them",
            )
    elif name in ("queue", "priority_class", "service_account", "pod_priority_class"):
        if len(value) > 253 or not _DNS1123_SUBDOMAIN.match(value):
            raise BadInput(
                f"{where}: `{value}` is not a valid Kubernetes object name",
                "use lowercase letters, digits, '-' and '.'",
            )
        if name in ("queue", "priority_class") and len(value) > 63:
            raise BadInput(f"{where}: `{value}` is longer than 63 characters", "it is used as a label value")
    elif name == "placement_policy":
        try:
            sample = value.format(device="tpu7x-128", topology="4x4x4", generation="tpu7x")
        except (KeyError, IndexError, ValueError):
            raise BadInput(
                f"{where}: `{value}` has an unknown placeholder",
                f"allowed: {', '.join('{' + p + '}' for p in _PLACEHOLDERS)}",
            ) from None
        if len(sample) > 63 or not _LABEL_VALUE.match(sample):
            raise BadInput(
                f"{where}: `{value}` does not make a valid label value",
                "use letters, digits, '-', '_' and '.', at most 63 characters",
            )
    elif name == "backend":
        if value not in backends:
            raise BadInput(f"{where}: `{value}` is not a backend", f"use {' or '.join(backends)}")
    elif name == "image":
        if not value or any(c.isspace() for c in value):
            raise BadInput(
                f"{where}: `{value}` is not an image reference", "e.g. us-docker.pkg.dev/p/r/olmo-ctl:0.1.0"
            )
    elif name == "run_root":
        if not value.strip():
            raise BadInput(f"{where}: the run root is empty", "e.g. gs://my-bucket/runs")
        if "://" in value and not value.startswith("gs://"):
            raise BadInput(
                f"{where}: `{value}` is not a gs:// URL or a local path", "e.g. gs://my-bucket/runs"
            )
    elif name == "notify_webhook":
        if not re.match(r"^https?://[^\s/]+", value):
            raise BadInput(
                f"{where}: `{mask_url(value)}` is not an http:// or https:// URL",
                "e.g. https://hooks.example.com/olmo",
            )
    elif name == "kube_context":
        if not value.strip():
            raise BadInput(f"{where}: the kube context is empty", "leave it unset to use the current context")


# A webhook URL carries its secret in its path (Slack's /services/T…/B…/…), its query (?token=) or
# its userinfo (user:password@): `mask_url` is how every command shows it.
_URL = re.compile(r"^(?:([A-Za-z][A-Za-z0-9+.-]*)://)?([^/?#]*)(.*)$", re.S)


def _url_parts(url: str) -> tuple[str, str | None, str, str, str]:
    """(scheme:// or "", userinfo or None, host[:port], the path prefix shown, the rest: hidden). A
    path's first segment is shown only when more path follows it (`/services/`): a one-segment path
    (`/TOKEN`) may be the secret itself. Anything that is not a URL is read as `host/path`."""
    m = _URL.match(url)
    assert m is not None  # every group may be empty
    scheme, authority, rest = m.groups()
    userinfo, at, host = authority.rpartition("@")
    first = re.match(r"/[^/?#]*/", rest)
    kept = first.group(0) if first else ("/" if rest.startswith("/") else "")
    return (f"{scheme}://" if scheme else ""), (userinfo if at else None), host, kept, rest[len(kept) :]


def mask_url(url: str) -> str:
    """A webhook URL as it may be shown: scheme, host and port, the user name without its password
    (`user:***@`; a userinfo without one may be a token: `***@`), the path's first segment when more
    follows, everything else (path, query, fragment) `***`:
    https://bot:pw@hooks.slack.com/services/T0/B0/XX?x=1 -> https://bot:***@hooks.slack.com/services/***."""
    scheme, userinfo, host, kept, hidden = _url_parts(url)
    who = ""
    if userinfo is not None:
        user, colon, _ = userinfo.partition(":")
        who = f"{user}:***@" if colon and user else "***@"
    tail = ("***" if kept.endswith("/") else "/***") if hidden else ""
    return f"{scheme}{who}{host}{kept}{tail}"


def strip_userinfo(url: str) -> tuple[str, str | None]:
    """(the URL without its `user:password@`, that userinfo still percent-encoded, or None): an HTTP
    client sends the userinfo as an Authorization header, never in the request line."""
    scheme, userinfo, host, kept, hidden = _url_parts(url)
    return f"{scheme}{host}{kept}{hidden}", userinfo


def scrub_url(text: str, url: str) -> str:
    """`text` (an error message) with nothing of `url` that `mask_url` hides: the URL whole becomes
    its masked form; its password (a bare userinfo whole), hidden path, query and fragment, and each
    of their segments and values of 6 characters or more, as written or percent-decoded, become `***`
    (the host is left as it is)."""
    scheme, userinfo, host, kept, hidden = _url_parts(url)
    bare = f"{scheme}{host}{kept}{hidden}"
    hostname = re.sub(r":\d*$", "", host)
    shown = {w: mask_url(url) for w in (url, bare, unquote(url), unquote(bare))}
    shown |= {h: h for h in (host, hostname) if h}
    pieces = {hidden, *re.split(r"[?#]", hidden)}
    pieces |= {w for w in re.split(r"[/?#&=;]", hidden) if len(w) >= 6}  # a token alone (shorter: a word)
    if userinfo is not None:
        user, colon, password = userinfo.partition(":")
        pieces |= {userinfo, password} if colon else {userinfo}
    pieces |= {unquote(p) for p in pieces}
    pieces.discard("")

    def scrub(part: str) -> str:
        for piece in sorted(pieces, key=len, reverse=True):
            part = part.replace(piece, "***")
        return part

    out, at = [], 0
    for m in re.finditer("|".join(map(re.escape, sorted(shown, key=len, reverse=True))), text):
        out += [scrub(text[at : m.start()]), shown[m.group(0)]]
        at = m.end()
    return "".join([*out, scrub(text[at:])])


def _check_prices(value: Any, src: str) -> dict[str, dict[str, float]]:
    """`prices` as a mapping generation -> {on_demand, spot} of non-negative USD per chip-hour (a
    GPU machine type, `h100-mega-80gb-8`: per GPU-hour)."""
    where = f"setting `prices` ({src})"
    example = "e.g. prices: {v5p: {on_demand: 4.0, spot: 2.0}} (USD per chip-hour, your own prices)"
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadInput(f"{where} must be a mapping of TPU generations to prices", example)
    out: dict[str, dict[str, float]] = {}
    for gen, kinds in value.items():
        if gen not in GENERATIONS and gen not in GPU_MACHINES:
            raise BadInput(
                f"{where}: `{gen}` is not a TPU generation or GPU machine type",
                f"use {' or '.join([*GENERATIONS, *GPU_MACHINES])}",
            )
        if not isinstance(kinds, dict) or not kinds:
            raise BadInput(f"{where}: `{gen}` must map on_demand and/or spot to a price", example)
        out[gen] = {}
        for kind, price in kinds.items():
            if kind not in PRICE_KINDS:
                raise BadInput(f"{where}: `{gen}.{kind}` is not a price kind", "use on_demand or spot")
            if isinstance(price, bool) or not isinstance(price, int | float) or not price >= 0:
                raise BadInput(
                    f"{where}: `{gen}.{kind}` must be a non-negative number of USD per chip-hour, got {price!r}"
                )
            out[gen][kind] = float(price)
    return out


# Label keys the launch template sets itself; an extra node selector may not override them.
_OWN_SELECTORS = (
    "cloud.google.com/gke-tpu-accelerator",
    "cloud.google.com/gke-tpu-topology",
    "cloud.google.com/gke-accelerator",
    "cloud.google.com/gce-machine-type",
    "cloud.google.com/placement-policy-name",
    "cloud.google.com/gke-spot",
    "cloud.google.com/reservation-name",
    "cloud.google.com/gke-queued",
)
_QUALIFIED_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_EXAMPLES = {
    "prices": "e.g. prices: {v5p: {on_demand: 4.0, spot: 2.0}} (USD per chip-hour, your own prices)",
    "node_selectors": "e.g. node_selectors: {cloud.google.com/gke-nodepool: tpu-pool-a}",
    "tolerations": "e.g. tolerations: [{key: dedicated, operator: Equal, value: ml, effect: NoSchedule}]",
    "pod_annotations": 'e.g. pod_annotations: {gke-gcsfuse/volumes: "true"}',
    "image_pull_secrets": "e.g. image_pull_secrets: [registry-credentials]",
}

_ENV_EXAMPLES = {
    "prices": "{v5p: {on_demand: 4.0, spot: 2.0}}",
    "node_selectors": "{cloud.google.com/gke-nodepool: tpu-pool-a}",
    "tolerations": "[{key: dedicated, operator: Exists, effect: NoSchedule}]",
    "pod_annotations": "{example.com/team: pretraining}",
    "image_pull_secrets": "[registry-credentials]",
}


def _check_mapping(name: str, value: Any, src: str) -> dict[str, str]:
    """A mapping of label-style keys (`prefix/name`) to strings: node selectors, pod annotations."""
    where = f"setting `{name}` ({src})"
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadInput(f"{where} must be a mapping", _EXAMPLES[name])
    out: dict[str, str] = {}
    for k, v in value.items():
        if not isinstance(k, str) or len(k.rpartition("/")[2]) > 63 or not _QUALIFIED_NAME.match(k):
            raise BadInput(
                f"{where}: `{k}` is not a valid key", "prefix/name, the name at most 63 characters"
            )
        if not isinstance(v, str | int | float) or isinstance(v, bool):
            raise BadInput(f"{where}: the value of `{k}` must be a string, got {v!r}", "quote it")
        v = str(v)
        if name == "node_selectors":
            if k in _OWN_SELECTORS:
                raise BadInput(
                    f"{where}: `{k}` is set by olmo-ctl",
                    "the device, placement_policy and capacity settings choose it",
                )
            if len(v) > 63 or not _LABEL_VALUE.match(v):
                raise BadInput(f"{where}: `{v}` (for `{k}`) is not a valid label value")
        out[k] = v
    return out


def _check_tolerations(value: Any, src: str) -> list[dict[str, str]]:
    """Kubernetes tolerations: key, operator (Equal or Exists), value (Equal only), effect."""
    where = f"setting `tolerations` ({src})"
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadInput(f"{where} must be a list", _EXAMPLES["tolerations"])
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, dict):
            raise BadInput(f"{where}: item {i + 1} is not a mapping", _EXAMPLES["tolerations"])
        unknown = sorted(set(t) - set(_TOLERATION_KEYS))
        if unknown:
            raise BadInput(
                f"{where}: item {i + 1} has unknown keys {unknown}", f"known: {', '.join(_TOLERATION_KEYS)}"
            )
        op = t.get("operator", "Equal")
        if op not in ("Equal", "Exists"):
            raise BadInput(f"{where}: item {i + 1}: operator `{op}` is not Equal or Exists")
        if op == "Exists" and t.get("value") not in (None, ""):
            raise BadInput(f"{where}: item {i + 1}: operator Exists takes no value")
        if not t.get("key") and op != "Exists":
            raise BadInput(f"{where}: item {i + 1}: a toleration without a key needs operator Exists")
        if t.get("effect") not in (None, *_EFFECTS):
            raise BadInput(f"{where}: item {i + 1}: effect `{t['effect']}` is not {', '.join(_EFFECTS)}")
        seconds = t.get("tolerationSeconds")
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, int) or t.get("effect") != "NoExecute"
        ):
            raise BadInput(
                f"{where}: item {i + 1}: tolerationSeconds is an integer, with effect NoExecute only"
            )
        item: dict[str, Any] = {
            k: str(t[k]) for k in ("key", "operator", "value", "effect") if t.get(k) not in (None, "")
        }
        if seconds is not None:
            item["tolerationSeconds"] = seconds
        out.append(item)
    return out


def _check_secrets(value: Any, src: str) -> list[str]:
    where = f"setting `image_pull_secrets` ({src})"
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadInput(f"{where} must be a list of Secret names", _EXAMPLES["image_pull_secrets"])
    for v in value:
        if len(v) > 253 or not _DNS1123_SUBDOMAIN.match(v):
            raise BadInput(
                f"{where}: `{v}` is not a valid Secret name", "use lowercase letters, digits, '-' and '.'"
            )
    return list(value)


def _check_structured(name: str, value: Any, src: str) -> Any:
    if name == "prices":
        return _check_prices(value, src)
    if name == "tolerations":
        return _check_tolerations(value, src)
    if name == "image_pull_secrets":
        return _check_secrets(value, src)
    return _check_mapping(name, value, src)


def _parse_env_yaml(name: str, text: str, src: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        raise BadInput(
            f"setting `{name}` ({src}) is not valid YAML",
            f"e.g. OLMO_CTL_{name.upper()}='{_ENV_EXAMPLES[name]}'",
        ) from None


def _load_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    import yaml

    try:
        raw = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except OSError as e:
        raise BadInput(f"cannot read config file `{path}`: {e.strerror}") from None
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else "syntax error"
        raise BadInput(f"config file `{path}` is not valid YAML ({first})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadInput(
            f"config file `{path}` must be a YAML mapping of settings", f"keys: {', '.join(setting_names())}"
        )
    names = setting_names()
    for k, v in raw.items():
        if k not in names:
            raise BadInput(
                f"config file `{path}`: unknown setting `{k}`", f"known settings: {', '.join(names)}"
            )
        if k in STRUCTURED:
            continue  # a mapping or a list, checked where it is resolved
        if (
            v is not None
            and not isinstance(v, str)
            and not (k == "host_network" and isinstance(v, bool))
            and not (k == "trainer_resources" and isinstance(v, bool))  # YAML reads a bare `off` as false
            and not (k == "ttl_seconds_after_finished" and isinstance(v, int) and not isinstance(v, bool))
        ):
            got = f"a {type(v).__name__}" if k == "notify_webhook" else repr(v)  # never the URL's secret
            raise BadInput(f"config file `{path}`: setting `{k}` must be a string, got {got}")
    return raw


def resolve_settings(default_run_roots: Mapping[str, str | None], **flag_values: str | None) -> Settings:
    """Settings from flags (non-None values win), then OLMO_CTL_<NAME> env, then the config file.

    `default_run_roots` is the backends' declaration (`olmo_ctl.backends.resolve_settings` passes it):
    each backend's name, and the local path its runs default to when no source sets a run root (None:
    the placeholder). An empty string (from any source) clears an optional setting (kube_context,
    priority_class, placement_policy) and is an error for the others.
    """
    names = setting_names()
    unknown = set(flag_values) - set(names)
    if unknown:
        raise TypeError(f"unknown settings {sorted(unknown)}")  # a programming error, not a user one
    path = config_path()
    from_file = _load_file(path)
    optional = {
        "kube_context",
        "priority_class",
        "placement_policy",
        "xla_flags",
        "notify_webhook",
        "notify_command",
        "pod_priority_class",
        "ttl_seconds_after_finished",
    }
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    value: Any  # a string from a flag, the environment or the file; host_network may be a YAML bool
    for name in ["backend"] + [n for n in names if n != "backend"]:  # run_root's default depends on it
        env_name = ENV_PREFIX + name.upper()
        if name in STRUCTURED:  # a mapping or a list: the environment or the file, no flag
            if env_name in os.environ:
                src = f"env {env_name}"
                values[name] = _check_structured(name, _parse_env_yaml(name, os.environ[env_name], src), src)
            elif from_file.get(name) is not None:
                src = f"file {path}"
                values[name] = _check_structured(name, from_file[name], src)
            else:
                src = "default"
            sources[name] = src
            continue
        if flag_values.get(name) is not None:
            value, src = flag_values[name], "flag --" + name.replace("_", "-")
        elif env_name in os.environ:
            value, src = os.environ[env_name], f"env {env_name}"
        elif from_file.get(name) is not None:
            value, src = from_file[name], f"file {path}"
        elif name == "run_root" and default_run_roots.get(values.get("backend", Settings.backend)):
            # A backend whose runs live on this machine declares a local default (absolute, so every
            # process agrees).
            root = default_run_roots[values.get("backend", Settings.backend)]
            assert root is not None
            values[name] = os.path.abspath(root)
            sources[name] = f"default for the {values.get('backend')} backend"
            continue
        else:
            sources[name] = "default"
            continue
        if name == "host_network":
            word = str(value).strip().lower()
            if word not in _TRUE + _FALSE:
                raise BadInput(f"setting `host_network` ({src}): `{value}` is not true or false")
            values[name], sources[name] = word in _TRUE, src
            continue
        if name == "trainer_resources" and isinstance(value, bool):
            if value:
                raise BadInput(
                    f"setting `trainer_resources` ({src}): `{value}` is not a trainer resources setting",
                    "use auto (sized from the node type), off (none), or cpu=N,memory=Q",
                )
            value = "off"
        value = str(value).strip()
        if value == "" and name in optional:
            values[name] = None
        else:
            _check(name, value, src, tuple(default_run_roots))
            if name == "run_root" and not value.startswith("gs://"):
                value = os.path.abspath(os.path.expanduser(value))  # every process sees the same directory
            if name == "trainer_resources":
                value = value.lower() if value.lower() in ("auto", "off") else value
            values[name] = int(value) if name == "ttl_seconds_after_finished" else value
        sources[name] = src
    return Settings(**values, sources={n: sources[n] for n in names})
