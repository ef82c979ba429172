"""Causal-LM cross-entropy per token and per example (Hugging Face label convention), the one definition.

Shapes: n examples, T tokens, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.collators import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "per_token_losses", "per_example_losses"]


def per_token_losses(logits_nTV: torch.Tensor, labels_nT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy of every position, in float32, with the mask of target tokens.

    Labels are unshifted (position t predicts ``labels[t + 1]``) and ``-100`` (``IGNORE_INDEX``) marks
    tokens without loss. The labels are shifted, not the logits: slicing the logits would copy them
    and make the backward materialise a zero-filled full-size gradient (SliceBackward), costing
    time and memory at large V. The last position has no target, so its loss and mask are 0.

    Args:
        logits_nTV: ``(n, T, V)`` logits.
        labels_nT: ``(n, T)`` labels.

    Returns:
        ``(loss_nT, mask_nT)``: the per-token loss (0 where no target) and the bool target mask.
    """
    n, t, v = logits_nTV.shape
    targets_nT = torch.cat([labels_nT[:, 1:], labels_nT.new_full((n, 1), IGNORE_INDEX)], dim=1)
    loss_nT = F.cross_entropy(
        logits_nTV.reshape(n * t, v).float(),
        targets_nT.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(n, t)
    return loss_nT, targets_nT != IGNORE_INDEX


def per_example_losses(logits_nTV: torch.Tensor, labels_nT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over each example's target tokens (float32).

    An example with no target token gets loss 0 (and so a zero gradient).

    Args:
        logits_nTV: ``(n, T, V)`` logits.
        labels_nT: ``(n, T)`` unshifted labels, ``-100`` where no loss is taken.

    Returns:
        ``(n,)`` losses.
    """
    loss_nT, mask_nT = per_token_losses(logits_nTV, labels_nT)
    return loss_nT.sum(dim=1) / mask_nT.sum(dim=1).clamp_min(1)
