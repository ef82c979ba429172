"""Split each domain's validation samples into a part that guides selection and a held-out part for evaluation."""

from __future__ import annotations

import hashlib
import logging
import math

import numpy as np
from torch.utils.data import Dataset, Subset

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_GUIDE_FRACTION", "guide_mask", "dataset_guide_mask", "heldout_subset"]

# Half of every domain's validation split guides validation-aware selection; evaluation reads the other half.
DEFAULT_GUIDE_FRACTION = 0.5

# (domain, split) pairs already reported as single-example domains (one warning per process).
_WARNED_SINGLE: set[tuple[str, str]] = set()


def guide_mask(domain: str, num_samples: int, guide_fraction: float) -> np.ndarray:
    """Which of a domain's `num_samples` validation samples (by position in its split) guide selection.

    The samples are ranked by a hash of (domain name, position), fixed across runs, seeds and
    machines, and the first `round(guide_fraction * num_samples)` are the guide part; when
    0 < guide_fraction < 1 and the domain has 2 or more samples, each part keeps at least one.
    A domain with a single sample cannot be split: for 0 < guide_fraction < 1 it is held out
    (evaluated, never guiding selection; `dataset_guide_mask` warns naming it), so its per-domain
    evaluator still has something to read. The ranking is shared by every fraction, so a smaller
    fraction's guide part lies inside a larger one's: evaluating with a fraction >= the selection's
    never reads a guide sample.

    Args:
        domain: Domain name (salts the hash, so domains get different patterns).
        num_samples: Samples of this domain in the split.
        guide_fraction: Share of the samples that guide selection, in [0, 1].

    Returns:
        A boolean array of length `num_samples` (True: guide, False: held out).

    Raises:
        ValueError: `guide_fraction` outside [0, 1].
    """
    if not (math.isfinite(guide_fraction) and 0.0 <= guide_fraction <= 1.0):
        raise ValueError(f"guide_fraction must be in [0, 1], got {guide_fraction}")
    n = int(num_samples)
    k = int(math.floor(guide_fraction * n + 0.5))
    if 0.0 < guide_fraction < 1.0:
        k = min(max(k, 1), n - 1)  # a single sample (n = 1) stays held out: k = 0
    salt = int.from_bytes(hashlib.blake2b(domain.encode(), digest_size=8).digest(), "little")
    z = np.arange(n, dtype=np.uint64) + np.uint64(salt)
    # splitmix64 finaliser (uint64 arrays wrap silently).
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    mask = np.zeros(n, dtype=bool)
    mask[np.argsort(z, kind="stable")[:k]] = True
    return mask


def dataset_guide_mask(dataset, guide_fraction: float) -> np.ndarray:
    """`guide_mask` over a `DomainStreamingDataset`'s global sample ids (any subset of domains).

    Each stream is one domain's split, its samples contiguous from `sample_offset_per_stream`,
    so a sample's part depends only on its domain and position in that domain: datasets over
    different domain subsets agree.

    A domain with a single sample in the split is held out (see `guide_mask`), with a warning
    naming it, once per process.

    Returns:
        A boolean array of length `dataset.num_samples`.
    """
    mask = np.zeros(int(dataset.num_samples), dtype=bool)
    single = []
    for s, domain_id in enumerate(dataset.stream_domain_ids):
        start, n = int(dataset.sample_offset_per_stream[s]), int(dataset.samples_per_stream[s])
        name = dataset.domain_names[domain_id]
        mask[start : start + n] = guide_mask(name, n, guide_fraction)
        if n == 1 and 0.0 < guide_fraction < 1.0:
            single.append(name)
    fresh = [name for name in single if (name, dataset.split) not in _WARNED_SINGLE]
    if fresh:
        _WARNED_SINGLE.update((name, dataset.split) for name in fresh)
        log.warning(
            "%s split: domain(s) %s have a single example, which cannot be both guide and held out: it is "
            "evaluated and never guides selection (guide_fraction %g); shard more %s examples for them to guide",
            dataset.split,
            ", ".join(repr(n) for n in fresh),
            guide_fraction,
            dataset.split,
        )
    return mask


def heldout_subset(dataset, guide_fraction: float, *, what: str = "evaluation") -> Dataset:
    """The samples of `dataset` outside the guide part, as a map-style dataset (the whole dataset at 0).

    Raises:
        ValueError: nothing is left (a fraction of 1).
    """
    if guide_fraction == 0.0:
        return Subset(dataset, list(range(int(dataset.num_samples))))
    ids = np.flatnonzero(~dataset_guide_mask(dataset, guide_fraction))
    if ids.size == 0:
        domains = [dataset.domain_names[d] for d in dataset.stream_domain_ids]
        raise ValueError(
            f"{what}: guide_fraction {guide_fraction} leaves no held-out {dataset.split} samples in domains "
            f"{domains}; use a guide_fraction < 1 (and >= the selection's), or 0 to read the whole split"
        )
    return Subset(dataset, ids.tolist())
