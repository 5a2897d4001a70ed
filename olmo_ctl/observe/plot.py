"""`monitor --plot FILE.png`: train and held-out loss, LR, tokens/s and MFU, each on its own axes with
a legend, with resumes, resizes and restarts within an attempt (a JobSet restart) marked.

The throughput panels draw `monitor.windows`, the logging windows whose last one is the report's "now"
(and the trainer's last `step` line), so the plot ends where the table does.
matplotlib (Agg, no display) is imported only here, only when a plot is asked for.
"""

from __future__ import annotations

import numpy as np

from olmo_ctl.core.devices import peak_note
from olmo_ctl.core.errors import BadInput
from olmo_ctl.observe.monitor import EVAL_TAG, LOSS_TAG, LR_TAGS, Sources, restarts, windows


def _resume_marks(src: Sources) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(step, label) where a new attempt's first logged step lies, and where a resize happened."""
    loss = src.reader.series(LOSS_TAG)
    resumes: list[tuple[int, str]] = []
    resizes: list[tuple[int, str]] = []
    if loss is None or not len(loss):
        return resumes, resizes
    change = np.flatnonzero(loss.attempts[1:] != loss.attempts[:-1]) + 1
    devices = {}
    for r in src.journal or []:
        if r.get("attempt") is not None and r.get("device"):
            devices[int(r["attempt"])] = r["device"]
    for i in change:
        a_new, a_old = int(loss.attempts[i]), int(loss.attempts[i - 1])
        step = int(loss.steps[i])
        if devices.get(a_new) and devices.get(a_old) and devices[a_new] != devices[a_old]:
            resizes.append((step, f"{devices[a_old]}→{devices[a_new]}"))
        else:
            resumes.append((step, f"attempt {a_new}"))
    return resumes, resizes


def _restart_marks(src: Sources) -> list[tuple[int, str]]:
    """(step, label) where an attempt's trainer started again within the same attempt (a JobSet
    restart; `monitor.restarts`)."""
    return [(step, f"attempt {attempt}") for attempt, step in restarts(src.reader)]


def figure(src: Sources, report: dict):
    """The plot as a matplotlib Figure (Agg): loss, LR, tokens/s and MFU %, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, ScalarFormatter

    r = src.reader
    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    ax_loss, ax_lr, ax_tps, ax_mfu = axes
    loss = r.series(LOSS_TAG)
    if loss is not None and len(loss):
        stride = max(1, len(loss) // 20000)  # a 1.4M-point line is slow to draw and no sharper
        ax_loss.plot(loss.steps[::stride], loss.values[::stride], lw=0.6, alpha=0.45, label="train CE")
        k = max(2, min(50, len(loss) // 20))  # a running mean that still shows the start of a short run
        if len(loss) > k:
            sm = np.convolve(loss.values, np.ones(k) / k, mode="valid")
            ax_loss.plot(loss.steps[k - 1 :][::stride], sm[::stride], lw=1.4, label=f"train CE ({k}-pt mean)")
    ev = r.series(EVAL_TAG)
    if ev is not None and len(ev):
        ax_loss.plot(ev.steps, ev.values, "o-", ms=3, lw=1.2, label="held-out lm_loss")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(
        f"{report.get('run')}  step {report.get('step')}"
        + (f" / {report['final_step']}" if report.get("final_step") else "")
    )

    for tag in LR_TAGS:
        s = r.series(tag)
        if s is not None and len(s):
            ax_lr.plot(s.steps, s.values, lw=1.0, label=tag)
    ax_lr.set_ylabel("learning rate")

    win = windows(src)
    stride = max(1, len(win) // 20000)
    tps = win.tokens_per_s if np.isfinite(win.tokens_per_s).any() else 1.0 / win.step_time_s
    unit = "tokens/s" if np.isfinite(win.tokens_per_s).any() else "steps/s"
    if len(win):
        ax_tps.plot(win.steps[::stride], tps[::stride], lw=0.8, label=f"{unit} (run, per logging window)")
    ax_tps.set_ylabel(unit)
    if np.isfinite(win.mfu).any():
        th = report.get("throughput") or {}
        note = peak_note(th.get("device"))  # a local device's peak is nominal
        ax_mfu.plot(
            win.steps[::stride],
            100 * win.mfu[::stride],
            lw=0.8,
            color="tab:green",
            label=f"MFU ({th.get('flops_formula') or 'logged'} FLOPs" + (f", {note})" if note else ")"),
        )
    ax_mfu.set_ylabel("MFU %")
    ax_mfu.set_xlabel("step")
    # Rates from 0, in plain numbers: a near-constant MFU would otherwise get an offset axis ("1e-5").
    ax_tps.set_ylim(bottom=0)
    ax_tps.yaxis.set_major_formatter(EngFormatter())  # 1.5M, not 1500000 or 1e6
    ax_mfu.set_ylim(bottom=0)
    fmt = ScalarFormatter(useOffset=False)
    fmt.set_scientific(False)
    ax_mfu.yaxis.set_major_formatter(fmt)

    resumes, resizes = _resume_marks(src)
    restarts = _restart_marks(src)
    marks = [(step, f"resume ({lab})", "tab:orange", "--") for step, lab in resumes]
    marks += [(step, f"resize {lab}", "tab:purple", "-.") for step, lab in resizes]
    marks += [(step, f"restart ({lab})", "tab:red", ":") for step, lab in restarts]
    for ax in axes:
        for step, _text, color, ls in marks:
            ax.axvline(step, color=color, ls=ls, lw=0.9)
    for step, text, color, _ls in marks:
        ax_loss.annotate(
            text,
            (step, 1),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color=color,
        )
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:  # rates drawn from 0 leave room below the line
            ax.legend(loc="lower right" if ax in (ax_tps, ax_mfu) else "upper right", fontsize=8)
    fig.tight_layout()
    return fig


def write_plot(src: Sources, report: dict, out_path: str) -> str:
    if not str(out_path).lower().endswith(".png"):
        raise BadInput(f"--plot `{out_path}` must name a .png file")
    import matplotlib.pyplot as plt

    fig = figure(src, report)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
