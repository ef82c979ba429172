"""Keep transformers' causal fast path for unpacked rows (no attention mask, no position ids).

Transformers 4.53.1 and later (the stack allows up to 4.53.x) look for packed sequences in the
position ids whenever a forward has no attention mask and no KV cache: the case of every
training, loss and scoring forward here, which pass `use_cache=False`. The model's default position
ids (`arange`) are then turned into a packed-sequence mask that, although it packs nothing,
disables SDPA's causal skip: every forward builds a (B, 1, T, T) boolean mask and every attention
layer takes it (huggingface/transformers#41856; fixed upstream in #42367, after this stack's
pin). On CUDA that costs the flash kernel (the masked kernels run instead) and T^2 bytes a row; on
any device about a dozen extra aten ops a layer (the mask's slices, its conversion to an additive
bias), each a kernel launch on a GPU.

`unpacked_rows()` restores the causal path for forwards whose rows are not packed: inside it,
transformers' packed-sequence detection reports none, so a forward without an attention mask runs
SDPA with `is_causal=True`, as transformers 4.53.0 and 4.54+ do. The outputs are the same (the
packed mask of default positions is the causal mask; bit for bit on the CPU, tests/training/
test_causal_masks.py). Use it only around forwards that pass no `position_ids`: rows whose
positions encode packing need the detection. Outside the context nothing is changed; on
transformers without packed-sequence detection it does nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

__all__ = ["packs_by_position", "unpacked_rows", "unpacked_rows_for"]

try:  # transformers 4.53+: the mask helpers and their packed-sequence detection
    from transformers import masking_utils as _masking_utils
except ImportError:  # older transformers build masks without the detection
    _masking_utils = None

_DETECTOR = "find_packed_sequence_indices"
_lock = threading.Lock()
_depth = 0  # contexts open (they nest, and may be entered from several threads)
_saved: Any = None  # transformers' own detector while a context is open


def packs_by_position() -> bool:
    """Whether the installed transformers detects packed sequences from position ids (4.53+)."""
    return _masking_utils is not None and callable(getattr(_masking_utils, _DETECTOR, None))


def _no_packing(position_ids: Any) -> None:
    # What `find_packed_sequence_indices` returns where transformers detects no packing.
    return None


@contextmanager
def unpacked_rows() -> Iterator[None]:
    """Forwards inside run as for unpacked rows: no packed-sequence mask, SDPA's causal path (see the module doc)."""
    global _depth, _saved
    if not packs_by_position():
        yield
        return
    with _lock:
        if _depth == 0:
            _saved = getattr(_masking_utils, _DETECTOR)
            setattr(_masking_utils, _DETECTOR, _no_packing)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                setattr(_masking_utils, _DETECTOR, _saved)
                _saved = None


@contextmanager
def unpacked_rows_for(batch: Any) -> Iterator[None]:
    """`unpacked_rows()` where `batch` (a mapping of model inputs) gives no `position_ids`; otherwise nothing."""
    if isinstance(batch, Mapping) and batch.get("position_ids") is not None:
        yield
        return
    with unpacked_rows():
        yield
