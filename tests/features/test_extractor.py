"""GradFeatureExtractor end to end: no side effects, graph cut, shared projection, chunking, errors."""

from __future__ import annotations

import copy

import pytest
import torch

from composer_algos.features import FeatureError, GradFeatureExtractor, per_example_grads
from tests.common.models import tiny_llama
from tests.features.helpers import make_batch, tiny_lora


def _snapshot_optimizer(opt: torch.optim.Optimizer) -> dict:
    return copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize("normalization", ["adam_optimizer", "adam_simulated", "unit"])
@pytest.mark.parametrize("lora", [False, True])
def test_leaves_params_grads_optimizer_and_modes_untouched(normalization, lora):
    model = tiny_lora(seed=0, dropout=0.1) if lora else tiny_llama(seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    batch = make_batch(n=4, seed=1)
    model.train()
    model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
    opt.step()  # optimizer state exists, and .grad holds an accumulated gradient
    model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
    inner = model.get_base_model() if lora else model
    inner.model.layers[0].eval()  # mixed modes must come back exactly
    modes = {name: m.training for name, m in model.named_modules()}
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    requires = {name: p.requires_grad for name, p in model.named_parameters()}
    opt_state = _snapshot_optimizer(opt)

    ex = GradFeatureExtractor(model, normalization=normalization, last_n_blocks=2, proj_dim=40, chunk_size=3)
    G, gbar = ex.compute(make_batch(n=5, seed=2, pad_rows=2), make_batch(n=2, seed=3), step=1, optimizer=opt)
    assert G.shape == (5, 40) and gbar is not None and gbar.shape == (40,)
    assert G.dtype == torch.float32 and G.isfinite().all() and G.abs().sum() > 0

    assert {name: m.training for name, m in model.named_modules()} == modes
    for name, p in model.named_parameters():
        assert torch.equal(p, values[name]), name
        assert p.requires_grad == requires[name], name
        if name in grads:
            assert p.grad is not None and torch.equal(p.grad, grads[name]), name
        else:
            assert p.grad is None, name
    after = _snapshot_optimizer(opt)
    assert after["param_groups"] == opt_state["param_groups"]
    for k, st in opt_state["state"].items():
        for key, val in st.items():
            assert torch.equal(after["state"][k][key], val), (k, key)


def test_eval_mode_during_scoring_gives_deterministic_features_with_dropout():
    model = tiny_lora(seed=4, dropout=0.5, dtype=torch.float64).train()
    batch = make_batch(n=4, seed=5)
    ex = GradFeatureExtractor(model, normalization="none", proj_dim=0)
    G1, _ = ex.compute(batch)
    G2, _ = ex.compute(batch)
    torch.testing.assert_close(G1, G2, rtol=0, atol=0)


def test_no_graph_below_lowest_target_block():
    model = tiny_llama(seed=6, num_hidden_layers=3)
    seen = {}

    def record(name):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            seen[name] = (hidden.requires_grad, torch.is_grad_enabled())

        return hook

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(record(i))
    backward_calls = []
    model.model.layers[0].register_full_backward_hook(lambda *a: backward_calls.append(0))
    model.model.layers[1].register_full_backward_hook(lambda *a: backward_calls.append(1))
    ex = GradFeatureExtractor(model, normalization="none", last_n_blocks=1, proj_dim=16)
    ex.compute(make_batch(n=3, seed=7))
    assert seen[0] == (False, False) and seen[1] == (False, False), seen
    assert seen[2][0], "the target block must be in the graph"
    assert backward_calls == []
    assert torch.is_grad_enabled(), "the caller's grad mode must be restored"


def test_same_projection_for_pool_and_validation_and_chunking_invariance():
    model = tiny_llama(seed=8, dtype=torch.float64)
    pool = make_batch(n=7, seed=9, pad_rows=3)
    kwargs = dict(normalization="none", proj_dim=24, exact_max_numel=5000, sketch_dim=6, seed=3)
    G, gbar = GradFeatureExtractor(model, chunk_size=2, **kwargs).compute(pool, pool)
    torch.testing.assert_close(gbar, G.mean(dim=0))
    G_whole, _ = GradFeatureExtractor(model, chunk_size=16, **kwargs).compute(pool)
    torch.testing.assert_close(G, G_whole)
    # A single validation row lands exactly on its pool row.
    one = {k: v[4:5] for k, v in pool.items()}
    _, gbar_one = GradFeatureExtractor(model, chunk_size=2, **kwargs).compute(pool, one)
    torch.testing.assert_close(gbar_one, G[4])


def test_compression_preserves_gram_of_raw_features():
    model = tiny_llama(seed=10, dtype=torch.float64)
    pool = make_batch(n=8, seed=11)
    raw, _ = GradFeatureExtractor(model, normalization="unit", proj_dim=0).compute(pool)
    ex = GradFeatureExtractor(model, normalization="none", proj_dim=1024)
    assert ex.feature_dim == 1024
    proj, _ = ex.compute(pool)
    norms = proj.norm(dim=1, keepdim=True)
    raw_unnormalised = torch.cat(list(per_example_grads(model, pool, ex.targets).values()), dim=1).float()
    torch.testing.assert_close(norms.squeeze(1), raw_unnormalised.norm(dim=1), rtol=0.15, atol=0)
    cos = (proj / norms) @ (proj / norms).T
    assert (cos - raw @ raw.T).abs().max() < 0.15


def test_defaults_feature_dim_and_targets():
    model = tiny_llama(seed=12)
    ex = GradFeatureExtractor(model)
    assert ex.feature_dim == model.config.hidden_size
    assert ex.target_names == [f"model.layers.1.{m}" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    lora = GradFeatureExtractor(tiny_lora(seed=12), proj_dim=0)
    assert all(".lora_A." in n or ".lora_B." in n for n in lora.target_names)
    assert lora.feature_dim == sum(t.d_out * t.d_in for t in lora.targets)
    assert GradFeatureExtractor(model, include_lm_head=True, exact_max_numel=1000, sketch_dim=(3, 5), proj_dim=0).feature_dim == 8 * 15
    assert GradFeatureExtractor(model, proj_dim=10**9).feature_dim == sum(t.d_out * t.d_in for t in ex.targets)


def test_bad_specs_raise_value_error_with_candidates():
    model = tiny_llama(seed=13)
    with pytest.raises(ValueError, match=r"no target module matches.*model\.layers\.1\.mlp\.up_proj"):
        GradFeatureExtractor(model, target_modules=["nonexistent"])
    with pytest.raises(ValueError, match="last_n_blocks"):
        GradFeatureExtractor(model, last_n_blocks=5)
    with pytest.raises(ValueError, match="normalization"):
        GradFeatureExtractor(model, normalization="adam")
    with pytest.raises(TypeError, match="PreTrainedModel"):
        GradFeatureExtractor(torch.nn.Linear(2, 2))


def test_all_zero_features_raise_feature_error():
    model = tiny_llama(seed=14)
    batch = make_batch(n=3, seed=15)
    batch["labels"][:] = -100
    ex = GradFeatureExtractor(model, normalization="none", proj_dim=16)
    with pytest.raises(FeatureError, match="all 3 pool feature rows are zero"):
        ex.compute(batch)
    good = make_batch(n=3, seed=16)
    with pytest.raises(FeatureError, match="gbar is all zero"):
        ex.compute(good, batch)


def test_non_finite_features_raise_feature_error_naming_layers():
    model = tiny_llama(seed=17)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    ex = GradFeatureExtractor(model, normalization="adam_simulated", proj_dim=16)
    with pytest.raises(FeatureError, match=r"non-finite.*model\.layers\.1\.mlp\.down_proj"):
        ex.compute(make_batch(n=3, seed=18))
    assert ex.simulated.count == 0, "a failed call must not advance the simulated-Adam state"


def test_resample_projections_folds_in_step():
    model = tiny_llama(seed=19)
    batch = make_batch(n=4, seed=20)
    fixed = GradFeatureExtractor(model, normalization="none", proj_dim=16, exact_max_numel=0, sketch_dim=8)
    torch.testing.assert_close(fixed.compute(batch, step=0)[0], fixed.compute(batch, step=5)[0], rtol=0, atol=0)
    moving = GradFeatureExtractor(
        model, normalization="none", proj_dim=16, exact_max_numel=0, sketch_dim=8, resample_projections=True
    )
    G0, gbar0 = moving.compute(batch, batch, step=0)
    G1, _ = moving.compute(batch, step=1)
    assert not torch.allclose(G0, G1)
    torch.testing.assert_close(gbar0, G0.mean(dim=0))  # pool and validation share the step's projection
    torch.testing.assert_close(moving.compute(batch, step=0)[0], G0, rtol=0, atol=0)


def test_ddp_wrapped_composer_model_is_unwrapped(tmp_path):
    import torch.distributed as dist
    from composer.models import HuggingFaceModel

    model = tiny_llama(seed=21)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(HuggingFaceModel(model, tokenizer=None, use_logits=True))
        ex = GradFeatureExtractor(wrapped, normalization="none", proj_dim=16)
        assert ex.model is model
        G, _ = ex.compute(make_batch(n=3, seed=22))
        assert G.shape == (3, 16)
        assert all(p.grad is None for p in model.parameters())
    finally:
        dist.destroy_process_group()


def test_spearman_matches_hand_computed_ranks():
    from composer_algos.features import spearman

    # ranks a: [0, 2, 1, 3]; ranks b: [0, 1, 2, 3]; d = [0, 1, -1, 0] -> 1 - 6 * 2 / (4 * 15) = 0.8
    assert spearman(torch.tensor([1.0, 5.0, 3.0, 9.0]), torch.tensor([2.0, 3.0, 4.0, 5.0])) == pytest.approx(0.8)
    # ties get their average rank: [0.5, 0.5, 2] against [0, 1, 2] -> Pearson of ranks = sqrt(3) / 2
    assert spearman(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([1.0, 2.0, 3.0])) == pytest.approx(3**0.5 / 2)


def test_fidelity_is_exact_uncompressed_and_falls_with_width():
    model = tiny_llama(seed=3)
    pool, val = make_batch(n=24, seed=4), make_batch(n=3, seed=5)
    raw = GradFeatureExtractor(model, normalization="none", proj_dim=0).fidelity(pool, val)
    assert raw["score_spearman"] == pytest.approx(1.0) and raw["gram_rel_error"] == pytest.approx(0.0, abs=1e-12)
    narrow = [GradFeatureExtractor(model, normalization="none", proj_dim=4, seed=s).fidelity(pool, val) for s in range(6)]
    wide = [GradFeatureExtractor(model, normalization="none", proj_dim=1024, seed=s).fidelity(pool, val) for s in range(6)]
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    assert mean(wide, "score_spearman") > mean(narrow, "score_spearman")
    assert mean(wide, "gram_rel_error") < mean(narrow, "gram_rel_error")
