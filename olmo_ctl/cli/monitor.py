"""`olmo-ctl monitor`: the run's report; the live attempt's state comes from its backend through
`supervise.attempts.handle_status`.

Start-up stays light: no jax, no tensorboard; numpy and the event reader load inside the commands.
"""

import json
import sys
import time
from typing import Annotated

import typer

from olmo_ctl.cli.app import Output, OutputOpt, app, console, output_width, plural, print_data
from olmo_ctl.core.errors import BadInput, Interrupted, OlmoCtlError


def _fmt_s(s) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.2f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def _fmt_n(x, unit: str = "") -> str:
    if x is None:
        return "-"
    x = float(x)
    for div, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f}{suf}{unit}"
    return f"{x:.3g}{unit}"


def _g(x, fmt: str = ".4g") -> str:
    return "-" if x is None else format(float(x), fmt)


def host_lines(hosts: list[dict]) -> list[str]:
    """The `hosts` list (each host's latest logging window) as the table shows it."""
    out = ["hosts (latest window):"]
    for h in hosts:
        slow = ", ".join(h.get("slow") or [])  # "data wait", "compute"
        out.append(
            f"  host {h['host']}  step {h['step']:,}  step time {_fmt_s(h['step_time_s'])}"
            f"  data wait {_fmt_s(h['data_wait_s'])}  compute {_fmt_s(h['compute_s'])}"
            + (f"  slow: {slow}" if slow else "")
        )
    return out


def render(rep: dict):
    """A rich renderable of a monitor report (the table view and the --watch layout)."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from olmo_ctl.core.devices import peak_note
    from olmo_ctl.observe.monitor import GOING_ON_STATES, amendment_lines, timeline_summary

    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()

    def row(label: str, value: str) -> None:
        t.add_row(label, Text(value))  # plain text: a `[...]` in a value is shown, not read as markup

    step, final = rep.get("step"), rep.get("final_step")
    if step is None:
        prog = "no steps logged yet"
    elif final:
        prog = f"{step:,} / {final:,} ({rep['progress_pct']:.2f}%)"
    else:
        prog = f"{step:,}"
    row("step", prog)
    lo = rep["loss"]
    row("train CE (last 50 mean / last)", f"{_g(lo['train_ce_smoothed'])} / {_g(lo['train_ce'])}")
    row(
        "eval lm_loss",
        "-" if lo["eval_lm_loss"] is None else f"{lo['eval_lm_loss']:.4g} @ step {lo['eval_step']:,}",
    )
    tok = rep["tokens"]
    row("tokens seen", _fmt_n(tok["seen"]))
    th = rep["throughput"]
    win = th.get("window")
    row(
        "now = logging window",
        "-" if not win else f"steps {win['first_step']:,}..{win['last_step']:,} (attempt {win['attempt']})",
    )
    row(
        "tokens/s (now / run avg)",
        f"{_fmt_n(tok['per_s'])} / {_fmt_n(tok['per_s_run_avg'])}"
        + (
            f"  ({_fmt_n(th['tokens_per_s_per_device'])} per device now)"
            if th.get("tokens_per_s_per_device")
            else ""
        ),
    )
    dev = f" on {th['device']} ({plural(th['devices'], 'device')})" if th.get("device") else ""
    row(
        "TFLOP/s per device",
        f"{_g(th['tflops_per_device'], '.4g')} / {_g(th['tflops_per_device_run_avg'], '.4g')} avg{dev}",
    )
    mfu = "-" if th["mfu"] is None else f"{th['mfu'] * 100:.1f}%"
    mfu_avg = "-" if th["mfu_run_avg"] is None else f"{th['mfu_run_avg'] * 100:.1f}%"
    basis = [f"{th['flops_formula']} FLOPs"] if th.get("flops_formula") else []
    basis += [note] if (note := peak_note(th.get("device"))) else []  # a local device's peak is nominal
    row("MFU (now / run avg)", f"{mfu} / {mfu_avg}" + (f"  [{'; '.join(basis)}]" if basis else ""))
    row("step time (now / median)", f"{_fmt_s(th['step_time_s'])} / {_fmt_s(th['step_time_median_s'])}")
    at = rep["attempt"]
    if rep["eta_s"] == 0 and final and step is not None and step >= final:
        row("ETA", "done: final step reached")
    elif rep["eta_s"] is None and at.get("state") not in GOING_ON_STATES:
        row("ETA", f"- (nothing is running: attempt #{at['attempt']} {at['state']})")
    else:
        row("ETA", "-" if rep["eta_s"] is None else f"{_fmt_s(rep['eta_s'])} ({rep['eta']})")
    sk = rep["skipped_steps"]
    row(
        "skipped steps",
        "-" if sk["total"] is None else f"{sk['total']} total, {sk['last_1000']} in the last 1000",
    )
    ck = rep["checkpoint"]
    last = "none committed yet" if ck["committed_step"] is None else f"step {ck['committed_step']:,}"
    if ck.get("ephemeral"):
        perm = ck.get("permanent_step")
        last += " (ephemeral; " + ("no permanent one yet)" if perm is None else f"permanent: step {perm:,})")
    elif "permanent_step" in ck and ck["committed_step"] is not None:
        last += " (permanent)"
    row("last checkpoint", last)
    if ck["steps_at_risk"] is not None:
        row("steps at risk", f"{ck['steps_at_risk']:,}")
    if at.get("attempt") is not None:
        row(
            "attempt",
            f"#{at['attempt']} {at.get('device') or ''}: {at.get('state') or '?'}"
            + (f" — {at['reason']}" if at.get("reason") else "")
            + (f"  [{at['source']}]" if at.get("source") else ""),
        )
    else:
        row("attempt", at.get("source") or "-")
    w = at.get("waiting")
    if w and w.get("kind"):  # the backend named what holds it: the one line `runs` prints too
        row(
            "waiting",
            w["line"]
            + (f"; since {w['since']}" if w.get("since") else "")
            + (f", {_fmt_s(w['seconds'])}" if w.get("seconds") is not None else ""),
        )
    elif w:
        row(
            "waiting",
            f"for capacity ({w['cause']}) since {w['since']}"
            + (f", {_fmt_s(w['seconds'])}" if w.get("seconds") is not None else "")
            + (f": {w['reason']}" if w.get("reason") else ""),
        )
    gp = rep["goodput"]
    if gp["fraction"] is not None:
        # every bucket of the wall time (productive + these = wall), the largest first
        spent = sorted(((v, k) for k, v in (gp.get("buckets") or gp["lost_s"]).items() if v), reverse=True)
        lost = ", ".join(f"{k.replace('_', ' ')} {_fmt_s(v)}" for v, k in spent)
        row(
            "goodput",
            f"{gp['fraction'] * 100:.1f}% of {_fmt_s(gp['wall_s'])}" + (f" (lost: {lost})" if lost else ""),
        )
    if rep["replays"]["steps"]:
        row(
            "replayed steps",
            f"{rep['replays']['steps']} (mismatching values: {rep['replays']['mismatch_count']}"
            + (
                f", {n} equal up to layout rounding)"
                if (n := rep["replays"].get("layout_rounding_count"))
                else ")"
            ),
        )
    parts: list[Table | Text] = [t]
    if rep.get("hosts"):
        parts.append(Text("\n".join(host_lines(rep["hosts"]))))
    tl = timeline_summary(rep["timeline"])
    if not tl and len(rep.get("attempts_in_events") or []) > 1:  # no journal: the event files still tell
        tl = [
            f"#{a['attempt']}: steps {a['first_step']:,}..{a['last_step']:,}"
            + (f" ({a['replayed_steps']} replayed by a later attempt)" if a["replayed_steps"] else "")
            for a in rep["attempts_in_events"]
        ]
    if tl:
        parts.append(Text("\n".join(tl[-8:])))
    if rep.get("amendments"):
        parts.append(Text("\n".join(amendment_lines(rep["amendments"]))))
    if rep["warnings"]:
        parts.append(Text("\n".join(f"! {w}" for w in rep["warnings"]), style="yellow"))
    return Panel(Group(*parts), title=f"{rep['run']}  ({rep['path']})", subtitle=rep.get("generated_at"))


def _refreshed(src, last: dict, stall_after, backend: bool, reference: dict | None = None) -> dict:
    """The next report; when storage is briefly unreachable, the last one with a warning (a watch that
    runs for days must ride out a transient outage; the next refresh tries again)."""
    from olmo_ctl.observe.monitor import build_report
    from olmo_ctl.supervise.attempts import handle_status

    try:
        src.refresh()
    except OlmoCtlError as e:
        if e.exit_code != 3:
            raise
        return {
            **last,
            "warnings": [
                f"refresh failed, showing the previous report: {e.one_line()}",
                *[w for w in last["warnings"] if not w.startswith("refresh failed")],
            ],
        }
    return build_report(
        src, stall_after_s=stall_after, ask_backend=backend, status_of=handle_status, reference=reference
    )


@app.command(example="olmo-ctl monitor gs://my-bucket/runs/olmo3-7b-s1 --watch")
def monitor(
    run: Annotated[
        str,
        typer.Argument(
            metavar="RUN",
            help="Run name under the run root, or a run directory, local or gs:// (or one holding only "
            "tensorboard/).",
        ),
    ],
    run_root: Annotated[
        str | None,
        typer.Option(
            "--run-root", help="Where run directories live (gs://...), for a RUN that is a run's name."
        ),
    ] = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh a live view until Ctrl-C.")] = False,
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds between refreshes with --watch.")
    ] = 10.0,
    plot: Annotated[
        str | None, typer.Option("--plot", help="Write a PNG: loss, LR, throughput/MFU, resumes.")
    ] = None,
    stall_after: Annotated[
        float | None,
        typer.Option(
            "--stall-after",
            help="Seconds without a step before a running attempt is called stalled (default: max(300, 20 step times)).",
        ),
    ] = None,
    backend: Annotated[
        bool,
        typer.Option(
            "--backend/--no-backend",
            help="Ask the backend (local processes, GKE) for the live attempt's state; --no-backend uses the journal only.",
        ),
    ] = True,
    reference: Annotated[
        str | None,
        typer.Option(
            "--reference",
            help="A reference run directory (or step,value curve of its training loss): warn when this run's "
            "training loss runs below it while its held-out loss does not (memorization).",
        ),
    ] = None,
    reference_heldout: Annotated[
        str | None,
        typer.Option(
            "--reference-heldout",
            help="The reference's held-out loss as a step,value curve (or run directory), when --reference is a curve.",
        ),
    ] = None,
    memorization_threshold: Annotated[
        float | None,
        typer.Option(
            "--memorization-threshold",
            min=0,
            help="Nats the training loss must run below the reference for the alarm (default: derived from "
            "the runs' own evaluations, at least 0.02).",
        ),
    ] = None,
    output: OutputOpt = Output.table,
) -> None:
    """Show a run's progress, loss, throughput and MFU, checkpoints, attempts and goodput. RUN
    without a '/' that is not a directory here is a run's name under the run root, as `logs` and `stop`
    take it.

    Exit codes: 0 ok, 2 not a run directory (or no run of that name), 3 storage unreachable; with --watch 130 on Ctrl-C (the
    run is untouched).
    """
    from olmo_ctl.observe.monitor import build_report, load
    from olmo_ctl.supervise.attempts import handle_status

    if interval <= 0:
        raise BadInput(f"--interval {interval} must be positive")
    from olmo_ctl.observe.compare import reference_curves

    if reference_heldout and not reference:
        raise BadInput("--reference-heldout needs --reference", "give the reference's training loss too")
    if plot:
        _check_plot_path(plot)
    ref = reference_curves(reference, reference_heldout, memorization_threshold) if reference else None
    from olmo_ctl.observe.runs import composite_lines, composite_report, is_composite

    run = _run_dir(run, run_root)
    soup = _soup_manifest(run)
    if soup is not None:  # a soup (surgery soup, a run of ingredients' last step): what it averaged
        if watch or plot or ref:
            raise BadInput(f"`{run}` is a soup, not a run: --watch, --plot and --reference take a run")
        if output != Output.table:
            print_data(soup, output)
        else:
            typer.echo(
                f"{run}: soup of {len(soup.get('sources', []))} checkpoints of {soup.get('model')} "
                f"({soup.get('parameters', 0):,} parameters, {soup.get('dtype')}; {soup.get('accumulation')})"
            )
            for src in soup.get("sources", []):
                step = "" if src.get("step") is None else f" step {src['step']}"
                typer.echo(f"  {src.get('weight', 0):.6g} x {src.get('path')} ({src.get('kind')}{step})")
        return
    if is_composite(run):  # a run of ingredients: each one's line, and the soup
        if watch or plot or ref:
            raise BadInput(
                f"`{run}` is a run of ingredients: --watch, --plot and --reference take one of its runs",
                "monitor one ingredient's run directory (NAME-i1, ...)",
            )
        comp = composite_report(run.rstrip("/"), handle_status if backend else None)
        if output != Output.table:
            print_data(comp, output)
        else:
            typer.echo("\n".join(composite_lines(comp, output_width())))
        return
    src = load(run)
    rep = build_report(
        src, stall_after_s=stall_after, ask_backend=backend, status_of=handle_status, reference=ref
    )
    if plot:
        from olmo_ctl.observe.plot import write_plot

        write_plot(src, rep, plot)
    if not watch:
        if output != Output.table:
            print_data(rep, output)
        else:
            console().print(render(rep))
            if plot:
                sys.stderr.write(f"wrote {plot}\n")
        return
    try:
        if output != Output.table:
            while True:  # one JSON object per line per refresh; YAML: one document per refresh
                if output == Output.json:
                    sys.stdout.write(json.dumps(rep, default=str) + "\n")
                else:
                    sys.stdout.write("---\n")
                    print_data(rep, output)
                sys.stdout.flush()
                time.sleep(interval)
                rep = _refreshed(src, rep, stall_after, backend, ref)
        from rich.live import Live

        with Live(render(rep), refresh_per_second=2, screen=False) as live:
            while True:
                time.sleep(interval)
                rep = _refreshed(src, rep, stall_after, backend, ref)
                if plot:
                    write_plot(src, rep, plot)
                live.update(render(rep))
    except KeyboardInterrupt:
        # Leaving the view never touches the run.
        raise Interrupted(f"stopped watching {run}; the run is untouched") from None


def _run_dir(run: str, run_root: str | None) -> str:
    """RUN as given when it is a path (a '/' in it, or a directory here), else the run of that name
    under the run root (`backends.existing_runs`: `runs/` while no run root is set)."""
    import os

    from olmo_ctl import storage
    from olmo_ctl.backends import existing_runs, resolve_settings

    if run and not storage.is_gcs(run) and os.path.isfile(run):
        raise BadInput(
            f"`{run}` is a file, not a run directory",
            "give the run's directory (the one holding run.yaml), or a run's name under the run root",
        )
    if not run or "/" in run or storage.is_gcs(run) or os.path.exists(run):
        return run
    root = existing_runs(resolve_settings(run_root=run_root)).run_root
    path = storage.join(root, run)
    if not storage.is_gcs(path) and not os.path.exists(path):
        from olmo_ctl.rundir import did_you_mean, near_runs

        raise BadInput(
            f"no run `{run}` under {root}, and no directory `{run}` here",
            did_you_mean(near_runs(root, run))
            + "give a run directory (local or gs://), or --run-root; `olmo-ctl runs` lists the runs",
        )
    return path


def _check_plot_path(plot: str) -> None:
    """--plot writes a local PNG: its directory must exist (checked before anything is read)."""
    import os

    parent = os.path.dirname(os.path.abspath(plot))
    if os.path.isdir(plot):
        raise BadInput(f"--plot `{plot}` is a directory", "give a file name, e.g. --plot loss.png")
    if not os.path.isdir(parent):
        what = "is a file, not a directory" if os.path.exists(parent) else "does not exist"
        raise BadInput(
            f"--plot `{plot}`: directory `{parent}` {what}", "create it, or write the plot elsewhere"
        )


def _soup_manifest(path: str) -> dict | None:
    """The manifest of a soup directory (`surgery soup`'s soup.json), or None for anything else."""
    from olmo_ctl.checkpoints.soup import read_manifest

    return read_manifest(path)
