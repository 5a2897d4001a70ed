"""Which device this trainer runs on: `--device`, else the TPU slice's type or the JAX platform's
devices, checked against what JAX actually sees (devices and joined processes, over every slice)."""

from __future__ import annotations

import os

from olmo_ctl.core.devices import Device, get_device
from olmo_ctl.core.errors import BadInput


def detect_device(name: str | None, slices: int = 1) -> Device:
    """The catalog device for `--device name` (or the one detected), a BadInput when JAX disagrees."""
    import jax

    if name:
        dev = get_device(name)
    else:
        acc = os.environ.get("TPU_ACCELERATOR_TYPE")
        platform = jax.default_backend()
        if platform == "tpu" and acc:
            dev = get_device(acc)
        elif platform == "tpu":
            raise BadInput("cannot tell the TPU slice type", "pass --device, e.g. --device v5p-256")
        else:
            dev = get_device(f"{platform}-{jax.device_count()}")
    what = dev.name if slices == 1 else f"{slices} x {dev.name}"
    if dev.devices * slices != jax.device_count():
        raise BadInput(
            f"--device {what} has {dev.devices * slices} devices but JAX sees {jax.device_count()}",
            f"run with the matching device (e.g. cpu-{jax.device_count()})",
        )
    if dev.processes * slices != jax.process_count():
        raise BadInput(
            f"--device {what} runs {dev.processes * slices} processes but JAX joined {jax.process_count()}",
            "start every host of the slice with the same --device (and --slices)",
        )
    return dev
