"""Evaluation the paper's way: math-suite accuracy by generation, molecule metrics, gradient-conflict curves."""

import importlib
from typing import Any

# Names resolve on first use (PEP 562), so that importing a light submodule such as
# math_suites (tools/evaluate.py --help) does not load torch and transformers via checkpoint.
_HOMES = {
    "extract_answer": "answers",
    "is_equivalent": "answers",
    "normalize_number": "answers",
    "load_model_and_tokenizer": "checkpoint",
    "load_conflict_curves": "conflicts",
    "summarize_conflicts": "conflicts",
    "METAMATH_PROMPT": "generate",
    "generate_greedy": "generate",
    "evaluate_math": "math_eval",
    "format_math_table": "math_eval",
    "write_math_results": "math_eval",
    "SUITES": "math_suites",
    "MathExample": "math_suites",
    "load_suite": "math_suites",
    "evaluate_mol_generation": "mol_eval",
    "load_mol_instructions": "mol_eval",
    "evaluate_predictions": "mol_metrics",
    "molecule_metrics": "mol_metrics",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = [
    "METAMATH_PROMPT",
    "SUITES",
    "MathExample",
    "evaluate_math",
    "evaluate_mol_generation",
    "evaluate_predictions",
    "extract_answer",
    "format_math_table",
    "generate_greedy",
    "is_equivalent",
    "load_conflict_curves",
    "load_model_and_tokenizer",
    "load_mol_instructions",
    "load_suite",
    "molecule_metrics",
    "normalize_number",
    "summarize_conflicts",
    "write_math_results",
]
