"""Data mixes: AI2's manifests ship with the package, paths are built as OLMo-core builds them, and
`data info` lists a mix's files in the manifest's order (a missing file is exit 2, named)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.mixes import MIXES
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.data.files import resolve_files, resolve_mix
from olmo_ctl.data.mixes import MIXES_DIR, load_mix, mix_paths

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_CTL_")}
    return subprocess.run(
        [sys.executable, "-m", "olmo_ctl", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def _manifest_lines(name: str) -> list[tuple[str, str]]:
    """The manifest read independently: `label,path` lines, comments and blanks skipped."""
    out = []
    for line in (MIXES_DIR / f"{name}.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            label, path = line.strip().split(",")
            out.append((label, path))
    return out


def _anneal_manifest_lines(name: str) -> list[tuple[str, str]]:
    """An OLMo 2 anneal manifest read as `AnnealingDataMix.build` reads it (OLMo-2-0325-32B-anneal.py:
    60-76): stripped lines, `#` and blank lines skipped, the path as written, its label the second
    `/` component."""
    out = []
    for line in (MIXES_DIR / f"{name}.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append((line.split("/")[1], line))
    return out


# name -> (files, distinct files, the directory `DataMix.build` puts for {TOKENIZER} with the dolma2
# tokenizer: src/olmo_core/data/mixes/__init__.py:84-110)
DATAMIX_MANIFESTS = {
    "OLMo-mix-0625-official": (1016, 1016, "allenai/dolma3-tokenizer"),
    "OLMo-midtraining-mix-0625-100B": (11933, 11933, "allenai/dolma3-tokenizer"),
    "OLMo-longmino-mix-0625": (998, 998, "allenai/dolma3-tokenizer"),
    "OLMo-mix-0925-official": (950, 950, "allenai/dolma3-tokenizer"),
    "OLMo-midtraining-mix-0925-ingredient1-100B": (12252, 12252, "allenai/dolma3-tokenizer"),
    "OLMo-midtraining-mix-0925-ingredient2-100B": (12252, 12252, "allenai/dolma3-tokenizer"),
    "OLMo-longmino-mix-0925": (1000, 1000, "allenai/dolma3-tokenizer"),
    # DataMix.build has no case for it: {TOKENIZER} is `TokenizerName.dolma2` itself. Five dclm files
    # are listed twice, and read twice.
    "OLMoE-mix-0824": (1122, 1117, "allenai/dolma2-tokenizer"),
}
# The OLMo 2 anneal mixes (upsampled sources listed again): name -> (files, distinct files, first label).
ANNEAL_MANIFESTS = {
    "dolmino100": (1253, 697, "personahub_math_v5_regen_149960"),
    "dolmino300": (2476, 992, "pes2o"),
}


def test_every_training_mix_has_its_rule_here():
    assert sorted(MIXES) == sorted([*DATAMIX_MANIFESTS, *ANNEAL_MANIFESTS])


@pytest.mark.parametrize("name", list(DATAMIX_MANIFESTS))
def test_manifests_ship_with_the_package_in_their_order(name):
    count, distinct, tokenizer = DATAMIX_MANIFESTS[name]
    entries = load_mix(name)
    lines = _manifest_lines(name)
    assert len(entries) == len(lines) == count
    assert [e.label for e in entries] == [label for label, _ in lines]
    assert [e.path for e in entries] == [p.replace("{TOKENIZER}", tokenizer) for _, p in lines]
    assert len({e.path for e in entries}) == distinct
    assert all(e.path.startswith("preprocessed/") and f"/{tokenizer}/" in e.path for e in entries)
    assert mix_paths(name, "gs://b") == [f"gs://b/{p.replace('{TOKENIZER}', tokenizer)}" for _, p in lines]


@pytest.mark.parametrize("name", list(ANNEAL_MANIFESTS))
def test_anneal_manifests_keep_their_order_and_repeats(name):
    count, distinct, first_label = ANNEAL_MANIFESTS[name]
    entries = load_mix(name)
    lines = _anneal_manifest_lines(name)
    assert len(entries) == len(lines) == count
    assert [(e.label, e.path) for e in entries] == lines
    assert len({e.path for e in entries}) == distinct < count
    assert all(e.path.startswith("preprocessed/") and e.path.endswith(".npy") for e in entries)
    assert mix_paths(name, "gs://b/") == [f"gs://b/{path}" for _, path in lines]
    assert entries[0].label == first_label and entries[-1].label == "dclm"


# sha256 of each manifest as OLMo-core holds it at fa6c5014 (src/olmo_core/data/mixes/ and, for the
# anneal mixes, src/scripts/train/OLMo2/anneal/): the shipped files are those, unchanged.
UPSTREAM_SHA256 = {
    "OLMo-mix-0925-official": "e72803971ba7150d7ecf6260a21abb4086953bd915edcb96881d2e78b1de6471",
    "OLMo-midtraining-mix-0925-ingredient1-100B": "44b28e8585c472251b942d505d3278f1049576ca775db0b16001712021667ecf",
    "OLMo-midtraining-mix-0925-ingredient2-100B": "27b0cc8c9466a29493b063660408033e44efd4aada710f72c9a273a8c303ab93",
    "OLMo-longmino-mix-0925": "1d71bfa279f7aee8c68cb0a27dcbcf4a045de58e21df77e3d16b5c7a1b3dc99b",
    "OLMoE-mix-0824": "b784bb2a3867ac4ecb0e54bdbab87bfefd64808b4b5ea649bb71d07f0b9e0a0f",
    "dolmino100": "a25e1c71bf2c89b216b1abee3fa3e8d2bb5669691215be7bbda07da9b1bda2fb",
    "dolmino300": "a7d25e2ebfc1fbf8e09d9afa51c10bf661eebcf29c507e12efbf91fae5b98697",
}


@pytest.mark.parametrize("name", list(UPSTREAM_SHA256))
def test_the_32b_manifests_are_upstream_s_unchanged(name):
    assert hashlib.sha256((MIXES_DIR / f"{name}.txt").read_bytes()).hexdigest() == UPSTREAM_SHA256[name]


def test_stage1_mix_order_is_the_manifest_s_not_sorted():
    paths = [e.path for e in load_mix("OLMo-mix-0625-official")]
    assert paths[0] == (
        "preprocessed/dolma3-0625/v0.1-official/allenai/dolma3-tokenizer/"
        "common_crawl/adult_content/000000.npy"
    )
    assert "/dolma1_7-wiki-en/" in paths[-1]
    assert paths != sorted(paths)


def test_paths_are_built_like_olmo_core():
    # DataMix.build: base_dir gets one trailing "/", then the path with {TOKENIZER} substituted.
    first = load_mix("OLMo-longmino-mix-0625")[0].path
    assert first == "preprocessed/dolma3_longmino_0625/allenai/dolma3-tokenizer/000000.npy"
    assert mix_paths("OLMo-longmino-mix-0625", "gs://b")[0] == f"gs://b/{first}"
    assert mix_paths("OLMo-longmino-mix-0625", "gs://b/")[0] == f"gs://b/{first}"
    with pytest.raises(BadInput, match="not a data mix"):
        load_mix("OLMo-mix-0625")


def _materialise(root: Path, name: str) -> list[str]:
    """Every file of the mix under root, small and distinct (i+1 uint32 tokens for file i)."""
    paths = mix_paths(name, str(root))
    for i, p in enumerate(paths):
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(b"\x01\x00\x00\x00" * (i % 7 + 1))
    return paths


def test_data_info_lists_the_stage1_mix_in_order_and_a_missing_file_exits_2(tmp_path):
    root = tmp_path / "olmo-data"
    paths = _materialise(root, "OLMo-mix-0625-official")
    (root / "preprocessed" / "stray.npy").write_bytes(b"\0" * 16)  # outside the mix: never picked up
    p = cli("data", "info", "--stage", "1", "--set", f"data.root={root}", "-o", "json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["files"] == paths and d["train_files"] == 1016 and d["mix"] == "OLMo-mix-0625-official"
    assert d["train_tokens"] == sum(i % 7 + 1 for i in range(1016))
    assert d["first_file"] == paths[0] and d["last_file"] == paths[-1]
    # The fingerprint covers the names relative to data.root: the same mix elsewhere fingerprints the same.
    names = [f.name for f in resolve_files(load_recipe(stage=1, overrides=[f"data.root={root}/"]))]
    assert names == [e.path for e in load_mix("OLMo-mix-0625-official")]

    os.remove(paths[500])
    p = cli("data", "info", "--stage", "1", "--set", f"data.root={root}", "-o", "json")
    assert p.returncode == 2 and p.stdout == ""
    assert paths[500] in p.stderr and "does not exist" in p.stderr
    assert len(p.stderr.strip().splitlines()) <= 2  # one line of error, one of hint
    os.remove(paths[0])
    with pytest.raises(BadInput, match=r"000000\.npy` does not exist \(and 1 more of its 1016 files\)"):
        resolve_mix("OLMo-mix-0625-official", str(root))


def test_data_info_reads_a_32b_stage_s_mix_with_its_repeats_in_order(tmp_path):
    # `--model olmo2-32b --stage 2` is the anneal on dolmino100, whose upsampled files repeat.
    root = tmp_path / "olmo-data"
    paths = _materialise(root, "dolmino100")
    p = cli(
        "data", "info", "--model", "olmo2-32b", "--stage", "2", "--set", f"data.root={root}", "-o", "json"
    )
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["mix"] == "dolmino100" and d["files"] == paths and d["train_files"] == 1253
    assert d["train_tokens"] == sum(os.path.getsize(x) // 4 for x in paths)  # a repeat is read again
    # The same files under --stage 2 alone are the 7B's stage 2, which names another mix.
    p = cli("data", "info", "--stage", "2", "--set", f"data.root={root}", "-o", "json")
    assert p.returncode == 2 and "OLMo-midtraining-mix-0625-100B" in p.stderr


def test_a_mix_needs_a_root_and_a_glob_remains_possible(tmp_path):
    with pytest.raises(BadInput, match="needs data.root"):
        resolve_files(load_recipe(stage=3, overrides=["data.root=''"]))
    (tmp_path / "x.npy").write_bytes(b"\0" * 64)
    r = load_recipe(
        stage=1, overrides=["data.mix=''", f"data.root={tmp_path}", "data.train=['{root}/*.npy']"]
    )
    assert [f.name for f in resolve_files(r)] == ["x.npy"]


@pytest.mark.gcs
def test_a_mix_on_gcs_resolves_with_one_listing(tmp_path):
    from olmo_ctl import storage
    from olmo_ctl.sandbox.gcs_emulator import gcs_emulator

    with gcs_emulator() as (_, bucket):
        storage._gcs = None
        try:
            root = f"gs://{bucket}/olmo-data"
            paths = mix_paths("OLMo-longmino-mix-0625", root)
            store = storage.store_for(root)
            for i, p in enumerate(paths[:-1]):
                store.write_bytes(p, b"\x02\x00\x00\x00" * (i % 3 + 1))
            store.write_bytes(f"{root}/preprocessed/dolma3_longmino_0625/stray.npy", b"\0" * 8)
            with pytest.raises(BadInput, match=r"000997\.npy` does not exist"):
                resolve_mix("OLMo-longmino-mix-0625", root)
            store.write_bytes(paths[-1], b"\x02\x00\x00\x00")
            got = resolve_mix("OLMo-longmino-mix-0625", root + "/")
            assert [f.path for f in got] == paths
            assert [f.name for f in got] == [e.path for e in load_mix("OLMo-longmino-mix-0625")]
            assert [f.size for f in got[:4]] == [4, 8, 12, 4]
        finally:
            storage._gcs = None
