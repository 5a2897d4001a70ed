"""What `monitor` and `runs` say about a run of ingredients (supervise/ingredients.py): each
ingredient's row as `runs` makes it, and the soup."""

from __future__ import annotations

from typing import Any

from olmo_ctl import storage
from olmo_ctl.observe.monitor import StatusOf
from olmo_ctl.observe.runs import RunRow, run_row


def is_composite(path: str) -> bool:
    from olmo_ctl.supervise.ingredients import SPEC

    p = storage.join(path, SPEC)
    return storage.store_for(p).exists(p)


def _composite(path: str):
    from olmo_ctl.supervise.ingredients import Composite

    root, _, name = path.rstrip("/").rpartition("/")
    return Composite(root, name)


def report(path: str, status_of: StatusOf | None = None) -> dict[str, Any]:
    """{run, path, kind: ingredients, state, ingredients: [runs rows + name], soup: manifest | None}."""
    c = _composite(path)
    spec = c.spec()
    rows = []
    for ing, rd in zip(spec["ingredients"], c.runs(), strict=True):
        row = run_row(rd.path, status_of) if rd.exists() else None
        rows.append(
            {
                "name": ing.get("name"),
                "run": rd.name,
                "set": ing.get("set") or [],
                "step": row.step if row else 0,
                "final_step": row.final_step if row else None,
                "state": row.state if row else "not started",
                "last_loss": row.last_loss if row else None,
                "reason": row.reason if row else "",
            }
        )
    soup = c.souped()
    done = sum(r["state"] == "done" for r in rows)
    if soup is not None:
        state = "done"
    elif done == len(rows):
        state = "souping"
    else:
        current = next((r for r in rows if r["state"] != "done"), None)
        state = f"{done}/{len(rows)} ingredients done" + (
            f", {current['run']} {current['state']}" if current and current["state"] != "not started" else ""
        )
    return {
        "run": c.name,
        "path": c.dir.path,
        "kind": "ingredients",
        "recipe": (spec.get("recipe") or {}).get("name"),
        "start_from": spec.get("start_from"),
        "state": state,
        "ingredients": rows,
        "soup": {"path": c.soup_path, **soup} if soup is not None else None,
    }


def row(path: str, status_of: StatusOf | None = None) -> RunRow:
    """The `runs` line of a run of ingredients: its ingredients' steps summed, its state."""
    rep = report(path, status_of)
    recipe = _composite(path).recipe()
    rows = rep["ingredients"]
    final = sum(int(recipe.ingredient_recipe(k).train.max_steps) for k in range(len(rows)))
    last = next((r["last_loss"] for r in reversed(rows) if r["last_loss"] is not None), None)
    journal = _composite(path).dir.journal()
    return RunRow(
        rep["run"],
        rep["path"],
        int(recipe.stage) or None,
        _composite(path).spec().get("device"),
        sum(r["step"] for r in rows),
        final,
        rep["state"],
        last,
        journal[-1].get("time") if journal else _composite(path).spec().get("created"),
        f"{len(rows)} ingredients, souped" if rep["soup"] else f"{len(rows)} ingredients",
    )


def render_lines(rep: dict) -> list[str]:
    """The table `monitor` prints for a run of ingredients."""
    out = [f"{rep['run']}: run of {len(rep['ingredients'])} ingredients ({rep['recipe']}): {rep['state']}"]
    if rep["start_from"]:
        out.append(f"  start: {rep['start_from']}")
    for r in rep["ingredients"]:
        step = f"{r['step']}/{r['final_step']}" if r["final_step"] is not None else str(r["step"])
        loss = "-" if r["last_loss"] is None else f"{r['last_loss']:.4f}"
        out.append(
            f"  {r['run']:<24} {r['name'] or '':<12} {step:>15}  {r['state']:<12} loss {loss}  "
            + " ".join(r["set"])
        )
    s = rep["soup"]
    out.append(
        f"  soup: {s['path']} (mean of {len(s.get('sources', []))} checkpoints, {s.get('dtype')})"
        if s
        else "  soup: not yet (written when every ingredient's final step is committed)"
    )
    return out
