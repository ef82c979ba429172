"""Evaluation that runs the frozen blocks below the LoRA adapters once per input, not once per run.

With adapters only in the top k blocks (`model.lora.top_blocks`), the embedding and the blocks below
them hold no trainable parameter: on a fixed evaluation set their outputs are the same after every
training step and in every run that starts from the same pretrained weights. A study evaluates the
same held-out examples and questions in dozens of runs, and on CPU those frozen blocks are most of
an evaluation's cost (26 of SmolLM2-135M's 30 blocks under the study's 4 adapted ones).
`FrozenPrefixCache` hooks the decoder so that an evaluation forward (inside `evaluation_forwards()`,
which `DomainCausalLM.eval_forward` and the answer-accuracy callback enter; module in eval mode,
autograd off) whose input it has seen before skips those blocks: the first time, their output (and, when the
forward fills a KV cache, as the prefill of `generate` does, their keys and values) is written to a
directory, keyed by everything it depends on; afterwards it is read back and the blocks are replaced,
for that forward only, by stubs that hand it on. The decode steps of generation, training forwards and
selection's scoring pass run the model unchanged. The scoring pass must: it too runs the frozen blocks
in eval mode without autograd (`features.capture.truncated_graph`), and a study's runs score the same
pools at the same steps, so a cache there would make selection cheaper in a study than in use and
bias every equal-compute comparison. Hence the explicit context rather than "eval mode, no grad".

The key: a digest of the frozen weights (embedding, the blocks, their buffers), the block count, the
input ids, attention mask and position ids, whether a KV cache is filled, the device type, the autocast
state, the attention implementation and the thread count (CPU kernels may round differently with more
threads), so a replayed forward computes what the model would, bit for bit (tests compare).

Legend: B batch, T sequence, H hidden size.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = ["FrozenPrefixCache", "evaluation_forwards", "install_frozen_prefix_cache"]

_EVALUATING: ContextVar[bool] = ContextVar("frozen_prefix_evaluating", default=False)


@contextmanager
def evaluation_forwards() -> Iterator[None]:
    """The forwards inside are evaluation (held-out loss, generation): the only ones the cache may serve."""
    token = _EVALUATING.set(True)
    try:
        yield
    finally:
        _EVALUATING.reset(token)


class FrozenPrefixCache:
    """Disk cache of the frozen bottom blocks' outputs for evaluation forwards (module docstring).

    Args:
        decoder: the transformers decoder (`get_decoder()`, e.g. `LlamaModel`) with `embed_tokens`
            and a `layers` ModuleList whose first `n_frozen` blocks hold no trainable parameter.
        n_frozen: how many bottom blocks are frozen (the model's depth minus `lora.top_blocks`).
        cache_dir: where the entries are written (shared by every run that evaluates the same inputs;
            writes are atomic, so concurrent runs may share it).

    Attributes:
        hits, misses: evaluation forwards replayed from the cache and recorded into it.
    """

    def __init__(self, decoder: torch.nn.Module, n_frozen: int, cache_dir: str | os.PathLike) -> None:
        layers = check_frozen_blocks(decoder, n_frozen, "model.eval_prefix_cache")
        self.decoder, self.n_frozen = decoder, n_frozen
        self.cache_dir = Path(cache_dir)
        self.hits = self.misses = 0
        self._digest: str | None = None
        self._active: dict[str, Any] | None = None  # the forward in progress: its key, mode and cache object
        self._recorded: torch.Tensor | None = None
        self._originals: list[torch.nn.Module] = []  # the frozen blocks while stubs stand in for them
        decoder.register_forward_pre_hook(self._before, with_kwargs=True)
        decoder.register_forward_hook(self._after, with_kwargs=True, always_call=True)
        layers[n_frozen - 1].register_forward_hook(self._record_output)

    # -- hooks ---------------------------------------------------------------------------------------

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._active, self._recorded = None, None
        if not _EVALUATING.get() or module.training or torch.is_grad_enabled():
            return  # outside evaluation (training, the scoring pass): the model as it is
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        past = kwargs.get("past_key_values")
        if input_ids is None or kwargs.get("inputs_embeds") is not None:
            return
        if past is not None and past.get_seq_length() > 0:
            return  # a decode step of generation: one new token through every block
        use_cache = kwargs.get("use_cache")
        use_cache = bool(getattr(module.config, "use_cache", False) if use_cache is None else use_cache)
        key = self._key(input_ids, kwargs.get("attention_mask"), kwargs.get("position_ids"), use_cache)
        path = self.cache_dir / key[:2] / f"{key}.pt"
        if path.exists():
            entry = torch.load(path, map_location=input_ids.device, weights_only=True)
            self.hits += 1
            self._active = {"mode": "replay", "path": path}
            self._swap_in(entry)
        else:
            self.misses += 1
            self._active = {"mode": "record", "path": path, "use_cache": use_cache}

    def _record_output(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._active is not None and self._active["mode"] == "record":
            self._recorded = output[0] if isinstance(output, tuple) else output
            self._active["tuple"] = isinstance(output, tuple)

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        active, self._active = self._active, None
        if active is None:
            return
        if active["mode"] == "replay":
            self._swap_out()
            return
        past = getattr(output, "past_key_values", None)
        if self._recorded is None or output is None or (active["use_cache"] and past is None):
            self._recorded = None
            return  # the forward failed: record nothing rather than an entry without its keys and values
        entry: dict[str, Any] = {"hidden": self._recorded.detach().cpu(), "tuple": active["tuple"]}
        if active["use_cache"]:
            kv = [past[i] for i in range(self.n_frozen)]
            entry["keys"] = [k.detach().cpu() for k, _ in kv]
            entry["values"] = [v.detach().cpu() for _, v in kv]
        self._recorded = None
        _save_atomic(entry, active["path"])

    # -- replay --------------------------------------------------------------------------------------

    def _swap_in(self, entry: dict[str, Any]) -> None:
        layers = self.decoder.layers
        self._originals = [layers[i] for i in range(self.n_frozen)]
        for i in range(self.n_frozen):
            layers[i] = _ReplayBlock(i, entry, last=i == self.n_frozen - 1)

    def _swap_out(self) -> None:
        for i, layer in enumerate(self._originals):
            self.decoder.layers[i] = layer
        self._originals = []

    # -- the key -------------------------------------------------------------------------------------

    def _key(self, input_ids: torch.Tensor, attention_mask: Any, position_ids: Any, use_cache: bool) -> str:
        h = hashlib.sha256()
        device = input_ids.device.type
        autocast = torch.is_autocast_enabled(device) if device in ("cuda", "cpu") else False
        autocast_dtype = torch.get_autocast_dtype(device) if autocast else None
        attn = getattr(self.decoder.config, "_attn_implementation", None)
        h.update(repr((self.weights_digest(), self.n_frozen, device, str(autocast_dtype), attn, use_cache,
                       torch.get_num_threads(), torch.__version__)).encode())
        for t in (input_ids, attention_mask, position_ids):
            if isinstance(t, torch.Tensor):
                host = t.detach().cpu()  # one host transfer per evaluation forward (not a training path)
                h.update(repr((tuple(host.shape), str(host.dtype))).encode())
                h.update(host.contiguous().numpy().tobytes())
            else:
                h.update(b"none")
        return h.hexdigest()

    def weights_digest(self) -> str:
        """A digest of the frozen part's parameters and buffers (computed once; they may not train)."""
        if self._digest is None:
            modules = [("embed_tokens", self.decoder.embed_tokens)]
            modules += [(f"layers.{i}", self.decoder.layers[i]) for i in range(self.n_frozen)]
            if hasattr(self.decoder, "rotary_emb"):
                modules.append(("rotary_emb", self.decoder.rotary_emb))
            h = hashlib.sha256()
            for prefix, m in modules:
                for name, t in [*m.named_parameters(), *m.named_buffers()]:
                    if t.requires_grad:
                        raise ValueError(
                            f"model.eval_prefix_cache: {prefix}.{name} is trainable; the cache needs the blocks below "
                            f"the adapters frozen (model.lora.top_blocks)"
                        )
                    host = t.detach().cpu().contiguous()
                    h.update(repr((prefix, name, tuple(host.shape), str(host.dtype))).encode())
                    h.update(host.view(torch.uint8).numpy().tobytes() if host.numel() else b"")
            self._digest = h.hexdigest()
        return self._digest


def install_frozen_prefix_cache(causal_lm: torch.nn.Module, n_frozen: int, cache_dir: str | os.PathLike) -> FrozenPrefixCache:
    """Hook a transformers causal LM (or a peft model around one) with a `FrozenPrefixCache`."""
    return FrozenPrefixCache(decoder_of(causal_lm, "model.eval_prefix_cache"), n_frozen, cache_dir)


def decoder_of(causal_lm: torch.nn.Module, option: str) -> torch.nn.Module:
    """The decoder (`get_decoder()`) of a transformers causal LM or a peft model around one; `option` names the
    setting that needs it in the error."""
    base = causal_lm.get_base_model() if hasattr(causal_lm, "get_base_model") else causal_lm
    if not hasattr(base, "get_decoder"):
        raise ValueError(f"{option} needs a decoder-only model with get_decoder; {type(base).__name__} has none")
    return base.get_decoder()


def check_frozen_blocks(decoder: torch.nn.Module, n_frozen: int, option: str) -> torch.nn.ModuleList:
    """The decoder's block list, after checking it has `embed_tokens`, blocks, and 1 to depth - 1 frozen ones."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not hasattr(decoder, "embed_tokens"):
        raise ValueError(
            f"{option} needs a decoder with `embed_tokens` and a `layers` list of blocks; {type(decoder).__name__} has none"
        )
    if not 0 < n_frozen < len(layers):
        raise ValueError(f"{option}: {n_frozen} frozen blocks of {len(layers)}; needs 1 to {len(layers) - 1}")
    return layers


class _ReplayBlock(torch.nn.Module):
    """Stands in for frozen block `index` during one replayed forward: fills its KV, hands the recorded output on."""

    def __init__(self, index: int, entry: dict[str, Any], *, last: bool) -> None:
        super().__init__()
        self.index, self.entry, self.last = index, entry, last

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        past = kwargs.get("past_key_value")
        if past is not None and "keys" in self.entry:
            past.update(self.entry["keys"][self.index], self.entry["values"][self.index], self.index)
        out = self.entry["hidden"] if self.last else hidden_states
        return (out,) if self.entry["tuple"] else out


def _save_atomic(entry: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        torch.save(entry, tmp)
        os.replace(tmp, path)  # concurrent runs writing the same key write the same bytes; the last one wins
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
