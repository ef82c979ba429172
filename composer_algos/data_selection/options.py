"""`DataSelection`'s options as one typed, frozen object, and the rules they must satisfy.

`DataSelectionOptions.problems()` reports every invalid option at once (the registry runs it on a
yaml's values before anything is built); `DataSelection.__init__` raises them as one `ValueError`.
What each option means is in `DataSelection`'s docstring and docs/data_selection.md.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ADAPTIVE_STRATEGIES",
    "BETWEEN_MODES",
    "DEFAULT_OVERSAMPLING",
    "DataSelectionOptions",
    "SELECTION_STRATEGIES",
    "VALIDATION_KEYS",
    "VALIDATION_TARGETS",
    "validation_config",
]

# Strategies the algorithm accepts: the selection registry's plus "none" (train on the whole pool).
SELECTION_STRATEGIES = (
    "partitionsel",
    "greats",
    "id",
    "iwd",
    "gradnorm",
    "colm",
    "facloc",
    "uniprot",
    "random",
    "random_stratified",
    "none",
)

# The one default of the oversampling ratio r (pool = r x kappa); train.py sizes the loader from the
# algorithm's value, so a yaml that omits it selects with r = 2.
DEFAULT_OVERSAMPLING = 2.0

# What the steps between selections (`interval` > 1) train on; see `DataSelection`'s `between`.
BETWEEN_MODES = ("random", "stale_topk")

VALIDATION_KEYS = (
    "shard_dir", "split", "domains", "batch_size", "remote", "guide_fraction", "average_beta", "batches", "target",
    "stratify",
)

# What the guiding validation feature is (`validation.target`).
VALIDATION_TARGETS = ("mean", "domain_balanced")

# Strategies whose refit weights the adaptive capacities' per-domain utilities are computed from.
ADAPTIVE_STRATEGIES = ("partitionsel", "iwd")


@dataclass(frozen=True)
class DataSelectionOptions:
    """Every option of `DataSelection`, as given (its docstring says what each does; defaults are its own)."""

    strategy: str
    oversampling: float
    scope: str
    validation: Mapping[str, Any] | str | os.PathLike | Iterable[Mapping[str, Any]] | None
    domain_key: str
    domain_names: Sequence[str] | None
    features: Mapping[str, Any] | None
    strategy_options: Mapping[str, Any] | None
    capacity_fractions: Mapping[str, float] | str | None
    capacities: str | dict[str, Any] | None
    weighted_loss: bool
    start: float
    end: float
    interval: int
    between: str
    check_consistency: bool
    seed: int
    log_conflicts: bool
    select_ahead: bool = False

    @functools.cached_property
    def validation_cfg(self) -> dict[str, Any]:
        """`validation` as a mapping: a shard directory or an iterable of batches become one key."""
        return validation_config(self.validation)

    @functools.cached_property
    def known_strategies(self) -> tuple[str, ...]:
        """The built-ins, "none", and strategies other packages add (entry points partitionsel.strategies)."""
        from composer_algos.selection import strategy_names

        return (*SELECTION_STRATEGIES, *(n for n in strategy_names() if n not in SELECTION_STRATEGIES))

    def guided(self) -> bool:
        """Whether the strategy is known and draws a validation batch."""
        from composer_algos.selection import get_strategy

        known = self.strategy in self.known_strategies and self.strategy != "none"
        return known and get_strategy(self.strategy).needs_validation

    def problems(self) -> list[str]:
        """Every rule the options break, as messages naming the option, the value and what is allowed."""
        return [
            *self._run_problems(),
            *self._validation_problems(),
            *self._capacity_problems(),
            *self._other_problems(),
        ]

    def unused_settings(self) -> list[str]:
        """Settings given that this strategy never reads, a message each (`DataSelection` warns of them at init).

        Warned, not refused: a study's arms often share one yaml and change only `strategy`, so a `random`
        arm carries the guided arms' `features` and `validation`. Unknown strategies are `problems()`'."""
        from composer_algos.selection import get_strategy

        if self.strategy not in self.known_strategies:
            return []
        spec = None if self.strategy == "none" else get_strategy(self.strategy)
        unused = []
        if self.features and not (spec is not None and spec.needs_features) and not self.log_conflicts:
            unused.append(
                f"features ({', '.join(sorted(self.features))}): strategy {self.strategy!r} computes no gradient "
                "features (nor does log_conflicts: false)"
            )
        if self.validation is not None and not self.guided():
            unused.append(f"validation: strategy {self.strategy!r} draws no validation batch")
        return unused

    def capacity_policy(self):
        """The capacity policy the options give (`capacity_policy.parse_capacity_policy`); valid options only."""
        from composer_algos.data_selection.capacity_policy import FractionsPolicy

        if self.capacity_fractions:
            weights = self.capacity_fractions if isinstance(self.capacity_fractions, str) else dict(self.capacity_fractions)
            return FractionsPolicy(weights=weights, source="algorithms.data_selection.capacity_fractions")
        policy, _ = self._parsed_capacities
        return policy

    @functools.cached_property
    def _parsed_capacities(self) -> tuple[Any, str | None]:
        """`capacities` parsed once (a `file:` policy reads its file here): (policy, None) or (None, why not)."""
        from composer_algos.data_selection.capacity_policy import parse_capacity_policy

        try:
            return parse_capacity_policy(self.capacities, where="capacities"), None
        except (ValueError, FileNotFoundError) as e:
            return None, str(e)

    def _run_problems(self) -> list[str]:
        """The strategy, the ratio, the scope and when selection runs."""
        problems = []
        strategy, oversampling, known = self.strategy, self.oversampling, self.known_strategies
        if strategy not in known:
            problems.append(f"strategy must be one of {known}, got {strategy!r}")
        if not oversampling >= 1:
            problems.append(f"oversampling must be >= 1, got {oversampling}")
        elif oversampling == 1 and strategy != "none":
            problems.append(
                f"oversampling 1 with strategy {strategy!r}: the pool would equal kappa and nothing would be "
                f"selected; use oversampling > 1 (default {DEFAULT_OVERSAMPLING:g}) or strategy none"
            )
        if self.scope not in ("auto", "global", "local"):
            problems.append(f"scope must be auto, global or local, got {self.scope!r}")
        if not 0 <= self.start < self.end <= 1:
            problems.append(
                f"start and end must satisfy 0 <= start < end <= 1, got start={self.start}, end={self.end}"
            )
        if self.interval < 1:
            problems.append(f"interval must be >= 1, got {self.interval}")
        if self.between not in BETWEEN_MODES:
            problems.append(f"between must be one of {list(BETWEEN_MODES)}, got {self.between!r}")
        elif self.between == "stale_topk" and strategy in known and not self.guided():
            problems.append(
                f"between: stale_topk scores the pool against the validation feature of the last selection, "
                f"so it needs a validation-guided strategy (partitionsel, greats, id, iwd); strategy "
                f"{strategy!r} has none; use between: random"
            )
        return problems

    def _validation_problems(self) -> list[str]:
        """The validation mapping's keys and values, and settings a strategy without validation would ignore."""
        problems = []
        cfg = self.validation_cfg
        unknown_val = sorted(set(cfg) - set(VALIDATION_KEYS))
        if unknown_val:
            problems.append(f"validation does not take {unknown_val}; allowed: {', '.join(VALIDATION_KEYS)}")
        size = cfg.get("batch_size", 1)
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            problems.append(f"validation.batch_size must be an integer > 0, got {size!r}")
        beta = cfg.get("average_beta", 0.0)
        if not (isinstance(beta, (int, float)) and 0.0 <= beta < 1.0):
            problems.append(f"validation.average_beta must be in [0, 1), got {beta!r}")
        elif beta > 0:
            problems += _average_beta_conflicts(beta, self.features or {})
        target = cfg.get("target", "mean")
        if target not in VALIDATION_TARGETS:
            problems.append(f"validation.target must be one of {list(VALIDATION_TARGETS)}, got {target!r}")
        stratify = cfg.get("stratify", False)
        if not isinstance(stratify, bool):
            problems.append(f"validation.stratify must be true or false, got {stratify!r}")
        elif stratify and cfg.get("batches") is not None:
            problems.append(
                "validation.stratify draws from validation shards; with given batches the draw is yours: remove "
                "validation.stratify or give validation.shard_dir"
            )
        if self.strategy in self.known_strategies and not self.guided() and (target != "mean" or stratify is True):
            problems.append(
                f"validation.target {target!r} / validation.stratify {stratify!r} would be ignored: strategy "
                f"{self.strategy!r} draws no validation batch; remove them or use a validation-guided strategy"
            )
        return problems

    def _capacity_problems(self) -> list[str]:
        """The capacity policy (or the older capacity_fractions), and whether the strategy honours it."""
        problems = []
        strategy, capacities, fractions = self.strategy, self.capacities, self.capacity_fractions
        known = strategy in self.known_strategies
        policy = None
        if capacities is not None and fractions:
            problems.append(
                "capacities and capacity_fractions both given; capacity_fractions is the older spelling of "
                "capacities: {policy: fractions, weights: ...} (or capacities: uniform): keep one"
            )
        else:
            policy, why_not = self._parsed_capacities
            if why_not is not None:
                problems.append(why_not)
        if policy is not None and capacities is not None and policy.name != "proportional" and known:
            ignored = _ignored_capacities(strategy, f"capacities {policy.describe()!r}", "them", "capacities")
            if ignored:
                problems.append(ignored)
            elif policy.name == "adaptive" and strategy not in ADAPTIVE_STRATEGIES:
                problems.append(
                    f"capacities adaptive updates each domain's budget from the refit weights of the selection, which "
                    f"strategy {strategy!r} does not have; use one of {list(ADAPTIVE_STRATEGIES)}"
                )
        if fractions and known:
            ignored = _ignored_capacities(strategy, f"capacity_fractions {fractions!r}", "it", "capacity_fractions")
            if ignored:
                problems.append(ignored)
        return problems

    def _other_problems(self) -> list[str]:
        problems = []
        if self.check_consistency and self.scope == "local":
            problems.append(
                "check_consistency: true needs scope global or auto (with local scope every rank selects "
                "from its own pool, so the selections differ by design); got scope 'local'"
            )
        bad_opts = sorted(k for k in (self.strategy_options or {}) if k not in self.known_strategies)
        if bad_opts:
            problems.append(
                f"strategy_options is keyed by strategy name; {bad_opts} are not strategies "
                f"(allowed: {self.known_strategies}), e.g. strategy_options: {{partitionsel: {{refit: exact}}}}"
            )
        if not isinstance(self.log_conflicts, bool):
            problems.append(f"log_conflicts must be true or false, got {self.log_conflicts!r}")
        if not isinstance(self.select_ahead, bool):
            problems.append(f"select_ahead must be true or false, got {self.select_ahead!r}")
        return problems


def _ignored_capacities(strategy: str, given: str, pronoun: str, key: str) -> str | None:
    """The message when `strategy` would ignore the capacities given as `given` (None when it honours them)."""
    from composer_algos.selection import STRATEGIES, get_strategy

    if strategy != "none" and get_strategy(strategy).uses_capacities:
        return None
    honour = [name for name, spec in STRATEGIES.items() if spec.uses_capacities]
    what = "trains on the whole pool" if strategy == "none" else "does not use per-domain capacities"
    return (
        f"{given} would be ignored: strategy {strategy!r} {what} (only {', '.join(honour)} honour {pronoun}): "
        f"remove {key} or choose one of those strategies"
    )


def _average_beta_conflicts(beta: float, features: Mapping[str, Any]) -> list[str]:
    """Feature settings that make a running mean of the validation feature average incomparable steps.

    `ValidationAverage` folds `gbar` of many steps into one vector, which is meaningful only when the
    validation side carries no step-dependent scaling or projection: the optimizer's preconditioner
    on the validation side (`precondition: split | both` with `adam_optimizer`), the simulated-Adam
    filter (its state moves every step) or projections drawn anew every step.
    """
    import inspect

    from composer_algos.features import GradFeatureExtractor

    defaults = inspect.signature(GradFeatureExtractor).parameters
    normalization = features.get("normalization", defaults["normalization"].default)
    precondition = features.get("precondition", defaults["precondition"].default)
    resample = features.get("resample_projections", defaults["resample_projections"].default)
    found = []
    if normalization == "adam_optimizer" and precondition in ("split", "both"):
        found.append(
            f"features.precondition {precondition!r} scales the validation feature by the optimizer's current "
            "second moment"
        )
    if normalization == "adam_simulated":
        found.append("features.normalization 'adam_simulated' filters it with a state that moves every step")
    if resample:
        found.append(f"features.resample_projections {resample!r} draws new projections every step")
    if not found:
        return []
    return [
        f"validation.average_beta {beta:g} averages the validation feature over steps, which needs a validation "
        f"side with no step-dependent scaling or projection, but {' and '.join(found)}: use "
        "features.precondition: pool with normalization adam_optimizer (the defaults) and fixed projections, "
        "or validation.average_beta: 0"
    ]


def validation_config(validation: Any) -> dict[str, Any]:
    """The `validation` argument as a mapping: a shard directory or an iterable of batches become one key."""
    if validation is None:
        return {}
    if isinstance(validation, (str, os.PathLike)):
        return {"shard_dir": os.fspath(validation)}
    if isinstance(validation, Mapping):
        return dict(validation)
    if isinstance(validation, Iterable):
        return {"batches": validation}
    raise TypeError(
        f"validation must be a shard directory, an iterable of batches or a mapping of options, got {type(validation).__name__}"
    )
