"""`features.compile_forward`: the blocks below the cut compiled for the scoring forward (issue 31.2).

The compiled blocks must give the eager features, share one graph, and be in the model only while a
scoring forward runs (the training forward, checkpoints and module names never see them).
"""

from __future__ import annotations

import pytest
import torch

from composer_algos.features import GradFeatureExtractor
from composer_algos.features.compiled_forward import CompiledBlocksBelowCut
from composer_algos.features.targets import choose_cut_module, resolve_targets
from tests.common.models import tiny_llama
from tests.features.helpers import compute_or_skip_without_compiler


def _batch(n: int, T: int, seed: int) -> dict:
    ids = torch.randint(0, 128, (n, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _below(model, **kw):
    return CompiledBlocksBelowCut(model, choose_cut_module(model, resolve_targets(model, **kw)))


def test_the_blocks_below_the_cut_stand_in_only_inside_the_context():
    model = tiny_llama(seed=0, num_hidden_layers=4)
    originals = list(model.model.layers)
    below = _below(model, last_n_blocks=1)  # the cut is the top block: three below it
    assert below.below == 3 and len(below.compiled) == 3
    with below.swapped():
        inside = list(model.model.layers)
    assert [getattr(b, "_orig_mod", None) for b in inside[:3]] == originals[:3]
    assert inside[3] is originals[3]  # the cut block and above stay eager
    assert list(model.model.layers) == originals
    with pytest.raises(RuntimeError, match="boom"), below.swapped():
        raise RuntimeError("boom")
    assert list(model.model.layers) == originals  # put back after an error too
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in tiny_llama(seed=0, num_hidden_layers=4).named_parameters()]


def test_a_cut_above_the_blocks_compiles_them_all_and_a_cut_at_the_first_none():
    model = tiny_llama(seed=0, num_hidden_layers=3)
    assert _below(model, last_n_blocks=0, include_lm_head=True).below == 3
    assert _below(model, last_n_blocks=3).below == 0


def test_wrapped_blocks_below_the_cut_are_refused():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_llama(seed=0, num_hidden_layers=3)
    for i, block in enumerate(list(model.model.layers)):  # as Composer's activation checkpointing wraps them
        model.model.layers[i] = checkpoint_wrapper(block)
    with pytest.raises(ValueError, match=r"compile_forward: the blocks below the cut are wrapped \(CheckpointWrapper\)"):
        _below(model, last_n_blocks=1)


def test_compile_forward_must_be_a_bool():
    with pytest.raises(ValueError, match="`compile_forward` must be true or false, got 'yes'"):
        GradFeatureExtractor(tiny_llama(seed=0), compile_forward="yes")


@pytest.mark.slow  # inductor compiles C++ on the CPU: 1-3 minutes on a loaded 2-core machine
@pytest.mark.timeout(900)
def test_compiled_blocks_give_the_eager_features_with_one_graph_for_every_block():
    from torch._dynamo.utils import counters

    model = tiny_llama(seed=3, dtype=torch.float32, num_hidden_layers=4)
    pool, val = _batch(6, 16, seed=1), _batch(2, 16, seed=2)
    kw = dict(exact_max_numel=0, last_n_blocks=1, sketch_dim=4, normalization="none", proj_dim=24, score_window=8)
    eager = GradFeatureExtractor(model, **kw)
    compiled = GradFeatureExtractor(model, compile_forward=True, **kw)
    G_e, g_e = eager.compute(pool, val, step=3)
    torch._dynamo.reset()
    counters.clear()
    G_c, g_c = compute_or_skip_without_compiler(compiled, pool, val, step=3)
    # The pool's and the validation rows' windows are one forward of one shape: the three blocks below
    # the cut run one compiled graph, three times.
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch.testing.assert_close(G_c, G_e, rtol=1e-4, atol=1e-6 * float(G_e.abs().max()))
    torch.testing.assert_close(g_c, g_e, rtol=1e-4, atol=1e-6 * float(g_e.abs().max()))
    G_2, _ = compiled.compute(pool, val, step=4)  # the next step replays the graph: no new one
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(G_2, G_c, rtol=1e-6, atol=0.0)
    assert all(not hasattr(b, "_orig_mod") for b in model.model.layers)
