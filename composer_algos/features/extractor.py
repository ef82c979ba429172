"""`GradFeatureExtractor`: normalised, compressed per-example gradient features of a pool and a validation batch.

Shapes: n examples, T tokens, O = d_out, I = d_in, K = k_out, J = k_in, D features of one layer, d output features.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from composer_algos.features.capture import (
    capture_layer_signals,
    checkpoint_inner,
    checkpoint_wrappers,
    scoring_mode,
    unwrapped_checkpoints,
)
from composer_algos.features.compiled_forward import CompiledBlocksBelowCut
from composer_algos.features.normalize import (
    NORMALIZATIONS,
    FactoredScales,
    SimulatedAdam,
    batched_factored_scales,
    exact_adam_scale,
    factored_adam_scales,
    optimizer_second_moments,
    sharded_adam_scales,
    unit_rows,
)
from composer_algos.features.projection import (
    FJLTPlan,
    FJLTStack,
    apply_fjlt,
    fjlt_stack,
    make_fjlt_plan,
    stack_fjlt_plans,
)
from composer_algos.features.score_tokens import first_target_tokens, score_tokens_problem
from composer_algos.features.sketch import (
    compute_dtype,
    exact_layer_grads,
    sketch_layer_grads,
    sketch_matrices,
    sketched_layer_products,
)
from composer_algos.features.targets import (
    TargetLayer,
    choose_cut_module,
    forward_module,
    fsdp_param_shards,
    fsdp_state_params,
    fsdp_whole_units,
    resolve_targets,
    settle_fsdp_units,
    unwrap_model,
)
from composer_algos.features.windows import (
    POOL_STREAM,
    VALIDATION_STREAM,
    score_window_problems,
    window_batch,
)
from composer_algos.losses import mask_and_labels, projects_at_targets
from composer_algos.selection.types import check_or_defer

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FeatureError",
    "GradFeatureExtractor",
    "PRECONDITION_SIDES",
    "feature_option_problems",
    "is_out_of_memory",
    "spearman",
]

# Examples per scoring forward when `chunk_size` is "auto" and the caller gives no microbatch size
# (DataSelection passes the run's device microbatch size, so this is for standalone use).
DEFAULT_CHUNK_SIZE = 16

# The messages Composer's auto microbatching takes for an out-of-memory error (composer/trainer/
# trainer.py `_is_cuda_oom`), besides torch's own OutOfMemoryError; this core does not import Composer.
_OOM_MESSAGES = ("CUDA out of memory", "CUDA error: out of memory")

# Where the optimizer's Adam preconditioner P = 1 / (sqrt(v_hat) + eps) is applied, as the power of P
# on the (pool, validation) side. The first-order effect of an Adam step on the selected examples on
# the validation loss is -lr g_val^T P sum_i g_i, so the score <x_i, xbar> must carry P once:
# `pool` (P g_i against raw g_val, as LESS does; the default) or `split` (P^1/2 on both sides, same
# scores, and a Gram K = G P G^T that measures redundancy in the preconditioned metric). `both`
# divides both sides by sqrt(v_hat) + eps, scoring g_i^T P^2 g_val: not the first-order effect. The
# dm_math study's training runs chose the default (docs/results/study_dm_math.md, ablations).
PRECONDITION_SIDES = {"pool": (1.0, 0.0), "split": (0.5, 0.5), "both": (1.0, 1.0)}


class FeatureError(RuntimeError):
    """The features of this call are unusable (non-finite, or all zero); the caller should fall back for the step."""


def feature_option_problems(
    *,
    normalization: str,
    sketch_dim: int | tuple[int, int],
    chunk_size: int | str,
    proj_dim: int | None,
    adam_betas: tuple[float, float],
    adam_eps: float,
    precondition: str,
    score_tokens: int | None = None,
    score_window: int | None = None,
    score_window_position: str = "start",
    compile: bool = False,
    compile_forward: bool = False,
) -> list[str]:
    """Every invalid value among `GradFeatureExtractor`'s options, one message each (none: valid).

    The extractor raises with them; the run config reports them when the yaml is loaded.
    """
    problems = []
    if normalization not in NORMALIZATIONS:
        problems.append(f"`normalization` must be one of {list(NORMALIZATIONS)}, got {normalization!r}")
    k_out, k_in = (sketch_dim, sketch_dim) if isinstance(sketch_dim, int) else tuple(sketch_dim)
    if k_out < 1 or k_in < 1:
        problems.append(f"`sketch_dim` must be >= 1 (or a pair of such), got {sketch_dim!r}")
    if chunk_size != "auto" and not (isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size >= 1):
        problems.append(
            f"`chunk_size` must be 'auto' or an int >= 1, got {chunk_size!r} "
            f"('auto': the run's device microbatch size)"
        )
    if proj_dim is not None and proj_dim < 0:
        problems.append(f"`proj_dim` must be None (hidden size), 0 (no compression) or positive, got {proj_dim}")
    if not (0 <= adam_betas[0] < 1 and 0 <= adam_betas[1] < 1):
        problems.append(f"`adam_betas` must lie in [0, 1), got {adam_betas}")
    if adam_eps <= 0:
        problems.append(f"`adam_eps` must be > 0, got {adam_eps}")
    if precondition not in PRECONDITION_SIDES:
        problems.append(f"`precondition` must be one of {list(PRECONDITION_SIDES)}, got {precondition!r}")
    score_tokens_error = score_tokens_problem(score_tokens)
    if score_tokens_error:
        problems.append(score_tokens_error)
    problems.extend(score_window_problems(score_window, score_window_position, score_tokens))
    if not isinstance(compile, bool):
        problems.append(f"`compile` must be true or false, got {compile!r}")
    if not isinstance(compile_forward, bool):
        problems.append(f"`compile_forward` must be true or false, got {compile_forward!r}")
    return problems


class GradFeatureExtractor:
    """Per-example gradient features `G` (n x d) of a pool and the mean feature `gbar` of a validation batch.

    Implements the paper's "Memory Efficient Gradient Computation" appendix (PartitionSel): gradients
    of the per-example loss (mean cross-entropy over the example's target tokens) w.r.t. a few linear
    layers near the output, Adam-normalised, then compressed by a randomized FFT. Per call:

    1. one forward per `chunk_size` examples in eval mode, with no autograd graph below the lowest
       target block, and one `autograd.grad` to the target layers' outputs (no `.grad` is written);
    2. per layer, the exact per-example gradient `sum_t delta_t a_t^T` when `d_out * d_in <=
       exact_max_numel`, else the two-sided sketch `P_out G P_in^T` (k_out x k_in, seeded projections);
    3. normalisation (see below), then 4. FJLT compression of each layer to `proj_dim`, summed over
       layers (an unbiased JL map of the concatenation), and 5. for `unit`, unit rows.

    Normalisations: `none`; `unit` (cosine Gram); `adam_optimizer` (divide by `sqrt(v_hat) + eps` of
    the optimizer's own second moment: elementwise for exact layers, a rank-one row/column fit for
    sketched ones; falls back to `none` while the optimizer has no state, see `normalization_in_use`,
    and leaves a target whose parameters have no optimizer state, e.g. a frozen `lm_head`, raw, see
    `preconditioned_fraction`);
    `adam_simulated` (the paper's per-example low-pass filter, `SimulatedAdam`, checkpointable).

    The model's parameters, their `.grad`, the optimizer state and every module's train/eval flag are
    left exactly as found.

    Args:
        model: a transformers causal LM, a peft `PeftModel`, or Composer's `HuggingFaceModel`.
        target_modules: regex patterns over module names; None picks the LoRA A/B factors of the
            active adapters (peft) or every linear layer (attention and MLP) of the chosen blocks.
        last_n_blocks: take targets from the last this many blocks (default 1).
        include_lm_head: also use the output embedding (sketched unless tiny).
        exact_max_numel: a layer with `d_out * d_in` above this is sketched (default 65536).
        sketch_dim: k_out = k_in, or a (k_out, k_in) tuple (default 32).
        normalization: "none" | "unit" | "adam_optimizer" (default) | "adam_simulated".
        adam_betas: betas of the simulated filter (the optimizer's own betas are read from it).
        adam_eps: epsilon of both Adam normalisations.
        precondition: where `adam_optimizer` applies P = 1/(sqrt(v_hat)+eps): "pool" (default: the
            pool's features carry P, the validation feature is raw, so <x_i, xbar> = g_i^T P g_val,
            the first-order effect of an Adam step), "split" (P^1/2 on both sides: same scores, Gram
            in the preconditioned metric) or "both" (P on both sides, scoring g_i^T P^2 g_val).
            "pool" is the default because it trained to a lower held-out loss than "both" and
            "split" on dm_math at equal steps (docs/results/study_dm_math.md, ablations).
            `normalization_in_use` names it, e.g. "adam_optimizer/pool".
        proj_dim: compressed width; None uses the model's hidden size, 0 keeps the raw features. A
            value at least the raw width also keeps them raw.
        chunk_size: examples per forward, bounding activation and logits memory; "auto" (default)
            takes the `auto_chunk_size` given to `compute` (DataSelection passes the run's device
            microbatch size), else `DEFAULT_CHUNK_SIZE`. An out-of-memory error while scoring
            halves the chunk and retries (down to 1); the halved size is kept for later calls and
            `chunk_size_in_use` tells the size of the last call.
        seed: base seed of all projections (each layer's index is folded in).
        resample_projections: fold `step` into the seeds so projections change every step (default
            False: fixed projections, required for `adam_simulated` in sketch mode to be meaningful).
        score_tokens: score each POOL example on its first this many target tokens (labels !=
            -100) instead of all (default None: all). Later labels are ignored and each chunk's
            sequences are cut after the furthest target still needed, so the forward below and
            through the target blocks runs over fewer positions (`features/score_tokens.py`).
            The validation batch is always scored in full: it is the target the pool is matched
            to. A value at least the sequence length changes nothing. `score_length_in_use`
            tells the longest cut of the last call (positions scored per pool row).
        score_window: score each row of the pool AND of the validation batch on a window of this
            many tokens, cut out and run as its own sequence (no left context), so the whole
            scoring forward and backward runs over t positions instead of T (for packed long
            sequences; `features/windows.py` says why no context). None (default): whole rows. A
            value at least the sequence length changes nothing. Exclusive with `score_tokens`.
        score_window_position: `start` (each row's first t tokens) or `random` (a start drawn per
            row and step from `(seed, step)` alone: the same on every rank, the same on resume).
        compile: compile the per-layer products of sketched targets with `torch.compile` (default
            False: eager). On CUDA in mode `reduce-overhead`, so their kernels replay as one CUDA
            graph; the shapes are static within a run (pool, windows and targets are fixed). The
            forward and backward stay eager.
        compile_forward: compile the blocks below the cut for the scoring forward (default False:
            eager): they run without autograd on shapes fixed for a run, so every block shares one
            graph (on CUDA in mode `reduce-overhead`); the blocks from the cut up stay eager
            (`compiled_forward.CompiledBlocksBelowCut`). The training forward is not touched.

    Raises:
        ValueError: for bad options or targets (the message lists the candidate modules).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        target_modules: list[str] | None = None,
        last_n_blocks: int = 1,
        include_lm_head: bool = False,
        exact_max_numel: int = 65536,
        sketch_dim: int | tuple[int, int] = 32,
        normalization: str = "adam_optimizer",
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        precondition: str = "pool",
        proj_dim: int | None = None,
        chunk_size: int | str = "auto",
        seed: int = 0,
        resample_projections: bool = False,
        score_tokens: int | None = None,
        score_window: int | None = None,
        score_window_position: str = "start",
        compile: bool = False,
        compile_forward: bool = False,
        logits_at: str = "all",
    ) -> None:
        problems = feature_option_problems(
            normalization=normalization,
            sketch_dim=sketch_dim,
            chunk_size=chunk_size,
            proj_dim=proj_dim,
            adam_betas=adam_betas,
            adam_eps=adam_eps,
            precondition=precondition,
            score_tokens=score_tokens,
            score_window=score_window,
            score_window_position=score_window_position,
            compile=compile,
            compile_forward=compile_forward,
        )
        if problems:
            raise ValueError("; ".join(problems))
        k_out, k_in = (sketch_dim, sketch_dim) if isinstance(sketch_dim, int) else tuple(sketch_dim)

        self._bind_model(model, target_modules, last_n_blocks, include_lm_head, exact_max_numel, compile_forward)
        self.logits_at = self._scoring_logits_at(logits_at)
        self.k_out, self.k_in = k_out, k_in
        self.normalization, self.adam_eps, self.precondition = normalization, adam_eps, precondition
        self.chunk_size = chunk_size
        self.chunk_size_in_use: int | None = None
        self._oom_chunk_cap: int | None = None  # the chunk an out-of-memory error settled on
        self._attempt_rows = 0  # rows of the chunk being scored (for the retry after an OOM)
        self.seed, self.resample_projections, self.score_tokens = seed, resample_projections, score_tokens
        self.score_length_in_use: int | None = None  # longest pool sequence the last call scored
        # (n_v, d) the last call's validation features row by row (gbar is their mean), or None.
        self.val_features_in_use: torch.Tensor | None = None
        self.score_window, self.score_window_position = score_window, score_window_position
        _log_scored_tokens(score_tokens, score_window, score_window_position)
        self.simulated = SimulatedAdam(adam_betas, adam_eps)

        self._raw_dims = [t.raw_dim(k_out, k_in) for t in self.targets]
        self.proj_dim = self._resolved_proj_dim(proj_dim, sum(self._raw_dims))
        self.normalization_in_use = normalization
        # Share of target layers whose features carried the Adam normalisation in the last call (None
        # before the first); with adam_optimizer, the layers whose parameters have optimizer state.
        self.preconditioned_fraction: float | None = None
        self._unpreconditioned_warned: tuple[str, ...] = ()
        self.last_step: int | None = None
        self._sketch_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # Every target sketched (large layers, the pretraining recipes): products and FJLT batched
        # across layers (`_sketched_rows_features`).
        self._all_sketched = all(t.sketched for t in self.targets)
        self._fjlt_stack_cache: dict[tuple, FJLTStack] = {}
        self._call_cache: dict[tuple, Any] = {}  # per compute() call: projections scaled by that call's Adam scales
        # `compile`: the batched products compiled once (static shapes: the pool, window and targets
        # are fixed for a run); on CUDA in mode reduce-overhead, i.e. replayed as a CUDA graph.
        self.compile = compile
        self._products: Callable[..., torch.Tensor] = (
            _compiled_products(next(self.model.parameters()).is_cuda) if compile else sketched_layer_products
        )
        self._fjlt_cache: dict[tuple, FJLTPlan] = {}

    def _bind_model(
        self,
        model: nn.Module,
        target_modules: list[str] | None,
        last_n_blocks: int,
        include_lm_head: bool,
        exact_max_numel: int,
        compile_forward: bool,
    ) -> None:
        """The model's parts the scoring pass uses: the forward module, the targets, the cut, FSDP's units."""
        self.model = unwrap_model(model)
        # Under FSDP the forward goes through the outermost FSDP wrapper (it gathers the shards) and the
        # Adam state of the targets is read from every rank's shard (docs/features.md, "FSDP").
        self._forward_model = forward_module(model)
        self._shards = fsdp_param_shards(self._forward_model)
        # Units that hold whole parameters (NO_SHARD: FSDP on one rank) score as without FSDP; they are
        # put back after each scoring backward, which runs none of FSDP's post-backward hooks.
        self._whole_units = fsdp_whole_units(self._forward_model)
        self.targets: list[TargetLayer] = resolve_targets(
            self.model,
            target_modules=target_modules,
            last_n_blocks=last_n_blocks,
            include_lm_head=include_lm_head,
            exact_max_numel=exact_max_numel,
        )
        # Checkpoint-wrapped blocks run unwrapped in the scoring pass (capture.unwrapped_checkpoints), so
        # the cut's hook goes on the module that runs then.
        self._checkpoint_wrappers = checkpoint_wrappers(self._forward_model)
        self._cut = checkpoint_inner(choose_cut_module(self.model, self.targets))
        # `compile_forward`: the blocks below the cut compiled for the scoring forward (compiled_forward.py).
        self._compiled_below = CompiledBlocksBelowCut(self.model, self._cut) if compile_forward else None
        # What the optimizer keys each target's state by under such units (FSDP's flat parameters
        # with use_orig_params false); None: the targets' own parameters.
        self._state_params = (
            [fsdp_state_params(self._whole_units, t) for t in self.targets] if self._whole_units else None
        )

    def _scoring_logits_at(self, logits_at: str) -> str:
        """Where the scoring forward projects to the vocabulary: the model's `logits_at` where it can.

        With `targets` (composer_algos.models.causal_lm) the scoring forward projects only the positions
        with a loss too, where its logits are the decoder's output through a linear output embedding that
        is not itself a target, and outside FSDP (whose outermost wrapper's forward must run); the same
        per-example losses either way.
        """
        if logits_at != "targets":
            return "all"
        lm_head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        if self._forward_model is not self.model:
            log.info("model.logits_at=targets: the scoring forward projects every position under FSDP")
            return "all"
        if not projects_at_targets(self.model) or any(t.module is lm_head for t in self.targets):
            log.info("model.logits_at=targets: the scoring forward projects every position (output embedding targeted or transformed)")
            return "all"
        return "targets"

    def _resolved_proj_dim(self, proj_dim: int | None, raw_total: int) -> int:
        """The projection width (default: the model's hidden size); 0 keeps features at `raw_total` unprojected."""
        if proj_dim is None:
            proj_dim = getattr(getattr(self.model, "config", None), "hidden_size", None)
            if not isinstance(proj_dim, int):
                raise ValueError("`proj_dim=None` needs `model.config.hidden_size`; pass `proj_dim` explicitly")
        if proj_dim and proj_dim >= raw_total:
            log.info("proj_dim=%d >= raw feature width %d: features are kept uncompressed", proj_dim, raw_total)
        return 0 if proj_dim >= raw_total else proj_dim

    @property
    def feature_dim(self) -> int:
        """Width d of the returned features."""
        return self.proj_dim or sum(self._raw_dims)

    @property
    def target_names(self) -> list[str]:
        """Names of the target modules, in feature order."""
        return [t.name for t in self.targets]

    def compute(
        self,
        pool_batch: Mapping[str, torch.Tensor],
        val_batch: Mapping[str, torch.Tensor] | None = None,
        *,
        step: int = 0,
        optimizer: torch.optim.Optimizer | None = None,
        precision_context: Callable[[], AbstractContextManager] | None = None,
        auto_chunk_size: int | None = None,
        row_offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Features of the pool and the mean feature of the validation batch.

        Args:
            pool_batch: `input_ids` (n, T) long, `attention_mask` (n, T), `labels` (n, T) long with -100
                masked; other keys are ignored.
            val_batch: same layout, or None.
            step: the training step (folded into the seeds only with `resample_projections`).
            optimizer: the training optimizer, read (never written) by `adam_optimizer`.
            precision_context: factory of the context every scoring forward runs in (the run's
                autocast, e.g. `lambda: get_precision_context(state.precision)`); the layer
                signals it produces are upcast to float32 before any product (docs/features.md,
                Precision). None: the model's own dtype.
            auto_chunk_size: what `chunk_size="auto"` means for this call (the run's device
                microbatch size); ignored when `chunk_size` is an int.
            row_offset: the pool's first row in the global pool (rank x rows per rank), for
                `score_window_position: random` (the draw is one vector over the global pool).

        Returns:
            G (n, d) float32 and gbar (d,) float32 (None without `val_batch`), on the model's device;
            both with the same projections and normalisation.

        Raises:
            FeatureError: when some feature is non-finite, or G (or gbar) is all zero.
            ValueError: for an `auto_chunk_size` below 1.
            RuntimeError: an out-of-memory error with chunks of one example, or any other error.
        """
        self.last_step = step
        device = next(self.model.parameters()).device
        with record_function("features/normalization"):
            preconditioners = self._adam_preconditioners(optimizer)
        use_sim = self.normalization == "adam_simulated"
        pool_pre, val_pre = _split_preconditioners(preconditioners, self.precondition)
        self._call_cache = {}
        full_length = int(pool_batch["input_ids"].shape[1])
        pool_batch, val_batch = self._windowed(pool_batch, val_batch, step, row_offset)
        chunk = self._rows_per_forward(auto_chunk_size, full_length)
        while True:
            oom = False
            try:
                G_nd, gbar_d = self._score_once(
                    pool_batch, val_batch, pool_pre, val_pre, use_sim, device, step, chunk, precision_context
                )
                break
            except BaseException as e:
                self.simulated.discard()
                if not (isinstance(e, Exception) and is_out_of_memory(e)) or self._attempt_rows <= 1:
                    raise
                oom = True
            if oom:
                # Outside the except block, so the failed attempt's frames (and their tensors) are freed.
                chunk = self._halve_chunk(chunk)
        self.chunk_size_in_use = chunk
        if use_sim:
            self.simulated.commit()
        G_nd = G_nd.float()
        return G_nd, (gbar_d.float() if gbar_d is not None else None)

    def _score_once(
        self,
        pool_batch: Mapping[str, torch.Tensor],
        val_batch: Mapping[str, torch.Tensor] | None,
        pool_pre: Any,
        val_pre: Any,
        use_sim: bool,
        device: torch.device,
        step: int,
        chunk: int,
        precision_context: Callable[[], AbstractContextManager] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One attempt of `compute` at `chunk` rows a forward: G and gbar, checked (one host sync)."""
        bad_rows: list[torch.Tensor] = []  # per-call tensors; one host sync at the end
        with scoring_mode(self.model):
            parts = [(pool_batch, pool_pre, use_sim, self.score_tokens)]
            if val_batch is not None:
                parts.append((val_batch, val_pre, False, None))
            # Windows of the pool and of the validation batch share one forward (their rows
            # have the same length); whole rows are scored batch by batch as before.
            joint = self._joint_windows(pool_batch, val_batch)
            outs = self._features_of(
                parts if joint else parts[:1], device, step, bad_rows, chunk=chunk,
                precision_context=precision_context,
            )
            if not joint and val_batch is not None:
                outs += self._features_of(
                    parts[1:], device, step, bad_rows, chunk=chunk, precision_context=precision_context
                )
            G_nd = outs[0]
            gbar_d, self.val_features_in_use = None, None
            if val_batch is not None:
                V_nd = outs[1]
                gbar_d = V_nd.mean(dim=0)
                self.val_features_in_use = V_nd
        with record_function("features/check_host_sync"):
            self._check(G_nd, gbar_d, bad_rows)
        return G_nd, gbar_d

    def fidelity(
        self,
        pool_batch: Mapping[str, torch.Tensor],
        val_batch: Mapping[str, torch.Tensor],
        *,
        step: int = 0,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> dict[str, float]:
        """How faithfully the compressed features rank and relate the pool, against uncompressed ones.

        Computes the features twice on the same batches, with the configured `proj_dim` and with
        none (same targets, sketches and normalisation), and compares the validation scores
        `<x_i, xbar>` (Spearman rank correlation) and the Grams `X X^T` (relative Frobenius error).
        Nothing is committed: the simulated-Adam state is left as found. Use it to choose `proj_dim`
        (docs/features.md); it costs two feature passes.

        Returns:
            `{"score_spearman", "gram_rel_error", "proj_dim", "raw_dim"}`; a `proj_dim` of 0 (no
            compression) gives Spearman 1 and error 0.
        """
        device = next(self.model.parameters()).device
        pre = self._adam_preconditioners(optimizer)
        pool_pre, val_pre = _split_preconditioners(pre, self.precondition)
        self._call_cache = {}
        full_length = int(pool_batch["input_ids"].shape[1])
        pool_batch, val_batch = self._windowed(pool_batch, val_batch, step, 0)
        chunk = self._rows_per_forward(None, full_length)
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        saved = self.proj_dim
        try:
            with scoring_mode(self.model):
                for width in (saved, 0):
                    self.proj_dim = width
                    G = self._features(
                        pool_batch, device, step, pool_pre, [], accumulate=False, chunk=chunk, score_tokens=self.score_tokens
                    )
                    V = self._features(val_batch, device, step, val_pre, [], accumulate=False, chunk=chunk)
                    G, V = G.double(), V.double()
                    out.append((G, V.mean(dim=0)))
        finally:
            self.proj_dim = saved
            self.simulated.discard()
        (G_c, g_c), (G_r, g_r) = out
        K_c, K_r = G_c @ G_c.T, G_r @ G_r.T
        return {
            "score_spearman": spearman(G_c @ g_c, G_r @ g_r),
            "gram_rel_error": float((K_c - K_r).norm() / K_r.norm().clamp_min(1e-300)),
            "proj_dim": float(saved),
            "raw_dim": float(sum(self._raw_dims)),
        }

    def _windowed(self, pool_batch, val_batch, step: int, row_offset: int):
        """The pool and validation batches cut to their scoring windows (as given without `score_window`)."""
        t = self.score_window
        if t is None:
            return pool_batch, val_batch
        kw = {"position": self.score_window_position, "seed": self.seed, "step": step}
        pool_batch = window_batch(pool_batch, t, stream=POOL_STREAM, row_offset=row_offset, **kw)
        if val_batch is not None:
            val_batch = window_batch(val_batch, t, stream=VALIDATION_STREAM, **kw)
        self.score_length_in_use = int(pool_batch["input_ids"].shape[1])
        return pool_batch, val_batch

    def state_dict(self) -> dict:
        """Checkpointable state (the simulated-Adam moments and the settings that shape the features)."""
        return {
            "simulated_adam": self.simulated.state_dict(),
            "target_names": self.target_names,
            "sketch_dim": (self.k_out, self.k_in),
            "seed": self.seed,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from `state_dict()`.

        Raises:
            ValueError: when the saved targets, sketch size or seed differ from this extractor's.
        """
        now = {"target_names": self.target_names, "sketch_dim": [self.k_out, self.k_in], "seed": self.seed}
        saved = {k: (list(state[k]) if isinstance(state[k], (list, tuple)) else state[k]) for k in now if k in state}
        mismatches = [f"{k}: saved {saved[k]!r}, now {now[k]!r}" for k in saved if saved[k] != now[k]]
        if mismatches:
            raise ValueError(f"feature-extractor state does not fit this extractor ({'; '.join(mismatches)})")
        self.simulated.load_state_dict(state["simulated_adam"])
        self.last_step = state.get("last_step")

    def _features(
        self,
        batch: Mapping[str, torch.Tensor],
        device: torch.device,
        step: int,
        preconditioners: list[list[torch.Tensor]] | None,
        bad_rows: list[torch.Tensor],
        *,
        accumulate: bool,
        chunk: int,
        precision_context: Callable[[], AbstractContextManager] | None = None,
        score_tokens: int | None = None,
    ) -> torch.Tensor:
        """Normalised, compressed features of one batch, `chunk` examples a forward (each cut to `score_tokens`)."""
        parts = [(batch, preconditioners, accumulate, score_tokens)]
        return self._features_of(parts, device, step, bad_rows, chunk=chunk, precision_context=precision_context)[0]

    def _features_of(
        self,
        parts: list[tuple[Mapping[str, torch.Tensor], Any, bool, int | None]],
        device: torch.device,
        step: int,
        bad_rows: list[torch.Tensor],
        *,
        chunk: int,
        precision_context: Callable[[], AbstractContextManager] | None = None,
    ) -> list[torch.Tensor]:
        """Features of several batches scored in the same forwards, `chunk` rows a forward.

        `parts` are `(batch, preconditioners, accumulate, score_tokens)`; their rows are stacked
        (the batches must have the same length; `score_tokens` is for a lone batch) and cut into
        forwards of `chunk` rows, and each forward's signals are turned into features, each row
        with its batch's preconditioners (`_forward_features`: with every target sketched, all the
        forward's rows in one pass). Returns one `(rows, d)` tensor per part.
        """
        batches = [p[0] for p in parts]
        sizes = [int(b["input_ids"].shape[0]) for b in batches]
        if min(sizes) == 0:
            raise ValueError("a batch passed to GradFeatureExtractor.compute has no rows")
        batch = batches[0] if len(batches) == 1 else _stack_rows(batches)
        score_tokens = parts[0][3] if len(parts) == 1 else None
        bounds = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
        outs: list[list[torch.Tensor]] = [[] for _ in parts]
        longest = 0
        for start in range(0, bounds[-1][1], chunk):
            stop = min(start + chunk, bounds[-1][1])
            # Cut where the batch is (the loader's: the host, so the cut's length costs no sync),
            # then moved without making the host wait.
            whole = (start, stop) == (0, bounds[-1][1])
            part = {k: v if whole else v[start:stop] for k, v in batch.items() if torch.is_tensor(v)}
            part = first_target_tokens(part, score_tokens)
            part = {k: v.to(device, non_blocking=True) for k, v in part.items()}
            longest = max(longest, int(part["input_ids"].shape[1]))
            self._attempt_rows = stop - start
            with (
                unwrapped_checkpoints(self._checkpoint_wrappers),
                self._compiled_below.swapped() if self._compiled_below is not None else nullcontext(),
            ):
                signals, _ = capture_layer_signals(
                    self._forward_model, part, self.targets, self._cut, precision_context, logits_at=self.logits_at
                )
            if self._whole_units:
                settle_fsdp_units(self._whole_units)
            # This forward's rows of each part: (part, first row, end row), rows counted in the forward.
            segments = [
                (i, max(lo, start) - start, min(hi, stop) - start)
                for i, (lo, hi) in enumerate(bounds)
                if max(lo, start) < min(hi, stop)
            ]
            pieces = self._forward_features(signals, [(*parts[i][1:3], a, b) for i, a, b in segments], step, bad_rows)
            for (i, _, _), x in zip(segments, pieces):
                outs[i].append(x)
        if score_tokens is not None:
            self.score_length_in_use = longest
        out = [torch.cat(o, dim=0) if len(o) > 1 else o[0] for o in outs]
        return [unit_rows(X) for X in out] if self.normalization == "unit" else out

    def _forward_features(
        self,
        signals: list[tuple[torch.Tensor, torch.Tensor]],
        segments: list[tuple[Any, bool, int, int]],
        step: int,
        bad_rows: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """The features of one forward's rows, one `(rows, d)` tensor per segment `(preconditioners, accumulate, lo, hi)`.

        With every target sketched, all the rows go through one pass (`_sketched_rows_features`),
        each segment's rows with its own preconditioners; else segment by segment.
        """
        if self._all_sketched:
            x_nd = self._sketched_rows_features(signals, segments, step, bad_rows)
            # The segments tile the forward's rows in order: one split.
            return [x_nd] if len(segments) == 1 else list(x_nd.split([hi - lo for _, _, lo, hi in segments]))
        n = int(signals[0][0].shape[0])
        out = []
        for pre, accumulate, lo, hi in segments:
            rows = signals if (lo, hi) == (0, n) else [(x[lo:hi], d[lo:hi]) for x, d in signals]
            out.append(self._rows_features(rows, pre, step, accumulate, bad_rows))
        return out

    def _rows_features(
        self,
        signals: list[tuple[torch.Tensor, torch.Tensor]],
        preconditioners: Any,
        step: int,
        accumulate: bool,
        bad_rows: list[torch.Tensor],
    ) -> torch.Tensor:
        """Normalised, compressed features (m, d) of the rows whose layer signals are given, layer by layer."""
        out_nd = None
        raw_parts = []
        for t, (a_nTI, delta_nTO) in zip(self.targets, signals):
            # Upcast before any product: under a bf16 autocast the captured inputs and output
            # gradients are bf16, and the per-example sums over T tokens, the Adam scales, the
            # FFT and the solver all run in float32 (float64 models keep float64).
            dtype = torch.promote_types(a_nTI.dtype, torch.float32)
            a_nTI, delta_nTO = a_nTI.to(dtype), delta_nTO.to(dtype)
            pre = preconditioners[t.index] if preconditioners is not None else None
            with record_function("features/products"):
                x_nD, col_scale_D = self._layer_features(t, a_nTI, delta_nTO, pre, step)
            if self.normalization == "adam_simulated":
                if accumulate:
                    self.simulated.accumulate(t.name, x_nD)
                x_nD = self.simulated.filter(t.name, x_nD)
            # A row holding NaN/inf has a non-finite sum: one reduction instead of an elementwise mask.
            bad_rows.append((~torch.isfinite(x_nD.sum(dim=1))).sum())
            if self.proj_dim:
                if out_nd is None:
                    out_nd = x_nD.new_zeros(x_nD.shape[0], self.proj_dim)
                with record_function("features/fjlt"):
                    apply_fjlt(x_nD, self._fjlt_plan(t, x_nD, step), out_nd, col_scale_D)
            else:
                raw_parts.append(x_nD if col_scale_D is None else x_nD * col_scale_D)
        return out_nd if self.proj_dim else torch.cat(raw_parts, dim=1)

    def _sketched_rows_features(
        self,
        signals: list[tuple[torch.Tensor, torch.Tensor]],
        segments: list[tuple[Any, bool, int, int]],
        step: int,
        bad_rows: list[torch.Tensor],
    ) -> torch.Tensor:
        """The features (n, d) of every row of a forward when every target is sketched: layers and rows batched.

        Every sketch is K x J, so the L layers' features stack into one (L, n, K J) tensor: the
        input-side projections take one matmul per distinct input (q, k and v read the same
        tensor; so do gate and up), the products one batched matmul, the non-finite check one
        reduction and the FJLT one batched FFT (`fjlt_stack`). Rows with different
        preconditioners (the pool's and the validation batch's windows, `segments` of
        `(preconditioners, accumulate, lo, hi)`) share the pass: each side's projections stand
        side by side (S sides: S K x S J sketches of every row), and each row keeps the block of
        its own side, i.e. its products with its own side's projections. The same arithmetic as
        the layer-by-layer path, grouped (each output row of a matmul or FFT depends only on its
        own inputs, up to the floating-point order of the grouped kernels).
        """
        sides: list[Any] = []  # distinct preconditioners (by identity), in order of first use
        for pre, _, _, _ in segments:
            if not any(pre is side for side in sides):
                sides.append(pre)
        out_projections, in_projections = self._side_projections(sides, signals[0][0], step)
        # The hooks detach each call's input, so layers reading one tensor hold distinct views of
        # the same memory: grouped by where their data lives.
        groups: dict[tuple, list[int]] = {}
        for pos, (a_nTI, _) in enumerate(signals):
            key = (a_nTI.data_ptr(), tuple(a_nTI.shape), a_nTI.stride(), a_nTI.dtype)
            groups.setdefault(key, []).append(pos)
        inputs = [signals[positions[0]][0] for positions in groups.values()]
        grouped = [
            self._stacked_inputs(in_projections, positions, a.shape[-1], sides) for a, positions in zip(inputs, groups.values())
        ]
        biases = [in_projections[pos][a.shape[-1]] if t.has_bias else None for pos, (t, (a, _)) in enumerate(zip(self.targets, signals))]
        with record_function("features/products"):
            x_LnD = self._products(
                inputs, grouped, tuple(tuple(p) for p in groups.values()),
                [d for _, d in signals], list(out_projections), biases, len(sides) * self.k_in,
            )
        if len(sides) > 1:
            x_LnD = self._own_side_blocks(x_LnD, sides, segments)
        if self.normalization == "adam_simulated":
            filtered = []
            for t, x_nD in zip(self.targets, x_LnD):
                for _, accumulate, lo, hi in segments:
                    if accumulate:
                        self.simulated.accumulate(t.name, x_nD[lo:hi])
                filtered.append(self.simulated.filter(t.name, x_nD))
            x_LnD = torch.stack(filtered)
        # A row holding NaN/inf has a non-finite sum (x * 0 is NaN exactly then): one count per layer.
        bad_rows.append(torch.isnan(x_LnD.sum(dim=2) * 0).sum(dim=1))
        if not self.proj_dim:
            return x_LnD.transpose(0, 1).flatten(1)
        with record_function("features/fjlt"):
            return fjlt_stack(x_LnD, self._fjlt_stack_plan(x_LnD, step))

    def _own_side_blocks(self, x_LnD: torch.Tensor, sides: list[Any], segments: list[tuple[Any, bool, int, int]]) -> torch.Tensor:
        """From the (L, n, S K S J) products with every side's projections, each row's own side's (L, n, K J).

        Side s's sketch of a row is the (s, s) block: its output-side and input-side projections.
        """
        L, n, S = x_LnD.shape[0], x_LnD.shape[1], len(sides)
        x_LnKJS = x_LnD.view(L, n, S, self.k_out, S, self.k_in).diagonal(dim1=2, dim2=4)
        pieces = []
        for pre, _, lo, hi in segments:
            side = next(s for s, p in enumerate(sides) if p is pre)
            pieces.append(x_LnKJS.narrow(1, lo, hi - lo).select(4, side))
        return torch.cat(pieces, dim=1).flatten(2)

    def _layer_features(
        self,
        t: TargetLayer,
        a_nTI: torch.Tensor,
        delta_nTO: torch.Tensor,
        pre: tuple[torch.Tensor, ...] | None,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One layer's raw features (n, D), and the elementwise Adam scale (D,) still to apply (exact layers)."""
        if not t.sketched:
            x_nD = exact_layer_grads(a_nTI, delta_nTO, t.has_bias)
            return x_nD, (pre[0].to(x_nD.dtype) if pre is not None else None)
        P_out_KO, P_in_JI = self._sketch(t, a_nTI.device, a_nTI.dtype, step)
        if pre is not None:
            s_out_O, s_in_I = pre
            P_out_KO = P_out_KO * s_out_O.to(P_out_KO.dtype)
            P_in_JI = P_in_JI * s_in_I.to(P_in_JI.dtype)
        return sketch_layer_grads(a_nTI, delta_nTO, P_out_KO, P_in_JI), None

    def _resolve_chunk(self, auto_chunk_size: int | None) -> int:
        """Examples per forward: `chunk_size`, or for "auto" the caller's microbatch size; at most the OOM cap."""
        return self._rows_per_forward(auto_chunk_size, None)

    def _rows_per_forward(self, auto_chunk_size: int | None, full_length: int | None) -> int:
        """Rows scored per forward: `chunk_size` rows of the batch's full length, at most the OOM cap.

        `chunk_size` (or for "auto" the caller's microbatch size) counts rows of `full_length`
        tokens (the training microbatch's memory). With `score_window` t shorter than that, a
        window holds t / full_length of a row's tokens, activations and logits, so
        `full_length // t` windows take one row's place in a forward.
        """
        if auto_chunk_size is not None and not (isinstance(auto_chunk_size, int) and auto_chunk_size >= 1):
            raise ValueError(f"`auto_chunk_size` must be an int >= 1 (the run's microbatch size), got {auto_chunk_size!r}")
        if isinstance(self.chunk_size, int):
            chunk = self.chunk_size
        else:
            chunk = auto_chunk_size if auto_chunk_size is not None else DEFAULT_CHUNK_SIZE
        t = self.score_window
        if t is not None and full_length is not None and t < full_length:
            chunk *= full_length // t
        return min(chunk, self._oom_chunk_cap) if self._oom_chunk_cap is not None else chunk

    def _joint_windows(self, pool_batch: Mapping[str, torch.Tensor], val_batch: Mapping[str, torch.Tensor] | None) -> bool:
        """Whether the pool's and the validation batch's windows are scored in the same forwards."""
        if val_batch is None or self.score_window is None:
            return False
        t = self.score_window
        return int(pool_batch["input_ids"].shape[1]) == int(val_batch["input_ids"].shape[1]) == t

    def _side_projections(self, sides: list[Any], like: torch.Tensor, step: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Per target, its sketch projections transposed, each side's Adam scales folded in, the sides side by side.

        Target l gets (O_l, S K) and (I_l, S J) (I_l + 1 rows with a bias), side s in columns s K ..
        (s + 1) K: `P_out diag(s_out)` and `P_in diag(s_in)` of that side's scales, transposed. All
        targets' columns are scaled at once (one product a side and matrix), once per call.
        """
        dtype = compute_dtype(like.dtype)
        key = ("sides", tuple(id(pre) for pre in sides), like.device, dtype)
        cached = self._call_cache.get(key)
        if cached is None:
            raw_out_OK, raw_in_IJ = self._flat_sketches(like.device, dtype, step)
            outs, ins = [], []
            for pre in sides:
                if pre is None:
                    outs.append(raw_out_OK)
                    ins.append(raw_in_IJ)
                else:
                    s_out, s_in = self._flat_scales(pre, like, dtype)
                    outs.append(raw_out_OK * s_out.unsqueeze(1))
                    ins.append(raw_in_IJ * s_in.unsqueeze(1))
            out_OK = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
            in_IJ = ins[0] if len(ins) == 1 else torch.cat(ins, dim=1)
            cached = (
                out_OK.split([t.d_out for t in self.targets]),
                in_IJ.split([t.d_in + t.has_bias for t in self.targets]),
            )
            self._call_cache[key] = cached
        return cached

    def _flat_sketches(self, device: torch.device, dtype: torch.dtype, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every target's sketch projections, transposed and stacked: (sum O, K) and (sum I, J) (cached)."""
        key = ("flat", device, dtype, step if self.resample_projections else None)
        cached = self._sketch_cache.get(key)
        if cached is None:
            pairs = [self._sketch(t, device, dtype, step) for t in self.targets]
            cached = (torch.cat([P_out.T for P_out, _ in pairs]), torch.cat([P_in.T for _, P_in in pairs]))
            self._sketch_cache[key] = cached
        return cached

    def _flat_scales(self, pre: list[tuple[torch.Tensor, ...] | None], like: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One side's factored Adam scales of every target, concatenated: (sum O,) and (sum I,); ones for a target without."""
        flat = getattr(pre, "flat", None)  # `batched_factored_scales` keeps them concatenated
        if flat is None:
            outs, ins = [], []
            for t, scales in zip(self.targets, pre):
                outs.append(scales[0] if scales is not None else like.new_ones(t.d_out, dtype=dtype))
                ins.append(scales[1] if scales is not None else like.new_ones(t.d_in + t.has_bias, dtype=dtype))
            flat = (torch.cat(outs), torch.cat(ins))
        return flat[0].to(dtype), flat[1].to(dtype)

    def _stacked_inputs(self, in_projections: tuple[torch.Tensor, ...], positions: list[int], d_in: int, sides: list[Any]) -> torch.Tensor:
        """The input-side projections of the targets at `positions` (one input tensor), side by side (I, len S J)."""
        key = ("inputs", tuple(id(pre) for pre in sides), tuple(positions), in_projections[positions[0]].dtype)
        cached = self._call_cache.get(key)
        if cached is None:
            parts = [in_projections[pos] if in_projections[pos].shape[0] == d_in else in_projections[pos][:d_in] for pos in positions]
            cached = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            self._call_cache[key] = cached
        return cached

    def _fjlt_stack_plan(self, x_LnD: torch.Tensor, step: int) -> FJLTStack:
        """Every target's (cached) FJLT plan, stacked for `fjlt_stack` (the targets share their width D)."""
        step_key = step if self.resample_projections else None
        key = (x_LnD.shape[2], x_LnD.device, x_LnD.dtype, step_key)
        if key not in self._fjlt_stack_cache:
            if self.resample_projections:
                self._fjlt_stack_cache = {}
            x_nD = x_LnD[0]
            self._fjlt_stack_cache[key] = stack_fjlt_plans([self._fjlt_plan(t, x_nD, step) for t in self.targets])
        return self._fjlt_stack_cache[key]

    def _halve_chunk(self, chunk: int) -> int:
        """After an out-of-memory error: half the rows that failed, kept as the cap for later calls."""
        failed = min(chunk, self._attempt_rows)
        new = max(failed // 2, 1)
        self._oom_chunk_cap = new
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.warning(
            "out of memory while scoring %d examples a forward: chunk size %d -> %d, retrying the step's "
            "features (as Composer's auto microbatching halves the microbatch)",
            failed,
            failed,
            new,
        )
        return new

    def _adam_preconditioners(
        self, optimizer: torch.optim.Optimizer | None
    ) -> list[tuple[torch.Tensor, ...] | None] | None:
        """Per target, the Adam scale from the optimizer's v_hat, computed once per call.

        Exact layers get `(1 / (sqrt(v_hat) + eps),)` flattened in feature order, sketched layers the
        factored `(s_out, s_in)`. A target whose parameters have no second moment in the optimizer
        (frozen, or not given to it) gets None and is used unpreconditioned while the others keep
        theirs, with one warning naming it. None for every target (no optimizer, step 0) gives None
        and `normalization_in_use = "none"`. `preconditioned_fraction` records the share of
        targets preconditioned in this call.
        """
        if self.normalization != "adam_optimizer":
            self.normalization_in_use = self.normalization
            self.preconditioned_fraction = 1.0 if self.normalization == "adam_simulated" else 0.0
            return None
        if self._shards is not None:
            layers = [(t.params, t.d_out, t.d_in, t.sketched) for t in self.targets]
            pre = sharded_adam_scales(optimizer, layers, self._shards, self.adam_eps, torch.distributed.all_reduce)
        else:
            params_of = [self._state_params[t.index] if self._state_params else t.params for t in self.targets]
            # Every target a sketched bias-free matrix (the pretraining recipes): all layers' scales at once.
            batched = None
            if self._all_sketched and all(len(params) == 1 for params in params_of):
                batched = batched_factored_scales(optimizer, [params[0] for params in params_of], self.adam_eps)
            pre = batched if batched is not None else []  # keeps `batched.flat` for `_flat_scales`
            for t in self.targets if batched is None else ():
                params = self._state_params[t.index] if self._state_params else t.params
                v = optimizer_second_moments(optimizer, params)
                if v is None:
                    pre.append(None)
                else:
                    pre.append(factored_adam_scales(v, self.adam_eps) if t.sketched else (exact_adam_scale(v, self.adam_eps),))
        missing = tuple(t.name for t, scales in zip(self.targets, pre) if scales is None)
        self.preconditioned_fraction = 1.0 - len(missing) / len(self.targets)
        if len(missing) == len(self.targets):
            stepped = optimizer is not None and len(optimizer.state) > 0  # not step 0: the targets are frozen
            if self.normalization_in_use != "none" and not stepped:
                log.warning(
                    "adam_optimizer normalisation: the optimizer has no second moment for any target layer "
                    "yet (no optimizer, or step 0); using no normalisation until it has"
                )
            elif stepped and missing != self._unpreconditioned_warned:
                log.warning(
                    "adam_optimizer normalisation: the optimizer has taken steps but holds no second moment for "
                    "any target layer %s (frozen, or not given to the optimizer); the features are not normalised "
                    "(selection/normalization_preconditioned_fraction 0)",
                    list(missing),
                )
                self._unpreconditioned_warned = missing
            self.normalization_in_use = "none"
            return None
        if missing and missing != self._unpreconditioned_warned:
            log.warning(
                "adam_optimizer normalisation: the optimizer holds no second moment for target layer(s) %s "
                "(frozen, or not given to the optimizer): their features are used without the preconditioner, "
                "the other %d layer(s)' with it (selection/normalization_preconditioned_fraction %.3f); leave "
                "frozen layers out of the targets (target_modules, include_lm_head) to score with "
                "preconditioned layers only",
                list(missing),
                len(self.targets) - len(missing),
                self.preconditioned_fraction,
            )
        self._unpreconditioned_warned = missing
        self.normalization_in_use = f"adam_optimizer/{self.precondition}"
        return pre

    def _sketch(self, t: TargetLayer, device: torch.device, dtype: torch.dtype, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's (cached) sketch projections."""
        step_key = step if self.resample_projections else None
        key = (t.index, device, dtype, step_key)
        if key not in self._sketch_cache:
            if self.resample_projections:
                self._sketch_cache.clear()
            self._sketch_cache[key] = sketch_matrices(
                self.seed, t.index, t.d_out, t.d_in + t.has_bias, self.k_out, self.k_in,
                device=device, dtype=dtype, step=step_key,
            )
        return self._sketch_cache[key]

    def _fjlt_plan(self, t: TargetLayer, x_nD: torch.Tensor, step: int) -> FJLTPlan:
        """The layer's (cached) FJLT plan; a function of (seed, layer, D, d[, step]) only."""
        step_key = step if self.resample_projections else None
        key = (t.index, x_nD.shape[1], x_nD.device, x_nD.dtype, step_key)
        if key not in self._fjlt_cache:
            if self.resample_projections:
                self._fjlt_cache = {k: v for k, v in self._fjlt_cache.items() if k[-1] == step_key}
            self._fjlt_cache[key] = make_fjlt_plan(
                self.seed, t.index, x_nD.shape[1], self.proj_dim, device=x_nD.device, dtype=x_nD.dtype, step=step_key
            )
        return self._fjlt_cache[key]

    def _check(self, G_nd: torch.Tensor, gbar_d: torch.Tensor | None, bad_rows: list[torch.Tensor]) -> None:
        """Raise FeatureError for non-finite or all-zero features (one host sync for all checks).

        Inside a `selection.deferring_checks` block (the selection step) the flags are recorded
        instead and the error is raised when the step judges them, from its one transfer.
        """
        # bad_rows: per forward (and batch, layer by layer), the non-finite rows of each target (one
        # 0-dim count per layer, or one count per layer stacked), in target order.
        counts = [r if r.dim() == 1 else r.reshape(-1) for r in bad_rows]
        # A row (or gbar) holding NaN/inf has a non-finite sum (times 0: NaN exactly then); a sum
        # that overflows float counts as non-finite too, its Gram entries would.
        flags = [torch.isnan(G_nd.sum(dim=1) * 0).sum(), G_nd.ne(0).any()]
        if gbar_d is not None:
            flags += [torch.isnan(gbar_d.sum() * 0), gbar_d.ne(0).any()]
        flags_t = torch.stack(flags)
        flags_t = torch.cat([*counts, flags_t]) if counts else flags_t
        n_counts = sum(int(c.numel()) for c in counts)
        check_or_defer(flags_t, partial(self._judge, n_counts, int(G_nd.shape[0]), gbar_d is not None))

    def _judge(self, n_bad: int, n_rows: int, with_gbar: bool, flags: list[float]) -> None:
        """`_check`'s verdict on the host values of its flags."""
        flags = [int(f) for f in flags]
        n_layers = len(self.targets)
        per_chunk_layer = flags[:n_bad]
        bad_by_layer = [0] * n_layers
        for i, count in enumerate(per_chunk_layer):
            bad_by_layer[i % n_layers] += count
        bad_layers = {self.targets[i].name: c for i, c in enumerate(bad_by_layer) if c}
        G_bad_rows, G_nonzero = flags[n_bad], flags[n_bad + 1]
        if bad_layers or G_bad_rows:
            raise FeatureError(
                f"non-finite gradient features: rows with NaN/inf per layer {bad_layers}, "
                f"{G_bad_rows} of {n_rows} pool rows non-finite after normalisation/projection"
            )
        if not G_nonzero:
            raise FeatureError(
                f"all {n_rows} pool feature rows are zero (layers {self.target_names}); "
                f"do the examples have target tokens (labels != -100)?"
            )
        if with_gbar:
            gbar_non_finite, gbar_nonzero = flags[n_bad + 2], flags[n_bad + 3]
            if gbar_non_finite:
                raise FeatureError("the validation mean feature gbar is non-finite")
            if not gbar_nonzero:
                raise FeatureError("the validation mean feature gbar is all zero (no validation target tokens?)")


def _log_scored_tokens(score_tokens: int | None, score_window: int | None, position: str) -> None:
    """Say which tokens of each row the scoring pass reads, when not all of them."""
    if score_tokens is not None:
        log.info("score_tokens=%d: pool examples are scored on their first %d target tokens", score_tokens, score_tokens)
    if score_window is not None:
        log.info(
            "score_window=%d (%s): pool and validation rows are scored on %d-token windows, each as its own sequence",
            score_window, position, score_window,
        )


def _compiled_products(on_cuda: bool) -> Callable[..., torch.Tensor]:
    """`features.compile`: the batched products compiled once (static shapes: the pool, window and targets
    are fixed for a run); on CUDA in mode reduce-overhead, i.e. replayed as a CUDA graph."""
    return torch.compile(sketched_layer_products, dynamic=False, mode="reduce-overhead" if on_cuda else None)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an accelerator out-of-memory error, as Composer's auto microbatching recognises them."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _OOM_MESSAGES)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two 1-D tensors (average ranks for ties); nan for constant input."""
    ra, rb = _ranks(a.detach().double().cpu()), _ranks(b.detach().double().cpu())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(ra.norm() * rb.norm())
    return float(ra @ rb) / denom if denom > 0 else float("nan")


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 0..n-1 with ties given their average rank."""
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(x.numel(), dtype=x.dtype)
    uniq, inverse = torch.unique(x, return_inverse=True)
    if uniq.numel() < x.numel():
        sums = torch.zeros(uniq.numel(), dtype=x.dtype).index_add_(0, inverse, ranks)
        counts = torch.zeros(uniq.numel(), dtype=x.dtype).index_add_(0, inverse, torch.ones_like(x))
        ranks = (sums / counts)[inverse]
    return ranks


def _split_preconditioners(
    pre: list[tuple[torch.Tensor, ...] | None] | None, side: str
) -> tuple[list[tuple[torch.Tensor, ...] | None] | None, list[tuple[torch.Tensor, ...] | None] | None]:
    """The (pool, validation) preconditioners: each target's scales raised to that side's power of P.

    Exact layers carry one elementwise scale, sketched layers the factored `(s_out, s_in)`; raising
    every factor to the power `e` raises their product (the approximated P) to `e`. Power 0 is None;
    a target without a preconditioner (None) stays None on both sides.
    """
    if pre is None:
        return None, None
    out: list[list[tuple[torch.Tensor, ...] | None] | None] = []
    for power in PRECONDITION_SIDES[side]:
        if power == 0:
            out.append(None)
        elif power == 1:
            out.append(pre)
        elif isinstance(pre, FactoredScales):  # every target's scales in two vectors: two kernels
            out.append(pre.powered(power))
        else:
            out.append([None if scales is None else tuple(s.pow(power) for s in scales) for scales in pre])
    return out[0], out[1]


def _stack_rows(batches: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The rows of several batches of one length, stacked (labels defaulted; a mask when any batch has one)."""
    with_mask = any(b.get("attention_mask") is not None for b in batches)
    # The defaults only where some batch lacks its field (a default mask is made for nothing else).
    filled = [
        mask_and_labels(b) if with_mask or b.get("labels") is None else (None, b["labels"]) for b in batches
    ]
    out = {
        "input_ids": torch.cat([b["input_ids"] for b in batches]),
        "labels": torch.cat([labels for _, labels in filled]),
    }
    if with_mask:
        out["attention_mask"] = torch.cat([mask for mask, _ in filled])
    return out
