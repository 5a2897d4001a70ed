"""`olmo-ctl monitor`: run directories built with TensorBoard's writer, a journal and committed checkpoints."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers.attempts import attempt_of
from helpers.cli import invoke
from helpers.events import T0, TAGS, value, write_segment

from olmo_ctl.observe.monitor import build_report, load

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "docs" / "monitor-schema.json").read_text())
TOKENS_PER_STEP = 8 * 128  # smoke recipe: global batch 8 x seq 128


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def cli(*args, env=None):
    """`olmo-ctl ARGS` in this process (helpers.cli.invoke); `env` adds to this environment."""
    return invoke(*args, env={**os.environ, **(env or {})})


def values(tag, step, desync=None):
    if tag == "throughput/total tokens":
        return float(step * TOKENS_PER_STEP)
    return value(tag, step, desync=desync)


def write_run_yaml(run: Path, max_steps: int = 200, device: str = "cpu-2") -> None:
    from olmo_ctl.core.recipe import load_recipe

    r = load_recipe("smoke", overrides=[f"train.max_steps={max_steps}"])
    run.mkdir(parents=True, exist_ok=True)
    (run / "run.yaml").write_text(
        yaml.safe_dump(
            {
                "run": run.name,
                "created": iso(T0 - 30),
                "recipe": r.to_dict(),
                "recipe_fingerprint": r.fingerprint(),
                "data_fingerprint": "x",
                "device": device,
            },
            sort_keys=False,
        )
    )


def journal(run: Path, recs: list[tuple]) -> None:
    with open(run / "journal.jsonl", "w") as f:
        for t, event, attempt, reason, committed in recs:
            f.write(
                json.dumps(
                    {
                        "time": iso(t),
                        "event": event,
                        "attempt": attempt,
                        "device": "cpu-2",
                        "reason": reason,
                        "committed_step": committed,
                    }
                )
                + "\n"
            )


def commit(run: Path, *steps: int, uncommitted: tuple[int, ...] = ()) -> None:
    for s in steps:
        (run / "checkpoints" / str(s)).mkdir(parents=True)
        (run / "checkpoints" / str(s) / "commit_success.txt").write_text("ok")
    for s in uncommitted:
        (run / "checkpoints" / f"{s}.orbax-checkpoint-tmp-123").mkdir(parents=True)


def make_resumed_run(run: Path, desync: int | None = None) -> None:
    """Attempt 1 runs steps 1..60 and is preempted (checkpoint 50); attempt 2 resumes at 51 and is at 120."""
    write_run_yaml(run)
    tb = run / "tensorboard"
    write_segment(tb, range(1, 61), attempt=1, values=values)
    write_segment(
        tb,
        range(51, 121),
        attempt=2,
        start_time=1767225700,
        wall0=T0 + 30,
        values=lambda tag, s: values(tag, s, desync),
    )
    commit(run, 50, 100, uncommitted=(110,))
    journal(
        run,
        [
            (T0 - 20, "submitted", 1, "", None),
            (T0 - 20, "queued", 1, "", None),
            (T0 - 10, "admitted", 1, "", None),
            (T0 - 8, "running", 1, "", None),
            (T0 + 62, "preempted", 1, "exit 143 (SIGTERM)", 50),
            (T0 + 70, "submitted", 2, "", 50),
            (T0 + 75, "admitted", 2, "", None),
            (T0 + 76, "running", 2, "", None),
        ],
    )


def test_report_of_a_resumed_run(tmp_path):
    run = tmp_path / "r1"
    make_resumed_run(run)
    rep = build_report(load(str(run)), now=T0 + 150, ask_backend=False)
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.validate(rep, SCHEMA)
    bad = json.loads(json.dumps(rep))
    bad["checkpoint"]["committed_step"] = "100"
    with pytest.raises(jsonschema.ValidationError):  # the schema does constrain the report
        jsonschema.validate(bad, SCHEMA)
    assert rep["step"] == 120 and rep["final_step"] == 200 and rep["progress_pct"] == pytest.approx(60.0)
    assert set(rep["last"]) == set(TAGS)
    assert rep["last"]["train/CE loss"] == value("train/CE loss", 120)
    assert rep["tokens"]["seen"] == 120 * TOKENS_PER_STEP
    assert rep["tokens"]["per_s"] == pytest.approx(TOKENS_PER_STEP)  # one step per second
    assert rep["throughput"]["step_time_s"] == pytest.approx(1.0)
    assert rep["throughput"]["devices"] == 2
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.core.flops import flops_per_token_olmo_core
    from olmo_ctl.core.recipe import load_recipe

    ftok = flops_per_token_olmo_core(load_recipe("smoke").model, 128)
    assert rep["throughput"]["tflops_per_device"] == pytest.approx(TOKENS_PER_STEP / 2 * ftok / 1e12)
    assert rep["throughput"]["mfu"] == pytest.approx(
        rep["throughput"]["tflops_per_device"] / get_device("cpu-2").peak_tflops_per_device
    )
    assert rep["eta_s"] == pytest.approx(80.0)
    # Smoothed: the mean of the last 50 logged steps (71..120), a number a user can check.
    want = np.mean([np.float32(value("train/CE loss", k)) for k in range(71, 121)])
    assert rep["loss"]["train_ce_smoothed"] == pytest.approx(float(want), rel=1e-6)
    assert rep["checkpoint"] == {"committed_step": 100, "steps_at_risk": 20, "committed": [50, 100]}
    assert rep["attempt"]["attempt"] == 2 and rep["attempt"]["state"] == "running"
    assert [r["event"] for r in rep["timeline"]][:5] == [
        "submitted",
        "queued",
        "admitted",
        "running",
        "preempted",
    ]
    assert rep["replays"] == {
        "steps": 10,
        "mismatch_count": 0,
        "mismatches": [],
        "layout_rounding_count": 0,
        "rounding_tolerance": None,
    }
    assert [
        (a["attempt"], a["first_step"], a["last_step"], a["replayed_steps"])
        for a in rep["attempts_in_events"]
    ] == [(1, 1, 50, 10), (2, 51, 120, 0)]
    gp = rep["goodput"]
    # wall: first journal record (T0-20) to now (T0+150); stepping 60 + 70 s, of which 10 recomputed
    assert gp["wall_s"] == pytest.approx(170.0)
    assert gp["productive_s"] == pytest.approx(120.0)
    assert gp["lost_s"]["queueing"] == pytest.approx(10 + 5)
    # admitted -> first step of attempt 1; running -> first step of attempt 2 (its pods' start is recovery)
    assert gp["lost_s"]["startup"] == pytest.approx(10 + 4)
    assert gp["lost_s"]["recomputed"] == pytest.approx(12.0)  # steps 51..60 until preempted at T0+62
    assert gp["lost_s"]["recovery"] == pytest.approx(8 + 1)  # preempted -> submitted, admitted -> running
    assert gp["buckets"]["wasted_progress"] == gp["lost_s"]["recomputed"]
    assert gp["buckets"]["infrastructure_recovery"] == pytest.approx(9.0)
    assert gp["productive_s"] + sum(gp["buckets"].values()) == pytest.approx(gp["wall_s"])
    assert gp["productive_s"] + sum(gp["lost_s"].values()) == pytest.approx(gp["wall_s"])
    assert gp["fraction"] == pytest.approx(120 / 170)
    assert rep["warnings"] == []
    from olmo_ctl.observe.monitor import timeline_summary

    assert timeline_summary(rep["timeline"])[0] == (
        "#1 cpu-2: submitted → queued → admitted → running → preempted (exit 143 (SIGTERM))"
    )


def test_cli_json_validates_and_table_renders(tmp_path):
    run = tmp_path / "r1"
    make_resumed_run(run, desync=55)
    p = cli("monitor", str(run), "-o", "json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    import jsonschema

    jsonschema.validate(rep, SCHEMA)
    assert rep["step"] == 120 and rep["replays"]["mismatch_count"] >= 6
    assert any("differ after a resume" in w and "step 55" in w for w in rep["warnings"])
    t = cli("monitor", str(run))
    assert t.returncode == 0, t.stderr
    assert "120 / 200 (60.00%)" in t.stdout and "step 100" in t.stdout and "steps at risk" in t.stdout


def test_tensorboard_only_directory_and_event_dir(tmp_path):
    tb = tmp_path / "only" / "tensorboard"
    write_segment(tb, range(1, 21))
    for path in (tmp_path / "only", tb):
        p = cli("monitor", str(path), "-o", "json")
        assert p.returncode == 0, p.stderr
        rep = json.loads(p.stdout)
        import jsonschema

        jsonschema.validate(rep, SCHEMA)
        assert rep["step"] == 20 and rep["last"]["train/PPL"] == value("train/PPL", 20)
        assert rep["attempt"]["state"] is None and "no journal" in rep["attempt"]["source"]


def test_empty_run_and_no_checkpoint_yet(tmp_path):
    run = tmp_path / "empty"
    write_run_yaml(run)
    p = cli("monitor", str(run), "-o", "json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    import jsonschema

    jsonschema.validate(rep, SCHEMA)
    assert rep["step"] is None and rep["last"] == {} and rep["checkpoint"]["committed_step"] is None
    t = cli("monitor", str(run))
    assert t.returncode == 0 and "no steps logged yet" in t.stdout and "none committed yet" in t.stdout
    write_segment(run / "tensorboard", range(1, 11))
    rep = json.loads(cli("monitor", str(run), "-o", "json").stdout)
    assert rep["step"] == 10 and rep["checkpoint"] == {
        "committed_step": None,
        "steps_at_risk": 10,
        "committed": [],
    }


def test_truncated_last_record_is_a_warning_not_a_traceback(tmp_path):
    run = tmp_path / "r"
    write_run_yaml(run)
    p = write_segment(run / "tensorboard", range(1, 31))
    data = open(p, "rb").read()
    open(p, "wb").write(data[:-5])
    r = cli("monitor", str(run), "-o", "json")
    assert r.returncode == 0 and "Traceback" not in r.stderr
    rep = json.loads(r.stdout)
    assert rep["step"] == 30 and any("last record incomplete" in w for w in rep["warnings"])


def test_bad_paths_exit_2_with_one_line(tmp_path):
    r = cli("monitor", str(tmp_path / "nope"))
    assert r.returncode == 2 and r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "notrun").mkdir()
    (tmp_path / "notrun" / "x.txt").write_text("hi")
    r = cli("monitor", str(tmp_path / "notrun"))
    assert r.returncode == 2 and "not a run directory" in r.stderr and "Traceback" not in r.stderr


def test_warnings_stall_slow_host_loss_spike(tmp_path):
    run = tmp_path / "w"
    write_run_yaml(run, max_steps=1000)
    tb = run / "tensorboard"
    spike = lambda tag, s: 50.0 if (tag == "train/CE loss" and s == 300) else values(tag, s)  # noqa: E731
    write_segment(tb, range(1, 201), attempt=1, segment=0, values=spike)
    write_segment(tb, range(201, 301), attempt=1, segment=1, wall0=T0 - 200, step_s=2.0, values=spike)
    journal(run, [(T0 - 5, "submitted", 1, "", None), (T0 - 1, "running", 1, "", None)])
    rep = build_report(load(str(run)), now=T0 + 400 + 3600, ask_backend=False)
    w = "\n".join(rep["warnings"])
    assert "throughput below the run's median" in w
    assert "loss spike at step 300" in w
    assert "stalled: no new step for 3600 s" in w
    assert rep["throughput"]["step_time_s"] == pytest.approx(2.0)


def test_plot_png(tmp_path):
    run = tmp_path / "r1"
    make_resumed_run(run)
    out = tmp_path / "m.png"
    r = cli("monitor", str(run), "--plot", str(out))
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    import matplotlib.image as mpimg

    img = mpimg.imread(str(out))
    assert img.shape[0] > 500 and img.shape[1] > 500 and float(np.std(img)) > 0.01  # not a blank canvas


def test_watch_json_picks_up_new_steps(tmp_path):
    run = tmp_path / "live"
    write_run_yaml(run)
    write_segment(run / "tensorboard", range(1, 11), segment=0)
    p = subprocess.Popen(
        [sys.executable, "-m", "olmo_ctl", "monitor", str(run), "--watch", "-o", "json", "--interval", "0.3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        first = json.loads(p.stdout.readline())
        assert first["step"] == 10
        write_segment(run / "tensorboard", range(11, 21), segment=1)
        for _ in range(50):
            rep = json.loads(p.stdout.readline())
            if rep["step"] == 20:
                break
        assert rep["step"] == 20 and rep["reader"]["files"] == 2
    finally:
        p.terminate()
        p.wait(10)


@pytest.mark.gcs
def test_gcs_run_dir_and_missing_bucket(tmp_path, gcs):
    from olmo_ctl import storage

    local = tmp_path / "r1"
    make_resumed_run(local)
    bucket = gcs.bucket
    st = storage.store_for(f"gs://{bucket}")
    base = f"gs://{bucket}/runs/r1"
    for dp, _d, fns in os.walk(local):
        for fn in fns:
            full = os.path.join(dp, fn)
            st.write_bytes(base + "/" + os.path.relpath(full, local), open(full, "rb").read())
    r = cli("monitor", base, "-o", "json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["step"] == 120 and rep["checkpoint"]["committed_step"] == 100
    assert rep["replays"]["steps"] == 10 and rep["attempt"]["attempt"] == 2
    r = cli("monitor", "gs://no-such-bucket-here/runs/r1")
    assert r.returncode == 2 and r.stderr.startswith("error: bucket `no-such-bucket-here` does not exist")
    assert len(r.stderr.strip().splitlines()) == 1


def test_metrics_fetched_every_k_steps_share_a_wall_time(tmp_path):
    """The trainer fetches metrics every k steps: k points with one wall time. One step still takes 1 s."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    run = tmp_path / "k"
    write_run_yaml(run, max_steps=100)
    w = EventFileWriter(str(run / "tensorboard"))
    for step in range(1, 51):
        wall = T0 + 5 * ((step + 4) // 5)  # steps 1..5 at T0+5, 6..10 at T0+10, ...
        w.add_event(
            event_pb2.Event(
                wall_time=wall,
                step=step,
                summary=summary_pb2.Summary(
                    value=[
                        summary_pb2.Summary.Value(
                            tag="train/CE loss", simple_value=value("train/CE loss", step)
                        )
                    ]
                ),
            )
        )
    w.close()
    rep = build_report(load(str(run)), now=T0 + 50, ask_backend=False)
    assert rep["throughput"]["step_time_s"] == pytest.approx(1.0)
    assert rep["eta_s"] == pytest.approx(50.0)
    assert rep["goodput"]["productive_s"] == pytest.approx(50.0)


@pytest.mark.chaos
def test_watch_while_resume_until_done_survives_a_kill(tmp_path):
    """The whole loop: `resume-until-done` (local backend) runs the smoke recipe, the trainer is killed
    with SIGKILL, the supervisor resumes it; `monitor --watch` shows the kill and the resume in the
    journal timeline, and no replayed step changed value."""
    import signal
    import time

    root = tmp_path / "runs"
    sup = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "olmo_ctl",
            "resume-until-done",
            "--recipe",
            "smoke",
            "--set",
            "train.max_steps=300",
            "--run",
            "live",
            "--run-root",
            str(root),
            "--backend",
            "local",
            "--device",
            "cpu-2",
            "--retry-backoff",
            "1",
            "--poll",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    run = root / "live"
    deadline = time.time() + 400
    w = None
    try:
        while not (run / "journal.jsonl").exists() and time.time() < deadline:
            time.sleep(0.5)
        w = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "olmo_ctl",
                "monitor",
                str(run),
                "--watch",
                "-o",
                "json",
                "--interval",
                "0.5",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        while time.time() < deadline:
            rep = json.loads(w.stdout.readline())
            if (rep["step"] or 0) >= 30 and rep["attempt"]["state"] == "running":
                break
        pid = json.loads((run / "attempts" / "1.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        while time.time() < deadline:
            rep = json.loads(w.stdout.readline())
            if rep["step"] == 300 and rep["attempt"]["state"] == "succeeded":
                break
        assert rep["step"] == 300 and rep["attempt"]["attempt"] == 2, rep["attempt"]
        events = [(r["attempt"], r["event"]) for r in rep["timeline"]]
        assert (1, "running") in events and (1, "preempted") in events and (2, "running") in events
        assert events.index((1, "preempted")) < events.index((2, "running"))
        from olmo_ctl.observe.monitor import timeline_summary

        lines = timeline_summary(rep["timeline"])
        assert lines[0].startswith("#1 cpu-2: submitted → running → preempted (exit -9 (SIGKILL))"), lines
        assert rep["replays"]["mismatch_count"] == 0, rep["replays"]
        assert rep["goodput"]["fraction"] is not None and 0 < rep["goodput"]["fraction"] <= 1
        assert sup.wait(120) == 0
    finally:
        for p in (sup, w):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(30)
        for f in (run / "attempts").glob("*.json") if (run / "attempts").exists() else ():
            try:  # never leave a trainer behind when the test fails midway
                os.kill(json.loads(f.read_text())["pid"], signal.SIGKILL)
            except (ProcessLookupError, KeyError, ValueError):
                pass


def test_storage_client_errors_become_exit_3():
    """The GCS client's own retry deadline (RetryError) or a refused connection is 'unreachable' (exit 3), one line."""
    from google.api_core.exceptions import RetryError

    from olmo_ctl.core.errors import Unreachable
    from olmo_ctl.observe.monitor import storage_guard

    def give_up():
        raise RetryError(
            "Timeout of 120.0s exceeded, last exception: connection refused", ConnectionRefusedError()
        )

    with pytest.raises(Unreachable) as e:
        storage_guard("gs://b/runs/x", give_up)
    assert e.value.exit_code == 3 and "storage unreachable for `gs://b/runs/x`" in e.value.one_line()
    with pytest.raises(ZeroDivisionError):  # a bug stays a bug
        storage_guard("gs://b/runs/x", lambda: 1 / 0)


def test_run_average_mfu_across_a_resize(tmp_path):
    """cpu-2 for steps 1..50, then resized to cpu-4 for 51..100 at the same global batch and step time:
    the run-average TFLOP/s per device weights each attempt by its device-seconds; the plot marks the resize."""
    run = tmp_path / "rs"
    write_run_yaml(run)
    tb = run / "tensorboard"
    write_segment(tb, range(1, 51), attempt=1, values=values)
    write_segment(tb, range(51, 101), attempt=2, start_time=1767225700, wall0=T0 + 10, values=values)
    with open(run / "journal.jsonl", "w") as f:
        for t, ev, a, dev in [
            (T0 - 2, "submitted", 1, "cpu-2"),
            (T0 - 1, "running", 1, "cpu-2"),
            (T0 + 52, "resized", 1, "cpu-2"),
            (T0 + 55, "submitted", 2, "cpu-4"),
            (T0 + 59, "running", 2, "cpu-4"),
        ]:
            f.write(
                json.dumps(
                    {
                        "time": iso(t),
                        "event": ev,
                        "attempt": a,
                        "device": dev,
                        "reason": "",
                        "committed_step": None,
                    }
                )
                + "\n"
            )
    src = load(str(run))
    rep = build_report(src, now=T0 + 111, ask_backend=False)
    from olmo_ctl.core.flops import flops_per_token_olmo_core
    from olmo_ctl.core.recipe import load_recipe

    ftok = flops_per_token_olmo_core(load_recipe("smoke").model, 128)
    total_flops = 100 * TOKENS_PER_STEP * ftok
    assert rep["throughput"]["devices"] == 4
    assert rep["throughput"]["tflops_per_device_run_avg"] == pytest.approx(
        total_flops / (50 * 2 + 50 * 4) / 1e12
    )
    assert rep["throughput"]["tflops_per_device"] == pytest.approx(TOKENS_PER_STEP / 4 * ftok / 1e12)
    from olmo_ctl.observe.plot import _resume_marks

    assert _resume_marks(src) == ([], [(51, "cpu-2→cpu-4")])


def test_rising_skipped_steps_warning(tmp_path):
    run = tmp_path / "sk"
    write_run_yaml(run, max_steps=5000)
    skipped = {500, 2600, 2700, 2800, 2900}
    write_segment(
        run / "tensorboard",
        range(1, 3001),
        tags=["train/CE loss", "optim/step skipped"],
        values=lambda tag, s: float(s in skipped) if tag == "optim/step skipped" else value(tag, s),
    )
    rep = build_report(load(str(run)), now=T0 + 3001, ask_backend=False)
    assert rep["skipped_steps"] == {"total": 5, "last_1000": 4}
    assert any(w.startswith("skipped steps rising: 4 in the last 1000 steps") for w in rep["warnings"])
    calm = tmp_path / "calm"
    write_run_yaml(calm, max_steps=5000)
    write_segment(
        calm / "tensorboard",
        range(1, 3001),
        tags=["train/CE loss", "optim/step skipped"],
        values=lambda tag, s: float(s in {500, 1500, 2900}) if tag == "optim/step skipped" else value(tag, s),
    )
    rep = build_report(load(str(calm)), now=T0 + 3001, ask_backend=False)
    assert rep["skipped_steps"]["total"] == 3 and not any(
        "skipped steps rising" in w for w in rep["warnings"]
    )


# ---------------------------------------------------------------- one definition per figure


def _row(table: str, label: str) -> str:
    return next(ln for ln in table.splitlines() if label in ln)


def test_table_json_trainer_log_and_plot_agree_on_the_last_window(smoke_run):
    """The session's smoke run (a trainer-only run directory, cpu-1): the trainer's last `step` line,
    the scalars it logged for that window, `monitor -o json`, the table and the plot's last points give
    one tokens/s, one MFU and one step time; TFLOP/s is known without run.yaml too."""
    from helpers.runs import STEPS, trainer_log

    from olmo_ctl.core.contracts import parse_step_line
    from olmo_ctl.observe.plot import figure

    line = [p for p in map(parse_step_line, trainer_log(smoke_run).read_text().splitlines()) if p][-1]
    assert line.step == STEPS and line.tokens_per_s is not None
    p = cli("monitor", str(smoke_run), "-o", "json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    import jsonschema

    jsonschema.validate(rep, SCHEMA)
    th, last = rep["throughput"], rep["last"]
    from olmo_ctl.core.recipe import load_recipe

    every = load_recipe(
        "smoke"
    ).logging.metrics_every  # one fetch, one window: its steps share the line's figures
    assert th["window"] == {"attempt": 0, "first_step": STEPS - every + 1, "last_step": STEPS}
    assert th["devices"] == 1
    # the trainer prints tokens/s to the unit, MFU to 0.01 %, the step time to 0.1 ms
    assert rep["tokens"]["per_s"] == pytest.approx(line.tokens_per_s, rel=2e-3)
    assert th["tokens_per_s"] == rep["tokens"]["per_s"]
    assert th["tokens_per_s_per_device"] == pytest.approx(line.tokens_per_s_per_device, rel=2e-3)
    assert th["tokens_per_s_per_device"] == pytest.approx(last["throughput/device/TPS"], rel=2e-3)
    assert th["mfu"] == pytest.approx(line.mfu, rel=2e-3, abs=5e-5)
    assert th["mfu"] == pytest.approx(last["throughput/device/MFU"], rel=2e-3)
    assert th["step_time_s"] == pytest.approx(line.step_time_s, rel=2e-3, abs=5e-5)
    assert th["step_time_s"] == pytest.approx(last["perf/step_time_s"], rel=2e-3)
    assert th["tflops_per_device"] == pytest.approx(last["throughput/device/TFLOPS"], rel=2e-3)
    assert th["tflops_per_device_run_avg"] is not None and th["mfu_run_avg"] is not None
    t = cli("monitor", str(smoke_run))
    assert t.returncode == 0, t.stderr
    assert f"steps {STEPS - every + 1}..{STEPS} (attempt 0)" in _row(t.stdout, "now = logging window")
    assert f" {rep['tokens']['per_s'] / 1000:.2f}k / " in _row(t.stdout, "tokens/s (now / run avg)")
    assert f"{th['mfu'] * 100:.1f}% /" in _row(t.stdout, "MFU (now / run avg)")
    assert "- / -" not in _row(t.stdout, "TFLOP/s per device")
    fig = figure(load(str(smoke_run)), rep)
    ax_tps, ax_mfu = fig.axes[2], fig.axes[3]
    assert ax_tps.lines[0].get_xdata()[-1] == STEPS
    assert ax_tps.lines[0].get_ydata()[-1] == pytest.approx(rep["tokens"]["per_s"])
    assert ax_mfu.lines[0].get_ydata()[-1] == pytest.approx(100 * th["mfu"])


def test_now_is_the_last_window_not_a_median(tmp_path):
    """60 one-second windows, then one of 3 s: "now" is that last window everywhere (the median of
    recent windows gave 1 s while the trainer's last line and the plot said 3 s); the ETA keeps the
    median of the attempt's recent windows."""
    from olmo_ctl.observe.plot import figure

    run = tmp_path / "slow-end"
    write_run_yaml(run, max_steps=100)
    walls = {s: T0 + s for s in range(1, 61)} | {61: T0 + 63}
    write_segment(run / "tensorboard", range(1, 61), attempt=1, values=values)
    write_segment(
        run / "tensorboard", [61], attempt=1, segment=1, wall0=T0 - 61 * 2 + 2, step_s=3.0, values=values
    )
    journal(run, [(T0 - 2, "submitted", 1, "", None), (T0 - 1, "running", 1, "", None)])
    src = load(str(run))
    rep = build_report(src, now=walls[61] + 1, ask_backend=False)
    th = rep["throughput"]
    assert th["window"] == {"attempt": 1, "first_step": 61, "last_step": 61}
    assert th["step_time_s"] == pytest.approx(3.0) and th["step_time_median_s"] == pytest.approx(1.0)
    assert rep["tokens"]["per_s"] == pytest.approx(TOKENS_PER_STEP / 3)
    assert th["tokens_per_s_per_device"] == pytest.approx(TOKENS_PER_STEP / 3 / 2)  # cpu-2
    assert rep["eta_s"] == pytest.approx(39 * 1.0)
    fig = figure(src, rep)
    assert fig.axes[2].lines[0].get_ydata()[-1] == pytest.approx(TOKENS_PER_STEP / 3)
    assert fig.axes[3].lines[0].get_ydata()[-1] == pytest.approx(100 * th["mfu"])


# ---------------------------------------------------------------- goodput of a finished run


def test_a_supervisor_run_again_on_a_finished_run_leaves_goodput_alone(tmp_path, smoke_run):
    """`resume-until-done` on a run whose final step is committed journals `supervisor_started` and
    `done` (here 1000 s later): the wall time still ends at the final commit."""
    import io

    from helpers.runs import STEPS, copy_run

    from olmo_ctl.backends.local import LocalBackend
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.supervise.attempts import data_fingerprint
    from olmo_ctl.supervise.policy import RetryPolicy
    from olmo_ctl.supervise.supervisor import Printer, Supervisor

    run = copy_run(smoke_run, tmp_path / "runs" / "done-run")
    rd = RunDir(str(run))
    rec = load_recipe("smoke", overrides=[f"train.max_steps={STEPS}"])  # the trainer's checkpoints:
    rd.create_run(rec.to_dict(), rec.fingerprint(), data_fingerprint(rec), "cpu-1", adopt=True)
    before = build_report(load(str(run)), ask_backend=False)["goodput"]
    ck = load(str(run)).reader.series("checkpoint/save_duration_s")
    final_commit = float(ck.wall_times[-1])
    later = final_commit + 1000
    sup = Supervisor(
        rd,
        LocalBackend(str(tmp_path / "runs")),
        RetryPolicy(),
        poll_s=0.05,
        clock=lambda: later,
        printer=Printer(rd.name, stream=io.StringIO(), clock=lambda: later),
    )
    assert sup.run() == 0
    assert [r["event"] for r in rd.journal()] == ["supervisor_started", "done"]
    after = build_report(load(str(run)), ask_backend=False, now=later + 5)["goodput"]
    assert after == before
    first_step_wall = float(load(str(run)).reader.series("train/CE loss").wall_times[0])
    assert after["wall_s"] < final_commit - first_step_wall + 5  # it ends at the final commit


def test_goodput_of_a_real_run_adds_up_to_its_wall_time(tmp_path, smoke_run):
    """A real local run's events (restore, data set-up and process start logged by the trainer) in a
    journal of one attempt: productive + the buckets = wall, each part where the trainer put it."""
    from olmo_ctl.rundir import RunDir

    run = copy_run_of(smoke_run, tmp_path / "real")
    r = load(str(run)).reader
    since = r.series("timing/since_start_s")
    restore = r.series("checkpoint/restore_duration_s")
    assert since is not None and restore is not None and since.steps.tolist() == [0]
    started = float(since.wall_times[0] - since.values[0])
    first = float(r.series("train/CE loss").wall_times[0])
    rd = RunDir(str(run))
    rd.append("submitted", attempt=1, device="cpu-1", t=started - 30)
    rd.append("queued", attempt=1, device="cpu-1", t=started - 30)
    rd.append("admitted", attempt=1, device="cpu-1", t=started - 12)
    rd.append("running", attempt=1, device="cpu-1", t=started - 2)
    ends = float(r.series("checkpoint/save_duration_s").wall_times[-1]) + 0.5
    rd.append("exited", attempt=1, device="cpu-1", reason="exit 0", exit_code=0, t=ends)
    rep = build_report(load(str(run)), ask_backend=False)
    import jsonschema

    jsonschema.validate(rep, SCHEMA)
    gp = rep["goodput"]
    b = gp["buckets"]
    assert abs(gp["productive_s"] + sum(b.values()) - gp["wall_s"]) < 1.0
    assert abs(gp["productive_s"] + sum(gp["lost_s"].values()) - gp["wall_s"]) < 1.0
    assert b["queueing"] == pytest.approx(18.0)
    assert b["checkpoint_restore"] == pytest.approx(float(restore.values[0]), abs=1e-3)
    assert b["checkpoint_save"] > 0 and b["data_loading"] > 0
    # admitted -> the trainer's first step: its pods and process start, restore, data set-up, compile
    startup = b["program_startup"] + b["checkpoint_restore"] + r.series("timing/data_setup_s").values[0]
    assert startup < first - (started - 12) + 1e-6
    assert b["program_startup"] > 12 - 1e-6  # admitted -> the process started, at least
    assert b["wasted_progress"] == b["infrastructure_recovery"] == 0.0
    assert gp["wall_s"] == pytest.approx(ends - (started - 30))
    assert 0 < gp["fraction"] < 1


def test_a_jobset_restarted_in_place_is_recovery_not_queueing(tmp_path):
    """The supervisor journals `admitted` after `running` when the JobSet restarts in place (a host
    event): the outage is recovery, the steps run again are wasted, and nothing of it is productive
    or queueing."""
    run = tmp_path / "in-place"
    write_run_yaml(run)
    tb = run / "tensorboard"
    write_segment(tb, range(1, 61), attempt=1, values=values)  # steps 1..60 at T0+1..T0+60
    write_segment(tb, range(51, 121), attempt=1, start_time=1767225700, wall0=T0 + 45, values=values)
    write_segment(
        tb,
        [50],
        attempt=1,
        segment=1,
        start_time=1767225700,
        tags=["timing/since_start_s", "checkpoint/restore_duration_s"],
        wall0=T0 + 45,  # at T0+95: the restarted process started at T0+90 and restored in 2 s
        values=lambda tag, s: 5.0 if tag == "timing/since_start_s" else 2.0,
    )
    commit(run, 50, 100)
    journal(
        run,
        [
            (T0 - 20, "submitted", 1, "", None),
            (T0 - 10, "admitted", 1, "", None),
            (T0 - 1, "running", 1, "", None),
            (T0 + 70, "admitted", 1, "pods recreated", 50),  # the host event, seen at T0+70
            (T0 + 92, "running", 1, "", 50),
        ],
    )
    gp = build_report(load(str(run)), now=T0 + 165, ask_backend=False)["goodput"]
    b = gp["buckets"]
    assert gp["wall_s"] == pytest.approx(185.0)
    assert gp["productive_s"] == pytest.approx(50.0 + 70.0)  # steps 1..50, then 51..120 (T0+95..T0+165)
    assert b["queueing"] == pytest.approx(10.0)  # the first admission only
    assert b["wasted_progress"] == pytest.approx(20.0)  # T0+50 -> T0+70: steps 51..60 and the outage
    assert b["infrastructure_recovery"] == pytest.approx(20.0)  # T0+70 -> the process start at T0+90
    assert b["checkpoint_restore"] == pytest.approx(2.0)  # T0+93 -> T0+95
    assert b["program_startup"] == pytest.approx(10.0 + 3.0)  # admitted -> step 1; T0+90 -> T0+93
    assert gp["productive_s"] + sum(b.values()) == pytest.approx(gp["wall_s"])
    assert gp["productive_s"] + sum(gp["lost_s"].values()) == pytest.approx(gp["wall_s"])


def copy_run_of(src: Path, dst: Path) -> Path:
    from helpers.runs import copy_run

    return copy_run(src, dst)


# ---------------------------------------------------------------- attempts that end unwatched


def test_an_unwatched_attempt_that_ends_cleanly_is_journaled_and_succeeded(tmp_path, smoke_run):
    """An attempt nobody supervises (submitted, then left): its trainer journals its own exit, and
    `monitor` calls it what the supervisor would: this one restored the final checkpoint, had nothing
    to train and exited 0 (its log holds no step line, which read as `preempted`)."""
    from helpers.runs import STEPS, copy_run

    from olmo_ctl.backends.local import LocalBackend
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.supervise.attempts import data_fingerprint, submit_next

    root = tmp_path / "runs"
    run = copy_run(smoke_run, root / "unwatched")
    rd = RunDir(str(run))
    rec = load_recipe("smoke", overrides=[f"train.max_steps={STEPS}"])  # the trainer's checkpoints:
    rd.create_run(rec.to_dict(), rec.fingerprint(), data_fingerprint(rec), "cpu-1", adopt=True)
    be = LocalBackend(str(root))
    h = submit_next(rd, be, attempt_of(rd, 0, "cpu-1"), "first attempt")
    _, status = os.waitpid(int(h.data["pid"]), 0)  # reaped here: the backend never sees its exit code
    assert os.waitstatus_to_exitcode(status) == 0
    exited = [r for r in rd.journal() if r["event"] == "exited"]
    assert len(exited) == 1, rd.journal()
    assert (exited[0]["attempt"], exited[0]["exit_code"], exited[0]["committed_step"]) == (1, 0, STEPS)
    p = cli("monitor", str(run), "-o", "json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["attempt"]["state"] == "succeeded", rep["attempt"]
    from olmo_ctl.observe.monitor import timeline_summary

    assert timeline_summary(rep["timeline"]) == ["#1 cpu-1: submitted → exited (exit 0)"]


def test_plot_panels_legends_no_offset_and_a_restart_marked(tmp_path):
    """tokens/s and MFU each on their own axes with a legend; a near-constant v5p MFU shows plain
    percents (no `1e-5` offset); a trainer started again within one attempt (a JobSet restart: same
    attempt number, a new writer) is marked where the new writer's steps begin."""
    from olmo_ctl.observe.plot import _restart_marks, figure

    run = tmp_path / "v5p"
    write_run_yaml(run, max_steps=100, device="v5p-8")
    tb = run / "tensorboard"
    write_segment(tb, range(1, 31), attempt=1, values=values)
    write_segment(tb, range(21, 41), attempt=1, start_time=1767225700, wall0=T0 + 15, values=values)
    src = load(str(run))
    rep = build_report(src, now=T0 + 60, ask_backend=False)
    assert _restart_marks(src) == [(21, "attempt 1")]
    from olmo_ctl.observe.monitor import windows

    win = windows(src)  # the restarted trainer's first window holds its start-up: no throughput point
    assert list(win.steps) == [*range(2, 21), *range(22, 41)]
    fig = figure(src, rep)
    fig.canvas.draw()
    ax_loss, _ax_lr, ax_tps, ax_mfu = fig.axes
    assert len(fig.axes) == 4 and ax_tps.get_ylabel() == "tokens/s" and ax_mfu.get_ylabel() == "MFU %"
    for ax in (ax_tps, ax_mfu):
        assert ax.get_legend() is not None and len(ax.get_legend().get_texts()) == 1
        assert ax.yaxis.get_offset_text().get_text() == ""
    assert ax_mfu.get_legend().get_texts()[0].get_text() == "MFU (olmo_core FLOPs)"
    assert ax_mfu.lines[0].get_ydata()[-1] == pytest.approx(100 * rep["throughput"]["mfu"])
    assert "restart (attempt 1)" in [t.get_text() for t in ax_loss.texts]


def test_the_table_shows_each_hosts_latest_window_and_the_slow_one(tmp_path):
    """A multi-host run's `hosts` list (each host's last window: step time, data wait, compute) is in
    the table as in -o json, and the slow host's slow part is named in both."""
    run = tmp_path / "mh"
    write_run_yaml(run, device="cpu-2x1")
    timing = {"step_time_s": 0.61, "compute_s": 0.4}
    host_tags = [f"hosts/{h}/{k}" for h in (0, 1) for k in ("step_time_s", "data_wait_s", "compute_s")]

    def vals(tag, step):
        if not tag.startswith("hosts/"):
            return values(tag, step)
        _, h, k = tag.split("/")
        return timing.get(k, 0.21 if h == "1" else 0.004)

    write_segment(run / "tensorboard", range(1, 31), tags=[*TAGS, *host_tags], values=vals)
    rep = json.loads(cli("monitor", str(run), "-o", "json").stdout)
    assert [(h["host"], h["step"], h["data_wait_s"], h["slow"]) for h in rep["hosts"]] == [
        (0, 30, pytest.approx(0.004), []),
        (1, 30, pytest.approx(0.21), ["data wait"]),
    ]
    t = cli("monitor", str(run), env={"COLUMNS": "200"})
    assert t.returncode == 0, t.stderr
    lines = [ln.strip("│ ") for ln in t.stdout.splitlines()]
    assert "host 0  step 30  step time 610 ms  data wait 4 ms  compute 400 ms" in lines
    assert "host 1  step 30  step time 610 ms  data wait 210 ms  compute 400 ms  slow: data wait" in lines


# ---------------------------------------------------------------- ETA only while the run goes on


@pytest.mark.parametrize(
    "event, reason",
    [
        ("succeeded", "exit 0"),  # stopped short of the final step on purpose (`smoke`, --stop-at-step)
        ("failed", "failed-user: exit 1"),
        ("stopped", "stopped on request (olmo-ctl stop)"),
        ("preempted", "exit 143 (SIGTERM)"),
    ],
)
def test_a_run_whose_last_attempt_is_over_has_no_eta(tmp_path, event, reason):
    """Attempt 2 at step 120 of 200 while running: an ETA (80 s at 1 s/step). Once it is over short of
    the final step, nothing runs toward it: no ETA in -o json, and the table says why."""
    run = tmp_path / "r"
    make_resumed_run(run)
    assert build_report(load(str(run)), now=T0 + 150, ask_backend=False)["eta_s"] == pytest.approx(80.0)
    with open(run / "journal.jsonl", "a") as f:
        f.write(json.dumps({"time": iso(T0 + 100), "event": event, "attempt": 2, "reason": reason}) + "\n")
    p = cli("monitor", str(run), "-o", "json", "--no-backend")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert (rep["step"], rep["attempt"]["state"], rep["eta_s"], rep["eta"]) == (120, event, None, None)
    t = cli("monitor", str(run), "--no-backend", env={"COLUMNS": "200"})
    assert t.returncode == 0, t.stderr
    (eta,) = [ln.strip("│ ") for ln in t.stdout.splitlines() if ln.strip("│ ").startswith("ETA")]
    assert eta.split(None, 1)[1].strip() == f"- (nothing is running: attempt #2 {event})"


def test_a_cpu_runs_mfu_is_said_to_be_against_a_nominal_cpu_peak(tmp_path):
    """The resumed run trained on cpu-2, whose peak is nominal: the table's MFU row and the plot's
    legend say so; -o json keeps its keys as they are."""
    from olmo_ctl.observe.plot import figure

    run = tmp_path / "r"
    make_resumed_run(run)
    t = cli("monitor", str(run), "--no-backend", env={"COLUMNS": "200"})
    assert t.returncode == 0, t.stderr
    (mfu,) = [ln.strip("│ ") for ln in t.stdout.splitlines() if ln.strip("│ ").startswith("MFU")]
    assert mfu.endswith("  [olmo_core FLOPs; nominal CPU peak]"), mfu
    src = load(str(run))
    rep = build_report(src, now=T0 + 150, ask_backend=False)
    fig = figure(src, rep)
    assert fig.axes[3].get_legend().get_texts()[0].get_text() == "MFU (olmo_core FLOPs, nominal CPU peak)"
    js = json.loads(cli("monitor", str(run), "--no-backend", "-o", "json").stdout)
    assert set(js["throughput"]) == set(SCHEMA["properties"]["throughput"]["properties"])


def _fallback_run(run: Path, second_device: str, later=None) -> None:
    """Attempt 1 on cpu-2 logs steps 1..60 (checkpoint 50) and is preempted; attempt 2 falls back to
    `second_device`, restores 50 and replays 51..60, its losses from `later(tag, step, value)`."""
    write_run_yaml(run)
    tb = run / "tensorboard"
    write_segment(tb, range(1, 61), attempt=1, values=values)
    write_segment(
        tb,
        range(51, 101),
        attempt=2,
        start_time=1767225700,
        wall0=T0 + 30,
        values=lambda tag, s: later(tag, s, values(tag, s)) if later else values(tag, s),
    )
    commit(run, 50)
    with open(run / "journal.jsonl", "w") as f:
        for t, ev, a, dev in [
            (T0 - 2, "submitted", 1, "cpu-2"),
            (T0 - 1, "running", 1, "cpu-2"),
            (T0 + 62, "preempted", 1, "cpu-2"),
            (T0 + 70, "submitted", 2, second_device),
            (T0 + 76, "running", 2, second_device),
        ]:
            f.write(json.dumps({"time": iso(t), "event": ev, "attempt": a, "device": dev}) + "\n")


def _last_bits(tag, step, v):
    """The losses another device layout computes: one float32 ulp away (3.1099791526794434 vs
    3.1099789142608643 in a real fallback), the rest the same."""
    if tag not in ("train/CE loss", "train/PPL"):
        return v
    return float(np.nextafter(np.float32(v), np.float32(-np.inf)))


def test_replays_on_another_layout_are_equal_up_to_layout_rounding(tmp_path):
    run = tmp_path / "fallback"
    _fallback_run(run, "cpu-1", _last_bits)
    rep = build_report(load(str(run)), now=T0 + 150, ask_backend=False)
    import jsonschema

    jsonschema.validate(rep, SCHEMA)
    rp = rep["replays"]
    assert rp["steps"] == 10 and rp["mismatch_count"] == 20 and rp["layout_rounding_count"] == 20
    assert not any("differ after a resume" in w for w in rep["warnings"]), rep["warnings"]
    assert rp["rounding_tolerance"]["dtype"] == "float32" and rp["rounding_tolerance"]["k"] == 10.0
    m = rp["mismatches"][0]
    assert (m["earlier_attempt"], m["later_attempt"], m["step"]) == (1, 2, 51)
    assert 0 < abs(m["later"] - m["earlier"]) <= m["layout_rounding_bound"]
    # step 51 is the first step on the new layout: k * eps * sqrt(1) * |value|
    assert m["layout_rounding_bound"] == pytest.approx(
        10 * 2.0**-23 * max(abs(m["earlier"]), abs(m["later"]))
    )
    t = cli("monitor", str(run), env={"COLUMNS": "240"})  # one line per row, whatever the path's length
    assert t.returncode == 0, t.stderr
    assert "mismatching values: 20, 20 equal up to layout rounding" in t.stdout
    assert "differ after a resume" not in t.stdout


def test_replays_on_the_same_layout_stay_bitwise_and_a_real_change_is_named(tmp_path):
    same = tmp_path / "same"
    _fallback_run(same, "cpu-2", _last_bits)
    rep = build_report(load(str(same)), now=T0 + 150, ask_backend=False)
    assert rep["replays"]["mismatch_count"] == 20 and rep["replays"]["layout_rounding_count"] == 0
    assert rep["replays"]["rounding_tolerance"] is None
    assert any(w.startswith("20 replayed value(s) differ after a resume") for w in rep["warnings"])

    changed = tmp_path / "changed"  # on another layout, a loss 0.01 off from step 55: not rounding
    _fallback_run(changed, "cpu-1", lambda tag, s, v: _last_bits(tag, s, value(tag, s, desync=55)))
    rep = build_report(load(str(changed)), now=T0 + 150, ask_backend=False)
    assert rep["replays"]["layout_rounding_count"] == 8  # steps 51..54 of CE loss and PPL
    (w,) = [w for w in rep["warnings"] if "differ after a resume" in w]
    assert "replayed value(s) differ after a resume; first: train/CE loss step 55: " in w
