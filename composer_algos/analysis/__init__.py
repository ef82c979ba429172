"""Analysis for studies and benchmarks: nothing a training run needs to select data.

- `compute_plan.py`: equal-compute planning (steps per run from measured step costs) and the FLOPs a run spent.
- `experiment_stats.py`: paired per-seed comparisons of strategies, with intervals.
- `lookahead.py`: the one-step check that a selected subset lowers the loss of examples that did not guide it.

Imported by `tools/` and by the time-budget callback (for the model's shape keys); never by the
selection cores or the algorithm.
"""
