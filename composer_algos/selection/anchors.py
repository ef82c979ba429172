"""Similarities between pool examples and validation anchors, shared by facloc and uniprot."""

# Shape legend: N pool size, V validation anchors, D feature dim.

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AnchorOptions", "anchor_similarities"]

_SIMILARITIES = ("cosine", "dot")


@dataclass(frozen=True, kw_only=True)
class AnchorOptions:
    """How pool examples are compared with the validation anchors.

    Args:
        similarity: ``"cosine"`` (default: the official code normalises every gradient before these
            modes, `grads.normalize`) or ``"dot"`` (raw inner products of the features).
    """

    similarity: str = "cosine"

    def __post_init__(self) -> None:
        if self.similarity not in _SIMILARITIES:
            raise ValueError(
                f"invalid selection options: `similarity` must be one of {list(_SIMILARITIES)}, got {self.similarity!r}"
            )


def anchor_similarities(val_rows_VD: torch.Tensor, features_ND: torch.Tensor, similarity: str) -> torch.Tensor:
    """``(V, N)`` similarities ``S[a, i]`` of anchor ``a`` and pool example ``i`` (cosine: 0 for a zero row)."""
    if similarity == "cosine":
        tiny = torch.finfo(features_ND.dtype).tiny
        features_ND = features_ND / features_ND.norm(dim=1, keepdim=True).clamp_min(tiny)
        val_rows_VD = val_rows_VD / val_rows_VD.norm(dim=1, keepdim=True).clamp_min(tiny)
    return val_rows_VD @ features_ND.T
