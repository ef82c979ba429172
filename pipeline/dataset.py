"""A domain-tagged StreamingDataset over the per-domain MDS directories written by `tools/shard.py`."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from filelock import FileLock
from streaming import Stream, StreamingDataset
from streaming.base.world import World

from pipeline.manifest import DomainInfo, Manifest, load_manifest

log = logging.getLogger(__name__)

__all__ = [
    "DomainStreamingDataset",
    "build_domain_streams",
    "resolve_domain_weights",
    "split_samples",
    "streamed_domains",
]

# Streaming 0.13 registers a dataset's shared memory prefix in two moves: it scans /dev/shm for the
# first free prefix, then creates `<prefix>_locals` (streaming/base/shared/prefix.py::get_shm_prefix).
# Two jobs whose datasets start at the same moment both find the same free prefix and the second
# dies with `FileExistsError: '/000000_locals'` (seen with tools/run_experiment.py --jobs 2). Local
# leaders (the process of each job and node that creates the prefix) take this machine-wide lock
# around the registration, so they register one after the other. The other ranks take no lock (a
# leader holds it across Streaming's barriers), and in Streaming 0.13 each of them scans for the
# free prefix itself, before the leader registers (prefix.py:213-216): another process that takes or
# frees a prefix between the leader's scan and theirs makes them look for one the leader did not
# register ("prefix=0 was not registered by local leader", seen beside another test run). The CPU
# FSDP tests give the ranks their leader's number (tests/training/cpu_fsdp_runs.py); a run here
# does not yet (its all-gather on NCCL is untested).
PREFIX_LOCK = os.path.join(tempfile.gettempdir(), "partitionsel_streaming_prefix.lock")


@contextlib.contextmanager
def _prefix_registration_lock() -> Iterator[None]:
    if World.detect().is_local_leader:
        with FileLock(PREFIX_LOCK):
            yield
    else:
        yield


class DomainStreamingDataset(StreamingDataset):
    """A StreamingDataset with one Stream per domain that tags every sample with its domain id.

    Streaming keeps no per-sample stream tag, so the domain is derived from the sample's shard:
    `spanner` maps a global sample id to its shard, and `stream_per_shard` maps the shard to its
    stream. Streams are built from the shard manifest, so the domain id of a sample is the
    domain's position in `manifest.domains` (sorted by name) whatever subset of domains or
    proportions this dataset uses.

    Args:
        shard_dir: The output directory of `tools/shard.py` (holds `manifest.json`), local or the
            local mirror of `remote`.
        split: `train` or `val`.
        remote: Optional remote root (s3://, gs://, ...) laid out like `shard_dir`; shards are
            downloaded into `shard_dir`.
        domains: Restrict to these domain names (default: every domain with samples in `split`).
        domain_weights: Stream proportions by domain name (for instance DoReMi's weights);
            domains with weight 0 are left out. None keeps the natural mixture.
        **kwargs: Passed to `StreamingDataset` (shuffle, shuffle_seed, batch_size, epoch_size,
            sampling_method, batching_method, num_canonical_nodes, predownload, ...).

    Raises:
        ValueError: unknown domain names, weights that are negative or sum to 0, or a split with
            no data.
    """

    def __init__(
        self,
        *,
        shard_dir: str,
        split: str = "train",
        remote: str | None = None,
        domains: Sequence[str] | None = None,
        domain_weights: Mapping[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        self.manifest: Manifest = load_manifest(shard_dir)
        streams, stream_domain_ids = build_domain_streams(
            self.manifest,
            shard_dir=shard_dir,
            split=split,
            remote=remote,
            domains=domains,
            domain_weights=domain_weights,
        )
        self.domain_names: list[str] = [d.name for d in self.manifest.domains]
        self.stream_domain_ids: list[int] = list(stream_domain_ids)  # manifest domain id of each stream
        self.split = split
        self.shard_dir, self.remote = shard_dir, remote  # DataSelection's default validation shards
        with _prefix_registration_lock():
            super().__init__(streams=streams, **kwargs)
        # stream index -> domain id in the manifest's order.
        self._domain_per_shard = np.asarray(stream_domain_ids, dtype=np.int64)[self.stream_per_shard]

    @property
    def num_domains(self) -> int:
        return len(self.domain_names)

    def get_item(self, sample_id: int, retry: int = 7) -> dict[str, Any]:
        sample = super().get_item(sample_id, retry=retry)
        shard_id, _ = self.spanner[sample_id]
        sample["domain_id"] = int(self._domain_per_shard[shard_id])
        # The global sample index, so selections can be logged and compared example by example.
        sample["sample_id"] = int(sample_id)
        return sample


def build_domain_streams(
    manifest: Manifest,
    *,
    shard_dir: str,
    split: str,
    remote: str | None = None,
    domains: Sequence[str] | None = None,
    domain_weights: Mapping[str, float] | None = None,
) -> tuple[list[Stream], list[int]]:
    """One Streaming `Stream` per domain of `split`, and the manifest domain id of each.

    Args:
        manifest: The loaded shard manifest.
        shard_dir: Local root of the shards.
        split: `train` or `val`.
        remote: Optional remote root with the same layout.
        domains: Restrict to these domain names.
        domain_weights: Stream proportions by domain name (normalised here).

    Returns:
        The streams and, aligned with them, the domain ids.

    Raises:
        ValueError: see `DomainStreamingDataset`.
    """
    streams: list[Stream] = []
    ids: list[int] = []
    for domain_id, proportion in streamed_domains(
        manifest, shard_dir=shard_dir, split=split, domains=domains, domain_weights=domain_weights
    ):
        info = manifest.domains[domain_id]
        local = os.path.join(shard_dir, split, info.dir)
        streams.append(
            Stream(
                remote=None if remote is None else f"{remote.rstrip('/')}/{split}/{info.dir}",
                local=local,
                proportion=proportion,
            )
        )
        ids.append(domain_id)
    return streams, ids


def streamed_domains(
    manifest: Manifest,
    *,
    shard_dir: str,
    split: str,
    domains: Sequence[str] | None = None,
    domain_weights: Mapping[str, float] | None = None,
) -> list[tuple[int, float | None]]:
    """The domains a `split` streams, as (manifest domain id, normalised proportion or None), in manifest order.

    A domain is streamed when it is asked for (`domains`, default all), has samples in `split` and
    a weight above 0 (when `domain_weights` are given). No file is opened beyond the manifest, so
    configuration checks can call it before any dataset is built.

    Raises:
        ValueError: see `DomainStreamingDataset`.
    """
    by_name = {d.name: i for i, d in enumerate(manifest.domains)}
    wanted = list(domains) if domains is not None else [d.name for d in manifest.domains]
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise ValueError(
            f"domains {unknown} are not in the shard manifest {os.path.join(shard_dir, 'manifest.json')}; "
            f"known domains: {sorted(by_name)}"
        )
    weights = resolve_domain_weights(domain_weights, wanted, source=shard_dir) if domain_weights else None
    chosen: list[tuple[int, float | None]] = []
    for name in wanted:
        if split_samples(manifest.domains[by_name[name]], split) == 0:
            continue
        proportion = None
        if weights is not None:
            proportion = weights[name]
            if proportion == 0.0:
                log.info("domain %s has weight 0 and is left out of the %s stream mix", name, split)
                continue
        chosen.append((by_name[name], proportion))
    if not chosen:
        raise ValueError(f"no domain of {shard_dir} has samples in split {split!r} (domains asked: {wanted})")
    return chosen


def resolve_domain_weights(
    weights: Mapping[str, float], domain_names: Sequence[str], *, source: str = "domain_weights"
) -> dict[str, float]:
    """Validate per-domain weights against `domain_names` and normalise them to sum to 1.

    Domains missing from `weights` get weight 0 (and a warning, so nothing is dropped silently).

    Raises:
        ValueError: a weight for an unknown domain, a negative or non-finite weight, or all zero.
    """
    unknown = sorted(set(weights) - set(domain_names))
    if unknown:
        raise ValueError(f"{source}: weights given for unknown domains {unknown}; allowed: {list(domain_names)}")
    bad = {k: v for k, v in weights.items() if not (math.isfinite(float(v)) and float(v) >= 0)}
    if bad:
        raise ValueError(f"{source}: domain weights must be finite and >= 0, got {bad}")
    missing = [n for n in domain_names if n not in weights]
    if missing:
        log.warning("%s: no weight for domains %s; they get weight 0", source, missing)
    total = sum(float(weights.get(n, 0.0)) for n in domain_names)
    if total <= 0:
        raise ValueError(f"{source}: domain weights sum to {total}; at least one must be positive")
    return {n: float(weights.get(n, 0.0)) / total for n in domain_names}


def split_samples(info: DomainInfo, split: str) -> int:
    """Samples the manifest records for `split` of one domain (0 when the split is absent)."""
    stats = info.splits.get(split)
    return 0 if stats is None else int(stats.samples)
