"""One slice, several trainer processes: joining them, a stop that reaches every host, a lost peer.

A slice of P hosts runs P trainer processes (one per TPU VM; `cpu-PxD` runs P local processes of D
host devices each, with gloo collectives). This module holds what is specific to that:

- `join(device, runtime)`: `jax.distributed.initialize` before any other jax call. On TPU the
  coordinator, process count and id come from the TPU environment (GKE's webhook sets them); the
  local twin's launcher sets `OLMO_CTL_COORDINATOR_ADDRESS`, `OLMO_CTL_NUM_PROCESSES` and
  `OLMO_CTL_PROCESS_ID`. A TPU device on the CPU platform (JAX_PLATFORMS=cpu: a pod of `olmo-ctl
  sandbox`, each TPU VM one process) joins from the webhook's TPU_WORKER_ID and TPU_WORKER_HOSTNAMES
  and the sandbox's `OLMO_CTL_COORDINATOR_ADDRESS`, with gloo collectives. On GPU nodes (one process
  per node) they come from the JobSet's environment, XPK's names for GPU node pools: NNODES, NODE_RANK,
  JAX_COORDINATOR_ADDRESS and JAX_COORDINATOR_PORT (`gpu_nodes_params`). Any failure to join (a
  coordinator that never answers, a peer that never arrives within `runtime.init_timeout_s`) raises
  `JoinFailed`, exit 3: the attempt is restarted, it is not a user error.
- Multislice (`--slices N`): one world of N x the slice's hosts. GKE's webhook adds
  MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID and MEGASCALE_COORDINATOR_ADDRESS (slice 0's worker 0) to
  every pod; JAX numbers the processes slice by slice (process = slice id x hosts per slice + worker
  id), the emulated slice the same way. A world that is not N x the slice's hosts is `JoinFailed`.
- The first step together (`first_call_together`): on a gloo world the first step is compiled ahead
  and run after a coordination-service barrier, as gloo gives a late peer only 30 s.
- A lost peer: the distributed runtime's heartbeat (`runtime.peer_timeout_s`) notices a host that
  died (SIGKILL, a lost VM); the runtime then aborts every other process (SIGABRT). A C-level SIGABRT
  handler turns that abort into exit 3 (restart) with one line saying why, instead of 134.
- A stop that reaches everyone: SIGTERM to any one host (GKE maintenance of one VM, `olmo-ctl
  resize`) is caught by JAX's preemption service, which makes every host agree on the same step
  (`multihost_utils.reached_preemption_sync_point`); all hosts finish it, write one checkpoint and exit
  143. Measured on the 2 x 2 CPU twin: every host stops at the same step about 1.5 s after the signal,
  and the check costs nothing between notices (no collective per step).
- Log lines: with `OLMO_CTL_LOG_PREFIX` set (`host 1: `), everything the process writes to its stdout
  and stderr (Python and C++ alike) reaches the shared attempt log one line at a time, prefixed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Any, Required, TypedDict

from olmo_ctl.core.contracts import (
    COORDINATOR_ENV,
    EXIT_RESTART,
    GPU_COORDINATOR_ADDRESS_ENV,
    GPU_COORDINATOR_PORT_ENV,
    GPU_NODE_RANK_ENV,
    GPU_NODES_ENV,
    LOG_PREFIX_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
)
from olmo_ctl.core.errors import OlmoCtlError


class JoinFailed(OlmoCtlError):
    """The hosts of the slice could not be joined: infrastructure, so the attempt is restarted (exit 3)."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message, hint, exit_code=EXIT_RESTART)


class _State(TypedDict, total=False):
    joined: Required[bool]
    out_fd: Required[int | None]  # the attempt log's fd once `prefix_output` took fd 1 and 2
    joining: str | None  # what `join` is doing, for the abort handler's line
    gloo: bool
    init_timeout_s: float
    thread: threading.Thread | None  # `prefix_output`'s copier


_state: _State = {"joined": False, "out_fd": None}


def joined() -> bool:
    return _state["joined"]


def join(device, runtime, committed: int = 0, slices: int = 1) -> bool:
    """Join the processes of `slices` x `device` when there is more than one; True when joined.
    `committed` (the run's latest committed step) primes the agreed stop at once (`prime_stop`)."""
    processes = device.processes * slices
    what = device.name if slices == 1 else f"{slices} x {device.name}"
    if processes <= 1:
        return False
    import jax

    kwargs: dict[str, Any] = {
        "initialization_timeout": int(runtime.init_timeout_s),
        "heartbeat_timeout_seconds": int(runtime.peer_timeout_s),
    }
    gloo = device.platform == "cpu" or ((device.is_tpu or device.is_gpu_nodes) and emulated_slice())
    if device.platform == "cpu":
        missing = [k for k in (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV) if not os.environ.get(k)]
        if missing:
            raise JoinFailed(
                f"--device {device.name} runs {device.processes} processes but {', '.join(missing)} "
                "is not set",
                "start it through `olmo-ctl submit --backend local`, which sets them",
            )
        n = int(os.environ[NUM_PROCESSES_ENV])
        if n != device.processes:
            raise JoinFailed(
                f"--device {device.name} has {device.processes} processes but {NUM_PROCESSES_ENV}={n}"
            )
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        kwargs.update(
            coordinator_address=os.environ[COORDINATOR_ENV],
            num_processes=n,
            process_id=int(os.environ[PROCESS_ID_ENV]),
        )
    elif device.is_tpu and emulated_slice():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        kwargs.update(_emulated_slice_params(device, slices))
    elif device.is_gpu_nodes:
        if gloo:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        kwargs.update(gpu_nodes_params(device))
    _exit_3_on_abort()
    _state["joining"] = f"could not join the {processes} hosts of {what}"
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as e:  # noqa: BLE001 - the runtime raises many types; all mean "could not join"
        raise JoinFailed(
            f"could not join the {processes} hosts of {what} "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
            "a peer or the coordinator did not answer; the attempt will be restarted",
        ) from None
    finally:
        _state["joining"] = None
    if jax.process_count() != processes:
        raise JoinFailed(
            f"joined {jax.process_count()} processes, but {what} has {processes}",
            "every pod of the attempt must run with the same --device and --slices"
            if slices > 1
            else "every host of the slice must run with the same --device",
        )
    _state["joined"] = True
    _state["gloo"] = gloo
    _state["init_timeout_s"] = float(runtime.init_timeout_s)
    prime_stop(committed)
    print(
        f"joined {jax.process_count()} hosts as process {jax.process_index()} "
        f"({jax.local_device_count()} local devices, {jax.device_count()} in all)",
        flush=True,
    )
    return True


def emulated_slice() -> bool:
    """A TPU slice's VM emulated by a CPU process (`olmo-ctl sandbox` runs pods so): JAX_PLATFORMS=cpu."""
    return os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"


def gpu_nodes_params(device, environ: dict[str, str] | None = None) -> dict:
    """`jax.distributed.initialize`'s coordinator, process count and process id on GPU nodes, from what
    the JobSet sets in every pod (XPK's get_gpu_env, src/xpk/core/docker_resources.py; as MaxText's
    initialize_jax_for_gpu reads them): NNODES, NODE_RANK (the pod's completion index),
    JAX_COORDINATOR_ADDRESS (pod 0's DNS name) and JAX_COORDINATOR_PORT. JAX detects none of these by
    itself; a missing or inconsistent one is `JoinFailed` naming it."""
    env = os.environ if environ is None else environ
    wanted = (GPU_NODES_ENV, GPU_NODE_RANK_ENV, GPU_COORDINATOR_ADDRESS_ENV, GPU_COORDINATOR_PORT_ENV)
    missing = [k for k in wanted if not env.get(k, "").strip()]
    if missing:
        raise JoinFailed(
            f"--device {device.name} runs on {device.vms} GPU nodes but {', '.join(missing)} is not set",
            "run it as a pod of the JobSet `olmo-ctl submit --backend gke` renders, which sets them",
        )
    numbers = {k: env[k].strip() for k in (GPU_NODES_ENV, GPU_NODE_RANK_ENV, GPU_COORDINATOR_PORT_ENV)}
    bad = [f"{k}={v!r}" for k, v in numbers.items() if not v.isdigit()]
    if bad:
        raise JoinFailed(f"{', '.join(bad)} is not a number", "the JobSet sets them; do not override them")
    nodes, rank = int(numbers[GPU_NODES_ENV]), int(numbers[GPU_NODE_RANK_ENV])
    if nodes != device.vms:
        raise JoinFailed(f"--device {device.name} is {device.vms} nodes but {GPU_NODES_ENV}={nodes}")
    if rank >= nodes:
        raise JoinFailed(f"{GPU_NODE_RANK_ENV}={rank} is outside the {nodes} nodes of {device.name}")
    return {
        "coordinator_address": f"{env[GPU_COORDINATOR_ADDRESS_ENV].strip()}:{numbers[GPU_COORDINATOR_PORT_ENV]}",
        "num_processes": nodes,
        "process_id": rank,
    }


def _emulated_slice_params(device, slices: int = 1) -> dict:
    """Join an emulated slice explicitly, from what GKE's TPU webhook injects (TPU_WORKER_ID,
    TPU_WORKER_HOSTNAMES, and for several slices MEGASCALE_NUM_SLICES / MEGASCALE_SLICE_ID) and the
    coordinator the sandbox serves for the JobSet, one for all its slices (OLMO_CTL_COORDINATOR_ADDRESS;
    MEGASCALE_COORDINATOR_ADDRESS names a pod's DNS name, which only a cluster resolves). Processes are
    numbered as JAX numbers them on GKE (jax/_src/clusters/cloud_tpu_cluster.py): slice id x hosts per
    slice + worker id. On a real TPU, JAX detects all of it by itself and this is never used."""
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    multi = slices > 1 or os.environ.get("MEGASCALE_NUM_SLICES", "1").strip() not in ("", "1")
    wanted = [
        ("TPU_WORKER_ID", os.environ.get("TPU_WORKER_ID", "").isdigit()),
        ("TPU_WORKER_HOSTNAMES", bool(hosts)),
        (COORDINATOR_ENV, bool(os.environ.get(COORDINATOR_ENV))),
    ]
    if multi:
        wanted += [
            ("MEGASCALE_NUM_SLICES", os.environ.get("MEGASCALE_NUM_SLICES", "").strip().isdigit()),
            ("MEGASCALE_SLICE_ID", os.environ.get("MEGASCALE_SLICE_ID", "").strip().isdigit()),
        ]
    missing = [k for k, ok in wanted if not ok]
    if missing:
        raise JoinFailed(
            f"--device {device.name}{f' --slices {slices}' if slices > 1 else ''} on the CPU platform is "
            f"an emulated slice, but {', '.join(missing)} is not set",
            "run it as a pod of `olmo-ctl sandbox`, which sets them",
        )
    n_slices = int(os.environ["MEGASCALE_NUM_SLICES"]) if multi else 1
    slice_id = int(os.environ["MEGASCALE_SLICE_ID"]) if multi else 0
    what = device.name if slices == 1 else f"{slices} x {device.name}"
    if n_slices != slices:
        raise JoinFailed(
            f"--device {what} is {slices} slice{'s' if slices > 1 else ''} but MEGASCALE_NUM_SLICES={n_slices}",
            "start every pod of the attempt with --slices equal to its JobSet's slice count",
        )
    if len(hosts) != device.processes:
        raise JoinFailed(
            f"--device {device.name} has {device.processes} hosts but TPU_WORKER_HOSTNAMES names "
            f"{len(hosts)}" + (f" in each of {slices} slices" if slices > 1 else "")
        )
    worker = int(os.environ["TPU_WORKER_ID"])
    if worker >= len(hosts) or slice_id >= slices:
        raise JoinFailed(
            f"TPU_WORKER_ID={worker}"
            + (f", MEGASCALE_SLICE_ID={slice_id}" if multi else "")
            + f" is outside {what} ({len(hosts)} hosts"
            + (f" x {slices} slices)" if multi else ")")
        )
    return {
        "coordinator_address": os.environ[COORDINATOR_ENV],
        "num_processes": len(hosts) * slices,
        "process_id": slice_id * len(hosts) + worker,
    }


def first_call_together(step):
    """`step` (a jitted function), whose first call on a world joined by gloo (the CPU twin, the
    sandbox's emulated slices) compiles ahead, waits for every host at a barrier of the coordination
    service (within runtime.init_timeout_s), and only then runs; later calls run the same executable.

    Gloo sets up each group of hosts at its first collective and gives a peer 30 s to arrive, fixed in
    jaxlib. Hosts reach their first step that far apart when the set-up or the compile of one takes
    longer (host 0 writes the epoch order the others wait for; 8 trainer processes compiling on 2
    cores): 2 x v5p-16 in the sandbox then failed its first step with exit 3, attempt after attempt.
    On a TPU nothing changes (its collectives wait as long as the runtime's own deadlines)."""
    if not (joined() and _state.get("gloo")):
        return step
    compiled: list = []

    def call(*args):
        if not compiled:
            exe = step.lower(*args).compile()
            barrier("first-step", _state.get("init_timeout_s", 300.0))
            compiled.append(exe)
        return compiled[0](*args)

    return call


def barrier(name: str, timeout_s: float) -> None:
    """Wait until every host of the world reaches the barrier `name` (once per name and process): the
    distributed runtime's coordination service, no collective (so no gloo group) involved."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return
    client.wait_at_barrier(f"olmo_ctl/{name}", int(timeout_s * 1000))


# ---------------------------------------------------------------- a lost peer: SIGABRT -> exit 3

_ABORT_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)
_keep: list = []  # the C callback must outlive this module's functions


def _on_abort(signum: int) -> None:
    fd = _state["out_fd"] if _state["out_fd"] is not None else 2
    prefix = os.environ.get(LOG_PREFIX_ENV, "").encode()
    why = (
        f"{_state['joining']} (the distributed runtime gave up: a peer or the coordinator did not answer)"
        if _state.get("joining")
        else "the distributed runtime aborted (a peer host was lost or the coordination service failed)"
    )
    try:
        os.write(fd, prefix + f"error: {why}; exiting 3 so that the attempt is restarted\n".encode())
    finally:
        os._exit(EXIT_RESTART)


def _exit_3_on_abort() -> None:
    """The runtime aborts every surviving process when a peer misses its heartbeats; abort() raises
    SIGABRT in the runtime's own thread, where a Python-level handler would never run. A C-level
    handler (a ctypes callback) runs there and exits 3."""
    if _keep:
        return
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, _ABORT_HANDLER]
    cb = _ABORT_HANDLER(_on_abort)
    _keep.append(cb)
    libc.signal(signal.SIGABRT, cb)


def exit_alone(code: int) -> None:
    """End a process of several hosts that fails on its own (exit 1, 2 or 3) now, with its output
    drained: Python's normal exit would run `jax.distributed.shutdown` (a barrier with the other hosts,
    which wait inside the next step's collectives for this one) and join the loader's and Orbax's
    threads; meanwhile this process keeps heartbeating, so the others never see it lost and the slice
    hangs until the watchdogs fire. Exiting at once lets them notice within runtime.peer_timeout_s.
    A checkpoint still being written is not lost: an uncommitted step is never read."""
    if not joined() or code in (0, 143):
        return
    drain_output()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# ---------------------------------------------------------------- a stop agreed by every host


def prime_stop(committed: int) -> None:
    """Right after the join, on every host: tell the preemption service where this attempt starts.

    The runtime agrees on a stop step as one past the last step any host reported; before the first
    report that is step 1, which a resumed attempt (starting after step N) never reaches: a SIGTERM
    during restore, the data set-up or the compile was lost, and the hosts trained on until SIGKILL.
    Reporting N - 1 here makes a notice during start-up agree on step N, which the loop asks about
    before its first step (`StopHook.pre_step`): every host stops there with nothing new to save."""
    if committed >= 1:
        stop_agreed(committed - 1)


def stop_agreed(step: int) -> bool:
    """True on every host at the same step once any host got SIGTERM (JAX's preemption service)."""
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(step))


def allgather_floats(values: list[float]) -> list[list[float]]:
    """Every host's `values` (same length on every host), on every host; a collective."""
    import numpy as np
    from jax.experimental import multihost_utils

    got = multihost_utils.process_allgather(np.asarray(values, np.float64))
    return [list(map(float, row)) for row in np.asarray(got).reshape(-1, len(values))]


# ---------------------------------------------------------------- one prefixed log


def prefix_output(prefix: str) -> None:
    """Route fd 1 and 2 through a pipe; a thread copies each line to the original stdout, prefixed.

    The original stdout is the attempt's log (opened for append by the launcher), so the lines of P
    processes interleave whole. C++ output (XLA, gloo, the runtime) is prefixed too.
    """
    if not prefix or _state["out_fd"] is not None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    out = os.dup(1)
    r, w = os.pipe()
    os.dup2(w, 1)
    os.dup2(w, 2)
    os.close(w)
    _state["out_fd"] = out
    pre = prefix.encode()

    def copy() -> None:
        buf = b""
        with os.fdopen(r, "rb", buffering=0) as src:
            while True:
                chunk = src.read(65536)
                if not chunk:
                    break
                buf += chunk
                *lines, buf = buf.split(b"\n")
                if lines:
                    os.write(out, b"".join(pre + ln + b"\n" for ln in lines))
        if buf:
            os.write(out, pre + buf + b"\n")

    t = threading.Thread(target=copy, name="log-prefix", daemon=True)
    t.start()
    _state["thread"] = t


def drain_output(timeout: float = 5.0) -> None:
    """Close our ends of the pipe and wait for the copier: call before the process exits."""
    t, out = _state.get("thread"), _state["out_fd"]
    if t is None:
        return
    assert out is not None  # set before the copier started
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    for fd in (1, 2):
        try:
            os.dup2(out, fd)  # later writes go straight to the log; the pipe's last writer closes
        except OSError:
            pass
    t.join(timeout)
    _state["thread"] = None
