"""What `olmo-ctl amend` may change in a run, and what an amendment becomes once its first step is known.

A run keeps what makes it that run (the network, the data and its order, the seeds, the step shape,
the optimizer) for its whole life. From its next attempt on it may change how long it runs
(`train.max_steps`, the schedule continuing to the new horizon as core/schedule.py stitches it), how
often it checkpoints, what and how often it evaluates, how often it logs, and how the trainer guards
it. An amendment is recorded pending (rundir: run.yaml `amendments`) and bound when the run's next
attempt is submitted, to the step that attempt trains first: `from_step`, one after the committed step
it restores. Steps before it keep the recipe they were trained with, so a resume replays them exactly.
"""

from __future__ import annotations

from typing import Any

from olmo_ctl.core import schedule
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import Recipe, _override_keys, recipe_from_dict

# Keys an amendment may set, and sections all of whose keys it may set.
AMENDABLE = (
    "train.max_steps",
    "checkpoint.interval",
    "checkpoint.keep",
    "checkpoint.ephemeral_interval",
    "checkpoint.upload_hosts",
    "checkpoint.async_save",
    "data.eval",  # the held-out files of eval/lm_loss: evaluation
    "data.tokenizer",  # read by the evaluators only
)
AMENDABLE_SECTIONS = ("eval", "logging", "runtime")
# Keys that place the run on its devices: another device is `resize`; anything else a new run.
LAYOUT = (
    "train.mesh",
    "train.data_parallel",
    "train.seq_shards",
    "train.shard_group",
    "train.max_per_device_batch",
)
NEW_RUN = "start a new run for it (--run NAME)"


def amendable(key: str) -> bool:
    return key in AMENDABLE or key.split(".", 1)[0] in AMENDABLE_SECTIONS


def refusal(key: str) -> tuple[str, str]:
    """(what is wrong, what to do) for a key an amendment may not set."""
    section = key.split(".", 1)[0]
    if key in ("train.global_batch", "train.seq_len"):
        return (
            f"`{key}` is the run's step shape, which every attempt keeps",
            f"another device at the same batch is `olmo-ctl resize`; another {key.split('.')[1]} is a new run "
            "(--run NAME)",
        )
    if key in LAYOUT:
        return (
            f"`{key}` lays the run out on its device, fixed with it",
            f"to move the run use `olmo-ctl resize RUN --device ...`; otherwise {NEW_RUN}",
        )
    if section == "schedule":
        return (
            f"`{key}` would change the LR of a run under way",
            "amend train.max_steps: the schedule continues to the new horizon (docs/runs-logs-stop.md); "
            f"for another schedule {NEW_RUN}",
        )
    what = {
        "model": "the network",
        "data": "what the run reads and in which order",
        "optimizer": "the optimizer",
        "train": "the run's training" if key != "train.seed" else "the run's seed",
    }.get(section, "what the run is")
    return f"`{key}` is {what}: another value makes another run", NEW_RUN


def _get(d: dict, key: str) -> Any:
    for part in key.split("."):
        d = d[part]
    return d


def _set(d: dict, key: str, value: Any) -> None:
    *path, last = key.split(".")
    for part in path:
        d = d.setdefault(part, {})
    d[last] = value


def changes(recipe: Recipe, sets: list[str] | tuple[str, ...], committed_step: int) -> list[dict]:
    """[{key, old, new}] that `--set` items make to the run's `recipe`, once `committed_step` steps are
    committed; BadInput (naming the --set) for a value the recipe refuses, a key no amendment may set, a
    value it already has, or a final step that is not after the committed one."""
    if not sets:
        raise BadInput(
            "amend needs at least one --set KEY=VALUE", "for example --set train.max_steps=2000000"
        )
    given: dict[str, str] = {}
    for item in sets:  # an amendment records one value per key: a key given twice is ambiguous
        key = ".".join(p for p in item.partition("=")[0].strip().split(".") if p)
        if key in given:
            raise BadInput(f"--set {key} is given twice ({given[key]}, {item})", "give each key once")
        given[key] = item
    src = recipe.source or "run.yaml"
    new = recipe_from_dict(recipe.to_dict(), src, sets)  # unknown keys and bad values, said of the --set
    old_d, new_d = recipe.to_dict(), new.to_dict()
    out = []
    for key, item in _override_keys(sets):
        if not amendable(key):
            why, hint = refusal(key)
            raise BadInput(f"--set {item}: {why}", hint)
        old, value = _get(old_d, key), _get(new_d, key)
        if old == value:
            raise BadInput(f"--set {item}: the run already has {key} = {old}", "give a value that differs")
        out.append({"key": key, "old": old, "new": value})
    final = new.train.max_steps
    if any(c["key"] == "train.max_steps" for c in out) and final <= committed_step:
        raise BadInput(
            f"--set train.max_steps={final}: the run has committed step {committed_step}; its final step "
            "must come after it",
            "give a larger train.max_steps",
        )
    return out


def bind(recipe: Recipe, change_list: list[dict], from_step: int) -> dict:
    """The values an amendment sets when its first step is `from_step` ({dotted key: value}): its own,
    and for a new `train.max_steps` the schedule continued from there (core/schedule.continue_horizon)."""
    values = {c["key"]: c["new"] for c in change_list}
    if "train.max_steps" in values:
        sched = schedule.continue_horizon(
            recipe.schedule, recipe.train.max_steps, int(values["train.max_steps"]), from_step - 1
        )
        if sched is not None:
            values["schedule"] = sched
    return values


def apply(recipe: Recipe, values: dict) -> Recipe:
    """`recipe` with an amendment's bound values set, validated."""
    raw = recipe.to_dict()
    for key, value in values.items():
        _set(raw, key, value)
    return recipe_from_dict(raw, recipe.source or "run.yaml")
