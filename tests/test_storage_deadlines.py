"""Storage that stops answering ends the trainer with exit 3 within runtime.storage_timeout_s + 60 s
(a save, whose arrays and metadata go through two clients in a row: 2 x storage_timeout_s + 60 s).

A real trainer process on an emulator bucket, its clients pointed at a proxy in front of the emulator
(tests/helpers/storage_proxy.py) that, from a chosen request on, accepts and never answers: during
restore (Orbax's listing of the committed steps over gcsfs, then the arrays over tensorstore) and
during a save (tensorstore's writes). Nothing committed is lost: the committed steps are the same
after. The watchdog's absolute bounds (the first window, the storage phases) are tested in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from helpers.storage_proxy import StallingProxy

from olmo_ctl.rundir import RunDir
from olmo_ctl.sandbox.gcs_emulator import emulator_env
from olmo_ctl.trainer.watchdog import Watchdog, storage_phase_s

STORAGE_TIMEOUT_S = 12
SETS = (
    "--set",
    f"runtime.storage_timeout_s={STORAGE_TIMEOUT_S}",
    "--set",
    "eval.interval=1000",
    "--set",
    "logging.metrics_every=1",
)


def _trainer(run: str, proxy: StallingProxy, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(emulator_env(proxy.url), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "olmo_ctl.trainer", "--recipe", "smoke", "--run-dir", run]
    cmd += ["--device", "cpu-1", *SETS, *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _ended_after_hold(p: subprocess.Popen, proxy: StallingProxy, limit_s: float) -> tuple[int, float, str]:
    """(exit code, seconds from the first held request to the trainer's exit-3 line, the output). The
    line is the decision; what follows it (the journal's own bounded try on the stalled storage, the
    interpreter's teardown) is not the hang being bounded."""
    out: list[str] = []
    decided: list[float] = []

    def read() -> None:
        for line in p.stdout or ():
            out.append(line)
            if "exit 3:" in line and not decided:
                decided.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = p.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        reader.join(5)
        raise AssertionError(
            f"the trainer did not exit within {limit_s:.0f} s:\n{''.join(out)[-4000:]}"
        ) from None
    ended = time.monotonic()
    reader.join(10)
    text = "".join(out)
    assert proxy.held_since is not None, f"storage was never held:\n{text[-3000:]}"
    return code, (decided[0] if decided else ended) - proxy.held_since, text


def _committed_run(gcs, name: str, steps: int) -> str:
    """A run on the emulator bucket with checkpoints at steps//2 and steps."""
    run = f"gs://{gcs.bucket}/runs/{name}"
    with StallingProxy(gcs.url) as proxy:
        p = _trainer(run, proxy, "--stop-at-step", str(steps), "--set", f"checkpoint.interval={steps // 2}")
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-3000:]
    assert RunDir(run).committed_steps() == [steps // 2, steps]
    return run


BOUND_S = STORAGE_TIMEOUT_S + 60
# A save is two operations in a row when storage stalls: tensorstore's arrays give up (about T + 3T/8),
# then Orbax's finalize writes its metadata over gcsfs, which gives up on its own (at most T + 40 s).
SAVE_BOUND_S = 2 * STORAGE_TIMEOUT_S + 60


@pytest.mark.chaos  # a real trainer against a stalled proxy: about 35 s each
@pytest.mark.gcs
@pytest.mark.parametrize(
    "client, phase",
    [("gcsfs", "Orbax's listing of the committed steps"), ("tensorstore", "the restore of the arrays")],
)
def test_storage_that_stops_answering_during_restore_exits_3_in_bound(gcs, client, phase):
    run = _committed_run(gcs, f"restore-{client}", 4)
    with StallingProxy(gcs.url) as proxy:
        proxy.hold_when(lambda r, c=client: r.client == c)
        p = _trainer(run, proxy, "--stop-at-step", "8")
        code, after_s, text = _ended_after_hold(p, proxy, 400)
    assert code == 3, text[-4000:]
    assert after_s <= BOUND_S, f"{phase}: exit 3 came {after_s:.0f} s after storage stalled\n{text[-3000:]}"
    assert "restored checkpoint" not in text
    assert RunDir(run).committed_steps() == [2, 4]  # nothing lost


@pytest.mark.gcs
def test_storage_that_never_answers_from_the_start_exits_3_in_bound(gcs):
    """google-cloud-storage's first listing (the committed steps, before the hosts join) already has the
    recipe's deadline."""
    run = f"gs://{gcs.bucket}/runs/never"
    with StallingProxy(gcs.url) as proxy:
        proxy.hold()
        p = _trainer(run, proxy, "--stop-at-step", "2")
        code, after_s, text = _ended_after_hold(p, proxy, 400)
    assert code == 3, text[-4000:]
    assert "storage unreachable" in text and after_s <= BOUND_S, f"{after_s:.0f} s\n{text[-3000:]}"


@pytest.mark.chaos  # about a minute
@pytest.mark.gcs
def test_storage_that_stops_answering_during_a_save_exits_3_in_bound(gcs):
    run = _committed_run(gcs, "save", 2)
    with StallingProxy(gcs.url) as proxy:
        # The arrays of checkpoint 3 are the first thing tensorstore writes after the restore's reads.
        proxy.hold_when(lambda r: r.client == "tensorstore" and r.method in ("POST", "PUT"))
        p = _trainer(run, proxy, "--stop-at-step", "6", "--set", "checkpoint.interval=3")
        code, after_s, text = _ended_after_hold(p, proxy, 400)
    assert code == 3, text[-4000:]
    assert "restored checkpoint 2" in text
    assert after_s <= SAVE_BOUND_S, f"exit 3 came {after_s:.0f} s after storage stalled\n{text[-3000:]}"
    assert RunDir(run).committed_steps() == [1, 2]  # the stalled step never counts


# ---------------------------------------------------------------- the watchdog's absolute bounds


def _watching(factor: float = 5.0, min_s: float = 0.3) -> tuple[Watchdog, list[str]]:
    hangs: list[str] = []
    return Watchdog(factor, min_s, on_hang=hangs.append, poll_s=0.02).start(), hangs


def test_a_storage_phase_without_progress_is_a_hang_and_progress_keeps_it_alive():
    wd, hangs = _watching()
    with wd.judged("restore", 0.4):
        for _ in range(8):  # 0.8 s in all, never 0.4 s without progress
            time.sleep(0.1)
            wd.progress()
        assert hangs == []
        time.sleep(0.8)
    wd.close()
    assert len(hangs) == 1 and "in restore (allowed 0.4 s without progress)" in hangs[0]


def test_the_first_window_is_judged_by_the_compile_time():
    """The first dispatch (the compile) is not judged; what follows may take factor x its time."""
    wd, hangs = _watching(factor=3.0, min_s=0.1)
    with wd.first_dispatch(True):
        time.sleep(0.3)  # the compile: longer than min_s, not judged
    assert hangs == [] and wd.allowance() == pytest.approx(0.9, abs=0.1)
    time.sleep(1.5)  # a first collective that never returns
    wd.close()
    assert len(hangs) == 1 and "in the first window" in hangs[0] and "the compile time" in hangs[0]


def test_a_timed_window_replaces_the_first_window_bound():
    wd, hangs = _watching(factor=3.0, min_s=0.1)
    wd.compiled(10.0)
    assert wd.allowance() == pytest.approx(30.0)
    wd.step_times(0.05, 4)
    assert wd.allowance() == pytest.approx(0.15)
    with wd.paused():
        assert wd.allowance() is None
    wd.close()
    assert hangs == []


def test_a_storage_timeout_below_4_s_is_bad_input():
    from olmo_ctl.core.errors import BadInput
    from olmo_ctl.core.recipe import load_recipe

    with pytest.raises(BadInput, match=r"`runtime.storage_timeout_s` must be at least 4"):
        load_recipe("smoke", overrides=["runtime.storage_timeout_s=2"])
    assert load_recipe("smoke", overrides=["runtime.storage_timeout_s=30"]).runtime.storage_timeout_s == 30


def test_every_client_gets_the_deadline():
    """What `deadlines.apply` hands each client, for a deadline of 120 s."""
    from olmo_ctl import storage
    from olmo_ctl.trainer import deadlines

    assert deadlines.tensorstore_env(120)["TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS"] == "30"
    assert deadlines.tensorstore_retries(120) == {"max_retries": 3, "initial_delay": "1s", "max_delay": "15s"}
    assert deadlines.gcsfs_config(120) == {"requests_timeout": 20.0}
    saved = storage.deadline_s()
    try:
        storage.set_deadline(20)
        assert storage.try_timeout_s() == 5.0
    finally:
        storage.set_deadline(saved)


@pytest.mark.chaos
def test_a_host_hung_in_its_first_window_exits_3_with_its_stacks(tmp_path):
    """A hang right after the first step (the first window: no step time yet, only the compile's) used to
    wait forever; now it is judged by the compile time, and ends with exit 3 and every thread's stack."""
    from helpers.trainer import train

    sets = ("--set", "runtime.watchdog_min_s=0.5", "--set", "runtime.watchdog_factor=5")
    env = {"OLMO_CTL_FAULT_HANG_AT_STEP": "2"}
    t0 = time.monotonic()
    p = train(tmp_path / "run", *SETS, *sets, env=env, expect=3)
    assert time.monotonic() - t0 < 300
    assert "watchdog: no progress" in p.stderr and "in the first window" in p.stderr, p.stderr[-3000:]
    assert "Thread 0x" in p.stderr and "maybe_hang" in p.stderr


def test_storage_phases_are_bounded_by_the_storage_timeout():
    from olmo_ctl.core.recipe import RuntimeConfig

    assert storage_phase_s(RuntimeConfig()) == 10 * 120.0
    assert storage_phase_s(RuntimeConfig(storage_timeout_s=10, watchdog_factor=2)) == 300.0  # min_s
