"""The running mean of validation features."""

from __future__ import annotations

import pytest
import torch

from composer_algos.features.val_average import ValidationAverage


def test_beta_zero_is_the_identity():
    g = torch.tensor([1.0, -2.0])
    assert torch.equal(ValidationAverage(0.0).update(g), g)


def test_bias_corrected_ema_against_a_hand_computation():
    avg = ValidationAverage(0.5)
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 4.0])
    torch.testing.assert_close(avg.update(a), a)  # first step: (0.5 a) / (1 - 0.5)
    # m = 0.5 * (0.5 a) + 0.5 b = [0.5, 2]; / (1 - 0.25) -> [2/3, 8/3]
    torch.testing.assert_close(avg.update(b), torch.tensor([2 / 3, 8 / 3]))


def test_averaging_constant_signal_plus_noise_reduces_the_noise():
    gen = torch.Generator().manual_seed(0)
    signal = torch.randn(64, generator=gen)
    avg = ValidationAverage(0.9)
    for _ in range(60):
        out = avg.update(signal + 2.0 * torch.randn(64, generator=gen))
    single = signal + 2.0 * torch.randn(64, generator=gen)
    cos = torch.nn.functional.cosine_similarity
    assert cos(out, signal, dim=0) > cos(single, signal, dim=0) + 0.2


def test_state_round_trip_resumes_exactly():
    gen = torch.Generator().manual_seed(1)
    steps = [torch.randn(8, generator=gen) for _ in range(5)]
    full = ValidationAverage(0.8)
    outs = [full.update(g) for g in steps]
    first = ValidationAverage(0.8)
    for g in steps[:3]:
        first.update(g)
    resumed = ValidationAverage(0.8)
    resumed.load_state_dict(first.state_dict())
    assert torch.equal(resumed.update(steps[3]), outs[3]) and torch.equal(resumed.update(steps[4]), outs[4])


def test_bad_beta_is_rejected_with_the_key_name():
    with pytest.raises(ValueError, match="average_beta"):
        ValidationAverage(1.0)
