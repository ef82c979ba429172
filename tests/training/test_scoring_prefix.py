"""`composer_algos.models.scoring_prefix`: the frozen blocks' output recorded in the scoring pass, handed on in training."""

from __future__ import annotations

import pytest
import torch

from composer_algos.models.scoring_prefix import ScoringPrefix, install_scoring_prefix
from tests.common.models import tiny_llama


def _prefix(parts: list[torch.Tensor]) -> ScoringPrefix:
    model = tiny_llama(seed=0, num_hidden_layers=3)
    prefix = ScoringPrefix(model.model, 2)
    prefix._recorded = list(parts)
    return prefix


def _rows(n: int, T: int, start: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.float32).view(n, 1, 1).expand(n, T, 4).clone()


def test_take_returns_the_pool_rows_of_the_last_pass_whatever_the_validation_rows_length():
    # The pool's 8 rows in two forwards of 4 (length 12), then 2 validation rows padded to 16.
    pool = [_rows(4, 12, 0), _rows(4, 12, 4)]
    got = _prefix([*pool, _rows(2, 16, 100)]).take(8, 10)
    assert got is not None and got.shape == (8, 12, 4) and got[:, 0, 0].tolist() == list(range(8))
    # A pass that ran out of memory part-way, then the whole retry: the retry's rows.
    retry = [_rows(3, 12, 50), *pool, _rows(2, 16, 100)]
    assert _prefix(retry).take(8, 10)[:, 0, 0].tolist() == list(range(8))
    assert _prefix(pool[:1]).take(8, 10) is None  # fewer rows than the pass scores: nothing to hand on
    prefix = _prefix(pool)
    assert prefix.take(8, 8) is not None and prefix.take(8, 8) is None  # taken once


def test_the_handed_on_output_gives_the_models_own_forward():
    model = tiny_llama(seed=1, num_hidden_layers=3).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    prefix = install_scoring_prefix(model, 2)
    ids = torch.randint(0, 128, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), prefix.recording():
        full = model(input_ids=ids, use_cache=False).logits
    hidden = prefix.take(3, 3)
    originals = list(model.model.layers)
    with torch.no_grad(), prefix.handing_on(hidden):
        handed = model(input_ids=ids, use_cache=False).logits
    assert list(model.model.layers) == originals and prefix.handed_on == 1
    torch.testing.assert_close(handed, full, rtol=0, atol=0)  # the same batch: the same numbers


def test_a_trainable_block_below_the_adapters_is_refused():
    model = tiny_llama(seed=0, num_hidden_layers=3)  # every parameter trainable
    with pytest.raises(ValueError, match=r"model.reuse_scoring_prefix: embed_tokens.weight is trainable"):
        install_scoring_prefix(model, 2)
    with pytest.raises(ValueError, match="needs 1 to 2"):
        ScoringPrefix(model.model, 3)
