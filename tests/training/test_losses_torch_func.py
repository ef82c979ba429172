"""The project's losses under torch.func transforms (issue 20 point 4): grad, vmap of grad, jacrev.

tools/bench/bench_features.py's reference computes per-example gradients with `vmap(grad(...))` through
`per_example_losses`; its custom autograd.Function must support the transforms and give the same
gradients as the plain autograd path (and as F.cross_entropy's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import grad, jacrev, vmap

from composer_algos.losses import IGNORE_INDEX, per_example_losses, per_token_losses


def _instance(seed: int = 0, n: int = 4, t: int = 9, v: int = 37):
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n, t, v, generator=gen)
    labels = torch.randint(0, v, (n, t), generator=gen)
    labels[1, 2:5] = IGNORE_INDEX
    labels[-1] = IGNORE_INDEX  # no target token: loss 0, gradient 0
    return logits, labels


def _reference_example_loss(logits_TV, labels_T):
    targets = torch.cat([labels_T[1:], labels_T.new_full((1,), IGNORE_INDEX)])
    loss = F.cross_entropy(logits_TV, targets, ignore_index=IGNORE_INDEX, reduction="none")
    return loss.sum() / (targets != IGNORE_INDEX).sum().clamp_min(1)


def _example_loss(logits_TV, labels_T):
    return per_example_losses(logits_TV[None], labels_T[None])[0]


def test_vmap_of_grad_gives_the_per_example_gradients():
    logits, labels = _instance()
    per_example = vmap(grad(_example_loss))(logits, labels)
    # The plain autograd path: the examples are independent, so the batch gradient of the summed
    # per-example losses holds each example's gradient in its own rows.
    leaf = logits.clone().requires_grad_()
    (batch,) = torch.autograd.grad(per_example_losses(leaf, labels).sum(), leaf)
    reference = torch.stack([torch.func.grad(_reference_example_loss)(logits[i], labels[i]) for i in range(len(logits))])
    assert per_example.shape == logits.shape
    torch.testing.assert_close(per_example, batch, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(per_example, reference, rtol=1e-6, atol=1e-7)
    assert not per_example[3].any()


def test_grad_alone_and_vmap_of_the_loss_values():
    logits, labels = _instance(seed=1)
    g = grad(lambda x: per_example_losses(x, labels).sum())(logits)
    leaf = logits.clone().requires_grad_()
    (expected,) = torch.autograd.grad(per_example_losses(leaf, labels).sum(), leaf)
    assert torch.equal(g, expected)  # same ops, same order: bit for bit
    values = vmap(_example_loss)(logits.requires_grad_(), labels)
    with torch.no_grad():
        plain = per_example_losses(logits, labels)
    torch.testing.assert_close(values.detach(), plain, rtol=1e-6, atol=1e-7)


def test_jacrev_of_the_per_token_losses():
    logits, labels = _instance(seed=2, n=2, t=5, v=11)
    jac = jacrev(lambda x: per_token_losses(x, labels)[0])(logits)  # (n, T) losses by (n, T, V) logits
    # Each token's loss depends only on its own logits row: d loss[i, t] / d logits[i, t] is
    # softmax - onehot(target), zero where the position has no target.
    targets = torch.cat([labels[:, 1:], labels.new_full((2, 1), IGNORE_INDEX)], dim=1)
    expect = torch.zeros(2, 5, 2, 5, 11)
    for i in range(2):
        for t in range(5):
            if targets[i, t] != IGNORE_INDEX:
                expect[i, t, i, t] = torch.softmax(logits[i, t], -1) - F.one_hot(targets[i, t], 11).float()
    torch.testing.assert_close(jac, expect, rtol=1e-5, atol=1e-6)
