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


def test_uniform_capacity_fractions_give_every_domain_the_same_share(dolma_shards, tmp_path, monkeypatch):
    seen = []
    original = selection.compute_capacities

    def spy(pool_counts, kappa, fractions=None, generator=None):
        seen.append((len(pool_counts), fractions))
        return original(pool_counts, kappa, fractions, generator=generator)

    monkeypatch.setattr(selection, "compute_capacities", spy)
    overrides = tiny_overrides(
        dolma_shards,
        tmp_path / "run",
        "algorithms.data_selection.strategy=random_stratified",
        "algorithms.data_selection.capacity_fractions=uniform",
    )
    train.build_trainer(load_config(TINY, overrides)).fit()
    assert seen
    for num_domains, fractions in seen:
        assert num_domains > 1 and fractions == pytest.approx([1 / num_domains] * num_domains)


def test_unknown_capacity_fractions_word_is_rejected_with_the_allowed_values(dolma_shards, tmp_path):
    overrides = tiny_overrides(
        dolma_shards, tmp_path / "run", "algorithms.data_selection.capacity_fractions=equal"
    )
    with pytest.raises(ValueError, match="(?s)capacity_fractions.*'equal'.*uniform"):
        train.build_trainer(load_config(TINY, overrides))
