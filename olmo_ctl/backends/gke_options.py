"""The GKE backend's site options (`backends/options.py`): the cluster it talks to and what its
JobSets are rendered with. Pure: loads neither the backend nor the Kubernetes client."""

from __future__ import annotations

from dataclasses import dataclass

from olmo_ctl.backends.options import option


@dataclass(frozen=True)
class GKEOptions:
    kube_context: str | None = option("kubeconfig context.", "cluster")
    namespace: str | None = option("Kubernetes namespace.", "cluster")
    queue: str | None = option("Kueue LocalQueue name.")
    priority_class: str | None = option("Kueue WorkloadPriorityClass.")
    image: str | None = option("Container image with olmo-ctl.")
    service_account: str | None = option("Kubernetes service account (Workload Identity).")
    placement_policy: str | None = option(
        "Placement policy of multi-host Ironwood node pools ({topology} ok)."
    )
    capacity: str | None = option(
        "Capacity type of the node pools: on-demand, spot, reservation:NAME or flex-start (the node "
        "selector XPK renders for it)."
    )
