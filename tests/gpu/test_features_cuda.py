"""Gradient features on CUDA: parity with the CPU in float32, and bf16 autocast against float32 (issue 12.5)."""

from __future__ import annotations

import pytest
import torch
from composer.core.precision import get_precision_context

from composer_algos.features import GradFeatureExtractor
from tests.common.models import tiny_llama
from tests.features.helpers import make_batch

pytestmark = pytest.mark.gpu

OPTIONS = dict(normalization="none", proj_dim=64, sketch_dim=16, seed=7)


def _small_llama(device: torch.device) -> torch.nn.Module:
    """A small Llama (4 blocks, hidden 256, vocab 2048): big enough for bf16 rounding to matter."""
    return tiny_llama(
        seed=3,
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    ).to(device)


def _row_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1)


@pytest.mark.parametrize("normalization", ["none", "adam_optimizer"])
def test_cuda_features_match_cpu_in_float32(cuda, normalization):
    model = tiny_llama(seed=1)
    pool, val = make_batch(n=8, seed=2, pad_rows=3), make_batch(n=4, seed=3)
    optimizer = None
    if normalization == "adam_optimizer":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(**pool).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    options = {**OPTIONS, "normalization": normalization, "exact_max_numel": 5000}
    G_cpu, g_cpu = GradFeatureExtractor(model, **options).compute(pool, val, optimizer=optimizer)
    model.to(cuda)  # moves the parameters in place; the optimizer state is moved by hand
    if optimizer is not None:
        for st in optimizer.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    st[k] = v.to(cuda)
    G_gpu, g_gpu = GradFeatureExtractor(model, **options).compute(pool, val, optimizer=optimizer)
    assert G_gpu.device.type == "cuda" and G_gpu.dtype == torch.float32
    torch.testing.assert_close(G_gpu.cpu(), G_cpu, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(g_gpu.cpu(), g_cpu, rtol=1e-3, atol=1e-5)


def test_bf16_autocast_features_within_cosine_099_of_float32(cuda):
    model = _small_llama(cuda)
    pool = make_batch(n=16, T=128, vocab=2048, seed=4, pad_rows=4)
    val = make_batch(n=8, T=128, vocab=2048, seed=5)
    seen: list[torch.dtype] = []
    hook = model.model.layers[-1].mlp.down_proj.register_forward_hook(lambda m, a, o: seen.append(a[0].dtype))
    try:
        G32, g32 = GradFeatureExtractor(model, **OPTIONS).compute(
            pool, val, precision_context=lambda: get_precision_context("fp32")
        )
        seen.clear()
        G16, g16 = GradFeatureExtractor(model, **OPTIONS).compute(
            pool, val, precision_context=lambda: get_precision_context("amp_bf16")
        )
    finally:
        hook.remove()
    assert set(seen) == {torch.bfloat16}, seen
    assert G16.dtype == torch.float32 and torch.isfinite(G16).all() and torch.isfinite(g16).all()
    cos = _row_cosine(G16, G32)
    assert cos.min() >= 0.99, f"per-row cosine bf16 vs fp32: min {cos.min():.4f}, mean {cos.mean():.4f}"
    assert float(_row_cosine(g16[None], g32[None])) >= 0.99


def test_scoring_peak_memory_at_most_a_training_microbatch(cuda):
    model = _small_llama(cuda)
    pool = make_batch(n=8, T=128, vocab=2048, seed=6)
    ctx = lambda: get_precision_context("amp_bf16")  # noqa: E731
    ex = GradFeatureExtractor(model, **OPTIONS)
    ex.compute(pool, precision_context=ctx, auto_chunk_size=8)  # warm-up (projection caches)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ex.compute(pool, precision_context=ctx, auto_chunk_size=8)
    score = torch.cuda.max_memory_allocated() - base
    gpu_pool = {k: v.to(cuda) for k, v in pool.items()}
    model.train()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with ctx():
        outputs = model(**gpu_pool)  # held through the backward, as Composer holds state.outputs
    outputs.loss.backward()
    train = torch.cuda.max_memory_allocated() - base
    print(f"peak MB over the model: scoring {score / 2**20:.1f}, training microbatch {train / 2**20:.1f}")
    assert score <= train, (
        f"scoring peak {score / 2**20:.1f} MB > training microbatch peak {train / 2**20:.1f} MB"
    )


@pytest.mark.parametrize("precision", ["fp32", "amp_bf16"])
def test_compiled_blocks_below_the_cut_give_the_eager_features_on_cuda(cuda, precision):
    """`compile_forward` (mode reduce-overhead: the blocks below the cut replayed as CUDA graphs), two steps."""
    model = _small_llama(cuda)
    pool = make_batch(n=16, T=128, vocab=2048, seed=4)
    val = make_batch(n=8, T=128, vocab=2048, seed=5)
    ctx = lambda: get_precision_context(precision)  # noqa: E731
    eager = GradFeatureExtractor(model, score_window=64, **OPTIONS)
    compiled = GradFeatureExtractor(model, score_window=64, compile_forward=True, **OPTIONS)
    assert compiled._compiled_below is not None and compiled._compiled_below.mode == "reduce-overhead"
    for step in (1, 2):  # the second call replays the recorded graphs
        G_e, g_e = eager.compute(pool, val, step=step, precision_context=ctx)
        G_c, g_c = compiled.compute(pool, val, step=step, precision_context=ctx)
        cos = _row_cosine(G_c, G_e)
        assert cos.min() >= (0.9999 if precision == "fp32" else 0.99), f"step {step}: min row cosine {cos.min():.5f}"
        assert float(_row_cosine(g_c[None], g_e[None])) >= 0.99
