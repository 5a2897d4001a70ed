"""Splash attention block sizes per TPU generation, by compiling ahead of time with libtpu (no TPU needed).

For each generation's small topology (tpu7x:2x2x1, v5p:2x2x1) and each candidate block size, compiles a
forward + backward of the trainer's splash attention on the 7B attention shape (per device: 1 sequence of
8192 tokens, 32 heads of 128, bf16), once with OLMo 3's 4096-token local mask and once causal, batch
sharded one sequence per device (the trainer's shard_map). Prints one JSON line per compile: whether it
compiles, the temporaries per device, and compile time. A TPU's run time is not measured here.

    PYTHONPATH=$PWD python benchmarks/splash_blocks.py [--topology tpu7x:2x2x1] [--blocks 512,1024,2048]
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--topology", action="append", help="default: tpu7x:2x2x1 and v5p:2x2x1")
    ap.add_argument("--blocks", default="512,1024,2048", help="block_q = block_kv candidates")
    ap.add_argument("--compute", type=int, default=512, help="block_kv_compute (<= block)")
    ap.add_argument("--seq", type=int, default=8192)
    args = ap.parse_args()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from olmo_ctl.trainer import attention as A
    from olmo_ctl.trainer import sharding

    for topo_name in args.topology or ["tpu7x:2x2x1", "v5p:2x2x1"]:
        gen = topo_name.split(":")[0]
        devs = list(topologies.get_topology_desc(platform="tpu", topology_name=topo_name).devices)
        mesh = sharding.make_mesh(devs, activate=False)
        n, T, H, D = len(devs), args.seq, 32, 128
        shard = NamedSharding(mesh, PartitionSpec(sharding.AXES))
        q = jax.ShapeDtypeStruct((n, T, H, D), jnp.bfloat16, sharding=shard)
        for blk in (int(b) for b in args.blocks.split(",")):
            blocks = (blk, blk, min(args.compute, blk))
            for window in (4096, None):

                def f(q, k, v, window=window, blocks=blocks):
                    def loss(q, k, v):
                        o = A.splash_attention(q, k, v, window=window, blocks=blocks, interpret=False)
                        return jnp.sum(o.astype(jnp.float32))

                    return jax.grad(loss, (0, 1, 2))(q, k, v)

                row = {"topology": topo_name, "generation": gen, "blocks": list(blocks), "window": window}
                t0 = time.monotonic()
                try:
                    with A.compile_target("tpu", gen), jax.set_mesh(mesh):
                        compiled = jax.jit(f).lower(q, q, q).compile()
                    mem = compiled.memory_analysis()
                    row.update(compiles=True, temp_gib=round(mem.temp_size_in_bytes / 2**30, 3))
                except Exception as e:  # noqa: BLE001 - a refused block size is a result
                    row.update(compiles=False, error=str(e).strip().splitlines()[0][:200])
                row["compile_s"] = round(time.monotonic() - t0, 2)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
