"""TensorBoard events as immutable segments, safe on gs:// (which has no append).

Scalars are classic `simple_value` summaries in TFRecord event files. Each attempt writes a series of
complete event files under `<run-dir>/tensorboard/`:

    events.out.tfevents.<unix start time, 10 digits>.<host>.a<attempt 4 digits>.s<segment 5 digits>

each starting with a `file_version` record and holding only records not in earlier segments, so a
metric never appears in two segments of one attempt. A segment is built in memory and written as
one whole object (local paths get the same names, written atomically). Names sort by start time,
so readers see attempts in order. After a kill, steps past the last checkpoint that an attempt
logged are logged again by the next attempt; each attempt starts with a `SessionLog.START` record at
its first step, on which TensorBoard's EventAccumulator purges the earlier attempt's records from
that step on (the classic restart protocol), so a reader sees each step once, with the replayed value.
"""

from __future__ import annotations

import io
import os
import socket
import time

from olmo_ctl.core.contracts import (
    DATA_SETUP_TAG,
    RESTORE_DURATION_TAG,
    SINCE_START_TAG,
    segment_name,
)
from olmo_ctl.storage import join, store_for

_IMPORTED_AT = time.time()


def _process_started_at() -> float:
    """When this process started, by the kernel's clock of it (Linux: boot time + start ticks, as
    psutil reads it); else when this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except Exception:  # noqa: BLE001 - not Linux, or no /proc
        return _IMPORTED_AT


def _event_bytes(events) -> bytes:
    from tensorboard.summary.writer.record_writer import RecordWriter

    buf = io.BytesIO()
    w = RecordWriter(buf)
    for e in events:
        w.write(e.SerializeToString())
    return buf.getvalue()


class EventLog:
    """Buffers scalars and uploads them as a new immutable segment on `upload()`."""

    def __init__(
        self, run_dir: str, attempt: int = 0, host: str | None = None, start_time: int | None = None
    ):
        self.dir = join(run_dir, "tensorboard")
        self.attempt = attempt
        self.host = host or socket.gethostname().split(".")[0]
        self.start_time = int(time.time()) if start_time is None else start_time
        self.segment = 0
        self._pending: list = []
        self._last_upload = time.monotonic()

    def scalars(self, step: int, values: dict[str, float], wall_time: float | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        wt = time.time() if wall_time is None else wall_time
        summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
        self._pending.append(Event(wall_time=wt, step=int(step), summary=summary))

    def startup(self, step: int, data_setup: list[float], restore: list[float]) -> None:
        """The parts of this trainer start, at the step it restored (observe/goodput.py reads them): the
        data set-up and the restore as [start, end] wall times, and the seconds since the process
        started, at the restore's end."""
        self.scalars(step, {DATA_SETUP_TAG: data_setup[1] - data_setup[0]}, data_setup[1])
        self.scalars(
            step,
            {
                RESTORE_DURATION_TAG: restore[1] - restore[0],
                SINCE_START_TAG: restore[1] - _process_started_at(),
            },
            restore[1],
        )

    def session_start(self, step: int) -> None:
        """Mark a (re)start at `step`, the first step this attempt will log: TensorBoard readers then
        drop every record at or after `step` from earlier attempts (steps a killed attempt logged past
        its last checkpoint, which this attempt replays)."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self._pending.append(
            Event(wall_time=time.time(), step=int(step), session_log=SessionLog(status=SessionLog.START))
        )

    def due(self, every_s: float) -> bool:
        return bool(self._pending) and time.monotonic() - self._last_upload >= every_s

    def upload(self) -> str | None:
        """Write pending records as the next segment; on a storage error they stay pending."""
        from tensorboard.compat.proto.event_pb2 import Event

        if not self._pending:
            return None
        header = Event(wall_time=self._pending[0].wall_time, file_version="brain.Event:2")
        data = _event_bytes([header, *self._pending])
        path = join(self.dir, segment_name(self.start_time, self.host, self.attempt, self.segment))
        store_for(path).write_bytes(path, data)  # raises -> records stay pending, same name next time
        self.segment += 1
        self._pending = []
        self._last_upload = time.monotonic()
        return path
