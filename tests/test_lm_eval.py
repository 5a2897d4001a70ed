"""OLMo-core's LM evaluator (`eval.lm`): one padded instance per document, per-label CE loss and PPL
over the whole set, split over hosts, logged under OLMo-core's tag names; a bad `eval.lm` is exit 2.

The instances and the loss are checked against straightforward re-implementations of OLMo-core's rules
(`NumpyPaddedFSLDataset`, `get_labels`, `LMEvaluator` with `MeanMetric`); the evaluator runs the real
jitted step on the 8 host CPU devices of the test process, with the smoke model."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from olmo_ctl.core.batching import make_plan
from olmo_ctl.core.devices import get_device
from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.data.files import TokenFile
from olmo_ctl.data.mixes import load_mix, mix_paths
from olmo_ctl.trainer import lm_eval as L

EOS, PAD, T = 256, 257, 16  # the smoke model's byte tokenizer; a short sequence
SETS = [f"train.seq_len={T}", "model.sliding_window=8", "eval.batch_size=8", "eval.micro_batch=8"]


def _write(path: Path, docs: list[list[int]], tail: list[int] = ()) -> Path:
    """Documents each ended by EOS, then `tail` (tokens after the last EOS: no document)."""
    toks = [t for d in docs for t in [*d, EOS]] + list(tail)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.asarray(toks, "<u4").tofile(path)
    return path


def _docs(rng, lengths) -> list[list[int]]:
    return [rng.integers(0, 250, n).tolist() for n in lengths]


def _olmo_core_instances(tokens: np.ndarray, seq_len: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """OLMo-core's padded FSL instances, written out plainly: (input_ids, label_mask, labels) per document."""
    out, doc = [], []
    for t in tokens.tolist():
        doc.append(t)
        if t == EOS:  # a document ends with (and holds) its EOS
            kept = doc[:seq_len]  # truncated to the sequence length
            ids = np.array(kept + [PAD] * (seq_len - len(kept)))
            mask = np.array([True] * len(kept) + [False] * (seq_len - len(kept)))
            labels = np.where(mask, ids, -100)  # get_labels: masked, shifted left, last ignored
            out.append((ids, mask, np.append(labels[1:], -100)))
            doc = []
    return out  # a tail without EOS is no document


def test_instances_are_olmo_cores_padded_documents(tmp_path):
    rng = np.random.default_rng(0)
    # shorter than T, longer than T (truncated), exactly T with its EOS, only an EOS, then a tail
    path = _write(tmp_path / "a.npy", _docs(rng, [5, 40, T - 1, 0, 9]), tail=[7, 8, 9])
    f = TokenFile(str(path), "a.npy", path.stat().st_size)
    data = L.LMEvalData([L.LabelledFiles("a", (f,))], T, EOS, PAD, vocab_size=258)
    want = _olmo_core_instances(np.fromfile(path, "<u4"), T)
    assert len(data) == len(want) == 5
    got = data.batch(range(len(data)), rows=7)  # two padding rows after the five instances
    for r, (ids, mask, labels) in enumerate(want):
        assert got["input_ids"][r].tolist() == ids.tolist()
        assert got["labels"][r].tolist() == labels.tolist()
        assert got["weight"][r] == mask.sum()  # OLMo-core's denominator: the label-mask positions
    assert got["weight"].tolist()[:5] == [6, T, T, 1, 10]
    assert (got["labels"][5:] == -100).all() and got["label_index"].tolist() == [0] * 5 + [-1, -1]
    assert got["weight"][5:].tolist() == [0, 0]


def test_a_file_without_a_document_is_refused(tmp_path):
    path = _write(tmp_path / "x.npy", [], tail=[1, 2, 3])
    f = TokenFile(str(path), "x.npy", path.stat().st_size)
    with pytest.raises(BadInput, match=r"eval.lm `c4`: .* holds no document \(no EOS token 256\)"):
        L.LMEvalData([L.LabelledFiles("c4", (f,))], T, EOS, PAD)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 13, 1000])
@pytest.mark.parametrize("n_proc", [1, 2, 3, 8])
def test_every_instance_is_evaluated_by_exactly_one_host(n, n_proc):
    shares = [L.host_share(n, p, n_proc) for p in range(n_proc)]
    assert sorted(i for s in shares for i in s) == list(range(n))
    assert max(len(s) for s in shares) - min(len(s) for s in shares) <= 1
    for rows in (1, 4, 8):
        steps = L.steps_per_eval(n, n_proc, rows)
        assert all(len(s) <= steps * rows for s in shares)  # every host's share fits its steps
        assert steps == 0 or max(len(s) for s in shares) > (steps - 1) * rows  # and no step is wasted


def _setup(recipe, proc: int = 0, n_proc: int = 1, activate: bool = False):
    """What the evaluator reads of the trainer's set-up. `activate`: the mesh constrains activations
    until `sharding.deactivate()` (the process-wide state every later test in this worker would see)."""
    import jax

    from olmo_ctl.trainer import sharding as S

    plan = make_plan(recipe, get_device("cpu-8"))
    mesh = S.make_mesh(jax.devices()[:8], seq_shards=plan.seq_shards, activate=activate)
    return SimpleNamespace(recipe=recipe, plan=plan, mesh=mesh, proc=proc, n_proc=n_proc, local_devices=8)


@pytest.fixture(scope="module")
def two_sets(tmp_path_factory):
    """Two labels: 7 documents in two files (one longer than T), and 6 in one; 13 instances in all."""
    root = tmp_path_factory.mktemp("lm")
    rng = np.random.default_rng(1)
    _write(root / "c4" / "0.npy", _docs(rng, [3, 30, 8]))
    _write(root / "c4" / "1.npy", _docs(rng, [15, 1, 6, 11]), tail=[4, 4])
    _write(root / "wiki" / "0.npy", _docs(rng, [2, 20, 9, 9, 5, 14]))
    sets = (
        "eval.lm.sets=[{label: c4, files: ['{root}/c4/*.npy']}, {label: wiki, files: ['{root}/wiki/*.npy']}]"
    )
    return load_recipe("smoke", overrides=[*SETS, f"data.root={root}", sets, "eval.lm.interval=2"])


def _direct_losses(recipe, params, instances) -> dict[str, float]:
    """Per label: sum of each instance's token CE (float64 from the logits of a one-row forward) over its
    targets, divided by the sum of its document lengths (OLMo-core's MeanMetric over label_mask)."""
    import jax

    from olmo_ctl.trainer.model import forward

    data = L.LMEvalData(L.resolve_sets(recipe), T, EOS, PAD)
    fwd = jax.jit(lambda p, x: forward(p, x, recipe.model))
    ce = {x: 0.0 for x in data.labels}
    weight = {x: 0 for x in data.labels}
    for i in instances:
        b = data.batch([i], rows=1)
        logits = np.asarray(fwd(params, b["input_ids"]), np.float64)[0]
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        y = b["labels"][0]
        label = data.labels[data.label_index[i]]
        ce[label] += float(-logp[np.arange(T), np.where(y < 0, 0, y)][y >= 0].sum())
        weight[label] += int((b["input_ids"][0] != PAD).sum())  # no PAD inside these documents
    return {x: ce[x] / weight[x] for x in data.labels}


@pytest.mark.parametrize("seq_shards,whole_batches_of", [(1, 0), (2, 0), (1, 4)])
def test_per_label_loss_equals_the_direct_computation(two_sets, seq_shards, whole_batches_of):
    """On 8 devices: 8 data-parallel rows, or 4 rows of sequences split over 2 devices each; every
    instance, or the 12 of 13 that OLMo-core's loader reads in whole batches of 4."""
    import dataclasses

    import jax

    from olmo_ctl.trainer import model as M
    from olmo_ctl.trainer import sharding as S

    recipe = dataclasses.replace(
        two_sets,
        train=dataclasses.replace(two_sets.train, seq_shards=seq_shards),
        eval=dataclasses.replace(
            two_sets.eval, lm=dataclasses.replace(two_sets.eval.lm, whole_batches_of=whole_batches_of)
        ),
    )
    params = M.init_params(two_sets.model, jax.random.PRNGKey(0))
    s = _setup(recipe, activate=True)
    try:
        assert s.plan.seq_shards == seq_shards
        ev = L.LMEvaluator.for_recipe(s)
        assert ev is not None and len(ev.data) == 13 and ev.steps == 2  # 13 instances, 8 rows a step
        assert len(ev.instances) == (12 if whole_batches_of else 13)
        with jax.set_mesh(s.mesh):
            got = ev.evaluate(jax.device_put(params, S.replicated(s.mesh)))
            again = ev.evaluate(jax.device_put(params, S.replicated(s.mesh)))
    finally:
        S.deactivate()
    assert got == again  # deterministic
    want = _direct_losses(two_sets, params, L.evaluated_instances(13, whole_batches_of).tolist())
    assert sorted(got) == ["eval/lm/c4/CE loss", "eval/lm/c4/PPL", "eval/lm/wiki/CE loss", "eval/lm/wiki/PPL"]
    for label, loss in want.items():
        assert got[f"eval/lm/{label}/CE loss"] == pytest.approx(loss, rel=2e-6)
        assert got[f"eval/lm/{label}/PPL"] == pytest.approx(math.exp(loss), rel=1e-5)


def test_two_hosts_read_disjoint_shares_that_cover_the_set(two_sets):
    """The split as two processes make it (each its own share, the same number of eval steps)."""
    import jax

    hosts = []
    for p in range(2):
        ev = L.LMEvaluator(L.LMEvalData(L.resolve_sets(two_sets), T, EOS, PAD), _setup(two_sets, p, 2))
        assert ev.rows_per_proc == 4 and ev.steps == 2  # shares of 6 and 7 instances in 4-row halves
        assert set(ev.data._cache) == set(ev.data.file_index[ev.share].tolist())  # only its files read
        hosts.append([b for b in ev.host_batches()])
    jax.clear_caches()
    rows = [
        (tuple(b["input_ids"][r]), int(b["label_index"][r]))
        for h in hosts
        for b in h
        for r in range(len(b["weight"]))
        if b["weight"][r]
    ]
    whole = L.LMEvalData(L.resolve_sets(two_sets), T, EOS, PAD).batch(range(13), rows=13)
    assert sorted(rows) == sorted(
        (tuple(whole["input_ids"][r]), int(whole["label_index"][r])) for r in range(13)
    )


def test_whole_batches_of_keeps_what_olmo_cores_eval_loader_reads():
    """NumpyFSLDataLoader's global indices: `get_rng(seed + epoch).shuffle(arange(n))` with seed 0 and
    epoch 1, cut to `instances_per_batch * (n // instances_per_batch)`."""
    n, b = 1003, 64
    order = np.arange(n, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(seed=1)).shuffle(order)
    want = sorted(order[: n // b * b].tolist())
    got = L.evaluated_instances(n, b)
    assert got.tolist() == want and len(got) == 960
    assert L.evaluated_instances(n, 0).tolist() == list(range(n))  # the default: every instance
    assert L.evaluated_instances(10, 64).tolist() == []


def test_instances_are_numbered_in_file_order_with_labels_by_file(tmp_path):
    """A label may come back after another (OLMo-core numbers its dataset file by file)."""
    rng = np.random.default_rng(2)
    files = [_write(tmp_path / f"{i}.npy", _docs(rng, [3] * (i + 1))) for i in range(3)]
    sets = [
        L.LabelledFiles(x, (TokenFile(str(f), f.name, f.stat().st_size),))
        for x, f in zip("aba", files, strict=True)
    ]
    data = L.LMEvalData(sets, T, EOS, PAD)
    assert data.labels == ["a", "b"]
    assert data.file_index.tolist() == [0, 1, 1, 2, 2, 2]
    assert data.label_index.tolist() == [0, 1, 1, 0, 0, 0]


def test_the_validation_mix_is_olmo_cores_and_its_tags_are_olmo_cores_names():
    entries = load_mix("v3-small-ppl-validation")
    assert [e.label for e in entries] == [
        f"{x}-validation"
        for x in (
            "c4_en",
            "dolma_books",
            "dolma_common-crawl",
            "dolma_pes2o",
            "dolma_reddit",
            "dolma_stack",
            "dolma_wiki",
            "ice",
            "m2d2_s2orc",
            "pile",
            "wikitext_103",
        )
    ]
    # As OLMo-core's src/test/data/mixes_test.py builds it for the dolma2 tokenizer.
    assert mix_paths("v3-small-ppl-validation", "s3://ai2-llm")[0] == (
        "s3://ai2-llm/eval-data/perplexity/v3_small_dolma2-tokenizer/c4_en/val/part-0-00000.npy"
    )
    values = L.per_label_metrics([e.label for e in entries[:2]], [2.0, 3.0], [1.0, 2.0])
    assert values == {
        "eval/lm/c4_en-validation/CE loss": 2.0,
        "eval/lm/c4_en-validation/PPL": math.exp(2.0),
        "eval/lm/dolma_books-validation/CE loss": 1.5,
        "eval/lm/dolma_books-validation/PPL": math.exp(1.5),
    }


def test_the_hook_logs_olmo_cores_tags_every_interval(capsys):
    from olmo_ctl.trainer import hooks as H

    logged = []
    evaluator = L.LMEvaluator.__new__(L.LMEvaluator)  # its set and its sums, without a mesh
    evaluator.data, evaluator.interval = SimpleNamespace(labels=["c4_en-validation"]), 10
    evaluator.sums = lambda params: ([6.0], [2.0])
    hook = H.EvaluatorHook([evaluator])
    loop = SimpleNamespace(
        step=10,
        state={"params": None},
        s=SimpleNamespace(proc=0),
        flush=lambda: logged.append("flush"),
        watchdog=SimpleNamespace(paused=__import__("contextlib").nullcontext),
        events=SimpleNamespace(scalars=lambda step, values: logged.append((step, values))),
    )
    hook.post_step(loop)
    loop.step = 15
    hook.post_step(loop)  # not an eval step
    assert logged == [
        "flush",
        (10, {"eval/lm/c4_en-validation/CE loss": 3.0, "eval/lm/c4_en-validation/PPL": math.exp(3.0)}),
    ]
    assert "eval step 10 lm c4_en-validation 3.0000" in capsys.readouterr().out
    assert L.LMEvaluator.for_recipe(SimpleNamespace(recipe=load_recipe("smoke"))) is None  # no eval.lm
    assert H.EvaluatorHook([]).post_step(loop) is None  # no evaluator: nothing


def test_stage_1_evaluates_on_the_validation_mix_every_10000_steps_as_ai2_did():
    for name in ("olmo3-7b-stage1", "olmo3-7b-stage1-cosine"):
        lm = load_recipe(name).eval.lm
        assert (lm.mix, lm.sets, lm.interval) == ("v3-small-ppl-validation", (), 10000)
    for stage in (2, 3):  # AI2's midtrain and long-context scripts run no LM evaluator
        lm = load_recipe(stage=stage).eval.lm
        assert not lm.enabled and lm.interval == 10000
    assert not load_recipe("smoke").eval.lm.enabled


def test_the_mix_needs_its_files_under_data_root(tmp_path):
    r = load_recipe("smoke", overrides=[f"data.root={tmp_path}", "eval.lm.mix=v3-small-ppl-validation"])
    with pytest.raises(
        BadInput, match=r"eval.lm.mix `v3-small-ppl-validation`: .*c4_en/val/part-0-00000.npy` does"
    ):
        L.resolve_sets(r)
    for p in mix_paths("v3-small-ppl-validation", str(tmp_path)):
        _write(Path(p), [[1, 2]])
    sets = L.resolve_sets(r)
    assert [s.label for s in sets][:2] == ["c4_en-validation", "dolma_books-validation"]
    assert all(len(s.files) == 1 for s in sets) and len(sets) == 11


@pytest.mark.parametrize(
    "sets,message",
    [
        (["eval.lm.mix=v3-small"], "`eval.lm.mix` must be one of v3-small-ppl-validation"),
        (["eval.lm.mix=OLMo-mix-0625-official"], "`eval.lm.mix` must be one of v3-small-ppl-validation"),
        (
            ["eval.lm.sets=[{label: c4}]"],
            "`eval.lm.sets[0].files` must list at least one token file for label 'c4'",
        ),
        (["eval.lm.sets=[{files: [x.npy]}]"], "`eval.lm.sets[0].label` must name the set"),
        (
            ["eval.lm.sets=[{label: a, files: [x]}, {label: a, files: [y]}]"],
            "`eval.lm.sets[1].label` 'a' is given twice",
        ),
        (
            ["eval.lm.mix=v3-small-ppl-validation", "eval.lm.sets=[{label: a, files: [x]}]"],
            "`eval.lm.sets` must be empty when eval.lm.mix is set",
        ),
        (["eval.lm.interval=0"], "`eval.lm.interval` must be positive"),
        (["eval.lm.whole_batches_of=-1"], "`eval.lm.whole_batches_of` must be >= 0"),
    ],
)
def test_a_bad_eval_lm_is_one_error_line_and_exit_2_at_recipe_load(sets, message, tmp_path):
    from helpers.cli import clean_env, invoke

    args = ["plan", "--recipe", "smoke", "--device", "cpu-1"]
    for s in sets:
        args += ["--set", s]
    p = invoke(*args, env=clean_env(tmp_path))
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    errors = [line for line in p.stderr.splitlines() if not line.startswith("note: ")]
    assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], p.stderr


LM_SETS = "eval.lm.sets=[{label: smoke_eval, files: ['{root}/eval/*.npy']}]"


@pytest.mark.chaos  # a trainer process: about 20 s
def test_the_trainer_logs_the_lm_evaluator_at_its_interval(tmp_path):
    """A real trainer process (smoke recipe, cpu-1) with `eval.lm` over the smoke held-out files: the
    tags at steps 2 and 4, next to `eval/lm_loss`, and the evaluator's log line."""
    from helpers.trainer import scalars, train

    p = train(tmp_path / "run", "--stop-at-step", "4", "--set", LM_SETS, "--set", "eval.lm.interval=2")
    assert "eval step 2 lm smoke_eval " in p.stdout and "eval step 4 lm smoke_eval " in p.stdout
    got = scalars(tmp_path / "run")
    ce, ppl = got["eval/lm/smoke_eval/CE loss"], got["eval/lm/smoke_eval/PPL"]
    assert sorted(ce) == sorted(ppl) == [2, 4]
    assert ce[4] < ce[2] and ppl[2] == pytest.approx(math.exp(ce[2]), rel=1e-5)


@pytest.mark.chaos  # a trainer and a two-host twin: about a minute
def test_two_hosts_log_the_one_host_losses(tmp_path):
    """The multi-host twin (2 processes x 2 devices): each host evaluates its share, both read the
    slice's sums; the logged losses are the one-device run's (to fp32 rounding of the trained params)."""
    from helpers.trainer import scalars, train
    from test_multihost import host_codes, start, wait_ended

    sets = ("--set", LM_SETS, "--set", "eval.lm.interval=2")
    train(tmp_path / "one", "--stop-at-step", "2", *sets)
    backend, h = start(tmp_path, "cpu-2x2", 100, "--stop-at-step", "2", *sets, run="two")
    assert wait_ended(backend, h, 300) and host_codes(backend, h) == [0, 0]
    one, two = (scalars(tmp_path / r)["eval/lm/smoke_eval/CE loss"][2] for r in ("one", "two"))
    assert float(two) == pytest.approx(float(one), rel=1e-5)


def test_a_token_outside_the_vocab_is_refused_when_the_share_is_read(tmp_path):
    path = _write(tmp_path / "a.npy", [[1, 2, 300]])
    f = TokenFile(str(path), "a.npy", path.stat().st_size)
    data = L.LMEvalData([L.LabelledFiles("a", (f,))], T, EOS, PAD, vocab_size=258)
    with pytest.raises(
        BadInput, match=r"eval.lm `a`: .*a.npy` holds token id 300, outside the model's vocab"
    ):
        data.cache_share(range(1))
