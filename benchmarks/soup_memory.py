"""Peak memory of `surgery soup` against the size of the largest tensor and of the whole model.

Builds `--sources` parameter directories of one OLMo-shaped model (the `convert hf-to-orbax` layout:
`convert.save_orbax`, random float32 values, one seed each; `--chunk-mib` is the stored chunk size,
as the converter's 64 MiB or a trainer's FSDP shards set it), then runs, each in a fresh child
process, (1) only the imports and metadata reads the soup does (the floor of any such process) and
(2) the soup of all sources (`olmo_ctl.checkpoints.soup.soup`), and reads each child's peak resident
memory (`resource.getrusage(RUSAGE_SELF).ru_maxrss`, read by the child as it exits). The sources are
built in a child process too: Linux carries a process's peak RSS over into the children it starts,
so the parent stays small (it never imports jax).

    PYTHONPATH=. python benchmarks/soup_memory.py [--layers 8] [--d-model 1024] [--mlp 3072]
        [--vocab 8192] [--sources 3] [--chunk-mib 64] [--dir DIR]

The last stdout line is one JSON object: model_mib (one source's parameters), largest_tensor_mib,
floor_mib and soup_mib (peak RSS of the two children), above_floor_mib, and the ratios of
above_floor_mib to the largest tensor and to the model.
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
from olmo_ctl.checkpoints import soup
sources, out, run = json.loads(sys.argv[1])
t0 = time.perf_counter()
if run:
    soup.soup(sources, out)
else:  # the floor: the same imports, and what soup reads before any tensor
    soup.check_one_model([soup.open_source(p) for p in sources])
print(json.dumps({"rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "seconds": time.perf_counter() - t0}))
"""


def build(directory: str, args) -> tuple[list[str], int, int]:
    """`args.sources` converted directories; (their paths, one model's bytes, the largest tensor's bytes)."""
    import dataclasses

    import jax
    import numpy as np

    from olmo_ctl.checkpoints import convert
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.trainer.model import param_shapes

    head_dim = 64
    cfg = dataclasses.replace(
        load_recipe("smoke").model,
        name="soup-bench",
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.d_model // head_dim,
        n_kv_heads=args.d_model // head_dim,
        head_dim=head_dim,
        mlp_hidden=args.mlp,
        vocab_size=args.vocab,
        padded_vocab_size=args.vocab,
    )
    shapes = param_shapes(cfg)
    paths = []
    for i in range(args.sources):
        rng = np.random.default_rng(i)
        params = jax.tree.map(
            lambda s, rng=rng: rng.standard_normal(s, np.float32),
            shapes,
            is_leaf=lambda x: isinstance(x, tuple),
        )
        path = os.path.join(directory, f"ingredient{i}")
        convert.save_orbax(path, params, cfg, chunk_bytes=args.chunk_mib * 2**20)
        paths.append(path)
    sizes = [int(np.prod(s)) * 4 for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))]
    return paths, sum(sizes), max(sizes)


def child(*argv: str) -> dict:
    """Run a child Python (`-c CODE ARG` or this script with arguments); its last stdout line, as JSON."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, check=False)
    if p.returncode != 0:
        raise SystemExit(p.stdout + p.stderr)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--mlp", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--sources", type=int, default=3)
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--dir", default=None, help="where to build (default: a temporary directory)")
    ap.add_argument("--build-only", action="store_true", help="(the child that builds the sources)")
    args = ap.parse_args()
    if args.build_only:
        sources, model_bytes, largest = build(args.dir, args)
        print(json.dumps({"sources": sources, "model_bytes": model_bytes, "largest": largest}))
        return

    directory = args.dir or tempfile.mkdtemp(prefix="soup-bench-")
    try:
        t0 = time.perf_counter()
        flags = [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("dir", "build_only")
        ]
        built = child(__file__, "--build-only", f"--dir={directory}", *flags)
        sources, model_bytes, largest = built["sources"], built["model_bytes"], built["largest"]
        print(f"built {len(sources)} sources in {time.perf_counter() - t0:.1f} s", flush=True)
        floor = child("-c", CHILD, json.dumps([sources, os.path.join(directory, "unused"), False]))
        soup = child("-c", CHILD, json.dumps([sources, os.path.join(directory, "soup"), True]))
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    mib = 2**20
    floor_mib = floor["rss_kib"] / 1024
    soup_mib = soup["rss_kib"] / 1024
    above = soup_mib - floor_mib
    res = {
        "sources": args.sources,
        "chunk_mib": args.chunk_mib,
        "model_mib": round(model_bytes / mib, 1),
        "largest_tensor_mib": round(largest / mib, 1),
        "floor_mib": round(floor_mib, 1),
        "soup_mib": round(soup_mib, 1),
        "above_floor_mib": round(above, 1),
        "above_floor_per_largest_tensor": round(above / (largest / mib), 2),
        "above_floor_per_model": round(above / (model_bytes / mib), 3),
        "soup_s": round(soup["seconds"], 1),
        "cpus": os.cpu_count(),
    }
    print(
        f"model {res['model_mib']} MiB per source, largest tensor {res['largest_tensor_mib']} MiB,"
        f" {args.sources} sources: peak RSS {res['soup_mib']} MiB, {res['above_floor_mib']} MiB above"
        f" the {res['floor_mib']} MiB floor = {res['above_floor_per_largest_tensor']}x the largest tensor,"
        f" {res['above_floor_per_model']}x the model ({res['soup_s']} s)"
    )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
