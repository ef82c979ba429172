"""The one-step check: does a strategy's selected subset lower the loss of examples that never guided it?

From a model and its optimizer state (a checkpoint), for seeded pools, each strategy ("arm") picks a
subset; one SGD step and one step of the run's optimizer are taken on it, and the realized drop of
the mean per-example loss is measured on the guiding (validation) examples and on independent
evaluation examples, against many random subsets drawn with the same per-domain capacities. The
arms' features are also compared with exact full-model gradients (rank correlation of the scores).
`tools/studies/lookahead.py` is the command line; docs/results/study_dm_math.md reports what it measured.

Legend: N pool size, K subset size, C domains, P flattened trainable parameters.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from composer_algos.analysis.experiment_stats import paired_summary
from composer_algos.features import GradFeatureExtractor, per_example_losses, spearman, unwrap_model
from composer_algos.selection import STRATEGIES, compute_capacities, select_random_stratified

log = logging.getLogger(__name__)

__all__ = ["Arm", "LookaheadResult", "run_lookahead", "summarize", "format_summary"]

# Diagnostic arms that select by exact full-model scores instead of features: against the guiding
# gradient (Adam-weighted when the optimizer has state; plain for "oracle_sgd"), or against the
# evaluation set's own gradient ("oracle_eval": cheating, an upper bound on what any selection can do).
ORACLES = {"oracle": "adam", "oracle_sgd": "sgd", "oracle_eval": "eval"}

# The loss-drop figures: (optimizer, evaluation set).
STEPS = ("sgd", "opt")
SETS = ("eval", "guide")


@dataclass(frozen=True)
class Arm:
    """One selection configuration under test.

    Attributes:
        name: label in the report.
        strategy: a `composer_algos.selection.STRATEGIES` name.
        features: `GradFeatureExtractor` keyword arguments.
        options: the strategy's keyword options.
        weighted_loss: train on the refit weights (weighted per-example mean) when the strategy has them.
        guide_size: validation examples guiding the arm (the first this many of the guide set);
            None uses all of it.
    """

    name: str
    strategy: str
    features: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    weighted_loss: bool = False
    guide_size: int | None = None


@dataclass
class LookaheadResult:
    """Per pool and arm: loss drops (before - after; positive is better) and fidelity figures.

    Attributes:
        drops: `drops[arm][(step, set)]` a list over pools of the arm's drop.
        random_drops: `random_drops[(step, set)]` a list over pools of the list of random drops.
        fidelity: `fidelity[arm][key]` a list over pools (`exact_spearman`, `exact_sgd_spearman`,
            `raw_spearman`).
        guide_eval_cosine: `{guide_size: cosine}` of the full guiding and evaluation gradients.
        selected: `selected[arm]` a list over pools of the selected pool positions.
    """

    drops: dict[str, dict[tuple[str, str], list[float]]] = field(default_factory=dict)
    random_drops: dict[tuple[str, str], list[list[float]]] = field(default_factory=dict)
    fidelity: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    guide_eval_cosine: dict[int, float] = field(default_factory=dict)
    selected: dict[str, list[list[int]]] = field(default_factory=dict)


def run_lookahead(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    pools: Sequence[Mapping[str, torch.Tensor]],
    guide: Mapping[str, torch.Tensor],
    evalset: Mapping[str, torch.Tensor],
    arms: Sequence[Arm],
    *,
    kappa: int,
    num_domains: int,
    n_random: int = 20,
    sgd_lr: float = 1e-2,
    seed: int = 0,
    chunk_size: int = 64,
    progress: Callable[[int], None] | None = None,
    steps: Sequence[str] = STEPS,
) -> LookaheadResult:
    """Measure every arm's one-step effect on the given pools (model and optimizer left as found).

    Args:
        model: the causal LM (a transformers model, peft model, or Composer `HuggingFaceModel`).
        optimizer: the run's optimizer with its state (its current learning rate is used, and eta).
        pools: collated batches with `input_ids`, `attention_mask`, `labels`, `domain_id` (N,).
        guide: the validation examples that guide selection (arms use the first `guide_size`).
        evalset: independent evaluation examples, never used to guide.
        arms: the configurations to test.
        kappa: examples trained per step.
        num_domains: C.
        n_random: random subsets per pool, drawn within the same capacities.
        sgd_lr: learning rate of the SGD step.
        seed: base seed of capacities and random draws (pool p uses seed + p).
        chunk_size: examples per forward when evaluating losses.
        progress: called with the pool index after each pool.
        steps: which one-step updates to measure, a subset of `STEPS` ("sgd", "opt"); each costs
            a loss evaluation of the evaluation and guide sets per subset, the bulk of the time on
            long sequences.

    Returns:
        A `LookaheadResult`.
    """
    steps = tuple(steps)
    if not steps or any(s not in STEPS for s in steps):
        raise ValueError(f"steps must be a non-empty subset of {list(STEPS)}, got {list(steps)}")
    hf = unwrap_model(model)
    params = [p for p in hf.parameters() if p.requires_grad]
    theta0 = [p.detach().clone() for p in params]
    opt_state0 = copy.deepcopy(optimizer.state_dict())
    eta = float(optimizer.param_groups[0]["lr"])
    was_training = hf.training
    hf.eval()
    result = LookaheadResult()
    try:
        base = {"eval": _mean_loss(hf, evalset, chunk_size), "guide": _mean_loss(hf, guide, chunk_size)}
        g_eval = _flat_grad(hf, params, evalset, None)
        precond_P = _adam_preconditioner(optimizer, params)
        n_guide = int(guide["input_ids"].shape[0])
        g_guide = _guide_grads(hf, params, guide, arms, n_guide, g_eval, result)
        extractors = {
            a.name: GradFeatureExtractor(hf, seed=seed, **dict(a.features))
            for a in arms
            if a.strategy not in ORACLES
        }
        run = _Run(
            hf=hf, optimizer=optimizer, params=params, theta0=theta0, opt_state0=opt_state0, guide=guide,
            evalset=evalset, steps=steps, base=base, sgd_lr=sgd_lr, chunk_size=chunk_size, kappa=kappa,
            num_domains=num_domains, n_random=n_random, eta=eta, seed=seed, g_eval=g_eval, g_guide=g_guide,
            precond_P=precond_P, n_guide=n_guide, extractors=extractors,
        )
        for p_idx, pool in enumerate(pools):
            _measure_pool(run, arms, p_idx, pool, result)
            if progress is not None:
                progress(p_idx)
    finally:
        _restore(params, theta0, optimizer, opt_state0)
        hf.train(was_training)
    return result


@dataclass(frozen=True)
class _Run:
    """What every pool of `run_lookahead` shares: the model as found, the sets, the settings, the fixed gradients."""

    hf: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]  # the trainable parameters
    theta0: list[torch.Tensor]  # their values as found
    opt_state0: dict  # the optimizer's state as found
    guide: Mapping[str, torch.Tensor]
    evalset: Mapping[str, torch.Tensor]
    steps: tuple[str, ...]
    base: dict[str, float]  # the mean losses of "eval" and "guide" before any step
    sgd_lr: float
    chunk_size: int
    kappa: int
    num_domains: int
    n_random: int
    eta: float
    seed: int
    g_eval: torch.Tensor  # (P,) the evaluation set's gradient
    g_guide: dict[int, torch.Tensor]  # by guide size: (P,) the gradient of the first `size` guiding examples
    precond_P: torch.Tensor | None  # the Adam preconditioner, None when the optimizer has no state yet
    n_guide: int
    extractors: dict[str, GradFeatureExtractor]  # by arm name, for the arms that are not oracles


def _guide_grads(
    hf: nn.Module,
    params: list[torch.Tensor],
    guide: Mapping[str, torch.Tensor],
    arms: Sequence[Arm],
    n_guide: int,
    g_eval: torch.Tensor,
    result: LookaheadResult,
) -> dict[int, torch.Tensor]:
    """By guide size: the gradient of the first `size` guiding examples; their cosines with `g_eval` go to `result`."""
    g_guide = {}
    for size in sorted({a.guide_size or n_guide for a in arms} | {n_guide}):
        g_guide[size] = _flat_grad(hf, params, _rows(guide, torch.arange(size)), None)
        result.guide_eval_cosine[size] = float(
            torch.nn.functional.cosine_similarity(g_guide[size], g_eval, dim=0)
        )
    return g_guide


def _drops(
    run: _Run, grads_NP: torch.Tensor, tokens_N: torch.Tensor, idx_K: torch.Tensor, weights_K: torch.Tensor | None
) -> dict[tuple[str, str], float]:
    """By (step, set): the loss drop of one step on the subset `idx_K`, the model and optimizer restored after."""
    grad_P = _subset_grad(grads_NP, tokens_N, idx_K, weights_K)
    out = {}
    for step in run.steps:
        _apply_step(step, run.params, run.theta0, grad_P, run.optimizer, run.opt_state0, run.sgd_lr)
        for name, rows in (("eval", run.evalset), ("guide", run.guide)):
            out[(step, name)] = run.base[name] - _mean_loss(run.hf, rows, run.chunk_size)
        _restore(run.params, run.theta0, run.optimizer, run.opt_state0)
    return out


def _measure_pool(
    run: _Run, arms: Sequence[Arm], p_idx: int, pool: Mapping[str, torch.Tensor], result: LookaheadResult
) -> None:
    """Append to `result` the drops of the random subsets and of every arm on pool `p_idx`, and the arms' fidelity."""
    gen = torch.Generator().manual_seed(run.seed + p_idx)
    domain_N = pool["domain_id"]
    caps_C = compute_capacities(torch.bincount(domain_N, minlength=run.num_domains), run.kappa, generator=gen)
    # Exact full-model per-example gradients, once per pool: every subset's training gradient
    # is a (token-weighted) mean of these rows, and they give the exact scores.
    grads_NP, tokens_N = _per_example_grads(run.hf, run.params, pool)
    exact = _exact_scores(run, grads_NP)
    rand = []
    for _ in range(run.n_random):
        r = select_random_stratified(
            features=None,
            val_feature=None,
            domain_ids=domain_N,
            num_domains=run.num_domains,
            kappa=run.kappa,
            eta=run.eta,
            generator=gen,
            capacities=caps_C,
        )
        rand.append(_drops(run, grads_NP, tokens_N, r.indices, None))
    for key in rand[0]:
        result.random_drops.setdefault(key, []).append([d[key] for d in rand])
    for arm in arms:
        guide_b = _rows(run.guide, torch.arange(arm.guide_size or run.n_guide))
        idx_K, weights, feats_ND, gbar_D = _select(run, arm, p_idx, pool, guide_b, exact, domain_N, caps_C)
        d = _drops(run, grads_NP, tokens_N, idx_K, weights)
        arm_drops = result.drops.setdefault(arm.name, {})
        for key, value in d.items():
            arm_drops.setdefault(key, []).append(value)
        result.selected.setdefault(arm.name, []).append(idx_K.tolist())
        if feats_ND is not None and gbar_D is not None:
            _record_fidelity(run, arm, pool, guide_b, feats_ND, gbar_D, exact, result)


def _exact_scores(run: _Run, grads_NP: torch.Tensor) -> dict[tuple[str, int], torch.Tensor]:
    """(N,) exact scores by (kind, guide size): kinds "adam", "sgd" and "eval" (see `ORACLES`)."""

    def precond(g_P: torch.Tensor) -> torch.Tensor:
        return g_P * run.precond_P if run.precond_P is not None else g_P

    # Exact scores by kind and guide size: Adam-weighted and plain against the guiding
    # gradient of that size; against the evaluation gradient for oracle_eval.
    exact = {("eval", size): grads_NP @ precond(run.g_eval) for size in run.g_guide}
    for size, g_P in run.g_guide.items():
        exact[("adam", size)] = grads_NP @ precond(g_P)
        exact[("sgd", size)] = grads_NP @ g_P
    return exact


def _select(
    run: _Run,
    arm: Arm,
    p_idx: int,
    pool: Mapping[str, torch.Tensor],
    guide_b: Mapping[str, torch.Tensor],
    exact: Mapping[tuple[str, int], torch.Tensor],
    domain_N: torch.Tensor,
    caps_C: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The arm's subset of the pool: `(idx_K, weights or None, feats_ND, gbar_D)`, the features None when unused."""
    feats_ND = gbar_D = None
    if arm.strategy in ORACLES:
        # Top kappa within the capacities by an exact score (no features): the best a
        # first-order selector guided by that gradient could do.
        idx_K, weights = (
            _top_within(
                exact[(ORACLES[arm.strategy], arm.guide_size or run.n_guide)], domain_N, caps_C
            ),
            None,
        )
    else:
        ex = run.extractors[arm.name]
        spec = STRATEGIES[arm.strategy]
        if spec.needs_features:
            feats_ND, gbar_D = ex.compute(
                pool, guide_b if spec.needs_validation else None, optimizer=run.optimizer
            )
        res = spec.fn(
            features=feats_ND,
            val_feature=gbar_D,
            domain_ids=domain_N,
            num_domains=run.num_domains,
            kappa=run.kappa,
            eta=run.eta,
            generator=torch.Generator().manual_seed(run.seed + p_idx),
            capacities=caps_C if spec.uses_capacities else None,
            **dict(arm.options),
        )
        idx_K = res.indices
        weights = res.weights if (arm.weighted_loss and res.weights is not None) else None
    return idx_K, weights, feats_ND, gbar_D


def _record_fidelity(
    run: _Run,
    arm: Arm,
    pool: Mapping[str, torch.Tensor],
    guide_b: Mapping[str, torch.Tensor],
    feats_ND: torch.Tensor,
    gbar_D: torch.Tensor,
    exact: Mapping[tuple[str, int], torch.Tensor],
    result: LookaheadResult,
) -> None:
    """Append the arm's fidelity figures on this pool to `result.fidelity` (see `LookaheadResult`)."""
    scores = feats_ND.double() @ gbar_D.double()
    fid = result.fidelity.setdefault(arm.name, {})
    fid.setdefault("exact_spearman", []).append(
        spearman(scores, exact[("adam", arm.guide_size or run.n_guide)])
    )
    fid.setdefault("exact_sgd_spearman", []).append(
        spearman(scores, exact[("sgd", arm.guide_size or run.n_guide)])
    )
    ex = run.extractors[arm.name]
    raw = (
        ex.fidelity(pool, guide_b, optimizer=run.optimizer)["score_spearman"]
        if ex.proj_dim
        else 1.0
    )
    fid.setdefault("raw_spearman", []).append(raw)


def summarize(result: LookaheadResult) -> dict[str, Any]:
    """Per arm and (step, set): mean of (arm drop - mean random drop) over pools with a 95% interval,
    the fraction of pools where the arm beats the random median, and the mean random spread (std).

    Args:
        result: from `run_lookahead`.
    """
    out: dict[str, Any] = {"arms": {}, "guide_eval_cosine": result.guide_eval_cosine}
    for arm, drops in result.drops.items():
        row: dict[str, Any] = {}
        for key, values in drops.items():
            rand = result.random_drops[key]
            diffs = [v - sum(r) / len(r) for v, r in zip(values, rand)]
            wins = [v > _median(r) for v, r in zip(values, rand)]
            spread = [paired_summary(r)["std"] for r in rand]
            stats = paired_summary(diffs)
            mean, half = stats["mean"], (stats["ci_high"] - stats["ci_low"]) / 2
            row[f"{key[0]}/{key[1]}"] = {
                "diff_mean": mean,
                "diff_ci95": half,
                "win_fraction": sum(wins) / len(wins),
                "random_spread": sum(spread) / len(spread),
                "pools": len(values),
            }
        for key, values in result.fidelity.get(arm, {}).items():
            finite = [v for v in values if math.isfinite(v)]
            row[key] = sum(finite) / len(finite) if finite else float("nan")
        out["arms"][arm] = row
    return out


def format_summary(summary: Mapping[str, Any]) -> str:
    """The summary as markdown tables (loss drops against random, then fidelity)."""
    lines = [
        "| arm | step/set | arm - random drop (mean ± 95% CI) | wins vs random median | random spread | pools |",
        "|---|---|---|---|---|---|",
    ]
    for arm, row in summary["arms"].items():
        for key in (f"{s}/{e}" for s in STEPS for e in SETS):
            if key in row:
                r = row[key]
                lines.append(
                    f"| {arm} | {key} | {r['diff_mean']:+.3e} ± {r['diff_ci95']:.1e} | {r['win_fraction']:.2f} "
                    f"| {r['random_spread']:.1e} | {r['pools']} |"
                )
    lines += [
        "",
        "| arm | Spearman vs exact (Adam-weighted) | vs exact (SGD) | vs uncompressed |",
        "|---|---|---|---|",
    ]
    for arm, row in summary["arms"].items():
        if "exact_spearman" in row:
            lines.append(
                f"| {arm} | {row['exact_spearman']:.3f} | {row['exact_sgd_spearman']:.3f} | {row['raw_spearman']:.3f} |"
            )
    cos = summary.get("guide_eval_cosine", {})
    if cos:
        lines += [
            "",
            "guiding-vs-evaluation gradient cosine by guide size: "
            + ", ".join(f"{k}: {v:.3f}" for k, v in sorted(cos.items())),
        ]
    return "\n".join(lines)


def _rows(batch: Mapping[str, torch.Tensor], idx_K: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rows `idx_K` of every per-example tensor of a batch."""
    n = int(batch["input_ids"].shape[0])
    idx_K = idx_K.to(batch["input_ids"].device)
    return {
        k: v[idx_K] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n else v for k, v in batch.items()
    }


def _losses(hf: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """(n,) per-example losses (mean over each example's target tokens)."""
    logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return per_example_losses(logits, batch["labels"])


@torch.no_grad()
def _mean_loss(hf: nn.Module, batch: Mapping[str, torch.Tensor], chunk_size: int) -> float:
    n = int(batch["input_ids"].shape[0])
    total = 0.0
    for s in range(0, n, chunk_size):
        total += float(_losses(hf, _rows(batch, torch.arange(s, min(n, s + chunk_size)))).sum())
    return total / n


def _flat_grad(
    hf: nn.Module,
    params: list[torch.Tensor],
    batch: Mapping[str, torch.Tensor],
    weights_K: torch.Tensor | None,
) -> torch.Tensor:
    """(P,) gradient of the training loss on `batch`: the token mean over the batch (what the model's
    own loss trains on), or the weighted mean of per-example losses when `weights_K` is given."""
    with torch.enable_grad():
        if weights_K is None:
            loss = hf(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
            ).loss
        else:
            w_K = weights_K.to(torch.float32)
            loss = (w_K * _losses(hf, batch)).sum() / w_K.sum().clamp_min(1e-12)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat(
        [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)]
    )


def _per_example_grads(
    hf: nn.Module, params: list[torch.Tensor], pool: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, P) gradients of each example's loss (mean over its target tokens) and (N,) its target-token counts."""
    n = int(pool["input_ids"].shape[0])
    rows = [_flat_grad(hf, params, _rows(pool, torch.tensor([i])), None) for i in range(n)]
    tokens_N = (pool["labels"][:, 1:] != -100).sum(dim=1).clamp_min(1).to(torch.float32)
    return torch.stack(rows), tokens_N


def _subset_grad(
    grads_NP: torch.Tensor, tokens_N: torch.Tensor, idx_K: torch.Tensor, weights_K: torch.Tensor | None
) -> torch.Tensor:
    """(P,) the training gradient on the subset: the token mean over its examples (the model's own
    loss), or the weighted mean of per-example losses (`weighted_loss`)."""
    idx_K = idx_K.to(grads_NP.device)
    if weights_K is None:
        w_K = tokens_N[idx_K]
    else:
        w_K = weights_K.to(grads_NP.dtype).to(grads_NP.device)
    return (w_K[:, None] * grads_NP[idx_K]).sum(dim=0) / w_K.sum().clamp_min(1e-12)


def _top_within(scores_N: torch.Tensor, domain_N: torch.Tensor, caps_C: torch.Tensor) -> torch.Tensor:
    """The highest-scoring examples of each domain, `caps_C[c]` of domain c, as sorted pool positions."""
    picks = []
    for c in range(int(caps_C.numel())):
        members = torch.nonzero(domain_N == c).flatten()
        k = int(caps_C[c])
        if k:
            picks.append(members[torch.topk(scores_N[members], k).indices])
    return torch.sort(torch.cat(picks)).values if picks else torch.zeros(0, dtype=torch.long)


def _adam_preconditioner(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> torch.Tensor | None:
    """(P,) `1 / (sqrt(v_hat) + eps)` from the optimizer's state, or None when it has none yet."""
    from composer_algos.features.normalize import optimizer_second_moments

    v_hats = optimizer_second_moments(optimizer, params)
    if v_hats is None:
        return None
    eps = float(optimizer.param_groups[0].get("eps", 1e-8))
    return torch.cat([(v.sqrt() + eps).reciprocal().reshape(-1) for v in v_hats])


def _apply_step(step, params, theta0, grad_P, optimizer, opt_state0, sgd_lr) -> None:
    """Move the parameters by one SGD step (`sgd`) or one step of the run's optimizer (`opt`)."""
    offset = 0
    with torch.no_grad():
        for p, p0 in zip(params, theta0):
            g = grad_P[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if step == "sgd":
                p.copy_(p0 - sgd_lr * g)
            else:
                p.grad = g.clone()
    if step == "opt":
        optimizer.step()
        for p in params:
            p.grad = None


def _restore(params, theta0, optimizer, opt_state0) -> None:
    with torch.no_grad():
        for p, p0 in zip(params, theta0):
            p.copy_(p0)
            p.grad = None
    # load_state_dict may alias the given tensors: hand it a copy so the next step cannot alter the snapshot.
    optimizer.load_state_dict(copy.deepcopy(opt_state0))


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])
