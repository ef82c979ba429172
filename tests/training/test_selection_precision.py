"""The selection step scores in the run's precision context and in chunks of the run's microbatch (issue 12.1, 12.2)."""

from __future__ import annotations

import contextlib

import pytest
from composer.loggers import InMemoryLogger

import composer_algos.data_selection.algorithm as selection_algorithm
import train
from pipeline.config import load_config
from tests.common.paths import REPO_ROOT
from tests.training.conftest import tiny_overrides

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"


def test_trainer_scores_inside_the_runs_precision_context_in_microbatch_chunks(
    dolma_shards, tmp_path, monkeypatch
):
    calls: list[tuple] = []
    active = {"depth": 0}
    real = selection_algorithm.get_precision_context

    @contextlib.contextmanager
    def recording(precision, precision_config=None):
        calls.append((precision, precision_config))
        active["depth"] += 1
        try:
            with real(precision, precision_config):
                yield
        finally:
            active["depth"] -= 1

    monkeypatch.setattr(selection_algorithm, "get_precision_context", recording)
    cfg = load_config(
        TINY,
        tiny_overrides(
            dolma_shards,
            tmp_path,
            "loggers.in_memory={}",
            "eval_loader=null",
            "device_train_microbatch_size=2",
        ),
    )
    trainer = train.build_trainer(cfg)
    algo = selection_algorithm.find_data_selection(trainer.state)
    assert algo is not None
    in_context: list[bool] = []
    trainer.state.model.model.lm_head.register_forward_hook(lambda *_: in_context.append(active["depth"] > 0))
    trainer.fit()

    state = trainer.state
    # Every scoring forward entered the run's own context; the training forwards are Composer's.
    assert calls and {c for c in calls} == {(state.precision, state.precision_config)}
    rows = algo.extractor.chunk_size_in_use
    # Pool of 12 and validation batch of 2 per step, in chunks of the microbatch 2: 7 forwards a step.
    assert rows == 2 and len(calls) == 3 * 7, (rows, len(calls))
    assert in_context.count(True) == len(calls)
    mem = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
    assert [float(v) for _, v in mem.data["selection/score_chunk_size"]] == [2.0, 2.0, 2.0]
    trainer.close()


@pytest.mark.parametrize(
    ("microbatch", "kappa", "expected"), [(2, 4, 2), (8, 4, 4), (None, 4, 4), (2.5, 4, 2)]
)
def test_auto_chunk_is_the_microbatch_capped_at_the_examples_trained(microbatch, kappa, expected):
    class State:
        device_train_microbatch_size = microbatch

    algo = selection_algorithm.DataSelection(domain_names=["a"])
    algo.kappa = kappa
    assert algo._auto_chunk_size(State()) == expected
