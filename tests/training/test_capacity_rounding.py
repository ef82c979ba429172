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


def _capacity_calls(shards, run_dir, monkeypatch, *overrides):
    """Train the tiny config with random_stratified; return each step's compute_capacities arguments."""
    calls = []
    original = selection.compute_capacities

    def spy(pool_counts, kappa, fractions=None, generator=None):
        calls.append((pool_counts, fractions, generator))
        return original(pool_counts, kappa, fractions, generator=generator)

    monkeypatch.setattr(selection, "compute_capacities", spy)
    cfg = load_config(
        TINY, tiny_overrides(shards, run_dir, "algorithms.data_selection.strategy=random_stratified", *overrides)
    )
    train.build_trainer(cfg).fit()
    return calls


@pytest.mark.parametrize("scope", ["local", "global"])
def test_training_path_passes_a_generator_to_the_capacities(dolma_shards, tmp_path, monkeypatch, scope):
    calls = _capacity_calls(dolma_shards, tmp_path / "run", monkeypatch, f"algorithms.data_selection.scope={scope}")
    generators = [g for _, _, g in calls]
    assert len(generators) == 3, generators
    assert all(isinstance(g, torch.Generator) for g in generators), generators


def test_uniform_capacity_fractions_give_every_domain_the_same_share(dolma_shards, tmp_path, monkeypatch):
    calls = _capacity_calls(
        dolma_shards, tmp_path / "run", monkeypatch, "algorithms.data_selection.capacity_fractions=uniform"
    )
    assert calls
    for pool_counts, fractions, _ in calls:
        num_domains = len(pool_counts)
        assert num_domains > 1 and fractions == pytest.approx([1 / num_domains] * num_domains)


def test_unknown_capacity_fractions_word_is_rejected_with_the_allowed_values(dolma_shards, tmp_path):
    overrides = tiny_overrides(
        dolma_shards, tmp_path / "run", "algorithms.data_selection.capacity_fractions=equal"
    )
    with pytest.raises(ValueError, match="(?s)capacity_fractions.*'equal'.*uniform"):
        train.build_trainer(load_config(TINY, overrides))


@pytest.mark.parametrize("strategy", ["greats", "gradnorm", "colm", "random", "none"])
@pytest.mark.parametrize("fractions", ["uniform", {"a": 2.0, "b": 1.0}])
def test_capacity_fractions_with_a_strategy_that_ignores_them_is_rejected_at_construction(strategy, fractions):
    from composer_algos.data_selection.algorithm import DataSelection

    with pytest.raises(ValueError, match="capacity_fractions") as info:
        DataSelection(strategy=strategy, oversampling=2, capacity_fractions=fractions)
    msg = str(info.value)
    assert repr(strategy) in msg
    for honours in ("partitionsel", "id", "iwd", "random_stratified"):
        assert honours in msg, msg


@pytest.mark.parametrize("strategy", ["partitionsel", "id", "iwd", "random_stratified"])
def test_capacity_fractions_are_accepted_by_the_strategies_that_use_capacities(strategy):
    from composer_algos.data_selection.algorithm import DataSelection

    DataSelection(strategy=strategy, capacity_fractions="uniform")


def test_capacity_fractions_with_greats_is_reported_when_the_yaml_is_loaded():
    from composer_algos.registry import load_run_config
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="(?s)capacity_fractions.*'greats'"):
        load_run_config(
            TINY, ["algorithms.data_selection.strategy=greats", "algorithms.data_selection.capacity_fractions=uniform"]
        )
