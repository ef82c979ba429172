"""Suite readers: the real samples, hand-made files in the documented layouts, and clear errors."""

from __future__ import annotations

import json

import pytest

from pipeline.evaluation.math_suites import SUITES, load_suite, read_json_records, resolve_suite_path
from tests.common.paths import require_shared_data


def _write(path, data, jsonl=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    if jsonl:
        path.write_text("\n".join(json.dumps(r) for r in data) + "\n", encoding="utf-8")
    else:
        path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_real_samples_load():
    data = require_shared_data("eval")
    gsm = load_suite("gsm8k", data)
    assert len(gsm) == 1319 and gsm[0].gold == "18" and gsm[0].query.startswith("Janet")
    svamp = load_suite("SVAMP", data, limit=2)
    assert [e.gold for e in svamp] == ["51", "1"]
    assert svamp[0].query == (
        "Each pack of dvds costs 76 dollars. If there is a discount of 25 dollars on each pack "
        "How much do you have to pay to buy each pack?"
    )
    aqua = load_suite("aqua", data, limit=1)
    assert aqua[0].gold == "A" and aqua[0].options is not None and aqua[0].options["A"] == "5(√3 + 1)"
    assert aqua[0].query.endswith("Answer Choices: (A) 5(√3 + 1) (B) 6(√3 + √2) (C) 7(√3 – 1) (D) 8(√3 – 2) (E) None of these")


def test_aqua_is_json_lines_despite_its_name():
    records = read_json_records(require_shared_data("eval", "AQuA.json"))
    assert len(records) == 254 and {"question", "options", "rationale", "correct"} <= set(records[0])


def test_nested_mammoth_layout_is_found(tmp_path):
    _write(tmp_path / "gsm8k" / "gsm8k.jsonl", [{"question": "q", "answer": "work\n#### 1,234"}], jsonl=True)
    assert resolve_suite_path("gsm8k", tmp_path) == tmp_path / "gsm8k" / "gsm8k.jsonl"
    assert load_suite("gsm8k", tmp_path)[0].gold == "1234"


@pytest.mark.parametrize("suite", ["numglue", "simuleq", "deepmind"])
def test_question_answer_layouts(tmp_path, suite):
    _write(
        tmp_path / suite / f"{suite}.json",
        [
            {"question": "How many?", "answer": 12.0},
            {"question": "Which is heavier? Option A or B", "answer": "B"},
            {"question": "Solve the system", "answer": [3, 4.5]},
            {"question": "Differentiate x^2", "answer": "2*x"},
        ],
    )
    examples = load_suite(suite, tmp_path)
    assert [(e.gold, e.answer_type) for e in examples] == [
        ("12", "number"),
        ("B", "option"),
        ("3, 4.5", "number_set"),
        ("2*x", "expression"),
    ]
    assert examples[1].option_letters == "AB"


def test_sat_options_read_from_question(tmp_path):
    q = "If 2x = 8, what is x? Answer Choices: (A) 2 (B) 4 (C) 6 (D) 8"
    _write(tmp_path / "sat" / "sat.json", [{"question": q, "answer": "B"}])
    (ex,) = load_suite("sat", tmp_path)
    assert ex.answer_type == "option" and ex.gold == "B"
    assert ex.options == {"A": "2", "B": "4", "C": "6", "D": "8"} and ex.option_letters == "ABCD"


def test_mmlu_math_index_answer(tmp_path):
    _write(
        tmp_path / "mmlu" / "mathematics.json",
        [{"question": "2+2?", "choices": ["3", "4", "5", "6"], "answer": 1, "subject": "elementary_mathematics"}],
    )
    (ex,) = load_suite("mmlu-math", tmp_path)
    assert ex.gold == "B" and ex.option_letters == "ABCD"
    assert ex.query == "2+2?\nAnswer Choices: (A) 3 (B) 4 (C) 5 (D) 6"
    assert ex.meta == {"subject": "elementary_mathematics"}


def test_math_hendrycks_folder_and_mammoth_file(tmp_path):
    sol = "We get $x = \\boxed{\\frac{1}{2}}$."
    record = {"problem": "Solve 2x=1.", "level": "Level 1", "type": "Algebra", "solution": sol}
    _write(tmp_path / "MATH" / "test" / "algebra" / "1.json", record)
    (ex,) = load_suite("math", tmp_path)
    assert ex.gold == "\\frac{1}{2}" and ex.answer_type == "expression" and ex.meta["level"] == "Level 1"
    other = tmp_path / "other"
    _write(other / "math" / "MATH.json", [{"question": "Solve 2x=1.", "answer": "\\frac{1}{2}"}])
    assert load_suite("math", other)[0].gold == "\\frac{1}{2}"


def test_missing_field_names_file_record_and_field(tmp_path):
    path = _write(tmp_path / "SVAMP.json", [{"Body": "b", "Question": "q", "Answer": 1}, {"Body": "b", "Answer": 2}])
    with pytest.raises(ValueError, match=r"SVAMP\.json: record 1 is missing field\(s\) \['Question'\]"):
        load_suite("svamp", tmp_path)
    assert path.exists()


def test_gsm8k_without_final_line_is_rejected(tmp_path):
    _write(tmp_path / "gsm8k.jsonl", [{"question": "q", "answer": "no final line"}], jsonl=True)
    with pytest.raises(ValueError, match="####"):
        load_suite("gsm8k", tmp_path)


def test_missing_suite_file_lists_what_was_tried(tmp_path):
    with pytest.raises(FileNotFoundError, match="numglue/numglue.json"):
        load_suite("numglue", tmp_path)


def test_unknown_suite_and_bad_limit(tmp_path):
    with pytest.raises(ValueError, match="unknown suite 'gsm9k'"):
        load_suite("gsm9k", tmp_path)
    with pytest.raises(ValueError, match="`limit` must be a positive integer"):
        load_suite("gsm8k", tmp_path, limit=0)


def test_bad_json_lines_names_the_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n{oops\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_json_records(path)


def test_suite_table_matches_the_paper():
    assert [s.display for s in SUITES.values()] == [
        "GSM8K", "MATH", "NumGLUE", "SVAMP", "DeepMind", "SimulEq", "AQuA", "SAT", "MMLU-Math",
    ]
