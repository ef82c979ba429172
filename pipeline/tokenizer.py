"""Loads a Hugging Face tokenizer by local path, hub name or GGUF file and makes sure it has EOS and padding tokens."""

from __future__ import annotations

import difflib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.gguf import resolve_pretrained

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = ["DEMO_TOKENIZER", "load_tokenizer", "missing_local_directory"]

# The small byte-level BPE tokenizer committed with the project (tools/train_tokenizer.py).
DEMO_TOKENIZER = str(Path(__file__).resolve().parents[1] / "assets" / "tokenizer")


def missing_local_directory(name: str) -> str | None:
    """Why `name` names a local directory that does not exist, or None (it exists, or reads as a hub name).

    A path that starts from the filesystem (``/``, ``./``, ``../``, ``~``), or whose parent directory exists here
    (``assets/tokenizr``), is meant to be local: `from_pretrained` would instead ask the hub for it, which on a
    machine without network retries for about a minute before failing."""
    path = Path(name).expanduser()
    if path.exists() or not name or "://" in name:
        return None
    local = name.startswith(("/", "./", "../", "~")) or (len(path.parts) > 1 and path.parent.is_dir())
    if not local:
        return None
    near = ""
    if path.parent.is_dir():
        names = [p.name for p in path.parent.iterdir() if p.is_dir()]
        if close := difflib.get_close_matches(path.name, names, n=1):
            near = f"; did you mean {str(path.parent / close[0])!r}?"
    return f"no such directory (its parent {str(path.parent)!r} is here{near})" if path.parent.is_dir() else "no such directory"


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

    source = resolve_pretrained(name_or_path, field="tokenizer")
    if problem := missing_local_directory(source):
        raise ValueError(f"`tokenizer` {str(name_or_path)!r}: {problem}")
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
