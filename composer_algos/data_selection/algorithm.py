"""The `DataSelection` Composer algorithm: oversample a pool, select a subset each step, train on it.

Legend: N = pool size on this rank, P = pool size over all ranks (global scope), K = examples
trained per step (this rank), C = domains, D = feature dimension.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from composer.core import Algorithm, Event, State, TimeUnit
from composer.core.precision import get_precision_context
from composer.loggers import Logger
from composer.utils import dist
from torch.nn.parallel import DistributedDataParallel

from composer_algos.data_selection.ahead import PeekableLoader, PendingSelection, pool_key
from composer_algos.data_selection.options import (
    BETWEEN_MODES,
    DEFAULT_OVERSAMPLING,
    SELECTION_STRATEGIES,
    DataSelectionOptions,
)
from composer_algos.data_selection.step import (
    assemble_problem,
    record_step,
    redistribute,
    selection_metrics,
    settle_on_host,
    solve_problem,
)
from composer_algos.data_selection.validation_source import (
    BatchValidationSource,
    ValidationSource,
    model_inputs,
)
from composer_algos.features.targets import sharded_fsdp_units_kept
from composer_algos.features.val_average import ValidationAverage
from composer_algos.models.scoring_prefix import PREFIX_KEY
from composer_algos.seeding import mix_seed
from composer_algos.selection.conflicts import conflict_fraction
from composer_algos.selection.types import DeferredChecks

log = logging.getLogger(__name__)

__all__ = [
    "BETWEEN_MODES",
    "DataSelection",
    "DEFAULT_OVERSAMPLING",
    "SELECTION_STRATEGIES",
    "find_data_selection",
    "find_data_selection_in",
    "top_k_within_capacities",
]


class DataSelection(Algorithm):
    """Select a subset of every oversampled batch with a data-selection strategy, then train on it.

    Drop it into any Composer `Trainer` whose loader yields dict batches (`input_ids`, optional
    `attention_mask` and `labels`, and a per-example domain id under `domain_key`), sized
    `oversampling` times the examples to train per step::

        DataSelection(strategy="partitionsel", oversampling=2, validation=val_batches)

    Each step (`AFTER_DATALOADER`) runs four stages (composer_algos/data_selection/step.py): assemble
    the problem (the pool's gradient features and the validation feature, gathered from every rank
    under global scope), solve it for kappa = pool / oversampling examples per rank with the
    optimizer's current learning rate as eta, redistribute the picks (every per-example field
    subset together; under global scope each rank trains exactly kappa), and record the metrics
    through Composer's logger. See docs/data_selection.md (the method card) and the PartitionSel
    paper.

    Args:
        strategy: One of `SELECTION_STRATEGIES` (default `partitionsel`); `none` trains on the pool.
        oversampling: Pool size / examples trained, r (default `DEFAULT_OVERSAMPLING` = 2). kappa
            per rank is `round(pool / r)`, the pool being the train loader's batch size. A selecting
            strategy needs r > 1 and a pool larger than kappa; `train.py` sizes its loader from this.
        scope: `global` (gather the problem from every rank, solve the same problem everywhere,
            then rebalance so each rank trains exactly kappa), `local` (select within each rank)
            or `auto` (default: global when the world size is > 1).
        validation: Where validation-guided strategies (partitionsel, greats, id, iwd) draw their
            validation batch each step: a shard directory (str or path, the output of
            `tools/shard.py`), an iterable of dict batches (a DataLoader, or a list: step s takes
            the batch at position s mod its length, so a resumed run draws the same), or a mapping
            with `shard_dir`, `split` (`val`), `domains`, `batch_size` (4), `remote`,
            `guide_fraction` (0.5: draw from the guide half of each domain's split; evaluation reads
            the other), `batches` (instead of `shard_dir`), `average_beta` (0.0: a running mean of
            the validation feature over steps, `ValidationAverage`), `target` (`mean`, default: the
            mean of the validation rows; `domain_balanced`: every domain present in the step's
            validation rows weighted equally, the official code's `val_srcwt`) and `stratify`
            (False; True draws every domain each step, `ValidationSource`). Default: the training
            dataset's shards when it is a `DomainStreamingDataset`; `domains` then defaults to the
            domains the training dataset streams (a run restricted to some domains is guided by
            those). The collator's pad id and length come from the shards' manifest. Given to a
            strategy that draws none (random, random_stratified, none, ...): warned of at init.
        domain_key: Batch field holding each example's domain id (default `domain_id`).
        domain_names: Names of the domains by id (default: the validation shards' or the training
            dataset's manifest, else `domain_<i>` for each id seen; under global scope, seen on any
            rank, so every rank solves for the same number of domains).
        features: Keyword arguments of `GradFeatureExtractor` (target_modules, last_n_blocks,
            include_lm_head, exact_max_numel, sketch_dim, normalization, proj_dim, chunk_size, ...).
            Scoring runs in the run's precision context (`state.precision`, as the training
            forward); `chunk_size: auto` (default) scores the run's device microbatch size (at most
            the examples a rank trains) per forward, halved on an out-of-memory error. Given to a
            strategy that computes no features, without `log_conflicts`: warned of at init.
        strategy_options: Extra options per strategy name, e.g. `{partitionsel: {refit: exact,
            refine: swap}}`; only the running strategy's entry is used, so the strategy can be
            switched from the command line without editing the options.
        capacity_fractions: Fixed per-domain shares of kappa by domain name, or `uniform` (the
            same share for every domain); default: proportional to the pool, as in the paper.
            Only the strategies that select within capacities honour it (partitionsel, id, iwd,
            random_stratified); with another strategy it is rejected. The older spelling of
            `capacities: {policy: fractions, weights: ...}` (or `capacities: uniform`); give one.
        capacities: The capacity policy (`composer_algos.data_selection.capacity_policy.parse_capacity_policy`):
            `proportional` (default), `uniform`, `adaptive` (the official code's budget curriculum;
            partitionsel and iwd only), or a mapping `{policy: slack, factor: s}`, `{policy:
            adaptive, beta, lamb}`, `{policy: fractions, weights: {...} | file: <DoReMi weights
            file>}`, `{policy: minority_full, domains: [...] | max_share: x, base: ...}`. Honoured
            by the strategies that select within capacities; with another one a policy other than
            `proportional` is rejected.
        weighted_loss: Weight each selected example's loss by its refit weight, so the step
            optimises `sum_i w_i l_i / sum_i w_i` over the selected examples of all ranks and
            microbatches (weights normalised to mean 1 over all ranks); strategies without weights
            train unweighted. The model's loss must read the batch's `loss_weight` (DomainCausalLM).
        start, end: Fraction of training during which to select (outside, a uniform random
            subset of the same size is trained on, so every step costs the same).
        interval: Select every `interval` batches (what is trained on in between: `between`).
        between: What the steps between selections train on when `interval` > 1: `random` (default,
            a uniform random subset of kappa, no scoring) or `stale_topk`: the pool's gradient
            features are computed (the pool only: no validation batch is drawn or scored, no solver
            runs), scored against the validation feature saved at the last selecting step, and
            the top kappa by `<g_i, gbar_stale>` within the step's per-domain capacities are
            trained on, unweighted. It saves the validation features and the solve, not the pool
            features. Needs a validation-guided strategy (partitionsel, greats, id, iwd); works
            under both scopes (under global scope on the gathered pool, with the gathered
            validation feature). The saved feature is in the checkpoint; until a selecting step
            has produced one (and after a resume of `scope: local` on several ranks, whose
            per-rank features the rank-0 checkpoint cannot hold) a between step trains on a random
            subset, with a warning. Outside `[start, end)` the steps stay random.
        check_consistency: Verify (one all-gather of a digest) that every rank assembled the same
            gathered problem (features, validation feature, domains, budget); the selections are
            identical by construction, rank 0's being broadcast. Global scope only (rejected with
            `scope: local`, where ranks select from their own pools by design).
        seed: Seed of the per-step generators (selection and validation draws).
        log_conflicts: Also compute the pool's gradient features on the steps of a strategy that
            computes none (random, random_stratified), only to log `selection/conflict_fraction` of
            the examples it selected, so that random's conflicts can be set beside the guided
            strategies' (issue 21.5). The selection never reads them: the same examples are picked.
            It costs one feature pass of the pool a step (no validation batch), counted in
            `selection/time_features_s` and in the training time. A no-op for strategies that
            compute features (they log the fraction already) and on the random steps outside
            `[start, end)` or between selections; skipped, with one warning, under global scope on
            several ranks (the indices then refer to the gathered pool).
        select_ahead: Select the next step's subset at this step's `AFTER_TRAIN_BATCH`, on the next
            pool fetched early from the loader, instead of at the next step's `AFTER_DATALOADER`
            (composer_algos/data_selection/ahead.py). The selection's host work (launching the
            scoring pass, the solver's reads) then runs while the accelerator works through this
            step's backward, not on a device that Composer's per-step reads have drained. The
            selection is the same function of its inputs, three of which are one step older: the
            features are computed with this step's weights and optimizer state (before its optimizer
            step; with `normalization: adam_optimizer` the second step's selection finds no second
            moments yet), and eta is this step's learning rate. The first step, a step whose pool
            was not fetched early (the epoch's or the run's last batch), and a resumed run's first
            step on several ranks select as usual; a selection made ahead and not used is undone
            (the state it changed is put back). The pending selection is in the checkpoint, so a
            single-rank run resumes bitwise. Under FSDP (fsdp_config) the selection leaves the sharded
            units as the backward left them (`sharded_fsdp_units_kept`). Refused at the start of fit on
            several ranks under FSDP2 (not verified), with automatic microbatching, or with an
            unsized loader. A `DataSpec` whose
            `batch_transforms` build a new batch turns it off (with a warning).
            docs/results/bench_gpu.md measures what it saves.

    Raises:
        ValueError: every invalid argument at once (unknown strategy, oversampling below 1, or 1 with
            a selecting strategy, bad scope, start/end, interval, between, validation keys or
            average_beta, or an average_beta > 0 with features whose validation side changes with
            the step: `precondition` split or both, `adam_simulated`, `resample_projections`).
    """

    def __init__(
        self,
        *,
        strategy: str = "partitionsel",
        oversampling: float = DEFAULT_OVERSAMPLING,
        scope: str = "auto",
        validation: Mapping[str, Any] | str | os.PathLike | Iterable[Mapping[str, Any]] | None = None,
        domain_key: str = "domain_id",
        domain_names: Sequence[str] | None = None,
        features: Mapping[str, Any] | None = None,
        strategy_options: Mapping[str, Any] | None = None,
        capacity_fractions: Mapping[str, float] | str | None = None,
        capacities: str | dict[str, Any] | None = None,
        weighted_loss: bool = False,
        start: float = 0.0,
        end: float = 1.0,
        interval: int = 1,
        between: str = "random",
        check_consistency: bool = False,
        seed: int = 0,
        log_conflicts: bool = False,
        select_ahead: bool = False,
    ) -> None:
        self.options = options = DataSelectionOptions(
            strategy=strategy, oversampling=oversampling, scope=scope, validation=validation, domain_key=domain_key,
            domain_names=domain_names, features=features, strategy_options=strategy_options,
            capacity_fractions=capacity_fractions, capacities=capacities, weighted_loss=weighted_loss, start=start,
            end=end, interval=interval, between=between, check_consistency=check_consistency, seed=seed,
            log_conflicts=log_conflicts, select_ahead=select_ahead,
        )
        problems = options.problems()
        if problems:
            raise ValueError("algorithms.data_selection: " + "; ".join(problems))
        for unused in options.unused_settings():
            log.warning("algorithms.data_selection.%s: the setting has no effect", unused)
        if isinstance(capacity_fractions, str) and capacity_fractions != "uniform":
            raise ValueError(
                f"algorithms.data_selection.capacity_fractions: got {capacity_fractions!r}; allowed: "
                "'uniform' or a mapping of domain name to share (e.g. {algebra: 2, numbers: 1})"
            )
        # The options the step reads, as Composer's algorithms keep theirs: attributes.
        self.strategy, self.oversampling, self.scope = strategy, float(oversampling), scope
        self.validation_cfg, self.validation_target = options.validation_cfg, options.validation_cfg.get("target", "mean")
        self.domain_key, self.weighted_loss, self.seed = domain_key, weighted_loss, seed
        self.feature_cfg, self.strategy_options = dict(features or {}), dict(strategy_options or {})
        self.capacity_fractions: dict[str, float] | str | None = (
            capacity_fractions if isinstance(capacity_fractions, str) else dict(capacity_fractions or {}) or None
        )
        self.capacity_policy = options.capacity_policy()
        self.start, self.end, self.interval, self.between = start, end, interval, between
        self.check_consistency, self.log_conflicts, self.select_ahead = check_consistency, log_conflicts, select_ahead
        self._pending: PendingSelection | None = None  # select_ahead: the selection made ahead for the next step
        self.domain_names = list(domain_names) if domain_names is not None else None
        self._names_given = domain_names is not None
        self._trained_domains: list[str] | None = None  # the names the training dataset streams, once known
        self._warned_log_conflicts = False
        self._warned_prefix = False
        self._prefix_rows: torch.Tensor | None = None

        self.kappa: int | None = None  # per rank, from the first pool (see _resolve_kappa)
        self.spec = None
        self._fractions: list[float] | None = None
        self._fractions_for: int = -1  # number of domains the fractions were resolved for
        self.extractor = None
        self.validation: ValidationSource | BatchValidationSource | None = None
        self.val_average = ValidationAverage(float(self.validation_cfg.get("average_beta", 0.0)))
        self.fallbacks = 0
        self._extractor_state: dict[str, Any] | None = None
        # between: stale_topk: the validation feature of the last selecting step (the gathered one
        # under global scope, after the running average), and whether it is the same on every rank.
        self._stale_gbar: torch.Tensor | None = None
        self._stale_gbar_shared = True
        # This step's validation rows (V, D) and their domain ids (V,), when `_needs_validation_rows`.
        self._val_rows_VD: torch.Tensor | None = None
        self._val_domain_V: torch.Tensor | None = None

    # ------------------------------------------------------------------ Composer hooks
    def match(self, event: Event, state: State) -> bool:
        if event in (Event.INIT, Event.AFTER_DATALOADER):
            return True
        return self.select_ahead and self.strategy != "none" and event in (
            Event.FIT_START, Event.AFTER_TRAIN_BATCH, Event.FIT_END
        )

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            self._init(state)
        elif event == Event.FIT_START:
            self._wrap_loader(state)
        elif event == Event.AFTER_TRAIN_BATCH:
            self._select_ahead(state)
        elif event == Event.FIT_END:
            if isinstance(state.dataloader, PeekableLoader):
                state.dataloader.release()  # the pass's iterator (its workers) and any batch fetched early
        else:
            self._select(state, logger)

    def state_dict(self) -> dict[str, Any]:
        pending = self._pending
        if pending is not None and dist.get_world_size() > 1:
            # The pending selection is not saved (rank 0's alone), so neither is what making it changed: the
            # resumed run makes that step's selection again, from the state it had before.
            now = self._ahead_state()
            self._restore_ahead_state(pending.before)
            try:
                return self._state_dict()
            finally:
                self._restore_ahead_state(now)
        return self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["fallbacks"] = self.fallbacks
        sd["val_average"] = self.val_average.state_dict()
        if self.extractor is not None:
            sd["extractor"] = self.extractor.state_dict()
        elif self._extractor_state is not None:
            sd["extractor"] = self._extractor_state
        # Composer writes rank 0's state: a per-rank feature (local scope, several ranks) is left out.
        keep = self._stale_gbar is not None and self._stale_gbar_shared
        sd["stale_gbar"] = self._stale_gbar.detach().cpu() if keep else None  # type: ignore[union-attr]
        if self.capacity_policy.stateful:
            # The same on every rank under global scope (see AdaptivePolicy); local scope on several ranks is rejected.
            sd["capacity_policy"] = {"name": self.capacity_policy.name, **self.capacity_policy.state_dict()}
        # select_ahead: the next step's selection, already made (its pool is read again on resume). Rank 0's
        # alone would not do for several ranks: they select as usual after a resume.
        keep = self._pending is not None and dist.get_world_size() == 1
        sd["pending"] = self._pending.state_dict() if keep else None  # type: ignore[union-attr]
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fallbacks = int(state.get("fallbacks", 0))
        if state.get("val_average") is not None:
            self.val_average.load_state_dict(state["val_average"])
        self._extractor_state = state.get("extractor")
        if self.extractor is not None and self._extractor_state is not None:
            self.extractor.load_state_dict(self._extractor_state)
        self._stale_gbar = state.get("stale_gbar")
        saved = state.get("capacity_policy")
        if saved is not None and self.capacity_policy.stateful:
            if saved.get("name") != self.capacity_policy.name:
                raise ValueError(
                    f"algorithms.data_selection.capacities: the checkpoint holds the state of capacity policy "
                    f"{saved.get('name')!r}, the run configures {self.capacity_policy.name!r}"
                )
            self.capacity_policy.load_state_dict(saved)
        pending = state.get("pending")
        usable = self.select_ahead and self.strategy != "none" and dist.get_world_size() == 1
        if pending is not None and not usable:
            log.warning(
                "data_selection: the checkpoint holds a selection made ahead for step %s; this run (select_ahead %s, "
                "strategy %r, world size %d) does not use it, and its state includes that selection's update (e.g. the "
                "validation average) once more than an uninterrupted run's", pending.get("number"), self.select_ahead,
                self.strategy, dist.get_world_size(),
            )
        self._pending = PendingSelection.from_state(pending) if pending is not None and usable else None

    @property
    def num_domains(self) -> int:
        return len(self.domain_names or [])

    # ------------------------------------------------------------------ setup
    def _init(self, state: State) -> None:
        if self.strategy == "none":
            return
        from composer_algos.selection import get_strategy

        self.spec = get_strategy(self.strategy)
        if self.val_average.beta > 0 and self.scope == "local" and dist.get_world_size() > 1:
            raise ValueError(
                f"algorithms.data_selection.validation.average_beta {self.val_average.beta} needs scope global or "
                "auto on more than one rank (with scope local each rank would average its own validation "
                "feature and only rank 0's average would be checkpointed); set average_beta: 0 or scope: auto"
            )
        if self.capacity_policy.stateful and self.scope == "local" and dist.get_world_size() > 1:
            raise ValueError(
                f"algorithms.data_selection.capacities {self.capacity_policy.name} keeps a per-domain state across steps, "
                "which needs scope global or auto on more than one rank (with scope local every rank would follow its "
                "own pool and only rank 0's state would be checkpointed); set scope: auto"
            )
        cfg = self.validation_cfg
        if self.spec.needs_validation and ("shard_dir" in cfg or "batches" in cfg):
            self._build_validation(None)  # fail at INIT on a missing split rather than at the first batch

    def _build_validation(self, state: State | None) -> None:
        """The validation source: the configured batches or shards, else the training dataset's shards."""
        cfg = self.validation_cfg
        if cfg.get("batches") is not None:
            self.validation = BatchValidationSource(cfg["batches"])
            return
        shard_dir, remote = cfg.get("shard_dir"), cfg.get("remote")
        if shard_dir is None and state is not None:
            dataset = getattr(getattr(state, "train_dataloader", None), "dataset", None)
            shard_dir = getattr(dataset, "shard_dir", None)
            remote = remote if remote is not None else getattr(dataset, "remote", None)
        if shard_dir is None:
            raise ValueError(
                f"strategy {self.strategy!r} needs a validation stream: pass validation= a shard directory, a "
                "dataloader or list of batches, or {shard_dir: ...} (algorithms.data_selection.validation.shard_dir; "
                "default: the training dataset's shards when it is a DomainStreamingDataset)"
            )
        domains = cfg.get("domains")
        if domains is None and state is not None:
            domains = self._default_validation_domains(state, shard_dir)
        try:
            self.validation = ValidationSource(
                shard_dir=str(shard_dir),
                split=cfg.get("split", "val"),
                domains=domains,
                stratify=bool(cfg.get("stratify", False)),
                batch_size=int(cfg.get("batch_size", 4)),
                remote=remote,
                guide_fraction=float(cfg.get("guide_fraction", 0.5)),
                seed=self.seed,
                rank=dist.get_global_rank(),
            )
        except ValueError as e:
            raise ValueError(f"strategy {self.strategy!r} needs a validation stream, and it failed: {e}") from e
        if self.domain_names is None:
            self.domain_names = list(self.validation.dataset.domain_names)

    def _default_validation_domains(self, state: State, shard_dir: Any) -> list[str] | None:
        """The trained domains, when the validation shards are the training dataset's (else None: every domain).

        A run restricted to some domains (`train_loader.dataset.domains`) is then guided by those, not by
        domains it neither trains nor evaluates. Validation shards elsewhere (a target set) keep all theirs.
        """
        dataset = getattr(getattr(state, "train_dataloader", None), "dataset", None)
        trained = _trained_domain_names(dataset)
        train_dir = getattr(dataset, "shard_dir", None)
        if trained is None or train_dir is None:
            return None
        same = os.path.realpath(os.fspath(train_dir)) == os.path.realpath(os.fspath(shard_dir))
        return trained if same else None

    def _prepare(self, state: State, n: int, domain_N: torch.Tensor) -> torch.Tensor:
        """Settle what the first batch tells: kappa, the validation source, the domain names; returns the pool's (C,) counts."""
        if self.kappa is None:
            dataset = getattr(getattr(state, "train_dataloader", None), "dataset", None)
            self._trained_domains = _trained_domain_names(dataset)
            self._restrict_validation(state)
            self.kappa = self._resolve_kappa(state, n)
        if self.domain_names is None:
            dataset = getattr(getattr(state, "train_dataloader", None), "dataset", None)
            names = getattr(dataset, "domain_names", None)
            self.domain_names = list(names) if names is not None else []
        # One count on the host sizes C too: its length is max(C, largest id + 1).
        pool_C = torch.bincount(domain_N.cpu(), minlength=self.num_domains)
        self._grow_domains(int(pool_C.shape[0]))
        return pool_C

    def _grow_domains(self, top: int) -> None:
        """Name the ids below `top` beyond the known names (no manifest) `domain_<i>`; C only grows.

        Under global scope `top` must be the same on every rank (the gathered pool's), or a rank
        whose pool lacks the largest id would size the problem smaller than the others.
        """
        if not self._names_given:
            assert self.domain_names is not None
            self.domain_names += [f"domain_{i}" for i in range(len(self.domain_names), top)]
        self._resolve_fractions()

    def _restrict_validation(self, state: State) -> None:
        """At the first batch: rebuild validation shards built at INIT when they draw untrained domains."""
        if not isinstance(self.validation, ValidationSource) or self.validation_cfg.get("domains") is not None:
            return
        wanted = self._default_validation_domains(state, self.validation.dataset.shard_dir)
        names = self.validation.dataset.domain_names
        drawn = {names[i] for i in self.validation.domain_ids}
        if wanted is not None and not drawn <= set(wanted):
            log.info("data_selection: validation restricted to the trained domains %s (was %s)", wanted, sorted(drawn))
            self._build_validation(state)

    def _resolve_fractions(self) -> None:
        """Bind the capacity policy to the domain names, again whenever the number of domains changes."""
        if self._fractions_for != self.num_domains and self.domain_names:
            # Fractions: missing domains get 0 (with a warning); the rest is normalised to sum to 1.
            self.capacity_policy.bind(self.domain_names, self._trained_domains)
            self._fractions = self.capacity_policy.fractions() if self.capacity_policy.simple() else None
            self._fractions_for = self.num_domains

    def _capacity_fn(self):
        """What `solve_problem` calls for capacities: None for `compute_capacities` with `_fractions`."""
        return None if self.capacity_policy.simple() else self.capacity_policy.capacities

    def _resolve_kappa(self, state: State, n: int) -> int:
        """kappa per rank = round(pool / oversampling), the pool being the loader's batch size (else this batch's)."""
        pool = getattr(getattr(state, "train_dataloader", None), "batch_size", None)
        if not isinstance(pool, int) or pool < 1:
            pool = n
        kappa = int(round(pool / self.oversampling))
        if self.strategy != "none" and not 1 <= kappa < pool:
            raise ValueError(
                f"algorithms.data_selection: a pool of {pool} examples per rank with oversampling "
                f"{self.oversampling:g} gives kappa {kappa}; strategy {self.strategy!r} needs 1 <= kappa < pool "
                "(the loader's batch size must be oversampling x the examples trained per rank)"
            )
        return kappa

    def _build_extractor(self, state: State) -> None:
        from composer_algos.features import GradFeatureExtractor

        model = state.model.module if isinstance(state.model, DistributedDataParallel) else state.model
        # The model's `logits_at: targets` (answer-only fine-tuning) applies to the scoring forward too.
        self.extractor = GradFeatureExtractor(
            model, seed=self.seed, logits_at=getattr(model, "logits_at", "all"), **self.feature_cfg
        )
        if self._extractor_state is not None:
            self.extractor.load_state_dict(self._extractor_state)

    # ------------------------------------------------------------------ the step
    def _select(self, state: State, logger: Logger) -> None:
        """One step (AFTER_DATALOADER): train on the selection made ahead for this pool, or make it now."""
        batch = state.batch
        self._check_batch(batch)
        number = int(state.timestamp.batch.value)
        pending, self._pending = self._pending, None
        if self._pending_applies(state, pending, number, batch):
            assert pending is not None
            state.batch = pending.batch
            record_step(logger, **self._noting_ahead(pending.record, True))
            return
        if pending is not None and pending.before is not None:
            self._restore_ahead_state(pending.before)  # what making it changed, undone: the step selects anew
        state.batch, record = self._selection(state, batch, number)
        record_step(logger, **self._noting_ahead(record, False))

    def _noting_ahead(self, record: dict[str, Any], ahead: bool) -> dict[str, Any]:
        """With select_ahead, `selection/made_ahead`: 1 when the step trains on a selection made at the previous step."""
        if self.select_ahead and record.get("metrics") is not None:
            record = {**record, "metrics": {**record["metrics"], "selection/made_ahead": float(ahead)}}
        return record

    def _check_batch(self, batch: Any) -> None:
        if not isinstance(batch, Mapping) or self.domain_key not in batch:
            keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise TypeError(
                f"DataSelection needs dict batches with a per-example domain id tensor under domain_key "
                f"{self.domain_key!r}; got {keys} (set domain_key, or use pipeline's collators)"
            )

    def _selection(
        self, state: State, batch: Mapping[str, Any], number: int, *, ahead: bool = False
    ) -> tuple[Any, dict[str, Any]]:
        """The four stages of composer_algos/data_selection/step.py on the pool `batch` of step `number`.

        Returns the batch to train on and the keyword arguments of `record_step` for the step.
        `ahead`: made at the previous step's AFTER_TRAIN_BATCH (select_ahead).
        """
        domain_N = batch[self.domain_key]
        pool_C = self._prepare(state, int(domain_N.shape[0]), domain_N)
        pool_ids = batch.get("sample_id")  # the pool's dataset indices, for MixtureMonitor(log_selected_ids=True)
        if self.strategy == "none":
            return batch, dict(method="none", strategy="none", pool_counts_C=pool_C, pool_sample_ids_N=pool_ids)
        step = self._begin_step(state, pool_C, pool_ids, number, ahead)
        problem, probe_ND = self._assemble(state, batch, domain_N, step)
        outcome, extra_values, adaptive_metrics = self._solve(problem, probe_ND, step)
        new_batch, t_exchange = self._redistribute(batch, problem, outcome, step)
        return new_batch, self._record(problem, outcome, new_batch, step, extra_values, adaptive_metrics, t_exchange)

    # ------------------------------------------------------------------ select_ahead
    def _wrap_loader(self, state: State) -> None:
        """FIT_START: the active (train) dataloader, wrapped so the next pool can be fetched early."""
        world = dist.get_world_size()
        if world > 1 and _uses_fsdp2(state.model):
            raise ValueError(
                f"algorithms.data_selection.select_ahead: true is not supported under FSDP2 (parallelism_config.fsdp2) "
                f"on several ranks (world size {world}): the next pool's scoring pass would run between the backward "
                "and the optimizer step of its sharded modules, which is verified for FSDP1 (fsdp_config) only; set "
                "select_ahead: false, or use fsdp_config"
            )
        if world > 1 and state.dataloader_len is None:
            raise ValueError(
                "algorithms.data_selection.select_ahead: true on several ranks needs a train loader with a length "
                "(every rank must know, without reading the device, that a batch follows before it selects for it)"
            )
        if world > 1 and getattr(state, "auto_microbatching", False):
            raise ValueError(
                "algorithms.data_selection.select_ahead: true is not supported with device_train_microbatch_size: auto "
                "on several ranks (a rank retrying its microbatches after an out-of-memory error would meet the others "
                "in the selection's collectives); set a fixed device_train_microbatch_size, or select_ahead: false"
            )
        loader = state.dataloader
        if loader is not None and not isinstance(loader, PeekableLoader):
            length = state.dataloader_len
            wrapped = PeekableLoader(loader, epoch=lambda: int(state.timestamp.epoch))
            state.set_dataloader(wrapped, state.dataloader_label, length if length is not None else -1)

    def _select_ahead(self, state: State) -> None:
        """AFTER_TRAIN_BATCH: the next step's selection, on its pool fetched now, while this step's backward runs."""
        loader = state.dataloader
        if not isinstance(loader, PeekableLoader) or not self._next_batch_follows(state):
            return
        number = int(state.timestamp.batch.value) + 1
        if self._pending is not None and self._pending.number == number:
            return  # AFTER_TRAIN_BATCH again for this batch (Composer retrying its microbatches): made already
        batch = loader.peek()
        if batch is None:
            if dist.get_world_size() > 1:  # the others select for a batch this rank does not have
                raise RuntimeError(
                    f"data_selection select_ahead: the train loader of rank {dist.get_global_rank()} ended before "
                    f"the {len(loader)} batches it has (the ranks' loaders must yield equally many batches)"
                )
            return
        self._check_batch(batch)
        before = self._ahead_state()
        try:
            # Between this step's backward and its optimizer step: FSDP's sharded units are left as the backward
            # left them (their gradients, no gathered copy kept), which a scoring pass alone would not do.
            with sharded_fsdp_units_kept(state.model):
                new_batch, record = self._selection(state, batch, number, ahead=True)
        except torch.OutOfMemoryError as e:
            self._restore_ahead_state(before)
            if dist.get_world_size() > 1:  # not an OOM of the training step: auto microbatching must not retry it
                raise RuntimeError(f"data_selection select_ahead: out of memory selecting for step {number}") from e
            log.warning("data_selection step %d: out of memory selecting ahead (%s); selecting at the step", number, e)
            return
        self._pending = PendingSelection(number, pool_key(batch, self.domain_key), new_batch, record, before=before, pool=batch)

    def _ahead_state(self) -> dict[str, Any]:
        """What making a selection changes in the algorithm's state, as it is now (references and small copies;
        no read of the device): `_restore_ahead_state` puts it back."""
        ext = self.extractor
        return {
            "val_average": self.val_average.snapshot(),
            "simulated": ext.simulated.snapshot() if ext is not None else None,
            "last_step": ext.last_step if ext is not None else None,
            "capacity_policy": copy.deepcopy(self.capacity_policy) if self.capacity_policy.stateful else None,
            "fallbacks": self.fallbacks,
            "stale_gbar": (self._stale_gbar, self._stale_gbar_shared),
        }

    def _restore_ahead_state(self, saved: Mapping[str, Any]) -> None:
        self.val_average.restore(saved["val_average"])
        if self.extractor is not None and saved["simulated"] is not None:
            self.extractor.simulated.restore(saved["simulated"])
            self.extractor.last_step = saved["last_step"]
        if saved["capacity_policy"] is not None:
            self.capacity_policy = saved["capacity_policy"]
        self.fallbacks = saved["fallbacks"]
        self._stale_gbar, self._stale_gbar_shared = saved["stale_gbar"]

    def _next_batch_follows(self, state: State) -> bool:
        """Whether this epoch and the run go on to another batch (as far as the batch counts tell)."""
        ts = state.timestamp
        length = state.dataloader_len
        if length is not None and int(ts.batch_in_epoch) + 1 >= int(length):
            return False
        limit = state.max_duration
        return not (limit is not None and limit.unit == TimeUnit.BATCH and int(ts.batch) + 1 >= int(limit.value))

    def _pending_applies(
        self, state: State, pending: PendingSelection | None, number: int, batch: Mapping[str, Any]
    ) -> bool:
        """Whether this step's pool is the one the pending selection was made for (on every rank, when several).

        The batch must be the very object fetched early: a `DataSpec` whose `batch_transforms` made another
        one would be bypassed by the subset made from the untransformed pool (select_ahead then turns off).
        """
        collective = self.select_ahead and dist.get_world_size() > 1  # decided before anything can turn it off
        if not self.select_ahead and pending is None:
            return False
        ok = False
        if pending is not None:
            loader = state.dataloader
            fetched = pending.restored or (isinstance(loader, PeekableLoader) and loader.yielded_ahead)
            ok = fetched and pending.matches(number, batch, self.domain_key)
            if ok and not pending.restored and batch is not pending.pool:
                ok = False
                self._turn_ahead_off(
                    "the batch the step received is not the pool fetched early (a DataSpec's batch_transforms?)"
                )
        if collective:
            # All ranks use theirs or none does: a rank selecting alone would wait in the others' collectives.
            flag = state.device.tensor_to_device(torch.tensor([int(ok)], dtype=torch.int64))
            dist.all_reduce(flag, reduce_operation="MIN")
            ok = bool(flag.item())
        if not ok and pending is not None:
            log.warning(
                "data_selection step %d: the selection made ahead (for step %d) does not match this step's pool; "
                "selecting now", number, pending.number,
            )
        return ok

    def _turn_ahead_off(self, why: str) -> None:
        log.warning("data_selection: select_ahead turned off for the rest of the run: %s", why)
        self.select_ahead = False

    def _begin_step(self, state: State, pool_C: torch.Tensor, pool_ids: Any, number: int, ahead: bool) -> _Step:
        """What this step runs and how: scope, seed, learning rate, strategy, which features it needs."""
        from composer_algos.selection import get_strategy

        assert self.kappa is not None
        world = dist.get_world_size()
        use_global = self.scope == "global" or (self.scope == "auto" and world > 1)
        multi = use_global and world > 1
        strategy = self.strategy if self._is_active(state, number, ahead) else "random"
        stale = strategy == "random" and self._is_stale_step(state, number, ahead)
        model = getattr(state, "model", None)
        cpu = torch.device("cpu")
        return _Step(
            number=number,
            world=world,
            multi=multi,
            seed=mix_seed(self.seed, number, 0 if use_global else dist.get_global_rank()),
            eta=float(state.optimizers[0].param_groups[0]["lr"]) if state.optimizers else 0.0,
            strategy=strategy,
            stale=stale,
            needs_features=get_strategy(strategy).needs_features or stale,
            # The validation rows one by one (and their domains), for the targets and strategies that read them.
            rows_needed=not stale and strategy == self.strategy and self._needs_validation_rows(),
            pool_C=pool_C,
            pool_ids=pool_ids,
            clock=_StageClock(next((p.device for p in model.parameters()), cpu) if model is not None else cpu),
        )

    def _assemble(
        self, state: State, batch: Mapping[str, Any], domain_N: torch.Tensor, step: _Step
    ) -> tuple[Any, torch.Tensor | None]:
        """Stage 1: the problem (this rank's pool, or every rank's under global scope), and a log-only probe.

        Locally the step reads the device once (settle_on_host): the checks of device values (finite
        features, a finite objective) are recorded as they run and judged from that one transfer,
        which also brings the selection to the host. Global scope agrees on fallbacks across ranks
        before it gathers, so it judges as it goes.
        """
        feats_ND, gbar_D, fallback = None, None, None  # fallback: why this step selects at random
        self._val_rows_VD, self._val_domain_V = None, None
        self._prefix_rows = None  # the pool rows' frozen-prefix output, when the scoring pass recorded it
        if step.needs_features:
            with _deferring(step.feature_checks if step.deferred else None):
                feats_ND, gbar_D, fallback = self._features(
                    state, batch, step.number, defer_commits=step.multi or step.deferred, validation=not step.stale,
                    record_prefix=True,
                )
        probe_ND = self._conflict_probe(state, batch, step)
        step.clock.mark("features")
        t1 = time.perf_counter()
        step.average_before = self.val_average.snapshot()
        problem = assemble_problem(
            domain_N,
            kappa_rank=self.kappa,
            gather=step.multi,
            needs_features=step.needs_features,
            features_ND=feats_ND,
            gbar_D=gbar_D,
            n_val=self.validation.last_batch_size if self.validation is not None else 1,
            fallback=fallback,
            average_gbar=None if step.stale else self.val_average.update,
            val_rows_VD=self._val_rows_VD if step.rows_needed else None,
            val_domain_V=self._val_domain_V if step.rows_needed else None,
            balance_domains=step.rows_needed and self.validation_target == "domain_balanced",
        )
        step.t_gather = time.perf_counter() - t1 if step.multi else 0.0
        if step.multi and problem.domain_P.numel():
            # C from the gathered ids, identical on every rank (this rank's pool may lack the largest);
            # an id beyond the given names stops every rank here, not one rank inside the solver.
            top = int(problem.domain_P.max()) + 1
            if self._names_given and top > self.num_domains:
                raise ValueError(
                    f"algorithms.data_selection: the pool of some rank holds domain id {top - 1}, but domain_names "
                    f"names {self.num_domains} domains {self.domain_names}; give a name for every domain id"
                )
            self._grow_domains(top)
            step.pool_C = torch.bincount(domain_N.cpu(), minlength=self.num_domains)
        if self.check_consistency and step.multi:
            self._check_same_problem(problem)
        return problem, probe_ND

    def _conflict_probe(self, state: State, batch: Mapping[str, Any], step: _Step) -> torch.Tensor | None:
        """log_conflicts: features of the pool for the log only (the problem never sees them)."""
        if not self.log_conflicts or step.needs_features or step.strategy != self.strategy:
            return None
        if step.multi:
            if not self._warned_log_conflicts:
                log.warning(
                    "data_selection: log_conflicts is skipped under global scope on %d ranks (the selection's "
                    "indices refer to the gathered pool); use scope local or one rank",
                    step.world,
                )
                self._warned_log_conflicts = True
            return None
        # Its checks are never judged: a broken probe only loses its logged fraction (see _solve).
        with _deferring(DeferredChecks()):
            probe_ND, _, _ = self._features(state, batch, step.number, validation=False)
        return probe_ND

    def _solve(self, problem: Any, probe_ND: torch.Tensor | None, step: _Step) -> tuple[Any, dict, dict[str, float]]:
        """Stage 2: solve (falling back to random within capacities when the problem is broken), then settle.

        Returns the settled outcome, the extra values read with it (the conflict fraction) and the
        adaptive capacities' metrics.
        """
        step.clock.mark("solve start")
        strategy = step.strategy
        options = self.strategy_options.get(strategy) if strategy == self.strategy else None
        if step.stale and problem.fallback is None:
            outcome = self._stale_topk(problem, step.seed)
        else:
            outcome = solve_problem(
                problem,
                strategy,
                eta=step.eta,
                seed=step.seed,
                num_domains=self.num_domains,
                options=options,
                fractions=self._fractions,
                capacity_fn=self._capacity_fn(),
                deferred=step.solver_checks if step.deferred else None,
            )
        # The conflict fraction of the selection, read with it (dropped if the step falls back).
        logged_PD = problem.features_PD if probe_ND is None else probe_ND
        extras = {}
        if logged_PD is not None and outcome.fallback is None and outcome.result.indices.numel() > 1:
            fraction = conflict_fraction(logged_PD, outcome.result.indices)
            if probe_ND is not None:  # a broken probe logs nothing (nan is dropped in _record)
                usable = torch.isfinite(probe_ND).all() & (probe_ND != 0).any()
                fraction = torch.where(usable, fraction, torch.full_like(fraction, float("nan")))
            extras["conflicts"] = fraction
        step.clock.mark("solve end")
        return self._settle(problem, outcome, extras, step)

    def _settle(self, problem: Any, outcome: Any, extras: dict, step: _Step) -> tuple[Any, dict, dict[str, float]]:
        """The step's one host sync (local scope): the selection, its numbers and the checks; then what they decide."""
        outcome, extra_values, failed_checks = settle_on_host(
            outcome,
            problem,
            {"unusable gradient features": step.feature_checks, f"{step.strategy} failed numerically": step.solver_checks},
            num_domains=self.num_domains,
            seed=step.seed,
            fractions=self._fractions,
            capacity_fn=self._capacity_fn(),
            extras=extras,
        )
        features_ok = "unusable gradient features" not in failed_checks and problem.fallback is None
        if not features_ok:
            # The features were unusable: the step is a fallback, and nothing learnt from them stays.
            self.val_average.restore(step.average_before)
            problem.features_PD, problem.gbar_D = None, None
        if step.needs_features:
            self._settle_simulated_adam(step.multi, failed=not features_ok, deferred=step.deferred)
        if self.between == "stale_topk" and not step.stale and problem.gbar_D is not None:
            self._stale_gbar, self._stale_gbar_shared = problem.gbar_D.detach().clone(), step.multi or step.world == 1
        adaptive_metrics = (
            self._update_adaptive(problem, outcome, step.eta) if step.rows_needed and outcome.fallback is None else {}
        )
        step.clock.mark("settled", host_only=True)
        return outcome, extra_values, adaptive_metrics

    def _redistribute(
        self, batch: Mapping[str, Any], problem: Any, outcome: Any, step: _Step
    ) -> tuple[dict[str, Any], float]:
        """Stage 3: subset locally, or rebalance the global picks across ranks; returns the batch and its seconds."""
        t3 = time.perf_counter()
        new_batch = redistribute(
            batch, problem, outcome.result, domain_key=self.domain_key, weighted_loss=self.weighted_loss
        )
        t_exchange = time.perf_counter() - t3 + step.t_gather
        if self._prefix_rows is not None and not problem.gathered:
            # The selected rows' frozen-prefix output rides in the batch (Composer splits it with the rows into
            # microbatches); the training forward hands it on past the frozen blocks (composer_algos/models/scoring_prefix.py).
            idx_K = outcome.result.indices.to(self._prefix_rows.device, non_blocking=True)
            new_batch[PREFIX_KEY] = self._prefix_rows.index_select(0, idx_K)
        self._prefix_rows = None
        return new_batch, t_exchange

    def _record(
        self,
        problem: Any,
        outcome: Any,
        new_batch: Mapping[str, Any],
        step: _Step,
        extra_values: dict,
        adaptive_metrics: dict[str, float],
        t_exchange: float,
    ) -> dict[str, Any]:
        """Stage 4: what the step records (`record_step`'s keyword arguments; Composer's logger only)."""
        if outcome.fallback is not None:
            self._note_fallback(step.number, outcome.fallback)
        conflicts = extra_values.get("conflicts")
        clock = step.clock
        metrics = selection_metrics(
            outcome.result,
            features_PD=None,
            new_batch=new_batch,
            domain_key=self.domain_key,
            fallback=outcome.fallback is not None,
            fallbacks_total=self.fallbacks,
            times_s=(
                clock.seconds("start", "features"),
                clock.seconds("solve start", "solve end") + clock.host_seconds("solve end", "settled"),
                t_exchange,
            ),
            conflicts=conflicts if conflicts is not None and math.isfinite(conflicts) else None,
        )
        if step.needs_features and self.extractor is not None:
            metrics.update(self._extractor_metrics())
        metrics.update(adaptive_metrics)
        return dict(
            method=self.strategy,
            strategy=outcome.strategy,
            pool_counts_C=step.pool_C,
            metrics=metrics,
            pool_sample_ids_N=step.pool_ids,
            capacities_C=outcome.capacities,
            capacities_shared=problem.gathered,
        )

    def _extractor_metrics(self) -> dict[str, float]:
        """What the feature pass chose this step: its chunk, its scored length, the preconditioned share."""
        extractor, metrics = self.extractor, {}
        if extractor.chunk_size_in_use is not None:
            metrics["selection/score_chunk_size"] = float(extractor.chunk_size_in_use)
        if extractor.score_length_in_use is not None:
            metrics["selection/score_seq_len"] = float(extractor.score_length_in_use)
        if extractor.preconditioned_fraction is not None:
            # The normalisation in use: the share of target layers Adam-normalised this step.
            metrics["selection/normalization_preconditioned_fraction"] = extractor.preconditioned_fraction
        return metrics

    def _needs_validation_rows(self) -> bool:
        """Whether a selecting step keeps the validation rows (not only their mean)."""
        spec = self.spec
        if spec is None or not spec.needs_validation:
            return False
        return bool(
            spec.needs_validation_rows or self.validation_target == "domain_balanced" or self.capacity_policy.stateful
        )

    def _update_adaptive(self, problem: Any, outcome: Any, eta: float) -> dict[str, float]:
        """Fold the step's per-domain utilities into the adaptive capacities' state (the same on every rank)."""
        from composer_algos.data_selection.capacity_policy import AdaptivePolicy, per_domain_utilities

        policy = self.capacity_policy
        result = outcome.result
        if (
            not isinstance(policy, AdaptivePolicy)
            or outcome.fallback is not None
            or result.weights is None
            or problem.features_PD is None
            or problem.val_rows_VD is None
        ):
            return {}
        # The refit weights in the scale-free variable v = eta w (reported as v already at eta = 0).
        scale_free = bool(result.info.get("scale_free", False)) or eta <= 0
        v_K = result.weights.double() * (1.0 if scale_free else eta)
        utilities_C, observed_C = per_domain_utilities(
            problem.features_PD, result.indices, v_K, problem.val_rows_VD, problem.val_domain_V, self.num_domains, eta
        )
        if problem.gathered:
            # Rank 0's utilities on every rank, so the states stay identical whatever the kernels' last bits.
            dist.broadcast(utilities_C, src=0)
        policy.update(utilities_C, observed_C)
        names = self.domain_names or []
        out = {}
        for c, name in enumerate(names):
            out[f"selection/adaptive_gain/{name}"] = float(policy.gain_C[c])
            out[f"selection/adaptive_utility/{name}"] = float(policy.prev_C[c])
        return out

    def _settle_simulated_adam(self, multi: bool, *, failed: bool, deferred: bool = False) -> None:
        """Advance the simulated-Adam filter with the step's pool once the features are judged (or drop it).

        Under global scope with every rank's pool: each rank's filter would otherwise follow its
        own pool, so the gathered rows would be normalised differently and only rank 0's state would
        reach the checkpoint. Locally with `deferred` checks, once the step's one transfer has
        judged the features (a failed call must leave the state unchanged).
        """
        ext = self.extractor
        if not (multi or deferred) or ext is None or ext.normalization != "adam_simulated":
            return
        if failed:
            ext.simulated.discard()
        elif multi:
            ext.simulated.commit_global(lambda t: dist.all_reduce(t, reduce_operation="SUM"))
        else:
            ext.simulated.defer_commits = False
            ext.simulated.commit()

    def _note_fallback(self, step: int, reason: str) -> None:
        """Count a fallback and log it (every time: `warnings.warn` would show it once per call site)."""
        self.fallbacks += 1
        log.warning(
            "data_selection step %d: %s; falling back to random selection within capacities (%d fallbacks so far)",
            step,
            reason,
            self.fallbacks,
        )

    def _features(
        self, state: State, batch: Mapping[str, Any], step: int, *, defer_commits: bool = False, validation: bool = True,
        record_prefix: bool = False,
    ):
        """`(features, gbar, None)`, or `(None, None, reason)` when the features are unusable.

        With `validation` False (a stale_topk step) no validation batch is drawn or scored: gbar is None.
        With `record_prefix` and the model's `scoring_prefix` (`model.reuse_scoring_prefix`), the frozen
        blocks' output on the pool rows is kept in `self._prefix_rows` when the pass scored whole rows.
        """
        from composer_algos.features import FeatureError

        if self.extractor is None:
            self._build_extractor(state)
        assert self.extractor is not None
        self.extractor.simulated.defer_commits = defer_commits
        # Host tensors: the extractor cuts windows / score tokens there and moves what it scores.
        pool = model_inputs(batch)
        val = None
        val_domain_V = None
        if validation and self.spec is not None and self.spec.needs_validation:
            if self.validation is None:
                self._build_validation(state)
            assert self.validation is not None
            val_batch = self.validation.batch_for_step(step)
            val = model_inputs(val_batch)
            val_domain_V = self._validation_domain_ids(val_batch)
        precision = getattr(state, "precision", None)
        context = None
        if precision is not None:
            # The training forward's own context (Composer's trainer enters the same around it).
            precision_config = getattr(state, "precision_config", None)

            def context():
                return get_precision_context(precision, precision_config)

        prefix = self._scoring_prefix(state) if record_prefix else None
        try:
            with prefix.recording() if prefix is not None else contextlib.nullcontext():
                feats, gbar = self.extractor.compute(
                    pool,
                    val,
                    step=step,
                    optimizer=state.optimizers[0] if state.optimizers else None,
                    precision_context=context,
                    auto_chunk_size=self._auto_chunk_size(state),
                    row_offset=dist.get_global_rank() * int(pool["input_ids"].shape[0]),
                )
            if prefix is not None:
                n_pool = int(pool["input_ids"].shape[0])
                self._prefix_rows = prefix.take(n_pool, n_pool + (int(val["input_ids"].shape[0]) if val is not None else 0))
            rows = self.extractor.val_features_in_use
            if rows is not None and val_domain_V is not None:
                self._val_rows_VD = rows.float()
                self._val_domain_V = val_domain_V.to(rows.device, non_blocking=True)
            return feats, gbar, None
        except FeatureError as e:
            return None, None, f"unusable gradient features ({e})"

    def _scoring_prefix(self, state: State) -> Any:
        """The model's `ScoringPrefix` when this step's scoring pass sees whole rows of this rank's pool, else None."""
        model = state.model.module if isinstance(state.model, DistributedDataParallel) else state.model
        prefix = getattr(model, "scoring_prefix", None)
        if prefix is None or self.extractor is None:
            return None
        why = None
        if self.scope == "global" or (self.scope == "auto" and dist.get_world_size() > 1):
            why = "selection scope is global (the selected rows may come from other ranks)"
        elif self.extractor.score_window is not None or self.extractor.score_tokens is not None:
            why = "the scoring pass sees part of each row (score_window or score_tokens)"
        elif self.extractor._forward_model is not self.extractor.model:
            why = "the model is wrapped in FSDP"
        if why is not None:
            if not self._warned_prefix:
                log.warning("model.reuse_scoring_prefix: the training forward runs every block: %s", why)
                self._warned_prefix = True
            return None
        return prefix

    def _validation_domain_ids(self, val_batch: Mapping[str, Any]) -> torch.Tensor | None:
        """The validation batch's per-example domain ids (zeros when the batch has none and none are needed)."""
        if not self._needs_validation_rows():
            return None
        ids = val_batch.get(self.domain_key, val_batch.get("domain_id"))
        n = int(val_batch["input_ids"].shape[0])
        if isinstance(ids, torch.Tensor) and ids.shape == (n,):
            return ids.long()
        if self.validation_target == "domain_balanced" or self.capacity_policy.stateful:
            raise TypeError(
                f"algorithms.data_selection: validation.target {self.validation_target!r} / capacities "
                f"{self.capacity_policy.name!r} need each validation example's domain: the validation batches need "
                f"a ({n},) domain id tensor under {self.domain_key!r} (the validation shards' collator writes it)"
            )
        return torch.zeros(n, dtype=torch.long)

    def _auto_chunk_size(self, state: State) -> int | None:
        """What `chunk_size: auto` scores per forward: the run's device microbatch, at most kappa.

        `state.device_train_microbatch_size` is the configured microbatch or, under auto
        microbatching, the size it has settled on (it starts at the loader's batch, the pool); a
        training microbatch never holds more than the kappa examples a rank trains. Without a
        microbatch size, kappa (the whole training batch is one microbatch); None when neither is
        known (the extractor's default then applies).
        """
        microbatch = getattr(state, "device_train_microbatch_size", None)
        if not isinstance(microbatch, (int, float)) or isinstance(microbatch, bool) or microbatch < 1:
            return self.kappa
        chunk = int(microbatch)
        return min(chunk, self.kappa) if self.kappa is not None else chunk

    def _is_active(self, state: State, step: int, ahead: bool = False) -> bool:
        return self._in_window(state, ahead) and step % self.interval == 0

    def _in_window(self, state: State, ahead: bool = False) -> bool:
        """Whether the fraction of training elapsed lies in [start, end): at the next batch's start with `ahead`
        (exact for batch and epoch durations; with sample or token durations the current fraction)."""
        elapsed = state.get_elapsed_duration()
        frac = float(elapsed.value) if elapsed is not None else 0.0
        limit = state.max_duration if ahead else None
        if limit is not None and limit.unit == TimeUnit.BATCH:
            frac = (int(state.timestamp.batch) + 1) / int(limit.value)
        return self.start <= frac < self.end

    def _is_stale_step(self, state: State, step: int, ahead: bool = False) -> bool:
        """Whether this step, between selections inside the window, trains on the stale top-k."""
        if self.between != "stale_topk" or step % self.interval == 0 or not self._in_window(state, ahead):
            return False
        if self._stale_gbar is None:
            log.warning(
                "data_selection step %d: between: stale_topk has no validation feature from a selecting step "
                "yet (none has run or all fell back since the start, or a resume of scope local on several "
                "ranks); training on a random subset",
                step,
            )
            return False
        return True

    def _stale_topk(self, problem: Any, seed: int) -> Any:
        """The between step's selection: the top kappa by `<g_i, gbar_stale>` within this step's capacities."""
        from composer_algos.data_selection.step import SolveOutcome, broadcast_selection
        from composer_algos.selection import compute_capacities, count_domains
        from composer_algos.selection.types import finish_result

        assert problem.features_PD is not None and self._stale_gbar is not None
        features_PD = problem.features_PD
        scores_P = features_PD @ self._stale_gbar.to(features_PD.device, features_PD.dtype, non_blocking=True)
        domain_P = problem.domain_P.to(features_PD.device, non_blocking=True)
        # The same generator stream as a selecting step's capacities (solve_problem's _run_strategy).
        gen = torch.Generator().manual_seed(seed)
        counts_C = count_domains(problem.domain_P, self.num_domains).cpu()
        capacity_fn = self._capacity_fn()
        if capacity_fn is not None:
            caps_C = capacity_fn(counts_C, min(problem.kappa, int(problem.domain_P.shape[0])), gen)
        else:
            caps_C = compute_capacities(counts_C, problem.kappa, self._fractions, generator=gen)
        sel_K = top_k_within_capacities(scores_P, domain_P, caps_C.to(domain_P.device, non_blocking=True), problem.kappa)
        result = finish_result(sel_K, domain_P, self.num_domains)
        if problem.gathered:
            result = broadcast_selection(result, problem.domain_P, self.num_domains)
        return SolveOutcome(result, "stale_topk", None, caps_C)

    def _check_same_problem(self, problem: Any) -> None:
        """Verify (one all-gather of a digest) that every rank assembled the same gathered problem.

        The selections are identical by construction (rank 0's are broadcast); what can differ is
        the problem each rank holds: the gathered features `G`, the validation feature `gbar`, the
        domains and the budget. A difference there means the ranks' feature passes disagree.
        """
        digest = hashlib.sha1(str(problem.kappa).encode())
        for t in (problem.domain_P, problem.features_PD, problem.gbar_D):
            digest.update(b"|" if t is None else t.detach().contiguous().cpu().numpy().tobytes())
        mine = int.from_bytes(digest.digest()[:8], "little") & 0x7FFFFFFFFFFFFFFF
        all_ = torch.cat(dist.all_gather(torch.tensor([mine], dtype=torch.int64, device=problem.domain_P.device)))
        if not bool((all_ == all_[0]).all()):
            raise RuntimeError(
                f"data_selection check_consistency: ranks assembled different selection problems (digests of "
                f"the gathered features, validation feature, domains and budget by rank: {all_.tolist()}); "
                f"the gathered features should be bit-identical on every rank"
            )


def find_data_selection(state: State) -> DataSelection | None:
    """The run's `DataSelection` algorithm, or None when the run selects nothing."""
    return find_data_selection_in(state.algorithms)


def find_data_selection_in(algorithms: Iterable[Any]) -> DataSelection | None:
    """The `DataSelection` among `algorithms`, or None (train.py sizes the loader from its oversampling)."""
    return next((a for a in algorithms if isinstance(a, DataSelection)), None)


def top_k_within_capacities(
    scores_N: torch.Tensor, domain_N: torch.Tensor, capacities_C: torch.Tensor, k: int
) -> torch.Tensor:
    """The `k` highest-scoring examples, at most `capacities_C[c]` from domain c (unsorted positions).

    The examples are scanned from the highest score down and kept while their domain has room,
    until `k` are kept; with capacities summing to `k` that is the top `capacities_C[c]` of every
    domain. Ties go to the lower position. Vectorised: two stable sorts rank each example within
    its domain (as `select_random_stratified` does with random keys).

    Args:
        scores_N: (N,) scores.
        domain_N: (N,) domain ids in [0, C).
        capacities_C: (C,) per-domain caps.
        k: examples to keep (at most the room the caps leave).

    Returns:
        (min(k, room),) int64 pool positions.
    """
    n = scores_N.shape[0]
    device = scores_N.device
    by_score_N = torch.sort(-scores_N, stable=True).indices  # highest first
    by_domain_N = torch.sort(domain_N[by_score_N], stable=True).indices
    perm_N = by_score_N[by_domain_N]  # grouped by domain, best first inside each
    counts_C = torch.bincount(domain_N, minlength=capacities_C.shape[0])
    starts_C = torch.cumsum(counts_C, 0) - counts_C
    rank_N = torch.empty_like(perm_N)
    rank_N[perm_N] = torch.arange(n, device=device) - starts_C[domain_N[perm_N]]
    keep_N = rank_N < capacities_C[domain_N]
    # Among the keepable examples, the k best (the scan stops at k).
    order_N = torch.sort(torch.where(keep_N, -scores_N, torch.full_like(scores_N, float("inf"))), stable=True).indices
    return order_N[: min(k, int(keep_N.sum()))]


def _trained_domain_names(dataset: Any) -> list[str] | None:
    """The domains a `DomainStreamingDataset` streams (manifest order), or None for another dataset."""
    ids, names = getattr(dataset, "stream_domain_ids", None), getattr(dataset, "domain_names", None)
    if ids is None or names is None:
        return None
    return [names[i] for i in sorted(set(int(i) for i in ids))]


class _StageClock:
    """Times of a step's stages without making the host wait for the accelerator.

    On CUDA each mark also records an event; the times between marks taken before the step's one
    transfer are read from the events after it (they are complete by then), so they measure the
    device's work. Elsewhere (and for marks taken after the transfer) the host clock. Created at
    the mark "start".
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._host: dict[str, float] = {}
        self._events: dict[str, Any] = {}
        self.mark("start")

    def mark(self, name: str, *, host_only: bool = False) -> None:
        self._host[name] = time.perf_counter()
        if self.cuda and not host_only:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events[name] = event

    def host_seconds(self, a: str, b: str) -> float:
        return self._host[b] - self._host[a]

    def seconds(self, a: str, b: str) -> float:
        """Device time between two marks when both events are complete, else host time."""
        ea, eb = self._events.get(a), self._events.get(b)
        if ea is not None and eb is not None and eb.query():
            return ea.elapsed_time(eb) / 1000.0
        return self.host_seconds(a, b)


@dataclass
class _Step:
    """What one step's stages share: decided at its start (`DataSelection._begin_step`), filled in as they run."""

    number: int  # the batch index
    world: int
    multi: bool  # global scope on several ranks: the problem is gathered from every rank
    seed: int  # the step's generator seed
    eta: float  # the optimizer's learning rate
    strategy: str  # what runs this step (random outside [start, end) and between selections)
    stale: bool  # a between step scoring the pool against the last selection's validation feature
    needs_features: bool
    rows_needed: bool  # keep the validation rows one by one, not only their mean
    pool_C: torch.Tensor  # (C,) the pool's domain counts on this rank
    pool_ids: Any  # the pool's sample ids, when the batch has them
    clock: _StageClock
    feature_checks: DeferredChecks = field(default_factory=DeferredChecks)
    solver_checks: DeferredChecks = field(default_factory=DeferredChecks)
    average_before: Any = None  # the validation average before this step folded its feature in
    t_gather: float = 0.0

    @property
    def deferred(self) -> bool:
        """Whether the checks of device values wait for the step's one transfer (local scope)."""
        return not self.multi


def _deferring(checks: Any):
    """`selection.deferring_checks(checks)`, or nothing for None."""
    from composer_algos.selection import deferring_checks

    return deferring_checks(checks) if checks is not None else contextlib.nullcontext()


def _uses_fsdp2(model: torch.nn.Module) -> bool:
    """Whether FSDP2 (`fully_shard`, Composer's `parallelism_config.fsdp2`) manages a module of `model`."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())
