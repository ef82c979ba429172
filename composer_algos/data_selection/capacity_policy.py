"""Capacity policies: how a step's budget kappa is split into per-domain capacities of the partition matroid.

`algorithms.data_selection.capacities` names one policy (docs/data_selection.md, Capacities):

- `proportional` (default, the paper's "uniform constraints"): ``kappa n_c / n``, rounded without bias.
- `uniform` and `fractions`: fixed shares of kappa per domain, from the yaml (`weights`) or from a
  DoReMi run's weights file (`file`: this project's `mixture.json`, or the official DoReMi JSON with
  `train_domain_weights`).
- `slack` with a factor ``s >= 1``: per-domain *upper bounds* ``min(n_c, ceil(s q_c))``, ``q_c`` the
  proportional capacity, with the total still kappa, so the joint utility decides how many examples
  each domain gets (``s = 1`` is `proportional` exactly; ``s = inf`` is domain-free selection).
- `adaptive`: the budget curriculum of the official PartitionSel code (see `AdaptivePolicy`).
- `minority_full`: listed (or small) domains kept whole, the rest of kappa by a base policy.

The policies are host-side bookkeeping over ``C`` numbers per step; the tensor work they need
(`per_domain_utilities`, `domain_balanced_mean`) is vectorised and stays on the features' device.

Shape legend: C domains, P pool, K selected, V validation rows, D feature dimension.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from composer_algos.selection.capacities import compute_capacities
from pipeline.config import ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "POLICY_NAMES",
    "CapacityPolicy",
    "ProportionalPolicy",
    "FractionsPolicy",
    "SlackPolicy",
    "AdaptivePolicy",
    "MinorityFullPolicy",
    "parse_capacity_policy",
    "read_domain_weights_file",
    "adaptive_budgets",
    "adaptive_gain_update",
    "per_domain_utilities",
    "domain_balanced_mean",
    "standardize",
]

POLICY_NAMES = ("proportional", "uniform", "fractions", "slack", "adaptive", "minority_full")

WHERE = "algorithms.data_selection.capacities"


class CapacityPolicy:
    """A named capacity policy (the base class of the policies below).

    Attributes:
        name: the yaml name.
        bounds: the capacities are upper bounds summing above the budget (only `slack`); every other
            policy's capacities sum to the budget exactly, so every capacity is filled.
        stateful: the policy carries state across steps (`adaptive`: in the algorithm's checkpoint).
    """

    name = "proportional"
    bounds = False
    stateful = False

    def bind(self, domain_names: Sequence[str], trained: Sequence[str] | None = None) -> None:
        """Resolve names to domain ids once the run's domains are known (again when C grows).

        Args:
            domain_names: the run's domains by id.
            trained: the domains the training dataset streams (None when unknown).

        Raises:
            ConfigError: (a ValueError) a named domain the run does not have, or a trained domain a
                weights file lacks; `composer_algos.registry.shard_problems` makes the same call
                before anything is built, so this is the backstop for shards it could not read.
        """

    def fractions(self) -> list[float] | None:
        """Fixed shares by domain id when the policy is `compute_capacities` with fractions, else None."""
        return None

    def simple(self) -> bool:
        """Whether `compute_capacities(counts, k, self.fractions(), generator)` is the whole policy."""
        return True

    def capacities(self, pool_counts_C: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
        """``(C,)`` int64 capacities for a pool with ``pool_counts_C`` and budget ``k = min(kappa, n)``.

        A pure function of the arguments and the policy's state: the solve calls it again for a
        fallback, and every rank of a global-scope run calls it with the same generator.
        """
        return compute_capacities(pool_counts_C, k, self.fractions(), generator=generator)

    def describe(self) -> str:
        return self.name

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None


@dataclass(kw_only=True)
class ProportionalPolicy(CapacityPolicy):
    """Capacities proportional to the pool, ``k n_c / n`` (randomised rounding with the step's generator)."""

    name = "proportional"


@dataclass(kw_only=True)
class FractionsPolicy(CapacityPolicy):
    """Fixed shares of the budget by domain name (``compute_capacities`` water-fills over the pool).

    Args:
        weights: domain name -> non-negative weight (normalised), or `uniform` (the same share for
            every domain of the run).
        file: instead of `weights`, a DoReMi run's weights file (`read_domain_weights_file`): every
            domain the run trains must be in it (else the error names the missing ones).
        source: the yaml path named in messages.
    """

    name = "fractions"
    weights: dict[str, float] | str | None = None
    file: str | None = None
    source: str = WHERE
    _by_id: list[float] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.weights == "uniform":
            self.name = "uniform"
        if self.file is not None:
            self.weights = read_domain_weights_file(self.file)

    def bind(self, domain_names: Sequence[str], trained: Sequence[str] | None = None) -> None:
        from pipeline.dataset import resolve_domain_weights

        names = list(domain_names)
        shares = dict.fromkeys(names, 1.0) if self.weights == "uniform" else dict(self.weights or {})
        if self.file is not None:
            unknown = sorted(set(shares) - set(names))
            if unknown:
                log.warning("%s: %s names domains the run does not have: %s (ignored)", self.source, self.file, unknown)
                shares = {n: w for n, w in shares.items() if n in names}
            needed = list(trained) if trained is not None else names
            missing = [n for n in needed if n not in shares]
            if missing:
                raise ConfigError(
                    f"{self.source}: the weights file {self.file} has no weight for domains {missing} that the run "
                    f"trains (it covers {sorted(shares)}); use the weights file of a DoReMi run on the same domains"
                )
        # Missing domains get 0 (with a warning); the rest is normalised to sum to 1.
        try:
            weights = resolve_domain_weights(shares, names, source=self.source)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self._by_id = [weights[n] for n in names]

    def fractions(self) -> list[float] | None:
        assert self._by_id is not None, "FractionsPolicy.bind() first"
        return self._by_id

    def describe(self) -> str:
        return f"fractions from {self.file}" if self.file is not None else self.name


@dataclass(kw_only=True)
class SlackPolicy(CapacityPolicy):
    """Upper bounds ``min(n_c, ceil(s q_c))`` around the proportional capacities ``q_c``, total still ``k``.

    The solvers select ``k`` examples under the bounds (a partition matroid truncated at ``k``; the
    greedy and OMP stop after ``k`` picks), so the joint utility decides each domain's share within
    its bound. ``q_c`` is the proportional capacity as `proportional` rounds it (same generator
    draws), so ``s = 1`` gives exactly `proportional`'s capacities and selections; ``s = inf`` bounds
    every domain by its pool count only (domain-free selection).

    Args:
        factor: ``s >= 1`` (``inf`` allowed).
    """

    name = "slack"
    bounds = True
    factor: float = 1.0

    def simple(self) -> bool:
        return False

    def capacities(self, pool_counts_C: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
        q_C = compute_capacities(pool_counts_C, k, None, generator=generator)
        if math.isinf(self.factor):
            return torch.minimum(pool_counts_C.to(q_C.dtype), torch.full_like(q_C, k))
        # ceil(s q) in exact arithmetic for the usual decimal factors (1.5 * 4 must be 6, not 6.000001).
        scaled = [math.ceil(round(self.factor * q, 9)) for q in q_C.tolist()]
        bound_C = torch.tensor(scaled, dtype=q_C.dtype, device=q_C.device)
        return torch.minimum(bound_C, pool_counts_C.to(q_C.dtype))

    def describe(self) -> str:
        return f"slack {self.factor:g}"


@dataclass(kw_only=True)
class AdaptivePolicy(CapacityPolicy):
    """The budget curriculum of the official PartitionSel code (efficiency-learning/PartitionSEL at 9d33660).

    `tunix/sft/subsel/subsel.py::curr_budget` sets each step's budgets from a per-domain gain, and
    `tunix/sft/subsel_utils.py::subset_select` (mode `joint`) updates the gain after the solve from
    `per_class_utilities` (same file as `curr_budget`):

    1. budgets (`adaptive_budgets`): ``b_c = kappa / C - (kappa / lamb) standardize(gain)_c`` over
       the ``C`` domains present in the pool, clipped to ``[0, n_c]``, rounded to the nearest integer
       and adjusted one unit at a time at random (the step's generator) until they sum to kappa;
    2. after the solve (`per_domain_utilities`): each domain's utility ``U_c``, the selection's
       scale-free objective with that domain's validation examples as the target,
       ``U_c = <v, G_S gbar_c + (eta/2) diag K_SS> - v^T K_SS v / 2`` (``v = eta w``, the refit
       weights);
    3. (`adaptive_gain_update`) the relative change ``r_c = (U_c - U_c^prev) / |U_c^prev|`` (0 when
       ``U_c^prev = 0``), the average ``gain_c <- beta r_c + (1 - beta) gain_c`` (the official
       weighting: beta on the new value) and ``U_c^prev <- U_c``.

    A domain that improves faster than the others (positive standardised gain) gets a smaller
    budget next step. Deviations from the official code: ``C`` counts the domains present in the
    step's pool (the official code's every training source), and a domain without a validation
    example this step keeps its gain and previous utility (the official code scores it against a
    zero target); use `validation.stratify: true` so that every domain is drawn.

    The state (gain, previous utility) is in the algorithm's checkpoint. Under global scope every
    rank updates it from the same gathered problem and rank 0's utilities (broadcast), so it is
    identical on every rank.

    Args:
        beta: weight of the newest relative change (default 0.9).
        lamb: the curriculum's lambda (default 0.5); budgets move by ``kappa / lamb`` per standard
            deviation of the gain.
    """

    name = "adaptive"
    stateful = True
    beta: float = 0.9
    lamb: float = 0.5
    gain_C: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64), repr=False)
    prev_C: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64), repr=False)

    def simple(self) -> bool:
        return False

    def bind(self, domain_names: Sequence[str], trained: Sequence[str] | None = None) -> None:
        self._grow(len(domain_names))

    def capacities(self, pool_counts_C: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
        self._grow(int(pool_counts_C.shape[0]))
        return adaptive_budgets(self.gain_C[: pool_counts_C.shape[0]], pool_counts_C, k, self.lamb, generator)

    def update(self, utilities_C: torch.Tensor, observed_C: torch.Tensor) -> None:
        """Fold one step's per-domain utilities into the gain (`adaptive_gain_update`)."""
        self._grow(int(utilities_C.shape[0]))
        c = utilities_C.shape[0]
        gain, prev = adaptive_gain_update(
            self.gain_C[:c], self.prev_C[:c], utilities_C.double().cpu(), observed_C.cpu(), self.beta
        )
        self.gain_C[:c], self.prev_C[:c] = gain, prev

    def describe(self) -> str:
        return f"adaptive (beta {self.beta:g}, lamb {self.lamb:g})"

    def state_dict(self) -> dict[str, Any]:
        return {"gain": self.gain_C.tolist(), "prev": self.prev_C.tolist()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.gain_C = torch.tensor(list(state.get("gain", [])), dtype=torch.float64)
        self.prev_C = torch.tensor(list(state.get("prev", [])), dtype=torch.float64)

    def _grow(self, c: int) -> None:
        if self.gain_C.shape[0] < c:
            pad = torch.zeros(c - self.gain_C.shape[0], dtype=torch.float64)
            self.gain_C = torch.cat([self.gain_C, pad])
            self.prev_C = torch.cat([self.prev_C, pad.clone()])


@dataclass(kw_only=True)
class MinorityFullPolicy(CapacityPolicy):
    """Some domains kept whole, the rest of the budget split by a base policy.

    The kept domains are the listed `domains`, or those whose share of the step's pool is at most
    `max_share` (the official code's `minority_full` with `minority_classes`). Each kept domain's
    capacity is its pool count; the other domains share ``k - sum(kept)`` by `base`
    (`proportional`, `uniform` or `fractions`: a policy whose capacities sum to its budget, so every
    kept domain is filled). When the kept domains alone hold at least ``k`` examples they share
    ``k`` proportionally (a warning is logged once).

    Args:
        domains: names of the domains to keep whole.
        max_share: instead, keep every domain present with at most this share of the pool.
        base: the policy of the other domains (default `proportional`).
    """

    name = "minority_full"
    domains: list[str] | None = None
    max_share: float | None = None
    base: CapacityPolicy = field(default_factory=ProportionalPolicy)
    _kept_C: list[bool] | None = field(default=None, init=False, repr=False)
    _warned: bool = field(default=False, init=False, repr=False)

    def simple(self) -> bool:
        return False

    def bind(self, domain_names: Sequence[str], trained: Sequence[str] | None = None) -> None:
        names = list(domain_names)
        self.base.bind(names, trained)
        if self.domains is not None:
            unknown = [d for d in self.domains if d not in names]
            if unknown:
                raise ConfigError(f"{WHERE}.domains: unknown domains {unknown}; the run's domains are {names}")
            self._kept_C = [n in self.domains for n in names]

    def capacities(self, pool_counts_C: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
        counts = [int(c) for c in pool_counts_C.tolist()]
        n = sum(counts)
        if self._kept_C is not None:
            kept = [bool(self._kept_C[c]) if c < len(self._kept_C) else False for c in range(len(counts))]
        else:
            assert self.max_share is not None
            kept = [0 < m <= self.max_share * n for m in counts]
        kept = [kp and m > 0 for kp, m in zip(kept, counts)]
        kept_total = sum(m for m, kp in zip(counts, kept) if kp)
        mask_C = torch.tensor(kept, dtype=torch.bool, device=pool_counts_C.device)
        if kept_total >= k:
            if kept_total > k and not self._warned:
                self._warned = True
                log.warning(
                    "%s: the domains kept whole hold %d examples of the pool, more than the budget %d; they share it "
                    "proportionally this step (logged once)",
                    WHERE,
                    kept_total,
                    k,
                )
            return compute_capacities(torch.where(mask_C, pool_counts_C, 0), k, None, generator=generator)
        rest_C = torch.where(mask_C, torch.zeros_like(pool_counts_C), pool_counts_C)
        fractions = self.base.fractions()
        if fractions is not None:
            fractions = [0.0 if kp else f for f, kp in zip(fractions, kept)]
            total = sum(fractions)
            fractions = [f / total for f in fractions] if total > 0 else None
        caps_C = compute_capacities(rest_C, k - kept_total, fractions, generator=generator)
        return torch.where(mask_C, pool_counts_C.to(caps_C.dtype), caps_C)

    def describe(self) -> str:
        which = f"domains {self.domains}" if self.domains is not None else f"max_share {self.max_share:g}"
        return f"minority_full ({which}, base {self.base.describe()})"


def parse_capacity_policy(value: Any, *, where: str = WHERE) -> CapacityPolicy:
    """The policy a yaml value names.

    Forms: a name (`proportional`, `uniform`, `adaptive`), or a mapping with `policy:` and the
    policy's keys: ``{policy: slack, factor: 2}``, ``{policy: adaptive, beta: 0.9, lamb: 0.5}``,
    ``{policy: fractions, weights: {a: 2, b: 1}}``, ``{policy: fractions, file: runs/doremi/mixture.json}``,
    ``{policy: minority_full, domains: [a], base: proportional}`` (or ``max_share: 0.05``).

    Raises:
        ValueError: every problem at once, each naming the key, the value and what is allowed.
    """
    if value is None:
        return ProportionalPolicy()
    if isinstance(value, CapacityPolicy):
        return value
    if isinstance(value, str):
        if value == "proportional":
            return ProportionalPolicy()
        if value == "uniform":
            return FractionsPolicy(weights="uniform", source=where)
        if value == "adaptive":
            return AdaptivePolicy()
        if value in POLICY_NAMES:
            raise ValueError(f"{where}: {value!r} needs options; write it as a mapping, e.g. {_EXAMPLES[value]}")
        raise ValueError(f"{where}: unknown policy {value!r}; allowed: {', '.join(POLICY_NAMES)}")
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{where} must be a policy name ({', '.join(POLICY_NAMES)}) or a mapping with `policy:`, got {value!r}"
        )
    data = dict(value)
    name = data.pop("policy", None)
    if name not in POLICY_NAMES:
        raise ValueError(f"{where}.policy must be one of {', '.join(POLICY_NAMES)}, got {name!r}")
    allowed = _KEYS[name]
    unknown = sorted(set(data) - set(allowed))
    problems = [f"{where}: policy {name} does not take {unknown}; allowed: {list(allowed) or 'none'}"] if unknown else []
    if name == "proportional":
        policy: CapacityPolicy = ProportionalPolicy()
    elif name == "uniform":
        policy = FractionsPolicy(weights="uniform", source=where)
    elif name == "slack":
        factor = data.get("factor")
        if isinstance(factor, str) and factor.lower() in ("inf", "infinity", "unbounded"):
            factor = math.inf
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
            problems.append(f"{where}.factor must be a number >= 1 (or inf: domain-free), got {factor!r}")
            factor = 1.0
        policy = SlackPolicy(factor=float(factor))
    elif name == "adaptive":
        beta, lamb = data.get("beta", 0.9), data.get("lamb", 0.5)
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 < beta <= 1:
            problems.append(f"{where}.beta must be in (0, 1], got {beta!r}")
            beta = 0.9
        if isinstance(lamb, bool) or not isinstance(lamb, (int, float)) or not (lamb > 0 and math.isfinite(lamb)):
            problems.append(f"{where}.lamb must be a finite number > 0, got {lamb!r}")
            lamb = 0.5
        policy = AdaptivePolicy(beta=float(beta), lamb=float(lamb))
    elif name == "fractions":
        policy = _parse_fractions(data, where, problems)
    else:
        policy = _parse_minority(data, where, problems)
    if problems:
        raise ValueError("; ".join(problems))
    return policy


def read_domain_weights_file(path: str | os.PathLike) -> dict[str, float]:
    """Domain weights (summing to 1) from a DoReMi run's weights file, in either of two formats.

    - This project's `mixture.json` (`composer_algos.mixture_io`, what the DoReMi algorithm and
      `MixtureMonitor` write): its `weights`. A run directory stands for DoReMi's learned weights,
      `doremi/mixture.json`, where it has them (a DoReMi proxy run's own `mixture.json` is the mixture it
      was fed, which `MixtureMonitor` writes into every run directory), else for its `mixture.json`.
    - The official DoReMi JSON (github.com/sangmichaelxie/doremi, `configs/*.json`): its
      `train_domain_weights` mapping (`eval_domain_weights` and other keys are ignored).

    Raises:
        FileNotFoundError: no such file.
        ValueError: neither format, or weights that are not finite, non-negative and of positive sum
            (the message names the file).
    """
    p = Path(path)
    if p.is_dir():
        for candidate in (p / "doremi" / "mixture.json", p / "mixture.json"):
            if candidate.is_file():
                p = candidate
                break
    if not p.is_file():
        raise FileNotFoundError(f"{WHERE}.file: no such file {str(path)!r} (give DoReMi's mixture.json or its JSON)")
    try:
        doc = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{WHERE}.file: {p} is not valid JSON ({e})") from e
    if isinstance(doc, dict) and "train_domain_weights" in doc:
        raw = doc["train_domain_weights"]
        if not isinstance(raw, dict) or not raw:
            raise ValueError(f"{p}: `train_domain_weights` must map domain name to weight, got {raw!r}")
        try:
            weights = {str(k): float(v) for k, v in raw.items()}
        except (TypeError, ValueError) as e:
            raise ValueError(f"{p}: `train_domain_weights` values must be numbers ({e})") from e
        bad = {k: v for k, v in weights.items() if not (math.isfinite(v) and v >= 0)}
        total = sum(weights.values())
        if bad or not total > 0:
            raise ValueError(f"{p}: `train_domain_weights` must be finite, >= 0 and sum above 0, got {weights}")
        return {k: v / total for k, v in weights.items()}
    if isinstance(doc, dict) and "format_version" in doc:
        from composer_algos.mixture_io import read_mixture_json

        return dict(read_mixture_json(p).weights)
    keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
    raise ValueError(
        f"{WHERE}.file: {p} is neither this project's mixture.json (format_version, weights) nor the official DoReMi "
        f"JSON (train_domain_weights); it has {keys}"
    )


def standardize(x_C: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / std`` with the population std; zeros where the std is 0 (the official `standardize`)."""
    if x_C.numel() == 0:
        return x_C.clone()
    mean = x_C.mean()
    std = ((x_C - mean) ** 2).mean().sqrt()
    return torch.where(std > 0, (x_C - mean) / torch.where(std > 0, std, torch.ones_like(std)), torch.zeros_like(x_C))


def adaptive_budgets(
    gain_C: torch.Tensor, pool_counts_C: torch.Tensor, k: int, lamb: float, generator: torch.Generator | None
) -> torch.Tensor:
    """The curriculum's budgets: ``k / C - (k / lamb) standardize(gain)``, clipped, rounded, summing to ``k``.

    ``C`` and the standardisation run over the domains present in the pool; absent domains get 0.
    Rounding is to the nearest integer (half to even, as `jnp.rint`); then, while the sum differs
    from ``k``, one unit is added to (removed from) a domain drawn uniformly among those below their
    pool count (above 0), with the step's `generator` (the official `_adjust_to_target`).

    Args:
        gain_C: ``(C,)`` float64 gains.
        pool_counts_C: ``(C,)`` pool counts.
        k: the budget, at most the pool size.
        lamb: the curriculum's lambda.
        generator: the step's generator (None: a fresh default one).

    Returns:
        ``(C,)`` int64 budgets on ``pool_counts_C.device``, each in ``[0, n_c]``, summing to ``k``.
    """
    counts = pool_counts_C.detach().cpu().to(torch.float64)
    present = counts > 0
    num_present = int(present.sum())
    budgets = torch.zeros_like(counts)
    if num_present and k > 0:
        z = standardize(gain_C.detach().cpu().double()[present])
        raw = k / num_present - (k / lamb) * z
        budgets[present] = torch.round(torch.minimum(raw.clamp_min(0.0), counts[present]))
    caps = [int(b) for b in budgets.tolist()]
    room = [int(c) for c in counts.tolist()]
    diff = k - sum(caps)
    if diff:
        gen = generator if generator is not None else torch.Generator()
        uniforms = torch.rand(abs(diff), generator=gen, dtype=torch.float64, device=gen.device).tolist()
        for u in uniforms:
            eligible = [c for c in range(len(caps)) if (caps[c] < room[c] if diff > 0 else caps[c] > 0)]
            if not eligible:
                break
            caps[eligible[min(int(u * len(eligible)), len(eligible) - 1)]] += 1 if diff > 0 else -1
    assert sum(caps) == min(k, sum(room)), (caps, k, room)
    return torch.tensor(caps, dtype=torch.long, device=pool_counts_C.device)


def adaptive_gain_update(
    gain_C: torch.Tensor, prev_C: torch.Tensor, utilities_C: torch.Tensor, observed_C: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the curriculum's state: ``(gain, prev)`` after the utilities ``U`` of a step.

    ``r = (U - prev) / |prev|`` (0 where ``prev = 0``), ``gain <- beta r + (1 - beta) gain`` and
    ``prev <- U``, for the observed domains only (the others keep both).
    """
    safe = torch.where(prev_C == 0, torch.ones_like(prev_C), prev_C.abs())
    rel_C = torch.where(prev_C == 0, torch.zeros_like(prev_C), (utilities_C - prev_C) / safe)
    new_gain = beta * rel_C + (1.0 - beta) * gain_C
    return torch.where(observed_C, new_gain, gain_C), torch.where(observed_C, utilities_C, prev_C)


def per_domain_utilities(
    features_PD: torch.Tensor,
    indices_K: torch.Tensor,
    v_K: torch.Tensor,
    val_rows_VD: torch.Tensor,
    val_domain_V: torch.Tensor,
    num_domains: int,
    eta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each domain's utility of a weighted selection, against that domain's validation examples.

    ``U_c = <v, G_S gbar_c + (eta/2) diag K_SS> - v^T K_SS v / 2`` with ``K_SS = G_S G_S^T`` and
    ``gbar_c`` the mean of the validation rows of domain ``c``: the scale-free PartitionSel
    objective (``Phi = eta f``, docs/selection.md) with ``gbar_c`` as the target, which is the
    official code's `per_class_utilities` in the same units. Computed in float64, no host sync.

    Returns:
        ``(U_C, observed_C)``: float64 utilities (0 for a domain without validation rows) and a bool
        mask of the domains with validation rows.
    """
    G_KD = features_PD.index_select(0, indices_K.to(features_PD.device)).double()
    v_K = v_K.to(G_KD.device, torch.float64)
    V_VD = val_rows_VD.to(G_KD.device, torch.float64)
    dom_V = val_domain_V.to(G_KD.device, torch.long)
    count_C = torch.bincount(dom_V, minlength=num_domains)[:num_domains].to(torch.float64)
    sums_CD = torch.zeros(num_domains, V_VD.shape[1], dtype=torch.float64, device=G_KD.device).index_add_(0, dom_V, V_VD)
    gbar_CD = sums_CD / count_C.clamp_min(1.0)[:, None]
    K_KK = G_KD @ G_KD.T
    mu_KC = G_KD @ gbar_CD.T + (0.5 * eta) * torch.diagonal(K_KK)[:, None]
    quad = 0.5 * torch.dot(v_K, K_KK @ v_K)
    return v_K @ mu_KC - quad, count_C > 0


def domain_balanced_mean(rows_VD: torch.Tensor, domain_V: torch.Tensor, num_domains: int | None = None) -> torch.Tensor:
    """The mean of validation rows giving every domain present equal weight (the official `wt_mean`).

    Row ``i`` of domain ``d`` has weight ``1 / (C_present n_d)``, ``n_d`` the rows of ``d`` and
    ``C_present`` the domains with a row. No host sync.

    Args:
        rows_VD: ``(V, D)`` validation features.
        domain_V: ``(V,)`` their domain ids.
        num_domains: ``C`` (default: the largest id + 1, one host sync).

    Returns:
        ``(D,)`` in the rows' dtype.
    """
    dom_V = domain_V.to(rows_VD.device, torch.long)
    c = int(dom_V.max()) + 1 if num_domains is None else num_domains
    count_C = torch.bincount(dom_V, minlength=c)
    present = (count_C > 0).sum().to(rows_VD.dtype)
    w_V = 1.0 / (count_C.index_select(0, dom_V).to(rows_VD.dtype) * present)
    return (w_V[:, None] * rows_VD).sum(0)


_EXAMPLES = {
    "slack": "{policy: slack, factor: 2}",
    "fractions": "{policy: fractions, weights: {algebra: 2, numbers: 1}} or {policy: fractions, file: mixture.json}",
    "minority_full": "{policy: minority_full, domains: [small_domain]} or {policy: minority_full, max_share: 0.05}",
}

_KEYS = {
    "proportional": (),
    "uniform": (),
    "slack": ("factor",),
    "adaptive": ("beta", "lamb"),
    "fractions": ("weights", "file"),
    "minority_full": ("domains", "max_share", "base"),
}


def _parse_fractions(data: dict[str, Any], where: str, problems: list[str]) -> FractionsPolicy:
    weights, path = data.get("weights"), data.get("file")
    if (weights is None) == (path is None):
        problems.append(f"{where}: policy fractions takes exactly one of `weights` (a mapping) or `file` (a weights file)")
        return FractionsPolicy(weights={}, source=where)
    if path is not None:
        if not isinstance(path, (str, os.PathLike)):
            problems.append(f"{where}.file must be a path, got {path!r}")
            return FractionsPolicy(weights={}, source=where)
        try:
            return FractionsPolicy(file=os.fspath(path), source=f"{where}.file")
        except (ValueError, FileNotFoundError) as e:
            problems.append(str(e))
            return FractionsPolicy(weights={}, source=where)
    if weights == "uniform":
        return FractionsPolicy(weights="uniform", source=where)
    if not isinstance(weights, Mapping) or not weights:
        problems.append(f"{where}.weights must map domain name to a share (or be 'uniform'), got {weights!r}")
        return FractionsPolicy(weights={}, source=where)
    bad = {k: v for k, v in weights.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0}
    if bad or not sum(float(v) for k, v in weights.items() if k not in bad) > 0:
        problems.append(f"{where}.weights must be numbers >= 0 with a positive sum, got {dict(weights)}")
        return FractionsPolicy(weights={}, source=where)
    return FractionsPolicy(weights={str(k): float(v) for k, v in weights.items()}, source=f"{where}.weights")


def _parse_minority(data: dict[str, Any], where: str, problems: list[str]) -> MinorityFullPolicy:
    domains, max_share = data.get("domains"), data.get("max_share")
    if (domains is None) == (max_share is None):
        problems.append(f"{where}: policy minority_full takes exactly one of `domains` (a list) or `max_share`")
    elif domains is not None and (
        isinstance(domains, str) or not isinstance(domains, Sequence) or not all(isinstance(d, str) for d in domains)
    ):
        problems.append(f"{where}.domains must be a list of domain names, got {domains!r}")
        domains = None
    elif max_share is not None and (
        isinstance(max_share, bool) or not isinstance(max_share, (int, float)) or not 0 < max_share < 1
    ):
        problems.append(f"{where}.max_share must be in (0, 1), got {max_share!r}")
        max_share = None
    raw_base = data.get("base", "proportional")
    try:
        base = parse_capacity_policy(raw_base, where=f"{where}.base")
    except ValueError as e:
        problems.append(str(e))
        base = ProportionalPolicy()
    if not isinstance(base, (ProportionalPolicy, FractionsPolicy)):
        problems.append(
            f"{where}.base must be proportional, uniform or fractions (capacities that sum to the budget, so the kept "
            f"domains are filled), got {base.name!r}"
        )
        base = ProportionalPolicy()
    return MinorityFullPolicy(
        domains=list(domains) if domains is not None else None,
        max_share=float(max_share) if max_share is not None else None,
        base=base,
    )
