"""The event reader against files written by TensorBoard's own writers, checked against EventAccumulator."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from helpers.events import T0, TAGS, value, write_segment

from olmo_ctl.observe.crc import masked_crc
from olmo_ctl.observe.reader import EventReader, read_scalars


def accumulator(logdir) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        ev = acc.Scalars(tag)
        out[tag] = (np.array([e.step for e in ev]), np.array([e.value for e in ev]))
    for tag in acc.Tags()["tensors"]:
        from tensorboard.util import tensor_util

        ev = acc.Tensors(tag)
        out[tag] = (
            np.array([e.step for e in ev]),
            np.array([float(tensor_util.make_ndarray(e.tensor_proto)) for e in ev]),
        )
    return out


def test_simple_value_scalars_match_event_accumulator(tmp_path):
    tb = tmp_path / "tb"
    write_segment(tb, range(0, 700))  # step 0 (no step field on the wire) and 1..3-byte step varints
    r = read_scalars(str(tb))
    ref = accumulator(tb)
    assert sorted(ref) == r.tags() == sorted(TAGS)
    for tag, (steps, vals) in ref.items():
        s = r.series(tag)
        np.testing.assert_array_equal(s.steps, steps)
        np.testing.assert_array_equal(s.values, vals.astype(np.float64))
        np.testing.assert_array_equal(s.wall_times, T0 + steps.astype(float))
    assert r.problems() == []
    assert r.max_step() == 699


def test_tensor_scalars_of_every_dtype(tmp_path):
    """tensorboard.summary.Writer's tensor scalars, plus double/int64/half tensors and tensor_content."""
    import tensorboard.summary as tbs
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    w = tbs.Writer(str(tmp_path / "w"))
    for step in range(1, 301):
        w.add_scalar("loss", 3.0 / step, step, wall_time=T0 + step)
        w.add_scalar("lr", step * 1e-6, step, wall_time=T0 + step)
    w.close()
    r = read_scalars(str(tmp_path / "w"))
    ref = accumulator(tmp_path / "w")
    for tag in ("loss", "lr"):
        np.testing.assert_array_equal(r.series(tag).steps, ref[tag][0])
        np.testing.assert_array_equal(r.series(tag).values, ref[tag][1].astype(np.float64))

    e = EventFileWriter(str(tmp_path / "t"))
    protos = {
        "f64": lambda s: tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE, double_val=[s / 3]),
        "i64": lambda s: tensor_pb2.TensorProto(dtype=types_pb2.DT_INT64, int64_val=[-s * 1000]),
        "half": lambda s: tensor_pb2.TensorProto(
            dtype=types_pb2.DT_HALF, half_val=[int(np.array([s / 4], np.float16).view(np.uint16)[0])]
        ),
        "content": lambda s: tensor_pb2.TensorProto(
            dtype=types_pb2.DT_FLOAT, tensor_content=struct.pack("<f", s + 0.5)
        ),
    }
    want = {
        "f64": lambda s: s / 3,
        "i64": lambda s: -s * 1000.0,
        "half": lambda s: float(np.float16(s / 4)),
        "content": lambda s: s + 0.5,
    }
    for step in range(1, 200):
        for tag, mk in protos.items():
            e.add_event(
                event_pb2.Event(
                    wall_time=T0 + step,
                    step=step,
                    summary=summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, tensor=mk(step))]),
                )
            )
    e.close()
    r = read_scalars(str(tmp_path / "t"))
    for tag, f in want.items():
        s = r.series(tag)
        assert list(s.steps) == list(range(1, 200)), tag
        np.testing.assert_array_equal(s.values, [f(x) for x in range(1, 200)], err_msg=tag)


def test_truncated_last_record_then_tailing_completes_it(tmp_path):
    full = write_segment(tmp_path / "src", range(1, 101))
    data = open(full, "rb").read()
    tb = tmp_path / "tb"
    tb.mkdir()
    dst = tb / os.path.basename(full)
    dst.write_bytes(data[:-7])  # cut into the last record
    r = EventReader(str(tb))
    st = r.refresh()
    s = r.series("train/CE loss")
    assert s.steps[-1] == 100 and len(r.series(TAGS[-1])) == 99  # only the very last record is missing
    assert any("last record incomplete" in p for p in r.problems())
    # the writer finishes the record: only the missing bytes (plus the pending partial record) are read
    dst.write_bytes(data)
    st = r.refresh()
    assert len(r.series(TAGS[-1])) == 100
    assert st.bytes_read < 200
    assert r.problems() == []


def test_a_file_rewritten_smaller_is_read_again(tmp_path):
    p = write_segment(tmp_path / "tb", range(1, 41))
    r = EventReader(str(tmp_path / "tb"))
    r.refresh()
    shorter = write_segment(tmp_path / "src", range(1, 11), values=lambda tag, s: value(tag, s) + 1)
    os.replace(shorter, p)
    r.refresh()
    s = r.series("train/CE loss")
    np.testing.assert_array_equal(s.steps, np.arange(1, 11))
    assert s.values[0] == value("train/CE loss", 1) + 1


def test_many_segments_tail_reads_only_new_bytes(tmp_path):
    tb = tmp_path / "tb"
    for seg in range(6):
        write_segment(tb, range(seg * 50 + 1, seg * 50 + 51), segment=seg)
    r = EventReader(str(tb))
    r.refresh()
    assert len(r.series("train/CE loss")) == 300
    st = r.refresh()
    assert st.bytes_read == 0 and st.records == 0  # nothing new: nothing read
    p = write_segment(tb, range(301, 351), segment=6)
    st = r.refresh()
    assert st.new_files == 1 and st.bytes_read == os.path.getsize(p)
    assert r.series("train/CE loss").steps[-1] == 350
    np.testing.assert_array_equal(r.series("train/CE loss").steps, np.arange(1, 351))


def test_replayed_steps_after_resume_are_deduplicated_later_attempt_wins(tmp_path):
    tb = tmp_path / "tb"
    write_segment(tb, range(1, 31), attempt=1, start_time=1767225600)
    # attempt 2 resumed from checkpoint 20: steps 21..30 run again (same values: an exact resume)
    write_segment(tb, range(21, 41), attempt=2, start_time=1767229200, wall0=T0 + 3600)
    r = read_scalars(str(tb))
    s = r.series("train/CE loss")
    np.testing.assert_array_equal(s.steps, np.arange(1, 41))
    assert r.replays("train/CE loss") == 10 and r.replayed_by_attempt("train/CE loss") == {1: 10}
    assert r.mismatches() == []
    assert (s.attempts[s.steps > 20] == 2).all() and (s.attempts[s.steps <= 20] == 1).all()
    assert s.wall_times[s.steps == 25][0] == T0 + 3600 + 25  # the later record's wall time

    # a desynchronised resume: step 25 onwards differ; reported, and the later value wins
    tb2 = tmp_path / "tb2"
    write_segment(tb2, range(1, 31), attempt=1)
    write_segment(tb2, range(21, 41), attempt=2, values=lambda tag, st: value(tag, st, desync=25))
    r = read_scalars(str(tb2))
    assert {m.tag for m in r.mismatches()} == {
        t for t in TAGS if t not in ("throughput/device/TPS", "perf/step_time_s")
    }
    mm = [m for m in r.mismatches() if m.tag == "train/CE loss"]
    assert [m.step for m in mm] == list(range(25, 31))
    assert mm[0].earlier == value("train/CE loss", 25) and mm[0].later == value(
        "train/CE loss", 25, desync=25
    )
    assert (mm[0].earlier_attempt, mm[0].later_attempt) == (1, 2)
    assert r.series("train/CE loss").values[24] == value("train/CE loss", 25, desync=25)


def test_replays_arriving_incrementally(tmp_path):
    """Tailing a live resume: the replayed segment lands after the first read."""
    tb = tmp_path / "tb"
    write_segment(tb, range(1, 31), attempt=1)
    r = EventReader(str(tb))
    r.refresh()
    write_segment(tb, range(21, 26), attempt=2, segment=0, start_time=1767229200)
    r.refresh()
    write_segment(tb, range(26, 41), attempt=2, segment=1, start_time=1767229200)
    r.refresh()
    s = r.series("train/CE loss")
    np.testing.assert_array_equal(s.steps, np.arange(1, 41))
    assert r.replays("train/CE loss") == 10 and r.mismatches() == []


def test_corrupt_record_is_skipped_and_counted(tmp_path):
    p = write_segment(tmp_path / "tb", range(1, 201))
    data = bytearray(open(p, "rb").read())
    # flip one bit inside the value of the record of step 100's first tag
    off = 0
    n_rec = 0
    while off < len(data):
        (n,) = struct.unpack_from("<Q", data, off)
        if n_rec == 1 + 99 * len(TAGS):
            data[off + 12 + n - 2] ^= 0x01
            break
        off += 16 + n
        n_rec += 1
    open(p, "wb").write(bytes(data))
    r = read_scalars(str(tmp_path / "tb"))
    s = r.series(TAGS[0])
    assert 100 not in s.steps and len(s) == 199
    assert len(r.series(TAGS[1])) == 200
    assert any("failed their checksum" in x for x in r.problems())


def test_garbage_length_stops_the_file_with_a_message(tmp_path):
    p = write_segment(tmp_path / "tb", range(1, 51))
    with open(p, "ab") as f:
        f.write(struct.pack("<QI", 123, 0xDEADBEEF) + b"x" * 200)
    r = read_scalars(str(tmp_path / "tb"))
    assert len(r.series("train/CE loss")) == 50
    assert any("bad length checksum" in x for x in r.problems())


def test_masked_crc_matches_tensorboard():
    from tensorboard.summary.writer.record_writer import masked_crc32c

    for blob in (b"", b"a", b"hello world" * 13, bytes(range(256))):
        assert masked_crc(blob) == masked_crc32c(blob)


@pytest.mark.gcs
def test_reads_and_tails_gcs(tmp_path, gcs):
    from olmo_ctl import storage

    local = tmp_path / "tb"
    paths = [write_segment(local, range(s * 40 + 1, s * 40 + 41), segment=s) for s in range(3)]
    bucket = gcs.bucket
    st = storage.store_for(f"gs://{bucket}")
    prefix = f"gs://{bucket}/runs/r1/tensorboard"
    for p in paths[:2]:
        st.write_bytes(f"{prefix}/{os.path.basename(p)}", open(p, "rb").read())
    r = EventReader(prefix)
    r.refresh()
    np.testing.assert_array_equal(r.series("train/CE loss").steps, np.arange(1, 81))
    st.write_bytes(f"{prefix}/{os.path.basename(paths[2])}", open(paths[2], "rb").read())
    stats = r.refresh()
    assert stats.new_files == 1 and stats.bytes_read == os.path.getsize(paths[2])
    np.testing.assert_array_equal(r.series("train/CE loss").steps, np.arange(1, 121))
    ref = read_scalars(str(local))
    np.testing.assert_array_equal(r.series("train/PPL").values, ref.series("train/PPL").values)
    # a long run's many small segments: fetched in parallel, decoded in order
    many = f"gs://{bucket}/runs/r2/tensorboard"
    for seg in range(80):
        p = write_segment(tmp_path / "many", range(seg * 5 + 1, seg * 5 + 6), segment=seg)
        st.write_bytes(f"{many}/{os.path.basename(p)}", open(p, "rb").read())
    r2 = EventReader(many)
    assert r2.refresh().files == 80
    np.testing.assert_array_equal(r2.series("train/CE loss").steps, np.arange(1, 401))
    assert r2.problems() == []
    # an object rewritten under the same name (a new generation) is read again, not appended to
    other = write_segment(
        tmp_path / "other", range(81, 121), segment=2, values=lambda tag, s: value(tag, s, desync=100)
    )
    st.write_bytes(f"{prefix}/{os.path.basename(paths[2])}", open(other, "rb").read())
    r.refresh()
    s = r.series("train/CE loss")
    np.testing.assert_array_equal(s.steps, np.arange(1, 121))
    assert s.values[-1] == value("train/CE loss", 120, desync=100) and r.mismatches() == []


@pytest.mark.parametrize("chunk", [100, 997, 4096])
def test_records_crossing_read_chunks(tmp_path, chunk):
    """Large files are read in chunks: records that straddle a chunk boundary are read whole."""
    tb = tmp_path / "tb"
    write_segment(tb, range(1, 301))
    small = EventReader(str(tb), chunk_bytes=chunk)
    small.refresh()
    whole = read_scalars(str(tb))
    assert small.problems() == []
    for tag in TAGS:
        np.testing.assert_array_equal(small.series(tag).steps, np.arange(1, 301))
        np.testing.assert_array_equal(small.series(tag).values, whole.series(tag).values)


def test_non_scalar_events_are_skipped(tmp_path):
    """Histograms, images and log messages interleaved with scalars: only the scalars are read."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.compat.proto.summary_pb2 import HistogramProto
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    w = EventFileWriter(str(tmp_path / "tb"))
    for step in range(1, 301):
        w.add_event(
            event_pb2.Event(
                wall_time=T0 + step,
                step=step,
                summary=summary_pb2.Summary(
                    value=[
                        summary_pb2.Summary.Value(
                            tag="w/hist", histo=HistogramProto(min=0, max=step, num=3, sum=step)
                        )
                    ]
                ),
            )
        )
        w.add_event(
            event_pb2.Event(
                wall_time=T0 + step,
                step=step,
                summary=summary_pb2.Summary(
                    value=[
                        summary_pb2.Summary.Value(
                            tag="train/CE loss", simple_value=value("train/CE loss", step)
                        )
                    ]
                ),
            )
        )
        if step % 50 == 0:
            w.add_event(
                event_pb2.Event(
                    wall_time=T0 + step,
                    step=step,
                    summary=summary_pb2.Summary(
                        value=[
                            summary_pb2.Summary.Value(
                                tag="img",
                                image=summary_pb2.Summary.Image(
                                    height=1, width=1, colorspace=1, encoded_image_string=b"x" * step
                                ),
                            )
                        ]
                    ),
                )
            )
    w.close()
    r = read_scalars(str(tmp_path / "tb"))
    assert r.tags() == ["train/CE loss"] and r.problems() == []
    np.testing.assert_array_equal(r.series("train/CE loss").steps, np.arange(1, 301))
    np.testing.assert_array_equal(
        r.series("train/CE loss").values, [value("train/CE loss", s) for s in range(1, 301)]
    )
