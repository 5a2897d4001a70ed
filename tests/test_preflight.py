"""Preflight: the trainer's real step compiled for a v5p-8 topology with libtpu, on this CPU machine.

A reduced OLMo 3 (8 layers = two scanned groups of 3 sliding + 1 full, narrow width, seq 1024 so the
blocked attention runs its loops; splash, the TPU default, is compiled in its own test) with grad accumulation 2, so every loop preflight has to count
(accumulation scan, layer-group scan, attention loops) really iterates. Compiles are shared through
one cache directory per module; each takes ~30-80 s of CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from olmo_ctl.core.batching import param_count
from olmo_ctl.core.devices import GIB, get_device
from olmo_ctl.core.generations import GENERATIONS
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.preflight import compile as pf

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not pf.libtpu_available(), reason="needs libtpu (pip install 'olmo-ctl[tpu]')"),
]

SETS = [
    "model.n_layers=8",
    "model.d_model=256",
    "model.n_heads=2",
    "model.n_kv_heads=2",
    "model.head_dim=128",
    "model.mlp_hidden=704",
    "model.vocab_size=1000",
    "model.padded_vocab_size=1024",
    "model.sliding_window=256",
    "model.eos_token_id=1",
    "model.pad_token_id=2",
    "train.seq_len=1024",
    "train.global_batch=16",
    "train.max_per_device_batch=2",
    "model.remat=none",
    "model.attention=blocked",
]
DEVICE = "v5p-8"  # 4 devices: global batch 16 = 4 per device = micro-batch 2 x accumulation 2
BATCH = 2


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("cache")
    old = os.environ.get("OLMO_CTL_CACHE_DIR")
    os.environ["OLMO_CTL_CACHE_DIR"] = str(d)
    yield d
    if old is None:
        os.environ.pop("OLMO_CTL_CACHE_DIR", None)
    else:
        os.environ["OLMO_CTL_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(stage=1, overrides=SETS)


@pytest.fixture(scope="module")
def base(cache, recipe):
    """remat=none, head dim 128: compiled once for the module."""
    return pf.run_preflight(recipe, get_device(DEVICE), remat="none", per_device_batch=BATCH)


def test_compiles_and_reports_memory_and_plan(base, recipe):
    assert base.compiled_by_xla and not base.cached
    assert (base.topology, base.devices) == ("v5p:2x2x1", 4)
    assert (base.per_device_batch, base.grad_accum) == (2, 2)
    assert base.param_count == param_count(recipe.model)
    # Arguments = fp32 params + two fp32 Adam moments (sharded 4 ways) + the int32 batch shard.
    state = 3 * 4 * base.param_count / 4
    batch = 2 * 2 * BATCH * recipe.train.seq_len * 4
    assert state <= base.argument_bytes_per_device <= 1.05 * (state + batch) + 1e5
    assert base.alias_bytes_per_device >= 0.99 * state  # the donated state is updated in place
    assert base.peak_bytes_per_device == (
        base.argument_bytes_per_device
        + base.output_bytes_per_device
        - base.alias_bytes_per_device
        + base.temp_bytes_per_device
        + base.generated_code_bytes_per_device
    )
    assert base.fits and base.hbm_bytes_per_device == min(
        get_device(DEVICE).hbm_bytes_per_device, GENERATIONS["v5p"].compiler_hbm_bytes
    )
    assert base.compile_s > 0


def test_the_eval_step_is_compiled_beside_the_train_step_and_bounded_by_its_micro_batch(base, recipe):
    # The eval batch (the global batch, 16) in the train step's micro-batches: 8 instances over 4 devices.
    assert (base.eval_micro_batch, base.eval_peak_bytes_per_device > 0) == (8, True)
    logits = recipe.train.seq_len * recipe.model.padded_vocab_size * 4  # one instance's fp32 logits
    peaks = {}
    for micro in (4, 16):
        r = load_recipe(stage=1, overrides=[*SETS, f"eval.micro_batch={micro}"])
        peaks[micro] = pf.run_preflight(r, get_device(DEVICE), n_layers=1, per_device_batch=BATCH)
    assert [p.eval_micro_batch for p in peaks.values()] == [4, 16]
    # One pass over the eval batch holds 4 instances' logits per device; micro-batches of 4 hold one.
    assert peaks[16].eval_peak_bytes_per_device - peaks[4].eval_peak_bytes_per_device >= 3 * logits
    assert peaks[4].peak_bytes_per_device == peaks[16].peak_bytes_per_device  # the train step is the same
    # An eval step over HBM fails the verdict though the train step fits.
    train = peaks[16].peak_bytes_per_device
    over = dataclasses.replace(peaks[16], eval_peak_bytes_per_device=train + GIB)
    tight = pf._with_hbm(over, train + GIB // 2)
    assert (tight.fits, tight.shortfall_bytes_per_device) == (False, GIB - GIB // 2)
    assert "trains but does not evaluate on v5p-8 with eval micro-batch 16" in tight.verdict()
    assert "0.50 GiB over" in tight.verdict()


def test_xla_flops_count_every_loop_iteration_and_match_the_formula(base, recipe):
    # Dense (weight) matmuls: XLA's compiled program vs MaxText's 6 x weights x tokens, with the
    # accumulation scan (2) and the layer-group scan (2) multiplied in: without them it would be ~1/4.
    assert base.dense_xla_vs_formula == pytest.approx(1.0, abs=0.01)
    assert base.xla_recompute_flops_per_step == 0  # remat=none recomputes nothing
    # The attention kernel's loops are counted tile by tile (skipped tiles included): above MaxText's
    # causal-halved term, below 4x of it.
    assert 1.0 < base.xla_attention_flops_per_step / base.formula_attention_flops_per_step < 4.0
    # The loop correction only adds iterations to what cost_analysis() counted once.
    assert base.xla_flops_per_step > 3 * base.xla_flops_per_device_body_once * base.devices / 4
    assert base.xla_flops_per_step >= base.xla_dense_flops_per_step + base.xla_attention_flops_per_step
    assert base.xla_vs_formula == pytest.approx(base.xla_flops_per_step / base.formula_flops_per_step)


def test_hlo_walk_matches_xla_cost_analysis(base):
    """With every loop body counted once, the HLO walk reproduces cost_analysis() (matmuls dominate)."""
    assert base.hlo_loops >= 4 and base.hlo_unresolved_loops == 0
    assert base.hlo_flops_per_device_body_once == pytest.approx(base.xla_flops_per_device_body_once, rel=0.03)


def test_tiny_hbm_does_not_fit_and_says_by_how_much(base, recipe):
    hbm = base.peak_bytes_per_device - GIB // 4
    r = pf.run_preflight(recipe, get_device(DEVICE), remat="none", per_device_batch=BATCH, hbm_bytes=hbm)
    assert r.cached  # the verdict changes, the compile is reused
    assert not r.fits
    assert r.shortfall_bytes_per_device == GIB // 4
    assert "does not fit" in r.verdict() and "0.25 GiB over" in r.verdict()


def test_head_dim_256_same_parameters_and_flops(base, recipe):
    wide = pf.run_preflight(recipe, get_device(DEVICE), remat="none", per_device_batch=BATCH, head_dim=256)
    assert (wide.head_dim, wide.n_heads) == (256, 1)
    assert wide.param_count == base.param_count
    assert wide.xla_flops_per_step == pytest.approx(base.xla_flops_per_step, rel=0.01)
    assert wide.formula_flops_per_step == base.formula_flops_per_step


def test_search_recommends_the_cheapest_policy_that_fits(base, recipe):
    # HBM just below what remat=none needs: the search must move on to mlp (less memory).
    hbm = base.peak_bytes_per_device - 1
    tried, best = pf.search(recipe, get_device(DEVICE), per_device_batch=BATCH, hbm_bytes=hbm)
    assert [t.remat for t in tried][:2] == ["none", "mlp"]
    assert not tried[0].fits
    assert best is not None and best.fits and best.remat == tried[-1].remat
    assert best.peak_bytes_per_device < base.peak_bytes_per_device
    assert best.xla_recompute_flops_per_step > 0


def _cli(*args, cache_dir):
    env = dict(os.environ, OLMO_CTL_CACHE_DIR=str(cache_dir))
    cmd = [sys.executable, "-c", "from olmo_ctl.cli import entry; entry()"]
    sets = [x for s in SETS for x in ("--set", s)]
    return subprocess.run(
        [
            *cmd,
            "preflight",
            "--stage",
            "1",
            "--device",
            DEVICE,
            "--remat",
            "none",
            "--per-device-batch",
            str(BATCH),
            *sets,
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_cli_json_and_exit_codes(base, cache):
    p = _cli("-o", "json", cache_dir=cache)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    for k in (
        "device",
        "topology",
        "devices",
        "per_device_batch",
        "grad_accum",
        "remat",
        "hbm_bytes_per_device",
        "peak_bytes_per_device",
        "eval_peak_bytes_per_device",
        "eval_micro_batch",
        "fits",
        "xla_flops_per_step",
        "formula_flops_per_step",
        "compile_s",
    ):
        assert k in d
    assert d["cached"] and d["fits"] and d["peak_bytes_per_device"] == base.peak_bytes_per_device
    assert d["eval_peak_bytes_per_device"] == base.eval_peak_bytes_per_device > 0
    table = _cli(cache_dir=cache)
    words = " ".join(table.stdout.split())
    assert table.returncode == 0 and "eval = the eval step's peak, in micro-batches of 8 instances" in words
    assert f"{base.eval_peak_bytes_per_device / GIB:.2f}" in table.stdout, table.stdout
    small = (base.peak_bytes_per_device - GIB // 2) / GIB
    p = _cli("--hbm-gib", str(small), cache_dir=cache)
    assert p.returncode == 1
    assert "does not fit on v5p-8" in p.stderr and "0.50 GiB over" in p.stderr
    assert "Traceback" not in p.stderr
    p = _cli("--head-dim", "96", cache_dir=cache)
    assert p.returncode == 2 and "--head-dim 96" in p.stderr


def test_submit_check_uses_the_plan_and_the_cache(base, recipe):
    from olmo_ctl.core.batching import make_plan

    dev = get_device(DEVICE)
    plan = make_plan(recipe, dev)
    assert plan.per_device_batch == BATCH
    lines = []
    r = pf.submit_check(recipe, dev, plan, log=lines.append)
    assert r is not None and r.cached and r.fits
    assert len(lines) == 1 and "fits on v5p-8" in lines[0] and "(cached)" in lines[0]
    assert pf.submit_check(recipe, get_device("cpu-4"), plan, log=lines.append) is None


def test_the_shipped_smoke_result_compiles_again_to_the_same_figures(cache):
    """The shipped results (preflight/shipped.json) are what this trainer compiles: the cheapest of them,
    compiled again here, gives the same memory, FLOPs and verdict (else: make preflight-shipped)."""
    from olmo_ctl.preflight.cache import load_shipped

    recipe, dev = load_recipe("smoke"), get_device("v5p-8")
    shipped = load_shipped(pf.shipped_key_for(recipe, dev))
    assert shipped is not None, "no shipped result for smoke on v5p-8: run `make preflight-shipped`"
    again = pf.run_preflight(recipe, dev, use_cache=False).to_dict()
    same = (
        "per_device_batch",
        "grad_accum",
        "remat",
        "attention",
        "argument_bytes_per_device",
        "output_bytes_per_device",
        "alias_bytes_per_device",
        "temp_bytes_per_device",
        "peak_bytes_per_device",
        "eval_peak_bytes_per_device",
        "fits",
        "xla_flops_per_step",
        "xla_flags",
    )
    assert {k: again[k] for k in same} == {k: shipped[k] for k in same}


def test_parse_compiler_refusal():
    msg = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
        "(505.08G) exceeds available HBM (95.74G)."
    )
    used, cap, temps_only = pf.parse_hbm_oom(msg)
    assert temps_only and used == int(505.08 * GIB) and cap == int(95.74 * GIB)
    assert pf.parse_hbm_oom("Used 120.5G of 95.74G hbm. Exceeded hbm capacity by 24.76G.")[:2] == (
        int(120.5 * GIB),
        int(95.74 * GIB),
    )
    assert pf.parse_hbm_oom("INTERNAL: something else") is None


def test_splash_compiles_and_its_flops_are_counted_from_the_mask(cache, recipe):
    """`auto` on a TPU slice is splash; XLA counts none of the Pallas kernel's FLOPs, preflight adds
    them from the mask: forward 2 and fused backward 5 matmuls per computed tile, per head and sequence."""
    from olmo_ctl.core.xla_flags import xla_flags_for
    from olmo_ctl.trainer import attention as A

    auto = load_recipe(stage=1, overrides=[*SETS, "model.attention=auto"])
    r = pf.run_preflight(auto, get_device(DEVICE), remat="none", per_device_batch=BATCH)
    assert r.compiled_by_xla and r.attention == "splash"
    assert r.xla_flags == xla_flags_for(get_device(DEVICE), auto, None) and r.xla_flags  # v5p's set
    m, t = auto.model, auto.train
    (bq, bkv, _), tp = A.splash_blocks("v5p", t.seq_len)
    per_seq_head = sum(
        2.0 * bq * bkv * m.head_dim * (2 + 5) * A.splash_mask_blocks(tp, w, bq, bkv)
        for w in [None if m.layer_is_full(i) else m.sliding_window for i in range(m.n_layers)]
    )
    assert r.kernel_flops_per_step == pytest.approx(per_seq_head * m.n_heads * t.global_batch, rel=1e-9)
    assert any("does not count Pallas kernels" in n for n in r.notes)
    # The weight matmuls are unchanged; attention is now the kernel's tiles (here one 1024-token tile).
    assert r.dense_xla_vs_formula == pytest.approx(1.0, abs=0.01)
    assert 1.0 <= r.xla_attention_flops_per_step / r.formula_attention_flops_per_step < 3.0


def test_misspelled_flag_in_a_recipe_is_refused_with_exit_2(cache):
    p = _cli(
        "--set", "xla_flags=[--xla_tpu_enable_async_collective_fusion_fuse_all_gathr=false]", cache_dir=cache
    )
    assert p.returncode == 2, p.stderr
    assert "--xla_tpu_enable_async_collective_fusion_fuse_all_gathr" in p.stderr and "xla_flags" in p.stderr
    assert "Traceback" not in p.stderr
    p = _cli("--set", "xla_flags=[not-a-flag]", cache_dir=cache)
    assert p.returncode == 2 and "`not-a-flag` is not of the form --name=value" in p.stderr


def test_two_slices_compile_ahead_of_time(cache):
    """libtpu describes N slices of a topology (`num_slices`): the step compiles for 2 x v5p-16 with the
    slices on the outer data axis, the global batch over all 16 devices and the same state per device."""
    r = load_recipe("smoke", overrides=["train.global_batch=16"])
    one = pf.run_preflight(r, get_device("v5p-16"), n_layers=1, use_cache=False)
    two = pf.run_preflight(r, get_device("v5p-16"), n_layers=1, slices=2, use_cache=False)
    assert two.error is None and two.fits
    assert (one.devices, two.devices) == (8, 16) and (one.per_device_batch, two.per_device_batch) == (2, 1)
    assert two.argument_bytes_per_device < one.argument_bytes_per_device  # half the batch rows per device


# Compiles smoke's one-layer step for each device named on the command line, in this one process, and
# prints the last one's result.
_COMPILE_IN_TURN = """
import json, sys
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.preflight.compile import run_preflight
for name in sys.argv[1:]:
    result = run_preflight(load_recipe("smoke"), get_device(name), n_layers=1, use_cache=False)
print(json.dumps(result.to_dict()))
"""


def test_a_second_generation_compiled_in_one_process_gets_the_figures_of_a_fresh_process(cache, tmp_path):
    """libtpu reads LIBTPU_INIT_ARGS once, when a process first asks it for a topology, and every later
    compile there starts from those flags: tpu7x's would move a v5p step's memory and FLOPs. v5p-8
    compiled after tpu7x-8 in one process (a benchmark's loop, `make preflight-shipped`) has the
    figures of v5p-8 compiled alone in a fresh process, as `olmo-ctl submit` computes them."""
    from helpers.cli import clean_env

    env = {**clean_env(tmp_path / "xdg"), "OLMO_CTL_CACHE_DIR": str(cache)}

    def compiled(*devices: str) -> dict:
        p = subprocess.run(
            [sys.executable, "-c", _COMPILE_IN_TURN, *devices],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.splitlines()[-1])

    # Each in a process of its own, so which generation starts libtpu there does not depend on what this
    # test run compiled before.
    after, alone = compiled("tpu7x-8", "v5p-8"), compiled("v5p-8")
    figures = (
        "argument_bytes_per_device",
        "temp_bytes_per_device",
        "peak_bytes_per_device",
        "eval_peak_bytes_per_device",
        "xla_flops_per_step",
        "xla_flags",
    )
    assert after["device"] == alone["device"] == "v5p-8"
    assert {k: after[k] for k in figures} == {k: alone[k] for k in figures}


@pytest.mark.parametrize(("device", "topology"), [("v6e-8", "v6e:2x4"), ("v5litepod-8", "v5e:2x4")])
def test_2d_generations_compile_ahead_of_time_with_their_flags(cache, device, topology):
    """v6e and v5e slices (2D tori, one TensorCore per chip) compile like v5p's: libtpu's topology of
    the catalog's name, its devices, the generation's XLA flags, the catalog's HBM."""
    r = load_recipe("smoke", overrides=["train.global_batch=16"])
    dev = get_device(device)
    res = pf.run_preflight(r, dev, n_layers=1, use_cache=False)
    assert res.error is None and res.fits and res.compiled_by_xla
    assert (res.topology, res.devices, res.per_device_batch) == (topology, 8, 2)
    assert res.hbm_bytes_per_device == dev.hbm_bytes_per_device
    assert res.xla_flags == list(GENERATIONS[dev.generation].xla_flags)


def test_a_compile_says_what_it_compiles_and_that_it_still_runs(cache, monkeypatch):
    """Off a terminal too: a start line, a `still compiling` line every HEARTBEAT_S, the compile time."""
    from helpers.cli import invoke

    monkeypatch.setattr(pf, "HEARTBEAT_S", 0.2)
    r = invoke("preflight", "--recipe", "smoke", "--device", DEVICE, "--no-cache", "-o", "json")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("preflight: compiling the train step of smoke for v5p-8 (2x2x1), remat ")
    assert any(ln.startswith("preflight: still compiling (") for ln in lines[1:-1]), lines
    assert lines[-1] == f"preflight: compiled in {json.loads(r.stdout)['compile_s']:.0f} s"
