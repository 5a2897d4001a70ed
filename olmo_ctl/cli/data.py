"""`olmo-ctl data prepare`: token files (OLMo-core raw uint32 layout) from text, with a held-out split."""

import os
from typing import Annotated

import typer

from olmo_ctl.cli.app import (
    ModelOpt,
    OlmoTyper,
    Output,
    OutputOpt,
    RecipeOpt,
    SetOpt,
    StageOpt,
    app,
    plural,
    print_data,
)
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.data.tokenizer import BYTES_TOKENIZER

data_app = OlmoTyper(help="Make and inspect training data (token files).")
app.add_typer(data_app, name="data", example="olmo-ctl data info --recipe smoke -o json")


@data_app.command(
    "prepare",
    example="olmo-ctl data prepare books/*.txt --out gs://my-bucket/books --held-out-fraction 0.05 --seq-len 128",
)
def prepare(
    files: Annotated[
        list[str],
        typer.Argument(
            help="Text files (one document each) or .npy token files; JSONL for --kind sft|preference|prompts."
        ),
    ],
    out: Annotated[
        str,
        typer.Option("--out", help="Output directory, local or gs://; must not hold train/ or eval/ files."),
    ],
    held_out_fraction: Annotated[
        float, typer.Option("--held-out-fraction", help="Share of the inputs held out for eval/.")
    ] = 0.05,
    seq_len: Annotated[
        int,
        typer.Option(
            "--seq-len",
            help="Check each split holds whole instances of this length; parts are cut at multiples of it.",
        ),
    ] = 0,
    tokenizer: Annotated[
        str,
        typer.Option(
            "--tokenizer",
            help="builtin://bytes (the smoke model's), or a Hugging Face tokenizer.json or a directory holding"
            " one, local or gs:// (e.g. the dolma2 tokenizer).",
        ),
    ] = BYTES_TOKENIZER,
    eos_id: Annotated[
        int | None,
        typer.Option(
            "--eos-id",
            help="Token appended after each document; default: the recipe's model.eos_token_id (256 for"
            " builtin://bytes).",
        ),
    ] = None,
    kind: Annotated[
        str,
        typer.Option(
            "--kind",
            help="text: documents to token files; sft, preference, prompts: JSONL conversations (`messages`;"
            " `chosen`/`rejected`; `messages` with `ground_truth` and `dataset`) tokenized as open-instruct does.",
        ),
    ] = "text",
    chat_template: Annotated[
        str,
        typer.Option(
            "--chat-template",
            help="For --kind sft|preference|prompts: tulu, or olmo (OLMo 3's <|im_start|>).",
        ),
    ] = "tulu",
    max_seq_length: Annotated[
        int,
        typer.Option(
            "--max-seq-length",
            help="sft, preference: truncate each sequence to this many tokens; prompts: drop longer ones. 0: none.",
        ),
    ] = 4096,
    add_bos: Annotated[
        bool | None,
        typer.Option(
            "--add-bos/--no-add-bos",
            help="Begin each conversation with BOS (= EOS); default as AI2's scripts: tulu yes, olmo no.",
            show_default=False,
        ),
    ] = None,
    stage: StageOpt = None,
    model: ModelOpt = None,
    recipe: RecipeOpt = None,
    set_: SetOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """Make token files from text (or .npy token files), with a held-out split; or chat data for post-training.

    Writes OUT/train/part-NNNNN.npy, OUT/eval/part-NNNNN.npy (raw uint32 tokens) and
    OUT/manifest.json. Each text file is one document: tokenized by --tokenizer without its special
    tokens (no BOS), then EOS, as OLMo-core's data is. builtin://bytes, the default: tokens 0-255, EOS
    256, vocab 258 as in the smoke recipe. A Hugging Face tokenizer needs the EOS from --eos-id or a
    recipe (--stage N or --recipe NAME: its model.eos_token_id; every id must be below its
    model.vocab_size). Pre-tokenized .npy files (e.g. dolma2) are copied as they are.
    --kind sft|preference|prompts reads JSONL conversations and writes open-instruct's numpy files
    (token_ids_part_NNNN.npy, labels_mask_part_NNNN.npy, token_ids_part_NNNN.csv.gz; chosen/ and
    rejected/ for pairs) or prompts.jsonl, and OUT/manifest.json (docs/data.md).
    Exit codes: 0 written, 2 bad input (nothing written; a bad JSONL line is named FILE:LINE),
    3 storage unreachable.
    """
    from olmo_ctl.data.files import prepare as do_prepare

    model_cfg = None
    if stage is not None or recipe is not None or model is not None or set_:
        model_cfg = load_recipe(recipe, stage, set_ or [], model=model).model
    if kind != "text":
        _prepare_chat(
            files,
            out,
            kind,
            chat_template,
            max_seq_length,
            add_bos,
            seq_len,
            tokenizer,
            eos_id,
            model_cfg,
            output,
        )
        return
    manifest = do_prepare(
        list(files),
        out,
        held_out_fraction=held_out_fraction,
        seq_len=seq_len,
        tokenizer=tokenizer,
        eos_token_id=eos_id,
        model=model_cfg,
    )
    if output != Output.table:
        print_data(manifest, output)
        return
    for split in ("train", "eval"):
        n = len(manifest[split])
        line = f"{split}: {manifest[f'{split}_tokens']:,} tokens in {n} file{'s' if n != 1 else ''}"
        if seq_len > 1:
            line += f" ({manifest[f'{split}_instances']:,} instances of {seq_len})"
        typer.echo(line)
    eos = f" (EOS {manifest['eos_token_id']})" if "eos_token_id" in manifest else ""
    typer.echo(f"tokenizer: {manifest['tokenizer']}{eos}; manifest: {out.rstrip('/')}/manifest.json")


def _prepare_chat(
    files, out, kind, chat_template, max_seq_length, add_bos, seq_len, tokenizer, eos_id, model_cfg, output
) -> None:
    from olmo_ctl.core.errors import BadInput
    from olmo_ctl.data.chat_files import prepare_chat

    if seq_len:
        raise BadInput(f"--seq-len is for --kind text, not {kind}", "use --max-seq-length")
    m = prepare_chat(
        list(files),
        out,
        kind=kind,
        template=chat_template,
        max_seq_length=max_seq_length,
        add_bos=add_bos,
        tokenizer=tokenizer,
        eos_token_id=eos_id,
        model=model_cfg,
    )
    if output != Output.table:
        print_data(m, output)
        return
    if kind == "prompts":
        typer.echo(
            f"prompts: {m['prompts']:,} ({m['prompt_tokens']:,} tokens), {m['dropped_too_long']:,} dropped as longer"
            f" than {max_seq_length}"
        )
    else:
        sides = [("sft", m)] if kind == "sft" else [("chosen", m["chosen"]), ("rejected", m["rejected"])]
        n = m["documents"] if kind == "sft" else m["pairs"]
        typer.echo(
            f"{kind}: {plural(n, 'conversation' if kind == 'sft' else 'pair')}, {m['truncated']:,} truncated, "
            f"{m['dropped_no_labels']:,} dropped (no assistant token left)"
        )
        for name, side in sides:
            typer.echo(
                f"{name}: {side['tokens']:,} tokens ({side['trainable_tokens']:,} trained on) in "
                f"{plural(len(side['parts']), 'part')}, {m['token_dtype']}"
            )
    typer.echo(
        f"template: {m['chat_template']} (BOS {'added' if m['add_bos'] else 'not added'}); "
        f"manifest: {out.rstrip('/')}/manifest.json"
    )


def data_report(recipe) -> dict:
    """What a recipe's data resolves to: files, tokens, instances, epoch length and fingerprint."""
    from olmo_ctl.data.files import dataset_fingerprint, resolve_files

    t = recipe.train
    files = resolve_files(recipe, "train")
    instances = sum(f.tokens // t.seq_len for f in files)
    batches = instances // t.global_batch
    d = {
        "recipe": recipe.name,
        "mix": recipe.data.mix or None,
        "train_files": len(files),
        "train_tokens": sum(f.tokens for f in files),
        "train_instances": instances,
        "seq_len": t.seq_len,
        "global_batch": t.global_batch,
        "batches_per_epoch": batches,
        "max_steps": t.max_steps,
        "epochs_for_max_steps": t.max_steps / batches if batches else None,
        "data_seed": recipe.data.seed,
        "fingerprint": dataset_fingerprint(files, t.seq_len, recipe.data.seed),
        "first_file": files[0].path,
        "last_file": files[-1].path,
    }
    if recipe.data.eval:
        ev = resolve_files(recipe, "eval")
        d.update({"eval_files": len(ev), "eval_instances": sum(f.tokens // t.seq_len for f in ev)})
    d["files"] = [f.path for f in files]  # the ordered training files, as resolved
    return d


@data_app.command("info", example="olmo-ctl data info --recipe smoke -o json")
def info(
    stage: StageOpt = None,
    model: ModelOpt = None,
    recipe: RecipeOpt = None,
    set_: SetOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """Resolve a recipe's data: files, tokens, instances, batches per epoch and the dataset fingerprint.

    Exit codes: 0 shown, 2 bad input, 3 storage unreachable.
    """
    d = data_report(load_recipe(recipe, stage, set_ or [], model=model))
    if output != Output.table:
        print_data(d, output)
        return
    for k, v in d.items():
        if k == "files" or v is None:
            continue  # the whole list is in -o json; first_file and last_file stand for it here
        if isinstance(v, float):
            shown = f"{v:.3g}"  # a ratio such as epochs_for_max_steps; -o json has every digit
        elif isinstance(v, int) and not isinstance(v, bool) and k != "data_seed":
            shown = f"{v:,}"
        else:
            shown = str(v)
        typer.echo(f"{k}: {shown}")


@data_app.command("audit", example="olmo-ctl data audit smoke-demo -o json")
def audit(
    run: Annotated[
        str,
        typer.Argument(
            metavar="RUN", help="Run name under the run root, or a run directory (local or gs://)."
        ),
    ],
    run_root: Annotated[
        str | None, typer.Option("--run-root", help="Where run directories live (gs://...).")
    ] = None,
    output: OutputOpt = Output.table,
) -> None:
    """Check that the run read every instance of its data order once, in order, over every attempt.

    Replays the epoch order against the instances each host recorded at each committed step, across
    SIGKILLs, resizes and changes of process count: instances read, distinct, read twice, skipped, and
    the first step that departs from the order. The report is kept in the run directory
    (data_audit/result.json), where `monitor` reads it: instances read twice raise its memorization alarm.
    Exit codes: 0 every step read its batch of the order, 1 a departure (named), 2 bad input (no such run,
    no committed step, no records), 3 storage unreachable.
    """
    from olmo_ctl import storage
    from olmo_ctl.backends import existing_runs, resolve_settings
    from olmo_ctl.checkpoints.data_audit import audit_run, record_result

    if "/" in run or storage.is_gcs(run):
        path = run if storage.is_gcs(run) else os.path.abspath(run)
    else:
        path = storage.join(existing_runs(resolve_settings(run_root=run_root)).run_root, run)
    rep = audit_run(path)
    try:
        record_result(path, rep)
    except (storage.PermissionDenied, OSError) as e:  # a read-only view of the run still gets its audit
        typer.echo(f"note: the audit was not kept in the run directory ({e})", err=True)
    if output != Output.table:
        print_data(rep.to_dict(), output)
    else:
        typer.echo(
            f"{path}: steps 1..{rep.committed_step}: {rep.instances:,} instances read, {rep.distinct:,} distinct, "
            f"{rep.repeated:,} read twice, {rep.skipped:,} skipped"
        )
        for la in rep.launches:
            typer.echo(
                f"  attempt {la['attempt']} (restored step {la['restored_step']}, "
                f"{plural(la['processes'], 'process', 'processes')}): "
                f"steps {la['first_step']}..{la['last_step']}"
            )
        d = rep.first_departure
        if d:
            typer.echo(f"DEPARTS at step {d['step']}: {d['reason']}")
        r = rep.first_repeat
        if r:
            typer.echo(
                f"first repeat: instance {r['instance']} of epoch {r['epoch']} at step {r['step']} "
                f"(first read at step {r['first_read_step']})"
            )
        if rep.ok:
            typer.echo("ok: every step read its batch of the order")
    if not rep.ok:
        raise typer.Exit(1)
