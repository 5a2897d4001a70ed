"""Preflight's check of the XLA flags a slice's pods get (LIBTPU_INIT_ARGS), before anything compiles.

libtpu reads LIBTPU_INIT_ARGS once, when it starts, and stops the process on a flag it does not know
(`ERROR: Unknown command line flag 'x'`). So the check starts libtpu in a child process with exactly
the pod's LIBTPU_INIT_ARGS (`olmo_ctl.core.xla_flags.libtpu_init_args`, the same function the
JobSet renderer calls) and compiles a tiny program for the slice's topology with every flag also
given as a compile option. A flag libtpu refuses is bad input (exit 2) naming the flag and where it came from.
Flags that libtpu takes at start-up but not per compile (`No such compile option`) are reported as
start-up flags; the rest are the compile options preflight's own compile of the step uses, so the
step compiles with the pod's flags even when this process started libtpu with other ones.

    python -m olmo_ctl.preflight.flags TOPOLOGY   # LIBTPU_INIT_ARGS from the environment; prints JSON
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

from olmo_ctl.core.errors import BadInput

_UNKNOWN = re.compile(r"Unknown command line flag '([^']+)'")
_NO_OPTION = re.compile(r"No such compile option: '([^']+)'")


@functools.lru_cache(maxsize=16)
def check(libtpu_args: str, topology: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(names usable as compile options, start-up-only names) for a LIBTPU_INIT_ARGS string.

    Raises BadInput naming the first flag libtpu does not know.
    """
    if not libtpu_args.strip():
        return (), ()
    env = dict(os.environ, LIBTPU_INIT_ARGS=libtpu_args, ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu")
    p = subprocess.run(
        [sys.executable, "-m", "olmo_ctl.preflight.flags", topology],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    unknown = _UNKNOWN.search(p.stderr + p.stdout)
    if unknown:
        raise UnknownFlag(unknown.group(1))
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise RuntimeError(f"the XLA flag check for {topology} failed (exit {p.returncode}): {tail}")
    d = json.loads(lines[-1])
    if d.get("unknown"):
        raise UnknownFlag(d["unknown"])
    return tuple(d["compile_options"]), tuple(d["startup_only"])


class UnknownFlag(Exception):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def refuse(name: str, sources: dict[str, tuple[str, str]]) -> BadInput:
    """The bad-input error for an unknown flag, naming where it was set."""
    where = sources.get(name, ("", "LIBTPU_INIT_ARGS"))[1]
    return BadInput(
        f"XLA flag `--{name}` ({where}) is not known to this libtpu: it says `Unknown command line"
        f" flag '{name}'`",
        "check its spelling, or remove it from where it is set; nothing was compiled or submitted",
    )


def _child(topology: str) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    args = os.environ.get("LIBTPU_INIT_ARGS", "").split()
    opts = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
    devs = list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    mesh = Mesh(np.asarray(devs), ("x",))
    x = jax.ShapeDtypeStruct(
        (len(devs) * 8, 256), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("x"))
    )
    lowered = jax.jit(lambda a: jnp.sum(a @ a.T)).lower(x)
    startup: list[str] = []
    while True:
        try:
            lowered.compile(compiler_options=dict(opts))
            break
        except Exception as e:  # noqa: BLE001 - JaxRuntimeError's module moves between jax versions
            m = _NO_OPTION.search(str(e))
            if not m or m.group(1) not in opts:
                unknown = _UNKNOWN.search(str(e))
                if unknown:
                    print(json.dumps({"unknown": unknown.group(1)}))
                    return 0
                raise
            startup.append(m.group(1))
            del opts[m.group(1)]
    print(json.dumps({"compile_options": sorted(opts), "startup_only": startup}))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
