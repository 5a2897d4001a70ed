"""What the trainer writes and everyone else reads: one formatter and one parser each."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from olmo_ctl.core import contracts
from olmo_ctl.core.contracts import (
    CE_LOSS_TAG,
    EXIT_SIGTERM,
    METRIC_TAG_PREFIXES,
    PRIMARY_LOSS_TAGS,
    TRAINER_TAGS,
    VOLATILE_TAG_PREFIXES,
    State,
    committed_line,
    exit_state,
    host_tag,
    lm_eval_tags,
    log_progress,
    parse_committed_line,
    parse_host_tag,
    parse_segment_name,
    parse_step_line,
    primary_loss_tag,
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


# ---------------------------------------------------------------- metric tags

PKG = Path(contracts.__file__).resolve().parent.parent
CONTRACTS = Path(contracts.__file__).resolve()
# Strings that start like a tag but are not one: run-directory paths.
NOT_TAGS = {
    ("olmo_ctl/observe/verify.py", "eval/verify"),  # CACHE_DIR
    ("olmo_ctl/trainer/downstream.py", "eval/downstream"),  # CACHE_DIR
    # Owned by an in-flight change to `olmo-ctl evaluate`: to become `contracts.EVAL_LOSS_TAG` there.
    ("olmo_ctl/checkpoints/evaluate.py", "eval/lm_loss"),
}


def test_primary_loss_tag_names_each_objective_or_says_the_known_ones():
    from olmo_ctl.core.errors import BadInput

    assert primary_loss_tag() == primary_loss_tag("lm") == CE_LOSS_TAG == "train/CE loss"
    assert set(PRIMARY_LOSS_TAGS.values()) <= set(TRAINER_TAGS)
    with pytest.raises(BadInput) as e:
        primary_loss_tag("dpo")
    assert "'dpo'" in e.value.message and "lm" in (e.value.hint or "")
    assert not isinstance(e.value, KeyError)


def test_every_tag_has_a_known_prefix_and_host_tags_round_trip():
    assert len(set(TRAINER_TAGS)) == len(TRAINER_TAGS)
    for tag in (*TRAINER_TAGS, *lm_eval_tags("c4_en"), contracts.DOWNSTREAM_PREFIX, host_tag(3, "compute_s")):
        assert tag.startswith(METRIC_TAG_PREFIXES), tag
    assert all(p.startswith(METRIC_TAG_PREFIXES) for p in VOLATILE_TAG_PREFIXES)
    assert host_tag(12, "data_wait_s") == "hosts/12/data_wait_s"
    assert parse_host_tag(host_tag(12, "data_wait_s")) == (12, "data_wait_s")
    for other in ("hosts/x/step_time_s", "hosts/1/a/b", "train/CE loss", "host/1/compute_s"):
        assert parse_host_tag(other) is None


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def spelled_tags(source: str, rel: str) -> list[str]:
    """`rel:line: 'text'` for each string literal of `source` (not a docstring) that is a metric tag,
    starts like one (`METRIC_TAG_PREFIXES`, f-strings' literal parts included). Prose that mentions a
    tag (a help text, a message) is left alone."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
            continue
        text = node.value
        if (rel, text) in NOT_TAGS:
            continue
        if text in TRAINER_TAGS or text.startswith(METRIC_TAG_PREFIXES):
            found.append(f"{rel}:{node.lineno}: {text!r}")
    return found


def test_no_metric_tag_or_journal_event_is_spelled_outside_the_contracts():
    """Every metric tag is named in core/contracts.py only: writers and readers use its constants
    (the training loss: `primary_loss_tag(objective)`), so a new objective's tag is added in one place.
    (Journal event names are not checked yet: see rundir.JOURNAL_EVENTS.)"""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if path.resolve() == CONTRACTS:
            continue
        rel = path.relative_to(PKG.parent).as_posix()
        found += spelled_tags(path.read_text(), rel)
    assert not found, (
        "metric tags spelled outside olmo_ctl/core/contracts.py (use its constants):\n" + "\n".join(found)
    )


def test_the_tag_check_sees_literals_and_fstrings_but_not_docstrings_or_prose():
    src = (
        '"""Reads `train/CE loss`."""\n'
        'A = "train/CE loss"\n'
        'B = f"hosts/{h}/compute_s"\n'
        "C = \"pass --tags 'optim/total grad norm'\"\n"
        'def f():\n    """eval/lm_loss in prose"""\n    return "train/ CE"\n'
        'D = "eval/verify"\n'
    )
    assert [x.split(": ")[0] for x in spelled_tags(src, "olmo_ctl/observe/verify.py")] == [
        "olmo_ctl/observe/verify.py:2",
        "olmo_ctl/observe/verify.py:3",
        "olmo_ctl/observe/verify.py:7",
    ]
