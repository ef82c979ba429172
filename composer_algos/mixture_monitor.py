"""A callback that logs the domain mixture each step trained on, and writes it as mixture.json / CSV."""

from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from composer_algos.mixture_io import MixtureCSVWriter, write_mixture_json
from composer_algos.selection_algorithm import find_data_selection

log = logging.getLogger(__name__)

__all__ = ["MixtureMonitor", "SELECTION_LOG_COLUMNS"]

SELECTION_LOG_COLUMNS = (
    "step",
    "strategy",
    "conflict_fraction",
    "objective",
    "time_features_s",
    "time_solve_s",
    "time_exchange_s",
    "kept_samples",
    "kept_tokens",
    "fallback",
    "selected_hash",
)


class MixtureMonitor(Callback):
    """Logs the induced per-step domain mixture and writes DoReMi-comparable mixture files.

    Every step (after any selection algorithm ran) it counts the domains of the examples
    actually trained on, over all ranks, and logs through Composer's logger (so console, file,
    wandb, mlflow and tensorboard all get it):

    - `data/mixture/<domain>`: the share of each domain among the trained examples this step;
    - `data/mixture_mean/<domain>`: its running mean over steps (comparable to DoReMi's
      averaged domain weights);
    - `data/pool/<domain>`: the share of each domain in the candidate pool (equal to the
      mixture when nothing is selected).

    On rank 0 it appends `mixture_steps.csv` (per-step mixture) and `selection_log.csv` (the
    selection metrics of `DataSelection` plus mixture and pool columns) in `run_dir`, and writes
    `mixture.json` (the running mean, in the shape of DoReMi's output) at every checkpoint and
    at the end of training. With `log_selected_ids`, it also appends `selected_ids.jsonl`: one
    line per step, `{"step", "pool", "selected"}`, the dataset sample indices (`sample_id`, the
    StreamingDataset's global index) of the candidate pool and of the examples trained on, over
    all ranks, so overlaps between runs can be computed (`tools/run_experiment.py`).

    Args:
        domain_names: Domain names by id (filled in by `train.py`).
        run_dir: Where the files go (filled in by `train.py`: the save folder or runs/<run_name>).
        natural_weights: Per-domain sample counts of the training split, recorded as the
            natural shares in mixture.json (filled in by `train.py`).
        method: The method name written into mixture.json (default: the selection strategy, or
            `natural` when no selection runs).
        log_selected_ids: Write `selected_ids.jsonl` (default False: a pool of ids per step).
    """

    def __init__(
        self,
        *,
        domain_names: Sequence[str],
        run_dir: str = "runs/run",
        natural_weights: Sequence[float] | None = None,
        method: str | None = None,
        log_selected_ids: bool = False,
    ) -> None:
        self.domain_names = list(domain_names)
        self.run_dir = Path(run_dir)
        self.natural = None
        if natural_weights is not None:
            total = float(sum(natural_weights))
            self.natural = [float(w) / total for w in natural_weights] if total > 0 else None
        self.method = method
        self.log_selected_ids = log_selected_ids
        self._ids_file = None
        self.sum_C = torch.zeros(len(self.domain_names), dtype=torch.float64)
        self.steps = 0
        self._resumed = False
        self._mix_csv: MixtureCSVWriter | None = None
        self._sel_csv = None
        self._sel_writer = None

    def state_dict(self) -> dict[str, Any]:
        return {"sum": self.sum_C.tolist(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sum_C = torch.tensor(state["sum"], dtype=torch.float64)
        self.steps = int(state["steps"])
        self._resumed = True

    @property
    def running_mean(self) -> torch.Tensor:
        return self.sum_C / max(self.steps, 1)

    def after_dataloader(self, state: State, logger: Logger) -> None:
        batch = state.batch
        C = len(self.domain_names)
        trained_C = torch.bincount(batch["domain_id"].detach().cpu(), minlength=C).to(torch.float64)
        stats = _selection_stats(state)
        pool_C = stats.get("pool_counts_local")
        pool_C = trained_C.clone() if pool_C is None else pool_C.to(torch.float64)
        both = torch.cat([trained_C, pool_C])
        if dist.get_world_size() > 1:
            dist.all_reduce(both, reduce_operation="SUM")
        trained_C, pool_C = both[:C], both[C:]
        mix_C = trained_C / trained_C.sum().clamp_min(1)
        pool_mix_C = pool_C / pool_C.sum().clamp_min(1)
        self.sum_C += mix_C
        self.steps += 1
        mean_C = self.running_mean
        metrics = {}
        for c, name in enumerate(self.domain_names):
            metrics[f"data/mixture/{name}"] = float(mix_C[c])
            metrics[f"data/mixture_mean/{name}"] = float(mean_C[c])
            metrics[f"data/pool/{name}"] = float(pool_mix_C[c])
        logger.log_metrics(metrics)
        if dist.get_global_rank() == 0:
            self._write_rows(int(state.timestamp.batch.value), mix_C, pool_mix_C, stats)
        if self.log_selected_ids:
            self._write_ids(int(state.timestamp.batch.value), batch, stats)

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._write_json(state)

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self._write_json(state)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._write_json(state)
        self.close(state, logger)

    def close(self, state: State, logger: Logger) -> None:
        if self._mix_csv is not None:
            self._mix_csv.close()
            self._mix_csv = None
        if self._sel_csv is not None:
            self._sel_csv.close()
            self._sel_csv = None
        if self._ids_file is not None:
            self._ids_file.close()
            self._ids_file = None

    # ------------------------------------------------------------------ files (rank 0)
    def _write_rows(self, step: int, mix_C: torch.Tensor, pool_C: torch.Tensor, stats: dict[str, Any]) -> None:
        if self._mix_csv is None:
            self._mix_csv = MixtureCSVWriter(self.run_dir / "mixture_steps.csv", self.domain_names, resume=self._resumed)
        self._mix_csv.write(step, mix_C.tolist())
        if self._sel_writer is None:
            path = self.run_dir / "selection_log.csv"
            header = [*SELECTION_LOG_COLUMNS]
            header += [f"mixture/{n}" for n in self.domain_names] + [f"pool/{n}" for n in self.domain_names]
            rows: list[list[str]] = []
            if self._resumed and path.exists():
                with open(path, newline="") as f:
                    rows = [r for r in csv.reader(f)][1:]
                rows = [r for r in rows if r and int(r[0]) < step]
            self._sel_csv = open(path, "w", newline="")
            self._sel_writer = csv.writer(self._sel_csv)
            self._sel_writer.writerow(header)
            self._sel_writer.writerows(rows)
        m = stats.get("metrics", {})
        row = [step, stats.get("strategy", self.method or "none")]
        for col in SELECTION_LOG_COLUMNS[2:]:
            value = m.get(f"selection/{col}")
            row.append("" if value is None else repr(float(value)))
        row += [repr(float(x)) for x in mix_C] + [repr(float(x)) for x in pool_C]
        self._sel_writer.writerow(row)
        assert self._sel_csv is not None
        self._sel_csv.flush()

    def _write_ids(self, step: int, batch: Any, stats: dict[str, Any]) -> None:
        if "sample_id" not in batch:
            raise ValueError(
                "callbacks.mixture_monitor.log_selected_ids needs batches with a sample_id field "
                "(DomainStreamingDataset with pipeline's collators); set log_selected_ids: false"
            )
        selected = batch["sample_id"].detach().cpu().tolist()
        pool_ids = stats.get("pool_sample_ids_local")
        pool = selected if pool_ids is None else pool_ids.detach().cpu().tolist()
        if dist.get_world_size() > 1:
            gathered = dist.all_gather_object((pool, selected))
            pool = [i for p, _ in gathered for i in p]
            selected = [i for _, s in gathered for i in s]
        if dist.get_global_rank() != 0:
            return
        if self._ids_file is None:
            path = self.run_dir / "selected_ids.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            kept: list[str] = []
            if self._resumed and path.exists():
                kept = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] < step]
            self._ids_file = open(path, "w")
            self._ids_file.writelines(ln + "\n" for ln in kept)
        self._ids_file.write(json.dumps({"step": step, "pool": pool, "selected": selected}) + "\n")
        self._ids_file.flush()

    def _write_json(self, state: State) -> None:
        if dist.get_global_rank() != 0 or self.steps == 0:
            return
        method = self.method or _method_name(state)
        os.makedirs(self.run_dir, exist_ok=True)
        mean = self.running_mean
        mean = mean / mean.sum()
        write_mixture_json(
            self.run_dir / "mixture.json",
            method=method,
            domain_names=self.domain_names,
            weights=mean.tolist(),
            steps=self.steps,
            natural=self.natural,
            extra={"run_name": state.run_name, "batch": int(state.timestamp.batch.value)},
        )


def _selection_stats(state: State) -> dict[str, Any]:
    algo = find_data_selection(state)
    return algo.last_stats if algo is not None else {}


def _method_name(state: State) -> str:
    algo = find_data_selection(state)
    return algo.strategy if algo is not None else "natural"
