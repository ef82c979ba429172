"""Stepping Composer trainers one batch at a time, timed: the harness bench_step.py and window_cost.py share.

`prepare_for_stepping` readies a trainer to be stepped by `Trainer.fit(duration="1ba")` calls in turn
(round robin between strategies, so a shared machine's noise falls on every arm alike);
`make_step_timer` is the callback that times each step, from asking the loader for a batch to the end
of the optimizer step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

# Composer loads in the functions, so the tools' --help stays fast.
if TYPE_CHECKING:
    from composer.core import State
    from composer.loggers import Logger

__all__ = ["make_step_timer", "prepare_for_stepping"]


def make_step_timer():
    """A Composer callback timing each step: from asking the loader for a batch to the end of the optimizer step."""
    from composer.core import Callback

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._t0 = 0.0

        def before_dataloader(self, state: State, logger: Logger) -> None:
            self._t0 = time.perf_counter()

        def batch_end(self, state: State, logger: Logger) -> None:
            self.times.append(time.perf_counter() - self._t0)

    return StepTimer()


def prepare_for_stepping(trainer) -> None:
    """Ready a trainer to be stepped one batch per fit() call, quietly.

    No checkpoint at each call's end, no console or progress output, and the mixture monitor's
    files stay open until the end (its fit_end would close them).
    """
    from composer.callbacks import CheckpointSaver
    from composer.loggers import ConsoleLogger, ProgressBarLogger

    from composer_algos.data_selection.mixture_monitor import MixtureMonitor

    quiet = (ConsoleLogger, ProgressBarLogger)
    callbacks = trainer.state.callbacks
    callbacks[:] = [c for c in callbacks if not isinstance(c, (CheckpointSaver, *quiet))]
    for c in callbacks:
        if isinstance(c, MixtureMonitor):
            c.fit_end = _no_fit_end  # type: ignore[method-assign]
    trainer.logger.destinations = tuple(d for d in trainer.logger.destinations if not isinstance(d, quiet))


def _no_fit_end(state: State, logger: Logger) -> None:
    return None
