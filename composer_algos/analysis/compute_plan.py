"""Equal-compute planning: steps per run from measured step costs, and the FLOPs a run spent.

Comparing data-selection strategies at equal compute (Kaddour et al. 2023, "No Train No Gain")
means giving each run the number of steps its budget buys and laying its learning-rate schedule
over exactly those steps, so every run ends decayed. `plan_steps` turns per-step costs (seconds
of training per step, measured by a short calibration run or given) and a budget into steps;
`tools/run_experiment.py --compute-budget` runs the plan with `max_duration` = the run's own steps.

`estimate_run_flops` estimates what a finished run computed, from the counts `TrainTimeBudget`
records (`train_budget.json`), the steps that scored a pool (`selection_log.csv`) and the run's
`config.yaml`. Conventions (those of `tools/bench/bench_step.py`): forward FLOPs per token of a
Llama-style model at sequence width S are

    2 (L (P_attn + P_mlp) + h V) + 4 L S h_attn

(matmul weights twice, the attention scores and their product with V over the full S x S square;
embeddings, norms and softmax not counted); a training step is `training_forwards` forwards of its
trained rows at their padded width (3 for full training: the forward, the input and the weight
gradients; fewer with LoRA, whose frozen weights get no gradient); a scoring step of a feature strategy costs, per scored
row at the scored width, the feature pass's floor (`scoring_forwards`: the whole forward, the
lm_head's input gradient, and for each target block its input gradient and the per-example
products), over the pool and, for validation-guided strategies, the validation batch (at the
pool's width). The sketch, the solver, the optimizer step and evaluation are not counted.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ComputeBudget",
    "CostModel",
    "StepSamples",
    "StepWork",
    "cost_spread",
    "fit_cost_model",
    "sensitivity_counts",
    "step_work",
    "estimate_run_flops",
    "forward_flops_per_token",
    "parse_compute_budget",
    "parse_step_costs",
    "plan_steps",
    "scoring_forwards",
    "training_forwards",
]

# DataSelection's validation batch size when `validation.batch_size` is not given.
VALIDATION_BATCH = 4

# The model dimensions a FLOP estimate needs (a transformers config's names).
SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "head_dim",
)


@dataclass(frozen=True)
class ComputeBudget:
    """Training seconds per run, given directly or as `steps` steps of the `reference` run.

    Attributes:
        seconds: The budget in seconds of training (evaluation excluded), or None.
        reference: The label whose `steps` steps define the budget (e.g. `random`), or None.
        steps: The reference's steps.
    """

    seconds: float | None = None
    reference: str | None = None
    steps: int | None = None

    def describe(self, unit: str = "s") -> str:
        """In words; `unit` names the clock of the seconds (`s`, `CPU s`)."""
        if self.reference is not None:
            return f"the cost of {self.steps} steps of {self.reference}"
        return f"{self.seconds:g} {unit} of training"


def parse_compute_budget(text: str) -> ComputeBudget:
    """`LABEL=N` (the cost of N steps of LABEL) or `S` / `Ss` (S seconds of training).

    Raises:
        ValueError: anything else, a non-positive value, or N not an integer, naming the text.
    """
    raw = text.strip()
    allowed = "expected LABEL=STEPS (e.g. random=200) or SECONDS (e.g. 300 or 300s)"
    if "=" in raw:
        label, steps = (p.strip() for p in raw.split("=", 1))
        try:
            n = int(steps)
        except ValueError:
            raise ValueError(f"--compute-budget {text!r}: {steps!r} is not an integer number of steps; {allowed}") from None
        if not label or n < 1:
            raise ValueError(f"--compute-budget {text!r}: {allowed}, with STEPS >= 1")
        return ComputeBudget(reference=label, steps=n)
    try:
        seconds = float(raw.removesuffix("s"))
    except ValueError:
        raise ValueError(f"--compute-budget {text!r}: {allowed}") from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"--compute-budget {text!r}: the seconds must be finite and > 0")
    return ComputeBudget(seconds=seconds)


def parse_step_costs(text: str) -> dict[str, float]:
    """`LABEL=SECONDS[,LABEL=SECONDS...]`: given seconds of training per step (e.g. from a benchmark).

    Raises:
        ValueError: a malformed item or a cost that is not finite and > 0, naming it.
    """
    costs: dict[str, float] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        label, sep, value = item.partition("=")
        try:
            cost = float(value) if sep else math.nan
        except ValueError:
            cost = math.nan
        if not label.strip() or not (math.isfinite(cost) and cost > 0):
            raise ValueError(
                f"--step-costs: {item!r} must be LABEL=SECONDS with SECONDS finite and > 0 (seconds of training per step)"
            )
        costs[label.strip()] = cost
    if not costs:
        raise ValueError(f"--step-costs {text!r}: no LABEL=SECONDS given")
    return costs


def plan_steps(costs: Mapping[str, float], budget: ComputeBudget, labels: Sequence[str]) -> dict[str, int]:
    """The steps each run trains: the most whose cost fits the budget, `floor(budget / cost)`.

    Args:
        costs: Seconds of training per step of each label (the reference's too, for a
            `LABEL=N` budget).
        budget: The budget every run gets.
        labels: The runs to plan.

    Returns:
        label -> steps (the reference of a `LABEL=N` budget gets exactly N).

    Raises:
        ValueError: a label (or the reference) without a cost, a cost that is not finite and
            > 0, or a budget too small for one step of a label, naming them.
    """
    needed = list(labels) + ([budget.reference] if budget.reference is not None else [])
    missing = [x for x in dict.fromkeys(needed) if x not in costs]
    if missing:
        raise ValueError(f"no step cost for {missing} (costs known: {dict(costs)})")
    bad = {x: costs[x] for x in needed if not (math.isfinite(costs[x]) and costs[x] > 0)}
    if bad:
        raise ValueError(f"step costs must be finite and > 0 seconds, got {bad}")
    if budget.reference is not None:
        assert budget.steps is not None
        seconds = budget.steps * costs[budget.reference]
    else:
        assert budget.seconds is not None
        seconds = budget.seconds
    plan = {}
    for label in labels:
        if label == budget.reference:
            plan[label] = int(budget.steps)  # type: ignore[arg-type]
            continue
        # The relative tolerance keeps exact ratios (2 x 0.1 / 0.1) from flooring one step short.
        steps = math.floor(seconds / costs[label] * (1 + 1e-9))
        if steps < 1:
            raise ValueError(
                f"a budget of {budget.describe()} ({seconds:.3g} s) is less than one step of {label} "
                f"({costs[label]:.3g} s a step)"
            )
        plan[label] = steps
    return plan


@dataclass(frozen=True)
class StepWork:
    """What one training step of a configuration computes, from its settings alone (no measurement).

    Configurations of one work key (`work_key`: random and random_stratified, whose selections
    draw a few indices and run no model pass) are one calibrated configuration, so the cost model
    gives them the same cost and an equal-compute plan the same steps, whatever the calibration
    measured. Equal `StepWork` alone does not mean equal cost: the FLOP count does not see
    everything a configuration does (the frozen blocks `model.reuse_scoring_prefix` skips, a
    solver's options, the optimizer), so each calibrated configuration is priced by its own
    measurement (`CostModel`).

    Attributes:
        train_flops: the training step, `training_forwards` forwards of the trained rows at the trained width.
        score_flops: the selection's model pass (the feature pass on the pool and, when the strategy
            is validation-guided, the validation batch, at the scored width); 0 without one.
        solver: the strategy whose solve follows the model pass (None: no model pass); the solve's
            time per step is measured per configuration (it is not FLOPs).
    """

    train_flops: float
    score_flops: float = 0.0
    solver: str | None = None


def step_work(
    shape: Mapping[str, Any],
    *,
    train_rows: int,
    train_width: int,
    solver: str | None = None,
    pool_rows: int = 0,
    val_rows: int = 0,
    scored_width: int = 0,
    last_n_blocks: int = 1,
    lora: bool = False,
    lora_top_blocks: int | None = None,
    reuse_prefix: bool = False,
) -> StepWork:
    """The `StepWork` of a step that trains `train_rows` rows and, with a `solver`, scores `pool_rows + val_rows`.

    The conventions are the module docstring's (`forward_flops_per_token`, `training_forwards`,
    `scoring_forwards`); `lora`, `lora_top_blocks` and `reuse_prefix` are the model's LoRA adapters
    (`model.lora`, its `top_blocks`) and `model.reuse_scoring_prefix`.
    """
    adapted = (lora_top_blocks or int(shape["num_hidden_layers"])) if lora else None
    forwards = training_forwards(shape, train_width, adapted_blocks=adapted, reuse_prefix=reuse_prefix)
    train = forwards * train_rows * train_width * forward_flops_per_token(shape, train_width)
    if solver is None:
        return StepWork(train_flops=train)
    per_row = scored_width * forward_flops_per_token(shape, scored_width)
    score = (pool_rows + val_rows) * per_row * scoring_forwards(shape, scored_width, last_n_blocks)
    return StepWork(train_flops=train, score_flops=score, solver=solver)


@dataclass(frozen=True)
class StepSamples:
    """A calibration's measurements of one configuration: per timed step, on the cost's clock.

    Attributes:
        step_s: the step's training time (selection included, evaluation excluded).
        features_s: the part of it the selection's model pass took (0 without one).
        selection_s: the part the whole selection took (the model pass, the solve, the exchange).
    """

    step_s: tuple[float, ...]
    features_s: tuple[float, ...]
    selection_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.step_s or not len(self.step_s) == len(self.features_s) == len(self.selection_s):
            raise ValueError(
                f"StepSamples needs as many feature and selection times as step times (at least one), got "
                f"{len(self.step_s)}, {len(self.features_s)}, {len(self.selection_s)}"
            )

    def take(self, index: Sequence[int]) -> StepSamples:
        """The samples at positions `index` (a bootstrap resample)."""
        return StepSamples(
            step_s=tuple(self.step_s[i] for i in index),
            features_s=tuple(self.features_s[i] for i in index),
            selection_s=tuple(self.selection_s[i] for i in index),
        )


@dataclass(frozen=True)
class CostModel:
    """Seconds per step of each calibrated configuration, split by kind of work.

    ``cost = train factor * train_flops + [model pass] score_s_per_flop * score_flops + solve_s[key]``

    The train factor is that of the calibrated configurations without a model pass whose training
    step has the same FLOPs (`train_s_per_flop_at`), else the pooled `train_s_per_flop`: a step of
    16 rows is not twice one of 8 (larger products run faster per FLOP; the per-step overhead is
    shared), so each training size is priced by its own measurement, and calibrating another size
    later leaves the costs of the sizes already measured as they were.

    What the factors leave of a configuration with a model pass (its solve, its bookkeeping, and
    whatever its FLOP count does not see) is that configuration's own, keyed like the calibration
    (`work_key`): two configurations of one strategy may do different work that their `StepWork`
    cannot tell apart (with `model.reuse_scoring_prefix` the training forward skips the frozen
    blocks below the adapters, which the FLOP convention counts all the same; the solver's options),
    and pooling their remainders priced both at one sample-weighted mean (the fine-tuning study
    planned PartitionSel's 17.8 CPU s step and the reuse arm's 13.2 s at 13.8 s each).
    Likewise for configurations without a model pass: two of one training size that differ in what
    FLOPs do not see (the optimizer, the precision) share `train_s_per_flop_at`, and each keeps what
    that factor leaves of its own step. So every calibrated configuration costs its own measured
    mean step, and the factors say where the time went.

    Attributes:
        train_s_per_flop: seconds per FLOP of the training step (data loading and the optimizer
            ride on it: they scale with the trained batch), pooled over every calibrated size.
        score_s_per_flop: seconds per FLOP of the selection's model pass.
        solve_s: per configuration key, the rest of its step's time: with a model pass the solve,
            the bookkeeping and what its FLOPs do not see; without one, what its training size's
            factor leaves (0 when it is the only configuration of that size).
        train_s_per_flop_at: per training FLOP count measured without a model pass, its own factor.
        works: per configuration key, its `StepWork`.
    """

    train_s_per_flop: float
    score_s_per_flop: float
    solve_s: Mapping[str, float]
    train_s_per_flop_at: Mapping[float, float] = dataclasses.field(default_factory=dict)
    works: Mapping[str, StepWork] = dataclasses.field(default_factory=dict)

    def train_factor(self, train_flops: float) -> float:
        return self.train_s_per_flop_at.get(train_flops, self.train_s_per_flop)

    def step_cost(self, key: str) -> float:
        """The step cost of the calibrated configuration `key`."""
        work = self.works[key]
        cost = self.train_factor(work.train_flops) * work.train_flops + self.solve_s[key]
        if work.solver is not None:
            cost += self.score_s_per_flop * work.score_flops
        return cost


def fit_cost_model(classes: Mapping[str, tuple[StepWork, StepSamples]]) -> CostModel:
    """The factors of `CostModel` from calibrated configurations (configuration key -> work, samples).

    - `train_s_per_flop`: the pooled ratio of step time to training FLOPs over the configurations
      without a model pass; with none calibrated, the step time less the selection's over the
      others. `train_s_per_flop_at`: the same ratio per training size (FLOPs) among the former; a
      configuration with a model pass takes its training size's factor when one was measured.
    - `score_s_per_flop`: the pooled ratio of the model pass's time to its FLOPs.
    - `solve_s[key]`: the mean over that configuration's steps of what the factors leave of the step
      (so its cost is its own mean step time).

    Raises:
        ValueError: no configuration, or a FLOP count that is not positive.
    """
    if not classes:
        raise ValueError("fit_cost_model: no calibrated configuration")
    bad = [w for w, _ in classes.values() if not w.train_flops > 0 or (w.solver is not None and not w.score_flops > 0)]
    if bad:
        raise ValueError(f"fit_cost_model: FLOP counts must be > 0, got {bad}")
    plain = [(w, s) for w, s in classes.values() if w.solver is None]
    passes = {k: (w, s) for k, (w, s) in classes.items() if w.solver is not None}
    if plain:
        train_s = sum(sum(s.step_s) for _, s in plain)
        train_flops = sum(w.train_flops * len(s.step_s) for w, s in plain)
    else:
        train_s = sum(sum(y - x for y, x in zip(s.step_s, s.selection_s)) for _, s in passes.values())
        train_flops = sum(w.train_flops * len(s.step_s) for w, s in passes.values())
    a_train = train_s / train_flops
    by_size: dict[float, list[float]] = {}  # training FLOPs -> [seconds, FLOPs] over the plain samples
    for w, s in plain:
        acc = by_size.setdefault(w.train_flops, [0.0, 0.0])
        acc[0] += sum(s.step_s)
        acc[1] += w.train_flops * len(s.step_s)
    at = {flops: secs / total for flops, (secs, total) in by_size.items()}
    a_score = 0.0
    if passes:
        a_score = sum(sum(s.features_s) for _, s in passes.values()) / sum(w.score_flops * len(s.step_s) for w, s in passes.values())
    rest = {}
    for key, (w, s) in classes.items():
        base = at.get(w.train_flops, a_train) * w.train_flops + (a_score * w.score_flops if w.solver is not None else 0.0)
        rest[key] = sum(y - base for y in s.step_s) / len(s.step_s)
    return CostModel(
        train_s_per_flop=a_train,
        score_s_per_flop=a_score,
        solve_s=rest,
        train_s_per_flop_at=at,
        works={k: w for k, (w, _) in classes.items()},
    )


def cost_spread(
    classes: Mapping[str, tuple[StepWork, StepSamples]],
    arms: Mapping[str, str],
    *,
    reference: str | None = None,
    draws: int = 400,
    seed: int = 0,
) -> dict[str, float]:
    """How much each arm's planned steps could move with the calibration's noise.

    Bootstrap: every configuration's timed steps are resampled with replacement `draws` times,
    the model refitted, and each arm's step cost taken relative to the `reference` arm's (the
    budget's `LABEL` of `LABEL=N`; None: the cost itself, for a budget in seconds).

    Args:
        classes: configuration key -> (its work, its calibration samples).
        arms: arm label -> its configuration key.

    Returns:
        label -> the relative standard deviation of (cost / reference cost); exactly 0 for an arm
        whose configuration is the reference's (equal work costs the same in every resample).
    """
    import numpy as np

    keys = list(classes)
    rng = np.random.default_rng(seed)
    ratios: dict[str, list[float]] = {label: [] for label in arms}
    for _ in range(draws):
        resampled = {}
        for key in keys:
            work, samples = classes[key]
            index = rng.integers(0, len(samples.step_s), size=len(samples.step_s)).tolist()
            resampled[key] = (work, samples.take(index))
        model = fit_cost_model(resampled)
        ref = model.step_cost(arms[reference]) if reference is not None else 1.0
        for label, key in arms.items():
            ratios[label].append(model.step_cost(key) / ref)
    out = {}
    for label, values in ratios.items():
        if reference is not None and arms[label] == arms[reference]:
            out[label] = 0.0
            continue
        arr = np.asarray(values)
        out[label] = float(arr.std(ddof=1) / abs(arr.mean())) if len(arr) > 1 else math.inf
    return out


# Settings that change neither a step's work nor its measured time: left out of `work_key`.
_WORK_NEUTRAL = (
    "run_name", "seed", "save_folder", "save_interval", "save_num_checkpoints_to_keep", "save_overwrite",
    "load_path", "load_weights_only", "autoresume", "max_duration", "eval_interval", "eval_loader",
    "console_log_interval", "progress_bar", "python_log_level", "loggers", "dist_timeout",
)
# `WorkShape` fields read from the model section (which `work_key` hashes whole).
_MODEL_KIND_FIELDS = ("lora", "lora_top_blocks", "reuse_prefix")
# Settings inside a section that only evaluation reads (the evaluation forwards' frozen-block cache).
_WORK_NEUTRAL_NESTED = (("model", "eval_prefix_cache"),)


@dataclass(frozen=True)
class WorkShape:
    """The sizes a configuration's `StepWork` is made of (`config_work`), besides the model's shape."""

    train_rows: int
    train_width: int
    solver: str | None
    pool_rows: int
    val_rows: int
    scored_width: int
    last_n_blocks: int
    # The model's LoRA adapters (`model.lora`, its `top_blocks`) and `model.reuse_scoring_prefix`:
    # what a training step computes (`training_forwards`).
    lora: bool = False
    lora_top_blocks: int | None = None
    reuse_prefix: bool = False

    def work(self, shape: Mapping[str, Any]) -> StepWork:
        return step_work(shape, **dataclasses.asdict(self))


def config_work(cfg: Any, world_size: int = 1) -> WorkShape:
    """The sizes of one step of a run config (a typed `TrainConfig` from `registry.load_run_config`).

    A strategy runs a model pass when it needs features (or the run logs conflicts, or scores
    stale top-k between selections); `none` trains the whole pool. Widths are the configured
    `max_seq_len` and scoring window: the cost is what the configuration asks for, not what the
    rows it happened to draw held, so equal configurations get equal costs.
    """
    import inspect

    from composer_algos.features import GradFeatureExtractor
    from composer_algos.selection import get_strategy
    batch, width = int(cfg.global_train_batch_size), int(cfg.max_seq_len)
    lora = getattr(cfg.model, "lora", None)
    kind = {
        "lora": lora is not None,
        "lora_top_blocks": getattr(lora, "top_blocks", None),
        "reuse_prefix": bool(getattr(cfg.model, "reuse_scoring_prefix", False)),
    }
    sel = cfg.algorithms.get("data_selection")
    if sel is None:
        return WorkShape(batch, width, None, 0, 0, 0, 1, **kind)
    pool = int(round(batch * float(sel.oversampling)))
    strategy = str(sel.strategy)
    if strategy == "none":
        return WorkShape(pool, width, None, pool, 0, 0, 1, **kind)
    spec = get_strategy(strategy)
    if not (spec.needs_features or sel.log_conflicts or sel.between == "stale_topk"):
        return WorkShape(batch, width, None, pool, 0, 0, 1, **kind)  # the pool is loaded all the same
    defaults = {k: v.default for k, v in inspect.signature(GradFeatureExtractor).parameters.items()}
    features = {**defaults, **dict(sel.features or {})}
    window = features.get("score_window") or features.get("score_tokens")
    validation = sel.validation if isinstance(sel.validation, Mapping) else {}
    val_rows = int(validation.get("batch_size", VALIDATION_BATCH)) * world_size if spec.needs_validation else 0
    return WorkShape(
        train_rows=batch,
        train_width=width,
        solver=strategy,
        pool_rows=pool,
        val_rows=val_rows,
        scored_width=min(int(window), width) if window else width,
        last_n_blocks=int(features["last_n_blocks"]),
        **kind,
    )


def work_key(cfg: Any, work: WorkShape) -> str:
    """A digest that two configurations share exactly when their steps do the same work.

    The config without its work-neutral settings (names, seeds, checkpointing, evaluation and its
    frozen-block cache, the duration) and without `algorithms.data_selection`, plus the step's sizes (`config_work`); a
    strategy with a model pass adds its whole `data_selection` section (its options change its
    solve). So random and random_stratified share a key: their selections run no model pass.
    Settings at their defaults are left out, so a setting added later with a default that keeps
    today's behaviour leaves the keys of saved calibrations as they were.
    """
    import hashlib

    from pipeline.config import config_to_dict

    data = config_to_dict(cfg, skip_defaults=True)
    for key in _WORK_NEUTRAL:
        data.pop(key, None)
    for section, key in _WORK_NEUTRAL_NESTED:
        if isinstance(data.get(section), dict):
            data[section] = {k: v for k, v in data[section].items() if k != key}
    algorithms = dict(data.get("algorithms") or {})
    selection = algorithms.pop("data_selection", None)
    data["algorithms"] = algorithms
    callbacks = dict(data.get("callbacks") or {})
    callbacks.pop("train_budget", None)
    data["callbacks"] = callbacks
    # The model's training kind is in its section above already: saved calibrations keep their keys.
    data["work"] = {k: v for k, v in dataclasses.asdict(work).items() if k not in _MODEL_KIND_FIELDS}
    if work.solver is not None:
        data["data_selection"] = {k: v for k, v in dict(selection or {}).items() if k != "seed"}
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def read_step_samples(run_dir: Path, clock: str = "wall") -> tuple[StepSamples, dict[str, int] | None]:
    """A calibration run's `StepSamples` on `clock` (`wall` or `cpu`) and the model's shape.

    Step times come from `train_budget.json` (`step_times_s` / `step_cpu_times_s`, the steps after
    its warm-up); the selection's parts from `selection_log.csv` (`time_features_s` and the whole
    selection, features + solve + exchange, wall clock), scaled on the CPU clock by the step's
    CPU-to-wall ratio. A step without a selection row (no selection algorithm) has parts 0.

    Raises:
        ValueError: the run recorded no timed steps.
    """
    budget = json.loads((run_dir / "train_budget.json").read_text())
    walls = [float(x) for x in budget.get("step_times_s") or []]
    cpus = [float(x) for x in budget.get("step_cpu_times_s") or []]
    if not walls or len(walls) != len(cpus):
        raise ValueError(f"{run_dir / 'train_budget.json'} has no per-step times (step_times_s)")
    first = int(budget["steps"]) - len(walls) + 1  # the first timed step
    parts: dict[int, tuple[float, float]] = {}
    log_path = run_dir / "selection_log.csv"
    if log_path.exists():
        with open(log_path, newline="") as f:
            for row in csv.DictReader(f):
                t = [float(row.get(k) or 0.0) for k in ("time_features_s", "time_solve_s", "time_exchange_s")]
                parts[int(float(row["step"]))] = (t[0], sum(t))
    steps = range(first - 1, first - 1 + len(walls))  # the log counts steps from 0 (the batch's index)
    ratio = [c / w if w > 0 else 1.0 for c, w in zip(cpus, walls)] if clock == "cpu" else [1.0] * len(walls)
    samples = StepSamples(
        step_s=tuple(cpus if clock == "cpu" else walls),
        features_s=tuple(parts.get(k, (0.0, 0.0))[0] * r for k, r in zip(steps, ratio)),
        selection_s=tuple(parts.get(k, (0.0, 0.0))[1] * r for k, r in zip(steps, ratio)),
    )
    return samples, budget.get("model")


def sensitivity_counts(budget_seconds: float, cost: float, spread: float) -> list[int]:
    """The step counts other than the plan's that a cost within one spread of its estimate would buy.

    The plan trains ``floor(budget / cost)`` steps; with the cost at ``cost (1 - spread)`` and
    ``cost (1 + spread)`` the budget buys these counts, so a verdict that changes between them is
    inside the calibration's noise. Empty when both give the plan's own count (the noise cannot
    move it a step) or the spread is 0 (the arm's work is the reference's).
    """
    if not spread > 0:
        return []
    planned = math.floor(budget_seconds / cost * (1 + 1e-9))
    edges = {math.floor(budget_seconds / (cost * (1 + sign * spread)) * (1 + 1e-9)) for sign in (1, -1)}
    return sorted(n for n in edges if n != planned and n >= 1)


def flops_per_token_parts(shape: Mapping[str, Any], seq_len: float) -> dict[str, float]:
    """Forward FLOPs per token of a Llama-style model at sequence width `seq_len`, by part (the one definition).

    `block`: one block, 2 x its weights (q, k, v, o, gate, up, down) plus the attention scores and
    their product with V, 4 S h_attn, over the full S x S square (PaLM's appendix B convention);
    `head`: the lm_head, 2 h V; `total`: L blocks and the head; `layers`: L. Embedding lookups,
    norms and softmax are not counted. tools/bench/bench_step.py and tools/bench/window_cost.py use it too.

    Args:
        shape: `hidden_size`, `num_hidden_layers`, `intermediate_size`, `num_attention_heads`,
            `vocab_size`, optional `num_key_value_heads` (default: the heads) and `head_dim`
            (default: hidden / heads).
        seq_len: S, the width the attention scores are counted at.
    """
    h, layers = int(shape["hidden_size"]), int(shape["num_hidden_layers"])
    heads = int(shape["num_attention_heads"])
    kv_heads = int(shape.get("num_key_value_heads") or heads)
    d_head = int(shape.get("head_dim") or h // heads)
    attn_params = h * (heads + 2 * kv_heads) * d_head + heads * d_head * h  # q, k, v, o
    mlp_params = 3 * h * int(shape["intermediate_size"])  # gate, up, down
    block = 2.0 * (attn_params + mlp_params) + 4.0 * seq_len * heads * d_head
    head = 2.0 * h * int(shape["vocab_size"])
    return {"block": block, "head": head, "total": layers * block + head, "layers": float(layers)}


def forward_flops_per_token(shape: Mapping[str, Any], seq_len: float) -> float:
    """Forward FLOPs per token of a Llama-style model at sequence width `seq_len` (`flops_per_token_parts`)."""
    return flops_per_token_parts(shape, seq_len)["total"]


def training_forwards(
    shape: Mapping[str, Any], seq_len: float, *, adapted_blocks: int | None = None, reuse_prefix: bool = False
) -> float:
    """A training step on one row in forwards of that row.

    Full training (`adapted_blocks` None): 3, the forward and the input and weight gradients. LoRA
    adapters in the top `t = adapted_blocks` of `L` blocks (`L` when every block has them): the
    forward, then the lm_head's input gradient (`share`, its share of the forward) and about one
    forward of each adapted block (its input gradient); the frozen weights get no gradient and the
    adapters' rank-r products are not counted: `1 + share + t (1 - share) / L`. With `reuse_prefix`
    (`model.reuse_scoring_prefix`) the forward skips the frozen blocks below the adapters, whose
    output the scoring pass handed on: `2 (share + t (1 - share) / L)`.
    """
    if adapted_blocks is None:
        return 3.0
    total = forward_flops_per_token(shape, seq_len)
    share = 2 * int(shape["hidden_size"]) * int(shape["vocab_size"]) / total
    layers = int(shape["num_hidden_layers"])
    top = share + min(adapted_blocks, layers) * (1 - share) / layers
    return 2 * top if reuse_prefix else 1 + top


def scoring_forwards(shape: Mapping[str, Any], seq_len: float, last_n_blocks: int) -> float:
    """The feature pass on one row in forwards of that row: `1 + share + 2 n (1 - share) / L`.

    `share` is the lm_head's share of the forward at this width; the pass runs the whole forward,
    the lm_head's input gradient (`share`) and, for each of the last `n` blocks, the input
    gradient and the per-example products (about two forwards of a block each).
    """
    total = forward_flops_per_token(shape, seq_len)
    share = 2 * int(shape["hidden_size"]) * int(shape["vocab_size"]) / total
    layers = int(shape["num_hidden_layers"])
    return 1 + share + 2 * min(last_n_blocks, layers) * (1 - share) / layers


def estimate_run_flops(run_dir: Path) -> dict[str, Any] | None:
    """Estimated FLOPs of a finished run (module docstring): training, selection's scoring, total.

    Reads `train_budget.json` (`steps`, the trained and pool rows and padded tokens, the model's
    shape, the world size), `selection_log.csv` (which steps scored a pool, and whether with a
    validation batch) and `config.yaml` (`algorithms.data_selection`: the strategy, the
    validation batch size, `features.last_n_blocks` and a scoring window). Returns None when the
    run has no `train_budget.json` or it lacks the counts (a run of an older version).
    """
    budget_path = run_dir / "train_budget.json"
    if not budget_path.exists():
        return None
    budget = json.loads(budget_path.read_text())
    shape = budget.get("model")
    if not shape or any(budget.get(k) is None for k in ("trained_tokens", "pool_samples", "pool_tokens")):
        return None
    trained_tokens = float(budget["trained_tokens"])
    trained_width = trained_tokens / budget["trained_samples"] if budget.get("trained_samples") else 0.0
    config = _saved_config(run_dir / "config.yaml")
    train = trained_tokens * forward_flops_per_token(shape, trained_width) * training_forwards(
        shape, trained_width, **_training_kind(config.get("model") or {}, shape)
    )

    selection_cfg = dict((config.get("algorithms") or {}).get("data_selection") or {})
    pool_rows, val_rows = scored_rows(run_dir / "selection_log.csv", selection_cfg, budget)
    pool_width = budget["pool_tokens"] / budget["pool_samples"] if budget["pool_samples"] else 0.0
    features = selection_cfg.get("features") or {}
    window = features.get("score_window") or features.get("score_tokens")
    width = min(pool_width, float(window)) if window else pool_width
    per_row = width * forward_flops_per_token(shape, width)
    scoring = (pool_rows + val_rows) * per_row * scoring_forwards(shape, width, int(features.get("last_n_blocks", 1)))
    return {
        "train": train,
        "selection": scoring,
        "total": train + scoring,
        "scored_pool_rows": pool_rows,
        "scored_validation_rows": val_rows,
        "scored_width": width,
        "trained_width": trained_width,
    }


def scored_rows(log_path: Path, selection_cfg: Mapping[str, Any], budget: Mapping[str, Any]) -> tuple[float, float]:
    """(pool rows, validation rows) the feature pass scored over a run, from `selection_log.csv`.

    A step scored its pool when the strategy that ran needs features (`stale_topk` between
    steps included, without a validation batch), or when it fell back after scoring; it scored a
    validation batch when that strategy (the configured one, for a fallback) is validation-guided.
    Pool rows per step are the run's mean (`pool_samples / steps`), validation rows the configured
    `validation.batch_size` on every rank.
    """
    if not log_path.exists() or not budget.get("steps"):
        return 0.0, 0.0
    from composer_algos.selection import get_strategy, strategy_names

    known = set(strategy_names())
    method = str(selection_cfg.get("strategy", ""))
    pool_steps = val_steps = 0
    with open(log_path, newline="") as f:
        for row in csv.DictReader(f):
            ran = row.get("strategy", "")
            fell_back = float(row.get("fallback") or 0.0) > 0
            name = method if fell_back else ran
            if name == "stale_topk":
                pool_steps += 1
            elif name in known and get_strategy(name).needs_features:
                pool_steps += 1
                val_steps += bool(get_strategy(name).needs_validation)
    pool_per_step = budget["pool_samples"] / budget["steps"]
    val_batch = int((selection_cfg.get("validation") or {}).get("batch_size", VALIDATION_BATCH))
    return pool_steps * pool_per_step, val_steps * val_batch * int(budget.get("world_size", 1))


def _saved_config(path: Path) -> dict[str, Any]:
    """A run's saved `config.yaml` as a mapping ({} when absent)."""
    if not path.exists():
        return {}
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert isinstance(cfg, dict)
    return cfg


def _training_kind(model: Mapping[str, Any], shape: Mapping[str, Any]) -> dict[str, Any]:
    """`training_forwards`' keywords from a run's `model` section: its LoRA adapters and the prefix reuse."""
    lora = model.get("lora")
    if not lora:
        return {}
    top = lora.get("top_blocks") if isinstance(lora, Mapping) else None
    adapted = int(top) if top is not None else int(shape["num_hidden_layers"])
    return {"adapted_blocks": adapted, "reuse_prefix": bool(model.get("reuse_scoring_prefix"))}