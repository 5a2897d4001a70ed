"""GPU machine types in the catalog: XPK's names x a node count (`h100-mega-80gb-8x160`), their facts,
`devices`, `plan` (per-GPU batch at the recipe's global batch, tokens/s at an MFU, GPU-hours and
dollars), the batches nodes cannot share, and the one-line refusal of GPU nodes by what runs only on TPU
slices or this machine (tests/test_gpu_jobset.py: the GKE backend's JobSet for them)."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers.cli import clean_env, invoke

from olmo_ctl.core.batching import make_plan, plan_report
from olmo_ctl.core.devices import Target, get_device, gpu_catalog
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.generations import GPU_MACHINES
from olmo_ctl.core.recipe import load_recipe

# XPK's rows (src/xpk/core/system_characteristics.py at 367c8382): device type -> (machine type, GKE
# accelerator, GPUs a node, gpu_direct_name); peak dense bf16 TFLOP/s and HBM per GPU are NVIDIA's.
XPK_GPU_ROWS = {
    "h100-mega-80gb-8": ("a3-megagpu-8g", "nvidia-h100-mega-80gb", 8, "tcpxo", 989.0, 80.0),
    "h200-141gb-8": ("a3-ultragpu-8g", "nvidia-h200-141gb", 8, "rdma", 989.0, 141.0),
    "b200-8": ("a4-highgpu-8g", "nvidia-b200", 8, "rdma", 2250.0, 180.0),
}


@pytest.mark.parametrize("name", sorted(XPK_GPU_ROWS))
def test_gpu_machine_types_keep_xpks_facts(name):
    machine, label, gpus, direct, peak, hbm = XPK_GPU_ROWS[name]
    m = GPU_MACHINES[name]
    assert (m.machine_type, m.accelerator_label, m.gpus_per_node) == (machine, label, gpus)
    assert m.interconnect.endswith(f"({direct})")
    assert (m.peak_tflops_per_gpu, m.hbm_gib_per_gpu) == (peak, hbm)
    one = get_device(name)  # XPK's name alone: one node
    assert (one.name, one.vms, one.devices, one.chips, one.chips_per_vm) == (name, 1, gpus, gpus, gpus)
    d = get_device(f"{name}x20")
    assert (d.generation, d.platform, d.topology) == (name, "gpu", None)
    assert (d.vms, d.devices, d.chips, d.processes, d.devices_per_process) == (
        20,
        20 * gpus,
        20 * gpus,
        20,
        gpus,
    )
    assert (d.machine_type, d.accelerator_label) == (machine, label)
    assert (d.peak_tflops_per_device, d.hbm_gib_per_device) == (peak, hbm)
    assert d.is_gpu_nodes and not d.is_tpu and d.peak_note == ""  # the hardware's peak, not a nominal one
    assert get_device(f"{name}x1") == one  # one name for one node
    assert Target.from_dict(Target.parse(d.name).to_dict()) == Target(d)  # the launch record round-trips


def test_the_local_gpu_n_is_not_gpu_nodes():
    d = get_device("gpu-8")
    assert not d.is_gpu_nodes and d.peak_note == "nominal GPU peak"


@pytest.mark.parametrize(
    "name,says",
    [
        ("h100-mega-80gb-8x0", "GPU nodes are h100-mega-80gb-8xN, N nodes from 1 to 1024"),
        ("h100-mega-80gb-8x1025", "N nodes from 1 to 1024"),
        ("h100-mega-80gb-8-20", "GPU nodes are h100-mega-80gb-8xN"),
        ("b200-8x", "GPU nodes are b200-8xN"),
        ("h200-141gb-8x02", "GPU nodes are h200-141gb-8xN"),
        ("h100-8", "GPU nodes h100-mega-80gb-8xN, h200-141gb-8xN, b200-8xN"),
    ],
)
def test_gpu_node_names_that_are_not_devices(name, says):
    with pytest.raises(BadInput) as e:
        get_device(name)
    assert says in e.value.one_line() and "olmo-ctl devices" in e.value.one_line()


def test_a_gpu_name_off_by_case_gets_did_you_mean():
    with pytest.raises(BadInput) as e:
        get_device("H100-MEGA-80GB-8x4")
    assert "did you mean `h100-mega-80gb-8x4`?" in e.value.one_line()


def test_slices_of_gpu_nodes_are_named_as_nodes():
    with pytest.raises(BadInput) as e:
        Target.parse("h100-mega-80gb-8x2", 3)
    assert e.value.one_line() == (
        "--slices 3: `h100-mega-80gb-8x2` is GPU nodes; its name counts them, --slices joins TPU slices; "
        "name the nodes instead: h100-mega-80gb-8x6"
    )


def test_devices_lists_the_three_gpu_machine_types():
    p = invoke("devices")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "h100-mega-80gb-8: machine type a3-megagpu-8g, 8 x H100 80GB a node" in lines
    assert "  GKE accelerator nvidia-h200-141gb, nvidia.com/gpu, RDMA over gIB (rdma)" in lines
    assert "b200-8: machine type a4-highgpu-8g, 8 x B200 180GB a node" in lines
    assert "  GKE backend: launch_templates/gpu-tcpxo.yaml (not the local backend)" in lines
    row = next(line for line in lines if line.startswith("h100-mega-80gb-8x128 "))
    assert row.split() == ["h100-mega-80gb-8x128", "128", "1024", "989", "80"]
    row = next(line for line in lines if line.startswith("b200-8 "))
    assert row.split() == ["b200-8", "1", "8", "2250", "180"]
    assert "and h100-mega-80gb-8xN for any N nodes up to 1024 (h100-mega-80gb-8: one node)" in lines
    js = invoke("devices", "--generation", "h200-141gb-8", "-o", "json")
    assert js.returncode == 0, js.stderr
    rows = json.loads(js.stdout)
    assert [r["name"] for r in rows] == [d.name for d in gpu_catalog("h200-141gb-8")]
    assert rows[0]["name"] == "h200-141gb-8" and rows[-1]["name"] == "h200-141gb-8x256"
    assert {(r["machine_type"], r["accelerator_label"], r["platform"]) for r in rows} == {
        ("a3-ultragpu-8g", "nvidia-h200-141gb", "gpu")
    }


# ---------------------------------------------------------------- plan


def test_olmo2_32b_on_h100_nodes_at_38_percent_mfu_is_about_1800_tokens_per_gpu():
    """AI2 reports ~1,800 tokens/s per H100 (~38% MFU) for OLMo 2 32B; the plan's FLOPs per token give it
    within a few percent (OLMo-core's formula 1,821, MaxText's 1,895)."""
    r = load_recipe(stage=1, model="olmo2-32b")
    rep = plan_report(r, get_device("h100-mega-80gb-8x128"), 0.38)
    assert (rep["devices"], rep["chips"], rep["vms"]) == (1024, 1024, 128)
    assert (rep["per_device_batch"], rep["grad_accum"]) == (2, 1)  # 2048 instances over 1,024 GPUs
    e = rep["estimate"]
    assert e["olmo_core"]["tokens_per_s_per_device"] == pytest.approx(1800, rel=0.02)
    assert e["maxtext"]["tokens_per_s_per_device"] == pytest.approx(1800, rel=0.06)
    assert e["olmo_core"]["tokens_per_s_per_device"] == pytest.approx(
        0.38 * 989e12 / rep["flops_per_token"]["olmo_core"]
    )
    assert e["olmo_core"]["chip_hours"] == pytest.approx(e["olmo_core"]["wall_clock_s"] * 1024 / 3600)
    # The node count changes the per-GPU batch, never the global batch or the per-GPU rate.
    wide = load_recipe(stage=1, model="olmo2-32b", overrides=["train.global_batch=2560"])
    rep160 = plan_report(wide, get_device("h100-mega-80gb-8x160"), 0.38)
    assert (rep160["per_device_batch"] * rep160["grad_accum"], rep160["global_batch"]) == (2, 2560)
    assert rep160["estimate"]["olmo_core"]["tokens_per_s_per_device"] == pytest.approx(
        e["olmo_core"]["tokens_per_s_per_device"]
    )


def test_a_batch_the_gpus_cannot_share_in_whole_instances_is_exit_2_naming_node_counts_that_can():
    """OLMo 2 32B's 2,048 instances over 160 nodes x 8 GPUs would be 1.6 a GPU (12.8 a node)."""
    with pytest.raises(BadInput) as e:
        make_plan(load_recipe(stage=1, model="olmo2-32b"), get_device("h100-mega-80gb-8x160"))
    assert "2048 cannot be split exactly over the 1280 devices of h100-mega-80gb-8x160" in e.value.one_line()
    p = invoke("plan", "--model", "olmo2-32b", "--stage", "1", "--device", "h100-mega-80gb-8x160")
    assert p.returncode == 2 and p.stdout == ""
    (line,) = p.stderr.splitlines()
    assert "per-device batch would be 1.6" in line
    assert "use h100-mega-80gb-8x128 (2 per GPU) or h100-mega-80gb-8x256 (1 per GPU)" in line
    # More nodes than instances: the nodes (trainer processes) cannot each load whole instances either.
    q = invoke("plan", "--stage", "3", "--device", "b200-8x128")
    assert q.returncode == 2 and "Traceback" not in q.stderr and len(q.stderr.splitlines()) == 1


def _plan(tmp_path, *args, prices=None):
    env = clean_env(tmp_path / "cfg")
    if prices is not None:
        cfg = tmp_path / "cfg" / "olmo-ctl" / "config.yaml"
        cfg.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text(yaml.safe_dump({"prices": prices}))
    return invoke("plan", *args, env=env)


def test_plan_on_gpu_nodes_prints_per_gpu_batch_tokens_gpu_hours_and_price_unknown(tmp_path):
    args = ("--model", "olmo2-32b", "--stage", "1", "--device", "h100-mega-80gb-8x128", "--mfu", "0.38")
    p = _plan(tmp_path, *args)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "olmo2-32b-stage1 on h100-mega-80gb-8x128: 1024 GPUs on 128 nodes (a3-megagpu-8g)"
    assert "  per device        batch 2 x 1 accumulation step(s) = 2 instances per step" in lines
    assert "compute estimate at 38% MFU (989 TFLOP/s peak per device)" in lines
    (tps,) = [ln for ln in lines if ln.startswith("  tokens/s per GPU")]
    assert tps.split()[-2:] == ["1,821", "1,895"]
    (hours,) = [ln for ln in lines if ln.startswith("  GPU-hours")]
    r = json.loads(_plan(tmp_path, *args, "-o", "json").stdout)
    assert hours.split()[-2:] == [f"{r['estimate'][f]['chip_hours']:,.0f}" for f in ("olmo_core", "maxtext")]
    assert r["usd_per_chip_hour"] is None and r["generation"] == "h100-mega-80gb-8"
    assert (
        "  USD             price unknown: set yours per GPU-hour for h100-mega-80gb-8 (site setting `prices`)"
        in lines
    )
    # With the user's own price per GPU-hour of the machine type (a made-up number): dollars.
    priced = _plan(tmp_path, *args, "-o", "json", prices={"h100-mega-80gb-8": {"on_demand": 3.0}})
    rp = json.loads(priced.stdout)
    assert rp["usd_per_chip_hour"] == {"on_demand": 3.0}
    assert rp["estimate"]["maxtext"]["usd"] == {"on_demand": rp["estimate"]["maxtext"]["chip_hours"] * 3.0}
    table = _plan(tmp_path, *args, prices={"h100-mega-80gb-8": {"on_demand": 3.0}}).stdout
    assert "  at your prices per GPU-hour: on demand $3 (site setting `prices`)" in table.splitlines()
    assert "price unknown" not in table


# ---------------------------------------------------------------- what does not run on GPU nodes


def _refusal(by: str) -> str:
    return (
        f"error: `h100-mega-80gb-8x2` is GPU nodes (2 x a3-megagpu-8g): {by} does not run on GPU node pools;"
        " `olmo-ctl submit --backend gke` runs them (`plan` and `devices` take them too); here use a TPU"
        " slice (e.g. tpu7x-128) or a local device\n"
    )


LOCAL_REFUSAL = (
    "error: `h100-mega-80gb-8x2` is GPU nodes on GKE (2 x a3-megagpu-8g); the local backend runs cpu-N or"
    " gpu-N (this machine's GPUs); use --backend gke, or a local device such as gpu-8\n"
)


@pytest.mark.parametrize(
    "args,says",
    [
        (
            ("submit", "--stage", "1", "--device", "h100-mega-80gb-8x2", "--backend", "local", "--dry-run"),
            LOCAL_REFUSAL,
        ),
        (
            (
                "resume-until-done",
                "--stage",
                "1",
                "--device",
                "v5p-256",
                "--fallback",
                "h100-mega-80gb-8x2",
                "--run",
                "r",
            ),
            _refusal("--fallback"),
        ),
    ],
    ids=["submit-local", "fallback"],
)
def test_what_runs_only_on_tpu_slices_or_here_refuses_gpu_nodes_in_one_line(tmp_path, args, says):
    env = clean_env(tmp_path / "cfg")
    env["OLMO_CTL_RUN_ROOT"] = str(tmp_path / "runs")
    p = invoke(*(a.format(tmp=tmp_path) for a in args), env=env)
    assert (p.returncode, p.stdout, p.stderr) == (2, "", says)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "kubeconfig").exists()


def test_preflights_compile_refuses_gpu_nodes_and_the_command_prints_the_plans_estimate(tmp_path):
    """libtpu's topologies are TPU slices'; `olmo-ctl preflight` on GPU nodes compiles nothing and says
    the plan's memory estimate, labelled as one (and `submit` logs the same line before it queues)."""
    from olmo_ctl.preflight.compile import submit_check, topology_devices

    dev = get_device("b200-8x4")
    with pytest.raises(BadInput, match="preflight's compile does not run on GPU node pools"):
        topology_devices(dev)
    env = clean_env(tmp_path / "cfg")
    p = invoke("preflight", "--stage", "1", "--device", "h100-mega-80gb-8x2", env=env)
    assert p.returncode == 0, p.stderr
    recipe = load_recipe(stage=1)
    plan = make_plan(recipe, get_device("h100-mega-80gb-8x2"))
    line = (
        f"preflight: estimate, not compiled: {plan.estimated_bytes_per_device / 2**30:.1f} GiB of 80 GiB per GPU"
        f" on h100-mega-80gb-8x2 at micro-batch {plan.per_device_batch} (the plan's memory estimate;"
        " preflight compiles for TPU slices only)"
    )
    assert p.stdout == line + "\n"
    js = json.loads(
        invoke("preflight", "--stage", "1", "--device", "h100-mega-80gb-8x2", "-o", "json", env=env).stdout
    )
    assert js["compiled"] is False and js["estimated_bytes_per_device"] == plan.estimated_bytes_per_device
    said: list[str] = []
    assert submit_check(recipe, get_device("h100-mega-80gb-8x2"), plan, log=said.append) is None
    assert said == [line]
