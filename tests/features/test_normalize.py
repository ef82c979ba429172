"""Adam normalisations (optimizer second moment, exact and factored; the paper's simulated filter) and unit rows."""

from __future__ import annotations

import pytest
import torch

from composer_algos.features import GradFeatureExtractor, SimulatedAdam, per_example_grads, sketch_matrices
from composer_algos.features.normalize import factored_adam_scales, optimizer_second_moments, unit_rows
from tests.common.models import tiny_llama
from tests.features.helpers import make_batch


def _train_steps(model, optimizer, steps: int, seed: int = 100) -> None:
    for s in range(steps):
        batch = make_batch(n=4, seed=seed + s)
        optimizer.zero_grad()
        model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
        optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("opt_name", ["adamw", "decoupled_adamw"])
def test_optimizer_second_moments_bias_corrected(opt_name):
    model = tiny_llama(seed=0)
    if opt_name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    else:
        from composer.optim import DecoupledAdamW

        opt = DecoupledAdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    p = model.model.layers[1].mlp.up_proj.weight
    assert optimizer_second_moments(opt, [p]) is None, "no state before the first step"
    assert optimizer_second_moments(None, [p]) is None
    _train_steps(model, opt, 3)
    (v_hat,) = optimizer_second_moments(opt, [p])
    torch.testing.assert_close(v_hat, opt.state[p]["exp_avg_sq"] / (1 - 0.95**3))


def test_adam_optimizer_exact_is_elementwise_preconditioning():
    model = tiny_llama(seed=1, dtype=torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = make_batch(n=5, seed=2)
    ex = GradFeatureExtractor(model, normalization="adam_optimizer", proj_dim=0, target_modules=["v_proj", "up_proj"])
    G0, _ = ex.compute(batch, optimizer=opt)
    assert ex.normalization_in_use == "none", "step 0: the optimizer has no state yet"
    raw = per_example_grads(model, batch, ex.targets, mode="exact")
    torch.testing.assert_close(G0, torch.cat(list(raw.values()), dim=1).float())

    _train_steps(model, opt, 2)
    G, _ = ex.compute(batch, optimizer=opt)
    assert ex.normalization_in_use == "adam_optimizer/pool"  # the default side
    raw = per_example_grads(model, batch, ex.targets, mode="exact")
    expected = []
    for t in ex.targets:
        st = opt.state[t.module.weight]
        v_hat = st["exp_avg_sq"] / (1 - 0.999 ** st["step"])
        expected.append(raw[t.name] / (v_hat.sqrt() + 1e-8).reshape(-1))
    torch.testing.assert_close(G, torch.cat(expected, dim=1).float())


@pytest.mark.parametrize("side, power", [("pool", 1.0), ("split", 1.0), ("both", 2.0)])
def test_precondition_side_sets_the_power_of_p_in_the_scores(side, power):
    """<x_i, xbar> = g_i^T P^power g_val: P once for `pool` and `split`, squared only for `both`."""
    model = tiny_llama(seed=1, dtype=torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train_steps(model, opt, 2)
    pool, val = make_batch(n=5, seed=2), make_batch(n=3, seed=9)
    ex = GradFeatureExtractor(
        model, normalization="adam_optimizer", precondition=side, proj_dim=0, target_modules=["v_proj", "up_proj"]
    )
    G, gbar = ex.compute(pool, val, optimizer=opt)
    assert ex.normalization_in_use == f"adam_optimizer/{side}"
    raw_pool = per_example_grads(model, pool, ex.targets, mode="exact")
    raw_val = per_example_grads(model, val, ex.targets, mode="exact")
    expected = torch.zeros(5, dtype=torch.float64)
    for t in ex.targets:
        st = opt.state[t.module.weight]
        P = 1.0 / ((st["exp_avg_sq"] / (1 - 0.999 ** st["step"])).sqrt() + 1e-8).reshape(-1)
        expected += raw_pool[t.name] @ (P**power * raw_val[t.name].mean(dim=0))
    torch.testing.assert_close((G.double() @ gbar.double()), expected, rtol=1e-4, atol=0)


def test_a_target_without_optimizer_state_is_used_raw_and_the_others_preconditioned(caplog):
    """A frozen lm_head under LoRA with include_lm_head: only that layer goes unpreconditioned (issue 20.5)."""
    from tests.features.helpers import tiny_lora

    model = tiny_lora(seed=1, dtype=torch.float64)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ex = GradFeatureExtractor(model, include_lm_head=True, proj_dim=0)
    frozen = [t.name for t in ex.targets if not t.params[0].requires_grad]
    assert len(frozen) == 1 and "lm_head" in frozen[0] and len(ex.targets) > 1
    batch = make_batch(n=5, seed=2)
    with caplog.at_level("WARNING", logger="composer_algos.features.extractor"):
        ex.compute(batch, optimizer=opt)
        at_step_0 = ex.normalization_in_use, getattr(ex, "preconditioned_fraction", None)
        _train_steps(model, opt, 2)
        G, _ = ex.compute(batch, optimizer=opt)
        ex.compute(batch, optimizer=opt)
    raw = per_example_grads(model, batch, ex.targets, mode="exact")
    expected = []
    for t in ex.targets:
        if t.name in frozen:
            expected.append(raw[t.name])
            continue
        scale = torch.cat(
            [
                ((opt.state[p]["exp_avg_sq"] / (1 - 0.999 ** opt.state[p]["step"])).sqrt() + 1e-8).reciprocal().reshape(-1)
                for p in t.params
            ]
        )
        expected.append(raw[t.name] * scale)
    torch.testing.assert_close(G, torch.cat(expected, dim=1).float())
    assert at_step_0 == ("none", 0.0)  # no layer has optimizer state yet
    n = len(ex.targets)
    assert ex.preconditioned_fraction == pytest.approx((n - 1) / n)
    assert ex.normalization_in_use.startswith("adam_optimizer/pool")
    named = [r.getMessage() for r in caplog.records if frozen[0] in r.getMessage()]
    assert len(named) == 1, named  # once, naming the layer


def test_targets_all_without_state_after_steps_are_named_once(caplog):
    model = tiny_llama(seed=1)
    ex = GradFeatureExtractor(model, proj_dim=0, target_modules=["v_proj"])
    frozen = {id(p) for t in ex.targets for p in t.params}
    opt = torch.optim.Adam([p for p in model.parameters() if id(p) not in frozen], lr=1e-3)
    _train_steps(model, opt, 1)
    with caplog.at_level("WARNING", logger="composer_algos.features.extractor"):
        ex.compute(make_batch(n=3, seed=2), optimizer=opt)
        ex.compute(make_batch(n=3, seed=3), optimizer=opt)
    assert ex.normalization_in_use == "none" and ex.preconditioned_fraction == 0.0
    named = [r.getMessage() for r in caplog.records if ex.target_names[0] in r.getMessage()]
    assert len(named) == 1 and "taken steps" in named[0], caplog.text


def test_precondition_side_is_validated():
    with pytest.raises(ValueError, match="precondition"):
        GradFeatureExtractor(tiny_llama(seed=0), precondition="twice")


def test_factored_scales_exact_for_rank_one_second_moment():
    gen = torch.Generator().manual_seed(3)
    r = torch.rand(12, generator=gen, dtype=torch.float64) + 0.1
    c = torch.rand(9, generator=gen, dtype=torch.float64) + 0.1
    v = torch.outer(r, c) * 1e-4
    s_out, s_in = factored_adam_scales([v], eps=1e-16)
    torch.testing.assert_close(torch.outer(s_out, s_in), v.rsqrt(), rtol=1e-6, atol=0)
    s_out_b, s_in_b = factored_adam_scales([v[:, :-1], v[:, -1]], eps=1e-16)  # last column as a bias
    torch.testing.assert_close(torch.outer(s_out_b, s_in_b), v.rsqrt(), rtol=1e-6, atol=0)


def test_adam_optimizer_sketch_uses_factored_preconditioner():
    model = tiny_llama(seed=4, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_batch(n=4, seed=5)
    ex = GradFeatureExtractor(
        model, normalization="adam_optimizer", proj_dim=0, exact_max_numel=0, sketch_dim=(6, 5),
        target_modules=["down_proj"], seed=11,
    )
    (t,) = ex.targets
    gen = torch.Generator().manual_seed(6)
    r = torch.rand(t.d_out, generator=gen, dtype=torch.float64) + 0.5
    c = torch.rand(t.d_in, generator=gen, dtype=torch.float64) + 0.5
    opt.state[t.module.weight] = {
        "step": torch.tensor(4.0),
        "exp_avg": torch.zeros_like(t.module.weight),
        "exp_avg_sq": torch.outer(r, c) * 1e-3,
    }
    G, _ = ex.compute(batch, optimizer=opt)
    assert ex.normalization_in_use == "adam_optimizer/pool"  # the default side
    # Reference: the full per-example gradient, preconditioned elementwise (v is rank one, so the
    # factored fit is exact), then sketched with the extractor's seeded projections.
    grads = per_example_grads(model, batch, ex.targets, mode="exact")[t.name].reshape(4, t.d_out, t.d_in)
    v_hat = torch.outer(r, c) * 1e-3 / (1 - 0.999**4)
    P_out, P_in = sketch_matrices(11, t.index, t.d_out, t.d_in, 6, 5, dtype=torch.float64)
    expected = torch.stack([(P_out @ (g / (v_hat.sqrt() + 1e-8)) @ P_in.T).reshape(-1) for g in grads])
    torch.testing.assert_close(G, expected.float(), rtol=1e-4, atol=1e-6)


def _simulated_reference(rounds: list[torch.Tensor], betas=(0.9, 0.99), eps=1e-8) -> list[torch.Tensor]:
    """Coordinate-by-coordinate loop of the paper's filter with bias correction; state moves with the pool mean."""
    b1, b2 = betas
    D = rounds[0].shape[1]
    m, v = [0.0] * D, [0.0] * D
    outs = []
    for t, g in enumerate(rounds, start=1):
        out = torch.zeros_like(g)
        for i in range(g.shape[0]):
            for j in range(D):
                mi = b1 * m[j] + (1 - b1) * g[i, j].item()
                vi = b2 * v[j] + (1 - b2) * g[i, j].item() ** 2
                out[i, j] = (mi / (1 - b1**t)) / ((vi / (1 - b2**t)) ** 0.5 + eps)
        for j in range(D):
            m[j] = b1 * m[j] + (1 - b1) * g[:, j].mean().item()
            v[j] = b2 * v[j] + (1 - b2) * (g[:, j] ** 2).mean().item()
        outs.append(out)
    return outs


def test_simulated_adam_matches_loop_and_resumes():
    gen = torch.Generator().manual_seed(7)
    rounds = [torch.randn(4, 6, generator=gen, dtype=torch.float64) * (k + 1) for k in range(4)]
    expected = _simulated_reference(rounds)
    sim = SimulatedAdam(betas=(0.9, 0.99), eps=1e-8)
    for k, g in enumerate(rounds):
        if k == 2:  # checkpoint / resume mid-way
            state = sim.state_dict()
            sim = SimulatedAdam(betas=(0.9, 0.99), eps=1e-8)
            sim.load_state_dict(state)
        got = sim.filter("layer", g)
        sim.accumulate("layer", g[:2])
        sim.accumulate("layer", g[2:])  # chunks accumulate to the pool mean
        sim.commit()
        torch.testing.assert_close(got, expected[k])
    # Step 1 is sign(g)-like.
    torch.testing.assert_close(expected[0], rounds[0] / (rounds[0].abs() + 1e-8))


def test_extractor_simulated_state_roundtrip():
    model = tiny_llama(seed=8)
    kwargs = dict(normalization="adam_simulated", proj_dim=32, exact_max_numel=0, sketch_dim=8)
    ex = GradFeatureExtractor(model, **kwargs)
    batches = [make_batch(n=4, seed=20 + s) for s in range(3)]
    ex.compute(batches[0], step=0)
    G1, _ = ex.compute(batches[1], step=1)
    assert ex.normalization_in_use == "adam_simulated"
    assert not torch.allclose(G1, GradFeatureExtractor(model, **kwargs).compute(batches[1])[0]), "state must matter"
    state = ex.state_dict()
    G2, gbar2 = ex.compute(batches[2], batches[0], step=2)
    fresh = GradFeatureExtractor(model, **kwargs)
    fresh.load_state_dict(state)
    G2b, gbar2b = fresh.compute(batches[2], batches[0], step=2)
    torch.testing.assert_close(G2b, G2, rtol=0, atol=0)
    torch.testing.assert_close(gbar2b, gbar2, rtol=0, atol=0)
    other = GradFeatureExtractor(model, **{**kwargs, "sketch_dim": 4})
    with pytest.raises(ValueError, match="sketch_dim"):
        other.load_state_dict(state)


def test_unit_rows_and_unit_normalization():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1e-30, 0.0]])
    torch.testing.assert_close(unit_rows(x), torch.tensor([[0.6, 0.8], [0.0, 0.0], [1.0, 0.0]]))
    model = tiny_llama(seed=9)
    G, gbar = GradFeatureExtractor(model, normalization="unit", proj_dim=48).compute(make_batch(n=5), make_batch(n=3, seed=1))
    torch.testing.assert_close(G.norm(dim=1), torch.ones(5))
    assert gbar.norm() <= 1.0 + 1e-6
