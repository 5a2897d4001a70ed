"""Generative evaluation: a checkpoint's completions of written problems, scored by open-instruct's
verifiers (`verifiers.verify`: GSM8K's last number, MATH's normalized answer, IFEval's RLVR constraint).

The problems are JSONL in the layout of AI2's RLVR data sets, one object a line:

    {"messages": [{"role": "user", "content": "..."}], "ground_truth": "18", "dataset": "gsm8k"}
    {"prompt": "...", "ground_truth": "18"}

`messages` (a chat; the prompt is the conversation up to its last user turn) or `prompt` (text);
`ground_truth` (text, or an IFEval constraint's object); `dataset` (gsm8k, math or ifeval; a line
without one takes its file's label when the label names a verifier: `--generative gsm8k=PATH`). A
one-element list of `dataset` or `ground_truth` (as some RLVR sets hold them) is its element.

Each prompt is rendered with a chat template (`data/chat.py`: tulu or olmo, with the generation
prompt) or, with none, is the raw prompt text (a chat's last user turn), tokenized without special
tokens, continued by an `Engine` (`trainer/decode.py`; greedy by default, stopping at the model's
EOS), and the completion's text scored. A file's result: its accuracy (the mean score), the standard
error sqrt(p(1-p)/n), n, and each item's prompt, completion and score.

Everything that reads input (`read_problems`) runs before any parameter is read: a bad line is a
BadInput naming `file:line`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from olmo_ctl.core.errors import BadInput

TEMPLATES = ("tulu", "olmo", "none")
LAYOUT = 'one JSON object a line: {"messages": [...] or "prompt": "...", "ground_truth": ..., "dataset": ...}'


@dataclass(frozen=True)
class Problem:
    """One line of a problems file: where it is (`file:line`), its verifier, its prompt, its answer."""

    where: str
    dataset: str
    messages: tuple[dict, ...]  # the chat up to its last user turn (a `prompt` line: one user turn)
    ground_truth: Any

    @property
    def text(self) -> str:
        """The raw prompt text: the last user turn's content."""
        return str(self.messages[-1]["content"])


@dataclass
class Result:
    """A file's score: accuracy (mean score), its standard error, n, and each item's record."""

    label: str
    accuracy: float
    stderr: float
    n: int
    items: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        return {"accuracy": self.accuracy, "stderr": self.stderr, "n": self.n}


def parse_generative(values: Sequence[str]) -> dict[str, str]:
    """`--generative NAME=PATH` (repeatable): {label: path}, in order; a label given twice is refused."""
    out: dict[str, str] = {}
    for v in values:
        label, sep, path = (x.strip() for x in v.partition("="))
        if not sep or not label or not path:
            raise BadInput(f"--generative `{v}` is not NAME=PATH", "e.g. --generative gsm8k=problems.jsonl")
        if label in out:
            raise BadInput(f"--generative: the label `{label}` is given twice", "one file per label")
        out[label] = path
    return out


def _one(value: Any) -> Any:
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def read_problems(path: str, label: str, limit: int = 0) -> list[Problem]:
    """The problems of the JSONL file at `path` (local or gs://), the first `limit` of them (0: all);
    a BadInput naming `path:line` for a line that is not one."""
    from olmo_ctl import storage
    from olmo_ctl.data.chat import check_messages
    from olmo_ctl.evaluation.verifiers import VERIFIERS

    known = ", ".join(sorted(VERIFIERS))
    try:
        text = storage.store_for(path).read_text(path)
    except (storage.NotFound, FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise BadInput(f"--generative {label}={path}: no such file", LAYOUT) from None
    out: list[Problem] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if limit and len(out) >= limit:
            break
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise BadInput(f"{where} is not JSON", LAYOUT) from None
        if not isinstance(row, dict):
            raise BadInput(f"{where} is not a JSON object", LAYOUT)
        if row.get("ground_truth") is None:
            raise BadInput(f"{where} has no `ground_truth`", LAYOUT)
        dataset = _one(row.get("dataset"))
        if dataset is None:
            if label.lower() not in VERIFIERS:
                raise BadInput(
                    f"{where} has no `dataset`, and the label `{label}` names no verifier",
                    f"give each line a `dataset` ({known}) or label the file with one: --generative gsm8k=PATH",
                )
            dataset = label
        if not isinstance(dataset, str) or dataset.lower() not in VERIFIERS:
            raise BadInput(f"{where}: dataset {dataset!r} has no verifier", f"known: {known}")
        if "messages" in row:
            try:
                msgs = check_messages(row["messages"], "tulu")
            except ValueError as err:
                raise BadInput(f"{where}: {err}", LAYOUT) from None
            last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
            if last_user is None:
                raise BadInput(f"{where}: `messages` has no user turn", "the last user turn is the prompt")
            messages = tuple(msgs[: last_user + 1])
        elif isinstance(row.get("prompt"), str) and row["prompt"]:
            messages = ({"role": "user", "content": row["prompt"]},)
        else:
            raise BadInput(f"{where} has neither `messages` nor a `prompt` text", LAYOUT)
        out.append(Problem(where, dataset.lower(), messages, _one(row["ground_truth"])))
    if not out:
        raise BadInput(f"--generative {label}={path}: no problems in the file", LAYOUT)
    return out


def prompt_text(problem: Problem, template: str, tok: Any = None) -> str:
    """The text the model continues: the chat rendered by `template` with the generation prompt (the
    template's BOS as open-instruct adds it), or with "none" the raw prompt text."""
    if template == "none":
        return problem.text
    from olmo_ctl.data.chat import DEFAULT_ADD_BOS, render

    return render(
        list(problem.messages), tok, template, DEFAULT_ADD_BOS[template], add_generation_prompt=True
    )


def check_template(template: str) -> str:
    if template not in TEMPLATES:
        raise BadInput(f"--chat-template {template!r} is not a template", f"one of {', '.join(TEMPLATES)}")
    return template


def stderr_of(p: float, n: int) -> float:
    """The standard error of an accuracy `p` over `n` items: sqrt(p(1-p)/n)."""
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def evaluate(
    problems: dict[str, list[Problem]],
    engine: Any,
    tok: Any,
    sampling: Any,
    template: str = "none",
) -> dict[str, Result]:
    """Each label's problems decoded by `engine` (`Engine.generate(prompts, sampling)`, the prompts as
    token ids of `tok`, a `data.chat.ChatTokenizer`) and scored: {label: Result}."""
    from olmo_ctl.evaluation.verifiers import verify

    out: dict[str, Result] = {}
    for label, probs in problems.items():
        texts = [prompt_text(p, template, tok) for p in probs]
        ids = tok.encode_batch(texts)
        for p, i in zip(probs, ids, strict=True):
            if not i:
                raise BadInput(f"{p.where}: the prompt has no tokens", "give every problem some text")
        done = engine.generate(ids, sampling)
        items = []
        for p, text, c in zip(probs, texts, done, strict=True):
            completion = c.text if c.text is not None else tok.hf.decode(c.tokens, skip_special_tokens=True)
            score = float(verify(p.dataset, completion, p.ground_truth))
            items.append(
                {
                    "label": label,
                    "dataset": p.dataset,
                    "prompt": text,
                    "completion": completion,
                    "ground_truth": p.ground_truth,
                    "score": score,
                    "finish_reason": c.finish_reason,
                }
            )
        n = len(items)
        acc = sum(x["score"] for x in items) / n
        out[label] = Result(label, acc, stderr_of(acc, n), n, items)
    return out


def write_items(results: dict[str, Result], path: str) -> None:
    """Every item's record, one JSON object a line, label by label (local or gs://)."""
    from olmo_ctl import storage

    lines = [json.dumps(x) for r in results.values() for x in r.items]
    storage.store_for(path).write_text(path, "".join(line + "\n" for line in lines))


def run(
    ckpt: Any,
    problems: dict[str, list[Problem]],
    devices: Sequence[Any],
    *,
    tokenizer: str | None = None,
    template: str = "none",
    max_tokens: int = 256,
    batch_size: int = 8,
) -> dict[str, Result]:
    """The checkpoint `ckpt` (checkpoints/evaluate.Checkpoint) on `devices`: its parameters read over
    them, a JaxEngine, greedy decoding to `max_tokens` or the model's EOS, each label scored."""
    from olmo_ctl.checkpoints.evaluate import load_sharded
    from olmo_ctl.checkpoints.generate import tokenizer_of
    from olmo_ctl.data.chat import chat_tokenizer
    from olmo_ctl.trainer import sharding
    from olmo_ctl.trainer.decode import JaxEngine, Sampling

    tok = chat_tokenizer(tokenizer_of(ckpt, tokenizer), model=ckpt.model)
    sampling = Sampling(max_tokens=max_tokens, stop_token_ids=(ckpt.model.eos_token_id,))
    sampling.check()
    mesh = sharding.make_mesh(list(devices), activate=False)
    params = load_sharded(ckpt, mesh)
    engine = JaxEngine(
        params,
        ckpt.model,
        decode=lambda t: tok.hf.decode(t, skip_special_tokens=True),
        mesh=mesh,
        batch_size=batch_size,
    )
    return evaluate(problems, engine, tok, sampling, template)
