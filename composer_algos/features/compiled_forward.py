"""The scoring forward's blocks below the cut, compiled (`features.compile_forward`; issue 31.2).

The scoring forward runs every block below the cut without autograd (`capture.truncated_graph`):
pure inference on shapes that are fixed for a run (the pool's windows, the validation rows). Eager,
each block is about 40 small kernels (norms, rotary, attention, MLP) on a few thousand tokens, and a
GPU step is bound by launching them. Compiled, every block of the same shape shares one graph
(`torch.compile` treats a module's parameters as the graph's inputs), whose pointwise ops fuse into
a few kernels around the matrix products; on CUDA in mode `reduce-overhead` the graph is replayed as
a CUDA graph.

Only the scoring forward sees the compiled blocks: they are put in the block list for the length of
`swapped()` and the original modules put back after it, so the training forward, checkpoints and
every `named_modules()` outside a scoring forward are as before. The blocks from the cut up (they
record the graph the features' backward needs) stay eager.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from composer_algos.features.targets import find_blocks

__all__ = ["CompiledBlocksBelowCut"]


class CompiledBlocksBelowCut:
    """Compiled stand-ins of the blocks below `cut_module`, swapped into the model for a scoring forward.

    Args:
        model: the unwrapped model (`targets.unwrap_model`).
        cut_module: `targets.choose_cut_module`'s module: a block, or a module above the blocks
            (then every block is below it).
        mode: `torch.compile`'s mode; None: `reduce-overhead` when the model is on CUDA, else the default.

    Raises:
        ValueError: when a block below the cut is wrapped (FSDP unit, activation checkpointing): the
            wrapper's own forward must run, which a compiled block would bypass.
    """

    def __init__(self, model: nn.Module, cut_module: nn.Module, *, mode: str | None = None) -> None:
        _, blocks = find_blocks(model)
        index = next((i for i, b in enumerate(blocks) if b is cut_module), len(blocks))
        wrapped = sorted({type(b).__name__ for b in list(blocks)[:index] if _is_wrapper(b)})
        if wrapped:
            raise ValueError(
                f"features.compile_forward: the blocks below the cut are wrapped ({', '.join(wrapped)}); "
                f"compile_forward needs plain blocks (no per-block FSDP unit or activation checkpointing), "
                f"set it to false"
            )
        on_cuda = next(model.parameters()).is_cuda
        self.mode = mode if mode is not None else ("reduce-overhead" if on_cuda else None)
        self.blocks = blocks
        self.below = index
        self.compiled = [torch.compile(b, dynamic=False, mode=self.mode) for b in list(blocks)[:index]]

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The compiled blocks stand in for the originals inside the context; the originals are put back after."""
        originals = list(self.blocks)[: self.below]
        if self.mode == "reduce-overhead":
            # Each scoring forward is a new generation of CUDA graph outputs: the last one's are consumed.
            torch.compiler.cudagraph_mark_step_begin()
        try:
            for i, block in enumerate(self.compiled):
                self.blocks[i] = block
            yield
        finally:
            for i, block in enumerate(originals):
                self.blocks[i] = block


def _is_wrapper(module: nn.Module) -> bool:
    """An FSDP unit or an activation-checkpoint wrapper (both hold the real block as a child)."""
    name = type(module).__name__
    # FSDP2's fully_shard swaps the block's class for an "FSDP<Class>" subclass with its own hooks.
    return name in ("FullyShardedDataParallel", "CheckpointWrapper", "OffloadWrapper") or name.startswith("FSDP")
