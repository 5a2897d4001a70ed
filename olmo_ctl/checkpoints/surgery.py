"""Checkpoint surgery: the stage-2 "warm-Adam" initialisation (souping is `checkpoints/soup.py`).

`warm_adam(SRC, DST_RUN_DIR)`: OLMo 3 stage 2 starts from the stage-1 final parameters *and* Adam
moments, with the step counter (and so the LR schedule, a function of the step) at 0 and a fresh
data order. The output is checkpoint `0` of DST_RUN_DIR: the trainer restores it as "0 steps
completed" and runs step 1 of the stage-2 recipe next. Adam's bias-correction count is kept with the
moments it describes (as a restored PyTorch AdamW state keeps its per-parameter `step`): a reset count
would re-amplify moments that are already warm. The skip-step window starts empty.

It reads the checkpoint without knowing the model (host arrays) and writes with the same Orbax layout
as the trainer.
"""

from __future__ import annotations

import numpy as np

from olmo_ctl.core.errors import BadInput


def quiet_orbax() -> None:
    """Orbax pointed at a GCS emulator if one is set, and its read-only notices kept off the terminal."""
    import logging

    from olmo_ctl.trainer.checkpoint import emulator_env_defaults

    emulator_env_defaults()

    logging.getLogger("absl").setLevel(logging.ERROR)  # read-only manager notices are not news here


def _fresh_window(src_skip: dict) -> dict:
    size = int(np.asarray(src_skip["losses"]).shape[0])
    return {
        "losses": np.zeros(size, np.float32),
        "grad_norms": np.zeros(size, np.float32),
        "recorded": np.zeros((), np.int32),
    }


def _host(tree):
    import jax

    return jax.tree.map(lambda x: np.asarray(x), tree)


def _empty_destination(run_dir: str):
    from olmo_ctl.trainer.checkpoint import Checkpointer

    dst = Checkpointer.for_run(run_dir, keep=0, async_save=False)
    if dst.committed_steps():
        raise BadInput(
            f"`{run_dir}` already holds checkpoints {dst.committed_steps()}",
            "write to a new run directory (surgery never overwrites a run)",
        )
    return dst


def check_committed(path: str) -> int:
    """The step of the committed training checkpoint `path` (BadInput otherwise), read on the CPU
    without JAX's or Orbax's start-up noise, from a process that goes on to other work."""
    from olmo_ctl.trainer.checkpoint import open_step
    from olmo_ctl.trainer.quiet import cpu_only_while

    with cpu_only_while():
        quiet_orbax()
        ckpt, step = open_step(path)
        ckpt.close()
    return step


def warm_adam(src_checkpoint: str, dst_run_dir: str) -> dict:
    """Write DST_RUN_DIR/checkpoints/0 from SRC's params + moments; returns a summary (on the CPU,
    whatever the caller's environment says; the environment is restored after)."""
    from olmo_ctl.trainer.quiet import cpu_only_while

    with cpu_only_while():
        return _warm_adam(src_checkpoint, dst_run_dir)


def _warm_adam(src_checkpoint: str, dst_run_dir: str) -> dict:
    from olmo_ctl.trainer.checkpoint import open_step

    quiet_orbax()
    src, step = open_step(src_checkpoint)
    state, meta = src.restore_host(step)
    state = _host(state)
    for k in ("params", "opt", "skip"):
        if k not in state:
            raise BadInput(
                f"`{src_checkpoint}` has no `{k}`: it is not a training checkpoint of this trainer"
            )
    dst = _empty_destination(dst_run_dir)
    new = {
        "step": np.zeros((), np.int32),
        "params": state["params"],
        "opt": state["opt"],
        "skip": _fresh_window(state["skip"]),
    }
    new_meta = {
        "data": None,
        "data_fingerprint": None,
        "step": 0,
        "surgery": {
            "kind": "warm-adam",
            "source": src_checkpoint,
            "source_step": step,
            "source_recipe": meta.get("recipe"),
        },
    }
    dst.save(0, new, new_meta)
    dst.close()
    return {"source_step": step, "adam_count": int(state["opt"]["count"]), "out": dst.directory + "/0"}
