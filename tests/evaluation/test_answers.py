"""Answer extraction and checking: hand-made model outputs and the real suite samples' gold answers."""

from __future__ import annotations

import pytest

from pipeline.evaluation.answers import (
    extract_answer,
    extract_boxed,
    final_answer_segment,
    infer_answer_type,
    is_equivalent,
    normalize_number,
)
from pipeline.evaluation.math_suites import load_suite
from tests.common.paths import require_shared_data


@pytest.mark.parametrize(
    ("text", "answer_type", "expected"),
    [
        # MetaMath's answer line wins over any later or earlier number.
        ("She has 3 + 4 = 7 apples.\nThe answer is: 7", "number", "7"),
        ("Total $1,234.50 spent.\nThe answer is: $1,234.50.", "number", "1234.50"),
        ("So x = -3.\nThe answer is: -3", "number", "-3"),
        ("The answer is: 18\n\nSome trailing 99", "number", "18"),
        ("the answer is 42 apples", "number", "42"),
        ("The answer is: \\frac{3}{4}", "number", "3/4"),
        ("The answer is: 25%", "number", "25"),
        # No answer line: last \boxed{}, then the last number (a binary minus is not a sign).
        ("Thus \\boxed{\\frac{3}{4}} is it, not 7.", "number", "3/4"),
        ("5-3=2 so 2 apples", "number", "2"),
        ("#### 18", "number", "18"),
        ("no numbers here", "number", None),
        # Expressions keep LaTeX; wrapping $...$ and a final period go.
        ("The answer is: \\boxed{2\\sqrt{3}}.", "expression", "2\\sqrt{3}"),
        ("The answer is: $x^2+1$.", "expression", "x^2+1"),
        ("We find $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$ in the end", "expression", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        # Option letters in their usual spellings.
        ("A train leaves. The answer is (C).", "option", "C"),
        ("The answer is: D) 12", "option", "D"),
        ("The answer is: \\boxed{B}", "option", "B"),
        ("A train leaves at noon. Answer: (E)", "option", "E"),
        # Systems of equations: every number of the answer, sorted.
        ("The answer is 12, 3 and 7.", "number_set", "3, 7, 12"),
    ],
)
def test_extract_answer_hand_made(text, answer_type, expected):
    assert extract_answer(text, answer_type) == expected


def test_option_letters_are_restricted_to_the_offered_ones():
    # "E" is not an option of a 4-choice MMLU problem, so the lone D is the answer.
    assert extract_answer("E is wrong; pick (D)", "option", option_letters="ABCD") == "D"
    assert extract_answer("The answer is: E", "option", option_letters="ABCD") is None


def test_option_from_stated_value_maps_back_to_its_letter():
    options = {"A": "5(√3 + 1)", "B": "6(√3 + √2)", "C": "12", "D": "1,500"}
    assert extract_answer("The answer is: 12", "option", "ABCD", options) == "C"
    assert extract_answer("The answer is: 1500.", "option", "ABCD", options) == "D"
    assert extract_answer("The answer is: 5(√3 + 1)", "option", "ABCD", options) == "A"
    assert extract_answer("The answer is: 13", "option", "ABCD", options) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a \\boxed{1} b \\boxed{{2}+{3}} c", "{2}+{3}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 5$", "5"),
        ("\\boxed{unclosed", None),
        ("nothing", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_final_answer_segment_sources():
    assert final_answer_segment("x\nThe answer is: 4\nmore") == ("4", "answer_is")
    assert final_answer_segment("so \\boxed{4}.") == ("4", "boxed")
    assert final_answer_segment("just 4") == (None, "none")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1,000", 1000.0),
        ("$18.00", 18.0),
        ("25%", 25.0),
        ("3/4", 0.75),
        ("\\frac{3}{4}", 0.75),
        ("-\\frac{1}{2}", -0.5),
        ("-2.0", -2.0),
        ("1{,}000", 1000.0),
        ("1,2", None),  # a list, not twelve
        ("1 2", None),
        ("x+1", None),
        ("1/0", None),
    ],
)
def test_normalize_number(text, value):
    assert normalize_number(text) == value


@pytest.mark.parametrize(
    ("prediction", "gold", "answer_type", "expected"),
    [
        ("18", "18", "number", True),
        ("18.0", "18", "number", True),
        ("1234.50", "1234.5", "number", True),
        ("3/4", "0.75", "number", True),
        ("70000", "70,000", "number", True),
        ("19", "18", "number", False),
        ("18.01", "18", "number", False),
        (None, "18", "number", False),
        ("", "18", "number", False),
        ("c", "C", "option", True),
        ("(C)", "C", "option", True),
        ("B", "C", "option", False),
        # math-verify: LaTeX equivalences a string comparison would miss.
        ("\\sqrt{12}", "2\\sqrt{3}", "expression", True),
        ("1+x^2", "x^2+1", "expression", True),
        ("0.5", "\\frac{1}{2}", "expression", True),
        ("\\frac{1}{3}", "\\frac{1}{2}", "expression", False),
        ("12", "1,2", "expression", False),
        ("3, 2, 1", "1, 2, 3", "number_set", True),
        ("1, 2", "1, 2, 3", "number_set", False),
    ],
)
def test_is_equivalent(prediction, gold, answer_type, expected):
    assert is_equivalent(prediction, gold, answer_type) is expected


@pytest.mark.parametrize(
    ("gold", "letters", "expected"),
    [(12, "", "number"), ("12.5", "", "number"), ("B", "AB", "option"), ("x+1", "", "expression"), ([1, 2], "", "number_set")],
)
def test_infer_answer_type(gold, letters, expected):
    assert infer_answer_type(gold, letters) == expected


def test_unknown_answer_type_is_rejected():
    with pytest.raises(ValueError, match="answer_type"):
        extract_answer("The answer is: 1", "integer")


# ---------------------------------------------------------------- real sample files

# How a MetaMath-style, a boxed, and a GSM8K-style model would state the gold answer.
_FORMATS = ["Reasoning with 123 and 4.\nThe answer is: {gold}", "So the total is $\\boxed{{{gold}}}$.", "Work: 5 + 7 = 12\n#### {gold}"]


@pytest.mark.parametrize("suite", ["gsm8k", "svamp"])
@pytest.mark.parametrize("template", _FORMATS)
def test_real_gold_numbers_verify_against_themselves(suite, template):
    """Every gold answer of the real samples, written as a model would, is extracted and judged correct;
    the same output with the gold answer plus one is judged wrong."""
    examples = load_suite(suite, require_shared_data("eval"))
    assert len(examples) > 100
    wrong_accepted, right_rejected = [], []
    for ex in examples:
        pred = extract_answer(template.format(gold=ex.gold), ex.answer_type)
        if not is_equivalent(pred, ex.gold, ex.answer_type):
            right_rejected.append((ex.gold, pred))
        off = normalize_number(ex.gold)
        assert off is not None
        bad = extract_answer(template.format(gold=f"{off + 1:g}"), ex.answer_type)
        if is_equivalent(bad, ex.gold, ex.answer_type):
            wrong_accepted.append((ex.gold, bad))
    assert right_rejected == []
    assert wrong_accepted == []


def test_real_gsm8k_gold_with_thousands_separator():
    """The gsm8k worked solutions write big numbers with commas; the gold is comma-free and equal."""
    examples = load_suite("gsm8k", require_shared_data("eval"), limit=3)
    assert examples[2].gold == "70000"  # "#### 70000" in the file; the solution says "$70,000"
    assert is_equivalent(extract_answer("The answer is: $70,000.", "number"), examples[2].gold, "number")


@pytest.mark.parametrize("template", ["The answer is: ({gold})", "The answer is {gold}.", "Answer: {gold})", "so \\boxed{{{gold}}}"])
def test_real_aqua_letters(template):
    examples = load_suite("aqua", require_shared_data("eval"))
    for ex in examples:
        assert ex.answer_type == "option" and ex.option_letters == "ABCDE"
        pred = extract_answer(template.format(gold=ex.gold), "option", ex.option_letters, ex.options)
        assert pred == ex.gold
        other = "ABCDE"[("ABCDE".index(ex.gold) + 1) % 5]
        assert not is_equivalent(other, ex.gold, "option")


def test_real_aqua_stated_option_text_maps_to_gold_letter():
    """A MetaMath model states the value, not the letter; the value of the gold option maps back."""
    examples = load_suite("aqua", require_shared_data("eval"))
    hits = 0
    for ex in examples:
        assert ex.options is not None
        text = ex.options[ex.gold]
        # Skip options whose text is shared with another option (ambiguous by construction).
        if sum(t == text for t in ex.options.values()) > 1:
            continue
        pred = extract_answer(f"The answer is: {text}", "option", ex.option_letters, ex.options)
        assert pred == ex.gold, (text, ex.options)
        hits += 1
    assert hits > 200
