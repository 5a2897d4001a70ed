"""`monitor --plot FILE.png`: train and held-out loss, LR, throughput and MFU, with resumes and resizes marked.

matplotlib (Agg, no display) is imported only here, only when a plot is asked for.
"""

from __future__ import annotations

import numpy as np

from olmo_ctl.core.errors import BadInput
from olmo_ctl.observe.monitor import EVAL_TAG, LOSS_TAG, LR_TAGS, Sources, _intervals


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


def write_plot(src: Sources, report: dict, out_path: str) -> str:
    if not str(out_path).lower().endswith(".png"):
        raise BadInput(f"--plot `{out_path}` must name a .png file")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = src.reader
    fig, axes = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    ax_loss, ax_lr, ax_tp = axes
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
    ax_loss.legend(loc="upper right", fontsize=8)
    ax_loss.set_title(
        f"{report.get('run')}  step {report.get('step')}"
        + (f" / {report['final_step']}" if report.get("final_step") else "")
    )

    for tag in LR_TAGS:
        s = r.series(tag)
        if s is not None and len(s):
            ax_lr.plot(s.steps, s.values, lw=1.0, label=tag)
    ax_lr.set_ylabel("learning rate")
    if ax_lr.lines:
        ax_lr.legend(loc="upper right", fontsize=8)

    tps = report.get("tokens", {}).get("per_step")
    if loss is not None and len(loss) > 1:
        _d, per_step_s, _e, steps_i = _intervals(loss)
        if len(per_step_s):
            y = (tps / per_step_s) if tps else (1.0 / per_step_s)
            ax_tp.plot(steps_i, y, lw=0.6, label="tokens/s" if tps else "steps/s")
            ax_tp.set_ylabel("tokens/s" if tps else "steps/s")
            th = report.get("throughput", {})
            ftok, ndev = th.get("flops_per_token"), th.get("devices")
            if tps and ftok and ndev and th.get("mfu") and th.get("tflops_per_device"):
                peak = th["tflops_per_device"] / th["mfu"]
                ax2 = ax_tp.twinx()
                ax2.plot(steps_i, y / ndev * ftok / 1e12 / peak * 100, lw=0.6, color="tab:red", alpha=0.5)
                ax2.set_ylabel("MFU %", color="tab:red")
    ax_tp.set_xlabel("step")

    resumes, resizes = _resume_marks(src)
    for ax in axes:
        for step, _lab in resumes:
            ax.axvline(step, color="tab:orange", ls="--", lw=0.8)
        for step, _lab in resizes:
            ax.axvline(step, color="tab:purple", ls="-.", lw=1.0)
    marks = [(step, f"resume ({lab})", "tab:orange") for step, lab in resumes]
    marks += [(step, f"resize {lab}", "tab:purple") for step, lab in resizes]
    for step, text, color in marks:
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
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
