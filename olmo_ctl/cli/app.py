"""The Typer application object and the helpers every command module shares.

Command modules (`olmo_ctl/cli/*.py`) register on `app`; `olmo_ctl/cli/__init__.py` imports them.
Commands parse, call one operation, print, and map errors to exit codes; no logic lives here.
"""

import json
import sys
from enum import Enum
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

# `--help` lists commands in the order a user meets them, not alphabetically.
COMMAND_ORDER = (
    "devices",
    "plan",
    "config",
    "doctor",
    "submit",
    "resume-until-done",
    "monitor",
    "compare",
    "resize",
    "smoke",
    "preflight",
    "data",
    "convert",
    "parity",
    "surgery",
    "sandbox",
)


class _OrderedGroup(TyperGroup):
    def list_commands(self, ctx):
        rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
        return sorted(super().list_commands(ctx), key=lambda n: (rank.get(n, len(rank)), n))

    def invoke(self, ctx):
        # Typer turns a Ctrl-C it sees into a silent exit 130; a command that did not handle it still
        # says so in one line (core.errors.Interrupted).
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            from olmo_ctl.core.errors import Interrupted

            raise Interrupted() from None


app = typer.Typer(
    cls=_OrderedGroup,
    name="olmo-ctl",
    help="Run OLMo 3 7B stage 1/2 on TPU slices (GKE, JobSet, Kueue) or on this machine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _root() -> None:
    """Run OLMo 3 7B stage 1/2 on TPU slices (GKE, JobSet, Kueue) or on this machine."""


class Output(str, Enum):
    table = "table"
    json = "json"


class ManifestOutput(str, Enum):
    yaml = "yaml"
    json = "json"


# Options shared by every command that takes a recipe.
StageOpt = Annotated[
    int | None,
    typer.Option("--stage", help="OLMo 3 stage: 1 (pre-training), 2 (mid-training) or 3 (long context)."),
]
RecipeOpt = Annotated[
    str | None, typer.Option("--recipe", help="Recipe file or name from recipes/ (e.g. smoke).")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a recipe value: --set key.sub=value (repeatable)."),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="Device type, e.g. tpu7x-128, v5p-256, cpu-4.")]
OutputOpt = Annotated[Output, typer.Option("--output", "-o", help="table or json.")]


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def console():
    from rich.console import Console

    return Console()
