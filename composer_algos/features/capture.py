"""One truncated forward/backward that captures each target layer's inputs and per-example output-gradients.

Shapes: n examples, T tokens, V vocabulary, I = d_in, O = d_out, D features of one layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn
from torch.profiler import record_function

from composer_algos.causal_masks import unpacked_rows
from composer_algos.features.sketch import exact_layer_grads, sketch_layer_grads, sketch_matrices
from composer_algos.features.targets import (
    TargetLayer,
    choose_cut_module,
    resolve_targets,
    unwrap_model,
)
from composer_algos.losses import (
    IGNORE_INDEX,
    per_example_losses,
    row_means,
    target_position_logits,
    target_token_losses,
)

log = logging.getLogger(__name__)

__all__ = [
    "IGNORE_INDEX",
    "checkpoint_inner",
    "checkpoint_wrappers",
    "unwrapped_checkpoints",
    "per_example_losses",
    "scoring_mode",
    "truncated_graph",
    "capture_layer_signals",
    "per_example_grads",
]


@contextmanager
def scoring_mode(model: nn.Module) -> Iterator[None]:
    """Put `model` in eval mode (no dropout) and restore every submodule's own train/eval flag afterwards."""
    flags = [(mod, mod.training) for mod in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for mod, was_training in flags:
            mod.training = was_training


def _wrapped(module: nn.Module) -> nn.Module | None:
    # The wrapper's own submodule, not an attribute lookup: FSDP1 forwards unknown attributes to the
    # module it wraps, so an FSDP unit around a checkpoint wrapper would look like one.
    return module._modules.get("_checkpoint_wrapped_module")


def checkpoint_inner(module: nn.Module) -> nn.Module:
    """The module inside any activation-checkpoint (or offload) wrappers: what runs in their place while scoring."""
    while _wrapped(module) is not None:
        module = _wrapped(module)
    return module


def checkpoint_wrappers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """`(parent, child name, wrapper)` of every activation-checkpoint wrapper in `model` (outermost ones)."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if _wrapped(child) is not None and _wrapped(parent) is None:
                found.append((parent, name, child))
    return found


@contextmanager
def unwrapped_checkpoints(wrappers: list[tuple[nn.Module, str, nn.Module]]) -> Iterator[None]:
    """Run the forwards inside with each checkpoint wrapper's inner module in its place.

    Activation checkpointing (torch's `checkpoint_wrapper`, which Composer's `fsdp_config:
    activation_checkpointing` and llm-foundry put around each block) re-runs a block's forward in the
    backward. The scoring pass's graph must not: its hooks record each target's output in the forward
    and `autograd.grad` differentiates with respect to those outputs, which a reentrant checkpoint
    computes without autograd and a non-reentrant one replaces in the recomputation. The scoring pass
    keeps activations of the blocks from the cut up only, so it needs no checkpointing; the wrappers
    are put back after it, for training.
    """
    try:
        for parent, name, wrapper in wrappers:
            setattr(parent, name, checkpoint_inner(wrapper))
        yield
    finally:
        for parent, name, wrapper in wrappers:
            setattr(parent, name, wrapper)


@contextmanager
def truncated_graph(cut_module: nn.Module) -> Iterator[dict[str, bool]]:
    """Run the model's forward without autograd below `cut_module` and with it from there on.

    The forward runs under `torch.no_grad()`; a forward pre-hook on `cut_module` switches grad mode on
    and replaces its hidden-state input by a detached leaf that requires grad. The blocks below thus
    record no graph and keep no activations, the blocks from `cut_module` up do, and every output
    above the cut requires grad even when its weights are frozen. Leaving the context restores the
    caller's grad mode. No parameter's `requires_grad` is touched.

    Args:
        cut_module: the lowest module gradients must flow through (a transformer block or lm_head).

    Yields:
        A dict whose "fired" entry tells whether the cut module ran.
    """
    status = {"fired": False}

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        torch.set_grad_enabled(True)
        status["fired"] = True
        if args and torch.is_tensor(args[0]):
            args = (args[0].detach().requires_grad_(True), *args[1:])
        elif torch.is_tensor(kwargs.get("hidden_states")):
            kwargs = {**kwargs, "hidden_states": kwargs["hidden_states"].detach().requires_grad_(True)}
        else:
            raise ValueError(
                f"cannot cut the graph at {type(module).__name__}: its first argument is not a tensor and "
                f"no `hidden_states` keyword was passed"
            )
        return args, kwargs

    handle = cut_module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        with torch.no_grad():
            yield status
    finally:
        handle.remove()


def capture_layer_signals(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    targets: list[TargetLayer],
    cut_module: nn.Module,
    precision_context: Callable[[], AbstractContextManager] | None = None,
    logits_at: str = "all",
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """One truncated forward + backward: per target, its inputs `a` and per-example output-gradients `delta`.

    `delta` is `d(sum_i l_i)/d(output)` taken with `torch.autograd.grad` w.r.t. the captured outputs, so
    no parameter's `.grad` is written and no weight gradient is computed. In eval mode the examples do
    not interact, so row i of `delta` is `dl_i/d(output_i)` and example i's weight gradient is
    `sum_t delta_it a_it^T`. A module called several times in one forward gets its calls concatenated
    along the token axis (the gradient sums over calls). The caller is responsible for eval mode.

    Args:
        model: the unwrapped model.
        batch: `input_ids` (n, T), optional `attention_mask` (n, T), optional `labels` (n, T) with -100
            masked (default: `input_ids` with padding masked).
        targets: from `resolve_targets`.
        cut_module: from `choose_cut_module`.
        precision_context: a factory of the context the forward and the loss run in, e.g. the
            training run's autocast (`composer.core.precision.get_precision_context`); None runs
            them as the model is. The backward runs outside it, as autocast's recipe asks: its
            ops take the dtypes the forward recorded.
        logits_at: "all": the model's own forward (logits at every position); "targets": the
            vocabulary projection only at the positions with a target
            (`losses.target_position_logits`; the same per-example losses, for a model
            `losses.projects_at_targets` accepts and no output-embedding target).

    Returns:
        ([(a_nTI, delta_nTO) per target, detached, in the dtypes the forward produced (bfloat16
        under a bf16 autocast)], losses_n detached).

    Raises:
        ValueError: when a target does not run in the forward, or its activations are not batch-major.
    """
    input_ids = batch["input_ids"]
    attention_mask = batch.get("attention_mask")
    labels = batch.get("labels")
    if labels is None:
        labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    n = input_ids.shape[0]

    records: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {t.index: [] for t in targets}

    def make_hook(index: int):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            # `.data`: the input detached in one aten op (`.detach()` dispatches two); only read after.
            records[index].append((args[0].data, output))

        return hook

    handles = [t.module.register_forward_hook(make_hook(t.index)) for t in targets]
    try:
        with truncated_graph(cut_module) as status:
            losses_n = _forward_losses(model, input_ids, attention_mask, labels, n, precision_context, logits_at)
            if not status["fired"]:
                raise ValueError(f"the cut module {type(cut_module).__name__} did not run in the forward")
            missing = [t.name for t in targets if not records[t.index]]
            if missing:
                raise ValueError(
                    f"target modules {missing} did not run in the forward (merged or inactive adapters?); "
                    f"choose modules that are called"
                )
            outputs = [o for t in targets for _, o in records[t.index]]
            with record_function("features/backward"):
                deltas = torch.autograd.grad(losses_n.sum(), outputs, materialize_grads=True)
    finally:
        for h in handles:
            h.remove()

    return _signals_by_target(targets, records, deltas, n), losses_n.detach()


def _forward_losses(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    n: int,
    precision_context: Callable[[], AbstractContextManager] | None,
    logits_at: str,
) -> torch.Tensor:
    """The forward and the loss of `capture_layer_signals` in the precision context: (n,) per-example losses.

    The rows carry no position ids, so they are not packed: the forward keeps SDPA's causal path
    (`causal_masks.unpacked_rows`).
    """
    with (precision_context or nullcontext)(), unpacked_rows():
        if logits_at == "targets":
            with record_function("features/forward"):
                logits_NV, targets_N, rows_N = target_position_logits(model, input_ids, attention_mask, labels)
            with record_function("features/loss"):
                losses_n = row_means(target_token_losses(logits_NV, targets_N), rows_N, n)
            del logits_NV
        else:
            with record_function("features/forward"):
                out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            with record_function("features/loss"):
                losses_n = per_example_losses(out.logits, labels)
            # The loss's backward needs its own saved tensors, not the logits: dropping them
            # here keeps the n x T x V logits out of the backward's peak.
            del out
    return losses_n


def _signals_by_target(
    targets: list[TargetLayer],
    records: Mapping[int, list[tuple[torch.Tensor, torch.Tensor]]],
    deltas: tuple[torch.Tensor, ...],
    n: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per target `(a_nTI, delta_nTO)`: its calls' inputs and output-gradients (`deltas` in call order), concatenated.

    Raises:
        ValueError: when a target's activations are not batch-major.
    """
    signals = []
    pos = 0
    for t in targets:
        calls = records[t.index]
        a_parts, d_parts = [], []
        for a, _ in calls:
            if a.shape[0] != n:
                raise ValueError(
                    f"target module {t.name!r} sees inputs of shape {tuple(a.shape)}, not batch-major with "
                    f"n={n} rows; per-example gradients need (n, ..., d_in) activations"
                )
            # `autograd.grad` (no `create_graph`) returns tensors outside the graph: nothing to detach.
            a_parts.append(_as_rows(a, n, t.d_in))
            d_parts.append(_as_rows(deltas[pos], n, t.d_out))
            pos += 1
        a_nTI = a_parts[0] if len(a_parts) == 1 else torch.cat(a_parts, dim=1)
        delta_nTO = d_parts[0] if len(d_parts) == 1 else torch.cat(d_parts, dim=1)
        signals.append((a_nTI, delta_nTO))
    return signals


def _as_rows(x: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """`x` as (n, tokens, width): itself when it has that shape already (a reshape is an aten op)."""
    return x if x.dim() == 3 and x.shape[0] == n and x.shape[2] == width else x.reshape(n, -1, width)


def per_example_grads(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    targets: list[TargetLayer] | None = None,
    *,
    mode: str = "auto",
    sketch_dim: int | tuple[int, int] = 32,
    seed: int = 0,
    chunk_size: int = 16,
    **target_kwargs,
) -> dict[str, torch.Tensor]:
    """Per-layer per-example gradient features before normalisation and compression (for tests and benchmarks).

    Args:
        model: HF causal LM, peft model, or Composer `HuggingFaceModel`.
        batch: as in `capture_layer_signals` (moved to the model's device).
        targets: from `resolve_targets` on the unwrapped model; None resolves them with `target_kwargs`.
        mode: "exact" (every layer exact), "sketch" (every layer sketched), or "auto" (each target's
            `sketched` flag, from `exact_max_numel`).
        sketch_dim: k, or (k_out, k_in).
        seed: base seed of the sketch projections (the layer index is folded in).
        chunk_size: examples per forward.
        **target_kwargs: `target_modules`, `last_n_blocks`, `include_lm_head`, `exact_max_numel`.

    Returns:
        {layer name: (n, D_l)} in the compute dtype (float32, or float64 for a float64 model); exact
        features are the row-major weight gradient followed by the bias gradient.

    Raises:
        ValueError: for an unknown `mode` or a bad target spec.
    """
    if mode not in ("auto", "exact", "sketch"):
        raise ValueError(f"`mode` must be 'auto', 'exact' or 'sketch', got {mode!r}")
    inner = unwrap_model(model)
    if targets is None:
        targets = resolve_targets(inner, **target_kwargs)
    k_out, k_in = (sketch_dim, sketch_dim) if isinstance(sketch_dim, int) else sketch_dim
    cut = choose_cut_module(inner, targets)
    device = next(inner.parameters()).device
    n = batch["input_ids"].shape[0]
    parts: dict[str, list[torch.Tensor]] = {t.name: [] for t in targets}
    with scoring_mode(inner):
        for start in range(0, n, chunk_size):
            chunk = {k: v[start : start + chunk_size].to(device) for k, v in batch.items() if torch.is_tensor(v)}
            signals, _ = capture_layer_signals(inner, chunk, targets, cut)
            for t, (a_nTI, delta_nTO) in zip(targets, signals):
                dtype = torch.promote_types(a_nTI.dtype, torch.float32)
                a_nTI, delta_nTO = a_nTI.to(dtype), delta_nTO.to(dtype)
                sketched = t.sketched if mode == "auto" else mode == "sketch"
                if sketched:
                    P_out, P_in = sketch_matrices(
                        seed, t.index, t.d_out, t.d_in + t.has_bias, k_out, k_in, device=device, dtype=dtype
                    )
                    parts[t.name].append(sketch_layer_grads(a_nTI, delta_nTO, P_out, P_in))
                else:
                    parts[t.name].append(exact_layer_grads(a_nTI, delta_nTO, t.has_bias))
    return {name: torch.cat(p, dim=0) for name, p in parts.items()}
