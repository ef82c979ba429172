"""Loads a Hugging Face tokenizer by local path, hub name or GGUF file and makes sure it has EOS and padding tokens."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.gguf import resolve_pretrained

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = ["DEMO_TOKENIZER", "load_tokenizer"]

# The small byte-level BPE tokenizer committed with the project (tools/train_tokenizer.py).
DEMO_TOKENIZER = str(Path(__file__).resolve().parents[1] / "assets" / "tokenizer")


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer with `AutoTokenizer.from_pretrained` (a local directory, a hub name or a `.gguf` file).

    A `.gguf` file is converted once to a cached model directory (`pipeline.gguf.gguf_model_dir`), whose
    tokenizer, special tokens and chat template come from the file.

    A tokenizer without a padding token gets its EOS token as padding (Llama-style tokenizers
    ship without one); nothing is added to the vocabulary.

    Args:
        name_or_path: A directory holding tokenizer files (e.g. `assets/tokenizer`), a hub name or a `.gguf` file.

    Returns:
        The tokenizer, with `eos_token_id` and `pad_token_id` set.

    Raises:
        ValueError: If the tokenizer cannot be loaded, or has no EOS token; a `.gguf` file that is not
            GGUF or holds an architecture transformers cannot load.
        FileNotFoundError: A `.gguf` file that does not exist.
        ImportError: A `.gguf` file to convert while the `gguf` package is missing.
    """
    # transformers takes seconds to import: only when a tokenizer is needed, not for --help.
    from transformers import AutoTokenizer

    source = resolve_pretrained(name_or_path, field="tokenizer")  # a missing local directory: ValueError at once
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"`tokenizer` {str(name_or_path)!r} could not be loaded: give a directory with tokenizer files "
            f"(e.g. {DEMO_TOKENIZER!r}) or a hub name that is cached or reachable ({exc})"
        ) from exc
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"`tokenizer` {str(name_or_path)!r} has no EOS token; sequences are separated by EOS, so choose a "
            "tokenizer that defines one"
        )
    if tokenizer.pad_token_id is None:
        logger.info("tokenizer %s has no pad token; using its EOS token %r for padding", name_or_path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
