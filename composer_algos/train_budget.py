"""A callback that stops training once a wall-clock budget of training time is spent, and evaluates at the stop."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import dist

log = logging.getLogger(__name__)

__all__ = ["TrainTimeBudget"]


class TrainTimeBudget(Callback):
    """Stop training at the first step whose cumulative training wall time exceeds a budget.

    Training time is Composer's own account, `state.timestamp.total_wct`: the time from one
    batch end to the next (data loading, selection, forward, backward, optimizer step), with
    evaluation excluded; it is the maximum over ranks, so every rank stops at the same step.
    Comparing strategies at equal budgets then charges each its own selection overhead.
    `max_duration` stays the step cap (and the learning-rate schedule's horizon).

    Composer evaluates at the end of training only after the `FIT_END` callbacks, so
    `eval_results.json` (written by `EvalHistory` at `FIT_END`) would hold the previous
    evaluation whenever the last step is not a multiple of `eval_interval`. This callback
    therefore also makes every evaluator run at the last step's `BATCH_END` (the budget stop or
    `max_duration`), and skip the then redundant `FIT_END` evaluation.

    On rank 0 it writes `train_budget.json` (`budget_seconds`, `train_time_s`, `steps`,
    `stopped_by_budget`) in `run_dir` at the end of training.

    Args:
        budget_seconds: Training seconds allowed (None: no budget, only the final evaluation).
        run_dir: Output directory (filled in by `train.py`).

    Raises:
        ValueError: a negative or non-finite budget.
    """

    def __init__(self, *, budget_seconds: float | None = None, run_dir: str = "runs/run") -> None:
        if budget_seconds is not None and not (math.isfinite(float(budget_seconds)) and budget_seconds >= 0):
            raise ValueError(
                f"callbacks.train_budget.budget_seconds must be a finite number >= 0 (or null), got {budget_seconds}"
            )
        self.budget_seconds = None if budget_seconds is None else float(budget_seconds)
        self.run_dir = Path(run_dir)
        self.stop_step: int | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        for evaluator in state.evaluators:
            if evaluator.eval_interval is not None:
                evaluator.eval_interval = _eval_at_last_step(evaluator.eval_interval)

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.budget_seconds is None or self.stop_step is not None:
            return
        if state.timestamp.total_wct.total_seconds() > self.budget_seconds:
            self.stop_step = int(state.timestamp.batch.value)
            log.info(
                "training-time budget of %.1fs spent at step %d; stopping",
                self.budget_seconds,
                self.stop_step,
            )
            state.stop_training()

    def fit_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        out = {
            "budget_seconds": self.budget_seconds,
            "train_time_s": state.timestamp.total_wct.total_seconds(),
            "steps": int(state.timestamp.batch.value),
            "stopped_by_budget": self.stop_step is not None,
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "train_budget.json").write_text(json.dumps(out, indent=2))


def _eval_at_last_step(inner: Callable[[State, Event], bool]) -> Callable[[State, Event], bool]:
    """Wrap an evaluator's schedule so it also fires at the last step's BATCH_END, and not again at FIT_END."""
    evaluated_at: list[int] = []

    def should_evaluate(state: State, event: Event) -> bool:
        due = inner(state, event)
        batch = int(state.timestamp.batch.value)
        if event == Event.BATCH_END:
            elapsed = state.get_elapsed_duration()
            if due or (elapsed is not None and float(elapsed) >= 1.0):
                evaluated_at[:] = [batch]
                return True
            return False
        if event == Event.FIT_END and evaluated_at == [batch]:
            return False
        return due

    return should_evaluate
