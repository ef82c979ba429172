"""`score_window`: score each row of a (packed) batch on a window of t tokens, run as its own sequence.

On long packed sequences (pretraining: S = 1024-8192 tokens a row, every position a target) the
forward of the pool dominates the scoring cost; scoring a window of t tokens instead of S divides
that forward by about S / t (OPUS, arXiv 2602.05400, scores a random 512-token window of each
6144-token sequence).

Which context a window sees: none. The window at position p is cut out and scored as a sequence of
its own (positions renumbered from 0, nothing before p attended to), as OPUS does. Giving it its
left context would need the forward of the p tokens before it (a key/value cache of the prefix
costs that forward), which is the cost the window exists to avoid; and with a random p the mean
cost would be about S / 2 positions again. The price is that the window's first tokens are
predicted from little context, so their losses (and gradients) are those of a document start; the
features still measure which direction the model would move on that text. `tools/window_fidelity.py`
measures how much of the full-length selection a window keeps (docs/data_selection.md, Windowed
scoring).

Positions: `start` takes each row's first t tokens (a slice, no copy). `random` draws one position a
row, uniform over the starts that keep the window inside the row's tokens (`attention_mask`, right
padding), from a generator seeded by `(seed, step, stream)` only: every rank draws the same vector
for the whole global pool and takes its own rows (`row_offset`), and a resumed run draws the same
windows at the same step. A row no longer than t is kept whole (from position 0).

Shapes: n rows, T tokens, t window length.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from composer_algos.losses import mask_and_labels
from composer_algos.seeding import mix_seed

__all__ = ["WINDOW_POSITIONS", "score_window_problems", "take_windows", "window_batch", "window_positions"]

WINDOW_POSITIONS = ("start", "random")

# The batch fields the scoring forward reads; each is (n, T) and windowed together.
_SEQUENCE_KEYS = ("input_ids", "attention_mask", "labels")

# Folded into the window generator's seed so it never coincides with another per-step generator of
# the same (seed, step) (validation draws, capacities).
_WINDOW_SALT = 0x57494E44  # "WIND"

# Streams: the pool and the validation batch draw their windows independently.
POOL_STREAM, VALIDATION_STREAM = 0, 1


def score_window_problems(score_window: object, position: object, score_tokens: object = None) -> list[str]:
    """Why the window options are invalid (empty when valid)."""
    problems = []
    if score_window is not None and not (
        isinstance(score_window, int) and not isinstance(score_window, bool) and score_window >= 2
    ):
        problems.append(
            f"`score_window` must be None (score whole rows) or an int >= 2 (tokens a window: a window of "
            f"t tokens holds t - 1 next-token targets), got {score_window!r}"
        )
    if position not in WINDOW_POSITIONS:
        problems.append(f"`score_window_position` must be one of {list(WINDOW_POSITIONS)}, got {position!r}")
    if score_window is not None and score_tokens is not None:
        problems.append(
            f"`score_window` ({score_window!r}) and `score_tokens` ({score_tokens!r}) cannot both be set: "
            "`score_tokens` keeps each example's first target tokens (fine-tuning answers), `score_window` "
            "a window of positions of a packed row (pretraining); choose one"
        )
    return problems


def window_positions(
    lengths_n: torch.Tensor,
    t: int,
    *,
    position: str,
    seed: int,
    step: int,
    stream: int = POOL_STREAM,
    row_offset: int = 0,
) -> torch.Tensor:
    """Each row's window start (n,) long, on `lengths_n`'s device.

    Args:
        lengths_n: tokens of each row (the attention mask's row sums), (n,).
        t: window length.
        position: `start` (0 for every row) or `random` (uniform over `0 .. max(length - t, 0)`).
        seed, step, stream: seed the draw; nothing else (not the rank) enters it.
        row_offset: this batch's first row in the global pool (rank x rows per rank): the draw is
            one vector over the global pool, of which this batch takes rows `row_offset ..
            row_offset + n`.

    No host sync: the uniforms are drawn on the CPU (seeded generator) and moved without blocking.
    """
    n = int(lengths_n.shape[0])
    if position == "start":
        return torch.zeros(n, dtype=torch.long, device=lengths_n.device)
    if position != "random":
        raise ValueError(f"window position must be one of {list(WINDOW_POSITIONS)}, got {position!r}")
    if row_offset < 0:
        raise ValueError(f"row_offset must be >= 0, got {row_offset}")
    gen = torch.Generator().manual_seed(mix_seed(seed, step, _WINDOW_SALT, stream))
    u_n = torch.rand(row_offset + n, generator=gen, dtype=torch.float64)[row_offset:]
    u_n = u_n.to(lengths_n.device, non_blocking=True)
    starts_n = (lengths_n.long() - t).clamp_min(0) + 1  # number of admissible starts
    return torch.floor(u_n * starts_n.double()).long().clamp_max(starts_n - 1)


def take_windows(batch: Mapping[str, torch.Tensor], t: int, starts_n: torch.Tensor) -> dict[str, torch.Tensor]:
    """The batch with each row cut to `t` tokens from its start (a new dict; other fields passed through).

    `input_ids`, `attention_mask` and `labels` (defaults as `losses.mask_and_labels`; a batch
    without a mask, i.e. without padding, gets none) become (n, t).
    With `t >= T` the batch is returned as given (the same tensors): nothing to cut. All-zero
    starts are a slice (no copy); otherwise one gather per field.
    """
    input_ids = batch["input_ids"]
    T = int(input_ids.shape[1])
    if t >= T:
        return batch  # type: ignore[return-value]
    out = _with_defaults(batch)
    index_nt = starts_n.to(input_ids.device).view(-1, 1) + torch.arange(t, device=input_ids.device)
    for key in _SEQUENCE_KEYS:
        if key in out:
            out[key] = out[key].gather(1, index_nt)
    return out


def _with_defaults(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A new dict of the batch with its labels filled in; a missing mask (no padding) stays missing."""
    out = dict(batch)  # the mask, when there is one, as it is
    if out.get("labels") is None:
        out["labels"] = mask_and_labels(batch)[1]
    return out


def window_batch(
    batch: Mapping[str, torch.Tensor],
    t: int | None,
    *,
    position: str,
    seed: int,
    step: int,
    stream: int,
    row_offset: int = 0,
) -> Mapping[str, torch.Tensor]:
    """`batch` scored on windows of `t` tokens (`batch` itself when `t` is None or covers the rows)."""
    if t is None or t >= int(batch["input_ids"].shape[1]):
        return batch
    if position == "start":
        out = _with_defaults(batch)
        for key in _SEQUENCE_KEYS:
            if key in out:
                out[key] = out[key][:, :t]
        return out
    mask, _ = mask_and_labels(batch)
    starts_n = window_positions(
        mask.sum(dim=1), t, position=position, seed=seed, step=step, stream=stream, row_offset=row_offset
    )
    return take_windows(batch, t, starts_n)
