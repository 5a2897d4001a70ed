"""Recipes: YAML files validated into typed, frozen objects.

Unknown keys, wrong types and impossible values are errors that name the key and the file.
`--set key.sub=value` overrides are applied to the raw mapping before validation, so they are
checked exactly like values from the file. Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.mixes import MIXES

# Package data: `recipes/` at the top of the repository, `olmo_ctl/recipes` (a link to it) in a checkout,
# real files in an installed wheel.
RECIPES_DIR = Path(str(resources.files("olmo_ctl") / "recipes"))
STAGE_RECIPES = {1: "olmo3-7b-stage1", 2: "olmo3-7b-stage2", 3: "olmo3-7b-stage3"}


@dataclass(frozen=True)
class RopeScalingConfig:
    """YaRN RoPE scaling (OLMo-core `YaRNRoPEScalingConfig`, HF `rope_type: yarn`)."""

    kind: Literal["yarn"] = "yarn"
    factor: float = 8.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_context: int = 8192  # the context the base model was trained with (old_context_len)
    full_layers_only: bool = True  # OLMo-core `with_rope_scaling(full_attn_layers_only=True)`

    @property
    def attention_factor(self) -> float:
        """cos/sin (so q and k) are scaled by this: 0.1 ln(factor) + 1 (YaRN paper, section 3.4)."""
        import math

        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


@dataclass(frozen=True)
class ModelConfig:
    name: str = "olmo3-7b"
    n_layers: int = 32
    d_model: int = 4096
    n_heads: int = 32
    n_kv_heads: int = 32
    head_dim: int = 128
    mlp_hidden: int = 11008
    vocab_size: int = 100278  # real tokens
    padded_vocab_size: int = 100352  # embedding rows used in training
    sliding_window: int = 4096  # a token sees itself plus window-1 before it
    full_attention_every: int = 4  # layer i is full attention where (i+1) % full_attention_every == 0
    rope_theta: float = 500000.0
    rope_scaling: RopeScalingConfig | None = None  # stage 3: YaRN on the full-attention layers
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    # Rematerialisation: none | full (recompute the whole block) | save_proj (keep attention/MLP projections)
    remat: Literal["none", "full", "save_proj"] = "full"
    # Attention implementation: auto picks splash on TPU, cudnn on GPU (blocked without cuDNN), reference
    # on CPU (olmo_ctl/trainer/attention.py; docs/attention-and-xla-flags.md).
    attention: Literal["auto", "splash", "blocked", "reference", "cudnn"] = "auto"
    eos_token_id: int = 100257
    pad_token_id: int = 100277

    def layer_is_full(self, i: int) -> bool:
        """Full attention where (i+1) % full_attention_every == 0, and always on the last layer
        (OLMo-core's `force_full_attention_on_last_layer`, which matters when n_layers is not a
        multiple of full_attention_every)."""
        return (i + 1) % self.full_attention_every == 0 or i == self.n_layers - 1

    def layer_rope_scaled(self, i: int) -> bool:
        """Whether layer i's RoPE uses `rope_scaling` (full-attention layers only, unless configured)."""
        rs = self.rope_scaling
        return rs is not None and (not rs.full_layers_only or self.layer_is_full(i))


@dataclass(frozen=True)
class SkipStepConfig:
    enabled: bool = True
    window: int = 128
    min_history: int = 64
    sigma: float = 6.0


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    z_loss: float = 1e-5
    skip_step: SkipStepConfig = field(default_factory=SkipStepConfig)


@dataclass(frozen=True)
class SchedulePart:
    """One OLMo-core scheduler (see core/schedule.py for the formulas)."""

    kind: Literal["cosine", "half_cosine", "linear"] = "cosine"
    warmup_steps: int = 0
    alpha: float = 0.1  # eta_min = alpha * peak
    t_max: int = 0  # the part's horizon in steps (0 = train.max_steps)
    last_step: int = 0  # the last step whose LR this part sets (0 on the final part: to the end)


@dataclass(frozen=True)
class ScheduleConfig:
    # cosine = CosWithWarmup, half_cosine = HalfCosWithWarmup, linear = LinearWithWarmup (OLMo-core);
    # stitched = `parts` one after the other (the other fields are then unused).
    kind: Literal["cosine", "half_cosine", "linear", "stitched"] = "cosine"
    warmup_steps: int = 2000
    alpha: float = 0.1  # final LR = alpha * peak; linear decays to 0 when alpha = 0
    t_max: int = 0  # horizon in steps (0 = train.max_steps)
    parts: tuple[SchedulePart, ...] = ()


@dataclass(frozen=True)
class DataConfig:
    # Token files (raw uint32). `mix` names a shipped file list (OLMo-core's data mixes, in their
    # order) under the base directory `root`; otherwise `train` lists paths where `{root}` is replaced
    # by `root` (globs allowed, each sorted).
    root: str = ""
    mix: str = ""
    train: tuple[str, ...] = ()
    eval: tuple[str, ...] = ()
    seed: int = 34521
    ngram_filter: bool = False
    prefetch_workers: int = 0
    prefetch_buffer: int = 2
    # OLMo-core's packed FSL dataset (stage 3; olmo_ctl/trainer/packed.py): documents packed into
    # instances with best-fit decreasing, per group of `source_group_size` files, attention masked
    # at document boundaries. `source_permutation_seed` shuffles the file list first (any dataset).
    packed: bool = False
    source_group_size: int = 1
    source_permutation_seed: int | None = None


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 2000
    keep: int = 3  # committed checkpoints to keep (0 keeps all)
    async_save: bool = True


@dataclass(frozen=True)
class EvalConfig:
    interval: int = 1000
    batches: int = 8
    batch_size: int = 0  # 0 = the training global batch


@dataclass(frozen=True)
class LoggingConfig:
    metrics_every: int = 10  # fetch on-device metrics to the host every N steps
    upload_every_s: float = 60.0  # event-file segment upload to gs://


@dataclass(frozen=True)
class RuntimeConfig:
    """How the trainer guards a run (docs/multi-host.md); not part of the fingerprint."""

    peer_timeout_s: int = 60  # a host that misses heartbeats this long is lost: the others exit 3
    init_timeout_s: int = 300  # joining the slice's hosts; past it exit 3 (restart)
    watchdog_factor: float = 10.0  # a step longer than this x the median step time is a hang: exit 3
    watchdog_min_s: float = 300.0  # ... and never shorter than this


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 8192
    global_batch: int = 512
    max_steps: int = 1413814  # final step: checkpoint `max_steps` ends the run
    seed: int = 34521  # parameter init and other RNG
    max_per_device_batch: int = 0  # recipe cap on the micro-batch per device (0 = from the memory estimate)
    mesh: Literal["fsdp", "hybrid"] = "fsdp"
    data_parallel: int = 1  # replicas along the data axis when mesh = hybrid
    # Devices each sequence is split over (context parallelism, docs/planning.md); 0 = the plan
    # chooses (1 unless the slice has more devices than instances or one instance does not fit).
    seq_shards: int = 0


@dataclass(frozen=True)
class Recipe:
    name: str
    stage: int = 0  # 1, 2, 3, or 0 for other runs
    description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    # XLA/libtpu flags (`--name=value`) merged over the launch template's for this run's slices
    # (docs/attention-and-xla-flags.md). Performance only: not part of the fingerprint, so an attempt
    # may change them.
    xla_flags: tuple[str, ...] = ()
    source: str = field(default="", compare=False)  # file it came from (not part of the recipe)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch * self.train.seq_len

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source", None)
        return _plain(d)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def fingerprint(self) -> str:
        """Stable hash of the resolved recipe (its content, not where it came from)."""
        d = self.to_dict()
        d.pop("xla_flags", None)
        d.pop("runtime", None)  # how the run is guarded, not what it trains
        d["train"].pop("seq_shards", None)  # a layout, like the slice: not what the run trains
        for k, default in (("packed", False), ("source_group_size", 1), ("source_permutation_seed", None)):
            if d["data"].get(k) == default:  # absent unless set: older runs keep their fingerprint
                d["data"].pop(k, None)
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def data_paths(self, split: str = "train") -> list[str]:
        paths = self.data.train if split == "train" else self.data.eval
        return [p.replace("{root}", self.data.root.rstrip("/")) for p in paths]


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


# ---------------------------------------------------------------- loading and validation


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (tuple,):
        return "list"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, src: str) -> Any:
    """Check `value` against the annotation `tp`; return it converted (lists -> tuples, ints -> floats)."""
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise BadInput(f"{src}: `{key}` must be a mapping, got {type(value).__name__}")
        return _build(tp, value, key, src)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise BadInput(f"{src}: `{key}` must be one of {_type_name(tp)}, got {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):
        for arg in typing.get_args(tp):
            if arg is type(None) and value is None:
                return None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, src)
            except BadInput:
                continue
        raise BadInput(f"{src}: `{key}` has the wrong type ({value!r})")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise BadInput(f"{src}: `{key}` must be a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]", src) for i, v in enumerate(value))
        if len(value) != len(args):
            raise BadInput(f"{src}: `{key}` must have {len(args)} items, got {len(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]", src) for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if tp is bool:
        if not isinstance(value, bool):
            raise BadInput(f"{src}: `{key}` must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadInput(f"{src}: `{key}` must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadInput(f"{src}: `{key}` must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise BadInput(f"{src}: `{key}` must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} for {key}")


def _build(cls: type, raw: dict, prefix: str, src: str):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls) if f.name != "source"}
    kwargs = {}
    for k, v in raw.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            raise BadInput(f"{src}: unknown key `{key}`", f"known keys here: {', '.join(sorted(names))}")
        kwargs[k] = _coerce(v, hints[k], key, src)
    return cls(**kwargs)


def _parse_value(text: str) -> Any:
    """A `--set` value is read as YAML (numbers, booleans, lists) so `1e-4`, `true`, `[a, b]` work."""
    try:
        v = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(v, str):
        # YAML reads 3e-4 (no dot) as a string; accept it as a number.
        try:
            return float(v) if any(c in v for c in "eE.") else v
        except ValueError:
            return v
    return v


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...], src: str) -> dict:
    raw = json.loads(json.dumps(raw))  # deep copy of plain data
    for item in overrides or ():
        if "=" not in item:
            raise BadInput(f"--set `{item}` is not key.sub=value", "for example --set train.max_steps=100")
        key, _, text = item.partition("=")
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise BadInput(f"--set `{item}` has an empty key", "for example --set train.max_steps=100")
        node = raw
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise BadInput(f"{src}: --set `{key}`: `{p}` is not a section")
            node = nxt
        node[parts[-1]] = _parse_value(text)
    return raw


def validate(r: Recipe, src: str) -> None:
    """Impossible values; each message names the key and the file."""
    m, t, o, s = r.model, r.train, r.optimizer, r.schedule

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise BadInput(f"{src}: `{key}` {why}")

    need(r.stage in (0, 1, 2, 3), "stage", f"must be 0, 1, 2 or 3, got {r.stage}")
    for k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden", "vocab_size",
              "padded_vocab_size", "sliding_window", "full_attention_every"):
        need(getattr(m, k) > 0, f"model.{k}", f"must be positive, got {getattr(m, k)}")
    need(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", f"must divide model.n_heads ({m.n_heads})")
    need(m.padded_vocab_size >= m.vocab_size, "model.padded_vocab_size",
         f"must be >= model.vocab_size ({m.vocab_size})")
    need(m.rope_theta > 0, "model.rope_theta", "must be positive")
    if m.rope_scaling is not None:
        rs = m.rope_scaling
        need(rs.factor >= 1, "model.rope_scaling.factor", f"must be >= 1, got {rs.factor}")
        need(rs.beta_fast > 0 and rs.beta_slow > 0, "model.rope_scaling.beta_fast",
             "and beta_slow must be positive")
        need(rs.original_context > 0, "model.rope_scaling.original_context", "must be positive")
    need(m.rms_norm_eps > 0, "model.rms_norm_eps", "must be positive")
    need(m.init_std > 0, "model.init_std", "must be positive")
    need(m.sliding_window <= t.seq_len, "model.sliding_window",
         f"({m.sliding_window}) must not exceed train.seq_len ({t.seq_len})")
    need(0 <= m.eos_token_id < m.vocab_size, "model.eos_token_id", "must be a token id below model.vocab_size")
    need(0 <= m.pad_token_id < m.vocab_size, "model.pad_token_id", "must be a token id below model.vocab_size")
    need(t.seq_len > 1, "train.seq_len", f"must be > 1, got {t.seq_len}")
    need(t.global_batch > 0, "train.global_batch", f"must be positive, got {t.global_batch}")
    need(t.max_steps > 0, "train.max_steps", f"must be positive, got {t.max_steps}")
    need(t.max_per_device_batch >= 0, "train.max_per_device_batch", "must be >= 0")
    need(t.data_parallel >= 1, "train.data_parallel", "must be >= 1")
    need(t.seq_shards >= 0, "train.seq_shards", "must be >= 0 (0: the plan chooses)")
    if t.seq_shards > 1:
        need(t.seq_len % t.seq_shards == 0, "train.seq_shards", f"({t.seq_shards}) must divide train.seq_len ({t.seq_len})")
        need(m.n_heads % t.seq_shards == 0 and m.n_kv_heads % t.seq_shards == 0, "train.seq_shards",
             f"({t.seq_shards}) must divide model.n_heads and n_kv_heads ({m.n_heads}, {m.n_kv_heads}): "
             "attention runs each sequence's heads split over its shards")
    d = r.data
    need(d.source_group_size >= 1, "data.source_group_size", "must be >= 1")
    if d.packed:
        need(t.seq_len & (t.seq_len - 1) == 0, "train.seq_len",
             f"must be a power of two for data.packed (OLMo-core's packer), got {t.seq_len}")
    if t.mesh == "hybrid":
        need(t.global_batch % t.data_parallel == 0, "train.global_batch",
             f"({t.global_batch}) must be a multiple of train.data_parallel ({t.data_parallel})")
    need(o.lr > 0, "optimizer.lr", f"must be positive, got {o.lr}")
    need(all(0 <= b < 1 for b in o.betas), "optimizer.betas", "must be in [0, 1)")
    need(o.eps > 0, "optimizer.eps", "must be positive")
    need(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
    need(o.grad_clip > 0, "optimizer.grad_clip", "must be positive")
    need(o.z_loss >= 0, "optimizer.z_loss", "must be >= 0")
    ss = o.skip_step
    need(ss.window >= 2, "optimizer.skip_step.window", "must be >= 2")
    need(2 <= ss.min_history <= ss.window, "optimizer.skip_step.min_history",
         "must be between 2 and optimizer.skip_step.window")
    need(ss.sigma > 0, "optimizer.skip_step.sigma", "must be positive")
    _validate_schedule(s, t.max_steps, need)
    need(r.checkpoint.interval > 0, "checkpoint.interval", "must be positive")
    need(r.checkpoint.keep >= 0, "checkpoint.keep", "must be >= 0")
    need(r.eval.interval > 0, "eval.interval", "must be positive")
    need(r.eval.batches >= 0, "eval.batches", "must be >= 0")
    need(r.eval.batch_size >= 0, "eval.batch_size", "must be >= 0")
    need(r.logging.metrics_every > 0, "logging.metrics_every", "must be positive")
    need(r.runtime.peer_timeout_s > 0, "runtime.peer_timeout_s", "must be positive")
    need(r.runtime.init_timeout_s > 0, "runtime.init_timeout_s", "must be positive")
    need(r.runtime.watchdog_factor > 1, "runtime.watchdog_factor", "must be > 1")
    need(r.runtime.watchdog_min_s > 0, "runtime.watchdog_min_s", "must be positive")
    need(r.data.prefetch_workers >= 0, "data.prefetch_workers", "must be >= 0")
    if r.data.mix:
        need(r.data.mix in MIXES, "data.mix", f"must be one of {', '.join(sorted(MIXES))}, got {r.data.mix!r}")
        need(not r.data.train, "data.train", "must be empty when data.mix names the training files (--set data.train=[])")
    else:
        need(len(r.data.train) > 0, "data.train", "must list at least one token file or glob (or set data.mix)")


def _validate_schedule(s: ScheduleConfig, max_steps: int, need) -> None:
    items: list[tuple[str, SchedulePart | ScheduleConfig]]
    if s.kind == "stitched":
        need(len(s.parts) >= 1, "schedule.parts", "must list at least one part when schedule.kind is stitched")
        items = [(f"schedule.parts[{i}]", p) for i, p in enumerate(s.parts)]
    else:
        need(not s.parts, "schedule.parts", "is only for schedule.kind: stitched (--set schedule.parts=[])")
        items = [("schedule", s)]
    prev_last = 0
    for i, (key, p) in enumerate(items):
        t_max = p.t_max or max_steps
        need(p.warmup_steps >= 0, f"{key}.warmup_steps", "must be >= 0")
        need(p.t_max >= 0, f"{key}.t_max", "must be >= 0 (0 = train.max_steps)")
        need(p.warmup_steps < t_max, f"{key}.warmup_steps",
             f"({p.warmup_steps}) must be below the horizon ({key}.t_max or train.max_steps: {t_max})")
        need(0 <= p.alpha <= 1, f"{key}.alpha", "must be in [0, 1]")
        if s.kind != "stitched":
            continue
        assert isinstance(p, SchedulePart)  # stitched: the items are the parts
        if i < len(items) - 1:
            need(p.last_step > prev_last, f"{key}.last_step",
                 f"must be a step after the previous part's last step ({prev_last})")
            prev_last = p.last_step
        else:
            need(p.last_step == 0, f"{key}.last_step", "must be 0 on the last part (it runs to the end)")


def resolve_recipe_path(recipe: str | None = None, stage: int | None = None) -> Path:
    """`--stage 1|2|3` or `--recipe FILE|NAME` -> a file path. Exactly one of them must be given."""
    if recipe is not None and stage is not None:
        raise BadInput("--stage and --recipe are exclusive", "give one of them")
    if stage is not None:
        if stage not in STAGE_RECIPES:
            raise BadInput(f"--stage {stage} is not a stage", "OLMo 3 stages here are 1, 2 and 3")
        return RECIPES_DIR / f"{STAGE_RECIPES[stage]}.yaml"
    if recipe is None:
        raise BadInput("no recipe given", "pass --stage 1|2|3 or --recipe FILE|NAME")
    p = Path(recipe)
    if p.suffix in (".yaml", ".yml") or p.exists() or "/" in recipe:
        if not p.exists():
            raise BadInput(f"recipe file `{recipe}` does not exist", "pass a YAML file or a name from recipes/")
        return p
    named = RECIPES_DIR / f"{recipe}.yaml"
    if not named.exists():
        names = ", ".join(sorted(x.stem for x in RECIPES_DIR.glob("*.yaml")))
        raise BadInput(f"`{recipe}` is not a recipe", f"known recipes: {names}")
    return named


def load_raw(path: Path) -> dict:
    src = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"recipe `{src}` is not UTF-8 text (byte {e.start} is 0x{e.object[e.start]:02x})",
                       "pass a recipe YAML file (UTF-8), e.g. recipes/smoke.yaml, or a name such as smoke") from None
    except OSError as e:
        raise BadInput(f"cannot read recipe `{src}`: {e.strerror}") from None
    if "\x00" in text:
        raise BadInput(f"recipe `{src}` is a binary file, not YAML",
                       "pass a recipe YAML file (UTF-8), e.g. recipes/smoke.yaml, or a name such as smoke")
    try:
        raw = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml: start-up time
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else "syntax error"
        raise BadInput(f"{src}: not valid YAML ({first})") from None
    if not isinstance(raw, dict):
        raise BadInput(f"{src}: a recipe is a YAML mapping")
    return raw


def recipe_from_dict(raw: dict, src: str = "<recipe>", overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    raw = apply_overrides(raw, overrides, src)
    if "name" not in raw:
        raise BadInput(f"{src}: missing key `name`")
    r = _build(Recipe, raw, "", src)
    r = dataclasses.replace(r, source=src)
    validate(r, src)
    return r


def load_recipe(
    recipe: str | None = None, stage: int | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Recipe:
    path = resolve_recipe_path(recipe, stage)
    return recipe_from_dict(load_raw(path), str(path), overrides)
