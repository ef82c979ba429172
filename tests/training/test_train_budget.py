"""The training-time budget callback: stops on train wall time (evaluation excluded) and evaluates at the stop."""

from __future__ import annotations

import csv
import datetime
import json
from types import SimpleNamespace

import train
from composer_algos.train_budget import TrainTimeBudget
from pipeline.config import load_config
from tests.common.paths import REPO_ROOT
from tests.training.conftest import tiny_overrides

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"


def _eval_steps(run_dir):
    with open(run_dir / "eval_history.csv", newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


def test_budget_counts_composer_train_time_only():
    cb = TrainTimeBudget(budget_seconds=2.0)
    stopped = []
    state = SimpleNamespace(
        timestamp=SimpleNamespace(total_wct=datetime.timedelta(seconds=1.5), batch=SimpleNamespace(value=3)),
        stop_training=lambda: stopped.append(True),
        evaluators=[],
    )
    cb.batch_end(state, None)  # type: ignore[arg-type]
    assert not stopped and cb.stop_step is None
    state.timestamp.total_wct = datetime.timedelta(seconds=2.5)
    state.timestamp.batch.value = 4
    cb.batch_end(state, None)  # type: ignore[arg-type]
    assert stopped == [True] and cb.stop_step == 4


def test_budget_stops_run_and_evaluates_at_the_stopping_step(dolma_shards, tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(
        TINY,
        tiny_overrides(
            dolma_shards,
            run_dir,
            "algorithms.data_selection.strategy=random",
            "max_duration=50ba",
            "eval_interval=50ba",
            "save_interval=50ba",
            "callbacks.train_budget.budget_seconds=0.0",
        ),
    )
    trainer = train.build_trainer(cfg)
    trainer.fit()
    trainer.close()
    # A zero budget is spent by the first batch: one step, and its evaluation happened before
    # eval_results.json was written.
    assert int(trainer.state.timestamp.batch.value) == 1
    assert _eval_steps(run_dir) and set(_eval_steps(run_dir)) == {1}
    results = json.loads((run_dir / "eval_results.json").read_text())
    assert results["steps"] == 1 and results["val_cross_entropy"]
    budget = json.loads((run_dir / "train_budget.json").read_text())
    assert budget["budget_seconds"] == 0.0 and budget["stopped_by_budget"] is True and budget["steps"] == 1
    assert budget["train_time_s"] > 0


def test_final_eval_precedes_results_when_steps_are_not_a_multiple_of_the_interval(dolma_shards, tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(
        TINY,
        tiny_overrides(
            dolma_shards,
            run_dir,
            "algorithms.data_selection.strategy=random",
            "max_duration=3ba",
            "eval_interval=2ba",
            "callbacks.train_budget.budget_seconds=null",
        ),
    )
    trainer = train.build_trainer(cfg)
    trainer.fit()
    trainer.close()
    steps = _eval_steps(run_dir)
    assert sorted(set(steps)) == [2, 3] and steps.count(3) == steps.count(2)  # no duplicate final eval
    results = json.loads((run_dir / "eval_results.json").read_text())
    with open(run_dir / "eval_history.csv", newline="") as f:
        last = {r["domain"]: float(r["cross_entropy"]) for r in csv.DictReader(f) if int(r["step"]) == 3}
    assert results["val_cross_entropy"] == last
