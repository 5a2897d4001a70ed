"""The training loop's hooks: every concern that acts around a step, one small class each.

The loop (`trainer/train.py`) restores, runs steps and fetches their device metrics; everything else
hooks in (OLMo-core's callbacks). A hook may act before a step (`pre_step`: an exit code ends the loop
before it), as the step's batch is read (`pre_batch`: its time counts as the step's data loading),
after it (`post_step`), on each fetched window of step metrics (`on_window`, then `on_step_metrics`
for each of its steps in order) and at the end (`post_train`, in a `finally`: on success and on an
exception alike). The loop calls the hooks of each kind in the list's order, and `default_hooks`
fixes that order; it is the order the trainer has always acted in:

  after a step   EvaluatorHook   each evaluator (trainer/evaluator.py) every its own interval, in order:
                                 the held-out loss, OLMo-core's per-label LM evaluator, the downstream
                                 tasks (the pending metrics fetched before each)
                 StopHook        the final step, or a stop every host agreed on: the exit code (0 / 143)
                 CheckpointHook  stopping: the final save, committed; else every `checkpoint.interval`
                 MetricsHook     every `logging.metrics_every` steps, fetch the pending metrics
                 EventsHook      every `logging.upload_every_s`, upload the events
  a window       StragglerHook   every host's timings as `hosts/<h>/...`, slow hosts named
  each step's    StopHook        a non-finite loss or grad norm: TrainingFailed (exit 1), before it is logged
  metrics        MetricsHook     the step's scalars (MFU, TPS, ...) and its `step N/M loss ...` line
  at the end     CheckpointHook  wait for a save in flight; MetricsHook: fetch the rest; EventsHook: upload
  before a step  StopHook        a stop requested before the first step: 143 with nothing new to save
                 FaultHook       the test-only fault knobs (core/faults.py): a hang, a failing data read,
                                 then slow data loading as the batch is read

FaultHook also acts where the attempt is set up, before the loop exists: the loader it trains from,
a slow restore, a resume off by some batches (`wrap_loader`, `pre_restore`, `post_restore`).

Once StopHook has set `loop.exit_code`, the hooks after it do only what stopping needs (the final
save uploads the events itself). On the exception path the last fetch skips the per-host timings on
several hosts: their allgather is a collective, which deadlocks when one host fails alone.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from olmo_ctl.core import faults, stragglers
from olmo_ctl.core.contracts import (
    DATA_WAIT_TAG,
    EXIT_SIGTERM,
    GRAD_NORM_TAG,
    LR_GROUP1_TAG,
    LR_TAG,
    MFU_AVG_TAG,
    MFU_TAG,
    PPL_TAG,
    SAVE_DURATION_TAG,
    STEP_SKIPPED_PARITY_TAG,
    STEP_SKIPPED_TAG,
    STEP_TIME_TAG,
    STOP_BUDGET_ENV,
    TFLOPS_TAG,
    TOTAL_TOKENS_PARITY_TAG,
    TOTAL_TOKENS_TAG,
    TPS_AVG_TAG,
    TPS_TAG,
    Z_LOSS_TAG,
    host_tag,
    primary_loss_tag,
    step_line,
)
from olmo_ctl.trainer import injected
from olmo_ctl.trainer.evaluator import Evaluator
from olmo_ctl.trainer.exits import TrainingFailed

# Set when this process's stop wrote no checkpoint for want of time (`CheckpointHook._no_time_to_write`):
# the trainer's `exited` journal record carries it (`core.contracts.stop_unsaved_note`).
STOP_UNSAVED: dict | None = None


@dataclass
class Window:
    """One fetch of the device metrics of finished steps (a logging window)."""

    steps: list[
        tuple[int, dict, float]
    ]  # (step, its metrics on the host, its data loading seconds), in order
    step_time_s: float  # per step, over the window
    elapsed_s: float  # since this attempt's clock started
    wall: float  # unix time of the fetch
    index: int  # 1 for the attempt's first window, which holds the compile
    steps_run: int  # steps run by this attempt so far
    gather: bool = True  # False on the exception path: no collective may run


class Hook:
    """A concern of the loop. `loop` offers `s` (the setup), `step`, `state`, `loader`, `ckpt`,
    `events`, `watchdog`, `pending` (unfetched step metrics), `steps_run`, `exit_code` and `flush()`."""

    def pre_train(self, loop) -> None:
        pass

    def pre_step(self, loop) -> int | None:
        return None

    def pre_batch(self, loop) -> None:
        pass

    def post_step(self, loop) -> None:
        pass

    def on_window(self, loop, w: Window) -> None:
        pass

    def on_step_metrics(self, loop, w: Window, step: int, m: dict, load_s: float) -> None:
        pass

    def post_train(self, loop, ok: bool) -> None:
        pass


# ---------------------------------------------------------------- dispatch (the loop's side)


def pre_train(hooks: list[Hook], loop) -> None:
    for h in hooks:
        h.pre_train(loop)


def pre_step(hooks: list[Hook], loop) -> int | None:
    for h in hooks:
        code = h.pre_step(loop)
        if code is not None:
            return code
    return None


def pre_batch(hooks: list[Hook], loop) -> None:
    for h in hooks:
        h.pre_batch(loop)


def post_step(hooks: list[Hook], loop) -> int | None:
    """Every hook after a step; the exit code StopHook set, if any."""
    for h in hooks:
        h.post_step(loop)
    return loop.exit_code


def window(hooks: list[Hook], loop, w: Window) -> None:
    for h in hooks:
        h.on_window(loop, w)
    for step, m, load_s in w.steps:
        for h in hooks:
            h.on_step_metrics(loop, w, step, m, load_s)


def post_train(hooks: list[Hook], loop, ok: bool, *also: Callable[[], None]) -> None:
    """Every hook's `post_train`, then `also`: each runs even when one before it raised (the last error
    is raised, as nested `finally` blocks would)."""
    err = None
    for fn in [*(lambda h=h: h.post_train(loop, ok) for h in hooks), *also]:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the others ran
            err = e
    if err is not None:
        raise err


# ---------------------------------------------------------------- the hooks


def stop_budget_s() -> float | None:
    """The seconds from SIGTERM to the kill the launcher gave this process (`STOP_BUDGET_ENV`), or None."""
    raw = os.environ.get(STOP_BUDGET_ENV, "")
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


class StopSignals:
    """SIGTERM/SIGINT set a flag; the loop checks it between steps. On several hosts SIGTERM belongs
    to JAX's preemption service instead, and `requested(step)` is the step every host agreed on."""

    def __init__(self):
        self.signal: int | None = None
        self.hosts = False
        self.at: float | None = None  # when this process learnt of the stop (time.monotonic)

    def install(self) -> None:
        from olmo_ctl.trainer import multihost

        self.hosts = multihost.joined()
        for sig in (signal.SIGINT,) if self.hosts else (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def requested(self, step: int) -> bool:
        """Called once per step, after it, on every host (a sync point on several hosts)."""
        if self.hosts:
            from olmo_ctl.trainer import multihost

            if multihost.stop_agreed(step):
                print(f"stop requested: every host stops after step {step}", flush=True)
                self.signal = self.signal or signal.SIGTERM
                self.at = self.at or time.monotonic()
                return True
        return self.signal is not None

    def _handler(self, signum, frame) -> None:
        if self.signal is None:
            print(f"received signal {signum}: finishing the current step, then checkpointing", flush=True)
            self.at = time.monotonic()
        self.signal = signum


class EvaluatorHook(Hook):
    """Every evaluator (trainer/evaluator.py) after each step that is a multiple of its interval, in
    the list's order: the pending step metrics fetched first, the hang watchdog paused while it runs,
    its scalars logged by process 0 and its `eval step N ...` line printed."""

    def __init__(self, evaluators: list[Evaluator]):
        self.evaluators = list(evaluators)

    @classmethod
    def for_recipe(cls, s, run_dir: str | None = None) -> EvaluatorHook:
        """The recipe's evaluators for the run's setup `s` (an off one is left out); `run_dir` keeps the
        downstream tasks an earlier attempt built."""
        from olmo_ctl.trainer.downstream import DownstreamEvaluator
        from olmo_ctl.trainer.evaluator import HeldOutLoss
        from olmo_ctl.trainer.lm_eval import LMEvaluator

        found = [
            HeldOutLoss.for_recipe(s),
            LMEvaluator.for_recipe(s),
            DownstreamEvaluator.for_recipe(s, run_dir=run_dir),
        ]
        return cls([e for e in found if e is not None])

    def post_step(self, loop) -> None:
        for evaluator in self.evaluators:
            if loop.step % evaluator.interval:
                continue
            loop.flush()
            with loop.watchdog.paused():
                result = evaluator.run(loop.state["params"])
            if loop.s.proc == 0:
                loop.events.scalars(loop.step, result.metrics)
            print(f"eval step {loop.step} {result.summary}", flush=True)


class StopHook(Hook):
    """When to stop: the final step (exit 0), a signal or a stop every host agreed on (exit 143), a
    non-finite loss (TrainingFailed, exit 1: restarting would fail again)."""

    def __init__(self, signals: StopSignals, final_step: int):
        self.signals, self.final_step = signals, final_step

    def pre_step(self, loop) -> int | None:
        if loop.steps_run:
            return None
        # Before the first step: a stop requested during start-up ends the attempt with nothing new to
        # save (on several hosts: the step the runtime agreed on, primed by multihost.prime_stop).
        if self.signals.hosts:
            return EXIT_SIGTERM if loop.step >= 1 and self.signals.requested(loop.step) else None
        return EXIT_SIGTERM if self.signals.signal is not None else None

    def post_step(self, loop) -> None:
        if loop.step >= self.final_step:
            loop.exit_code = 0
        elif self.signals.requested(loop.step):
            loop.exit_code = EXIT_SIGTERM

    def on_step_metrics(self, loop, w: Window, step: int, m: dict, load_s: float) -> None:
        ce, grad_norm = float(m["ce"]), float(m["grad_norm"])
        if not math.isfinite(ce) or not math.isfinite(grad_norm):
            raise TrainingFailed(
                f"loss is not finite at step {step} (CE {ce}, grad norm {grad_norm})",
                "lower the learning rate or check the data; restarting would fail again",
            )


class CheckpointHook(Hook):
    """The checkpoint of the final (or stopping) step, committed before exit, one every
    `checkpoint.interval` steps and, with `checkpoint.ephemeral_interval`, one every that many steps
    (the Checkpointer deletes those once a later one commits); the metrics are fetched first, so a
    non-finite loss is never saved."""

    def __init__(
        self,
        interval: int,
        ephemeral_interval: int = 0,
        run_dir: str | None = None,
        attempt: int = 0,
        signals: StopSignals | None = None,
    ):
        self.interval, self.ephemeral_interval = interval, ephemeral_interval
        self.run_dir, self.attempt, self.signals = run_dir, attempt, signals

    def post_step(self, loop) -> None:
        if loop.exit_code is not None:
            if not self._no_time_to_write(loop):
                self.save(loop, final=True)
        elif loop.step % self.interval == 0 or (
            self.ephemeral_interval and loop.step % self.ephemeral_interval == 0
        ):
            self.save(loop, final=False)
            if self._asked_to_stop_here(loop):
                # `resize --at-next-checkpoint`, `amend --restart`: this checkpoint is the attempt's last.
                from olmo_ctl.trainer.watchdog import storage_phase_s

                with loop.watchdog.judged(
                    f"the checkpoint write of step {loop.step}", storage_phase_s(loop.s.recipe.runtime)
                ):
                    loop.ckpt.wait()
                print(
                    f"stop at this checkpoint requested: step {loop.step} is the attempt's last", flush=True
                )
                loop.exit_code = EXIT_SIGTERM

    def _no_time_to_write(self, loop) -> bool:
        """A stop (exit 143) whose checkpoint write would not finish before the kill: the time left of
        the stop budget (`STOP_BUDGET_ENV`: the pod's grace period, a spot VM's notice) is less than
        this attempt's last write took, on the slowest host. Then no write starts: one cut off would
        be lost anyway, and the previous checkpoint stands (a run loses the steps since it, bounded by
        `checkpoint.ephemeral_interval` where set). Without a budget or a write measured, it writes."""
        if loop.exit_code != EXIT_SIGTERM or self.signals is None:
            return False
        budget = stop_budget_s()
        took = float(getattr(loop.ckpt, "last_write_s", 0.0))
        at = self.signals.at
        left = -1.0 if budget is None else budget - (time.monotonic() - at if at is not None else 0.0)
        if loop.s.n_proc > 1:  # every host decides the same: the slowest write, the least time left
            from olmo_ctl.trainer import multihost

            rows = multihost.allgather_floats([took, left])
            took, left = max(r[0] for r in rows), min(r[1] for r in rows)
        if budget is None or took <= 0 or took <= left:
            return False
        committed = loop.ckpt.latest_step()
        loop.committed_at_stop = committed or 0  # the exit's `committed step` line names it
        global STOP_UNSAVED
        STOP_UNSAVED = {
            "step": int(loop.step),
            "write_s": round(took, 1),
            "left_s": round(max(left, 0.0), 1),
            "budget_s": budget,
            "committed_step": committed or 0,
        }
        print(
            f"stop: step {loop.step} not checkpointed: a checkpoint write took {took:.1f} s in this attempt "
            f"and the stop leaves {max(left, 0.0):.1f} s ({STOP_BUDGET_ENV}={budget:g}); the run resumes "
            f"from checkpoint {committed if committed is not None else 'none (step 0)'}",
            flush=True,
        )
        return True

    def _asked_to_stop_here(self, loop) -> bool:
        """Whether the run directory asks this attempt to stop at this checkpoint (process 0 reads it,
        every host takes its answer: the hosts stop together)."""
        if self.run_dir is None:
            return False
        asked = 0.0
        if loop.s.proc == 0:
            from olmo_ctl.rundir import RunDir

            asked = float(RunDir(self.run_dir).stop_at_checkpoint_requested(self.attempt))
        if loop.s.n_proc > 1:
            from olmo_ctl.trainer import multihost

            asked = multihost.allgather_floats([asked])[0][0]
        return asked > 0

    def save(self, loop, final: bool) -> None:
        from olmo_ctl.trainer.watchdog import storage_phase_s

        loop.flush()  # a non-finite loss stops here, before it is checkpointed
        # Judged with an absolute bound (a save that stalls on storage is exit 3, never a silent wait).
        with loop.watchdog.judged(
            f"the checkpoint write of step {loop.step}", storage_phase_s(loop.s.recipe.runtime)
        ):
            getattr(loop.loader, "write_record", lambda: None)()  # the instances of the steps it commits
            secs = loop.ckpt.save(loop.step, loop.state, self.meta(loop))
            if final:
                loop.ckpt.wait()
        if loop.s.proc == 0:
            loop.events.scalars(loop.step, {SAVE_DURATION_TAG: secs})
        upload_events(loop)

    @staticmethod
    def meta(loop) -> dict:
        r = loop.s.recipe
        return {
            "data": loop.loader.state(),
            "data_fingerprint": loop.loader.fingerprint,
            "seed": r.train.seed,
            "recipe": r.name,
            "recipe_fingerprint": r.fingerprint(),
            "step": loop.step,
        }

    def post_train(self, loop, ok: bool) -> None:
        from olmo_ctl.trainer.watchdog import storage_phase_s

        with loop.watchdog.judged("the last checkpoint's commit", storage_phase_s(loop.s.recipe.runtime)):
            loop.ckpt.close()  # waits for an async save in flight


class StragglerHook(Hook):
    """Every host's step time, data wait and compute per window (`hosts/<h>/...` on process 0), and a
    line naming a slow host once per host and part per attempt (core/stragglers.py)."""

    def __init__(self):
        self.host_windows: dict[int, list[dict]] = {}  # process 0: every host's recent windows
        self.named: set[tuple[int, str]] = set()  # slow hosts already logged by this attempt

    def on_window(self, loop, w: Window) -> None:
        from olmo_ctl.trainer import multihost

        n_proc = loop.s.n_proc
        if w.index == 1 or (not w.gather and n_proc > 1):  # the first window holds the compile (and host
            return  # 0's epoch order); on the exception path a collective could wait forever
        step_time, data_wait = w.step_time_s, sum(ld for _, _, ld in w.steps) / len(w.steps)
        mine = [step_time, data_wait, max(0.0, step_time - data_wait)]
        rows = multihost.allgather_floats(mine) if n_proc > 1 else [mine]
        if loop.s.proc != 0:
            return
        values = {}
        for h, (st, dw, comp) in enumerate(rows):
            values.update(
                {
                    host_tag(h, "step_time_s"): st,
                    host_tag(h, "data_wait_s"): dw,
                    host_tag(h, "compute_s"): comp,
                }
            )
            self.host_windows.setdefault(h, []).append({"data_wait_s": dw, "compute_s": comp})
            del self.host_windows[h][: -stragglers.RECENT]
        loop.events.scalars(w.steps[-1][0], values, w.wall)
        for slow in stragglers.slow_hosts(self.host_windows):
            if (slow.host, slow.part) not in self.named:
                self.named.add((slow.host, slow.part))
                print(stragglers.slow_host_line(slow), flush=True)


class MetricsHook(Hook):
    """Each step's scalars (loss, LR, TPS, MFU against the device's peak, ...) on process 0 and its
    `step N/M loss ...` line (core/contracts.py: the supervisor and smoke parse it). The metrics stay
    on the device until a fetch: every `logging.metrics_every` steps, at checkpoints and at the end."""

    def __init__(self, recipe, plan, device, metrics_every: int):
        from olmo_ctl.core import flops

        self.recipe, self.plan, self.device, self.metrics_every = recipe, plan, device, metrics_every
        self.fpt = flops.flops_per_token_olmo_core(recipe.model, recipe.train.seq_len)

    def post_step(self, loop) -> None:
        if loop.exit_code is None and len(loop.pending) >= self.metrics_every:
            loop.flush()

    def on_step_metrics(self, loop, w: Window, step: int, m: dict, load_s: float) -> None:
        from olmo_ctl.core import flops

        if loop.s.proc != 0:
            return
        tokens_per_step = self.recipe.tokens_per_step
        ce, grad_norm, lr = float(m["ce"]), float(m["grad_norm"]), float(m["lr"])
        # The window's figures (docs/monitoring-and-compare.md#throughput): `monitor` derives the same
        # ones from the window's wall times, so the line, the scalars and the report agree.
        run_tps = tokens_per_step / w.step_time_s
        tps = run_tps / self.plan.devices  # every slice's devices
        tflops = flops.tflops_per_device(tps, self.fpt)
        mfu = flops.mfu(tflops, self.device)
        # OLMo-core's "actual avg": this attempt's steps over its time since start (compile included)
        tps_avg = tokens_per_step * w.steps_run / max(w.elapsed_s, 1e-9) / self.plan.devices
        mfu_avg = flops.mfu(flops.tflops_per_device(tps_avg, self.fpt), self.device)
        values = {
            primary_loss_tag(): ce,
            PPL_TAG: math.exp(min(ce, 80.0)),
            Z_LOSS_TAG: float(m["z"]),
            GRAD_NORM_TAG: grad_norm,
            LR_TAG: lr,
            LR_GROUP1_TAG: lr,
            STEP_SKIPPED_TAG: float(m["skipped"]),
            STEP_SKIPPED_PARITY_TAG: float(m["skipped"]),
            TOTAL_TOKENS_TAG: float(step * tokens_per_step),
            TOTAL_TOKENS_PARITY_TAG: float(step * tokens_per_step),
            TPS_TAG: tps,
            TPS_AVG_TAG: tps_avg,
            TFLOPS_TAG: tflops,
            MFU_TAG: mfu,
            MFU_AVG_TAG: mfu_avg,
            DATA_WAIT_TAG: load_s,
            STEP_TIME_TAG: w.step_time_s,
        }
        loop.events.scalars(step, values, w.wall)
        print(
            step_line(
                step,
                self.recipe.train.max_steps,
                ce,
                grad_norm,
                lr,
                run_tps,
                tps,
                mfu,
                w.step_time_s,
                bool(m["skipped"]),
            ),
            flush=True,
        )

    def post_train(self, loop, ok: bool) -> None:
        loop.flush(gather=ok)


class EventsHook(Hook):
    """TensorBoard events: the attempt's `SessionLog.START` (readers drop what an earlier attempt logged
    from its first step on), an upload every `logging.upload_every_s`, and one at the end."""

    def __init__(self, upload_every_s: float):
        self.upload_every_s = upload_every_s

    def pre_train(self, loop) -> None:
        if loop.s.proc == 0:
            loop.events.session_start(loop.step + 1)

    def post_step(self, loop) -> None:
        if loop.exit_code is None and loop.events.due(self.upload_every_s):
            upload_events(loop)

    def post_train(self, loop, ok: bool) -> None:
        upload_events(loop)


class FaultHook(Hook):
    """The fault knobs of core/faults.py at the points they act (tests only; never set in a real run;
    each announced by a `FAULT INJECTION` line, trainer/injected.py). Set-up: the loader's rows
    (DOUBLE_SHARD), a slow restore (SLOW_START), a resume off by some batches (DATA_SHIFT). The loop:
    a hang (HANG_AT_STEP) and a failing data read (FAIL_AT_STEP) before a step, and data loading
    slowed (SLOW_DATA) as its batch is read."""

    def __init__(self, proc: int):
        self.proc = proc
        self.slow_data_s = 0.0

    def wrap_loader(self, loader):
        return injected.double_shard(loader)

    def pre_restore(self) -> None:
        injected.slow_start()

    def post_restore(self, loader) -> None:
        """After the loader took a checkpoint's data position."""
        shift = faults.data_shift(os.environ)
        if shift:
            injected.data_shift(loader, shift)

    def pre_train(self, loop) -> None:
        self.slow_data_s = injected.slow_data_s(self.proc)

    def pre_step(self, loop) -> int | None:
        from olmo_ctl.trainer.watchdog import maybe_hang

        maybe_hang(loop.step + 1, self.proc)
        injected.maybe_fail(loop.step + 1, self.proc)
        return None

    def pre_batch(self, loop) -> None:
        if self.slow_data_s:
            time.sleep(self.slow_data_s)


def upload_events(loop) -> None:
    """Process 0 uploads; a storage hiccup must not end a week-long run: the records stay pending."""
    if loop.s.proc != 0:
        return
    try:
        loop.events.upload()
    except Exception as e:  # noqa: BLE001 - storage errors come in many types (requests, api_core, OSError)
        print(
            f"warning: event upload to {loop.events.dir} failed ({e}); retrying at the next upload",
            flush=True,
        )


def default_hooks(
    s, signals: StopSignals, run_dir: str | None = None, knobs: FaultHook | None = None, attempt: int = 0
) -> list[Hook]:
    """The trainer's hooks in the order they act (see the module docstring); `s` is the run's setup,
    `run_dir` where the downstream tasks built by an earlier attempt are kept and a stop at the next
    checkpoint is asked for (of `attempt`), `knobs` the fault hook that set the attempt up (a new one
    otherwise)."""
    r = s.recipe
    return [
        EvaluatorHook.for_recipe(s, run_dir),
        StragglerHook(),
        StopHook(signals, s.final_step),
        CheckpointHook(r.checkpoint.interval, r.checkpoint.ephemeral_interval, run_dir, attempt, signals),
        MetricsHook(r, s.plan, s.device, r.logging.metrics_every),
        EventsHook(r.logging.upload_every_s),
        knobs or FaultHook(s.proc),
    ]
