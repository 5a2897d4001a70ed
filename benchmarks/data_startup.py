"""Data-loader start-up of a restart: the first attempt (computes and stores the epoch order) against
a later attempt (reads only its rows of the stored order), at the 7B mix's size.

The token files are synthetic (sizes only, no tokens: the loader never opens them before the first
batch is read), so the benchmark measures the order and the loader state, not token reads. Each
attempt is a fresh Python process that builds the training loader of process p of P, restores a
position in the middle of epoch 1 and gets the instance indices of its next two batches.

    PYTHONPATH=. python benchmarks/data_startup.py --instances 724000000 [--processes 4]

The last stdout line is one JSON object: first_s, first_peak_rss_mib (the first attempt, one
process; its resident set is mostly the memory-mapped scratch file, which the kernel can write back)
and first_peak_anon_mib (its anonymous memory), next_s (the slowest later process, loader start-up
to indices in hand), next_wall_s (the same including interpreter start-up) and next_rss_mib (the
largest peak resident set of a later process).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def synthetic_files(instances: int, seq_len: int, n_files: int):
    from olmo_ctl.data.files import TOKEN_BYTES, TokenFile

    base, extra = divmod(instances, n_files)
    out = []
    for i in range(n_files):
        tokens = (base + (i < extra)) * seq_len + 17  # a remainder that the dataset drops
        out.append(TokenFile(f"synthetic://mix/part-{i:05d}.npy", f"part-{i:05d}.npy", tokens * TOKEN_BYTES))
    return out


def worker(ns) -> int:
    """One attempt's loader start-up in this process; prints a JSON line."""
    peak_anon = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], _status_kib("RssAnon"))
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    from olmo_ctl.trainer.data import BatchLoader, TokenDataset

    files = synthetic_files(ns.instances, ns.seq_len, ns.files)
    ds = TokenDataset(files, ns.seq_len)
    loader = BatchLoader(ds, ns.global_batch, ns.seed, ns.worker, ns.processes, order_dir=ns.dir)
    state = dict(loader.state(), epoch=1, batch_in_epoch=loader.batches_per_epoch // 2)
    loader.restore(state)
    rows = [loader.local_indices(1, state["batch_in_epoch"] + k) for k in range(2)]
    startup = time.monotonic() - t0
    done.set()
    sampler.join()
    peak_anon[0] = max(peak_anon[0], _status_kib("RssAnon"))
    print(
        json.dumps(
            {
                "startup_s": round(startup, 3),
                "peak_rss_mib": round(_status_kib("VmHWM") / 1024, 1),
                "peak_anon_mib": round(peak_anon[0] / 1024, 1),
                "rows": [int(r[0]) for r in rows],
                "instances": len(ds),
            }
        )
    )
    return 0


def _spawn(ns, p: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        str(p),
        "--processes",
        str(ns.processes),
        "--instances",
        str(ns.instances),
        "--seq-len",
        str(ns.seq_len),
        "--global-batch",
        str(ns.global_batch),
        "--seed",
        str(ns.seed),
        "--files",
        str(ns.files),
        "--dir",
        ns.dir,
    ]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    )
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)


def _collect(procs) -> list[dict]:
    out = []
    for pr, t0 in procs:
        stdout, _ = pr.communicate()
        if pr.returncode:
            raise SystemExit(f"worker failed with exit {pr.returncode}")
        r = json.loads(stdout.strip().splitlines()[-1])
        r["wall_s"] = time.monotonic() - t0
        out.append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=724_000_000)
    ap.add_argument("--processes", type=int, default=1, help="later-attempt processes started together")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--files", type=int, default=4096)
    ap.add_argument("--dir", default=None, help="order directory (default: a temporary one, removed after)")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.worker is not None:
        return worker(ns)
    keep = ns.dir is not None
    ns.dir = ns.dir or tempfile.mkdtemp(prefix="order-bench-")
    try:
        t0 = time.monotonic()
        first = _collect([(_spawn(ns, 0), t0)])[0]
        print(
            f"first attempt (computes and stores the order): {first['startup_s']:.2f} s, "
            f"peak RSS {first['peak_rss_mib']:.0f} MiB (anonymous {first['peak_anon_mib']:.0f} MiB)"
        )
        procs = []
        for p in range(ns.processes):
            procs.append((_spawn(ns, p), time.monotonic()))
        later = _collect(procs)
        for p, r in enumerate(later):
            print(
                f"later attempt, process {p}/{ns.processes}: {r['startup_s']:.3f} s "
                f"({r['wall_s']:.2f} s with interpreter start), peak RSS {r['peak_rss_mib']:.0f} MiB"
            )
        if later[0]["rows"] != first["rows"] and ns.processes >= 1:
            raise SystemExit(
                f"a later attempt read other rows than the first: {later[0]['rows']} != {first['rows']}"
            )
        result = {
            "instances": first["instances"],
            "processes": ns.processes,
            "first_s": first["startup_s"],
            "first_peak_rss_mib": first["peak_rss_mib"],
            "first_peak_anon_mib": first["peak_anon_mib"],
            "next_s": max(r["startup_s"] for r in later),
            "next_wall_s": round(max(r["wall_s"] for r in later), 3),
            "next_rss_mib": max(r["peak_rss_mib"] for r in later),
        }
        print(json.dumps(result))
    finally:
        if not keep:
            shutil.rmtree(ns.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
