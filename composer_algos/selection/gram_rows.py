"""Rows of the Gram matrix K = G G^T: from a precomputed K, or computed from G on demand in batches."""

# Shape legend: N pool size, D feature dim, B rows in one batch, S support size.
#
# Greedy OMP with the exact refit reads K only through the rows of the elements it selects (and
# swap refinement through the rows of its candidates), plus diag(K). With k of n selected, the
# selected rows cost k n D multiply-adds instead of the (3/4) n^2 D of the full Gram: a quarter
# of the work at n = 4k. The pick order is sequential, so rows are computed in speculative
# batches: when a pick has no row yet, the best-scoring candidates without a row come along in
# the same GEMM (the next picks are mostly among them).

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from composer_algos.selection.objective import compute_gram

log = logging.getLogger(__name__)

__all__ = ["GramRows", "as_gram_rows"]


class GramRows:
    """The Gram matrix ``K = G G^T`` with its rows available full or on demand.

    ``gram_NN`` is the (possibly partial) Gram: row ``i`` is valid once ``ensure`` has covered
    ``i`` (always, for a full Gram). Readers index rows of ``gram_NN`` (and columns within rows
    they own: ``K[i, j]`` for ``i`` ensured) and take the diagonal from ``diag_N``, never from
    ``gram_NN``. Host-side bookkeeping: ``ensure`` needs the indices on the host, so a lazy Gram
    costs its caller one host sync per pick (on CPU, microseconds).

    Args:
        gram_NN: a precomputed full ``(N, N)`` Gram (then ``features_ND`` is ignored), or None.
        features_ND: ``(N, D)`` features to compute rows from when ``gram_NN`` is None.
        batch_rows: rows computed per GEMM when a requested row is missing (default 32): the
            missing rows plus the best-scoring candidates without a row.
    """

    def __init__(
        self,
        gram_NN: torch.Tensor | None = None,
        features_ND: torch.Tensor | None = None,
        *,
        batch_rows: int = 32,
    ) -> None:
        if gram_NN is not None:
            self.gram_NN = gram_NN
            self.features_ND = None
            self.diag_N = torch.diagonal(gram_NN)
            self.lazy = False
        else:
            if features_ND is None:
                raise ValueError("GramRows needs `gram_NN` or `features_ND`, got neither")
            n = features_ND.shape[0]
            self.features_ND = features_ND
            # Uninitialised storage: only the rows that get computed are ever touched.
            self.gram_NN = torch.empty(n, n, dtype=features_ND.dtype, device=features_ND.device)
            self.diag_N = torch.linalg.vector_norm(features_ND, dim=1).square()
            self.lazy = True
            self._have: set[int] = set()
            self._have_N = torch.zeros(n, dtype=torch.bool, device=features_ND.device)
        if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
            raise ValueError(f"GramRows: `batch_rows` must be an int >= 1, got {batch_rows!r}")
        self.batch_rows = batch_rows
        self.rows_computed = 0
        self.batches = 0

    @property
    def n(self) -> int:
        """The pool size ``N``."""
        return self.gram_NN.shape[0]

    def has(self, i: int) -> bool:
        """Whether row ``i`` is available."""
        return not self.lazy or i in self._have

    def ensure(self, idx: Sequence[int], scores_N: torch.Tensor | None = None) -> None:
        """Make the rows ``idx`` available, computing the missing ones in one GEMM.

        When some are missing and ``scores_N`` is given, the batch is filled up to ``batch_rows``
        with the highest-scoring elements that have no row yet and a finite score (pass ``-inf``
        for elements that cannot be picked): speculative rows for the next requests.

        Args:
            idx: pool positions (host ints).
            scores_N: optional ``(N,)`` priority of the speculative rows.
        """
        if not self.lazy:
            return
        missing = list(dict.fromkeys(i for i in idx if i not in self._have))
        if not missing:
            return
        extra = self.batch_rows - len(missing)
        if scores_N is not None and extra > 0:
            missing_t = torch.tensor(missing, dtype=torch.long, device=scores_N.device)
            masked_N = scores_N.masked_fill(self._have_N, float("-inf")).index_fill_(
                0, missing_t, float("-inf")
            )
            top = torch.topk(masked_N, min(extra, self.n))
            # One sync: the speculative candidates and whether their scores are finite.
            cand = torch.stack([top.indices.to(masked_N.dtype), top.values]).tolist()
            missing += [int(i) for i, s in zip(*cand) if s != float("-inf")]
        self._compute(missing)

    def full(self) -> torch.Tensor:
        """The whole ``(N, N)`` Gram (computes it at once when lazy and rows are missing)."""
        if self.lazy and len(self._have) < self.n:
            assert self.features_ND is not None
            self.gram_NN = compute_gram(self.features_ND)
            self.diag_N = torch.diagonal(self.gram_NN)
            self.rows_computed = self.n
            self._have = set(range(self.n))
            self._have_N.fill_(True)
        return self.gram_NN

    def block(self, idx_S: torch.Tensor) -> torch.Tensor:
        """``K[S, S]`` for ensured rows ``idx_S``."""
        return self.gram_NN.index_select(0, idx_S).index_select(1, idx_S)

    def _compute(self, rows: list[int]) -> None:
        """Compute ``G[rows] G^T`` into the cache."""
        assert self.features_ND is not None
        idx_B = torch.tensor(rows, dtype=torch.long, device=self.gram_NN.device)
        feats_BD = self.features_ND.index_select(0, idx_B)
        self.gram_NN.index_copy_(0, idx_B, feats_BD @ self.features_ND.T)
        self._have_N.index_fill_(0, idx_B, True)
        self._have.update(rows)
        self.rows_computed += len(rows)
        self.batches += 1


def as_gram_rows(gram: torch.Tensor | GramRows) -> GramRows:
    """Wrap a full Gram tensor (or pass a ``GramRows`` through)."""
    return gram if isinstance(gram, GramRows) else GramRows(gram_NN=gram)
