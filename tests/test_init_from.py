"""`--init-from` on the multi-host twin: only the parameters are read, each host only its own shards.

A source run on `cpu-2x2` (2 real trainer processes, gloo) writes a checkpoint with parameters and
Adam moments; new runs on `cpu-2x2` start from it and from its parameters converted (one host's write). Each host says how many bytes it read
(tensorstore's own counters); the same counters measure, in this process, what reading the whole
checkpoint onto one host costs (the old path: parameters and both moments, every array whole).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_multihost import host_codes, host_lines, start, wait_ended

from olmo_ctl.checkpoints import convert
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.trainer.checkpoint import Checkpointer, storage_bytes_read

READ = re.compile(r"initialised parameters from (\S+) \(([0-9.]+) MiB read by this host\)")


@pytest.mark.chaos
def test_init_from_reads_only_this_hosts_parameter_shards_and_starts_fresh_adam(tmp_path):
    backend, src = start(tmp_path, "cpu-2x2", 100, "--stop-at-step", "3", run="src")
    assert wait_ended(backend, src, 300) and host_codes(backend, src) == [0, 0]
    source = str(tmp_path / "src" / "checkpoints" / "3")
    backend, init = start(tmp_path, "cpu-2x2", 100, "--stop-at-step", "1", "--init-from", source, run="init")
    assert wait_ended(backend, init, 300) and host_codes(backend, init) == [0, 0]

    ck = Checkpointer(str(tmp_path / "src" / "checkpoints"), read_only=True, async_save=False)
    before = storage_bytes_read()
    whole, _ = ck.restore_host(3)  # what every host read before: the whole state, on one device
    whole_read = storage_bytes_read() - before
    param_bytes = sum(np.asarray(x).nbytes for x in _leaves(whole["params"]))
    assert whole_read > 2.5 * param_bytes  # parameters and both Adam moments

    per_host = []
    for h in (0, 1):
        lines = [m for m in map(READ.search, host_lines(init, h)) if m]
        assert len(lines) == 1 and lines[0].group(1) == source, host_lines(init, h)
        per_host.append(float(lines[0].group(2)) * 2**20)
    # Each host: about half the parameters (its two devices' shards of the 4-way FSDP split, plus
    # metadata), neither moment and not the other host's half.
    for read in per_host:
        assert 0.3 * param_bytes < read < 0.7 * param_bytes, (read, param_bytes)

    # The initialised run: the source's parameters one Adam step on, and moments from that step alone.
    r = load_recipe("smoke")
    b1, b2 = r.optimizer.betas
    after, _ = Checkpointer(str(tmp_path / "init" / "checkpoints"), read_only=True).restore_host(1)
    assert int(after["step"]) == 1 and int(after["opt"]["count"]) == 1
    for p0, p1, mu, nu in zip(
        *(_leaves(t) for t in (whole["params"], after["params"], after["opt"]["mu"], after["opt"]["nu"])),
        strict=True,
    ):
        p0, p1, mu, nu = (np.asarray(x, np.float64) for x in (p0, p1, mu, nu))
        assert np.max(np.abs(p1 - p0)) <= 1.5 * r.optimizer.lr  # one step of at most the peak LR
        big = nu > 1e-20  # fresh moments: mu = (1 - b1) g and nu = (1 - b2) g^2, so mu^2 / nu is fixed
        np.testing.assert_allclose(mu[big] ** 2 / nu[big], (1 - b1) ** 2 / (1 - b2), rtol=1e-3)
    fresh_src_mu = _leaves(whole["opt"]["mu"])
    assert any(not np.allclose(a, b) for a, b in zip(fresh_src_mu, _leaves(after["opt"]["mu"]), strict=True))

    # A converted checkpoint (written on one host) is stored in chunks, so it too is read by shards.
    converted = str(tmp_path / "converted")
    convert.save_orbax(converted, whole["params"], r.model, chunk_bytes=16 * 2**10)
    backend, conv = start(
        tmp_path, "cpu-2x2", 100, "--stop-at-step", "1", "--init-from", converted, run="conv"
    )
    assert wait_ended(backend, conv, 300) and host_codes(backend, conv) == [0, 0]
    for h in (0, 1):
        (m,) = [m for m in map(READ.search, host_lines(conv, h)) if m]
        assert 0.3 * param_bytes < float(m.group(2)) * 2**20 < 0.7 * param_bytes, m.group(0)
    again, _ = Checkpointer(str(tmp_path / "conv" / "checkpoints"), read_only=True).restore_host(1)
    for a, b in zip(_leaves(after["params"]), _leaves(again["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same start, the same step


def _leaves(tree) -> list:
    import jax

    return jax.tree.leaves(tree)
