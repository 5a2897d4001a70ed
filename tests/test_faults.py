"""Fault knobs: one table in core/faults.py, the same table in docs/testing.md, and how each value reads."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from olmo_ctl.core import faults

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_table_lists_every_knob_and_no_other():
    text = (ROOT / "docs" / "testing.md").read_text()
    section = text.split("## Fault knobs", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(OLMO_CTL_\w+)` \| `([^`]*)` \| ([^|]+) \|", section, re.MULTILINE)
    assert [(n, v, who.strip().strip("`")) for n, v, who in rows] == [
        (k.name, k.value, k.read_by) for k in faults.KNOBS
    ]


def test_no_module_but_core_faults_spells_a_knob():
    """A knob's name is a string in the code of one module only: its users import it (docstrings may say it)."""
    names = {k.name for k in faults.KNOBS}
    spelled = sorted(
        {
            p.relative_to(ROOT).as_posix()
            for p in (ROOT / "olmo_ctl").rglob("*.py")
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.Constant) and node.value in names
        }
    )
    assert spelled == ["olmo_ctl/core/faults.py"]


@pytest.mark.parametrize(
    "value, step, host, hangs",
    [
        ("8", 8, 0, True),
        ("8", 8, 3, True),
        ("8", 7, 0, False),
        ("8:1", 8, 1, True),
        ("8:1", 8, 0, False),
        ("", 8, 0, False),
        ("x", 8, 0, False),
        ("8:x", 8, 0, False),
    ],
)
def test_hang_at_step(value, step, host, hangs):
    assert faults.hangs({faults.HANG_AT_STEP.name: value}, step, host) is hangs


def test_hang_at_step_reads_step_and_host():
    assert faults.hang_at_step({faults.HANG_AT_STEP.name: "12:3"}) == (12, 3)
    assert faults.hang_at_step({faults.HANG_AT_STEP.name: "12"}) == (12, None)
    assert faults.hang_at_step({}) is None


@pytest.mark.parametrize(
    "value, host, ms",
    [
        ("1:150", 1, 150.0),
        ("1:150", 0, 0.0),
        ("0:2.5", 0, 2.5),
        ("1:", 1, 0.0),
        ("a:5", 0, 0.0),
        ("", 0, 0.0),
    ],
)
def test_slow_data(value, host, ms):
    assert faults.slow_data_ms({faults.SLOW_DATA.name: value}, host) == ms


def test_data_shift_and_smoke_faults():
    assert faults.data_shift({}) == 0
    assert faults.data_shift({faults.DATA_SHIFT.name: "-2"}) == -2
    assert faults.smoke_faults(" lr, data-shift ,") == {"lr", "data-shift"}
    assert faults.smoke_faults(None) == set()
