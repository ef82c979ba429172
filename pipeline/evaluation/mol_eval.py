"""Mol-Instructions evaluation by generation: read task files, prompt, decode, and score per task."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.evaluation.generate import chat_prompt_ids, generate_greedy
from pipeline.evaluation.math_suites import read_json_records
from pipeline.evaluation.mol_metrics import evaluate_predictions
from pipeline.prompts import CHAT, render_prompt

__all__ = [
    "MolExample",
    "build_mol_prompts",
    "evaluate_mol_generation",
    "format_mol_table",
    "load_mol_instructions",
    "write_mol_results",
]

log = logging.getLogger(__name__)

_LAYOUT = "a JSON array of {instruction, input, output, metadata: {task, split}} (Mol-Instructions)"


@dataclass
class MolExample:
    """One Mol-Instructions record.

    Args:
        task: ``metadata.task`` (the file name when absent).
        index: Position in its file.
        instruction: The instruction.
        input: The input (may be empty).
        reference: The gold ``output``.
    """

    task: str
    index: int
    instruction: str
    input: str
    reference: str


def load_mol_instructions(
    paths: Sequence[str | Path], *, split: str | None = "test", limit_per_task: int | None = None
) -> list[MolExample]:
    """Read Mol-Instructions task files.

    Args:
        paths: JSON files, or folders whose ``*.json`` files are read.
        split: Keep records whose ``metadata.split`` equals this (default ``"test"``); ``None``
            keeps all. A file whose records carry no split at all is kept whole, with a warning.
        limit_per_task: Keep the first N records of each task (default: all).

    Returns:
        The examples, grouped by file.

    Raises:
        ValueError: If a record lacks ``instruction``/``output``, or ``limit_per_task`` < 1.
        FileNotFoundError: If a path does not exist.
    """
    if limit_per_task is not None and limit_per_task < 1:
        raise ValueError(f"`limit_per_task` must be a positive integer or None, got {limit_per_task}")
    files: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"Mol-Instructions path {p} does not exist")
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    out: list[MolExample] = []
    counts: dict[str, int] = defaultdict(int)
    for f in files:
        records = read_json_records(f)
        has_split = any(isinstance(r.get("metadata"), dict) and "split" in r["metadata"] for r in records)
        if split is not None and not has_split:
            log.warning("%s: records carry no metadata.split; using all %d records", f, len(records))
        for i, rec in enumerate(records):
            missing = [k for k in ("instruction", "output") if k not in rec]
            if missing:
                raise ValueError(f"{f}: record {i} is missing field(s) {missing}; expected {_LAYOUT}")
            meta = rec.get("metadata") if isinstance(rec.get("metadata"), dict) else {}
            if split is not None and has_split and meta.get("split") != split:
                continue
            task = str(meta.get("task") or f.stem)
            if limit_per_task is not None and counts[task] >= limit_per_task:
                continue
            counts[task] += 1
            out.append(MolExample(task, i, str(rec["instruction"]), str(rec.get("input") or ""), str(rec["output"])))
    return out


def build_mol_prompts(tokenizer, template: str, examples: Sequence[MolExample]) -> list[str] | list[list[int]]:
    """The prompts of examples, as `evaluate_mol_generation` gives them to the model.

    Args:
        tokenizer: The evaluated model's tokenizer.
        template: A `pipeline.prompts` template name or string. ``"chat"`` gives token ids: the
            instruction (and input) as the user turn of the tokenizer's chat template, exactly the
            prompt of a fine-tuning example sharded with ``--prompt-template chat``
            (`pipeline.evaluation.generate.chat_prompt_ids`).
        examples: From `load_mol_instructions`.

    Returns:
        One prompt per example: text, or token ids for ``"chat"``.

    Raises:
        ValueError: If the template is invalid, or is ``"chat"`` and the tokenizer has no chat template.
    """
    messages = [render_prompt(template, ex.instruction, ex.input) for ex in examples]
    return chat_prompt_ids(tokenizer, messages) if template == CHAT else messages


def evaluate_mol_generation(
    model: torch.nn.Module,
    tokenizer,
    examples: Sequence[MolExample],
    *,
    batch_size: int = 8,
    max_new_tokens: int = 256,
    prompt_template: str = "alpaca",
    drop_invalid: bool = True,
    show_progress: bool = True,
) -> tuple[dict[str, dict[str, float]], list[dict[str, Any]]]:
    """Greedy-decode every example and score each task with the molecule metrics.

    Args:
        model: Causal LM on its device.
        tokenizer: Its tokenizer.
        examples: From `load_mol_instructions`.
        batch_size: Prompts per generate call (default 8).
        max_new_tokens: Generation budget (default 256).
        prompt_template: A `pipeline.prompts` template name or string (default ``"alpaca"``, the
            fine-tuning prompt; Mol-Instructions also uses Alpaca's prompt); see `build_mol_prompts`.
        drop_invalid: Mol-Instructions' protocol of scoring valid molecules only (default True).
        show_progress: tqdm bar.

    Returns:
        ``(metrics per task plus "average", prediction records {task, index, prediction, reference})``.
    """
    prompts = build_mol_prompts(tokenizer, prompt_template, examples)
    completions = generate_greedy(
        model,
        tokenizer,
        prompts,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        show_progress=show_progress,
        desc="mol",
    )
    records = [
        {"task": ex.task, "index": ex.index, "prediction": c.strip(), "reference": ex.reference}
        for ex, c in zip(examples, completions)
    ]
    return evaluate_predictions(records, drop_invalid=drop_invalid), records


def format_mol_table(metrics: dict[str, dict[str, float]]) -> str:
    """A plain-text table with one row per task and the metrics as columns (``-`` where absent)."""
    columns = [
        "n",
        "validity",
        "bleu",
        "levenshtein",
        "levenshtein_selfies",
        "exact_match",
        "maccs",
        "rdk",
        "morgan",
    ]
    present = [c for c in columns if any(c in m for m in metrics.values())]
    rows = [["task", *present]]
    for task, m in metrics.items():
        rows.append([task, *(_fmt(m.get(c)) for c in present)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_mol_results(
    metrics: dict[str, dict[str, float]],
    out_json: str | Path,
    records: Sequence[dict[str, Any]] | None = None,
    run_info: dict[str, Any] | None = None,
) -> Path:
    """Write ``{"tasks": metrics, "run": run_info}`` and, when given, the predictions beside it."""
    out = Path(out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"tasks": metrics, "run": run_info or {}}
    if records is not None:
        preds = out.with_name(f"{out.stem}.predictions.jsonl")
        with open(preds, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        summary["predictions"] = str(preds)
    # NaN (no valid pair) is written as null so the file stays strict JSON.
    out.write_text(json.dumps(_nan_to_none(summary), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):  # a count (n, n_scored)
        return str(value)
    if value != value:  # NaN
        return "nan"
    return f"{value:.4f}"


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_to_none(v) for v in obj]
    return obj
