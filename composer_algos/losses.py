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

    Missing mask: all ones, as a cached read-only view of one 1 (no op for a shape seen before;
    writing into it raises). Missing labels: the inputs, with padding ignored (IGNORE_INDEX).
    """
    input_ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if mask is None:
        mask = _ones_view(input_ids)
    labels = batch.get("labels")
    if labels is None:
        labels = input_ids.masked_fill(mask == 0, IGNORE_INDEX)
    return mask, labels


_ONES: dict[tuple[torch.device, torch.dtype, tuple[int, ...] | None], torch.Tensor] = {}  # None: the 0-dim one


def _ones_view(like: torch.Tensor) -> torch.Tensor:
    """Ones of `like`'s shape, dtype and device: a cached `expand` of one 0-dim tensor (per device and dtype).

    Read-only (writing into it raises, as into any expanded tensor); no op at all for a shape seen
    before. A shape of at most one element (whose view could be written) gets a fresh tensor.
    """
    device, dtype, shape = like.device, like.dtype, tuple(like.shape)
    if like.numel() <= 1:
        return torch.ones_like(like)
    view = _ONES.get((device, dtype, shape))
    if view is None:
        one = _ONES.get((device, dtype, None))
        if one is None:
            with torch.inference_mode(False), torch.no_grad():
                # A host one is made as the project makes host tensors: without `device=`.
                one = torch.ones((), dtype=dtype) if device.type == "cpu" else torch.ones((), dtype=dtype, device=device)
            _ONES[(device, dtype, None)] = one
        if len(_ONES) > 64:  # a few shapes recur (the pool's, the validation batch's): keep the cache small
            _ONES.clear()
            _ONES[(device, dtype, None)] = one
        view = _ONES[(device, dtype, shape)] = one.expand(shape)
    return view


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
    targets_nT = torch.cat([labels_nT.narrow(1, 1, t - 1), labels_nT.new_full((n, 1), IGNORE_INDEX)], dim=1)
    is_target_nT = targets_nT != IGNORE_INDEX
    logits_MV = logits_nTV.reshape(n * t, v).float()
    targets_M = targets_nT.view(-1)
    if logits_MV.requires_grad and torch.is_grad_enabled():
        # The target masks and safe indices once here, for the forward and the backward.
        loss_M, _ = _TokenCrossEntropy.apply(logits_MV, targets_M.clamp_min(0).unsqueeze(1), ~is_target_nT.view(-1))
    else:
        loss_M = F.cross_entropy(logits_MV, targets_M, ignore_index=IGNORE_INDEX, reduction="none")
    return loss_M.view(n, t), is_target_nT


def target_token_losses(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of `(N, V)` logits at their `(N,)` targets, in float32, one value each.

    The loss of `model.logits_at: targets` (`composer_algos.models.causal_lm.DomainCausalLM`), which projects
    only the positions that have a target, so there is nothing to mask or shift here.
    """
    return F.cross_entropy(logits_NV.float(), targets_N, reduction="none")


def projects_at_targets(causal_lm: torch.nn.Module) -> bool:
    """Whether `target_position_logits` computes `causal_lm`'s logits: a decoder, then a linear output embedding.

    False for models that transform the projection (e.g. a final logit soft-cap) or have no
    `get_decoder` / linear `get_output_embeddings`; their logits come from the model's own forward.
    """
    base = causal_lm.get_base_model() if hasattr(causal_lm, "get_base_model") else causal_lm
    if not (hasattr(base, "get_decoder") and hasattr(base, "get_output_embeddings")):
        return False
    config = getattr(base, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        return False
    return isinstance(base.get_output_embeddings(), torch.nn.Linear)


def target_position_logits(
    causal_lm: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoder on every position, the vocabulary projection only where a next token has a loss.

    With a loss on the answer only, the prompt's positions need the decoder's hidden states (the
    answer attends to them) but not their logits, which for a large vocabulary are a large share of a
    small model's forward and as much again of its backward. Position t predicts `labels[t + 1]`, as
    in Hugging Face's loss. The positions are found with one `nonzero` (a host sync on CUDA).

    Args:
        causal_lm: a transformers causal LM or a peft model around one (`projects_at_targets` true).
        input_ids, attention_mask: `(B, T)`.
        labels_BT: `(B, T)` unshifted labels, `IGNORE_INDEX` where there is no loss.

    Returns:
        `(logits_NV, targets_N, rows_N)`: the logits of the N target positions, their next tokens and
        the row each belongs to.
    """
    base = causal_lm.get_base_model() if hasattr(causal_lm, "get_base_model") else causal_lm
    hidden_BTH = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    ignore = labels_BT.new_full((labels_BT.shape[0], 1), IGNORE_INDEX)
    targets_BT = torch.cat([labels_BT[:, 1:], ignore], dim=1)
    rows_N, cols_N = (targets_BT != IGNORE_INDEX).nonzero(as_tuple=True)
    logits_NV = base.get_output_embeddings()(hidden_BTH[rows_N, cols_N])
    return logits_NV, targets_BT[rows_N, cols_N], rows_N


def row_means(values_N: torch.Tensor, rows_N: torch.Tensor, n_rows: int) -> torch.Tensor:
    """The mean of `values_N` per row index (0 for a row with none), as `per_example_losses` gives per example."""
    sums_B = values_N.new_zeros(n_rows).index_add(0, rows_N, values_N)
    counts_B = values_N.new_zeros(n_rows).index_add(0, rows_N, torch.ones_like(values_N))
    return sums_B / counts_B.clamp_min(1)


class _TokenCrossEntropy(torch.autograd.Function):
    """`F.cross_entropy(logits, targets, ignore_index=-100, reduction="none")` with a lighter backward.

    Called as `apply(logits_MV, safe_M1, ignored_M)`: the targets clamped to >= 0 as an (M, 1)
    index (`targets.clamp_min(0).unsqueeze(1)`) and the bool mask of positions without a target
    (`targets == -100`), which the caller computes once for the forward and the backward.

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

    It works under torch.func transforms (`grad`, `vmap` of `grad`, `jacrev`; issue 20): the
    forward takes no ctx and also returns the log-probabilities (non-differentiable) for
    `setup_context` to save, and the vmap rule is generated. Inside a transform the backward
    computes the same formula out of place.
    """

    # torch.func transforms (grad, vmap, jacrev: tools/bench/bench_features.py's per-example reference)
    # need the forward without ctx, a setup_context, and a vmap rule (generated: every op here batches).
    generate_vmap_rule = True

    @staticmethod
    def forward(
        logits_MV: torch.Tensor, safe_M1: torch.Tensor, ignored_M: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logp_MV = torch.log_softmax(logits_MV, dim=-1)
        loss_M = -logp_MV.gather(1, safe_M1).squeeze(1)
        loss_M = loss_M.masked_fill(ignored_M, 0.0)
        # The log-probabilities are an output only so that setup_context can save them (a forward
        # without ctx cannot save intermediates); they are not differentiable and callers drop them.
        return loss_M, logp_MV

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _logits_MV, safe_M1, ignored_M = inputs
        _loss_M, logp_MV = output
        ctx.mark_non_differentiable(logp_MV)
        ctx.set_materialize_grads(False)  # no zero (M, V) gradient for the log-probabilities output
        ctx.save_for_backward(logp_MV, safe_M1, ignored_M)
        ctx.consumed = False

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_M: torch.Tensor | None, _g_logp: None) -> tuple[torch.Tensor | None, None, None]:
        if ctx.consumed:
            raise RuntimeError(
                "per_token_losses: a second backward through the same graph (retain_graph=True) is not "
                "supported; its backward reuses the saved log-probabilities in place"
            )
        ctx.consumed = True
        if g_M is None:
            return None, None, None
        logp_MV, safe_M1, ignored_M = ctx.saved_tensors
        g_M1 = g_M.masked_fill(ignored_M, 0.0).unsqueeze(1)
        if _functorch_wrapped(logp_MV, g_M):
            # Under a torch.func transform (vmap over this backward, as jacrev does, batches `g`
            # but not the saved buffer, and in-place ops cannot write a batched value into an
            # unbatched tensor): the same formula out of place, with the in-place scatter that
            # has a vmap batching rule (scatter_add_ has none and falls back to a per-example loop).
            grad_MV = logp_MV.exp() * g_M1
            return grad_MV.scatter_reduce_(1, safe_M1, -g_M1, "sum"), None, None
        grad_MV = logp_MV.exp_().mul_(g_M1)  # the saved buffer becomes the gradient
        grad_MV.scatter_add_(1, safe_M1, -g_M1)
        return grad_MV, None, None


def _functorch_wrapped(*tensors: torch.Tensor) -> bool:
    """Whether any tensor is a torch.func wrapper (batched or grad-tracking): a transform is running."""
    return any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


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
