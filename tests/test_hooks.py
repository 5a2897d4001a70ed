"""The training loop's hooks act in the order the trainer always acted in: evaluate, decide to stop,
checkpoint, fetch the metrics, upload the events; a non-finite loss is caught before its step is
logged; the end runs every hook even when one fails, and never gathers on the exception path.

The hooks are the real ones (trainer/hooks.py); the loop around them is a recorder (the real loop
runs in the trainer tests: test_trainer_resume, test_trainer_signals, test_multihost)."""

from __future__ import annotations

import contextlib
import math
import signal
from types import SimpleNamespace

import pytest

from olmo_ctl.core.batching import make_plan
from olmo_ctl.core.contracts import EXIT_SIGTERM, parse_step_line
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.trainer import hooks as H
from olmo_ctl.trainer.evaluator import Evaluation, Evaluator, HeldOutLoss
from olmo_ctl.trainer.exits import TrainingFailed

RECIPE = load_recipe("smoke")
DEVICE = get_device("cpu-1")
PLAN = make_plan(RECIPE, DEVICE)


class FakeSignals:
    def __init__(self, requested_at: int | None = None, signal_: int | None = None):
        self.requested_at, self.signal, self.hosts = requested_at, signal_, False

    def requested(self, step: int) -> bool:
        return step == self.requested_at


class Loop:
    """What the hooks see of the loop; every action lands in `log`."""

    def __init__(
        self, step: int, pending: int = 0, due: bool = False, n_proc: int = 1, fail_close: bool = False
    ):
        self.log: list[tuple] = []
        log = self.log
        self.s = SimpleNamespace(proc=0, n_proc=n_proc, recipe=RECIPE)
        self.step, self.state, self.steps_run, self.exit_code = step, {"params": "p"}, 1, None
        self.pending = [(step - i, {}, 0.0) for i in range(pending)]
        self.loader = SimpleNamespace(state=lambda: {"batches_seen": step}, fingerprint="fp")

        def close():
            log.append(("ckpt.close",))
            if fail_close:
                raise OSError("storage went away")

        self.ckpt = SimpleNamespace(
            save=lambda st, state, meta: log.append(("save", st, meta["step"])) or 0.5,
            wait=lambda: log.append(("wait",)),
            close=close,
        )
        self.events = SimpleNamespace(
            dir="events",
            due=lambda every_s: due,
            scalars=lambda st, values, wall=None: log.append(("scalars", st, sorted(values)[0])),
            upload=lambda: log.append(("upload",)),
            session_start=lambda st: log.append(("session_start", st)),
        )
        self.watchdog = SimpleNamespace(
            paused=contextlib.nullcontext, judged=lambda what, seconds: contextlib.nullcontext()
        )

    def flush(self, gather: bool = True) -> None:
        self.log.append(("flush", len(self.pending), gather))
        self.pending.clear()


def hooks(
    signals=None, final_step: int = 20, eval_every: int = 5, ckpt_every: int = 5, metrics_every: int = 4
):
    held_out = HeldOutLoss(lambda params, batch: ([4.0, 2.0], [1.0, 1.0]), [{"input_ids": None}], eval_every)
    return [
        H.EvaluatorHook([held_out]),
        H.StragglerHook(),
        H.StopHook(signals or FakeSignals(), final_step),
        H.CheckpointHook(ckpt_every),
        H.MetricsHook(RECIPE, PLAN, DEVICE, metrics_every),
        H.EventsHook(5.0),
    ]


def test_the_default_order():
    no_eval = load_recipe("smoke", overrides=["eval.batches=0"])  # no held-out batches to put on a mesh
    s = SimpleNamespace(recipe=no_eval, mesh=None, proc=0, n_proc=1, final_step=20, plan=PLAN, device=DEVICE)
    found = H.default_hooks(s, H.StopSignals())
    assert [type(h).__name__ for h in found] == [
        "EvaluatorHook",
        "StragglerHook",
        "StopHook",
        "CheckpointHook",
        "MetricsHook",
        "EventsHook",
        "FaultHook",
    ]
    assert found[0].evaluators == []  # no held-out batches, no eval.lm, no downstream tasks: none runs


class Recorded(Evaluator):
    """An evaluator of its own: one class, plugged into the one evaluation hook."""

    def __init__(self, name: str, interval: int, log: list):
        self.name, self.interval, self.log = name, interval, log

    def run(self, params) -> Evaluation:
        self.log.append(("run", self.name, params))
        return Evaluation({f"eval/{self.name}": 1.0}, f"{self.name} 1.0000")


def test_every_evaluator_runs_at_its_own_interval_in_order_after_a_fetch(capsys):
    loop = Loop(step=10, pending=2)
    hook = H.EvaluatorHook(
        [Recorded("a", 5, loop.log), Recorded("b", 3, loop.log), Recorded("c", 10, loop.log)]
    )
    hook.post_step(loop)
    assert loop.log == [
        ("flush", 2, True),
        ("run", "a", "p"),
        ("scalars", 10, "eval/a"),
        ("flush", 0, True),
        ("run", "c", "p"),
        ("scalars", 10, "eval/c"),
    ]
    assert capsys.readouterr().out.splitlines() == ["eval step 10 a 1.0000", "eval step 10 c 1.0000"]


def test_the_final_step_is_evaluated_then_saved_committed_and_uploaded_once(capsys):
    loop = Loop(step=20, pending=3, due=True)
    assert H.post_step(hooks(final_step=20), loop) == 0
    assert loop.log == [
        ("flush", 3, True),
        ("scalars", 20, "eval/lm_loss"),
        ("flush", 0, True),
        ("save", 20, 20),
        ("wait",),
        ("scalars", 20, "checkpoint/save_duration_s"),
        ("upload",),
    ]  # no periodic fetch or upload after the final save
    assert "eval step 20 lm_loss 3.0000" in capsys.readouterr().out


def test_a_stop_saves_the_step_it_is_in_and_exits_143():
    loop = Loop(step=7, pending=2, due=True)
    assert H.post_step(hooks(FakeSignals(requested_at=7)), loop) == EXIT_SIGTERM
    assert loop.log == [
        ("flush", 2, True),
        ("save", 7, 7),
        ("wait",),
        ("scalars", 7, "checkpoint/save_duration_s"),
        ("upload",),
    ]


def test_an_interval_checkpoint_is_not_waited_for_and_the_loop_goes_on():
    loop = Loop(step=15, pending=1, due=True)
    assert H.post_step(hooks(eval_every=4), loop) is None
    assert loop.log == [
        ("flush", 1, True),
        ("save", 15, 15),
        ("scalars", 15, "checkpoint/save_duration_s"),
        ("upload",),
        ("upload",),
    ]  # the upload timer is asked after the save, as always


def test_metrics_are_fetched_every_metrics_every_steps_then_the_events_uploaded_when_due():
    assert H.post_step(hooks(), loop := Loop(step=6, pending=4, due=True)) is None
    assert loop.log == [("flush", 4, True), ("upload",)]
    assert H.post_step(hooks(), loop := Loop(step=6, pending=3, due=False)) is None
    assert loop.log == []


def test_a_signal_before_any_step_ends_the_attempt_without_a_step():
    h = hooks(FakeSignals(signal_=signal.SIGTERM))
    loop = Loop(step=4)
    loop.steps_run = 0
    assert H.pre_step(h, loop) == EXIT_SIGTERM
    loop.steps_run = 1  # a step ran: it is saved after the step instead
    assert H.pre_step(h, loop) is None


def _window(*losses: float, index: int = 2, gather: bool = True) -> H.Window:
    steps = [
        (10 + i, {"ce": ce, "grad_norm": 1.0, "lr": 1e-3, "z": 0.1, "skipped": 0.0}, 0.01)
        for i, ce in enumerate(losses, start=1)
    ]
    return H.Window(
        steps, step_time_s=0.5, elapsed_s=10.0, wall=1.0, index=index, steps_run=12, gather=gather
    )


def test_each_fetched_step_is_logged_and_a_non_finite_loss_stops_before_its_step_is_logged(capsys):
    loop = Loop(step=13)
    with pytest.raises(TrainingFailed, match="loss is not finite at step 12"):
        H.window(hooks(), loop, _window(2.5, math.nan, 2.4))
    # hosts' timings for the window first, then step 11 logged, then the NaN of step 12 stops it
    assert loop.log == [("scalars", 13, "hosts/0/compute_s"), ("scalars", 11, "optim/LR (group 0)")]
    lines = [parse_step_line(x) for x in capsys.readouterr().out.splitlines()]
    assert [(p.step, p.loss) for p in lines if p] == [(11, "2.5000")]


def test_the_first_window_is_never_timed():
    loop = Loop(step=12)
    H.window(hooks(), loop, _window(2.5, index=1))
    assert loop.log == [("scalars", 11, "optim/LR (group 0)")]


def test_the_end_runs_every_hook_even_after_a_failure_and_gathers_nothing(monkeypatch):
    from olmo_ctl.trainer import multihost

    def no_collective(values):
        raise AssertionError("a collective on the exception path")

    monkeypatch.setattr(multihost, "allgather_floats", no_collective)
    loop = Loop(step=9, pending=2, n_proc=2, fail_close=True)
    closed = []
    with pytest.raises(OSError, match="storage went away"):
        H.post_train(hooks(), loop, False, lambda: closed.append("loader"))
    assert loop.log == [("ckpt.close",), ("flush", 2, False), ("upload",)] and closed == ["loader"]
    H.window(hooks(), loop, _window(2.5, gather=False))  # several hosts, exception path: no hosts/* timings
    assert loop.log[-1] == ("scalars", 11, "optim/LR (group 0)")


def test_the_attempt_opens_with_a_session_start_at_its_first_step():
    loop = Loop(step=40)
    H.pre_train(hooks(), loop)
    assert loop.log == [("session_start", 41)]


def test_the_training_loop_stays_short():
    """The loop is a loop: what it does around a step lives in hooks.py and the modules named in its
    docstring, not in train.py."""
    from pathlib import Path

    train = Path(__file__).resolve().parent.parent / "olmo_ctl" / "trainer" / "train.py"
    assert len(train.read_text().splitlines()) <= 350


def test_the_fault_knobs_act_before_a_step_after_the_stop_check(monkeypatch, capsys):
    """FaultHook comes last: a stop before the first step ends the attempt before any knob acts; else
    the failing data read (FAIL_AT_STEP) raises before the step, and slow data loading (SLOW_DATA) is
    slept as its batch is read."""
    from olmo_ctl.core import faults

    monkeypatch.setenv(faults.FAIL_AT_STEP.name, "8:0")
    monkeypatch.setenv(faults.SLOW_DATA.name, "0:1")
    found = [H.StopHook(FakeSignals(signal_=signal.SIGTERM), 20), H.FaultHook(proc=0)]
    loop = Loop(step=7)
    loop.steps_run = 0
    H.pre_train(found, loop)
    assert found[1].slow_data_s == 0.001
    assert H.pre_step(found, loop) == EXIT_SIGTERM  # the stop: no knob acted
    found[0] = H.StopHook(FakeSignals(), 20)
    with pytest.raises(OSError, match="injected data read error on host 0 before step 8"):
        H.pre_step(found, loop)
    H.pre_batch(found, loop)  # 1 ms
    out = capsys.readouterr().out
    assert "FAULT INJECTION: data loading on host 0 slowed by 1 ms" in out
    assert "FAULT INJECTION: host 0's data read fails before step 8" in out
