"""Small helpers over plain-dict Kubernetes objects shared by the controllers."""

from __future__ import annotations

from typing import Any

from olmo_ctl.backends.kube import QUANTITY_SUFFIX as _SUFFIX
from olmo_ctl.backends.kube import parse_quantity

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
KUEUE_API = "kueue.x-k8s.io/v1beta1"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
PODSET_LABEL = "kueue.x-k8s.io/podset"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
RJOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
RESTARTS_LABEL = "jobset.sigs.k8s.io/restart-attempt"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
JOB_TRACKING_FINALIZER = "batch.kubernetes.io/job-tracking"
RESOURCE_IN_USE_FINALIZER = "kueue.x-k8s.io/resource-in-use"


def md(obj: dict) -> dict:
    return obj["metadata"]


def labels(obj: dict) -> dict:
    return obj["metadata"].get("labels") or {}


def find_cond(obj: dict | None, ctype: str) -> dict | None:
    if not obj:
        return None
    return next(
        (c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == ctype), None
    )


def is_true(obj: dict | None, ctype: str) -> bool:
    c = find_cond(obj, ctype)
    return c is not None and c.get("status") == "True"


def set_status_condition(
    obj: dict, ctype: str, status: str, reason: str, message: str, now: str, observed_generation: bool = True
) -> bool:
    """apimeta.SetStatusCondition: lastTransitionTime moves only when the status changes; returns
    whether anything changed."""
    conds = obj.setdefault("status", {}).setdefault("conditions", [])
    c = next((c for c in conds if c.get("type") == ctype), None)
    new: dict[str, Any] = {"type": ctype, "status": status, "reason": reason, "message": message}
    if observed_generation:
        new["observedGeneration"] = int(obj["metadata"].get("generation") or 1)
    if c is None:
        conds.append({**new, "lastTransitionTime": now})
        return True
    changed = any(c.get(k) != v for k, v in new.items())
    if c.get("status") != status:
        c["lastTransitionTime"] = now
        changed = True
    c.update(new)
    return changed


def owner_ref(owner: dict, api_version: str, kind: str, controller: bool = True) -> dict:
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": controller,
        "blockOwnerDeletion": True,
    }


def controlled_by(obj: dict, owner: dict) -> bool:
    uid = owner["metadata"].get("uid")
    return any(
        r.get("uid") == uid and r.get("controller") for r in obj["metadata"].get("ownerReferences") or []
    )


def deleting(obj: dict) -> bool:
    return obj["metadata"].get("deletionTimestamp") is not None


def pod_terminal(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


quantity = parse_quantity  # "100m", "64Mi", 4 -> a number (the backend's own parser)


def format_quantity(resource: str, v: float) -> str:
    """The way resource.Quantity prints: millis for fractional values, binary suffixes for bytes."""
    if abs(v - round(v)) > 1e-9:
        return f"{round(v * 1000)}m"
    n = int(round(v))
    if resource in ("memory", "ephemeral-storage") and n:
        for suf in ("Ti", "Gi", "Mi", "Ki"):
            if n % _SUFFIX[suf] == 0:
                return f"{n // _SUFFIX[suf]}{suf}"
    return str(n)


def sidecars(spec: dict) -> list[dict]:
    """The pod's sidecar containers: init containers with `restartPolicy: Always` (KEP-753), which
    start before the regular containers and run beside them until those have exited."""
    return [c for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"]


def pod_requests(template: dict) -> dict[str, float]:
    """Requests of one pod of a template (limits where a request is missing), as Kueue counts them."""
    out: dict[str, float] = {}
    for c in (template.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        for k, v in merged.items():
            out[k] = out.get(k, 0.0) + quantity(v)
    return out


def node_capacity(device) -> dict[str, str]:
    """A node's CPU and memory capacity: its machine type's vCPUs and memory (the generation's profile)."""
    from olmo_ctl.core.node_resources import machine_of

    prof = machine_of(device.generation)
    return {} if prof is None else {"cpu": str(prof.vm_vcpus), "memory": f"{prof.vm_memory_gib}Gi"}


def node_allocatable(device) -> dict[str, str]:
    """What GKE leaves of that capacity to pods (core/node_resources.gke_allocatable)."""
    from olmo_ctl.core.node_resources import gke_allocatable, machine_of

    prof = machine_of(device.generation)
    if prof is None:
        return {}
    cpu_m, mem_mib = gke_allocatable(prof.vm_vcpus, prof.vm_memory_gib)
    return {"cpu": f"{cpu_m}m", "memory": f"{mem_mib}Mi"}
