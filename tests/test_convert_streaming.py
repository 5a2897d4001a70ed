"""`convert` streams: both directions write one stored chunk at a time, and their files equal those of
converting the whole model in memory (written out below as the reference) bit for bit: the same
Orbax arrays, chunks and olmo_model.json; the same safetensors bytes, shards and index. Sharded HF
inputs convert; broken ones are refused in one line, with nothing written."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmo_ctl.checkpoints import convert
from olmo_ctl.core.errors import BadInput

# vocab 300 padded to 384: the padding starts inside a stored chunk; GQA, head_dim != hidden / heads
HF_CONFIG = {
    "architectures": ["Olmo3ForCausalLM"],
    "model_type": "olmo3",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "sliding_window": 16,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "tie_word_embeddings": False,
}
SMALL_CHUNK_BYTES = 4096  # many chunks per parameter, cut along every axis


def hf_tensors(cfg: dict, dtype: str, seed: int, tied: bool = False) -> dict[str, np.ndarray]:
    """Random tensors of an HF Olmo3ForCausalLM with `cfg`'s shapes, in the safetensors order."""
    rng = np.random.default_rng(seed)
    d, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {
        "self_attn.q_proj.weight": (q, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q),
        "self_attn.q_norm.weight": (q,),
        "self_attn.k_norm.weight": (kv,),
        "post_attention_layernorm.weight": (d,),
        "post_feedforward_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }
    dt = convert._np_dtype(dtype)
    out = {"model.embed_tokens.weight": rng.standard_normal((v, d), np.float32).astype(dt)}
    for i in range(cfg["num_hidden_layers"]):
        for name, shape in shapes.items():
            out[f"model.layers.{i}.{name}"] = rng.standard_normal(shape, np.float32).astype(dt)
    out["model.norm.weight"] = rng.standard_normal(d, np.float32).astype(dt)
    if not tied:
        out["lm_head.weight"] = rng.standard_normal((v, d), np.float32).astype(dt)
    return out


def write_hf(path: Path, cfg: dict, tensors: dict[str, np.ndarray], shards: int = 1) -> str:
    """An HF directory: config.json and the tensors in `shards` files (with an index when more than one)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if shards == 1:
        convert.write_safetensors(path / "model.safetensors", tensors)
        return str(path)
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        fn = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        convert.write_safetensors(path / fn, part)
        weight_map.update(dict.fromkeys(part, fn))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(path)


# ----------------------------------------------------------------------------- the in-memory reference


def reference_hf_to_orbax(hf_dir: str, out: str, param_dtype: str = "float32") -> None:
    """The whole model in memory: every HF tensor, stacked and padded, saved in one go."""
    hf, state = convert.load_hf_dir(hf_dir)
    name = os.path.basename(hf_dir.rstrip("/"))
    cfg = convert.model_config_from_hf(hf, param_dtype=param_dtype, name=name)  # type: ignore[arg-type]
    params = convert.hf_state_to_params(state, cfg)
    convert.save_orbax(out, params, cfg, hf, str(state["model.embed_tokens.weight"].dtype))


def reference_orbax_to_hf(orbax_dir: str, out: str, dtype: str | None = None) -> None:
    """The whole model in memory: every parameter restored, every HF tensor built, then the files."""
    params, cfg, meta = convert.load_orbax(orbax_dir)
    dtype = dtype or meta.get("hf_dtype") or "float32"
    hf_config = convert.hf_config_from_model(cfg, meta.get("hf_config"), dtype)
    state = convert.params_to_hf_state(params, cfg, dtype)
    os.makedirs(out)
    Path(out, "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, t in state.items():
        if size and size + t.nbytes > convert.SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    if len(shards) == 1:
        convert.write_safetensors(Path(out, "model.safetensors"), shards[0])
        return
    weight_map = {}
    for k, shard in enumerate(shards):
        fn = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        convert.write_safetensors(Path(out, fn), shard)
        weight_map.update(dict.fromkeys(shard, fn))
    total = sum(t.nbytes for t in state.values())
    Path(out, "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )


def stored(orbax_dir: str) -> dict[str, tuple]:
    """Each stored parameter: (dtype, shape, chunk shape, the values' bytes)."""
    _, leaves, zarr3, ocdbt = convert.read_param_leaves(orbax_dir, orbax_dir, "")
    out = {}
    for key, leaf in leaves.items():
        t = convert.open_param(orbax_dir, leaf, zarr3, ocdbt).result()
        values = t.read().result()
        out[key] = (str(values.dtype), values.shape, tuple(t.chunk_layout.read_chunk.shape), values.tobytes())
    return out


def assert_same_orbax(a: str, b: str) -> None:
    sa, sb = stored(a), stored(b)
    assert sa.keys() == sb.keys() and len(sa) == 3 + len(convert.LAYER_MAP)
    for key in sa:
        assert sa[key][:3] == sb[key][:3], key
        assert sa[key][3] == sb[key][3], key
    assert Path(a, convert.META_FILE).read_text() == Path(b, convert.META_FILE).read_text()


def assert_same_files(a: str, b: str) -> None:
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert (mismatch, errors) == ([], []) and len(match) == len(names)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr("olmo_ctl.trainer.checkpoint.INIT_CHUNK_BYTES", SMALL_CHUNK_BYTES)


# ----------------------------------------------------------------------------- equal to the reference


@pytest.mark.parametrize(
    ("hf_dtype", "param_dtype", "tied"),
    [("float32", "float32", False), ("bfloat16", "float32", False), ("float32", "bfloat16", True)],
)
def test_streamed_files_equal_the_in_memory_conversion(
    tmp_path, small_chunks, monkeypatch, hf_dtype, param_dtype, tied
):
    hf = write_hf(tmp_path / "hf", HF_CONFIG, hf_tensors(HF_CONFIG, hf_dtype, seed=0, tied=tied))
    convert.hf_to_orbax(hf, str(tmp_path / "orbax"), param_dtype=param_dtype)  # type: ignore[arg-type]
    reference_hf_to_orbax(hf, str(tmp_path / "orbax-ref"), param_dtype)
    assert_same_orbax(str(tmp_path / "orbax"), str(tmp_path / "orbax-ref"))
    _, shape, chunk, _ = stored(str(tmp_path / "orbax"))["['blocks']['mlp']['w1']"]
    assert chunk[0] == shape[0] and chunk[1] < shape[1] and chunk[2] < shape[2]  # as the 32B's [64, 512, 512]

    monkeypatch.setattr(convert, "SHARD_BYTES", 64 * 2**10)  # several files and an index
    convert.orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back"))
    reference_orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back-ref"))
    assert_same_files(str(tmp_path / "back"), str(tmp_path / "back-ref"))
    n_files = len([f for f in os.listdir(tmp_path / "back") if f.endswith(".safetensors")])
    assert n_files > 3 and (tmp_path / "back" / "model.safetensors.index.json").exists()

    _, back = convert.load_hf_dir(str(tmp_path / "back"))
    _, original = convert.load_hf_dir(hf)
    if tied:  # the head was read from the embedding
        original = {**original, "lm_head.weight": original["model.embed_tokens.weight"]}
    assert back.keys() == original.keys()
    for name, t in original.items():
        if param_dtype == "float32":  # the round trip is exact
            assert back[name].dtype == t.dtype and back[name].tobytes() == t.tobytes(), name
        else:  # through bfloat16 parameters: each value rounded once
            want = t.astype(convert._np_dtype("bfloat16")).astype(np.float32)
            assert np.array_equal(back[name], want), name


def test_bf16_export_of_float32_parameters_equals_the_reference(tmp_path, small_chunks):
    hf = write_hf(tmp_path / "hf", HF_CONFIG, hf_tensors(HF_CONFIG, "float32", seed=1))
    convert.hf_to_orbax(hf, str(tmp_path / "orbax"))
    convert.orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back"), dtype="bfloat16")
    reference_orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back-ref"), "bfloat16")
    assert_same_files(str(tmp_path / "back"), str(tmp_path / "back-ref"))
    _, back = convert.load_hf_dir(str(tmp_path / "back"))
    assert {str(t.dtype) for t in back.values()} == {"bfloat16"}


def test_a_sharded_hf_directory_converts_as_one_file_does(tmp_path):
    tensors = hf_tensors(HF_CONFIG, "bfloat16", seed=2)
    one = write_hf(tmp_path / "one", HF_CONFIG, tensors)
    sharded = write_hf(tmp_path / "sharded", HF_CONFIG, tensors, shards=3)
    convert.hf_to_orbax(one, str(tmp_path / "a"))
    convert.hf_to_orbax(sharded, str(tmp_path / "b"))
    sa, sb = stored(str(tmp_path / "a")), stored(str(tmp_path / "b"))
    assert sa == sb
    convert.orbax_to_hf(str(tmp_path / "b"), str(tmp_path / "back"))
    assert filecmp.cmp(Path(one, "model.safetensors"), tmp_path / "back" / "model.safetensors", shallow=False)


# ----------------------------------------------------------------------------- refused, nothing written


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", "from olmo_ctl.cli import entry; entry()", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_a_tensor_of_the_wrong_shape_is_refused_in_one_line(tmp_path):
    tensors = hf_tensors(HF_CONFIG, "float32", seed=3)
    tensors["model.layers.2.mlp.up_proj.weight"] = tensors["model.layers.2.mlp.up_proj.weight"][:, :32]
    hf = write_hf(tmp_path / "hf", HF_CONFIG, tensors)
    r = cli("convert", "hf-to-orbax", hf, str(tmp_path / "orbax"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "model.layers.2.mlp.up_proj.weight" in r.stderr and "[160, 32]" in r.stderr
    assert not (tmp_path / "orbax").exists()


@pytest.mark.parametrize("damage", ["missing shard", "missing tensor", "truncated file"])
def test_a_broken_hf_directory_is_refused_before_anything_is_written(tmp_path, damage):
    tensors = hf_tensors(HF_CONFIG, "float32", seed=4)
    if damage == "missing tensor":
        del tensors["model.layers.3.self_attn.k_norm.weight"]
    hf = Path(write_hf(tmp_path / "hf", HF_CONFIG, tensors, shards=2))
    shard = hf / "model-00002-of-00002.safetensors"
    if damage == "missing shard":
        shard.unlink()
    elif damage == "truncated file":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 100)
    with pytest.raises(BadInput) as e:
        convert.hf_to_orbax(str(hf), str(tmp_path / "orbax"))
    line = e.value.one_line()
    assert {
        "missing shard": "model-00002-of-00002.safetensors",
        "missing tensor": "model.layers.3.self_attn.k_norm.weight",
        "truncated file": "does not hold",
    }[damage] in line
    assert not (tmp_path / "orbax").exists()


def test_an_orbax_directory_of_another_shape_is_refused_before_anything_is_written(tmp_path):
    hf = write_hf(tmp_path / "hf", HF_CONFIG, hf_tensors(HF_CONFIG, "float32", seed=5))
    convert.hf_to_orbax(hf, str(tmp_path / "orbax"))
    meta = json.loads(Path(tmp_path, "orbax", convert.META_FILE).read_text())
    meta["model"]["mlp_hidden"] = 128  # the config no longer describes the tensors
    Path(tmp_path, "orbax", convert.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(BadInput) as e:
        convert.orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back"))
    assert "['blocks']['mlp']" in e.value.one_line() and "128" in e.value.one_line()
    assert not (tmp_path / "back").exists()
