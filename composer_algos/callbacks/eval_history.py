"""A callback that records every per-domain evaluation (validation log-perplexity) to CSV and JSON."""

from __future__ import annotations

import csv
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from composer.core import State
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist

from composer_algos.data_selection.mixture_monitor import attach_destination

log = logging.getLogger(__name__)

__all__ = ["EvalHistory"]

_SELECTION_TIMES = ("selection/time_features_s", "selection/time_solve_s", "selection/time_exchange_s")


class EvalHistory(LoggerDestination):
    """Appends `eval_history.csv` (step, domain, cross-entropy) after each evaluator runs and
    writes `eval_results.json` at the end of training (last per-domain losses, their unweighted
    average, wall-clock time and the selection overhead: the sum of the `selection/time_*_s`
    metrics `DataSelection` logged, read as a logger destination it adds itself to at `INIT`; with
    the `answer_accuracy` callback, `answer_accuracy` per domain and `answer_accuracy_mean`).

    Only rank 0 writes. The metric values are Composer's (already reduced over ranks).

    Args:
        run_dir: Output directory (filled in by `train.py`).
    """

    def __init__(self, *, run_dir: str = "runs/run") -> None:
        super().__init__()
        self.run_dir = Path(run_dir)
        self.last: dict[str, float] = {}
        self._t0: float | None = None
        self._selection_s = 0.0
        self.accuracy: dict[str, float] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"last": dict(self.last), "selection_s": self._selection_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last = dict(state.get("last", {}))
        self._selection_s = float(state.get("selection_s", 0.0))

    def fit_start(self, state: State, logger: Logger) -> None:
        self._t0 = time.perf_counter()

    def init(self, state: State, logger: Logger) -> None:
        attach_destination(self, logger)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        for key in _SELECTION_TIMES:
            if key in metrics:
                self._selection_s += float(metrics[key])
        for key, value in metrics.items():  # `AnswerAccuracy`'s, at the last step (and at the start)
            if key.startswith(("accuracy/", "accuracy_start/")):
                self.accuracy[key] = float(value)

    def eval_end(self, state: State, logger: Logger) -> None:
        label = state.dataloader_label or ""
        metric = state.eval_metrics.get(label, {}).get("LanguageCrossEntropy")
        if metric is None or not label.startswith("val/"):
            return
        value = float(metric.compute())
        domain = label[len("val/") :]
        self.last[domain] = value
        if dist.get_global_rank() != 0:
            return
        path = self.run_dir / "eval_history.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        with open(path, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["step", "domain", "cross_entropy"])
            w.writerow([int(state.timestamp.batch.value), domain, repr(value)])

    def fit_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        wall = time.perf_counter() - self._t0 if self._t0 is not None else float("nan")
        finite = [v for v in self.last.values() if math.isfinite(v)]
        out = {
            "run_name": state.run_name,
            "steps": int(state.timestamp.batch.value),
            "val_cross_entropy": self.last,
            "val_cross_entropy_mean": sum(finite) / len(finite) if finite else None,
            "wall_time_s": wall,
            "selection_time_s": self._selection_s,
        }
        for prefix, name in (("accuracy/", "answer_accuracy"), ("accuracy_start/", "answer_accuracy_start")):
            found = {k[len(prefix) :]: v for k, v in self.accuracy.items() if k.startswith(prefix)}
            if found:
                out[f"{name}_mean"] = found.pop("average")
                out[name] = found
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "eval_results.json").write_text(json.dumps(out, indent=2))
