"""tools/studies/loader_mixture.py: the epoch's first samples against the corpus's domain shares, per Streaming shuffle."""

from __future__ import annotations

import loader_mixture as lm
import numpy as np
import pytest
from omegaconf import OmegaConf

from pipeline.config import DatasetConfig
from pipeline.dataset import DomainStreamingDataset
from tests.common.paths import REPO_ROOT

# A corpus shaped like dm_math's training split: one shard per domain, shares from 2.4% to 24%.
DM_MATH_LIKE = np.array([2400, 3000, 600, 1500, 900, 2400, 1200, 300])


@pytest.mark.parametrize("algo", ["py1e", "py1br"])
def test_the_order_is_the_loaders(math_shards, algo):
    names, sizes, domain_of = lm.shard_sizes(math_shards)
    assert len(names) >= 3 and sizes.sum() > 50
    dataset = DomainStreamingDataset(shard_dir=str(math_shards), split="train", shuffle=True, shuffle_seed=17,
                                     shuffle_algo=algo, batch_size=1, num_canonical_nodes=1)
    seen = [(s["sample_id"], s["domain_id"]) for s in dataset]
    want = lm.epoch_order(sizes, algo, 17)
    assert [i for i, _ in seen] == want[: len(seen)].tolist()
    assert [d for _, d in seen] == np.repeat(domain_of, sizes)[want[: len(seen)]].tolist()


def test_py1e_starts_the_epoch_near_equal_shares_and_the_dm_math_recipe_does_not():
    domain_of = np.arange(len(DM_MATH_LIKE))
    iid = lm.iid_tv(DM_MATH_LIKE, domain_of, 320)
    # The yaml as written, not validated: validation wants its model file, which lives in ../shared.
    recipe = OmegaConf.load(REPO_ROOT / "yamls" / "smollm2-135m_dm_math.yaml")
    algo, seed = recipe.train_loader.dataset.shuffle_algo, int(recipe.train_loader.dataset.shuffle_seed)
    seeds = range(seed, seed + 20)
    assert lm.prefix_tv(DM_MATH_LIKE, domain_of, algo, seeds, 320) <= 1.3 * iid
    # Why the recipe is not on Streaming's default: py1e's first pools lean towards equal shares.
    assert lm.prefix_tv(DM_MATH_LIKE, domain_of, "py1e", seeds, 320) >= 2.5 * iid
    first = np.repeat(domain_of, DM_MATH_LIKE)[lm.epoch_order(DM_MATH_LIKE, "py1e", seed)[:320]]
    assert np.mean(first == 7) > 2 * DM_MATH_LIKE[7] / DM_MATH_LIKE.sum()  # the smallest domain over-drawn


def test_the_command_prints_a_row_per_shuffle_and_the_independent_draws(math_shards, capsys):
    assert lm.main([str(math_shards), "--samples", "8", "16", "--seeds", "1-3", "--algos", "py1e,naive"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "shuffle" not in line]
    assert [r.split(" | ")[0] for r in rows] == ["| py1e", "| naive", "| independent draws"]
    assert all(len(r.split("|")) == 5 for r in rows)  # two prefix lengths


def test_bad_arguments_name_what_is_allowed(math_shards, tmp_path, capsys):
    with pytest.raises(SystemExit):
        lm.main([str(math_shards), "--algos", "py1b"])
    assert "unknown ['py1b']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lm.main([str(tmp_path)])
    assert "no manifest.json" in capsys.readouterr().err


def test_an_unknown_shuffle_algo_is_a_configuration_error(tmp_path):
    errs = DatasetConfig(shard_dir=str(tmp_path), shuffle_algo="py1b").validate("train_loader")
    assert any("train_loader.dataset.shuffle_algo" in e and "'py1b'" in e and "py1br" in e for e in errs)
    assert DatasetConfig(shard_dir=str(tmp_path), shuffle_algo="py1br").validate("train_loader") == []
