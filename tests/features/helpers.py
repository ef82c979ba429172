"""Batches, LoRA models and reference per-example gradients shared by the feature tests."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from torch.func import functional_call, grad, vmap

from tests.common.models import tiny_llama

__all__ = ["compute_or_skip_without_compiler", "make_batch", "tiny_lora", "func_per_example_grads", "loop_per_example_grads", "loop_example_loss"]


def make_batch(n: int = 6, T: int = 16, vocab: int = 128, seed: int = 0, prompt_len: int = 4, pad_rows: int = 0) -> dict:
    """Random tokens; the first `prompt_len` labels masked; the last `pad_rows` rows right-padded by varying amounts."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (n, T), generator=gen)
    attention_mask = torch.ones(n, T, dtype=torch.long)
    for r in range(n - pad_rows, n):
        attention_mask[r, T - 2 - (r % 5) :] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :prompt_len] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def tiny_lora(seed: int = 0, dtype: torch.dtype = torch.float32, dropout: float = 0.0, **config_kwargs):
    """A tiny Llama with random (non-zero) LoRA factors on the attention and MLP projections."""
    base = tiny_llama(seed=seed, dtype=dtype, **config_kwargs)
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=dropout,
        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
        init_lora_weights=False,  # random B as well, so lora_A's gradient is not zero
    )
    torch.manual_seed(seed + 1)
    return get_peft_model(base, cfg).to(dtype)


def func_per_example_grads(model, batch: dict, param_names: list[str]) -> dict[str, torch.Tensor]:
    """torch.func reference: vmap over examples of grad of the example's loss w.r.t. `param_names` (full forward).

    The batch must be unpadded (each example runs alone, without an attention mask).
    """
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss_fn(tp, ids_T, labels_T):
        # The model's own loss (HF shifts the labels and averages over the non -100 targets), so the
        # reference does not share the code under test.
        kwargs = {"labels": labels_T[None], "use_cache": False}
        return functional_call(model, ({**params, **tp}, buffers), (ids_T[None],), kwargs).loss

    tp = {k: params[k] for k in param_names}
    with torch.enable_grad():
        return vmap(grad(loss_fn), in_dims=(None, 0, 0))(tp, batch["input_ids"], batch["labels"])


def loop_per_example_grads(model, batch: dict, params: list[torch.nn.Parameter]) -> list[list[torch.Tensor]]:
    """Slow reference: each example alone, its padding stripped, autograd w.r.t. `params` (eval mode)."""
    out = []
    for i in range(batch["input_ids"].shape[0]):
        keep = batch["attention_mask"][i].bool()
        ids, labels = batch["input_ids"][i][keep][None], batch["labels"][i][keep][None]
        with torch.enable_grad():
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
            out.append(list(torch.autograd.grad(loss, params)))
    return out


def loop_example_loss(logits_TV: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
    """Token-by-token mean next-token cross-entropy of one example over its non -100 targets."""
    terms = [
        -torch.log_softmax(logits_TV[t].double(), dim=-1)[labels_T[t + 1]]
        for t in range(labels_T.shape[0] - 1)
        if labels_T[t + 1] != -100
    ]
    return torch.stack(terms).mean() if terms else logits_TV.new_zeros((), dtype=torch.float64)


def compute_or_skip_without_compiler(extractor, pool: dict, val: dict, step: int):
    """`extractor.compute(pool, val, step=step)` with torch.compile inside; a skip, with the reason, where inductor
    has no C++ toolchain to build CPU kernels (any other error is raised)."""
    import pytest

    try:
        return extractor.compute(pool, val, step=step)
    except Exception as e:  # noqa: BLE001
        if "compiler" in str(e).lower() or "InvalidCxxCompiler" in type(e).__name__:
            pytest.skip(f"torch.compile cannot build CPU kernels on this machine: {e}")
        raise

