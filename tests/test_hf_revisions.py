"""`--reference hf:ORG/NAME`: a reference whose checkpoints are revisions of a Hugging Face repository,
read from the local Hugging Face cache as huggingface_hub lays it out.

The cache is built here the way huggingface_hub builds it (`models--ORG--NAME/refs/<revision>` holding
a commit hash, `snapshots/<hash>/` that commit's files), its snapshots the session smoke run's own
checkpoints 20 and 40 exported with `olmo-ctl convert orbax-to-hf`, under AI2's revision names
(`stage1-step20-tokens0B`). `verify` finds both landmarks in it, evaluates them converted in memory and
keeps them like any reference's; a revision the cache lacks, or a repository it holds nothing of, is one
line and exit 2 with nothing written. No network: every call runs with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from helpers.cli import clean_env, invoke

from olmo_ctl.core.errors import BadInput
from olmo_ctl.observe import hf_revisions as H
from olmo_ctl.observe import verify as V

REPO = "olmo-test/smoke-revisions"
REVISIONS = {20: "stage1-step20-tokens0B", 40: "stage1-step40-tokens0B"}  # the smoke run's checkpoints
LM = "smoke_eval={root}/eval/*.npy"
ARGS = ("--recipe", "smoke", "--tasks", "copycolors_10way", "--limit", "4", "--lm", LM, "--kl-tokens", "256")


def _commit(revision: str) -> str:
    return hashlib.sha1(revision.encode()).hexdigest()


@pytest.fixture(scope="module")
def hub(smoke_run, tmp_path_factory) -> Path:
    """A Hugging Face cache holding REPO at REVISIONS (and `main`, at the last of them)."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo = Path(H.repo_dir(str(cache), REPO))
    (repo / "refs").mkdir(parents=True)
    for step, revision in REVISIONS.items():
        snapshot = repo / "snapshots" / _commit(revision)
        p = invoke(
            "convert",
            "orbax-to-hf",
            str(smoke_run / "checkpoints" / str(step)),
            str(snapshot),
            "--recipe",
            "smoke",
        )
        assert p.returncode == 0, p.stderr
        (repo / "refs" / revision).write_text(_commit(revision))  # as huggingface_hub writes it: no newline
    (repo / "refs" / "main").write_text(_commit(REVISIONS[40]))
    return cache


def _env(tmp_path: Path, cache: Path) -> dict[str, str]:
    env = clean_env(tmp_path / "xdg")
    env.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    return env


@pytest.mark.parametrize(
    "name,step,tokens_b",
    [
        ("stage1-step10000-tokens42B", 10000, 42),  # the step, not the name's last number
        ("stage1-step10000", 10000, None),
        ("stage2-ingredient1-step1000-tokens5B", 1000, 5),
        ("step20000-tokens84B", 20000, 84),
        ("step-10000", 10000, None),
        ("step_10000", 10000, None),
        ("10000", 10000, None),
        ("main", None, None),
        ("stage1", None, None),
        ("stage1-step10000-tokens42B-extra", None, None),
    ],
)
def test_a_checkpoint_name_gives_the_number_after_step_and_its_tokens(name, step, tokens_b):
    assert H.step_of(name) == (None if step is None else (step, tokens_b))
    m = V.STEP_NAME.search(name)  # verify's rule for a directory of checkpoints is the same one
    assert (int(m.group(1)) if m else None) == step


def test_a_directory_of_revisions_gives_each_its_step(tmp_path):
    for name in ("stage1-step10000-tokens42B", "stage1-step20000-tokens84B", "main", "README"):
        (tmp_path / name).mkdir()
    assert V.checkpoints_of(str(tmp_path)) == {
        10000: str(tmp_path / "stage1-step10000-tokens42B"),
        20000: str(tmp_path / "stage1-step20000-tokens84B"),
    }


def test_the_cache_is_where_huggingface_hub_keeps_it():
    home = str(Path.home())
    assert H.hub_cache({}) == f"{home}/.cache/huggingface/hub"
    assert H.hub_cache({"XDG_CACHE_HOME": "/x"}) == "/x/huggingface/hub"
    assert H.hub_cache({"XDG_CACHE_HOME": "/x", "HF_HOME": "/h"}) == "/h/hub"
    assert H.hub_cache({"HF_HOME": "/h", "HUGGINGFACE_HUB_CACHE": "/old"}) == "/old"
    assert H.hub_cache({"HF_HOME": "/h", "HUGGINGFACE_HUB_CACHE": "/old", "HF_HUB_CACHE": "/c"}) == "/c"


def test_the_cache_gives_every_revision_named_by_step_or_those_named(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = Path(H.repo_dir(str(hub), REPO))
    revs = H.revisions(f"hf:{REPO}", str(hub))
    assert revs == {
        step: H.Revision(name, step, 0, str(repo / "snapshots" / _commit(name)))
        for step, name in REVISIONS.items()
    }  # `main` names no step: not a landmark
    assert list(H.revisions(f"hf:{REPO}@{REVISIONS[40]}", str(hub))) == [40]
    assert (repo / "snapshots" / _commit(REVISIONS[40]) / "config.json").is_file()
    # Two revisions of one step are refused: which one is the landmark is the user's to say.
    other = tmp_path / "hub"
    shutil.copytree(hub, other)
    (Path(H.repo_dir(str(other), REPO)) / "refs" / "stage1-step40").write_text(_commit(REVISIONS[40]))
    with pytest.raises(BadInput, match="both step 40"):
        H.revisions(f"hf:{REPO}", str(other))


def test_tokens_per_step_from_the_revision_names():
    def rev(name):
        step, tokens_b = H.step_of(name) or (0, None)
        return H.Revision(name, step, tokens_b, "")

    # OLMo 3 7B stage 1 trains 512 x 8192 = 4,194,304 tokens a step: 10000 steps are 41.9B tokens.
    revs = {
        r.step: r
        for r in map(rev, ("stage1-step0-tokens0B", "stage1-step1000-tokens4B", "stage1-step10000-tokens42B"))
    }
    assert H.tokens_per_step(revs) == pytest.approx(4_194_304, rel=0.5 / 42)
    assert H.tokens_per_step({10000: rev("stage1-step10000")}) is None


def test_verify_against_revisions_in_the_cache(smoke_run, hub, tmp_path):
    env = _env(tmp_path, hub)
    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    p = invoke("verify", str(run), "--reference", f"hf:{REPO}", *ARGS, "-o", "json", env=env)
    assert p.returncode in (0, 1) and "Traceback" not in p.stderr, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert res["reference"] == f"hf:{REPO}"
    assert [m["step"] for m in res["landmarks"]] == [20, 40]
    assert p.returncode == 0
    snapshots = {str(Path(H.repo_dir(str(hub), REPO)) / "snapshots" / _commit(r)) for r in REVISIONS.values()}
    assert sum(f"evaluating {s} " in p.stderr for s in snapshots) == 2, p.stderr  # each revision's snapshot
    # Each revision is the run's own checkpoint exported (every trained row of the padded vocabulary
    # kept), converted back in memory: the same function, so identical at both landmarks.
    assert res["level"] == "identical", res
    for m in res["landmarks"]:
        assert m["lm"] == {"smoke_eval": 0.0} and m["kl"] == 0.0, m
        assert m["downstream"]["copycolors_10way"] == 0.0 and m["level"] == "identical"
    again = invoke("verify", str(run), "--reference", f"hf:{REPO}", *ARGS, "-o", "json", env=env)
    kept = json.loads(again.stdout)
    assert (
        again.returncode == p.returncode and kept["evaluated"] == 0 and kept["landmarks"] == res["landmarks"]
    )


@pytest.mark.parametrize(
    "reference,says",
    [
        (
            f"hf:{REPO}@stage1-step60-tokens0B",
            f"hf:{REPO}: revision stage1-step60-tokens0B is not in the Hugging Face cache ({{cache}}); "
            f"download it with `hf download {REPO} --revision stage1-step60-tokens0B`",
        ),
        (
            "hf:olmo-test/partial",  # a ref whose snapshot never arrived
            "hf:olmo-test/partial: revision stage1-step20-tokens0B is not in the Hugging Face cache ({cache})",
        ),
        (
            "hf:olmo-test/absent",
            "hf:olmo-test/absent: no revision named by step is in the Hugging Face cache",
        ),
        (f"hf:{REPO}@main", f"hf:{REPO}: revision main names no step"),
        ("hf:smoke-revisions", "`hf:smoke-revisions` is not a Hugging Face reference"),
    ],
    ids=["not-in-cache", "ref-without-snapshot", "repo-not-in-cache", "no-step", "not-org-name"],
)
def test_a_missing_revision_is_one_line_and_exit_2_and_nothing_is_written(
    smoke_run, hub, tmp_path, reference, says
):
    cache = tmp_path / "hub"
    shutil.copytree(hub, cache)
    partial = Path(H.repo_dir(str(cache), "olmo-test/partial")) / "refs"
    partial.mkdir(parents=True)
    (partial / REVISIONS[20]).write_text(_commit(REVISIONS[20]))
    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    p = invoke("verify", str(run), "--reference", reference, *ARGS, env=_env(tmp_path, cache))
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr, p.stderr
    errors = [x for x in p.stderr.splitlines() if not x.startswith("note: ")]
    assert len(errors) == 1 and says.format(cache=cache) in errors[0], p.stderr
    assert not (run / "eval").exists()
    held = {x.name for x in hub.iterdir()} | {"models--olmo-test--partial"}
    assert {x.name for x in cache.iterdir()} == held  # nothing downloaded into the cache


def test_a_step_the_cache_lacks_is_fetched_where_the_network_allows_else_named(smoke_run, hub, tmp_path):
    """`--steps N` with a plain `hf:` reference asks the repository for its revision of step N (none
    here: HF_HUB_OFFLINE) and, without it, names the step and how to download it; nothing is written."""
    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    p = invoke(
        "verify", str(run), "--reference", f"hf:{REPO}", *ARGS, "--steps", "30", env=_env(tmp_path, hub)
    )
    assert p.returncode == 2 and p.stdout == "", p.stderr
    (line,) = [x for x in p.stderr.splitlines() if not x.startswith("note: ")]
    assert "step 30 is not a checkpoint of both the run and the reference" in line
    assert f"hf download {REPO} --revision" in line
    assert not (run / "eval").exists()
