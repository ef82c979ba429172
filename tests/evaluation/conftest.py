"""Fixtures for the evaluation tests: an offline tokenizer and a tiny saved Llama that covers it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.common.models import tiny_llama
from tests.common.paths import REPO_ROOT

ASSET_TOKENIZER = REPO_ROOT / "assets" / "tokenizer"


def build_tokenizer(tmp_dir: Path):
    """The committed demo tokenizer, or (before it exists) a throwaway byte-level BPE trained here."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (ASSET_TOKENIZER / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(ASSET_TOKENIZER, local_files_only=True)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["Below is an instruction. The answer is: 18", "### Response: Let's think"], trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    hf.save_pretrained(tmp_dir / "tokenizer")
    return hf


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    """A seeded tiny Llama + tokenizer saved with save_pretrained (vocab = len(tokenizer))."""
    out = tmp_path_factory.mktemp("tiny_llama")
    model = tiny_llama(
        seed=0,
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
    )
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
