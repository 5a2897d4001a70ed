"""JobSet rendering: one attempt of a run on one TPU slice (or N: multislice) or on N GPU nodes, from
`launch_templates/`. Pure.

`launch_templates/common.yaml` holds the JobSet's shape and its tunable `vars`; the generation's
file, the one its profile names (`core/generations.py`: `tpu7x.yaml`, `v5p.yaml`), is merged over
it. GPU nodes merge `gpu.yaml` and then their interconnect's file (`gpu-tcpxo.yaml`, `gpu-rdma.yaml`,
the one the machine type's profile names) over it, by Kubernetes' strategic-merge rules (`_merge`).
Placeholders (`${name}`) are filled on the parsed tree, never in YAML text, so a value cannot
change the manifest's structure. The result is a plain dict: what `submit --dry-run` prints and
exactly what the GKE backend applies.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from olmo_ctl.core.batching import Plan
from olmo_ctl.core.config import Settings
from olmo_ctl.core.contracts import (
    GPU_COORDINATOR_ADDRESS_ENV,
    GPU_COORDINATOR_PORT,
    GPU_COORDINATOR_PORT_ENV,
    GPU_NODE_RANK_ENV,
    GPU_NODES_ENV,
    SPOT_STOP_BUDGET_S,
    STOP_BUDGET_ENV,
    trainer_argv,
)
from olmo_ctl.core.devices import Device, Target, check_slices
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.generations import GENERATIONS, GPU_MACHINES
from olmo_ctl.core.names import validate_run_name
from olmo_ctl.core.node_resources import check_shm_fits, trainer_resources_for
from olmo_ctl.core.recipe import Recipe
from olmo_ctl.core.xla_flags import libtpu_init_args, xla_flags_for

# Package data: `launch_templates/` at the top of the repository, `olmo_ctl/launch_templates` (a link to
# it) in a checkout, real files in an installed wheel.
TEMPLATES_DIR = Path(str(resources.files("olmo_ctl") / "launch_templates"))

# Labels and annotations the GKE backend and `monitor` look attempts up by.
LABEL_QUEUE = "kueue.x-k8s.io/queue-name"
LABEL_PRIORITY = "kueue.x-k8s.io/priority-class"
LABEL_RUN = "olmo-ctl/run"
LABEL_ATTEMPT = "olmo-ctl/attempt"
LABEL_DEVICE = "olmo-ctl/device"
ANNOTATION_RUN_DIR = "olmo-ctl/run-dir"
ANNOTATION_RECIPE = "olmo-ctl/recipe"
ANNOTATION_PLAN = "olmo-ctl/plan"
REPLICATED_JOB = "slice"
CONTAINER = "trainer"

MAX_JOBSET_NAME = 40  # pod names grow `-slice-<i>-<j>-<hash>`; XPK caps at 40 too
_PLACEHOLDER = re.compile(r"\$\{(\w+)\}")
_DROP = object()


# ---------------------------------------------------------------- names


def jobset_name(run: str, attempt: int) -> str:
    """`<run>-a<attempt>`, a DNS-1035 label of at most 40 characters.

    A longer name keeps the start of the run name and ends with a hash of the whole run name,
    so attempts of one run still sort together and two long runs never collide.
    """
    validate_run_name(run)
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise BadInput(f"attempt `{attempt}` is not a non-negative integer")
    name = f"{run}-a{attempt}"
    if len(name) <= MAX_JOBSET_NAME:
        return name
    suffix = f"-{hashlib.sha256(run.encode()).hexdigest()[:6]}-a{attempt}"
    return run[: MAX_JOBSET_NAME - len(suffix)].rstrip("-") + suffix


# ---------------------------------------------------------------- templates


def _named(items: Any) -> bool:
    return isinstance(items, list) and all(isinstance(x, dict) and "name" in x for x in items)


def _merge(base: Any, over: Any) -> Any:
    """`over` merged over `base` as Kubernetes' strategic merge patch does: mappings merge key by key
    and a null removes the key; a list of named items (containers, volumes, replicatedJobs) merges
    item by item on `name`, items new to `base` appended in order; anything else in `over` replaces
    `base`."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = _merge(base[k], v) if k in base else v
        return out
    if base and _named(base) and _named(over):
        out_items = list(base)
        index = {x["name"]: i for i, x in enumerate(base)}
        for x in over:
            if x["name"] in index:
                out_items[index[x["name"]]] = _merge(base[index[x["name"]]], x)
            else:
                out_items.append(x)
        return out_items
    return over


@functools.lru_cache(maxsize=8)
def _load_template(paths: tuple[Path, ...]) -> dict:
    """common.yaml, then each of `paths` merged over it in order. The last file may set only the vars
    the files below it declare (a misspelt var is an error, not a new var)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: start-up time
    merged = yaml.load((TEMPLATES_DIR / "common.yaml").read_text(), Loader=loader)
    for path in paths:
        specific = yaml.load(path.read_text(), Loader=loader) or {}
        if path == paths[-1]:
            unknown = set(specific.get("vars", {})) - set(merged["vars"])
            if unknown:
                raise ValueError(f"{path}: unknown vars {sorted(unknown)} (known: {sorted(merged['vars'])})")
        merged = _merge(merged, specific)
    return merged


# The file every GPU node's template is merged over before its interconnect's (`gpu-tcpxo.yaml`, ...).
GPU_TEMPLATE = "gpu.yaml"


def template_path(generation: str) -> Path:
    """The launch template a TPU generation's profile names (`launch_templates/<generation>.yaml`), or
    a GPU machine type's: its interconnect's (`launch_templates/gpu-tcpxo.yaml`)."""
    if generation in GPU_MACHINES:
        return TEMPLATES_DIR / GPU_MACHINES[generation].template_file
    return TEMPLATES_DIR / GENERATIONS[generation].template_file


def launch_template(generation: str) -> dict:
    """The merged template `{vars: ..., jobset: ...}` for a TPU generation or a GPU machine type (a
    fresh copy)."""
    path = template_path(generation)
    if not path.exists():
        what = "GPU machine type" if generation in GPU_MACHINES else "TPU generation"
        raise BadInput(f"no launch template for {what} `{generation}`", f"expected {path}")
    paths = (TEMPLATES_DIR / GPU_TEMPLATE, path) if generation in GPU_MACHINES else (path,)
    return copy.deepcopy(_load_template(paths))


def _fill(node: Any, values: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            v = _fill(v, values)
            if v is not _DROP:
                out[k] = v
        return out
    if isinstance(node, list):
        return [x for x in (_fill(v, values) for v in node) if x is not _DROP]
    if isinstance(node, str):
        whole = _PLACEHOLDER.fullmatch(node)
        if whole:
            value = values[whole.group(1)]
            return _DROP if value is None else copy.deepcopy(value)

        def text(m: re.Match) -> str:
            value = values[m.group(1)]
            if value is None or isinstance(value, dict | list):
                raise ValueError(f"`{m.group(1)}` cannot be part of the string {node!r}")
            return str(value)

        return _PLACEHOLDER.sub(text, node)
    return node


# ---------------------------------------------------------------- rendering


# The placement policy XPK names for a slice whose node pools need one (src/xpk/core/scheduling.py
# get_placement_policy_name: `<device type>-<topology>-placement-policy`; the pods select it with
# create_placement_policy_label, and `xpk cluster create` makes the node pools with it).
XPK_PLACEMENT_POLICY = "{device}-{topology}-placement-policy"
NO_PLACEMENT_POLICY = "none"  # the site setting that turns the selector off


def placement_policy_for(device: Device, settings: Settings) -> str | None:
    """The placement policy a slice's pods select (XPK's name unless the site setting names another,
    or `none`), or None where its node pools carry none: single-host slices, and generations whose
    template says `never`."""
    if settings.placement_policy == NO_PLACEMENT_POLICY or not device.is_tpu or device.vms < 2:
        return None
    if launch_template(device.generation)["vars"]["placement_policy"] != "multi-host":
        return None
    return (settings.placement_policy or XPK_PLACEMENT_POLICY).format(
        device=device.name, topology=device.topology, generation=device.generation
    )


# The node selector of each capacity type: XPK's `get_capacity_node_selectors_from_capacity_type`
# (src/xpk/core/capacity.py). GKE labels the nodes of spot, reservation and flex-start (queued
# provisioning) node pools so; on-demand pools carry no such label and need no selector.
CAPACITY_SELECTOR_KEYS = {
    "spot": "cloud.google.com/gke-spot",
    "reservation": "cloud.google.com/reservation-name",
    "flex-start": "cloud.google.com/gke-queued",
}


def stop_budget_s(settings: Settings, grace_period_s: int) -> int:
    """Seconds the trainer has from SIGTERM to its kill (`STOP_BUDGET_ENV`): on spot VMs what GKE's
    graceful node shutdown leaves non-system pods of the 30 s notice (SPOT_STOP_BUDGET_S), else the
    pod's termination grace period."""
    if settings.capacity.partition(":")[0] == "spot":
        return min(SPOT_STOP_BUDGET_S, grace_period_s)
    return grace_period_s


def capacity_node_selector(capacity: str) -> dict[str, str]:
    """The pods' node selector for a capacity type (`on-demand`, `spot`, `reservation:NAME`, `flex-start`)."""
    kind, _, reservation = capacity.partition(":")
    if kind == "on-demand":
        return {}
    if kind == "reservation":
        return {CAPACITY_SELECTOR_KEYS["reservation"]: reservation}
    return {CAPACITY_SELECTOR_KEYS[kind]: "true"}


def pod_node_selector(settings: Settings, device: Device | None = None) -> dict[str, str]:
    """What the site adds to the slice's node selector: the capacity type's, then `node_selectors`;
    with `device`, its placement policy too (`placement_policy_for`)."""
    policy = placement_policy_for(device, settings) if device is not None else None
    return {
        **capacity_node_selector(settings.capacity),
        **settings.node_selectors,
        **({"cloud.google.com/placement-policy-name": policy} if policy else {}),
    }


def host_network(settings: Settings | None) -> bool:
    """Whether the pods run on the host network (the site setting `host_network`; off by default)."""
    return bool(getattr(settings, "host_network", False))


def identity_note(settings: Settings | None, device: Device | None = None) -> str | None:
    """One line on the pods' GCS identity when hostNetwork changes it, else None. GPU nodes' pods
    never run on the host network (`launch_templates/gpu.yaml`): said instead."""
    if settings is None or not host_network(settings):
        return None
    if device is not None and device.is_gpu_nodes:
        return (
            f"host_network is on but not used: {device.name} pods stay off the host network (GKE "
            "multi-networking gives them the GPU NICs), so Workload Identity applies"
        )
    return (
        "host_network is on: GKE Workload Identity does not apply to hostNetwork pods, so the trainer reaches "
        f"GCS as the node pool's service account, not as Kubernetes service account "
        f"`{settings.service_account}`; that account needs read/write on the run root's bucket"
    )


# Multislice: the variables that join N slices over DCN. GKE's TPU webhook injects them into every pod
# of a JobSet whose replicated job has several replicas and requests google.com/tpu (with TPU_WORKER_ID
# and TPU_WORKER_HOSTNAMES): XPK's `workload create --num-slices N` sets none of them for TPU JobSets
# (src/xpk/commands/workload.py WORKLOAD_CREATE_YAML; src/xpk/core/docker_resources.py get_env_container
# -> format_env_dict(args.env) for TPU), nor does JobSet's own GKE multislice example
# (site/static/examples/tpu-multislice/v6e-jax-workload.yaml), and JAX reads them from the environment
# "for GKE via JobSet" (jax/_src/clusters/cloud_tpu_cluster.py). So the manifest never sets them, and
# an extra env (the launch template's, a test's) may not name them either: a variable set twice.
INJECTED_ENV = (
    "MEGASCALE_COORDINATOR_ADDRESS",
    "MEGASCALE_NUM_SLICES",
    "MEGASCALE_SLICE_ID",
    "MEGASCALE_PORT",
    "TPU_WORKER_ID",
    "TPU_WORKER_HOSTNAMES",
)


def _env(
    template_env: dict[str, Any],
    libtpu_args: str = "",
    extra: tuple[tuple[str, str], ...] = (),
    *,
    xla_flags: str = "",
    nodes: tuple[dict, ...] = (),
) -> list[dict]:
    env = [{"name": str(k), "value": str(v)} for k, v in template_env.items()]
    if libtpu_args:
        env.append({"name": "LIBTPU_INIT_ARGS", "value": libtpu_args})
    if xla_flags:
        env.append({"name": "XLA_FLAGS", "value": xla_flags})
    env += list(nodes)
    env += [{"name": k, "value": v} for k, v in extra]
    check_env(env)
    return env


def _field(path: str) -> dict:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def gpu_nodes_env(device: Device) -> list[dict]:
    """How the trainers on N GPU nodes find each other, as XPK sets it for GPU node pools
    (src/xpk/core/docker_resources.py get_gpu_env): the node count, the pod's rank (its Job completion
    index), GPUs a node, the interconnect (USE_GPUDIRECT) and the coordinator, pod 0 of the replicated
    job by its JobSet DNS name (`<jobset>-slice-0-0.<jobset>`, spelled from the variables before it).
    The trainer joins by these names (`core/contracts.py`, `trainer/multihost.py`)."""
    return [
        {
            "name": "REPLICATED_JOB_NAME",
            **_field("metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']"),
        },
        {"name": "JOBSET_NAME", **_field("metadata.annotations['jobset.sigs.k8s.io/jobset-name']")},
        {"name": GPU_NODES_ENV, "value": str(device.vms)},
        {
            "name": GPU_NODE_RANK_ENV,
            **_field("metadata.annotations['batch.kubernetes.io/job-completion-index']"),
        },
        {"name": "USE_GPUDIRECT", "value": GPU_MACHINES[device.generation].gpu_direct},
        {"name": "GPUS_PER_NODE", "value": str(device.chips_per_vm)},
        {"name": GPU_COORDINATOR_PORT_ENV, "value": str(GPU_COORDINATOR_PORT)},
        {
            "name": GPU_COORDINATOR_ADDRESS_ENV,
            "value": "$(JOBSET_NAME)-$(REPLICATED_JOB_NAME)-0-0.$(JOBSET_NAME)",
        },
    ]


def network_interfaces(networks: list[str]) -> str | None:
    """The `networking.gke.io/interfaces` annotation: eth0, eth1, ... on `networks` in order (GKE
    multi-networking); None for none."""
    if not networks:
        return None
    lines = [
        json.dumps({"interfaceName": f"eth{i}", "network": n}, separators=(",", ":"))
        for i, n in enumerate(networks)
    ]
    return "[\n" + ",\n".join(f"  {line}" for line in lines) + "\n]\n"


# Kueue's topology request XPK puts on GPU pods (src/xpk/commands/workload.py): one pod per host.
PREFERRED_TOPOLOGY = "kubernetes.io/hostname"


def preferred_topology(template_vars: dict, settings: Settings) -> str | None:
    """The pods' `kueue.x-k8s.io/podset-preferred-topology`, where XPK adds it: GPU node pools of a
    capacity type that allows Kueue's topology-aware scheduling (the template's
    `topology_request_capacities`; XPK's src/xpk/commands/common.py is_GPU_TAS_possible). None on TPU."""
    kind = settings.capacity.partition(":")[0]
    return PREFERRED_TOPOLOGY if kind in template_vars.get("topology_request_capacities", ()) else None


def check_env(env: list[dict]) -> None:
    """Every variable once, and none of those GKE's TPU webhook injects."""
    names = [e["name"] for e in env]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"environment variables set twice: {twice}")
    injected = sorted(set(names) & set(INJECTED_ENV))
    if injected:
        raise ValueError(f"{injected} are injected by GKE's TPU webhook; the manifest must not set them")


def render_jobset(
    recipe: Recipe,
    plan: Plan,
    device: Device,
    settings: Settings,
    run_name: str,
    attempt: int,
    run_dir: str,
    slices: int = 1,
    *,
    extra_args: tuple[str, ...] = (),
    extra_env: tuple[tuple[str, str], ...] = (),
) -> dict:
    """The JobSet for one attempt: a plain dict, ready for YAML/JSON or the Kubernetes API.
    `extra_args` go after the trainer's command line, `extra_env` after the template's variables."""
    if not device.is_tpu and not device.is_gpu_nodes:
        raise BadInput(
            f"`{device.name}` is a local device; the GKE backend runs on TPU slices and GPU nodes",
            "use --backend local, or a TPU device such as tpu7x-128",
        )
    slices = check_slices(device, slices)
    if plan.device != device.name or plan.devices != device.devices * slices or plan.slices != slices:
        raise ValueError(
            f"plan for {plan.device} ({plan.devices} devices) does not match {slices} x {device.name}"
        )
    if plan.recipe != recipe.name:
        raise ValueError(f"plan for recipe {plan.recipe} does not match recipe {recipe.name}")
    if not run_dir.startswith("gs://"):
        raise BadInput(
            f"run directory `{run_dir}` is not on GCS; {'GPU' if device.is_gpu_nodes else 'TPU'} pods cannot "
            "see this machine's files",
            "set the run root to gs://BUCKET/PREFIX (--run-root, OLMO_CTL_RUN_ROOT or run_root "
            "in the config file)",
        )
    name = jobset_name(run_name, attempt)
    template = launch_template(device.generation)
    v = template["vars"]
    gpu = device.is_gpu_nodes
    resources = trainer_resources_for(device.generation, settings.trainer_resources)
    check_shm_fits(v.get("shm_size"), resources)
    values = {
        "name": name,
        "namespace": settings.namespace,
        "run": run_name,
        "attempt": str(attempt),
        "device": device.name,
        "run_dir": run_dir,
        "queue": settings.queue,
        "priority_class": settings.priority_class,
        "accelerator": device.accelerator_label,
        "topology": device.topology,
        "placement_policy": placement_policy_for(device, settings),
        "slices": slices,
        "vms": device.vms,
        "chips_per_vm": device.chips_per_vm,
        "image": settings.image,
        "service_account": settings.service_account,
        "host_network": True if host_network(settings) else None,
        "dns_policy": "ClusterFirstWithHostNet" if host_network(settings) else None,
        "env": _env(
            v["env"],
            "" if gpu else libtpu_init_args(device, recipe, settings),
            ((STOP_BUDGET_ENV, str(stop_budget_s(settings, v["termination_grace_period_s"]))), *extra_env),
            xla_flags=" ".join(xla_flags_for(device, recipe, settings)) if gpu else "",
            nodes=tuple(gpu_nodes_env(device)) if gpu else (),
        ),
        "trainer_command": trainer_argv("python", run_dir, Target(device, slices), plan, attempt)
        + list(extra_args),
        "coordinator_port": GPU_COORDINATOR_PORT,
        "preferred_topology": preferred_topology(v, settings),
        "network_interfaces": network_interfaces(v.get("networks", [])),
        "shm_size": v.get("shm_size"),
        "trainer_cpu": resources["cpu"] if resources else None,
        "trainer_memory": resources["memory"] if resources else None,
        "termination_grace_period_s": v["termination_grace_period_s"],
        "max_restarts": v["max_restarts"],
        "user_error_exit_codes": v["user_error_exit_codes"],
        "restart_exit_codes": v["restart_exit_codes"],
        "classified_exit_codes": sorted({*v["user_error_exit_codes"], *v["restart_exit_codes"]}),
    }
    jobset = _fill(template["jobset"], values)
    _add_site_pod_fields(jobset, settings)
    jobset["metadata"]["annotations"].update(
        {
            ANNOTATION_RECIPE: recipe.name,
            ANNOTATION_PLAN: f"global_batch={plan.global_batch} per_device_batch={plan.per_device_batch} "
            f"grad_accum={plan.grad_accum} devices={plan.devices}"
            + (f" slices={plan.slices}" if plan.slices > 1 else "")
            + (f" seq_shards={plan.seq_shards}" if plan.seq_shards > 1 else ""),
        }
    )
    leftover = _PLACEHOLDER.search(json.dumps(jobset))
    if leftover:
        raise ValueError(f"unfilled placeholder {leftover.group(0)} in the launch template")
    return jobset


def _add_site_pod_fields(jobset: dict, settings: Settings) -> None:
    """What the site adds to every pod (capacity selector, extra selectors, tolerations, annotations,
    pull secrets, priority class) and to the JobSet (ttlSecondsAfterFinished), after the template's own."""
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    spec = pod["spec"]
    selector = pod_node_selector(settings)
    if selector:
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **selector}
    if settings.tolerations:
        spec["tolerations"] = [*spec.get("tolerations", []), *settings.tolerations]
    if settings.pod_annotations:
        pod["metadata"]["annotations"] = {
            **pod["metadata"].get("annotations", {}),
            **settings.pod_annotations,
        }
    if settings.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in settings.image_pull_secrets]
    if settings.pod_priority_class:
        spec["priorityClassName"] = settings.pod_priority_class
    if settings.ttl_seconds_after_finished is not None:
        jobset["spec"]["ttlSecondsAfterFinished"] = settings.ttl_seconds_after_finished


# ---------------------------------------------------------------- output


@functools.cache
def _dumper() -> Any:
    """The safe dumper (libyaml's when present: the same text, faster) writing a string of several lines
    as a literal block (`|`), as it was written: the GPU pods' multi-line annotations."""
    import yaml

    base = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

    def text(dumper, value: str):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    dumper: Any = type("ManifestDumper", (base,), {})
    dumper.add_representer(str, text)
    return dumper


def dump_yaml(obj: Any) -> str:
    import yaml

    return yaml.dump(obj, Dumper=_dumper(), sort_keys=False, default_flow_style=False, width=120)


def dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=2) + "\n"
