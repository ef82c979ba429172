"""A seeded, cycling source of small validation batches for validation-guided selection."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from composer_algos.seeding import mix_seed
from pipeline.collators import build_collator
from pipeline.dataset import DomainStreamingDataset
from pipeline.holdout import DEFAULT_GUIDE_FRACTION, dataset_guide_mask

log = logging.getLogger(__name__)

__all__ = ["ValidationSource"]


class ValidationSource:
    """Draws `batch_size` validation examples per step, cycling through seeded permutations.

    The draw for a step is a pure function of (seed, rank, step): epoch `e` of the cycle is
    a permutation seeded by (seed, rank, e), and step `s` takes positions
    `[s * batch_size, (s + 1) * batch_size)` of the concatenated epochs. No state needs saving
    for an exact resume, and each rank draws different examples.

    Only the guide part of each domain's split is drawn from (`pipeline.holdout.guide_mask`,
    `guide_fraction` of it); the per-domain evaluators and `tools/evaluate.py ppl` read the rest,
    so no evaluated example ever guides a selection.

    Args:
        shard_dir: Shard directory (the output of `tools/shard.py`).
        split: Which split to draw from (default `val`).
        domains: Restrict to these domains (default: all).
        batch_size: Examples per step (the paper uses 2 to 4).
        seed: Base seed.
        rank: This process's global rank.
        pad_token_id: Padding id for the collator.
        max_seq_len: Sequence length of the run.
        remote: Optional remote root of the shards.
        guide_fraction: Share of each domain's split to draw from (default 0.5; 1 draws from
            all of it, leaving nothing held out for evaluation).

    Raises:
        ValueError: a batch size <= 0, a guide_fraction outside (0, 1], or an empty guide part.
    """

    def __init__(
        self,
        *,
        shard_dir: str,
        split: str = "val",
        domains: Sequence[str] | None = None,
        batch_size: int = 4,
        seed: int = 0,
        rank: int = 0,
        pad_token_id: int,
        max_seq_len: int,
        remote: str | None = None,
        guide_fraction: float = DEFAULT_GUIDE_FRACTION,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"validation.batch_size must be > 0, got {batch_size}")
        if not 0.0 < guide_fraction <= 1.0:
            raise ValueError(f"validation.guide_fraction must be in (0, 1], got {guide_fraction}")
        self.dataset = DomainStreamingDataset(
            shard_dir=shard_dir, split=split, domains=domains, remote=remote, shuffle=False
        )
        # Global sample ids of the guide part; draws are positions in this list.
        self.sample_ids = np.flatnonzero(dataset_guide_mask(self.dataset, guide_fraction))
        self.num_samples = int(self.sample_ids.size)
        if self.num_samples == 0:
            raise ValueError(
                f"validation split {split!r} of {shard_dir} has no samples in its guide part "
                f"(guide_fraction {guide_fraction}); shard with a larger validation split or raise guide_fraction"
            )
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.collate = build_collator(self.dataset.manifest.mode, pad_token_id=pad_token_id, max_seq_len=max_seq_len)

    def indices_for_step(self, step: int) -> list[int]:
        """Global sample ids drawn at `step` (deterministic)."""
        n = self.num_samples
        start = step * self.batch_size
        out: list[int] = []
        while len(out) < self.batch_size:
            epoch, pos = divmod(start + len(out), n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(mix_seed(self.seed, self.rank, epoch)))
            take = min(n - pos, self.batch_size - len(out))
            out.extend(int(self.sample_ids[p]) for p in perm[pos : pos + take].tolist())
        return out

    def batch_for_step(self, step: int) -> dict[str, torch.Tensor]:
        """The collated validation batch for `step`."""
        return self.collate([self.dataset[i] for i in self.indices_for_step(step)])
