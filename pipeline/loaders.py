"""DataLoaders and per-domain evaluators over domain-tagged shards."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from composer.core import DataSpec, Evaluator
from composer.utils import dist
from torch.utils.data import DataLoader

from pipeline.collators import build_collator
from pipeline.config import LoaderConfig
from pipeline.dataset import DomainStreamingDataset, split_samples
from pipeline.holdout import DEFAULT_GUIDE_FRACTION, heldout_subset
from pipeline.manifest import load_manifest

log = logging.getLogger(__name__)

__all__ = [
    "build_domain_evaluators",
    "build_heldout_dataloader",
    "build_train_dataloader",
    "eval_domains",
    "train_dataloader_from_config",
]


def build_train_dataloader(
    *,
    shard_dir: str,
    device_batch_size: int,
    pad_token_id: int,
    max_seq_len: int,
    remote: str | None = None,
    split: str = "train",
    domains: Sequence[str] | None = None,
    domain_weights: Mapping[str, float] | None = None,
    shuffle: bool = True,
    shuffle_seed: int = 9176,
    shuffle_algo: str = "py1e",
    num_canonical_nodes: int | None = None,
    predownload: int | None = None,
    epoch_size: int | None = None,
    num_workers: int = 0,
    drop_last: bool = True,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
    pin_memory: bool = False,
) -> DataSpec:
    """The training loader: a shuffled domain-tagged stream mix, batches of `device_batch_size`.

    `device_batch_size` is what one rank receives per step: with a selection algorithm that
    is the candidate pool, not the number of examples trained on.

    Returns:
        A Composer `DataSpec` whose batches hold input_ids, attention_mask, labels, domain_id.

    Raises:
        ValueError: the shards' max_seq_len differs from the run's.
    """
    manifest = load_manifest(shard_dir)
    _check_seq_len(manifest.max_seq_len, max_seq_len, shard_dir)
    dataset = DomainStreamingDataset(
        shard_dir=shard_dir,
        split=split,
        remote=remote,
        domains=domains,
        domain_weights=domain_weights,
        shuffle=shuffle,
        shuffle_seed=shuffle_seed,
        shuffle_algo=shuffle_algo,
        num_canonical_nodes=num_canonical_nodes,
        predownload=predownload,
        epoch_size=epoch_size,
        batch_size=device_batch_size,
    )
    _check_pool_fits_split(dataset, device_batch_size, drop_last, shard_dir=shard_dir, split=split)
    loader = DataLoader(
        dataset,
        batch_size=device_batch_size,
        collate_fn=build_collator(manifest.mode, pad_token_id=pad_token_id, max_seq_len=max_seq_len),
        num_workers=num_workers,
        drop_last=drop_last,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        persistent_workers=persistent_workers and num_workers > 0,
        pin_memory=pin_memory,
    )
    return DataSpec(loader)


def train_dataloader_from_config(
    loader: LoaderConfig,
    *,
    device_batch_size: int,
    pad_token_id: int,
    max_seq_len: int,
    domain_weights: Mapping[str, float] | None,
) -> DataSpec:
    """`build_train_dataloader` with the dataset and loader options of a `train_loader` section.

    `domain_weights` replaces the section's own (`pipeline.config.DatasetConfig`: its
    `domain_weights_file` is read by the caller, `composer_algos.mixture_io.stream_weights`).
    """
    data = loader.dataset
    return build_train_dataloader(
        shard_dir=data.shard_dir,
        remote=data.remote,
        split=data.split,
        domains=data.domains,
        domain_weights=domain_weights,
        shuffle=data.shuffle,
        shuffle_seed=data.shuffle_seed,
        shuffle_algo=data.shuffle_algo,
        num_canonical_nodes=data.num_canonical_nodes,
        predownload=data.predownload,
        epoch_size=data.epoch_size,
        device_batch_size=device_batch_size,
        pad_token_id=pad_token_id,
        max_seq_len=max_seq_len,
        num_workers=loader.num_workers,
        drop_last=loader.drop_last,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        pin_memory=loader.pin_memory,
    )


def build_heldout_dataloader(
    *,
    shard_dir: str,
    domains: Sequence[str],
    device_batch_size: int,
    pad_token_id: int,
    max_seq_len: int,
    remote: str | None = None,
    split: str = "val",
    guide_fraction: float = DEFAULT_GUIDE_FRACTION,
    what: str = "evaluation",
) -> DataSpec:
    """An evaluation loader over the held-out part of `domains`' `split` (see `build_domain_evaluators`)."""
    manifest = load_manifest(shard_dir)
    _check_seq_len(manifest.max_seq_len, max_seq_len, shard_dir)
    dataset = DomainStreamingDataset(
        shard_dir=shard_dir, split=split, remote=remote, domains=domains, shuffle=False, batch_size=device_batch_size
    )
    # A map-style view of the held-out samples; Composer drops a DistributedSampler's padding.
    heldout = heldout_subset(dataset, guide_fraction, what=what)
    loader = DataLoader(
        heldout,
        batch_size=device_batch_size,
        collate_fn=build_collator(manifest.mode, pad_token_id=pad_token_id, max_seq_len=max_seq_len),
        drop_last=False,
        sampler=dist.get_sampler(heldout, shuffle=False, drop_last=False),
    )
    return DataSpec(loader)


def eval_domains(shard_dir: str, split: str, domains: Sequence[str] | None) -> list[str]:
    """The domains of `domains` (default: all) that have samples in `split`, in manifest order.

    Raises:
        ValueError: no such domain has samples in `split`.
    """
    manifest = load_manifest(shard_dir)
    names = list(domains) if domains is not None else [d.name for d in manifest.domains]
    with_data = [d.name for d in manifest.domains if d.name in names and split_samples(d, split) > 0]
    if not with_data:
        raise ValueError(f"{shard_dir}: no domain has samples in split {split!r}; shard with a validation split")
    skipped = sorted(set(names) - set(with_data))
    if skipped:
        log.warning("domains %s have no %s samples and get no evaluator", skipped, split)
    return with_data


def build_domain_evaluators(
    *,
    shard_dir: str,
    device_batch_size: int,
    pad_token_id: int,
    max_seq_len: int,
    remote: str | None = None,
    split: str = "val",
    per_domain: bool = True,
    subset_num_batches: int = -1,
    domains: Sequence[str] | None = None,
    guide_fraction: float = DEFAULT_GUIDE_FRACTION,
) -> list[Evaluator]:
    """One evaluator per domain (label `val/<domain>`), or one over all domains (`val/all`).

    Each reports LanguageCrossEntropy (validation log-perplexity) and LanguagePerplexity.
    Evaluators read only the held-out part of each domain's split: the `guide_fraction` share
    that validation-guided selection draws from (`pipeline.holdout`) is left out, so no
    evaluated example ever guided a selection. `guide_fraction=0` reads the whole split (for
    shards selection never sees); it must be >= the selection's `validation.guide_fraction`.
    """
    manifest = load_manifest(shard_dir)
    _check_seq_len(manifest.max_seq_len, max_seq_len, shard_dir)
    with_data = eval_domains(shard_dir, split, domains)
    groups = [[n] for n in with_data] if per_domain else [with_data]
    evaluators = []
    for group in groups:
        label = f"val/{group[0]}" if per_domain else "val/all"
        loader = build_heldout_dataloader(
            shard_dir=shard_dir,
            domains=group,
            device_batch_size=device_batch_size,
            pad_token_id=pad_token_id,
            max_seq_len=max_seq_len,
            remote=remote,
            split=split,
            guide_fraction=guide_fraction,
            what=f"evaluator {label}",
        )
        evaluators.append(
            Evaluator(
                label=label,
                dataloader=loader,
                metric_names=["LanguageCrossEntropy", "LanguagePerplexity"],
                subset_num_batches=subset_num_batches,
            )
        )
    return evaluators


def _check_pool_fits_split(
    dataset: DomainStreamingDataset, device_batch_size: int, drop_last: bool, *, shard_dir: str, split: str
) -> None:
    # Each rank reads ceil(epoch_size / ranks) samples an epoch, in batches of device_batch_size;
    # with drop_last and fewer samples than one batch the loader yields nothing, and Composer
    # starts epoch after empty epoch without ever reaching max_duration.
    from composer.utils import dist

    if not drop_last or dataset.length >= device_batch_size:
        return
    ranks = dist.get_world_size()
    raise ValueError(
        f"the candidate pool of {device_batch_size * ranks} examples a step ({device_batch_size} per rank x {ranks} ranks = global_train_batch_size x algorithms.data_selection.oversampling) is larger than the {dataset.epoch_size} samples an epoch of the {split!r} split in {shard_dir} ({dataset.length} per rank): the loader would yield no batch and the run would hang; lower global_train_batch_size or oversampling so that the pool is at most {dataset.length} examples per rank, or shard more data (or raise train_loader.dataset.epoch_size)"
    )


def _check_seq_len(shard_len: int, run_len: int, shard_dir: str) -> None:
    if shard_len != run_len:
        raise ValueError(
            f"max_seq_len {run_len} does not match the shards in {shard_dir} (manifest max_seq_len {shard_len}); "
            "re-shard or set max_seq_len to match"
        )
