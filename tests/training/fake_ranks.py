"""Several ranks in one process: threads with Composer's `dist` collectives emulated, and a minimal State.

Lets `DataSelection._select` run as rank 0 and rank 1 of a world of W in a test of a few seconds
(the real two-process launches in test_multiprocess.py take about a minute each).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["ThreadRanks", "FakeState", "ListLogger"]


class ThreadRanks:
    """W threads, each a rank; `all_gather` / `all_reduce` meet at a barrier (timeout: no hung tests).

    Use `patch(monkeypatch)` to route `composer.utils.dist` through it, then `run(fn)` calls
    `fn(rank)` on every rank concurrently and returns the results by rank.
    """

    def __init__(self, world: int, timeout_s: float = 60.0) -> None:
        self.world = world
        self._barrier = threading.Barrier(world, timeout=timeout_s)
        self._slots: list[Any] = [None] * world
        self._local = threading.local()

    def patch(self, monkeypatch) -> None:
        from composer.utils import dist

        monkeypatch.setattr(dist, "get_world_size", lambda: self.world)
        monkeypatch.setattr(dist, "get_global_rank", self.rank)
        monkeypatch.setattr(dist, "all_gather", self.all_gather)
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)
        monkeypatch.setattr(dist, "broadcast", self.broadcast)

    def rank(self) -> int:
        return getattr(self._local, "rank", 0)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._barrier.wait()  # every rank has read the previous collective's slots
        self._slots[self.rank()] = tensor.detach().clone()
        self._barrier.wait()
        return [s.clone() for s in self._slots]

    def all_reduce(self, tensor: torch.Tensor, reduce_operation: str = "SUM") -> None:
        stacked = torch.stack(self.all_gather(tensor))
        ops = {"SUM": lambda x: x.sum(0), "MAX": lambda x: x.amax(0), "MIN": lambda x: x.amin(0)}
        tensor.copy_(ops[reduce_operation.upper()](stacked))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        tensor.copy_(self.all_gather(tensor)[src])

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.world
        errors: list[BaseException | None] = [None] * self.world

        def body(rank: int) -> None:
            self._local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # re-raised in the main thread below
                errors[rank] = e
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = next(
            (e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None
        )
        if first is None:
            first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results


class FakeState:
    """What `DataSelection._select` reads from Composer's State: batch, step, lr, elapsed duration."""

    def __init__(self, batch: dict[str, Any], step: int = 0, lr: float = 1e-3, model: Any = None) -> None:
        self.batch = batch
        self.timestamp = SimpleNamespace(batch=SimpleNamespace(value=step))
        self.optimizers = [SimpleNamespace(param_groups=[{"lr": lr}])]
        self.model = model

    def get_elapsed_duration(self):
        return None


class ListLogger:
    """Collects `log_metrics` and `log_traces` calls."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []
        self.traces: list[dict[str, Any]] = []

    def log_metrics(self, metrics: dict[str, float]) -> None:
        self.metrics.append(dict(metrics))

    def log_traces(self, traces: dict[str, Any]) -> None:
        self.traces.append(dict(traces))
