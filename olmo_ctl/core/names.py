"""Run names: what a user may call a run, the name a recipe gives one by default, and the names
`olmo-ctl smoke` gives its runs (which `olmo-ctl runs` hides unless asked).

A run name is a DNS-1035 label of at most 63 characters: it names the run directory, labels every
pod of every attempt, and starts the name of each attempt's JobSet (`olmo_ctl.backends.jobset`).
"""

from __future__ import annotations

import re

from olmo_ctl.core.errors import BadInput

MAX_RUN_NAME = 63  # a label value and a DNS-1035 label
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def validate_run_name(run: str) -> str:
    """A run name is a DNS-1035 label (it names the JobSet and labels every pod)."""
    hint = "use lowercase letters, digits and '-', starting with a letter, e.g. olmo3-7b-s1"
    if not isinstance(run, str) or not run:
        raise BadInput("the run name is empty", hint)
    if len(run) > MAX_RUN_NAME:
        raise BadInput(f"run name `{run[:20]}...` has {len(run)} characters, more than {MAX_RUN_NAME}", hint)
    if not DNS1035.match(run):
        raise BadInput(f"`{run}` is not a valid run name", hint)
    return run


def default_run_name(recipe) -> str:
    """The recipe's name made into a run name (`olmo3-7b-stage1`)."""
    name = re.sub(r"[^a-z0-9-]+", "-", recipe.name.lower()).strip("-")
    name = re.sub(r"-{2,}", "-", name)
    if not name or not name[0].isalpha():
        name = f"run-{name}".rstrip("-")
    return name[:MAX_RUN_NAME].rstrip("-")


# `olmo-ctl smoke`'s runs: smoke-DEVICE-MMDDHHMMSS-XXXX (UTC time, 4 random hex digits), and its
# uninterrupted twin, the same name + SMOKE_TWIN.
SMOKE_TWIN = "-twin"
SMOKE_RUN = re.compile(r"^smoke-[a-z0-9][-a-z0-9]*-[0-9]{10}-[0-9a-f]{4}(" + SMOKE_TWIN + ")?$")


def smoke_run_name(device: str, stamp: str, token: str) -> str:
    """The name of a run `olmo-ctl smoke` makes on `device` (`stamp`: MMDDHHMMSS, `token`: 4 hex digits)."""
    return f"smoke-{device}-{stamp}-{token}"


def is_smoke_run(name: str) -> bool:
    """Whether `name` is one `olmo-ctl smoke` gave a run (its twin's included)."""
    return bool(SMOKE_RUN.match(name))
