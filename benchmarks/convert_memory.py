"""Peak memory of `convert hf-to-orbax` and `convert orbax-to-hf` against the largest tensor and the model.

Builds a synthetic Hugging Face Olmo3ForCausalLM directory (config.json + model.safetensors written
with `convert.write_safetensors`, random values in `--hf-dtype`; no torch), then runs, each in a
fresh child process, and reads each child's peak resident memory
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`, read by the child as it exits):

- floor: the imports and the metadata reads a conversion does (the floor of any such process);
- hf-to-orbax and orbax-to-hf (`olmo_ctl.checkpoints.convert`), streamed;
- with `--in-memory`, also both directions with the whole model in memory, as a reference
  (`load_hf_dir` + `hf_state_to_params` + `save_orbax`; `load_orbax` + `params_to_hf_state` +
  `write_safetensors`).

The directory is built in a child process too: Linux carries a process's peak RSS over into the
children it starts, so the parent stays small (it never imports jax).

    PYTHONPATH=. python benchmarks/convert_memory.py [--layers 8] [--d-model 1024] [--mlp 4096]
        [--vocab 16384] [--hf-dtype bfloat16] [--in-memory] [--dir DIR]

The last stdout line is one JSON object: model_mib (our float32 parameters), hf_mib (the HF files),
largest_param_mib (the largest of our parameters, a stacked MLP weight), largest_hf_tensor_mib,
floor_mib, the peak RSS of each child and its excess over the floor, and the ratios of that excess
to the largest parameter and to the model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

CHILD = """
import json, resource, sys, time
from olmo_ctl.trainer.quiet import cpu_only
cpu_only()
from olmo_ctl.checkpoints import convert
hf, orbax_dir, back, what = json.loads(sys.argv[1])
t0 = time.perf_counter()
if what == "floor":  # the same imports, and what a conversion reads before any tensor
    import orbax.checkpoint, tensorstore  # noqa: F401
    convert.index_hf_dir(hf)
    convert.read_param_leaves(orbax_dir, orbax_dir, "")
elif what == "hf-to-orbax":
    convert.hf_to_orbax(hf, orbax_dir)
elif what == "orbax-to-hf":
    convert.orbax_to_hf(orbax_dir, back)
elif what == "hf-to-orbax in memory":
    cfg_hf, state = convert.load_hf_dir(hf)
    cfg = convert.model_config_from_hf(cfg_hf)
    convert.save_orbax(orbax_dir, convert.hf_state_to_params(state, cfg), cfg, cfg_hf, "bfloat16")
elif what == "orbax-to-hf in memory":
    params, cfg, meta = convert.load_orbax(orbax_dir)
    import os
    os.makedirs(back)
    state = convert.params_to_hf_state(params, cfg, meta["hf_dtype"])
    convert.write_safetensors(os.path.join(back, "model.safetensors"), state)
print(json.dumps({"rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "seconds": time.perf_counter() - t0}))
"""


def build(directory: str, args) -> dict:
    """The synthetic HF directory; the sizes the figures are read against."""
    import numpy as np

    from olmo_ctl.checkpoints import convert

    d, f, v, L = args.d_model, args.mlp, args.vocab, args.layers
    heads = d // 64
    hf_config = {
        "architectures": ["Olmo3ForCausalLM"],
        "model_type": "olmo3",
        "vocab_size": v,
        "hidden_size": d,
        "intermediate_size": f,
        "num_hidden_layers": L,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "sliding_window": 4096,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 or i == L - 1 else "sliding_attention" for i in range(L)
        ],
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
    }
    dt = convert._np_dtype(args.hf_dtype)
    rng = np.random.default_rng(0)

    def rand(*shape):
        return rng.standard_normal(shape, np.float32).astype(dt)

    per_layer = {
        "self_attn.q_proj.weight": (d, d),
        "self_attn.k_proj.weight": (d, d),
        "self_attn.v_proj.weight": (d, d),
        "self_attn.o_proj.weight": (d, d),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "post_feedforward_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }
    tensors = {"model.embed_tokens.weight": rand(v, d)}
    for i in range(L):
        tensors.update({f"model.layers.{i}.{n}": rand(*s) for n, s in per_layer.items()})
    tensors["model.norm.weight"] = rand(d)
    tensors["lm_head.weight"] = rand(v, d)
    hf = os.path.join(directory, "hf")
    os.makedirs(hf)
    with open(os.path.join(hf, "config.json"), "w") as fh:
        json.dump(hf_config, fh)
    convert.write_safetensors(os.path.join(hf, "model.safetensors"), tensors)
    cfg = convert.model_config_from_hf(hf_config)
    params = [
        (cfg.padded_vocab_size * d, "embed"),
        (cfg.padded_vocab_size * d, "lm_head"),
        (L * f * d, "blocks/mlp/w1"),
    ]
    model = cfg.padded_vocab_size * d * 2 + d + L * (4 * d * d + 3 * f * d + 4 * d)
    return {
        "hf": hf,
        "model_bytes": 4 * model,
        "hf_bytes": os.path.getsize(os.path.join(hf, "model.safetensors")),
        "largest_param_bytes": 4 * max(n for n, _ in params),
        "largest_param": max(params)[1],
        "largest_hf_tensor_bytes": max(t.nbytes for t in tensors.values()),
    }


def child(*argv: str) -> dict:
    """Run a child Python (`-c CODE ARG` or this script with arguments); its last stdout line, as JSON."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, check=False)
    if p.returncode != 0:
        raise SystemExit(p.stdout + p.stderr)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--mlp", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--hf-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--in-memory", action="store_true", help="also convert with the whole model in memory")
    ap.add_argument("--dir", default=None, help="where to build (default: a temporary directory)")
    ap.add_argument("--build-only", action="store_true", help="(the child that builds the directory)")
    args = ap.parse_args()
    if args.build_only:
        print(json.dumps(build(args.dir, args)))
        return

    directory = args.dir or tempfile.mkdtemp(prefix="convert-bench-")
    mib = 2**20
    try:
        t0 = time.perf_counter()
        flags = [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if k not in ("dir", "build_only", "in_memory")
        ]
        built = child(__file__, "--build-only", f"--dir={directory}", *flags)
        print(
            f"built {built['hf_bytes'] / mib:.0f} MiB of HF files in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        hf, orbax, back = built["hf"], os.path.join(directory, "orbax"), os.path.join(directory, "back")
        runs = {}
        for what in ("hf-to-orbax", "floor", "orbax-to-hf"):  # the floor reads the converted directory
            runs[what] = child("-c", CHILD, json.dumps([hf, orbax, back, what]))
        if args.in_memory:
            for what in ("hf-to-orbax in memory", "orbax-to-hf in memory"):
                shutil.rmtree(orbax if what.startswith("hf") else back, ignore_errors=True)
                runs[what] = child("-c", CHILD, json.dumps([hf, orbax, back, what]))
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    floor_mib = runs["floor"]["rss_kib"] / 1024
    largest, model = built["largest_param_bytes"] / mib, built["model_bytes"] / mib
    res: dict = {
        "hf_dtype": args.hf_dtype,
        "model_mib": round(model, 1),
        "hf_mib": round(built["hf_bytes"] / mib, 1),
        "largest_param": built["largest_param"],
        "largest_param_mib": round(largest, 1),
        "largest_hf_tensor_mib": round(built["largest_hf_tensor_bytes"] / mib, 1),
        "floor_mib": round(floor_mib, 1),
        "cpus": os.cpu_count(),
    }
    for what, r in runs.items():
        if what == "floor":
            continue
        peak = r["rss_kib"] / 1024
        above = peak - floor_mib
        res[what] = {
            "peak_mib": round(peak, 1),
            "above_floor_mib": round(above, 1),
            "above_floor_per_largest_param": round(above / largest, 2),
            "above_floor_per_model": round(above / model, 3),
            "seconds": round(r["seconds"], 1),
        }
        print(
            f"{what}: peak RSS {peak:.0f} MiB, {above:.0f} MiB above the {floor_mib:.0f} MiB floor ="
            f" {above / largest:.2f}x the largest parameter ({largest:.0f} MiB), {above / model:.3f}x"
            f" the model ({model:.0f} MiB float32), {r['seconds']:.1f} s"
        )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
