"""Which linear layers of a causal LM the gradient features are taken from, and where to cut the graph."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

__all__ = [
    "TargetLayer",
    "ParamShard",
    "unwrap_model",
    "forward_module",
    "fsdp_param_shards",
    "FlatSlice",
    "fsdp_whole_units",
    "fsdp_state_params",
    "settle_fsdp_units",
    "sharded_fsdp_units_kept",
    "find_blocks",
    "resolve_targets",
    "choose_cut_module",
    "is_peft_model",
]


@dataclass(frozen=True)
class TargetLayer:
    """One linear layer whose per-example gradient becomes part of the feature.

    Attributes:
        name: the module's name in `model.named_modules()` (of the unwrapped model), FSDP's and
            activation checkpointing's wrapper prefixes removed, so it is the same with and without FSDP.
        module: the `nn.Linear` itself.
        index: position in the target list; folded into every random seed of this layer.
        block: index of the transformer block holding it, or None (e.g. `lm_head`).
        d_out: output features (`out_features`, the unsharded shape also under FSDP).
        d_in: input features (`in_features`).
        has_bias: whether the layer's bias is part of the feature.
        sketched: True when `d_out * d_in` exceeds the exact threshold, so the gradient is sketched.
    """

    name: str
    module: nn.Linear
    index: int
    block: int | None
    d_out: int
    d_in: int
    has_bias: bool
    sketched: bool

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters this layer's feature is the gradient of: weight, then bias if present."""
        return [self.module.weight] + ([self.module.bias] if self.has_bias else [])  # type: ignore[list-item]

    def raw_dim(self, k_out: int, k_in: int) -> int:
        """Length of this layer's feature before compression (exact numel or the k_out x k_in sketch)."""
        if self.sketched:
            return k_out * k_in
        return self.d_out * self.d_in + (self.d_out if self.has_bias else 0)


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model` is a peft `PeftModel` (duck-typed, so peft stays optional)."""
    try:
        from peft import PeftModel
    except ImportError:  # peft is optional for plain models
        return False
    return isinstance(model, PeftModel)


@dataclass(frozen=True)
class ParamShard:
    """The part of a parameter this rank holds under FSDP (FSDP1, `use_orig_params=True`).

    Attributes:
        numel: elements of the whole (unsharded) parameter.
        start: first element of this rank's slice of the flattened parameter.
        end: one past its last element (`start == end`: this rank holds none of it).
    """

    numel: int
    start: int
    end: int


def unwrap_model(model: nn.Module) -> nn.Module:
    """Return the transformers / peft model inside Composer's `HuggingFaceModel` (or `model` itself).

    Args:
        model: a `PreTrainedModel`, a peft `PeftModel`, or a wrapper exposing one as `.model`
            (Composer's `HuggingFaceModel`), possibly inside `DistributedDataParallel`, and possibly
            wrapped by FSDP (`FullyShardedDataParallel`, as Composer does for a yaml with `fsdp_config`).

    Returns:
        The model whose `forward(input_ids=..., attention_mask=...)` returns `.logits`, FSDP's wrapper
        removed: use it to find modules, and call `forward_module(model)` instead.

    Raises:
        TypeError: when no transformers or peft model can be found.
    """
    return _unwrap(model)[1]


def forward_module(model: nn.Module) -> nn.Module:
    """The module to call for a forward of `unwrap_model(model)`.

    Under FSDP this is the outermost `FullyShardedDataParallel` around the transformers model: its
    forward all-gathers the sharded parameters (unit by unit) and its hooks gather them again for the
    backward; calling the inner module would see this rank's flat shards. Otherwise it is the
    unwrapped model itself (DDP's wrapper is skipped: no parameter gradient is produced, so DDP's
    reducer must not see this forward).

    Args:
        model: as for `unwrap_model`.

    Raises:
        TypeError: when no transformers or peft model can be found.
    """
    return _unwrap(model)[0]


def fsdp_param_shards(model: nn.Module) -> dict[int, ParamShard] | None:
    """Where each FSDP-sharded parameter's local slice lies, by `id(param)`; None when nothing is sharded.

    Reads FSDP1's flat-parameter metadata (`_shard_param_infos`; torch 2.7), which records, for every
    original parameter, the range of its flattened elements this rank's shard holds. The optimizer's
    state of such a parameter (e.g. Adam's `exp_avg_sq`) is that 1-D slice.

    Units that hold whole parameters (NO_SHARD, which FSDP makes of every strategy on one rank or on
    a shard group of one) shard nothing: with only such units this returns None and the optimizer
    state is read as without FSDP (`fsdp_whole_units`, `fsdp_state_params`).

    Args:
        model: anything holding the FSDP modules (e.g. `forward_module(model)`).

    Raises:
        ValueError: for units that shard with `use_orig_params=False` (the target layers' parameters
            are then not the optimizer's; Composer's default is True), and for a model mixing units
            that shard with units that hold whole parameters.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    units = [w for w in FullyShardedDataParallel.fsdp_modules(model) if w._handle is not None]
    sharded = [(w, w._handle) for w in units if _shards(w._handle)]
    if not sharded:
        return None
    whole = fsdp_whole_units(model)
    if whole:
        raise ValueError(
            f"gradient features need every FSDP unit to shard or none: {len(sharded)} unit(s) shard their "
            f"parameters and {len(whole)} hold them whole (NO_SHARD or a shard group of one rank, e.g. "
            f"{type(whole[0].module).__name__}); give all units one fsdp_config.sharding_strategy"
        )
    shards: dict[int, ParamShard] = {}
    for wrapper, handle in sharded:
        flat = handle.flat_param
        if not getattr(handle, "_use_orig_params", False) or flat._params is None:
            raise ValueError(
                "gradient features under a sharding FSDP strategy need `fsdp_config.use_orig_params: true` "
                f"(Composer's default), got false for the unit {type(wrapper.module).__name__}; on one rank, "
                f"or with NO_SHARD, false works too"
            )
        for param, info, shape in zip(flat._params, flat._shard_param_infos, flat._shapes):
            numel = shape.numel()
            if info.in_shard:
                shards[id(param)] = ParamShard(numel, info.intra_param_start_idx, info.intra_param_end_idx + 1)
            else:
                shards[id(param)] = ParamShard(numel, 0, 0)
    return shards


@dataclass(frozen=True, eq=False)
class FlatSlice:
    """Where an original parameter lies in FSDP's flat parameter, when the optimizer holds the latter.

    With `use_orig_params=False` FSDP hands the optimizer its `FlatParameter`s; a unit holding whole
    parameters keeps every original parameter in full inside it, so its optimizer state (e.g. Adam's
    `exp_avg_sq`, shaped like the flat parameter) holds the parameter's at `offset`.

    Attributes:
        flat_param: the `FlatParameter` (the optimizer's key).
        offset: first element of the parameter in it.
        shape: the parameter's shape.
    """

    flat_param: nn.Parameter
    offset: int
    shape: torch.Size


def fsdp_whole_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units of `model` that hold whole parameters (NO_SHARD, a shard group of one rank); [] without FSDP.

    FSDP makes every strategy NO_SHARD when the shard group has one rank (torch 2.7: a Composer run
    with `fsdp_config` on one GPU, or HYBRID_SHARD with one GPU per node). Such a unit's parameters
    are whole between forwards, as without FSDP; `settle_fsdp_units` puts them back after scoring.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    units = FullyShardedDataParallel.fsdp_modules(model)
    return [w for w in units if w._handle is not None and not _shards(w._handle)]


def fsdp_state_params(units: list[nn.Module], target: TargetLayer) -> list[nn.Parameter | FlatSlice]:
    """What the optimizer keys `target`'s parameters by (weight, then bias) when `units` hold them whole.

    The parameters themselves with `use_orig_params=True` (and outside FSDP); with `False`, the
    `FlatSlice` of each in its unit's flat parameter (a tied parameter: its primary's).

    Args:
        units: from `fsdp_whole_units`.
        target: a target layer of the model inside them.
    """
    wanted = ["weight"] + (["bias"] if target.has_bias else [])
    found: dict[str, FlatSlice] = {}
    for unit in units:
        handle = unit._handle
        if handle._use_orig_params:
            continue
        flat = handle.flat_param
        where = {
            (id(info.module), info.param_name): FlatSlice(flat, shard.offset_in_shard, shape)
            for info, shard, shape in zip(flat._param_infos, flat._shard_param_infos, flat._shapes)
        }
        for shared in flat._shared_param_infos:
            primary = where[(id(shared.prim_module), shared.prim_param_name)]
            where[(id(shared.module), shared.param_name)] = primary
        for name in wanted:
            if (id(target.module), name) in where:
                found[name] = where[(id(target.module), name)]
    return [found.get(name, param) for name, param in zip(wanted, target.params)]


def settle_fsdp_units(units: list[nn.Module]) -> None:
    """Put units that hold whole parameters back as FSDP's post-backward reshard leaves them.

    The scoring backward runs to layer outputs only, so no parameter gets a gradient and FSDP's
    per-parameter post-backward hooks, which reshard, never run; for a NO_SHARD unit FSDP's end-of-
    backward catch-all also skips it (its flat parameter already is its "shard"). Measured (torch 2.7,
    CPU/gloo): with `use_orig_params=True` the unit is left with the forward's plain tensor views in
    place of its parameters, and its next forward fails ("Cannot writeback when the parameter shape
    changes"). This does FSDP's own reshard (`_reshard`: full-precision flat parameter, the original
    parameters as views of it, the low-precision copy freed) for each unit not at rest; no copies.

    Args:
        units: from `fsdp_whole_units`; call between forwards, not inside one.
    """
    from torch.distributed.fsdp._runtime_utils import _reshard

    for unit in units:
        handle = unit._handle
        flat = handle.flat_param
        at_rest = flat.data_ptr() == flat._local_shard.data_ptr() and not handle._skipped_use_sharded_views
        if at_rest and handle._use_orig_params:
            at_rest = all(
                getattr(info.module, info.param_name) is p for p, info in zip(flat._params, flat._param_infos)
            )
        if not at_rest:
            _reshard(unit, handle, False)


@contextlib.contextmanager
def sharded_fsdp_units_kept(model: nn.Module) -> Iterator[None]:
    """A scoring pass between a training backward and its optimizer step (`select_ahead`) that leaves the FSDP1
    units that shard (several ranks) as the backward left them: resharded, with their gradients.

    The scoring backward runs to layer outputs only. FSDP's pre-backward hook moves each unit's sharded
    gradient aside (`prepare_gradient_for_backward`), and, with no parameter gradient computed, its end of
    backward drops it instead of putting it back (`prepare_gradient_for_optim`): the units above the cut and the
    root lose their training gradients (the original parameters keep views of them, the flat parameters do
    not). And a unit whose gathered parameters outlive a forward without a backward (the blocks below the cut
    under `SHARD_GRAD_OP`) keeps that gathered copy: the next forward and `summon_full_params` use it instead of
    gathering again, so the optimizer step's update of the shards never reaches them. Measured on two CPU
    ranks, torch 2.7 (tests/features/test_fsdp.py): under `SHARD_GRAD_OP` the step after such a scoring pass
    left the blocks below the cut at their old weights (by the learning rate). So the gradients are put back
    and every gathered copy is freed, as the training backward's end leaves them. Outside FSDP, and for units
    that hold whole parameters (`settle_fsdp_units`), this does nothing.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._runtime_utils import _reshard

    units = [u for u in FullyShardedDataParallel.fsdp_modules(model) if u._handle is not None and _shards(u._handle)]
    grads = [u._handle.flat_param.grad for u in units]
    try:
        yield
    finally:
        for unit, grad in zip(units, grads):
            handle = unit._handle
            flat = handle.flat_param
            if not handle.needs_unshard():  # a gathered copy is allocated (or in use): free it
                _reshard(unit, handle, True)
            if flat.grad is not grad:
                if grad is not None and grad.dtype != flat.dtype:  # keep_low_precision_grads: FSDP's own way to hold it
                    flat.grad = torch.empty_like(flat)
                    flat.grad.data = grad
                else:
                    flat.grad = grad
            if handle._use_orig_params:
                handle._use_sharded_grad_views()


def _shards(handle) -> bool:
    """Whether an FSDP1 flat-parameter handle splits its parameters over more than one rank."""
    return bool(handle.uses_sharded_strategy) and handle.world_size > 1


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Find the list of transformer blocks: the `nn.ModuleList` of same-class modules holding the most parameters.

    Args:
        model: the unwrapped model.

    Returns:
        (the ModuleList's name in `model.named_modules()`, the ModuleList).

    Raises:
        ValueError: when the model holds no such list.
    """
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if len({type(child) for child in mod}) != 1:
            continue
        numel = sum(p.numel() for p in mod.parameters())
        if best is None or numel > best[0]:
            best = (numel, name, mod)
    if best is None:
        raise ValueError(
            f"could not find the transformer blocks of {type(model).__name__}: no nn.ModuleList of "
            f"same-class modules; pass a standard transformers causal LM"
        )
    return best[1], best[2]


def resolve_targets(
    model: nn.Module,
    *,
    target_modules: list[str] | None = None,
    last_n_blocks: int = 1,
    include_lm_head: bool = False,
    exact_max_numel: int = 65536,
) -> list[TargetLayer]:
    """Choose the target linear layers.

    Candidates are the `nn.Linear` modules inside the last `last_n_blocks` blocks, plus the output
    embedding (`lm_head`) when `include_lm_head`. Among them, `target_modules` (regexes, `re.search` on
    the module name) keeps the matches; by default a peft model keeps the LoRA A/B factors of its
    active adapters and any other model keeps every candidate (attention and MLP projections).

    Args:
        model: the unwrapped model (see `unwrap_model`).
        target_modules: regex patterns over module names, or None for the defaults above.
        last_n_blocks: how many of the last blocks to take layers from (0 to the number of blocks).
        include_lm_head: add the output embedding (always sketched unless tiny).
        exact_max_numel: a layer with `d_out * d_in` above this is sketched, otherwise exact.

    Returns:
        The targets in module order, each with its `index`.

    Raises:
        ValueError: for an out-of-range `last_n_blocks`, a bad pattern, or when nothing matches (the
            message lists the candidates).
    """
    block_prefix, blocks = find_blocks(model)
    block_prefix = _clean_name(block_prefix)
    n_blocks = len(blocks)
    if not isinstance(last_n_blocks, int) or not 0 <= last_n_blocks <= n_blocks:
        raise ValueError(
            f"`last_n_blocks` must be an int in [0, {n_blocks}] (the model has {n_blocks} blocks), "
            f"got {last_n_blocks!r}"
        )
    if exact_max_numel < 0:
        raise ValueError(f"`exact_max_numel` must be >= 0, got {exact_max_numel}")
    first_block = n_blocks - last_n_blocks
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if include_lm_head and not isinstance(lm_head, nn.Linear):
        raise ValueError(
            f"`include_lm_head=True` but {type(model).__name__} has no nn.Linear output embedding "
            f"(got {type(lm_head).__name__}); set include_lm_head=False"
        )

    candidates = _candidate_layers(model, block_prefix, first_block, include_lm_head, lm_head)
    chosen = _chosen_candidates(model, candidates, target_modules, last_n_blocks, include_lm_head)

    targets = []
    for i, (name, mod, block) in enumerate(chosen):
        # in/out_features, not weight.shape: under FSDP the weight is this rank's 1-D flat shard.
        d_out, d_in = mod.out_features, mod.in_features
        has_bias = mod.bias is not None
        targets.append(
            TargetLayer(
                name=name,
                module=mod,
                index=i,
                block=block,
                d_out=d_out,
                d_in=d_in,
                has_bias=has_bias,
                sketched=d_out * d_in > exact_max_numel,
            )
        )
    log.debug("gradient-feature targets: %s", [(t.name, "sketch" if t.sketched else "exact") for t in targets])
    return targets


def _candidate_layers(
    model: nn.Module, block_prefix: str, first_block: int, include_lm_head: bool, lm_head: nn.Module | None
) -> list[tuple[str, nn.Linear, int | None]]:
    """`(name, module, block)` of every `nn.Linear` in the blocks from `first_block` on, and `lm_head` when included."""
    candidates: list[tuple[str, nn.Linear, int | None]] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        name = _clean_name(name)
        block = _block_index(name, block_prefix)
        if block is not None and block >= first_block:
            candidates.append((name, mod, block))
        elif include_lm_head and mod is lm_head:
            candidates.append((name, mod, None))
    return candidates


def _chosen_candidates(
    model: nn.Module,
    candidates: list[tuple[str, nn.Linear, int | None]],
    target_modules: list[str] | None,
    last_n_blocks: int,
    include_lm_head: bool,
) -> list[tuple[str, nn.Linear, int | None]]:
    """The candidates `target_modules` keeps (or the defaults of `resolve_targets`).

    Raises:
        ValueError: for a bad pattern, or when nothing matches (the message lists the candidates).
    """
    if target_modules is not None:
        if isinstance(target_modules, str):
            target_modules = [target_modules]
        try:
            patterns = [re.compile(p) for p in target_modules]
        except re.error as err:
            raise ValueError(f"`target_modules` holds an invalid regex ({err}): {target_modules!r}") from err
        chosen = [c for c in candidates if any(p.search(c[0]) for p in patterns)]
        what = f"`target_modules`={target_modules!r}"
    elif is_peft_model(model):
        adapters = set(getattr(model, "active_adapters", None) or [])
        chosen = [c for c in candidates if _is_lora_factor(c[0], adapters) or c[2] is None]
        what = f"the LoRA factors of the active adapters {sorted(adapters)}"
    else:
        chosen = candidates
        what = "the default (every linear layer)"
    if not chosen:
        names = [c[0] for c in candidates] or ["(none)"]
        raise ValueError(
            f"no target module matches {what} in the last {last_n_blocks} block(s) "
            f"(include_lm_head={include_lm_head}); candidate nn.Linear modules are: {names}"
        )
    return chosen


def choose_cut_module(model: nn.Module, targets: list[TargetLayer]) -> nn.Module:
    """The module whose input is detached: the lowest block holding a target, else the lowest target itself.

    Args:
        model: the unwrapped model.
        targets: from `resolve_targets`.

    Returns:
        The module to put the graph-cutting pre-hook on.
    """
    _, blocks = find_blocks(model)
    in_blocks = [t.block for t in targets if t.block is not None]
    if in_blocks:
        return blocks[min(in_blocks)]
    # Only modules above the blocks (lm_head): cut right at the first of them.
    return targets[0].module


def _unwrap(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(the module to call, the transformers/peft model inside it); see `unwrap_model` and `forward_module`."""
    from transformers import PreTrainedModel

    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    for candidate in (model, getattr(model, "model", None)):
        if not isinstance(candidate, nn.Module):
            continue
        inner = _strip_fsdp(candidate)
        if isinstance(inner, PreTrainedModel) or is_peft_model(inner):
            return candidate, inner
    raise TypeError(
        f"`model` must be a transformers PreTrainedModel, a peft PeftModel, or a wrapper with one as "
        f"`.model` (Composer's HuggingFaceModel), got {type(model).__name__}"
    )


def _strip_fsdp(module: nn.Module) -> nn.Module:
    """The module inside any FSDP1 wrappers (FSDP2's `fully_shard` adds none)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    while isinstance(module, FullyShardedDataParallel):
        module = module.module
    return module


def _clean_name(name: str) -> str:
    """A module name without FSDP's and activation checkpointing's wrapper prefixes (as torch's `clean_tensor_name`)."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def _block_index(name: str, block_prefix: str) -> int | None:
    """The block number in `name` when it lies inside `block_prefix.<i>.`, else None."""
    head = f"{block_prefix}." if block_prefix else ""
    if not name.startswith(head):
        return None
    first = name[len(head) :].split(".", 1)[0]
    return int(first) if first.isdigit() else None


def _is_lora_factor(name: str, adapters: set[str]) -> bool:
    """Whether `name` is `....lora_A.<adapter>` or `....lora_B.<adapter>` for an active adapter."""
    parts = name.rsplit(".", 2)
    return len(parts) == 3 and parts[1] in ("lora_A", "lora_B") and parts[2] in adapters

