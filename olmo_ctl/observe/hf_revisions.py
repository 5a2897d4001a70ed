"""`hf:ORG/NAME`: a reference whose checkpoints are revisions of a Hugging Face repository.

AI2 publishes intermediate checkpoints as revisions (git branches) named by step, and by tokens
trained: `allenai/Olmo-3-1025-7B@stage1-step10000`, `allenai/OLMo-2-0325-32B@stage1-step10000-tokens42B`.
They are read from the local Hugging Face cache, laid out as huggingface_hub lays it out:
`models--ORG--NAME/refs/<revision>` (a file holding a commit hash) and
`models--ORG--NAME/snapshots/<hash>/` (that commit's files: config.json, safetensors, tokenizer), a
Hugging Face model directory that `open_checkpoint` converts in memory.

Reading the cache needs no huggingface_hub. Where it is installed (and HF_HUB_OFFLINE is not set), a
revision asked for by name (`hf:ORG/NAME@REV,...`) that the cache lacks is downloaded into the cache,
and a repository the cache holds no revision of is listed, so the refusal names revisions there are.
Nothing is downloaded unless a revision is named.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from olmo_ctl.core.errors import BadInput

PREFIX = "hf:"
# A checkpoint's name -> its step (group 1) and the billions of tokens the name states (group 2): AI2's
# revision names (`stage1-step10000-tokens42B`, `step20000-tokens84B`, `stage1-step10000`) and the
# directories named like them (`step-10000`, `10000`). The step is the number after `step`, not the
# name's last number.
CHECKPOINT_NAME = re.compile(r"^(?:.*?step[-_]?)?(\d+)(?:[-_]tokens(\d+)B)?$")
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
FORMAT = "hf:ORG/NAME or hf:ORG/NAME@REVISION[,REVISION...], e.g. hf:allenai/Olmo-3-1025-7B@stage1-step10000"


@dataclass(frozen=True)
class Revision:
    """One revision of a repository that names a step."""

    name: str  # stage1-step10000-tokens42B
    step: int  # checkpoint <step>: the state after that many steps
    tokens_b: int | None  # billions of tokens trained, as the name rounds them; None: the name has none
    path: str  # its snapshot directory in the cache


def step_of(name: str) -> tuple[int, int | None] | None:
    """(step, billions of tokens or None) of a checkpoint's name; None when the name gives no step."""
    m = CHECKPOINT_NAME.match(name)
    if m is None:
        return None
    return int(m.group(1)), None if m.group(2) is None else int(m.group(2))


def hub_cache(environ: Mapping[str, str] = os.environ) -> str:
    """The Hugging Face hub cache huggingface_hub uses: $HF_HUB_CACHE (or the older
    $HUGGINGFACE_HUB_CACHE), else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    ~/.cache/huggingface/hub. Read from `environ` on each call (huggingface_hub reads it once, on import)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if environ.get(var):
            return os.path.expandvars(os.path.expanduser(environ[var]))
    home = environ.get("HF_HOME") or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return os.path.join(os.path.expandvars(os.path.expanduser(home)), "hub")


def parse(ref: str) -> tuple[str, tuple[str, ...]]:
    """`hf:ORG/NAME[@REV,REV...]` -> (the repository id, the revisions named: () for all in the cache)."""
    if not ref.startswith(PREFIX):
        raise BadInput(f"`{ref}` is not a Hugging Face reference", FORMAT)
    repo_id, _, revs = ref[len(PREFIX) :].partition("@")
    names = tuple(dict.fromkeys(r.strip() for r in revs.split(",") if r.strip()))
    if not REPO_ID.match(repo_id) or (revs and not names):
        raise BadInput(f"`{ref}` is not a Hugging Face reference", FORMAT)
    for name in names:
        if step_of(name) is None:
            raise BadInput(
                f"{PREFIX}{repo_id}: revision {name} names no step",
                "AI2's checkpoints are revisions named by step, e.g. stage1-step10000",
            )
    return repo_id, names


def repo_dir(cache: str, repo_id: str) -> str:
    return os.path.join(cache, "models--" + repo_id.replace("/", "--"))


def cached(repo_id: str, cache: str) -> dict[str, str | None]:
    """{revision: its snapshot directory, or None when the cache has the ref but not the model (no
    config.json there: a download that did not finish)} of every ref the cache holds of the repository."""
    refs = os.path.join(repo_dir(cache, repo_id), "refs")
    out: dict[str, str | None] = {}
    for root, _, files in os.walk(refs):
        for f in files:
            name = os.path.relpath(os.path.join(root, f), refs).replace(os.sep, "/")
            with open(os.path.join(root, f)) as fh:
                commit = fh.read().strip()
            snapshot = os.path.join(repo_dir(cache, repo_id), "snapshots", commit)
            out[name] = snapshot if commit and os.path.isfile(os.path.join(snapshot, "config.json")) else None
    return out


def _hub():
    """huggingface_hub, where it is installed and may reach the network (HF_HUB_OFFLINE unset); else None."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    try:
        import huggingface_hub
    except ImportError:
        return None
    return huggingface_hub


def missing(repo_id: str, revision: str, cache: str, why: str = "") -> BadInput:
    """The refusal of a revision the cache lacks: the repository, the revision and what to do."""
    return BadInput(
        f"{PREFIX}{repo_id}: revision {revision} is not in the Hugging Face cache ({cache}){why}",
        f"download it with `hf download {repo_id} --revision {revision}`",
    )


def _download(repo_id: str, revision: str, cache: str) -> None:
    """Fetch `revision` into the cache with huggingface_hub, or refuse it in one line."""
    hub = _hub()
    if hub is None:
        raise missing(repo_id, revision, cache)
    try:
        hub.snapshot_download(repo_id, revision=revision, cache_dir=cache)
    except Exception as e:  # no network, no such revision, a gated repository: all the same to the user
        raise missing(repo_id, revision, cache, f" and could not be downloaded: {type(e).__name__}") from None


def _listed(repo_id: str) -> list[str]:
    """The repository's branches that name a step, over the network; [] when it cannot be asked."""
    hub = _hub()
    if hub is None:
        return []
    try:
        refs = hub.list_repo_refs(repo_id)
    except Exception:
        return []
    named = [(s[0], b.name) for b in refs.branches if (s := step_of(b.name)) is not None]
    return [name for _, name in sorted(named)]


def revisions(ref: str, cache: str | None = None, steps: list[int] | None = None) -> dict[int, Revision]:
    """{step: Revision} of an `hf:` reference: the revisions it names (each downloaded where the
    cache lacks it and huggingface_hub can), or every revision of the cache that names a step. With
    `steps` (verify's --steps) and no revision named, a step the cache lacks is the repository's
    revision of that step, downloaded where the network allows (else the landmark check names it)."""
    repo_id, names = parse(ref)
    cache = hub_cache() if cache is None else cache
    have = cached(repo_id, cache)
    cached_steps = {s[0] for n, p in have.items() if p is not None and (s := step_of(n)) is not None}
    lacking = [s for s in steps or () if s not in cached_steps]
    if not names and lacking:
        by_step: dict[int, list[str]] = {}
        for name in _listed(repo_id):
            by_step.setdefault((step_of(name) or (0, None))[0], []).append(name)
        for step in lacking:
            if len(by_step.get(step, [])) == 1:  # two revisions of one step: the user names one
                _download(repo_id, by_step[step][0], cache)
        have = cached(repo_id, cache)
    for name in names:
        if have.get(name) is None:
            _download(repo_id, name, cache)
            have = cached(repo_id, cache)
            if have.get(name) is None:
                raise missing(repo_id, name, cache)
    chosen = names or tuple(n for n in sorted(have) if step_of(n) is not None)
    if not chosen:
        listed = _listed(repo_id)
        hint = (
            f"its revisions: {', '.join(listed[:3])}{', ...' if len(listed) > 3 else ''} ({len(listed)}); "
            if listed
            else ""
        )
        raise BadInput(
            f"{PREFIX}{repo_id}: no revision named by step is in the Hugging Face cache ({cache})",
            f"{hint}download one with `hf download {repo_id} --revision stage1-stepN`, "
            f"or name it: --reference {PREFIX}{repo_id}@REVISION",
        )
    out: dict[int, Revision] = {}
    for name in chosen:
        path = have[name]
        if path is None:  # a ref whose snapshot is not there: refused, not skipped (a landmark would vanish)
            raise missing(repo_id, name, cache, " (its ref is there, its config.json is not)")
        step, tokens_b = step_of(name) or (0, None)
        if step in out:
            raise BadInput(
                f"{PREFIX}{repo_id}: revisions {out[step].name} and {name} are both step {step}",
                f"name the one to compare: --reference {PREFIX}{repo_id}@{name}",
            )
        out[step] = Revision(name, step, tokens_b, path)
    return out


def checkpoints(ref: str, steps: list[int] | None = None) -> dict[int, str]:
    """{step: snapshot directory} of an `hf:` reference (`verify`'s `checkpoints_of`)."""
    return {step: r.path for step, r in sorted(revisions(ref, steps=steps).items())}


def tokens_per_step(revs: Mapping[int, Revision]) -> float | None:
    """Tokens per step as the revision names state it (at the last step that states tokens, where the
    rounding to whole billions weighs least); None when no name states tokens."""
    stated = [(r.step, r.tokens_b) for r in revs.values() if r.tokens_b is not None and r.step > 0]
    if not stated:
        return None
    step, tokens_b = max(stated)
    return tokens_b * 1e9 / step
