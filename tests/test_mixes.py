"""Data mixes: AI2's manifests ship with the package, paths are built as OLMo-core builds them, and
`data info` lists a mix's files in the manifest's order (a missing file is exit 2, named)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.recipe import load_recipe
from olmo_ctl.data.files import resolve_files, resolve_mix
from olmo_ctl.data.mixes import MIXES_DIR, TOKENIZER_ID, load_mix, mix_paths

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


@pytest.mark.parametrize(
    "name,count",
    [
        ("OLMo-mix-0625-official", 1016),
        ("OLMo-midtraining-mix-0625-100B", 11933),
        ("OLMo-longmino-mix-0625", 998),
    ],
)
def test_manifests_ship_with_the_package_in_their_order(name, count):
    entries = load_mix(name)
    lines = _manifest_lines(name)
    assert len(entries) == len(lines) == count
    assert [e.label for e in entries] == [label for label, _ in lines]
    assert [e.path for e in entries] == [
        p.replace("{TOKENIZER}", "allenai/dolma3-tokenizer") for _, p in lines
    ]
    assert len({e.path for e in entries}) == count  # no repeats
    assert all(e.path.startswith("preprocessed/") and TOKENIZER_ID in e.path for e in entries)


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
