"""Build optimizers, schedulers, loggers, callbacks and algorithms from plain config values."""

from __future__ import annotations

import importlib
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

__all__ = ["ALGORITHMS", "CALLBACKS", "LOGGERS", "build_optimizer", "build_scheduler", "build_registered"]

# name -> "module:Class"; resolved lazily so optional parts import only when used.
ALGORITHMS: dict[str, str] = {
    "data_selection": "composer_algos.selection_algorithm:DataSelection",
    "doremi": "composer_algos.doremi:DoReMi",
}
CALLBACKS: dict[str, str] = {
    "mixture_monitor": "composer_algos.mixture_monitor:MixtureMonitor",
    "eval_history": "composer_algos.eval_history:EvalHistory",
    "train_budget": "composer_algos.train_budget:TrainTimeBudget",
    "speed_monitor": "composer.callbacks:SpeedMonitor",
    "lr_monitor": "composer.callbacks:LRMonitor",
    "memory_monitor": "composer.callbacks:MemoryMonitor",
    "runtime_estimator": "composer.callbacks:RuntimeEstimator",
    "optimizer_monitor": "composer.callbacks:OptimizerMonitor",
}
LOGGERS: dict[str, str] = {
    "file": "composer_algos.file_logger:AppendFileLogger",  # appends on autoresume (Composer 0.32.1 truncates)
    "wandb": "composer.loggers:WandBLogger",
    "mlflow": "composer.loggers:MLFlowLogger",
    "tensorboard": "composer.loggers:TensorboardLogger",
    "in_memory": "composer.loggers:InMemoryLogger",
}


def build_optimizer(
    params: Any, *, name: str, lr: float, betas: Sequence[float], eps: float, weight_decay: float
) -> torch.optim.Optimizer:
    """AdamW-family optimizer (Composer's DecoupledAdamW, torch AdamW or Adam)."""
    betas_t = (float(betas[0]), float(betas[1]))
    if name == "decoupled_adamw":
        return DecoupledAdamW(params, lr=lr, betas=betas_t, eps=eps, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas_t, eps=eps, weight_decay=weight_decay)
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


def build_registered(
    kind: str,
    registry: Mapping[str, str],
    name: str,
    kwargs: Mapping[str, Any] | None,
    context: Mapping[str, Any] | None = None,
) -> Any:
    """Instantiate `registry[name]` with the yaml `kwargs`.

    Constructor parameters that the yaml leaves out but `context` provides (for instance
    `domain_names` from the shard manifest) are filled in from `context`.

    Raises:
        ValueError: an unknown name, or keyword arguments the class does not take.
    """
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; available: {sorted(registry)}")
    module_name, cls_name = registry[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    params = inspect.signature(cls).parameters
    given = dict(kwargs or {})
    takes_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = sorted(k for k in given if k not in params)
    if unknown and not takes_var_kw:
        allowed = sorted(k for k in params if k not in (context or {}))
        raise ValueError(f"{kind} {name!r} does not take {unknown}; allowed keys: {allowed}")
    for key, value in (context or {}).items():
        if key in params and key not in given:
            given[key] = value
    return cls(**given)
