"""Preflight: compile the real train step for a TPU slice on this machine and check that it fits.

The step is the trainer's own (`olmo_ctl.trainer.train.make_train_step`: model, loss, gradient
accumulation, AdamW with skip-step), jitted with the trainer's state shardings, donation and
micro-batch layout, and lowered with abstract inputs (`jax.ShapeDtypeStruct`, nothing allocated) for
the slice's topology from libtpu (`jax.experimental.topologies`). No TPU is needed: the real TPU
compiler runs on the CPU, the way MaxText checks a config before queueing for a slice.

What comes back, per device:
* memory: XLA's `memory_analysis()` of the compiled step. Peak = arguments + outputs - aliased
  (the donated state) + temporaries + generated code. `fits` compares it with the device's HBM.
  When the TPU compiler itself refuses the program for lack of HBM, its "used X of Y" is parsed.
* FLOPs: XLA's `cost_analysis()` counts the body of every while loop once (the grad-accumulation
  scan, the layer-group scan and the blocked attention's loops), so preflight adds the matmul FLOPs
  of every repeated iteration, counted on the compiled HLO (`olmo_ctl.preflight.hlo_flops`). A
  conditional counts its most expensive branch, as XLA does: the blocked attention's skipped tiles
  are counted as executed, so XLA's number is an upper bound on the attention part. Element-wise
  FLOPs inside loops are counted once (well under 1% of a transformer step).
* the same numbers from our formulas (`olmo_ctl.core.flops`, MaxText and OLMo-core), and compile time.
* the eval step's peak memory per device (`trainer/step.py:make_eval_step`, compiled beside the train
  step in the trainer's eval micro-batches): the verdict needs both steps to fit.

Results are cached as JSON per (recipe fingerprint, device, remat, batch, trainer version): see
`olmo_ctl.preflight.cache`.

libtpu reads LIBTPU_INIT_ARGS (the pods' XLA flags) once, when a process first asks it for a topology,
and every later compile in that process starts from those flags: a compile option overrides only the
flags it names, so a v5p step compiled after a tpu7x one would keep Ironwood's settings for the rest
(its memory and FLOPs move). A compile whose pods get other flags than the ones this process's libtpu
started with (another generation, a recipe's or site's own flags) therefore runs in a process of its
own (`python -m olmo_ctl.preflight.compile`, its result back as JSON): a caller that compiles several
slices in one process (`benchmarks/preflight_7b.py`, `make preflight-shipped`, a test run, a Python
session) gets the figures of a fresh process. The commands (`preflight`, `submit`, `resize`) compile
for one slice per process and never need the child.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, TypedDict, Unpack

from olmo_ctl.core import flops as flops_lib
from olmo_ctl.core.batching import Plan, make_plan, mesh_layout, param_count
from olmo_ctl.core.config import Settings
from olmo_ctl.core.devices import GIB, Device
from olmo_ctl.core.errors import EXIT_RUN_FAILED, BadInput, Interrupted, OlmoCtlError
from olmo_ctl.core.generations import GENERATIONS
from olmo_ctl.core.recipe import Recipe
from olmo_ctl.core.xla_flags import xla_flag_sources
from olmo_ctl.preflight.cache import (
    cache_key,
    load_cached,
    load_shipped,
    shipped_compile_s,
    shipped_key,
    store_cached,
    trainer_version,
)
from olmo_ctl.preflight.hlo_flops import hlo_flops

# Cheapest recompute first: `--search` takes the first one that fits.
REMAT_POLICIES = ("none", "mlp", "save_proj", "budget", "full")
HEARTBEAT_S = 30.0  # while a compile runs, a "still compiling" line this often (off a terminal too)
HEAD_DIMS = (128, 256)
_LIBTPU_STARTED_WITH: str | None = None  # the LIBTPU_INIT_ARGS this process's libtpu read when it started


@dataclass
class PreflightResult:
    recipe: str
    recipe_fingerprint: str
    device: str
    topology: str
    devices: int
    per_device_batch: int
    grad_accum: int
    seq_len: int
    remat: str
    head_dim: int
    n_heads: int
    n_layers: int
    attention: str
    param_count: int
    hbm_bytes_per_device: int
    argument_bytes_per_device: int
    output_bytes_per_device: int
    alias_bytes_per_device: int
    temp_bytes_per_device: int
    generated_code_bytes_per_device: int
    peak_bytes_per_device: int
    fits: bool
    shortfall_bytes_per_device: int  # 0 when it fits
    xla_flops_per_step: float | None
    xla_flops_per_device_body_once: float | None  # cost_analysis() as XLA reports it
    formula_flops_per_step: float  # MaxText formula (the case study's 1565 TFLOP/device/step)
    formula_olmo_core_flops_per_step: float
    xla_vs_formula: float | None  # xla_flops_per_step / formula_flops_per_step
    # The matmul part split three ways (per step, whole slice), next to the MaxText formula's terms:
    xla_dense_flops_per_step: float | None  # weight matmuls, forward + backward
    xla_attention_flops_per_step: float | None  # attention einsums as compiled (skipped tiles included)
    xla_recompute_flops_per_step: float | None  # forward ops run again by rematerialisation
    formula_dense_flops_per_step: float
    formula_attention_flops_per_step: float
    dense_xla_vs_formula: float | None
    compile_s: float
    compiled_by_xla: bool  # False when the compiler refused the program for lack of HBM
    trainer_version: str
    error: str | None = None
    cached: bool = False
    shipped: bool = False  # answered from the results shipped with the package (preflight/shipped.json)
    notes: list[str] = field(default_factory=list)
    hlo_flops_per_device_body_once: float | None = None  # the HLO walk's matmuls, loops once: checks the walk
    hlo_loops: int | None = None
    hlo_unresolved_loops: int | None = None
    largest_buffers: list[str] = field(default_factory=list)  # XLA's biggest allocations per device
    xla_flags: list[str] = field(default_factory=list)  # the pods' LIBTPU_INIT_ARGS, compiled with
    # Pallas kernels (splash attention) as counted from their masks: XLA's cost analysis counts none of
    # their FLOPs; they are added to xla_flops_per_step and xla_attention_flops_per_step.
    kernel_flops_per_step: float | None = None
    seq_shards: int = 1  # devices each instance's sequence is split over (the plan's)
    slices: int = 1
    # The eval step (`trainer/step.py:make_eval_step`) compiled beside the train step: its peak per
    # device (arguments + outputs + temporaries + code; None when the recipe evaluates nothing) and its
    # micro-batch (instances per forward pass over the slice, `core.batching.eval_micro_batch`).
    eval_peak_bytes_per_device: int | None = None
    eval_micro_batch: int | None = None
    # What was compiled: a digest of the lowered train and eval steps (`program_digest`). A result of
    # another trainer version stands for this one's when this one lowers to the same program.
    program: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes_per_device / GIB

    @property
    def shortfall_gib(self) -> float:
        return self.shortfall_bytes_per_device / GIB

    @property
    def eval_peak_gib(self) -> float | None:
        return None if self.eval_peak_bytes_per_device is None else self.eval_peak_bytes_per_device / GIB

    def verdict(self) -> str:
        hbm = self.hbm_bytes_per_device / GIB
        eval_peak = self.eval_peak_bytes_per_device or 0
        if self.compiled_by_xla and self.peak_bytes_per_device <= self.hbm_bytes_per_device < eval_peak:
            return (
                f"{self.recipe} trains but does not evaluate on {self.device} with eval micro-batch"
                f" {self.eval_micro_batch}: the eval step needs {eval_peak / GIB:.2f} GiB of {hbm:.2f} GiB HBM"
                f" per device, {self.shortfall_gib:.2f} GiB over"
            )
        if self.fits:
            return (
                f"{self.recipe} fits on {self.device} with remat={self.remat}: {self.peak_gib:.2f} GiB of "
                f"{hbm:.2f} GiB HBM per device ({hbm - self.peak_gib:.2f} GiB free)"
            )
        return (
            f"{self.recipe} does not fit on {self.device} with remat={self.remat}, per-device batch "
            f"{self.per_device_batch}: needs {self.peak_gib:.2f} GiB of {hbm:.2f} GiB HBM per device, "
            f"{self.shortfall_gib:.2f} GiB over"
        )


# ----------------------------------------------------------------------------- recipe variants


def preflight_recipe(
    recipe: Recipe, *, remat: str | None = None, head_dim: int | None = None, n_layers: int | None = None
) -> Recipe:
    """The recipe as preflight compiles it: remat / head-dim / depth overrides applied.

    `head_dim=256` keeps d_model and the parameter count: heads = n_heads * head_dim / 256 (the
    case study's 16 x 256 layout for OLMo 3 7B, which fills a 256x256 MXU).
    """
    m = recipe.model
    changes: dict = {}
    if remat is not None:
        if remat not in REMAT_POLICIES:
            raise BadInput(f"--remat `{remat}` is not a policy", f"use one of {', '.join(REMAT_POLICIES)}")
        changes["remat"] = remat
    if head_dim is not None and head_dim != m.head_dim:
        if head_dim not in HEAD_DIMS:
            raise BadInput(f"--head-dim {head_dim} is not supported", "use 128 or 256")
        q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
        if q % head_dim or kv % head_dim:
            raise BadInput(
                f"--head-dim {head_dim} does not divide the attention width {q}",
                "choose a head dim that divides n_heads * head_dim",
            )
        changes.update(head_dim=head_dim, n_heads=q // head_dim, n_kv_heads=kv // head_dim)
    if n_layers is not None:
        if n_layers < 1:
            raise BadInput("--layers must be >= 1")
        changes["n_layers"] = n_layers
    if not changes:
        return recipe
    return dataclasses.replace(recipe, model=dataclasses.replace(m, **changes))


def plan_for(recipe: Recipe, device: Device, per_device_batch: int | None = None, slices: int = 1) -> Plan:
    """The trainer's plan on `slices` x `device`; `per_device_batch` forces the micro-batch (accumulation
    makes up the rest)."""
    t = recipe.train
    devices = device.devices * slices
    if per_device_batch is None or t.global_batch % devices:
        return make_plan(recipe, device, slices)  # (raises the plan's own message when it does not split)
    share = t.global_batch // devices
    if per_device_batch < 1 or share % per_device_batch:
        raise BadInput(
            f"--per-device-batch {per_device_batch} does not divide the per-device share of the global batch"
            f" ({t.global_batch} / {devices} devices = {share})",
            "choose a divisor of the share, or change train.global_batch",
        )
    relaxed = dataclasses.replace(recipe, train=dataclasses.replace(t, max_per_device_batch=per_device_batch))
    try:
        base = make_plan(relaxed, device, slices)
    except BadInput:  # the estimate says nothing fits: the compile is the judge here
        base = make_plan(
            dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, n_layers=1)), device, slices
        )
    return dataclasses.replace(
        base,
        per_device_batch=per_device_batch,
        grad_accum=share // per_device_batch,
        remat=recipe.model.remat,
    )


# ----------------------------------------------------------------------------- compile


def topology_devices(device: Device, slices: int = 1, libtpu_args: str = "", *, any_flags: bool = False):
    """The slice's JAX devices from libtpu's topology description (no TPU attached); with `slices` > 1
    those of N such slices, each device carrying its `slice_index` (libtpu's `num_slices`).

    The first call in a process starts libtpu with `libtpu_args` (the pods' LIBTPU_INIT_ARGS; this
    environment's when empty), which it keeps for the life of the process: a later call with other
    flags is refused (`compiles_in_this_process` says when a compile must run in a process of its own),
    unless `any_flags` (the devices are only lowered for, never compiled for: `program_digest`).
    """
    global _LIBTPU_STARTED_WITH
    device.check_launchable("preflight's compile")
    if not device.is_tpu:
        raise BadInput(
            f"preflight compiles for TPU slices; `{device.name}` is a local device",
            "pass a TPU device such as tpu7x-128 or v5p-256",
        )
    try:
        from jax.experimental import topologies
    except ImportError:  # pragma: no cover
        raise BadInput("preflight needs jax", "pip install 'olmo-ctl[trainer,tpu]'") from None
    if not libtpu_available():
        raise BadInput("preflight needs libtpu to compile for TPU", "pip install 'olmo-ctl[tpu]'")
    # libtpu takes a machine-wide lock file unless told otherwise; a compile-only process needs no
    # exclusive access to a TPU, and two preflights (or a test run) may compile at the same time.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    start = libtpu_start_args(libtpu_args)
    if not any_flags and not compiles_in_this_process(libtpu_args):
        raise RuntimeError(
            f"libtpu in this process started with other flags than {device.name}'s pods get"
            " (`run_preflight` compiles such a slice in a process of its own)"
        )
    kw = {"num_slices": slices} if slices > 1 else {}
    try:
        with _environ("LIBTPU_INIT_ARGS", start):  # read by libtpu when this starts it, and never again
            topo = topologies.get_topology_desc(platform="tpu", topology_name=device.topology_name, **kw)
    finally:  # started, even when it refused the topology (with the flags of the first call)
        if _LIBTPU_STARTED_WITH is None:
            _LIBTPU_STARTED_WITH = start
    devs = list(topo.devices)
    if len(devs) != device.devices * slices:
        raise RuntimeError(
            f"libtpu topology {slices} x {device.topology_name} has {len(devs)} devices, the catalog"
            f" says {device.devices * slices}"
        )
    return devs


def libtpu_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def libtpu_start_args(libtpu_args: str) -> str:
    """The LIBTPU_INIT_ARGS libtpu starts with for a compile with the pods' `libtpu_args`: those, or this
    environment's when the pods get none."""
    return libtpu_args or os.environ.get("LIBTPU_INIT_ARGS", "")


def compiles_in_this_process(libtpu_args: str) -> bool:
    """Whether a compile with the pods' `libtpu_args` gets, in this process, the figures a fresh process
    gets: libtpu has not started here yet, or it started with the same flags (see the module docstring)."""
    return _LIBTPU_STARTED_WITH in (None, libtpu_start_args(libtpu_args))


def abstract_inputs(recipe: Recipe, mesh, grad_accum: int):
    """The trainer's state and batch as sharded `ShapeDtypeStruct`s (mirrors `train.run`)."""
    import jax
    import jax.numpy as jnp

    from olmo_ctl.trainer.step import abstract_train_state, micro_batch_sharding

    t = recipe.train
    state, state_shard = abstract_train_state(recipe, mesh)
    micro_shard = micro_batch_sharding(mesh)
    shape = (grad_accum, t.global_batch // grad_accum, t.seq_len)
    keys = ("input_ids", "labels") + (
        ("segment_ids",) if recipe.data.packed else ()
    )  # packed: document masks
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=micro_shard) for k in keys}
    return state, state_shard, batch


_HBM_USED = re.compile(r"Used\s+([0-9.]+)([KMGT]?)\s+of\s+([0-9.]+)([KMGT]?)\s+hbm", re.I)
_HBM_TEMPS = re.compile(
    r"HLO temporaries \(([0-9.]+)([KMGT]?)\) exceeds available HBM \(([0-9.]+)([KMGT]?)\)", re.I
)
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_hbm_oom(message: str) -> tuple[int, int, bool] | None:
    """From the TPU compiler's refusal: (bytes, capacity, temporaries_only).

    libtpu says either "Used X of Y hbm" (everything) or "the total memory required for HLO
    temporaries (X) exceeds available HBM (Y)" (temporaries only: add the arguments).
    """
    for rx, temps_only in ((_HBM_USED, False), (_HBM_TEMPS, True)):
        m = rx.search(message)
        if m:
            used = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
            cap = int(float(m.group(3)) * _UNITS[m.group(4).upper()])
            return used, cap, temps_only
    return None


def argument_bytes(tree) -> int:
    """Bytes per device of sharded `ShapeDtypeStruct` inputs (one shard of each)."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * leaf.dtype.itemsize
    return total


def compile_step(
    recipe: Recipe,
    device: Device,
    plan: Plan,
    dump_dir: str | None = None,
    xla_options: dict[str, str] | None = None,
    libtpu_args: str = "",
):
    """Lower and compile the trainer's step for the slice.

    Returns (compiled or None, compile_s, error message or None, argument bytes per device).
    With `dump_dir`, XLA writes its buffer assignment there (see `largest_buffers`). `xla_options`
    are the pod's XLA flags libtpu takes per compile; `libtpu_args` is the pod's LIBTPU_INIT_ARGS,
    given to libtpu when this process starts it (see `topology_devices` and `olmo_ctl.preflight.flags`).
    """
    import jax

    from olmo_ctl.trainer import attention as attn_lib
    from olmo_ctl.trainer import sharding
    from olmo_ctl.trainer.step import make_train_step

    devs = topology_devices(device, plan.slices, libtpu_args)
    kind, replicas = mesh_layout(recipe, device.devices)
    # The topology's mesh is made current only while tracing (not activated for the process): a
    # later trace in this process (the trainer, a test) must not pin activations to abstract TPU devices.
    mesh = sharding.make_mesh(
        devs, kind, replicas, activate=False, slices=plan.slices, seq_shards=plan.seq_shards
    )
    state, state_shard, batch = abstract_inputs(recipe, mesh, plan.grad_accum)
    step = jax.jit(make_train_step(recipe), donate_argnums=(0,), out_shardings=(state_shard, None))
    options: dict[str, str | bool] = dict(xla_options or {})
    if dump_dir:
        options.update(xla_dump_to=dump_dir, xla_dump_hlo_module_re="jit_step")
    t0 = time.monotonic()
    try:
        # `auto` attention and splash's block sizes follow the slice, not this machine's CPU.
        with jax.set_mesh(mesh), attn_lib.compile_target("tpu", device.generation):
            lowered = step.lower(state, batch)
        compiled = lowered.compile(compiler_options=options or None)
    except Exception as e:  # noqa: BLE001 - JaxRuntimeError's module moves between jax versions
        msg = str(e)
        if "RESOURCE_EXHAUSTED" in msg or parse_hbm_oom(msg):
            return None, time.monotonic() - t0, msg, argument_bytes((state, batch))
        raise
    return compiled, time.monotonic() - t0, None, argument_bytes((state, batch))


def compile_eval_step(
    recipe: Recipe,
    device: Device,
    plan: Plan,
    xla_options: dict[str, str] | None = None,
    libtpu_args: str = "",
):
    """Lower and compile the trainer's eval step for the slice, in the micro-batches the trainer runs.

    Returns (peak bytes per device or None, micro-batch, note or None): None and no note when the
    recipe evaluates nothing (`eval.batches` 0); when the compiler refuses it for lack of HBM, its
    "used X" and a note. `xla_options` and `libtpu_args` as for `compile_step`.
    """
    import jax

    from olmo_ctl.core.batching import eval_micro_batch
    from olmo_ctl.trainer import attention as attn_lib
    from olmo_ctl.trainer import sharding
    from olmo_ctl.trainer.step import abstract_eval_batch, abstract_train_state, jit_eval_step

    if recipe.eval.batches <= 0:
        return None, None, None
    micro = eval_micro_batch(recipe, plan)
    kind, replicas = mesh_layout(recipe, device.devices)
    mesh = sharding.make_mesh(
        topology_devices(device, plan.slices, libtpu_args),
        kind,
        replicas,
        activate=False,
        slices=plan.slices,
        seq_shards=plan.seq_shards,
    )
    state, _ = abstract_train_state(recipe, mesh)
    params, batch = state["params"], abstract_eval_batch(recipe, plan, mesh)
    try:
        with jax.set_mesh(mesh), attn_lib.compile_target("tpu", device.generation):
            lowered = jit_eval_step(recipe).lower(params, batch)
        compiled = lowered.compile(compiler_options=xla_options or None)
    except Exception as e:  # noqa: BLE001 - JaxRuntimeError's module moves between jax versions
        used = parse_hbm_oom(str(e))
        if "RESOURCE_EXHAUSTED" not in str(e) and used is None:
            raise
        need = 0 if used is None else used[0] + (argument_bytes((params, batch)) if used[2] else 0)
        return (
            need,
            micro,
            f"the TPU compiler refused the eval step: it needs {need / GIB:.2f} GiB per device",
        )
    mem = compiled.memory_analysis()
    peak = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
        + mem.generated_code_size_in_bytes
    )
    return peak, micro, None


_REPORT_ROW = re.compile(r"^\s*[0-9.]+\w+\(\s*\d+%\);\s*([0-9.]+\w+);\s*\d+;\s*\d+;\s*(.*)$")


def largest_buffers(dump_dir: str, n: int = 6) -> list[str]:
    """The `n` largest HBM allocations from XLA's memory-usage report, e.g. `32.00GiB 5xf32[16,16,...]`.

    Each is one allocation that XLA shares between the values listed (they are never live at once).
    """
    reports = sorted(Path(dump_dir).glob("*jit_step*memory-usage-report.txt"))
    if not reports:
        return []
    rows: list[str] = []
    for line in reports[-1].read_text().splitlines():
        if line.startswith("Memory Space:") and rows:
            break  # only the default (HBM) space
        m = _REPORT_ROW.match(line)
        if m:
            shapes = m.group(2).replace("\u00d7", "x")
            rows.append(f"{m.group(1)} {shapes[:160]}")
        if len(rows) >= n:
            break
    return rows


# ----------------------------------------------------------------------------- the check


def formula_flops_per_step(recipe: Recipe) -> dict[str, float]:
    """Training FLOPs for one optimizer step of the whole slice: MaxText (total, dense, attention), OLMo-core."""
    m, t = recipe.model, recipe.train
    tokens = recipe.tokens_per_step
    maxtext = flops_lib.flops_per_token_maxtext(m, t.seq_len) * tokens
    attention = m.n_layers * 6 * t.seq_len * m.n_heads * m.head_dim * tokens  # MaxText's causal-halved term
    return {
        "maxtext": maxtext,
        "dense": maxtext - attention,
        "attention": float(attention),
        "olmo_core": flops_lib.flops_per_token_olmo_core(m, t.seq_len) * tokens,
    }


def _tpu_attention(recipe: Recipe) -> Recipe:
    """`attention: auto` resolves by the platform at trace time; on a TPU slice that is `splash`."""
    # attention.resolve(..., platform="tpu")
    on_tpu: dict[str, Literal["splash", "blocked"]] = {"auto": "splash", "cudnn": "blocked"}
    if recipe.model.attention not in on_tpu:
        return recipe
    return dataclasses.replace(
        recipe, model=dataclasses.replace(recipe.model, attention=on_tpu[recipe.model.attention])
    )


def pod_xla_flags(
    recipe: Recipe, device: Device, settings: Settings | None
) -> tuple[list[str], dict[str, str]]:
    """The XLA flags the slice's pods get and the subset preflight passes as compile options.

    Checked by libtpu first (`olmo_ctl.preflight.flags`): an unknown flag is bad input naming it.
    """
    from olmo_ctl.preflight import flags as flags_lib

    sources = xla_flag_sources(device, recipe, settings)
    flags = [f"--{k}={v}" for k, (v, _) in sources.items()]
    try:
        per_compile, _startup = flags_lib.check(" ".join(flags), device.topology_name)
    except flags_lib.UnknownFlag as e:
        raise flags_lib.refuse(e.name, sources) from None
    return flags, {k: sources[k][0] for k in per_compile}


@contextlib.contextmanager
def _no_persistent_compilation_cache():
    """JAX's persistent compilation cache off for a topology compile: an executable compiled for a
    TPU slice that is not here can be stored but never loaded without that slice's client (JAX warns
    `PjRtCompiler must be constructed with a Client` on every read). Preflight keeps its own cache
    of results (`preflight/cache.py`)."""
    import jax

    # jax's Config declares no attribute per flag (they are set at import), so mypy sees none.
    was = jax.config.jax_enable_compilation_cache  # type: ignore[attr-defined]
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)


@contextlib.contextmanager
def _environ(name: str, value: str):
    """The environment variable `name` set to `value` for a block, as it was after it."""
    was = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if was is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = was


@contextlib.contextmanager
def _heartbeat(log: Callable[[str], None] | None, every_s: float):
    """`log("preflight: still compiling (N s)")` every `every_s` until the block ends."""
    if log is None:
        yield
        return
    done = threading.Event()
    t0 = time.monotonic()

    def beat() -> None:
        while not done.wait(every_s):
            log(f"preflight: still compiling ({time.monotonic() - t0:.0f} s)")

    t = threading.Thread(target=beat, name="preflight-heartbeat", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()


def program_digest(
    recipe: Recipe, device: Device, plan: Plan, libtpu_args: str = "", *, any_flags: bool = False
) -> str:
    """`sha256:HEX` of the train and eval steps as `compile_step` and `compile_eval_step` lower them for
    the slice (StableHLO text, without source locations; the Pallas kernels' own locations without this
    installation's path prefix: `_installed_anywhere`). What the compiler is given: with the same
    compiler versions and flags (the rest of a result's key) the same digest compiles to the same
    figures, so an edit of the trainer that changes no program (a comment, a docstring, a function
    moved) keeps a compiled result valid. Lowering takes seconds where compiling takes minutes, and
    reads none of libtpu's flags: `any_flags` lowers in a process whose libtpu started with others."""
    import hashlib

    import jax

    from olmo_ctl.trainer import attention as attn_lib
    from olmo_ctl.trainer import sharding
    from olmo_ctl.trainer.step import abstract_eval_batch, jit_eval_step, make_train_step

    devs = topology_devices(device, plan.slices, libtpu_args, any_flags=any_flags)
    kind, replicas = mesh_layout(recipe, device.devices)
    mesh = sharding.make_mesh(
        devs, kind, replicas, activate=False, slices=plan.slices, seq_shards=plan.seq_shards
    )
    state, state_shard, batch = abstract_inputs(recipe, mesh, plan.grad_accum)
    step = jax.jit(make_train_step(recipe), donate_argnums=(0,), out_shardings=(state_shard, None))
    h = hashlib.sha256()
    with jax.set_mesh(mesh), attn_lib.compile_target("tpu", device.generation):
        h.update(_installed_anywhere(step.lower(state, batch).as_text()).encode())
        if recipe.eval.batches > 0:
            h.update(b"\0eval\0")
            params = state["params"]
            h.update(
                _installed_anywhere(
                    jit_eval_step(recipe).lower(params, abstract_eval_batch(recipe, plan, mesh)).as_text()
                ).encode()
            )
    return f"sha256:{h.hexdigest()}"


_KERNEL_BODY = re.compile(r"\\22([A-Za-z0-9+/]{64,}={0,2})\\22")


def _installed_anywhere(text: str) -> str:
    """The lowered program's text as any installation lowers it. A Pallas kernel (splash attention) is
    carried as Mosaic bytecode (base64, in its custom call's config) with debug locations that name the
    kernel's Python source by its installed path (`.../site-packages/jax/...`): each kernel body is
    replaced by the digest of its module printed without debug information."""
    import base64
    import hashlib

    from jax._src.interpreters import mlir  # the context JAX lowers in, with Mosaic's TPU dialect
    from jax._src.lib import tpu
    from jaxlib.mlir import ir

    def strip(m: re.Match) -> str:
        try:
            body = base64.b64decode(m.group(1), validate=True)
            with mlir.make_ir_context() as ctx, ir.Location.unknown():
                tpu.register_dialect(ctx)  # its memory spaces; the versioned ops read unregistered
                ctx.allow_unregistered_dialects = True
                asm = ir.Module.parse(body).operation.get_asm(enable_debug_info=False)
        except Exception:  # noqa: BLE001 - not a kernel's module: kept as it is
            return m.group(0)
        return "\\22kernel sha256:" + hashlib.sha256(str(asm).encode()).hexdigest() + "\\22"

    return _KERNEL_BODY.sub(strip, text)


def _same_program(reuse: dict | None, digest: str, version: str) -> PreflightResult | None:
    """`reuse` (a result compiled by another trainer version) as this version's result when it was
    compiled from the program `digest`; else None."""
    names = {f.name for f in dataclasses.fields(PreflightResult)}
    if not isinstance(reuse, dict) or reuse.get("program") != digest or not set(reuse) <= names:
        return None
    try:
        result = PreflightResult(**reuse)
    except TypeError:  # an entry from an older layout
        return None
    note = f"compiled by trainer {result.trainer_version}: this trainer lowers to the same program"
    return dataclasses.replace(
        result,
        trainer_version=version,
        notes=[n for n in result.notes if not n.startswith("compiled by")] + [note],
    )


def _case(
    recipe: Recipe,
    device: Device,
    *,
    remat: str | None = None,
    head_dim: int | None = None,
    n_layers: int | None = None,
    per_device_batch: int | None = None,
    settings: Settings | None = None,
    slices: int = 1,
):
    """What `run_preflight` compiles: (the recipe as compiled for a TPU slice, its plan, the pods' XLA
    flags, the subset given as compile options)."""
    recipe = _tpu_attention(preflight_recipe(recipe, remat=remat, head_dim=head_dim, n_layers=n_layers))
    plan = plan_for(recipe, device, per_device_batch, slices)
    flags, xla_options = pod_xla_flags(recipe, device, settings)
    return recipe, plan, flags, xla_options


def shipped_key_for(
    recipe: Recipe, device: Device, *, settings: Settings | None = None, slices: int = 1
) -> str:
    """The key `run_preflight` looks up in the shipped results for `recipe` on `slices` x `device` as
    planned (tools/preflight_shipped.py writes each result under it)."""
    recipe, plan, flags, _ = _case(recipe, device, settings=settings, slices=slices)
    return shipped_key(recipe, device, plan.per_device_batch, flags, plan.slices)


def _why_compiling(recipe: Recipe, skey: str, version: str, looked: bool = True) -> str:
    """For the line a compile starts with: why the step is compiled (when the cache and the shipped
    results were `looked` at: no shipped result covers it, or the shipped one is another trainer
    version's) and how long that takes (the longest shipped compile of the same model, layers and
    remat on any slice, else minutes)."""
    m = recipe.model
    took = shipped_compile_s(recipe.name, n_layers=m.n_layers, head_dim=m.head_dim, remat=m.remat)
    expect = "minutes on a CPU" if not took else f"about {_duration(took)} on a 2-core machine"
    if not looked:
        return f"this takes {expect}"
    other = load_shipped(skey)
    why = (
        "no shipped result covers it"
        if other is None
        else f"the shipped result is trainer {other.get('trainer_version')}'s, not this {version}'s"
    )
    return f"{why}; this takes {expect}, once per recipe, device and trainer version"


def run_preflight(
    recipe: Recipe,
    device: Device,
    *,
    remat: str | None = None,
    head_dim: int | None = None,
    n_layers: int | None = None,
    per_device_batch: int | None = None,
    hbm_bytes: int | None = None,
    use_cache: bool = True,
    settings: Settings | None = None,
    slices: int = 1,
    log: Callable[[str], None] | None = None,
    announce: bool = True,
    reuse: dict | None = None,
) -> PreflightResult:
    """Compile the train step of `recipe` for `slices` x `device` and report memory, FLOPs and compile time.

    A result shipped by another trainer version (or `reuse`, one compiled before) answers without a
    compile when this trainer lowers the steps to the same program (`program_digest`, seconds); it is
    then stored in the cache under this trainer version.

    With `log`, a compile (not a cache hit) says what it compiles, why (no shipped result covers it)
    and how long that takes when it starts (unless `announce` is False: the caller said it), that it
    still runs every HEARTBEAT_S, and how long it took: the 7B step takes minutes of CPU.

    `hbm_bytes` overrides the device's HBM per device for the verdict only (the compile always
    targets the real chip). `settings` (site settings) may add XLA flags (`xla_flags`); the step
    compiles with the flags the pods get, in a process of its own when this process's libtpu started
    with other ones (`compile_in_own_process`). Does not raise when the step does not fit: look at `fits`.
    """
    asked = recipe
    recipe, plan, flags, xla_options = _case(
        recipe,
        device,
        remat=remat,
        head_dim=head_dim,
        n_layers=n_layers,
        per_device_batch=per_device_batch,
        settings=settings,
        slices=slices,
    )
    hbm = int(hbm_bytes) if hbm_bytes is not None else usable_hbm_bytes(device)
    version = trainer_version()
    key = cache_key(recipe, device, plan.per_device_batch, version, flags, plan.slices)
    skey = shipped_key(recipe, device, plan.per_device_batch, flags, plan.slices)
    if use_cache:
        names = {f.name for f in dataclasses.fields(PreflightResult)}
        for hit, from_package in ((load_cached(key), False), (load_shipped(skey, version), True)):
            if hit is not None and set(hit) <= names:
                hit["cached"], hit["shipped"] = True, from_package
                try:
                    return _with_hbm(PreflightResult(**hit), hbm)
                except TypeError:  # an entry from an older layout: compile again
                    pass
        other = load_shipped(skey)
        if reuse is None and other is not None and other.get("program"):
            reuse = other  # another trainer version's: it stands if this one lowers the same program

    m = recipe.model
    what = device.name if plan.slices == 1 else f"{plan.slices} x {device.name}"
    compiling = (
        f"preflight: compiling the train step of {recipe.name} for {what} ({device.topology}), "
        f"remat {m.remat}, micro-batch {plan.per_device_batch} x {plan.grad_accum}; "
    )
    if log is not None and announce:
        log(
            f"preflight: the result of {recipe.name} on {what} was compiled by trainer"
            f" {reuse.get('trainer_version')}: lowering this trainer's step to compare (seconds)"
            if reuse is not None
            else compiling + _why_compiling(recipe, skey, version, looked=use_cache)
        )
    from olmo_ctl.trainer.quiet import cpu_only_while

    program = None
    if reuse is not None:  # lowering needs no flags of libtpu's: any process may compare
        with cpu_only_while(), _no_persistent_compilation_cache():
            program = program_digest(recipe, device, plan, " ".join(flags), any_flags=True)
        same = _same_program(reuse, program, version)
        if same is not None:
            if log is not None:
                log("preflight: the same program: its figures stand, nothing to compile")
            same = dataclasses.replace(same, cached=True, shipped=True)
            store_cached(key, same.to_dict())
            return _with_hbm(same, hbm)
        if log is not None:
            log(
                compiling
                + f"this trainer's step lowers to another program than trainer {reuse.get('trainer_version')}'s; "
                + _why_compiling(recipe, skey, version, looked=False)
            )
    if not compiles_in_this_process(" ".join(flags)):
        alone = compile_in_own_process(
            asked,
            device,
            log=log,
            remat=remat,
            head_dim=head_dim,
            n_layers=n_layers,
            per_device_batch=per_device_batch,
            settings=settings,
            slices=slices,
        )
        return _with_hbm(alone, hbm)  # (cached by the process that compiled it)

    formula = formula_flops_per_step(recipe)
    if program is None:
        with cpu_only_while(), _no_persistent_compilation_cache():
            program = program_digest(recipe, device, plan, " ".join(flags))

    # JAX on the CPU, libtpu only for the topology: no TPU runtime noise (trainer/quiet.py).
    with (
        tempfile.TemporaryDirectory(prefix="olmo-ctl-preflight-") as dump,
        _heartbeat(log, HEARTBEAT_S),
        cpu_only_while(),
        _no_persistent_compilation_cache(),
    ):
        compiled, compile_s, error, arg_estimate = compile_step(
            recipe, device, plan, dump_dir=dump, xla_options=xla_options, libtpu_args=" ".join(flags)
        )
        buffers = largest_buffers(dump)
        t_eval = time.monotonic()
        eval_peak, eval_micro, eval_note = compile_eval_step(
            recipe, device, plan, xla_options, libtpu_args=" ".join(flags)
        )
        compile_s = round(compile_s + time.monotonic() - t_eval, 2)  # as -o json reports it
    if log is not None:
        log(
            f"preflight: compiled in {compile_s:.0f} s"
            if error is None
            else f"preflight: the compiler refused the program after {compile_s:.0f} s"
        )
    notes: list[str] = [eval_note] if eval_note else []
    xla_step = xla_once = ratio = dense = attention = recompute = dense_ratio = counted = kernel = None
    if compiled is not None:
        mem = compiled.memory_analysis()
        arg, out, alias = mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes
        temp, code = mem.temp_size_in_bytes, mem.generated_code_size_in_bytes
        peak = arg + out - alias + temp + code
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        xla_once = float(cost.get("flops", 0.0))
        counted = hlo_flops(compiled.as_text(), kernel_flops=splash_kernel_flops)
        if counted.unresolved_loops:
            notes.append(
                f"{counted.unresolved_loops} of {counted.loops} loops had no inferable trip count"
                " (counted once)"
            )
        # XLA's own count, plus the matmul FLOPs of every repeated loop iteration, plus the Pallas
        # kernels' (which XLA does not count).
        per_device = xla_once + (counted.with_trip_counts - counted.body_once) + counted.kernel
        n = plan.devices
        xla_step = per_device * n
        kernel = counted.kernel * n
        dense, recompute = counted.dense * n, counted.recompute * n
        attention = (counted.attention + counted.kernel) * n
        if counted.kernel:
            notes.append(
                f"XLA's cost analysis does not count Pallas kernels: {kernel / 1e12:,.0f} TFLOP/step of"
                f" {m.attention} attention added, counted from its masks (the tiles it computes)"
            )
        ratio = xla_step / formula["maxtext"]
        dense_ratio = dense / formula["dense"]
    else:
        used = parse_hbm_oom(error or "")
        arg, out, alias, temp, code = arg_estimate, 0, 0, 0, 0
        peak = 0
        if used:
            need, cap, temps_only = used
            if temps_only:
                temp, peak = need, need + arg_estimate
                what = "temporaries"
            else:
                peak, what = need, "in all"
            notes.append(
                f"the TPU compiler refused the program: it needs {need / GIB:.2f} GiB ({what}) of"
                f" {cap / GIB:.2f} GiB HBM per device"
            )
    result = PreflightResult(
        recipe=recipe.name,
        recipe_fingerprint=recipe.fingerprint(),
        device=device.name,
        topology=device.topology_name,
        devices=plan.devices,
        per_device_batch=plan.per_device_batch,
        seq_shards=plan.seq_shards,
        slices=plan.slices,
        eval_peak_bytes_per_device=eval_peak,
        eval_micro_batch=eval_micro,
        grad_accum=plan.grad_accum,
        seq_len=recipe.train.seq_len,
        remat=m.remat,
        head_dim=m.head_dim,
        n_heads=m.n_heads,
        n_layers=m.n_layers,
        attention=m.attention,
        param_count=param_count(m),
        hbm_bytes_per_device=device.hbm_bytes_per_device,
        argument_bytes_per_device=arg,
        output_bytes_per_device=out,
        alias_bytes_per_device=alias,
        temp_bytes_per_device=temp,
        generated_code_bytes_per_device=code,
        peak_bytes_per_device=peak,
        fits=compiled is not None,
        shortfall_bytes_per_device=0,
        xla_flops_per_step=xla_step,
        xla_flops_per_device_body_once=xla_once,
        formula_flops_per_step=formula["maxtext"],
        formula_olmo_core_flops_per_step=formula["olmo_core"],
        xla_vs_formula=ratio,
        xla_dense_flops_per_step=dense,
        xla_attention_flops_per_step=attention,
        xla_recompute_flops_per_step=recompute,
        formula_dense_flops_per_step=formula["dense"],
        formula_attention_flops_per_step=formula["attention"],
        dense_xla_vs_formula=dense_ratio,
        hlo_flops_per_device_body_once=counted.body_once if counted else None,
        hlo_loops=counted.loops if counted else None,
        hlo_unresolved_loops=counted.unresolved_loops if counted else None,
        largest_buffers=buffers,
        xla_flags=flags,
        kernel_flops_per_step=kernel,
        compile_s=round(compile_s, 2),
        compiled_by_xla=compiled is not None,
        trainer_version=version,
        error=None if compiled is not None else (error or "").strip().splitlines()[0][:500],
        notes=notes,
        program=program,
    )
    store_cached(key, result.to_dict())
    return _with_hbm(result, hbm)


_SPLASH_SCOPE = re.compile(r"splash_T(\d+)_W(\d+)_Q(\d+)_K(\d+)")
_SPLASH_PHASE = re.compile(r"splash_m[hq]a_(fwd|dq|dkv)")
_ARRAYS = re.compile(r"\b(?:bf16|f16|f32)\[([0-9,]+)\]")


def splash_kernel_flops(ins) -> float:
    """Matmul FLOPs of one splash-attention custom call, from its mask (the tiles it computes).

    The trainer names each call's scope after its mask (`attention.splash_scope`: padded length,
    window, blocks); the phase (fwd, dq, dkv) is the kernel's name; heads x local batch and the
    head dim come from the query operand's shape.
    """
    from olmo_ctl.trainer import attention as attn_lib

    scope, phase = _SPLASH_SCOPE.search(ins.attrs), _SPLASH_PHASE.search(ins.attrs)
    constraints = ins.attrs.split("operand_layout_constraints=", 1)
    if not scope or not phase or len(constraints) < 2:
        return 0.0
    query = next((x for x in _ARRAYS.findall(constraints[1]) if x.count(",") >= 2), None)
    if query is None:
        return 0.0
    dims = [int(d) for d in query.split(",")]
    T, W, bq, bkv = (int(g) for g in scope.groups())
    kind = phase.group(1)
    if kind == "dkv" and attn_lib.SPLASH_FUSED_BWD:  # the fused dkv kernel computes dq too
        kind = "dkv_fused"
    tiles = attn_lib.splash_mask_blocks(T, W or None, bq, bkv)
    return 2.0 * bq * bkv * dims[-1] * attn_lib.SPLASH_TILE_MATMULS[kind] * tiles * math.prod(dims[:-2])


def usable_hbm_bytes(device: Device) -> int:
    """HBM per device a step may use: the smaller of the catalog's and the compiler's (the generation
    profile's `compiler_hbm_gib`), so a step judged to fit is not refused on the slice."""
    gen = GENERATIONS.get(device.generation)
    compiler = gen.compiler_hbm_bytes if gen is not None else None
    return device.hbm_bytes_per_device if compiler is None else min(device.hbm_bytes_per_device, compiler)


def _with_hbm(result: PreflightResult, hbm: int) -> PreflightResult:
    """Set the verdict against `hbm` bytes per device: the train step and the eval step must both fit."""
    result.hbm_bytes_per_device = hbm
    peak = max(result.peak_bytes_per_device, result.eval_peak_bytes_per_device or 0)
    result.fits = result.compiled_by_xla and peak <= hbm
    result.shortfall_bytes_per_device = max(0, peak - hbm)
    return result


class PreflightOptions(TypedDict, total=False):
    """The keyword options of `run_preflight` but `remat`, which `search` passes to every policy's compile."""

    head_dim: int | None
    n_layers: int | None
    per_device_batch: int | None
    hbm_bytes: int | None
    use_cache: bool
    settings: Settings | None
    slices: int
    log: Callable[[str], None] | None


def search(
    recipe: Recipe, device: Device, **kw: Unpack[PreflightOptions]
) -> tuple[list[PreflightResult], PreflightResult | None]:
    """Try the remat policies from the cheapest recompute up; stop at the first that fits."""
    tried = []
    for policy in REMAT_POLICIES:
        r = run_preflight(recipe, device, remat=policy, **kw)
        tried.append(r)
        if r.fits:
            return tried, r
    return tried, None


# ----------------------------------------------------------------------------- submit's gate


def gpu_estimate_note(device: Device, plan: Plan) -> str:
    """What preflight says for GPU nodes, where it compiles nothing: the plan's memory estimate
    (`core/batching.py`), labelled as one."""
    return (
        f"preflight: estimate, not compiled: {plan.estimated_bytes_per_device / GIB:.1f} GiB of "
        f"{plan.hbm_bytes_per_device / GIB:.0f} GiB per GPU on {device.name} at micro-batch "
        f"{plan.per_device_batch} (the plan's memory estimate; preflight compiles for TPU slices only)"
    )


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def submit_check(
    recipe: Recipe, device: Device, plan: Plan, *, log=print, settings: Settings | None = None
) -> PreflightResult | None:
    """The preflight `submit` runs before queueing for a slice (skip it with `--no-preflight`).

    Runs only for TPU slices and only where libtpu is installed (else returns None): it compiles
    the step with the plan's micro-batch, or answers from the cache or the results shipped with the
    package (same recipe, device, remat, batch, flags and trainer version) without compiling. Raises BadInput when the step does not fit, so nothing is
    submitted that would die of an out-of-memory error after waiting in the queue. For GPU nodes it
    logs the plan's memory estimate, labelled as one, and compiles nothing.
    """
    if device.is_gpu_nodes:
        log(gpu_estimate_note(device, plan))
        return None
    if not device.is_tpu or not libtpu_available():
        return None

    def said(line: str) -> None:  # the line a compile starts with says how to skip it
        log(line + " (--no-preflight skips it)" if line.startswith("preflight: compiling") else line)

    try:
        result = run_preflight(
            recipe,
            device,
            per_device_batch=plan.per_device_batch,
            settings=settings,
            slices=plan.slices,
            log=said,
        )
    except OlmoCtlError:
        raise
    except Exception as e:  # noqa: BLE001 - a step that does not compile would fail on the slice too
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise OlmoCtlError(
            f"the train step does not compile for {device.name}: {first}",
            "nothing was submitted; `olmo-ctl preflight` shows the details, --no-preflight skips the check",
            exit_code=EXIT_RUN_FAILED,
        ) from None
    if not result.fits:
        raise BadInput(
            result.verdict(),
            f"nothing was submitted; try `olmo-ctl preflight --device {device.name}"
            " --search` for a remat policy that fits, a smaller micro-batch (--set"
            f" train.max_per_device_batch={max(1, plan.per_device_batch // 2)}: the rest becomes"
            " accumulation), a larger slice, or --no-preflight",
        )
    log(
        f"preflight: {result.verdict()}"
        + (
            f" (shipped with olmo-ctl, compiled by {result.trainer_version})"
            if result.shipped
            else " (cached)"
            if result.cached
            else ""  # run_preflight said how long it compiled
        )
    )
    return result


# ----------------------------------------------------------------------------- a process of its own


def compile_in_own_process(
    recipe: Recipe,
    device: Device,
    *,
    remat: str | None = None,
    head_dim: int | None = None,
    n_layers: int | None = None,
    per_device_batch: int | None = None,
    hbm_bytes: int | None = None,
    settings: Settings | None = None,
    slices: int = 1,
    log: Callable[[str], None] | None = None,
    reuse: dict | None = None,
) -> PreflightResult:
    """`run_preflight(..., use_cache=False)` in a fresh Python process (`python -m
    olmo_ctl.preflight.compile`), whose libtpu starts with this slice's flags whatever this process
    compiled before. Its progress lines (HEARTBEAT_S apart, as here) reach `log`; it stores its result
    in the same cache.

    The call reaches the child pickled, on its stdin; the child answers on its stdout with one JSON
    object a line: `{"log": LINE}` for each progress line, then `{"result": RESULT}` or `{"error": ...}`.
    An expected failure there (OlmoCtlError) is raised here with its message, hint and exit code.
    """
    options = dict(
        remat=remat,
        head_dim=head_dim,
        n_layers=n_layers,
        per_device_batch=per_device_batch,
        hbm_bytes=hbm_bytes,
        settings=settings,
        slices=slices,
        reuse=reuse,
    )
    answer: dict | None = None
    with tempfile.TemporaryFile() as call, tempfile.TemporaryFile() as stderr:
        pickle.dump((recipe, device, options, HEARTBEAT_S), call)
        call.seek(0)
        child = subprocess.Popen(
            [sys.executable, "-m", "olmo_ctl.preflight.compile"],
            stdin=call,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        assert child.stdout is not None
        try:
            for raw in child.stdout:
                if not raw.startswith(b"{"):
                    continue  # not the child's answer (a stray print before it took stdout for itself)
                message = json.loads(raw)
                if "log" in message:
                    if log is not None:
                        log(message["log"])
                else:
                    answer = message
            returncode = child.wait()
        except BaseException:  # an interrupt here ends the compile there too
            child.kill()
            child.wait()
            raise
        finally:
            child.stdout.close()
        stderr.seek(0)
        said = stderr.read().decode(errors="replace").strip().splitlines()
    if answer is not None and "result" in answer:
        return PreflightResult(**answer["result"])
    error = (answer or {}).get("error")
    if error is None:
        how = (
            f"was killed by signal {-returncode} (out of memory?)"
            if returncode < 0
            else f"exited {returncode} without an answer"
        )
        last = f": {said[-1][:300]}" if said else ""
        raise RuntimeError(f"preflight's compile for {device.name} in a process of its own {how}{last}")
    if error["exit_code"] is None:  # unexpected there: its type and message, as it would read here
        raise RuntimeError(f"{error['kind']}: {error['message']}" if error["message"] else error["kind"])
    kinds = {"BadInput": BadInput, "Interrupted": Interrupted}
    if error["kind"] in kinds:
        raise kinds[error["kind"]](error["message"], error["hint"])
    raise OlmoCtlError(error["message"], error["hint"], exit_code=error["exit_code"])


def _compile_and_answer() -> int:
    """The child's side of `compile_in_own_process`: read the call, compile, answer on stdout."""
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else written to stdout (libtpu, a print) goes to stderr

    def say(**message) -> None:
        try:
            answer.write(json.dumps(message) + "\n")
            answer.flush()
        except BrokenPipeError:  # the caller is gone (killed without unwinding): stop compiling for nobody
            os._exit(1)

    global HEARTBEAT_S
    recipe, device, options, HEARTBEAT_S = pickle.load(sys.stdin.buffer)
    try:
        result = run_preflight(
            recipe, device, use_cache=False, log=lambda line: say(log=line), announce=False, **options
        )
    except OlmoCtlError as e:
        say(error={"kind": type(e).__name__, "message": e.message, "hint": e.hint, "exit_code": e.exit_code})
        return 0
    except Exception as e:  # noqa: BLE001 - raised in the caller's process as it would be here
        import traceback

        traceback.print_exc()
        say(error={"kind": type(e).__name__, "message": str(e), "hint": None, "exit_code": None})
        return 1
    say(result=result.to_dict())
    return 0


if __name__ == "__main__":
    sys.exit(_compile_and_answer())
