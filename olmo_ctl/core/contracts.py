"""What the trainer writes and everyone else reads (docs/CONTRACTS.md), in one place.

- its log lines: `step N/M loss X ...` per logged step and `committed step N` after a checkpoint
  commits (one formatter and one parser each);
- its event file names: `events.out.tfevents.<start, 10 digits>.<host>.a<attempt>.s<segment>`;
- its metric tags (`TRAINER_TAGS`, the training objective's loss `primary_loss_tag`, the hosts' and
  the evaluators' tags: `eval/lm/<label>/CE loss`, OLMo-core's names), named here only;
- its exit codes, and the attempt state each one means (`exit_state`), which every backend reports.

Pure and light: the trainer, the backends, the supervisor and the monitor all import it.
"""

from __future__ import annotations

import enum
import re
from typing import TYPE_CHECKING, NamedTuple

from olmo_ctl.core.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_RUN_FAILED, EXIT_UNREACHABLE, BadInput

if TYPE_CHECKING:
    from olmo_ctl.core.batching import Plan
    from olmo_ctl.core.devices import Target

TRAINER_MODULE = "olmo_ctl.trainer"


def trainer_argv(python: str, run_dir: str, target: Target, plan: Plan, attempt: int) -> list[str]:
    """The trainer's command line as every backend renders it (docs/CONTRACTS.md, "Trainer entry
    point"): `--device`/`--slices` say the target for people, `--plan` carries it and the attempt's plan
    (`core.batching.launch_record`); the trainer reads the recipe from `<run_dir>/run.yaml`."""
    from olmo_ctl.core.batching import launch_record

    argv = [
        python,
        "-m",
        TRAINER_MODULE,
        "--run-dir",
        run_dir,
        "--device",
        target.name,
        "--attempt",
        str(attempt),
    ]
    argv += ["--slices", str(target.slices)] if target.slices > 1 else []
    return argv + ["--plan", launch_record(target, plan)]


class State(str, enum.Enum):
    """The normalised state of an attempt (`monitor -o json` reports its value)."""

    QUEUED = "queued"
    ADMITTED = "admitted"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FAILED_INFRA = "failed-infra"
    FAILED_USER = "failed-user"
    SUCCEEDED = "succeeded"
    MISSING = "missing"

    @property
    def live(self) -> bool:
        """The attempt may still make progress (a supervisor must not submit another)."""
        return self in (State.QUEUED, State.ADMITTED, State.RUNNING)

    @property
    def terminal(self) -> bool:
        return not self.live


# ---------------------------------------------------------------- exit codes

# The local multi-host twin (cpu-PxD): set per host by the local backend, read by the trainer.
COORDINATOR_ENV = "OLMO_CTL_COORDINATOR_ADDRESS"
NUM_PROCESSES_ENV = "OLMO_CTL_NUM_PROCESSES"
PROCESS_ID_ENV = "OLMO_CTL_PROCESS_ID"
LOG_PREFIX_ENV = "OLMO_CTL_LOG_PREFIX"  # `host <h>: ` before each of the host's lines in the attempt log
# GPU nodes on GKE: XPK's names for the JAX coordinator environment of GPU node pools
# (src/xpk/core/docker_resources.py get_gpu_env), set in every pod by the JobSet
# (`backends/jobset.py` gpu_nodes_env) and read by the trainer's join (`trainer/multihost.py`).
GPU_NODES_ENV = "NNODES"  # the node count: one trainer process per node
GPU_NODE_RANK_ENV = "NODE_RANK"  # this pod's node, its Job completion index
GPU_COORDINATOR_ADDRESS_ENV = "JAX_COORDINATOR_ADDRESS"  # pod 0's DNS name
GPU_COORDINATOR_PORT_ENV = "JAX_COORDINATOR_PORT"
GPU_COORDINATOR_PORT = 6002  # XPK's, also the container port it opens
# Seconds a trainer has from SIGTERM to its kill: the pod's grace period, or on spot VMs what GKE's
# graceful node shutdown leaves the pods (30 s of notice, of which the last 15 s are the system
# pods': SPOT_STOP_BUDGET_S). A stop whose checkpoint write would not finish in it writes none.
STOP_BUDGET_ENV = "OLMO_CTL_STOP_BUDGET_S"
SPOT_STOP_BUDGET_S = 15
# The `exited` record of such a stop carries `stop_unsaved` ({step, write_s, left_s, budget_s,
# committed_step}); `stop_unsaved_note` words it for its reason, monitor's timeline and the supervisor.


def stop_unsaved_note(info: dict | None) -> str:
    """`step 57 not checkpointed (a write takes 20.1 s, the stop left 14.2 s): resumes from 50`, or ""."""
    if not info:
        return ""
    return (
        f"step {info.get('step')} not checkpointed (a write takes {info.get('write_s')} s, the stop left"
        f" {info.get('left_s')} s): resumes from {info.get('committed_step') or 0}"
    )


# The trainer's codes are the command table's (core/errors.py), named for what the trainer means by them.
EXIT_DONE = EXIT_OK  # the final step (or --stop-at-step) reached, its checkpoint committed
EXIT_FAILED = EXIT_RUN_FAILED  # a deterministic error in training (a bug, a NaN loss)
# EXIT_BAD_INPUT (2): bad recipe, data fingerprint mismatch
EXIT_RESTART = (
    EXIT_UNREACHABLE  # storage, network or a peer lost: restartable, like an infrastructure failure
)
EXIT_SIGTERM = 143  # stopped by SIGTERM after checkpointing its last completed step
EXIT_SIGKILL = 137
USER_EXIT_CODES = frozenset({EXIT_FAILED, EXIT_BAD_INPUT})  # the only user failures: never retried blindly


# The journal record a trainer (process 0) of an olmo-ctl attempt writes as it exits, with its exit code
# and the committed step: an attempt's end is recorded even when no supervisor watches it (detached,
# `submit`), in the same words (`exit_state`) a supervisor's record uses.
EXITED_EVENT = "exited"


def exit_state(code: int | None) -> tuple[State, str]:
    """The state an attempt is in when its trainer exited with `code` (None: still running), and why.

    0 SUCCEEDED; 143/137 (SIGTERM/SIGKILL, or the negative codes of a killed child) PREEMPTED;
    1/2 FAILED_USER; anything else FAILED_INFRA."""
    if code is None:
        return State.RUNNING, "running"
    if code == EXIT_DONE:
        return State.SUCCEEDED, "exit 0"
    if code in (EXIT_SIGTERM, -15):
        return State.PREEMPTED, f"exit {code} (SIGTERM)"
    if code in (EXIT_SIGKILL, -9):
        return State.PREEMPTED, f"exit {code} (SIGKILL)"
    if code in USER_EXIT_CODES:
        return State.FAILED_USER, f"exit {code}"
    if code < 0:  # a child killed by another signal
        import signal

        try:
            return State.FAILED_INFRA, f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return State.FAILED_INFRA, f"exit {code}"


# ---------------------------------------------------------------- log lines

_STEP_LINE = re.compile(r"(?:^|\s)step (\d+)/(\d+) loss (\S+)")
_COMMITTED_LINE = re.compile(r"committed step (\d+)")


def step_line(
    step: int,
    final: int,
    loss: float,
    grad_norm: float,
    lr: float,
    tokens_per_s: float,
    tokens_per_s_per_device: float,
    mfu: float,
    step_time_s: float,
    skipped: bool = False,
) -> str:
    """The line the trainer prints for a logged step. The throughput figures are its logging window's
    (the steps of one metrics fetch, timed from the previous fetch): tokens/s of the run (every device
    of every slice) and per device, MFU (0..1, printed in %), seconds per step (printed in ms)."""
    return (
        f"step {step}/{final} loss {loss:.4f} grad_norm {grad_norm:.4f} lr {lr:.3e}"
        f" tokens/s {tokens_per_s:.0f} ({tokens_per_s_per_device:.0f}/device) mfu {100 * mfu:.2f}%"
        f" step_time {1000 * step_time_s:.1f} ms" + (" skipped" if skipped else "")
    )


def committed_line(step: int) -> str:
    """The line the trainer prints once checkpoint `step` is committed (its last line on exit 0 and 143)."""
    return f"committed step {step}"


class StepLine(NamedTuple):
    step: int
    final: int
    loss: str  # as printed
    tokens_per_s: float | None = None  # the window's, as printed (None: a line without them)
    tokens_per_s_per_device: float | None = None
    mfu: float | None = None  # fraction 0..1
    step_time_s: float | None = None


_STEP_FIGURES = re.compile(r" tokens/s (\S+) \((\S+)/device\) mfu (\S+)% step_time (\S+) ms")


def parse_step_line(line: str) -> StepLine | None:
    m = _STEP_LINE.search(line)
    if not m:
        return None
    f = _STEP_FIGURES.search(line, m.end())
    if not f:
        return StepLine(int(m.group(1)), int(m.group(2)), m.group(3))
    tps, per_dev, mfu, ms = (float(x) for x in f.groups())
    return StepLine(int(m.group(1)), int(m.group(2)), m.group(3), tps, per_dev, mfu / 100, ms / 1000)


def final_committed(committed_step: int | None, final_step: int | None) -> bool:
    """The run's final step is committed. An attempt that is over then counts as succeeded, whatever its
    exit (a SIGKILL after the final commit, a trainer that restored the final checkpoint and had nothing
    to do): the supervisor's first rule (supervise/policy.py) and the monitor's."""
    return committed_step is not None and final_step is not None and committed_step >= final_step


_HOST_PREFIX = re.compile(r"^host \d+: ")  # a multi-host attempt's log (LOG_PREFIX_ENV)


def parse_committed_line(line: str) -> int | None:
    m = _COMMITTED_LINE.fullmatch(_HOST_PREFIX.sub("", line.strip()))
    return int(m.group(1)) if m else None


class LogProgress(NamedTuple):
    """What a trainer's log tail says: the newest step line, and the committed step if the log ends
    with one (None for each where the tail holds none)."""

    step: int | None = None
    final: int | None = None
    loss: str | None = None
    committed: int | None = None
    max_step: int | None = None  # the largest step logged in the tail
    slow_hosts: tuple[str, ...] = ()  # `host <h>: <part> ...` of each slow-host line in the tail


def log_progress(lines: list[str]) -> LogProgress:
    from olmo_ctl.core.stragglers import parse_slow_host_line

    steps = [s for s in map(parse_step_line, lines) if s is not None]
    last = next((ln for ln in reversed(lines) if ln.strip()), "")
    newest = steps[-1] if steps else None
    slow = tuple(dict.fromkeys(s.message() for s in map(parse_slow_host_line, lines) if s is not None))
    return LogProgress(
        newest.step if newest else None,
        newest.final if newest else None,
        newest.loss if newest else None,
        parse_committed_line(last),
        max(s.step for s in steps) if steps else None,
        slow,
    )


# ---------------------------------------------------------------- metric tags

# The scalars the trainer writes (OLMo-core's names, plus the TPU case study's parity tags; the
# training loss's is `primary_loss_tag()`), named once: the trainer writes them by these names and
# `monitor`, `compare`, `runs`, goodput, memorization, the smoke checks and the supervisor read them by
# the same names (tests/test_contracts.py checks no module spells one).
CE_LOSS_TAG = "train/CE loss"
PPL_TAG = "train/PPL"
Z_LOSS_TAG = "train/Z loss"
GRAD_NORM_TAG = "optim/total grad norm"
LR_TAG = "optim/LR (group 0)"
LR_GROUP1_TAG = "optim/LR (group 1)"
STEP_SKIPPED_TAG = "optim/step skipped"
STEP_SKIPPED_PARITY_TAG = "optim/step_skipped"
TOTAL_TOKENS_TAG = "throughput/total tokens"
TOTAL_TOKENS_PARITY_TAG = "perf/total_tokens"
TPS_TAG = "throughput/device/TPS"
TPS_AVG_TAG = "throughput/device/TPS (actual avg)"
TFLOPS_TAG = "throughput/device/TFLOPS"
MFU_TAG = "throughput/device/MFU"
MFU_AVG_TAG = "throughput/device/MFU (actual avg)"
DATA_WAIT_TAG = "throughput/device/data loading (s)"  # seconds per step waiting on the data loader
STEP_TIME_TAG = "perf/step_time_s"
SAVE_DURATION_TAG = "checkpoint/save_duration_s"
RESTORE_DURATION_TAG = "checkpoint/restore_duration_s"
DATA_SETUP_TAG = "timing/data_setup_s"
SINCE_START_TAG = "timing/since_start_s"  # process start to the restore's end
EVAL_LOSS_TAG = "eval/lm_loss"  # the in-loop evaluator's held-out loss (trainer/evaluator.py)

# Every tag above, in the order the trainer's docs list them (docs/CONTRACTS.md).
TRAINER_TAGS = (
    CE_LOSS_TAG,
    PPL_TAG,
    Z_LOSS_TAG,
    GRAD_NORM_TAG,
    LR_TAG,
    LR_GROUP1_TAG,
    STEP_SKIPPED_TAG,
    STEP_SKIPPED_PARITY_TAG,
    TOTAL_TOKENS_TAG,
    TOTAL_TOKENS_PARITY_TAG,
    TPS_TAG,
    TPS_AVG_TAG,
    TFLOPS_TAG,
    MFU_TAG,
    MFU_AVG_TAG,
    DATA_WAIT_TAG,
    STEP_TIME_TAG,
    SAVE_DURATION_TAG,
    RESTORE_DURATION_TAG,
    DATA_SETUP_TAG,
    SINCE_START_TAG,
    EVAL_LOSS_TAG,
)

# The primary loss tag of each training objective a recipe names (today every recipe is `lm`;
# post-training objectives will write their own): readers ask `primary_loss_tag`, never a spelling.
PRIMARY_LOSS_TAGS = {"lm": CE_LOSS_TAG}


def primary_loss_tag(objective: str = "lm") -> str:
    """The tag of the loss a run of `objective` trains on (the curve `monitor`, `compare`, `runs` and
    the smoke checks follow)."""
    tag = PRIMARY_LOSS_TAGS.get(objective)
    if tag is None:
        raise BadInput(
            f"unknown training objective {objective!r}",
            f"use one of: {', '.join(sorted(PRIMARY_LOSS_TAGS))}",
        )
    return tag


# Every host's timings per window, `hosts/<h>/<figure>` (trainer/hooks.py StragglerHook).
HOST_TAG_PREFIX = "hosts/"
HOST_FIGURES = ("step_time_s", "data_wait_s", "compute_s")


def host_tag(host: int, figure: str) -> str:
    return f"{HOST_TAG_PREFIX}{host}/{figure}"


def parse_host_tag(tag: str) -> tuple[int, str] | None:
    """(host, figure) of a `hosts/<h>/<figure>` tag, else None."""
    parts = tag.split("/")
    if len(parts) == 3 and f"{parts[0]}/" == HOST_TAG_PREFIX and parts[1].isdigit():
        return int(parts[1]), parts[2]
    return None


# Tags that measure time or speed: a replayed step legitimately logs another value for them
# (observe/series.py).
VOLATILE_TAG_PREFIXES = (
    "throughput/device/",
    "perf/step_time",
    "checkpoint/",
    "timing/",
    "time/",
    "system/",
    HOST_TAG_PREFIX,
)

# The first parts of every tag a trainer or an evaluator writes (and of the other writers' tags that
# `VOLATILE_TAG_PREFIXES` names): a string that starts with one is a tag, and is spelled here only.
METRIC_TAG_PREFIXES = (
    "train/",
    "optim/",
    "throughput/",
    "perf/",
    "checkpoint/",
    "timing/",
    "time/",
    "system/",
    "eval/",
    HOST_TAG_PREFIX,
)


# ---------------------------------------------------------------- tags of the LM evaluator

# OLMo-core's `EvaluatorCallback.perform_eval` records `{prefix}/{evaluator.name}/{metric}` with prefix
# `eval`, the LM evaluator's name `lm` and `LMEvaluator.compute_metrics`'s `<label>/CE loss`, `<label>/PPL`.
LM_EVAL_PREFIX = "eval/lm/"
# The downstream evaluator's: `eval/downstream/<task> (<metric>)` (trainer/downstream.py).
DOWNSTREAM_PREFIX = "eval/downstream/"


def lm_eval_tags(label: str) -> tuple[str, str]:
    """(CE loss tag, PPL tag) of one `eval.lm` label, as OLMo-core names them."""
    return f"{LM_EVAL_PREFIX}{label}/CE loss", f"{LM_EVAL_PREFIX}{label}/PPL"


# ---------------------------------------------------------------- event file names

EVENT_FILE_PREFIX = "events.out.tfevents."
_SEGMENT_NAME = re.compile(r"tfevents\.(\d+)\.(.*?)(?:\.a(\d+)\.s(\d+))?$")


def segment_name(start_time: int, host: str, attempt: int, segment: int) -> str:
    """The name of one immutable event segment; names sort by the writer's start time."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", host) or "host"
    return f"{EVENT_FILE_PREFIX}{start_time:010d}.{host}.a{attempt:04d}.s{segment:05d}"


def segment_names_from(start_unix: float) -> str:
    """The smallest segment name written by a trainer started at or after `start_unix`."""
    return f"{EVENT_FILE_PREFIX}{max(0, int(start_unix)):010d}"


def is_event_file(name: str) -> bool:
    return "tfevents" in name


def parse_segment_name(name: str) -> tuple[int, str, int | None, int | None] | None:
    """(start time, host, attempt, segment) of an event file name; attempt and segment are None for a
    file another writer named (TensorBoard's own `events.out.tfevents.<time>.<host>`)."""
    m = _SEGMENT_NAME.search(name)
    if not m:
        return None
    ts, host, att, seg = m.groups()
    return int(ts), host, int(att) if att else None, int(seg) if seg else None
