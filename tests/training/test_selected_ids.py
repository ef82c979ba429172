"""Per-step logging of the pool's and the selection's sample ids (MixtureMonitor log_selected_ids)."""

from __future__ import annotations

import csv
import json

import train
from composer_algos.analysis.experiment_stats import read_selected_ids, selection_overlap
from pipeline.config import load_config
from pipeline.dataset import DomainStreamingDataset
from tests.common.paths import REPO_ROOT
from tests.training.conftest import tiny_overrides

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
STEPS = 3


def _run(shards, run_dir, strategy):
    cfg = load_config(
        TINY,
        tiny_overrides(
            shards,
            run_dir,
            f"algorithms.data_selection.strategy={strategy}",
            f"max_duration={STEPS}ba",
            "eval_interval=100ba",
            "callbacks.mixture_monitor.log_selected_ids=true",
        ),
    )
    trainer = train.build_trainer(cfg)
    trainer.fit()
    trainer.close()
    return read_selected_ids(run_dir / "selected_ids.jsonl")


def test_selected_ids_are_real_samples_of_identical_pools(dolma_shards, tmp_path):
    rand = _run(dolma_shards, tmp_path / "random", "random")
    strat = _run(dolma_shards, tmp_path / "strat", "random_stratified")
    assert sorted(rand) == sorted(strat) == list(range(STEPS))
    dataset = DomainStreamingDataset(shard_dir=str(dolma_shards), split="train", shuffle=False)
    with open(tmp_path / "random" / "mixture_steps.csv", newline="") as f:
        mixture_rows = list(csv.DictReader(f))
    names = dataset.domain_names
    for step, (pool, selected) in rand.items():
        assert len(pool) == 12 and len(set(pool)) == 12  # oversampling 3 x kappa 4
        assert len(selected) == 4 and set(selected) <= set(pool)
        assert all(0 <= i < dataset.num_samples for i in pool)
        # The logged ids are the examples trained on: their domains give the logged mixture.
        domains = [names[dataset[i]["domain_id"]] for i in selected]
        row = next(r for r in mixture_rows if int(r["step"]) == step)
        for name in names:
            assert float(row[name]) == domains.count(name) / 4
    overlap = selection_overlap(strat, rand)
    assert overlap["pools_identical"] is True and overlap["steps"] == STEPS
    assert 0.0 <= overlap["mean_jaccard"] <= 1.0


def test_ids_not_logged_by_default(dolma_shards, tmp_path):
    cfg = load_config(
        TINY,
        tiny_overrides(
            dolma_shards, tmp_path / "run", "algorithms.data_selection.strategy=random", "max_duration=1ba"
        ),
    )
    trainer = train.build_trainer(cfg)
    trainer.fit()
    trainer.close()
    assert not (tmp_path / "run" / "selected_ids.jsonl").exists()
    json.loads((tmp_path / "run" / "mixture.json").read_text())
