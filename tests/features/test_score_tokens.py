"""`score_tokens`: the pool scored on each example's first t target tokens, the sequence cut after the last one needed."""

from __future__ import annotations

import pytest
import torch

from composer_algos.features import GradFeatureExtractor
from composer_algos.features.score_tokens import first_target_tokens
from pipeline.config import ConfigError
from tests.common.models import tiny_llama
from tests.common.paths import REPO_ROOT
from tests.features.helpers import make_batch

M = -100


def _extractor(model, **kw):
    return GradFeatureExtractor(model, normalization="none", last_n_blocks=2, proj_dim=40, chunk_size=3, **kw)


def _finetune_batch():
    """Two rows of 10 tokens: prompt-masked labels (fine-tuning layout), the second right-padded."""
    ids = torch.arange(20).view(2, 10) % 128
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 8:] = 0
    labels = ids.clone()
    labels[0, :3] = M  # prompt of row 0: positions 0-2; targets at 3..9 (7)
    labels[1, :5] = M  # prompt of row 1: positions 0-4; targets at 5, 6, 7; padding 8, 9
    labels[1, 8:] = M
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "domain_id": torch.tensor([0, 1])}


def test_cut_of_a_fine_tuning_batch_by_hand():
    batch = _finetune_batch()
    out = first_target_tokens(batch, 2)
    # Row 0 keeps targets 3, 4; row 1 keeps 5, 6; the furthest needed position is 6, so 7 positions remain.
    assert out["input_ids"].shape == (2, 7)
    assert out["labels"][0].tolist() == [M, M, M, 3, 4, M, M]
    assert out["labels"][1].tolist() == [M, M, M, M, M, 15, 16]
    assert torch.equal(out["input_ids"], batch["input_ids"][:, :7])
    assert torch.equal(out["attention_mask"], batch["attention_mask"][:, :7])
    assert torch.equal(out["domain_id"], batch["domain_id"])  # per-example fields pass through
    assert batch["labels"][0, 5] == 5  # the caller's tensors are not written
    # Row 1 has 3 targets: t = 3 keeps them all and cuts after position 7, row 0 after 5.
    assert first_target_tokens(batch, 3)["input_ids"].shape == (2, 8)


def test_cut_of_a_pretraining_batch_by_hand():
    ids = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[2, 2:] = 0  # one real target (position 1)
    labels = ids.masked_fill(mask == 0, M)  # labels = inputs: position 0 is labelled but never predicted
    out = first_target_tokens({"input_ids": ids, "attention_mask": mask, "labels": labels}, 3)
    # Targets are positions 1, 2, 3 of full rows: cut after position 3.
    assert out["input_ids"].shape == (3, 4)
    assert torch.equal(out["labels"][:2], ids[:2, :4])
    assert out["labels"][2].tolist() == [int(ids[2, 0]), int(ids[2, 1]), M, M]
    # Without labels the default (inputs, padding ignored) is cut the same way.
    out2 = first_target_tokens({"input_ids": ids, "attention_mask": mask}, 3)
    assert torch.equal(out2["labels"], out["labels"]) and torch.equal(out2["input_ids"], out["input_ids"])


@pytest.mark.parametrize("t", [None, 16, 17, 1000])
def test_at_least_the_sequence_length_leaves_batch_and_features_untouched(t):
    batch = make_batch(n=5, T=16, seed=1, pad_rows=2)
    assert first_target_tokens(batch, t) is batch
    model = tiny_llama(seed=0)
    G_full, g_full = _extractor(model).compute(batch, make_batch(n=2, seed=3))
    G_t, g_t = _extractor(model, score_tokens=t).compute(batch, make_batch(n=2, seed=3))
    assert torch.equal(G_t, G_full) and torch.equal(g_t, g_full)


def test_few_tokens_change_the_pool_features_but_not_the_validation_feature():
    model = tiny_llama(seed=0)
    pool, val = make_batch(n=5, T=16, seed=1, prompt_len=4), make_batch(n=2, T=16, seed=3, prompt_len=4)
    G_full, g_full = _extractor(model).compute(pool, val)
    ex = _extractor(model, score_tokens=3)
    G_t, g_t = ex.compute(pool, val)
    # Labels 0-3 are the prompt: every row has 12 targets (positions 4..15); t = 3 keeps 4, 5, 6.
    assert ex.score_length_in_use == 7
    assert not torch.allclose(G_t, G_full, atol=1e-3)
    assert torch.equal(g_t, g_full)  # the validation batch is the target and is scored in full


def _mask_after_first_targets_by_hand(batch: dict, t: int) -> dict:
    """Reference: walk each row's labels and ignore every target after the t-th (no cut)."""
    labels = batch["labels"].clone()
    for i in range(labels.shape[0]):
        seen = 0
        for j in range(1, labels.shape[1]):
            if labels[i, j] != M:
                seen += 1
                if seen > t:
                    labels[i, j] = M
    return {**batch, "labels": labels}


@pytest.mark.parametrize("t", [1, 4, 9])
def test_cut_features_equal_those_of_the_full_length_batch_masked_by_hand(t):
    # float64 scoring (the features come back float32): the cut changes only the summation lengths.
    model = tiny_llama(seed=2, dtype=torch.float64)
    pool = make_batch(n=7, T=16, seed=5, prompt_len=3, pad_rows=3)
    pool["labels"][0, 3:13] = M  # a row with only 2 targets
    G_cut, _ = _extractor(model, score_tokens=t).compute(pool)
    G_ref, _ = _extractor(model).compute(_mask_after_first_targets_by_hand(pool, t))
    torch.testing.assert_close(G_cut, G_ref, rtol=1e-5, atol=1e-5 * float(G_ref.abs().max()))


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "16"])
def test_bad_values_are_rejected_naming_the_option_and_value(bad):
    with pytest.raises(ValueError, match=r"`score_tokens` must be None .* got " + repr(bad).replace(".", r"\.")):
        GradFeatureExtractor(tiny_llama(), score_tokens=bad)


def test_config_key_is_typed_and_checked():
    tiny = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
    key = "algorithms.data_selection.features.score_tokens"
    from composer_algos.registry import load_run_config

    assert load_run_config(tiny, [f"{key}=32"]).algorithms["data_selection"].features.score_tokens == 32
    with pytest.raises(ConfigError, match=rf"{key}.*got 0"):
        load_run_config(tiny, [f"{key}=0"])
