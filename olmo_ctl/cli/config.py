"""`olmo-ctl config show` and `config init`: the resolved site settings, and a commented site file."""

import os
import sys
import tempfile
from typing import Annotated

import typer

from olmo_ctl.backends import placeholders
from olmo_ctl.cli.app import OlmoTyper, Output, OutputOpt, app, output_width, print_data
from olmo_ctl.cli.options import SiteFlags, note, site_options
from olmo_ctl.core.config import DESCRIPTIONS, Settings, config_path, mask_url, setting_names
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.mixes import AI2_DATA_ROOT, DATA_ROOT_HINT
from olmo_ctl.core.text import wrap

config_app = OlmoTyper(help="Site settings: flags > OLMO_CTL_* environment > config file > defaults.")
app.add_typer(config_app, name="config", example="olmo-ctl config show -o json")


def _settings(s: Settings) -> dict:
    """The settings as `config show` prints them: the webhook URL masked (its path, query or password
    is its secret)."""
    out = s.to_dict()
    if out.get("notify_webhook"):
        out["notify_webhook"] = mask_url(out["notify_webhook"])
    return out


def _shown(name: str, value) -> str:
    if name == "prices":
        return (
            "; ".join(
                f"{gen} " + ", ".join(f"{kind} ${usd:g}" for kind, usd in kinds.items())
                for gen, kinds in value.items()
            )
            + " per chip-hour"
            if value
            else "-"
        )
    if value is None or value in ({}, []):
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(
            item if isinstance(item, str) else " ".join(f"{k}={v}" for k, v in item.items()) for item in value
        )
    return str(value)


@config_app.command("show", example="olmo-ctl config show -o json")
@site_options()
def config_show(
    output: OutputOpt = Output.table,
    *,
    site: SiteFlags,
) -> None:
    """Show the resolved site settings and where each value came from.

    Exit codes: 0 shown, 2 a malformed config file or setting.
    """
    s = site.resolve()
    path = config_path()
    if output != Output.table:
        print_data(
            {
                "config_file": str(path),
                "config_file_exists": path.exists(),
                "settings": _settings(s),
                "sources": dict(s.sources),
                "descriptions": DESCRIPTIONS,
                "placeholders": placeholders(s),
            },
            output,
        )
        return
    columns = output_width()
    lines = [*wrap(f"config file: {path}{'' if path.exists() else ' (not present)'}", columns), ""]
    width = max(len(n) for n in setting_names())
    shown = _settings(s)
    for name in setting_names():  # a long value wraps under itself
        lines += wrap(f"{name:{width}}  {_shown(name, shown[name])}  ({s.sources[name]})", columns, width + 2)
    sys.stdout.write("\n".join(lines) + "\n")
    for name in placeholders(s):
        note(
            f"`{name}` is a placeholder: set --{name.replace('_', '-')}, OLMO_CTL_{name.upper()} or "
            f"`{name}:` in {path} before submitting"
        )
    note(DATA_NOTE)


# Where a run's data comes from is the recipe's (`data.root`), not a site setting: said beside them.
DATA_NOTE = (
    f"the shipped recipes read their data from {AI2_DATA_ROOT} (data.root), AI2's bucket; to read your own "
    f"copy pass {DATA_ROOT_HINT} to submit or resume-until-done"
)


def _comment(text: str) -> list[str]:
    import textwrap

    return textwrap.wrap(text, 98, initial_indent="# ", subsequent_indent="# ")


def site_file_text() -> str:
    """A config file that sets nothing: every setting commented out at its default, with what it is.
    Uncommenting a line sets it; `config show` reads the file as it is."""
    import yaml

    defaults = Settings()
    out = [
        "# olmo-ctl site settings (written by `olmo-ctl config init`).",
        "# Each setting is taken from a flag (--namespace ...), else the environment",
        "# (OLMO_CTL_NAMESPACE=...), else this file, else the default shown here. Uncomment a line to",
        "# set it; `olmo-ctl config show` prints what every setting resolves to and where it came from.",
        "# Before the first submit to GKE set at least run_root and image (they hold placeholders).",
        "",
        "# Data is the recipe's, not a site setting: the shipped recipes read their data mixes from AI2's",
        f"# bucket, {AI2_DATA_ROOT} (data.root). To read your own copy, pass to submit or resume-until-done",
        f"# {DATA_ROOT_HINT}.",
        "",
    ]
    for name in setting_names():
        if name == "prices":
            continue
        value = getattr(defaults, name)
        shown = "" if value is None else yaml.safe_dump(value, default_flow_style=True).strip()
        shown = shown.removesuffix("\n...").removesuffix(" ...")
        out += [*_comment(DESCRIPTIONS[name]), f"# {name}: {shown}".rstrip(), ""]
    out += [
        *_comment(DESCRIPTIONS["prices"] + "."),
        "# olmo-ctl knows no prices: take yours from your agreement or the TPU pricing page. The numbers",
        "# below are placeholders to replace, not Google's prices.",
        "# prices:",
        "#   tpu7x: {on_demand: 0.00, spot: 0.00}",
        "#   v5p: {on_demand: 0.00, spot: 0.00}",
    ]
    return "\n".join(out) + "\n"


@config_app.command("init", example="olmo-ctl config init")
def config_init(
    force: Annotated[bool, typer.Option("--force", help="Replace an existing config file.")] = False,
) -> None:
    """Write a commented site file: every setting, what it is and its default, all commented out.

    It goes to $XDG_CONFIG_HOME/olmo-ctl/config.yaml (default ~/.config/olmo-ctl/config.yaml), where
    every command reads it. An existing file is kept unless --force.
    Exit codes: 0 written, 2 the file exists (pass --force to replace it) or cannot be written.
    """
    path = config_path()
    if path.exists() and not force:
        raise BadInput(
            f"config file `{path}` exists", "edit it, or pass --force to replace it with a commented one"
        )
    if path.is_dir():
        raise BadInput(f"`{path}` is a directory", "remove it, then run `olmo-ctl config init` again")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".config-", suffix=".yaml", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(site_file_text())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)  # never a half-written config file
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        raise BadInput(f"cannot write config file `{path}`: {e.strerror}") from None
    typer.echo(f"wrote {path}")
    typer.echo("next: uncomment and set run_root and image, then check with")
    typer.echo("  olmo-ctl config show")
    note(DATA_NOTE)
