"""Global-scope selection across ranks: gather the selection problem, then rebalance the chosen examples.

Legend: W = world size, N = pool size on one rank, M = the largest pool over ranks,
K = selected examples in total, D = feature dimension, T = sequence length.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from composer.utils import dist

__all__ = ["gather_rows", "plan_rebalance", "exchange_examples", "IGNORE_PAD"]

# Padding values per batch key when sequences of different lengths are stacked.
IGNORE_PAD = {"labels": -100}


def gather_rows(x_N: torch.Tensor, n_max: int) -> torch.Tensor:
    """All-gather a per-rank tensor whose first dimension may differ between ranks.

    Rows are zero-padded to `n_max` before the gather, so the result is (W * n_max, ...) with
    rank r's rows at `[r * n_max, r * n_max + N_r)`.
    """
    if x_N.shape[0] < n_max:
        pad = x_N.new_zeros((n_max - x_N.shape[0], *x_N.shape[1:]))
        x_N = torch.cat([x_N, pad], dim=0)
    return torch.cat(dist.all_gather(x_N.contiguous()), dim=0)


def plan_rebalance(owner_K: torch.Tensor, world_size: int, per_rank: int) -> torch.Tensor:
    """Assign each selected example a training rank so every rank trains exactly `per_rank`.

    Examples stay on the rank that holds them while it has room (no data moves in the common
    case); the overflow fills the ranks that selected too few, in a deterministic order.

    Args:
        owner_K: Rank holding each selected example, in a deterministic order shared by ranks.
        world_size: W.
        per_rank: Examples each rank trains on (K must equal W * per_rank).

    Returns:
        (K,) target rank of each selected example.
    """
    K = owner_K.numel()
    assert K == world_size * per_rank, (K, world_size, per_rank)
    order_K = torch.argsort(owner_K * K + torch.arange(K, device=owner_K.device), stable=True)
    owner_sorted = owner_K[order_K]
    counts_W = torch.bincount(owner_K, minlength=world_size)
    starts_W = torch.cumsum(counts_W, 0) - counts_W
    rank_in_owner = torch.arange(K, device=owner_K.device) - starts_W[owner_sorted]
    stays = rank_in_owner < per_rank
    deficit_W = (per_rank - counts_W.clamp(max=per_rank)).clamp_min(0)
    free_slots = torch.repeat_interleave(torch.arange(world_size, device=owner_K.device), deficit_W)
    target_sorted = owner_sorted.clone()
    target_sorted[~stays] = free_slots
    target_K = torch.empty_like(owner_K)
    target_K[order_K] = target_sorted
    return target_K


def exchange_examples(
    batch: Mapping[str, Any],
    *,
    owner_K: torch.Tensor,
    local_index_K: torch.Tensor,
    target_K: torch.Tensor,
    rank: int,
    world_size: int,
    n_local: int,
) -> dict[str, Any]:
    """Build this rank's training batch from the global selection, moving only the overflow.

    Every per-example tensor of `batch` (first dimension `n_local`) is subset together; the
    examples another rank must train are sent through one padded all-gather per key.
    Sequence tensors of different lengths on different ranks are right-padded (labels with
    -100, everything else with 0; attention masks mark the padding).

    Args:
        batch: This rank's pool batch.
        owner_K, local_index_K, target_K: For each selected example, its holder, its row in the
            holder's pool and the rank that trains it (identical on every rank).
        rank, world_size: This process.
        n_local: Pool size on this rank.

    Returns:
        The batch this rank trains on: kept examples first, then the received ones, in the
        global selection order.
    """
    keep = (owner_K == rank) & (target_K == rank)
    incoming = (target_K == rank) & (owner_K != rank)
    outgoing = (owner_K == rank) & (target_K != rank)
    # Same counts on every rank: computed from the shared plan, no communication needed.
    out_counts_W = torch.bincount(owner_K[target_K != owner_K], minlength=world_size)
    max_out = int(out_counts_W.max())
    keep_idx = local_index_K[keep]
    send_idx = local_index_K[outgoing]
    recv_rows = _received_rows(owner_K, target_K, out_counts_W, max_out, rank)
    assert int(incoming.sum()) == recv_rows.numel()

    # One all-gather for the sequence widths of every 2-D per-example field (same key order on all ranks).
    seq_keys = [
        k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == n_local
    ]
    widths: dict[str, int] = {}
    if world_size > 1 and max_out > 0 and seq_keys:
        mine = torch.tensor([batch[k].shape[1] for k in seq_keys], device=owner_K.device)
        widest = torch.stack(dist.all_gather(mine)).amax(0).tolist()
        widths = dict(zip(seq_keys, widest))

    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n_local:
            kept = value[keep_idx.to(value.device)]
            if world_size == 1 or max_out == 0:
                out[key] = kept
                continue
            pad_value = IGNORE_PAD.get(key, 0)
            width = widths.get(key)
            block = value[send_idx.to(value.device)]
            block = _pad_to(block, max_out, width, pad_value)
            gathered = torch.cat(dist.all_gather(block.contiguous()), dim=0)
            received = gathered[recv_rows.to(gathered.device)]
            out[key] = torch.cat([_pad_to(kept, kept.shape[0], width, pad_value), received], dim=0)
        elif isinstance(value, (list, tuple)) and len(value) == n_local:
            if max_out and world_size > 1:
                raise TypeError(
                    f"batch key {key!r} is a per-example list; global-scope selection can only move tensors "
                    "(use scope: local or collate it into a tensor)"
                )
            out[key] = [value[i] for i in keep_idx.tolist()]
        else:
            out[key] = value
    return out


def _received_rows(
    owner_K: torch.Tensor, target_K: torch.Tensor, out_counts_W: torch.Tensor, max_out: int, rank: int
) -> torch.Tensor:
    """The rows of the all-gathered outgoing blocks (each sender's padded to `max_out`) that `rank` receives."""
    # Position of each incoming example inside its sender's padded outgoing block.
    moving = target_K != owner_K
    moving_owner = owner_K[moving]
    order = torch.argsort(moving_owner * owner_K.numel() + torch.nonzero(moving).flatten(), stable=True)
    slot_in_sender = torch.empty_like(order)
    sorted_owner = moving_owner[order]
    starts = torch.cumsum(out_counts_W, 0) - out_counts_W
    slot_in_sender[order] = torch.arange(order.numel(), device=order.device) - starts[sorted_owner]
    recv_mask_moving = target_K[moving] == rank
    return moving_owner[recv_mask_moving] * max(max_out, 1) + slot_in_sender[recv_mask_moving]


def _pad_to(x: torch.Tensor, rows: int, width: int | None, pad_value: int) -> torch.Tensor:
    if width is not None and x.dim() >= 2 and x.shape[1] < width:
        pad = x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), pad_value)
        x = torch.cat([x, pad], dim=1)
    if x.shape[0] < rows:
        pad = x.new_full((rows - x.shape[0], *x.shape[1:]), pad_value)
        x = torch.cat([x, pad], dim=0)
    return x
