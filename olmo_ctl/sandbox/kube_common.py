"""What the test API server (`kube_api`) and what it serves beyond plain objects (`kube_views`) both
read: the CRD files it serves (`crds/`: JobSet v0.10.1, Kueue v0.17.1, GKE's multi-network objects) and
their schemas, and
`ApiError`, a request's failure as the `Status` object kube-apiserver answers with.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

CRD_DIR = Path(__file__).resolve().parent / "crds"
JOBSET_CRD = "jobset.x-k8s.io_jobsets.v0.10.1.yaml"
WORKLOAD_CRD = "kueue.x-k8s.io_workloads.v0.17.1.yaml"
LOCALQUEUE_CRD = "kueue.x-k8s.io_localqueues.v0.17.1.yaml"
CLUSTERQUEUE_CRD = "kueue.x-k8s.io_clusterqueues.v0.17.1.yaml"
RESOURCEFLAVOR_CRD = "kueue.x-k8s.io_resourceflavors.v0.17.1.yaml"
WPC_CRD = "kueue.x-k8s.io_workloadpriorityclasses.v0.17.1.yaml"
ADMISSIONCHECK_CRD = "kueue.x-k8s.io_admissionchecks.v0.17.1.yaml"
NETWORK_CRD = "networking.gke.io_networks.v0.3.0.yaml"
GKE_NETWORK_PARAMSET_CRD = "networking.gke.io_gkenetworkparamsets.v0.3.0.yaml"


# ---------------------------------------------------------------- schemas


@functools.cache
def crd_versions(filename: str) -> dict[str, dict]:
    """{version: openAPIV3Schema} of the served versions of one CRD file."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(CRD_DIR / filename) as f:
        crd = yaml.load(f, Loader=loader)
    return {v["name"]: v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v.get("served")}


# ---------------------------------------------------------------- errors


class ApiError(Exception):
    def __init__(
        self, code: int, reason: str, message: str, details: dict | None = None, headers: dict | None = None
    ):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}
        self.headers = headers or {}

    def status(self) -> dict:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


def _python_patterns(node: Any) -> Any:
    """The schema's `pattern`s as Python's `re` reads them: RE2 (the API server's) takes a flag group
    after `^` (`^(?i)[a-z]...`, Kueue's AdmissionCheck), Python only at the start (`(?i)^[a-z]...`)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "pattern" and isinstance(v, str):
                node[k] = re.sub(r"^\^\((\?[a-z]+)\)", r"(\1)^", v)
            else:
                _python_patterns(v)
    elif isinstance(node, list):
        for v in node:
            _python_patterns(v)
    return node
