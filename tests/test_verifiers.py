"""The verifiers and IFEval checks of olmo_ctl/evaluation, against the ORIGINAL open-instruct code: every
expectation below is what open-instruct at commit 686a521a3 returns for the same input
(ground_truth_utils.REWARD_FN_MAPPING for GSM8K, MATH and the RLVR IFEval constraints;
eval/ifeval's INSTRUCTION_DICT checks, strict and loose as run_eval.py applies them, for IFEval
evaluation), computed once and pasted here. Regenerate them from a checkout of open-instruct at that
commit: `python tools/verifier_oracle.py PATH/TO/open-instruct` (its docstring says what to install),
and paste its output over the tables GSM8K, MATH, IFEVAL and IFEVAL_EVAL (the inputs live in the tool).
"""

from __future__ import annotations

import json

import pytest

from olmo_ctl.core.errors import BadInput
from olmo_ctl.evaluation import ifeval, verifiers

langdetect = pytest.importorskip("langdetect")
pytest.importorskip("sympy")
pytest.importorskip("antlr4")

# fmt: off
GSM8K = [
    ('The answer is 42.', '42', 1.0),
    ('She has 1,234 apples in total, so 1,234.', '1234', 1.0),
    ('It costs $1,000,000 in the end', '1000000', 1.0),
    ('The temperature drops to -5 degrees.', '-5', 0.0),
    ('The change is -2.5 dollars', '-2.5', 1.0),
    ('First 3, then 7, so the answer is 10', '10', 1.0),
    ('First 3, then 7, so the answer is 10', '7', 0.0),
    ('The answer is 18.0', '18', 0.0),
    ('no number here', 'no number here', 1.0),
    ('#### 72', '72', 1.0),
    ('Total: 5 + 6 = 11. Final answer: 11', '12', 0.0),
    ('1,2,3', '123', 0.0),
]
MATH = [
    ('So the answer is \\boxed{\\frac{1}{2}}.', '0.5', 1.0),
    ('So the answer is \\boxed{\\frac{1}{2}}.', '\\frac{1}{2}', 1.0),
    ('Final Answer: The final answer is $x^2+1$. I hope it is correct.', 'x^2+1', 1.0),
    ('Final Answer: The final answer is $5$. I hope it is correct.', '6', 0.0),
    ('Final Answer: The final answer is 10', '10', 0.0),
    ('We get $y = 3$ and then $x = 7$', '7', 1.0),
    ('The result is \\boxed{3\\sqrt{2}}', '3\\sqrt2', 1.0),
    ('The answer is \\boxed 5$ done', '5', 1.0),
    ('Thus \\fbox{12} is it.', '12', 0.0),
    ('The answer is 1,000', '1000', 0.0),
    ('\\boxed{\\dfrac{3}{4}}', '3/4', 1.0),
    ('\\boxed{(1, 2)}', '(1,2)', 1.0),
    ('The area is \\boxed{50\\text{ square units}}', '50', 1.0),
    ('\\boxed{x = 2}', '2', 1.0),
    ("I think it's 4", '5', 0.0),
    ('\\boxed{90^\\circ}', '90', 1.0),
    ('\\boxed{-\\frac{2}{3}}', '-\\frac{2}{3}', 1.0),
]
IFEVAL = [
    ('Apples and bananas are fruit.', {'func_name': 'verify_keywords', 'keyword_list': ['apple', 'Banana']}, 1.0),
    ('Apples only.', {'func_name': 'verify_keywords', 'keyword_list': ['apple', 'banana']}, 0.0),
    ('the cat and THE dog', {'func_name': 'verify_keyword_frequency', 'word': 'the', 'N': 2}, 1.0),
    ('No bad words here', {'func_name': 'validate_forbidden_words', 'forbidden_words': ['evil', 'bad']}, 0.0),
    ('hello world', {'func_name': 'verify_letter_frequency', 'letter': 'l', 'N': 3}, 1.0),
    ('This is a plain English sentence about the weather today.', {'func_name': 'validate_response_language', 'language': 'en'}, 1.0),
    ('One\n* * *\nTwo\n* * *\nThree', {'func_name': 'verify_paragraph_count', 'N': 3}, 1.0),
    ('One\n* * *\n\n* * *\nThree', {'func_name': 'verify_paragraph_count', 'N': 3}, 0.0),
    ('one two three four five', {'func_name': 'validate_word_constraint', 'N': 5, 'quantifier': 'at least'}, 1.0),
    ('one two three', {'func_name': 'validate_word_constraint', 'N': 10, 'quantifier': 'around'}, 0.0),
    ('Hi. Mr. Smith is here. Is it? Yes.', {'func_name': 'verify_sentence_constraint', 'N': 3, 'quantifier': 'at most'}, 1.0),
    ('Intro text\n\nSecond starts here\n\nThird', {'func_name': 'validate_paragraphs', 'N': 3, 'first_word': 'Second', 'i': 2}, 1.0),
    ('Body text.\nP.S. see you', {'func_name': 'verify_postscript', 'postscript_marker': 'P.S.'}, 1.0),
    ('Body text. P.S.', {'func_name': 'verify_postscript', 'postscript_marker': 'P.S.'}, 0.0),
    ('Dear [name], at [address]', {'func_name': 'validate_placeholders', 'N': 2}, 1.0),
    ('* one\n* two\n- three', {'func_name': 'verify_bullet_points', 'N': 3}, 1.0),
    ('<<A Title>>\nbody', {'func_name': 'validate_title'}, 1.0),
    ('yes', {'func_name': 'validate_choice', 'options': ['My answer is yes.', 'My answer is no.']}, 1.0),
    ('*a* and *b*', {'func_name': 'validate_highlighted_sections', 'N': 2}, 1.0),
    ('SECTION 1 a SECTION 2 b', {'func_name': 'validate_sections', 'N': 2, 'section_splitter': 'SECTION'}, 1.0),
    ('{"a": 1}', {'func_name': 'validate_json_format'}, 1.0),
    ('```json\n{"a": 1}\n```', {'func_name': 'validate_json_format'}, 0.0),
    ('Write a poem. Here it is.', {'func_name': 'validate_repeat_prompt', 'original_prompt': 'Write a poem.'}, 1.0),
    ('first ****** second', {'func_name': 'validate_two_responses'}, 1.0),
    ('ALL CAPS HERE', {'func_name': 'validate_uppercase'}, 1.0),
    ('all lower here', {'func_name': 'validate_lowercase'}, 1.0),
    ('I AM SO HAPPY today', {'func_name': 'validate_frequency_capital_words', 'N': 3, 'quantifier': 'at least'}, 1.0),
    ('That is all. Any other questions?', {'func_name': 'validate_end', 'end_phrase': 'Any other questions?'}, 1.0),
    ('"quoted"', {'func_name': 'validate_quotation'}, 1.0),
    ('no commas here', {'func_name': 'validate_no_commas'}, 1.0),
    ('<|user|>\nhi\n<|assistant|>\n  done, with a comma ', {'func_name': 'validate_no_commas', 'extra': None}, 0.0),
    ('text', {'keyword_list': ['x']}, 0.0),
    ('  "x" ', '{"func_name": "validate_quotation"}', 0.0),
]
IFEVAL_EVAL = [
    ('keywords:existence', {'keywords': ['rain', 'umbrella']}, 'Take an UMBRELLA, it may rain.', True, True),
    ('keywords:existence', {'keywords': ['rain', 'umbrella']}, 'Sunny all day.', False, False),
    ('keywords:frequency', {'keyword': 'cat', 'frequency': 2, 'relation': 'at least'}, 'cat catalog', True, True),
    ('keywords:frequency', {'keyword': 'cat', 'frequency': 2, 'relation': 'less than'}, 'one cat', True, True),
    ('keywords:forbidden_words', {'forbidden_words': ['bad', 'evil']}, 'A badge is fine.', True, True),
    ('keywords:forbidden_words', {'forbidden_words': ['bad', 'evil']}, 'Evil lurks.', False, False),
    ('keywords:letter_frequency', {'letter': 'E', 'let_frequency': 3, 'let_relation': 'at least'}, 'Eerie tree', True, True),
    ('language:response_language', {'language': 'en'}, 'This response is written entirely in English words.', True, True),
    ('language:response_language', {'language': 'de'}, 'This response is written entirely in English words.', False, False),
    ('length_constraints:number_paragraphs', {'num_paragraphs': 2}, 'One.\n***\nTwo.', True, True),
    ('length_constraints:number_paragraphs', {'num_paragraphs': 2}, '***\nOne.\n***\nTwo.\n***', True, True),
    ('length_constraints:number_paragraphs', {'num_paragraphs': 3}, 'One.\n***\n***\nTwo.', False, False),
    ('length_constraints:number_words', {'num_words': 5, 'relation': 'less than'}, "It's a short one.", False, False),
    ('length_constraints:number_words', {'num_words': 3, 'relation': 'at least'}, 'one two', False, False),
    ('length_constraints:nth_paragraph_first_word', {'num_paragraphs': 2, 'nth_paragraph': 2, 'first_word': 'Then'}, 'First part.\n\n"Then," she said.', True, True),
    ('length_constraints:nth_paragraph_first_word', {'num_paragraphs': 3, 'nth_paragraph': 1, 'first_word': 'hello'}, 'Hello there\n\nmore', False, False),
    ('detectable_content:number_placeholders', {'num_placeholders': 2}, '[a] and [b]', True, True),
    ('detectable_content:postscript', {'postscript_marker': 'P.P.S'}, 'Body\nP. P. S. more', True, True),
    ('detectable_content:postscript', {'postscript_marker': 'P.S.'}, 'Body without it', False, False),
    ('detectable_format:number_bullet_lists', {'num_bullets': 2}, '* one\n* two\n**bold** line', True, True),
    ('detectable_format:constrained_response', {}, 'I think... My answer is maybe.', True, True),
    ('detectable_format:number_highlighted_sections', {'num_highlights': 2}, '*one* and **two**', True, True),
    ('detectable_format:number_highlighted_sections', {'num_highlights': 3}, '*one* and * * and ** **', False, False),
    ('detectable_format:multiple_sections', {'section_spliter': 'Section', 'num_sections': 2}, 'Section 1\na\nSection 2\nb', True, True),
    ('detectable_format:json_format', {}, '```JSON\n{"k": [1, 2]}\n```', True, True),
    ('detectable_format:json_format', {}, 'Here is JSON: {}', False, False),
    ('detectable_format:title', {}, '<<Poem of Joy>>\nlines', True, True),
    ('detectable_format:title', {}, '<< >>\nlines', False, False),
    ('combination:two_responses', {}, 'First answer.\n******\nSecond answer.', True, True),
    ('combination:two_responses', {}, 'Same.\n******\nSame.', False, False),
    ('combination:repeat_prompt', {'prompt_to_repeat': 'Write a haiku.'}, 'write a haiku. Leaves fall.', True, True),
    ('startend:end_checker', {'end_phrase': 'Is there anything else I can help with?'}, '"Done. Is there anything else I can help with?"', True, True),
    ('startend:end_checker', {'end_phrase': 'Bye.'}, 'Bye. Really', False, False),
    ('change_case:english_capital', {}, 'THIS IS ALL CAPITAL LETTERS IN ENGLISH.', True, True),
    ('change_case:english_lowercase', {}, 'this is all lowercase english text.', True, True),
    ('change_case:english_lowercase', {}, 'Not lowercase.', False, False),
    ('punctuation:no_comma', {}, 'No commas at all', True, True),
    ('punctuation:no_comma', {}, 'Well, no.', False, False),
    ('startend:quotation', {}, '  "Wrapped in quotes."  ', True, True),
    ('startend:quotation', {}, 'Answer:\n"Wrapped"', False, True),
    ('punctuation:no_comma', {}, 'Sure, here it is:\nNo commas here\nHope this helps, bye', False, True),
    ('detectable_format:title', {}, '   ', False, False),
]
# fmt: on


@pytest.fixture(autouse=True)
def _seeded_langdetect():
    """langdetect is random unless seeded; the oracle ran with seed 0."""
    langdetect.DetectorFactory.seed = 0


@pytest.mark.parametrize(("prediction", "label", "expected"), GSM8K)
def test_gsm8k_matches_the_original(prediction, label, expected):
    assert verifiers.gsm8k_correct(prediction, label) == expected
    assert verifiers.verify("gsm8k", prediction, label) == expected


@pytest.mark.parametrize(("prediction", "label", "expected"), MATH)
def test_math_matches_the_original(prediction, label, expected):
    assert verifiers.math_correct(prediction, label) == expected
    assert verifiers.verify("MATH", prediction, label) == expected


@pytest.mark.parametrize(("prediction", "constraint", "expected"), IFEVAL)
def test_ifeval_constraint_matches_the_original(prediction, constraint, expected):
    given = json.loads(json.dumps(constraint))
    assert verifiers.ifeval_correct(prediction, given) == expected
    assert given == constraint, "the caller's constraint is left as it was"
    assert verifiers.verify("ifeval", prediction, constraint) == expected


def test_every_if_function_of_the_original_map_is_ported():
    # if_functions.py:494-520@686a521a3, in its order.
    assert list(verifiers.IF_FUNCTIONS) == [
        "verify_keywords", "verify_keyword_frequency", "validate_forbidden_words", "verify_letter_frequency",
        "validate_response_language", "verify_paragraph_count", "validate_word_constraint",
        "verify_sentence_constraint", "validate_paragraphs", "verify_postscript", "validate_placeholders",
        "verify_bullet_points", "validate_title", "validate_choice", "validate_highlighted_sections",
        "validate_sections", "validate_json_format", "validate_repeat_prompt", "validate_two_responses",
        "validate_uppercase", "validate_lowercase", "validate_frequency_capital_words", "validate_end",
        "validate_quotation", "validate_no_commas",
    ]  # fmt: skip
    assert {c["func_name"] for _, c, _ in IFEVAL if isinstance(c, dict) and "func_name" in c} == set(
        verifiers.IF_FUNCTIONS
    ), "every function has an oracle case"


def test_the_registry_and_unknown_names():
    assert set(verifiers.VERIFIERS) == {"gsm8k", "math", "ifeval"}
    with pytest.raises(BadInput) as e:
        verifiers.verify("gsm9k", "1", "1")
    assert "gsm8k, ifeval, math" in e.value.one_line()
    with pytest.raises(BadInput, match="func_name"):
        verifiers.ifeval_correct("x", {"func_name": "validate_nothing"})


def test_the_math_helpers_on_their_own():
    assert verifiers.last_boxed_only_string("a \\boxed{x{y}} b \\boxed{z}") == "\\boxed{z}"
    assert verifiers.last_boxed_only_string("no box") is None
    # The closing sentence is appended with no space before it, so it may be left out only after ". ".
    assert verifiers.get_unnormalized_answer("Final Answer: The final answer is $7$") == "[invalidanswer]"
    assert verifiers.get_unnormalized_answer("Final Answer: The final answer is $7$. ") == "$7$"
    assert verifiers.normalize_final_answer("x = 1,000") == "1000"
    assert verifiers.strip_string("0.5") == "\\frac{1}{2}"
    assert verifiers.hendrycks_is_equiv("3/4", "\\frac34")


@pytest.mark.parametrize(("instruction_id", "kwargs", "response", "strict", "loose"), IFEVAL_EVAL)
def test_ifeval_checks_match_the_original(instruction_id, kwargs, response, strict, loose):
    check = ifeval.build_check(instruction_id, kwargs)
    assert ifeval.follows(check, response, loose=False) == strict
    assert ifeval.follows(check, response, loose=True) == loose


def test_every_supported_instruction_has_an_oracle_case():
    assert {c[0] for c in IFEVAL_EVAL} == set(ifeval.INSTRUCTIONS)
    # instructions_registry.py:39-77@686a521a3: 25 instructions, two of them unsupported here.
    assert len(ifeval.INSTRUCTIONS) + len(ifeval.UNSUPPORTED) == 25
    assert not set(ifeval.INSTRUCTIONS) & set(ifeval.UNSUPPORTED)


def test_score_counts_prompts_and_instructions():
    rows = [
        {"key": 1, "prompt": "p1", "instruction_id_list": ["punctuation:no_comma", "startend:quotation"],
         "kwargs": [{}, {}]},
        {"key": 2, "prompt": "p2", "instruction_id_list": ["detectable_format:title"], "kwargs": [{}]},
        {"key": 3, "prompt": "p3", "instruction_id_list": ["length_constraints:number_words"],
         "kwargs": [{"num_words": 2, "relation": "at least", "keywords": None}]},
    ]  # fmt: skip
    responses = ['Sure:\n"no commas"', "no title", "two words"]
    out = ifeval.score(rows, responses)
    assert out["prompts"] == 3 and out["instructions"] == 4 and out["skipped_unsupported"] == 0
    assert out["per_prompt"][0]["strict"] == [True, False] and out["per_prompt"][0]["loose"] == [True, True]
    assert out["prompt_level_strict_acc"] == pytest.approx(1 / 3)
    assert out["inst_level_strict_acc"] == pytest.approx(2 / 4)
    assert out["prompt_level_loose_acc"] == pytest.approx(2 / 3)
    assert out["inst_level_loose_acc"] == pytest.approx(3 / 4)
    assert out["per_instruction_loose_acc"]["startend"] == 1.0


def test_score_refuses_what_it_cannot_score_exactly():
    row = {"prompt": "p", "instruction_id_list": ["length_constraints:number_sentences"],
           "kwargs": [{"num_sentences": 2, "relation": "at least"}]}  # fmt: skip
    with pytest.raises(BadInput, match="Punkt"):
        ifeval.score([row], ["One. Two."])
    out = ifeval.score([row], ["One. Two."], skip_unsupported=True)
    assert out["skipped_unsupported"] == 1 and out["instructions"] == 0
    with pytest.raises(BadInput, match="num_words"):
        ifeval.build_check("length_constraints:number_words", {"relation": "at least"})
    with pytest.raises(BadInput, match="relation"):
        ifeval.build_check("length_constraints:number_words", {"num_words": 3, "relation": "at most"})
    with pytest.raises(BadInput, match="unexpected"):
        ifeval.build_check("punctuation:no_comma", {"num_words": 3})
    with pytest.raises(BadInput, match="responses"):
        ifeval.score([row], [])
