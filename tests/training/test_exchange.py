"""The global-scope rebalancing plan: every rank trains exactly per_rank, nothing moves needlessly."""

from __future__ import annotations

import pytest
import torch

from composer_algos.data_selection.exchange import exchange_examples, plan_rebalance


@pytest.mark.parametrize("world,per_rank,seed", [(2, 4, 0), (4, 3, 1), (3, 5, 2), (8, 2, 3)])
def test_plan_balances_and_keeps_local_when_possible(world, per_rank, seed):
    g = torch.Generator().manual_seed(seed)
    owner = torch.randint(0, world, (world * per_rank,), generator=g)
    target = plan_rebalance(owner, world, per_rank)
    assert torch.bincount(target, minlength=world).tolist() == [per_rank] * world
    # Minimal movement: a rank keeps min(selected_on_it, per_rank) of its own examples.
    for r in range(world):
        own = int((owner == r).sum())
        kept = int(((owner == r) & (target == r)).sum())
        assert kept == min(own, per_rank)


def test_single_rank_exchange_is_a_subset():
    batch = {"input_ids": torch.arange(12).view(6, 2), "domain_id": torch.tensor([0, 1, 0, 1, 2, 2]), "meta": "x"}
    owner = torch.zeros(3, dtype=torch.long)
    local = torch.tensor([4, 1, 2])
    target = plan_rebalance(owner, 1, 3)
    out = exchange_examples(batch, owner_K=owner, local_index_K=local, target_K=target, rank=0, world_size=1, n_local=6)
    assert out["domain_id"].tolist() == [2, 1, 0]
    assert out["input_ids"].tolist() == [[8, 9], [2, 3], [4, 5]]
    assert out["meta"] == "x"
