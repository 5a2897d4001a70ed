"""Chat data for post-training (`data prepare --kind sft|preference|prompts`) against open-instruct's own functions.

The oracle: transformers' `PreTrainedTokenizerFast` built from the same tokenizer.json, its chat template the
jinja source of open-instruct's CHAT_TEMPLATES (prefixed with "{{ bos_token }}" as get_tokenizer_tulu_v2_2
does with add_bos, its BOS the EOS as for OLMo's GPTNeoX tokenizers), and faithful ports of
`sft_tulu_tokenize_and_truncate_v1`, `preference_tulu_tokenize_and_truncate_v1` and `rlvr_tokenize_v1` that
call `tokenizer.apply_chat_template` (open-instruct 686a521a3, open_instruct/dataset_transformation.py
lines 607-677, 722-760 and 762-784). olmo_ctl/data/chat.py (plain Python, no jinja) must give the same ids and
masks on every conversation written here, for three tokenizers (a GPT-2-style byte-level BPE, a BPE whose
merges cross message boundaries, and the project's byte tokenizer) and every truncation length.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from olmo_ctl.data import chat
from olmo_ctl.data.chat_files import prepare_chat, read_chat_data
from tests.helpers.cli import invoke

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

EOS = "<|endoftext|>"

# open-instruct 686a521a3 CHAT_TEMPLATES["tulu"] (dataset_transformation.py:171-187), verbatim.
TULU_JINJA = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '<|system|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{% if not loop.last %}"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token + '\n' }}"
    "{% else %}"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endif %}"
    "{% if loop.last and add_generation_prompt %}"
    "{{ '<|assistant|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
)
# open-instruct e6c3044aa CHAT_TEMPLATES["olmo"] (dataset_transformation.py:197-236), verbatim.
OLMO_JINJA = (
    "{% set has_system = messages|selectattr('role', 'equalto', 'system')|list|length > 0 %}"
    "{% if not has_system %}"
    "{{ '<|im_start|>system\nYou are OLMo, a helpful function-calling AI assistant built by Ai2. Your date cutoff is November 2024, and your model weights are available at https://huggingface.co/allenai. You do not currently have access to any functions. <functions></functions><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + message['content'] }}"
    "{% if message.get('functions', none) is not none %}"
    "{{ ' <functions>' + message['functions'] + '</functions><|im_end|>\n' }}"
    "{% else %}"
    "{{ ' You do not currently have access to any functions. <functions></functions><|im_end|>\n' }}"
    "{% endif %}"
    "{% elif message['role'] == 'user' %}"
    "{% if message.get('functions', none) is not none %}"
    "{{ '<|im_start|>user\n' + message['content'] + '\n' + '<functions>' + message['functions'] + '</functions><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>user\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% if message.get('content', none) is not none %}"
    "{{ message['content'] }}"
    "{% endif %}"
    "{% if message.get('function_calls', none) is not none %}"
    "{{ '<function_calls>' + message['function_calls'] + '</function_calls>' }}"
    "{% endif %}"
    "{% if not loop.last %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% else %}"
    "{{ eos_token }}"
    "{% endif %}"
    "{% elif message['role'] == 'environment' %}"
    "{{ '<|im_start|>environment\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% if loop.last and add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
    "{% endfor %}"
)
JINJA = {"tulu": TULU_JINJA, "olmo": OLMO_JINJA}


def S(c):
    return {"role": "system", "content": c}


def U(c):
    return {"role": "user", "content": c}


def A(c):
    return {"role": "assistant", "content": c}


LONG = " ".join(f"the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(40))
# Written here: multi-turn, system turns, an assistant first, users in a row, all-user ones (no label: dropped),
# text that holds the templates' own markers, unicode, empty and blank contents, and long turns to truncate.
CONVERSATIONS = [
    [U("Hello"), A("Hi there!")],
    [S("You are a helpful assistant."), U("What is 2+2?"), A("2+2 is 4.")],
    [
        U("Tell me a joke."),
        A("Why did the chicken cross the road?"),
        U("Why?"),
        A("To get to the other side."),
    ],
    [S("Be brief."), U("a"), A("b"), U("c"), A("d"), U("e"), A("f")],
    [A("I start the conversation."), U("Oh, hello."), A("Hello!")],
    [U("First question."), U("Second question, before any answer."), A("Both answered here.")],
    [U("Question?"), A("Answer."), U("A follow-up the data never answers.")],
    [U("All user, no assistant: nothing to train on.")],
    [S("System."), U("User one."), U("User two.")],
    [U("Écris en français, s'il te plaît."), A("Bien sûr ! Voici: café, naïve, 中文, 🙂.")],
    [U("  leading and trailing spaces  "), A("\n\nnew lines\n\n inside \n")],
    [U("Say nothing."), A("")],
    [U("What does <|endoftext|> mean?"), A("It is the end-of-text token <|endoftext|> itself.")],
    [U("Print <|assistant|>\nplease"), A("<|user|>\nthis is not a user turn")],
    [S("Long."), U("Count for me."), A(LONG), U("Again?"), A(LONG)],
    [S("Long user."), U(LONG), A("That was long."), U(LONG), A("Again long.")],
    [U("Two answers in a row."), A("One."), A("Two.")],
    [S("Only a system prompt, then the assistant."), A("Speaking without being asked.")],
    [U("1, 2, 3, 4, 5... 3.14159 $$ %% && || !!"), A("6, 7, 8; 2.71828 ## @@ ~~")],
    [U("   "), A("   ")],
    [U("Repeat."), A("word " * 60)],
    [U("Hi"), A("Hello."), S("A system turn in the middle."), U("Go on."), A("Going on.")],
    [S("x"), U("y"), A("z")],
    [U("The <|im_start|>user\nmarker and <|im_end|> appear in text."), A("Handled<|im_end|>")],
    [U("A question with a tab\tand a carriage\rreturn."), A("Tab\tanswer.")],
]
PREFERENCES = [
    (c[:-1] + [A(c[-1]["content"])], c[:-1] + [A("A worse answer than " + c[-1]["content"][:20])])
    for c in CONVERSATIONS
    if c[-1]["role"] == "assistant"
] + [([U("All user.")], [U("All user.")])]
PROMPTS = [
    {"messages": [U("What is 3*7?")], "ground_truth": "21", "dataset": "gsm8k"},
    {"messages": [S("Think."), U("Solve x+1=2.")], "ground_truth": "1", "dataset": "MATH"},
    {
        "messages": [U("Q"), A("partial"), U("Q2"), A("dropped last turn")],
        "ground_truth": ["a", "b"],
        "dataset": "ifeval",
    },
    {"messages": [U(LONG)], "ground_truth": "long", "dataset": "long"},
]

TRAIN_TEXT = [
    "Hello, how are you today? I am fine, thank you very much.",
    "The quick brown fox jumps over the lazy dog. 0123456789 numbers and words.",
    "<|user|>\n<|assistant|>\n<|system|>\n user assistant system question answer",
    "Bien sûr, café, naïve. Even odd the number is. Count again, long user turn.",
    LONG,
]


def _bpe(regex: bool) -> str:
    """A small byte-level BPE: with the GPT-2 split (as dolma2's), or without one so merges cross boundaries."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    text = TRAIN_TEXT + [chat.render(c, _FakeEos, "tulu") for c in CONVERSATIONS[:6]]
    tok.train_from_iterator(text, trainer)
    specials = [EOS, "<|pad|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return tok.to_str()


class _FakeEos:
    bos_token = eos_token = EOS


@pytest.fixture(scope="module")
def tok_files(tmp_path_factory) -> dict[str, tuple[str, int]]:
    """name -> (tokenizer.json path, EOS id)."""
    from olmo_ctl.data.tokenizer import BYTE_EOS, BYTES_TOKENIZER, tokenizer_path

    d = tmp_path_factory.mktemp("tok")
    out = {}
    for name, regex in (("bpe", True), ("bpe-noregex", False)):
        p = d / f"{name}.json"
        p.write_text(_bpe(regex))
        eos = tokenizers.Tokenizer.from_file(str(p)).token_to_id(EOS)
        out[name] = (str(p), eos)
    out["bytes"] = (tokenizer_path(BYTES_TOKENIZER, str(d)), BYTE_EOS)
    return out


@pytest.fixture(scope="module")
def pair(tok_files):
    """name -> (our ChatTokenizer, a maker of the oracle's tokenizer for a template and add_bos)."""
    out = {}
    for name, (path, eos) in tok_files.items():
        ours = chat.chat_tokenizer(path, eos)
        cache: dict = {}

        def oracle(template: str, add_bos: bool, path=path, cache=cache):
            if (template, add_bos) not in cache:
                t = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
                t.eos_token = EOS
                t.bos_token = EOS  # get_tokenizer_tulu_v2_2: a GPTNeoX tokenizer without BOS gets bos = eos
                t.pad_token = "<|pad|>"
                t.chat_template = ("{{ bos_token }}" if add_bos else "") + JINJA[template]
                cache[(template, add_bos)] = t
            return cache[(template, add_bos)]

        out[name] = (ours, oracle)
    return out


# ---------------------------------------------------------------- the oracle: open-instruct's functions, ported


def _act(tokenizer, messages, max_seq_length, add_generation_prompt):
    """`tokenizer.apply_chat_template(conversation=..., tokenize=True, return_tensors="pt", padding=False,
    truncation=True, max_length=max_seq_length, ...)`; `.shape[1]` is the length of this list."""
    return tokenizer.apply_chat_template(
        conversation=messages,
        tokenize=True,
        padding=False,
        truncation=max_seq_length is not None,
        max_length=max_seq_length,
        add_generation_prompt=add_generation_prompt,
        return_dict=False,
    )


def oi_sft_tulu_tokenize_and_truncate_v1(messages, tokenizer, max_seq_length):
    """open-instruct 686a521a3 dataset_transformation.py:607-673, torch tensors as lists."""
    if len(messages) == 0:
        raise ValueError("messages field is empty.")
    input_ids = _act(tokenizer, messages, max_seq_length, False)
    labels = list(input_ids)
    for message_idx, message in enumerate(messages):
        if message["role"] != "assistant":
            if message_idx == 0:
                message_start_idx = 0
            else:
                message_start_idx = len(_act(tokenizer, messages[:message_idx], max_seq_length, False))
            if message_idx < len(messages) - 1 and messages[message_idx + 1]["role"] == "assistant":
                message_end_idx = len(_act(tokenizer, messages[: message_idx + 1], max_seq_length, True))
            else:
                message_end_idx = len(_act(tokenizer, messages[: message_idx + 1], max_seq_length, False))
            labels[message_start_idx:message_end_idx] = [-100] * len(
                labels[message_start_idx:message_end_idx]
            )
            if max_seq_length and message_end_idx >= max_seq_length:
                break
    return input_ids, labels


def oi_sft_tulu_filter_v1(labels):
    """686a521a3:675-676."""
    return any(x != -100 for x in labels)


def oi_rlvr_prompt_ids(messages, tokenizer):
    """686a521a3:762-772: `input_ids_prompt` (apply_chat_template's defaults: tokenized, not truncated)."""
    prompt = messages if len(messages) == 1 else messages[:-1]
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)


def _oracle_sft(oracle, template, add_bos, messages, max_len):
    ids, labels = oi_sft_tulu_tokenize_and_truncate_v1(messages, oracle(template, add_bos), max_len)
    return np.asarray(ids), np.asarray(labels) != -100


# ---------------------------------------------------------------- the port equals the oracle


def test_enough_conversations_are_written():
    assert len(CONVERSATIONS) >= 20
    assert (
        any(len(c) >= 5 for c in CONVERSATIONS)
        and sum(any(m["role"] == "system" for m in c) for c in CONVERSATIONS) >= 5
    )


@pytest.mark.parametrize("template", chat.TEMPLATES)
def test_rendering_equals_the_jinja_template(pair, template):
    ours, oracle = pair["bpe"]
    for add_bos in (True, False):
        t = oracle(template, add_bos)
        for c in CONVERSATIONS:
            for k in range(1, len(c) + 1):
                for agp in (False, True):
                    want = t.apply_chat_template(c[:k], tokenize=False, add_generation_prompt=agp)
                    assert chat.render(c[:k], ours, template, add_bos, agp) == want


@pytest.mark.parametrize("name", ["bpe", "bpe-noregex", "bytes"])
@pytest.mark.parametrize("template", chat.TEMPLATES)
def test_sft_ids_and_masks_equal_open_instructs(pair, name, template):
    """Every conversation, untruncated and at 4096, and cut at lengths that fall in system, user and assistant
    turns alike: identical ids and masks, and the same conversations left without a label."""
    ours, oracle = pair[name]
    add_bos = chat.DEFAULT_ADD_BOS[template]
    cut_kinds = set()
    dropped = 0
    for c in CONVERSATIONS:
        full_len = len(oracle(template, add_bos).apply_chat_template(c, return_dict=False))
        lengths = [None, 4096, *sorted({max(1, full_len * f // 7) for f in range(1, 7)})]
        for max_len in lengths:
            want_ids, want_mask = _oracle_sft(oracle, template, add_bos, c, max_len)
            ids, mask = chat.encode_sft(c, ours, max_len, add_bos, template)
            assert ids.tolist() == want_ids.tolist(), (c, max_len)
            assert mask.tolist() == want_mask.tolist(), (c, max_len)
            assert chat.has_labels(mask) == oi_sft_tulu_filter_v1(
                np.where(want_mask, want_ids, -100).tolist()
            )
            if max_len is None:
                dropped += not chat.has_labels(mask)
            elif max_len < full_len:
                # where the cut fell: the role whose rendering holds the last kept token
                role = next(
                    m["role"]
                    for k, m in enumerate(c)
                    if len(oracle(template, add_bos).apply_chat_template(c[: k + 1], return_dict=False))
                    >= max_len
                )
                cut_kinds.add(role)
    # The two all-user conversations; with olmo also the one whose system turn comes after its first message:
    # its prefixes get the template's default system prompt, which the whole conversation does not, so the
    # prefix token counts the original masks by run past every assistant token (the original's behaviour too).
    assert dropped == (3 if template == "olmo" else 2)
    assert {"user", "assistant", "system"} <= cut_kinds


def test_batched_encoding_equals_one_by_one(pair):
    ours, _ = pair["bpe-noregex"]
    one = [chat.encode_sft(c, ours, 40) for c in CONVERSATIONS]
    many = chat.encode_sft_batch(CONVERSATIONS, ours, 40)
    assert all((a[0] == b[0]).all() and (a[1] == b[1]).all() for a, b in zip(one, many, strict=True))


def test_merges_across_message_boundaries_are_exercised(pair):
    """The no-regex BPE tokenizes a prefix differently from the same text inside the whole conversation, the case
    the original's re-tokenized prefixes decide (and the port must decide the same way)."""
    ours, _ = pair["bpe-noregex"]
    differs = 0
    for c in CONVERSATIONS:
        full = ours.encode_batch([chat.render(c, ours)])[0]
        for k in range(1, len(c)):
            pre = ours.encode_batch([chat.render(c[:k], ours, add_generation_prompt=True)])[0]
            differs += full[: len(pre)] != pre
    assert differs > 0


@pytest.mark.parametrize("template", chat.TEMPLATES)
def test_preference_and_prompts_equal_open_instructs(pair, template):
    ours, oracle = pair["bpe"]
    add_bos = chat.DEFAULT_ADD_BOS[template]
    for chosen, rejected in PREFERENCES:
        for max_len in (None, 24):
            (ci, cm), (ri, rm) = chat.encode_preference(chosen, rejected, ours, max_len, add_bos, template)
            # preference_tulu_tokenize_and_truncate_v1 (686a521a3:722-755): sft on each side
            wci, wcm = _oracle_sft(oracle, template, add_bos, chosen, max_len)
            wri, wrm = _oracle_sft(oracle, template, add_bos, rejected, max_len)
            assert (ci.tolist(), cm.tolist(), ri.tolist(), rm.tolist()) == (
                wci.tolist(),
                wcm.tolist(),
                wri.tolist(),
                wrm.tolist(),
            )
    for p in PROMPTS:
        assert chat.encode_prompt(p["messages"], ours, add_bos, template) == oi_rlvr_prompt_ids(
            p["messages"], oracle(template, add_bos)
        )


# ---------------------------------------------------------------- files


def _jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _olmo_core_doc_indices(tokens: np.ndarray, eos: int, bos: int | None):
    """OLMo-core fa6c5014 data/utils.py iter_document_indices, from the local array (use_array_if_local)."""
    if bos is None:
        ends = (tokens == eos).nonzero()[0]
    else:
        ends = np.logical_and(tokens[:-1] == eos, tokens[1:] == bos).nonzero()[0]
        if tokens[-1] == eos:
            ends = np.append(ends, tokens.shape[0] - 1)
    start, out = 0, []
    for i in ends:
        out.append((start, int(i) + 1))
        start = int(i) + 1
    return out


def test_sft_files_load_in_both_layouts(tmp_path, pair, tok_files):
    path, eos = tok_files["bpe"]
    ours, oracle = pair["bpe"]
    src = _jsonl(tmp_path / "sft.jsonl", [{"messages": c, "id": i} for i, c in enumerate(CONVERSATIONS)])
    out = tmp_path / "sft"
    # a small part size: several parts, each cut between documents
    m = prepare_chat([src], str(out), "sft", "tulu", 64, None, path, eos, part_bytes=600)
    want = [_oracle_sft(oracle, "tulu", True, c, 64) for c in CONVERSATIONS]
    kept = [w for w in want if w[1].any()]
    # dropped: the two all-user conversations and the one whose long user turn the cut at 64 leaves unanswered
    assert m["documents"] == len(kept) == len(CONVERSATIONS) - 3 and m["dropped_no_labels"] == 3
    full = [len(oracle("tulu", True).apply_chat_template(c, return_dict=False)) for c in CONVERSATIONS]
    assert m["truncated"] == sum(n > 64 for n, w in zip(full, want, strict=True) if w[1].any()) > 0
    assert len(m["parts"]) > 1 and m["token_dtype"] == "uint16"
    # 1. the project's reader, through the manifest
    _, docs = read_chat_data(str(out))
    assert [(d[0].tolist(), d[1].tolist()) for d in docs] == [(w[0].tolist(), w[1].tolist()) for w in kept]
    # 2. open-instruct's / OLMo-core's layout read raw: memmap of the dtype, bool labels, csv.gz boundaries
    got = []
    for k in range(len(m["parts"])):
        ids = np.memmap(out / f"token_ids_part_{k:04d}.npy", mode="r", dtype=np.uint16)
        mask = np.memmap(out / f"labels_mask_part_{k:04d}.npy", mode="r", dtype=np.bool_)
        assert ids.shape == mask.shape
        rows = gzip.open(out / f"token_ids_part_{k:04d}.csv.gz", "rt").read().split()
        bounds = [tuple(int(x) for x in r.split(",")) for r in rows]
        assert bounds[0][0] == 0 and bounds[-1][1] == len(ids)
        got += [(ids[s:e].tolist(), mask[s:e].tolist()) for s, e in bounds]
        # OLMo-core finds the same documents from the array (EOS then BOS) where none was truncated
        if all(ids[e - 1] == eos for _, e in bounds):
            assert _olmo_core_doc_indices(np.asarray(ids), eos, eos) == bounds
    assert got == [(w[0].tolist(), w[1].tolist()) for w in kept]
    assert m["tokens"] == sum(len(w[0]) for w in kept) and m["trainable_tokens"] == sum(
        int(w[1].sum()) for w in kept
    )


def test_untruncated_documents_are_found_by_eos_then_bos(tmp_path, tok_files):
    path, eos = tok_files["bpe"]
    """Documents that end with an assistant turn (its EOS) and are not truncated: OLMo-core's search of the array
    for EOS followed by BOS (= EOS) finds the boundaries the .csv.gz lists. (One that ends with a user turn or is
    truncated has no EOS at its end: only the .csv.gz has its end.)"""
    ended = [c for c in CONVERSATIONS if c[-1]["role"] == "assistant"]
    src = _jsonl(tmp_path / "sft.jsonl", [{"messages": c} for c in ended])
    m = prepare_chat([src], str(tmp_path / "o"), "sft", "tulu", 0, None, path, eos)
    ids = np.fromfile(tmp_path / "o" / "token_ids_part_0000.npy", dtype=m["token_dtype"])
    rows = gzip.open(tmp_path / "o" / "token_ids_part_0000.csv.gz", "rt").read().split()
    assert _olmo_core_doc_indices(ids, eos, eos) == [tuple(int(x) for x in r.split(",")) for r in rows]
    assert m["truncated"] == 0 and len(rows) == len(ended) == m["documents"]


def test_cli_end_to_end_sft_preference_prompts(tmp_path, pair, tok_files):
    path, eos = tok_files["bpe"]
    ours, oracle = pair["bpe"]
    sft = _jsonl(tmp_path / "a.jsonl", [{"messages": c} for c in CONVERSATIONS[:12]])
    sft2 = _jsonl(tmp_path / "b.jsonl", [{"messages": c} for c in CONVERSATIONS[12:]])
    common = ["--tokenizer", path, "--eos-id", str(eos), "--max-seq-length", "48"]
    r = invoke("data", "prepare", sft, sft2, "--out", str(tmp_path / "sft"), "--kind", "sft", *common)
    assert r.returncode == 0, r.stderr
    want = [w for w in (_oracle_sft(oracle, "tulu", True, c, 48) for c in CONVERSATIONS) if w[1].any()]
    dropped = len(CONVERSATIONS) - len(want)
    assert f"sft: {len(want)} conversations" in r.stdout and f"{dropped} dropped" in r.stdout, r.stdout
    _, docs = read_chat_data(str(tmp_path / "sft"))
    assert [d[0].tolist() for d in docs] == [w[0].tolist() for w in want]

    prefs = _jsonl(tmp_path / "p.jsonl", [{"chosen": c, "rejected": r_} for c, r_ in PREFERENCES])
    r = invoke(
        "data",
        "prepare",
        prefs,
        "--out",
        str(tmp_path / "pref"),
        "--kind",
        "preference",
        *common,
        "-o",
        "json",
    )
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    sides = [
        (_oracle_sft(oracle, "tulu", True, c, 48), _oracle_sft(oracle, "tulu", True, r_, 48))
        for c, r_ in PREFERENCES
    ]
    kept = [(c, r_) for c, r_ in sides if c[1].any() and r_[1].any()]  # preference_tulu_filter_v1
    assert m["pairs"] == len(kept) and m["dropped_no_labels"] == len(PREFERENCES) - len(kept) >= 1
    _, pairs = read_chat_data(str(tmp_path / "pref"))
    flat = [tuple(a.tolist() for side in pr for a in side) for pr in pairs]
    assert flat == [tuple(a.tolist() for side in pr for a in side) for pr in kept]
    assert (tmp_path / "pref" / "chosen" / "labels_mask_part_0000.npy").is_file()

    prompts = _jsonl(tmp_path / "q.jsonl", PROMPTS)
    out = tmp_path / "prompts"
    want = [oi_rlvr_prompt_ids(p["messages"], oracle("olmo", False)) for p in PROMPTS]
    limit = sorted(len(w) for w in want)[
        -2
    ]  # the longest prompt is dropped (rlvr_filter_v1's max_prompt_token_length)
    args = [
        "--tokenizer",
        path,
        "--eos-id",
        str(eos),
        "--max-seq-length",
        str(limit),
        "--chat-template",
        "olmo",
    ]
    r = invoke("data", "prepare", prompts, "--out", str(out), "--kind", "prompts", *args)
    assert r.returncode == 0, r.stderr
    kept = [(w, p) for w, p in zip(want, PROMPTS, strict=True) if len(w) <= limit]
    assert len(kept) == len(PROMPTS) - 1
    assert f"prompts: {len(kept)} " in r.stdout and "1 dropped" in r.stdout, r.stdout
    m, rows = read_chat_data(str(out))
    assert m["add_bos"] is False and m["chat_template"] == "olmo"
    assert [x["input_ids_prompt"] for x in rows] == [w for w, _ in kept]
    assert [(x["ground_truth"], x["dataset"]) for x in rows] == [
        (p["ground_truth"], p["dataset"]) for _, p in kept
    ]


BAD_LINES = [
    ("{not json", "not JSON"),
    ('["a list"]', "not an object"),
    ('{"conversation": []}', "no `messages`"),
    ('{"messages": []}', "is empty"),
    ('{"messages": [{"role": "tool", "content": "x"}]}', "role 'tool'"),
    ('{"messages": [{"role": "user"}]}', "no text `content`"),
]


@pytest.mark.parametrize("line,reason", BAD_LINES, ids=[r for _, r in BAD_LINES])
def test_a_bad_line_is_named_and_nothing_is_written(tmp_path, line, reason):
    good = json.dumps({"messages": [U("q"), A("a")]})
    src = tmp_path / "in.jsonl"
    src.write_text(f"{good}\n\n{good}\n{line}\n{good}\n")
    out = tmp_path / "out"
    r = invoke("data", "prepare", str(src), "--out", str(out), "--kind", "sft")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and f"{src}:4: " in lines[0] and reason in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_kind_specific_checks(tmp_path):
    src = _jsonl(tmp_path / "x.jsonl", [{"messages": [U("q")]}])
    r = invoke("data", "prepare", src, "--out", str(tmp_path / "o"), "--kind", "prompts")
    assert r.returncode == 2 and f"{src}:1: no `ground_truth`" in r.stderr
    r = invoke("data", "prepare", src, "--out", str(tmp_path / "o"), "--kind", "preference")
    assert r.returncode == 2 and "no `chosen`" in r.stderr
    r = invoke("data", "prepare", src, "--out", str(tmp_path / "o"), "--kind", "sft", "--seq-len", "8")
    assert r.returncode == 2 and "--seq-len is for --kind text" in r.stderr
    r = invoke("data", "prepare", src, "--out", str(tmp_path / "o"), "--kind", "dpo")
    assert r.returncode == 2 and "--kind 'dpo'" in r.stderr
    # nothing left to train (a user turn alone): an empty data set is refused, nothing written
    r = invoke("data", "prepare", src, "--out", str(tmp_path / "o"), "--kind", "sft")
    assert r.returncode == 2 and "nothing to write: 1 records read, 1 dropped" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()
    # a second prepare into the same directory is refused
    src = _jsonl(tmp_path / "y.jsonl", [{"messages": [U("q"), A("a")]}])
    assert invoke("data", "prepare", src, "--out", str(tmp_path / "o"), "--kind", "sft").returncode == 0
    r = invoke("data", "prepare", src, "--out", str(tmp_path / "o"), "--kind", "sft")
    assert r.returncode == 2 and "already holds" in r.stderr


def test_progress_bar_draws_and_erases():
    import io

    from olmo_ctl.data.chat_files import Progress

    s = io.StringIO()
    p = Progress(1000, "conversations", stream=s, force=True)
    p.update(500, 10)
    p.update(500, 10)
    p.close()
    text = s.getvalue()
    assert "prepare: " in text and "20 conversations" in text and text.endswith("\r")
    quiet = io.StringIO()
    Progress(10 << 20, "conversations", stream=quiet).update(1, 1)  # not a terminal: nothing
    assert quiet.getvalue() == ""


@pytest.mark.gcs
def test_gs_out(tmp_path, gcs, tok_files):
    path, eos = tok_files["bytes"]
    src = _jsonl(tmp_path / "sft.jsonl", [{"messages": c} for c in CONVERSATIONS[:5]])
    dest = f"gs://{gcs.bucket}/chat/sft"
    r = invoke("data", "prepare", src, "--out", dest, "--kind", "sft", "--max-seq-length", "256")
    assert r.returncode == 0, r.stderr
    m, docs = read_chat_data(dest)
    ours = chat.chat_tokenizer(path, eos)
    want = [chat.encode_sft(c, ours, 256) for c in CONVERSATIONS[:5]]
    assert [d[0].tolist() for d in docs] == [w[0].tolist() for w in want] and m["token_dtype"] == "uint16"
