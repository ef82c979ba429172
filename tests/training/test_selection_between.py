"""`interval` > 1: what the steps between selections train on (`between: random | stale_topk`).

Ranks are threads (tests/training/fake_ranks.py); features are handed in except where the test counts
the validation forwards of a real (tiny) model.
"""

from __future__ import annotations

import logging

import pytest
import torch

import composer_algos.data_selection.algorithm as selection_algorithm
from composer_algos.data_selection.algorithm import DataSelection, top_k_within_capacities
from composer_algos.features import GradFeatureExtractor
from composer_algos.seeding import mix_seed
from composer_algos.selection import STRATEGIES, compute_capacities, select_random
from tests.common.models import tiny_llama
from tests.features.helpers import make_batch
from tests.training.fake_ranks import FakeState, ListLogger, ThreadRanks

DOMAINS = ["a", "b", "c"]
T, V, D = 6, 11, 8


def _pool(n: int, seed: int) -> dict[str, torch.Tensor]:
    """A pool whose first token is a unique example id (1000 * seed + row)."""
    g = torch.Generator().manual_seed(100 + seed)
    input_ids = torch.randint(0, V, (n, T), generator=g)
    input_ids[:, 0] = torch.arange(n) + 1000 * seed
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones(n, T, dtype=torch.long),
        "labels": input_ids.clone(),
        "domain_id": torch.arange(n) % len(DOMAINS),
    }


def _feats(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + seed)
    return torch.randn(n, D, generator=g), torch.randn(D, generator=g)


class _HandedFeatures:
    """Stands in for `DataSelection._features`: step s gets `_feats(n, 10 * rank + s)`, gbar only when asked."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, state, batch, step, *, validation=True, **_):
        self.calls.append((step, validation))
        g, gbar = _feats(int(batch["domain_id"].shape[0]), 10 * self.rank + step)
        return g, (gbar if validation else None), None


def _algo(kappa: int = 4, handed: bool = True, rank: int = 0, **kwargs) -> DataSelection:
    algo = DataSelection(strategy="partitionsel", domain_names=DOMAINS, interval=2, **kwargs)
    algo.spec = STRATEGIES["partitionsel"]
    algo.kappa = kappa
    if handed:
        algo._features = _HandedFeatures(rank)  # type: ignore[method-assign]
    return algo


def _step(algo: DataSelection, batch: dict, step: int, model=None) -> tuple[dict, ListLogger]:
    state, logger = FakeState(dict(batch), step=step, model=model), ListLogger()
    algo._select(state, logger)
    return state.batch, logger


def _picked(pool: dict, new_batch: dict) -> set[int]:
    """Pool positions of the trained rows (the first token is the row's id)."""
    first = pool["input_ids"][:, 0].tolist()
    return {first.index(int(v)) for v in new_batch["input_ids"][:, 0]}


def _count_solves(monkeypatch) -> list[str]:
    calls: list[str] = []
    original = selection_algorithm.solve_problem

    def counting(problem, strategy, **kw):
        calls.append(strategy)
        return original(problem, strategy, **kw)

    monkeypatch.setattr(selection_algorithm, "solve_problem", counting)
    return calls


def test_top_k_within_capacities_by_hand():
    scores = torch.tensor([5.0, 1.0, 4.0, 9.0, 3.0, 2.0, 8.0, 7.0])
    domain = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    # Domain 0 may give 2 (its best: rows 0, 2), domain 1 one (row 3), domain 2 one (row 6, not 7).
    sel = top_k_within_capacities(scores, domain, torch.tensor([2, 1, 1]), 4)
    assert sorted(sel.tolist()) == [0, 2, 3, 6]
    # Caps with room to spare: the scan keeps the k best that fit.
    sel = top_k_within_capacities(scores, domain, torch.tensor([3, 3, 0]), 3)
    assert sorted(sel.tolist()) == [0, 2, 3]


def test_random_between_selections_is_a_uniform_subset_without_features(monkeypatch):
    solves = _count_solves(monkeypatch)
    algo = _algo()
    pools = [_pool(12, s) for s in range(4)]
    for step, pool in enumerate(pools):
        new, logger = _step(algo, pool, step)
        assert logger.traces[-1]["selection/strategy"] == ("partitionsel" if step % 2 == 0 else "random")
        if step % 2:
            # What select_random draws with the step's generator: the behaviour before `between` existed.
            expected = select_random(
                features=None, val_feature=None, domain_ids=pool["domain_id"], num_domains=3, kappa=4,
                eta=0.0, generator=torch.Generator().manual_seed(mix_seed(0, step, 0)),
            )
            assert _picked(pool, new) == set(expected.indices.tolist())
    assert [s for s, _ in algo._features.calls] == [0, 2]  # type: ignore[attr-defined]
    assert solves == ["partitionsel", "random", "partitionsel", "random"]


def test_stale_topk_picks_the_top_kappa_by_the_last_selections_gbar_within_capacities(monkeypatch):
    solves = _count_solves(monkeypatch)
    algo = _algo(kappa=4, between="stale_topk")
    pool0, pool1 = _pool(12, 0), _pool(12, 1)
    _step(algo, pool0, 0)
    new, logger = _step(algo, pool1, 1)
    assert logger.traces[-1]["selection/strategy"] == "stale_topk"
    assert solves == ["partitionsel"]  # no solver on the between step
    assert algo._features.calls == [(0, True), (1, False)]  # type: ignore[attr-defined]
    # By hand: step 1's features scored against step 0's gbar, best first inside each domain, as many
    # per domain as the step's capacities (drawn as a selecting step would draw them).
    g1, _ = _feats(12, 1)
    _, gbar0 = _feats(12, 0)
    scores = (g1 @ gbar0).tolist()
    caps = compute_capacities(torch.tensor([4, 4, 4]), 4, None, generator=torch.Generator().manual_seed(mix_seed(0, 1, 0)))
    expected = set()
    for c in range(3):
        rows = sorted((r for r in range(12) if r % 3 == c), key=lambda r: -scores[r])
        expected |= set(rows[: int(caps[c])])
    assert _picked(pool1, new) == expected
    assert "loss_weight" not in new  # unweighted


def test_stale_topk_runs_no_validation_forward_and_no_solve(monkeypatch):
    solves = _count_solves(monkeypatch)
    forwards: list[bool] = []
    original = GradFeatureExtractor.compute

    def compute(self, pool_batch, val_batch=None, **kw):
        forwards.append(val_batch is not None)
        return original(self, pool_batch, val_batch, **kw)

    monkeypatch.setattr(GradFeatureExtractor, "compute", compute)
    val = [make_batch(n=2, T=T, vocab=V, seed=s) for s in range(4)]
    algo = _algo(
        kappa=3, handed=False, between="stale_topk", validation=val,
        features={"normalization": "none", "proj_dim": 16, "last_n_blocks": 1},
    )
    draws: list[int] = []
    model = tiny_llama(seed=0, vocab_size=4096)  # the pools' first tokens are ids up to 3008
    for step in range(4):
        pool = _pool(9, step)
        new, logger = _step(algo, pool, step, model=model)
        if step == 0:
            assert algo.validation is not None
            batch_for_step = algo.validation.batch_for_step

            def counted(s, _orig=batch_for_step):
                draws.append(s)
                return _orig(s)

            algo.validation.batch_for_step = counted  # type: ignore[method-assign]
        assert new["input_ids"].shape[0] == 3
        assert logger.traces[-1]["selection/strategy"] == ("partitionsel" if step % 2 == 0 else "stale_topk")
    assert forwards == [True, False, True, False]  # the pool is scored every step, validation only when selecting
    assert draws == [2]  # after step 0: the validation stream is read on selecting steps only
    assert solves == ["partitionsel", "partitionsel"]


def test_stale_topk_under_global_scope_selects_one_set_from_the_gathered_pool(monkeypatch):
    ranks = ThreadRanks(2)
    ranks.patch(monkeypatch)

    def body(rank):
        algo = _algo(kappa=2, rank=rank, scope="global", between="stale_topk")
        _step(algo, _pool(6, rank), 0)
        new, logger = _step(algo, _pool(6, 10 + rank), 1)
        return new, logger.metrics[-1]["selection/selected_hash"], logger.traces[-1]["selection/strategy"]

    (b0, h0, s0), (b1, h1, s1) = ranks.run(body)
    assert s0 == s1 == "stale_topk" and h0 == h1
    assert b0["input_ids"].shape[0] == b1["input_ids"].shape[0] == 2
    # By hand: both ranks' step-1 features against the average of both ranks' step-0 gbar (equal sizes).
    g = torch.cat([_feats(6, 1)[0], _feats(6, 11)[0]])
    gbar = (_feats(6, 0)[1] + _feats(6, 10)[1]) / 2
    ids = torch.cat([_pool(6, 10)["input_ids"][:, 0], _pool(6, 11)["input_ids"][:, 0]])
    domain = torch.cat([torch.arange(6) % 3, torch.arange(6) % 3])
    caps = compute_capacities(torch.bincount(domain, minlength=3), 4, None, generator=torch.Generator().manual_seed(mix_seed(0, 1, 0)))
    scores = (g @ gbar).tolist()
    expected = set()
    for c in range(3):
        rows = sorted((r for r in range(12) if int(domain[r]) == c), key=lambda r: -scores[r])
        expected |= {int(ids[r]) for r in rows[: int(caps[c])]}
    trained = set(b0["input_ids"][:, 0].tolist()) | set(b1["input_ids"][:, 0].tolist())
    assert trained == expected


def test_the_stale_gbar_survives_a_resume():
    full = _algo(between="stale_topk")
    _step(full, _pool(12, 0), 0)
    want, _ = _step(full, _pool(12, 1), 1)

    first = _algo(between="stale_topk")
    _step(first, _pool(12, 0), 0)
    resumed = _algo(between="stale_topk")
    resumed.load_state_dict(first.state_dict())
    got, logger = _step(resumed, _pool(12, 1), 1)
    assert logger.traces[-1]["selection/strategy"] == "stale_topk"
    assert torch.equal(got["input_ids"], want["input_ids"])


def test_without_a_stale_gbar_a_between_step_is_random_with_a_warning(caplog):
    algo = _algo(between="stale_topk")
    with caplog.at_level(logging.WARNING, logger="composer_algos.data_selection.algorithm"):
        _, logger = _step(algo, _pool(12, 1), 1)
    assert logger.traces[-1]["selection/strategy"] == "random"
    assert "stale_topk has no validation feature" in caplog.text


def test_local_scope_on_several_ranks_keeps_the_per_rank_gbar_out_of_the_checkpoint(monkeypatch):
    ranks = ThreadRanks(2)
    ranks.patch(monkeypatch)

    def body(rank):
        algo = _algo(kappa=2, rank=rank, scope="local", between="stale_topk")
        _step(algo, _pool(6, rank), 0)
        assert algo._stale_gbar is not None
        return algo.state_dict()["stale_gbar"]

    assert ranks.run(body) == [None, None]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"between": "stale"}, r"between must be one of \['random', 'stale_topk'\], got 'stale'"),
        ({"between": "stale_topk", "strategy": "gradnorm"}, "validation-guided strategy.*'gradnorm'"),
        ({"between": "stale_topk", "strategy": "random"}, "validation-guided strategy.*'random'"),
    ],
)
def test_bad_between_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataSelection(domain_names=DOMAINS, interval=2, **kwargs)
