"""The verifiers AI2 used for OLMo 2 Instruct's RLVR rewards and generative tasks, ported from
open-instruct at commit 686a521a3 (Apache-2.0): `open_instruct/ground_truth_utils.py` (the verifier
classes), `open_instruct/math_utils.py` (answer extraction and equivalence, itself from EleutherAI's
lm-evaluation-harness Minerva math task and Hendrycks' MATH code) and `open_instruct/if_functions.py`
(the RLVR instruction-following constraints). Each function names the lines it ports as
`file:line@686a521a3`; the quirks of the original are kept on purpose (a reward must score what AI2's
scored), and the few places that differ say so.

`verify(dataset, prediction, ground_truth)` picks the verifier by the RLVR datasets' `dataset` field
("gsm8k", "math", "ifeval"; ground_truth_utils.py:65,83,154@686a521a3) and returns 1.0 or 0.0.

Pure Python: no jax. `math_correct` imports sympy and its LaTeX parser (which needs
antlr4-python3-runtime 4.11) when it first compares, and the "validate_response_language" constraint
imports langdetect; both come with the `eval` extra.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from olmo_ctl.core.errors import BadInput

log = logging.getLogger(__name__)

# --- GSM8K -------------------------------------------------------------------------------------------


def gsm8k_correct(prediction: str, label: str) -> float:
    """GSM8KVerifier.__call__ (ground_truth_utils.py:67-71@686a521a3): drop the commas between digits,
    take the last number (a decimal with its sign, else a run of digits: "-3" gives "3", the sign of an
    integer is not part of the match), else the whole response, and compare as lowercase strings."""
    response = re.sub(r"(\d),(\d)", r"\1\2", prediction)
    numbers = re.findall(r"[-+]?\d*\.\d+|\d+", response)
    extracted = numbers[-1] if numbers else response
    return float(str(extracted).lower() == str(label).lower())


# --- MATH: extraction (math_utils.py) ------------------------------------------------------------------


def last_boxed_only_string(text: str) -> str | None:
    """math_utils.py:13-40@686a521a3: the last `\\boxed{...}` (braces balanced) or `\\fbox{...}`; for
    `\\boxed ` (a space, no brace) everything after the last one up to a `$`."""
    idx = text.rfind("\\boxed")
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    if idx < 0:
        idx = text.rfind("\\fbox")
        if idx < 0:
            return None
    depth = 0
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth += 1
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[idx : i + 1]
    return None


def remove_boxed(text: str) -> str:
    """math_utils.py:43-54@686a521a3: the inside of `\\boxed{...}` (or what follows `\\boxed `). Raises
    AssertionError for anything else (an `\\fbox{...}`), as the original does; MathVerifier catches it."""
    if "\\boxed " in text:
        left = "\\boxed "
        assert text[: len(left)] == left
        return text[len(left) :]
    left = "\\boxed{"
    assert text[: len(left)] == left
    assert text[-1] == "}"
    return text[len(left) : -1]


def get_unnormalized_answer(text: str) -> str:
    """math_utils.py:57-68@686a521a3: the Minerva format, "Final Answer: The final answer is X. I hope it
    is correct.", or "[invalidanswer]". The closing sentence is appended first, with no space before
    it, so it may be left out only when the text ends with a character and a space ("... $7$. "); the
    pattern's dots match any character."""
    text += "I hope it is correct."
    match = re.search(r"Final Answer: The final answer is(.*?). I hope it is correct.", text)
    return match.group(1).strip() if match else "[invalidanswer]"


# math_utils.py:71-82@686a521a3
SUBSTITUTIONS = [
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
]
# math_utils.py:83-126@686a521a3
REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters",
    "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}",
    "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ",
    r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
]  # fmt: skip


def normalize_final_answer(final_answer: str) -> str:
    """math_utils.py:129-164@686a521a3 (Lewkowycz et al. 2022, appendix D): what follows the last "=",
    the substitutions and removals above, the inside of $...$, \\text{}, \\textbf{}, \\overline{},
    \\boxed{}; shorthand \\fracab and \\sqrta expanded; commas dropped from a plain number."""
    final_answer = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expr, "")
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer


# --- MATH: equivalence (math_utils.py) -----------------------------------------------------------------


@contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    """math_utils.py:167-180@686a521a3 (class timeout): SIGALRM after `seconds`, raising TimeoutError.
    Differs: signals work only in the main thread; off it, the original's signal.signal raises
    ValueError, which is_equiv's catch-all turns into "not equivalent" for every pair. Here, off the main
    thread, the comparison runs without a time limit instead."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: object) -> None:
        raise TimeoutError("Timeout")

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def is_equiv(x1: str, x2: str) -> bool:
    """math_utils.py:183-221@686a521a3: parse both with sympy's LaTeX parser (antlr) and check that the
    difference simplifies to 0, within 5 seconds; any failure is "not equivalent" (a missing antlr4 or
    sympy, an ImportError, is raised, as in the original)."""
    # Imported here, not under the time limit: the first import of sympy takes seconds.
    import sympy
    from sympy.parsing.latex import parse_latex
    from sympy.parsing.latex.errors import LaTeXParsingError

    try:
        with _time_limit(5):
            try:
                parsed_x1 = parse_latex(x1)
                parsed_x2 = parse_latex(x2)
            except (LaTeXParsingError, sympy.SympifyError, TypeError):
                log.debug("couldn't parse one of %s or %s", x1, x2)
                return False
            try:
                diff = parsed_x1 - parsed_x2
            except TypeError:
                log.debug("couldn't subtract %s and %s", x1, x2)
                return False
            try:
                return bool(sympy.simplify(diff) == 0)
            except ValueError:
                # The original logs and falls through, returning None: falsy, as False is.
                log.debug("Had some trouble simplifying when comparing %s and %s", x1, x2)
                return False
    except TimeoutError:
        log.debug("Timed out comparing %s and %s", x1, x2)
        return False
    except ImportError:
        raise
    except Exception as e:
        log.debug("Failed comparing %s and %s with %s", x1, x2, e)
        return False


def _fix_fracs(text: str) -> str:
    """math_utils.py:224-253@686a521a3 (fix_fracs): \\frac12 -> \\frac{1}{2}, \\frac1{2} -> \\frac{1}{2}.
    (An empty piece after a \\frac, "\\frac" at the very end, raises IndexError as in the original;
    hendrycks_is_equiv catches it.)"""
    substrs = text.split("\\frac")
    new_str = substrs[0]
    for substr in substrs[1:]:
        new_str += "\\frac"
        if substr[0] == "{":
            new_str += substr
            continue
        if len(substr) < 2:
            return text
        a, b = substr[0], substr[1]
        if b != "{":
            new_str += "{" + a + "}{" + b + "}" + substr[2:]
        else:
            new_str += "{" + a + "}" + b + substr[2:]
    return new_str


def _fix_a_slash_b(text: str) -> str:
    """math_utils.py:256-268@686a521a3 (fix_a_slash_b): "3/4" -> \\frac{3}{4} for two plain integers.
    (A non-integer side raises ValueError as in the original, which catches only AssertionError;
    hendrycks_is_equiv catches it.)"""
    if len(text.split("/")) != 2:
        return text
    a_text, b_text = text.split("/")
    a, b = int(a_text), int(b_text)
    if text != f"{a}/{b}":
        return text
    return "\\frac{" + str(a) + "}{" + str(b) + "}"


def _remove_right_units(text: str) -> str:
    """math_utils.py:271-278@686a521a3 (remove_right_units): what precedes "\\text{ " (an AssertionError
    when it occurs twice, as in the original)."""
    if "\\text{ " in text:
        splits = text.split("\\text{ ")
        assert len(splits) == 2
        return splits[0]
    return text


def _fix_sqrt(text: str) -> str:
    """math_utils.py:281-293@686a521a3 (fix_sqrt): \\sqrt3 -> \\sqrt{3}."""
    if "\\sqrt" not in text:
        return text
    splits = text.split("\\sqrt")
    new_string = splits[0]
    for split in splits[1:]:
        if split[0] != "{":
            new_string += "\\sqrt{" + split[0] + "}" + split[1:]
        else:
            new_string += "\\sqrt" + split
    return new_string


def strip_string(text: str) -> str:
    """math_utils.py:296-358@686a521a3: Hendrycks' MATH normalization (linebreaks, \\!, \\left/\\right,
    tfrac/dfrac, degrees, \\$, units after "\\text{ ", percent signs, leading zeros, a short "k = "
    prefix, sqrt and frac shorthand, spaces, 0.5 -> \\frac{1}{2}, a/b -> \\frac{a}{b})."""
    text = text.replace("\n", "")
    text = text.replace("\\!", "")
    text = text.replace("\\\\", "\\")
    text = text.replace("tfrac", "frac")
    text = text.replace("dfrac", "frac")
    text = text.replace("\\left", "")
    text = text.replace("\\right", "")
    text = text.replace("^{\\circ}", "")
    text = text.replace("^\\circ", "")
    text = text.replace("\\$", "")
    text = _remove_right_units(text)
    text = text.replace("\\%", "")
    text = text.replace("\\%", "")  # the original's second line, "\%", is the same string
    text = text.replace(" .", " 0.")
    text = text.replace("{.", "{0.")
    if len(text) == 0:
        return text
    if text[0] == ".":
        text = "0" + text
    if len(text.split("=")) == 2 and len(text.split("=")[0]) <= 2:
        text = text.split("=")[1]
    text = _fix_sqrt(text)
    text = text.replace(" ", "")
    text = _fix_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    text = _fix_a_slash_b(text)
    return text


def hendrycks_is_equiv(str1: str | None, str2: str | None) -> bool:
    """math_utils.py:361-375@686a521a3: equal after strip_string (equal as given when normalizing fails)."""
    if str1 is None and str2 is None:
        return True
    if str1 is None or str2 is None:
        return False
    try:
        return strip_string(str1) == strip_string(str2)
    except Exception:
        return str1 == str2


def math_correct(prediction: str, label: str) -> float:
    """MathVerifier.__call__ (ground_truth_utils.py:85-119@686a521a3). The candidates: the last \\boxed{}
    answer; the Minerva "Final Answer: The final answer is X. I hope it is correct." answer, normalized;
    only when neither is found, the last $...$ span, normalized; and only when that too is missing, the
    whole output, normalized. 1.0 when any candidate is_equiv (sympy) or hendrycks_is_equiv the label."""
    answers: list[str] = []
    boxed = last_boxed_only_string(prediction)
    if boxed is not None:
        try:
            answers.append(remove_boxed(boxed))
        except AssertionError:
            pass
    minerva = normalize_final_answer(get_unnormalized_answer(prediction))
    if minerva != "[invalidanswer]":
        answers.append(minerva)
    if not answers:
        dollars = [m.start() for m in re.finditer(r"\$", prediction)]
        if len(dollars) > 1:
            answers.append(normalize_final_answer(prediction[dollars[-2] + 1 : dollars[-1]]))
    if not answers:
        answers.append(normalize_final_answer(prediction))
    for answer in answers:
        if is_equiv(answer, label) or hendrycks_is_equiv(answer, label):
            return 1.0
    return 0.0


# --- IFEval constraints (if_functions.py) --------------------------------------------------------------


def verify_keywords(text: str, keyword_list: list[str]) -> bool:
    """if_functions.py:12-27@686a521a3: every keyword occurs, case-insensitively, as a substring."""
    lower = text.lower()
    return all(keyword.lower() in lower for keyword in keyword_list)


def verify_keyword_frequency(text: str, word: str, N: int) -> bool:
    """if_functions.py:31-58@686a521a3: `word` is exactly N of the text's \\b\\w+\\b words (lowercase)."""
    words = re.findall(r"\b\w+\b", text.lower())
    return sum(1 for w in words if w == word.lower()) == N


def validate_forbidden_words(text: str, forbidden_words: list[str]) -> bool:
    """if_functions.py:62-87@686a521a3: none of the words occurs, case-insensitively, as a substring."""
    lower = text.lower()
    return not [word for word in forbidden_words if word.lower() in lower]


def verify_letter_frequency(text: str, letter: str, N: int) -> bool:
    """if_functions.py:93-117@686a521a3: `letter` occurs exactly N times (case-sensitive); ValueError
    unless `letter` is one character."""
    if len(letter) != 1:
        raise ValueError("Letter parameter must be a single character")
    return text.count(letter) == N


def validate_response_language(text: str, language: str) -> bool:
    """if_functions.py:123-144@686a521a3: langdetect's language code for the text is `language`.
    langdetect is random unless its DetectorFactory.seed is set, and raises LangDetectException for a
    text with no letters; both as in the original, which sets no seed and catches nothing."""
    from langdetect import detect

    return bool(detect(text) == language)


def verify_paragraph_count(text: str, N: int) -> bool:
    """if_functions.py:149-185@686a521a3: N paragraphs separated by "* * *" (lines stripped first),
    none of them empty."""
    text = "\n".join(line.strip() for line in text.splitlines()).strip()
    paragraphs = text.split("* * *")
    if len([p for p in paragraphs if p.strip()]) != len(paragraphs):
        return False
    return len(paragraphs) == N


def validate_word_constraint(text: str, N: int, quantifier: str) -> bool:
    """if_functions.py:191-220@686a521a3: whitespace-separated words "at least" / "at most" N, or
    "around" N (within max(round(N * 0.1), 1)); any other quantifier fails."""
    count = len(text.strip().split())
    tolerance = max(round(N * 0.1), 1)
    if quantifier == "at least":
        return count >= N
    if quantifier == "at most":
        return count <= N
    if quantifier == "around":
        return abs(count - N) <= tolerance
    return False


def verify_sentence_constraint(text: str, N: int, quantifier: str) -> bool:
    """if_functions.py:224-250@686a521a3: sentences split on whitespace after "." or "?" (not after an
    abbreviation like "e.g." or "Mr."); "at least" / "at most" N, or "around" N (within 1)."""
    count = len(re.split(r"(?<!\w\.\w.)(?<![A-Z][a-z]\.)(?<=\.|\?)\s", text))
    if quantifier == "at least":
        return count >= N
    if quantifier == "around":
        return abs(count - N) <= 1
    if quantifier == "at most":
        return count <= N
    return False


def validate_paragraphs(text: str, N: int, first_word: str, i: int) -> bool:
    """if_functions.py:255-279@686a521a3: N paragraphs separated by "\\n\\n", the i-th (from 1)
    starting with `first_word` (a prefix check, case-sensitive)."""
    paragraphs = text.split("\n\n")
    if len(paragraphs) != N:
        return False
    return paragraphs[i - 1].strip().startswith(first_word)


def verify_postscript(text: str, postscript_marker: str) -> bool:
    """if_functions.py:285-303@686a521a3: the marker occurs and something follows its first occurrence."""
    if postscript_marker not in text:
        return False
    remaining = text[text.find(postscript_marker) :].strip()
    return len(remaining) > len(postscript_marker)


def validate_placeholders(text: str, N: int) -> bool:
    """if_functions.py:308-333@686a521a3: at least N [placeholders]."""
    return len(re.findall(r"\[(.*?)\]", text)) >= N


def verify_bullet_points(text: str, N: int) -> bool:
    """if_functions.py:338-358@686a521a3: exactly N lines that start (stripped) with "*" or "-"."""
    return len([line for line in text.split("\n") if line.strip().startswith(("*", "-"))]) == N


def validate_title(text: str) -> bool:
    """if_functions.py:362-369@686a521a3: a <<title>> (an empty one counts)."""
    return len(re.findall(r"<<(.*?)>>", text)) > 0


def validate_choice(text: str, options: list[str]) -> bool:
    """if_functions.py:373-377@686a521a3: the whole text is a substring of one of the options."""
    return any(text in option for option in options)


def validate_highlighted_sections(text: str, N: int) -> bool:
    """if_functions.py:382-389@686a521a3: at least N *highlighted* spans (non-greedy, one line or more)."""
    return len(re.findall(r"\*(.*?)\*", text)) >= N


def validate_sections(text: str, N: int, section_splitter: str) -> bool:
    """if_functions.py:395-404@686a521a3: split on the splitter, dropping an empty first piece: N pieces."""
    sections = text.split(section_splitter)
    if sections[0] == "":
        sections.pop(0)
    return len(sections) == N


def validate_json_format(text: str) -> bool:
    """if_functions.py:407-413@686a521a3: the whole text parses as JSON (no code fences allowed)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def validate_repeat_prompt(text: str, original_prompt: str) -> bool:
    """if_functions.py:417-422@686a521a3: the text starts with the prompt, exactly."""
    return text.startswith(original_prompt)


def validate_two_responses(text: str) -> bool:
    """if_functions.py:426-434@686a521a3: one "******", and the two sides differ (stripped)."""
    if text.count("******") == 1:
        first, second = text.split("******")
        return first.strip() != second.strip()
    return False


def validate_uppercase(text: str) -> bool:
    """if_functions.py:437-443@686a521a3: the text equals its upper-case form."""
    return text == text.upper()


def validate_lowercase(text: str) -> bool:
    """if_functions.py:447-453@686a521a3: the text equals its lower-case form."""
    return text == text.lower()


def validate_frequency_capital_words(text: str, N: int, quantifier: str) -> bool:
    """if_functions.py:457-467@686a521a3: \\b[A-Z]+\\b words "at least" / "at most" N, or exactly N for
    "around"."""
    count = len(re.findall(r"\b[A-Z]+\b", text))
    if quantifier == "at least":
        return count >= N
    if quantifier == "around":
        return count == N
    if quantifier == "at most":
        return count <= N
    return False


def validate_end(text: str, end_phrase: str) -> bool:
    """if_functions.py:470-476@686a521a3: the text ends with the phrase, exactly."""
    return text.endswith(end_phrase)


def validate_quotation(text: str) -> bool:
    """if_functions.py:479-484@686a521a3: starts and ends with a double quote (a lone '"' counts)."""
    return text.startswith('"') and text.endswith('"')


def validate_no_commas(text: str) -> bool:
    """if_functions.py:487-492@686a521a3: no comma."""
    return "," not in text


# if_functions.py:494-520@686a521a3: every function of IF_FUNCTIONS_MAP, by the same names.
IF_FUNCTIONS: dict[str, Callable[..., bool]] = {
    f.__name__: f
    for f in (
        verify_keywords,
        verify_keyword_frequency,
        validate_forbidden_words,
        verify_letter_frequency,
        validate_response_language,
        verify_paragraph_count,
        validate_word_constraint,
        verify_sentence_constraint,
        validate_paragraphs,
        verify_postscript,
        validate_placeholders,
        verify_bullet_points,
        validate_title,
        validate_choice,
        validate_highlighted_sections,
        validate_sections,
        validate_json_format,
        validate_repeat_prompt,
        validate_two_responses,
        validate_uppercase,
        validate_lowercase,
        validate_frequency_capital_words,
        validate_end,
        validate_quotation,
        validate_no_commas,
    )
}


def ifeval_correct(prediction: str, constraint: str | dict[str, Any]) -> float:
    """IFEvalVerifier.__call__ (ground_truth_utils.py:156-169@686a521a3). `constraint` is a dict or its
    JSON, {"func_name": NAME, kwarg: value, ...}; None-valued kwargs are dropped. The answer checked is
    what follows the last "<|assistant|>\\n", stripped, except that a constraint with only `func_name`
    checks the raw prediction, as the original does. A constraint without `func_name` scores 0.0.

    Differs from the original: the caller's dict is not changed (the original pops "func_name" from
    it, so the same dict scores 0.0 the second time), and an unknown `func_name` raises BadInput rather
    than KeyError."""
    parsed: dict[str, Any] = json.loads(constraint) if isinstance(constraint, str) else dict(constraint)
    if "func_name" not in parsed:
        log.warning("Constraint missing 'func_name': %s", parsed)
        return 0.0
    func_name = parsed.pop("func_name")
    func = IF_FUNCTIONS.get(func_name)
    if func is None:
        raise BadInput(
            f"unknown IFEval constraint func_name {func_name!r}",
            hint=f"known: {', '.join(sorted(IF_FUNCTIONS))}",
        )
    if not parsed:
        return float(func(prediction))
    answer = prediction.split("<|assistant|>\n")[-1].strip()
    return float(func(answer, **{k: v for k, v in parsed.items() if v is not None}))


# --- The registry ----------------------------------------------------------------------------------------

# Keyed as the RLVR datasets' `dataset` field names them (the verifier names in ground_truth_utils.py).
VERIFIERS: dict[str, Callable[[str, Any], float]] = {
    "gsm8k": gsm8k_correct,
    "math": math_correct,
    "ifeval": ifeval_correct,
}


def verify(dataset: str, prediction: str, ground_truth: Any) -> float:
    """The reward for one prediction: the verifier for `dataset` (lowercased, as REWARD_FN_MAPPING's
    keys are and model_utils.py:237@686a521a3 looks them up) applied to the prediction and its ground truth."""
    verifier = VERIFIERS.get(dataset.lower())
    if verifier is None:
        raise BadInput(
            f"no verifier for dataset {dataset!r}",
            hint=f"known: {', '.join(sorted(VERIFIERS))}",
        )
    return verifier(prediction, ground_truth)
