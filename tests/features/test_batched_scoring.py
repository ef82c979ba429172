"""The features pass in few, large kernels (issue 31.2): layers, rows and windows batched, same features.

Each eager op is a kernel launch on a GPU, so the pass batches what it used to loop over: every
sketched target's products and FJLT in one stacked computation, and the windows of the pool and of
the validation batch in the same forwards (a window is t of a row's T tokens, so T / t windows take
one row's place in the microbatch). Each is checked against the layer-by-layer / batch-by-batch
computation it replaces.
"""

from __future__ import annotations

import pytest
import torch

from composer_algos.features import GradFeatureExtractor
from composer_algos.features.projection import apply_fjlt, fjlt_stack, make_fjlt_plan, stack_fjlt_plans
from tests.common.models import tiny_llama
from tests.features.helpers import compute_or_skip_without_compiler


@pytest.mark.parametrize("dim_out", [40, 300])  # an FFT projection (d < D), an embedding (d >= D)
def test_stacked_fjlt_is_the_sum_of_the_layers_projections(dim_out):
    L, n, D = 4, 5, 96
    x = torch.randn(L, n, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    plans = [make_fjlt_plan(3, layer, D, dim_out, dtype=torch.float64) for layer in range(L)]
    expected = torch.zeros(n, dim_out, dtype=torch.float64)
    for layer in range(L):
        apply_fjlt(x[layer], plans[layer], expected)
    torch.testing.assert_close(fjlt_stack(x, stack_fjlt_plans(plans)), expected, rtol=1e-12, atol=1e-12)


def test_plans_of_different_widths_do_not_stack():
    with pytest.raises(ValueError, match="share their input width"):
        stack_fjlt_plans([make_fjlt_plan(0, 0, 10, 4), make_fjlt_plan(0, 1, 12, 4)])


def _adam_state(model: torch.nn.Module, batch: dict) -> torch.optim.Optimizer:
    """An AdamW with second moments for every parameter (one step on `batch`)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def _batch(n: int, T: int, seed: int) -> dict:
    ids = torch.randint(0, 128, (n, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("normalization", ["adam_optimizer", "adam_simulated", "none"])
@pytest.mark.parametrize("proj_dim", [48, 0])
def test_batched_sketched_layers_give_the_layer_by_layer_features(normalization, proj_dim):
    model = tiny_llama(seed=3, dtype=torch.float64)
    pool, val = _batch(6, 12, seed=1), _batch(3, 12, seed=2)
    opt = _adam_state(model, pool)
    kw = dict(
        exact_max_numel=0,  # every target sketched: the batched path
        last_n_blocks=2,
        include_lm_head=True,
        sketch_dim=(4, 5),
        normalization=normalization,
        proj_dim=proj_dim,
        chunk_size=4,
        precondition="split",  # Adam scales on both sides: each side's projections are its own
    )
    batched, looped = GradFeatureExtractor(model, **kw), GradFeatureExtractor(model, **kw)
    assert batched._all_sketched
    looped._all_sketched = False  # the layer-by-layer path it replaces
    for _ in range(2):  # twice: the simulated filter's state moves with the first call
        G_b, g_b = batched.compute(pool, val, optimizer=opt)
        G_l, g_l = looped.compute(pool, val, optimizer=opt)
        torch.testing.assert_close(G_b, G_l, rtol=1e-9, atol=1e-12 * float(G_l.abs().max()))
        torch.testing.assert_close(g_b, g_l, rtol=1e-9, atol=1e-12 * float(g_l.abs().max()))


def _count_forwards(model: torch.nn.Module) -> list[int]:
    rows: list[int] = []
    model.model.embed_tokens.register_forward_hook(lambda mod, args, out: rows.append(int(args[0].shape[0])))
    return rows


@pytest.mark.parametrize("sketched", [True, False])
def test_windows_of_the_pool_and_the_validation_batch_share_a_forward(sketched):
    model = tiny_llama(seed=5, dtype=torch.float64)
    forwards = _count_forwards(model)
    pool, val = _batch(6, 32, seed=3), _batch(2, 32, seed=4)
    kw = dict(
        score_window=8, score_window_position="random", normalization="none", proj_dim=40, last_n_blocks=1,
        exact_max_numel=0 if sketched else 65536, seed=2,
    )
    joint, apart = GradFeatureExtractor(model, **kw), GradFeatureExtractor(model, **kw)
    apart._joint_windows = lambda *_: False  # the batch-by-batch scoring it replaces
    # A microbatch of 2 rows of 32 tokens holds 8 windows of 8 tokens.
    assert joint._rows_per_forward(2, 32) == 8 and joint._rows_per_forward(2, 8) == 2
    G_j, g_j = joint.compute(pool, val, step=7, auto_chunk_size=2)
    assert forwards == [8], forwards  # pool (6) and validation (2) windows in one forward
    assert joint.chunk_size_in_use == 8
    forwards.clear()
    G_a, g_a = apart.compute(pool, val, step=7, auto_chunk_size=2)
    assert forwards == [6, 2]
    torch.testing.assert_close(G_j, G_a, rtol=1e-9, atol=1e-12 * float(G_a.abs().max()))
    torch.testing.assert_close(g_j, g_a, rtol=1e-9, atol=1e-12 * float(g_a.abs().max()))


def _biased_llama(seed: int) -> torch.nn.Module:
    """A tiny float64 Llama whose linear layers have biases (sketched with a bias column)."""
    from transformers import LlamaForCausalLM

    from tests.common.models import tiny_llama_config

    cfg = tiny_llama_config()
    cfg.attention_bias, cfg.mlp_bias = True, True
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(torch.float64)


@pytest.mark.parametrize(
    "normalization, precondition, biased",
    [
        ("adam_optimizer", "pool", False),
        ("adam_optimizer", "pool", True),  # per-layer scales (weight and bias): no batched `.flat`
        ("adam_optimizer", "split", False),
        ("adam_optimizer", "both", False),
        ("adam_simulated", "pool", False),
    ],
)
def test_pool_and_validation_windows_with_their_own_preconditioners_share_one_pass(normalization, precondition, biased):
    # Sketched targets: the pool's and the validation batch's rows of a forward go through one pass
    # of products, filter and FJLT, each row with its side's Adam scales (under `pool` the validation
    # side is raw): each row's features are the batch-by-batch ones.
    model = _biased_llama(seed=5) if biased else tiny_llama(seed=5, dtype=torch.float64)
    pool, val = _batch(6, 32, seed=3), _batch(2, 32, seed=4)
    opt = _adam_state(model, pool)
    kw = dict(
        score_window=8, score_window_position="random", normalization=normalization, precondition=precondition,
        proj_dim=40, last_n_blocks=1, exact_max_numel=0, sketch_dim=(4, 5), seed=2,
    )
    joint, apart = GradFeatureExtractor(model, **kw), GradFeatureExtractor(model, **kw)
    apart._joint_windows = lambda *_: False  # the batch-by-batch scoring ...
    apart._all_sketched = False  # ... layer by layer
    # Microbatches of 2 rows: one forward of all 8 windows; of 1 row: forwards of 4 windows, the
    # second holding the last 2 pool windows and the 2 validation windows.
    for step, auto_chunk_size in ((7, 2), (8, 1), (9, 2)):
        G_j, g_j = joint.compute(pool, val, step=step, optimizer=opt, auto_chunk_size=auto_chunk_size)
        G_a, g_a = apart.compute(pool, val, step=step, optimizer=opt, auto_chunk_size=auto_chunk_size)
        torch.testing.assert_close(G_j, G_a, rtol=1e-9, atol=1e-12 * float(G_a.abs().max()))
        torch.testing.assert_close(g_j, g_a, rtol=1e-9, atol=1e-12 * float(g_a.abs().max()))
    assert joint.normalization_in_use == apart.normalization_in_use
    if normalization == "adam_optimizer":
        assert joint.normalization_in_use == f"adam_optimizer/{precondition}"
        raw = GradFeatureExtractor(model, **{**kw, "normalization": "none"})
        G_r, g_r = raw.compute(pool, val, step=9, auto_chunk_size=2)
        assert not torch.allclose(G_r, G_j)  # the pool side is preconditioned
        # ... and the validation side only where the side's power of P is not 0
        assert torch.allclose(g_r, g_j, rtol=1e-9, atol=0) == (precondition == "pool")


def test_windows_in_forwards_of_a_microbatch_of_tokens_each():
    model = tiny_llama(seed=5, dtype=torch.float64)
    forwards = _count_forwards(model)
    ex = GradFeatureExtractor(model, score_window=8, normalization="none", proj_dim=40, chunk_size=1)
    ex.compute(_batch(9, 32, seed=3), _batch(2, 32, seed=4))
    assert forwards == [4, 4, 3]  # 1 row of 32 tokens a forward: 4 windows of 8


@pytest.mark.slow  # inductor compiles C++ on the CPU: 1-3 minutes on a loaded 2-core machine
@pytest.mark.timeout(900)
def test_compiled_products_give_the_eager_features():
    model = tiny_llama(seed=3, dtype=torch.float32)
    pool, val = _batch(6, 16, seed=1), _batch(2, 16, seed=2)
    kw = dict(exact_max_numel=0, last_n_blocks=1, sketch_dim=4, normalization="none", proj_dim=24, score_window=8)
    eager = GradFeatureExtractor(model, **kw)
    compiled = GradFeatureExtractor(model, compile=True, **kw)
    G_e, g_e = eager.compute(pool, val, step=3)
    G_c, g_c = compute_or_skip_without_compiler(compiled, pool, val, step=3)
    torch.testing.assert_close(G_c, G_e, rtol=1e-4, atol=1e-6 * float(G_e.abs().max()))
    torch.testing.assert_close(g_c, g_e, rtol=1e-4, atol=1e-6 * float(g_e.abs().max()))
    assert compiled.compile and not eager.compile


def test_compile_must_be_a_bool():
    with pytest.raises(ValueError, match="`compile` must be true or false, got 'yes'"):
        GradFeatureExtractor(tiny_llama(seed=0), compile="yes")


def test_batched_factored_scales_are_the_layer_by_layer_ones():
    from composer_algos.features.normalize import (
        batched_factored_scales,
        factored_adam_scales,
        optimizer_second_moments,
    )

    layers = [torch.nn.Parameter(torch.zeros(o, i, dtype=torch.float64)) for o, i in ((6, 4), (3, 4), (4, 7))]
    opt = torch.optim.AdamW(layers, lr=1e-3, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # a few steps: second moments that differ by row and column
        for p in layers:
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64) * torch.rand(p.shape[0], 1, generator=gen, dtype=torch.float64)
        opt.step()
    batched = batched_factored_scales(opt, layers, 1e-8)
    assert batched is not None
    for p, (s_out, s_in) in zip(layers, batched):
        ref_out, ref_in = factored_adam_scales(optimizer_second_moments(opt, [p]), 1e-8)
        torch.testing.assert_close(s_out, ref_out, rtol=1e-12, atol=0)
        torch.testing.assert_close(s_in, ref_in, rtol=1e-12, atol=0)
    # The same values concatenated (what the extractor scales its projections with), and raised to a
    # power (the `split` side) in two kernels: each layer's scales raised to it.
    torch.testing.assert_close(batched.flat[0], torch.cat([s_out for s_out, _ in batched]), rtol=0, atol=0)
    torch.testing.assert_close(batched.flat[1], torch.cat([s_in for _, s_in in batched]), rtol=0, atol=0)
    for (s_out, s_in), (p_out, p_in) in zip(batched, batched.powered(0.5)):
        torch.testing.assert_close(p_out, s_out.pow(0.5), rtol=0, atol=0)
        torch.testing.assert_close(p_in, s_in.pow(0.5), rtol=0, atol=0)
    fresh = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
    assert batched_factored_scales(opt, [*layers, fresh], 1e-8) is None  # no state: layer by layer
