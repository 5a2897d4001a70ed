"""Upload throttling (OLMo-core's throttle_uploads): with `checkpoint.upload_hosts=K` the hosts of a
multi-host run write their checkpoint shards in rounds of K, one round after the other, and the run
saves and resumes exactly as one whose hosts all write at once. Real trainers: 4 processes (cpu-4x1)
joined by jax.distributed, through the local backend."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from helpers.attempts import attempt as make_attempt
from helpers.trainer import same_steps, scalars
from helpers.waiting import wait_for

from olmo_ctl.backends.base import State
from olmo_ctl.backends.local import LocalBackend
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.trainer.checkpoint import Checkpointer, UploadRounds

WROTE = re.compile(
    r"^host (\d): checkpoint (\d+): host (\d) wrote shards in round (\d+) \(([\d.]+)\.\.([\d.]+)\)$"
)


def run(tmp_path: Path, name: str, attempt: int, stop: int, *sets: str):
    """One attempt of `name` on cpu-4x1 until `stop` (a checkpoint every 3 steps); its log lines."""
    backend = LocalBackend(str(tmp_path), stop_grace_s=60)
    extra = ("--set", "train.max_steps=100", "--set", "checkpoint.interval=3", "--set", "eval.interval=1000")
    extra += ("--set", "logging.metrics_every=1", "--stop-at-step", str(stop), *sets)
    a = make_attempt(name, str(tmp_path / name), attempt, "cpu-4x1", recipe_path="smoke", extra_args=extra)
    h = backend.send(backend.render(a))
    st = wait_for(lambda: (s := backend.status(h)).state != State.RUNNING and s, 600, "the attempt to end")
    lines = Path(h.data["log"]).read_text(errors="replace").splitlines()
    assert st.state == State.SUCCEEDED, lines[-30:]
    return lines


def writes(lines: list[str]) -> dict[int, list[tuple[int, int, float, float]]]:
    """{step: [(host, round, start, end)]} from the hosts' `wrote shards` lines."""
    out: dict[int, list] = {}
    for ln in lines:
        if m := WROTE.match(ln):
            assert m.group(1) == m.group(3)  # each host logs its own writes
            out.setdefault(int(m.group(2)), []).append(
                (int(m.group(3)), int(m.group(4)), float(m.group(5)), float(m.group(6)))
            )
    return out


def test_rounds_by_process_index():
    assert [(UploadRounds(2, i, 5).round, UploadRounds(2, i, 5).rounds) for i in range(5)] == [
        (0, 3), (0, 3), (1, 3), (1, 3), (2, 3)
    ]  # fmt: skip
    assert UploadRounds.for_world(0) is None and UploadRounds.for_world(1) is None  # one process: untouched


def test_upload_hosts_is_validated_and_not_fingerprinted():
    with pytest.raises(BadInput, match="checkpoint.upload_hosts"):
        load_recipe("smoke", overrides=["checkpoint.upload_hosts=-1"])
    assert (
        load_recipe("smoke", overrides=["checkpoint.upload_hosts=2"]).fingerprint()
        == load_recipe("smoke").fingerprint()
    )


@pytest.mark.chaos  # three 4-process attempts: ~95 s on a 2-core machine
def test_one_host_at_a_time_writes_in_turn_and_resumes_like_all_at_once(tmp_path):
    throttled = ("--set", "checkpoint.upload_hosts=1")
    lines = run(tmp_path, "one", 1, 6, *throttled)  # saves 3 and 6, one host at a time
    w = writes(lines)
    assert sorted(w) == [3, 6]
    for step, ws in w.items():
        assert sorted((h, r) for h, r, _, _ in ws) == [(0, 0), (1, 1), (2, 2), (3, 3)], step
        spans = sorted((r, t0, t1) for _, r, t0, t1 in ws)
        for (_, _, end), (r, start, _) in zip(spans, spans[1:], strict=False):
            assert start >= end, f"checkpoint {step}: round {r} started before the previous one ended"
    lines = run(tmp_path, "one", 2, 9, *throttled)
    assert any("restored checkpoint 6" in ln for ln in lines)
    assert sorted(writes(lines)) == [9]

    all_at_once = run(tmp_path, "all", 1, 9)
    assert writes(all_at_once) == {}  # upload_hosts 0: Orbax's own handler, no rounds
    assert same_steps(scalars(tmp_path / "all"), scalars(tmp_path / "one"), range(1, 10)) == []
    # the throttled checkpoint holds the same bits as the unthrottled one
    a, _ = Checkpointer.for_run(str(tmp_path / "one")).restore_host(6)
    b, _ = Checkpointer.for_run(str(tmp_path / "all")).restore_host(6)
    import jax

    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
