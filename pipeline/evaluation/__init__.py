"""Evaluation the paper's way: math-suite accuracy by generation, molecule metrics, gradient-conflict curves."""

from pipeline.evaluation.answers import extract_answer, is_equivalent, normalize_number
from pipeline.evaluation.checkpoint import load_model_and_tokenizer
from pipeline.evaluation.conflicts import load_conflict_curves, plot_conflicts, summarize_conflicts
from pipeline.evaluation.generate import METAMATH_PROMPT, generate_greedy
from pipeline.evaluation.math_eval import evaluate_math, format_math_table, write_math_results
from pipeline.evaluation.math_suites import SUITES, MathExample, load_suite
from pipeline.evaluation.mol_eval import evaluate_mol_generation, load_mol_instructions
from pipeline.evaluation.mol_metrics import evaluate_predictions, molecule_metrics

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
    "plot_conflicts",
    "summarize_conflicts",
    "write_math_results",
]
