"""The training-time budget callback: stops on train wall time (evaluation excluded) and evaluates at the stop."""

from __future__ import annotations

import csv
import datetime
import json
from types import SimpleNamespace

import train
from composer_algos.callbacks.train_budget import TrainTimeBudget
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


def test_budget_json_records_step_cost_and_the_counts_a_flop_estimate_needs(dolma_shards, tmp_path):
    """3 steps of kappa 4 from pools of 12 (oversampling 3), rows padded to 64 tokens; timing after 1 step."""
    run_dir = tmp_path / "run"
    cfg = load_config(
        TINY,
        tiny_overrides(
            dolma_shards,
            run_dir,
            "algorithms.data_selection.strategy=random",
            "callbacks.train_budget.budget_seconds=null",
            "callbacks.train_budget.warmup_steps=1",
        ),
    )
    trainer = train.build_trainer(cfg)
    trainer.fit()
    trainer.close()
    budget = json.loads((run_dir / "train_budget.json").read_text())
    assert budget["steps"] == 3 and budget["warmup_steps"] == 1 and budget["world_size"] == 1
    assert (budget["pool_samples"], budget["pool_tokens"]) == (36, 36 * 64)
    assert (budget["trained_samples"], budget["trained_tokens"]) == (12, 12 * 64)
    assert 0 < budget["warmup_time_s"] < budget["train_time_s"]
    assert budget["step_time_s"] == (budget["train_time_s"] - budget["warmup_time_s"]) / 2
    assert 0 < budget["warmup_cpu_s"] < budget["train_cpu_s"]
    assert budget["step_cpu_s"] == (budget["train_cpu_s"] - budget["warmup_cpu_s"]) / 2
    assert budget["model"] == {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 4096,
        "head_dim": 8,
    }


def test_step_time_is_null_until_the_warmup_steps_are_past():
    cb = TrainTimeBudget(warmup_steps=5)
    assert cb.step_time_s(steps=5, train_time_s=3.0) is None
    cb.warmup_time_s = 1.0
    assert cb.step_time_s(steps=9, train_time_s=3.0) == 0.5
    assert TrainTimeBudget(warmup_steps=0).step_time_s(steps=4, train_time_s=2.0) == 0.5


def test_bad_warmup_steps_are_rejected_naming_the_field():
    import pytest

    with pytest.raises(ValueError, match="callbacks.train_budget.warmup_steps"):
        TrainTimeBudget(warmup_steps=-1)


def test_cpu_time_counts_training_and_leaves_evaluation_out(monkeypatch):
    """Process CPU 0 at fit start, 1 at step 1's end, an evaluation until 5, 6 at step 2's end: 2 s trained."""
    import composer_algos.callbacks.train_budget as tb

    clock = iter([0.0, 1.0, 5.0, 6.0])
    monkeypatch.setattr(tb.time, "process_time", lambda: next(clock))
    cb = TrainTimeBudget(warmup_steps=1)
    state = SimpleNamespace(
        timestamp=SimpleNamespace(total_wct=datetime.timedelta(seconds=0.5), batch=SimpleNamespace(value=1)),
        evaluators=[],
    )
    cb.fit_start(state, None)  # type: ignore[arg-type]
    cb.batch_end(state, None)  # type: ignore[arg-type]
    cb.eval_end(state, None)  # type: ignore[arg-type]
    state.timestamp.batch.value = 2
    cb.batch_end(state, None)  # type: ignore[arg-type]
    assert (cb.train_cpu_s, cb.warmup_cpu_s) == (2.0, 1.0)


def test_cpu_time_of_a_step_ends_at_after_train_batch_not_at_callbacks_before_it(monkeypatch):
    """answer_accuracy generates at the last step's BATCH_END before this callback runs: not training time.

    Process CPU 0 at fit start, 1 at step 1's AFTER_TRAIN_BATCH, then 40 s of another callback's
    BATCH_END work (the clock reads 41 at this callback's BATCH_END): step 1 took 1 CPU s.
    """
    import composer_algos.callbacks.train_budget as tb

    clock = {"now": 0.0}
    monkeypatch.setattr(tb.time, "process_time", lambda: clock["now"])
    cb = TrainTimeBudget(warmup_steps=0)
    state = SimpleNamespace(
        timestamp=SimpleNamespace(total_wct=datetime.timedelta(seconds=1.0), batch=SimpleNamespace(value=1)),
        evaluators=[],
    )
    cb.fit_start(state, None)  # type: ignore[arg-type]
    clock["now"] = 1.0
    cb.after_train_batch(state, None)  # type: ignore[arg-type]
    clock["now"] = 41.0  # the callbacks listed before this one ran their BATCH_END
    cb.batch_end(state, None)  # type: ignore[arg-type]
    assert cb.train_cpu_s == 1.0 and cb.step_cpu_times_s == [1.0]


def test_a_callback_working_at_the_last_batch_end_is_not_counted_as_training_cpu(dolma_shards, tmp_path):
    """A callback ahead of train_budget burning 4 CPU s at the last step's BATCH_END (as answer_accuracy
    generates there) leaves every recorded step far below it, and the file says where a step's CPU time ends.
    (A tiny step takes 0.4-1.1 CPU s on the 2-core machine, depending on its load.)"""
    import time as _time

    from composer.core import Callback

    class BurnAtLastStep(Callback):
        def batch_end(self, state, logger):
            if int(state.timestamp.batch.value) == 3:
                t0 = _time.process_time()
                while _time.process_time() - t0 < 4.0:
                    pass

    run_dir = tmp_path / "run"
    cfg = load_config(TINY, tiny_overrides(dolma_shards, run_dir, "algorithms.data_selection.strategy=random",
                                           "callbacks.train_budget.budget_seconds=null"))
    trainer = train.build_trainer(cfg)
    trainer.state.callbacks.insert(0, BurnAtLastStep())
    trainer.fit()
    trainer.close()
    budget = json.loads((run_dir / "train_budget.json").read_text())
    assert budget["cpu_step_end"] == "after_train_batch"
    assert len(budget["step_cpu_times_s"]) == 2 and max(budget["step_cpu_times_s"]) < 2.5, budget["step_cpu_times_s"]
    assert abs(budget["train_cpu_s"] - budget["warmup_cpu_s"] - sum(budget["step_cpu_times_s"])) < 1e-6
