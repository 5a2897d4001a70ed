"""Options and helpers shared by several commands: the site settings as flags, `note`, `_echo`."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

# Site settings as flags (each wins over OLMO_CTL_<NAME> and the config file); shared with submit.
KubeContextOpt = Annotated[str | None, typer.Option("--kube-context", help="kubeconfig context.")]
NamespaceOpt = Annotated[str | None, typer.Option("--namespace", help="Kubernetes namespace.")]
QueueOpt = Annotated[str | None, typer.Option("--queue", help="Kueue LocalQueue name.")]
PriorityClassOpt = Annotated[str | None, typer.Option("--priority-class", help="Kueue WorkloadPriorityClass.")]
ImageOpt = Annotated[str | None, typer.Option("--image", help="Container image with olmo-ctl.")]
RunRootOpt = Annotated[str | None, typer.Option("--run-root", help="Where run directories live (gs://...).")]
ServiceAccountOpt = Annotated[
    str | None, typer.Option("--service-account", help="Kubernetes service account (Workload Identity).")
]
PlacementPolicyOpt = Annotated[
    str | None,
    typer.Option("--placement-policy", help="Placement policy of multi-host Ironwood node pools ({topology} ok)."),
]
AdmissionTimeoutOpt = Annotated[float | None, typer.Option(
    "--admission-timeout", min=1, help="Stop an attempt admitted by Kueue whose pods are not all running after this "
    "many seconds (pods refused, unschedulable) and count an infrastructure failure (default 1800; compile not "
    "included).")]
SlicesOpt = Annotated[int | None, typer.Option(
    "--slices", min=1, help="Slices of --device joined over the data-center network (multislice, tpu7x and v5p "
    "multi-host slices on GKE); the global batch is split over all of their devices. An existing run keeps its "
    "own (default 1 for a new run); another count is a resize.")]
BackendOpt = Annotated[str | None, typer.Option("--backend", help="gke or local.")]
# Passed to the trainer of every attempt (see docs/running-on-gke.md, "Versions").
AllowVersionChangeOpt = Annotated[bool, typer.Option(
    "--allow-version-change", help="Restore although the trainer's Orbax version differs from the run's "
    "(run.yaml `versions`) in a way its checkpoints may not read.")]


def note(text: str) -> None:
    """A remark for the person at the terminal; stderr, so stdout stays machine-readable."""
    sys.stderr.write(f"note: {text}\n")

TimeoutOpt = Annotated[float, typer.Option("--timeout", min=1, help="Give up (exit 124) after this many seconds.")]


def _echo(text: str) -> None:
    sys.stderr.write(text + "\n")
