"""`olmo-ctl config show`: the resolved site settings and where each came from."""

import sys

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, print_json
from olmo_ctl.cli.options import SiteFlags, note, site_options
from olmo_ctl.core.config import DESCRIPTIONS, config_path, setting_names

config_app = typer.Typer(
    help="Site settings: flags > OLMO_CTL_* environment > config file.", no_args_is_help=True
)
app.add_typer(config_app, name="config")


@config_app.command("show")
@site_options()
def config_show(
    output: OutputOpt = Output.table,
    *,
    site: SiteFlags,
) -> None:
    """Show the resolved site settings and where each value came from."""
    s = site.resolve()
    path = config_path()
    if output == Output.json:
        print_json(
            {
                "config_file": str(path),
                "config_file_exists": path.exists(),
                "settings": s.to_dict(),
                "sources": dict(s.sources),
                "descriptions": DESCRIPTIONS,
                "placeholders": s.placeholders(),
            }
        )
        return
    lines = [f"config file: {path}{'' if path.exists() else ' (not present)'}", ""]
    for name in setting_names():
        value = getattr(s, name)
        lines.append(f"{name:16}  {'-' if value is None else value}  ({s.sources[name]})")
    sys.stdout.write("\n".join(lines) + "\n")
    for name in s.placeholders():
        note(
            f"`{name}` is a placeholder: set --{name.replace('_', '-')}, OLMO_CTL_{name.upper()} or "
            f"`{name}:` in {path} before submitting"
        )
