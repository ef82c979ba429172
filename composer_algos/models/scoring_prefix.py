"""The frozen blocks' output on the selected rows, handed from the scoring pass to the training forward.

With LoRA adapters only in the top blocks (`model.lora.top_blocks`), the embedding and the blocks
below the lowest adapted one hold no trainable parameter. A selection step's scoring pass runs every
pool row through them (without autograd), and the training forward then runs the selected rows
through them again, with the same weights, to the same output. With `model.reuse_scoring_prefix:
true` the scoring pass records that output for the pool rows (`ScoringPrefix.recording`), the
selection puts the selected rows' share of it in the training batch (`PREFIX_KEY`, one more
per-example field, so Composer's microbatches split it with the rows), and the training forward
hands it on past those blocks (`ScoringPrefix.handing_on`): stubs stand in for the frozen blocks for
that forward only, the last one returning the recorded output. The blocks from the adapters up run
as before, so the gradients are the same computation; the frozen part's output differs from a fresh
forward only by the rounding of a batch of different size.

Only where the scoring pass saw whole rows of this rank's pool: local selection scope (under global
scope rows move between ranks), no `score_window` or `score_tokens` (those score part of a row), no
FSDP, a step whose scoring pass ran (not a step of a strategy without features). Elsewhere the
training forward runs every block, as without the option.

Legend: B rows, T tokens, H hidden size.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from composer_algos.models.frozen_prefix import check_frozen_blocks, decoder_of

__all__ = ["PREFIX_KEY", "ScoringPrefix", "install_scoring_prefix"]

#: The training batch's field holding the selected rows' frozen-prefix output, (B, T, H).
PREFIX_KEY = "scoring_prefix_hidden"


class ScoringPrefix:
    """Records the frozen blocks' output in the scoring pass and hands it on in the training forward.

    Args:
        decoder: the transformers decoder (`get_decoder()`, e.g. `LlamaModel`) with `embed_tokens` and a
            `layers` list whose first `n_frozen` blocks hold no trainable parameter.
        n_frozen: the frozen blocks (the model's depth minus `lora.top_blocks`).

    Raises:
        ValueError: a decoder without `layers`, or `n_frozen` outside 1 .. depth - 1.
    """

    def __init__(self, decoder: torch.nn.Module, n_frozen: int) -> None:
        layers = check_frozen_blocks(decoder, n_frozen, "model.reuse_scoring_prefix")
        self.decoder, self.n_frozen = decoder, n_frozen
        self._parts: list[torch.Tensor] | None = None  # the outputs while recording
        self._recorded: list[torch.Tensor] = []  # those of the last recording
        self._tuple = True  # whether a block returns a tuple (transformers' decoder layers of this version do)
        self.handed_on = 0  # training forwards that skipped the frozen blocks
        layers[n_frozen - 1].register_forward_hook(self._record)

    def check_frozen(self) -> None:
        """Raise when a parameter of the embedding or of the blocks below the adapters is trainable."""
        modules = [("embed_tokens", self.decoder.embed_tokens)]
        modules += [(f"layers.{i}", self.decoder.layers[i]) for i in range(self.n_frozen)]
        for prefix, module in modules:
            for name, p in module.named_parameters():
                if p.requires_grad:
                    raise ValueError(
                        f"model.reuse_scoring_prefix: {prefix}.{name} is trainable; handing the scoring pass's output "
                        f"on needs the blocks below the adapters frozen (model.lora.top_blocks)"
                    )

    # -- the scoring pass ----------------------------------------------------------------------------

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record the last frozen block's output of every forward inside (the scoring pass's)."""
        self._parts, self._recorded = [], []
        try:
            yield
        finally:
            self._recorded, self._parts = self._parts, None

    def take(self, n_rows: int, n_total: int) -> torch.Tensor | None:
        """The first `n_rows` of the last `n_total` rows of the last recording (the pool's, when the pass scored
        the pool, then `n_total - n_rows` validation rows; a retry after an out-of-memory error scores them all
        again), or None when fewer were recorded. Forgets the recording."""
        parts, self._recorded = self._recorded, []
        total = sum(int(p.shape[0]) for p in parts)
        if total < n_total:
            return None
        # The rows [start, start + n_rows) of the recorded sequence, from the forwards that hold them (the
        # validation rows may be padded to another length: they are never concatenated with the pool's).
        start, pos, pieces = total - n_total, 0, []
        for part in parts:
            lo, hi = pos, pos + int(part.shape[0])
            a, b = max(lo, start), min(hi, start + n_rows)
            if a < b:
                pieces.append(part[a - lo : b - lo])
            pos = hi
        if not _same_length(pieces):
            return None
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _record(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._parts is None:
            return
        self._tuple = isinstance(output, tuple)
        self._parts.append((output[0] if self._tuple else output).detach())

    # -- the training forward ------------------------------------------------------------------------

    @contextmanager
    def handing_on(self, hidden_BTH: torch.Tensor) -> Iterator[None]:
        """The frozen blocks replaced, for the forwards inside, by stubs that hand `hidden_BTH` on."""
        layers = self.decoder.layers
        originals = [layers[i] for i in range(self.n_frozen)]
        for i in range(self.n_frozen):
            layers[i] = _HandOn(hidden_BTH if i == self.n_frozen - 1 else None, self._tuple)
        self.handed_on += 1
        try:
            yield
        finally:
            for i, block in enumerate(originals):
                layers[i] = block


def install_scoring_prefix(causal_lm: torch.nn.Module, n_frozen: int) -> ScoringPrefix:
    """A `ScoringPrefix` on a transformers causal LM (or a peft model around one)."""
    prefix = ScoringPrefix(decoder_of(causal_lm, "model.reuse_scoring_prefix"), n_frozen)
    prefix.check_frozen()
    return prefix


def _same_length(parts: list[torch.Tensor]) -> bool:
    return len({tuple(p.shape[1:]) for p in parts}) == 1


class _HandOn(torch.nn.Module):
    """Stands in for a frozen block in one training forward: passes its input on, or (the last) the recorded output."""

    def __init__(self, hidden_BTH: torch.Tensor | None, as_tuple: bool) -> None:
        super().__init__()
        self.hidden_BTH, self.as_tuple = hidden_BTH, as_tuple

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = hidden_states if self.hidden_BTH is None else self.hidden_BTH.to(hidden_states.dtype)
        return (out,) if self.as_tuple else out
