"""Options and helpers shared by several commands: the site settings as flags, `note`, `_echo`.

The site settings are declared once (`SITE_OPTIONS`) and added to a command by `@site_options`,
which hands the command one `SiteFlags` object to resolve (XPK's `add_shared_arguments` is the
model): every command that renders an attempt takes the same options, and none silently lacks one.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

if TYPE_CHECKING:
    from olmo_ctl.core.config import Settings

# Site settings as flags (each wins over OLMO_CTL_<NAME> and the config file); shared with submit.
KubeContextOpt = Annotated[str | None, typer.Option("--kube-context", help="kubeconfig context.")]
NamespaceOpt = Annotated[str | None, typer.Option("--namespace", help="Kubernetes namespace.")]
QueueOpt = Annotated[str | None, typer.Option("--queue", help="Kueue LocalQueue name.")]
PriorityClassOpt = Annotated[
    str | None, typer.Option("--priority-class", help="Kueue WorkloadPriorityClass.")
]
ImageOpt = Annotated[str | None, typer.Option("--image", help="Container image with olmo-ctl.")]
RunRootOpt = Annotated[str | None, typer.Option("--run-root", help="Where run directories live (gs://...).")]
ServiceAccountOpt = Annotated[
    str | None, typer.Option("--service-account", help="Kubernetes service account (Workload Identity).")
]
PlacementPolicyOpt = Annotated[
    str | None,
    typer.Option(
        "--placement-policy", help="Placement policy of multi-host Ironwood node pools ({topology} ok)."
    ),
]
CapacityOpt = Annotated[
    str | None,
    typer.Option(
        "--capacity",
        help="Capacity type of the node pools: on-demand, spot, reservation:NAME or flex-start (the node "
        "selector XPK renders for it).",
    ),
]
AdmissionTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--admission-timeout",
        min=1,
        help="Stop an attempt admitted by Kueue whose pods are not all running after this "
        "many seconds (pods refused, unschedulable) and count an infrastructure failure (default 1800; compile not "
        "included).",
    ),
]
SlicesOpt = Annotated[
    int | None,
    typer.Option(
        "--slices",
        min=1,
        help="Slices of --device joined over the data-center network (multislice, tpu7x and v5p "
        "multi-host slices on GKE); the global batch is split over all of their devices. An existing run keeps its "
        "own (default 1 for a new run); another count is a resize.",
    ),
]
BackendOpt = Annotated[str | None, typer.Option("--backend", help="gke or local.")]

# Every site setting a command line may set, in the order `--help` lists them.
SITE_OPTIONS: dict[str, Any] = {
    "backend": BackendOpt,
    "run_root": RunRootOpt,
    "kube_context": KubeContextOpt,
    "namespace": NamespaceOpt,
    "queue": QueueOpt,
    "priority_class": PriorityClassOpt,
    "image": ImageOpt,
    "service_account": ServiceAccountOpt,
    "placement_policy": PlacementPolicyOpt,
    "capacity": CapacityOpt,
}


@dataclass(frozen=True)
class SiteFlags:
    """The site settings given on one command line (None: not given)."""

    backend: str | None = None
    run_root: str | None = None
    kube_context: str | None = None
    namespace: str | None = None
    queue: str | None = None
    priority_class: str | None = None
    image: str | None = None
    service_account: str | None = None
    placement_policy: str | None = None
    capacity: str | None = None

    def resolve(self) -> Settings:
        """Flags > OLMO_CTL_* environment > config file > defaults (`core.config.resolve_settings`)."""
        from olmo_ctl.backends import resolve_settings

        return resolve_settings(**{f.name: getattr(self, f.name) for f in fields(self)})


F = TypeVar("F", bound=Callable[..., Any])


def site_options(*, exclude: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Add the site options (less `exclude`) to a command whose function takes `site: SiteFlags`."""
    names = [n for n in SITE_OPTIONS if n not in exclude]

    def wrap(fn: F) -> F:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != "site"]
        added = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=SITE_OPTIONS[n])
            for n in names
        ]

        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            flags = SiteFlags(**{n: kwargs.pop(n, None) for n in names})
            return fn(*args, site=flags, **kwargs)

        command.__signature__ = sig.replace(parameters=own + added)  # type: ignore[attr-defined]
        command.__annotations__ = {
            **{p.name: p.annotation for p in own},
            **{n: SITE_OPTIONS[n] for n in names},
        }
        return command  # type: ignore[return-value]

    return wrap


# Passed to the trainer of every attempt (see docs/running-on-gke.md, "Versions").
AllowVersionChangeOpt = Annotated[
    bool,
    typer.Option(
        "--allow-version-change",
        help="Restore although the trainer's Orbax version differs from the run's "
        "(run.yaml `versions`) in a way its checkpoints may not read.",
    ),
]


def note(text: str) -> None:
    """A remark for the person at the terminal; stderr, so stdout stays machine-readable."""
    sys.stderr.write(f"note: {text}\n")


TimeoutOpt = Annotated[
    float, typer.Option("--timeout", min=1, help="Give up (exit 124) after this many seconds.")
]


def _echo(text: str) -> None:
    sys.stderr.write(text + "\n")
