"""`model.lora.top_blocks` (issue 29.2): adapters only in the last blocks, so the backward stops at the lowest adapted one."""

from __future__ import annotations

import pytest
import torch

from composer_algos.models.causal_lm import build_causal_lm
from pipeline.config import ConfigError, parse_config
from pipeline.tokenizer import load_tokenizer
from tests.common.paths import REPO_ROOT

CONFIG = {
    "model_type": "llama", "vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
}


def _model(top_blocks):
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "top_blocks": top_blocks}
    return build_causal_lm(tokenizer=load_tokenizer(REPO_ROOT / "assets" / "tokenizer"), config=CONFIG, lora=lora)


def _adapted_layers(model):
    return sorted({int(n.split("layers.")[1].split(".")[0]) for n, p in model.named_parameters() if p.requires_grad})


def test_top_blocks_adapts_only_the_last_blocks_and_the_backward_stops_there():
    assert _adapted_layers(_model(None)) == [0, 1, 2, 3]
    model = _model(2)
    assert _adapted_layers(model) == [2, 3]
    # The blocks below hold nothing to train: autograd never reaches them.
    reached = []
    for i, layer in enumerate(model.model.base_model.model.model.layers):
        layer.register_full_backward_hook(lambda *a, i=i: reached.append(i))
    ids = torch.randint(0, 4096, (2, 8))
    out = model.model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert sorted(set(reached)) == [2, 3]


def test_top_blocks_beyond_the_model_or_below_one_are_refused():
    with pytest.raises(ValueError, match="top_blocks 5 exceeds the model's 4 blocks"):
        _model(5)
    with pytest.raises(ConfigError, match="model.lora.top_blocks must be an integer >= 1"):
        parse_config(
            {
                "tokenizer_name": "assets/tokenizer", "max_seq_len": 32, "global_train_batch_size": 2,
                "max_duration": "1ba", "train_loader": {"dataset": {"shard_dir": "x"}},
                "model": {"config": CONFIG, "lora": {"top_blocks": 0}},
            }
        )
