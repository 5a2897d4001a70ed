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

`--packed`: the start-up of a packed dataset on a slice (stage 3's shape: the long-context mix's 998
files in groups of 8, seq_len 65,536), host 0 against the other hosts started at the same time.
The token files are synthetic (documents of random lengths, each ending in EOS; `--tokens-per-file`
each) in a temporary directory; the packing is stored under `--dir`. Host 0 packs every group and
stores it once; the others wait for each group's packing and read it.

    PYTHONPATH=. python benchmarks/data_startup.py --packed --processes 4 [--tokens-per-file 262144]

It prints each host's start-up seconds (dataset built, every group's packing in hand) and bytes read
(source files and stored packings); the last line is one JSON object: host0_s, host0_bytes_read,
other_s and other_bytes_read (the slowest other host, the most it read), groups, files.
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


def synthetic_token_files(directory: str, n_files: int, tokens: int, seq_len: int, eos: int, seed: int):
    """`n_files` raw uint32 token files of `tokens` tokens: documents of random lengths (a long tail
    past `seq_len`, as long-context data has), each ending in `eos`."""
    import numpy as np

    from olmo_ctl.data.files import TOKEN_BYTES, TokenFile

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_files):
        lengths = np.minimum(
            rng.lognormal(np.log(seq_len / 8), 1.2, size=4 * tokens // seq_len + 64), 4 * seq_len
        )
        ends = np.cumsum(np.maximum(lengths.astype(np.int64), 2))
        ends = ends[ends <= tokens]
        toks = rng.integers(1, 50000, size=tokens, dtype=np.uint32)
        toks[ends - 1] = eos
        name = f"part-{i:05d}.npy"
        path = os.path.join(directory, name)
        toks.astype("<u4").tofile(path)
        out.append(TokenFile(path, name, tokens * TOKEN_BYTES))
    return out


def packed_worker(ns) -> int:
    """One host's packed-dataset start-up in this process; prints a JSON line."""
    t0 = time.monotonic()
    from olmo_ctl.data.files import TOKEN_BYTES, TokenFile
    from olmo_ctl.trainer.packed import PackedDataset

    files = [
        TokenFile(
            os.path.join(ns.tokens_dir, f"part-{i:05d}.npy"),
            f"part-{i:05d}.npy",
            ns.tokens_per_file * TOKEN_BYTES,
        )
        for i in range(ns.files)
    ]
    ds = PackedDataset(
        files,
        ns.seq_len,
        eos_token_id=EOS,
        pad_token_id=EOS + 1,
        source_group_size=ns.group_size,
        cache_dir=ns.dir,
        build=ns.worker == 0 or ns.every_host_packs,
        poll_s=0.2,
    )
    startup = time.monotonic() - t0
    print(json.dumps({"startup_s": round(startup, 3), "bytes_read": ds.bytes_read, "instances": len(ds)}))
    return 0


def packed_main(ns) -> int:
    import numpy as np

    tokens_dir = tempfile.mkdtemp(prefix="packed-bench-tokens-")
    keep = ns.dir is not None
    ns.dir = ns.dir or tempfile.mkdtemp(prefix="packed-bench-")
    try:
        synthetic_token_files(tokens_dir, ns.files, ns.tokens_per_file, ns.seq_len, EOS, ns.seed)
        source = ns.files * ns.tokens_per_file * np.dtype("<u4").itemsize
        procs = []
        for p in range(ns.processes):
            extra = ["--packed", "--tokens-dir", tokens_dir]
            if ns.every_host_packs:  # each host its own cold cache, as when every host packed
                extra += ["--every-host-packs", "--dir", os.path.join(ns.dir, f"host-{p}")]
            procs.append((_spawn(ns, p, extra), time.monotonic()))
        hosts = _collect(procs)
        for p, r in enumerate(hosts):
            print(
                f"host {p}/{ns.processes}: start-up {r['startup_s']:.2f} s ({r['wall_s']:.2f} s with interpreter "
                f"start), read {r['bytes_read'] / 2**20:.1f} MiB"
            )
        others = hosts[1:] or [{"startup_s": 0.0, "bytes_read": 0}]
        print(
            json.dumps(
                {
                    "files": ns.files,
                    "groups": -(-ns.files // ns.group_size),
                    "source_bytes": source,
                    "processes": ns.processes,
                    "host0_s": hosts[0]["startup_s"],
                    "host0_bytes_read": hosts[0]["bytes_read"],
                    "other_s": max(r["startup_s"] for r in others),
                    "other_bytes_read": max(r["bytes_read"] for r in others),
                }
            )
        )
    finally:
        shutil.rmtree(tokens_dir, ignore_errors=True)
        if not keep:
            shutil.rmtree(ns.dir, ignore_errors=True)
    return 0


EOS = 100257  # dolma2's EOS id


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


def _spawn(ns, p: int, extra: list[str] | None = None) -> subprocess.Popen:
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
        "--group-size",
        str(ns.group_size),
        "--tokens-per-file",
        str(ns.tokens_per_file),
        *(extra or []),
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
    ap.add_argument(
        "--packed", action="store_true", help="a packed dataset's start-up, host 0 and the others"
    )
    ap.add_argument("--group-size", type=int, default=8, help="--packed: files per source group")
    ap.add_argument("--tokens-per-file", type=int, default=262144, help="--packed: tokens per synthetic file")
    ap.add_argument(
        "--every-host-packs",
        action="store_true",
        help="--packed: as before packing was built once: every host packs with its own cold cache",
    )
    ap.add_argument("--tokens-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.packed:
        # The long-context mix's shape (recipes/olmo3-7b-stage3.yaml) unless told otherwise.
        ns.files = ns.files if "--files" in (argv or sys.argv) else 998
        ns.seq_len = ns.seq_len if "--seq-len" in (argv or sys.argv) else 65536
        ns.processes = max(2, ns.processes)
        return packed_worker(ns) if ns.worker is not None else packed_main(ns)
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
