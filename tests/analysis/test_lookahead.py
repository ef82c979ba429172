"""The one-step lookahead check on a case whose answer is known."""

from __future__ import annotations

import pytest
import torch

from composer_algos.analysis.lookahead import Arm, format_summary, run_lookahead, summarize
from tests.common.models import tiny_llama


def _batch(ids: torch.Tensor, domains: torch.Tensor) -> dict:
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids.clone(),
        "domain_id": domains,
    }


def _setup(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    model = tiny_llama(seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(3):  # give the optimizer state, as a checkpoint would have
        ids = torch.randint(0, 128, (8, 16), generator=gen)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    opt.zero_grad()
    # The evaluation examples: one fixed periodic pattern, unlike the random-token pool rows.
    pattern = torch.arange(16) % 5 + 40
    evalset = _batch(torch.stack([pattern.roll(i) for i in range(4)]), torch.zeros(4, dtype=torch.long))
    guide = _batch(torch.stack([pattern.roll(i + 4) for i in range(2)]), torch.zeros(2, dtype=torch.long))
    pools, copies = [], []
    for _ in range(3):
        rows = torch.randint(0, 128, (16, 16), generator=gen)
        where = torch.randperm(16, generator=gen)[:4]
        rows[where] = evalset["input_ids"]  # the pool holds copies of the evaluation examples
        pools.append(_batch(rows, torch.arange(16) % 2))  # two domains, the copies in both
        copies.append(sorted(where.tolist()))
    return model, opt, pools, guide, evalset, copies


def test_selection_picks_the_copies_of_the_evaluation_examples_and_wins():
    model, opt, pools, guide, evalset, copies = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: v["exp_avg_sq"].clone() for k, v in zip(range(10**6), opt.state.values())}
    arm = Arm("ps", "partitionsel", features={"normalization": "none", "proj_dim": 0})
    oracle = Arm("or", "oracle_eval")
    res = run_lookahead(
        model,
        opt,
        pools,
        guide,
        evalset,
        [arm, oracle],
        kappa=4,
        num_domains=2,
        n_random=12,
        sgd_lr=0.5,
        seed=3,
    )
    for sel, cp in zip(res.selected["ps"], copies):
        assert len(set(sel) & set(cp)) >= 3, (sel, cp)
    summary = summarize(res)
    for key in ("sgd/eval", "opt/eval"):
        row = summary["arms"]["ps"][key]
        assert row["win_fraction"] == 1.0, (key, row)
        assert row["diff_mean"] > 0
    assert "ps" in format_summary(summary)
    assert (
        summary["arms"]["or"]["opt/eval"]["diff_mean"] > 0
    )  # selecting by the eval gradient itself helps it
    assert len(res.selected["or"][0]) == 4
    # the model and the optimizer state are left exactly as found
    for p, p0 in zip(model.parameters(), before):
        assert torch.equal(p, p0)
    for k, v in zip(range(10**6), opt.state.values()):
        assert torch.equal(v["exp_avg_sq"], state_before[k])


def test_random_arm_is_indistinguishable_from_random():
    model, opt, pools, guide, evalset, _ = _setup(seed=1)
    arm = Arm("rnd", "random_stratified")
    res = run_lookahead(model, opt, pools, guide, evalset, [arm], kappa=4, num_domains=2, n_random=6, seed=5)
    summary = summarize(res)
    row = summary["arms"]["rnd"]["sgd/eval"]
    # a random arm's mean difference is within a few random spreads of zero
    assert abs(row["diff_mean"]) < 3 * row["random_spread"]
    assert "exact_spearman" not in summary["arms"]["rnd"]


@pytest.mark.parametrize("proj_dim", [0, 64])
def test_fidelity_figures_are_reported_for_feature_arms(proj_dim):
    model, opt, pools, guide, evalset, _ = _setup(seed=2)
    arm = Arm("ps", "partitionsel", features={"normalization": "adam_optimizer", "proj_dim": proj_dim})
    res = run_lookahead(model, opt, pools[:1], guide, evalset, [arm], kappa=4, num_domains=2, n_random=2)
    fid = summarize(res)["arms"]["ps"]
    assert -1 <= fid["exact_spearman"] <= 1 and -1 <= fid["exact_sgd_spearman"] <= 1
    if proj_dim == 0:
        assert fid["raw_spearman"] == 1.0
    else:
        assert -1 <= fid["raw_spearman"] <= 1


def test_one_step_kind_measures_the_same_drops_as_both():
    model, opt, pools, guide, evalset, _ = _setup(seed=4)
    arm = Arm("ps", "partitionsel", features={"normalization": "none", "proj_dim": 0})
    kw = dict(kappa=4, num_domains=2, n_random=3, sgd_lr=0.5, seed=7)
    both = run_lookahead(model, opt, pools[:2], guide, evalset, [arm], **kw)
    only = run_lookahead(model, opt, pools[:2], guide, evalset, [arm], steps=("opt",), **kw)
    assert set(only.drops["ps"]) == {("opt", "eval"), ("opt", "guide")}
    for key, values in only.drops["ps"].items():
        assert values == pytest.approx(both.drops["ps"][key], rel=1e-5, abs=1e-7)
    assert "opt/eval" in format_summary(summarize(only)) and "sgd/eval" not in format_summary(summarize(only))
    with pytest.raises(ValueError, match="subset of"):
        run_lookahead(model, opt, pools[:1], guide, evalset, [arm], steps=("adam",), **kw)
