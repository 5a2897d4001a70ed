"""`olmo-ctl eval`: a checkpoint's LM losses and downstream task metrics, on this process's CPU devices.

End to end through the command line (helpers.cli.invoke, in this process): the session's smoke run
(its checkpoints 20 and 40; its recipe has no tasks, so they are given, with the bytes tokenizer and
the smoke held-out files as an LM set); a tiny Hugging Face Olmo3ForCausalLM directory evaluated as it
is and as its `convert hf-to-orbax` output, which must give the same numbers; bad input in one line,
exit 2, before the model is read. Few documents per task (`--limit`), so each case takes seconds."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml
from helpers.cli import ROOT, clean_env, invoke

from olmo_ctl.core.recipe import LMEvalSet
from olmo_ctl.trainer import downstream as D

pytest.importorskip("olmo_eval", reason="the eval extra (ai2-olmo-eval) is not installed")

TASKS = "copycolors_10way,arc_easy_test_bpb_5shot"  # ranked classification (acc) and BPB: bytes build them
LM_FILES = "{root}/eval/*.npy"  # the smoke held-out files (data.root builtin://smoke)
LM = f"smoke_eval={LM_FILES}"
LIMIT = "6"
ACC_KEYS = [
    "acc_v1",
    "acc_v2",
    "ce_loss_v1",
    "ce_loss_v2",
    "bpb_v1",
    "bpb_v2",
    "soft_v1",
    "soft_v2",
    "soft_log_v1",
    "soft_log_v2",
    "stderr",
]


@pytest.fixture
def env(tmp_path):
    return clean_env(tmp_path / "xdg")


def _smoke_args(smoke_run, step: int = 40) -> list[str]:
    ckpt = str(smoke_run / "checkpoints" / str(step))
    return [ckpt, "--recipe", "smoke", "--tasks", TASKS, "--tokenizer", D.BYTES_TOKENIZER, "--lm", LM]


def _report(*args: str, env) -> dict:
    p = invoke("eval", *args, "-o", "json", env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.fixture(scope="module")
def smoke_report(smoke_run, tmp_path_factory):
    env = clean_env(tmp_path_factory.mktemp("xdg"))
    return _report(*_smoke_args(smoke_run), "--limit", LIMIT, env=env)


def test_a_run_checkpoint_reports_lm_losses_and_task_metrics(smoke_report, smoke_run):
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.trainer.lm_eval import LMEvalData, resolve_sets

    r = smoke_report
    assert list(r) == ["checkpoint", "step", "lm", "downstream"]
    assert r["checkpoint"] == str(smoke_run / "checkpoints" / "40") and r["step"] == 40
    lm = r["lm"]["smoke_eval"]
    assert list(lm) == ["ce_loss", "ppl", "tokens"]
    assert 0 < lm["ce_loss"] < math.log(258) and lm["ppl"] == pytest.approx(math.exp(lm["ce_loss"]))
    # tokens: OLMo-core's denominator, the evaluated documents' lengths (at most seq_len each)
    recipe = load_recipe("smoke", overrides=[f"eval.lm.sets=[{{label: smoke_eval, files: ['{LM_FILES}']}}]"])
    data = LMEvalData(resolve_sets(recipe), 128, 256, 257)
    assert lm["tokens"] == int(np.sum((data.ends - data.starts)[: int(LIMIT)]))
    ds = r["downstream"]
    assert list(ds) == ["copycolors_10way", "arc_easy_test_bpb_5shot"]
    assert list(ds["copycolors_10way"]) == ACC_KEYS  # ICLMetric.compute()'s keys, then the standard error
    assert list(ds["arc_easy_test_bpb_5shot"]) == ["bpb_v1", "bpb_v2", "stderr"]
    assert 0 <= ds["copycolors_10way"]["acc_v1"] <= 1 and ds["arc_easy_test_bpb_5shot"]["bpb_v1"] > 0
    assert ds["arc_easy_test_bpb_5shot"]["stderr"] > 0


def test_the_numbers_are_the_evaluators_on_any_device_count_and_fall_with_training(smoke_run, env):
    """Checkpoint 20 on 1 and on 4 devices: the same numbers to fp32 rounding; checkpoint 40 (the
    same model trained longer) has the lower LM loss."""
    one = _report(*_smoke_args(smoke_run, 20), "--limit", "3", env=env)
    four = _report(*_smoke_args(smoke_run, 20), "--limit", "3", "--device", "cpu-4", env=env)
    assert one["step"] == four["step"] == 20
    assert four["lm"]["smoke_eval"]["tokens"] == one["lm"]["smoke_eval"]["tokens"]
    assert four["lm"]["smoke_eval"]["ce_loss"] == pytest.approx(one["lm"]["smoke_eval"]["ce_loss"], rel=1e-5)
    for task, metrics in one["downstream"].items():
        for k, v in metrics.items():
            assert four["downstream"][task][k] == pytest.approx(v, rel=1e-4, abs=1e-6), (task, k)
    forty = _report(*_smoke_args(smoke_run, 40), "--limit", "3", "--tasks", "none", env=env)
    assert forty["downstream"] == {}
    assert forty["lm"]["smoke_eval"]["ce_loss"] < one["lm"]["smoke_eval"]["ce_loss"]


def test_a_runs_recipe_gives_the_defaults(smoke_run, smoke_report, tmp_path, env):
    """A run whose run.yaml carries the tasks, the LM set and the tokenizer (`{root}/...`): `eval
    CHECKPOINT` alone evaluates them, at the recipe's sequence length; an option replaces one."""
    from helpers.runs import copy_run

    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.rundir import RunDir

    run = copy_run(smoke_run, tmp_path / "run")
    shutil.copy(D.tokenizer_path(D.BYTES_TOKENIZER, str(tmp_path / "tok")), tmp_path / "tokenizer.json")
    recipe = load_recipe(
        "smoke",
        overrides=[
            f"data.tokenizer={tmp_path}/tokenizer.json",
            f"eval.downstream=[{TASKS}]",
            f"eval.lm.sets=[{{label: smoke_eval, files: ['{LM_FILES}']}}]",
        ],
    )
    RunDir(str(run)).create_run(recipe.to_dict(), recipe.fingerprint(), "", "cpu-1", adopt=True)
    got = _report(str(run / "checkpoints" / "40"), "--limit", LIMIT, env=env)
    assert got["step"] == 40 and got["lm"] == smoke_report["lm"]
    assert got["downstream"] == smoke_report["downstream"]
    only_lm = _report(str(run / "checkpoints" / "40"), "--tasks", "none", env=env)
    assert only_lm["downstream"] == {} and only_lm["lm"] == smoke_report["lm"]


def test_a_process_of_its_own_runs_on_the_devices_asked_for(smoke_run, smoke_report, env):
    """`python -m olmo_ctl eval --device cpu-2`: JAX's CPU backend started with 2 devices (this test
    process has 8 already); the LM loss of the in-process 1-device report, and the notes on stderr."""
    ckpt = str(smoke_run / "checkpoints" / "40")
    p = subprocess.run(
        [sys.executable, "-m", "olmo_ctl", "eval", ckpt, "--recipe", "smoke", "--lm", LM, "--device", "cpu-2"]
        + ["-o", "json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    first, why = p.stderr.splitlines()  # the run has an in-loop held-out loss: what --lm is not
    assert first == "note: evaluating 1 LM set (2 documents) at seq_len 128 on cpu-2", p.stderr
    assert why.startswith("note: LM sets score one document per row") and "bare `eval`" in why
    got, want = json.loads(p.stdout)["lm"]["smoke_eval"], smoke_report["lm"]["smoke_eval"]
    assert got["tokens"] == want["tokens"] and got["ce_loss"] == pytest.approx(want["ce_loss"], rel=1e-5)


def test_lm_mix_reads_the_validation_mix_under_data_root(smoke_run, tmp_path, env):
    """`--lm v3-small-ppl-validation --data-root DIR`: its 11 files under DIR, labelled as OLMo-core
    labels them, in the manifest's order."""
    from olmo_ctl.data.mixes import load_mix, mix_paths

    rng = np.random.default_rng(3)
    for path in mix_paths("v3-small-ppl-validation", str(tmp_path)):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.asarray([*rng.integers(0, 256, 20).tolist(), 256], "<u4").tofile(path)
    ckpt = str(smoke_run / "checkpoints" / "40")
    args = ["--recipe", "smoke", "--lm", "v3-small-ppl-validation", "--data-root", str(tmp_path)]
    got = _report(ckpt, *args, env=env)["lm"]
    assert list(got) == [e.label for e in load_mix("v3-small-ppl-validation")]
    assert all(v["tokens"] == 21 and v["ce_loss"] > 0 for v in got.values())


def test_a_forward_pass_takes_up_to_8_rows_and_bounded_logits():
    from olmo_ctl.checkpoints.evaluate import rows_per_pass

    assert [rows_per_pass(n, 128, 384) for n in (1, 3, 4, 16)] == [8, 9, 8, 16]
    assert [rows_per_pass(n, 8192, 100352) for n in (1, 4)] == [1, 4]  # 3.1 GiB of logits a row
    assert rows_per_pass(1, 2048, 100352) == 2


def test_the_table_has_a_row_per_lm_set_and_per_task(smoke_run, smoke_report, env):
    from olmo_ctl.cli.evaluate import table_lines

    lines = table_lines(smoke_report)
    assert lines[0] == f"eval {smoke_run}/checkpoints/40 (step 40)"
    (lm_row,) = [x for x in lines if x.startswith("smoke_eval ")]
    assert f"{smoke_report['lm']['smoke_eval']['ce_loss']:.4f}" in lm_row
    cc, arc = (smoke_report["downstream"][t] for t in ("copycolors_10way", "arc_easy_test_bpb_5shot"))
    (cc_row,) = [x for x in lines if x.startswith("copycolors_10way ")]
    assert cc_row.split()[1:] == ["acc_v1", f"{cc['acc_v1']:.4f}", "±", f"{cc['stderr']:.4f}"]
    (arc_row,) = [x for x in lines if x.startswith("arc_easy_test_bpb_5shot ")]
    assert arc_row.split()[1:] == ["bpb_v1", f"{arc['bpb_v1']:.4f}", "±", f"{arc['stderr']:.4f}"]


def test_yaml_is_the_json_report(smoke_run, smoke_report, env):
    p = invoke("eval", *_smoke_args(smoke_run), "--limit", LIMIT, "-o", "yaml", env=env)
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load(p.stdout) == smoke_report


def _boom(*a, **k):
    raise AssertionError("the model was loaded before the input was checked")


@pytest.mark.parametrize(
    "case,args,message",
    [
        ("missing tokenizer", ["--tasks", "copycolors_10way", "--tokenizer", "{tmp}/nope"], "no {tmp}/nope"),
        (
            "no tokenizer",  # the smoke recipe names builtin://bytes: none given overrides it
            ["--tasks", "copycolors_10way", "--tokenizer", ""],
            "the downstream tasks need the model's tokenizer",
        ),
        (
            "unknown task",
            ["--tasks", "copycolors_11way", "--tokenizer", D.BYTES_TOKENIZER],
            "unknown downstream",
        ),
        (
            "fast-MC task",
            ["--tasks", "copycolors_10way_fast", "--tokenizer", D.BYTES_TOKENIZER],
            "needs each choice to be one token",
        ),
        ("nothing to evaluate", ["--tasks", "none", "--lm", "none"], "nothing to evaluate"),
        ("bad --lm", ["--lm", "c4_en"], "--lm `c4_en` is not a validation mix"),
        ("no LM file", ["--lm", "x={tmp}/none/*.npy"], "matches no file"),
        ("mix without a root", ["--lm", "v3-small-ppl-validation", "--data-root", ""], "--data-root DIR"),
        ("a TPU", ["--tasks", "copycolors_10way", "--device", "v5p-8"], "--device cpu-N"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_the_model_loads(
    case, args, message, smoke_run, env, tmp_path, monkeypatch
):
    from olmo_ctl.checkpoints import evaluate

    monkeypatch.setattr(evaluate, "load_sharded", _boom)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    p = invoke("eval", str(smoke_run / "checkpoints" / "40"), "--recipe", "smoke", *args, env=env)
    assert p.returncode == 2 and p.stdout == "", (case, p.stderr)
    (line,) = p.stderr.splitlines()
    assert line.startswith("error: ") and message.replace("{tmp}", str(tmp_path)) in line, (case, line)


@pytest.mark.parametrize(
    "which,message",
    [
        ("checkpoints/99", "checkpoint `{run}/checkpoints/99` does not exist"),
        ("nowhere", "checkpoint `{run}/nowhere` does not exist"),
        ("tensorboard", "is not a checkpoint: no olmo_model.json, no config.json, not a step directory"),
        ("checkpoints/40 --no-recipe", "its run has no run.yaml"),
    ],
)
def test_a_missing_checkpoint_is_one_line_and_exit_2(which, message, smoke_run, env):
    path, _, flag = which.partition(" ")
    recipe = [] if flag else ["--recipe", "smoke"]
    p = invoke("eval", str(smoke_run / path), *recipe, "--tasks", "copycolors_10way", env=env)
    assert p.returncode == 2 and p.stdout == ""
    (line,) = p.stderr.splitlines()
    assert line.startswith("error: ") and message.replace("{run}", str(smoke_run)) in line, line


def test_a_byte_level_model_with_nothing_to_evaluate_is_told_what_it_can_evaluate(smoke_run, env, tmp_path):
    """The smoke model's soup (`NAME/soup` of a run of ingredients: its recipe, from the run's run.yaml,
    has no eval.lm and no tasks, and a soup has no in-loop held-out loss) and `verify` of a smoke run:
    exit 2, advising what a byte-level model evaluates (its recipe's held-out files, tasks a byte
    tokenizer builds), not AI2's olmo3 set, which it cannot build. The advice, run as given, evaluates."""
    import re

    from helpers.runs import copy_run

    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.rundir import RunDir
    from olmo_ctl.supervise.attempts import data_fingerprint

    run = copy_run(smoke_run, tmp_path / "runs" / "r")
    r = load_recipe("smoke")
    RunDir(str(run)).create_run(r.to_dict(), r.fingerprint(), data_fingerprint(r), "cpu-1", adopt=True)
    soup = tmp_path / "soup"
    ckpts = [str(run / "checkpoints" / s) for s in ("20", "40")]
    assert invoke("surgery", "soup", *ckpts, "--out", str(soup), env=env).returncode == 0
    p = invoke("eval", str(soup), env=env)
    assert p.returncode == 2 and p.stdout == "", p.stderr
    (line,) = p.stderr.splitlines()
    assert line.startswith("error: nothing to evaluate: ") and "olmo3" not in line, line
    v = invoke("verify", str(run), "--reference", str(run), env=env)
    assert v.returncode == 2 and "olmo3" not in v.stderr, v.stderr
    assert v.stderr.strip().split("; ", 1)[1] == line.split("; ", 1)[1]  # the same advice
    lm = re.search(r"--lm '([^']+)'", line)
    tasks = re.search(r"--tasks (\S+) --limit (\d+)", line)
    assert lm and tasks, line
    for advised in (["--lm", lm[1]], ["--tasks", tasks[1], "--limit", tasks[2]]):
        got = _report(str(soup), *advised, env=env)
        assert got["lm"] or got["downstream"], (advised, got)


def test_list_tasks_names_every_label_and_the_olmo3_set(env):
    p = invoke("eval", "--list-tasks", "-o", "json", env=env)
    assert p.returncode == 0, p.stderr
    labels = json.loads(p.stdout)
    assert set(D.OLMO3_PRETRAIN_TASKS) <= set(labels) and "copycolors_10way" in labels


def test_tasks_and_lm_options_parse_as_documented():
    from olmo_ctl.cli.evaluate import parse_lm, parse_tasks

    assert parse_tasks("olmo3") == D.OLMO3_PRETRAIN_TASKS and len(parse_tasks("olmo3")) == 26
    assert parse_tasks("copycolors_10way, olmo3,hellaswag_bpb_5shot") == (
        "copycolors_10way",
        *D.OLMO3_PRETRAIN_TASKS,
    )
    assert parse_tasks("none") == ()
    assert parse_lm("v3-small-ppl-validation").mix == "v3-small-ppl-validation"
    assert parse_lm("c4=a/*.npy,wiki=b.npy,c4=c.npy").sets == (
        LMEvalSet("c4", ("a/*.npy", "c.npy")),
        LMEvalSet("wiki", ("b.npy",)),
    )
    assert not parse_lm("none").enabled


def test_limit_keeps_each_tasks_first_documents_and_each_labels_first_instances():
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.trainer.lm_eval import first_per_label

    tok = D.load_tokenizer(D.BYTES_TOKENIZER, load_recipe("smoke").model)
    ts = D.build_task_set("copycolors_10way", tok, 128)
    cut = ts.first_documents(3)
    docs = list(dict.fromkeys(ts.doc_id.tolist()))[:3]
    keep = [i for i in range(len(ts)) if int(ts.doc_id[i]) in docs]
    assert len(cut) == len(keep) == 30  # ten continuations each
    assert cut.query == [ts.query[i] for i in keep] and cut.cont_id.tolist() == ts.cont_id[keep].tolist()
    assert first_per_label(np.arange(7), np.array([0, 1, 0, 0, 1, 1, 0]), 2).tolist() == [0, 1, 2, 4]


# ---------------------------------------------------------------- a Hugging Face directory

HF_CONFIG = dict(  # byte vocabulary (EOS 256, pad 257: the bytes tokenizer's), window 16, full every 4th
    vocab_size=258,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=16,
)


@pytest.mark.parity  # transformers writes the directory
def test_an_hf_directory_evaluates_as_its_converted_checkpoint(tmp_path, env):
    """The Hugging Face directory (its own tokenizer.json, 512 positions: seq_len 512) and its
    `convert hf-to-orbax` output given the same tokenizer: the same report but for the path."""
    pytest.importorskip("transformers")
    from test_parity import make_hf

    hf = tmp_path / "hf"
    make_hf(hf, HF_CONFIG, seed=0)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 256, "pad_token_id": 257}))
    shutil.copy(D.tokenizer_path(D.BYTES_TOKENIZER, str(tmp_path / "tok")), hf / "tokenizer.json")
    rng = np.random.default_rng(0)
    docs = [[*rng.integers(0, 256, n).tolist(), 256] for n in (40, 700, 3, 90)]
    np.asarray([t for d in docs for t in d], "<u4").tofile(tmp_path / "held.npy")
    orbax = tmp_path / "orbax"
    p = invoke("convert", "hf-to-orbax", str(hf), str(orbax), env=env)
    assert p.returncode == 0, p.stderr
    args = ["--tasks", TASKS, "--lm", f"held={tmp_path}/held.npy", "--limit", "4"]
    a = _report(str(hf), *args, env=env)
    b = _report(str(orbax), *args, "--tokenizer", str(hf), env=env)
    assert (a["checkpoint"], a["step"], b["step"]) == (str(hf), None, None)
    assert a["lm"]["held"]["tokens"] == 41 + 512 + 4 + 91  # documents truncated to seq_len 512
    assert a["lm"] == b["lm"] and a["downstream"] == b["downstream"]
    p = invoke("eval", str(hf), "--recipe", "smoke", *args, env=env)  # the directory has its model
    assert p.returncode == 2 and "--recipe is for a run's step directory" in p.stderr
    assert list(a["downstream"]["copycolors_10way"]) == ACC_KEYS


def test_a_run_checkpoint_with_nothing_else_to_evaluate_gets_its_runs_held_out_loss(smoke_run, env):
    """The smoke recipe has no LM sets and no tasks: bare `eval` of its checkpoint gives the run's own
    in-loop held-out loss (eval.batches of data.eval), the value its loop logged as eval/lm_loss."""
    from helpers.trainer import scalars

    p = invoke("eval", str(smoke_run / "checkpoints" / "40"), "--recipe", "smoke", "-o", "json", env=env)
    assert p.returncode == 0, p.stderr
    held = json.loads(p.stdout)["held_out"]
    logged = scalars(smoke_run)["eval/lm_loss"]
    assert held["lm_loss"] == pytest.approx(float(logged[40]), rel=1e-6) and held["batches"] >= 1
    table = invoke("eval", str(smoke_run / "checkpoints" / "40"), "--recipe", "smoke", env=env)
    assert table.returncode == 0 and "held-out loss " in table.stdout and "eval lm_loss" in table.stdout
