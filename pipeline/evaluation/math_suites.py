"""Readers for the math evaluation suites in MAmmoTH's ``math_eval/dataset`` layout (GSM8K ... MATH)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.evaluation.answers import extract_boxed, infer_answer_type, normalize_number

__all__ = [
    "SUITES",
    "MathExample",
    "SuiteSpec",
    "load_suite",
    "read_json_records",
    "resolve_suite_path",
]

log = logging.getLogger(__name__)


@dataclass
class MathExample:
    """One evaluation problem.

    Args:
        suite: Suite key (``"gsm8k"``, ...).
        index: Position in the suite file.
        query: The problem as it is put into the prompt template (options included).
        gold: The gold answer as a string (``number_set``: numbers joined by ``", "``).
        answer_type: How the answer is compared (see ``pipeline.evaluation.answers.ANSWER_TYPES``).
        option_letters: The offered option letters (``""`` for open-ended problems).
        options: Letter -> option text, when the problem has options.
        meta: Extra fields kept with the prediction (MATH ``level``/``type``, ...).
    """

    suite: str
    index: int
    query: str
    gold: str
    answer_type: str
    option_letters: str = ""
    options: dict[str, str] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SuiteSpec:
    """Where a suite lives and how its records become `MathExample`s.

    Args:
        key: Command-line name.
        display: Name used in tables (the paper's spelling).
        candidates: Paths tried under ``--data-dir``, flat layout first, then MAmmoTH's nested one.
        parse: ``(records, path) -> examples``.
        layout: The record layout assumed, for docs and error messages.
    """

    key: str
    display: str
    candidates: tuple[str, ...]
    parse: Callable[[list[dict[str, Any]], Path], list[MathExample]]
    layout: str


def load_suite(name: str, data_dir: str | Path, limit: int | None = None) -> list[MathExample]:
    """Read one suite from a folder of suite files.

    Args:
        name: A key of `SUITES` (case-insensitive; ``mmlu-math`` and ``mmlu_mathematics`` also work).
        data_dir: Folder holding the suite files (flat, like ``/work/shared/data/eval``, or
            MAmmoTH's ``dataset/<suite>/<file>`` layout).
        limit: Keep only the first ``limit`` problems (default: all).

    Returns:
        The problems in file order.

    Raises:
        ValueError: For an unknown suite, a bad ``limit``, or a record missing a field.
        FileNotFoundError: If no file for the suite exists under ``data_dir``.
    """
    spec = _spec(name)
    if limit is not None and limit < 1:
        raise ValueError(f"`limit` must be a positive integer or None, got {limit}")
    path = resolve_suite_path(spec.key, data_dir)
    records = read_json_records(path)
    if limit is not None:
        records = records[:limit]
    examples = spec.parse(records, path)
    log.info("loaded %d %s problems from %s", len(examples), spec.display, path)
    return examples


def resolve_suite_path(name: str, data_dir: str | Path) -> Path:
    """Find a suite's file (or, for MATH, a folder of per-problem files) under ``data_dir``.

    Args:
        name: A key of `SUITES`.
        data_dir: The folder to search.

    Returns:
        The first existing candidate path.

    Raises:
        FileNotFoundError: Listing every path that was tried.
    """
    spec = _spec(name)
    root = Path(data_dir)
    for rel in spec.candidates:
        if (root / rel).exists():
            return root / rel
    tried = ", ".join(str(root / rel) for rel in spec.candidates)
    raise FileNotFoundError(
        f"no {spec.display} file under --data-dir {root}; looked for: {tried}. "
        f"Expected layout: {spec.layout}"
    )


def read_json_records(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSON array, JSON Lines (whatever the extension), or a folder of one-record JSON files.

    Args:
        path: A ``.json``/``.jsonl`` file, or a folder searched recursively for ``*.json``
            (Hendrycks' MATH ships one problem per file).

    Returns:
        The records, in file order (folders: sorted path order).

    Raises:
        ValueError: If the content is neither a JSON array nor JSON Lines of objects.
    """
    path = Path(path)
    if path.is_dir():
        return [_read_object(p) for p in sorted(path.rglob("*.json"))]
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, list):
        records = data
    elif isinstance(data, dict):
        records = [data]
    else:
        records = []
        # Split on "\n" only: questions may contain U+2028 and other separators.
        for lineno, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}: line {lineno} is not JSON ({err.msg}); expected a JSON array or JSON Lines"
                ) from err
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ValueError(f"{path}: record {i} is a {type(rec).__name__}, expected a JSON object")
    return records


def _read_object(path: Path) -> dict[str, Any]:
    """One JSON object from a file."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _require(rec: dict[str, Any], fields: Sequence[str], path: Path, i: int, layout: str) -> None:
    """Raise naming the file, the record and the missing fields."""
    missing = [f for f in fields if f not in rec]
    if missing:
        raise ValueError(
            f"{path}: record {i} is missing field(s) {missing} (it has {sorted(rec)}); expected {layout}"
        )


_OPTION_RE = re.compile(r"^\s*\(?([A-Z])\s*\)\s*(.*)$", re.DOTALL)
_CHOICES_IN_TEXT_RE = re.compile(r"\(([A-E])\)\s*(.*?)(?=\s*\([A-E]\)|$)", re.DOTALL)


def _format_options(options: dict[str, str]) -> str:
    """MAmmoTH's option line: ``Answer Choices: (A) x (B) y``."""
    return "Answer Choices: " + " ".join(f"({k}) {v}" for k, v in options.items())


def _number_string(value: Any) -> str:
    """A gold number as text without a trailing ``.0`` (``51.0`` -> ``"51"``)."""
    num = normalize_number(str(value))
    if num is None:
        return str(value).strip()
    return str(int(num)) if num.is_integer() else repr(num)


_GSM8K_LAYOUT = "JSON Lines with `question` and `answer` (a worked solution ending in `#### <number>`)"
_SVAMP_LAYOUT = "a JSON array with `Body`, `Question`, `Answer` (number)"
_AQUA_LAYOUT = "JSON Lines with `question`, `options` ([\"A)...\", ...]), `correct` (a letter)"
_QA_LAYOUT = "a JSON array (or JSON Lines) with `question` and `answer`"
_SAT_LAYOUT = (
    "a JSON array with `question` (ending in 'Answer Choices: (A) ... (D) ...') and `answer` (a letter)"
)
_MMLU_LAYOUT = "a JSON array with `question`, `choices` (list of 4) and `answer` (index 0-3 or a letter)"
_MATH_LAYOUT = (
    "Hendrycks' MATH records with `problem` and `solution` (answer in \\boxed{}), optionally `level`/`type`, "
    "as one JSON array, JSON Lines or a folder of per-problem .json files; or MAmmoTH's MATH.json "
    "with `question` and `answer`"
)


def _parse_gsm8k(records: list[dict[str, Any]], path: Path) -> list[MathExample]:
    out = []
    for i, rec in enumerate(records):
        _require(rec, ("question", "answer"), path, i, _GSM8K_LAYOUT)
        if "####" not in rec["answer"]:
            raise ValueError(f"{path}: record {i} field `answer` has no '#### <number>' final line")
        gold = _number_string(rec["answer"].split("####")[-1].strip().replace(",", ""))
        out.append(MathExample("gsm8k", i, rec["question"].strip(), gold, "number"))
    return out


def _parse_svamp(records: list[dict[str, Any]], path: Path) -> list[MathExample]:
    out = []
    for i, rec in enumerate(records):
        _require(rec, ("Body", "Question", "Answer"), path, i, _SVAMP_LAYOUT)
        query = f"{str(rec['Body']).strip()} {str(rec['Question']).strip()}"
        meta = {k: rec[k] for k in ("ID", "Type", "Equation") if k in rec}
        out.append(MathExample("svamp", i, query, _number_string(rec["Answer"]), "number", meta=meta))
    return out


def _parse_aqua(records: list[dict[str, Any]], path: Path) -> list[MathExample]:
    out = []
    for i, rec in enumerate(records):
        _require(rec, ("question", "options", "correct"), path, i, _AQUA_LAYOUT)
        options: dict[str, str] = {}
        for opt in rec["options"]:
            m = _OPTION_RE.match(str(opt))
            if m is None:
                raise ValueError(f"{path}: record {i} option {opt!r} is not of the form 'A)text'")
            options[m.group(1)] = m.group(2).strip()
        query = f"{rec['question'].strip()}\n{_format_options(options)}"
        letters = "".join(options)
        out.append(
            MathExample("aqua", i, query, str(rec["correct"]).strip(), "option", letters, options)
        )
    return out


def _parse_qa(suite: str) -> Callable[[list[dict[str, Any]], Path], list[MathExample]]:
    """NumGLUE / SimulEq / DeepMind: `question` + `answer`; the comparison follows the gold value."""

    def parse(records: list[dict[str, Any]], path: Path) -> list[MathExample]:
        out = []
        for i, rec in enumerate(records):
            _require(rec, ("question", "answer"), path, i, _QA_LAYOUT)
            gold_raw = rec["answer"]
            kind = infer_answer_type(gold_raw)
            if kind == "number_set":
                gold = ", ".join(_number_string(v) for v in gold_raw)
            elif kind == "number":
                gold = _number_string(gold_raw)
            else:
                gold = str(gold_raw).strip()
            # NumGLUE's comparison tasks answer "A"/"B"; restricting the letters keeps the
            # fallback from reading an article "A ..." as option C-E.
            letters = ("AB" if gold in "AB" else "ABCDE") if kind == "option" else ""
            out.append(MathExample(suite, i, str(rec["question"]).strip(), gold, kind, letters))
        return out

    return parse


def _parse_sat(records: list[dict[str, Any]], path: Path) -> list[MathExample]:
    out = []
    for i, rec in enumerate(records):
        _require(rec, ("question", "answer"), path, i, _SAT_LAYOUT)
        question = str(rec["question"]).strip()
        if "options" in rec:
            options = {}
            for opt in rec["options"]:
                m = _OPTION_RE.match(str(opt))
                if m is None:
                    raise ValueError(f"{path}: record {i} option {opt!r} is not of the form '(A) text'")
                options[m.group(1)] = m.group(2).strip()
            question = f"{question}\n{_format_options(options)}"
        else:
            tail = question.split("Answer Choices:")[-1] if "Answer Choices:" in question else ""
            options = {m.group(1): m.group(2).strip() for m in _CHOICES_IN_TEXT_RE.finditer(tail)}
        gold = str(rec["answer"]).strip().strip("()")
        letters = "".join(options) or "ABCDE"
        out.append(MathExample("sat", i, question, gold, "option", letters, options or None))
    return out


def _parse_mmlu(records: list[dict[str, Any]], path: Path) -> list[MathExample]:
    out = []
    for i, rec in enumerate(records):
        _require(rec, ("question", "choices", "answer"), path, i, _MMLU_LAYOUT)
        choices = list(rec["choices"])
        letters = "ABCDEFGHIJ"[: len(choices)]
        options = dict(zip(letters, (str(c).strip() for c in choices)))
        answer = rec["answer"]
        if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices):
            gold = letters[answer]
        elif isinstance(answer, str) and answer.strip().upper() in letters and answer.strip():
            gold = answer.strip().upper()
        else:
            raise ValueError(
                f"{path}: record {i} field `answer` is {answer!r}; expected an index 0-{len(choices) - 1} "
                f"or one of the letters {letters}"
            )
        query = f"{str(rec['question']).strip()}\n{_format_options(options)}"
        meta = {"subject": rec["subject"]} if "subject" in rec else {}
        out.append(MathExample("mmlu_math", i, query, gold, "option", letters, options, meta))
    return out


def _parse_math(records: list[dict[str, Any]], path: Path) -> list[MathExample]:
    out = []
    for i, rec in enumerate(records):
        if "problem" in rec or "solution" in rec:
            _require(rec, ("problem", "solution"), path, i, _MATH_LAYOUT)
            gold = extract_boxed(rec["solution"])
            if gold is None:
                raise ValueError(f"{path}: record {i} field `solution` has no \\boxed{{...}} answer")
            query = rec["problem"]
        else:
            _require(rec, ("question", "answer"), path, i, _MATH_LAYOUT)
            query, gold = rec["question"], str(rec["answer"])
        meta = {k: rec[k] for k in ("level", "type", "unique_id") if k in rec}
        out.append(MathExample("math", i, str(query).strip(), gold.strip(), "expression", meta=meta))
    return out


#: The suites in the order of the paper's tables, keyed by their command-line names.
SUITES: dict[str, SuiteSpec] = {
    spec.key: spec
    for spec in (
        SuiteSpec(
            "gsm8k", "GSM8K", ("gsm8k.jsonl", "gsm8k/gsm8k.jsonl", "gsm8k/test.jsonl"), _parse_gsm8k, _GSM8K_LAYOUT
        ),
        SuiteSpec(
            "math",
            "MATH",
            ("MATH.json", "math.json", "math/MATH.json", "MATH/test", "math/test", "MATH"),
            _parse_math,
            _MATH_LAYOUT,
        ),
        SuiteSpec("numglue", "NumGLUE", ("numglue.json", "numglue/numglue.json"), _parse_qa("numglue"), _QA_LAYOUT),
        SuiteSpec("svamp", "SVAMP", ("SVAMP.json", "svamp.json", "SVAMP/SVAMP.json"), _parse_svamp, _SVAMP_LAYOUT),
        SuiteSpec("deepmind", "DeepMind", ("deepmind.json", "deepmind/deepmind.json"), _parse_qa("deepmind"), _QA_LAYOUT),
        SuiteSpec("simuleq", "SimulEq", ("simuleq.json", "simuleq/simuleq.json"), _parse_qa("simuleq"), _QA_LAYOUT),
        SuiteSpec("aqua", "AQuA", ("AQuA.json", "aqua.json", "AQuA/AQuA.json"), _parse_aqua, _AQUA_LAYOUT),
        SuiteSpec("sat", "SAT", ("sat.json", "sat/sat.json"), _parse_sat, _SAT_LAYOUT),
        SuiteSpec(
            "mmlu_math",
            "MMLU-Math",
            ("mmlu_mathematics.json", "mmlu/mathematics.json", "mmlu_math.json"),
            _parse_mmlu,
            _MMLU_LAYOUT,
        ),
    )
}

_ALIASES = {"mmlu-math": "mmlu_math", "mmlu_mathematics": "mmlu_math", "mmlu": "mmlu_math"}


def _spec(name: str) -> SuiteSpec:
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in SUITES:
        raise ValueError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}")
    return SUITES[key]
