"""DoReMi's functional core against hand computations and slow loop references."""

# Shapes: B examples, T tokens, V vocabulary, C domains.

from __future__ import annotations

import math

import pytest
import torch

from composer_algos.doremi.core import (
    clipped_excess_sums,
    domain_sums,
    domain_token_counts,
    doremi_update,
    excess_per_domain,
    per_token_losses,
    resolve_initial_weights,
    weighted_domain_loss,
)
from tests.common.models import tiny_llama


def test_update_matches_hand_computation_on_three_domains():
    alpha = [0.5, 0.3, 0.2]
    lam = [0.1, 0.0, 0.4]
    eta, c = 1.0, 1e-3
    # By hand: alpha_c * exp(eta * lam_c), normalised, then mixed with uniform.
    unnorm = [0.5 * math.exp(0.1), 0.3 * math.exp(0.0), 0.2 * math.exp(0.4)]
    z = sum(unnorm)
    expected = [(1 - c) * u / z + c / 3 for u in unnorm]
    got = doremi_update(torch.tensor(alpha, dtype=torch.float64), torch.tensor(lam, dtype=torch.float64),
                        eta_dro=eta, smoothing=c)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-15)
    # The literal numbers, so a change in the formula cannot hide behind a matching rewrite above.
    torch.testing.assert_close(got, torch.tensor([0.4799655, 0.2607268, 0.2593076], dtype=torch.float64),
                               rtol=0, atol=1e-7)


def test_update_eta_and_smoothing_edge_cases():
    alpha = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    lam = torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64)
    # Full smoothing: uniform whatever the scores.
    torch.testing.assert_close(doremi_update(alpha, lam, eta_dro=5.0, smoothing=1.0), torch.full((3,), 1 / 3,
                               dtype=torch.float64))
    # Equal scores leave the weights unchanged when there is no smoothing.
    torch.testing.assert_close(doremi_update(alpha, torch.full((3,), 0.7, dtype=torch.float64), smoothing=0.0), alpha)
    # Larger eta moves more mass to the domain with the largest score.
    small = doremi_update(alpha, lam, eta_dro=0.1, smoothing=0.0)
    large = doremi_update(alpha, lam, eta_dro=2.0, smoothing=0.0)
    assert large[1] > small[1] > alpha[1]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("num_domains", [2, 8])
def test_update_stays_on_simplex_over_many_steps(seed, num_domains):
    gen = torch.Generator().manual_seed(seed)
    alpha = torch.full((num_domains,), 1.0 / num_domains, dtype=torch.float64)
    c = 1e-3
    for _ in range(200):
        lam = torch.rand(num_domains, generator=gen, dtype=torch.float64) * 50.0  # big scores: overflow guard
        alpha = doremi_update(alpha, lam, eta_dro=1.0, smoothing=c)
        assert torch.isfinite(alpha).all()
        assert abs(alpha.sum().item() - 1.0) < 1e-12
        assert (alpha >= c / num_domains - 1e-15).all()


def test_update_float32_stays_on_simplex():
    alpha = torch.tensor([0.9, 0.05, 0.05])
    alpha = doremi_update(alpha, torch.tensor([0.0, 100.0, 3.0]))
    assert alpha.dtype == torch.float32
    assert abs(alpha.sum().item() - 1.0) < 1e-6
    assert alpha[1] > 0.99


def test_update_rejects_bad_shapes_and_smoothing():
    with pytest.raises(ValueError, match="shape"):
        doremi_update(torch.ones(3) / 3, torch.zeros(2))
    with pytest.raises(ValueError, match="smoothing"):
        doremi_update(torch.ones(3) / 3, torch.zeros(3), smoothing=1.5)


def _toy_batch(seed, batch=6, seq=10, vocab=17, num_domains=3):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, vocab, generator=gen)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[torch.rand(batch, seq, generator=gen) < 0.3] = -100
    domain_id = torch.randint(0, num_domains, (batch,), generator=gen)
    return logits, labels, domain_id


def _loop_token_losses(logits, labels):
    """Slow reference: per-example, per-position cross-entropy with the causal shift."""
    out = {}
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            y = int(labels[b, t + 1])
            if y == -100:
                continue
            out[(b, t)] = -torch.log_softmax(logits[b, t].double(), dim=-1)[y].item()
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_per_token_losses_and_domain_sums_match_loops(seed):
    num_domains = 3
    logits, labels, domain_id = _toy_batch(seed, num_domains=num_domains)
    loss_BT, mask_BT = per_token_losses(logits, labels)
    ref = _loop_token_losses(logits, labels)
    expected_sums = [0.0] * num_domains
    expected_counts = [0] * num_domains
    for (b, t), v in ref.items():
        assert mask_BT[b, t] == 1
        assert loss_BT[b, t].item() == pytest.approx(v, abs=1e-5)
        expected_sums[int(domain_id[b])] += v
        expected_counts[int(domain_id[b])] += 1
    assert int(mask_BT.sum()) == len(ref)
    sums = domain_sums(loss_BT * mask_BT, domain_id, num_domains)
    torch.testing.assert_close(sums.double(), torch.tensor(expected_sums, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    counts = domain_token_counts(labels, domain_id, num_domains)
    assert counts.tolist() == expected_counts


def test_per_token_mean_equals_hf_loss():
    model = tiny_llama(seed=3)
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 128, (3, 12), generator=gen)
    labels = input_ids.clone()
    labels[:, :4] = -100
    out = model(input_ids=input_ids, labels=labels)
    loss_BT, mask_BT = per_token_losses(out.logits, labels)
    torch.testing.assert_close(loss_BT.sum() / mask_BT.sum(), out.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clipped_excess_matches_loop(seed):
    num_domains = 3
    logits, labels, domain_id = _toy_batch(seed, num_domains=num_domains)
    ref_logits = logits + torch.randn(logits.shape, generator=torch.Generator().manual_seed(99 + seed))
    proxy_BT, mask_BT = per_token_losses(logits, labels)
    ref_BT, _ = per_token_losses(ref_logits, labels)
    got = clipped_excess_sums(proxy_BT, ref_BT, mask_BT, domain_id, num_domains)
    p, r = _loop_token_losses(logits, labels), _loop_token_losses(ref_logits, labels)
    expected = [0.0] * num_domains
    negatives = 0
    for key in p:
        diff = p[key] - r[key]
        negatives += diff < 0
        expected[int(domain_id[key[0]])] += max(0.0, diff)
    assert negatives > 0  # the toy exercises the clipping
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-5)


def test_clipped_excess_has_no_gradient_path():
    proxy = torch.rand(2, 4, requires_grad=True)
    out = clipped_excess_sums(proxy, torch.zeros(2, 4), torch.ones(2, 4), torch.tensor([0, 1]), 2)
    assert not out.requires_grad


def test_absent_domains_keep_their_last_score():
    last = torch.tensor([0.3, 0.7, 0.2, 0.0], dtype=torch.float64)
    excess_sum = torch.tensor([2.0, 0.0, 0.0, 3.0], dtype=torch.float64)
    count = torch.tensor([4.0, 0.0, 5.0, 0.0], dtype=torch.float64)
    lam = excess_per_domain(excess_sum, count, last)
    # Present: token mean (domain 2 present with zero excess -> 0, not its last score);
    # absent: last score.
    assert lam.tolist() == [0.5, 0.7, 0.0, 0.0]


def test_weighted_domain_loss_matches_loop_and_has_gradient():
    num_domains = 3
    logits, labels, domain_id = _toy_batch(4, num_domains=num_domains)
    logits.requires_grad_(True)
    alpha = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    loss_BT, mask_BT = per_token_losses(logits, labels)
    count = domain_token_counts(labels, domain_id, num_domains)
    loss = weighted_domain_loss(domain_sums(loss_BT * mask_BT, domain_id, num_domains), count, alpha)
    ref = _loop_token_losses(logits.detach(), labels)
    per_domain = {c: [v for (b, _), v in ref.items() if int(domain_id[b]) == c] for c in range(num_domains)}
    expected = sum(alpha[c].item() * sum(v) / len(v) for c, v in per_domain.items() if v)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_weighted_domain_loss_ignores_absent_domain():
    loss = weighted_domain_loss(torch.tensor([2.0, 0.0]), torch.tensor([4.0, 0.0]), torch.tensor([0.5, 0.5]))
    assert loss.item() == pytest.approx(0.25)


def test_resolve_initial_weights():
    names = ["a", "b", "c", "d"]
    torch.testing.assert_close(resolve_initial_weights("uniform", names), torch.full((4,), 0.25, dtype=torch.float64))
    nat = resolve_initial_weights("natural", names, [2.0, 1.0, 1.0, 4.0])
    torch.testing.assert_close(nat, torch.tensor([0.25, 0.125, 0.125, 0.5], dtype=torch.float64))
    given = resolve_initial_weights({"a": 1, "b": 1, "c": 1, "d": 1}, names)
    torch.testing.assert_close(given, torch.full((4,), 0.25, dtype=torch.float64))


@pytest.mark.parametrize(
    ("arg", "natural", "match"),
    [
        ("natural", None, "natural_weights"),
        ("zipf", None, "uniform"),
        ({"a": 1.0, "b": 1.0}, None, "missing"),
        ({"a": 1.0, "b": 1.0, "c": 1.0, "x": 1.0}, None, "unknown"),
        ({"a": 1.0, "b": 0.0, "c": 1.0}, None, "> 0"),
        ("natural", [1.0, 2.0], "2 values"),
    ],
)
def test_resolve_initial_weights_errors(arg, natural, match):
    with pytest.raises(ValueError, match=match):
        resolve_initial_weights(arg, ["a", "b", "c"], natural)


def test_per_token_losses_in_bfloat16_are_computed_in_float32():
    logits, labels, _ = _toy_batch(0)
    loss_bf16, _ = per_token_losses(logits.bfloat16(), labels)
    assert loss_bf16.dtype == torch.float32
    ref, _ = per_token_losses(logits.bfloat16().float(), labels)
    torch.testing.assert_close(loss_bf16, ref)
