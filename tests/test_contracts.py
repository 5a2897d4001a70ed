"""What the trainer writes and everyone else reads: one formatter and one parser each."""

from __future__ import annotations

import pytest

from olmo_ctl.core.contracts import (
    EXIT_SIGTERM,
    State,
    committed_line,
    exit_state,
    log_progress,
    parse_committed_line,
    parse_segment_name,
    parse_step_line,
    segment_name,
    segment_names_from,
    step_line,
)


def test_step_line_round_trips():
    line = step_line(12, 100, 3.14159, 0.5, 1e-4, 24691.2, 12345.6, 0.4321, 0.33218, skipped=True)
    assert line == (
        "step 12/100 loss 3.1416 grad_norm 0.5000 lr 1.000e-04 tokens/s 24691 (12346/device) mfu 43.21%"
        " step_time 332.2 ms skipped"
    )
    p = parse_step_line(line)
    assert (p.step, p.final, p.loss) == (12, 100, "3.1416")
    assert (p.tokens_per_s, p.tokens_per_s_per_device, p.mfu, p.step_time_s) == (24691, 12346, 0.4321, 0.3322)
    assert parse_step_line("host 1: step 3/9 loss 2.0000").tokens_per_s is None  # a line without figures
    for other in ("training steps 1..10 of 10 on cpu-1", "eval step 5 lm_loss 2.0", "committed step 5", ""):
        assert parse_step_line(other) is None


def test_committed_line_round_trips():
    assert parse_committed_line(committed_line(40)) == 40
    assert parse_committed_line("  committed step 7 \n") == 7
    assert parse_committed_line("committed step 7 of 8") is None


def test_log_progress_reads_a_tail():
    lines = [step_line(s, 10, 2.0 - s / 10, 1, 1e-3, 2, 1, 0.1, 0.5) for s in (3, 4, 5)] + [committed_line(5)]
    seen = log_progress(lines)
    assert (seen.step, seen.final, seen.loss, seen.committed, seen.max_step) == (5, 10, "1.5000", 5, 5)
    assert log_progress(lines[:-1]).committed is None  # only a last line counts
    assert log_progress([]).step is None


@pytest.mark.parametrize(
    "code,state",
    [
        (None, State.RUNNING),
        (0, State.SUCCEEDED),
        (EXIT_SIGTERM, State.PREEMPTED),
        (-15, State.PREEMPTED),
        (137, State.PREEMPTED),
        (-9, State.PREEMPTED),
        (1, State.FAILED_USER),
        (2, State.FAILED_USER),
        (3, State.FAILED_INFRA),
        (-11, State.FAILED_INFRA),
        (42, State.FAILED_INFRA),
    ],
)
def test_exit_state(code, state):
    assert exit_state(code)[0] == state
    assert state.live == (code is None)


def test_segment_names_sort_by_start_and_parse_back():
    name = segment_name(1_700_000_000, "host.a.b", 3, 12)
    assert name == "events.out.tfevents.1700000000.host-a-b.a0003.s00012"
    assert parse_segment_name(name) == (1_700_000_000, "host-a-b", 3, 12)
    assert parse_segment_name("events.out.tfevents.1700000000.otherhost") == (
        1_700_000_000,
        "otherhost",
        None,
        None,
    )
    assert parse_segment_name("README") is None
    assert segment_names_from(1_700_000_000.9) <= name < segment_names_from(1_700_000_001)
