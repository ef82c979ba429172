"""`score_tokens`: cut a scoring batch to each example's first t target tokens, and the sequence after the last needed one.

Shapes: n examples, T tokens, L <= T tokens kept.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from composer_algos.losses import IGNORE_INDEX, mask_and_labels

__all__ = ["first_target_tokens", "score_tokens_problem"]

# The batch fields the scoring forward reads; each is (n, T) and cut along T together.
_SEQUENCE_KEYS = ("input_ids", "attention_mask", "labels")


def first_target_tokens(batch: Mapping[str, torch.Tensor], t: int | None) -> dict[str, torch.Tensor]:
    """The batch scored on each example's first `t` target tokens, cut after the furthest one needed.

    Labels follow the Hugging Face convention (aligned with `input_ids`, the loss shifts them:
    position j - 1 predicts `labels[j]`), so a target token is a position j >= 1 with `labels[j] !=
    -100` (`labels[0]` is never predicted). Labels after each row's t-th target token become -100,
    and `input_ids`, `attention_mask` and `labels` are cut to `L = max over rows of (position of
    the row's last kept target + 1)`: with causal attention and right padding the kept positions'
    outputs do not depend on the cut ones, so the loss of the kept targets, and its gradient, is
    what the full sequence gives for them, while the forward and backward run over L positions
    instead of T. Vectorised: a cumulative sum of the target mask ranks the targets; computing L
    is one host sync (a slice length must be a Python int).

    A row with fewer than `t` targets keeps all of them (and a row without any still contributes
    nothing). With `t` None or `t >= T` (no row can hold more than T - 1 targets) the batch is
    returned as given, the same tensors.

    Args:
        batch: `input_ids` (n, T), optional `attention_mask` (n, T, default ones) and `labels`
            (n, T, default: the inputs with padding ignored); other fields are passed through.
        t: target tokens to keep per example (>= 1), or None for all.

    Returns:
        The (possibly) cut batch: a new dict, or `batch` itself when nothing is cut.
    """
    input_ids = batch["input_ids"]
    T = int(input_ids.shape[1])
    if t is None or t >= T:
        return batch  # type: ignore[return-value]
    mask, labels = mask_and_labels(batch)
    is_target_nT = labels != IGNORE_INDEX
    is_target_nT[:, 0] = False  # the first position's label is never predicted
    rank_nT = is_target_nT.cumsum(dim=1)  # j-th entry: targets at positions <= j
    keep_nT = is_target_nT & (rank_nT <= t)
    labels = labels.masked_fill(is_target_nT & ~keep_nT, IGNORE_INDEX)
    positions_T = torch.arange(T, device=labels.device)
    last_n = torch.where(keep_nT, positions_T, torch.zeros_like(positions_T)).amax(dim=1)
    length = int(last_n.max()) + 1
    out = dict(batch)
    out.update({"input_ids": input_ids, "attention_mask": mask, "labels": labels})
    for key in _SEQUENCE_KEYS:
        out[key] = out[key][:, :length]
    return out


def score_tokens_problem(score_tokens: object) -> str | None:
    """Why `score_tokens` is invalid (None when it is an int >= 1 or None)."""
    if score_tokens is None or (isinstance(score_tokens, int) and not isinstance(score_tokens, bool) and score_tokens >= 1):
        return None
    return (
        f"`score_tokens` must be None (score every target token) or an int >= 1 (the first that many "
        f"target tokens of each pool example), got {score_tokens!r}"
    )
