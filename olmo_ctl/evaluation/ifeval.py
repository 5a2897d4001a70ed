"""IFEval scoring as AI2 ran it for OLMo 2 Instruct ("ifeval_old"): open-instruct's copy of Google's
instruction checks at commit 686a521a3 (Apache-2.0), `eval/ifeval/instructions.py` (the checks),
`instructions_registry.py` (instruction ids), `instructions_util.py` (word counting) and
`run_eval.py` (strict and loose following, prompt- and instruction-level accuracy). Each check names
the lines it ports as `file:line@686a521a3`.

    score(prompt_rows, responses) -> {"prompt_level_strict_acc": ..., "inst_level_strict_acc": ...,
                                      "prompt_level_loose_acc": ..., "inst_level_loose_acc": ..., ...}

A prompt row is one line of IFEval's input_data.jsonl: {"prompt", "instruction_id_list", "kwargs"}
(one kwargs dict per instruction; None values are dropped, so rows with every key filled in, as on the
Hugging Face copy, work too).

Differs from the original:
- A missing or out-of-range argument raises BadInput. The original's build_description draws a random
  one (instructions.py, each build_description; run_eval.py:217 seeds with 42), so a row without its
  arguments was scored against an invented instruction.
- Responses are matched to rows by position, not through a dict keyed by prompt text (run_eval.py:310,
  where two rows with the same prompt both get the last one's response).
- UNSUPPORTED: the two checks that need nltk and its Punkt models (data nltk downloads at run time, not
  part of its package; this project does without nltk):
  `length_constraints:number_sentences` (instructions_util.count_sentences, :138-142) and
  `change_case:capital_word_frequency` (nltk.word_tokenize, instructions.py:1531-1542). `score` raises
  BadInput for them unless skip_unsupported=True, which leaves those instructions out of every count
  and reports how many were left out.
"""

from __future__ import annotations

import collections
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from olmo_ctl.core.errors import BadInput

log = logging.getLogger(__name__)

Check = Callable[[str], bool]

# instructions.py:35@686a521a3
_COMPARISON_RELATION = ("less than", "at least")
# instructions.py:46-47@686a521a3
_CONSTRAINED_RESPONSE_OPTIONS = ("My answer is yes.", "My answer is no.", "My answer is maybe.")

UNSUPPORTED = ("length_constraints:number_sentences", "change_case:capital_word_frequency")


class _Args:
    """One instruction's kwargs: the accessors stand in for build_description's argument handling."""

    def __init__(self, instruction_id: str, kwargs: Mapping[str, Any]):
        self.id = instruction_id
        self.kwargs = {k: v for k, v in kwargs.items() if v is not None}
        self.used: set[str] = set()

    def _missing(self, key: str, why: str = "is missing") -> BadInput:
        return BadInput(
            f"IFEval instruction {self.id}: argument {key!r} {why}",
            hint="the original draws a random value here; give the row's kwargs",
        )

    def get(self, key: str) -> Any:
        self.used.add(key)
        if key not in self.kwargs:
            raise self._missing(key)
        return self.kwargs[key]

    def count(self, key: str) -> int:
        value = self.get(key)
        if not isinstance(value, int) or value < 0:
            raise self._missing(key, f"is {value!r}, not a count")
        return value

    def text(self, key: str) -> str:
        """A string argument, stripped (as build_description strips starter, section_spliter,
        postscript_marker, keyword and end_phrase)."""
        value = self.get(key)
        if not isinstance(value, str):
            raise self._missing(key, f"is {value!r}, not a string")
        return value.strip()

    def relation(self, key: str) -> str:
        value = self.get(key)
        if value not in _COMPARISON_RELATION:
            # instructions.py:194-196@686a521a3 (and 777-779 and the like): ValueError in the original.
            raise self._missing(key, f"is {value!r}, not one of {_COMPARISON_RELATION}")
        return str(value)

    def words(self, key: str) -> list[str]:
        value = self.get(key)
        if not value or not isinstance(value, list | tuple):
            raise self._missing(key, f"is {value!r}, not a list of words")
        return [str(v) for v in value]

    def done(self) -> None:
        extra = sorted(set(self.kwargs) - self.used)
        if extra:
            # The original's build_description takes keyword arguments only: TypeError.
            raise BadInput(f"IFEval instruction {self.id}: unexpected arguments {extra}")


def _compare(relation: str, actual: int, threshold: int) -> bool:
    """The "less than" / "at least" comparison of the counting checks."""
    return actual < threshold if relation == _COMPARISON_RELATION[0] else actual >= threshold


def _detect_language(value: str) -> str | None:
    """langdetect.detect, or None when it finds no features (LangDetectException), which the original
    counts as followed (instructions.py:157-164@686a521a3). langdetect is random unless
    DetectorFactory.seed is set; the original sets none."""
    import langdetect

    try:
        return str(langdetect.detect(value))
    except langdetect.LangDetectException as e:
        log.error("Unable to detect language for text %s due to %s", value, e)
        return None


def _response_language(a: _Args) -> Check:
    """ResponseLanguageChecker (instructions.py:113-164@686a521a3)."""
    language = a.get("language")

    def check(value: str) -> bool:
        detected = _detect_language(value)
        return detected is None or detected == language

    return check


def _placeholders(a: _Args) -> Check:
    """PlaceholderChecker (instructions.py:235-277@686a521a3): at least N [...] spans."""
    n = a.count("num_placeholders")
    return lambda value: len(re.findall(r"\[.*?\]", value)) >= n


def _bullet_lists(a: _Args) -> Check:
    """BulletListChecker (instructions.py:280-326@686a521a3): exactly N lines starting with "*" (not
    "**") or "-"."""
    n = a.count("num_bullets")

    def check(value: str) -> bool:
        stars = re.findall(r"^\s*\*[^\*].*$", value, flags=re.MULTILINE)
        dashes = re.findall(r"^\s*-.*$", value, flags=re.MULTILINE)
        return len(stars) + len(dashes) == n

    return check


def _constrained_response(a: _Args) -> Check:
    """ConstrainedResponseChecker (instructions.py:329-363@686a521a3): contains one of "My answer is
    yes." / "no." / "maybe."."""
    return lambda value: any(option in value.strip() for option in _CONSTRAINED_RESPONSE_OPTIONS)


def _highlighted_sections(a: _Args) -> Check:
    """HighlightSectionChecker (instructions.py:411-463@686a521a3): at least N non-empty *one-line*
    spans, counting **double** ones once more."""
    n = a.count("num_highlights")

    def check(value: str) -> bool:
        found = sum(1 for h in re.findall(r"\*[^\n\*]*\*", value) if h.strip("*").strip())
        found += sum(
            1
            for h in re.findall(r"\*\*[^\n\*]*\*\*", value)
            if h.removeprefix("**").removesuffix("**").strip()
        )
        return found >= n

    return check


def _multiple_sections(a: _Args) -> Check:
    """SectionChecker (instructions.py:466-527@686a521a3): at least N "SPLITTER <number>" markers
    (the splitter is a regular expression, as in the original)."""
    splitter = a.text("section_spliter")
    n = a.count("num_sections")
    return lambda value: len(re.split(r"\s?" + splitter + r"\s?\d+\s?", value)) - 1 >= n


def _number_paragraphs(a: _Args) -> Check:
    """ParagraphChecker (instructions.py:530-581@686a521a3): exactly N paragraphs split by "***"; an
    empty one counts as a failure unless it is the first or the last, which is not counted."""
    n = a.count("num_paragraphs")

    def check(value: str) -> bool:
        paragraphs = re.split(r"\s?\*\*\*\s?", value)
        count = len(paragraphs)
        for index, paragraph in enumerate(paragraphs):
            if not paragraph.strip():
                if index == 0 or index == len(paragraphs) - 1:
                    count -= 1
                else:
                    return False
        return count == n

    return check


def _postscript(a: _Args) -> Check:
    """PostscriptChecker (instructions.py:584-636@686a521a3): a line (lowercased) with the marker; "P.S."
    and "P.P.S" allow spaces between their letters; any other marker is a regular expression."""
    marker = a.text("postscript_marker")
    if marker == "P.P.S":
        pattern = r"\s*p\.\s?p\.\s?s.*$"
    elif marker == "P.S.":
        pattern = r"\s*p\.\s?s\..*$"
    else:
        pattern = r"\s*" + marker.lower() + r".*$"
    return lambda value: bool(re.findall(pattern, value.lower(), flags=re.MULTILINE))


def _keyword_existence(a: _Args) -> Check:
    """KeywordChecker (instructions.py:703-742@686a521a3): every keyword, as a case-insensitive regular
    expression, occurs."""
    keywords = sorted(a.words("keywords"))
    return lambda value: all(re.search(k, value, flags=re.IGNORECASE) for k in keywords)


def _keyword_frequency(a: _Args) -> Check:
    """KeywordFrequencyChecker (instructions.py:745-810@686a521a3): occurrences of the keyword (a
    case-insensitive regular expression, substrings included) "less than" / "at least" N."""
    raw = a.get("keyword")
    if not raw or not isinstance(raw, str):
        raise a._missing("keyword", f"is {raw!r}, not a word")
    keyword = raw.strip()
    n = a.count("frequency")
    relation = a.relation("relation")
    return lambda value: _compare(relation, len(re.findall(keyword, value, flags=re.IGNORECASE)), n)


def _count_words(text: str) -> int:
    """instructions_util.count_words (:125-130@686a521a3): nltk's RegexpTokenizer(r"\\w+") is
    re.findall(r"\\w+") (its default flags, UNICODE | MULTILINE | DOTALL, do not change \\w+)."""
    return len(re.findall(r"\w+", text))


def _number_words(a: _Args) -> Check:
    """NumberOfWords (instructions.py:813-870@686a521a3): \\w+ words "less than" / "at least" N."""
    n = a.count("num_words")
    relation = a.relation("relation")
    return lambda value: _compare(relation, _count_words(value), n)


def _json_format(a: _Args) -> Check:
    """JsonFormat (instructions.py:873-905@686a521a3): parses as JSON once ```json (or ```Json, ```JSON,
    ```) fences are taken off."""

    def check(value: str) -> bool:
        value = (
            value.strip()
            .removeprefix("```json")
            .removeprefix("```Json")
            .removeprefix("```JSON")
            .removeprefix("```")
            .removesuffix("```")
            .strip()
        )
        try:
            json.loads(value)
        except ValueError:
            return False
        return True

    return check


def _nth_paragraph_first_word(a: _Args) -> Check:
    """ParagraphFirstWordCheck (instructions.py:908-1011@686a521a3): N non-empty paragraphs split by
    "\\n\\n", and the nth's first word (quotes stripped from its start, cut at punctuation, lowercased)
    is the given word."""
    n = a.count("num_paragraphs")
    nth = a.count("nth_paragraph")
    if nth <= 0 or nth > n:
        raise a._missing("nth_paragraph", f"is {nth}, not between 1 and num_paragraphs ({n})")
    word_arg = a.get("first_word")
    if not isinstance(word_arg, str):
        raise a._missing("first_word", f"is {word_arg!r}, not a string")
    expected = word_arg.lower()  # lowercased, not stripped (instructions.py:942)

    def check(value: str) -> bool:
        paragraphs = re.split(r"\n\n", value)
        count = len(paragraphs) - sum(1 for p in paragraphs if not p.strip())
        if nth > count:
            return False
        paragraph = paragraphs[nth - 1].strip()
        if not paragraph:
            return False
        word = paragraph.split()[0].strip().lstrip("'").lstrip('"')
        first_word = ""
        for letter in word:
            if letter in {".", ",", "?", "!", "'", '"'}:
                break
            first_word += letter.lower()
        return count == n and first_word == expected

    return check


def _forbidden_words(a: _Args) -> Check:
    """ForbiddenWords (instructions.py:1070-1112@686a521a3): none of the words occurs as a whole word
    (\\bWORD\\b, a case-insensitive regular expression)."""
    words = sorted(set(a.words("forbidden_words")))
    return lambda value: not any(re.search(r"\b" + w + r"\b", value, flags=re.IGNORECASE) for w in words)


def _two_responses(a: _Args) -> Check:
    """TwoResponsesChecker (instructions.py:1171-1210@686a521a3): two different non-empty responses
    separated by "******" (an empty piece only at either end)."""

    def check(value: str) -> bool:
        valid = []
        pieces = value.split("******")
        for index, piece in enumerate(pieces):
            if not piece.strip():
                if index != 0 and index != len(pieces) - 1:
                    return False
            else:
                valid.append(piece)
        return len(valid) == 2 and valid[0].strip() != valid[1].strip()

    return check


def _repeat_prompt(a: _Args) -> Check:
    """RepeatPromptThenAnswer (instructions.py:1213-1247@686a521a3): starts with the prompt to repeat
    (both stripped and lowercased). (run_eval.py:92-94 rebuilds an instruction whose arguments include
    "prompt"; none does, so that line never acts.)"""
    prompt = a.get("prompt_to_repeat")
    if not prompt:
        raise a._missing("prompt_to_repeat", "is empty")  # ValueError in the original
    return lambda value: value.strip().lower().startswith(str(prompt).strip().lower())


def _end_checker(a: _Args) -> Check:
    """EndChecker (instructions.py:1250-1283@686a521a3): ends (stripped of spaces, then of double
    quotes, lowercased) with the phrase."""
    phrase = a.text("end_phrase").lower()
    return lambda value: value.strip().strip('"').lower().endswith(phrase)


def _title(a: _Args) -> Check:
    """TitleChecker (instructions.py:1286-1313@686a521a3): a <<title>> on one line, not blank."""
    return lambda value: any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", value))


def _letter_frequency(a: _Args) -> Check:
    """LetterFrequencyChecker (instructions.py:1316-1391@686a521a3): occurrences of the letter
    (case-insensitive) "less than" / "at least" N."""
    letter = a.get("letter")
    if not isinstance(letter, str) or len(letter) != 1 or not 97 <= ord(letter.lower()) <= 122:
        raise a._missing("letter", f"is {letter!r}, not one ASCII letter")
    letter = letter.strip().lower()
    n = a.count("let_frequency")
    relation = a.relation("let_relation")
    return lambda value: _compare(relation, collections.Counter(value.lower())[letter], n)


def _english_capital(a: _Args) -> Check:
    """CapitalLettersEnglishChecker (instructions.py:1394-1422@686a521a3): isupper() and English (or no
    language detected)."""

    def check(value: str) -> bool:
        if not value.isupper():  # the original's `and` skips detection too
            return False
        detected = _detect_language(value)
        return detected is None or detected == "en"

    return check


def _english_lowercase(a: _Args) -> Check:
    """LowercaseLettersEnglishChecker (instructions.py:1425-1454@686a521a3): islower() and English (or
    no language detected)."""

    def check(value: str) -> bool:
        if not value.islower():
            return False
        detected = _detect_language(value)
        return detected is None or detected == "en"

    return check


def _no_comma(a: _Args) -> Check:
    """CommaChecker (instructions.py:1457-1476@686a521a3): no comma."""
    return lambda value: not re.search(r"\,", value)


def _quotation(a: _Args) -> Check:
    """QuotationChecker (instructions.py:1545-1566@686a521a3): stripped, at least two characters, wrapped
    in double quotes."""

    def check(value: str) -> bool:
        value = value.strip()
        return len(value) > 1 and value[0] == '"' and value[-1] == '"'

    return check


# instructions_registry.py:39-77@686a521a3 (INSTRUCTION_DICT), less UNSUPPORTED.
INSTRUCTIONS: dict[str, Callable[[_Args], Check]] = {
    "keywords:existence": _keyword_existence,
    "keywords:frequency": _keyword_frequency,
    "keywords:forbidden_words": _forbidden_words,
    "keywords:letter_frequency": _letter_frequency,
    "language:response_language": _response_language,
    "length_constraints:number_paragraphs": _number_paragraphs,
    "length_constraints:number_words": _number_words,
    "length_constraints:nth_paragraph_first_word": _nth_paragraph_first_word,
    "detectable_content:number_placeholders": _placeholders,
    "detectable_content:postscript": _postscript,
    "detectable_format:number_bullet_lists": _bullet_lists,
    "detectable_format:constrained_response": _constrained_response,
    "detectable_format:number_highlighted_sections": _highlighted_sections,
    "detectable_format:multiple_sections": _multiple_sections,
    "detectable_format:json_format": _json_format,
    "detectable_format:title": _title,
    "combination:two_responses": _two_responses,
    "combination:repeat_prompt": _repeat_prompt,
    "startend:end_checker": _end_checker,
    "change_case:english_capital": _english_capital,
    "change_case:english_lowercase": _english_lowercase,
    "punctuation:no_comma": _no_comma,
    "startend:quotation": _quotation,
}


def build_check(instruction_id: str, kwargs: Mapping[str, Any]) -> Check:
    """The check for one instruction of a prompt row, its arguments validated."""
    if instruction_id in UNSUPPORTED:
        raise BadInput(
            f"IFEval instruction {instruction_id} is not supported: it needs nltk's Punkt models",
            hint="score(..., skip_unsupported=True) leaves it out",
        )
    builder = INSTRUCTIONS.get(instruction_id)
    if builder is None:
        raise BadInput(
            f"unknown IFEval instruction {instruction_id!r}", hint=f"known: {', '.join(sorted(INSTRUCTIONS))}"
        )
    args = _Args(instruction_id, kwargs)
    check = builder(args)
    args.done()
    return check


def loose_variants(response: str) -> list[str]:
    """run_eval.py:116-133@686a521a3: the response, without its first line, its last line or both, each
    also with every "*" removed."""
    lines = response.split("\n")
    remove_first = "\n".join(lines[1:]).strip()
    remove_last = "\n".join(lines[:-1]).strip()
    remove_both = "\n".join(lines[1:-1]).strip()
    return [
        response,
        response.replace("*", ""),
        remove_first,
        remove_last,
        remove_both,
        remove_first.replace("*", ""),
        remove_last.replace("*", ""),
        remove_both.replace("*", ""),
    ]


def follows(check: Check, response: str, loose: bool) -> bool:
    """Strict (run_eval.py:96-99@686a521a3): the response is not blank and passes. Loose
    (run_eval.py:146-150): any non-blank variant passes."""
    candidates = loose_variants(response) if loose else [response]
    return any(r.strip() and check(r) for r in candidates)


def score(
    prompt_rows: Sequence[Mapping[str, Any]], responses: Sequence[str], skip_unsupported: bool = False
) -> dict[str, Any]:
    """Strict and loose accuracy over the rows, each row's response at the same position: prompt-level
    (every instruction of the prompt followed) and instruction-level (run_eval.py:163-211@686a521a3's
    "prompt-leval accuracy" and "instruction-level accuracy"), per instruction id and per category
    (its tier1 and tier0), and each row's follow lists."""
    if len(prompt_rows) != len(responses):
        raise BadInput(f"{len(prompt_rows)} IFEval prompt rows but {len(responses)} responses")
    if not prompt_rows:
        raise BadInput("no IFEval prompt rows to score")
    skipped = 0
    per_prompt = []
    totals = {mode: [0, 0, 0, 0] for mode in ("strict", "loose")}  # prompts, correct, insts, correct
    tiers: dict[str, dict[str, list[int]]] = {
        "strict": collections.defaultdict(lambda: [0, 0]),
        "loose": collections.defaultdict(lambda: [0, 0]),
    }
    for row, response in zip(prompt_rows, responses, strict=True):
        ids = list(row["instruction_id_list"])
        kwargs = list(row.get("kwargs") or [{} for _ in ids])
        if len(kwargs) != len(ids):
            raise BadInput(
                f"IFEval row {row.get('key', row.get('prompt', '')[:40])!r}: kwargs and ids differ"
            )
        checks = []
        for instruction_id, kw in zip(ids, kwargs, strict=True):
            if skip_unsupported and instruction_id in UNSUPPORTED:
                skipped += 1
                continue
            checks.append((instruction_id, build_check(instruction_id, kw or {})))
        result: dict[str, Any] = {"instruction_id_list": [i for i, _ in checks]}
        for mode in ("strict", "loose"):
            followed = [follows(check, response, loose=mode == "loose") for _, check in checks]
            result[mode] = followed
            t = totals[mode]
            t[0] += 1
            t[1] += all(followed)
            t[2] += len(followed)
            t[3] += sum(followed)
            for (instruction_id, _), ok in zip(checks, followed, strict=True):
                for key in (instruction_id, instruction_id.split(":")[0]):
                    tiers[mode][key][0] += 1
                    tiers[mode][key][1] += ok
        per_prompt.append(result)
    out: dict[str, Any] = {}
    for mode in ("strict", "loose"):
        prompts, prompts_ok, insts, insts_ok = totals[mode]
        out[f"prompt_level_{mode}_acc"] = prompts_ok / prompts
        out[f"inst_level_{mode}_acc"] = insts_ok / insts if insts else 0.0
        out[f"per_instruction_{mode}_acc"] = {k: ok / n for k, (n, ok) in sorted(tiers[mode].items())}
    out["prompts"] = len(prompt_rows)
    out["instructions"] = totals["strict"][2]
    out["skipped_unsupported"] = skipped
    out["per_prompt"] = per_prompt
    return out
