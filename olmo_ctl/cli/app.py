"""The Typer application object and the helpers every command module shares.

Command modules (`olmo_ctl/cli/*.py`) register on `app`; `olmo_ctl/cli/__init__.py` imports the one a
command line names (`COMMAND_MODULES`), or all of them for the top-level help.
Commands parse, call one operation, print, and map errors to exit codes; no logic lives here.

What every command has without asking for it is declared here once: `-h` as well as `--help`, one
example at the end of its `--help` (`@app.command(example=...)`), argument names written one way
(`RUN`, `[RUN]`, `FILES...`), and in the top-level `--help` each command's whole first sentence.
"""

import json
import os
import sys
from enum import Enum
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

import olmo_ctl
from olmo_ctl.core.recipe import DEFAULT_MODEL, MODEL_STAGE_RECIPES

# `--help` lists commands in the order a user meets them, not alphabetically.
COMMAND_ORDER = (
    "devices",
    "recipes",
    "plan",
    "config",
    "doctor",
    "submit",
    "resume-until-done",
    "runs",
    "logs",
    "stop",
    "monitor",
    "compare",
    "resize",
    "amend",
    "smoke",
    "preflight",
    "data",
    "convert",
    "parity",
    "eval",
    "verify",
    "generate",
    "surgery",
    "sandbox",
)

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}


def _argument_name(param: Any) -> str:
    """An argument as usage lines and the Arguments section write it: RUN, [RUN], FILES..."""
    name = (param.metavar or param.name or "").upper()
    if param.nargs != 1:
        name += "..."
    return name if param.required else f"[{name}]"


def _format_params(cmd: Any, ctx: Any, formatter: Any) -> None:
    args, opts = [], []
    for param in cmd.get_params(ctx):
        if param.param_type_name == "argument":
            if not getattr(param, "hidden", False):
                args.append((_argument_name(param).strip("[]"), param.help or ""))
        else:
            rv = param.get_help_record(ctx)
            if rv is not None:
                opts.append(rv)
    if args:
        with formatter.section("Arguments"):
            formatter.write_dl(args)
    if opts:
        with formatter.section("Options"):
            formatter.write_dl(opts)


def _format_example(cmd: Any, formatter: Any) -> None:
    if cmd.epilog:
        formatter.write_paragraph()
        formatter.write_text("Example:")
        with formatter.indentation():
            for line in cmd.epilog.splitlines():
                formatter.write(f"{'':>{formatter.current_indent}}{line}\n")


class OlmoCommand(TyperCommand):
    """A command whose usage line and Arguments section write argument names one way, and whose
    epilog is its example, printed as written (never rewrapped)."""

    def collect_usage_pieces(self, ctx):
        rv = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                rv.append(_argument_name(param))
            else:
                rv.extend(param.get_usage_pieces(ctx))
        return rv

    def format_options(self, ctx, formatter) -> None:
        _format_params(self, ctx, formatter)

    def format_epilog(self, ctx, formatter) -> None:
        _format_example(self, formatter)


class OlmoGroup(TyperGroup):
    """A command group: commands in COMMAND_ORDER, each listed with its whole first sentence."""

    def list_commands(self, ctx):
        rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
        return sorted(super().list_commands(ctx), key=lambda n: (rank.get(n, len(rank)), n))

    def format_commands(self, ctx, formatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                # No limit: the first sentence whole (write_dl wraps it), never cut with "...".
                rows.append((name, cmd.get_short_help_str(limit=10_000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def invoke(self, ctx):
        # Typer turns a Ctrl-C it sees into a silent exit 130; a command that did not handle it still
        # says so in one line (core.errors.Interrupted).
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            from olmo_ctl.core.errors import Interrupted

            raise Interrupted() from None

    def format_options(self, ctx, formatter) -> None:
        _format_params(self, ctx, formatter)
        self.format_commands(ctx, formatter)

    def format_epilog(self, ctx, formatter) -> None:
        _format_example(self, formatter)

    def resolve_command(self, ctx, args):
        name = args[0] if args else ""
        if name and self.get_command(ctx, name) is None and f"--{name}" in self._option_names(ctx):
            ctx.fail(f"No such command '{name}'. Did you mean '--{name}'?")  # `olmo-ctl version`
        return super().resolve_command(ctx, args)

    def _option_names(self, ctx) -> set[str]:
        return {o for p in self.get_params(ctx) for o in (*p.opts, *p.secondary_opts)}


class OlmoTyper(typer.Typer):
    """typer.Typer whose commands are OlmoCommands and take `example=`: the one example their
    `--help` ends with (as README.md lists them)."""

    def __init__(self, **kw: Any):
        kw.setdefault("cls", OlmoGroup)
        kw.setdefault("context_settings", CONTEXT_SETTINGS)
        kw.setdefault("no_args_is_help", True)
        kw.setdefault("rich_markup_mode", None)
        kw.setdefault("pretty_exceptions_enable", False)
        kw.setdefault("add_completion", False)
        super().__init__(**kw)

    def command(self, name: str | None = None, *, example: str | None = None, **kw: Any):
        kw.setdefault("cls", OlmoCommand)
        kw.setdefault("context_settings", CONTEXT_SETTINGS)
        if example is not None:
            kw["epilog"] = example
        return super().command(name, **kw)

    def add_typer(self, typer_instance: typer.Typer, *, example: str | None = None, **kw: Any) -> None:
        if example is not None:
            kw["epilog"] = example
        super().add_typer(typer_instance, **kw)


app = OlmoTyper(
    name="olmo-ctl",
    add_completion=True,  # --install-completion, --show-completion (bash, zsh, fish, powershell)
)


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"olmo-ctl {olmo_ctl.__version__}\n")
        raise typer.Exit(0)


def _models() -> str:
    """The models `--model` names, as the top-level help says them: `OLMo 3 7B, OLMo 2 32B and OLMo 3
    32B` (from MODEL_STAGE_RECIPES, so a model added there is said here)."""
    names = [
        f"OLMo {m.removeprefix('olmo')[0]} {m.rpartition('-')[2].upper()}"
        if m.startswith("olmo") and "-" in m
        else m
        for m in MODEL_STAGE_RECIPES
    ]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


ROOT_HELP = (
    f"Run {_models()} pre-training, mid-training and long-context extension (their stages 1-3) on TPU "
    "slices or GPU nodes (GKE, JobSet, Kueue), or on this machine (the local backend).\n\n"
    "`olmo-ctl COMMAND -h` gives each command's options, exit codes and one example."
)


@app.callback(epilog="olmo-ctl plan --stage 1 --device tpu7x-128", help=ROOT_HELP)
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_version, help="Print the version and exit."),
    ] = False,
) -> None:
    """The top-level help is ROOT_HELP."""


class Output(str, Enum):
    table = "table"
    json = "json"
    yaml = "yaml"


class ManifestOutput(str, Enum):
    yaml = "yaml"
    json = "json"


# Options shared by every command that takes a recipe.
StageOpt = Annotated[
    int | None,
    typer.Option(
        "--stage",
        help="Stage of --model (OLMo 3 7B unless given): 1 (pre-training), 2 (mid-training) or 3 (long context).",
    ),
]
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="Whose stage --stage names: "
        + ", ".join(
            f"{m} (stages {', '.join(map(str, stages))}{'; the default' if m == DEFAULT_MODEL else ''})"
            for m, stages in MODEL_STAGE_RECIPES.items()
        )
        + ".",
    ),
]
RecipeOpt = Annotated[
    str | None, typer.Option("--recipe", help="Recipe file or name from recipes/ (e.g. smoke).")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a recipe value: --set key.sub=value (repeatable)."),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="Device type, e.g. tpu7x-128, v5p-256, cpu-4.")]
OutputOpt = Annotated[Output, typer.Option("--output", "-o", help="table, json or yaml.")]


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def print_yaml(obj: Any) -> None:
    import yaml

    plain = json.loads(json.dumps(obj, default=str))  # the same values -o json prints
    sys.stdout.write(yaml.safe_dump(plain, sort_keys=False, allow_unicode=True, default_flow_style=False))


def print_data(obj: Any, output: Output) -> None:
    """A report as -o json or -o yaml print it (the table is each command's own)."""
    (print_yaml if output == Output.yaml else print_json)(obj)


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 device`, `4 devices`."""
    return f"{n} {word if n == 1 else many or word + 's'}"


# ---------------------------------------------------------------- the width of human output
# One rule for every table, list and note a person reads: it fits `output_width()` columns, laid out
# by core/text.py (broken at spaces only: a word longer than the width, a path or a URL, is kept
# whole; copied, it still works). JSON and YAML are never wrapped; rich renderables (`console()`)
# follow the same rule at a terminal.

MIN_WIDTH = 40  # a narrower terminal gets 40-column lines rather than one word a line


def output_width(stream: Any = None) -> int | None:
    """The columns human output on `stream` (default stdout) fits in: $COLUMNS when set, else the
    terminal's width when `stream` is a terminal; None (lines never broken) for a pipe or a file."""
    env = os.environ.get("COLUMNS", "").strip()
    if env.isdigit() and int(env) > 0:
        return max(int(env), MIN_WIDTH)
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():
            return max(os.get_terminal_size(stream.fileno()).columns, MIN_WIDTH)
    except (AttributeError, ValueError, OSError):
        pass
    return None


def console():
    """A rich Console: it reads $COLUMNS, else the terminal's width (again at each refresh of
    `monitor --watch`), as `output_width` does; piped, rich lays out 80 columns."""
    from rich.console import Console

    return Console()
