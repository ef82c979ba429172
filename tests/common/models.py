"""Tiny randomly initialised transformers models for CPU tests (no downloads)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["HAND_COUNTED_SHAPE", "tiny_llama_config", "tiny_llama"]

# A Llama-style `model.config` small enough to count its FLOPs by hand (d_head 2, lm_head share
# 80 / 912 at width 8): the compute plan's tests and run_experiment's fake runs.
HAND_COUNTED_SHAPE = {
    "hidden_size": 4,
    "num_hidden_layers": 2,
    "intermediate_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 10,
    "head_dim": 2,
}


def tiny_llama_config(
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 64,
) -> LlamaConfig:
    """A Llama-architecture config small enough for CPU unit tests (2 layers, d_model 64)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs) -> LlamaForCausalLM:
    """A seeded, randomly initialised tiny Llama; `config_kwargs` override `tiny_llama_config`."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**config_kwargs))
    return model.to(dtype)
