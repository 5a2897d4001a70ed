"""Chat conversations to token ids and label masks, as AI2's open-instruct tokenizes them for post-training.

Plain-Python ports (no jinja, no transformers at run time: the `tokenizers` package alone) of:

- the chat templates `CHAT_TEMPLATES["tulu"]` (open-instruct 686a521a3 and HEAD e6c3044aa alike) and
  `CHAT_TEMPLATES["olmo"]` (OLMo 3's `<|im_start|>` format, open-instruct HEAD e6c3044aa,
  `open_instruct/dataset_transformation.py`), with `get_tokenizer_tulu_v2_2`'s `add_bos`: the template
  is prefixed with `{{ bos_token }}`, and OLMo's GPTNeoX tokenizers have no BOS of their own, so the BOS is
  the EOS token;
- `sft_tulu_tokenize_and_truncate_v1` (open-instruct 686a521a3): the whole conversation rendered and
  tokenized without special tokens, truncated to `max_seq_length`; then, for each non-assistant message,
  the tokens from the end of the previous messages' rendering to the end of its own (rendered with the
  assistant generation prefix `<|assistant|>\\n` when an assistant message follows, so the prefix is not
  trained on) are masked. Each boundary is the token count of a separately tokenized prefix of the
  conversation, truncated too, exactly as the original re-tokenizes: a token merged across a message
  boundary lands where the original puts it. `sft_tulu_filter_v1` drops a conversation with no label
  left (all users, or truncated before its first assistant token);
- `preference_tulu_tokenize_and_truncate_v1`: chosen and rejected, each as above; `preference_tulu_filter_v1`
  drops a pair where either side has no label;
- `rlvr_tokenize_v1`'s prompt: the messages but the last (the only one when there is one) rendered with the
  generation prefix, not truncated, `ground_truth` and `dataset` kept; `rlvr_filter_v1`'s
  `max_prompt_token_length` drops longer prompts.

data/chat_files.py reads JSONL into these and writes the numpy files (`olmo-ctl data prepare --kind`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from olmo_ctl.core.errors import BadInput
from olmo_ctl.data.tokenizer import BYTES_TOKENIZER, document_tokenizer, tokenizer_path

TEMPLATES = ("tulu", "olmo")
# Where each template was ported from (open-instruct, open_instruct/dataset_transformation.py).
TEMPLATE_SOURCES = {
    "tulu": "open-instruct 686a521a3 CHAT_TEMPLATES['tulu'] (unchanged at e6c3044aa)",
    "olmo": "open-instruct e6c3044aa CHAT_TEMPLATES['olmo']",
}
# AI2's scripts: `--add_bos` with tulu on OLMo's tokenizers (get_tokenizer_tulu_v2_2 asserts it); the OLMo 3
# templates must not add one (HEAD's get_tokenizer_tulu_v2_2 asserts `not add_bos` for an "olmo" template).
DEFAULT_ADD_BOS = {"tulu": True, "olmo": False}
ROLES = {"tulu": ("system", "user", "assistant"), "olmo": ("system", "user", "assistant", "environment")}

OLMO_DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are OLMo, a helpful function-calling AI assistant built by Ai2. Your date cutoff is"
    " November 2024, and your model weights are available at https://huggingface.co/allenai. You do not currently"
    " have access to any functions. <functions></functions><|im_end|>\n"
)
OLMO_NO_FUNCTIONS = " You do not currently have access to any functions. <functions></functions><|im_end|>\n"

Message = dict[str, Any]


@dataclass(frozen=True)
class ChatTokenizer:
    """A Hugging Face tokenizer (the `tokenizers` package) with the EOS and BOS texts the templates use."""

    hf: Any  # tokenizers.Tokenizer
    eos_token: str
    bos_token: str
    eos_token_id: int
    spec: str = ""
    model_vocab_size: int | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.hf.get_vocab_size(with_added_tokens=True))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids without the tokenizer's special tokens: what `apply_chat_template(tokenize=True)`
        encodes its rendering with (`add_special_tokens=False`)."""
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]


def chat_tokenizer(
    spec: str = BYTES_TOKENIZER, eos_token_id: int | None = None, model: Any = None
) -> ChatTokenizer:
    """The tokenizer `--tokenizer` names, its EOS from `--eos-id` or the recipe (data/tokenizer.py's rule), the
    BOS the EOS (OLMo's tokenizers have none: get_tokenizer_tulu_v2_2 sets `bos_token = eos_token`)."""
    doc = document_tokenizer(spec, eos_token_id, model)
    hf = doc.hf
    if hf is None:  # builtin://bytes: its tokenizer.json
        from tokenizers import Tokenizer

        hf = Tokenizer.from_file(tokenizer_path(BYTES_TOKENIZER))
    eos = hf.id_to_token(doc.eos_token_id)
    return ChatTokenizer(hf, eos, eos, doc.eos_token_id, spec, doc.model_vocab_size)


# ---------------------------------------------------------------- the templates


def check_messages(messages: Any, template: str = "tulu", what: str = "messages") -> list[Message]:
    """`messages` is a non-empty list of {role, content} with a role the template renders; ValueError if not."""
    if not isinstance(messages, list):
        raise ValueError(f"`{what}` is not a list of messages")
    if not messages:
        raise ValueError(f"`{what}` is empty")
    roles = ROLES[template]
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"`{what}[{i}]` is not an object with `role` and `content`")
        role = m.get("role")
        if role not in roles:
            raise ValueError(f"`{what}[{i}]` has role {role!r}, not one of {', '.join(roles)}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"`{what}[{i}]` ({role}) has no text `content`")
        for key in ("functions", "function_calls"):
            if template == "olmo" and m.get(key) is not None and not isinstance(m[key], str):
                raise ValueError(f"`{what}[{i}].{key}` is not text")
    return messages


def render(
    messages: Sequence[Message],
    tok: ChatTokenizer,
    template: str = "tulu",
    add_bos: bool = True,
    add_generation_prompt: bool = False,
) -> str:
    """The template's text for `messages`, as `tokenizer.apply_chat_template(tokenize=False)` renders it."""
    out = [tok.bos_token] if add_bos else []
    n = len(messages)
    if template == "tulu":
        for i, m in enumerate(messages):
            role, content, last = m["role"], m["content"], i == n - 1
            if role == "system":
                out.append("<|system|>\n" + content + "\n")
            elif role == "user":
                out.append("<|user|>\n" + content + "\n")
            elif role == "assistant":
                out.append("<|assistant|>\n" + content + tok.eos_token + ("" if last else "\n"))
            if last and add_generation_prompt:
                out.append("<|assistant|>\n")
    elif template == "olmo":
        if not any(m["role"] == "system" for m in messages):
            out.append(OLMO_DEFAULT_SYSTEM)
        for i, m in enumerate(messages):
            role, content, last = m["role"], str(m["content"]), i == n - 1
            functions = m.get("functions")
            if role == "system":
                out.append("<|im_start|>system\n" + content)
                if functions is not None:
                    out.append(" <functions>" + functions + "</functions><|im_end|>\n")
                else:
                    out.append(OLMO_NO_FUNCTIONS)
            elif role == "user":
                if functions is not None:
                    out.append(
                        "<|im_start|>user\n"
                        + content
                        + "\n<functions>"
                        + functions
                        + "</functions><|im_end|>\n"
                    )
                else:
                    out.append("<|im_start|>user\n" + content + "<|im_end|>\n")
            elif role == "assistant":
                out.append("<|im_start|>assistant\n" + content)  # content checked to be text: never `none`
                if m.get("function_calls") is not None:
                    out.append("<function_calls>" + m["function_calls"] + "</function_calls>")
                out.append("<|im_end|>\n" if not last else tok.eos_token)
            elif role == "environment":
                out.append("<|im_start|>environment\n" + content + "<|im_end|>\n")
            if last and add_generation_prompt:
                out.append("<|im_start|>assistant\n")
    else:
        raise ValueError(f"chat template {template!r}: one of {', '.join(TEMPLATES)}")
    return "".join(out)


# ---------------------------------------------------------------- sft_tulu_tokenize_and_truncate_v1


def _sft_steps(messages: Sequence[Message]) -> list[tuple[tuple[int, bool] | None, tuple[int, bool]]]:
    """The original's loop over non-assistant messages: each one's (start, end) renderings as (prefix length,
    add_generation_prompt); start None for the first message (index 0). The generation prefix is added
    when an assistant message follows, so `<|assistant|>\\n` is masked with the message before it."""
    n = len(messages)
    return [
        ((i, False) if i > 0 else None, (i + 1, i < n - 1 and messages[i + 1]["role"] == "assistant"))
        for i, m in enumerate(messages)
        if m["role"] != "assistant"
    ]


def encode_sft_batch(
    conversations: Sequence[Sequence[Message]],
    tok: ChatTokenizer,
    max_seq_length: int | None,
    add_bos: bool = True,
    template: str = "tulu",
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`encode_sft` of each conversation, their renderings tokenized together (the tokenizer's threads)."""
    return encode_sft_batch_with_lengths(conversations, tok, max_seq_length, add_bos, template)[0]


def encode_sft_batch_with_lengths(
    conversations: Sequence[Sequence[Message]],
    tok: ChatTokenizer,
    max_seq_length: int | None,
    add_bos: bool = True,
    template: str = "tulu",
) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[int]]:
    """`encode_sft_batch`, and each conversation's length before truncation.

    The original's loop runs in rounds, one non-assistant message of every conversation a round, the
    prefixes of a round tokenized in one batch; a conversation leaves at the original's `break` (a message
    ending at or past `max_seq_length`), so the prefixes after it, which change nothing, are not tokenized.
    """
    max_len = max_seq_length or None

    def count(e: Any) -> int:  # `.shape[1]` of a prefix tokenized with truncation
        return min(len(e), max_len) if max_len else len(e)

    fulls = tok.hf.encode_batch(
        [render(c, tok, template, add_bos, False) for c in conversations], add_special_tokens=False
    )
    ids = [np.asarray(e.ids[:max_len] if max_len else e.ids, dtype=np.int64) for e in fulls]
    masks = [np.ones(len(a), dtype=bool) for a in ids]
    steps = [_sft_steps(c) for c in conversations]
    known: list[dict[tuple[int, bool], int]] = [{} for _ in conversations]
    active = [b for b in range(len(conversations)) if steps[b]]
    r = 0
    while active:
        need = list(
            dict.fromkeys(
                (b, key) for b in active for key in steps[b][r] if key is not None and key not in known[b]
            )
        )
        texts = [render(conversations[b][: key[0]], tok, template, add_bos, key[1]) for b, key in need]
        for (b, key), e in zip(
            need, tok.hf.encode_batch(texts, add_special_tokens=False) if texts else [], strict=True
        ):
            known[b][key] = count(e)
        still = []
        for b in active:
            start_key, end_key = steps[b][r]
            start = 0 if start_key is None else known[b][start_key]
            end = known[b][end_key]
            masks[b][start:end] = False
            if not (max_len and end >= max_len) and r + 1 < len(steps[b]):
                still.append(b)
        active, r = still, r + 1
    return list(zip(ids, masks, strict=True)), [len(e) for e in fulls]


def encode_sft(
    messages: Sequence[Message],
    tok: ChatTokenizer,
    max_seq_length: int | None,
    add_bos: bool = True,
    template: str = "tulu",
) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels_mask) of one conversation as `sft_tulu_tokenize_and_truncate_v1` makes them: the
    mask is True where its label is the token (`labels != -100`), False on everything but assistant turns."""
    return encode_sft_batch([messages], tok, max_seq_length, add_bos, template)[0]


def has_labels(mask: np.ndarray) -> bool:
    """`sft_tulu_filter_v1`: a conversation is kept when any label is not -100."""
    return bool(mask.any())


# ---------------------------------------------------------------- preference and prompts


def encode_preference(
    chosen: Sequence[Message],
    rejected: Sequence[Message],
    tok: ChatTokenizer,
    max_seq_length: int | None,
    add_bos: bool = True,
    template: str = "tulu",
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """`preference_tulu_tokenize_and_truncate_v1`: ((chosen ids, mask), (rejected ids, mask)), each side as
    `encode_sft`; `preference_tulu_filter_v1` keeps the pair when both sides have a label."""
    c, r = encode_sft_batch([chosen, rejected], tok, max_seq_length, add_bos, template)
    return c, r


def prompt_messages(messages: Sequence[Message]) -> Sequence[Message]:
    """`rlvr_tokenize_v1`'s prompt: every message but the last, or the only one."""
    return messages if len(messages) == 1 else messages[:-1]


def encode_prompt_batch(
    conversations: Sequence[Sequence[Message]],
    tok: ChatTokenizer,
    add_bos: bool = True,
    template: str = "tulu",
) -> list[list[int]]:
    texts = [render(prompt_messages(c), tok, template, add_bos, True) for c in conversations]
    return tok.encode_batch(texts) if texts else []


def encode_prompt(
    messages: Sequence[Message], tok: ChatTokenizer, add_bos: bool = True, template: str = "tulu"
) -> list[int]:
    """`rlvr_tokenize_v1`'s `input_ids_prompt`: the prompt rendered with the generation prefix, not truncated."""
    return encode_prompt_batch([messages], tok, add_bos, template)[0]


def token_dtype(vocab_size: int) -> np.dtype:
    """open-instruct's `_select_token_dtype`: the smallest unsigned type holding ids below `vocab_size`."""
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise BadInput(f"a vocabulary of {vocab_size} tokens is too big for any numpy integer type")
