"""`olmo-ctl resize`: planning at a constant global batch, the GKE path against the Kubernetes API
test server (run directory on the GCS emulator), and a local run resized cpu-4 -> cpu-2 -> cpu-4
mid-flight compared with its un-resized twin (real trainer processes and Orbax checkpoints)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from helpers.attempts import attempt_of
from helpers.kube import write_kubeconfig

from olmo_ctl.core.devices import get_device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.supervise.resize import plan_resize

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- planning


@pytest.mark.parametrize(
    "old, new, micro",
    [
        ("tpu7x-512", "tpu7x-128", (1, 4)),
        ("tpu7x-128", "tpu7x-512", (4, 1)),
        ("tpu7x-512", "v5p-256", (1, 4)),
        ("tpu7x-128", "h100-mega-80gb-8x64", (4, 1)),  # TPU -> GPU nodes: both on GKE
        ("h100-mega-80gb-8x64", "v5p-256", (1, 4)),
    ],
)
def test_plan_keeps_the_global_batch_and_recomputes_the_per_device_batch(old, new, micro):
    r = load_recipe("olmo3-7b-stage1")
    p = plan_resize(r, get_device(old), get_device(new), "s1", 3, 4)
    assert (p.old.per_device_batch, p.new.per_device_batch) == micro
    assert p.old.global_batch == p.new.global_batch == r.train.global_batch
    assert p.old.tokens_per_step == p.new.tokens_per_step == r.train.global_batch * r.train.seq_len
    for dev, plan in ((old, p.old), (new, p.new)):
        assert plan.per_device_batch * plan.grad_accum * get_device(dev).devices == r.train.global_batch
    lines = "\n".join(p.plan_lines())
    assert f"per_device_batch      {micro[0]} -> {micro[1]}" in lines
    assert f"global_batch          {r.train.global_batch} -> {r.train.global_batch} (unchanged)" in lines


def test_plan_refuses_what_would_change_the_run():
    smoke = load_recipe("smoke")  # global batch 8
    with pytest.raises(BadInput, match="cannot be split exactly over the 3 devices"):
        plan_resize(smoke, get_device("cpu-4"), get_device("cpu-3"), "r", 1, 2)
    with pytest.raises(BadInput, match="already runs on cpu-4"):
        plan_resize(smoke, get_device("cpu-4"), get_device("cpu-4"), "r", 1, 2)
    with pytest.raises(BadInput, match="one runs on GKE .a TPU slice or GPU nodes., the other is a local"):
        plan_resize(smoke, get_device("cpu-4"), get_device("v5p-8"), "r", 1, 2)
    with pytest.raises(BadInput, match="one runs on GKE"):
        plan_resize(smoke, get_device("gpu-8"), get_device("h100-mega-80gb-8"), "r", 1, 2)


# ---------------------------------------------------------------- GKE against the test server


def _commit(run_dir: str, step: int) -> None:
    """A committed checkpoint as the run directory sees it on gs:// (the Orbax commit marker)."""
    from olmo_ctl.storage import store_for

    store_for(run_dir).write_text(f"{run_dir}/checkpoints/{step}/commit_success.txt", "ok")


@pytest.fixture
def gke(tmp_path, monkeypatch, srv, gcs):
    """A stage-1 run on the GCS emulator, attempt 1 running on tpu7x-512 in the test cluster."""
    from olmo_ctl.backends.gke import GKEBackend
    from olmo_ctl.core.config import Settings
    from olmo_ctl.rundir import RunDir

    bucket = gcs.bucket
    for k in [k for k in __import__("os").environ if k.startswith("OLMO_CTL_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(tmp_path / "kubeconfig", srv.url))
    root = f"gs://{bucket}/runs"
    recipe = load_recipe("olmo3-7b-stage1")
    rd = RunDir.of(root, "s1")
    rd.create_run(recipe.to_dict(), recipe.fingerprint(), "v1:test", "tpu7x-512")
    settings = Settings(image="img:1", run_root=root, queue="tpu-queue")
    be = GKEBackend(host=srv.url, settings=settings)
    h = be.send(be.render(attempt_of(rd, 1, "tpu7x-512")))
    rd.append("submitted", attempt=1, device="tpu7x-512", handle=h.to_dict(), backend="gke")
    srv.cluster.admit(h.name)
    srv.cluster.run_pods(h.name)
    _commit(rd.path, 100)
    # No preflight: the 7B step's compile for each new slice is tests/test_preflight.py's.
    args = [
        "--backend",
        "gke",
        "--run-root",
        root,
        "--image",
        "img:1",
        "--queue",
        "tpu-queue",
        "--no-preflight",
    ]
    yield srv, rd, be, args


def _cli(*argv: str) -> int:
    from olmo_ctl.cli import main

    return main(list(argv))


def _diff_lines(out: str, text: str) -> list[str]:
    """The changed lines of the printed manifest diff that mention `text`, indentation squeezed."""
    return [
        f"{ln[0]} {ln[1:].strip()}"
        for ln in out.splitlines()
        if ln[:1] in "+-" and not ln.startswith(("+++", "---")) and text in ln
    ]


def _plan_annotation(js: dict) -> dict:
    text = js["metadata"]["annotations"]["olmo-ctl/plan"]
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split())}


@pytest.mark.gcs
def test_gke_resize_renders_the_new_per_device_batch_and_then_the_v5p_manifest(gke, capsys):
    srv, rd, _, args = gke
    assert _cli("resize", "s1", "--device", "tpu7x-128", "-y", "--now", *args) == 0
    out = capsys.readouterr().out
    assert "per_device_batch      1 -> 4" in out and "global_batch          512 -> 512 (unchanged)" in out
    assert _diff_lines(out, "olmo-ctl/device:") == [
        "- olmo-ctl/device: tpu7x-512",
        "+ olmo-ctl/device: tpu7x-128",
    ]
    assert "- olmo-ctl/plan: global_batch=512 per_device_batch=1 grad_accum=1 devices=512" in _diff_lines(
        out, "plan"
    )
    assert srv.cluster.jobset_names() == ["s1-a2"]  # attempt 1 deleted (its pods got SIGTERM), then 2
    js = srv.cluster.jobset("s1-a2")
    assert _plan_annotation(js) == {
        "global_batch": 512,
        "per_device_batch": 4,
        "grad_accum": 1,
        "devices": 128,
    }
    node_sel = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["nodeSelector"]
    assert node_sel["cloud.google.com/gke-tpu-topology"] == "4x4x4"
    resized = [r for r in rd.journal() if r["event"] == "resized"]
    assert len(resized) == 1 and resized[0]["committed_step"] == 100
    assert resized[0]["old_plan"]["per_device_batch"] == 1 and resized[0]["new_plan"]["per_device_batch"] == 4
    assert (
        resized[0]["old_plan"]["tokens_per_step"] == resized[0]["new_plan"]["tokens_per_step"] == 512 * 8192
    )
    assert rd.read_lease()["released"] is True  # resize held the run while it acted, then let go

    # A generation change is the same operation.
    srv.cluster.admit("s1-a2")
    srv.cluster.run_pods("s1-a2")
    assert _cli("resize", "s1", "--device", "v5p-256", "-y", *args) == 0
    out = capsys.readouterr().out
    assert _diff_lines(out, "gke-tpu-accelerator") == [
        "- cloud.google.com/gke-tpu-accelerator: tpu7x",
        "+ cloud.google.com/gke-tpu-accelerator: tpu-v5p-slice",
    ]
    assert srv.cluster.jobset_names() == ["s1-a3"]
    js = srv.cluster.jobset("s1-a3")
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5p-slice"
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4x8"
    assert js["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 32
    assert _plan_annotation(js) == {
        "global_batch": 512,
        "per_device_batch": 4,
        "grad_accum": 1,
        "devices": 128,
    }
    assert [(r["attempt"], r["device"]) for r in rd.journal() if r["event"] == "submitted"] == [
        (1, "tpu7x-512"),
        (2, "tpu7x-128"),
        (3, "v5p-256"),
    ]


@pytest.mark.gcs
def test_gke_resize_moves_a_run_from_a_tpu_slice_to_gpu_nodes_and_back_at_the_same_batch(gke, capsys):
    """TPU slices and GPU nodes are both GKE: a resize between them is a generation change like any
    other. The GPU attempt goes to a queue whose flavor covers nvidia.com/gpu (XPK's GPU flavor: the
    accelerator label), renders the GPU template with the recomputed per-device batch, and the run
    comes back to a TPU slice the same way."""
    srv, rd, _, args = gke
    with srv.store.lock:
        srv.world.ensure_queue(
            "gpu-queue",
            "gpu-cluster-queue",
            "gpu-flavor",
            {"nvidia.com/gpu": 0, "cpu": 0, "memory": 0},  # the trainer's CPU and memory covered too
            node_labels={"cloud.google.com/gke-accelerator": "nvidia-h100-mega-80gb"},
        )
    gpu_args = [a if a != "tpu-queue" else "gpu-queue" for a in args]
    assert _cli("resize", "s1", "--device", "h100-mega-80gb-8x16", "-y", *gpu_args) == 0
    out = capsys.readouterr().out
    assert "per_device_batch      1 -> 4" in out and "global_batch          512 -> 512 (unchanged)" in out
    assert srv.cluster.jobset_names() == ["s1-a2"]
    js = srv.cluster.jobset("s1-a2")
    assert _plan_annotation(js) == {
        "global_batch": 512,
        "per_device_batch": 4,
        "grad_accum": 1,
        "devices": 128,
    }
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 16  # one pod per node
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-mega-80gb"}
    trainer = next(c for c in pod["containers"] if c["name"] == "trainer")
    assert trainer["resources"]["limits"] == {"nvidia.com/gpu": 8, "cpu": "197", "memory": "1736Gi"}
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["NNODES"] == "16" and "--xla_gpu_enable_latency_hiding_scheduler=true" in env["XLA_FLAGS"]
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"

    srv.cluster.admit("s1-a2")
    srv.cluster.run_pods("s1-a2")
    assert _cli("resize", "s1", "--device", "tpu7x-128", "-y", *args) == 0
    out = capsys.readouterr().out
    assert "per_device_batch      4 -> 4" in out and "devices               128 -> 128" in out
    assert srv.cluster.jobset_names() == ["s1-a3"]
    js = srv.cluster.jobset("s1-a3")
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu7x"
    assert [(r["attempt"], r["device"]) for r in rd.journal() if r["event"] == "submitted"] == [
        (1, "tpu7x-512"),
        (2, "h100-mega-80gb-8x16"),
        (3, "tpu7x-128"),
    ]
    resized = [r for r in rd.journal() if r["event"] == "resized"]
    assert [r["new_plan"]["tokens_per_step"] for r in resized] == [512 * 8192] * 2


@pytest.mark.gcs
def test_gke_resize_without_a_terminal_or_to_a_bad_device_changes_nothing(gke, capsys):
    srv, rd, _, args = gke
    assert _cli("resize", "s1", "--device", "tpu7x-128", *args) == 2  # stdin is no TTY, no -y
    assert "no terminal to ask on" in capsys.readouterr().err
    assert _cli("resize", "s1", "--device", "cpu-4", "-y", *args) == 2  # a GKE run on a local device
    assert "`cpu-4` is a local device; the GKE backend runs on TPU slices" in capsys.readouterr().err
    assert srv.cluster.jobset_names() == ["s1-a1"]
    assert [r["event"] for r in rd.journal()] == ["submitted"]
    final = load_recipe("olmo3-7b-stage1").train.max_steps
    _commit(rd.path, final)
    assert _cli("resize", "s1", "--device", "tpu7x-128", "-y", *args) == 2
    assert f"is complete (checkpoint {final} of {final} committed)" in capsys.readouterr().err
    assert srv.cluster.jobset_names() == ["s1-a1"]


@pytest.mark.gcs
def test_gke_resize_at_next_checkpoint_waits_for_it_and_for_the_old_pods(gke, capsys):
    """The stop comes only after a newer checkpoint commits, and the next attempt only once the old
    JobSet is gone (its pods may still be writing): never two attempts at once."""
    srv, rd, be, args = gke
    srv.cluster.hold_deletions = True
    events: list[str] = []

    def cluster_script():
        time.sleep(1.5)
        assert srv.cluster.jobset_names() == ["s1-a1"]  # still running: not stopped before the checkpoint
        events.append("checkpoint 140")
        _commit(rd.path, 140)
        for _ in range(100):  # the stop arrives: the JobSet lingers while its pods terminate
            if srv.cluster.jobset("s1-a1")["metadata"].get("deletionTimestamp"):
                break
            time.sleep(0.05)
        time.sleep(1.0)
        assert srv.cluster.jobset_names() == ["s1-a1"]  # no second attempt while the first lingers
        events.append("deleted")
        srv.cluster.finish_deletions()

    t = threading.Thread(target=cluster_script)
    t.start()
    rc = _cli("resize", "s1", "--device", "tpu7x-128", "-y", "--at-next-checkpoint", *args)
    t.join()
    assert rc == 0 and events == ["checkpoint 140", "deleted"]
    assert srv.cluster.jobset_names() == ["s1-a2"]
    assert [r["committed_step"] for r in rd.journal() if r["event"] == "resized"] == [140]


@pytest.mark.gcs
def test_gke_resize_with_a_live_supervisor_only_records_the_request(gke, capsys):
    srv, rd, _, args = gke
    lease = rd.acquire_lease(ttl_s=60)  # this process plays a live supervisor
    rc = _cli("resize", "s1", "--device", "tpu7x-128", "-y", "--timeout", "1", *args)
    assert rc == 124  # nobody carried it out within the timeout; the request stays
    req = rd.pending_resize()
    assert req["device"] == "tpu7x-128" and req["mode"] == "now"
    assert srv.cluster.jobset_names() == ["s1-a1"]  # resize itself touched nothing
    assert [r["event"] for r in rd.journal()] == ["submitted", "resize_requested"]
    rd.release_lease(lease)


# ---------------------------------------------------------------- local: cpu-4 -> cpu-2 -> cpu-4 mid-run

FINAL = 24


def _submitted(rd) -> dict:
    from olmo_ctl.backends.base import Handle

    return {r["attempt"]: Handle.from_dict(r["handle"]) for r in rd.journal() if r["event"] == "submitted"}


def _wait(pred, what: str, timeout_s: float = 240.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _logged(be, handle) -> int:
    from olmo_ctl.supervise.smoke import last_logged_step

    return last_logged_step(be.logs(handle, 400)) or 0


def _log_text(be, handle) -> str:
    return "\n".join(be.logs(handle, 0))


def _series(run_dir: str, tag: str) -> dict[int, float]:
    from olmo_ctl.observe.reader import read_scalars

    r = read_scalars(f"{run_dir}/tensorboard")
    assert not r.problems() and r.replays(tag) == 0
    s = r.series(tag)
    return {int(k): float(v) for k, v in zip(s.steps, s.values, strict=True)}


@pytest.mark.chaos
def test_local_run_resized_cpu4_cpu2_cpu4_mid_run_finishes_like_its_twin(tmp_path, monkeypatch, capsys):
    import io
    import os

    from olmo_ctl.backends.local import LocalBackend
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.supervise.policy import RetryPolicy
    from olmo_ctl.supervise.smoke import _create_run
    from olmo_ctl.supervise.supervisor import Printer, Supervisor

    for k in [k for k in os.environ if k.startswith("OLMO_CTL_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    root = str(tmp_path / "runs")
    recipe = load_recipe(
        "smoke", overrides=[f"train.max_steps={FINAL}", "logging.metrics_every=1", "logging.upload_every_s=1"]
    )
    be = LocalBackend(root)
    main, twin = RunDir.of(root, "rs"), RunDir.of(root, "rs-twin")
    for rd in (main, twin):
        _create_run(rd, recipe, "cpu-4")
    h1 = be.send(be.render(attempt_of(main, 1, "cpu-4")))
    main.append("submitted", attempt=1, device="cpu-4", handle=h1.to_dict(), backend="local")
    ht = be.send(be.render(attempt_of(twin, 1, "cpu-4")))  # the un-resized twin, alongside

    _wait(lambda: _logged(be, h1) >= 4, "attempt 1 to log step 4")
    local = ["-y", "--backend", "local", "--run-root", root]
    assert _cli("resize", "rs", "--device", "cpu-2", "--now", *local) == 0
    n1 = main.committed_step()
    # The trainer finished the step in flight, committed it and exited: nothing logged was lost.
    assert 4 <= n1 < FINAL and _logged(be, h1) == n1
    assert _log_text(be, h1).rstrip().endswith(f"committed step {n1}")
    h2 = _submitted(main)[2]

    # Now `resume-until-done` takes the run over (it reattaches to attempt 2); the second resize is
    # recorded for it and it carries it out, then drives the run to its final step.
    sup = Supervisor(
        main,
        LocalBackend(root),
        RetryPolicy(backoff_base_s=0.1),
        poll_s=0.1,
        printer=Printer("rs", stream=io.StringIO()),
    )
    result: dict = {}
    t = _start(sup, result)
    _wait(lambda: _logged(be, h2) >= n1 + 4, "attempt 2 to log 4 steps")
    _wait(lambda: any(r["event"] == "reattached" for r in main.journal()), "the supervisor to reattach")
    # No --backend: the run's journal says it runs on the local backend.
    assert _cli("resize", "rs", "--device", "cpu-4", "--now", "-y", "--run-root", root) == 0
    n2 = [r["committed_step"] for r in main.journal() if r["event"] == "resized"][-1]
    assert n1 + 4 <= n2 < FINAL and _logged(be, h2) == n2
    assert _log_text(be, h2).rstrip().endswith(f"committed step {n2}")
    h3 = _submitted(main)[3]
    t.join(240)
    assert result.get("rc") == 0, sup.out.stream.getvalue()
    assert main.committed_step() == FINAL and "committed step 24" in _log_text(be, h3)
    assert [r["event"] for r in main.journal() if r["event"] in ("resize_requested", "resized", "done")] == [
        "resized",
        "resize_requested",
        "resized",
        "done",
    ]
    _wait(lambda: be.status(ht).state.terminal, "the twin to finish")
    assert be.status(ht).state.value == "succeeded" and twin.committed_step() == FINAL

    # Each attempt restored the previous one's last completed step and ran the same global batch.
    assert f"restored checkpoint {n1}" in _log_text(be, h2) and f"restored checkpoint {n2}" in _log_text(
        be, h3
    )
    assert "per-device batch 2 x 1 accumulation" in _log_text(be, h1)
    assert "per-device batch 4 x 1 accumulation" in _log_text(be, h2)
    assert "per-device batch 2 x 1 accumulation" in _log_text(be, h3)
    resized = [r for r in main.journal() if r["event"] == "resized"]
    assert [(r["from_device"], r["device"], r["committed_step"]) for r in resized] == [
        ("cpu-4", "cpu-2", n1),
        ("cpu-2", "cpu-4", n2),
    ]
    assert {(r["global_batch"], r["tokens_per_step"]) for r in resized} == {(8, 8 * 128)}
    assert [(r["old_plan"]["per_device_batch"], r["new_plan"]["per_device_batch"]) for r in resized] == [
        (2, 4),
        (4, 2),
    ]
    tokens = _series(main.path, "throughput/total tokens")
    assert tokens == {s: float(s * 8 * 128) for s in range(1, FINAL + 1)}

    # The loss continues from each checkpoint: before the first resize it is the twin's bit for bit
    # (same device count); after it, it differs by float rounding only (another device count sums in
    # another order), far below what one lost or repeated step would change.
    ours, ref = _series(main.path, "train/CE loss"), _series(twin.path, "train/CE loss")
    assert sorted(ours) == sorted(ref) == list(range(1, FINAL + 1))
    assert all(ours[s] == ref[s] for s in range(1, n1 + 1))
    after = [abs(ours[s] - ref[s]) for s in range(n1 + 1, FINAL + 1)]
    shifted = [abs(ours[s] - ref[s - 1]) for s in range(n1 + 1, FINAL + 1)]  # as if one step were repeated
    print(
        f"resized at steps {n1} and {n2}: max |CE - twin CE| after the first resize {max(after):.3g} "
        f"(mean {sum(after) / len(after):.3g}); one step off would be at least {min(shifted):.3g}"
    )
    assert max(after) < 1e-3
    assert min(shifted) > 20 * max(after)
    # `compare` reads the journals' devices: from the first step on cpu-2 the twins differ by layout
    # rounding, within its bound (docs/monitoring-and-compare.md), not a divergence.
    from olmo_ctl.observe.compare import compare

    res = compare(twin.path, main.path)["tags"]["train/CE loss"]
    assert res["layout_change_step"] == n1 + 1 and res["layouts"] == {"a": "cpu-4", "b": "cpu-2"}
    assert res["first_exceed_step"] is None, res["verdict"]
    assert res["verdict"].startswith(("identical", "equal up to layout rounding")), res["verdict"]


# ---------------------------------------------------------------- a running supervisor carries it out


@pytest.fixture
def supervised(tmp_path, monkeypatch, srv, gcs):
    """A 200-step stage-1 run on the GCS emulator whose `resume-until-done` supervisor runs in a
    thread against the test cluster; every JobSet created is admitted and runs, and each creation
    records whether another attempt of the run still existed (a double attempt)."""
    import io
    import os

    from olmo_ctl.backends.gke import GKEBackend
    from olmo_ctl.backends.kube import KubeRetryPolicy
    from olmo_ctl.core.config import Settings
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.supervise.policy import RetryPolicy
    from olmo_ctl.supervise.supervisor import Printer, Supervisor

    bucket = gcs.bucket
    for k in [k for k in os.environ if k.startswith("OLMO_CTL_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("KUBECONFIG", write_kubeconfig(tmp_path / "kubeconfig", srv.url))
    root = f"gs://{bucket}/runs"
    recipe = load_recipe("olmo3-7b-stage1", overrides=["train.max_steps=200", "schedule.warmup_steps=10"])
    rd = RunDir.of(root, "s1")
    rd.create_run(recipe.to_dict(), recipe.fingerprint(), "v1:test", "tpu7x-512")
    srv.cluster.hold_deletions = True  # a deleted JobSet lingers while its pods "checkpoint"
    overlaps: list[tuple[str, list[str]]] = []

    def on_create(name: str) -> None:
        others = [n for n in srv.cluster.jobset_names() if n != name]
        if others:
            overlaps.append((name, others))
        threading.Timer(0.2, lambda: (srv.cluster.admit(name), srv.cluster.run_pods(name))).start()

    srv.cluster.on_create(on_create)

    def finish_deletions_soon() -> None:  # each deleted JobSet lingers 1.5 s, as pods would
        seen: dict[str, float] = {}
        while not stop.is_set():
            time.sleep(0.1)
            for n in srv.cluster.jobset_names():
                js = srv.cluster.jobset(n)
                if js and js["metadata"].get("deletionTimestamp"):
                    seen.setdefault(n, time.monotonic())
            if seen and time.monotonic() - min(seen.values()) > 1.5:
                srv.cluster.finish_deletions()
                seen.clear()

    stop = threading.Event()
    threading.Thread(target=finish_deletions_soon, daemon=True).start()
    settings = Settings(image="img:1", run_root=root, queue="tpu-queue")
    fast = KubeRetryPolicy(base_s=0.01, max_s=0.05, budget_s=5.0, connect_timeout_s=1.0, read_timeout_s=5.0)
    be = GKEBackend(host=srv.url, settings=settings, retry=fast)
    out = io.StringIO()
    sup = Supervisor(
        rd,
        be,
        RetryPolicy(backoff_base_s=0.1, backoff_cap_s=0.2),
        poll_s=0.1,
        printer=Printer(rd.name, stream=out),
    )
    result: dict = {}
    args = [
        "-y",
        "--backend",
        "gke",
        "--run-root",
        root,
        "--image",
        "img:1",
        "--queue",
        "tpu-queue",
        "--timeout",
        "60",
        "--no-preflight",  # the 7B step's compile for each new slice is tests/test_preflight.py's
    ]
    yield srv, rd, sup, result, overlaps, args, out
    stop.set()


def _start(sup, result):
    t = threading.Thread(target=lambda: result.update(rc=sup.run()), daemon=True)
    t.start()
    return t


@pytest.mark.gcs
def test_running_supervisor_adopts_the_new_device_with_no_double_attempt(supervised, capsys):
    srv, rd, sup, result, overlaps, args, out = supervised
    told: list[dict] = []  # what the supervisor hands its notifier (supervise.notify)
    sup.notify = told.append
    t = _start(sup, result)
    _wait(
        lambda: any(r["event"] == "running" and r["attempt"] == 1 for r in rd.journal()),
        "attempt 1 running",
        30,
    )
    _commit(rd.path, 60)
    assert (
        _cli("resize", "s1", "--device", "tpu7x-128", *args) == 0
    )  # recorded, then carried out by the supervisor
    printed = capsys.readouterr().out
    assert "a live supervisor drives this run" in printed and "per_device_batch      1 -> 4" in printed
    assert rd.pending_resize() is None
    js = srv.cluster.jobset("s1-a2")
    assert _plan_annotation(js) == {
        "global_batch": 512,
        "per_device_batch": 4,
        "grad_accum": 1,
        "devices": 128,
    }

    # A generation change through the supervisor: the same operation.
    _wait(
        lambda: any(r["event"] == "running" and r["attempt"] == 2 for r in rd.journal()),
        "attempt 2 running",
        30,
    )

    def next_checkpoint() -> None:  # the next scheduled checkpoint, once the request is recorded
        _wait(lambda: sum(r["event"] == "resize_requested" for r in rd.journal()) == 2, "second request", 60)
        time.sleep(1.0)
        _commit(rd.path, 80)

    threading.Thread(target=next_checkpoint, daemon=True).start()
    assert _cli("resize", "s1", "--device", "v5p-256", "--at-next-checkpoint", *args) == 0
    _wait(
        lambda: any(r["event"] == "running" and r["attempt"] == 3 for r in rd.journal()),
        "attempt 3 running",
        30,
    )
    _commit(rd.path, 200)
    srv.cluster.complete("s1-a3")
    t.join(30)
    assert result.get("rc") == 0, out.getvalue()

    assert overlaps == []  # every attempt was created only once the previous JobSet was gone
    j = rd.journal()
    assert [(r["attempt"], r["device"]) for r in j if r["event"] == "submitted"] == [
        (1, "tpu7x-512"),
        (2, "tpu7x-128"),
        (3, "v5p-256"),
    ]
    resized = [r for r in j if r["event"] == "resized"]
    requests = [r["request"] for r in j if r["event"] == "resize_requested"]
    assert [r["request"] for r in resized] == requests and len(requests) == 2
    assert [(r["from_device"], r["device"], r["committed_step"], r["mode"]) for r in resized] == [
        ("tpu7x-512", "tpu7x-128", 60, "now"),
        ("tpu7x-128", "v5p-256", 80, "at-next-checkpoint"),
    ]
    assert {r["tokens_per_step"] for r in resized} == {512 * 8192}
    assert [r["event"] for r in j if r["event"] in ("preempted", "failed", "backoff", "gave_up")] == []
    assert j[-1]["event"] == "done"
    # A resize is a notification (the run moved to another slice), and so is the finish.
    assert [(m["event"], m["device"], m["attempt"]) for m in told] == [
        ("resized", "tpu7x-128", 2),
        ("resized", "v5p-256", 3),
        ("finished", "v5p-256", None),
    ]


@pytest.mark.gcs
def test_a_request_recorded_between_attempts_moves_the_next_attempt(supervised):
    """No live attempt (the supervisor starts, or waits out a backoff): the next attempt is the resized
    one, and nothing is submitted on the old device."""
    from olmo_ctl.supervise.resize import record_request

    srv, rd, sup, result, overlaps, args, out = supervised
    record_request(rd, "tpu7x-128", "now")
    t = _start(sup, result)
    _wait(lambda: any(r["event"] == "running" for r in rd.journal()), "the first attempt running", 30)
    _commit(rd.path, 200)
    srv.cluster.complete("s1-a1")
    t.join(30)
    assert result.get("rc") == 0, out.getvalue()
    j = rd.journal()
    assert [(r["attempt"], r["device"]) for r in j if r["event"] == "submitted"] == [(1, "tpu7x-128")]
    assert [(r["event"], r.get("from_device")) for r in j if r["event"] == "resized"] == [
        ("resized", "tpu7x-512")
    ]
    assert srv.cluster.jobset("s1-a1")["metadata"]["labels"]["olmo-ctl/device"] == "tpu7x-128"
    assert overlaps == []


@pytest.mark.gcs
def test_supervisor_refuses_an_impossible_request_and_keeps_its_attempt(supervised):
    from olmo_ctl.supervise.resize import record_request, wait_for_request

    srv, rd, sup, result, overlaps, args, out = supervised
    t = _start(sup, result)
    _wait(lambda: any(r["event"] == "running" for r in rd.journal()), "attempt 1 running", 30)
    req = record_request(rd, "cpu-4", "now")  # a GKE run cannot move to a local device
    rec = wait_for_request(rd, req["id"], 30, poll_s=0.1)
    assert (
        rec["event"] == "resize_refused"
        and "one runs on GKE (a TPU slice or GPU nodes), the other is a local device" in rec["reason"]
    ), rec
    assert rd.pending_resize() is None
    assert srv.cluster.jobset_names() == ["s1-a1"]
    assert not srv.cluster.jobset("s1-a1")["metadata"].get("deletionTimestamp")  # never stopped
    _commit(rd.path, 200)
    srv.cluster.complete("s1-a1")
    t.join(30)
    assert result.get("rc") == 0, out.getvalue()
    assert [r["device"] for r in rd.journal() if r["event"] == "submitted"] == ["tpu7x-512"]


@pytest.mark.gcs
def test_gke_resize_after_an_eviction_removes_the_suspended_attempt_first(gke, capsys):
    """An evicted JobSet is suspended and requeued by Kueue, not gone: left alone it would be admitted
    again next to the resized attempt."""
    srv, rd, be, args = gke
    srv.cluster.evict("s1-a1")
    assert srv.cluster.jobset("s1-a1")["spec"]["suspend"] is True
    t0 = time.monotonic()
    assert _cli("resize", "s1", "--device", "tpu7x-128", "-y", "--timeout", "30", *args) == 0
    assert time.monotonic() - t0 < 20
    assert srv.cluster.jobset_names() == ["s1-a2"]
    assert ("JobSet", "s1-a1", "Foreground") in srv.cluster.deleted
    assert [r["committed_step"] for r in rd.journal() if r["event"] == "resized"] == [100]


def test_resize_asks_on_a_terminal_and_a_no_changes_nothing(tmp_path):
    import os
    import pty
    import subprocess
    import sys

    from olmo_ctl.rundir import RunDir

    root = str(tmp_path / "runs")
    rd = RunDir.of(root, "rq")
    r = load_recipe("smoke")
    rd.create_run(r.to_dict(), r.fingerprint(), "fp", "cpu-4")
    rd.append(
        "submitted",
        attempt=1,
        device="cpu-4",
        backend="local",
        handle={
            "backend": "local",
            "name": "999999",
            "attempt": 1,
            "data": {"pid": 999999, "state_dir": rd.path, "run_dir": rd.path},
        },
    )
    before = rd.journal()
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "olmo_ctl",
            "resize",
            "rq",
            "--device",
            "cpu-2",
            "--backend",
            "local",
            "--run-root",
            root,
        ],
        stdin=slave,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    os.close(slave)
    os.write(master, b"n\n")
    out, err = p.communicate(timeout=60)
    os.close(master)
    assert p.returncode == 130, err
    assert "per_device_batch      2 -> 4" in out
    assert _diff_lines(out, "XLA_FLAGS") == [
        "- XLA_FLAGS: --xla_force_host_platform_device_count=4",
        "+ XLA_FLAGS: --xla_force_host_platform_device_count=2",
    ]
    assert "not resized; nothing changed" in err
    assert rd.journal() == before and rd.read_lease() is None


@pytest.mark.gcs
def test_gke_resize_to_two_slices_and_back_keeps_the_batch_and_records_the_slices(gke, capsys):
    srv, rd, _, args = gke
    assert _cli("resize", "s1", "--device", "tpu7x-128", "--slices", "2", "-y", "--now", *args) == 0
    out = capsys.readouterr().out
    assert "on tpu7x-512 -> attempt 2 on 2 x tpu7x-128" in out
    assert "slices                1 -> 2" in out and "global_batch          512 -> 512 (unchanged)" in out
    js = srv.cluster.jobset("s1-a2")
    assert js["spec"]["replicatedJobs"][0]["replicas"] == 2
    assert _plan_annotation(js) == {
        "global_batch": 512,
        "per_device_batch": 2,
        "grad_accum": 1,
        "devices": 256,
        "slices": 2,
    }
    resized = [r for r in rd.journal() if r["event"] == "resized"][-1]
    assert (resized["from_slices"], resized["slices"]) == (1, 2)
    # the same device and slice count is no resize; without --slices the run keeps its own count
    srv.cluster.admit("s1-a2")
    assert _cli("resize", "s1", "--device", "tpu7x-128", "-y", *args) == 2
    assert "already runs on 2 x tpu7x-128" in capsys.readouterr().err
    assert _cli("resize", "s1", "--device", "tpu7x-256", "-y", *args) == 0  # 2 x tpu7x-256 = 512 devices
    assert "attempt 3 on 2 x tpu7x-256" in capsys.readouterr().out
    assert _cli("resize", "s1", "--device", "tpu7x-256", "--slices", "1", "-y", *args) == 0
    assert srv.cluster.jobset("s1-a4")["spec"]["replicatedJobs"][0]["replicas"] == 1
    assert [
        (r["attempt"], r["device"], r.get("slices")) for r in rd.journal() if r["event"] == "submitted"
    ] == [(1, "tpu7x-512", None), (2, "tpu7x-128", 2), (3, "tpu7x-256", 2), (4, "tpu7x-256", 1)]


@pytest.mark.chaos  # one real trainer to its checkpoint, then the resized attempt stopped: about 30 s
def test_local_resize_at_next_checkpoint_ends_the_attempt_on_that_checkpoint(tmp_path, monkeypatch):
    """`resize --at-next-checkpoint` asks the trainer to stop once its next checkpoint commits: the
    attempt ends on that checkpoint itself (no step past it, no second write), and the resized attempt
    starts from it. Which checkpoint depends on when the request lands (8, or a later one on a busy
    machine); every checkpoint is a multiple of the interval."""
    import os

    from olmo_ctl.backends.local import LocalBackend
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.supervise.smoke import _create_run

    for k in [k for k in os.environ if k.startswith("OLMO_CTL_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    root = str(tmp_path / "runs")
    recipe = load_recipe(
        "smoke", overrides=["train.max_steps=400", "checkpoint.interval=8", "logging.metrics_every=1"]
    )
    be = LocalBackend(root)
    rd = RunDir.of(root, "nc")
    _create_run(rd, recipe, "cpu-1")
    h1 = be.send(be.render(attempt_of(rd, 1, "cpu-1")))
    rd.append("submitted", attempt=1, device="cpu-1", handle=h1.to_dict(), backend="local")
    _wait(lambda: _logged(be, h1) >= 2, "attempt 1 to log step 2")
    local = ["-y", "--backend", "local", "--run-root", root]
    assert _cli("resize", "nc", "--device", "cpu-2", "--at-next-checkpoint", *local) == 0
    log = _log_text(be, h1)
    import re

    m = re.search(r"stop at this checkpoint requested: step (\d+) is the attempt's last", log)
    assert m, log[-2000:]
    n = int(m.group(1))
    assert n % 8 == 0 and n < 400
    assert log.rstrip().endswith(f"committed step {n}") and _logged(be, h1) == n, log[-2000:]
    steps = rd.committed_steps()
    assert max(steps) == n and all(s % 8 == 0 for s in steps)  # no write of a step past it
    assert [r["committed_step"] for r in rd.journal() if r["event"] == "resized"] == [n]
    assert not Path(rd.path, "stop_at_checkpoint.json").exists()
    h2 = _submitted(rd)[2]
    _wait(lambda: f"restored checkpoint {n}" in _log_text(be, h2), f"attempt 2 to restore checkpoint {n}")
    be.stop(h2)
