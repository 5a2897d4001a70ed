"""Retry policy: backoff, retry budget with reset on progress, stall detection (pure, fake clock)."""

from __future__ import annotations

import random

import pytest

from olmo_ctl.core.errors import BadInput
from olmo_ctl.supervise.policy import DEFAULT_BACKOFF_S, RetryBudget, RetryPolicy, StallWatch


def test_backoff_is_exponential_with_jitter_and_capped():
    p = RetryPolicy(backoff_base_s=10, backoff_cap_s=100, jitter=0.25)
    rng = random.Random(0)
    for n, full in [(0, 10), (1, 10), (2, 20), (3, 40), (4, 80), (5, 100), (12, 100)]:
        draws = [p.backoff_s(n, rng) for _ in range(200)]
        assert max(draws) <= full + 1e-9
        assert min(draws) >= full * 0.75 - 1e-9
        assert max(draws) - min(draws) > full * 0.1  # jitter really spreads the delays
    assert RetryPolicy(backoff_base_s=0).backoff_s(5) == 0


def test_budget_counts_only_attempts_without_progress_and_resets():
    b = RetryBudget(max_retries=3, best_step=100)
    assert b.record(100) and b.failures_in_row == 1
    assert b.record(100) and b.failures_in_row == 2
    assert b.record(140) and b.failures_in_row == 0  # progress refills the budget
    assert b.record(140)
    assert b.record(140)
    assert not b.record(140)  # 3 in a row without progress: a crash loop
    assert b.failures_in_row == 3


def test_flags_win_over_env_which_win_over_defaults(monkeypatch):
    for name in (
        "RETRY_BACKOFF_SECONDS",
        "MAX_RETRIES",
        "OLMO_CTL_RETRY_BACKOFF_SECONDS",
        "OLMO_CTL_MAX_RETRIES",
    ):
        monkeypatch.delenv(name, raising=False)
    p = RetryPolicy.from_env()
    assert p.backoff_base_s == DEFAULT_BACKOFF_S == 300
    monkeypatch.setenv("RETRY_BACKOFF_SECONDS", "7")
    monkeypatch.setenv("MAX_RETRIES", "2")
    p = RetryPolicy.from_env()
    assert (p.backoff_base_s, p.max_retries) == (7, 2)
    p = RetryPolicy.from_env(retry_backoff_s=1.5, max_retries=9)
    assert (p.backoff_base_s, p.max_retries) == (1.5, 9)
    monkeypatch.setenv("MAX_RETRIES", "many")
    with pytest.raises(BadInput, match="MAX_RETRIES"):
        RetryPolicy.from_env()
    with pytest.raises(BadInput, match="max-retries"):
        RetryPolicy.from_env(max_retries=0)


def test_stall_after_k_median_intervals():
    w = StallWatch(factor=5, min_s=10, startup_limit_s=100, started_at=0.0)
    assert w.stalled(99) is None
    w.progress(50)  # first step after 50 s of compile
    for t in (52, 54, 56, 58, 60):
        w.progress(t)
    assert w.median_interval_s() == 2
    assert w.limit_s() == 10  # 5 x 2 s = 10 s, the floor
    assert w.stalled(69) is None
    assert "no new step" in w.stalled(71)
    for t in (80, 100, 120, 140, 160, 180, 200):  # slower steps raise the limit
        w.progress(t)
    assert w.median_interval_s() == 20 and w.limit_s() == 100
    assert w.stalled(290) is None and w.stalled(301) is not None


def test_startup_longer_than_the_limit_is_a_stall():
    w = StallWatch(factor=5, min_s=10, startup_limit_s=100, started_at=1000.0)
    assert w.stalled(1099) is None
    assert "start-up/compile" in w.stalled(1101)


# ---------------------------------------------------------------- the outcome -> action table, row by row

from olmo_ctl.core.contracts import State  # noqa: E402
from olmo_ctl.supervise.policy import DONE, GIVE_UP, RETRY, STOP, History, Outcome  # noqa: E402


def _decide(
    state, committed=10, final=20, stalled=None, history=History(best_step=5), reason="why", **policy
):
    return RetryPolicy(max_retries=3, **policy).decide(
        Outcome(state, reason, committed, final, stalled), history
    )


@pytest.mark.parametrize("state", list(State))
def test_final_step_committed_is_done_whatever_the_exit(state):
    a = _decide(state, committed=20)
    assert (a.kind, a.event, a.exit_code) == (DONE, "succeeded", 0)
    assert a.reason == ("why" if state == State.SUCCEEDED else f"final step committed ({state.value}: why)")


def test_user_failure_stops_with_exit_1_and_spends_nothing():
    h = History(failures_in_row=1, best_step=5)
    a = _decide(State.FAILED_USER, history=h)
    assert (a.kind, a.event, a.reason, a.exit_code, a.history) == (STOP, "failed", "failed-user: why", 1, h)


def test_user_failure_is_retried_when_asked():
    a = _decide(State.FAILED_USER, retry_user_errors=True)
    assert (a.kind, a.event, a.reason, a.journal) == (RETRY, "failed", "failed-user: why", True)


def test_a_stalled_user_failure_is_a_stall_not_a_stop():
    a = _decide(State.FAILED_USER, stalled="no progress")
    assert (a.kind, a.event, a.reason, a.journal) == (RETRY, "stalled", "no progress", False)


@pytest.mark.parametrize(
    "state,event,reason",
    [
        (State.PREEMPTED, "preempted", "why"),
        (State.FAILED_INFRA, "failed", "failed-infra: why"),
        (State.MISSING, "failed", "missing: why"),
        (State.SUCCEEDED, "failed", "exited cleanly at committed step 10 < final 20"),
    ],
)
def test_retry_rows(state, event, reason):
    a = _decide(state)
    assert (a.kind, a.event, a.reason, a.journal, a.exit_code) == (RETRY, event, reason, True, None)
    assert a.failure == f"{event} ({reason})"
    assert a.history == History(0, 10)  # progress (5 -> 10) refills the budget


def test_the_third_attempt_in_a_row_without_progress_gives_up():
    h = History(failures_in_row=2, best_step=10)
    a = _decide(State.PREEMPTED, committed=10, history=h)
    assert (a.kind, a.event, a.exit_code) == (GIVE_UP, "preempted", 4)
    assert a.history == History(3, 10)
    assert a.gave_up == (
        "crash loop: 3 attempts in a row ended without a new committed step (still 10/20); last: why"
    )
    assert _decide(State.PREEMPTED, committed=11, history=h).kind == RETRY  # one more step: not a loop
    assert _decide(State.PREEMPTED, committed=10, history=History(1, 10)).kind == RETRY


def test_the_prefixed_names_win_and_each_backend_has_its_own_backoff(monkeypatch):
    from olmo_ctl.backends import backend_class

    for name in (
        "RETRY_BACKOFF_SECONDS",
        "MAX_RETRIES",
        "OLMO_CTL_RETRY_BACKOFF_SECONDS",
        "OLMO_CTL_MAX_RETRIES",
    ):
        monkeypatch.delenv(name, raising=False)
    # A SIGKILLed 15 s local run does not wait five minutes for its next attempt.
    local, gke = backend_class("local").retry_backoff_s, backend_class("gke").retry_backoff_s
    assert (local, gke) == (5.0, 300.0)
    assert RetryPolicy.from_env(default_backoff_s=local).backoff_base_s == 5.0
    monkeypatch.setenv("RETRY_BACKOFF_SECONDS", "7")
    monkeypatch.setenv("OLMO_CTL_RETRY_BACKOFF_SECONDS", "3")
    monkeypatch.setenv("OLMO_CTL_MAX_RETRIES", "4")
    p = RetryPolicy.from_env(default_backoff_s=local)
    assert (p.backoff_base_s, p.max_retries) == (3, 4)
    monkeypatch.setenv("OLMO_CTL_MAX_RETRIES", "x")
    with pytest.raises(BadInput, match="OLMO_CTL_MAX_RETRIES"):
        RetryPolicy.from_env()


def test_a_restart_loop_is_counted_only_after_runs_and_reset_by_a_new_checkpoint():
    from olmo_ctl.supervise.policy import RestartLoop

    loop = RestartLoop(limit=3)
    assert loop.observe(5, False, 10) is None  # restarts before the watch began are not a loop
    for r in (6, 7, 8, 9):  # restarts of pods that never ran (a kubelet refusing them): not counted
        assert loop.observe(r, False, 10) is None
    assert loop.counted == 0
    assert loop.observe(9, True, 10) is None
    assert loop.observe(10, True, 10) is None and loop.counted == 1
    assert loop.observe(11, True, 10) is None and loop.counted == 2
    assert loop.observe(12, True, 20) is None and loop.counted == 1  # a new checkpoint: the count restarts
    assert loop.observe(13, True, 20) is None
    why = loop.observe(14, True, 20)
    assert why == (
        "the JobSet restarted 3 times after its trainers ran with no new checkpoint since step 20 "
        "(a restart loop; limit 3)"
    )


def test_crashes_are_counted_once_each_and_past_max_restarts_end_the_attempt():
    """A crashed Job is seen on several polls (it lasts while it is deleted): counted once by its uid;
    the JobSet's maxRestarts crashes are allowed, one more is the end, whatever JobSet counted."""
    from olmo_ctl.supervise.policy import CrashCount

    c = CrashCount()
    crash = ("r-a1-slice-0", "uid-1", "Container trainer ... exit code 137 matching FailJob rule at index 3")
    assert c.observe((crash,), 3) == (["r-a1-slice-0: " + crash[2]], None)
    assert c.observe((crash,), 3) == ([], None)  # the same Job again
    for i in (2, 3):
        new, why = c.observe((("r-a1-slice-1", f"uid-{i}", "exit code 139 ... rule at index 3"),), 3)
        assert len(new) == 1 and why is None
    new, why = c.observe((("r-a1-slice-0", "uid-4", "exit code 137 ... rule at index 3"),), 3)
    assert why is not None and why.startswith("4 crashes counted, more than the JobSet's maxRestarts 3")
    assert "r-a1-slice-0: exit code 137" in why
    assert CrashCount().observe((crash,), None)[1] is None  # no limit known: never ends the attempt
