"""Sources of the small validation batch drawn each step for validation-guided selection: shards or given batches."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from composer_algos.losses import mask_and_labels
from composer_algos.seeding import mix_seed
from pipeline.collators import build_collator
from pipeline.dataset import DomainStreamingDataset
from pipeline.holdout import DEFAULT_GUIDE_FRACTION, dataset_guide_mask

log = logging.getLogger(__name__)

__all__ = ["ValidationSource", "BatchValidationSource", "model_inputs"]


class ValidationSource:
    """Draws `batch_size` validation examples per step, cycling through seeded permutations.

    The draw for a step is a pure function of (seed, rank, step): epoch `e` of the cycle is
    a permutation seeded by (seed, rank, e), and step `s` takes positions
    `[s * batch_size, (s + 1) * batch_size)` of the concatenated epochs. No state needs saving
    for an exact resume, and each rank draws different examples.

    Only the guide part of each domain's split is drawn from (`pipeline.holdout.guide_mask`,
    `guide_fraction` of it); the per-domain evaluators and `tools/evaluate.py ppl` read the rest,
    so no evaluated example ever guides a selection.

    With `stratify`, every domain has its own cycle of permutations (seeded by seed, rank, epoch
    and the domain) and each step takes `batch_size // C` examples from every one of the C domains
    with guide examples, plus one more from `batch_size % C` domains in rotation (the window
    advances by that many domains per step and is offset by the rank, so ranks cover different
    domains): at least one example per domain per step when `batch_size >= C`, every domain every
    `ceil(C / batch_size)` steps otherwise. Still a pure function of (seed, rank, step).

    Args:
        shard_dir: Shard directory (the output of `tools/shard.py`).
        split: Which split to draw from (default `val`).
        domains: Restrict to these domains (default: all).
        batch_size: Examples per step (the paper uses 2 to 4).
        seed: Base seed.
        rank: This process's global rank.
        pad_token_id: Padding id for the collator (default: the manifest's pad id, else its eos id).
        max_seq_len: Sequence length (default: the manifest's, which the run's must equal).
        remote: Optional remote root of the shards.
        guide_fraction: Share of each domain's split to draw from (default 0.5; 1 draws from
            all of it, leaving nothing held out for evaluation).
        stratify: Draw every domain each step (see above) instead of uniformly over the guide
            examples of all domains (default False).

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
        pad_token_id: int | None = None,
        max_seq_len: int | None = None,
        remote: str | None = None,
        guide_fraction: float = DEFAULT_GUIDE_FRACTION,
        stratify: bool = False,
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
        self.stratify = bool(stratify)
        # Per domain with guide examples: its guide sample ids (the strata of a stratified draw).
        self.strata: list[np.ndarray] = []
        if self.stratify:
            guide = np.zeros(int(self.dataset.num_samples), dtype=bool)
            guide[self.sample_ids] = True
            for s in range(len(self.dataset.stream_domain_ids)):
                start, n = int(self.dataset.sample_offset_per_stream[s]), int(self.dataset.samples_per_stream[s])
                ids = start + np.flatnonzero(guide[start : start + n])
                if ids.size:
                    self.strata.append(ids)
        manifest = self.dataset.manifest
        if pad_token_id is None:
            pad_token_id = manifest.pad_token_id if manifest.pad_token_id is not None else manifest.eos_token_id
        if pad_token_id is None:
            raise ValueError(f"{shard_dir}/manifest.json has neither pad_token_id nor eos_token_id; pass pad_token_id")
        self.collate = build_collator(
            manifest.mode, pad_token_id=pad_token_id, max_seq_len=max_seq_len or manifest.max_seq_len
        )

    @property
    def last_batch_size(self) -> int:
        """Examples in each drawn batch (the weight of this rank's validation feature across ranks)."""
        return self.batch_size

    @property
    def domain_ids(self) -> list[int]:
        """The manifest ids of the domains this source draws from."""
        return sorted(set(int(d) for d in self.dataset.stream_domain_ids))

    def indices_for_step(self, step: int) -> list[int]:
        """Global sample ids drawn at `step` (deterministic)."""
        if self.stratify:
            return self._stratified_indices(step)
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

    def _stratified_indices(self, step: int) -> list[int]:
        """`stratify`: `batch_size // C` from every domain, one more from `batch_size % C` of them in rotation."""
        num = len(self.strata)
        base, extra = divmod(self.batch_size, num)
        slots = base + (1 if extra else 0)  # positions each domain reserves per step in its own cycle
        start = ((step + self.rank) * extra) % num if extra else 0
        out: list[int] = []
        for j, ids in enumerate(self.strata):
            count = base + (1 if extra and (j - start) % num < extra else 0)
            n = int(ids.size)
            first = step * slots
            perm, perm_epoch = None, -1
            for pos in range(first, first + count):
                epoch, within = divmod(pos, n)
                if epoch != perm_epoch:
                    seed = mix_seed(self.seed, self.rank, epoch, 7919 + j)
                    perm, perm_epoch = torch.randperm(n, generator=torch.Generator().manual_seed(seed)), epoch
                out.append(int(ids[int(perm[within])]))
        return out


class BatchValidationSource:
    """Validation batches handed in by the user: a DataLoader, a list of dict batches, any iterable.

    Step `s` takes the batch at position `s mod len(batches)` of its iteration when `batches` has a
    length (a list is indexed; an iterable is re-iterated and skipped ahead as needed), so a
    resumed run draws what the uninterrupted one drew as long as the iterable yields the same
    batches each pass; an iterable without a length is cycled. Batches need `input_ids`;
    `attention_mask` defaults to ones and `labels` to the inputs with padding ignored.

    Args:
        batches: The validation batches.
    """

    def __init__(self, batches: Iterable[Mapping[str, Any]]) -> None:
        self.batches = batches
        self.last_batch_size = 1
        self._it: Iterator[Mapping[str, Any]] | None = None
        self._pos = 0

    def batch_for_step(self, step: int) -> Mapping[str, Any]:
        """The batch for `step`."""
        batch = self._draw(step)
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise TypeError(f"validation batches must be dicts with input_ids, got {type(batch).__name__}")
        self.last_batch_size = int(batch["input_ids"].shape[0])
        return batch

    def _draw(self, step: int) -> Mapping[str, Any]:
        if isinstance(self.batches, Sequence):
            if not self.batches:
                raise ValueError("validation: the list of validation batches is empty")
            return self.batches[step % len(self.batches)]
        length = len(self.batches) if hasattr(self.batches, "__len__") else None  # type: ignore[arg-type]
        if length is not None:
            target = step % length
            if self._it is None or self._pos > target:
                self._it, self._pos = iter(self.batches), 0
            while self._pos < target:
                next(self._it)
                self._pos += 1
            self._pos += 1
            return next(self._it)
        if self._it is None:
            self._it = iter(self.batches)
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.batches)
            return next(self._it)


def model_inputs(batch: Mapping[str, Any], device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """`input_ids`, `labels` and, when some token is padding, `attention_mask` of a batch.

    Defaults as `losses.mask_and_labels` (labels: the inputs, padding ignored). A mask of all ones
    on the host (the loader's batches) is left out: the model then takes its causal path without
    reading it (transformers tests `mask.all()` on the host, a sync on an accelerator, at every
    forward), and every scoring path defaults a missing mask to ones. With `device` the tensors are
    moved there without making the host wait; None (what the selection step passes) leaves them
    where they are, so the features cut windows and score tokens on the host and move only those.
    """
    input_ids = batch["input_ids"]
    mask, labels = mask_and_labels(batch)
    out = {"input_ids": input_ids, "labels": labels}
    if mask.device.type != "cpu" or not bool(mask.all()):
        out["attention_mask"] = mask
    if device is not None:
        out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
    return out
