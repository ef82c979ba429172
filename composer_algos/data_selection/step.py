"""One selection step as four stages: assemble the problem, solve it, redistribute the picks, record them.

`DataSelection` (composer_algos/data_selection/algorithm.py) runs them in order at `AFTER_DATALOADER`;
each is a function of tensors, numbers and Composer's `dist`, so each is unit-tested alone
(tests/training/test_selection_stages.py, with ranks as threads).

Legend: N = pool size on this rank, P = pool size over all ranks (global scope; P = N otherwise),
K = examples selected, C = domains, D = feature dimension, W = world size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from composer.utils import dist

from composer_algos.data_selection.exchange import exchange_examples, gather_rows, plan_rebalance

__all__ = [
    "SelectionProblem",
    "SolveOutcome",
    "assemble_problem",
    "broadcast_selection",
    "solve_problem",
    "settle_on_host",
    "redistribute",
    "record_step",
    "selection_metrics",
]

# Used when the strategy fails (bad features, a broken solve): uniform within the capacities.
FALLBACK_STRATEGY = "random_stratified"


@dataclass
class SelectionProblem:
    """What the solver sees: this rank's pool (local scope) or every rank's (global scope).

    Attributes:
        domain_P: (P,) domain id of each candidate.
        kappa: examples to select: this rank's budget, or under global scope the budget of all
            ranks together (a multiple of W, so every rank trains an equal share).
        features_PD: (P, D) gradient features, None when the strategy needs none or the step falls back.
        gbar_D: (D,) validation feature (averaged over ranks under global scope; after the running
            average when one is configured), or None.
        fallback: why this step selects at random within capacities, or None.
        owner_P, local_P: global scope only: the rank holding each candidate and its row there.
        world: W when gathered, else 1.
        val_rows_VD, val_domain_V: the validation rows' features and domain ids (gathered from every
            rank under global scope), when the step needs them (a domain-balanced target, the
            adaptive capacities, facloc, uniprot); else None.
    """

    domain_P: torch.Tensor
    kappa: int
    features_PD: torch.Tensor | None = None
    gbar_D: torch.Tensor | None = None
    fallback: str | None = None
    owner_P: torch.Tensor | None = None
    local_P: torch.Tensor | None = None
    world: int = 1
    val_rows_VD: torch.Tensor | None = None
    val_domain_V: torch.Tensor | None = None

    @property
    def gathered(self) -> bool:
        return self.owner_P is not None


@dataclass
class SolveOutcome:
    """The solver's result, the strategy that produced it and why it fell back (None when it did not)."""

    result: Any  # composer_algos.selection.SelectionResult
    strategy: str
    fallback: str | None
    capacities: torch.Tensor | None = None  # (C,) the capacities the strategy ran with, or None


def assemble_problem(
    domain_N: torch.Tensor,
    *,
    kappa_rank: int,
    gather: bool,
    needs_features: bool = False,
    features_ND: torch.Tensor | None = None,
    gbar_D: torch.Tensor | None = None,
    n_val: int = 1,
    fallback: str | None = None,
    average_gbar: Callable[[torch.Tensor], torch.Tensor] | None = None,
    val_rows_VD: torch.Tensor | None = None,
    val_domain_V: torch.Tensor | None = None,
    balance_domains: bool = False,
    num_domains: int | None = None,
) -> SelectionProblem:
    """Build the selection problem of this step, from this rank's pool or, with `gather`, from every rank's.

    Locally the problem keeps `domain_N` where it is (the loader's batch: the host), so the
    capacities and the domain bookkeeping cost no sync; the strategies move a copy to the features'
    device. Under `gather` the ranks all-gather their domain ids, features and validation features (the
    pools may differ in size); every rank then holds the same problem. If any rank's features
    failed, every rank falls back. The budget is `min(kappa_rank, P // W) * W`: an uneven
    end-of-epoch pool lowers the budget (the strategy chooses among every candidate) rather than
    trimming picks. Locally the budget is `min(kappa_rank, N)`.

    Args:
        domain_N: (N,) domain ids of this rank's pool.
        kappa_rank: examples each rank trains on.
        gather: assemble the global problem (needs a world size above 1 to differ from local).
        needs_features: the strategy computed features this step (a failed rank makes all fall back).
        features_ND, gbar_D: this rank's features and validation feature (None when absent).
        n_val: validation examples behind this rank's `gbar_D` (the ranks' features are averaged
            with these weights).
        fallback: this rank's reason to fall back, or None.
        average_gbar: applied to the (gathered) validation feature, e.g. `ValidationAverage.update`;
            under `gather` every rank applies it to the same vector, so all hold one state.
        val_rows_VD, val_domain_V: this rank's validation rows and their domain ids, kept in the
            problem (all-gathered under `gather`, in rank order) when given.
        balance_domains: replace the validation feature by the domain-balanced mean of the
            (gathered) rows (`capacity_policy.domain_balanced_mean`: every domain present weighted
            equally), before `average_gbar`; needs the rows.
        num_domains: C, for `balance_domains` (default: from the rows' ids).

    Returns:
        The `SelectionProblem`; its features and gbar are None when the step falls back.
    """
    device = features_ND.device if features_ND is not None else domain_N.device
    n = int(domain_N.shape[0])
    world = dist.get_world_size() if gather else 1
    if world > 1:
        domain_N = domain_N.to(device, non_blocking=True)  # collectives need it on the device
    if world <= 1:
        problem = SelectionProblem(domain_N, min(kappa_rank, n), features_ND, gbar_D, fallback)
    else:
        problem, val_rows_VD, val_domain_V = _gathered_problem(
            domain_N, kappa_rank, world, device, needs_features, features_ND, gbar_D, n_val, fallback,
            val_rows_VD, val_domain_V, balance_domains,
        )
    if problem.fallback is None and val_rows_VD is not None and val_domain_V is not None:
        problem.val_rows_VD = val_rows_VD
        problem.val_domain_V = val_domain_V.to(val_rows_VD.device, non_blocking=True)
        if balance_domains and problem.gbar_D is not None:
            from composer_algos.data_selection.capacity_policy import domain_balanced_mean

            balanced = domain_balanced_mean(val_rows_VD, problem.val_domain_V, num_domains)
            problem.gbar_D = balanced.to(problem.gbar_D.dtype)
    if problem.fallback is not None:
        problem.features_PD, problem.gbar_D = None, None
    elif problem.gbar_D is not None and average_gbar is not None:
        problem.gbar_D = average_gbar(problem.gbar_D)
    return problem


def _gathered_problem(
    domain_N: torch.Tensor,
    kappa_rank: int,
    world: int,
    device: torch.device,
    needs_features: bool,
    features_ND: torch.Tensor | None,
    gbar_D: torch.Tensor | None,
    n_val: int,
    fallback: str | None,
    val_rows_VD: torch.Tensor | None,
    val_domain_V: torch.Tensor | None,
    balance_domains: bool,
) -> tuple[SelectionProblem, torch.Tensor | None, torch.Tensor | None]:
    """`assemble_problem` under global scope: every rank's pool in one problem, and the gathered validation rows."""
    n = int(domain_N.shape[0])
    sizes_W = torch.cat(dist.all_gather(torch.tensor([n], device=device)))
    n_max = int(sizes_W.max())
    valid_P = (torch.arange(n_max, device=device)[None, :] < sizes_W[:, None]).flatten()
    owner_P = torch.arange(world, device=device).repeat_interleave(n_max)[valid_P]
    local_P = torch.arange(n_max, device=device).repeat(world)[valid_P]
    domain_P = gather_rows(domain_N, n_max)[valid_P]
    feats_PD = None
    if needs_features:
        # Every rank decides the same fallback: fall back if any rank failed.
        flag = torch.tensor([0 if fallback is None else 1], device=device)
        dist.all_reduce(flag, reduce_operation="MAX")
        if int(flag) and fallback is None:
            fallback = "the gradient features failed on another rank"
        if fallback is None:
            assert features_ND is not None
            feats_PD = gather_rows(features_ND, n_max)[valid_P]
            if val_rows_VD is not None and val_domain_V is not None:
                val_rows_VD, val_domain_V = _gather_validation_rows(val_rows_VD, val_domain_V, device)
            if gbar_D is not None and not (balance_domains and val_rows_VD is not None):
                # One gather of (n_val * gbar, n_val): the mean over every rank's validation examples.
                packed = torch.cat([gbar_D * float(n_val), gbar_D.new_tensor([float(n_val)])])
                summed = torch.stack(dist.all_gather(packed)).sum(0)
                gbar_D = summed[:-1] / summed[-1]
    kappa = min(kappa_rank, int(sizes_W.sum()) // world) * world
    problem = SelectionProblem(domain_P, kappa, feats_PD, gbar_D, fallback, owner_P, local_P, world)
    return problem, val_rows_VD, val_domain_V


def solve_problem(
    problem: SelectionProblem,
    strategy: str,
    *,
    eta: float,
    seed: int,
    num_domains: int,
    options: Mapping[str, Any] | None = None,
    fractions: list[float] | None = None,
    capacity_fn: Callable[[torch.Tensor, int, torch.Generator], torch.Tensor] | None = None,
    deferred: Any = None,
) -> SolveOutcome:
    """Run `strategy` on the problem; fall back to random selection within capacities when it breaks.

    Capacities (for strategies that use them) are drawn with the step's generator, seeded by
    `seed`, so every rank solving the same problem draws the same ones. A numerically broken solve
    (a `SelectionNumericsError`, a failed factorisation, a non-finite objective or weights) falls
    back; under global scope a failure on one rank makes every rank fall back. Invalid `options`
    raise. Under global scope rank 0's result is then broadcast (`broadcast_selection`), so every
    rank holds the same selection whether or not the replicated solves agree bit for bit.

    Args:
        problem: from `assemble_problem`.
        strategy: registry name of the strategy to run.
        eta: the optimizer's current learning rate.
        seed: seed of the step's generator.
        num_domains: C.
        options: the strategy's own options (dropped when falling back).
        fractions: fixed per-domain shares of the budget (default: proportional to the pool).
        capacity_fn: instead of `fractions`, the capacity policy: `(pool_counts_C, k, generator) ->
            capacities_C` (`CapacityPolicy.capacities`; with `slack`, upper bounds summing above k).
        deferred: a `selection.DeferredChecks` (local scope only): the strategy's checks of device
            values (finite features, objective, weights) are recorded there instead of read on the
            host, and the result stays where the strategy left it. `settle_on_host` then judges
            them in the step's one transfer and falls back there. None: judged here.

    Returns:
        A `SolveOutcome` (result, the strategy that produced it, the fallback reason or None).
    """
    from composer_algos.selection import deferring_checks, get_strategy

    fallback = problem.fallback
    if fallback is not None:
        strategy, options = FALLBACK_STRATEGY, None
    spec = get_strategy(strategy)  # a built-in or one another package adds (entry points)
    features = problem.features_PD if spec.needs_features else None
    gbar = problem.gbar_D if spec.needs_validation else None
    gen, caps_C = _step_generator(spec, problem, num_domains, seed, fractions, capacity_fn)
    if deferred is not None and not problem.gathered:
        with deferring_checks(deferred):
            result, error = _run_strategy(spec, strategy, problem, features, gbar, num_domains, eta, gen, options, caps_C)
        if error is None:
            return SolveOutcome(result, strategy, fallback, caps_C)
    else:
        result, error = _run_strategy(spec, strategy, problem, features, gbar, num_domains, eta, gen, options, caps_C)
    if problem.gathered and spec.needs_features:
        # Ranks solve the same problem; still, a failure on one must not leave the others diverged.
        flag = torch.tensor([0 if error is None else 1], device=problem.domain_P.device)
        dist.all_reduce(flag, reduce_operation="MAX")
        if int(flag) and error is None:
            error = "the solver failed on another rank"
    if error is not None:
        fallback, strategy = error, FALLBACK_STRATEGY
        spec = get_strategy(strategy)
        gen, caps_C = _step_generator(spec, problem, num_domains, seed, fractions, capacity_fn)
        result, _ = _run_strategy(spec, strategy, problem, None, None, num_domains, eta, gen, None, caps_C)
    if problem.gathered:
        result = broadcast_selection(result, problem.domain_P, num_domains)
    return SolveOutcome(result, strategy, fallback, caps_C)


def broadcast_selection(result: Any, domain_P: torch.Tensor, num_domains: int) -> Any:
    """Rank 0's selection on every rank: its indices, weights and objective, in one broadcast.

    Under global scope every rank solves the same gathered problem, but bit-identical solves are
    not guaranteed (different GPUs, nondeterministic kernels, a reduction order that differs): one
    pick apart and the ranks would exchange examples by different plans. Broadcasting rank 0's
    result makes the selection identical by construction. Every rank ran the same strategy (the
    fallback decision is agreed before), so the number of picks and the presence of weights match;
    the packet is float64, exact for indices below 2^53 and for float32/float64 weights.

    Args:
        result: this rank's `SelectionResult` (indices (K,), optional weights (K,) and objective).
        domain_P: (P,) domain ids of the gathered pool (the domain counts are recomputed from them).
        num_domains: C.

    Returns:
        A `SelectionResult` equal to rank 0's on every rank (this rank's `info` is kept).
    """
    k = int(result.indices.numel())
    device = domain_P.device
    has_weights = result.weights is not None
    packet = torch.zeros(2 + k * (2 if has_weights else 1), dtype=torch.float64, device=device)
    packet[0] = float(result.objective) if result.objective is not None else float("nan")
    packet[1] = 1.0 if result.objective is not None else 0.0
    packet[2 : 2 + k] = result.indices.to(device=device, dtype=torch.float64)
    if has_weights:
        packet[2 + k :] = result.weights.to(device=device, dtype=torch.float64)
    dist.broadcast(packet, src=0)
    indices_K = packet[2 : 2 + k].to(dtype=result.indices.dtype, device=result.indices.device)
    weights_K = None
    if has_weights:
        weights_K = packet[2 + k :].to(dtype=result.weights.dtype, device=result.weights.device)
    objective = None
    if result.objective is not None and bool(packet[1]):
        objective = packet[0].to(dtype=result.objective.dtype, device=result.objective.device)
    counts_C = torch.bincount(domain_P[indices_K.to(device)], minlength=num_domains)
    return dataclasses.replace(
        result,
        indices=indices_K,
        weights=weights_K,
        objective=objective,
        domain_counts=counts_C.to(result.domain_counts.device, result.domain_counts.dtype),
    )


def settle_on_host(
    outcome: SolveOutcome,
    problem: SelectionProblem,
    checks: Mapping[str, Any],
    *,
    num_domains: int,
    seed: int,
    fractions: list[float] | None = None,
    capacity_fn: Callable[[torch.Tensor, int, torch.Generator], torch.Tensor] | None = None,
    extras: Mapping[str, torch.Tensor] | None = None,
) -> tuple[SolveOutcome, dict[str, float], dict[str, str]]:
    """The step's one host sync: the selection, its numbers and every deferred check, in one transfer.

    Everything the host needs from the device after a local solve (the selected indices, weights,
    objective and counters, the deferred checks of the features and of the strategy, and the
    `extras` the step logs) is concatenated as float64 and copied once (`selection.types.host_values`:
    a few ops for all of it, none per field). The checks are then judged
    in the order of `checks`; the first that fails makes the step fall back to `random_stratified`
    within the capacities, computed on the host from the step's seed (as `solve_problem` would), so
    the fallback costs no further sync. Values already on the host are read where they are.

    Args:
        outcome: `solve_problem(..., deferred=...)`'s outcome (its result may live on the device).
        problem: the step's problem (local scope: its domain ids on the host).
        checks: name -> `DeferredChecks`, judged in order; a failure's message becomes the fallback
            reason, prefixed by the name (e.g. `{"unusable gradient features": ..., "partitionsel
            failed numerically": ...}`).
        num_domains, seed, fractions, capacity_fn: as `solve_problem` (for the fallback).
        extras: name -> 0-dim tensor to read with the rest (e.g. the conflict fraction).

    Returns:
        `(outcome with a host result, extras as floats, failed checks: name -> message)`; the host
        result's tensor `info` entries are Python numbers there. `extras` is empty after a fallback,
        and so is the failed-checks mapping when every check passed.
    """
    from composer_algos.selection import get_strategy
    from composer_algos.selection.types import host_values

    result = outcome.result
    host_domains = problem.domain_P if problem.domain_P.device.type == "cpu" else None
    fields: list[tuple[str, torch.Tensor]] = [("indices", result.indices)]
    if host_domains is None:  # a gathered pool's ids live on the device: its counts travel too
        fields.append(("domain_counts", result.domain_counts))
    if result.weights is not None:
        fields.append(("weights", result.weights))
    if result.objective is not None:
        fields.append(("objective", result.objective))
    fields += [(f"info:{k}", v) for k, v in result.info.items() if isinstance(v, torch.Tensor)]
    fields += [(f"extra:{k}", v) for k, v in (extras or {}).items()]
    for name, c in checks.items():
        fields += [(f"check:{name}:{i}", part) for i, part in enumerate(c.packed())]
    values = dict(zip((name for name, _ in fields), host_values([t for _, t in fields])))
    failed = _judge(checks, values)
    extra_values = {k[len("extra:"):]: v[0] for k, v in values.items() if k.startswith("extra:")}
    if failed:
        name, message = next(iter(failed.items()))
        fallback = outcome.fallback or f"{name} ({message})"
        spec = get_strategy(FALLBACK_STRATEGY)
        gen, caps_C = _step_generator(spec, problem, num_domains, seed, fractions, capacity_fn)
        fallback_result, _ = _run_strategy(spec, FALLBACK_STRATEGY, problem, None, None, num_domains, 0.0, gen, None, caps_C)
        return SolveOutcome(fallback_result, FALLBACK_STRATEGY, fallback, caps_C), {}, failed
    host_result = _host_result(result, values, host_domains, num_domains)
    caps = outcome.capacities.cpu() if outcome.capacities is not None else None
    return SolveOutcome(host_result, outcome.strategy, outcome.fallback, caps), extra_values, {}


def _judge(checks: Mapping[str, Any], values: Mapping[str, list[float]]) -> dict[str, str]:
    """The deferred checks judged in order from the fetched values: the first failure's name -> message."""
    from composer_algos.features import FeatureError
    from composer_algos.selection import SelectionNumericsError

    for name, c in checks.items():
        try:
            c.judge([v for i in range(len(c.packed())) for v in values[f"check:{name}:{i}"]])
        except (FeatureError, SelectionNumericsError) as e:
            return {name: str(e)}
    return {}


def _host_result(
    result: Any, values: Mapping[str, list[float]], host_domains: torch.Tensor | None, num_domains: int
) -> Any:
    """The selection rebuilt on the host from the fetched values, in the device result's dtypes; counts from host ids.

    The tensor-valued `info` entries (0-dim) become Python numbers (int, bool or float after their
    dtype): read on the host once, they cost nothing to log.
    """
    from composer_algos.selection import SelectionResult

    indices = torch.tensor(values["indices"], dtype=torch.long)
    counts_C = (
        torch.bincount(host_domains[indices], minlength=num_domains)
        if host_domains is not None
        else torch.tensor(values["domain_counts"], dtype=torch.long)
    )
    info = {k: v for k, v in result.info.items() if not isinstance(v, torch.Tensor)}  # host numbers as they are
    for key, value in result.info.items():
        if isinstance(value, torch.Tensor):
            info[key] = _host_number(values[f"info:{key}"], value)
    weights, objective = result.weights, result.objective
    return SelectionResult(
        indices=indices,
        domain_counts=counts_C,
        weights=torch.tensor(values["weights"], dtype=weights.dtype) if weights is not None else None,
        objective=torch.tensor(values["objective"][0], dtype=objective.dtype) if objective is not None else None,
        info=info,
    )


def _host_number(read: list[float], like: torch.Tensor) -> Any:
    """A fetched `info` value: a Python number of `like`'s kind when 0-dim, else a host tensor of its dtype and shape."""
    if like.dim() > 0:
        return torch.tensor(read, dtype=like.dtype).reshape(like.shape)
    if like.dtype == torch.bool:
        return bool(read[0])
    if like.is_floating_point():
        return read[0]
    return int(read[0])


def redistribute(
    batch: Mapping[str, Any],
    problem: SelectionProblem,
    result: Any,
    *,
    domain_key: str = "domain_id",
    weighted_loss: bool = False,
) -> dict[str, Any]:
    """This rank's training batch: the selected rows of its pool, or under global scope its share.

    Locally, every per-example field (first dimension N, tensors and lists) is subset together.
    Under global scope the picks are rebalanced so each rank trains `kappa / W` (examples stay
    where they are while their rank has room; only the overflow moves, `exchange_examples`).
    With `weighted_loss`, a `loss_weight` field carries each example's refit weight divided by
    the mean weight over the selected examples of ALL ranks (see `loss_weights`).

    Args:
        batch: this rank's pool.
        problem: the step's problem.
        result: the solver's `SelectionResult` (indices into the problem's rows, optional weights).
        domain_key: the batch field holding domain ids (sizes the pool).
        weighted_loss: add `loss_weight`.

    Returns:
        The new batch.
    """
    n = int(batch[domain_key].shape[0])
    sel_K = result.indices
    weights_K = result.weights
    if problem.gathered:
        assert problem.owner_P is not None and problem.local_P is not None
        world, rank = problem.world, dist.get_global_rank()
        owner_K, lidx_K = problem.owner_P[sel_K], problem.local_P[sel_K]
        target_K = plan_rebalance(owner_K, world, problem.kappa // world)
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
        new_batch = subset_batch(batch, sel_K.to(batch[domain_key].device), n)
    if weighted_loss:
        loss_weight_K = loss_weights(
            weights_K,
            result.weights,
            gathered=problem.gathered,
            n_trained=int(new_batch[domain_key].shape[0]),
            device=problem.domain_P.device,
        )
        if loss_weight_K is not None:
            new_batch["loss_weight"] = loss_weight_K
    return new_batch


def loss_weights(
    weights_K: torch.Tensor | None,
    all_weights: torch.Tensor | None,
    *,
    gathered: bool,
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
    if gathered:
        if all_weights is None:
            return None
        total = float(all_weights.detach().double().sum())
        count = float(all_weights.numel())
    else:
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        if weights_K is not None:
            sums[0], sums[1] = weights_K.detach().double().sum(), float(weights_K.numel())
        if dist.get_world_size() > 1:
            dist.all_reduce(sums, reduce_operation="SUM")
        total, count = sums.tolist()
    mean = total / count if count > 0 else 0.0
    if not (mean > 0 and math.isfinite(mean)):
        return None
    if weights_K is None:
        return torch.ones(n_trained, dtype=torch.float32)
    return (weights_K.detach().double().cpu() / mean).to(torch.float32)


def selection_metrics(
    result: Any,
    *,
    features_PD: torch.Tensor | None,
    new_batch: Mapping[str, Any],
    domain_key: str,
    fallback: bool,
    fallbacks_total: int,
    times_s: tuple[float, float, float],
    conflicts: float | None = None,
) -> dict[str, float]:
    """The step's `selection/*` metrics (see docs/data_selection.md, Logged metrics).

    `conflicts`: the conflict fraction of the selection when the caller read it already (the
    step reads it in its one transfer); otherwise it is computed from `features_PD` here.
    """
    from composer_algos.selection import conflict_fraction

    mask = new_batch.get("attention_mask")
    metrics: dict[str, float] = {
        "selection/time_features_s": times_s[0],
        "selection/time_solve_s": times_s[1],
        "selection/time_exchange_s": times_s[2],
        "selection/kept_samples": float(new_batch[domain_key].shape[0]),
        "selection/kept_tokens": float(mask.sum()) if isinstance(mask, torch.Tensor) else 0.0,
        "selection/fallback": float(fallback),
        "selection/fallbacks_total": float(fallbacks_total),
    }
    # The scale-free objective: Phi = eta * f(S) for the weighted strategies (solved in v = eta * w,
    # so it does not blow up as 1/eta during warm-up); the strategy's own score otherwise.
    objective = result.info.get("objective_scaled", result.objective)
    if objective is not None:
        metrics["selection/objective"] = float(objective)
    for key in ("singular_pivots", "ridge_share"):
        if key in result.info:
            metrics[f"selection/{key}"] = float(result.info[key])
    metrics["selection/selected_hash"] = float(selection_hash(result.indices))
    if conflicts is not None:
        metrics["selection/conflict_fraction"] = float(conflicts)
    elif features_PD is not None and result.indices.numel() > 1:
        metrics["selection/conflict_fraction"] = float(conflict_fraction(features_PD, result.indices))
    return metrics


def selection_hash(indices_K: torch.Tensor) -> int:
    """A 24-bit digest of the selected pool positions (exact in float32 loggers), to compare runs and ranks.

    The bytes hashed are the sorted positions in the indices' own integer dtype (sorted on the host, in NumPy).
    """
    positions = np.sort(indices_K.cpu().numpy())  # integer positions: never part of a graph
    digest = hashlib.sha1(positions.tobytes()).digest()
    return int.from_bytes(digest[:3], "little")


def record_step(
    logger: Any,
    *,
    method: str,
    strategy: str,
    pool_counts_C: torch.Tensor,
    metrics: Mapping[str, float] | None = None,
    pool_sample_ids_N: torch.Tensor | None = None,
    capacities_C: torch.Tensor | None = None,
    capacities_shared: bool = False,
) -> None:
    """Log the step through Composer's logger: numbers as metrics, the rest as traces.

    Metrics: `selection/*` (see `selection_metrics`). Traces (`Logger.log_traces`, which the
    console and file loggers print only with `log_traces=True`): `selection/method` (the configured
    strategy), `selection/strategy` (the one that ran this step: `random` outside the selection
    window, `random_stratified` after a fallback), `selection/pool_counts` ((C,) this rank's pool
    per domain) and `selection/pool_sample_ids` ((N,) the pool's dataset indices, when the batch
    has `sample_id`). With `capacities_C` (the step's per-domain capacities, or with `slack` upper
    bounds): `selection/capacities` and `selection/capacities_shared` (true under global scope,
    where they are those of the gathered problem, the same on every rank; false when each rank has
    its own). `MixtureMonitor` turns them into `data/pool/*`, `data/capacity/*`,
    `data/capacity_used/*`, `selection_log.csv`, `capacity_steps.csv` and `selected_ids.jsonl`.
    """
    if metrics:
        logger.log_metrics(dict(metrics))
    traces: dict[str, Any] = {
        "selection/method": method,
        "selection/strategy": strategy,
        "selection/pool_counts": _on_host(pool_counts_C),
    }
    if pool_sample_ids_N is not None:
        traces["selection/pool_sample_ids"] = _on_host(pool_sample_ids_N)
    if capacities_C is not None:
        traces["selection/capacities"] = _on_host(capacities_C)
        traces["selection/capacities_shared"] = bool(capacities_shared)
    logger.log_traces(traces)


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host, detached (a host tensor outside autograd as it is: no op)."""
    return (t.detach() if t.requires_grad else t).cpu()


def subset_batch(batch: Mapping[str, Any], idx: torch.Tensor, n: int) -> dict[str, Any]:
    """Rows `idx` of every per-example field (first dimension `n`); other fields unchanged."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n:
            out[key] = value[idx]
        elif isinstance(value, (list, tuple)) and len(value) == n:
            out[key] = [value[i] for i in idx.tolist()]
        else:
            out[key] = value
    return out


def _gather_validation_rows(
    rows_VD: torch.Tensor, domain_V: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's validation rows and domain ids, in rank order (the ranks' batches may differ in size)."""
    n_val = int(rows_VD.shape[0])
    sizes_W = torch.cat(dist.all_gather(torch.tensor([n_val], device=device)))
    v_max = int(sizes_W.max())
    valid = (torch.arange(v_max, device=device)[None, :] < sizes_W[:, None]).flatten()
    rows = gather_rows(rows_VD.to(device), v_max)[valid]
    domains = gather_rows(domain_V.to(device=device, dtype=torch.long), v_max)[valid]
    return rows, domains


def _step_generator(spec, problem, num_domains, seed, fractions, capacity_fn):
    """The step's generator and, for a strategy that uses them, the (C,) capacities drawn from it first.

    The capacities are the policy's `capacity_fn`, else `compute_capacities` with `fractions`.
    """
    from composer_algos.selection import compute_capacities, count_domains

    gen = torch.Generator().manual_seed(seed)
    if not spec.uses_capacities:
        return gen, None
    # On the host (free there; the capacities are host arithmetic): a gathered pool's ids live on
    # the device, and moving their counts is that case's one extra sync.
    ids_P = problem.domain_P
    on_host = ids_P.device.type == "cpu" and not problem.gathered
    counts_C = torch.bincount(ids_P, minlength=num_domains) if on_host else count_domains(ids_P, num_domains).cpu()
    if counts_C.shape[0] != num_domains:
        raise ValueError(f"the pool holds domain ids >= num_domains={num_domains} (counts {counts_C.tolist()})")
    if capacity_fn is not None:
        return gen, capacity_fn(counts_C, min(problem.kappa, int(problem.domain_P.shape[0])), gen)
    return gen, compute_capacities(counts_C, problem.kappa, fractions, generator=gen)


def _run_strategy(spec, strategy, problem, features, gbar, num_domains, eta, gen, options, capacities):
    """`(result, None)`, or `(None, reason)` when the problem is numerically broken.

    Inside a `deferring_checks` block the finiteness checks are recorded, not judged: a broken
    problem then shows when the block's owner judges them (`settle_on_host`).
    """
    from composer_algos.selection import SelectionNumericsError, check_or_defer

    extra: dict[str, Any] = {}
    if getattr(spec, "needs_validation_rows", False):
        extra["val_rows"] = problem.val_rows_VD if features is not None else None
    try:
        result = spec.fn(
            features=features,
            val_feature=gbar,
            domain_ids=problem.domain_P,
            num_domains=num_domains,
            kappa=problem.kappa,
            eta=eta,
            generator=gen,
            capacities=capacities,
            **extra,
            **dict(options or {}),
        )
        if result.objective is not None:
            check_or_defer(result.objective, partial(_judge_objective, strategy))
        if result.weights is not None:
            # One reduction: the largest |weight| is finite exactly when every weight is (a NaN propagates).
            check_or_defer(torch.linalg.vector_norm(result.weights, float("inf")), partial(_judge_weights, strategy))
    except (SelectionNumericsError, torch.linalg.LinAlgError) as e:
        return None, f"{strategy} failed numerically ({e})"
    return result, None


def _judge_objective(strategy: str, values: list[float]) -> None:
    from composer_algos.selection import SelectionNumericsError

    if not all(math.isfinite(v) for v in values):
        raise SelectionNumericsError(f"{strategy} returned a non-finite objective ({values[0] if values else None})")


def _judge_weights(strategy: str, values: list[float]) -> None:
    from composer_algos.selection import SelectionNumericsError

    if not all(math.isfinite(v) for v in values):
        raise SelectionNumericsError(f"{strategy} returned non-finite weights")
