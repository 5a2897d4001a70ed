"""The data mixes: AI2's file lists, shipped with the package (olmo_ctl/data/mixes/*.txt).

Each manifest is copied unchanged from OLMo-core (snapshot fa6c5014) and read by the rule of the
OLMo-core class that reads it there; the line order is the file order (and so the instance numbering
the shuffle permutes), `#` lines and blank lines are skipped, repeated lines are kept (a repeated
file is read again, as upstream):

* `DataMix` manifests (`src/olmo_core/data/mixes/<NAME>.txt`, read by `DataMix.build`,
  `src/olmo_core/data/mixes/__init__.py:80-126`): one `label,path` per line. `{TOKENIZER}` becomes
  the tokenizer directory `DataMix.build` picks for the mix and the dolma2 tokenizer:
  `allenai/dolma3-tokenizer` for the OLMo 3 mixes (the dolma2 tokenizer under the name they are
  stored with), `dolma2-tokenizer` for the validation mix `v3-small-ppl-validation`,
  `allenai/dolma2-tokenizer` (the tokenizer's own identifier) for `OLMoE-mix-0824`.
* The OLMo 2 anneal manifests `dolmino100` and `dolmino300` (`src/scripts/train/OLMo2/anneal/`,
  read by `AnnealingDataMix.build` in `src/scripts/official/OLMo2/OLMo-2-0325-32B-anneal.py:60-76`):
  one path per line, the tokenizer already in it; the label is the path's second component.

Paths are appended to the mix base directory (`data.root`) after one `/`. The validation mixes
(`EVAL_MIXES`) are what `eval.lm` names, never `data.mix`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from olmo_ctl.core.errors import BadInput
from olmo_ctl.core.mixes import EVAL_MIXES, MIXES

MIXES_DIR = Path(__file__).resolve().parent / "mixes"
TOKENIZER_ID = "allenai/dolma3-tokenizer"
# OLMo-core's `DataMix.build` (src/olmo_core/data/mixes/__init__.py:84-110): the dolma2 tokenizer's
# directory name for the mixes not stored under TOKENIZER_ID.
MIX_TOKENIZER_IDS = {
    "v3-small-ppl-validation": "dolma2-tokenizer",
    "OLMoE-mix-0824": "allenai/dolma2-tokenizer",  # no case of its own: `TokenizerName.dolma2` itself
}
# Manifests of bare paths (`AnnealingDataMix`): label = the path's second `/` component.
PATH_ONLY_MIXES = frozenset({"dolmino100", "dolmino300"})


@dataclass(frozen=True)
class MixEntry:
    label: str  # the source group (common_crawl_adult_content); in a validation mix the evaluator's label
    path: str  # relative to the mix base directory, {TOKENIZER} substituted


def known_mixes() -> list[str]:
    return sorted(MIXES)


def known_eval_mixes() -> list[str]:
    return sorted(EVAL_MIXES)


@functools.lru_cache(maxsize=8)
def load_mix(name: str) -> tuple[MixEntry, ...]:
    """The mix's files in the manifest's order (BadInput for an unknown name or a bad line)."""
    if name not in MIXES and name not in EVAL_MIXES:
        raise BadInput(
            f"`{name}` is not a data mix",
            f"known mixes: {', '.join(known_mixes())}; validation mixes: {', '.join(known_eval_mixes())}",
        )
    tokenizer_id = MIX_TOKENIZER_IDS.get(name, TOKENIZER_ID)
    src = MIXES_DIR / f"{name}.txt"
    out = []
    for i, line in enumerate(src.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if name in PATH_ONLY_MIXES:
            parts = line.split("/")
            if "," in line or len(parts) < 3:
                raise BadInput(f"{src}:{i}: not a bare `preprocessed/SOURCE/.../FILE` path")
            out.append(MixEntry(parts[1], line))
            continue
        label, sep, path = line.partition(",")
        if not sep or "," in path or "{TOKENIZER}" not in path:
            raise BadInput(f"{src}:{i}: not a `label,path` line with {{TOKENIZER}} in the path")
        out.append(MixEntry(label, path.replace("{TOKENIZER}", tokenizer_id)))
    return tuple(out)


def mix_paths(name: str, base_dir: str) -> list[str]:
    """Full paths of the mix's files under `base_dir`, as OLMo-core builds them."""
    if not base_dir.endswith("/"):
        base_dir = base_dir + "/"
    return [f"{base_dir}{e.path}" for e in load_mix(name)]
