"""A running mean of the validation feature across steps: a stronger guiding signal at no extra cost."""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = ["ValidationAverage"]


class ValidationAverage:
    """Exponential moving average of the per-step validation mean feature `gbar`, bias-corrected.

    A few validation examples a step give a noisy guiding gradient (on dm_math, 4 examples correlate
    with the held-out set's gradient far less than 16 or more do; docs/results/study_dm_math.md). The
    model moves little between steps, so averaging `gbar` over recent steps pools many more
    validation examples without scoring them again: `m_t = beta m_{t-1} + (1 - beta) gbar_t`, used as
    `m_t / (1 - beta^t)`. The projections must be the same every step (the default fixed ones) and
    validation features must carry no step-dependent scaling (`precondition: pool` keeps them raw):
    `DataSelection` rejects `beta > 0` with `precondition: split | both`, `adam_simulated` or
    `resample_projections` at construction.
    `beta = 0` returns `gbar_t` unchanged. Under global scope, update with the gathered `gbar` so every
    rank holds the same state.

    Args:
        beta: decay in [0, 1); the average spans about 1 / (1 - beta) steps.
    """

    def __init__(self, beta: float = 0.0) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"validation.average_beta must be in [0, 1), got {beta}")
        self.beta = float(beta)
        self.count = 0
        self._m: torch.Tensor | None = None

    def update(self, gbar_d: torch.Tensor) -> torch.Tensor:
        """Fold this step's `gbar` (d,) in and return the bias-corrected average (d,)."""
        if self.beta == 0.0:
            return gbar_d
        if self._m is None or self._m.shape != gbar_d.shape:
            if self._m is not None:
                log.warning(
                    "validation average: feature width changed from %d to %d; restarting the average",
                    self._m.numel(),
                    gbar_d.numel(),
                )
            self._m, self.count = torch.zeros_like(gbar_d, dtype=torch.float32), 0
        m = self._m.to(gbar_d.device)
        self._m = self.beta * m + (1.0 - self.beta) * gbar_d.float()
        self.count += 1
        return (self._m / (1.0 - self.beta**self.count)).to(gbar_d.dtype)

    def snapshot(self) -> tuple[torch.Tensor | None, int]:
        """The state as it is (`restore` puts it back; `update` never writes into the saved tensor)."""
        return self._m, self.count

    def restore(self, snapshot: tuple[torch.Tensor | None, int]) -> None:
        """Undo the updates since `snapshot()` (a step whose features turned out unusable)."""
        self._m, self.count = snapshot

    def state_dict(self) -> dict[str, Any]:
        return {
            "beta": self.beta,
            "count": self.count,
            "m": None if self._m is None else self._m.detach().cpu(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state.get("count", 0))
        self._m = state.get("m")
