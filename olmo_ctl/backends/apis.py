"""The Kubernetes APIs of JobSet and Kueue that olmo-ctl speaks: groups, versions and resources.

One place for the backend (`gke.py`, which creates and reads the objects) and the cluster checks
(`doctor.py`, which discovers that these APIs are served).
"""

from __future__ import annotations

JOBSET_GROUP, JOBSET_VERSION, JOBSETS = "jobset.x-k8s.io", "v1alpha2", "jobsets"
KUEUE_GROUP, WORKLOADS = "kueue.x-k8s.io", "workloads"
WORKLOAD_PRIORITY_CLASSES = "workloadpriorityclasses"
KUEUE_VERSIONS = ("v1beta2", "v1beta1")  # newest first; Kueue < 0.15 serves only v1beta1
