"""The `answer_accuracy` callback (issue 29.3): greedy answers to held-out questions, in eval_results.json."""

from __future__ import annotations

import json

import pytest

import train
from composer_algos.registry import load_run_config
from pipeline.config import ConfigError
from tests.common.paths import REPO_ROOT

TINY_FT = REPO_ROOT / "yamls" / "testing" / "tiny_finetune.yaml"


def _overrides(shards, run_dir, *extra):
    return [
        f"variables.shard_dir={shards}",
        f"save_folder={run_dir}",
        "max_duration=2ba",
        "eval_interval=2ba",
        "global_train_batch_size=4",
        "eval_loader.device_eval_batch_size=4",
        "eval_loader.subset_num_batches=1",
        "eval_loader.per_domain=true",
        "python_log_level=warning",
        "callbacks.answer_accuracy.per_domain=2",
        "callbacks.answer_accuracy.max_new_tokens=4",
        "callbacks.answer_accuracy.at_start=true",
        *extra,
    ]


def test_accuracy_of_every_evaluated_domain_is_in_eval_results(math_shards, tmp_path):
    cfg = load_run_config(TINY_FT, _overrides(math_shards, tmp_path / "run"))
    trainer = train.build_trainer(cfg)
    trainer.fit()
    trainer.close()
    results = json.loads((tmp_path / "run" / "eval_results.json").read_text())
    evaluated = set(results["val_cross_entropy"])
    for key in ("answer_accuracy", "answer_accuracy_start"):
        assert set(results[key]) == evaluated, key  # every per-domain evaluator's questions were asked
        assert all(0.0 <= v <= 1.0 for v in results[key].values())
        mean = sum(results[key].values()) / len(results[key])
        assert results[f"{key}_mean"] == pytest.approx(mean)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["eval_loader=null"], "answer_accuracy asks the per-domain evaluators"),
        (["eval_loader.per_domain=false"], "answer_accuracy asks the per-domain evaluators"),
        (["callbacks.answer_accuracy.per_domain=0"], "per_domain must be an integer >= 1"),
    ],
)
def test_bad_answer_accuracy_settings_are_config_errors(math_shards, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config(TINY_FT, _overrides(math_shards, tmp_path / "run", *extra))


def test_answer_accuracy_on_pretraining_shards_is_refused_before_anything_is_built(dolma_shards, tmp_path):
    tiny = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
    with pytest.raises(ConfigError, match="needs fine-tuning shards"):
        load_run_config(tiny, [f"variables.shard_dir={dolma_shards}", "callbacks.answer_accuracy.per_domain=2"])


def test_calibration_runs_drop_the_evaluation_callbacks_with_the_eval_loader(math_shards, tmp_path):
    """run_experiment's calibration runs drop the eval_loader; a yaml with answer_accuracy must still be valid there."""

    import run_experiment

    yaml = tmp_path / "ft.yaml"
    yaml.write_text(TINY_FT.read_text() + "\ncallbacks:\n  answer_accuracy:\n    per_domain: 2\n")
    base = [f"variables.shard_dir={math_shards}", f"save_folder={tmp_path / 'run'}", "eval_loader=null"]
    with pytest.raises(ConfigError, match="answer_accuracy"):  # what the calibration runs hit before
        load_run_config(yaml, base)
    drop = run_experiment._without_evaluation_callbacks(yaml)
    assert drop == ["~callbacks.answer_accuracy"]
    cfg = load_run_config(yaml, base + drop)
    assert "answer_accuracy" not in cfg.callbacks and cfg.eval_loader is None
    assert run_experiment._without_evaluation_callbacks(TINY_FT) == []

