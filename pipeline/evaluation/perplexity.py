"""Per-domain validation log-perplexity of a causal LM on domain-tagged shards."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm import tqdm

from pipeline.collators import build_collator
from pipeline.dataset import DomainStreamingDataset, split_samples
from pipeline.holdout import DEFAULT_GUIDE_FRACTION, heldout_subset
from pipeline.manifest import load_manifest

log = logging.getLogger(__name__)

__all__ = ["domain_log_perplexity", "format_ppl_table"]


@torch.no_grad()
def domain_log_perplexity(
    model: torch.nn.Module,
    *,
    shard_dir: str,
    pad_token_id: int,
    split: str = "val",
    domains: Sequence[str] | None = None,
    batch_size: int = 16,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
    show_progress: bool = True,
    guide_fraction: float = DEFAULT_GUIDE_FRACTION,
) -> dict[str, dict[str, float]]:
    """Token-weighted mean next-token cross-entropy (log-perplexity) per domain.

    The same quantity as Composer's `LanguageCrossEntropy` metric in `train.py`'s per-domain
    evaluators: summed over every target token (labels != -100) of the domain, divided by the
    number of those tokens.

    Args:
        model: A Hugging Face causal LM (in eval mode for the call; its mode is restored).
        shard_dir: Output directory of `tools/shard.py`.
        pad_token_id: Padding id for the collator.
        split: Which split (default `val`).
        domains: Restrict to these domains.
        batch_size: Sequences per forward.
        max_batches: Stop each domain after this many batches (None: all).
        device: Where to run (default: the model's device).
        show_progress: tqdm bar per domain.
        guide_fraction: Leave out this share of each domain's split, the part validation-guided
            selection draws from (`pipeline.holdout`), as the training evaluators do (default
            0.5); 0 scores the whole split.

    Returns:
        {domain: {"log_ppl": ..., "ppl": ..., "tokens": ...}}.

    Raises:
        ValueError: no domain has samples in `split`.
    """
    manifest = load_manifest(shard_dir)
    names = list(domains) if domains is not None else manifest.domain_names
    names = [n for n in names if split_samples(manifest.domains[manifest.domain_index(n)], split) > 0]
    if not names:
        raise ValueError(f"{shard_dir}: no domain has samples in split {split!r}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    collate = build_collator(manifest.mode, pad_token_id=pad_token_id, max_seq_len=manifest.max_seq_len)
    was_training = model.training
    model.eval()
    out: dict[str, dict[str, float]] = {}
    try:
        for name in names:
            ds = DomainStreamingDataset(
                shard_dir=shard_dir, split=split, domains=[name], shuffle=False, batch_size=batch_size
            )
            heldout = heldout_subset(ds, guide_fraction, what=f"ppl {name}")
            loader = DataLoader(heldout, batch_size=batch_size, collate_fn=collate)
            total = torch.zeros((), dtype=torch.float64, device=device)
            count = torch.zeros((), dtype=torch.long, device=device)
            bar = tqdm(loader, desc=f"ppl {name}", disable=not show_progress, leave=False)
            for i, batch in enumerate(bar):
                if max_batches is not None and i >= max_batches:
                    break
                logits = model(
                    input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
                ).logits
                labels = batch["labels"].to(device)[:, 1:]
                loss = F.cross_entropy(
                    logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                    labels.reshape(-1),
                    ignore_index=-100,
                    reduction="sum",
                )
                total += loss.double()
                count += (labels != -100).sum()
            tokens = int(count)
            log_ppl = float(total) / max(tokens, 1)
            out[name] = {"log_ppl": log_ppl, "ppl": math.exp(min(log_ppl, 50.0)), "tokens": tokens}
    finally:
        model.train(was_training)
    return out


def format_ppl_table(results: dict[str, dict[str, float]]) -> str:
    """Per-domain log-perplexity with the unweighted average over domains."""
    width = max(len(n) for n in results) + 2
    lines = [f"{'domain':<{width}}{'log-ppl':>10}{'ppl':>12}{'tokens':>10}"]
    for name, r in results.items():
        lines.append(f"{name:<{width}}{r['log_ppl']:>10.4f}{r['ppl']:>12.2f}{r['tokens']:>10d}")
    avg = sum(r["log_ppl"] for r in results.values()) / len(results)
    lines.append(f"{'average':<{width}}{avg:>10.4f}{math.exp(min(avg, 50.0)):>12.2f}")
    return "\n".join(lines)
