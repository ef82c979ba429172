"""Gradient features of a model whose blocks are wrapped for activation checkpointing.

Composer's `fsdp_config: activation_checkpointing: true` and llm-foundry wrap each block in torch's
`checkpoint_wrapper`. The scoring pass records the targets' outputs in its forward and differentiates
with respect to them; under a checkpoint the forward runs without autograd (reentrant) or is redone
in the backward (non-reentrant), and the pass failed either way. It now runs the blocks unwrapped and
puts the wrappers back for training.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from composer_algos.features import GradFeatureExtractor
from composer_algos.features.capture import checkpoint_wrappers
from tests.common.models import tiny_llama


def _batch(n: int, T: int, seed: int) -> dict:
    ids = torch.randint(0, 128, (n, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _checkpointed(model: nn.Module, impl: CheckpointImpl) -> nn.Module:
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )
    return model


@pytest.mark.parametrize("impl", [CheckpointImpl.REENTRANT, CheckpointImpl.NO_REENTRANT])
@pytest.mark.parametrize("last_n_blocks", [1, 2])
def test_checkpointed_blocks_give_the_features_of_the_plain_model(impl, last_n_blocks):
    kw = dict(last_n_blocks=last_n_blocks, normalization="none", proj_dim=24)
    pool, val = _batch(6, 16, seed=1), _batch(2, 16, seed=2)
    G0, g0 = GradFeatureExtractor(tiny_llama(seed=3, num_hidden_layers=3), **kw).compute(pool, val, step=1)
    model = _checkpointed(tiny_llama(seed=3, num_hidden_layers=3), impl)
    wrapped = list(model.model.layers)
    assert all(isinstance(b, CheckpointWrapper) for b in wrapped)
    G1, g1 = GradFeatureExtractor(model, **kw).compute(pool, val, step=1)
    torch.testing.assert_close(G1, G0, rtol=0, atol=0)
    torch.testing.assert_close(g1, g0, rtol=0, atol=0)
    assert list(model.model.layers) == wrapped  # the wrappers are back for training
    model.train()  # the training forward keeps no KV cache (DomainCausalLM.forward), which a recomputed block would grow
    model(input_ids=pool["input_ids"], labels=pool["labels"], use_cache=False).loss.backward()
    assert model.model.layers[0]._checkpoint_wrapped_module.mlp.down_proj.weight.grad is not None


class _ForwardingUnit(nn.Module):
    """Like an FSDP1 unit: it wraps a module and forwards attribute lookups it does not have to it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._fsdp_wrapped_module = module

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_fsdp_wrapped_module"], name)

    def forward(self, *args, **kwargs):
        return self._fsdp_wrapped_module(*args, **kwargs)


def test_a_unit_around_a_checkpoint_wrapper_is_not_taken_for_one():
    block = nn.Linear(4, 4)
    wrapper = checkpoint_wrapper(block)
    unit = _ForwardingUnit(wrapper)
    model = nn.Sequential(unit)
    assert unit._checkpoint_wrapped_module is block  # the lookup FSDP forwards
    assert checkpoint_wrappers(model) == [(unit, "_fsdp_wrapped_module", wrapper)]  # the unit itself stays
