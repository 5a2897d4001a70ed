"""The fault knobs of `core/faults.py` as the trainer applies them (tests only; never set in a real run):
each prints one `FAULT INJECTION` line, so a log shows that the run was tampered with."""

from __future__ import annotations

import os

from olmo_ctl.core import faults


def slow_data_s(proc: int) -> float:
    """The slow-host fault knob (core/faults.py SLOW_DATA): seconds added to this host's data loading."""
    ms = faults.slow_data_ms(os.environ, proc)
    if ms:
        print(
            f"FAULT INJECTION: data loading on host {proc} slowed by {ms:g} ms per step ({faults.SLOW_DATA.name})",
            flush=True,
        )
    return ms / 1000.0


def data_shift(loader, shift: int) -> None:
    """The resume fault knob (core/faults.py DATA_SHIFT): resume the data `shift` batches off."""
    state = dict(loader.state())
    state["batch_in_epoch"] = max(0, int(state["batch_in_epoch"]) + shift)
    state["batches_seen"] = max(0, int(state["batches_seen"]) + shift)
    loader.restore(state)
    print(f"FAULT INJECTION: data resumed {shift:+d} batch(es) off ({faults.DATA_SHIFT.name})", flush=True)


def maybe_fail(step: int, proc: int) -> None:
    """The failing-host fault knob (core/faults.py FAIL_AT_STEP): this host's data read fails with the
    OSError a storage error raises, on this host alone."""
    if faults.fails(os.environ, step, proc):
        print(
            f"FAULT INJECTION: host {proc}'s data read fails before step {step} ({faults.FAIL_AT_STEP.name})",
            flush=True,
        )
        raise OSError(f"injected data read error on host {proc} before step {step}")


def slow_start() -> None:
    """The slow start-up fault knob (core/faults.py SLOW_START): a restore that takes longer."""
    import time

    secs = faults.slow_start_s(os.environ)
    if secs:
        print(f"FAULT INJECTION: start-up slowed by {secs:g} s ({faults.SLOW_START.name})", flush=True)
        time.sleep(secs)


def double_shard(loader):
    """The loader-bug fault knob (core/faults.py DOUBLE_SHARD): this host's rows of each global batch,
    already its share, are strided again by the host index and repeated to fill the batch, so with 2+
    hosts each host reads some of its instances twice and never reads the others."""
    if not faults.double_shard(os.environ):
        return loader
    import numpy as np

    n_proc, proc, correct = loader.process_count, loader.process_index, loader.local_indices

    def local_indices(epoch: int, batch_in_epoch: int) -> np.ndarray:
        rows = correct(epoch, batch_in_epoch)  # sharded once: this host's rows
        return np.resize(rows[proc::n_proc], len(rows))  # ... and again, repeated to the batch's shape

    loader.local_indices = local_indices
    print(
        f"FAULT INJECTION: host {proc} strides its share of each batch again ({faults.DOUBLE_SHARD.name})",
        flush=True,
    )
    return loader


def kill_in_prune(step: int, index: int) -> None:
    """The prune fault knob (core/faults.py KILL_IN_PRUNE): SIGKILL in the prune at `step`, before
    its index-th deletion."""
    if faults.kill_in_prune(os.environ) == (step, index):
        import signal

        print(
            f"FAULT INJECTION: killed before checkpoint deletion {index} at step {step} ({faults.KILL_IN_PRUNE.name})",
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGKILL)
