"""Build optimizers, schedulers, loggers, callbacks and algorithms from typed config values."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from composer.optim import (
    ConstantWithWarmupScheduler,
    CosineAnnealingWithWarmupScheduler,
    DecoupledAdamW,
    LinearWithWarmupScheduler,
)

log = logging.getLogger(__name__)

__all__ = ["build_component", "build_optimizer", "build_scheduler"]


def build_optimizer(
    params: Any, *, name: str, lr: float, betas: Sequence[float], eps: float, weight_decay: float
) -> torch.optim.Optimizer:
    """AdamW-family optimizer (Composer's DecoupledAdamW, torch AdamW or Adam).

    `adamw` is torch's AdamW with `fused=True`: one multi-tensor kernel per parameter group and
    step, on CUDA and on the CPU (torch >= 2.4 fuses both). Composer's `decoupled_adamw` loops over
    the parameters in Python, about ten kernels each, and reads each one's step count with
    `.item()`: a host sync per parameter tensor every step on a GPU (146 for Llama-3.2-1B). The two
    make the same update when torch's `weight_decay` is Composer's divided by the initial learning
    rate: Composer multiplies the weights by `1 - (lr / initial_lr) wd`, torch by `1 - lr wd`
    (tests/training/test_optimizer_equivalence.py; tools/bench/bench_optimizer.py times both).
    """
    betas_t = (float(betas[0]), float(betas[1]))
    if name == "decoupled_adamw":
        return DecoupledAdamW(params, lr=lr, betas=betas_t, eps=eps, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas_t, eps=eps, weight_decay=weight_decay, fused=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas_t, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"optimizer.name must be decoupled_adamw, adamw or adam, got {name!r}")


def build_scheduler(*, name: str, t_warmup: str, alpha_f: float) -> Any:
    """Composer warmup schedulers (warmup in ba or dur; decay to `alpha_f` of the peak lr)."""
    if name == "linear_decay_with_warmup":
        return LinearWithWarmupScheduler(t_warmup=t_warmup, alpha_f=alpha_f)
    if name == "cosine_with_warmup":
        return CosineAnnealingWithWarmupScheduler(t_warmup=t_warmup, alpha_f=alpha_f)
    if name == "constant_with_warmup":
        return ConstantWithWarmupScheduler(t_warmup=t_warmup)
    raise ValueError(f"scheduler.name {name!r} is not supported")


def build_component(
    kind: str, name: str, options: Mapping[str, Any] | None, context: Mapping[str, Any] | None = None
) -> Any:
    """Instantiate the algorithm, callback or logger registered as `name` (`composer_algos.registry`).

    Args:
        kind: `algorithm`, `callback` or `logger`.
        name: the registry name, e.g. `data_selection`, `gradient_clipping`, `speed_monitor`.
        options: its constructor arguments: the `ConfigSection` the config parsed (only the keys
            the yaml gave are passed, so the class keeps its own defaults) or a plain mapping.
        context: values of the run (`registry.CONTEXT_KEYS`: domain names, run directory, seed, ...)
            passed to the constructor parameters of the same name that `options` leaves out.

    Raises:
        ValueError: an unknown name (a config from `load_config` has been checked already).
    """
    from composer_algos.registry import component_class

    cls = component_class(kind, name)
    params = inspect.signature(cls).parameters
    kwargs = dict(options or {})
    for key, value in (context or {}).items():
        if key in params and key not in kwargs:
            kwargs[key] = value
    return cls(**kwargs)
