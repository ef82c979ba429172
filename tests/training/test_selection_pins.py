"""Pinned selections and losses of every strategy on the tiny config: refactors and pure speed
changes must not change what is selected (issues 11 and 15).

The pins were recorded from the code before the shell refactor (`PARTITIONSEL_RECORD_PINS=1 pytest
tests/training/test_selection_pins.py` rewrites them: do that only for a change that is meant to
alter selections, and say so in the commit).
"""

from __future__ import annotations

import json
import os

import pytest
from composer.loggers import InMemoryLogger

import train
from pipeline.config import load_config
from tests.common.paths import REPO_ROOT
from tests.training.conftest import tiny_overrides

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
PINS = REPO_ROOT / "tests" / "training" / "data" / "selection_pins.json"
STRATEGIES = ["partitionsel", "greats", "id", "iwd", "gradnorm", "colm", "facloc", "uniprot", "random", "random_stratified"]
RECORD = os.environ.get("PARTITIONSEL_RECORD_PINS") == "1"


def _series(trainer, key):
    mem = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
    return [float(v) for _, v in mem.data.get(key, [])]


def _run(strategy: str, shard_dir, run_dir) -> dict:
    cfg = load_config(
        TINY,
        tiny_overrides(
            shard_dir,
            run_dir,
            "loggers.in_memory={}",
            "eval_loader=null",
            f"algorithms.data_selection.strategy={strategy}",
        ),
    )
    trainer = train.build_trainer(cfg)
    trainer.fit()
    out = {
        "selected_hash": _series(trainer, "selection/selected_hash"),
        "loss": _series(trainer, "loss/train/total"),
    }
    trainer.close()
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_selections_and_losses_match_the_pins(strategy, dolma_shards, tmp_path):
    got = _run(strategy, dolma_shards, tmp_path / strategy)
    assert len(got["selected_hash"]) == 3 and len(got["loss"]) == 3
    if RECORD:
        pins = json.loads(PINS.read_text()) if PINS.exists() else {}
        pins[strategy] = got
        PINS.parent.mkdir(parents=True, exist_ok=True)
        PINS.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
        pytest.skip("recorded")
    pins = json.loads(PINS.read_text())[strategy]
    assert got["selected_hash"] == pins["selected_hash"], f"{strategy}: selections changed"
    assert got["loss"] == pytest.approx(pins["loss"], rel=1e-5), f"{strategy}: losses changed"


@pytest.mark.slow  # inductor compiles the block below the cut on the CPU: about a minute
@pytest.mark.timeout(900)
def test_the_compiled_scoring_forward_selects_as_the_pins(dolma_shards, tmp_path):
    """`features.compile_forward` in a real run: the compiled blocks change rounding only, not the choice."""
    cfg = load_config(TINY, tiny_overrides(dolma_shards, tmp_path, "loggers.in_memory={}", "eval_loader=null",
                                           "algorithms.data_selection.strategy=partitionsel",
                                           "algorithms.data_selection.features.compile_forward=true"))
    trainer = train.build_trainer(cfg)
    trainer.fit()
    got = _series(trainer, "selection/selected_hash")
    from composer_algos.data_selection.algorithm import find_data_selection

    extractor = find_data_selection(trainer.state).extractor
    assert extractor._compiled_below is not None and extractor._compiled_below.below >= 1
    assert not any(hasattr(b, "_orig_mod") for b in extractor._compiled_below.blocks)  # only inside the scoring forward
    trainer.close()
    assert got == json.loads(PINS.read_text())["partitionsel"]["selected_hash"]
