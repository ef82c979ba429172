"""Equal-compute planning: steps per run from measured step costs, and the FLOPs a run spent.

Comparing data-selection strategies at equal compute (Kaddour et al. 2023, "No Train No Gain")
means giving each run the number of steps its budget buys and laying its learning-rate schedule
over exactly those steps, so every run ends decayed. `plan_steps` turns per-step costs (seconds
of training per step, measured by a short calibration run or given) and a budget into steps;
`tools/run_experiment.py --compute-budget` runs the plan with `max_duration` = the run's own steps.

`estimate_run_flops` estimates what a finished run computed, from the counts `TrainTimeBudget`
records (`train_budget.json`), the steps that scored a pool (`selection_log.csv`) and the run's
`config.yaml`. Conventions (those of `tools/bench_step.py`): forward FLOPs per token of a
Llama-style model at sequence width S are

    2 (L (P_attn + P_mlp) + h V) + 4 L S h_attn

(matmul weights twice, the attention scores and their product with V over the full S x S square;
embeddings, norms and softmax not counted); a training step is 3 forwards (forward + backward) of
its trained rows at their padded width; a scoring step of a feature strategy costs, per scored
row at the scored width, the feature pass's floor (`scoring_forwards`: the whole forward, the
lm_head's input gradient, and for each target block its input gradient and the per-example
products), over the pool and, for validation-guided strategies, the validation batch (at the
pool's width). The sketch, the solver, the optimizer step and evaluation are not counted.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ComputeBudget",
    "estimate_run_flops",
    "forward_flops_per_token",
    "parse_compute_budget",
    "parse_step_costs",
    "plan_steps",
    "scoring_forwards",
]

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


def flops_per_token_parts(shape: Mapping[str, Any], seq_len: float) -> dict[str, float]:
    """Forward FLOPs per token of a Llama-style model at sequence width `seq_len`, by part (the one definition).

    `block`: one block, 2 x its weights (q, k, v, o, gate, up, down) plus the attention scores and
    their product with V, 4 S h_attn, over the full S x S square (PaLM's appendix B convention);
    `head`: the lm_head, 2 h V; `total`: L blocks and the head; `layers`: L. Embedding lookups,
    norms and softmax are not counted. tools/bench_step.py and tools/window_cost.py use it too.

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
    train = 3.0 * trained_tokens * forward_flops_per_token(shape, trained_width)

    selection_cfg = _selection_config(run_dir / "config.yaml")
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
    val_batch = int((selection_cfg.get("validation") or {}).get("batch_size", 4))
    return pool_steps * pool_per_step, val_steps * val_batch * int(budget.get("world_size", 1))


def _selection_config(path: Path) -> dict[str, Any]:
    """`algorithms.data_selection` of a run's saved `config.yaml` ({} when absent)."""
    if not path.exists():
        return {}
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert isinstance(cfg, dict)
    return dict((cfg.get("algorithms") or {}).get("data_selection") or {})
