"""Scoring in the run's precision, the `chunk_size: auto` default and the out-of-memory retry (issue 12.1, 12.2)."""

from __future__ import annotations

import logging

import pytest
import torch

import composer_algos.features.extractor as extractor_module
from composer_algos.features import GradFeatureExtractor
from composer_algos.features.extractor import DEFAULT_CHUNK_SIZE, feature_option_problems, is_out_of_memory
from tests.common.models import tiny_llama
from tests.features.helpers import make_batch

OPTIONS = dict(normalization="none", proj_dim=48, exact_max_numel=5000, sketch_dim=8, seed=5)


def _row_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1)


def test_scoring_runs_in_the_given_precision_context_with_float32_features():
    model = tiny_llama(seed=1)
    pool, val = make_batch(n=6, seed=2, pad_rows=2), make_batch(n=3, seed=3)
    seen: list[torch.dtype] = []
    hook = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, o: seen.append(a[0].dtype))
    try:
        G32, g32 = GradFeatureExtractor(model, **OPTIONS).compute(pool, val)
        assert set(seen) == {torch.float32}
        seen.clear()
        ex = GradFeatureExtractor(model, **OPTIONS)
        G16, g16 = ex.compute(
            pool, val, precision_context=lambda: torch.autocast("cpu", dtype=torch.bfloat16)
        )
    finally:
        hook.remove()
    # The target layer ran in bfloat16 (pool and validation forwards); the features come back float32.
    assert seen and set(seen) == {torch.bfloat16}, seen
    assert G16.dtype == g16.dtype == torch.float32
    assert torch.isfinite(G16).all() and torch.isfinite(g16).all()
    cos = _row_cosine(G16, G32)
    assert cos.min() >= 0.99, f"per-row cosine bf16 vs fp32: {cos.tolist()}"
    assert float(_row_cosine(g16[None], g32[None])) >= 0.99
    assert not torch.is_autocast_enabled("cpu"), "the context must be left on return"


def test_backward_runs_outside_the_precision_context(monkeypatch):
    model = tiny_llama(seed=4)
    entered = []
    real_grad = torch.autograd.grad

    def spy(*args, **kwargs):
        entered.append(torch.is_autocast_enabled("cpu"))
        return real_grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", spy)
    GradFeatureExtractor(model, **OPTIONS).compute(
        make_batch(n=3, seed=5), precision_context=lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    )
    assert entered == [False]


def _record_chunks(monkeypatch, fail_above: int | None = None, message: str = "CUDA out of memory. Tried"):
    """Spy on the extractor's capture: the rows of every forward; raise an OOM above `fail_above` rows."""
    rows: list[int] = []
    real = extractor_module.capture_layer_signals

    def spy(model, batch, *args, **kwargs):
        n = batch["input_ids"].shape[0]
        rows.append(n)
        if fail_above is not None and n > fail_above:
            raise torch.cuda.OutOfMemoryError(message) if "CUDA out" in message else RuntimeError(message)
        return real(model, batch, *args, **kwargs)

    monkeypatch.setattr(extractor_module, "capture_layer_signals", spy)
    return rows


def test_auto_chunk_is_the_given_microbatch_else_the_default(monkeypatch):
    model = tiny_llama(seed=6)
    pool = make_batch(n=7, seed=7)
    rows = _record_chunks(monkeypatch)
    ex = GradFeatureExtractor(model, **OPTIONS)
    assert ex.chunk_size == "auto"
    ex.compute(pool, auto_chunk_size=3)
    assert rows == [3, 3, 1] and ex.chunk_size_in_use == 3
    rows.clear()
    ex.compute(make_batch(n=DEFAULT_CHUNK_SIZE + 2, seed=8))
    assert rows == [DEFAULT_CHUNK_SIZE, 2] and ex.chunk_size_in_use == DEFAULT_CHUNK_SIZE
    rows.clear()
    fixed = GradFeatureExtractor(model, chunk_size=2, **OPTIONS)
    fixed.compute(pool, auto_chunk_size=5)  # an explicit chunk_size wins over the run's microbatch
    assert rows == [2, 2, 2, 1] and fixed.chunk_size_in_use == 2


def test_out_of_memory_halves_the_chunk_and_retries(monkeypatch, caplog):
    model = tiny_llama(seed=9)
    pool, val = make_batch(n=8, seed=10, pad_rows=2), make_batch(n=4, seed=11)
    options = {**OPTIONS, "normalization": "adam_simulated"}
    clean = GradFeatureExtractor(model, chunk_size=2, **options)
    G_ref, g_ref = clean.compute(pool, val)
    rows = _record_chunks(monkeypatch, fail_above=2)
    ex = GradFeatureExtractor(model, chunk_size=8, **options)
    with caplog.at_level(logging.WARNING, logger="composer_algos.features.extractor"):
        G, gbar = ex.compute(pool, val)
    # Chunks above 2 rows fail (8, then 4); at 2 the pool (2, 2, 2, 2) and validation (2, 2) pass.
    assert rows == [8, 4, 2, 2, 2, 2, 2, 2], rows
    assert ex.chunk_size_in_use == 2
    torch.testing.assert_close(G, G_ref)
    torch.testing.assert_close(gbar, g_ref)
    # The failed attempts left no trace in the simulated-Adam state: one step committed, as in the clean run.
    assert ex.simulated.count == clean.simulated.count == 1
    for name in clean.target_names:
        torch.testing.assert_close(ex.simulated._m[name], clean.simulated._m[name])
    messages = [r.getMessage() for r in caplog.records]
    assert any("8 -> 4" in m for m in messages) and any("4 -> 2" in m for m in messages), messages
    # The settled chunk is kept for the next call (no new out-of-memory round trip).
    rows.clear()
    ex.compute(pool)
    assert rows == [2, 2, 2, 2]


def test_out_of_memory_at_chunk_one_and_other_errors_propagate(monkeypatch):
    model = tiny_llama(seed=12)
    _record_chunks(monkeypatch, fail_above=0, message="CUDA error: out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):
        GradFeatureExtractor(model, chunk_size=2, **OPTIONS).compute(make_batch(n=3, seed=13))
    _record_chunks(monkeypatch, fail_above=1, message="shape mismatch")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        GradFeatureExtractor(model, chunk_size=4, **OPTIONS).compute(make_batch(n=3, seed=13))


def test_is_out_of_memory_recognises_composers_messages():
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("x"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_out_of_memory(ValueError("CUDA out of memory"))


def test_chunk_size_option_accepts_auto_or_a_positive_int():
    base = dict(
        normalization="none",
        sketch_dim=8,
        proj_dim=None,
        adam_betas=(0.9, 0.99),
        adam_eps=1e-8,
        precondition="pool",
    )
    assert feature_option_problems(chunk_size="auto", **base) == []
    assert feature_option_problems(chunk_size=4, **base) == []
    (msg,) = feature_option_problems(chunk_size="big", **base)
    assert "`chunk_size` must be 'auto' or an int >= 1, got 'big'" in msg
    (msg,) = feature_option_problems(chunk_size=0, **base)
    assert "got 0" in msg


def test_logits_are_freed_before_the_backward(monkeypatch):
    # The n x T x V logits are the largest tensor of the scoring pass; the loss's backward does not
    # need them, so they must be gone when it runs (the scoring peak then stays under a training
    # microbatch's, which keeps Composer's state.outputs through its backward).
    import weakref

    import composer_algos.features.capture as capture_module

    model = tiny_llama(seed=14)
    logits_refs: list[weakref.ref] = []
    model.lm_head.register_forward_hook(lambda m, a, out: logits_refs.append(weakref.ref(out)))
    alive_at_backward: list[bool] = []
    real_grad = torch.autograd.grad

    def spy(*args, **kwargs):
        alive_at_backward.append(logits_refs[-1]() is not None)
        return real_grad(*args, **kwargs)

    monkeypatch.setattr(capture_module.torch.autograd, "grad", spy)
    GradFeatureExtractor(model, **OPTIONS).compute(make_batch(n=3, seed=15))
    assert alive_at_backward == [False]
