"""`olmo-ctl eval`: a checkpoint's LM losses, downstream task metrics and generative task accuracies,
computed on this machine or (but for generative tasks) as a job of its own on a single-host TPU slice
(`--backend gke`)."""

from typing import Annotated

import typer

from olmo_ctl.backends import THIS_MACHINE
from olmo_ctl.cli.app import Output, OutputOpt, app, plural, print_data
from olmo_ctl.cli.convert import CkptRecipeOpt, _need
from olmo_ctl.cli.options import SiteFlags, TimeoutOpt, _echo, note, site_options
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


SuiteOpt = Annotated[
    str | None,
    typer.Option(
        "--suite",
        help="Downstream tasks by name, instead of --tasks: olmo3-in-loop (AI2's 26 OLMo 3 in-loop "
        "tasks) or case-study (the OLMo 3 case study's eight: ARC-C, ARC-E, BoolQ, HellaSwag, "
        "OpenBookQA, PIQA, WinoGrande, MMLU; 5-shot multiple choice).",
    ),
]


def parse_suite(name: str) -> tuple[str, ...]:
    """`--suite NAME`: the task labels of a named suite (`downstream.SUITES`)."""
    from olmo_ctl.trainer.downstream import SUITES

    if name.strip() not in SUITES:
        raise BadInput(f"--suite `{name}` is not a suite", f"known suites: {', '.join(sorted(SUITES))}")
    return SUITES[name.strip()]


def chosen_tasks(tasks: str | None, suite: str | None) -> tuple[str, ...] | None:
    """The downstream tasks of `--tasks` or `--suite` (one of them at most); None when neither is given."""
    if tasks is not None and suite is not None:
        raise BadInput("--suite and --tasks both choose the downstream tasks", "give one of them")
    if suite is not None:
        return parse_suite(suite)
    return None if tasks is None else parse_tasks(tasks)


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


def cpu_count(device: str, command: str = "eval") -> int:
    """N of `--device cpu-N`: `command` runs in this process, on its host CPU devices."""
    from olmo_ctl.backends.base import Target

    d = Target.parse(device).device
    if d.generation != "cpu" or d.processes != 1:
        raise BadInput(
            f"--device {device}: {command} runs in this process on host CPU devices",
            "--device cpu-N, e.g. cpu-4",
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
    held = report.get("held_out")
    if held:
        out += [
            "",
            f"held-out loss {held['lm_loss']:.4f} over the run's {held['batches']} eval batches of data.eval "
            f"({held['instances']:,} instances): its in-loop eval/lm_loss, `eval lm_loss` in monitor",
        ]
    if lm:
        w = max(6, *(len(k) for k in lm))
        out += ["", f"{'LM SET':<{w}}  {'CE LOSS':>8}  {'PPL':>10}  {'TOKENS':>10}"]
        for label, v in lm.items():
            out.append(
                f"{label:<{w}}  {_num(v['ce_loss'], '.4f'):>8}  {_num(v['ppl'], '.3f'):>10}  {v['tokens']:>10,}"
            )
    gen = report.get("generative")
    if gen:
        w = max(10, *(len(k) for k in gen))
        out += ["", f"{'GENERATIVE':<{w}}  {'ACCURACY':>8}  {'± STDERR':>9}  {'N':>6}"]
        for label, v in gen.items():
            stderr = _num(v["stderr"], ".4f")
            out.append(f"{label:<{w}}  {_num(v['accuracy'], '.4f'):>8}  {'± ' + stderr:>9}  {v['n']:>6,}")
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
    example="olmo-ctl eval runs/smoke-demo/checkpoints/100 --tasks copycolors_10way --tokenizer builtin://bytes --limit 20",
)
@site_options(exclude=("backend",))
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
    suite: SuiteOpt = None,
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
        int,
        typer.Option(
            "--limit", help="Only the first N documents of each task, LM set and --generative file (0: all)."
        ),
    ] = 0,
    generative: Annotated[
        list[str] | None,
        typer.Option(
            "--generative",
            help="Generative problems, NAME=PATH (repeatable): a JSONL file (local or gs://) of RLVR-layout "
            "problems (messages or prompt, ground_truth, dataset gsm8k|math|ifeval; a line without dataset "
            "takes NAME), decoded greedily and scored by open-instruct's verifiers. Alone, nothing else is "
            "evaluated unless --tasks/--suite/--lm are given.",
        ),
    ] = None,
    chat_template: Annotated[
        str,
        typer.Option(
            "--chat-template",
            help="How --generative prompts are rendered: tulu or olmo (data/chat.py, with the generation "
            "prompt), or none (the raw prompt text).",
        ),
    ] = "tulu",
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="--generative: new tokens per problem at most.")
    ] = 256,
    generative_out: Annotated[
        str | None,
        typer.Option(
            "--generative-out",
            help="--generative: write each problem's prompt, completion and score here (JSONL, local or gs://).",
        ),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            help="local: cpu-N, N host CPU devices of this process (default cpu-1); gke: a single-host "
            "TPU slice, v5p-8 or tpu7x-8.",
        ),
    ] = None,
    recipe: CkptRecipeOpt = None,
    list_tasks: Annotated[
        bool,
        typer.Option(
            "--list-tasks",
            help="Print every task label ai2-olmo-eval builds (with --suite: the suite's) and exit.",
        ),
    ] = False,
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            help="local: in this process; gke: as a job of its own on the cluster (the trainer image). "
            "The backend site setting does not apply.",
        ),
    ] = THIS_MACHINE,
    out: Annotated[
        str | None,
        typer.Option(
            "--out",
            help="gke: the job's output directory (gs://), where it writes result.json and journals its "
            "attempts; never a run directory. Default: <run root>/eval-jobs/<job>.",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="gke: print the eval job's JobSet; submit nothing.")
    ] = False,
    timeout: TimeoutOpt = 86400.0,
    output: OutputOpt = Output.table,
    *,
    site: SiteFlags,
) -> None:
    """Evaluate a checkpoint: per-set LM loss and perplexity, and downstream task metrics.

    The trainer's evaluators (OLMo-core's LM evaluator, AI2's downstream tasks with ai2-olmo-eval's
    metrics and standard errors); a run's checkpoint takes its recipe's tasks, LM sets, tokenizer and
    sequence length unless given. --backend local (the default) evaluates on this machine's CPU
    devices; --backend gke runs the evaluation as a job on a single-host TPU slice, waits through
    Kueue's queue and prints the job's result (asked again, the same evaluation is read back, or its
    job waited for again). --generative NAME=PATH (local only) decodes a JSONL file of problems
    (gsm8k, math, ifeval) greedily and scores them with open-instruct's verifiers. Exit codes: 0
    evaluated, 1 the evaluation failed, 2 bad input (checked before the model is loaded; for a job,
    before it is submitted, but for building the tasks, which the job does), 3 the cluster or
    storage unreachable, 4 gave up (the job's attempts ended without a result), 124 timed out
    waiting (the job goes on), 130 interrupted (the job goes on).
    """
    if list_tasks:
        from olmo_ctl.trainer.downstream import known_tasks

        labels = known_tasks() if suite is None else list(chosen_tasks(tasks, suite) or ())
        if output != Output.table:
            print_data(labels, output)
        else:
            typer.echo("\n".join(labels))
        return
    if checkpoint is None:
        raise BadInput("CHECKPOINT is missing", "olmo-ctl eval CHECKPOINT [--tasks ...] [--lm ...]")
    from olmo_ctl.backends import backend_class

    kind = backend_class(backend)  # an unknown name: one line, exit 2
    if generative and not kind.trains_here:
        raise BadInput(
            "--generative with --backend gke: not yet", "evaluate generative tasks with --backend local"
        )
    task_labels = chosen_tasks(tasks, suite)
    lm_cfg = None if lm is None else parse_lm(lm)
    if not kind.trains_here:  # a cluster's backend: the evaluation is a job of its own there
        from olmo_ctl.checkpoints.evaluate import EvalSpec

        spec = EvalSpec(checkpoint, recipe, task_labels, lm_cfg, tokenizer, seq_len, data_root, limit)
        settings = site.replace(backend=backend).resolve()
        report = _on_cluster(spec, device, settings, out, dry_run, timeout, output)
        if report is not None:
            _show(report, output)
        return
    for flag, given in (("--out", out is not None), ("--dry-run", dry_run)):
        if given:
            raise BadInput(
                f"{flag} is for an eval job (--backend gke)", f"leave {flag} out, or add --backend gke"
            )
    if generative_out is not None and not generative:
        raise BadInput("--generative-out is for --generative", "leave it out, or add --generative NAME=PATH")
    problems = _generative_problems(generative or [], chat_template, max_tokens, limit)
    device = device or "cpu-1"
    n = cpu_count(device)
    _need("jax", "orbax.checkpoint", extra="trainer")
    from olmo_ctl.trainer.quiet import cpu_devices

    devices = cpu_devices(n)  # before anything starts JAX: this process's host CPU devices
    from olmo_ctl.checkpoints.evaluate import open_checkpoint, prepare, run

    if problems and task_labels is None and lm_cfg is None:  # --generative alone: only its problems
        ckpt = open_checkpoint(checkpoint, recipe)
        report = {"checkpoint": ckpt.given, "step": ckpt.step, "lm": {}, "downstream": {}}
        _add_generative(
            report, ckpt, problems, devices, device, tokenizer, chat_template, max_tokens, generative_out
        )
        _show(report, output)
        return

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
    from olmo_ctl.checkpoints.evaluate import held_out_batches

    if job.lm_data is not None and held_out_batches(job.checkpoint):
        note(
            "LM sets score one document per row, each from its start and cut to the sequence length; the "
            "run's in-loop `eval lm_loss` (monitor) is data.eval's packed instances, which a bare `eval` "
            "of this checkpoint gives"
        )
    report = run(job, devices)
    if problems:
        _add_generative(
            report,
            job.checkpoint,
            problems,
            devices,
            device,
            tokenizer,
            chat_template,
            max_tokens,
            generative_out,
        )
    _show(report, output)


def _generative_problems(values: list[str], template: str, max_tokens: int, limit: int) -> dict:
    """`--generative`'s problems, {label: [Problem]}, read and checked before anything else is."""
    if not values:
        return {}
    from olmo_ctl.checkpoints.generative import check_template, parse_generative, read_problems

    check_template(template)
    if max_tokens < 1:
        raise BadInput(f"--max-tokens {max_tokens} is not positive", "pass --max-tokens 1 or more")
    if limit < 0:
        raise BadInput(f"--limit {limit} is negative", "0 evaluates every document")
    return {label: read_problems(path, label, limit) for label, path in parse_generative(values).items()}


def _add_generative(
    report: dict, ckpt, problems: dict, devices, device: str, tokenizer, template, max_tokens, out
) -> None:
    """The report's `generative` section: {label: {accuracy, stderr, n}}; the items to `out`."""
    from olmo_ctl.checkpoints import generative as G

    total = sum(len(p) for p in problems.values())
    note(
        f"generating {plural(total, 'completion')} ({plural(len(problems), 'generative file')}) "
        f"of at most {max_tokens} tokens on {device}, chat template {template}"
    )
    results = G.run(ckpt, problems, devices, tokenizer=tokenizer, template=template, max_tokens=max_tokens)
    report["generative"] = {
        label: {k: _plain(v) for k, v in r.summary().items()} for label, r in results.items()
    }
    if out is not None:
        G.write_items(results, out)
        note(f"wrote {plural(total, 'item')} to {out}")


def _plain(x):
    import math

    return None if isinstance(x, float) and math.isnan(x) else x


def _show(report: dict, output: Output) -> None:
    if output != Output.table:
        print_data(report, output)
        return
    typer.echo("\n".join(table_lines(report)))


def _on_cluster(spec, device, settings, out, dry_run: bool, timeout: float, output: Output) -> dict | None:
    """`eval --backend gke`: check, then submit the eval job and wait for its result (the report), or
    print its JobSet (--dry-run; None)."""
    import importlib.util

    from olmo_ctl.backends import make_backend
    from olmo_ctl.backends.base import Target
    from olmo_ctl.backends.jobset import dump_json, dump_yaml
    from olmo_ctl.checkpoints.evaluate import check, open_checkpoint
    from olmo_ctl.core.errors import Interrupted
    from olmo_ctl.supervise import evaljob as J

    if device is None:
        raise BadInput("an eval job needs a slice", "--device v5p-8 or tpu7x-8")
    dev = Target.parse(device).device
    J.check_slice(dev, spec)  # before anything is read
    known = importlib.util.find_spec("olmo_eval") is not None
    recipe = check(
        open_checkpoint(spec.checkpoint, spec.recipe),
        devices=dev.devices,
        known_labels=known,
        **spec.options(),
    )
    if recipe.eval.downstream.tasks and not known:
        note("ai2-olmo-eval is not installed here (the eval extra): the job checks the task labels")
    name = J.job_name(spec, dev.name, out, settings.run_root)
    job = J.EvalJob(name, spec, recipe, dev, J.out_dir(name, out, settings.run_root), settings)
    J.check_paths(recipe, job.out)
    J.check_out(job.out)  # never a run's directory: the job journals its attempts there
    be = make_backend(settings)
    if dry_run:
        attempt = job.attempt(be, 0, render_only=True)
        for line in be.notes(attempt, render_only=True):
            note(line)
        manifest = be.printable(be.render(attempt))
        typer.echo((dump_json if output == Output.json else dump_yaml)(manifest), nl=False)
        return None
    try:
        record, kept = J.run_job(be, job, timeout_s=timeout, log=_echo)
    except KeyboardInterrupt:
        raise Interrupted(
            f"eval job {name} goes on; run the same command to wait for its result",
        ) from None
    d = record.get("devices") or {}
    where = f"{d.get('count')} {d.get('kind')} devices" if d else dev.name
    note(f"{'kept' if kept else 'evaluated'} by eval job {name} on {where}: {J.result_path(job.out)}")
    return record["report"]
