"""A callback that measures exact-match accuracy of greedy answers on held-out questions at the end of training.

yaml: `callbacks.answer_accuracy: {per_domain: 10, max_new_tokens: 16}`. See
`pipeline.evaluation.heldout_answers` for the questions and the scoring.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from composer_algos.models.frozen_prefix import evaluation_forwards
from pipeline.evaluation.heldout_answers import answer_accuracy, heldout_questions

log = logging.getLogger(__name__)

__all__ = ["AnswerAccuracy"]


class AnswerAccuracy(Callback):
    """Exact-match accuracy of greedy answers to held-out questions, per domain, at the last step.

    The questions are the first `per_domain` examples of each per-domain evaluator's held-out
    dataset (`eval_loader` with `per_domain: true` on fine-tuning shards): the examples the
    validation loss is measured on, none of which ever guided a selection. At the last step (the
    step `TrainTimeBudget` evaluates at too) each rank answers its share of them greedily, the
    counts are summed over ranks and `accuracy/<domain>` and `accuracy/average` (the unweighted
    mean over domains) are logged; `EvalHistory` writes them into `eval_results.json`
    (`answer_accuracy`, `answer_accuracy_mean`). With `at_start: true` they are also measured before
    the first step (`accuracy_start/...`), the base model's floor.

    Args:
        per_domain: held-out questions per domain (default 10).
        max_new_tokens: greedy tokens per answer (default 16: "The answer is: X" and a margin).
        batch_size: prompts per generate call (default 16).
        at_start: also measure before training.

    Raises:
        ValueError: a setting out of range (at construction), or at the first measurement no
            per-domain evaluator on fine-tuning shards, or a model sharded by FSDP.
    """

    def __init__(self, *, per_domain: int = 10, max_new_tokens: int = 16, batch_size: int = 16, at_start: bool = False) -> None:
        for name, value in (("per_domain", per_domain), ("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"callbacks.answer_accuracy.{name} must be an integer >= 1, got {value!r}")
        self.per_domain, self.max_new_tokens, self.batch_size = per_domain, max_new_tokens, batch_size
        self.at_start = bool(at_start)
        self._done_at: int | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        if self.at_start and int(state.timestamp.batch.value) == 0:
            self._measure(state, logger, prefix="accuracy_start")

    def batch_end(self, state: State, logger: Logger) -> None:
        elapsed = state.get_elapsed_duration()
        step = int(state.timestamp.batch.value)
        if elapsed is not None and float(elapsed) >= 1.0 and self._done_at != step:
            self._done_at = step
            self._measure(state, logger, prefix="accuracy")

    def _measure(self, state: State, logger: Logger, *, prefix: str) -> None:
        t0 = time.perf_counter()
        model = getattr(state.model, "model", state.model)  # the HF (or peft) model under Composer's wrapper
        if state.fsdp_enabled:
            raise ValueError("callbacks.answer_accuracy does not generate with an FSDP-sharded model; drop fsdp_config or the callback")
        tokenizer = getattr(state.model, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("callbacks.answer_accuracy needs the model's tokenizer (a HuggingFaceModel with one)")
        questions = heldout_questions(self._datasets(state), tokenizer, per_domain=self.per_domain)
        rank, world = dist.get_global_rank(), dist.get_world_size()
        mine = questions[rank::world]
        with evaluation_forwards():  # generate's prefill may use the frozen-prefix cache (model.eval_prefix_cache)
            result = answer_accuracy(model, tokenizer, mine, max_new_tokens=self.max_new_tokens, batch_size=self.batch_size)
        domains = sorted({q.domain for q in questions})
        right = torch.tensor([sum(r["correct"] for r in result["records"] if r["domain"] == d) for d in domains], dtype=torch.float64)
        total = torch.tensor([sum(r["domain"] == d for r in result["records"]) for d in domains], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(right)
            dist.all_reduce(total)
        per_domain = {d: float(r / n) for d, r, n in zip(domains, right.tolist(), total.tolist()) if n > 0}
        metrics = {f"{prefix}/{d}": v for d, v in per_domain.items()}
        metrics[f"{prefix}/average"] = sum(per_domain.values()) / len(per_domain)
        logger.log_metrics(metrics)
        log.info(
            "answer accuracy at step %d (%d questions, %.0f s): average %.3f; %s",
            int(state.timestamp.batch.value), len(questions), time.perf_counter() - t0, metrics[f"{prefix}/average"],
            ", ".join(f"{d} {v:.2f}" for d, v in per_domain.items()),
        )

    @staticmethod
    def _datasets(state: State) -> list[tuple[str, Any]]:
        """(domain, held-out dataset) of each per-domain evaluator (`val/<domain>`)."""
        out = []
        for evaluator in state.evaluators:
            label = evaluator.label
            loader = getattr(evaluator.dataloader, "dataloader", evaluator.dataloader)
            if label.startswith("val/") and label != "val/all":
                out.append((label[len("val/") :], loader.dataset))
        if not out:
            raise ValueError(
                "callbacks.answer_accuracy reads the per-domain evaluators' held-out questions: give an eval_loader with "
                "per_domain: true"
            )
        return out
