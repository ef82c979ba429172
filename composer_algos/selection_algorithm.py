"""The `DataSelection` Composer algorithm: oversample a pool, select a subset each step, train on it.

Legend: N = pool size on this rank, P = pool size over all ranks (global scope),
K = examples trained per step (this rank), C = domains, D = feature dimension.
"""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from composer.utils import dist
from torch.nn.parallel import DistributedDataParallel

from composer_algos.exchange import exchange_examples, gather_rows, plan_rebalance
from composer_algos.validation_source import ValidationSource, _mix

log = logging.getLogger(__name__)

__all__ = ["DataSelection", "SELECTION_STRATEGIES", "find_data_selection"]

# Strategies the algorithm accepts: the selection registry's plus "none" (train on the whole pool).
SELECTION_STRATEGIES = (
    "partitionsel",
    "greats",
    "id",
    "iwd",
    "gradnorm",
    "colm",
    "random",
    "random_stratified",
    "none",
)


class DataSelection(Algorithm):
    """Select a subset of every oversampled batch with a data-selection strategy, then train on it.

    The loader delivers a pool of `oversampling * kappa` examples per rank (`train.py` sizes it
    from `global_train_batch_size`). At `AFTER_DATALOADER` this algorithm computes what the
    strategy needs (per-example gradient features of the pool and of a small validation batch
    for partitionsel, greats, id, iwd; features alone for gradnorm and colm; nothing for the
    random ones), solves for kappa examples with the optimizer's current learning rate as eta
    and replaces the batch with them (every per-example field subset together). See
    docs/data_selection.md (the method card) and the PartitionSel paper.

    Args:
        strategy: One of `SELECTION_STRATEGIES`.
        oversampling: Pool size / examples trained (r). `train.py` reads it to size the loader.
        scope: `global` (gather the problem from every rank, solve the same problem everywhere,
            then rebalance so each rank trains exactly kappa), `local` (select within each rank)
            or `auto` (global when the world size is > 1).
        validation: `{shard_dir, split, domains, batch_size, remote}` for the validation batch
            drawn each step (defaults: the training shards' `val` split, 4 examples).
        features: Keyword arguments of `GradFeatureExtractor` (target_modules, last_n_blocks,
            include_lm_head, exact_max_numel, sketch_dim, normalization, proj_dim, chunk_size).
        strategy_options: Extra options per strategy name, e.g. `{partitionsel: {refit: exact,
            refine: swap}}`; only the running strategy's entry is used, so the strategy can be
            switched from the command line without editing the options.
        capacity_fractions: Fixed per-domain shares of kappa by domain name (default:
            proportional to the pool, as in the paper).
        weighted_loss: Weight each selected example's loss by its refit weight (normalised to
            mean 1); strategies without weights train unweighted.
        start, end: Fraction of training during which to select (outside, a uniform random
            subset of the same size is trained on, so every step costs the same).
        interval: Select every `interval` batches (random subsets in between).
        check_consistency: Verify (one all-gather) that every rank selected the same set.
        seed: Seed of the per-step generators (selection and validation draws).
        device_train_batch_size: kappa on this rank (filled in by `train.py`).
        domain_names: Names of the domains by id (filled in by `train.py`).
        shard_dir, pad_token_id, max_seq_len: Filled in by `train.py`.
    """

    def __init__(
        self,
        *,
        strategy: str = "partitionsel",
        oversampling: float = 2.0,
        scope: str = "auto",
        validation: Mapping[str, Any] | None = None,
        features: Mapping[str, Any] | None = None,
        strategy_options: Mapping[str, Any] | None = None,
        capacity_fractions: Mapping[str, float] | None = None,
        weighted_loss: bool = False,
        start: float = 0.0,
        end: float = 1.0,
        interval: int = 1,
        check_consistency: bool = False,
        seed: int = 0,
        device_train_batch_size: int | None = None,
        domain_names: Sequence[str] | None = None,
        shard_dir: str | None = None,
        pad_token_id: int | None = None,
        max_seq_len: int | None = None,
    ) -> None:
        problems = []
        if strategy not in SELECTION_STRATEGIES:
            problems.append(f"strategy must be one of {SELECTION_STRATEGIES}, got {strategy!r}")
        if not oversampling >= 1:
            problems.append(f"oversampling must be >= 1, got {oversampling}")
        if scope not in ("auto", "global", "local"):
            problems.append(f"scope must be auto, global or local, got {scope!r}")
        if not 0 <= start < end <= 1:
            problems.append(f"start and end must satisfy 0 <= start < end <= 1, got start={start}, end={end}")
        if interval < 1:
            problems.append(f"interval must be >= 1, got {interval}")
        if device_train_batch_size is not None and device_train_batch_size < 1:
            problems.append(f"device_train_batch_size must be >= 1, got {device_train_batch_size}")
        unknown_val = sorted(set(validation or {}) - {"shard_dir", "split", "domains", "batch_size", "remote"})
        if unknown_val:
            problems.append(
                f"validation does not take {unknown_val}; allowed: shard_dir, split, domains, batch_size, remote"
            )
        bad_opts = sorted(k for k in (strategy_options or {}) if k not in SELECTION_STRATEGIES)
        if bad_opts:
            problems.append(
                f"strategy_options is keyed by strategy name; {bad_opts} are not strategies "
                f"(allowed: {SELECTION_STRATEGIES}), e.g. strategy_options: {{partitionsel: {{refit: exact}}}}"
            )
        if problems:
            raise ValueError("algorithms.data_selection: " + "; ".join(problems))
        self.strategy = strategy
        self.oversampling = float(oversampling)
        self.scope = scope
        self.validation_cfg = dict(validation or {})
        self.feature_cfg = dict(features or {})
        self.strategy_options = dict(strategy_options or {})
        self.capacity_fractions = dict(capacity_fractions) if capacity_fractions else None
        self.weighted_loss = weighted_loss
        self.start, self.end, self.interval = start, end, interval
        self.check_consistency = check_consistency
        self.seed = seed
        self.kappa = device_train_batch_size
        self.domain_names = list(domain_names) if domain_names is not None else None
        self.shard_dir = shard_dir
        self.pad_token_id = pad_token_id
        self.max_seq_len = max_seq_len

        self.spec = None
        self._fractions: list[float] | None = None
        self.extractor = None
        self.validation: ValidationSource | None = None
        self.fallbacks = 0
        self._extractor_state: dict[str, Any] | None = None
        self.last_stats: dict[str, Any] = {}

    # ------------------------------------------------------------------ Composer hooks
    def match(self, event: Event, state: State) -> bool:
        return event in (Event.INIT, Event.AFTER_DATALOADER)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            self._init(state)
            return
        self._select(state, logger)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["fallbacks"] = self.fallbacks
        if self.extractor is not None:
            sd["extractor"] = self.extractor.state_dict()
        elif self._extractor_state is not None:
            sd["extractor"] = self._extractor_state
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fallbacks = int(state.get("fallbacks", 0))
        self._extractor_state = state.get("extractor")
        if self.extractor is not None and self._extractor_state is not None:
            self.extractor.load_state_dict(self._extractor_state)

    # ------------------------------------------------------------------ setup
    def _init(self, state: State) -> None:
        if self.strategy == "none":
            return
        from composer_algos.selection import STRATEGIES

        self.spec = STRATEGIES[self.strategy]
        if self.kappa is None:
            raise ValueError(
                "algorithms.data_selection needs device_train_batch_size (train.py fills it in from "
                "global_train_batch_size); give it explicitly when building the algorithm by hand"
            )
        if self.domain_names is None:
            raise ValueError("algorithms.data_selection needs domain_names (train.py fills them in from the manifest)")
        self._fractions = None
        if self.capacity_fractions is not None:
            from pipeline.dataset import resolve_domain_weights

            # Missing domains get 0 (with a warning); the rest is normalised to sum to 1.
            weights = resolve_domain_weights(
                self.capacity_fractions, self.domain_names, source="algorithms.data_selection.capacity_fractions"
            )
            self._fractions = [weights[name] for name in self.domain_names]
        if self.spec.needs_validation:
            shard_dir = self.validation_cfg.get("shard_dir", self.shard_dir)
            if shard_dir is None:
                raise ValueError(
                    f"strategy {self.strategy!r} needs a validation stream: set "
                    "algorithms.data_selection.validation.shard_dir (default: the training shards)"
                )
            if self.pad_token_id is None or self.max_seq_len is None:
                raise ValueError("algorithms.data_selection needs pad_token_id and max_seq_len (filled in by train.py)")
            try:
                self.validation = ValidationSource(
                    shard_dir=shard_dir,
                    split=self.validation_cfg.get("split", "val"),
                    domains=self.validation_cfg.get("domains"),
                    batch_size=int(self.validation_cfg.get("batch_size", 4)),
                    remote=self.validation_cfg.get("remote"),
                    seed=self.seed,
                    rank=dist.get_global_rank(),
                    pad_token_id=self.pad_token_id,
                    max_seq_len=self.max_seq_len,
                )
            except ValueError as e:
                raise ValueError(f"strategy {self.strategy!r} needs a validation stream, and it failed: {e}") from e

    def _build_extractor(self, state: State) -> None:
        from composer_algos.features import GradFeatureExtractor

        model = state.model.module if isinstance(state.model, DistributedDataParallel) else state.model
        self.extractor = GradFeatureExtractor(model, seed=self.seed, **self.feature_cfg)
        if self._extractor_state is not None:
            self.extractor.load_state_dict(self._extractor_state)

    # ------------------------------------------------------------------ the step
    def _select(self, state: State, logger: Logger) -> None:
        batch = state.batch
        if not isinstance(batch, Mapping) or "domain_id" not in batch:
            raise TypeError("DataSelection needs dict batches with a domain_id tensor (use pipeline's collators)")
        if self.strategy == "none":
            self.last_stats = {}
            return
        step = int(state.timestamp.batch.value)
        n = int(batch["domain_id"].shape[0])
        active = self._is_active(state, step)
        world = dist.get_world_size()
        use_global = self.scope == "global" or (self.scope == "auto" and world > 1)
        C = len(self.domain_names or [])
        gen = torch.Generator().manual_seed(_mix(self.seed, step, 0 if use_global else dist.get_global_rank()))
        eta = float(state.optimizers[0].param_groups[0]["lr"]) if state.optimizers else 0.0

        pool_local_C = torch.bincount(batch["domain_id"].cpu(), minlength=C)
        t0 = time.perf_counter()
        feats_ND, gbar_D, fallback = None, None, False
        strategy = self.strategy if active else "random"
        from composer_algos.selection import STRATEGIES

        spec = STRATEGIES[strategy]
        needs_features = spec.needs_features
        if needs_features:
            feats_ND, gbar_D, fallback = self._features(state, batch, step)
        t_feat = _sync_time(t0)

        # Assemble the problem (this rank's pool, or every rank's under global scope).
        domain_N = batch["domain_id"]
        device = feats_ND.device if feats_ND is not None else domain_N.device
        domain_N = domain_N.to(device)
        owner_P = local_P = None
        if use_global and world > 1:
            t1 = time.perf_counter()
            sizes = torch.cat(dist.all_gather(torch.tensor([n], device=device)))
            n_max = int(sizes.max())
            valid_P = (torch.arange(n_max, device=device)[None, :] < sizes[:, None]).flatten()
            owner_P = torch.arange(world, device=device).repeat_interleave(n_max)[valid_P]
            local_P = torch.arange(n_max, device=device).repeat(world)[valid_P]
            domain_N = gather_rows(domain_N, n_max)[valid_P]
            if needs_features:
                # Every rank decides the same fallback: fall back if any rank failed.
                flag = torch.tensor([1 if fallback else 0], device=device)
                dist.all_reduce(flag, reduce_operation="MAX")
                fallback = bool(int(flag))
                if not fallback:
                    assert feats_ND is not None
                    feats_ND = gather_rows(feats_ND, n_max)[valid_P]
                    if gbar_D is not None:
                        n_val = float(self.validation.batch_size) if self.validation else 1.0
                        gbar_D = (torch.stack(dist.all_gather(gbar_D * n_val)).sum(0)) / (n_val * world)
            kappa = min(self.kappa * world, int(sizes.sum()))
            t_gather = time.perf_counter() - t1
        else:
            kappa = min(self.kappa, n)
            t_gather = 0.0
        if fallback:
            feats_ND, gbar_D = None, None
            strategy, spec = "random_stratified", STRATEGIES["random_stratified"]
        pool_counts_C = torch.bincount(domain_N, minlength=C)

        t2 = time.perf_counter()
        capacities = None
        if spec.uses_capacities:
            from composer_algos.selection import compute_capacities

            capacities = compute_capacities(pool_counts_C, kappa, self._fractions, generator=gen)
        options = dict(self.strategy_options.get(strategy, {})) if strategy == self.strategy else {}
        result = spec.fn(
            features=feats_ND,
            val_feature=gbar_D,
            domain_ids=domain_N,
            num_domains=C,
            kappa=kappa,
            eta=eta,
            generator=gen,
            capacities=capacities,
            **options,
        )
        t_solve = _sync_time(t2)

        t3 = time.perf_counter()
        sel_K = result.indices
        if self.check_consistency and world > 1:
            self._check_same_selection(sel_K)
        if owner_P is not None:
            per_rank = kappa // world
            if per_rank * world != kappa:
                # An uneven end-of-epoch pool: trim so every rank trains the same number.
                sel_K = sel_K[: per_rank * world]
            owner_K, lidx_K = owner_P[sel_K], local_P[sel_K]
            target_K = plan_rebalance(owner_K, world, per_rank)
            new_batch = exchange_examples(
                batch,
                owner_K=owner_K.cpu(),
                local_index_K=lidx_K.cpu(),
                target_K=target_K.cpu(),
                rank=dist.get_global_rank(),
                world_size=world,
                n_local=n,
            )
            weights_K = None
            if result.weights is not None:
                mine = (target_K == dist.get_global_rank()) & (owner_K == dist.get_global_rank())
                theirs = (target_K == dist.get_global_rank()) & (owner_K != dist.get_global_rank())
                weights_K = torch.cat([result.weights[mine], result.weights[theirs]])
        else:
            idx = sel_K.to(batch["domain_id"].device)
            new_batch = _subset(batch, idx, n)
            weights_K = result.weights
        if self.weighted_loss and weights_K is not None and weights_K.numel() > 0:
            w = weights_K.detach().to(torch.float32).cpu()
            new_batch["loss_weight"] = w / w.mean().clamp_min(1e-12)
        t_exchange = time.perf_counter() - t3 + t_gather

        state.batch = new_batch
        if fallback:
            self.fallbacks += 1
        self._record(
            logger,
            result=result,
            feats_ND=feats_ND,
            pool_local_C=pool_local_C,
            new_batch=new_batch,
            strategy=strategy,
            fallback=fallback,
            times=(t_feat, t_solve, t_exchange),
        )
        if "sample_id" in batch:  # the pool's dataset indices, for MixtureMonitor(log_selected_ids=True)
            self.last_stats["pool_sample_ids_local"] = batch["sample_id"]

    def _features(self, state: State, batch: Mapping[str, Any], step: int):
        from composer_algos.features import FeatureError

        if self.extractor is None:
            self._build_extractor(state)
        assert self.extractor is not None
        device = next(p.device for p in state.model.parameters())
        pool = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "labels")}
        val = None
        if self.spec is not None and self.spec.needs_validation and self.validation is not None:
            vb = self.validation.batch_for_step(step)
            val = {k: vb[k].to(device) for k in ("input_ids", "attention_mask", "labels")}
        try:
            feats, gbar = self.extractor.compute(
                pool, val, step=step, optimizer=state.optimizers[0] if state.optimizers else None
            )
            return feats, gbar, False
        except FeatureError as e:
            warnings.warn(
                f"data_selection step {step}: {e}; falling back to random selection within capacities", stacklevel=2
            )
            return None, None, True

    def _is_active(self, state: State, step: int) -> bool:
        elapsed = state.get_elapsed_duration()
        frac = float(elapsed.value) if elapsed is not None else 0.0
        return self.start <= frac < self.end and step % self.interval == 0

    def _check_same_selection(self, sel_K: torch.Tensor) -> None:
        digest = hashlib.sha1(sel_K.cpu().numpy().tobytes()).digest()[:8]
        mine = torch.tensor([int.from_bytes(digest, "little") & 0x7FFFFFFFFFFFFFFF], dtype=torch.int64)
        all_ = torch.cat(dist.all_gather(mine.to(sel_K.device)))
        if not bool((all_ == all_[0]).all()):
            raise RuntimeError(f"data_selection: ranks selected different sets (hashes {all_.tolist()})")

    def _record(self, logger, *, result, feats_ND, pool_local_C, new_batch, strategy, fallback, times) -> None:
        from composer_algos.selection import conflict_fraction

        metrics: dict[str, float] = {
            "selection/time_features_s": times[0],
            "selection/time_solve_s": times[1],
            "selection/time_exchange_s": times[2],
            "selection/kept_samples": float(new_batch["domain_id"].shape[0]),
            "selection/kept_tokens": float(new_batch["attention_mask"].sum()) if "attention_mask" in new_batch else 0.0,
            "selection/fallback": float(fallback),
            "selection/fallbacks_total": float(self.fallbacks),
        }
        if result.objective is not None:
            metrics["selection/objective"] = float(result.objective)
        # A 24-bit digest of the selected pool positions (exact in float32 loggers), so runs and
        # ranks can be compared step by step.
        digest = hashlib.sha1(torch.sort(result.indices.cpu()).values.numpy().tobytes()).digest()
        metrics["selection/selected_hash"] = float(int.from_bytes(digest[:3], "little"))
        if feats_ND is not None and result.indices.numel() > 1:
            metrics["selection/conflict_fraction"] = float(conflict_fraction(feats_ND, result.indices))
        logger.log_metrics(metrics)
        self.last_stats = {
            "strategy": strategy,
            "pool_counts_local": pool_local_C,
            "metrics": metrics,
        }


def find_data_selection(state: State) -> DataSelection | None:
    """The run's `DataSelection` algorithm, or None when the run selects nothing."""
    return next((a for a in state.algorithms if isinstance(a, DataSelection)), None)


def _subset(batch: Mapping[str, Any], idx: torch.Tensor, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n:
            out[key] = value[idx]
        elif isinstance(value, (list, tuple)) and len(value) == n:
            out[key] = [value[i] for i in idx.tolist()]
        else:
            out[key] = value
    return out


def _sync_time(t0: float) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0
