"""DoReMi (Xie et al. 2023): Group DRO domain weights from a proxy trained against a reference model."""

from composer_algos.doremi.algorithm import DoReMi
from composer_algos.doremi.callback import MIXTURE_CSV, MIXTURE_JSON, DoReMiMixtureWriter
from composer_algos.doremi.core import (
    clipped_excess_sums,
    domain_sums,
    domain_token_counts,
    doremi_update,
    excess_per_domain,
    per_token_losses,
    resolve_initial_weights,
    weighted_domain_loss,
)
from composer_algos.doremi.reference import freeze_reference, load_reference_model

__all__ = [
    "DoReMi",
    "DoReMiMixtureWriter",
    "MIXTURE_CSV",
    "MIXTURE_JSON",
    "clipped_excess_sums",
    "doremi_update",
    "domain_sums",
    "domain_token_counts",
    "excess_per_domain",
    "freeze_reference",
    "load_reference_model",
    "per_token_losses",
    "resolve_initial_weights",
    "weighted_domain_loss",
]
