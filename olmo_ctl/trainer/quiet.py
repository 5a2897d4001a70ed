"""JAX for commands that compute on this machine's CPU (convert, parity, surgery, preflight, eval, and
the warm-Adam starts and the soup `resume-until-done` writes for a run of ingredients, in its own
process: `cpu_only_while`): no TPU runtime noise; `cpu_devices(n)`, N host CPU devices in this process.

Where libtpu is installed (the `tpu` extra, which preflight needs), JAX's first use probes for a TPU
and libtpu logs, on a machine without one, lines that read like failures: `E0000 ... INVALID_ARGUMENT:
Error: unexpected worker hostname ...`, `Failed to find host bounds ...`; and Orbax logs absl warnings
such as `Metadata file does not exist` for checkpoints written without that file. None of it is wrong.
`cpu_only()` runs before JAX is first used: JAX computes on the CPU (`JAX_PLATFORMS=cpu`, unless the
caller chose a platform), so no TPU client starts; libtpu, still loaded where preflight asks it for a
slice's topology, is told this machine is one host (`TPU_WORKER_HOSTNAMES=localhost`,
`TPU_HOST_BOUNDS=1,1,1`: what it otherwise asks the GCE metadata server for, and logs the failure
of), which a compile for a named topology does not use; absl logs errors only. Each is set only
where the caller has not. The trainer never calls it: on a TPU VM those values come from the VM.
"""

from __future__ import annotations

import contextlib
import logging
import os

from olmo_ctl.core.errors import BadInput

# This machine as one TPU host, for libtpu's start-up (the topology comes from the compile's request).
_ONE_HOST_ENV = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}


def cpu_only() -> None:
    """JAX on the CPU, without the TPU runtime's and absl's warnings (see the module docstring)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for k, v in _ONE_HOST_ENV.items():
        os.environ.setdefault(k, v)
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging
    except ImportError:  # pragma: no cover - absl comes with jax
        return
    absl_logging.set_verbosity(absl_logging.ERROR)


@contextlib.contextmanager
def cpu_only_while():
    """`cpu_only()` for a block of a longer-lived process (a test run, a supervisor): the environment is
    restored after it (JAX and libtpu read it once, when they start)."""
    keys = ("JAX_PLATFORMS", *_ONE_HOST_ENV)
    saved = {k: os.environ.get(k) for k in keys}
    cpu_only()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cpu_devices(n: int):
    """`n` host CPU devices of this process for JAX (`cpu_only()` first): asked for before JAX's
    backend starts (`jax_num_cpu_devices`; never fewer than already asked for, and not where XLA_FLAGS
    sets the count), then the first `n`. A BadInput when the running backend has fewer."""
    cpu_only()
    import jax
    from jax._src import xla_bridge

    flags = os.environ.get("XLA_FLAGS", "")
    if not xla_bridge.backends_are_initialized() and "xla_force_host_platform_device_count" not in flags:
        jax.config.update("jax_num_cpu_devices", max(n, xla_bridge.num_cpu_devices.value))
    have = jax.devices("cpu")
    if len(have) < n:
        raise BadInput(
            f"cpu-{n}: this process has {len(have)} host CPU devices",
            f"use --device cpu-{len(have)} or fewer (JAX's CPU backend had already started)",
        )
    return have[:n]
