"""Final-answer extraction from generated math solutions and equivalence checking against gold answers."""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Mapping

__all__ = [
    "ANSWER_TYPES",
    "extract_answer",
    "extract_boxed",
    "final_answer_segment",
    "infer_answer_type",
    "is_equivalent",
    "normalize_number",
]

log = logging.getLogger(__name__)

#: How a gold answer is compared: a number (GSM8K, SVAMP, ...), an option letter (AQuA, SAT, MMLU),
#: a LaTeX/free-form expression (MATH, some DeepMind answers), or an unordered set of numbers
#: (a system of equations whose gold answer is a list).
ANSWER_TYPES = ("number", "option", "expression", "number_set")

# A number: optional sign (not when it is the binary minus in "5-3"), digits with optional
# thousands groups, optional decimals, optional "/denominator"; or a bare ".5".
_UINT = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
_NUMBER_RE = re.compile(
    rf"(?:(?<![\w)\]}}])-)?(?:{_UINT}(?:\.\d+)?(?:\s*/\s*{_UINT}(?:\.\d+)?)?|\.\d+)"
)
# MetaMath's answer line: "The answer is: 18" (MAmmoTH-style models write "The answer is 18").
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_ANSWER_IS_RE = re.compile(r"the\s+(?:final\s+)?answer\s+is\s*:?", re.IGNORECASE)
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*(-?[\d.,]+)\s*\}\s*\{\s*(-?[\d.,]+)\s*\}")
_LATEX_NOISE_RE = re.compile(r"\\(?:left|right|!|,|;|:|quad|qquad)|\\text\{[^{}]*\}|\\mbox\{[^{}]*\}")


def final_answer_segment(text: str) -> tuple[str | None, str]:
    """Locate the part of a solution that states the final answer.

    Priority follows MetaMath's evaluation: the text after the last "The answer is" (to the end
    of that line), then the content of the last ``\\boxed{...}``; otherwise none.

    Args:
        text: A generated solution.

    Returns:
        ``(segment, source)`` with source ``"answer_is"``, ``"boxed"`` or ``"none"``
        (segment ``None``).
    """
    matches = list(_ANSWER_IS_RE.finditer(text))
    if matches:
        rest = text[matches[-1].end() :].strip()
        # The answer may itself be boxed and span braces; otherwise it ends at the line break.
        if rest.startswith("\\boxed") or rest.startswith("$\\boxed"):
            boxed = extract_boxed(rest)
            if boxed is not None:
                return boxed, "answer_is"
        return rest.split("\n", 1)[0].strip(), "answer_is"
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    return None, "none"


def extract_boxed(text: str) -> str | None:
    """Return the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces.

    Args:
        text: Text that may contain LaTeX.

    Returns:
        The braced content, ``\\boxed 5`` style content up to the next ``$``/space, or ``None``
        when there is no box (or its braces never close).
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    rest = rest[len("\\boxed") :] if rest.startswith("\\boxed") else rest[len("\\fbox") :]
    if rest.startswith(" ") and not rest.lstrip().startswith("{"):
        token = rest.strip().split("$", 1)[0].split()
        return token[0] if token else None
    rest = rest.lstrip()
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i].strip()
    return None


def normalize_number(text: str) -> float | None:
    """Parse a number the way answers are written: commas, ``$``, ``%``, fractions, ``\\frac``.

    Args:
        text: e.g. ``"1,000"``, ``"$18.00"``, ``"25%"``, ``"3/4"``, ``"\\frac{3}{4}"``, ``"-2.0"``.

    Returns:
        The value as a float (a percentage keeps its number: ``"25%"`` -> 25.0), or ``None``
        when the text is not a single number.
    """
    s = _FRAC_RE.sub(r"\1/\2", text)
    s = _LATEX_NOISE_RE.sub("", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = s.replace("{", "").replace("}", "").replace("\\", "").strip().rstrip(".").strip()
    s = re.sub(r"\s*/\s*", "/", s)
    # A comma is only a thousands separator ("1,000"); "1,2" is a list, not twelve.
    if "," in s:
        if not _THOUSANDS_RE.fullmatch(s):
            return None
        s = s.replace(",", "")
    if not s or any(ch.isspace() for ch in s):
        return None
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            value = float(num) / float(den)
        else:
            value = float(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value if math.isfinite(value) else None


def infer_answer_type(gold: object, option_letters: str = "") -> str:
    """Pick how a gold answer should be compared from its value.

    Args:
        gold: The gold answer as stored in a suite file (str, int, float or list).
        option_letters: Letters the example offers as options (``""`` when it has none).

    Returns:
        One of ``ANSWER_TYPES``.
    """
    if isinstance(gold, (list, tuple)):
        return "number_set"
    if isinstance(gold, (int, float)) and not isinstance(gold, bool):
        return "number"
    text = str(gold).strip()
    if len(text) == 1 and text.upper() in (option_letters or "ABCDE"):
        return "option"
    if normalize_number(text) is not None:
        return "number"
    return "expression"


def extract_answer(
    text: str,
    answer_type: str,
    option_letters: str = "ABCDE",
    options: Mapping[str, str] | None = None,
) -> str | None:
    """Extract the final answer of a generated solution.

    The answer segment is found by `final_answer_segment`; within it (or, when there is none, in
    the whole text) the answer is read according to ``answer_type``:

    - ``number``: the first number of the segment (MetaMath reads the first number after
      "The answer is:"), else the last number of the text. Commas are dropped and ``\\frac{a}{b}``
      becomes ``a/b``.
    - ``option``: a letter such as ``(C)``, ``C)`` or a lone ``C`` in the segment; when the segment
      holds no letter but equals one option's text (or value), that option's letter; without a
      segment, the last parenthesised letter of the text, then the last lone letter.
    - ``expression``: the segment itself (boxed content unwrapped, ``$`` and a final period
      dropped), else the last number of the text.
    - ``number_set``: every number of the segment, sorted, joined by ``", "``.

    Args:
        text: A generated solution.
        answer_type: One of ``ANSWER_TYPES``.
        option_letters: The option letters the example offers (for ``option``).
        options: Optional letter -> option text, used to map a stated value back to its letter.

    Returns:
        The extracted answer string, or ``None`` when nothing answer-like was found.

    Raises:
        ValueError: If ``answer_type`` is not one of ``ANSWER_TYPES``.
    """
    if answer_type not in ANSWER_TYPES:
        raise ValueError(f"`answer_type` must be one of {ANSWER_TYPES}, got {answer_type!r}")
    segment, _ = final_answer_segment(text)
    if answer_type == "option":
        return _extract_option(text, segment, option_letters, options)
    if answer_type == "number_set":
        source = segment if segment is not None else text.strip().rsplit("\n", 1)[-1]
        values = sorted(v for v in (normalize_number(m) for m in _numbers_in(source)) if v is not None)
        return ", ".join(_format_number(v) for v in values) if values else None
    if segment is not None:
        inner = extract_boxed(segment)
        segment = inner if inner is not None else segment
        if answer_type == "number":
            found = _numbers_in(segment)
            if found:
                return found[0]
        else:
            cleaned = _clean_expression(segment)
            if cleaned:
                return cleaned
    found = _numbers_in(text)
    return found[-1] if found else None


def is_equivalent(
    prediction: str | None,
    gold: str,
    answer_type: str,
    rel_tol: float = 1e-6,
) -> bool:
    """Decide whether an extracted answer matches the gold answer.

    Options compare letters. Numbers and expressions are checked with math-verify
    (``parse``/``verify`` on ``\\boxed{}``-wrapped strings, so LaTeX, fractions and percentages are
    understood), then by a numeric comparison with relative tolerance ``rel_tol`` (absolute
    ``1e-9`` near zero), and expressions finally by whitespace/``$``-insensitive string equality.
    The tolerance only absorbs float noise: a looser one (1e-4) would accept 70001 for 70000.

    Args:
        prediction: The extracted answer (``None`` counts as wrong).
        gold: The gold answer as a string (for ``number_set``: numbers joined by commas).
        answer_type: One of ``ANSWER_TYPES``.
        rel_tol: Relative tolerance of the numeric comparison (default 1e-6).

    Returns:
        Whether the prediction is judged correct.

    Raises:
        ValueError: If ``answer_type`` is not one of ``ANSWER_TYPES``.
    """
    if answer_type not in ANSWER_TYPES:
        raise ValueError(f"`answer_type` must be one of {ANSWER_TYPES}, got {answer_type!r}")
    if prediction is None or not prediction.strip():
        return False
    if answer_type == "option":
        return prediction.strip().strip("()").upper() == gold.strip().strip("()").upper()
    if answer_type == "number_set":
        pred_vals = sorted(v for v in (normalize_number(m) for m in _numbers_in(prediction)) if v is not None)
        gold_vals = sorted(v for v in (normalize_number(m) for m in _numbers_in(gold)) if v is not None)
        return len(pred_vals) == len(gold_vals) > 0 and all(
            _close(p, g, rel_tol) for p, g in zip(pred_vals, gold_vals)
        )
    pred_num, gold_num = normalize_number(prediction), normalize_number(gold)
    if pred_num is not None and gold_num is not None:
        if _close(pred_num, gold_num, rel_tol):
            return True
        # Two plain numbers that differ cannot become equal symbolically; only a percentage
        # ("25%" vs 0.25) needs math-verify's reading. Skipping it saves ~1 ms per wrong answer.
        if "%" not in prediction + gold:
            return False
    if _math_verify(prediction, gold):
        return True
    if answer_type == "expression":
        return _canonical_string(prediction) == _canonical_string(gold)
    return False


def _extract_option(
    text: str, segment: str | None, letters: str, options: Mapping[str, str] | None
) -> str | None:
    """Option letter from the answer segment, else from the whole text."""
    letters = letters or "ABCDE"
    cls = f"[{re.escape(letters)}]"
    if segment is not None:
        # "(C)" / "C)" first, then the text of an option ("5C3*4C3" must not read as C), then a
        # letter standing alone.
        for pattern in (rf"\(({cls})\)", rf"(?<![A-Za-z0-9])({cls})\)"):
            hit = re.search(pattern, segment)
            if hit:
                return hit.group(1)
        if options:
            letter = _match_option_text(segment, options)
            if letter is not None:
                return letter
        hit = re.search(rf"(?<![A-Za-z0-9])({cls})(?![A-Za-z0-9])", segment)
        return hit.group(1) if hit else None
    for pattern in (rf"\(({cls})\)", rf"(?<![A-Za-z])({cls})\)", rf"(?<![A-Za-z'])({cls})(?![A-Za-z'])"):
        hits = re.findall(pattern, text)
        if hits:
            return hits[-1]
    return None


def _match_option_text(segment: str, options: Mapping[str, str]) -> str | None:
    """The letter whose option text equals the stated answer (as a value or a string)."""
    stated = _clean_expression(extract_boxed(segment) or segment)
    stated_num = normalize_number(stated)
    for letter, option_text in options.items():
        option_num = normalize_number(option_text)
        if stated_num is not None and option_num is not None:
            if _close(stated_num, option_num, 1e-6):
                return letter
        elif _canonical_string(stated) == _canonical_string(option_text):
            return letter
    return None


def _numbers_in(text: str) -> list[str]:
    """All numbers in order, commas and inner spaces removed (``\\frac{a}{b}`` read as ``a/b``)."""
    text = _FRAC_RE.sub(r"\1/\2", text)
    return [m.group(0).replace(",", "").replace(" ", "") for m in _NUMBER_RE.finditer(text)]


def _clean_expression(text: str) -> str:
    """Strip the wrapping a model puts around a final expression."""
    s = text.strip()
    if s.endswith("."):
        s = s[:-1]
    s = s.strip().strip("$").strip()
    if s.startswith("\\(") and s.endswith("\\)"):
        s = s[2:-2].strip()
    return s


def _canonical_string(text: str) -> str:
    """Case-, space- and ``$``-insensitive form for a last-resort string comparison."""
    s = _LATEX_NOISE_RE.sub("", _clean_expression(text))
    return re.sub(r"\s+", "", s).replace("$", "").lower()


def _format_number(value: float) -> str:
    """Shortest decimal form without a trailing ``.0``."""
    return str(int(value)) if float(value).is_integer() else repr(value)


def _close(a: float, b: float, rel_tol: float) -> bool:
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-9)


def _math_verify(prediction: str, gold: str) -> bool:
    """math-verify equivalence; False when either side does not parse."""
    from math_verify import parse, verify

    # math-verify times out with SIGALRM, which only works on the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)  # type: ignore[arg-type]
        pred_parsed = parse(f"\\boxed{{{prediction}}}", parsing_timeout=timeout)  # type: ignore[arg-type]
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception as err:  # math-verify raises assorted sympy/timeout errors on odd input
        log.debug("math-verify failed on %r vs %r: %s", prediction, gold, err)
        return False
