"""Run names: what a user may call a run, and the name a recipe gives one by default.

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
