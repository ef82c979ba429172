"""A callback that stops training once a wall-clock budget of training time is spent, and evaluates at the stop.

It also records what a run cost: its training time, its steady time per step (the calibration
figure of `tools/run_experiment.py --compute-budget`) and the rows and tokens it trained and drew
(for `composer_algos.analysis.compute_plan.estimate_run_flops`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
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
    `max_duration` stays the step cap and the learning-rate schedule's horizon: a run the budget
    stops before `max_duration` ends wherever its schedule then is (not decayed), and fractions of
    the duration (`t_warmup: 0.03dur`, the selection's `start`/`end`) are fractions of the cap.
    For runs that each end decayed, give each the steps its budget buys as `max_duration`
    (`tools/run_experiment.py --compute-budget`) and no `budget_seconds`.

    Composer evaluates at the end of training only after the `FIT_END` callbacks, so
    `eval_results.json` (written by `EvalHistory` at `FIT_END`) would hold the previous
    evaluation whenever the last step is not a multiple of `eval_interval`. This callback
    therefore also makes every evaluator run at the last step's `BATCH_END` (the budget stop or
    `max_duration`), and skip the then redundant `FIT_END` evaluation.

    On rank 0 it writes `train_budget.json` in `run_dir` at the end of training:
    `budget_seconds`, `train_time_s`, `steps`, `stopped_by_budget`; `warmup_steps`,
    `warmup_time_s` (the training time after the first `warmup_steps` steps) and `step_time_s`
    (the mean training time of a step after them: `(train_time_s - warmup_time_s) / (steps -
    warmup_steps)`; null until a step after them has run); `train_cpu_s`, `warmup_cpu_s` and
    `step_cpu_s`, the same in this process's CPU time (`time.process_time`: every thread of rank
    0, evaluation left out; on a CPU shared with other jobs it varies less with their load than
    the wall clock does; a step's CPU time ends at its `AFTER_TRAIN_BATCH`, as its wall time ends
    before `BATCH_END`, so callbacks that evaluate at the last step's `BATCH_END`, such as
    `answer_accuracy`, are not counted: `cpu_step_end` says so); `step_times_s` and `step_cpu_times_s`, each step's training time after
    the warm-up on both clocks (the samples an equal-compute calibration fits its cost model to,
    `composer_algos.analysis.compute_plan.fit_cost_model`); `pool_samples` and `pool_tokens`
    (Composer's count of the loader's batches over all ranks: with a selection algorithm, the
    pools), `trained_samples` and `trained_tokens` (the rows and padded positions of the batches
    trained, counted on this rank at `BATCH_START`, after the selection, times the world size),
    `world_size`, and `model` (the model's dimensions from its transformers config, for a FLOP
    estimate; null when it has none).

    Args:
        budget_seconds: Training seconds allowed (None: no budget, only the final evaluation).
        run_dir: Output directory (filled in by `train.py`).
        warmup_steps: Steps left out of `step_time_s` (the first steps build lazy state: the
            optimizer's moments, the feature extractor, the loader's first pool).

    Raises:
        ValueError: a negative or non-finite budget, or negative `warmup_steps`.
    """

    def __init__(
        self, *, budget_seconds: float | None = None, run_dir: str = "runs/run", warmup_steps: int = 1
    ) -> None:
        if budget_seconds is not None and not (math.isfinite(float(budget_seconds)) and budget_seconds >= 0):
            raise ValueError(
                f"callbacks.train_budget.budget_seconds must be a finite number >= 0 (or null), got {budget_seconds}"
            )
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"callbacks.train_budget.warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.budget_seconds = None if budget_seconds is None else float(budget_seconds)
        self.run_dir = Path(run_dir)
        self.warmup_steps = warmup_steps
        self.stop_step: int | None = None
        # The clocks at the end of the warm-up steps (0 when there are none).
        self.warmup_time_s: float | None = 0.0 if warmup_steps == 0 else None
        self.train_cpu_s = 0.0
        self.warmup_cpu_s: float | None = 0.0 if warmup_steps == 0 else None
        self._cpu_mark = 0.0
        self._step_cpu_end: float | None = None  # the CPU clock at this step's AFTER_TRAIN_BATCH
        self._wall_mark = 0.0
        # Per-step training time after the warm-up (wall, this process's CPU): the calibration's samples.
        self.step_times_s: list[float] = []
        self.step_cpu_times_s: list[float] = []
        self.trained_samples = 0
        self.trained_tokens = 0

    def fit_start(self, state: State, logger: Logger) -> None:
        for evaluator in state.evaluators:
            if evaluator.eval_interval is not None:
                evaluator.eval_interval = _eval_at_last_step(evaluator.eval_interval)
        self._cpu_mark = time.process_time()

    def eval_end(self, state: State, logger: Logger) -> None:
        self._cpu_mark = time.process_time()  # the evaluation's CPU time is not training's

    def batch_start(self, state: State, logger: Logger) -> None:
        ids = state.batch.get("input_ids") if isinstance(state.batch, Mapping) else None
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:  # shapes only: no device sync
            self.trained_samples += int(ids.shape[0])
            self.trained_tokens += int(ids.numel())

    def after_train_batch(self, state: State, logger: Logger) -> None:
        # The step's CPU time ends here, after the optimizer, as its wall time ends before BATCH_END: the
        # BATCH_END callbacks listed before this one (answer_accuracy generates at the last step) are not training.
        self._step_cpu_end = time.process_time()

    def batch_end(self, state: State, logger: Logger) -> None:
        now, self._step_cpu_end = (time.process_time() if self._step_cpu_end is None else self._step_cpu_end), None
        self.train_cpu_s += now - self._cpu_mark
        wall = state.timestamp.total_wct.total_seconds()
        if int(state.timestamp.batch.value) > self.warmup_steps:
            self.step_times_s.append(wall - self._wall_mark)
            self.step_cpu_times_s.append(now - self._cpu_mark)
        self._cpu_mark, self._wall_mark = now, wall
        if int(state.timestamp.batch.value) == self.warmup_steps:
            self.warmup_time_s = state.timestamp.total_wct.total_seconds()
            self.warmup_cpu_s = self.train_cpu_s
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

    def step_time_s(self, *, steps: int, train_time_s: float, warmup_s: float | None = None) -> float | None:
        """The mean training time of a step after the first `warmup_steps` (None until one has run).

        `warmup_s` is the time at the end of the warm-up steps (default: the wall clock's).
        """
        warmup_s = self.warmup_time_s if warmup_s is None else warmup_s
        if warmup_s is None or steps <= self.warmup_steps:
            return None
        return (train_time_s - warmup_s) / (steps - self.warmup_steps)

    def fit_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        world = dist.get_world_size()
        steps = int(state.timestamp.batch.value)
        train_time_s = state.timestamp.total_wct.total_seconds()
        out = {
            "budget_seconds": self.budget_seconds,
            "train_time_s": train_time_s,
            "steps": steps,
            "stopped_by_budget": self.stop_step is not None,
            "warmup_steps": self.warmup_steps,
            "warmup_time_s": self.warmup_time_s,
            "step_time_s": self.step_time_s(steps=steps, train_time_s=train_time_s),
            "train_cpu_s": self.train_cpu_s,
            "warmup_cpu_s": self.warmup_cpu_s,
            "step_cpu_s": (
                self.step_time_s(steps=steps, train_time_s=self.train_cpu_s, warmup_s=self.warmup_cpu_s)
                if self.warmup_cpu_s is not None
                else None
            ),
            "cpu_step_end": "after_train_batch",  # absent in files written before the last step's callbacks were left out
            "step_times_s": self.step_times_s,
            "step_cpu_times_s": self.step_cpu_times_s,
            "pool_samples": int(state.timestamp.sample.value),
            "pool_tokens": int(state.timestamp.token.value),
            "trained_samples": self.trained_samples * world,
            "trained_tokens": self.trained_tokens * world,
            "world_size": world,
            "model": model_shape(state.model),
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "train_budget.json").write_text(json.dumps(out, indent=2))


def model_shape(model: object) -> dict[str, int] | None:
    """The dimensions a FLOP estimate needs, from the transformers config under a Composer model."""
    from composer_algos.analysis.compute_plan import SHAPE_KEYS

    config = getattr(getattr(model, "model", model), "config", None)
    if config is None:
        return None
    shape = {k: getattr(config, k, None) for k in SHAPE_KEYS}
    if shape["head_dim"] is None and shape["hidden_size"] and shape["num_attention_heads"]:
        shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    if any(not isinstance(v, int) for v in shape.values()):
        return None
    return shape


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
