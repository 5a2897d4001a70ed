"""`olmo-ctl runs`: one row per run directory under a run root, read from the run directories only.

A row is what a person scanning their runs asks first: name, stage, device, committed step of the
final one, state, last loss, and when the run last changed. The state is the run's, in this order:

  done       the final step is committed
  new        run.yaml exists, no attempt was ever submitted
  gave up    the supervisor's last word after the newest submission was `gave_up` (a crash loop)
  otherwise  the newest attempt's state as `monitor` derives it (`observe.monitor`, one rule):
             queued / admitted / running (asking the backend while the journal says it may be live),
             preempted, failed, succeeded, stopped (`olmo-ctl stop`), ...

A queued or admitted attempt's row also says what holds it, in one line (`waiting`): the backend's
status already asked for its state (one bounded status call per run whose journal says its attempt
may be live; none with --no-backend-status, when the supervisor's journaled wait is all it says).

The last loss is the `done` line's, else the newest TensorBoard segments' last training loss
(`LOSS_TAG`; a few files, not the run's whole history). `updated` is the journal's newest line (else
run.yaml's `created`).

The runs `olmo-ctl smoke` leaves under a run root (named smoke-DEVICE-..., `core.names.is_smoke_run`)
are counted, not listed, unless asked for: they are checks of a device, not runs anyone follows.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass
from typing import Any

from olmo_ctl import storage
from olmo_ctl.core.errors import EXIT_BAD_INPUT, BadInput, OlmoCtlError
from olmo_ctl.core.names import is_smoke_run
from olmo_ctl.core.text import fit, table_lines
from olmo_ctl.observe.monitor import LOSS_TAG, StatusOf, live_attempt_of
from olmo_ctl.observe.reader import EventReader
from olmo_ctl.rundir import SPEC, Composite, RunDir, warn

NEWEST_SEGMENTS = 4  # event files read for the last loss


@dataclass
class RunRow:
    name: str
    path: str
    stage: int | None
    device: str | None
    step: int
    final_step: int | None
    state: str
    last_loss: float | None
    updated: str | None
    reason: str = ""  # what the state's journal line (or the backend) says
    smoke: bool = False  # a run `olmo-ctl smoke` made
    # what holds its queued or admitted attempt: {cause, kind, since, seconds, reason, line}, as
    # `monitor`'s attempt.waiting (`observe.monitor.waiting_now`, one rule); None when nothing does
    waiting: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunList:
    """The rows `olmo-ctl runs` shows, and how many smoke runs it left out."""

    rows: list[RunRow]
    smoke_hidden: int = 0


class _NewestSegments(EventReader):
    """An EventReader of the newest few event files only."""

    def _list(self) -> list:
        return super()._list()[-NEWEST_SEGMENTS:]


def run_paths(run_root: str) -> list[str]:
    """The run directories directly under `run_root` (those holding run.yaml or journal.jsonl), by name."""
    store = storage.store_for(run_root)
    if not storage.is_gcs(run_root) and not os.path.isdir(run_root):
        what = "is a file, not a directory" if os.path.exists(run_root) else "does not exist"
        raise BadInput(f"run root `{run_root}` {what}", "pass --run-root DIR or gs://BUCKET/PATH")
    _files, dirs = store.list(run_root)
    out = []
    for d in dirs:
        path = d.rstrip("/")
        if store.exists(storage.join(path, "run.yaml")) or store.exists(storage.join(path, "journal.jsonl")):
            out.append(path)
    return sorted(out, key=lambda p: p.rsplit("/", 1)[-1])


def _last_loss(rd: RunDir, journal: list[dict]) -> float | None:
    done = next((r for r in reversed(journal) if r.get("event") == "done" and r.get("loss")), None)
    if done is not None:
        try:
            return float(done["loss"])
        except (TypeError, ValueError):
            pass
    r = _NewestSegments(rd.p("tensorboard"))
    try:
        r.refresh()
    except (OlmoCtlError, OSError):
        return None
    s = r.series(LOSS_TAG)
    return float(s.values[-1]) if s is not None and len(s) else None


def run_row(path: str, status_of: StatusOf | None = None) -> RunRow:
    if is_composite(path):
        return composite_row(path, status_of)
    rd = RunDir(path)
    journal = rd.journal()
    committed = rd.committed_step()
    stage = final = None
    device: str | None = None
    created = None
    try:
        doc = rd.read_run()
        recipe = rd.recipe(pending=True)  # the final step as amended
        stage, final = int(recipe.stage), int(recipe.train.max_steps)
        device, created = doc.get("device"), doc.get("created")
    except BadInput as e:
        if rd.exists():  # a run.yaml this version cannot read: say so in the row, list the others
            return RunRow(
                rd.name, rd.path, None, None, committed, None, "unreadable", None, None, e.one_line()
            )
    subs = [i for i, r in enumerate(journal) if r.get("event") == "submitted"]
    last = journal[subs[-1]] if subs else {}
    if last.get("device"):
        device = str(last["device"])
        if int(last.get("slices") or 1) > 1:
            device = f"{last['slices']} x {device}"
    updated = journal[-1].get("time") if journal else created
    reason = ""
    waiting = None
    if final is not None and committed >= final:
        state = "done"
    elif not subs:
        state = "new"
    else:
        after = journal[subs[-1] + 1 :]
        gave_up = next((r for r in reversed(after) if r.get("event") == "gave_up"), None)
        if gave_up is not None:
            state, reason = "gave up", gave_up.get("reason") or ""
        else:
            live = live_attempt_of(rd.path, journal, status_of)
            state, reason = live.get("state") or "submitted", live.get("reason") or ""
            waiting = live.get("waiting")
    return RunRow(
        rd.name,
        rd.path,
        stage or None,
        device,
        committed,
        final,
        state,
        _last_loss(rd, journal),
        updated,
        reason,
        is_smoke_run(rd.name),
        waiting,
    )


def list_runs(run_root: str, status_of: StatusOf | None = None, *, smoke: bool = False) -> RunList:
    """A row per run under `run_root`, by name (`status_of`: ask the backend about live attempts);
    `olmo-ctl smoke`'s runs only counted unless `smoke` (their directories are not read then)."""
    paths = run_paths(run_root)
    shown = [p for p in paths if smoke or not is_smoke_run(p.rsplit("/", 1)[-1])]
    return RunList([_row_or_unreadable(p, status_of) for p in shown], len(paths) - len(shown))


def _row_or_unreadable(path: str, status_of: StatusOf | None) -> RunRow:
    """`run_row`, or for a run whose files cannot be read (bad input: a run.yaml, ingredients.yaml or
    journal edited by hand or torn) a row in state `unreadable`; either way one warning naming the file,
    and the other runs are listed."""
    try:
        row = run_row(path, status_of)
    except OlmoCtlError as e:
        if e.exit_code != EXIT_BAD_INPUT:  # unreachable storage is not one run's problem
            raise
        name = path.rstrip("/").rsplit("/", 1)[-1]
        row = RunRow(name, path, None, None, 0, None, "unreadable", None, None, e.one_line())
    if row.state == "unreadable":
        warn(f"run `{row.name}` is listed as unreadable: {row.reason}")
    return row


# ---------------------------------------------------------------- a run of ingredients (docs/ingredients.md)
# What `monitor` and `runs` say of one: each ingredient's row as `runs` makes it, and the soup.


def is_composite(path: str) -> bool:
    """Whether `path` is a run of ingredients (its ingredients.yaml)."""
    p = storage.join(path, SPEC)
    return storage.store_for(p).exists(p)


def _composite(path: str) -> Composite:
    root, _, name = path.rstrip("/").rpartition("/")
    return Composite(root, name)


@contextlib.contextmanager
def _reading_spec(c: Composite):
    """An ingredients.yaml whose entries are not what `create` writes (edited by hand): bad input naming it."""
    try:
        yield
    except (LookupError, TypeError, AttributeError, ValueError) as e:
        raise BadInput(
            f"`{c.spec_path}` is not a run of ingredients ({type(e).__name__}: {e})",
            "restore it from a backup; `resume-until-done --recipe` writes it",
        ) from None


def _a_list(x: Any) -> list:
    if not isinstance(x, list):
        raise TypeError(f"{x!r} is not a list")
    return x


def _souped(c: Composite) -> dict | None:
    try:
        soup = c.souped()
    except ValueError as e:  # torn or edited by hand
        raise BadInput(f"`{storage.join(c.soup_path, 'soup.json')}` is not a soup's manifest ({e})") from None
    if soup is not None and not isinstance(soup, dict):
        raise BadInput(f"`{storage.join(c.soup_path, 'soup.json')}` is not a soup's manifest (not an object)")
    return soup


def composite_report(path: str, status_of: StatusOf | None = None) -> dict[str, Any]:
    """{run, path, kind: ingredients, state, ingredients: [runs rows + name], soup: manifest | None}."""
    return _report(_composite(path), status_of)


def _report(c: Composite, status_of: StatusOf | None) -> dict[str, Any]:
    spec = c.spec()
    with _reading_spec(c):  # each entry {run, name, set: [KEY=VALUE]}, as `Composite.create` writes it
        listed = [
            (ing.get("name"), [str(x) for x in _a_list(ing.get("set") or [])], rd)
            for ing, rd in zip(spec["ingredients"], c.runs(), strict=True)
        ]
        recipe_name = (spec.get("recipe") or {}).get("name")
    rows = []
    for name, sets, rd in listed:
        row = run_row(rd.path, status_of) if rd.exists() else None
        rows.append(
            {
                "name": name,
                "run": rd.name,
                "set": sets,
                "step": row.step if row else 0,
                "final_step": row.final_step if row else None,
                "state": row.state if row else "not started",
                "last_loss": row.last_loss if row else None,
                "reason": row.reason if row else "",
            }
        )
    soup = _souped(c)
    done = sum(r["state"] == "done" for r in rows)
    if soup is not None:
        state = "done"
    elif done == len(rows):
        state = "souping"
    else:
        going = [r for r in rows if r["state"] not in ("done", "not started")]  # several with --concurrent
        state = f"{done}/{len(rows)} ingredients done" + "".join(f", {r['run']} {r['state']}" for r in going)
    return {
        "run": c.name,
        "path": c.dir.path,
        "kind": "ingredients",
        "recipe": recipe_name,
        "start_from": spec.get("start_from"),
        "state": state,
        "ingredients": rows,
        "soup": (
            {"path": c.soup_path, **{k: v for k, v in soup.items() if k != "recipe"}}
            if soup is not None
            else None
        ),
    }


def composite_row(path: str, status_of: StatusOf | None = None) -> RunRow:
    """The `runs` line of a run of ingredients: its ingredients' steps summed, its state."""
    c = _composite(path)
    rep = _report(c, status_of)
    recipe = c.recipe()
    rows = rep["ingredients"]
    with _reading_spec(c):
        final = sum(int(recipe.ingredient_recipe(k).train.max_steps) for k in range(len(rows)))
    last = next((r["last_loss"] for r in reversed(rows) if r["last_loss"] is not None), None)
    journal = c.dir.journal()
    return RunRow(
        rep["run"],
        rep["path"],
        int(recipe.stage) or None,
        c.spec().get("device"),
        sum(r["step"] for r in rows),
        final,
        rep["state"],
        last,
        journal[-1].get("time") if journal else c.spec().get("created"),
        f"{len(rows)} ingredients, souped" if rep["soup"] else f"{len(rows)} ingredients",
    )


def composite_lines(rep: dict, width: int | None = None) -> list[str]:
    """The table `monitor` prints for a run of ingredients, to `width` columns (None: no limit)."""
    out = fit(
        f"{rep['run']}: run of {len(rep['ingredients'])} ingredients ({rep['recipe']}): {rep['state']}", width
    )
    if rep["start_from"]:
        out += fit(f"  start: {rep['start_from']}", width)
    rows = []
    for r in rep["ingredients"]:
        step = f"{r['step']}/{r['final_step']}" if r["final_step"] is not None else str(r["step"])
        loss = "-" if r["last_loss"] is None else f"{r['last_loss']:.4f}"
        rows.append((r["run"], r["name"] or "", step, r["state"], f"loss {loss}", " ".join(r["set"])))
    # The ingredients' --set items are free text: they wrap in their cell, or go under their row.
    out += table_lines(None, rows, right={"2"}, flex=("5",), under="5", width=width, prefix="  ")
    s = rep["soup"]
    out += fit(
        f"  soup: {s['path']} (mean of {len(s.get('sources', []))} checkpoints, {s.get('dtype')})"
        if s
        else "  soup: not yet (written when every ingredient's final step is committed)",
        width,
    )
    return out
