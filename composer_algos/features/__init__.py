"""Per-example gradient features of a causal LM for data selection: exact or sketched, Adam-normalised, FFT-compressed."""

from composer_algos.features.capture import (
    capture_layer_signals,
    per_example_grads,
    per_example_losses,
    scoring_mode,
    truncated_graph,
)
from composer_algos.features.extractor import PRECONDITION_SIDES, FeatureError, GradFeatureExtractor, spearman
from composer_algos.features.normalize import NORMALIZATIONS, SimulatedAdam
from composer_algos.features.projection import apply_fjlt, fjlt_project, make_fjlt_plan
from composer_algos.features.sketch import exact_layer_grads, sketch_layer_grads, sketch_matrices
from composer_algos.features.targets import TargetLayer, choose_cut_module, resolve_targets, unwrap_model

__all__ = [
    "FeatureError",
    "GradFeatureExtractor",
    "NORMALIZATIONS",
    "PRECONDITION_SIDES",
    "SimulatedAdam",
    "TargetLayer",
    "apply_fjlt",
    "capture_layer_signals",
    "choose_cut_module",
    "exact_layer_grads",
    "fjlt_project",
    "make_fjlt_plan",
    "per_example_grads",
    "per_example_losses",
    "resolve_targets",
    "scoring_mode",
    "sketch_layer_grads",
    "sketch_matrices",
    "spearman",
    "truncated_graph",
    "unwrap_model",
]
