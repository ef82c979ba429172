"""Held-out evaluation: the per-domain evaluators never read a validation example that guided selection."""

from __future__ import annotations

import numpy as np
import pytest

from composer_algos.data_selection.validation_source import ValidationSource
from pipeline.config import ConfigError, load_config
from pipeline.dataset import DomainStreamingDataset
from pipeline.holdout import dataset_guide_mask, guide_mask, heldout_subset
from pipeline.loaders import build_domain_evaluators
from tests.common.paths import REPO_ROOT
from tests.training.conftest import SEQ_LEN, tiny_overrides

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"


def test_guide_mask_sizes_nesting_and_determinism():
    m = guide_mask("wiki", 10, 0.5)
    assert m.sum() == 5 and np.array_equal(m, guide_mask("wiki", 10, 0.5))
    assert not np.array_equal(m, guide_mask("reddit", 10, 0.5))  # domains get their own pattern
    small, big = guide_mask("wiki", 100, 0.3), guide_mask("wiki", 100, 0.7)
    assert small.sum() == 30 and big.sum() == 70 and not (small & ~big).any()  # nested
    assert (
        guide_mask("wiki", 2, 0.01).sum() == 1 and guide_mask("wiki", 2, 0.99).sum() == 1
    )  # both parts kept
    assert guide_mask("wiki", 5, 0.0).sum() == 0 and guide_mask("wiki", 5, 1.0).sum() == 5
    with pytest.raises(ValueError, match="guide_fraction must be in"):
        guide_mask("wiki", 5, 1.5)


def _content(input_ids, attention_mask):
    return tuple(int(t) for t, m in zip(input_ids.tolist(), attention_mask.tolist(), strict=True) if m)


def test_no_guide_draw_is_ever_evaluated(dolma_shards):
    source = ValidationSource(
        shard_dir=str(dolma_shards), batch_size=4, seed=3, pad_token_id=1, max_seq_len=SEQ_LEN
    )
    guide = set()
    for step in range(50):  # many cycles over the guide part
        batch = source.batch_for_step(step)
        guide |= {_content(i, m) for i, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)}
    evaluated = set()
    evaluators = build_domain_evaluators(
        shard_dir=str(dolma_shards), device_batch_size=3, pad_token_id=1, max_seq_len=SEQ_LEN
    )
    for ev in evaluators:
        count = 0
        for batch in ev.dataloader.dataloader:
            evaluated |= {
                _content(i, m) for i, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)
            }
            count += len(batch["input_ids"])
        assert count > 0, ev.label
    whole = DomainStreamingDataset(shard_dir=str(dolma_shards), split="val", shuffle=False)
    everything = {
        _content(s["input_ids"], np.ones(len(s["input_ids"])))
        for s in (whole[i] for i in range(whole.num_samples))
    }
    assert guide and evaluated
    assert not guide & evaluated
    assert guide | evaluated == everything  # the two parts cover the split


def test_eval_guide_fraction_zero_reads_the_whole_split(dolma_shards):
    (ev,) = build_domain_evaluators(
        shard_dir=str(dolma_shards),
        device_batch_size=4,
        pad_token_id=1,
        max_seq_len=SEQ_LEN,
        per_domain=False,
        guide_fraction=0.0,
    )
    whole = DomainStreamingDataset(shard_dir=str(dolma_shards), split="val", shuffle=False)
    assert sum(len(b["input_ids"]) for b in ev.dataloader.dataloader) == whole.num_samples


def test_config_rejects_an_eval_that_reads_guide_samples(dolma_shards, tmp_path):
    overrides = tiny_overrides(
        dolma_shards, tmp_path / "r", "algorithms.data_selection.validation.guide_fraction=0.7"
    )
    with pytest.raises(ConfigError, match="eval_loader.guide_fraction 0.5 is below"):
        load_config(TINY, overrides)
    cfg = load_config(TINY, [*overrides, "eval_loader.guide_fraction=0.7"])
    assert cfg.eval_loader is not None and cfg.eval_loader.guide_fraction == 0.7


@pytest.mark.parametrize("spelling", ["{d}/", "{d}/.", "{d}/../{name}"])
def test_the_same_split_check_compares_resolved_paths(dolma_shards, tmp_path, spelling):
    """`shards/x` and `shards/x/` name one directory: the guide/evaluation check must see it (issue 20.9)."""
    other = spelling.format(d=dolma_shards, name=dolma_shards.name)
    overrides = tiny_overrides(
        dolma_shards,
        tmp_path / "r",
        "algorithms.data_selection.validation.guide_fraction=0.7",
        f"algorithms.data_selection.validation.shard_dir={other}",
    )
    with pytest.raises(ConfigError, match="eval_loader.guide_fraction 0.5 is below"):
        load_config(TINY, overrides)


class _Split:
    """What `dataset_guide_mask` / `heldout_subset` read from a DomainStreamingDataset: per-domain streams."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.domain_names = list(sizes)
        self.stream_domain_ids = list(range(len(sizes)))
        self.samples_per_stream = list(sizes.values())
        self.sample_offset_per_stream = list(np.cumsum([0, *sizes.values()])[:-1])
        self.num_samples = sum(sizes.values())
        self.split = "val"


def test_a_single_example_domain_is_evaluated_and_never_guides(caplog):
    """One validation example cannot be both guide and held out: it is held out (issue 20.10)."""
    assert not guide_mask("solo", 1, 0.5).any() and not guide_mask("solo", 1, 0.99).any()
    assert guide_mask("solo", 1, 1.0).all()  # everything guides when asked to
    with caplog.at_level("WARNING", logger="pipeline.holdout"):
        # The per-domain evaluator of that domain builds (it used to refuse, even in runs selecting nothing).
        only = heldout_subset(_Split({"solo": 1}), 0.5).indices
        mixed = _Split({"wiki": 10, "solo": 1})
        guide = dataset_guide_mask(mixed, 0.5)
    assert only == [0]
    assert guide[:10].sum() == 5 and not guide[10]  # the other domain still splits in half
    assert any("'solo'" in r.getMessage() and "evaluat" in r.getMessage() for r in caplog.records), caplog.text
