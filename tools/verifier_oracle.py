"""The expectations of tests/test_verifiers.py, computed by the ORIGINAL open-instruct code: run it against
a checkout of open-instruct at 686a521a3 and paste what it prints over the test's literal tables.

    git clone https://github.com/allenai/open-instruct && git -C open-instruct checkout 686a521a3
    pip install sympy antlr4-python3-runtime==4.11 langdetect nltk immutabledict absl-py
    python tools/verifier_oracle.py open-instruct > /tmp/expect.py

It imports `open_instruct.ground_truth_utils` (the RLVR verifiers) and `eval.ifeval.instructions_registry`
(the IFEval checks) from the checkout; the evaluation checks need nltk importable (not its data: the two
checks that need Punkt are not among the cases). langdetect is seeded with 0 as the test seeds it.

Exit codes: 0 printed, 2 the checkout is not importable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GSM8K_CASES = [
    ("The answer is 42.", "42"),
    ("She has 1,234 apples in total, so 1,234.", "1234"),
    ("It costs $1,000,000 in the end", "1000000"),
    ("The temperature drops to -5 degrees.", "-5"),
    ("The change is -2.5 dollars", "-2.5"),
    ("First 3, then 7, so the answer is 10", "10"),
    ("First 3, then 7, so the answer is 10", "7"),
    ("The answer is 18.0", "18"),
    ("no number here", "no number here"),
    ("#### 72", "72"),
    ("Total: 5 + 6 = 11. Final answer: 11", "12"),
    ("1,2,3", "123"),
]

MATH_CASES = [
    ("So the answer is \\boxed{\\frac{1}{2}}.", "0.5"),
    ("So the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("Final Answer: The final answer is $x^2+1$. I hope it is correct.", "x^2+1"),
    ("Final Answer: The final answer is $5$. I hope it is correct.", "6"),
    ("Final Answer: The final answer is 10", "10"),
    ("We get $y = 3$ and then $x = 7$", "7"),
    ("The result is \\boxed{3\\sqrt{2}}", "3\\sqrt2"),
    ("The answer is \\boxed 5$ done", "5"),
    ("Thus \\fbox{12} is it.", "12"),
    ("The answer is 1,000", "1000"),
    ("\\boxed{\\dfrac{3}{4}}", "3/4"),
    ("\\boxed{(1, 2)}", "(1,2)"),
    ("The area is \\boxed{50\\text{ square units}}", "50"),
    ("\\boxed{x = 2}", "2"),
    ("I think it's 4", "5"),
    ("\\boxed{90^\\circ}", "90"),
    ("\\boxed{-\\frac{2}{3}}", "-\\frac{2}{3}"),
]

IFEVAL_CASES = [
    ("Apples and bananas are fruit.", {"func_name": "verify_keywords", "keyword_list": ["apple", "Banana"]}),
    ("Apples only.", {"func_name": "verify_keywords", "keyword_list": ["apple", "banana"]}),
    ("the cat and THE dog", {"func_name": "verify_keyword_frequency", "word": "the", "N": 2}),
    ("No bad words here", {"func_name": "validate_forbidden_words", "forbidden_words": ["evil", "bad"]}),
    ("hello world", {"func_name": "verify_letter_frequency", "letter": "l", "N": 3}),
    (
        "This is a plain English sentence about the weather today.",
        {"func_name": "validate_response_language", "language": "en"},
    ),
    ("One\n* * *\nTwo\n* * *\nThree", {"func_name": "verify_paragraph_count", "N": 3}),
    ("One\n* * *\n\n* * *\nThree", {"func_name": "verify_paragraph_count", "N": 3}),
    ("one two three four five", {"func_name": "validate_word_constraint", "N": 5, "quantifier": "at least"}),
    ("one two three", {"func_name": "validate_word_constraint", "N": 10, "quantifier": "around"}),
    (
        "Hi. Mr. Smith is here. Is it? Yes.",
        {"func_name": "verify_sentence_constraint", "N": 3, "quantifier": "at most"},
    ),
    (
        "Intro text\n\nSecond starts here\n\nThird",
        {"func_name": "validate_paragraphs", "N": 3, "first_word": "Second", "i": 2},
    ),
    ("Body text.\nP.S. see you", {"func_name": "verify_postscript", "postscript_marker": "P.S."}),
    ("Body text. P.S.", {"func_name": "verify_postscript", "postscript_marker": "P.S."}),
    ("Dear [name], at [address]", {"func_name": "validate_placeholders", "N": 2}),
    ("* one\n* two\n- three", {"func_name": "verify_bullet_points", "N": 3}),
    ("<<A Title>>\nbody", {"func_name": "validate_title"}),
    ("yes", {"func_name": "validate_choice", "options": ["My answer is yes.", "My answer is no."]}),
    ("*a* and *b*", {"func_name": "validate_highlighted_sections", "N": 2}),
    ("SECTION 1 a SECTION 2 b", {"func_name": "validate_sections", "N": 2, "section_splitter": "SECTION"}),
    ('{"a": 1}', {"func_name": "validate_json_format"}),
    ('```json\n{"a": 1}\n```', {"func_name": "validate_json_format"}),
    (
        "Write a poem. Here it is.",
        {"func_name": "validate_repeat_prompt", "original_prompt": "Write a poem."},
    ),
    ("first ****** second", {"func_name": "validate_two_responses"}),
    ("ALL CAPS HERE", {"func_name": "validate_uppercase"}),
    ("all lower here", {"func_name": "validate_lowercase"}),
    (
        "I AM SO HAPPY today",
        {"func_name": "validate_frequency_capital_words", "N": 3, "quantifier": "at least"},
    ),
    (
        "That is all. Any other questions?",
        {"func_name": "validate_end", "end_phrase": "Any other questions?"},
    ),
    ('"quoted"', {"func_name": "validate_quotation"}),
    ("no commas here", {"func_name": "validate_no_commas"}),
    (
        "<|user|>\nhi\n<|assistant|>\n  done, with a comma ",
        {"func_name": "validate_no_commas", "extra": None},
    ),
    ("text", {"keyword_list": ["x"]}),
    ('  "x" ', json.dumps({"func_name": "validate_quotation"})),
]

# (instruction_id, kwargs, response): the IFEval evaluation checks, strict and loose.
IFEVAL_EVAL_CASES = [
    ("keywords:existence", {"keywords": ["rain", "umbrella"]}, "Take an UMBRELLA, it may rain."),
    ("keywords:existence", {"keywords": ["rain", "umbrella"]}, "Sunny all day."),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": "at least"}, "cat catalog"),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": "less than"}, "one cat"),
    ("keywords:forbidden_words", {"forbidden_words": ["bad", "evil"]}, "A badge is fine."),
    ("keywords:forbidden_words", {"forbidden_words": ["bad", "evil"]}, "Evil lurks."),
    ("keywords:letter_frequency", {"letter": "E", "let_frequency": 3, "let_relation": "at least"}, "Eerie tree"),
    ("language:response_language", {"language": "en"}, "This response is written entirely in English words."),
    ("language:response_language", {"language": "de"}, "This response is written entirely in English words."),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "One.\n***\nTwo."),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "***\nOne.\n***\nTwo.\n***"),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 3}, "One.\n***\n***\nTwo."),
    ("length_constraints:number_words", {"num_words": 5, "relation": "less than"}, "It's a short one."),
    ("length_constraints:number_words", {"num_words": 3, "relation": "at least"}, "one two"),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "Then"},
        'First part.\n\n"Then," she said.',
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 3, "nth_paragraph": 1, "first_word": "hello"},
        "Hello there\n\nmore",
    ),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "[a] and [b]"),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Body\nP. P. S. more"),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Body without it"),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n* two\n**bold** line"),
    ("detectable_format:constrained_response", {}, "I think... My answer is maybe."),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and **two**"),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 3}, "*one* and * * and ** **"),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2}, "Section 1\na\nSection 2\nb"),
    ("detectable_format:json_format", {}, '```JSON\n{"k": [1, 2]}\n```'),
    ("detectable_format:json_format", {}, "Here is JSON: {}"),
    ("detectable_format:title", {}, "<<Poem of Joy>>\nlines"),
    ("detectable_format:title", {}, "<< >>\nlines"),
    ("combination:two_responses", {}, "First answer.\n******\nSecond answer."),
    ("combination:two_responses", {}, "Same.\n******\nSame."),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a haiku."}, "write a haiku. Leaves fall."),
    ("startend:end_checker", {"end_phrase": "Is there anything else I can help with?"}, '"Done. Is there anything else I can help with?"'),
    ("startend:end_checker", {"end_phrase": "Bye."}, "Bye. Really"),
    ("change_case:english_capital", {}, "THIS IS ALL CAPITAL LETTERS IN ENGLISH."),
    ("change_case:english_lowercase", {}, "this is all lowercase english text."),
    ("change_case:english_lowercase", {}, "Not lowercase."),
    ("punctuation:no_comma", {}, "No commas at all"),
    ("punctuation:no_comma", {}, "Well, no."),
    ("startend:quotation", {}, '  "Wrapped in quotes."  '),
    ("startend:quotation", {}, 'Answer:\n"Wrapped"'),
    ("punctuation:no_comma", {}, "Sure, here it is:\nNo commas here\nHope this helps, bye"),
    ("detectable_format:title", {}, "   "),
]  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    checkout = Path(argv[0]).resolve()
    sys.path.insert(0, str(checkout))
    try:
        import langdetect
        from eval.ifeval import instructions_registry
        from open_instruct.ground_truth_utils import REWARD_FN_MAPPING
    except ImportError as e:
        print(f"error: cannot import open-instruct from {checkout}: {e}", file=sys.stderr)
        return 2
    langdetect.DetectorFactory.seed = 0

    def rlvr(name: str, prediction: str, label: object) -> float:
        if isinstance(label, dict):
            label = dict(label)  # IFEvalVerifier pops func_name from the dict it is given
        return float(REWARD_FN_MAPPING[name]([], prediction, label))

    def check(instruction_id: str, kwargs: dict, response: str) -> bool:
        instruction = instructions_registry.INSTRUCTION_DICT[instruction_id](instruction_id)
        instruction.build_description(**kwargs)
        return bool(response.strip() and instruction.check_following(response))

    def loose(instruction_id: str, kwargs: dict, response: str) -> bool:
        r = response.split("\n")
        first, last, both = "\n".join(r[1:]).strip(), "\n".join(r[:-1]).strip(), "\n".join(r[1:-1]).strip()
        variants = [response, response.replace("*", ""), first, last, both]
        variants += [first.replace("*", ""), last.replace("*", ""), both.replace("*", "")]
        return any(check(instruction_id, kwargs, v) for v in variants)

    print("# Computed by tools/verifier_oracle.py with open-instruct at 686a521a3.")
    for name, table, cases in (
        ("gsm8k", "GSM8K", GSM8K_CASES),
        ("math", "MATH", MATH_CASES),
        ("ifeval", "IFEVAL", IFEVAL_CASES),
    ):
        print(f"{table} = [")
        for prediction, label in cases:
            print(f"    ({prediction!r}, {label!r}, {rlvr(name, prediction, label)!r}),")
        print("]")
    print("IFEVAL_EVAL = [")
    for instruction_id, kwargs, response in IFEVAL_EVAL_CASES:
        strict, lo = check(instruction_id, kwargs, response), loose(instruction_id, kwargs, response)
        print(f"    ({instruction_id!r}, {kwargs!r}, {response!r}, {strict!r}, {lo!r}),")
    print("]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
