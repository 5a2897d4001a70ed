"""Upload throttling (`checkpoint.upload_hosts`) against the GCS emulator: P processes joined by
jax.distributed (gloo) save one checkpoint of a sharded state to gs:// through `Checkpointer`, with
every host writing at once (K=0) and in rounds of K hosts (K=1, 2).

Prints per K: the save time (the first host's save() to the last host's commit) and the peak number of
hosts writing shards at the same moment, from each host's `wrote shards in round R (t0..t1)` line.
For K=0 the hosts run a one-round `UploadRounds` (every host in round 0, no barrier: nothing held back,
only the interval logged), so all three are measured the same way. The requests the emulator saw
(through tests/helpers/storage_proxy.py) are counted per client.

    PYTHONPATH=.:tests python benchmarks/checkpoint_throttle.py [--processes 4] [--mib 64] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

WROTE = re.compile(r"wrote shards in round (\d+) \(([\d.]+)\.\.([\d.]+)\)")


def random_block(j: int, idx, rows: int):
    """Incompressible data (Orbax compresses with zstd: a constant array would write almost nothing)."""
    import numpy as np

    start = idx[0].start or 0
    n = (idx[0].stop or rows) - start
    return np.random.default_rng([j, start]).standard_normal((n, 1024), np.float32)


def worker(coordinator: str, processes: int, host: int, directory: str, upload_hosts: int, mib: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=processes, process_id=host)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from olmo_ctl.trainer import checkpoint, multihost

    if upload_hosts == 0:  # one round of every host: logs the write interval, holds nothing back
        checkpoint.UploadRounds.for_world = staticmethod(
            lambda k: checkpoint.UploadRounds(processes, host, processes)
        )
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    rows = mib * 2**20 // 4 // 8 // 1024  # 8 arrays of float32 [rows, 1024]
    rows -= rows % processes
    state = {
        f"w{j}": jax.make_array_from_callback(
            (rows, 1024), sharding, lambda idx, j=j: random_block(j, idx, rows)
        )
        for j in range(8)
    }
    ck = checkpoint.Checkpointer(directory, keep=0, upload_hosts=upload_hosts)
    multihost.barrier(f"bench-start-{upload_hosts}", 120)
    t0 = time.time()
    ck.save(1, state, {})
    ck.wait()
    t1 = time.time()
    ck.close()
    print("RESULT " + json.dumps({"host": host, "t0": t0, "t1": t1}), flush=True)


def run_once(processes: int, directory: str, upload_hosts: int, mib: int, env: dict) -> dict:
    from olmo_ctl.ports import free_port

    coordinator = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                coordinator,
                str(processes),
                str(h),
                directory,
                str(upload_hosts),
                str(mib),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for h in range(processes)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    results = [json.loads(ln[7:]) for out in outs for ln in out.splitlines() if ln.startswith("RESULT ")]
    spans = [(float(m.group(2)), float(m.group(3))) for out in outs for m in WROTE.finditer(out)]
    assert len(spans) == processes, outs[0][-2000:]
    events = sorted([(t0, 1) for t0, _ in spans] + [(t1, -1) for _, t1 in spans])
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return {
        "save_s": max(r["t1"] for r in results) - min(r["t0"] for r in results),
        "peak_hosts": peak,
        "write_s": max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--mib", type=int, default=64, help="size of the whole checkpointed state")
    p.add_argument("--repeat", type=int, default=2)
    a = p.parse_args()
    from helpers.storage_proxy import StallingProxy

    from olmo_ctl.sandbox.gcs_emulator import create_bucket, emulator_env, fake_gcs_server

    with fake_gcs_server() as url, StallingProxy(url) as proxy:
        create_bucket(url, "bench")
        env = {**os.environ, **emulator_env(proxy.url), "JAX_PLATFORMS": "cpu"}
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        print(f"{a.processes} processes, {a.mib} MiB state, GCS emulator behind a counting proxy")
        print(
            f"{'upload_hosts':>12} {'save s (median)':>16} {'writes s':>9} {'peak hosts writing':>19} {'tensorstore requests':>21}"
        )
        for k in (0, 1, 2):
            runs, before = [], len(proxy.requests)
            for i in range(a.repeat):
                runs.append(run_once(a.processes, f"gs://bench/k{k}-{i}", k, a.mib, env))
            n_ts = sum(r.client == "tensorstore" for r in proxy.requests[before:]) // a.repeat
            save = sorted(r["save_s"] for r in runs)[len(runs) // 2]
            write = sorted(r["write_s"] for r in runs)[len(runs) // 2]
            peak = max(r["peak_hosts"] for r in runs)
            print(f"{k:>12} {save:>16.2f} {write:>9.2f} {peak:>19} {n_ts:>21}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        c, n, h, d, k, m = sys.argv[2:8]
        worker(c, int(n), int(h), d, int(k), int(m))
    else:
        main()
