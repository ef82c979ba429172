"""torch's AdamW makes Composer's DecoupledAdamW update once its weight decay is converted (issue 31.4).

Composer multiplies every weight by `1 - (lr_t / initial_lr) wd` each step (the decay follows the
schedule, unscaled by the learning rate); torch by `1 - lr_t wd`. With `wd_torch = wd_composer /
initial_lr` the two decays agree, and the Adam steps are the same formula, so the parameters stay
equal to rounding through a warm-up-and-decay schedule. `optimizer.name: adamw` builds torch's
fused AdamW (CUDA and CPU): no Python loop over the parameters, no host sync per parameter.
"""

from __future__ import annotations

import pytest
import torch
from composer.optim import DecoupledAdamW

from composer_algos.builders import build_optimizer

LR, WD_COMPOSER = 4e-4, 0.1


def _run(make_opt, steps: int = 25) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = make_opt(model.parameters())
    # Warm-up then decay, as the recipes' schedulers: the learning rate moves under the decay.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * (0.9 ** max(0, s - 5)))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return [p.detach().clone() for p in model.parameters()]


def _composer(params):
    return DecoupledAdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD_COMPOSER)


@pytest.mark.parametrize("wd", [WD_COMPOSER, 0.0])
def test_torch_adamw_with_the_converted_decay_makes_composers_update(wd):
    composer = _run(lambda p: DecoupledAdamW(p, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd))
    torch_ = _run(lambda p: build_optimizer(p, name="adamw", lr=LR, betas=[0.9, 0.95], eps=1e-8, weight_decay=wd / LR))
    for a, b in zip(composer, torch_):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_the_unconverted_decay_is_not_the_same_update():
    # The control: torch's weight_decay read as Composer's decays far less (lr x 0.1 a step, not 0.1).
    composer = _run(_composer)
    torch_ = _run(lambda p: build_optimizer(p, name="adamw", lr=LR, betas=[0.9, 0.95], eps=1e-8, weight_decay=WD_COMPOSER))
    assert max(float((a - b).abs().max()) for a, b in zip(composer, torch_)) > 1e-2


def test_adamw_is_fused():
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(3))], name="adamw", lr=LR, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0)
    assert opt.param_groups[0]["fused"]
