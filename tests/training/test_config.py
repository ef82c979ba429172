"""Every yaml parses and validates; config errors list every problem with field names."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import ConfigError, TrainConfig, load_config
from tests.common.paths import REPO_ROOT

YAMLS = sorted(p for p in (REPO_ROOT / "yamls").rglob("*.yaml"))


def test_there_are_yamls():
    names = {p.name for p in YAMLS}
    assert {"llama1b_dolma.yaml", "qwen2.5-3b_metamathqa.yaml", "qwen2.5-3b_mol_instructions.yaml"} <= names


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_yaml_parses_and_validates(path: Path):
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig)
    assert cfg.global_train_batch_size > 0
    assert cfg.max_duration.endswith(("ba", "ep"))


def test_paper_recipes_are_encoded():
    pre = load_config(REPO_ROOT / "yamls" / "llama1b_dolma.yaml")
    assert pre.max_seq_len == 512 and pre.global_train_batch_size == 32
    assert pre.optimizer.lr == pytest.approx(3e-4) and pre.scheduler.t_warmup == "1000ba"
    assert pre.scheduler.name == "linear_decay_with_warmup"
    assert pre.model.config is not None and pre.model.config["hidden_size"] == 2048
    math = load_config(REPO_ROOT / "yamls" / "qwen2.5-3b_metamathqa.yaml")
    assert math.model.lora is not None and (math.model.lora.r, math.model.lora.alpha) == (16, 96)
    assert math.model.lora.dropout == pytest.approx(0.05)
    assert math.optimizer.lr == pytest.approx(2e-5) and math.scheduler.name == "cosine_with_warmup"
    assert math.max_duration == "2048ba"
    sel = math.algorithms["data_selection"]
    assert math.global_train_batch_size * sel["oversampling"] == 128
    mol = load_config(REPO_ROOT / "yamls" / "qwen2.5-3b_mol_instructions.yaml")
    assert mol.optimizer.lr == pytest.approx(2e-4) and mol.max_duration == "1024ba"


def test_overrides_apply(tmp_path):
    cfg = load_config(REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml", ["optimizer.lr=0.5", "max_duration=7ba"])
    assert cfg.optimizer.lr == 0.5 and cfg.max_duration == "7ba"


def test_unknown_and_missing_keys_are_all_listed(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "max_seq_len: 16\nmodel: {config: {model_type: llama}, lora_rank: 3}\n"
        "train_loader: {dataset: {shard_dir: x, shufle: true}}\nmax_duration: 5ba\nlearning_rate: 1\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    msg = str(info.value)
    for needle in ("lora_rank", "shufle", "learning_rate", "tokenizer_name", "global_train_batch_size"):
        assert needle in msg


def test_bad_values_name_field_and_value(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(
            REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml",
            ["max_duration=100sp", "optimizer.lr=-1", "scheduler.name=step", "model.lora.r=0"],
        )
    msg = str(info.value)
    assert "100sp" in msg and "optimizer.lr" in msg and "'step'" in msg
    with pytest.raises(ConfigError, match="global_train_batch_size"):
        load_config(REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml", ["global_train_batch_size=abc"])


def test_missing_yaml_file():
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config("nope.yaml")
