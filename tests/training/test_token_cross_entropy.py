"""per_token_losses' own backward (issue 15): F.cross_entropy's values and gradients, lighter; no second backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from composer_algos.losses import IGNORE_INDEX, per_example_losses, per_token_losses


def _reference(logits_nTV, labels_nT):
    n, t, v = logits_nTV.shape
    targets = torch.cat([labels_nT[:, 1:], labels_nT.new_full((n, 1), IGNORE_INDEX)], dim=1)
    return F.cross_entropy(logits_nTV.reshape(n * t, v), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="none").view(n, t)


@pytest.mark.parametrize("seed", [0, 1])
def test_values_and_gradients_match_cross_entropy(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(3, 11, 257, generator=gen)).requires_grad_()
    labels = torch.randint(0, 257, (3, 11), generator=gen)
    labels[0, 2:6] = IGNORE_INDEX
    labels[2] = IGNORE_INDEX  # an example without targets: loss 0, gradient 0
    weights = torch.rand(3, 11, generator=gen)
    loss, mask = per_token_losses(logits, labels)
    (grad,) = torch.autograd.grad((weights * loss).sum(), logits)
    ref = _reference(logits, labels)
    (ref_grad,) = torch.autograd.grad((weights * ref).sum(), logits)
    assert torch.equal(loss.detach(), ref.detach())
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)
    assert not grad[2].any() and not grad[0, 1:5].any()  # positions predicting ignored labels
    assert mask[2].sum() == 0


def test_per_example_losses_backward_and_no_grad_path_agree():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 7, 33, generator=gen).requires_grad_()
    labels = torch.randint(0, 33, (2, 7), generator=gen)
    with torch.no_grad():
        plain = per_example_losses(logits, labels)  # F.cross_entropy path
    graph = per_example_losses(logits, labels)  # the custom function
    assert torch.equal(plain, graph.detach())


def test_a_second_backward_through_the_graph_raises():
    logits = torch.randn(1, 5, 9).requires_grad_()
    loss, _ = per_token_losses(logits, torch.randint(0, 9, (1, 5)))
    total = loss.sum()
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        total.backward()
