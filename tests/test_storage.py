"""The storage interface behaves the same on a local path and on gs:// (the GCS emulator)."""

from __future__ import annotations

import pytest

from olmo_ctl import storage


@pytest.fixture(params=["local", pytest.param("gcs", marks=pytest.mark.gcs)])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return f"gs://{request.getfixturevalue('gcs').bucket}/run"


def test_write_read_conditional_write_and_find(root):
    st = storage.store_for(root)
    for name in (
        "checkpoints/10/commit_success.txt",
        "checkpoints/20/commit_success.txt",
        "checkpoints/20/state/x",
        "checkpoints/30.orbax-checkpoint-tmp-1/commit_success.txt",
        "tensorboard/events.out.tfevents.0000000100.h.a0001.s00000",
        "tensorboard/events.out.tfevents.0000000200.h.a0002.s00000",
    ):
        st.write_bytes(storage.join(root, name), b"x" * 3)

    found = st.find(storage.join(root, "checkpoints"), match_glob="*/commit_success.txt")
    assert sorted(o.path.rsplit("/", 2)[1] for o in found) == ["10", "20", "30.orbax-checkpoint-tmp-1"]
    later = st.find(storage.join(root, "tensorboard"), start_offset="events.out.tfevents.0000000150")
    assert [o.path.rpartition("/")[2] for o in later] == ["events.out.tfevents.0000000200.h.a0002.s00000"]
    assert all(o.size == 3 for o in later)

    lease = storage.join(root, "lease.json")
    gen = st.write_text(lease, "a", if_generation_match=0)
    with pytest.raises(storage.PreconditionFailed):
        st.write_text(lease, "b", if_generation_match=0)  # it exists now
    st.write_text(lease, "c", if_generation_match=gen)
    assert st.read_text(lease) == "c"
    assert st.read_range(lease, 0, 1) == b"c"
