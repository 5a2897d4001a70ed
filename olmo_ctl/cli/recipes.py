"""`olmo-ctl recipes`: the shipped recipes, one line each."""

import sys

from olmo_ctl.cli.app import Output, OutputOpt, app, output_width, print_data
from olmo_ctl.core.batching import param_count
from olmo_ctl.core.recipe import DEFAULT_MODEL, MODEL_STAGE_RECIPES, load_recipe, shipped_recipes
from olmo_ctl.core.text import table_lines


def _tokens(n: int) -> str:
    for div, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{suf}"
    return str(n)


def recipe_rows() -> list[dict]:
    """Every shipped recipe (recipes/*.yaml), resolved: what `--recipe NAME` and `[--model M] --stage N` run."""
    by_stage = {
        name: f"--stage {stage}" if model == DEFAULT_MODEL else f"--model {model} --stage {stage}"
        for model, stages in MODEL_STAGE_RECIPES.items()
        for stage, name in stages.items()
    }
    rows = []
    for name in shipped_recipes():
        r = load_recipe(name)
        t = r.train
        subs = [r.ingredient_recipe(k) for k in range(len(r.ingredients))]
        parts: list[dict] = [
            {
                "name": ing.name or f"i{k + 1}",
                "max_steps": s.train.max_steps,
                "tokens": s.train.max_steps * s.train.global_batch * s.train.seq_len,
            }
            for k, (ing, s) in enumerate(zip(r.ingredients, subs, strict=True))
        ]
        rows.append(
            {
                "name": r.name,
                "stage": r.stage,
                "stage_option": by_stage.get(name),
                "model": r.model.name,
                "params": param_count(r.model),
                "seq_len": t.seq_len,
                "global_batch": t.global_batch,
                "max_steps": t.max_steps,
                "tokens": t.max_steps * t.global_batch * t.seq_len,
                "description": r.description,
                "file": r.source,
                # A stage of ingredients trains each (its own steps and tokens); `tokens` above is the
                # recipe's own, `total_tokens` what all of them read.
                "ingredients": parts,
                "total_tokens": sum(int(p["tokens"]) for p in parts)
                if parts
                else t.max_steps * t.global_batch * t.seq_len,
            }
        )
    return rows


@app.command(example="olmo-ctl recipes -o json")
def recipes(output: OutputOpt = Output.table) -> None:
    """List the shipped recipes: stage, model, sequence length, global batch, steps and tokens.

    Each is what `--recipe NAME` loads (`--stage 1|2|3` names the OLMo 3 7B stage's own,
    `--model olmo2-32b|olmo3-32b --stage N` the 32B's); docs/recipes.md gives where every value comes
    from. A stage of ingredients shows each ingredient's steps (`11,921+11,921+35,763`) and the tokens
    of all of them. Exit codes: 0.
    """
    rows = recipe_rows()
    if output != Output.table:
        print_data(rows, output)
        return
    cols = ("NAME", "STAGE", "PARAMS", "SEQ", "BATCH", "STEPS", "TOKENS", "DESCRIPTION")
    table = [
        (
            r["name"],
            str(r["stage"] or "-"),
            _tokens(r["params"]),
            f"{r['seq_len']:,}",
            str(r["global_batch"]),
            "+".join(f"{p['max_steps']:,}" for p in r["ingredients"]) or f"{r['max_steps']:,}",
            _tokens(r["total_tokens"]),
            r["description"],
        )
        for r in rows
    ]
    sys.stdout.write(
        "\n".join(
            table_lines(
                cols,
                table,
                right={"PARAMS", "SEQ", "BATCH", "STEPS", "TOKENS"},
                flex=("DESCRIPTION",),
                under="DESCRIPTION",  # in a narrow terminal, under its recipe's line
                width=output_width(),
            )
        )
        + "\n"
    )
