"""DataSelection rounds the per-domain capacities with the step's generator (unbiased), not by largest remainder."""

from __future__ import annotations

import pytest
import torch

import composer_algos.selection as selection
import train
from pipeline.config import load_config
from tests.common.paths import REPO_ROOT
from tests.training.conftest import tiny_overrides

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"


@pytest.mark.parametrize("scope", ["local", "global"])
def test_training_path_passes_a_generator_to_the_capacities(dolma_shards, tmp_path, monkeypatch, scope):
    calls = []
    original = selection.compute_capacities

    def spy(pool_counts, kappa, fractions=None, generator=None):
        calls.append(generator)
        return original(pool_counts, kappa, fractions, generator=generator)

    monkeypatch.setattr(selection, "compute_capacities", spy)
    overrides = tiny_overrides(
        dolma_shards,
        tmp_path / "run",
        "algorithms.data_selection.strategy=random_stratified",
        f"algorithms.data_selection.scope={scope}",
    )
    trainer = train.build_trainer(load_config(TINY, overrides))
    trainer.fit()
    assert len(calls) == 3, calls
    assert all(isinstance(g, torch.Generator) for g in calls), calls
