"""Options and helpers shared by several commands: the site settings as flags, `note`, `_echo`.

The site settings a command line may set are declared by the backends (`backends/options.py`: each
backend's options dataclass, torchx's `runopts`); `SITE_OPTIONS` is generated from them and added to
a command by `@site_options`, which hands the command one `SiteFlags` object to resolve (XPK's
`add_shared_arguments` is the model): every command that renders an attempt takes the same options,
and none silently lacks one.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from olmo_ctl.backends import site_options as declared_site_options
from olmo_ctl.backends.options import ROLES, SiteOption

if TYPE_CHECKING:
    from olmo_ctl.core.config import Settings

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


def _flag(o: SiteOption) -> Any:
    return Annotated[str | None, typer.Option(o.flag, help=o.help)]


# Every site setting a command line may set, in the order `--help` lists them: generated from the
# backends' declarations (`backends/options.py`), each flag winning over OLMO_CTL_<NAME> and the
# config file.
DECLARED: dict[str, SiteOption] = {o.name: o for o in declared_site_options()}
SITE_OPTIONS: dict[str, Any] = {name: _flag(o) for name, o in DECLARED.items()}


@dataclass(frozen=True)
class SiteFlags:
    """The site settings given on one command line (a name missing or None: not given)."""

    given: dict[str, str | None] = field(default_factory=dict)

    def __getattr__(self, name: str) -> str | None:
        if name not in DECLARED:
            raise AttributeError(name)
        return self.given.get(name)

    def replace(self, **values: str | None) -> SiteFlags:
        return SiteFlags({**self.given, **values})

    def resolve(self) -> Settings:
        """Flags > OLMO_CTL_* environment > config file > defaults (`core.config.resolve_settings`)."""
        from olmo_ctl.backends import resolve_settings

        return resolve_settings(**{k: v for k, v in self.given.items() if v is not None})


F = TypeVar("F", bound=Callable[..., Any])


def site_options(*, roles: tuple[str, ...] = ROLES, exclude: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Add the site options of `roles` (less `exclude`) to a command whose function takes
    `site: SiteFlags`: `runs` (backend, run root), `cluster` (how to reach it), `render` (what an
    attempt is rendered with)."""
    names = [n for n, o in DECLARED.items() if o.role in roles and n not in exclude]

    def wrap(fn: F) -> F:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != "site"]
        added = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=SITE_OPTIONS[n])
            for n in names
        ]

        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            flags = SiteFlags({n: kwargs.pop(n, None) for n in names})
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
    """A remark for the person at the terminal; stderr, so stdout stays machine-readable. At a
    terminal (or with $COLUMNS) it is wrapped to its width (cli.app.output_width)."""
    from olmo_ctl.cli.app import output_width
    from olmo_ctl.core.text import fit

    sys.stderr.write("\n".join(fit(f"note: {text}", output_width(sys.stderr), 6)) + "\n")


TimeoutOpt = Annotated[
    float, typer.Option("--timeout", min=1, help="Give up (exit 124) after this many seconds.")
]


def _echo(text: str) -> None:
    sys.stderr.write(text + "\n")
