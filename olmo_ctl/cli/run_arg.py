"""The RUN argument of the commands that act on one existing run (`logs`, `stop`): a run name under
the run root, or a run directory's path (local or gs://), and the backend that reaches its attempts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from olmo_ctl.cli.options import SiteFlags

if TYPE_CHECKING:
    from olmo_ctl.backends.base import Backend
    from olmo_ctl.core.config import Settings
    from olmo_ctl.rundir import RunDir

RunArg = Annotated[
    str,
    typer.Argument(metavar="RUN", help="Run name under the run root, or a run directory (local or gs://)."),
]


def open_run(run: str, site: SiteFlags) -> tuple[RunDir, Settings, Backend]:
    """The run directory, the site settings (the run's own where not chosen here) and its backend."""
    from olmo_ctl import storage
    from olmo_ctl.backends import existing_runs, make_backend
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.supervise.attempts import run_settings

    settings = existing_runs(site.resolve())
    if "/" in run:
        rundir = RunDir(run if storage.is_gcs(run) else _abspath(run))
        root = rundir.path.rsplit("/", 1)[0]
    else:
        rundir, root = RunDir.of(settings.run_root, run), settings.run_root
    if not rundir.exists():
        from olmo_ctl.core.errors import BadInput
        from olmo_ctl.rundir import Composite

        comp = Composite(root, rundir.name)
        if comp.exists():
            runs = ", ".join(rd.name for rd in comp.runs())
            raise BadInput(
                f"`{rundir.name}` is a run of ingredients ({runs}): this command takes one of them",
                f"e.g. {comp.runs()[0].name}; `olmo-ctl monitor` and `stop` take the whole",
            )
    rundir.read_run()  # a run that does not exist: one line, exit 2
    settings = run_settings(settings, rundir)
    return rundir, settings, make_backend(settings, root)


def _abspath(p: str) -> str:
    import os

    return os.path.abspath(p)
