"""Math-suite evaluation: prompt, generate, extract, check, and report per-suite accuracy."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.evaluation.answers import extract_answer, is_equivalent
from pipeline.evaluation.generate import METAMATH_PROMPT, chat_prompt_ids, format_prompt, generate_greedy
from pipeline.evaluation.math_suites import SUITES, MathExample, load_suite
from pipeline.prompts import CHAT, render_prompt

__all__ = [
    "MATH_PROMPT_TEMPLATES",
    "MathEvalResult",
    "SuiteResult",
    "build_math_prompts",
    "evaluate_math",
    "format_math_table",
    "render_math_prompt",
    "score_completions",
    "write_math_results",
]

log = logging.getLogger(__name__)

#: Named math prompts (placeholder ``{query}``); other names go to `pipeline.prompts`.
MATH_PROMPT_TEMPLATES = {"metamath": METAMATH_PROMPT}


@dataclass
class SuiteResult:
    """Accuracy on one suite.

    Args:
        suite: Suite key.
        display: The paper's name for it.
        n: Problems evaluated.
        correct: Problems judged correct.
        no_answer: Completions from which no answer could be extracted.
    """

    suite: str
    display: str
    n: int
    correct: int
    no_answer: int

    @property
    def accuracy(self) -> float:
        """Fraction correct (0 for an empty suite)."""
        return self.correct / self.n if self.n else 0.0


@dataclass
class MathEvalResult:
    """Per-suite results and every prediction."""

    suites: list[SuiteResult]
    predictions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def average(self) -> float:
        """Unweighted mean accuracy over suites (the paper's "Avg" column)."""
        return sum(s.accuracy for s in self.suites) / len(self.suites) if self.suites else 0.0


def render_math_prompt(template: str, query: str) -> str:
    """Build the prompt of one problem.

    Args:
        template: ``"metamath"`` (MetaMath's evaluation prompt, the default of the CLI), a string
            with a ``{query}`` placeholder, or anything `pipeline.prompts.render_prompt` accepts (a
            training template name such as ``"alpaca"``, or a string with ``{instruction}``), so the
            evaluation prompt can match the fine-tuning prompt exactly. For ``"chat"`` this is the
            user message only: `build_math_prompts` puts it in the tokenizer's chat template.
        query: The problem text (options included).

    Returns:
        The prompt.

    Raises:
        ValueError: If the template is neither of these.
    """
    if template in MATH_PROMPT_TEMPLATES:
        return MATH_PROMPT_TEMPLATES[template].format(query=query)
    if "{query}" in template:
        return format_prompt(template, {"query": query})
    return render_prompt(template, query)


def build_math_prompts(tokenizer, template: str, queries: Sequence[str]) -> list[str] | list[list[int]]:
    """The prompts of problems, as `evaluate_math` gives them to the model.

    Args:
        tokenizer: The evaluated model's tokenizer.
        template: See `render_math_prompt`. ``"chat"`` gives token ids: the problem as the user
            turn of the tokenizer's chat template, exactly the prompt of a fine-tuning example
            sharded with ``--prompt-template chat`` (`pipeline.evaluation.generate.chat_prompt_ids`).
        queries: The problem texts.

    Returns:
        One prompt per problem: text, or token ids for ``"chat"``.

    Raises:
        ValueError: If the template is invalid, or is ``"chat"`` and the tokenizer has no chat template.
    """
    messages = [render_math_prompt(template, q) for q in queries]
    return chat_prompt_ids(tokenizer, messages) if template == CHAT else messages


def score_completions(
    examples: Sequence[MathExample], completions: Sequence[str]
) -> tuple[SuiteResult, list[dict[str, Any]]]:
    """Extract and check the answer of each completion.

    Args:
        examples: Problems of one suite.
        completions: Generated solutions, one per problem.

    Returns:
        ``(suite result, prediction records)``; a record holds the suite, index, query, gold,
        answer type, completion, extracted answer, correctness and the problem's metadata.

    Raises:
        ValueError: If the lengths differ or the examples span several suites.
    """
    if len(examples) != len(completions):
        raise ValueError(f"got {len(completions)} completions for {len(examples)} examples")
    suites = {ex.suite for ex in examples}
    if len(suites) > 1:
        raise ValueError(f"examples must come from one suite, got {sorted(suites)}")
    records = []
    correct = no_answer = 0
    for ex, completion in zip(examples, completions):
        pred = extract_answer(completion, ex.answer_type, ex.option_letters or "ABCDE", ex.options)
        ok = is_equivalent(pred, ex.gold, ex.answer_type)
        correct += ok
        no_answer += pred is None
        records.append(
            {
                "suite": ex.suite,
                "index": ex.index,
                "query": ex.query,
                "gold": ex.gold,
                "answer_type": ex.answer_type,
                "completion": completion,
                "prediction": pred,
                "correct": ok,
                **({"meta": ex.meta} if ex.meta else {}),
            }
        )
    key = next(iter(suites)) if suites else ""
    display = SUITES[key].display if key in SUITES else key
    return SuiteResult(key, display, len(examples), correct, no_answer), records


def evaluate_math(
    model: torch.nn.Module,
    tokenizer,
    suites: Sequence[str],
    data_dir: str | Path,
    *,
    limit: int | None = None,
    batch_size: int = 8,
    max_new_tokens: int = 512,
    prompt_template: str = "metamath",
    show_progress: bool = True,
) -> MathEvalResult:
    """Greedy-decode every problem of every suite and score it.

    Args:
        model: Causal LM on its device.
        tokenizer: Its tokenizer.
        suites: Suite keys (see ``SUITES``), evaluated in this order.
        data_dir: Folder of suite files.
        limit: First ``limit`` problems of each suite (default: all).
        batch_size: Prompts per generate call (default 8).
        max_new_tokens: Generation budget (default 512).
        prompt_template: A name or template string, see `render_math_prompt` (default
            ``"metamath"``).
        show_progress: tqdm bars (default True).

    Returns:
        The per-suite results and all predictions.

    Raises:
        ValueError: For an unknown suite, a template without usable placeholders, or ``"chat"`` with
            a tokenizer that has no chat template.
        FileNotFoundError: If a suite file is missing.
    """
    # Load everything first so a missing file fails before hours of generation.
    loaded = [load_suite(name, data_dir, limit) for name in suites]
    results, predictions = [], []
    for examples in loaded:
        if not examples:
            continue
        prompts = build_math_prompts(tokenizer, prompt_template, [ex.query for ex in examples])
        completions = generate_greedy(
            model,
            tokenizer,
            prompts,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            show_progress=show_progress,
            desc=examples[0].suite,
        )
        result, records = score_completions(examples, completions)
        log.info("%s: %d/%d correct (%.4f)", result.display, result.correct, result.n, result.accuracy)
        results.append(result)
        predictions += records
    return MathEvalResult(results, predictions)


def format_math_table(result: MathEvalResult) -> str:
    """A plain-text table: suite, n, correct, no answer, accuracy, plus the unweighted average."""
    rows = [("suite", "n", "correct", "no_answer", "accuracy")]
    rows += [(s.display, str(s.n), str(s.correct), str(s.no_answer), f"{s.accuracy:.4f}") for s in result.suites]
    rows.append(("Avg", str(sum(s.n for s in result.suites)), "", "", f"{result.average:.4f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_math_results(
    result: MathEvalResult,
    out_json: str | Path,
    predictions_jsonl: str | Path | None = None,
    run_info: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write the summary JSON and the per-example predictions (JSON Lines).

    Args:
        result: What `evaluate_math` returned.
        out_json: Summary path: ``{"suites": {key: {display, n, correct, no_answer, accuracy}},
            "average": ..., "run": run_info, "predictions": <jsonl path>}``.
        predictions_jsonl: Predictions path (default: ``<out_json stem>.predictions.jsonl`` beside it).
        run_info: Settings to record (model, template, max_new_tokens, ...).

    Returns:
        ``(summary path, predictions path)``.
    """
    out = Path(out_json)
    preds = Path(predictions_jsonl) if predictions_jsonl else out.with_name(f"{out.stem}.predictions.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    preds.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "suites": {s.suite: {**asdict(s), "accuracy": s.accuracy} for s in result.suites},
        "average": result.average,
        "run": run_info or {},
        "predictions": str(preds),
    }
    out.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    with open(preds, "w", encoding="utf-8") as f:
        for rec in result.predictions:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return out, preds
