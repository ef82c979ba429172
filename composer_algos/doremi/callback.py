"""Logs DoReMi's domain weights and writes them as `mixture.json` and `mixture_steps.csv`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import dist, format_name_with_dist

from composer_algos.mixture_io import MixtureCSVWriter, write_mixture_json

log = logging.getLogger(__name__)

__all__ = ["DoReMiMixtureWriter", "MIXTURE_JSON", "MIXTURE_CSV", "SUBDIR"]

MIXTURE_JSON = "mixture.json"
MIXTURE_CSV = "mixture_steps.csv"
SUBDIR = "doremi"


class DoReMiMixtureWriter(Callback):
    """Reports the weights of the run's `DoReMi` algorithm.

    Every step (`BATCH_END`, after the algorithm commits the step) it logs
    `doremi/weight/<domain>` (the step's weights `alpha_t`), `doremi/avg_weight/<domain>` (the
    running average, initial weights included) and `doremi/excess/<domain>` (`lambda_t`) through
    the Composer logger, and rank 0 appends `alpha_t` to `mixture_steps.csv` (row 0 holds the
    initial weights). Rank 0 writes `mixture.json` (method "doremi", the averaged weights) at
    every epoch end, at fit end, and every `json_every_n_batches` steps so that a checkpointed
    run always has a recent one. One device-to-host copy of 3C numbers per step.

    Args:
        output_dir: Output directory; `{run_name}` is replaced. None (default) uses
            `<run_dir>/doremi` with the algorithm's `run_dir`.
        json_every_n_batches: Also write `mixture.json` every this many steps (0: only at epoch and
            fit end). Default 100.

    Raises:
        ValueError: If `json_every_n_batches` is negative.
    """

    def __init__(self, output_dir: str | None = None, json_every_n_batches: int = 100) -> None:
        if json_every_n_batches < 0:
            raise ValueError(f"`json_every_n_batches` must be >= 0, got {json_every_n_batches}")
        self.output_dir = output_dir
        self.json_every_n_batches = json_every_n_batches
        self.folder: Path | None = None
        self._csv: MixtureCSVWriter | None = None

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.FIT_START:
            self._fit_start(state)
        elif event == Event.BATCH_END:
            self._batch_end(state, logger)
        elif event in (Event.EPOCH_END, Event.FIT_END):
            self._write_json(state)
            if event == Event.FIT_END and self._csv is not None:
                self._csv.close()

    def close(self, state: State, logger: Logger) -> None:
        if self._csv is not None:
            self._csv.close()

    def _fit_start(self, state: State) -> None:
        algo = _find_doremi(state)
        folder = self.output_dir or str(Path(algo.run_dir) / SUBDIR)
        self.folder = Path(format_name_with_dist(folder, state.run_name))
        if dist.get_global_rank() != 0:
            return
        resume = int(state.timestamp.batch) > 0
        self._csv = MixtureCSVWriter(self.folder / MIXTURE_CSV, algo.domain_names, resume=resume)
        if not resume:
            self._csv.write(0, algo.initial_alpha_C)
        log.info("doremi: writing %s and %s to %s", MIXTURE_JSON, MIXTURE_CSV, self.folder)

    def _batch_end(self, state: State, logger: Logger) -> None:
        algo = _find_doremi(state)
        names = algo.domain_names
        num = len(names)
        host = torch.cat([algo.alpha_C, algo.averaged_weights(), algo.last_lam_C]).cpu().tolist()
        alpha, avg, lam = host[:num], host[num : 2 * num], host[2 * num :]
        metrics = {f"doremi/weight/{n}": a for n, a in zip(names, alpha)}
        metrics.update({f"doremi/avg_weight/{n}": a for n, a in zip(names, avg)})
        metrics.update({f"doremi/excess/{n}": x for n, x in zip(names, lam)})
        logger.log_metrics(metrics)
        if self._csv is not None:
            self._csv.write(int(state.timestamp.batch), alpha)
        if self.json_every_n_batches and int(state.timestamp.batch) % self.json_every_n_batches == 0:
            self._write_json(state)

    def _write_json(self, state: State) -> None:
        if dist.get_global_rank() != 0 or self.folder is None:
            return
        algo = _find_doremi(state)
        write_mixture_json(
            self.folder / MIXTURE_JSON,
            method="doremi",
            domain_names=algo.domain_names,
            weights=algo.averaged_weights(),
            steps=algo.num_updates,
            natural=algo.natural_weights,
            extra={
                "initial_weights": dict(zip(algo.domain_names, algo.initial_alpha_C.tolist())),
                "final_weights": dict(zip(algo.domain_names, algo.alpha_C.cpu().tolist())),
                "eta_dro": algo.eta_dro,
                "smoothing": algo.smoothing,
                "averaging": "mean of alpha_0..alpha_T (initial weights included)",
            },
        )


@runtime_checkable
class DoReMiWeights(Protocol):
    """What the writer reads from the run's DoReMi algorithm (``composer_algos.doremi.DoReMi``).

    A protocol rather than the class itself: the algorithm attaches this writer, so the writer
    must not import the algorithm (imports point one way, algorithm -> callback).
    """

    domain_names: list[str]
    run_dir: str
    alpha_C: torch.Tensor
    last_lam_C: torch.Tensor
    initial_alpha_C: torch.Tensor
    num_updates: int
    eta_dro: float
    smoothing: float

    def averaged_weights(self) -> torch.Tensor: ...


def _find_doremi(state: State) -> DoReMiWeights:
    found = [a for a in state.algorithms if isinstance(a, DoReMiWeights)]
    if len(found) != 1:
        raise ValueError(f"DoReMiMixtureWriter needs exactly one DoReMi algorithm in the run, found {len(found)}")
    return found[0]
