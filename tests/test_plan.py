"""Global-batch planning and `olmo-ctl plan`: per-device batch, accumulation, refusals, and the compute
estimate checked against the published case study of reproducing OLMo 3 7B on TPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from olmo_ctl.core.batching import make_plan, plan_report
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    return subprocess.run(
        [sys.executable, "-m", "olmo_ctl", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )


@pytest.mark.parametrize(
    "stage,device,per_device",
    [(1, "tpu7x-128", 4), (1, "tpu7x-512", 1), (1, "v5p-256", 4), (2, "v5p-256", 2)],
)
def test_per_device_batch(stage, device, per_device):
    p = make_plan(load_recipe(stage=stage), get_device(device))
    assert (p.per_device_batch, p.grad_accum) == (per_device, 1)
    assert p.per_device_batch * p.grad_accum * p.devices == p.global_batch


def test_too_many_devices_is_a_clear_refusal():
    # (with sequence sharding allowed the plan splits each sequence instead: test_seq_shards.py)
    with pytest.raises(BadInput) as e:
        make_plan(load_recipe(stage=1, overrides=["train.seq_shards=1"]), get_device("tpu7x-1024"))
    msg = e.value.one_line()
    assert "512" in msg and "1024 devices" in msg and "never changed silently" in msg
    with pytest.raises(BadInput, match="256 cannot be split"):
        make_plan(load_recipe(stage=2, overrides=["train.seq_shards=1"]), get_device("tpu7x-512"))


def test_small_slice_accumulates_to_the_exact_global_batch():
    p = make_plan(load_recipe(stage=1), get_device("v5p-8"))
    assert p.devices == 4 and p.grad_accum > 1
    assert p.per_device_batch * p.grad_accum * p.devices == 512
    assert p.estimated_bytes_per_device <= p.hbm_bytes_per_device


def test_plan_json_contract():
    p = _cli("plan", "--stage", "1", "--device", "tpu7x-128", "-o", "json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    for key in (
        "global_batch",
        "devices",
        "per_device_batch",
        "grad_accum",
        "seq_len",
        "tokens_per_step",
        "params",
        "flops_per_token",
    ):
        assert key in r
    assert (r["global_batch"], r["devices"], r["per_device_batch"], r["grad_accum"]) == (512, 128, 4, 1)
    assert r["params"] == 7_298_617_344
    assert set(r["flops_per_token"]) == {"olmo_core", "maxtext"}
    assert r["flops_per_token"]["olmo_core"] == pytest.approx(4.94e10, rel=0.01)
    assert r["flops_per_token"]["maxtext"] == pytest.approx(4.78e10, rel=0.01)
    assert r["tokens"] == 5_929_965_715_456 and r["steps"] == 1413814
    assert r["mfu"] == 0.4
    for est in r["estimate"].values():
        assert est["wall_clock_s"] == pytest.approx(est["step_time_s"] * r["steps"])
        assert est["chip_hours"] == pytest.approx(est["wall_clock_s"] * 64 / 3600)


def test_estimate_reproduces_the_case_study():
    # Ironwood: 3.05 s per step on 128 devices at 44.5% MFU (MaxText formula); stage 1 ~ 77k chip-hours.
    r = json.loads(
        _cli("plan", "--stage", "1", "--device", "tpu7x-128", "--mfu", "0.445", "-o", "json").stdout
    )
    assert r["estimate"]["maxtext"]["step_time_s"] == pytest.approx(3.05, rel=0.01)
    assert r["estimate"]["maxtext"]["chip_hours"] == pytest.approx(77_000, rel=0.01)
    # v5p-256 at 57.4% MFU: stage 2 in ~39 h, ~5k chip-hours.
    r = json.loads(_cli("plan", "--stage", "2", "--device", "v5p-256", "--mfu", "0.574", "-o", "json").stdout)
    assert r["estimate"]["maxtext"]["wall_clock_s"] / 3600 == pytest.approx(39, rel=0.02)
    assert r["estimate"]["maxtext"]["chip_hours"] == pytest.approx(5_000, rel=0.02)


def test_plan_table_names_both_formulas_and_accumulation():
    p = _cli("plan", "--stage", "1", "--device", "v5p-8")
    assert p.returncode == 0, p.stderr
    assert "OLMo-core formula" in p.stdout and "MaxText formula" in p.stdout
    assert "batch 4 x 32 accumulation" in p.stdout
    assert "7,298,617,344" in p.stdout and "40% MFU" in p.stdout
    assert max(len(line) for line in p.stdout.splitlines()) <= 80


def test_plan_refusals_exit_2():
    p = _cli("plan", "--stage", "1", "--device", "tpu7x-1024", "--set", "train.seq_shards=1")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith("error: global batch 512 cannot be split") and p.stderr.count("\n") == 1
    p = _cli("plan", "--stage", "1", "--device", "v5p-8", "--mfu", "40")
    assert p.returncode == 2 and "--mfu 0.4" in p.stderr


def test_plan_report_is_pure_and_checks_mfu():
    r = plan_report(load_recipe(stage=2), get_device("v5p-256"), 0.5)
    assert (r["per_device_batch"], r["tokens"]) == (2, 47684 * 256 * 8192)
    e = r["estimate"]["olmo_core"]
    assert e["step_time_s"] == pytest.approx(
        r["flops_per_token"]["olmo_core"] * r["tokens_per_step"] / (128 * 459e12 * 0.5)
    )
    for bad in (0, -0.1, 1.5):
        with pytest.raises(BadInput, match="not a fraction"):
            plan_report(load_recipe(stage=2), get_device("v5p-256"), bad)


@pytest.mark.parametrize(
    "device,slices,per_device", [("tpu7x-128", 2, 2), ("v5p-256", 2, 2), ("tpu7x-64", 4, 2)]
)
def test_multislice_holds_the_global_batch_over_every_slice(device, slices, per_device):
    r, dev = load_recipe(stage=1), get_device(device)
    one, many = make_plan(r, dev), make_plan(r, dev, slices)
    assert (many.slices, many.devices, many.data_parallel) == (
        slices,
        slices * dev.devices,
        slices * dev.devices,
    )
    assert many.per_device_batch * many.grad_accum * many.devices == many.global_batch == one.global_batch
    assert many.per_device_batch == per_device and many.tokens_per_step == one.tokens_per_step
    # each slice holds the whole state, sharded over its own devices: the same state per device as one slice
    assert many.state_bytes_per_device == one.state_bytes_per_device
    assert make_plan(r, dev, slices).to_dict()["slices"] == slices and one.slices == 1
    rep = plan_report(r, dev, slices=slices)
    assert rep["chips"] == slices * dev.chips and rep["vms"] == slices * dev.vms


def test_multislice_refusals_are_bad_input():
    r = load_recipe(stage=1)
    unsharded = load_recipe(stage=1, overrides=["train.seq_shards=1"])
    with pytest.raises(BadInput, match=r"1024 devices of 2 x tpu7x-512"):  # 512 over 1024 devices
        make_plan(unsharded, get_device("tpu7x-512"), 2)
    # ... which sequence sharding inside each slice evens out: 2 shards of each instance.
    p = make_plan(r, get_device("tpu7x-512"), 2)
    assert (p.slices, p.seq_shards, p.devices, p.per_device_batch * p.grad_accum) == (2, 2, 1024, 1)
    with pytest.raises(BadInput, match="single-host"):
        make_plan(r, get_device("v5p-8"), 2)
    with pytest.raises(BadInput, match="local device"):
        make_plan(load_recipe("smoke"), get_device("cpu-2"), 2)
    for bad in (0, -1, 65, True):
        with pytest.raises(BadInput, match="slice count"):
            make_plan(r, get_device("tpu7x-128"), bad)


def _plan(tmp_path, *args, prices=None, env_prices=None):
    """`olmo-ctl plan ARGS` in this process with its own config file (holding `prices`, if given)."""
    import yaml
    from helpers.cli import clean_env, invoke

    env = clean_env(tmp_path / "xdg")
    if prices is not None:
        cfg = tmp_path / "xdg" / "olmo-ctl" / "config.yaml"
        cfg.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text(yaml.safe_dump({"prices": prices}))
    if env_prices is not None:
        env["OLMO_CTL_PRICES"] = env_prices
    return invoke("plan", *args, env=env)


def test_dollars_beside_chip_hours_at_the_users_prices(tmp_path):
    prices = {"tpu7x": {"on_demand": 10.0, "spot": 4.0}, "v5p": {"on_demand": 8.0}}
    args = ("--stage", "1", "--device", "tpu7x-128")
    r = json.loads(_plan(tmp_path, *args, "-o", "json", prices=prices).stdout)
    assert r["usd_per_chip_hour"] == {"on_demand": 10.0, "spot": 4.0}
    for f in ("olmo_core", "maxtext"):
        e = r["estimate"][f]
        assert e["usd"] == {"on_demand": e["chip_hours"] * 10.0, "spot": e["chip_hours"] * 4.0}
    t = _plan(tmp_path, *args, prices=prices).stdout.splitlines()
    e = r["estimate"]
    (od,) = [ln for ln in t if ln.startswith("  USD on demand")]
    assert od.split()[-2:] == [
        f"${e['olmo_core']['usd']['on_demand']:,.0f}",
        f"${e['maxtext']['usd']['on_demand']:,.0f}",
    ]
    assert any(ln.startswith("  USD spot") for ln in t)
    # v5p has only an on-demand price; OLMO_CTL_PRICES wins over the file.
    v5p = json.loads(
        _plan(tmp_path, "--stage", "1", "--device", "v5p-256", "-o", "json", prices=prices).stdout
    )
    assert set(v5p["estimate"]["maxtext"]["usd"]) == {"on_demand"}
    env_first = _plan(tmp_path, *args, "-o", "json", prices=prices, env_prices="{tpu7x: {spot: 1}}")
    assert json.loads(env_first.stdout)["usd_per_chip_hour"] == {"spot": 1.0}


def test_no_prices_no_dollars(tmp_path):
    r = json.loads(_plan(tmp_path, "--stage", "1", "--device", "tpu7x-128", "-o", "json").stdout)
    assert r["usd_per_chip_hour"] is None and r["estimate"]["olmo_core"]["usd"] is None
    assert "USD" not in _plan(tmp_path, "--stage", "1", "--device", "tpu7x-128").stdout
    local = _plan(
        tmp_path, "--recipe", "smoke", "--device", "cpu-1", "-o", "json", prices={"v5p": {"spot": 2}}
    )
    assert json.loads(local.stdout)["usd_per_chip_hour"] is None


@pytest.mark.parametrize(
    "prices,says",
    [
        ({"v4": {"spot": 1.0}}, "`v4` is not a TPU generation"),
        ({"v5p": {"list": 3.0}}, "`v5p.list` is not a price kind"),
        ({"v5p": {"spot": -1}}, "`v5p.spot` must be a non-negative number"),
        ({"v5p": {"spot": "cheap"}}, "`v5p.spot` must be a non-negative number"),
        ({"v5p": 4.2}, "`v5p` must map on_demand and/or spot"),
        ([1, 2], "must be a mapping"),
    ],
)
def test_bad_prices_are_one_line_and_exit_2(tmp_path, prices, says):
    p = _plan(tmp_path, "--stage", "1", "--device", "v5p-256", prices=prices)
    assert p.returncode == 2 and p.stdout == ""
    (line,) = p.stderr.splitlines()
    assert line.startswith("error: setting `prices` (file ") and says in line, line


# ---------------------------------------------------------------- the plan an attempt carries


def test_launch_record_round_trips_the_target_and_plan():
    from olmo_ctl.core.batching import launch_record, read_launch_record
    from olmo_ctl.core.devices import Target

    r = load_recipe("olmo3-7b-stage1")
    target = Target.parse("v5p-256", 2)
    plan = make_plan(r, target.device, target.slices)
    t2, p2 = read_launch_record(launch_record(target, plan))
    assert t2 == target and p2 == plan
    assert t2.device == get_device("v5p-256") and p2.devices == 256 and p2.slices == 2


@pytest.mark.parametrize(
    "edit, text",
    [
        (lambda rec: rec.update(plan={**rec["plan"], "device": "v5p-8"}), "is for v5p-8 x 1"),
        (lambda rec: rec["target"]["device"].pop("devices"), "is not one this version renders"),
        (lambda rec: rec.update(target="v5p-256"), "is not one this version renders"),
    ],
)
def test_a_record_that_is_not_one_is_refused(edit, text):
    from olmo_ctl.core.batching import launch_record, read_launch_record
    from olmo_ctl.core.devices import Target

    target = Target.parse("v5p-256")
    rec = json.loads(launch_record(target, make_plan(load_recipe("olmo3-7b-stage1"), target.device)))
    edit(rec)
    with pytest.raises(BadInput, match=text):
        read_launch_record(json.dumps(rec))
    with pytest.raises(BadInput, match="not a plan record"):
        read_launch_record("v5p-256")


def test_check_plan_refuses_a_plan_made_for_another_batch_or_one_that_does_not_hold_it():
    import dataclasses

    from olmo_ctl.core.batching import check_plan

    r = load_recipe("olmo3-7b-stage1")
    plan = make_plan(r, get_device("v5p-256"))
    check_plan(plan, r)
    check_plan(plan, load_recipe("olmo3-7b-stage1", overrides=["train.max_steps=10"]))  # horizon: no layout
    with pytest.raises(BadInput, match="global batch 512, the run's recipe 1024"):
        check_plan(plan, load_recipe("olmo3-7b-stage1", overrides=["train.global_batch=1024"]))
    with pytest.raises(BadInput, match="sequence length"):
        check_plan(plan, load_recipe("olmo3-7b-stage1", overrides=["train.seq_len=4096"]))
    with pytest.raises(BadInput, match="does not hold its global batch 512"):
        check_plan(dataclasses.replace(plan, grad_accum=plan.grad_accum * 2), r)
    with pytest.raises(BadInput, match="the run's recipe smoke"):
        check_plan(plan, load_recipe("smoke"))


def _trainer(tmp_path: Path, *args: str, xla_devices: int = 2) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={xla_devices}")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "olmo_ctl.trainer",
            "--run-dir",
            str(tmp_path / "r"),
            "--recipe",
            "smoke",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def _record(device: str, recipe: str = "smoke", overrides: tuple[str, ...] = ()) -> str:
    from olmo_ctl.core.batching import launch_record
    from olmo_ctl.core.devices import Target

    target = Target.parse(device)
    return launch_record(target, make_plan(load_recipe(recipe, overrides=list(overrides)), target.device))


@pytest.mark.parametrize(
    "args, text",
    [
        # made for another batch than the run's recipe: refused, not trained
        (
            ("--plan", _record("cpu-2", overrides=("train.global_batch=16",))),
            "global batch 16, the run's recipe 8",
        ),
        # made for more devices than JAX sees here
        (("--plan", _record("cpu-4")), "has 4 devices but JAX sees 2"),
        # a name beside the record that names something else
        (
            ("--plan", _record("cpu-2"), "--device", "cpu-4"),
            "--device cpu-4 x 1 disagrees with --plan's cpu-2",
        ),
        (("--plan", "{not json"), "--plan is not a plan record"),
    ],
)
def test_the_trainer_refuses_a_plan_that_disagrees_and_writes_nothing(tmp_path, args, text):
    p = _trainer(tmp_path, *args)
    assert p.returncode == 2, p.stderr[-2000:]
    assert text in p.stderr and "Traceback" not in p.stderr
    assert not any(p for p in (tmp_path / "r").rglob("*") if p.is_file() and "checkpoints" in p.parts)


def test_shard_group_shards_the_state_over_groups_and_the_trainer_meshes_it_so():
    """OLMo-core's HSDP by group size: the state over groups of `train.shard_group` devices (so each
    device holds slice/group times the plain FSDP share), replicated across the groups; the batch
    still over every device. The mesh the trainer and preflight build follows the same rule."""
    from olmo_ctl.core.batching import mesh_layout

    fsdp = make_plan(load_recipe(stage=1), get_device("v5p-256"))
    grouped = make_plan(load_recipe(stage=1, overrides=["train.shard_group=32"]), get_device("v5p-256"))
    assert (fsdp.shard_group, grouped.shard_group) == (128, 32)
    assert grouped.state_bytes_per_device == pytest.approx(fsdp.state_bytes_per_device * 4, rel=1e-6)
    assert (grouped.devices, grouped.data_parallel) == (fsdp.devices, fsdp.data_parallel)
    r = load_recipe("smoke", overrides=["train.shard_group=2"])
    assert mesh_layout(r, 8) == ("hybrid", 4) and mesh_layout(r, 2) == ("fsdp", 1)
    assert mesh_layout(load_recipe("smoke"), 8) == ("fsdp", 1)
    assert mesh_layout(load_recipe("smoke", overrides=["train.shard_group=16"]), 8) == (
        "fsdp",
        1,
    )  # the slice
    assert (
        load_recipe("smoke", overrides=["train.shard_group=2"]).fingerprint()
        == load_recipe("smoke").fingerprint()
    )


@pytest.mark.parametrize(
    "overrides,device,says",
    [
        (["train.shard_group=48"], "v5p-256", "does not divide the 128 devices"),
        (["train.shard_group=-1"], "v5p-256", "train.shard_group` must be >= 0"),
        (["train.shard_group=4", "train.mesh=hybrid", "train.data_parallel=2"], "v5p-256", "choose one"),
    ],
)
def test_a_shard_group_the_slice_cannot_hold_is_refused(overrides, device, says):
    with pytest.raises(BadInput, match=says):
        make_plan(load_recipe(stage=1, overrides=overrides), get_device(device))


def test_plan_refuses_a_shard_group_on_the_command_line():
    p = _cli("plan", "--stage", "1", "--device", "v5p-256", "--set", "train.shard_group=48")
    assert p.returncode == 2 and "shard_group 48 does not divide" in p.stderr and "Traceback" not in p.stderr


def test_a_local_devices_mfu_is_said_to_be_against_a_nominal_peak():
    """cpu-N's peak is a round number, not the machine's: the table says so; a TPU's is its own."""
    from helpers.cli import invoke

    cpu = invoke("plan", "--recipe", "smoke", "--device", "cpu-1")
    assert cpu.returncode == 0, cpu.stderr
    assert "compute estimate at 40% MFU (0.1 TFLOP/s nominal CPU peak per device)" in cpu.stdout.splitlines()
    tpu = invoke("plan", "--stage", "1", "--device", "v5p-8")
    assert "compute estimate at 40% MFU (459 TFLOP/s peak per device)" in tpu.stdout.splitlines()
    js = json.loads(invoke("plan", "--recipe", "smoke", "--device", "cpu-1", "-o", "json").stdout)
    assert js["peak_tflops_per_device"] == 0.1 and "peak_note" not in js  # the JSON keys as they were
