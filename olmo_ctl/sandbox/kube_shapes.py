"""What an object must hold before the test API server stores it, beyond its metadata and CRD schema:
kube-apiserver's validation and defaults of the built-in kinds the test cluster's controllers read
(Pod, Job, DaemonSet), and what those controllers need of a JobSet and a Workload.

kube-apiserver refuses a Pod without containers (`spec.containers: Required value`), a Job without a
pod template or with `restartPolicy: Always`, a DaemonSet without a selector or template, and it
defaults what a create leaves out: a new Pod's status is `phase: Pending` whatever was sent. The
types are the upstream OpenAPI ones (the PodSpec and JobSpec schemas JobSet's CRD embeds, generated
from k8s.io/api), so a field of the wrong type is refused as it is there. A JobSet without
`spec.replicatedJobs` (or a replicated Job without its Job and pod templates) and a Workload without
`spec.podSets` are refused too: there is nothing in them for the controllers to run. Each finding is
one line `path: Invalid value: ...` / `path: Required value`, as kube-apiserver words it; the server
answers them as 422 Invalid. A status written to a Pod, Job or Node is held to the types of the fields
the controllers read (`STATUS_SCHEMAS`).
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

from olmo_ctl.sandbox.kube_common import JOBSET_CRD, _python_patterns, crd_versions

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
POD_RESTART_POLICIES = ("Always", "OnFailure", "Never")
JOB_RESTART_POLICIES = ("OnFailure", "Never")


@functools.cache
def _schemas() -> dict[str, dict]:
    """{"job": JobSpec, "pod": PodSpec}: the schemas of k8s.io/api's types that JobSet's CRD embeds."""
    js = crd_versions(JOBSET_CRD)["v1alpha2"]
    job = js["properties"]["spec"]["properties"]["replicatedJobs"]["items"]["properties"]["template"][
        "properties"
    ]["spec"]
    return {"job": job, "pod": job["properties"]["template"]["properties"]["spec"]}


# The types of the status fields the controllers read (core/v1 PodStatus, NodeStatus, batch/v1
# JobStatus); what the status subresource of such an object may be written with.
_STR, _INT, _BOOL = {"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "boolean"}
_CONDITIONS = {
    "type": "array",
    "items": {"type": "object", "required": ["type", "status"], "properties": {"type": _STR, "status": _STR}},
}
_CONTAINER_STATUSES = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": _STR,
            "image": _STR,
            "ready": _BOOL,
            "started": _BOOL,
            "restartCount": _INT,
            "state": {"type": "object"},
            "lastState": {"type": "object"},
        },
    },
}
_QUANTITIES = {"type": "object", "additionalProperties": {"type": ["string", "integer", "number"]}}
STATUS_SCHEMAS: dict[str, dict] = {
    "Pod": {
        "type": "object",
        "properties": {
            "phase": {"enum": ["Pending", "Running", "Succeeded", "Failed", "Unknown"]},
            "conditions": _CONDITIONS,
            "containerStatuses": _CONTAINER_STATUSES,
            "initContainerStatuses": _CONTAINER_STATUSES,
            **{k: _STR for k in ("hostIP", "podIP", "startTime", "reason", "message", "nominatedNodeName")},
        },
    },
    "Job": {
        "type": "object",
        "properties": {
            "conditions": _CONDITIONS,
            **{k: _INT for k in ("active", "ready", "succeeded", "failed", "terminating")},
            **{k: _STR for k in ("startTime", "completionTime", "completedIndexes", "failedIndexes")},
            "uncountedTerminatedPods": {
                "type": "object",
                "properties": {
                    "succeeded": {"type": "array", "items": _STR},
                    "failed": {"type": "array", "items": _STR},
                },
            },
        },
    },
    "Node": {
        "type": "object",
        "properties": {"conditions": _CONDITIONS, "capacity": _QUANTITIES, "allocatable": _QUANTITIES},
    },
}


@functools.cache
def _validator(which: str):
    import jsonschema

    schema = STATUS_SCHEMAS[which] if which in STATUS_SCHEMAS else _schemas()[which]
    schema = _python_patterns(copy.deepcopy(schema))
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)(schema)


def _type_errors(which: str, value: Any, path: str) -> list[str]:
    out = []
    for e in sorted(_validator(which).iter_errors(value), key=lambda e: [str(p) for p in e.path]):
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
        out.append(f"{path}{where}: Invalid value: {e.message}")
    return out


def pod_spec_errors(
    spec: Any, path: str, restart_policies: tuple[str, ...] = POD_RESTART_POLICIES, image: bool = False
) -> list[str]:
    """A PodSpec at `path`: the upstream types, at least one container, each named (a DNS-1123 label,
    unique among the pod's containers) and, for a Pod itself (`image`), with an image."""
    if spec is None:
        return [f"{path}.containers: Required value"]
    errors = _type_errors("pod", spec, path)
    if errors:
        return errors
    if not spec.get("containers"):
        errors.append(f"{path}.containers: Required value")
    seen: set[str] = set()
    for field in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(field) or []):
            name = c.get("name")
            where = f"{path}.{field}[{i}]"
            if not name:
                errors.append(f"{where}.name: Required value")
            elif not _DNS1123_LABEL.match(name) or len(name) > 63:
                errors.append(
                    f'{where}.name: Invalid value: "{name}": a lowercase RFC 1123 label must consist of '
                    "lower case alphanumeric characters or '-', and must start and end with an "
                    "alphanumeric character"
                )
            elif name in seen:
                errors.append(f'{where}.name: Duplicate value: "{name}"')
            seen.add(name or "")
            if image and not c.get("image"):
                errors.append(f"{where}.image: Required value")
    policy = spec.get("restartPolicy") or "Always"  # defaulted before validation
    if policy not in restart_policies:
        errors.append(
            f'{path}.restartPolicy: Unsupported value: "{policy}": supported values: '
            + ", ".join(f'"{p}"' for p in restart_policies)
        )
    return errors


def _template_spec(template: Any, path: str) -> tuple[Any, list[str]]:
    """A PodTemplateSpec's `spec` (None when absent) or why the template itself is wrong."""
    if template is None:
        return None, [f"{path}.spec.containers: Required value"]
    if not isinstance(template, dict):
        return None, [f"{path}: Invalid value: must be an object"]
    return template.get("spec"), []


def job_spec_errors(spec: Any, path: str, restart: bool = True) -> list[str]:
    """A JobSpec at `path`: the upstream types, a pod template with containers and (`restart`, as the
    Job's own validation asks) restartPolicy OnFailure or Never."""
    if spec is None:
        return [f"{path}.template.spec.containers: Required value"]
    errors = _type_errors("job", spec, path)
    if errors:
        return errors
    pod, errors = _template_spec(spec.get("template"), f"{path}.template")
    if errors:
        return errors
    policies = JOB_RESTART_POLICIES if restart else POD_RESTART_POLICIES
    return pod_spec_errors(pod, f"{path}.template.spec", policies)


def _jobset_errors(spec: dict) -> list[str]:
    rjs = spec.get("replicatedJobs")
    if not rjs:
        return ["spec.replicatedJobs: Required value"]
    errors: list[str] = []
    for i, rj in enumerate(rjs):
        where = f"spec.replicatedJobs[{i}].template"
        job = (rj.get("template") or {}).get("spec")
        if job is None:
            errors.append(f"{where}.spec: Required value")
            continue
        # the CRD schema has checked the types; the Job's restart policy is the Job API's to refuse
        errors += job_spec_errors(job, f"{where}.spec", restart=False)
    return errors


def shape_errors(kind: str, obj: dict) -> list[str]:
    """Why `obj` (metadata checked, a custom resource's schema checked) cannot be stored, or []."""
    spec = obj.get("spec")
    if spec is not None and not isinstance(spec, dict):
        return ["spec: Invalid value: must be an object"]
    status = obj.get("status")
    if status is not None and not isinstance(status, dict):
        return ["status: Invalid value: must be an object"]
    if status is not None and kind in STATUS_SCHEMAS:
        errors = _type_errors(kind, status, "status")
        if errors:
            return errors
    if kind == "Pod":
        return pod_spec_errors(spec, "spec", image=True)
    if kind == "Job":
        return job_spec_errors(spec, "spec")
    if kind == "DaemonSet":
        spec = spec or {}
        errors = [] if spec.get("selector") else ["spec.selector: Required value"]
        if spec.get("selector") is not None and not isinstance(spec["selector"], dict):
            errors = ["spec.selector: Invalid value: must be an object"]
        pod, template_errors = _template_spec(spec.get("template"), "spec.template")
        return errors + (template_errors or pod_spec_errors(pod, "spec.template.spec", ("Always",)))
    if kind == "JobSet":
        return _jobset_errors(spec or {})
    if kind == "Workload" and not (spec or {}).get("podSets"):
        return ["spec.podSets: Required value"]
    return []


def default_pod_status(pod: dict, before: dict | None = None) -> None:
    """A Pod's status as kube-apiserver keeps it: `phase: Pending` on create (PrepareForCreate), and
    a write that leaves the status or its phase out keeps what it was."""
    old = (before or {}).get("status") or {}
    status = pod.get("status")
    if before is None or not isinstance(status, dict):
        status = {} if before is None else copy.deepcopy(old)
    status.setdefault("phase", old.get("phase") or "Pending")
    pod["status"] = status
