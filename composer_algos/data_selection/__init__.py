"""The Composer-facing shell of data selection: the `DataSelection` algorithm and what it needs around a step.

- `algorithm.py`: `DataSelection`, the Composer `Algorithm` (options, events, checkpoint state).
- `step.py`: one selection step as four pure stages (assemble, solve, redistribute, record).
- `capacity_policy.py`: how the step's budget is split into per-domain capacities.
- `validation_source.py`: where the validation batch that guides the choice comes from.
- `exchange.py`: global-scope selection across ranks.
- `mixture_monitor.py`: the callback that logs the domain mixture each step trained on.

The cores it drives (`composer_algos.selection`, `composer_algos.features`) never import it.
"""

from composer_algos.data_selection.algorithm import DataSelection
from composer_algos.data_selection.mixture_monitor import MixtureMonitor

__all__ = ["DataSelection", "MixtureMonitor"]
