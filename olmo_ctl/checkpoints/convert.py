"""Hugging Face `Olmo3ForCausalLM` / `Olmo2ForCausalLM` <-> our Orbax parameters.

Both families have the same tensors (OLMo 2's block is OLMo 3's; OLMo 3 adds the sliding-window
layers and per-layer-type RoPE), so one mapping serves both; `config.json`'s `model_type` chooses
`ModelConfig.architecture`, and converting out writes the family the model came from.

HF side: `config.json` + `model.safetensors` (or shards listed in `model.safetensors.index.json`).
Safetensors are read and written here directly (8-byte header length, JSON header, raw little-endian
bytes) with numpy + ml_dtypes, so conversion needs neither torch nor transformers and bf16 tensors
round-trip bit for bit.

Orbax side (ORBAX_DIR): an Orbax StandardSave checkpoint of `{"params": params}` (the pytree of
`model.init_params`) plus `olmo_model.json` = {"model": ModelConfig fields, "hf_config": the original
config.json, "hf_dtype": the original tensor dtype}, so the model can be rebuilt and converted back
to exactly the tensors it came from.

Mapping (HF Linear weights are [out, in]; ours are [in, out]):
    model.embed_tokens.weight [V_hf, d]            -> embed [V, d]      (rows padded with zeros)
    lm_head.weight [V_hf, d]                       -> lm_head [d, V]    (transposed, padded with zeros)
    model.norm.weight                              -> final_norm
    model.layers.i.self_attn.{q,k,v,o}_proj.weight -> blocks/attn/w{q,k,v,o}[i] (transposed)
    model.layers.i.self_attn.{q,k}_norm.weight     -> blocks/attn/{q,k}_norm[i]
    model.layers.i.post_attention_layernorm.weight -> blocks/attn_norm[i]
    model.layers.i.post_feedforward_layernorm.weight -> blocks/mlp_norm[i]
    model.layers.i.mlp.{gate,up,down}_proj.weight  -> blocks/mlp/w{1,3,2}[i] (transposed)
The zero rows padding adds to a converted model were never trained, so its config records its own rows
(`softmax_vocab_size`) and the model leaves the others out of the softmax, as transformers, which has
none, does. Converting out writes the rows the model's softmax covers (`hf_vocab_rows`): a converted
model's own rows, so it round-trips exactly; every padded row of a training checkpoint, which the
trainer trained (its LM head's padded columns take softmax mass in every step), as OLMo-core's
`save_hf_model` keeps them, so the export's logits are the checkpoint's; `vocab_size` rows only on
request (`truncate_vocab`), for tools that want the tokenizer's size.

Both directions stream, one parameter and within it one stored Orbax chunk (at most 64 MiB) at a
time, so peak memory is a few chunks whatever the model's size (docs/benchmarks.md,
`benchmarks/convert_memory.py`): `hf_to_orbax` hands Orbax a `StreamedArray` per parameter, which
fills each output chunk from the memory-mapped HF rows it covers; `orbax_to_hf` lays out every
safetensors file first (each tensor's shape and offset follow from the model config) and fills it
chunk by chunk with tensorstore reads. `save_orbax` / `load_orbax` keep the whole-tree forms for
callers that hold parameters in memory.

Orbax reads and writes gs:// itself; the HF side of a gs:// path is staged through a local temporary
directory with `olmo_ctl.storage`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Literal

import numpy as np

from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import ModelConfig, RopeScalingConfig
from olmo_ctl.storage import is_gcs, join, store_for

ParamDtype = Literal["float32", "bfloat16"]

META_FILE = "olmo_model.json"
VOCAB_MULTIPLE = 128
SHARD_BYTES = 5 * 1024**3
DOWNLOAD_PIECE_BYTES = 64 * 2**20

_ST_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}

# (HF name inside model.layers.{i}., our path under blocks, transpose)
LAYER_MAP = (
    ("self_attn.q_proj.weight", ("attn", "wq"), True),
    ("self_attn.k_proj.weight", ("attn", "wk"), True),
    ("self_attn.v_proj.weight", ("attn", "wv"), True),
    ("self_attn.o_proj.weight", ("attn", "wo"), True),
    ("self_attn.q_norm.weight", ("attn", "q_norm"), False),
    ("self_attn.k_norm.weight", ("attn", "k_norm"), False),
    ("post_attention_layernorm.weight", ("attn_norm",), False),
    ("post_feedforward_layernorm.weight", ("mlp_norm",), False),
    ("mlp.gate_proj.weight", ("mlp", "w1"), True),
    ("mlp.up_proj.weight", ("mlp", "w3"), True),
    ("mlp.down_proj.weight", ("mlp", "w2"), True),
)


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# ----------------------------------------------------------------------------- safetensors


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: where its bytes lie, read or written a band of rows at a time."""

    path: str
    offset: int  # of its first byte in the file
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def rows(self, start: int, stop: int, writable: bool = False) -> np.ndarray:
        """Rows [start, stop) (elements of a 1-D tensor) mapped from the file. The mapping is a window:
        once the caller drops it, its pages leave the process (they stay in the page cache)."""
        row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        return np.memmap(
            self.path,
            self.dtype,
            "r+" if writable else "r",
            offset=self.offset + start * row_bytes,
            shape=(stop - start, *self.shape[1:]),
        )


def read_safetensors_header(path: str | Path) -> dict[str, StoredTensor]:
    """The tensors of a safetensors file, from its header only (no tensor data is read)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if 8 + n <= size else None
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise BadInput(f"`{path}` is not a safetensors file", HF_HINT)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise BadInput(f"{path}: tensor `{name}` has unsupported dtype {info['dtype']}")
        t = StoredTensor(
            str(path),
            8 + n + info["data_offsets"][0],
            _np_dtype(_ST_DTYPES[info["dtype"]]),
            tuple(info["shape"]),
        )
        start, end = info["data_offsets"]
        if end - start != t.nbytes or t.offset + t.nbytes > size:
            raise BadInput(f"{path}: tensor `{name}` does not hold {list(t.shape)} {t.dtype} values", HF_HINT)
        out[name] = t
    return out


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, memory-mapped."""
    header = read_safetensors_header(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    return {
        name: np.frombuffer(raw[t.offset : t.offset + t.nbytes], dtype=t.dtype).reshape(t.shape)
        for name, t in header.items()
    }


def safetensors_header(
    tensors: list[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict | None = None
) -> bytes:
    """The bytes before the data of a safetensors file holding `tensors` (name, dtype, shape) in order."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": _ST_NAMES[str(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
    return struct.pack("<Q", len(blob)) + blob


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    with open(path, "wb") as f:
        f.write(safetensors_header([(k, t.dtype, t.shape) for k, t in tensors.items()], metadata))
        for t in tensors.values():
            f.write(np.ascontiguousarray(t).tobytes())


# ----------------------------------------------------------------------------- staging gs:// paths


@contextlib.contextmanager
def local_copy(path: str):
    """A local directory holding the files under `path` (downloaded when it is on gs://)."""
    if not is_gcs(path):
        if not os.path.isdir(path):
            raise BadInput(f"`{path}` is not a directory")
        yield path
        return
    store = store_for(path)
    files, _ = store.list(path, recursive=True)
    if not files:
        raise BadInput(f"`{path}` is empty or does not exist")
    prefix = path.rstrip("/") + "/"
    with tempfile.TemporaryDirectory(prefix="olmo-ctl-") as tmp:
        for f in files:
            rel = f.path[len(prefix) :]
            dst = Path(tmp, rel)
            dst.parent.mkdir(parents=True, exist_ok=True)
            with open(dst, "wb") as out:  # piece by piece: a 5 GB shard never sits in memory
                for start in range(0, f.size, DOWNLOAD_PIECE_BYTES):
                    out.write(store.read_range(f.path, start, min(f.size, start + DOWNLOAD_PIECE_BYTES)))
        yield tmp


@contextlib.contextmanager
def output_dir(path: str, overwrite: bool = False):
    """A local directory to write into; on exit it is uploaded when `path` is on gs://."""
    store = store_for(path)
    if is_gcs(path):
        files, _ = store.list(path, recursive=True)
        if files and not overwrite:
            raise BadInput(f"`{path}` already holds files", "choose a new path or pass --overwrite")
        with tempfile.TemporaryDirectory(prefix="olmo-ctl-") as tmp:
            out = os.path.join(tmp, "out")
            yield out
            for dp, _, fns in os.walk(out):
                for fn in fns:
                    full = os.path.join(dp, fn)
                    store.write_bytes(join(path, os.path.relpath(full, out)), Path(full).read_bytes())
        return
    if os.path.exists(path) and os.listdir(path):
        if not overwrite:
            raise BadInput(
                f"`{path}` already exists and is not empty", "choose a new path or pass --overwrite"
            )
        shutil.rmtree(path)
    yield os.path.abspath(path)


# ----------------------------------------------------------------------------- configs


def _full_every(layer_types: list[str]) -> int:
    """The P with layer i full iff (i+1) % P == 0 or i is the last layer (OLMo-core forces the last
    layer to full attention); BadInput when the pattern is not of that form."""
    n = len(layer_types)
    for p in range(1, n + 2):
        if all(
            (t == "full_attention") == ((i + 1) % p == 0 or i == n - 1) for i, t in enumerate(layer_types)
        ):
            return p
    raise BadInput(
        f"layer_types {layer_types} is not a `full every P-th layer, and the last` pattern",
        "OLMo 3 uses 3 sliding : 1 full (full where (i+1) % 4 == 0, and on the last layer)",
    )


_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0}


def _yarn_from_hf(params: dict, full_layers_only: bool) -> RopeScalingConfig:
    factor = float(params.get("factor") or 1.0)
    orig = params.get("original_max_position_embeddings")
    if not orig:
        raise BadInput(f"YaRN RoPE settings {params} have no original_max_position_embeddings")
    rs = RopeScalingConfig(
        factor=factor,
        beta_fast=float(params.get("beta_fast") or _YARN_DEFAULTS["beta_fast"]),
        beta_slow=float(params.get("beta_slow") or _YARN_DEFAULTS["beta_slow"]),
        original_context=int(orig),
        full_layers_only=full_layers_only,
    )
    af = params.get("attention_factor")
    unsupported = {k for k in ("mscale", "mscale_all_dim") if params.get(k)} | (
        {"truncate"} if params.get("truncate") is False else set()
    )
    if unsupported or (af is not None and abs(float(af) - rs.attention_factor) > 1e-12):
        raise BadInput(
            f"YaRN RoPE settings {params} are not OLMo-core's (attention factor 0.1 ln(factor) + 1,"
            " truncated correction range)",
            "OLMo 3 stage 3 uses factor 8, beta_fast 32, beta_slow 1",
        )
    return rs


def _rope_from_hf(hf: dict) -> tuple[float, RopeScalingConfig | None]:
    """(theta, YaRN scaling or None) from config.json: per-layer-type `rope_parameters` (transformers
    5.x) or the older `rope_theta` + `rope_scaling`, which Olmo3Config applies to full-attention layers."""
    rp = hf.get("rope_parameters") or {}
    if rp and all(isinstance(v, dict) for v in rp.values()):  # per layer type
        per_type = dict(rp)
    else:
        base = dict(rp) if rp else {"rope_type": "default"}
        base.setdefault("rope_theta", hf.get("rope_theta", 500000.0))
        full = dict(base)
        if hf.get("rope_scaling"):
            full.update(hf["rope_scaling"])
            full["rope_type"] = full.get("rope_type", full.get("type"))
        per_type = {"sliding_attention": base, "full_attention": full}
    thetas = {v.get("rope_theta") for v in per_type.values()}
    kinds = {t: v.get("rope_type", "default") or "default" for t, v in per_type.items()}
    if len(thetas) != 1 or set(kinds.values()) - {"default", "yarn"}:
        raise BadInput(
            f"RoPE settings {rp or hf.get('rope_scaling')} are not OLMo 3's (one theta; plain RoPE,"
            " or YaRN on the full-attention layers)",
            "stages 1-2 use default RoPE, theta 500000 on every layer; stage 3 adds YaRN on full layers",
        )
    theta = float(thetas.pop() or 500000.0)
    full_yarn, sliding_yarn = kinds.get("full_attention") == "yarn", kinds.get("sliding_attention") == "yarn"
    if sliding_yarn and (not full_yarn or per_type["full_attention"] != per_type["sliding_attention"]):
        raise BadInput(
            "YaRN RoPE on the sliding layers only, or different YaRN settings per layer type, is not"
            " OLMo 3's",
            "OLMo 3 stage 3 uses YaRN on the full-attention layers only",
        )
    if not full_yarn:
        return theta, None
    return theta, _yarn_from_hf(per_type["full_attention"], full_layers_only=not sliding_yarn)


def _rope_parameters(cfg: ModelConfig) -> dict:
    """transformers 5.x `rope_parameters` per layer type for `cfg` (OLMo-core's `to_hf_config` for YaRN)."""
    plain = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    rs = cfg.rope_scaling
    if rs is None:
        return {"full_attention": dict(plain), "sliding_attention": dict(plain)}
    yarn = {
        "rope_type": "yarn",
        "rope_theta": cfg.rope_theta,
        "factor": rs.factor,
        "original_max_position_embeddings": rs.original_context,
        "beta_fast": rs.beta_fast,
        "beta_slow": rs.beta_slow,
        "attention_factor": rs.attention_factor,
    }
    return {"full_attention": yarn, "sliding_attention": dict(yarn) if not rs.full_layers_only else plain}


def _olmo2_rope(hf: dict) -> float:
    """The one RoPE theta of an `Olmo2Config` (transformers 5.x `rope_parameters`, or the older
    `rope_theta` + `rope_scaling`); OLMo 2 uses plain RoPE only."""
    rp = hf.get("rope_parameters") or {}
    kind = rp.get("rope_type") or (hf.get("rope_scaling") or {}).get("rope_type") or "default"
    if kind != "default" or any(isinstance(v, dict) for v in rp.values()):
        raise BadInput(
            f"RoPE settings {rp or hf.get('rope_scaling')} are not OLMo 2's (one plain RoPE on every layer)",
            "OLMo 2 uses default RoPE, theta 500000",
        )
    return float(rp.get("rope_theta") or hf.get("rope_theta") or 500000.0)


def model_config_from_hf(
    hf: dict,
    vocab_size: int | None = None,
    padded_vocab_size: int | None = None,
    param_dtype: ParamDtype = "float32",
    name: str = "olmo3-hf",
) -> ModelConfig:
    model_type = hf.get("model_type") or "olmo3"
    if model_type not in ("olmo3", "olmo2"):
        raise BadInput(f"config.json is a `{model_type}` model, not olmo3 or olmo2")
    family = "OLMo 3" if model_type == "olmo3" else "OLMo 2"
    if hf.get("attention_bias"):
        raise BadInput(f"attention_bias=true is not {family} (no biases anywhere)")
    if hf.get("hidden_act", "silu") != "silu":
        raise BadInput(f"hidden_act {hf['hidden_act']!r} is not SwiGLU (silu)")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    n_layers = hf["num_hidden_layers"]
    scaling: RopeScalingConfig | None
    if model_type == "olmo2":  # every layer full attention, one plain RoPE
        every, window, theta, scaling = 1, 0, _olmo2_rope(hf), None
    else:
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n_layers)
        ]
        every = _full_every(layer_types)
        theta, scaling = _rope_from_hf(hf)
        if hf.get("sliding_window") is None and every != 1:
            raise BadInput("sliding layers without a sliding_window in config.json")
        window = int(hf.get("sliding_window") or hf.get("max_position_embeddings", 8192))
    v_hf = hf["vocab_size"]
    vocab = vocab_size or v_hf
    padded = padded_vocab_size or -(-max(vocab, v_hf) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if vocab > v_hf or padded < max(vocab, v_hf):
        raise BadInput(
            f"vocab sizes do not fit: HF has {v_hf} rows, vocab_size {vocab}, padded {padded}",
            "need vocab_size <= HF rows <= padded_vocab_size",
        )

    def token(key: str, default: int) -> int:
        t = hf.get(key)
        t = t[0] if isinstance(t, list) else t
        return t if isinstance(t, int) and 0 <= t < vocab else default

    return ModelConfig(
        name=name,
        n_layers=n_layers,
        d_model=d,
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or d // heads,
        mlp_hidden=hf["intermediate_size"],
        vocab_size=vocab,
        padded_vocab_size=padded,
        sliding_window=int(window),
        full_attention_every=every,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        init_std=float(hf.get("initializer_range", 0.02)),
        param_dtype=param_dtype,
        compute_dtype="float32",
        remat="none",
        eos_token_id=token("eos_token_id", min(vocab - 1, 100257)),
        pad_token_id=token("pad_token_id", min(vocab - 1, 100277)),
        architecture="olmo2" if model_type == "olmo2" else "olmo3",
        softmax_vocab_size=softmax_rows(v_hf, padded),
    )


def softmax_rows(hf_rows: int, padded: int) -> int:
    """`ModelConfig.softmax_vocab_size` of a model converted from `hf_rows` LM-head rows padded to
    `padded`: its own rows, or 0 when padding added none. The zero rows padding adds were never
    trained: in the softmax they would take mass the model never gave them (transformers has no such
    rows), so they are left out."""
    return hf_rows if hf_rows < padded else 0


def hf_vocab_rows(cfg: ModelConfig, truncate_vocab: bool = False) -> int:
    """The embedding and LM-head rows an export of `cfg` writes (the module docstring): the rows its
    softmax covers, or the tokenizer's `vocab_size` when `truncate_vocab`."""
    if truncate_vocab:
        return cfg.vocab_size
    return cfg.softmax_vocab_size or cfg.padded_vocab_size


def hf_config_from_model(
    cfg: ModelConfig, base: dict | None = None, dtype: str = "float32", vocab_rows: int | None = None
) -> dict:
    """config.json for `cfg`: an `Olmo3Config`, or an `Olmo2Config` (no sliding window or layer types,
    one RoPE for every layer) for architecture olmo2; fields of `base` (the original config.json) not
    derived from cfg are kept. `vocab_rows`: the rows the export writes (default `vocab_size`)."""
    olmo2 = cfg.architecture == "olmo2"
    hf = dict(base or {})
    hf.update(
        {
            "architectures": ["Olmo2ForCausalLM" if olmo2 else "Olmo3ForCausalLM"],
            "model_type": cfg.architecture,
            "vocab_size": vocab_rows or cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.mlp_hidden,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps,
            "attention_bias": False,
            "tie_word_embeddings": False,
        }
    )
    if olmo2:
        for key in ("sliding_window", "layer_types"):
            hf.pop(key, None)
    else:
        hf["sliding_window"] = cfg.sliding_window
        hf["layer_types"] = [
            "full_attention" if cfg.layer_is_full(i) else "sliding_attention" for i in range(cfg.n_layers)
        ]
    if cfg.head_dim != cfg.d_model // cfg.n_heads or "head_dim" in hf:
        hf["head_dim"] = cfg.head_dim
    same_rope = (
        _olmo2_rope(hf) == cfg.rope_theta
        if olmo2
        else _rope_from_hf(hf) == (cfg.rope_theta, cfg.rope_scaling)
    )
    if not base or not same_rope:  # else keep base's RoPE fields
        hf.update(
            {
                "rope_parameters": (
                    {"rope_type": "default", "rope_theta": cfg.rope_theta} if olmo2 else _rope_parameters(cfg)
                ),
                "rope_theta": cfg.rope_theta,  # what transformers 4.57-4.x reads
                "rope_scaling": None,
            }
        )
    if not base:
        hf.update(
            {
                "max_position_embeddings": 4096 if olmo2 else 65536,
                "initializer_range": cfg.init_std,
                "eos_token_id": cfg.eos_token_id,
                "pad_token_id": cfg.pad_token_id,
                "bos_token_id": None,
                "dtype": dtype,
            }
        )
    return hf


# ----------------------------------------------------------------------------- tensors


def hf_state_to_params(state: dict[str, np.ndarray], cfg: ModelConfig, dtype: str | None = None) -> dict:
    """HF tensors -> our parameter pytree (numpy, in `dtype` or cfg.param_dtype)."""
    dt = _np_dtype(dtype or cfg.param_dtype)
    V = cfg.padded_vocab_size

    def take(name: str) -> np.ndarray:
        if name not in state:
            raise BadInput(f"HF checkpoint has no tensor `{name}`")
        return state[name]

    def pad_rows(x: np.ndarray) -> np.ndarray:
        out = np.zeros((V, x.shape[1]), dt)
        out[: x.shape[0]] = x.astype(dt)
        return out

    embed = take("model.embed_tokens.weight")
    head = state.get("lm_head.weight", embed)  # tied checkpoints: the head is the embedding
    blocks: dict = {"attn": {}, "mlp": {}}
    for hf_name, path, transpose in LAYER_MAP:
        layers = [take(f"model.layers.{i}.{hf_name}") for i in range(cfg.n_layers)]
        arr = np.stack([w.T if transpose else w for w in layers]).astype(dt)
        node = blocks
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = arr
    params = {
        "embed": pad_rows(embed),
        "blocks": blocks,
        "final_norm": take("model.norm.weight").astype(dt),
        "lm_head": pad_rows(head).T.copy(),
    }
    _check_shapes(params, cfg)
    return params


def params_to_hf_state(
    params, cfg: ModelConfig, dtype: str, vocab_rows: int | None = None
) -> dict[str, np.ndarray]:
    """Our parameters -> HF tensors (`vocab_rows` rows of the vocabulary, default `hf_vocab_rows`), in
    `dtype`."""
    dt = _np_dtype(dtype)
    p = _to_numpy(params)
    V = vocab_rows or hf_vocab_rows(cfg)

    def c(x):
        return np.ascontiguousarray(np.asarray(x).astype(dt))

    out = {"model.embed_tokens.weight": c(p["embed"][:V])}
    for i in range(cfg.n_layers):
        for hf_name, path, transpose in LAYER_MAP:
            node = p["blocks"]
            for k in path:
                node = node[k]
            w = node[i]
            out[f"model.layers.{i}.{hf_name}"] = c(w.T if transpose else w)
    out["model.norm.weight"] = c(p["final_norm"])
    out["lm_head.weight"] = c(p["lm_head"][:, :V].T)
    return out


def _to_numpy(tree):
    import jax

    return jax.tree.map(lambda x: np.asarray(x), tree)


def _check_shapes(params, cfg: ModelConfig) -> None:
    from olmo_ctl.trainer.model import param_shapes

    want = param_shapes(cfg)
    import jax

    got = jax.tree.map(lambda x: tuple(x.shape), params)
    flat_w = jax.tree_util.tree_flatten_with_path(want, is_leaf=lambda x: isinstance(x, tuple))[0]
    flat_g = dict(jax.tree_util.tree_flatten_with_path(got, is_leaf=lambda x: isinstance(x, tuple))[0])
    for path, shape in flat_w:
        if flat_g.get(path) != shape:
            raise BadInput(
                f"tensor {jax.tree_util.keystr(path)} has shape {flat_g.get(path)}, the config says {shape}"
            )


# ----------------------------------------------------------------------------- routes (pure)


@dataclasses.dataclass(frozen=True)
class Route:
    """One of our parameters and the HF tensors it is made of: one per layer for a stacked `blocks`
    leaf (axis 0 is the layer), else one. `transpose`: HF holds it [out, in], we hold [in, out]. HF rows
    past the tensor's end (the padded vocabulary) are zeros on our side and dropped on theirs."""

    path: tuple[str, ...]  # under params
    hf_names: tuple[str, ...]
    stacked: bool
    transpose: bool

    @property
    def key(self) -> str:
        """The leaf's name as Orbax metadata and jax.tree_util.keystr spell it."""
        return "".join(f"[{p!r}]" for p in self.path)

    @property
    def hf_row_axis(self) -> int:
        """The axis of our array that runs along the HF tensors' rows."""
        return int(self.stacked) + int(self.transpose)

    def parts(self, index: tuple[slice, ...]):
        """(layer within the block or None, HF name, HF rows, HF columns or None) for each HF tensor a
        block `index` of our array covers."""
        layers, rest = (range(index[0].start, index[0].stop), index[1:]) if self.stacked else ([0], index)
        for k, layer in enumerate(layers):
            cols: slice | None
            if self.transpose:
                rows, cols = rest[1], rest[0]
            else:
                rows, cols = rest[0], rest[1] if len(rest) > 1 else None
            yield (k if self.stacked else None), self.hf_names[layer], rows, cols


def routes(cfg: ModelConfig) -> list[Route]:
    """Every parameter's route (the mapping in the module docstring)."""
    out = [Route(("embed",), ("model.embed_tokens.weight",), False, False)]
    for hf_name, path, transpose in LAYER_MAP:
        names = tuple(f"model.layers.{i}.{hf_name}" for i in range(cfg.n_layers))
        out.append(Route(("blocks", *path), names, True, transpose))
    out.append(Route(("final_norm",), ("model.norm.weight",), False, False))
    out.append(Route(("lm_head",), ("lm_head.weight",), False, True))
    return out


def hf_layout(cfg: ModelConfig, vocab_rows: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every HF tensor of `cfg`, in the order the files hold them; the vocabulary has
    `vocab_rows` rows (default `hf_vocab_rows`)."""
    from olmo_ctl.trainer.model import param_shapes

    shapes = param_shapes(cfg)
    per_name = {}
    for r in routes(cfg):
        node = shapes
        for p in r.path:
            node = node[p]
        shape = tuple(node[1:] if r.stacked else node)
        shape = shape[::-1] if r.transpose else shape
        if r.path in (("embed",), ("lm_head",)):
            shape = (vocab_rows or hf_vocab_rows(cfg), *shape[1:])
        per_name.update(dict.fromkeys(r.hf_names, shape))
    layers = [f"model.layers.{i}.{n}" for i in range(cfg.n_layers) for n, _, _ in LAYER_MAP]
    order = ["model.embed_tokens.weight", *layers, "model.norm.weight", "lm_head.weight"]
    return [(n, per_name[n]) for n in order]


def blocks(shape: tuple[int, ...], block: tuple[int, ...], outer_axis: int = 0):
    """The index expressions of the blocks of `shape`, `outer_axis` outermost, the others row-major."""
    order = [outer_axis, *(a for a in range(len(shape)) if a != outer_axis)]
    for start in itertools.product(*(range(0, shape[a], block[a]) for a in order)):
        at = dict(zip(order, start, strict=True))
        yield tuple(slice(at[a], min(at[a] + block[a], shape[a])) for a in range(len(shape)))


def shard_plan(
    layout: list[tuple[str, tuple[int, ...]]], dtype: np.dtype
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """HF tensors in order, cut into files of at most SHARD_BYTES (a larger tensor gets a file alone)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        if size and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


# ----------------------------------------------------------------------------- directories


def read_json_object(path: str, hint: str) -> dict:
    """A JSON object from a file (local or gs://); a file that is not one is bad input naming it."""
    store = store_for(path)
    try:
        obj = json.loads(store.read_bytes(path).decode("utf-8"))
    except UnicodeDecodeError:
        raise BadInput(f"`{path}` is not JSON (not UTF-8 text)", hint) from None
    except json.JSONDecodeError as e:
        raise BadInput(f"`{path}` is not JSON ({e.msg} at line {e.lineno} column {e.colno})", hint) from None
    except (IsADirectoryError, NotADirectoryError):
        raise BadInput(f"`{path}` is not a file", hint) from None
    if not isinstance(obj, dict):
        raise BadInput(f"`{path}` is not a JSON object", hint)
    return obj


HF_HINT = "pass a Hugging Face model directory (as written by save_pretrained)"


def read_hf_config(hf_dir: str) -> dict:
    """config.json of a Hugging Face model directory, local or gs:// (checked before any heavy work)."""
    if not is_gcs(hf_dir) and not os.path.isdir(hf_dir):
        raise BadInput(f"`{hf_dir}` is not a directory", HF_HINT)
    path = join(hf_dir, "config.json")
    if not store_for(path).exists(path):
        raise BadInput(f"`{hf_dir}` has no config.json", HF_HINT)
    return read_json_object(path, "fix it or download the model again (save_pretrained writes config.json)")


def index_hf_dir(hf_dir: str) -> tuple[dict, dict[str, StoredTensor]]:
    """(config.json, where each tensor lies) of a local HF model directory; no tensor data is read."""
    hf = read_hf_config(hf_dir)
    index = Path(hf_dir, "model.safetensors.index.json")
    if index.exists():
        weight_map = read_json_object(str(index), HF_HINT).get("weight_map")
        if not isinstance(weight_map, dict):
            raise BadInput(f"`{index}` has no `weight_map` object", HF_HINT)
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not Path(hf_dir, f).is_file()]
        if missing:
            raise BadInput(f"`{index}` names {missing[0]}, which `{hf_dir}` does not hold", HF_HINT)
    elif Path(hf_dir, "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise BadInput(f"`{hf_dir}` has no model.safetensors", "save the model with safe_serialization=True")
    tensors: dict[str, StoredTensor] = {}
    for f in files:
        tensors.update(read_safetensors_header(Path(hf_dir, f)))
    return hf, tensors


def load_hf_dir(hf_dir: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json, tensors memory-mapped) of a local HF model directory."""
    hf, tensors = index_hf_dir(hf_dir)
    files = sorted({t.path for t in tensors.values()})
    state: dict[str, np.ndarray] = {}
    for f in files:
        state.update(read_safetensors(f))
    return hf, state


def create_hf_dir(
    out: str, hf_config: dict, layout: list[tuple[str, tuple[int, ...]]], dtype: np.dtype
) -> dict[str, StoredTensor]:
    """config.json, the index (when there is more than one file) and every safetensors file at its full
    size with its header and no data yet; where each tensor's bytes go. The files are what
    `write_safetensors` writes once every tensor's bytes are in place."""
    os.makedirs(out, exist_ok=True)
    Path(out, "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    shards = shard_plan(layout, dtype)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    where: dict[str, StoredTensor] = {}
    for fn, shard in zip(names, shards, strict=True):
        path = str(Path(out, fn))
        head = safetensors_header([(name, dtype, shape) for name, shape in shard])
        offset = len(head)
        for name, shape in shard:
            where[name] = StoredTensor(path, offset, dtype, shape)
            offset += where[name].nbytes
        with open(path, "wb") as f:
            f.write(head)
            f.truncate(offset)  # the data, written in place band by band
    if len(shards) > 1:
        weight_map = {name: fn for fn, shard in zip(names, shards, strict=True) for name, _ in shard}
        total = sum(t.nbytes for t in where.values())
        Path(out, "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
        )
    return where


def _orbax_destination(out: str, overwrite: bool) -> str:
    """The path Orbax writes to (absolute when local); a destination that holds files is refused
    unless `overwrite`."""
    if is_gcs(out):
        if store_for(out).list(out, recursive=True)[0] and not overwrite:
            raise BadInput(f"`{out}` already holds files", "choose a new path or pass --overwrite")
        return out
    out = os.path.abspath(out)
    if os.path.exists(out) and os.listdir(out) and not overwrite:
        raise BadInput(f"`{out}` already exists and is not empty", "choose a new path or pass --overwrite")
    return out


def write_meta(out: str, cfg: ModelConfig, hf_config: dict | None, hf_dtype: str | None) -> None:
    """olmo_model.json of a parameter directory (the one writer of META_FILE)."""
    meta = {"model": dataclasses.asdict(cfg), "hf_config": hf_config or {}, "hf_dtype": hf_dtype}
    store_for(out).write_text(join(out, META_FILE), json.dumps(meta, indent=2) + "\n")


def save_orbax(
    out: str,
    params,
    cfg: ModelConfig,
    hf_config: dict | None = None,
    hf_dtype: str | None = None,
    overwrite: bool = False,
    chunk_bytes: int = 0,
) -> None:
    """Parameters held in memory -> a parameter directory. Orbax writes local and gs:// paths itself
    (its own commit protocol); the metadata goes through Store.
    `chunk_bytes`: the largest stored chunk of an array (0: `checkpoint.INIT_CHUNK_BYTES`)."""
    import orbax.checkpoint as ocp

    path = _orbax_destination(out, overwrite)
    import jax

    from olmo_ctl.trainer.checkpoint import INIT_CHUNK_BYTES

    # Arrays written in chunks of at most chunk_bytes (largest dimensions split first, as FSDP shards
    # them): `--init-from` on N hosts then reads about 1/N of each array per host, not all of it.
    chunk = chunk_bytes or INIT_CHUNK_BYTES
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk), params)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(path, {"params": params}, save_args={"params": save_args}, force=True)
    ckpt.wait_until_finished()
    write_meta(out, cfg, hf_config, hf_dtype)


def read_meta(orbax_dir: str) -> dict:
    store = store_for(orbax_dir)
    path = join(orbax_dir, META_FILE)
    if not store.exists(path):
        raise BadInput(
            f"`{orbax_dir}` has no {META_FILE}", "convert a model with `olmo-ctl convert hf-to-orbax`"
        )
    return read_json_object(path, "convert the model again with `olmo-ctl convert hf-to-orbax`")


def model_from_meta(meta: dict, cfg_overrides: dict | None = None) -> ModelConfig:
    """The ModelConfig an olmo_model.json records (its `model`). One written before
    `softmax_vocab_size` was recorded, by `hf-to-orbax` (its original config.json kept), gets it from
    that config.json's vocab_size."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    kw = {k: v for k, v in meta["model"].items() if k in fields}
    hf_rows = (meta.get("hf_config") or {}).get("vocab_size")
    if "softmax_vocab_size" not in kw and isinstance(hf_rows, int) and "padded_vocab_size" in kw:
        kw["softmax_vocab_size"] = softmax_rows(hf_rows, kw["padded_vocab_size"])
    if isinstance(kw.get("rope_scaling"), dict):
        kw["rope_scaling"] = RopeScalingConfig(**kw["rope_scaling"])
    return ModelConfig(**kw, **(cfg_overrides or {}))


def _is_run_checkpoint(orbax_dir: str) -> bool:
    return (
        not store_for(orbax_dir).exists(join(orbax_dir, META_FILE))
        and orbax_dir.rstrip("/").rpartition("/")[2].isdigit()
    )


def load_orbax(orbax_dir: str, cfg_overrides: dict | None = None, recipe: str | None = None):
    """(params as numpy on the host, ModelConfig, meta) from ORBAX_DIR (local or gs://): a directory
    written by `hf_to_orbax`, or a training checkpoint `<run-dir>/checkpoints/<N>` (its model comes
    from `recipe` or else `<run-dir>/run.yaml`)."""
    if _is_run_checkpoint(orbax_dir):
        cfg = _run_checkpoint_model(orbax_dir, cfg_overrides, recipe)
        params = _restore_state_params(join(orbax_dir, "state"))
        _check_shapes(params, cfg)
        return params, cfg, {"model": dataclasses.asdict(cfg), "hf_config": {}, "hf_dtype": None}
    meta = read_meta(orbax_dir)
    import orbax.checkpoint as ocp  # after the cheap checks above

    cfg = model_from_meta(meta, cfg_overrides)
    params = _to_numpy(ocp.StandardCheckpointer().restore(orbax_path(orbax_dir))["params"])
    _check_shapes(params, cfg)
    return params, cfg, meta


def _run_checkpoint_model(step_dir: str, cfg_overrides: dict | None = None, recipe: str | None = None):
    """The model of a committed training checkpoint: `recipe`'s, else its run's run.yaml's."""
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.trainer.checkpoint import open_step

    if recipe is not None:
        model = load_recipe(recipe).model
    else:
        run_yaml = join(step_dir.rstrip("/").rsplit("/", 2)[0], "run.yaml")
        store = store_for(run_yaml)
        if not store.exists(run_yaml):
            raise BadInput(
                f"`{step_dir}` has no {META_FILE} and `{run_yaml}` does not exist",
                "pass --recipe with the run's model, or a directory written by `convert hf-to-orbax`",
            )
        model = (
            RunDir(step_dir.rstrip("/").rsplit("/", 2)[0]).recipe().model
        )  # BadInput unless a run description
    cfg = dataclasses.replace(model, **(cfg_overrides or {}))
    open_step(step_dir)[0].close()  # BadInput unless it is a committed step
    return cfg


def _restore_state_params(state_dir: str):
    """Only the `params` subtree of a training checkpoint's `state` item, onto the host CPU
    (the optimizer moments, twice the size of the parameters, stay on disk)."""
    import jax
    import orbax.checkpoint as ocp

    path = orbax_path(state_dir)
    meta = ocp.StandardCheckpointer().metadata(path)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    if not isinstance(tree, dict) or "params" not in tree:
        raise BadInput(f"`{state_dir}` holds no `params`", "pass a checkpoint written by the trainer")
    cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    target = {
        k: (
            jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=cpu), v)
            if k == "params"
            else jax.tree.map(lambda _: ocp.PLACEHOLDER, v)
        )
        for k, v in tree.items()
    }
    restored = ocp.PyTreeCheckpointer().restore(
        path,
        args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
        ),
    )
    return _to_numpy(restored["params"])


# ----------------------------------------------------------------------------- Orbax arrays, a block at a time


def orbax_path(p: str) -> str:
    """The path Orbax is given: gs:// as is, a local one made absolute."""
    return p if is_gcs(p) else os.path.abspath(p)


def _epath(p: str):
    from etils import epath  # type: ignore[import-untyped]  # Orbax's path type

    return epath.Path(p)


def read_param_leaves(item_dir: str, source: str, hint: str) -> tuple[dict, dict[str, Any], bool, bool]:
    """(the `params` tree of an Orbax PyTree directory, its leaves by keystr, use_zarr3, use_ocdbt),
    from its metadata only (no tensor data); each leaf an Orbax ArrayMetadata (name, shape, dtype)."""
    import jax
    import orbax.checkpoint as ocp

    try:
        meta = ocp.PyTreeCheckpointer().metadata(item_dir)
    except (FileNotFoundError, ValueError) as e:
        raise BadInput(f"`{source}` holds no readable Orbax parameters ({e})", hint) from None
    item = getattr(meta, "item_metadata", meta)
    tree = getattr(item, "tree", item)
    if not isinstance(tree, dict) or not isinstance(tree.get("params"), dict):
        raise BadInput(f"`{source}` holds no `params`", hint)
    leaves = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree["params"])}
    if not all(hasattr(v, "shape") and hasattr(v, "name") for v in leaves.values()):
        raise BadInput(f"`{source}` holds parameters that are not arrays", hint)
    zarr3 = bool(getattr(item, "use_zarr3", False))
    return tree["params"], leaves, zarr3, ocp.type_handlers.is_ocdbt_checkpoint(item_dir)


def open_param(item_dir: str, leaf, use_zarr3: bool, use_ocdbt: bool, context=None):
    """A tensorstore future opening one stored parameter (`leaf`: its ArrayMetadata) for reading, in
    `context` (default: a new one of the kind Orbax reads such a checkpoint with)."""
    import orbax.checkpoint as ocp
    import tensorstore as ts

    handlers = ocp.type_handlers
    if context is None:
        context = handlers.get_ts_context(use_ocdbt=use_ocdbt)
    info = handlers.ParamInfo(
        name=leaf.name, parent_dir=_epath(item_dir), is_ocdbt_checkpoint=use_ocdbt, use_zarr3=use_zarr3
    )
    spec = handlers.get_json_tspec_read(info, use_ocdbt=use_ocdbt)
    return ts.open(ts.Spec(spec), open=True, context=context)


def chunk_shape(shape: tuple[int, ...], chunk) -> tuple[int, ...]:
    """A stored chunk's shape as tensorstore states it (`chunk`); an axis it does not state is whole."""
    if chunk is None:
        return shape
    return tuple(int(c) if c else dim for c, dim in zip(chunk, shape, strict=True))


class StreamedArray(abc.ABC):
    """An array not yet computed, handed to Orbax in its place: `write_streamed` has it write itself
    into the opened output array, a block at a time."""

    def __init__(self, shape: tuple[int, ...], dtype):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.size = math.prod(self.shape)
        self.ndim = len(self.shape)

    @abc.abstractmethod
    async def write_into(self, out, context) -> None:
        """Write every element into `out` (an opened tensorstore array of this shape and dtype)."""


def _streaming_handler():
    """Orbax's numpy-array handler with its write step replaced: the value it opens the array for is a
    StreamedArray, which writes itself there, one parameter at a time. The array metadata, chunking,
    file layout and commit are Orbax's own, so every reader of an Orbax checkpoint reads it (its type
    is recorded as `np.ndarray`)."""
    import orbax.checkpoint as ocp

    base = ocp.type_handlers.NumpyHandler
    if not hasattr(base, "_open_and_write"):  # the one Orbax method this relies on
        raise RuntimeError(
            "this orbax-checkpoint's NumpyHandler has no _open_and_write: streamed writes need 0.11-0.12"
        )

    class StreamingHandler(base):  # type: ignore[misc, valid-type]
        def __init__(self):
            super().__init__(deepcopy_host_arrays=False)
            self._one_at_a_time: asyncio.Lock | None = None

        async def _open_and_write(self, value, tspec, ts_context):
            import tensorstore as ts

            if self._one_at_a_time is None:
                self._one_at_a_time = asyncio.Lock()
            async with self._one_at_a_time:
                out = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
                await value.write_into(out, ts_context)

    return StreamingHandler()


def write_streamed(out: str, tree: dict) -> None:
    """An Orbax PyTree checkpoint of `tree` (StreamedArray leaves) at `out` (absolute or gs://), in the
    layout `save_orbax` writes (chunks of at most `checkpoint.INIT_CHUNK_BYTES`)."""
    import jax
    import orbax.checkpoint as ocp

    from olmo_ctl.trainer.checkpoint import INIT_CHUNK_BYTES

    registry = ocp.type_handlers.create_type_handler_registry((StreamedArray, _streaming_handler()))
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=INIT_CHUNK_BYTES), tree)
    ckpt = ocp.Checkpointer(handler)
    try:
        ckpt.save(out, args=ocp.args.PyTreeSave(tree, save_args=save_args), force=True)
    finally:
        ckpt.close()


def return_freed_blocks() -> None:
    """Have glibc give every freed block back to the system. Its default mmap threshold adapts upwards
    (to 32 MiB) as large buffers are freed, after which buffers of that size come from its per-thread
    arenas and stay resident when freed: tensorstore decodes and encodes blocks on many threads, and
    the process would keep several times the model resident. A fixed 1 MiB threshold keeps the
    resident set at the blocks in use (docs/benchmarks.md)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:  # not glibc: nothing to set
        return
    m_mmap_threshold = -3
    try:
        ctypes.CDLL(name).mallopt(m_mmap_threshold, 2**20)
    except (OSError, AttributeError):
        pass


# ----------------------------------------------------------------------------- the two commands


class _FromHf(StreamedArray):
    """One of our parameters, built from the memory-mapped HF tensors one output chunk at a time: each
    block reads only the HF rows it covers, through a mapping dropped after the block."""

    def __init__(self, route: Route, tensors: dict[str, StoredTensor], shape: tuple[int, ...], dtype):
        super().__init__(shape, dtype)
        self.route = route
        self.tensors = tensors

    def block(self, index: tuple[slice, ...]) -> np.ndarray:
        """The block `index` of this parameter, read from the HF rows it covers only."""
        index = tuple(slice(*s.indices(dim)[:2]) for s, dim in zip(index, self.shape, strict=True))
        block = np.zeros(tuple(s.stop - s.start for s in index), self.dtype)
        for k, name, rows, cols in self.route.parts(index):
            t = self.tensors[name]
            stop = min(rows.stop, t.shape[0])  # rows past the HF vocabulary stay zero
            if stop <= rows.start:
                continue
            band = t.rows(rows.start, stop)
            src = band if cols is None else band[:, cols]
            dst = block if k is None else block[k]
            if self.route.transpose:
                dst[:, : stop - rows.start] = src.T
            else:
                dst[: stop - rows.start] = src
            del band, src
        return block

    async def write_into(self, out, context) -> None:
        chunk = chunk_shape(self.shape, out.chunk_layout.write_chunk.shape)
        # HF rows outermost: consecutive blocks read the same band of rows, which the page cache keeps
        for index in blocks(self.shape, chunk, self.route.hf_row_axis):
            await out[index].write(self.block(index), can_reference_source_data_indefinitely=True)  # no copy


def hf_params_sharded(hf_dir: str, cfg: ModelConfig, shardings):
    """The parameters of the Hugging Face directory `hf_dir` (local) as jax arrays in `shardings` (a
    pytree of `param_shapes(cfg)`'s structure): each device's shard built from the memory-mapped HF
    rows it covers, so a host reads only its own devices' parts (the evaluation's sharded load)."""
    import jax

    from olmo_ctl.trainer.model import param_shapes

    _, tensors = index_hf_dir(hf_dir)
    sources = _hf_sources(tensors, cfg)
    shapes = param_shapes(cfg)
    dt = _np_dtype(cfg.param_dtype)
    out: dict = {}
    for r in routes(cfg):
        node, shape, sharding = out, shapes, shardings
        for p in r.path[:-1]:
            node, shape, sharding = node.setdefault(p, {}), shape[p], sharding[p]
        arr = _FromHf(r, sources, tuple(shape[r.path[-1]]), dt)

        def shard(index: tuple[slice, ...] | None, arr: _FromHf = arr) -> np.ndarray:
            return arr.block(index if index is not None else tuple(slice(None) for _ in arr.shape))

        node[r.path[-1]] = jax.make_array_from_callback(arr.shape, sharding[r.path[-1]], shard)
    return out


def _hf_sources(tensors: dict[str, StoredTensor], cfg: ModelConfig) -> dict[str, StoredTensor]:
    """The HF tensors `cfg` needs, by name, each checked against the shape the config gives it (tied
    checkpoints, with no lm_head.weight, read the embedding for the head)."""
    out = {}
    for name, shape in hf_layout(cfg):
        src = name if name in tensors or name != "lm_head.weight" else "model.embed_tokens.weight"
        if src not in tensors:
            raise BadInput(f"HF checkpoint has no tensor `{src}`")
        t = tensors[src]
        ok = t.shape == shape
        if name in ("model.embed_tokens.weight", "lm_head.weight"):  # any rows up to the padded vocab
            ok = len(t.shape) == 2 and t.shape[0] <= cfg.padded_vocab_size and t.shape[1] == shape[1]
        if not ok:
            raise BadInput(f"HF tensor `{src}` has shape {list(t.shape)}, the config says {list(shape)}")
        out[name] = t
    return out


def hf_to_orbax(
    hf_dir: str,
    orbax_dir: str,
    *,
    vocab_size: int | None = None,
    padded_vocab_size: int | None = None,
    param_dtype: ParamDtype = "float32",
    overwrite: bool = False,
) -> ModelConfig:
    """Stream an HF directory into a parameter directory: one parameter, and within it one stored
    chunk, at a time (peak memory: a few chunks and the HF rows they cover, never the model)."""
    read_hf_config(hf_dir)  # a directory that is not a model fails here, before any download
    dest = _orbax_destination(orbax_dir, overwrite)
    from olmo_ctl.checkpoints.surgery import quiet_orbax

    quiet_orbax()
    with local_copy(hf_dir) as src:
        hf, tensors = index_hf_dir(src)
        name = os.path.basename(hf_dir.rstrip("/")) or "olmo3-hf"
        cfg = model_config_from_hf(hf, vocab_size, padded_vocab_size, param_dtype, name=name)
        sources = _hf_sources(tensors, cfg)
        hf_dtype = str(sources["model.embed_tokens.weight"].dtype)
        from olmo_ctl.trainer.model import param_shapes

        shapes = param_shapes(cfg)
        params: dict = {}
        for r in routes(cfg):
            node, shape = params, shapes
            for p in r.path[:-1]:
                node, shape = node.setdefault(p, {}), shape[p]
            node[r.path[-1]] = _FromHf(r, sources, tuple(shape[r.path[-1]]), _np_dtype(cfg.param_dtype))
        return_freed_blocks()
        write_streamed(dest, {"params": params})
    write_meta(orbax_dir, cfg, hf, hf_dtype)
    return cfg


def _export(route: Route, stored, files: dict[str, StoredTensor]) -> None:
    """Write one of our stored parameters into the HF files, one stored chunk at a time: each chunk is
    read once and its rows put in place through a mapping of the HF rows it covers."""
    t = stored.result()
    shape = tuple(t.shape)
    for index in blocks(shape, chunk_shape(shape, t.chunk_layout.read_chunk.shape), route.hf_row_axis):
        block = t[index].read().result()
        for k, name, rows, cols in route.parts(index):
            dst_t = files[name]
            stop = min(rows.stop, dst_t.shape[0])  # the padded vocabulary is dropped
            if stop <= rows.start:
                continue
            src = block if k is None else block[k]
            src = src[:, : stop - rows.start].T if route.transpose else src[: stop - rows.start]
            band = dst_t.rows(rows.start, stop, writable=True)
            if cols is None:
                band[:] = src.astype(dst_t.dtype)
            else:
                band[:, cols] = src.astype(dst_t.dtype)
            del band
        del block


def orbax_to_hf(
    orbax_dir: str,
    hf_dir: str,
    *,
    dtype: str | None = None,
    overwrite: bool = False,
    recipe: str | None = None,
    truncate_vocab: bool = False,
) -> tuple[ModelConfig, int]:
    """Stream a parameter directory or training checkpoint into an HF directory: the files are laid
    out first (every shape is known from the model), then filled one stored chunk at a time. Returns
    the model and the vocabulary rows written (`hf_vocab_rows`)."""
    from olmo_ctl.checkpoints.surgery import quiet_orbax

    quiet_orbax()
    if _is_run_checkpoint(orbax_dir):
        cfg = _run_checkpoint_model(orbax_dir, recipe=recipe)
        meta: dict = {}
        item_dir, hint = join(orbax_dir, "state"), "pass a checkpoint written by the trainer"
    else:
        meta = read_meta(orbax_dir)
        cfg = model_from_meta(meta)
        item_dir, hint = orbax_dir, "convert the model again with `olmo-ctl convert hf-to-orbax`"
    _, leaves, zarr3, ocdbt = read_param_leaves(orbax_path(item_dir), orbax_dir, hint)
    from olmo_ctl.trainer.model import param_shapes

    for r in routes(cfg):
        want = param_shapes(cfg)
        for p in r.path:
            want = want[p]
        got = tuple(leaves[r.key].shape) if r.key in leaves else None
        if got != tuple(want):
            raise BadInput(f"tensor {r.key} has shape {got}, the config says {tuple(want)}")
    dtype = dtype or meta.get("hf_dtype") or "float32"
    rows = hf_vocab_rows(cfg, truncate_vocab)
    hf_config = hf_config_from_model(cfg, meta.get("hf_config"), dtype, rows)
    import orbax.checkpoint as ocp

    context = ocp.type_handlers.get_ts_context(use_ocdbt=ocdbt)  # one for every parameter
    with output_dir(hf_dir, overwrite) as out:
        files = create_hf_dir(out, hf_config, hf_layout(cfg, rows), _np_dtype(dtype))
        return_freed_blocks()
        for r in routes(cfg):
            _export(r, open_param(orbax_path(item_dir), leaves[r.key], zarr3, ocdbt, context), files)
    return cfg, rows
