"""Collators: shapes, prompt masking, padding and domain ids."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.collators import FinetuneCollator, PretrainCollator


def test_pretrain_collator_pads_short_tail_and_masks_it():
    samples = [
        {"input_ids": np.arange(1, 9, dtype=np.int32), "domain_id": 2},
        {"input_ids": np.array([5, 6, 7], dtype=np.int32), "domain_id": 0},
    ]
    b = PretrainCollator(pad_token_id=99, max_seq_len=8)(samples)
    assert b["input_ids"].shape == (2, 8)
    assert b["domain_id"].tolist() == [2, 0]
    assert b["input_ids"][1].tolist() == [5, 6, 7] + [99] * 5
    assert b["attention_mask"][1].tolist() == [1, 1, 1] + [0] * 5
    assert b["labels"][1].tolist() == [5, 6, 7] + [-100] * 5
    assert torch.equal(b["labels"][0], b["input_ids"][0])


def test_finetune_collator_masks_prompt_and_keeps_response():
    samples = [
        {"prompt_ids": np.array([1, 2, 3]), "response_ids": np.array([4, 5, 0]), "domain_id": 1},
        {"prompt_ids": np.array([7]), "response_ids": np.array([8, 0]), "domain_id": 3},
    ]
    b = FinetuneCollator(pad_token_id=9, max_seq_len=32, pad_to_multiple_of=4)(samples)
    assert b["input_ids"].shape == (2, 8)
    assert b["input_ids"][0, :6].tolist() == [1, 2, 3, 4, 5, 0]
    assert b["labels"][0, :6].tolist() == [-100, -100, -100, 4, 5, 0]
    assert b["labels"][1, :3].tolist() == [-100, 8, 0]
    assert (b["labels"][1, 3:] == -100).all() and (b["attention_mask"][1, 3:] == 0).all()
    assert b["domain_id"].tolist() == [1, 3]


def test_finetune_collator_cuts_prompt_from_the_left_when_too_long():
    samples = [{"prompt_ids": np.arange(10, 20), "response_ids": np.array([1, 2, 3]), "domain_id": 0}]
    b = FinetuneCollator(pad_token_id=0, max_seq_len=6, pad_to_multiple_of=1)(samples)
    assert b["input_ids"][0].tolist() == [17, 18, 19, 1, 2, 3]
    assert b["labels"][0].tolist() == [-100, -100, -100, 1, 2, 3]
