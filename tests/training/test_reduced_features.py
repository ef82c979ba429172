"""Reduced gradient features (issue 15's cost knobs) inside `DataSelection`: each selects, on the layers it names."""

from __future__ import annotations

import pytest
import torch

from composer_algos.data_selection.algorithm import DataSelection
from composer_algos.selection import STRATEGIES
from tests.common.models import tiny_llama
from tests.features.helpers import make_batch, tiny_lora
from tests.training.fake_ranks import FakeState, ListLogger

DOMAINS = ["a", "b"]
LAST = "model.layers.1."  # the tiny Llama has blocks 0 and 1


def _pool(n: int = 8) -> dict[str, torch.Tensor]:
    return {**make_batch(n=n, T=12, seed=3, prompt_len=3, pad_rows=2), "domain_id": torch.arange(n) % 2}


@pytest.mark.parametrize(
    ("features", "lora", "expected"),
    [
        ({"last_n_blocks": 2}, False, lambda names: len(names) == 14 and any(".layers.0." in n for n in names)),
        ({"target_modules": [r"mlp\.down_proj"]}, False, lambda names: names == [LAST + "mlp.down_proj"]),
        (
            {"target_modules": [r"self_attn\."]},
            False,
            lambda names: names == [LAST + f"self_attn.{p}_proj" for p in "qkvo"],
        ),
        ({"include_lm_head": True}, False, lambda names: names[-1] == "lm_head" and len(names) == 8),
        ({}, True, lambda names: names and all("lora_" in n and ".layers.1." in n for n in names)),
        ({"score_tokens": 4}, False, lambda names: len(names) == 7),
    ],
    ids=["last2", "mlp_down", "attention", "lm_head", "lora_default", "score_tokens"],
)
def test_reduced_features_select_in_data_selection(features, lora, expected):
    model = tiny_lora(seed=0) if lora else tiny_llama(seed=0)
    val = [make_batch(n=2, T=12, seed=9)]
    algo = DataSelection(
        strategy="partitionsel", domain_names=DOMAINS, validation=val,
        features={"normalization": "none", "proj_dim": 16, **features},
    )
    algo.spec, algo.kappa = STRATEGIES["partitionsel"], 4
    state, logger = FakeState(_pool(), step=0, model=model), ListLogger()
    algo._select(state, logger)
    assert logger.traces[-1]["selection/strategy"] == "partitionsel"
    assert logger.metrics[-1]["selection/fallback"] == 0.0
    assert state.batch["input_ids"].shape[0] == 4
    names = [n.removeprefix("base_model.model.") for n in algo.extractor.target_names]  # type: ignore[union-attr]
    assert expected(names), names


def test_the_study_knob_ablations_parse_on_the_study_yaml():
    from study_dm_math import ABLATIONS, YAML

    from composer_algos.registry import load_run_config

    sel = {name: load_run_config(YAML, ABLATIONS[name]).algorithms["data_selection"] for name in
           ("score_tokens32", "mlp_only", "interval2_stale", "interval2_random")}
    assert sel["score_tokens32"].features.score_tokens == 32
    assert list(sel["mlp_only"].features.target_modules) == [r"mlp\.down_proj"]
    assert (sel["interval2_stale"].interval, sel["interval2_stale"].between) == (2, "stale_topk")
    assert (sel["interval2_random"].interval, sel["interval2_random"].between) == (2, "random")
