"""AI2's downstream evaluator (`eval.downstream`): ai2-olmo-eval's task instances, scored by our model on
the mesh, aggregated to what `olmo_eval.ICLMetric` computes from the same model's full logits.

The reference is ai2-olmo-eval itself (the eval extra): its `collate_fn` batches, `ICLMetric.update`
with the model's full logits over each batch, `ICLMetric.compute()`. The model is a tiny OLMo-3-shaped
one over the GPT-NeoX tokenizer ai2-olmo-eval ships (50,280 tokens), so the fast multiple-choice tasks,
whose choices must be one token each, build as they do for AI2."""

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
from olmo_ctl.trainer import downstream as D

olmo_eval = pytest.importorskip("olmo_eval", reason="the eval extra (ai2-olmo-eval) is not installed")

T = 128
NEOX_EOS, NEOX_PAD = 50279, 1  # OLMo-core's TokenizerConfig.gpt_neox_olmo_dolma_v1_5()
NEOX = [
    "model.vocab_size=50280",
    "model.padded_vocab_size=50304",
    f"model.eos_token_id={NEOX_EOS}",
    f"model.pad_token_id={NEOX_PAD}",
]
# One task of each kind: fast multiple-choice (len_norm), ranked classification (acc; len_norm), BPB.
TASKS = {
    "mmlu_stem_test_mc_5shot_fast": "len_norm",
    "copycolors_10way_fast": "acc",
    "basic_skills_arithmetic_rc_5shot": "acc",
    "arc_challenge_rc_0shot": "len_norm",
    "hellaswag_bpb_5shot": "bpb",
}
DOCS = 24  # the first documents of each task: enough for every metric, quick on the CPU


def _neox_path() -> str:
    return str(Path(olmo_eval.__file__).parent / "tokenizers" / "allenai_gpt-neox-olmo-dolma-v1_5.json")


@pytest.fixture(scope="module")
def neox():
    """The recipe (smoke shape, NeoX vocabulary), its tokenizer, params and each task's first documents."""
    import jax

    from olmo_ctl.trainer import model as M

    recipe = load_recipe(
        "smoke",
        overrides=[*NEOX, f"train.seq_len={T}", "eval.batch_size=8", f"data.tokenizer={_neox_path()}"],
    )
    tok = D.load_tokenizer(recipe.data.tokenizer, recipe.model)
    params = M.init_params(recipe.model, jax.random.PRNGKey(3))
    tasks = {}
    for label in TASKS:
        task = olmo_eval.build_task(label, tok, model_ctx_len=T)
        docs = sorted({int(task[i]["doc_id"]) for i in range(len(task))})[:DOCS]
        keep = [i for i in range(len(task)) if int(task[i]["doc_id"]) in set(docs)]
        tasks[label] = (task, keep)
    return SimpleNamespace(recipe=recipe, tok=tok, params=params, tasks=tasks)


def _setup(recipe, proc=0, n_proc=1, devices=8):
    import jax

    from olmo_ctl.trainer import sharding as S

    plan = make_plan(recipe, get_device(f"cpu-{devices}"))
    mesh = S.make_mesh(jax.devices()[:devices], seq_shards=plan.seq_shards)
    return SimpleNamespace(
        recipe=recipe, plan=plan, mesh=mesh, proc=proc, n_proc=n_proc, local_devices=devices // n_proc
    )


def _icl_metric_reference(recipe, params, task, keep) -> dict[str, float]:
    """ai2-olmo-eval's own numbers: its collate_fn batches of the kept instances, ICLMetric.update with
    the model's full logits of each batch's input_ids, ICLMetric.compute()."""
    import jax
    import torch

    from olmo_ctl.trainer.model import forward

    fwd = jax.jit(lambda p, x: forward(p, x, recipe.model))
    metric = olmo_eval.ICLMetric(metric_type=task.metric_type)
    for k in range(0, len(keep), 8):
        batch = task.collate_fn([task[i] for i in keep[k : k + 8]])
        logits = np.asarray(fwd(params, batch["input_ids"].numpy().astype(np.int32)))
        metric.update(batch, torch.from_numpy(logits))
    return {k: float(v) for k, v in metric.compute().items()}


def test_the_metrics_equal_icl_metrics_for_the_same_model_and_tasks(neox):
    """For a fast-MC, two ranked-classification and a BPB task: our on-mesh scores (only continuation
    positions leave the device) aggregated by `icl_metrics` equal ICLMetric's within 1e-5."""
    import jax

    from olmo_ctl.trainer import sharding as S

    s = _setup(neox.recipe)
    evaluator = D.DownstreamEvaluator([], s)
    params = jax.device_put(neox.params, S.replicated(s.mesh))
    for label, (task, keep) in neox.tasks.items():
        assert task.metric_type == TASKS[label]
        ts = D.TaskSet.from_instances(label, task.metric_type, [task[i] for i in keep])
        assert ts.fast_mc == label.endswith("_fast")
        with jax.set_mesh(s.mesh):
            got = D.icl_metrics(ts, *evaluator.scores(params, ts))
        want = _icl_metric_reference(neox.recipe, neox.params, task, keep)
        assert sorted(k for k in got if k != "stderr") == sorted(want), label
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-5), (label, k)
        assert got["stderr"] > 0 or label.startswith("copycolors")  # an untrained model may be always wrong


LONG = 512  # rows of 22 to 424 tokens
LONG_TASKS = ("arc_challenge_rc_0shot", "arc_easy_test_bpb_5shot", "arc_challenge_test_mc_5shot_fast")
LONG_DOCS = 12


@pytest.fixture(scope="module")
def neox_long(neox):
    """The same model at seq_len 512, with three tasks whose queries are 22 to 424 tokens long."""
    import dataclasses

    recipe = dataclasses.replace(neox.recipe, train=dataclasses.replace(neox.recipe.train, seq_len=LONG))
    tasks = {}
    for label in LONG_TASKS:
        task = olmo_eval.build_task(label, neox.tok, model_ctx_len=LONG)
        docs = list(dict.fromkeys(int(task[i]["doc_id"]) for i in range(len(task))))[:LONG_DOCS]
        tasks[label] = (task, [i for i in range(len(task)) if int(task[i]["doc_id"]) in set(docs)])
    return SimpleNamespace(recipe=recipe, params=neox.params, tasks=tasks)


def test_rows_padded_to_their_steps_longest_keep_icl_metrics(neox_long):
    """At seq_len 512, rows sorted by length and padded to the shortest of 128, 256, 384, 512 that holds
    each step's longest (ai2-olmo-eval's collate_fn pads its batch to the longest rounded up to 128):
    ICLMetric's numbers within 1e-5, from well under the tokens of full-length rows."""
    import jax

    from olmo_ctl.trainer import sharding as S

    s = _setup(neox_long.recipe)
    evaluator = D.DownstreamEvaluator([], s)
    params = jax.device_put(neox_long.params, S.replicated(s.mesh))
    widths, tokens, full = set(), 0, 0
    for label, (task, keep) in neox_long.tasks.items():
        ts = D.TaskSet.from_instances(label, task.metric_type, [task[i] for i in keep])
        plan = evaluator.plan(ts)
        lengths = ts.query_lengths()
        assert sorted(np.concatenate([idx for idx, _ in plan]).tolist()) == list(range(len(ts)))
        for idx, width in plan:
            longest = int(lengths[idx].max())
            assert width == min(n for n in D.row_lengths(LONG) if n >= longest)
            widths.add(width)
            tokens += evaluator.rows_per_proc * width
        full += len(plan) * evaluator.rows_per_proc * LONG
        with jax.set_mesh(s.mesh):
            got = D.icl_metrics(ts, *evaluator.scores(params, ts))
        want = _icl_metric_reference(neox_long.recipe, neox_long.params, task, keep)
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-5), (label, k)
    assert {128, 256, 512} <= widths  # rows of several lengths, each compiled once
    assert tokens < 0.6 * full


def test_row_lengths_are_few_multiples_of_128_and_steps_take_rows_by_length():
    assert D.row_lengths(8192) == [128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert D.row_lengths(128) == [128] and D.row_lengths(1000) == [128, 256, 384, 512, 768, 1000]
    assert D.row_lengths(2048, 256) == [256, 512, 768, 1024, 1536, 2048]  # multiples of 256
    lengths = np.array([300, 5, 129, 40, 128, 600, 5])
    plan = D.batch_plan(lengths, 3, 1024)
    assert [(idx.tolist(), w) for idx, w in plan] == [([1, 6, 3], 128), ([4, 2, 0], 384), ([5], 768)]
    full = D.batch_plan(lengths, 3, 1024, pad_to_seq_len=True)
    assert [w for _, w in full] == [1024] * 3 and all(
        (a[0] == b[0]).all() for a, b in zip(plan, full, strict=True)
    )


def test_icl_metrics_follow_iclmetric_on_duplicates_and_ties():
    """ICLMetric's bookkeeping, on hand-made values: the first value of a repeated (doc, continuation)
    wins; the first of tied maxima is the prediction; acc and len_norm divide as documented."""
    base = dict(ctx="", query=[1, 2], ctx_len=1, cont_len=1, dc_len=1, dc_query=[1])
    inst = []
    for doc, cont, label in [(0, 0, 1), (0, 1, 1), (0, 1, 1), (1, 0, 0), (1, 1, 0)]:
        inst.append(
            dict(
                base,
                doc_id=doc,
                cont_id=cont,
                label_id=label,
                continuation=[5],
                cont_str_len=2 + cont,
                cont_byte_len=2 + cont,
                cont_str_len_no_leading_space=1 + cont,
                cont_byte_len_no_leading_space=1 + cont,
            )
        )
    ts = D.TaskSet.from_instances("t", "acc", inst)
    ll = np.array([-2.0, -1.0, -0.1, -3.0, -3.0], np.float32)  # doc 0: first (-1.0) counts, not -0.1
    got = D.icl_metrics(ts, ll, np.zeros((5, 1), np.float32))
    assert got["acc_v1"] == 1.0  # doc 0 predicts 1 (=label); doc 1 ties, predicts 0 (=label)
    assert got["ce_loss_v2"] == pytest.approx((1.0 / 3 + 3.0 / 2) / 2)  # each doc's gold continuation
    assert got["stderr"] == 0.0
    ts_ln = D.TaskSet.from_instances("t", "len_norm", inst)
    got_ln = D.icl_metrics(ts_ln, ll, np.zeros((5, 1), np.float32))
    assert (
        got_ln["len_norm_v1"] == 0.5
    )  # per character: doc 0 [-1, -1/3] -> 1 (its label); doc 1 [-1.5, -1] -> 1, not 0


def test_mean_stderr_is_lm_eval_harness_formula():
    x = [1.0, 0.0, 1.0, 1.0]
    assert D.mean_stderr(x) == pytest.approx(np.std(x, ddof=1) / 2)
    assert math.isnan(D.mean_stderr([1.0]))


def test_tags_are_olmo_cores_names():
    tags = D.tagged({"arc_easy_test_mc_5shot_fast": {"len_norm_v1": 0.3, "bpb_v1": 1.2, "stderr": 0.01}})
    assert tags == {
        "eval/downstream/arc_easy_test_mc_5shot_fast (length-normalized accuracy)": 0.3,
        "eval/downstream/arc_easy_test_mc_5shot_fast (BPB)": 1.2,
    }


def test_the_bytes_tokenizer_is_the_smoke_models_bytes(tmp_path):
    from tokenizers import Tokenizer

    text = "Question: 2+2=?\nAnswer: 4 — ünïcode\t"
    tok = Tokenizer.from_file(D.tokenizer_path(D.BYTES_TOKENIZER, str(tmp_path)))
    assert tok.encode(text).ids == list(text.encode())
    assert tok.decode(list(text.encode())) == text
    assert tok.token_to_id("<|endoftext|>") == 256 and tok.token_to_id("<|pad|>") == 257


def test_a_fast_mc_task_with_multi_token_choices_is_one_clear_error():
    recipe = load_recipe("smoke")
    tok = D.load_tokenizer(D.BYTES_TOKENIZER, recipe.model)
    with pytest.raises(BadInput, match="fast multiple-choice task needs each choice to be one token"):
        D.build_task_set("copycolors_10way_fast", tok, 128)
    with pytest.raises(BadInput, match=r"continuations are longer than the sequence length 128"):
        D.build_task_set("codex_humaneval_gold_bpb_3shot", tok, 128)
    ts = D.build_task_set("copycolors_10way", tok, 128)  # the ranked form of the first builds
    assert len(ts) and not ts.fast_mc and max(len(q) for q in ts.query) <= 128


@pytest.mark.parametrize(
    "sets,message",
    [
        (["data.tokenizer=''", "eval.downstream=[arc_easy_test_mc_5shot_fast]"], "data.tokenizer"),
        (["data.tokenizer=builtin://bytes", "eval.downstream=[a, a]"], "names a task twice"),
        (["data.tokenizer=builtin://bytes", "eval.downstream={tasks: [x], interval: 0}"], "must be positive"),
    ],
)
def test_a_bad_eval_downstream_is_refused_at_recipe_load(sets, message):
    with pytest.raises(BadInput, match=message):
        load_recipe("smoke", overrides=sets)


def test_unknown_tasks_and_missing_tokenizers_are_one_clear_error(tmp_path):
    with pytest.raises(BadInput, match="unknown downstream task 'arc_easy_mc_fast'"):
        D.check_tasks(["arc_easy_test_mc_5shot_fast", "arc_easy_mc_fast"])
    with pytest.raises(BadInput, match=r"tokenizer '.*nope': no .*nope/tokenizer.json"):
        D.tokenizer_path(str(tmp_path / "nope"))


def test_stage_1_carries_ai2s_downstream_tasks_every_10000_steps():
    ds = load_recipe("olmo3-7b-stage1").eval.downstream
    assert ds.tasks == D.OLMO3_PRETRAIN_TASKS and len(ds.tasks) == 26 and ds.interval == 10000
    D.check_tasks(ds.tasks)  # every label is one ai2-olmo-eval builds
    assert not load_recipe("smoke").eval.downstream.tasks


@pytest.mark.chaos  # a trainer process: about 30 s
def test_the_trainer_logs_olmo_cores_downstream_tags_at_its_interval(tmp_path):
    """A real trainer process (smoke recipe, cpu-1, the bytes tokenizer) with two ranked-classification
    tasks every 2 steps: OLMo-core's tags at steps 2 and 4 (accuracy, BPB, ...), the evaluator's line."""
    from helpers.trainer import scalars, train

    tasks = "eval.downstream={tasks: [copycolors_10way, basic_skills_pattern_rc_5shot], interval: 2}"
    p = train(
        tmp_path / "run", "--stop-at-step", "4", "--set", "data.tokenizer=builtin://bytes", "--set", tasks
    )
    assert "eval step 2 downstream copycolors_10way " in p.stdout and "eval step 4 downstream " in p.stdout
    got = scalars(tmp_path / "run")
    acc = got["eval/downstream/copycolors_10way (accuracy)"]
    bpb = got["eval/downstream/basic_skills_pattern_rc_5shot (BPB)"]
    assert sorted(acc) == sorted(bpb) == [2, 4]
    assert 0.0 <= acc[4] <= 1.0 and bpb[4] < bpb[2]  # the model learns bytes: BPB falls
    assert "eval/downstream/basic_skills_pattern_rc_5shot (accuracy)" in got


@pytest.mark.chaos  # a trainer process
def test_a_trainer_without_its_tokenizer_file_stops_at_start_with_exit_2(tmp_path):
    from helpers.trainer import train

    p = train(
        tmp_path / "run",
        "--stop-at-step",
        "1",
        "--set",
        f"data.tokenizer={tmp_path / 'missing'}",
        "--set",
        "eval.downstream=[copycolors_10way]",
        expect=2,
    )
    assert "no " in p.stderr and "tokenizer.json" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


@pytest.mark.chaos  # a trainer and a two-host twin: about a minute
def test_two_hosts_log_the_one_host_metrics(tmp_path):
    """The multi-host twin (2 processes x 2 devices): each host scores its share of every task, every
    row comes back with its instance index; the logged metrics are the one-device run's (to fp32
    rounding of the trained params)."""
    from helpers.trainer import scalars, train
    from test_multihost import host_codes, start, wait_ended

    sets = (
        "--set",
        "data.tokenizer=builtin://bytes",
        "--set",
        "eval.downstream={tasks: [copa], interval: 2}",
    )
    train(tmp_path / "one", "--stop-at-step", "2", *sets)
    backend, h = start(tmp_path, "cpu-2x2", 100, "--stop-at-step", "2", *sets, run="two")
    assert wait_ended(backend, h, 300) and host_codes(backend, h) == [0, 0]
    one, two = (scalars(tmp_path / r) for r in ("one", "two"))
    for metric in ("accuracy", "BPB", "CE loss", "soft loss"):
        tag = f"eval/downstream/copa ({metric})"
        assert float(two[tag][2]) == pytest.approx(float(one[tag][2]), rel=1e-5), tag


@pytest.mark.gcs
def test_a_tokenizer_directory_on_gcs_is_read_once_into_the_cache(gcs, tmp_path):
    from olmo_ctl import storage

    text = D.bytes_tokenizer_json()
    url = f"gs://{gcs.bucket}/tokenizers/bytes"
    storage.store_for(url).write_text(f"{url}/tokenizer.json", text)
    local = D.tokenizer_path(url, str(tmp_path / "cache"))
    assert Path(local).read_text() == text and Path(local).parent == tmp_path / "cache"
    recipe = load_recipe(
        "smoke", overrides=["data.tokenizer={root}/tokenizers/bytes", f"data.root=gs://{gcs.bucket}/"]
    )
    assert D.tokenizer_spec(recipe) == url
    with pytest.raises(BadInput, match=r"no gs://.*/nothing/tokenizer.json"):
        D.tokenizer_path(f"gs://{gcs.bucket}/nothing", str(tmp_path / "cache"))


def test_a_built_task_round_trips_through_the_run_directory_cache(tmp_path):
    """A task kept by process 0 reads back equal, field by field; another process does not write; a
    torn file is built again; another tokenizer or sequence length is another file."""
    import dataclasses

    recipe = load_recipe("smoke")
    tok_file = D.tokenizer_path(D.BYTES_TOKENIZER, str(tmp_path / "tok"))
    tok = D.load_tokenizer(tok_file, recipe.model)
    ts = D.build_task_set("copycolors_10way", tok, 128)
    other = D.TaskCache(str(tmp_path / "run"), tok_file, 128, recipe.model, write=False)
    other.put(ts)
    assert other.get("copycolors_10way") is None  # a process other than 0 keeps nothing
    cache = D.TaskCache(str(tmp_path / "run"), tok_file, 128, recipe.model, write=True)
    cache.put(ts)
    back = cache.get("copycolors_10way")
    assert back is not None
    for f in dataclasses.fields(ts):
        a, b = getattr(ts, f.name), getattr(back, f.name)
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, f.name
    assert cache.path("copycolors_10way").startswith(str(tmp_path / "run" / "eval" / "downstream"))
    assert D.TaskCache(str(tmp_path / "run"), tok_file, 64, recipe.model, write=True).key != cache.key
    Path(cache.path("copycolors_10way")).write_bytes(b"torn")
    assert cache.get("copycolors_10way") is None


@pytest.mark.chaos  # two trainer processes
def test_a_second_attempt_reads_the_tasks_the_first_built(tmp_path):
    from helpers.trainer import scalars, train

    tasks = "eval.downstream={tasks: [copa], interval: 2}"
    first = train(tmp_path / "run", "--stop-at-step", "2", "--set", tasks)
    assert "downstream: 1 tasks, 200 instances\n" in first.stdout
    second = train(tmp_path / "run", "--stop-at-step", "4", "--set", tasks)
    assert "downstream: 1 tasks, 200 instances (1 read from eval/downstream/)" in second.stdout
    acc = scalars(tmp_path / "run")["eval/downstream/copa (accuracy)"]
    assert sorted(acc) == [2, 4]
