"""A run resumed from a mid-epoch checkpoint reproduces the uninterrupted run's selections and losses."""

from __future__ import annotations

import pytest
from composer.loggers import InMemoryLogger

from tests.training.conftest import full_and_resumed


def _series(trainer, key):
    mem = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
    return {int(ts.batch.value): float(v) for ts, v in mem.data[key]}


WINDOW = [
    "algorithms.data_selection.features.score_window=8",
    "algorithms.data_selection.features.score_window_position=random",
]


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [("partitionsel", []), ("random", []), ("partitionsel", WINDOW)],
    ids=["partitionsel", "random", "partitionsel-random-window"],
)
def test_mid_epoch_resume_matches_uninterrupted_run(strategy, extra, dolma_shards, tmp_path):
    # With random scoring windows the draw must come back on resume (it depends on seed and step only).
    common = ["loggers.in_memory={}", f"algorithms.data_selection.strategy={strategy}", "eval_loader=null", *extra]
    full, resumed = full_and_resumed(dolma_shards, tmp_path, *common)
    assert resumed.state.timestamp.batch.value == 6

    loss_full, loss_res = _series(full, "loss/train/total"), _series(resumed, "loss/train/total")
    # Logged at the step being trained: batches 3, 4, 5 (0-based) after the checkpoint at 3.
    resumed_steps = sorted(loss_res)
    assert resumed_steps == [3, 4, 5]
    for step in resumed_steps:
        assert loss_res[step] == loss_full[step], (step, loss_res[step], loss_full[step])
    if extra:  # the windows were in force (tokens scored per row, logged every step)
        assert set(_series(full, "selection/score_seq_len").values()) == {8.0}
    if strategy == "partitionsel":
        h_full, h_res = _series(full, "selection/selected_hash"), _series(resumed, "selection/selected_hash")
        assert all(h_res[s] == h_full[s] for s in resumed_steps)
    mix_full = _series(full, "data/mixture_mean/wiki")
    mix_res = _series(resumed, "data/mixture_mean/wiki")
    assert mix_res[5] == pytest.approx(mix_full[5])
