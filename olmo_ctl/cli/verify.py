"""`olmo-ctl verify RUN --reference REF`: the landmark table of a reproduction against its reference."""

import math
import os
from typing import Annotated

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, print_data
from olmo_ctl.cli.evaluate import SuiteOpt
from olmo_ctl.cli.options import note


def _steps(text: str | None) -> list[int] | None:
    from olmo_ctl.core.errors import BadInput

    if not text:
        return None
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise BadInput(
            f"--steps {text!r} is not a list of step numbers", "e.g. --steps 10000,20000"
        ) from None


def _plain(x):
    """NaN (no accuracy task, say) as null in -o json."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x


def _path(p: str) -> str:
    from olmo_ctl import storage

    return p if storage.is_gcs(p) or p.startswith("hf:") else os.path.abspath(p)


@app.command(
    example="olmo-ctl verify gs://b/runs/olmo3-7b-s1 --reference gs://b/ai2-reference --device cpu-8"
)
def verify(
    run: Annotated[str, typer.Argument(metavar="RUN", help="The run directory (local or gs://).")],
    reference: Annotated[
        str,
        typer.Option(
            "--reference",
            help="Another run directory, a directory of checkpoints named by step (stage1-step10000, ...), "
            "or hf:ORG/NAME[@REVISION,...]: revisions of a Hugging Face repository in its local cache.",
        ),
    ],
    steps: Annotated[
        str | None, typer.Option("--steps", help="Landmark steps N,N,... (default: every step both have).")
    ] = None,
    tasks: Annotated[
        str | None,
        typer.Option(
            "--tasks", help="Downstream tasks LABEL,... or olmo3 (default: the run's eval.downstream)."
        ),
    ] = None,
    suite: SuiteOpt = None,
    lm: Annotated[
        str | None,
        typer.Option("--lm", help="LM sets: MIX, LABEL=PATH,... or none (default: the run's eval.lm)."),
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="Only each task's first N documents (0: all).")] = 0,
    kl_tokens: Annotated[
        int, typer.Option("--kl-tokens", help="Held-out tokens of the KL (0: no KL).")
    ] = 8192,
    lm_tolerance: Annotated[
        float | None,
        typer.Option(
            "--lm-tolerance",
            help="|Δ held-out loss| (nats) above which it moved (default: --sigmas σ of each domain, "
            "from both sides' per-document variance).",
        ),
    ] = None,
    sigmas: Annotated[
        float,
        typer.Option(
            "--sigmas",
            help="A Δ beyond this many σ is outside its band (held-out loss, macro accuracy, each task).",
        ),
    ] = 2.0,
    kl_tolerance: Annotated[
        float | None,
        typer.Option(
            "--kl-tolerance",
            help="Mean KL (nats/token) above which it moved (default 0.5: two faithful independent runs "
            "measured 0.389; docs/verifying.md).",
        ),
    ] = None,
    precision: Annotated[
        str,
        typer.Option(
            "--precision", help="Both sides' matmuls in float32 or bfloat16 (logits float32 either way)."
        ),
    ] = "float32",
    no_floor: Annotated[
        bool,
        typer.Option(
            "--no-floor",
            help="Skip the noise floor (the reference at the first landmark in the other precision): "
            "no landmark is then judged identical.",
        ),
    ] = False,
    device: Annotated[
        str, typer.Option("--device", help="cpu-N: N host CPU devices of this process.")
    ] = "cpu-1",
    recipe: Annotated[
        str | None,
        typer.Option("--recipe", help="The run's recipe, for a run directory without run.yaml."),
    ] = None,
    plot: Annotated[
        str | None, typer.Option("--plot", help="Write both runs' macro accuracy and the Δ band to this PNG.")
    ] = None,
    output: OutputOpt = Output.table,
) -> None:
    """Compare a run with its reference at every step both have a checkpoint of.

    Per landmark: Δ held-out loss per domain with σ (per-document variance), Δ per task judged
    jointly and Δ macro downstream accuracy with σ (the per-task standard errors of both sides in
    quadrature), the token-level KL(reference || run) on identical held-out tokens, tokens per step
    and the run's data audit, both sides in one precision; a level: identical (within the noise
    floor verify measures), same recipe (inside the bands of faithful independent runs) or moved
    (each surface named). Evaluations are kept in the run directory (eval/verify/): a second verify
    evaluates nothing new.

    Exit codes: 0 every landmark within noise, 1 a surface moved (named), 2 bad input (no such run or
    reference, no step in common, a missing tokenizer, an unknown task), 3 storage unreachable.
    """
    from olmo_ctl.cli.convert import _need
    from olmo_ctl.cli.evaluate import chosen_tasks, cpu_count, parse_lm

    _need("jax", "orbax.checkpoint", extra="trainer")
    n = cpu_count(device)
    chosen = chosen_tasks(tasks, suite)
    lm_sets = None if lm is None else parse_lm(lm)
    landmarks = _steps(steps)
    from olmo_ctl.trainer.quiet import cpu_devices

    cpu_devices(n)  # before anything starts JAX
    from olmo_ctl.observe.verify_run import verify as do_verify

    res = do_verify(
        _path(run),
        _path(reference),
        steps=landmarks,
        tasks=chosen,
        lm=lm_sets,
        limit=limit,
        kl_tokens=kl_tokens,
        devices=n,
        lm_tolerance=lm_tolerance,
        sigmas=sigmas,
        kl_tolerance=kl_tolerance,
        recipe_name=recipe,
        precision=precision,
        floor=not no_floor,
        log=note,
    )
    if plot:
        from olmo_ctl.observe.verify import plot as draw

        draw(res["landmarks"], _path(plot), sigmas=sigmas)
        res["plot"] = _path(plot)
    if output != Output.table:
        print_data(_plain(res), output)
    else:
        _table(res)
    if any(not m["within_noise"] for m in res["landmarks"]):
        raise typer.Exit(1)


def _g(x, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _beyond(j: dict | None) -> str:
    if not j or not j.get("judged"):
        return "-"
    return f"{len(j['beyond'])}/{j['judged']} ({j['expected']:g} by chance)"


def _table(res: dict) -> None:
    from rich.table import Table

    from olmo_ctl.cli.app import console

    t = Table(show_edge=False)
    for col in ("step", "Δ held-out (worst)", "Δ macro acc", "σ", "tasks > 2σ", "KL", "verdict"):
        t.add_column(col, justify="right" if col != "verdict" else "left")
    for m in res["landmarks"]:
        worst = max(m["lm"].items(), key=lambda kv: abs(kv[1]), default=None)
        ds = m["downstream"]
        t.add_row(
            str(m["step"]),
            "-" if worst is None else f"{worst[1]:+.4f} {worst[0]}",
            _g(ds["macro"], "+.4f"),
            _g(ds["sigma"], ".4f"),
            _beyond(m.get("tasks_beyond")),
            _g(m["kl"], ".3g"),
            m["verdict"],
        )
    con = console()
    con.print(t)
    fl = res.get("floor")
    if fl:
        worst = max(fl["lm"].values(), default=0.0)
        con.print(
            f"noise floor (reference at step {fl['step']}, {fl['between'][0]} vs {fl['between'][1]}): "
            f"held-out {worst:.2g} nats" + (f", KL {fl['kl']:.2g}" if fl.get("kl") is not None else "")
        )
    a = res.get("audit")
    if a is None:
        con.print("data order: not audited (the run recorded no data-coverage records)")
    con.print(
        f"verdict: {res['verdict']} ({res['evaluated']} evaluated, {res['cached']} from eval/verify/)"
        + (f"; plot: {res['plot']}" if res.get("plot") else "")
    )
