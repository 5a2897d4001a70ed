"""A fallback slice: `resume-until-done --fallback DEVICE --fallback-after D --return-after D` against the
sandbox cluster on a fake clock (test_waiting_for_capacity's), across TPU generations, as the case
study's stage 2 moved from Ironwood to v5p. The test plays the trainer by committing checkpoints."""

from __future__ import annotations

import io

import pytest
from helpers.cli import clean_env, invoke
from test_waiting_for_capacity import FAST, Clock, commit

from olmo_ctl.backends.gke import GKEBackend
from olmo_ctl.core.config import Settings
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.rundir import RunDir, parse_iso
from olmo_ctl.sandbox.sandbox import Sandbox
from olmo_ctl.supervise.policy import Fallback, RetryPolicy
from olmo_ctl.supervise.supervisor import Printer, Supervisor

PREFERRED, FALLBACK = "tpu7x-8", "v5p-8"


@pytest.fixture
def sandbox():
    with Sandbox(slices={PREFERRED: 1, FALLBACK: 1}) as sb:
        yield sb


@pytest.mark.chaos
def test_a_long_wait_falls_back_returns_and_falls_back_again_when_the_preferred_does_not_start(
    tmp_path, sandbox, gcs
):
    """tpu7x-8 loses its node at 10 min for 2 h 20 min. After 30 min of waiting the run moves to v5p-8
    (attempt 2, same recipe and data order); after 1 h there it tries tpu7x-8 again (attempt 3), which
    still has no node, so 30 min later it falls back again (attempt 4); an hour later it tries again
    (attempt 5), tpu7x-8 has its node back, and the run finishes there."""
    rd = RunDir.of(f"gs://{gcs.bucket}/{tmp_path.name}", "fb")
    r = load_recipe("smoke", overrides=["train.max_steps=20"])
    rd.create_run(r.to_dict(), r.fingerprint(), "fp", PREFERRED)
    settings = Settings(
        image="registry.example.com/olmo-ctl:test", run_root=f"gs://{gcs.bucket}", queue="multislice-queue"
    )
    be = GKEBackend(namespace="default", host=sandbox.url, retry=FAST, settings=settings)

    def outage(c: Clock) -> None:
        commit(rd, 5)
        c.fault(kind="capacity", pool=f"{PREFERRED}-np-0", nodes=0, **{"for": "2h20m"})

    def on_fallback(c: Clock) -> None:
        commit(rd, 10)

    def finish(c: Clock) -> None:
        commit(rd, 20)
        (last,) = c.sb.server.cluster.jobset_names()  # the live attempt: back on tpu7x-8
        c.sb.server.cluster.complete(last)

    clock = Clock(sandbox, [(600, outage), (3000, on_fallback), (4 * 3600, finish)])
    buf = io.StringIO()
    sup = Supervisor(
        rd,
        be,
        # The test plays a trainer that writes no events: no stall judgement (its own tests are elsewhere).
        RetryPolicy(
            backoff_base_s=60, max_retries=2, admission_timeout_s=600, stall_min_s=1e9, startup_limit_s=1e9
        ),
        poll_s=60,
        clock=clock.time,
        sleep=clock.sleep,
        printer=Printer(rd.name, stream=buf, clock=clock.time),
        fallback=Fallback((FALLBACK,), after_s=1800, return_after_s=3600),
    )
    rc = sup.run()
    out = buf.getvalue()
    assert rc == 0, out
    j = rd.journal()
    assert [(x["attempt"], x["device"]) for x in j if x["event"] == "submitted"] == [
        (1, PREFERRED),
        (2, FALLBACK),
        (3, PREFERRED),
        (4, FALLBACK),
        (5, PREFERRED),
    ]
    moves = [(x["event"], x["from"], x["to"]) for x in j if x["event"] in ("fallback", "returned")]
    assert moves == [
        ("fallback", PREFERRED, FALLBACK),
        ("returned", FALLBACK, PREFERRED),
        ("fallback", PREFERRED, FALLBACK),
        ("returned", FALLBACK, PREFERRED),
    ]
    waits = [x for x in j if x["event"] == "waiting"]
    falls = [x for x in j if x["event"] == "fallback"]

    # each fallback within --fallback-after (+ one poll) of the wait that led to it
    for w, f in zip([w for w in waits if w["attempt"] in (1, 3)], falls, strict=True):
        assert 1800 <= parse_iso(f["time"]) - parse_iso(w["time"]) <= 1800 + 120
    rets = [x for x in j if x["event"] == "returned"]
    for f, r in zip(falls, rets, strict=True):  # each return --return-after (+ one poll) after its fallback
        assert 3600 <= parse_iso(r["time"]) - parse_iso(f["time"]) <= 3600 + 120
    # nothing spent from the retry budget; every resize kept the committed step
    assert not [x for x in j if x["event"] in ("failed", "backoff", "gave_up")]
    assert [x["committed_step"] for x in j if x["event"] == "resized"] == [5, 10, 10, 10]
    assert j[-1]["event"] == "done" and j[-1]["committed_step"] == 20


def test_fallback_options_are_checked_before_anything_is_written(tmp_path):
    env = clean_env(tmp_path)
    base = ["resume-until-done", "--recipe", "smoke", "--device", "v5p-16", "--run-root", "gs://b/r"]
    for args, line in [
        (["--fallback-after", "30m"], "--fallback-after and --return-after need --fallback"),
        (["--fallback", "v5p-9"], "`v5p-9` is not a device type"),
        (["--fallback", "cpu-2"], "--fallback cpu-2: a fallback is a TPU slice on GKE"),
        (["--fallback", "v5p-16"], "names a device twice (or the run's own --device)"),
        (["--fallback", "v5p-8", "--fallback-after", "soon"], "--fallback-after `soon` is not a duration"),
    ]:
        p = invoke(*base, *args, env=env)
        assert p.returncode == 2, (args, p.stderr)
        assert line in p.stderr and p.stderr.count("\n") == 1, p.stderr


@pytest.mark.parametrize(
    "waiting_s,on_fallback_s,current,running,move",
    [
        (None, None, PREFERRED, True, None),
        (1799.0, None, PREFERRED, False, None),
        (1801.0, None, PREFERRED, False, ("fallback", FALLBACK)),
        (1801.0, 10.0, FALLBACK, False, ("fallback", "v5p-16")),  # the next in the chain
        (1801.0, 10.0, "v5p-16", False, None),  # nothing left to fall back to: it waits
        (None, 3599.0, FALLBACK, True, None),
        (None, 3600.0, FALLBACK, True, ("return", PREFERRED)),
        (None, 3600.0, FALLBACK, False, None),  # only a fallback that runs goes back
    ],
)
def test_the_fallback_rule(waiting_s, on_fallback_s, current, running, move):
    f = Fallback((FALLBACK, "v5p-16"), after_s=1800, return_after_s=3600)
    assert f.move(PREFERRED, current, waiting_s, on_fallback_s, running) == move
    assert Fallback((FALLBACK,), 1800).move(PREFERRED, FALLBACK, None, 1e9, True) is None  # no --return-after
