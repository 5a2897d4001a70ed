"""`--suite NAME`: downstream tasks by name in `eval` and `verify` (`downstream.SUITES`).

`olmo3-in-loop` is AI2's 26 OLMo 3 in-loop tasks (`--tasks olmo3`), `case-study` the OLMo 3 case
study's eight (ARC-Challenge, ARC-Easy, BoolQ, HellaSwag, OpenBookQA, PIQA, WinoGrande, MMLU: 5-shot
multiple choice; MMLU is ai2-olmo-eval's four categories). Every label is one ai2-olmo-eval builds;
`eval --list-tasks --suite` prints a suite; a suite beside `--tasks`, or a name that is no suite, is one
line and exit 2 with nothing written; `verify --suite` hands the suite to the run's evaluators. The
whole case-study suite evaluated on the smoke checkpoint builds every task from its full data set
(about a minute and a half): the chaos lane."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.cli import clean_env, invoke

from olmo_ctl.trainer import downstream as D

pytest.importorskip("olmo_eval", reason="the eval extra (ai2-olmo-eval) is not installed")

LM = "smoke_eval={root}/eval/*.npy"
CASE_STUDY = {"arc_challenge", "arc_easy", "boolq", "hellaswag", "openbookqa", "piqa", "winogrande", "mmlu"}


@pytest.fixture
def env(tmp_path):
    return {**clean_env(tmp_path / "xdg"), "COLUMNS": "200"}


def _task(label: str) -> str:
    """The task a label scores: `mmlu_stem_test_mc_5shot` -> mmlu, `arc_easy_test_mc_5shot` -> arc_easy."""
    return "mmlu" if label.startswith("mmlu_") else label.split("_test_")[0].split("_val_")[0]


def test_every_suite_is_labels_ai2_olmo_eval_builds():
    from olmo_ctl.cli.evaluate import chosen_tasks, parse_suite

    for name, labels in D.SUITES.items():
        D.check_tasks(labels)  # a BadInput for a label ai2-olmo-eval does not know
        assert len(set(labels)) == len(labels), name
        assert parse_suite(name) == labels
    assert (
        parse_suite("olmo3-in-loop") == D.OLMO3_PRETRAIN_TASKS
        and chosen_tasks("olmo3", None) == D.OLMO3_PRETRAIN_TASKS
    )
    case = parse_suite("case-study")
    assert {_task(t) for t in case} == CASE_STUDY and len(CASE_STUDY) == 8
    assert all("_mc_5shot" in t and not t.endswith("_fast") for t in case)
    assert sorted(t for t in case if t.startswith("mmlu_")) == [
        f"mmlu_{c}_test_mc_5shot" for c in ("humanities", "other", "social_sciences", "stem")
    ]
    assert chosen_tasks(None, None) is None


def test_list_tasks_with_a_suite_prints_its_labels(env):
    for name, labels in D.SUITES.items():
        p = invoke("eval", "--list-tasks", "--suite", name, "-o", "json", env=env)
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout) == list(labels)
    p = invoke("eval", "--list-tasks", "--suite", "case-study", env=env)
    assert p.stdout.splitlines() == list(D.CASE_STUDY_TASKS)


def test_help_documents_the_suites(env):
    for command in ("eval", "verify"):
        text = invoke(command, "--help", env=env).stdout
        assert "--suite" in text, command
        for name in D.SUITES:
            assert name in text, (command, name)


@pytest.mark.parametrize(
    "extra,says",
    [
        (("--suite", "nope"), "--suite `nope` is not a suite; known suites: case-study, olmo3-in-loop"),
        (("--suite", "case-study", "--tasks", "copycolors_10way"), "--suite and --tasks both choose"),
    ],
    ids=["unknown-suite", "suite-and-tasks"],
)
@pytest.mark.parametrize("command", ["eval", "verify", "list-tasks"])
def test_a_bad_suite_is_one_line_and_exit_2(smoke_run, tmp_path, env, command, extra, says):
    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    args = {
        "eval": (
            "eval",
            str(run / "checkpoints" / "40"),
            "--recipe",
            "smoke",
            "--tokenizer",
            D.BYTES_TOKENIZER,
        ),
        "verify": ("verify", str(run), "--reference", str(smoke_run), "--recipe", "smoke", "--lm", LM),
        "list-tasks": ("eval", "--list-tasks"),
    }[command]
    p = invoke(*args, *extra, env=env)
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr, p.stderr
    errors = [x for x in p.stderr.splitlines() if not x.startswith("note: ")]
    assert len(errors) == 1 and says in errors[0], p.stderr
    assert not (run / "eval").exists()


def test_verify_hands_the_suite_to_the_runs_evaluators(smoke_run, tmp_path, env):
    """The smoke recipe has no downstream tasks: with --suite, verify checks the suite's tasks against
    the run's tokenizer before reading a checkpoint (here a tokenizer that is not there: exit 2)."""
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.rundir import RunDir

    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    r = load_recipe("smoke", overrides=[f"data.tokenizer={tmp_path / 'no-tokenizer'}"])
    assert not r.eval.downstream.tasks
    RunDir(str(run)).create_run(r.to_dict(), r.fingerprint(), "", "cpu-1", adopt=True)
    p = invoke(
        "verify", str(run), "--reference", str(smoke_run), "--suite", "case-study", "--lm", LM, env=env
    )
    assert p.returncode == 2 and "no-tokenizer" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (run / "eval").exists()


@pytest.mark.chaos  # builds each of the suite's 11 tasks from its whole data set: about 100 s
def test_eval_scores_the_case_study_suite(smoke_run, env):
    ckpt = str(smoke_run / "checkpoints" / "40")
    args = ("--recipe", "smoke", "--tokenizer", D.BYTES_TOKENIZER, "--lm", "none", "--limit", "2")
    p = invoke("eval", ckpt, "--suite", "case-study", *args, "-o", "json", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    ds = json.loads(p.stdout)["downstream"]
    assert list(ds) == list(D.CASE_STUDY_TASKS)
    for task, metrics in ds.items():
        own = next(iter(metrics))
        assert own in ("acc_v1", "len_norm_v1"), (task, own)  # accuracies: verify's macro averages them
        assert 0.0 <= metrics[own] <= 1.0 and "stderr" in metrics
