"""Where this trainer runs: the target the attempt carries (`--plan`, rendered by a backend), else
`--device` by hand, else the TPU slice's type or the JAX platform's devices; checked against what JAX
actually sees (devices and joined processes, over every slice)."""

from __future__ import annotations

import os

from olmo_ctl.core.devices import Target
from olmo_ctl.core.errors import BadInput


def detect_target(target: Target | None) -> Target:
    """`target` (or the one this machine shows), a BadInput when JAX disagrees with it."""
    import jax

    if target is None:
        acc = os.environ.get("TPU_ACCELERATOR_TYPE")
        platform = jax.default_backend()
        if platform == "tpu" and acc:
            target = Target.parse(acc)
        elif platform == "tpu":
            raise BadInput("cannot tell the TPU slice type", "pass --device, e.g. --device v5p-256")
        else:
            target = Target.parse(f"{platform}-{jax.device_count()}")
    dev, slices = target.device, target.slices
    if dev.devices * slices != jax.device_count():
        raise BadInput(
            f"--device {target.on} has {dev.devices * slices} devices but JAX sees {jax.device_count()}",
            f"run with the matching device (e.g. cpu-{jax.device_count()})",
        )
    if dev.processes * slices != jax.process_count():
        raise BadInput(
            f"--device {target.on} runs {dev.processes * slices} processes but JAX joined {jax.process_count()}",
            "start every host of the slice with the same --device (and --slices)",
        )
    return target
