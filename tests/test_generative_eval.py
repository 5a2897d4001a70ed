"""Generative evaluation (`olmo-ctl eval --generative`): problems written here, in AI2's RLVR layout.

Unit: the prompt building (each chat template and none) and the scoring, with a stand-in engine that
returns known completions (the KV-cache decoder itself is tests/test_decode.py's), so the accuracy and
its standard error are known for gsm8k, math and ifeval problems. End to end: `olmo-ctl eval` on the
session's smoke run (a byte-level model, so plain prompts and `--chat-template none`), greedy, 8 new
tokens. Bad input: one line, exit 2, before the model is read."""

from __future__ import annotations

import json
import math

import pytest
from helpers.cli import clean_env, invoke

from olmo_ctl.checkpoints import generative as G
from olmo_ctl.core.errors import BadInput
from olmo_ctl.data.chat import chat_tokenizer
from olmo_ctl.trainer.decode import Completion, Sampling

GSM8K = [
    {
        "messages": [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"}],
        "ground_truth": "7",
    },
    {"prompt": "What is 6 times 7?", "ground_truth": "42", "dataset": "gsm8k"},
    {"prompt": "What is 10 minus 4?", "ground_truth": ["6"], "dataset": ["gsm8k"]},
]
MATH = [
    {"prompt": "Compute 1/2 + 0.", "ground_truth": "\\frac{1}{2}", "dataset": "math"},
    {"prompt": "What is 2+3?", "ground_truth": "5", "dataset": "math"},
]
IFEVAL = [
    {
        "prompt": "Describe rain without commas.",
        "ground_truth": json.dumps({"func_name": "validate_no_commas"}),
        "dataset": "ifeval",
    },
    {
        "prompt": "Say hello in lowercase.",
        "ground_truth": {"func_name": "validate_lowercase"},
        "dataset": "ifeval",
    },
]


def _write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


class StandIn:
    """An Engine test double: the completion for each prompt text, looked up by the text it contains."""

    def __init__(self, tok, answers: dict[str, str]):
        self.tok, self.answers, self.seen = tok, answers, []

    def generate(self, prompts, sampling):
        out = []
        for ids in prompts:
            text = self.tok.hf.decode(list(ids), skip_special_tokens=False)
            self.seen.append(text)
            answer = next(a for k, a in self.answers.items() if k in text)
            out.append(Completion(self.tok.encode_batch([answer])[0], "stop", answer))
        return out


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()  # builtin://bytes, EOS 256


def test_prompts_from_messages_and_text_with_each_template(tmp_path, tok):
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1"},
                {"role": "user", "content": "Q2"},
                {"role": "assistant", "content": "the reference answer"},
            ],
            "ground_truth": "1",
        },
        {"prompt": "Q3", "ground_truth": "2"},
    ]
    probs = G.read_problems(_write(tmp_path / "p.jsonl", rows), "gsm8k")
    assert [p.dataset for p in probs] == ["gsm8k", "gsm8k"]
    assert [m["content"] for m in probs[0].messages] == [
        "Be brief.",
        "Q1",
        "A1",
        "Q2",
    ]  # to the last user turn
    assert G.prompt_text(probs[0], "none") == "Q2" and G.prompt_text(probs[1], "none") == "Q3"
    eos = tok.eos_token
    assert G.prompt_text(probs[1], "tulu", tok) == f"{eos}<|user|>\nQ3\n<|assistant|>\n"
    assert G.prompt_text(probs[0], "tulu", tok) == (
        f"{eos}<|system|>\nBe brief.\n<|user|>\nQ1\n<|assistant|>\nA1{eos}\n<|user|>\nQ2\n<|assistant|>\n"
    )
    olmo = G.prompt_text(probs[1], "olmo", tok)
    assert olmo.startswith("<|im_start|>system\n") and olmo.endswith(
        "<|im_start|>user\nQ3<|im_end|>\n<|im_start|>assistant\n"
    )
    assert G.read_problems(str(tmp_path / "p.jsonl"), "gsm8k", limit=1) == probs[:1]


def test_accuracy_and_stderr_of_known_completions(tmp_path, tok):
    problems = {
        "gsm8k": G.read_problems(_write(tmp_path / "g.jsonl", GSM8K), "gsm8k"),
        "math": G.read_problems(_write(tmp_path / "m.jsonl", MATH), "math"),
        "ifeval": G.read_problems(_write(tmp_path / "i.jsonl", IFEVAL), "anything"),
    }
    engine = StandIn(
        tok,
        {
            "3 apples": "He has 3 + 4 = 7 apples. The answer is 7.",  # right
            "6 times 7": "6 times 7 is 42",  # right
            "10 minus 4": "It is 5.",  # wrong
            "1/2": "So the sum is $\\boxed{0.5}$.",  # right: 0.5 is \frac{1}{2}
            "2+3": "Final Answer: The final answer is $6$. I hope it is correct.",  # wrong
            "rain": "Rain falls softly on the roof",  # no comma: followed
            "hello": "Hello there",  # not lower case
        },
    )
    sampling = Sampling(max_tokens=8, stop_token_ids=(tok.eos_token_id,))
    out = G.evaluate(problems, engine, tok, sampling, template="tulu")
    assert all(
        s.startswith(tok.eos_token + "<|user|>\n") and s.endswith("<|assistant|>\n") for s in engine.seen
    )
    assert [x["score"] for x in out["gsm8k"].items] == [1.0, 1.0, 0.0]
    assert out["gsm8k"].summary() == {"accuracy": 2 / 3, "stderr": math.sqrt(2 / 3 * 1 / 3 / 3), "n": 3}
    assert out["math"].summary() == {"accuracy": 0.5, "stderr": math.sqrt(0.25 / 2), "n": 2}
    assert out["ifeval"].summary() == {"accuracy": 0.5, "stderr": math.sqrt(0.25 / 2), "n": 2}
    item = out["gsm8k"].items[1]
    assert (
        item["prompt"].endswith("What is 6 times 7?\n<|assistant|>\n")
        and item["completion"] == "6 times 7 is 42"
    )
    G.write_items(out, str(tmp_path / "items.jsonl"))
    lines = [json.loads(x) for x in (tmp_path / "items.jsonl").read_text().splitlines()]
    assert len(lines) == 7 and lines[0]["label"] == "gsm8k" and lines[0]["score"] == 1.0
    assert G.stderr_of(1.0, 4) == 0.0


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("not json", ":2 is not JSON"),
        ({"prompt": "Q"}, ":2 has no `ground_truth`"),
        ({"prompt": "Q", "ground_truth": "1", "dataset": "code"}, ":2: dataset 'code' has no verifier"),
        ({"ground_truth": "1"}, ":2 has neither `messages` nor a `prompt` text"),
        (
            {"messages": [{"role": "assistant", "content": "A"}], "ground_truth": "1"},
            ":2: `messages` has no user turn",
        ),
    ],
)
def test_a_bad_line_is_named(tmp_path, row, message):
    path = _write(tmp_path / "p.jsonl", [GSM8K[1], row])
    with pytest.raises(BadInput) as err:
        G.read_problems(path, "gsm8k")
    assert err.value.message == path + message


def test_a_line_without_dataset_needs_a_verifier_label(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "Q", "ground_truth": "1"}])
    with pytest.raises(BadInput, match=r"p\.jsonl:1 has no `dataset`, and the label `mine`"):
        G.read_problems(path, "mine")


# ------------------------------------------------------------------------- the command line


@pytest.fixture
def env(tmp_path):
    return clean_env(tmp_path / "xdg")


def _ckpt(smoke_run) -> str:
    return str(smoke_run / "checkpoints" / "40")


def test_eval_generative_on_the_smoke_checkpoint(smoke_run, tmp_path, env):
    path = _write(tmp_path / "gsm8k.jsonl", [{k: v for k, v in r.items() if k != "dataset"} for r in GSM8K])
    items = tmp_path / "items.jsonl"
    p = invoke(
        "eval", _ckpt(smoke_run), "--recipe", "smoke", "--generative", f"gsm8k={path}",
        "--chat-template", "none", "--max-tokens", "8", "--generative-out", str(items), "-o", "json",
        env=env,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["checkpoint"] == _ckpt(smoke_run) and r["step"] == 40 and r["lm"] == {} and r["downstream"] == {}
    g = r["generative"]["gsm8k"]
    assert set(g) == {"accuracy", "stderr", "n"} and g["n"] == 3 and 0 <= g["accuracy"] <= 1
    rows = [json.loads(x) for x in items.read_text().splitlines()]
    assert [x["prompt"] for x in rows] == [
        GSM8K[0]["messages"][0]["content"],
        GSM8K[1]["prompt"],
        GSM8K[2]["prompt"],
    ]
    assert all(len(x["completion"].encode()) <= 8 * 4 and x["score"] in (0.0, 1.0) for x in rows)


def _bad(smoke_run, env, *args: str):
    p = invoke("eval", _ckpt(smoke_run), "--recipe", "smoke", "--chat-template", "none", *args, env=env)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), p.stderr
    return lines[0]


def test_bad_generative_input_is_one_line_exit_2(smoke_run, tmp_path, env):
    missing = str(tmp_path / "nope.jsonl")
    assert f"--generative gsm8k={missing}: no such file" in _bad(
        smoke_run, env, "--generative", f"gsm8k={missing}"
    )
    path = _write(tmp_path / "p.jsonl", [GSM8K[1], {"prompt": "Q"}])
    assert f"{path}:2 has no `ground_truth`" in _bad(smoke_run, env, "--generative", f"gsm8k={path}")
    unknown = _write(tmp_path / "u.jsonl", [{"prompt": "Q", "ground_truth": "1", "dataset": "code"}])
    assert f"{unknown}:1: dataset 'code' has no verifier" in _bad(
        smoke_run, env, "--generative", f"x={unknown}"
    )
    good = _write(tmp_path / "g.jsonl", GSM8K)
    assert "--chat-template 'chatml'" in _bad(
        smoke_run, env, "--generative", f"gsm8k={good}", "--chat-template", "chatml"
    )
    assert "not yet" in _bad(
        smoke_run, env, "--generative", f"gsm8k={good}", "--backend", "gke", "--device", "v5p-8"
    )
