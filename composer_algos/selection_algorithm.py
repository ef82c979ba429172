"""The `DataSelection` Composer algorithm: oversample a pool, select a subset each step, train on it.

Legend: N = pool size on this rank, P = pool size over all ranks (global scope),
K = examples trained per step (this rank), C = domains, D = feature dimension.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from composer.utils import dist
from torch.nn.parallel import DistributedDataParallel

from composer_algos.exchange import exchange_examples, gather_rows, plan_rebalance
from composer_algos.seeding import mix_seed
from composer_algos.validation_source import ValidationSource

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
        validation: `{shard_dir, split, domains, batch_size, remote, guide_fraction}` for the
            validation batch drawn each step (defaults: the training shards' `val` split, 4
            examples, drawn from the guide half of it; evaluation reads the other half).
        features: Keyword arguments of `GradFeatureExtractor` (target_modules, last_n_blocks,
            include_lm_head, exact_max_numel, sketch_dim, normalization, proj_dim, chunk_size).
        strategy_options: Extra options per strategy name, e.g. `{partitionsel: {refit: exact,
            refine: swap}}`; only the running strategy's entry is used, so the strategy can be
            switched from the command line without editing the options.
        capacity_fractions: Fixed per-domain shares of kappa by domain name (default:
            proportional to the pool, as in the paper).
        weighted_loss: Weight each selected example's loss by its refit weight, so the step
            optimises `sum_i w_i l_i / sum_i w_i` over the selected examples of all ranks and
            microbatches (weights normalised to mean 1 over all ranks); strategies without weights
            train unweighted.
        start, end: Fraction of training during which to select (outside, a uniform random
            subset of the same size is trained on, so every step costs the same).
        interval: Select every `interval` batches (random subsets in between).
        check_consistency: Verify (one all-gather) that every rank selected the same set; global
            scope only (rejected with `scope: local`, where ranks select different sets by design).
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
        val_keys = ("shard_dir", "split", "domains", "batch_size", "remote", "guide_fraction")
        unknown_val = sorted(set(validation or {}) - set(val_keys))
        if unknown_val:
            problems.append(
                f"validation does not take {unknown_val}; allowed: {', '.join(val_keys)}"
            )
        if check_consistency and scope == "local":
            problems.append(
                "check_consistency: true needs scope global or auto (with local scope every rank selects "
                "from its own pool, so the selections differ by design); got scope 'local'"
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
                    guide_fraction=float(self.validation_cfg.get("guide_fraction", 0.5)),
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
        from composer_algos.selection import STRATEGIES

        step = int(state.timestamp.batch.value)
        n = int(batch["domain_id"].shape[0])
        active = self._is_active(state, step)
        world = dist.get_world_size()
        rank = dist.get_global_rank()
        use_global = self.scope == "global" or (self.scope == "auto" and world > 1)
        multi = use_global and world > 1
        C = len(self.domain_names or [])
        gen_seed = mix_seed(self.seed, step, 0 if use_global else rank)
        gen = torch.Generator().manual_seed(gen_seed)
        eta = float(state.optimizers[0].param_groups[0]["lr"]) if state.optimizers else 0.0

        pool_local_C = torch.bincount(batch["domain_id"].cpu(), minlength=C)
        t0 = time.perf_counter()
        feats_ND, gbar_D, fallback = None, None, None  # fallback: why this step selects at random
        strategy = self.strategy if active else "random"
        spec = STRATEGIES[strategy]
        needs_features = spec.needs_features
        if needs_features:
            feats_ND, gbar_D, fallback = self._features(state, batch, step, defer_commits=multi)
        t_feat = _sync_time(t0)

        # Assemble the problem (this rank's pool, or every rank's under global scope).
        domain_N = batch["domain_id"]
        device = feats_ND.device if feats_ND is not None else domain_N.device
        domain_N = domain_N.to(device)
        owner_P = local_P = None
        if multi:
            t1 = time.perf_counter()
            sizes = torch.cat(dist.all_gather(torch.tensor([n], device=device)))
            n_max = int(sizes.max())
            valid_P = (torch.arange(n_max, device=device)[None, :] < sizes[:, None]).flatten()
            owner_P = torch.arange(world, device=device).repeat_interleave(n_max)[valid_P]
            local_P = torch.arange(n_max, device=device).repeat(world)[valid_P]
            domain_N = gather_rows(domain_N, n_max)[valid_P]
            if needs_features:
                # Every rank decides the same fallback: fall back if any rank failed.
                flag = torch.tensor([0 if fallback is None else 1], device=device)
                dist.all_reduce(flag, reduce_operation="MAX")
                if int(flag) and fallback is None:
                    fallback = "the gradient features failed on another rank"
                if fallback is None:
                    assert feats_ND is not None
                    feats_ND = gather_rows(feats_ND, n_max)[valid_P]
                    if gbar_D is not None:
                        n_val = float(self.validation.batch_size) if self.validation else 1.0
                        gbar_D = (torch.stack(dist.all_gather(gbar_D * n_val)).sum(0)) / (n_val * world)
            # Solve for a budget every rank can train an equal share of: an uneven end-of-epoch pool
            # lowers the budget (the strategy chooses among every candidate) rather than trimming picks.
            kappa = min(self.kappa, int(sizes.sum()) // world) * world
            t_gather = time.perf_counter() - t1
        else:
            kappa = min(self.kappa, n)
            t_gather = 0.0
        if needs_features:
            self._settle_simulated_adam(multi, failed=fallback is not None)
        if fallback is not None:
            feats_ND, gbar_D = None, None
            strategy, spec = "random_stratified", STRATEGIES["random_stratified"]

        t2 = time.perf_counter()
        result, error = self._solve(spec, strategy, feats_ND, gbar_D, domain_N, C, kappa, eta, gen)
        if multi and spec.needs_features:
            # Ranks solve the same problem; still, a failure on one must not leave the others diverged.
            flag = torch.tensor([0 if error is None else 1], device=device)
            dist.all_reduce(flag, reduce_operation="MAX")
            if int(flag) and error is None:
                error = "the solver failed on another rank"
        if error is not None:
            fallback = error
            strategy, spec = "random_stratified", STRATEGIES["random_stratified"]
            feats_ND = None
            gen = torch.Generator().manual_seed(gen_seed)
            result, _ = self._solve(spec, strategy, None, None, domain_N, C, kappa, eta, gen)
        t_solve = _sync_time(t2)

        t3 = time.perf_counter()
        sel_K = result.indices
        if self.check_consistency and multi:
            self._check_same_selection(sel_K)
        weights_K = result.weights
        if owner_P is not None:
            per_rank = kappa // world
            owner_K, lidx_K = owner_P[sel_K], local_P[sel_K]
            target_K = plan_rebalance(owner_K, world, per_rank)
            new_batch = exchange_examples(
                batch,
                owner_K=owner_K.cpu(),
                local_index_K=lidx_K.cpu(),
                target_K=target_K.cpu(),
                rank=rank,
                world_size=world,
                n_local=n,
            )
            if result.weights is not None:
                # Same order as the exchanged batch: kept examples first, then received ones.
                mine = (target_K == rank) & (owner_K == rank)
                theirs = (target_K == rank) & (owner_K != rank)
                weights_K = torch.cat([result.weights[mine], result.weights[theirs]])
        else:
            idx = sel_K.to(batch["domain_id"].device)
            new_batch = _subset(batch, idx, n)
        if self.weighted_loss:
            n_trained = int(new_batch["domain_id"].shape[0])
            loss_weight_K = self._loss_weights(
                weights_K, result.weights, multi=multi, world=world, n_trained=n_trained, device=device
            )
            if loss_weight_K is not None:
                new_batch["loss_weight"] = loss_weight_K
        t_exchange = time.perf_counter() - t3 + t_gather

        state.batch = new_batch
        if fallback is not None:
            self._note_fallback(step, fallback)
        self._record(
            logger,
            result=result,
            feats_ND=feats_ND,
            pool_local_C=pool_local_C,
            new_batch=new_batch,
            strategy=strategy,
            fallback=fallback is not None,
            times=(t_feat, t_solve, t_exchange),
        )
        if "sample_id" in batch:  # the pool's dataset indices, for MixtureMonitor(log_selected_ids=True)
            self.last_stats["pool_sample_ids_local"] = batch["sample_id"]

    def _solve(self, spec, strategy, feats_ND, gbar_D, domain_N, C, kappa, eta, gen):
        """Run the strategy; returns `(result, None)`, or `(None, reason)` when the problem is numerically broken."""
        from composer_algos.selection import SelectionNumericsError, compute_capacities

        capacities = None
        if spec.uses_capacities:
            counts_C = torch.bincount(domain_N, minlength=C)
            capacities = compute_capacities(counts_C, kappa, self._fractions, generator=gen)
        options = dict(self.strategy_options.get(strategy, {})) if strategy == self.strategy else {}
        try:
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
        except (SelectionNumericsError, torch.linalg.LinAlgError) as e:
            return None, f"{strategy} failed numerically ({e})"
        if result.objective is not None and not bool(torch.isfinite(result.objective).all()):
            return None, f"{strategy} returned a non-finite objective ({float(result.objective)})"
        if result.weights is not None and not bool(torch.isfinite(result.weights).all()):
            return None, f"{strategy} returned non-finite weights"
        return result, None

    def _loss_weights(
        self,
        weights_K: torch.Tensor | None,
        all_weights: torch.Tensor | None,
        *,
        multi: bool,
        world: int,
        n_trained: int,
        device: torch.device,
    ) -> torch.Tensor | None:
        """Per-example loss weights `w_i / mean(w)`, the mean taken over the selected examples of ALL ranks.

        Composer scales each microbatch's loss by its share of the mean per-rank batch and DDP
        averages the ranks, so with the model's loss `sum_i w_i l_i / n_microbatch` (see
        `DomainCausalLM`) the step optimises `sum_i w_i l_i / sum_i w_i` over every selected example
        of every rank and microbatch. Under global scope every rank holds all weights; under local
        scope one all-reduce (every step, on every rank) sums them, and a rank without weights (a
        fallback) gives its examples the mean weight. None (unweighted) when no rank has weights.
        """
        if multi:
            if all_weights is None:
                return None
            total = float(all_weights.detach().double().sum())
            count = float(all_weights.numel())
        else:
            sums = torch.zeros(2, dtype=torch.float64, device=device)
            if weights_K is not None:
                sums[0], sums[1] = weights_K.detach().double().sum(), float(weights_K.numel())
            if world > 1:
                dist.all_reduce(sums, reduce_operation="SUM")
            total, count = sums.tolist()
        mean = total / count if count > 0 else 0.0
        if not (mean > 0 and math.isfinite(mean)):
            return None
        if weights_K is None:
            return torch.ones(n_trained, dtype=torch.float32)
        return (weights_K.detach().double().cpu() / mean).to(torch.float32)

    def _settle_simulated_adam(self, multi: bool, *, failed: bool) -> None:
        """Under global scope, advance the simulated-Adam filter with every rank's pool (or with none).

        Each rank's filter would otherwise follow its own pool, so the gathered rows would be
        normalised differently and only rank 0's state would reach the checkpoint.
        """
        ext = self.extractor
        if not multi or ext is None or ext.normalization != "adam_simulated":
            return
        if failed:
            ext.simulated.discard()
        else:
            ext.simulated.commit_global(lambda t: dist.all_reduce(t, reduce_operation="SUM"))

    def _note_fallback(self, step: int, reason: str) -> None:
        """Count a fallback and log it (every time: `warnings.warn` would show it once per call site)."""
        self.fallbacks += 1
        log.warning(
            "data_selection step %d: %s; falling back to random selection within capacities (%d fallbacks so far)",
            step,
            reason,
            self.fallbacks,
        )

    def _features(self, state: State, batch: Mapping[str, Any], step: int, *, defer_commits: bool = False):
        """`(features, gbar, None)`, or `(None, None, reason)` when the features are unusable."""
        from composer_algos.features import FeatureError

        if self.extractor is None:
            self._build_extractor(state)
        assert self.extractor is not None
        self.extractor.simulated.defer_commits = defer_commits
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
            return feats, gbar, None
        except FeatureError as e:
            return None, None, f"unusable gradient features ({e})"

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
        # The scale-free objective: Phi = eta * f(S) for the weighted strategies (solved in v = eta * w,
        # so it does not blow up as 1/eta during warm-up); the strategy's own score otherwise.
        objective = result.info.get("objective_scaled", result.objective)
        if objective is not None:
            metrics["selection/objective"] = float(objective)
        for key in ("singular_pivots", "ridge_share"):
            if key in result.info:
                metrics[f"selection/{key}"] = float(result.info[key])
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
