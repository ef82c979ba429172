"""Collators that turn domain-tagged MDS samples into causal-LM batches.

Legend: B = batch size, T = padded sequence length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["PretrainCollator", "FinetuneCollator", "build_collator"]

IGNORE_INDEX = -100


class PretrainCollator:
    """Stacks `input_ids` sequences; labels are the inputs (the model shifts them), padding ignored.

    Every pretraining sample is `max_seq_len` tokens except possibly the last one of a domain,
    which holds the remainder: it is right-padded with `pad_token_id` and masked.

    Args:
        pad_token_id: Token used for padding.
        max_seq_len: Pad/truncate every batch to this length (fixed shapes keep compiled and
            per-example feature code simple).
    """

    def __init__(self, *, pad_token_id: int, max_seq_len: int) -> None:
        self.pad_token_id = pad_token_id
        self.max_seq_len = max_seq_len

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        # Built in NumPy, then wrapped (no copy): one torch op per field, none per row.
        ids = [np.asarray(s["input_ids"], dtype=np.int64)[: self.max_seq_len] for s in samples]
        input_ids_BT = np.full((len(ids), self.max_seq_len), self.pad_token_id, dtype=np.int64)
        attention_mask_BT = np.zeros((len(ids), self.max_seq_len), dtype=np.int64)
        for b, seq in enumerate(ids):
            input_ids_BT[b, : len(seq)] = seq
            attention_mask_BT[b, : len(seq)] = 1
        labels_BT = np.where(attention_mask_BT == 0, IGNORE_INDEX, input_ids_BT)
        return {
            "input_ids": torch.from_numpy(input_ids_BT),
            "attention_mask": torch.from_numpy(attention_mask_BT),
            "labels": torch.from_numpy(labels_BT),
            "domain_id": _domain_ids(samples),
            **_sample_ids(samples),
        }


class FinetuneCollator:
    """Concatenates prompt and response ids; the loss is on the response only (prompt labels -100).

    Args:
        pad_token_id: Token used for right padding.
        max_seq_len: Upper bound on the padded length (`tools/shard.py` already truncated
            records to it; anything longer here is cut from the left of the prompt).
        pad_to_multiple_of: Pad the batch's longest sequence up to a multiple of this.
    """

    def __init__(self, *, pad_token_id: int, max_seq_len: int, pad_to_multiple_of: int = 8) -> None:
        self.pad_token_id = pad_token_id
        self.max_seq_len = max_seq_len
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seqs: list[tuple[np.ndarray, int]] = []
        for s in samples:
            prompt = np.asarray(s["prompt_ids"], dtype=np.int64)
            response = np.asarray(s["response_ids"], dtype=np.int64)[: self.max_seq_len]
            keep_prompt = max(0, min(len(prompt), self.max_seq_len - len(response)))
            prompt = prompt[len(prompt) - keep_prompt :]
            seqs.append((np.concatenate([prompt, response]), len(prompt)))
        longest = max(len(s) for s, _ in seqs)
        T = min(self.max_seq_len, -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of)
        # Built in NumPy, then wrapped (no copy): one torch op per field, none per row.
        input_ids_BT = np.full((len(seqs), T), self.pad_token_id, dtype=np.int64)
        labels_BT = np.full((len(seqs), T), IGNORE_INDEX, dtype=np.int64)
        attention_mask_BT = np.zeros((len(seqs), T), dtype=np.int64)
        for b, (seq, n_prompt) in enumerate(seqs):
            input_ids_BT[b, : len(seq)] = seq
            attention_mask_BT[b, : len(seq)] = 1
            labels_BT[b, n_prompt : len(seq)] = seq[n_prompt:]
        return {
            "input_ids": torch.from_numpy(input_ids_BT),
            "attention_mask": torch.from_numpy(attention_mask_BT),
            "labels": torch.from_numpy(labels_BT),
            "domain_id": _domain_ids(samples),
            **_sample_ids(samples),
        }


def build_collator(mode: str, *, pad_token_id: int, max_seq_len: int) -> PretrainCollator | FinetuneCollator:
    """The collator for a shard manifest's `mode` (`pretrain` or `finetune`)."""
    if mode == "pretrain":
        return PretrainCollator(pad_token_id=pad_token_id, max_seq_len=max_seq_len)
    if mode == "finetune":
        return FinetuneCollator(pad_token_id=pad_token_id, max_seq_len=max_seq_len)
    raise ValueError(f"shard mode must be 'pretrain' or 'finetune', got {mode!r}")


def _domain_ids(samples: Sequence[dict[str, Any]]) -> torch.Tensor:
    return torch.tensor([int(s["domain_id"]) for s in samples], dtype=torch.long)


def _sample_ids(samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """`{"sample_id": (B,)}` when every sample carries its dataset index (DomainStreamingDataset does), else {}."""
    if not samples or not all("sample_id" in s for s in samples):
        return {}
    return {"sample_id": torch.tensor([int(s["sample_id"]) for s in samples], dtype=torch.long)}
