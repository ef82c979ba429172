"""Causal-LM cross-entropy per token and per example (Hugging Face label convention), the one definition.

Shapes: n examples, T tokens, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.collators import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "mask_and_labels", "per_token_losses", "per_example_losses"]


def mask_and_labels(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's `attention_mask` and `labels`, with the defaults every scoring path uses.

    Missing mask: all ones. Missing labels: the inputs, with padding ignored (IGNORE_INDEX).
    """
    input_ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(input_ids)
    labels = batch.get("labels")
    if labels is None:
        labels = input_ids.masked_fill(mask == 0, IGNORE_INDEX)
    return mask, labels


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
    logits_MV = logits_nTV.reshape(n * t, v).float()
    if logits_MV.requires_grad and torch.is_grad_enabled():
        loss_M = _TokenCrossEntropy.apply(logits_MV, targets_nT.reshape(-1))
    else:
        loss_M = F.cross_entropy(logits_MV, targets_nT.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")
    return loss_M.view(n, t), targets_nT != IGNORE_INDEX


class _TokenCrossEntropy(torch.autograd.Function):
    """`F.cross_entropy(logits, targets, ignore_index=-100, reduction="none")` with a lighter backward.

    The same values bit for bit, and the same gradient formula as the composed `log_softmax` +
    `nll_loss` (whose backward is `go - exp(logp) * sum(go)` with `go` zero but `-g` at the
    target, so `exp(logp) * g` off the target and `exp(logp) * g - g` on it); the gradient differs
    only in the last bit where ATen's fused backward evaluates `exp` its own way (at most 6e-8
    absolute at V 4096 on CPU; the pinned selections and losses are unchanged). Where that
    backward allocates and zero-fills one (M, V) tensor for `nll_loss` and a second for
    `log_softmax`, this one turns the saved log-probabilities into the gradient in place, so the
    graph cannot be walked twice (a second backward raises). Measured on CPU at M 2048, V 4096:
    forward + backward 57 ms against 121 ms (issue 15; docs/data_selection.md, Cost of a
    selection step).
    """

    @staticmethod
    def forward(ctx, logits_MV: torch.Tensor, targets_M: torch.Tensor) -> torch.Tensor:
        logp_MV = torch.log_softmax(logits_MV, dim=-1)
        valid_M = targets_M != IGNORE_INDEX
        safe_M1 = targets_M.clamp_min(0).unsqueeze(1)
        loss_M = -logp_MV.gather(1, safe_M1).squeeze(1)
        loss_M = loss_M.masked_fill(~valid_M, 0.0)
        ctx.save_for_backward(logp_MV, safe_M1, valid_M)
        ctx.consumed = False
        return loss_M

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_M: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.consumed:
            raise RuntimeError(
                "per_token_losses: a second backward through the same graph (retain_graph=True) is not "
                "supported; its backward reuses the saved log-probabilities in place"
            )
        ctx.consumed = True
        logp_MV, safe_M1, valid_M = ctx.saved_tensors
        g_M1 = g_M.masked_fill(~valid_M, 0.0).unsqueeze(1)
        grad_MV = logp_MV.exp_().mul_(g_M1)  # the saved buffer becomes the gradient
        grad_MV.scatter_add_(1, safe_M1, -g_M1)
        return grad_MV, None


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
