"""A callback that logs the domain mixture each step trained on, and writes the logged metrics as mixture.json / CSV."""

from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from composer.core import State
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist

from composer_algos.mixture_io import MixtureCSVWriter, write_mixture_json

log = logging.getLogger(__name__)

__all__ = ["MixtureMonitor", "SELECTION_LOG_COLUMNS", "attach_destination"]

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
    "made_ahead",  # select_ahead: 1 when the step trained on a selection made at the previous step
)


class MixtureMonitor(LoggerDestination):
    """Logs the induced per-step domain mixture and writes DoReMi-comparable mixture files.

    Every step (after any selection algorithm ran) it counts the domains of the examples
    actually trained on, over all ranks, and logs through Composer's logger (so console, file,
    wandb, mlflow and tensorboard all get it):

    - `data/mixture/<domain>`: the share of each domain among the trained examples this step;
    - `data/mixture_mean/<domain>`: its running mean over steps (comparable to DoReMi's
      averaged domain weights);
    - `data/pool/<domain>`: the share of each domain in the candidate pool (equal to the
      mixture when nothing is selected);
    - `data/capacity/<domain>` and `data/capacity_used/<domain>`, on steps whose strategy ran
      within per-domain capacities (`selection/capacities`): each domain's capacity as a share of
      the examples trained (with `capacities: slack`, its upper bound: the shares then sum above
      1), and the part of it the selection used (trained / capacity; 1 whenever the capacities
      sum to the budget).

    It is also a logger destination (it adds itself to the run's `Logger` at `INIT`, so it can be
    listed with the callbacks): the files are written from what was logged, never from another
    object's attributes. `DataSelection` logs its `selection/*` metrics and its traces (the
    strategy, the pool's per-domain counts and sample ids; `selection_step.record_step`) before
    this callback sees the step. On rank 0 it appends `mixture_steps.csv` (per-step mixture),
    `capacity_steps.csv` (per-step capacity shares, when capacities are logged) and
    `selection_log.csv` (the logged selection metrics plus mixture, pool and capacity columns) in `run_dir`, and writes
    `mixture.json` (the running mean, in the shape of DoReMi's output) at every checkpoint and
    at the end of training. With `log_selected_ids`, it also appends `selected_ids.jsonl`: one
    line per step, `{"step", "pool", "selected"}`, the dataset sample indices (`sample_id`, the
    StreamingDataset's global index) of the candidate pool and of the examples trained on, over
    all ranks, so overlaps between runs can be computed (`tools/run_experiment.py`).

    Args:
        domain_names: Domain names by id (filled in by `train.py`; default: the training dataset's
            `domain_names`, else `domain_<i>` for each id seen).
        run_dir: Where the files go (filled in by `train.py`: the save folder or runs/<run_name>).
        natural_weights: Per-domain sample counts of the training split, recorded as the
            natural shares in mixture.json (filled in by `train.py`).
        method: The method name written into mixture.json (default: the selection strategy, or
            `natural` when no selection runs).
        log_selected_ids: Write `selected_ids.jsonl` (default False: a pool of ids per step).
        domain_key: Batch field holding each example's domain id (default `domain_id`).
    """

    def __init__(
        self,
        *,
        domain_names: Sequence[str] | None = None,
        run_dir: str = "runs/run",
        natural_weights: Sequence[float] | None = None,
        method: str | None = None,
        log_selected_ids: bool = False,
        domain_key: str = "domain_id",
    ) -> None:
        super().__init__()
        self.domain_names = list(domain_names) if domain_names is not None else []
        self._names_given = domain_names is not None
        self.domain_key = domain_key
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
        self._cap_csv: MixtureCSVWriter | None = None
        self._sel_csv = None
        self._sel_writer = None
        self._metrics: dict[str, float] = {}  # selection/* metrics logged this step
        self._traces: dict[str, Any] = {}  # selection/* traces logged this step
        self._logged_method: str | None = None

    # ------------------------------------------------------------------ logger destination
    def init(self, state: State, logger: Logger) -> None:
        attach_destination(self, logger)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self._metrics.update({k: v for k, v in metrics.items() if k.startswith("selection/")})

    def log_traces(self, traces: dict[str, Any]) -> None:
        self._traces.update({k: v for k, v in traces.items() if k.startswith("selection/")})
        if "selection/method" in traces:
            self._logged_method = str(traces["selection/method"])

    def state_dict(self) -> dict[str, Any]:
        return {"sum": self.sum_C.tolist(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sum_C = torch.tensor(state["sum"], dtype=torch.float64)
        if not self._names_given and len(self.domain_names) < len(self.sum_C):
            self.domain_names += [f"domain_{i}" for i in range(len(self.domain_names), len(self.sum_C))]
        self.steps = int(state["steps"])
        self._resumed = True

    @property
    def running_mean(self) -> torch.Tensor:
        return self.sum_C / max(self.steps, 1)

    def after_dataloader(self, state: State, logger: Logger) -> None:
        batch = state.batch
        metrics_logged, traces = self._metrics, self._traces
        self._metrics, self._traces = {}, {}
        domain_N = batch[self.domain_key].detach().cpu()
        self._grow_domains(state, domain_N)
        C = len(self.domain_names)
        trained_C = torch.bincount(domain_N, minlength=C).to(torch.float64)
        pool_C = traces.get("selection/pool_counts")
        pool_C = trained_C.clone() if pool_C is None else _pad(pool_C.to(torch.float64), C)
        caps = traces.get("selection/capacities")
        # Capacities of a gathered problem are the same on every rank: rank 0's count once. The flag
        # counts the ranks that logged capacities, so the sum is used only when every rank did.
        shared = bool(traces.get("selection/capacities_shared", False))
        mine = caps is not None and (not shared or dist.get_global_rank() == 0)
        caps_C = _pad(caps.to(torch.float64), C) if mine else torch.zeros(C, dtype=torch.float64)
        flag = torch.tensor([1.0 if caps is not None else 0.0], dtype=torch.float64)
        both = torch.cat([trained_C, pool_C, caps_C, flag])
        if dist.get_world_size() > 1:
            both = _on_comm_device(state, both)
            dist.all_reduce(both, reduce_operation="SUM")
            both = both.cpu()
        trained_C, pool_C, caps_C = both[:C], both[C : 2 * C], both[2 * C : 3 * C]
        has_caps = int(both[3 * C]) == dist.get_world_size()
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
        cap_share_C = None
        if has_caps:
            cap_share_C = caps_C / trained_C.sum().clamp_min(1)
            for c, name in enumerate(self.domain_names):
                metrics[f"data/capacity/{name}"] = float(cap_share_C[c])
                if caps_C[c] > 0:
                    metrics[f"data/capacity_used/{name}"] = float(trained_C[c] / caps_C[c])
        logger.log_metrics(metrics)
        if dist.get_global_rank() == 0:
            strategy = traces.get("selection/strategy", self.method or "none")
            self._write_rows(int(state.timestamp.batch.value), mix_C, pool_mix_C, strategy, metrics_logged, cap_share_C)
        if self.log_selected_ids:
            self._write_ids(int(state.timestamp.batch.value), batch, traces.get("selection/pool_sample_ids"))

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
        if self._cap_csv is not None:
            self._cap_csv.close()
            self._cap_csv = None
        if self._sel_csv is not None:
            self._sel_csv.close()
            self._sel_csv = None
        if self._ids_file is not None:
            self._ids_file.close()
            self._ids_file = None

    # ------------------------------------------------------------------ files (rank 0)
    def _grow_domains(self, state: State, domain_N: torch.Tensor) -> None:
        """Names for the ids seen (once from the training dataset, then domain_<i>); C only grows."""
        if self._names_given:
            return
        if not self.domain_names:
            dataset = getattr(getattr(state, "train_dataloader", None), "dataset", None)
            self.domain_names = list(getattr(dataset, "domain_names", None) or [])
        top = int(domain_N.max()) + 1 if domain_N.numel() else 0
        if dist.get_world_size() > 1:
            # Every rank must size the vectors it all-reduces alike: the largest id any rank saw (a rank
            # whose batch lacked it would otherwise reduce a shorter vector, and the others wait).
            top_t = _on_comm_device(state, torch.tensor([top], dtype=torch.int64))
            dist.all_reduce(top_t, reduce_operation="MAX")
            top = int(top_t.item())
        self.domain_names += [f"domain_{i}" for i in range(len(self.domain_names), top)]
        if len(self.sum_C) < len(self.domain_names):
            self.sum_C = _pad(self.sum_C, len(self.domain_names))

    def _write_rows(
        self,
        step: int,
        mix_C: torch.Tensor,
        pool_C: torch.Tensor,
        strategy: str,
        metrics: dict[str, Any],
        cap_C: torch.Tensor | None = None,
    ) -> None:
        if self._mix_csv is None:
            self._mix_csv = MixtureCSVWriter(self.run_dir / "mixture_steps.csv", self.domain_names, resume=self._resumed)
        self._mix_csv.write(step, mix_C.tolist())
        if cap_C is not None:
            if self._cap_csv is None:
                path = self.run_dir / "capacity_steps.csv"
                self._cap_csv = MixtureCSVWriter(path, self.domain_names, resume=self._resumed)
            self._cap_csv.write(step, cap_C.tolist())
        if self._sel_writer is None:
            path = self.run_dir / "selection_log.csv"
            header = [*SELECTION_LOG_COLUMNS]
            header += [f"mixture/{n}" for n in self.domain_names] + [f"pool/{n}" for n in self.domain_names]
            header += [f"capacity/{n}" for n in self.domain_names]
            rows: list[list[str]] = []
            if self._resumed and path.exists():
                with open(path, newline="") as f:  # by column name: a log written with fewer columns keeps its values
                    rows = [[r.get(col) or "" for col in header] for r in csv.DictReader(f)]
                rows = [r for r in rows if r[0] and int(r[0]) < step]
            self._sel_csv = open(path, "w", newline="")
            self._sel_writer = csv.writer(self._sel_csv)
            self._sel_writer.writerow(header)
            self._sel_writer.writerows(rows)
        row = [step, strategy]
        for col in SELECTION_LOG_COLUMNS[2:]:
            value = metrics.get(f"selection/{col}")
            row.append("" if value is None else repr(float(value)))
        row += [repr(float(x)) for x in mix_C] + [repr(float(x)) for x in pool_C]
        row += [repr(float(x)) for x in cap_C] if cap_C is not None else [""] * len(mix_C)
        self._sel_writer.writerow(row)
        assert self._sel_csv is not None
        self._sel_csv.flush()

    def _write_ids(self, step: int, batch: Any, pool_ids: torch.Tensor | None) -> None:
        if "sample_id" not in batch:
            raise ValueError(
                "callbacks.mixture_monitor.log_selected_ids needs batches with a sample_id field "
                "(DomainStreamingDataset with pipeline's collators); set log_selected_ids: false"
            )
        selected = batch["sample_id"].detach().cpu().tolist()
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
        method = self.method or self._logged_method or "natural"
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


def attach_destination(destination: LoggerDestination, logger: Logger) -> None:
    """Route the run's logging to `destination` too (call it at `INIT`), so it can be listed as a callback.

    Composer sends `log_metrics` / `log_traces` only to the `loggers=` given to the Trainer; a
    callback that consumes logged values adds itself here. At `INIT` Composer runs callbacks before
    algorithms, so it sees everything algorithms log.
    """
    if destination not in logger.destinations:
        logger.destinations = (*logger.destinations, destination)


def _on_comm_device(state: State, x: torch.Tensor) -> torch.Tensor:
    """`x` on the device the process group communicates on (NCCL takes CUDA tensors only): the run's device."""
    device = getattr(state, "device", None)
    return device.tensor_to_device(x) if hasattr(device, "tensor_to_device") else x


def _pad(x_C: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat([x_C, x_C.new_zeros(size - len(x_C))]) if len(x_C) < size else x_C
