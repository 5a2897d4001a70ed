"""Global-batch planning: per-device micro-batch x gradient accumulation x data-parallel devices.

The recipe's global batch is held exactly on any slice. Every JAX device holds a disjoint part of
the batch (FSDP and hybrid FSDP x DP both shard the batch over all devices), so the data-parallel
size is the device count. Multislice (N slices of one device type, joined over the data-center
network) splits the global batch over all N x devices; each slice holds a full copy of the state,
sharded over its own devices (the slices are data-parallel replicas: trainer/sharding.py). The micro-batch is the largest divisor of the per-device share that fits
the per-device memory estimate below (and the recipe cap); the rest becomes accumulation steps.

Memory estimate per device (bytes), documented so a plan can be checked by hand:
  state       = params x (4 master + 4 + 4 Adam moments + 4 gradients) / devices of one FSDP group
                (FSDP shards over a slice, or over each group of `train.shard_group` devices of it, or
                over the slice / `data_parallel` of a hybrid mesh; every group and slice holds a copy)
  per instance:
    logits    = seq x padded_vocab x 4 bytes x 3  (fp32 logits, softmax and its gradient)
    residuals = n_layers x seq x d_model x act_bytes x k_remat
                k_remat: full = 1 (only each block's input is kept), save_proj = 1 + (q,k,v,o,
                w1,w3 outputs) / d_model, none = every intermediate of the block (~ 16 + 3 x mlp/d),
                mlp = none's less the feed-forward's 3 x mlp/d, budget = 1 + the projections
                `budget_names` keeps / d_model
    working   = seq x (10 x d_model + 3 x mlp_hidden) x act_bytes   (one block being recomputed)
  usable      = HBM x 0.85 (XLA's own buffers and fragmentation)
The compiled truth is `olmo-ctl preflight`; this estimate only chooses accumulation.

Sequence sharding (`seq_shards`, context parallelism): when the slice has more devices than the
global batch has instances, or one instance does not fit a device, each instance is split over
`seq_shards` consecutive devices (the smallest number that divides the devices, train.seq_len,
model.n_heads and n_kv_heads, leaves a data-parallel size dividing the global batch and fits the
estimate; `train.seq_shards` fixes it). Then `per_device_batch x grad_accum x devices ==
global_batch x seq_shards`: a device holds 1/seq_shards of each of its instances, and its
activation estimate is the instance's divided by seq_shards.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from typing import Any

from olmo_ctl.core.devices import Device, Target
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import ModelConfig, Recipe

USABLE_HBM_FRACTION = 0.85
STATE_BYTES_PER_PARAM = 16  # fp32 master + two fp32 Adam moments + fp32 gradient


def param_count(m: ModelConfig) -> int:
    """Trainable parameters at the padded vocab: embeddings + LM head + blocks + final norm."""
    q = m.n_heads * m.head_dim
    kv = m.n_kv_heads * m.head_dim
    attn = m.d_model * q + 2 * m.d_model * kv + q * m.d_model + q + kv  # wq wk wv wo + q/k norms
    mlp = 3 * m.d_model * m.mlp_hidden
    norms = 2 * m.d_model  # post-attention and post-MLP norms
    block = attn + mlp + norms
    return 2 * m.padded_vocab_size * m.d_model + m.n_layers * block + m.d_model


def _act_bytes(m: ModelConfig) -> int:
    return 2 if m.compute_dtype == "bfloat16" else 4


# The projection outputs the model names (trainer/model.py checkpoint_name), in the order the
# budget mode keeps them.
PROJ_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "w1_proj", "w3_proj")


def proj_sizes(cfg: ModelConfig) -> dict[str, int]:
    """Elements per token of each named projection output (PROJ_NAMES)."""
    q, kv, h = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.mlp_hidden
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": cfg.d_model, "w1_proj": h, "w3_proj": h}


def budget_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The projections remat="budget" keeps for the backward pass: in the order of PROJ_NAMES, each
    one that still fits, while their elements per token stay within `remat_budget` x what the block
    keeps without rematerialisation (the estimate below, less the block input). OLMo-core's
    budget mode leaves the choice to torch's min-cut partitioner; this fixed order is ours."""
    allowed = cfg.remat_budget * (no_remat_factor(cfg) - 1.0) * cfg.d_model
    kept: list[str] = []
    used = 0
    for name, size in proj_sizes(cfg).items():
        if used + size <= allowed:
            kept.append(name)
            used += size
    return tuple(kept)


def no_remat_factor(m: ModelConfig) -> float:
    """k_remat without rematerialisation: every intermediate of the block (~ 16 + 3 x mlp / d)."""
    return 16.0 + 3.0 * m.mlp_hidden / m.d_model


def activation_bytes_per_instance(m: ModelConfig, seq_len: int, remat: str | None = None) -> int:
    remat = remat or m.remat
    a = _act_bytes(m)
    if remat == "full":
        k = 1.0
    elif remat == "save_proj":
        q = m.n_heads * m.head_dim
        kv = m.n_kv_heads * m.head_dim
        k = 1.0 + (2 * q + 2 * kv + 2 * m.mlp_hidden) / m.d_model
    elif remat == "budget":
        sizes = proj_sizes(m)
        k = 1.0 + sum(sizes[n] for n in budget_names(m)) / m.d_model
    elif remat == "mlp":  # the feed-forward keeps only its input
        k = no_remat_factor(m) - 3.0 * m.mlp_hidden / m.d_model
    else:
        k = no_remat_factor(m)
    logits = seq_len * m.padded_vocab_size * 4 * 3
    residuals = m.n_layers * seq_len * m.d_model * a * k
    working = seq_len * (10 * m.d_model + 3 * m.mlp_hidden) * a
    return int(logits + residuals + working)


def state_bytes_per_device(m: ModelConfig, devices: int) -> int:
    return param_count(m) * STATE_BYTES_PER_PARAM // devices


def mesh_layout(recipe: Recipe, slice_devices: int) -> tuple[str, int]:
    """(mesh kind, data-parallel replicas inside one slice) for `sharding.make_mesh`: the recipe's
    `mesh: hybrid` with its `data_parallel`, or `train.shard_group` (FSDP groups of that many devices,
    as many replicas as the slice holds: OLMo-core's HSDP), or plain FSDP over the slice (also when
    the group is at least the slice: a group never spans slices). BadInput when the group size is
    smaller than the slice and does not divide it."""
    t = recipe.train
    if t.mesh == "hybrid":
        return "hybrid", t.data_parallel
    if not t.shard_group or t.shard_group >= slice_devices:
        return "fsdp", 1
    if slice_devices % t.shard_group:
        raise BadInput(
            f"train.shard_group {t.shard_group} does not divide the {slice_devices} devices of a slice",
            f"choose a group size that divides {slice_devices}, or 0 for one group per slice",
        )
    return "hybrid", slice_devices // t.shard_group


@dataclass(frozen=True)
class Plan:
    recipe: str
    device: str
    devices: int
    data_parallel: int  # devices sharing each global batch
    global_batch: int
    per_device_batch: int  # instances per device per micro-step (instance shards when seq_shards > 1)
    grad_accum: int
    seq_len: int
    tokens_per_step: int
    max_steps: int
    remat: str
    state_bytes_per_device: int
    activation_bytes_per_instance: int
    estimated_bytes_per_device: int
    hbm_bytes_per_device: int
    slices: int = 1  # slices of `device` (multislice: devices = slices x the slice's devices)
    seq_shards: int = 1  # devices each instance's sequence is split over (1: unsharded), within a slice
    shard_group: int = 0  # devices each parameter is sharded over (an FSDP group; 0: not recorded)

    def to_dict(self) -> dict:
        return asdict(self)


def _divisors_desc(n: int) -> list[int]:
    return sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True)


def _seq_candidates(recipe: Recipe, devices: int, host_devices: int) -> list[int]:
    """Sequence shard counts the model and slice allow, smallest first (`devices`: one slice's;
    `host_devices`: one trainer process's). A sequence-shard group stays on one host: the loader hands
    each process whole instances, so the devices sharing an instance must be that process's own."""
    t, m = recipe.train, recipe.model
    dp = mesh_layout(recipe, devices)[1]
    return [
        s
        for s in range(1, devices + 1)
        if devices % (s * dp) == 0
        and host_devices % s == 0
        and t.seq_len % s == 0
        and m.n_heads % s == 0
        and m.n_kv_heads % s == 0
    ]


def check_loading(recipe: Recipe, device: Device, slices: int = 1, *, keep_batch: bool = False) -> None:
    """The data loader's rule: every trainer process loads a whole, equal share of each global batch
    and of each eval batch (`trainer/data.py`). The plan applies it, so a layout the trainer would
    refuse on the slice is refused here, before anything is queued. `keep_batch`: the run's global
    batch is fixed (a resize)."""
    t = recipe.train
    procs = device.processes * slices
    where = device.name if slices == 1 else f"{slices} x {device.name}"
    for what, batch, key in (
        ("global batch", t.global_batch, "train.global_batch"),
        ("eval batch", recipe.eval.batch_size or t.global_batch, "eval.batch_size"),
    ):
        if batch % procs:
            hint = (
                f"use a device with at most {batch} hosts"
                if procs > batch
                else f"use a device whose host count divides {batch}"
            )
            raise BadInput(
                f"{what} {batch} cannot be loaded by the {procs} trainer processes (hosts) of {where}: "
                f"each loads an equal share of whole instances ({batch / procs:g} here)",
                f"{hint} (a run keeps its global batch)"
                if keep_batch and key == "train.global_batch"
                else f"{hint}, or change {key} (the recipe's batch is never changed silently)",
            )


def _gpu_nodes_hint(device: Device, global_batch: int) -> str:
    """The node counts nearest `device`'s whose GPUs share `global_batch` in whole instances."""
    from olmo_ctl.core.devices import MAX_GPU_NODES

    gpus = device.chips_per_vm
    fits = [n for n in range(1, MAX_GPU_NODES + 1) if global_batch % (n * gpus) == 0]
    below = [n for n in fits if n < device.vms][-1:]
    above = [n for n in fits if n > device.vms][:1]
    names = [f"{device.generation}x{n} ({global_batch // (n * gpus)} per GPU)" for n in below + above]
    return f"use {' or '.join(names)}" if names else f"use a GPU count that divides {global_batch}"


def _memory_advice(recipe: Recipe, device: Device, slices: int, *, state_alone: bool) -> str:
    """What makes a recipe fit that does not fit `slices` x `device`: only a change that is not
    already so and with which the plan fits (each tried alone): model.remat=full, one group over the
    slice (train.shard_group=0), the smallest larger slice of the generation that holds it, the
    smallest of each generation with more HBM per device."""
    from olmo_ctl.core.devices import gpu_catalog, tpu_catalog

    def fits(r: Recipe, d: Device) -> bool:
        try:
            make_plan(r, d, slices, advise=False)
        except BadInput:
            return False
        return True

    m, t = recipe.model, recipe.train
    ways = []
    if m.remat != "full" and fits(
        dataclasses.replace(recipe, model=dataclasses.replace(m, remat="full")), device
    ):
        ways.append("model.remat=full")
    if t.mesh != "hybrid" and t.shard_group and t.shard_group < device.devices:
        if fits(dataclasses.replace(recipe, train=dataclasses.replace(t, shard_group=0)), device):
            ways.append("train.shard_group=0 (the state over the whole slice)")
    catalog = tpu_catalog() if device.is_tpu else gpu_catalog() if device.is_gpu_nodes else []
    larger = next(
        (
            d
            for d in catalog
            if d.generation == device.generation and d.devices > device.devices and fits(recipe, d)
        ),
        None,
    )
    if larger is not None:
        ways.append(f"a larger slice ({larger.name})" if device.is_tpu else f"more nodes ({larger.name})")
    others: dict[str, str] = {}
    for d in sorted(catalog, key=lambda d: d.devices):
        if (
            d.generation != device.generation
            and d.generation not in others
            and d.hbm_gib_per_device > device.hbm_gib_per_device
            and fits(recipe, d)
        ):
            others[d.generation] = d.name
    if others:
        ways.append(
            f"a generation with more HBM per device (the smallest slices that hold it: {', '.join(others.values())})"
        )
    what = "the state alone does not fit: " if state_alone else ""
    if not ways:
        return what + "no device olmo-ctl knows holds it with this recipe's settings"
    return what + "use " + (ways[0] if len(ways) == 1 else ", ".join(ways[:-1]) + " or " + ways[-1])


def make_plan(
    recipe: Recipe, device: Device, slices: int = 1, *, keep_batch: bool = False, advise: bool = True
) -> Plan:
    """The plan on `slices` x `device` (slices > 1: multislice, the batch over every slice's devices).
    Sequence shards (`train.seq_shards`, or the smallest count that evens the batch out and fits)
    stay within a slice. `keep_batch`: the run's global batch is fixed (a resize): no advice to
    change it. `advise`: a recipe that does not fit is told what would make it fit (`_memory_advice`,
    which plans each change with `advise=False`)."""
    from olmo_ctl.core.devices import check_slices

    t, m = recipe.train, recipe.model
    slices = check_slices(device, slices)
    devices = device.devices * slices
    where = device.name if slices == 1 else f"{slices} x {device.name}"
    gib = 1024**3
    if t.mesh == "hybrid" and device.devices % t.data_parallel:
        raise BadInput(
            f"train.data_parallel ({t.data_parallel}) does not divide the {device.devices} devices of {device.name}",
            "choose a data_parallel that divides the device count",
        )
    group = device.devices // mesh_layout(recipe, device.devices)[1]
    state = state_bytes_per_device(m, group)  # sharded within a group, one copy per group and slice
    per_instance = activation_bytes_per_instance(m, t.seq_len)
    usable = int(device.hbm_bytes_per_device * USABLE_HBM_FRACTION)
    allowed = _seq_candidates(recipe, device.devices, device.devices_per_process)
    if t.seq_shards:
        if (
            t.seq_shards in _seq_candidates(recipe, device.devices, t.seq_shards)
            and t.seq_shards not in allowed
        ):
            # Everything else allows it: only the host's devices do not (the trainer's mesh would refuse it).
            raise BadInput(
                f"train.seq_shards {t.seq_shards} on {where}: a sequence-shard group of {t.seq_shards} "
                f"devices would span hosts (each host of {device.name} has {device.devices_per_process}); "
                "the loader hands each host whole instances, so an instance's shards must be one host's devices",
                f"choose one of {', '.join(map(str, allowed))}, or 0 to let the plan choose",
            )
        if t.seq_shards not in allowed:
            raise BadInput(
                f"train.seq_shards {t.seq_shards} does not fit {device.name}: it must divide the {device.devices} "
                f"devices (with train.data_parallel), the {device.devices_per_process} devices of each host, "
                f"train.seq_len ({t.seq_len}) and the heads ({m.n_heads}, {m.n_kv_heads})",
                f"choose one of {', '.join(map(str, allowed))}, or 0 to let the plan choose",
            )
        candidates = [t.seq_shards]
    else:
        candidates = allowed
    split = [s for s in candidates if (t.global_batch * s) % devices == 0]
    if not split:
        if device.processes * slices > t.global_batch:
            check_loading(recipe, device, slices, keep_batch=keep_batch)  # more hosts than instances
        hint = (
            _gpu_nodes_hint(device, t.global_batch)
            if device.is_gpu_nodes
            else f"use a slice with at most {t.global_batch} devices"
            if devices > t.global_batch
            else f"use a device count that divides {t.global_batch}"
        )
        raise BadInput(
            f"global batch {t.global_batch} cannot be split exactly over the {devices} devices of {where}"
            f" (per-device batch would be {t.global_batch / devices:g}"
            + (
                f" with seq_shards {t.seq_shards})"
                if t.seq_shards
                else ", and no sequence sharding evens it out)"
            ),
            f"{hint} (a run keeps its global batch)"
            if keep_batch
            else f"{hint}, or change train.global_batch (the recipe's batch is never changed silently)",
        )
    check_loading(
        recipe, device, slices, keep_batch=keep_batch
    )  # the devices split it; can the hosts load it?
    for seq in split:
        share = t.global_batch * seq // devices  # instance shards per device per step
        shard_bytes = -(-per_instance // seq)
        by_memory = (usable - state) // shard_bytes if shard_bytes else share
        cap = share if t.max_per_device_batch == 0 else min(share, t.max_per_device_batch)
        cap = min(cap, by_memory)
        if cap >= 1:
            break
    else:
        raise BadInput(
            f"{recipe.name} does not fit on {device.name}: the estimate needs {state / gib:.1f} GiB of state"
            f" + {per_instance / split[-1] / gib:.1f} GiB per instance per device (seq_shards {split[-1]}),"
            f" {usable / gib:.1f} GiB usable",
            _memory_advice(recipe, device, slices, state_alone=state >= usable) if advise else None,
        )
    micro = next(d for d in _divisors_desc(share) if d <= cap)
    return Plan(
        recipe=recipe.name,
        device=device.name,
        devices=devices,
        data_parallel=devices // seq,
        global_batch=t.global_batch,
        per_device_batch=micro,
        grad_accum=share // micro,
        seq_len=t.seq_len,
        tokens_per_step=t.global_batch * t.seq_len,
        max_steps=t.max_steps,
        remat=m.remat,
        state_bytes_per_device=state,
        activation_bytes_per_instance=per_instance,
        estimated_bytes_per_device=state + micro * shard_bytes,
        hbm_bytes_per_device=device.hbm_bytes_per_device,
        slices=slices,
        seq_shards=seq,
        shard_group=group,
    )


# ---------------------------------------------------------------- the plan an attempt carries


def launch_record(target: Target, plan: Plan) -> str:
    """What a backend renders into the trainer's command line (`--plan`): the attempt's target (the
    catalog entry, not its name) and its one plan, as compact JSON. The trainer reads them instead of
    making its own, and refuses a plan that disagrees with its recipe or with what JAX sees."""
    return json.dumps({"target": target.to_dict(), "plan": plan.to_dict()}, separators=(",", ":"))


def read_launch_record(text: str) -> tuple[Target, Plan]:
    """The target and plan of a `launch_record`; BadInput for anything else."""
    hint = "the attempt's --plan is rendered by olmo-ctl; start the trainer by hand with --device instead"
    try:
        record = json.loads(text)
        target = Target.from_dict(record["target"])
        fields = {f.name for f in dataclasses.fields(Plan)}
        plan = Plan(**{k: v for k, v in record["plan"].items() if k in fields})
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"--plan is not a plan record ({type(e).__name__}: {e})", hint) from None
    if plan.device != target.name or plan.slices != target.slices:
        raise BadInput(f"--plan is for {plan.device} x {plan.slices} but names the target {target.on}", hint)
    return target, plan


def check_plan(plan: Plan, recipe: Recipe) -> None:
    """The plan an attempt carries against the recipe the trainer resolved (run.yaml): the batch and
    the sequence it was made for (the horizon is the recipe's: it shapes no layout), and a layout that holds the global batch exactly
    (`per_device_batch x grad_accum x devices == global_batch x seq_shards`). BadInput naming the
    first disagreement: the trainer never trains a batch other than the recipe's."""
    t = recipe.train
    hint = "resubmit the attempt (olmo-ctl makes its plan from the run's recipe)"
    for what, carried, wanted in (
        ("recipe", plan.recipe, recipe.name),
        ("global batch", plan.global_batch, t.global_batch),
        ("sequence length", plan.seq_len, t.seq_len),
    ):
        if carried != wanted:
            raise BadInput(f"the attempt's plan has {what} {carried}, the run's recipe {wanted}", hint)
    if (
        min(plan.per_device_batch, plan.grad_accum, plan.seq_shards, plan.devices) < 1
        or plan.per_device_batch * plan.grad_accum * plan.devices != plan.global_batch * plan.seq_shards
        or plan.data_parallel * plan.seq_shards != plan.devices
    ):
        raise BadInput(
            f"the attempt's plan does not hold its global batch {plan.global_batch}: per-device batch "
            f"{plan.per_device_batch} x accumulation {plan.grad_accum} x {plan.devices} devices "
            f"(seq_shards {plan.seq_shards}, data_parallel {plan.data_parallel})",
            hint,
        )


def eval_micro_batch(recipe: Recipe, plan: Plan) -> int:
    """Instances per forward pass of the eval step over the whole slice (the trainer and preflight).

    `eval.micro_batch` when set, else the train step's micro-batch (`global_batch / grad_accum`), whose
    forward and backward the plan already fits, capped by the eval batch rounded up to the rows. A
    micro-batch is a multiple of the data-parallel rows; of those allowed, the one that pads the eval
    batch least (the largest on a tie): an eval batch that is not a multiple of the micro-batch is
    padded with rows whose labels are all ignored, which add nothing to the loss. The eval step holds
    one micro-batch's fp32 logits at a time: micro / rows x seq_len x padded_vocab_size x 4 bytes per
    device. A BadInput when `eval.micro_batch` is not a multiple of the rows.
    """
    e, rows = recipe.eval, plan.data_parallel
    if e.micro_batch:
        if e.micro_batch % rows:
            raise BadInput(
                f"eval.micro_batch {e.micro_batch} is not a multiple of the {rows} data-parallel rows of"
                f" {plan.device}: each device takes an equal share of every forward pass",
                f"choose a multiple of {rows}, or 0 for the train step's micro-batch",
            )
        return e.micro_batch
    batch = e.batch_size or recipe.train.global_batch
    cap = max(rows, min(plan.global_batch // plan.grad_accum, -(-batch // rows) * rows))
    return min(range(rows, cap + 1, rows), key=lambda m: (-(-batch // m) * m - batch, -m))


DEFAULT_MFU = 0.4


def plan_report(
    recipe: Recipe,
    device: Device,
    mfu: float = DEFAULT_MFU,
    slices: int = 1,
    prices: dict[str, dict[str, float]] | None = None,
) -> dict:
    """The plan plus a compute estimate at an assumed MFU, by both FLOPs formulas (named).

    step time = FLOPs/token x tokens/step / (devices x peak per device x MFU); wall-clock = step
    time x steps; chip-hours = wall-clock x chips; dollars = chip-hours x the user's price per
    chip-hour of the device's generation (`prices`, the site setting), on demand and spot, where one
    is given; on GPU nodes a chip is a GPU, priced per GPU-hour of the machine type. What
    `olmo-ctl plan` prints.
    """
    from olmo_ctl.core import flops  # only `plan` estimates compute

    if not 0 < mfu <= 1:
        raise BadInput(f"MFU {mfu:g} is not a fraction in (0, 1]", "for 40% pass 0.4")
    plan = make_plan(recipe, device, slices)
    chips = device.chips * plan.slices
    fpt = {f: flops.flops_per_token(recipe.model, plan.seq_len, f) for f in flops.FORMULAS}
    sustained = device.peak_tflops_per_device * 1e12 * mfu * plan.devices  # FLOP/s over the slice
    estimate: dict[str, dict[str, Any]] = {}
    for f, per_token in fpt.items():
        step_s = per_token * plan.tokens_per_step / sustained
        wall_s = step_s * plan.max_steps
        estimate[f] = {
            "step_time_s": step_s,
            "wall_clock_s": wall_s,
            "wall_clock_days": wall_s / 86400,
            "device_hours": wall_s * plan.devices / 3600,
            "chip_hours": wall_s * chips / 3600 if chips else None,
            "tokens_per_s_per_device": plan.tokens_per_step / step_s / plan.devices,
        }
    price = (prices or {}).get(device.generation) if chips else None
    for e in estimate.values():
        e["usd"] = {kind: e["chip_hours"] * usd for kind, usd in price.items()} if price else None
    return {
        **plan.to_dict(),
        "generation": device.generation,  # whose price `usd_per_chip_hour` is
        "chips": chips,
        "vms": device.vms * plan.slices,
        "params": param_count(recipe.model),
        "remat_budget": recipe.model.remat_budget,
        "flops_per_token": fpt,
        "steps": plan.max_steps,
        "tokens": plan.tokens_per_step * plan.max_steps,
        "mfu": mfu,
        "peak_tflops_per_device": device.peak_tflops_per_device,
        "usd_per_chip_hour": dict(price) if price else None,
        "estimate": estimate,
    }
