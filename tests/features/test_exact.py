"""Exact per-example gradients match torch.func and loop references (float64), with and without LoRA."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from composer_algos.features import per_example_grads, per_example_losses, resolve_targets, unwrap_model
from tests.common.models import tiny_llama, tiny_llama_config
from tests.features.helpers import (
    func_per_example_grads,
    loop_example_loss,
    loop_per_example_grads,
    make_batch,
    tiny_lora,
)


def _assert_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-6) -> None:
    rel = ((actual - expected).norm() / expected.norm()).item()
    assert expected.norm() > 0, "reference gradient is zero: the test would be vacuous"
    assert rel <= rtol, f"relative error {rel:.3e} > {rtol:.0e} (max abs diff {(actual - expected).abs().max():.3e})"


@pytest.mark.parametrize(
    "spec",
    [
        {"last_n_blocks": 1},
        {"last_n_blocks": 2, "target_modules": [r"q_proj$", r"down_proj$"]},
        {"last_n_blocks": 1, "include_lm_head": True, "target_modules": ["up_proj", "lm_head"]},
    ],
    ids=["last_block", "two_blocks_patterns", "with_lm_head"],
)
def test_exact_matches_torch_func(spec):
    model = tiny_llama(seed=1, dtype=torch.float64).eval()
    batch = make_batch(n=5, seed=2)
    targets = resolve_targets(model, exact_max_numel=10**9, **spec)
    feats = per_example_grads(model, batch, targets, mode="exact", chunk_size=3)
    ref = func_per_example_grads(model, batch, [f"{t.name}.weight" for t in targets])
    for t in targets:
        _assert_rel(feats[t.name], ref[f"{t.name}.weight"].reshape(5, -1))


def test_exact_matches_torch_func_lora():
    model = tiny_lora(seed=3, dtype=torch.float64).eval()
    batch = make_batch(n=4, seed=4)
    targets = resolve_targets(model)
    assert targets and all(".lora_A." in t.name or ".lora_B." in t.name for t in targets)
    assert {t.block for t in targets} == {1}
    feats = per_example_grads(model, batch, targets, mode="exact")
    ref = func_per_example_grads(model, batch, [f"{t.name}.weight" for t in targets])
    for t in targets:
        _assert_rel(feats[t.name], ref[f"{t.name}.weight"].reshape(4, -1))


def test_exact_with_bias_and_padding_matches_loop():
    cfg = tiny_llama_config()
    cfg.attention_bias = True
    cfg.mlp_bias = True
    torch.manual_seed(5)
    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    batch = make_batch(n=5, seed=6, pad_rows=3)
    targets = resolve_targets(model, target_modules=["k_proj", "gate_proj"])
    assert all(t.has_bias for t in targets)
    feats = per_example_grads(model, batch, targets, mode="exact", chunk_size=2)
    ref = loop_per_example_grads(model, batch, [p for t in targets for p in t.params])
    for i in range(5):
        expected = torch.cat([g.reshape(-1) for g in ref[i]])
        got = torch.cat([feats[t.name][i] for t in targets])
        _assert_rel(got, expected)


def test_sum_of_per_example_grads_is_grad_of_summed_loss():
    model = tiny_llama(seed=7, dtype=torch.float64).eval()
    batch = make_batch(n=6, seed=8, pad_rows=2)
    targets = resolve_targets(model)
    feats = per_example_grads(model, batch, targets, mode="exact")
    with torch.enable_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        total = per_example_losses(logits, batch["labels"]).sum()
        grads = torch.autograd.grad(total, [t.module.weight for t in targets])
    for t, g in zip(targets, grads):
        _assert_rel(feats[t.name].sum(dim=0), g.reshape(-1))


def test_composer_wrapper_is_unwrapped():
    from composer.models import HuggingFaceModel

    model = tiny_llama(seed=9, dtype=torch.float64).eval()
    wrapped = HuggingFaceModel(model, tokenizer=None, use_logits=True)
    assert unwrap_model(wrapped) is model
    batch = make_batch(n=3, seed=10)
    a = per_example_grads(wrapped, batch, mode="exact")
    b = per_example_grads(model, batch, mode="exact")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_per_example_losses_match_token_loop():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 9, 13, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 13, (4, 9), generator=gen)
    labels[0, :5] = -100
    labels[2, 3:] = -100
    labels[3] = -100  # no targets at all -> loss 0
    got = per_example_losses(logits, labels)
    expected = torch.stack([loop_example_loss(logits[i], labels[i]) for i in range(4)]).float()
    torch.testing.assert_close(got, expected)
