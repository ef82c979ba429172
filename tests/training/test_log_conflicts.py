"""`log_conflicts`: random's conflict fraction, from pool features computed for the log only (issue 21.5)."""

from __future__ import annotations

import pytest
import torch

from composer_algos.data_selection.algorithm import DataSelection
from composer_algos.selection import STRATEGIES
from tests.common.models import tiny_llama
from tests.training.fake_ranks import FakeState, ListLogger

DOMAINS = ["a", "b", "c"]
T, V, D = 6, 11, 5


def _pool(n: int) -> dict[str, torch.Tensor]:
    """A pool whose first token is the row's position (so the picked rows can be read back)."""
    g = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, V, (n, T), generator=g)
    input_ids[:, 0] = torch.arange(n)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones(n, T, dtype=torch.long),
        "labels": input_ids.clone(),
        "domain_id": torch.arange(n) % len(DOMAINS),
    }


class _Handed:
    """Stands in for `DataSelection._features`: fixed features, and the calls it got."""

    def __init__(self, feats: torch.Tensor) -> None:
        self.feats = feats
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, state, batch, step, *, validation=True, **_):
        self.calls.append((step, validation))
        return self.feats, None, None


def _algo(strategy: str, kappa: int, **kwargs) -> DataSelection:
    algo = DataSelection(strategy=strategy, domain_names=DOMAINS, **kwargs)
    algo.spec = STRATEGIES[strategy]
    algo.kappa = kappa
    return algo


def _step(algo: DataSelection, pool: dict, step: int, model=None):
    state, logger = FakeState(dict(pool), step=step, model=model), ListLogger()
    algo._select(state, logger)
    metrics = {k: v for m in logger.metrics for k, v in m.items()}
    return state.batch, metrics


@pytest.mark.parametrize("strategy", ["random", "random_stratified"])
def test_random_logs_the_conflict_fraction_of_its_own_picks_and_picks_the_same(strategy):
    n, kappa = 12, 6
    feats = torch.randn(n, D, generator=torch.Generator().manual_seed(3))
    plain = _algo(strategy, kappa)
    probed = _algo(strategy, kappa, log_conflicts=True)
    handed = _Handed(feats)
    probed._features = handed  # type: ignore[method-assign]
    new_plain, m_plain = _step(plain, _pool(n), step=4)
    new_probed, m_probed = _step(probed, _pool(n), step=4)

    assert torch.equal(new_plain["input_ids"], new_probed["input_ids"])  # the log changes nothing selected
    assert "selection/conflict_fraction" not in m_plain  # today's behaviour without the option
    assert handed.calls == [(4, False)]  # the pool only: no validation batch drawn
    picked = [int(i) for i in new_probed["input_ids"][:, 0]]
    assert len(picked) == kappa
    # By hand: the share of unordered picked pairs whose features point against each other.
    pairs = [(a, b) for x, a in enumerate(picked) for b in picked[x + 1 :]]
    negative = sum(1 for a, b in pairs if sum(float(feats[a, d] * feats[b, d]) for d in range(D)) < 0)
    assert m_probed["selection/conflict_fraction"] == pytest.approx(negative / len(pairs))


def test_a_feature_strategy_is_unchanged_and_scored_once():
    n = 9
    feats = torch.randn(n, D, generator=torch.Generator().manual_seed(5))
    algo = _algo("gradnorm", 3, log_conflicts=True)
    handed = _Handed(feats)
    algo._features = handed  # type: ignore[method-assign]
    _, metrics = _step(algo, _pool(n), step=1)
    assert len(handed.calls) == 1 and "selection/conflict_fraction" in metrics


def test_the_probe_runs_on_a_real_model():
    algo = _algo("random", 3, log_conflicts=True, features={"normalization": "none", "proj_dim": 16, "last_n_blocks": 1})
    model = tiny_llama(seed=0, vocab_size=64)
    new, metrics = _step(algo, _pool(8), step=0, model=model)
    assert new["input_ids"].shape[0] == 3
    assert 0.0 <= metrics["selection/conflict_fraction"] <= 1.0


def test_log_conflicts_is_a_yaml_key_and_must_be_a_bool():
    from composer_algos.registry import load_run_config
    from tests.common.paths import REPO_ROOT

    yaml = REPO_ROOT / "yamls" / "study" / "dm_math.yaml"
    cfg = load_run_config(yaml, ["algorithms.data_selection.strategy=random", "algorithms.data_selection.log_conflicts=true"])
    assert cfg.algorithms["data_selection"]["log_conflicts"] is True
    with pytest.raises(ValueError, match="log_conflicts"):
        DataSelection(strategy="random", log_conflicts="yes")  # type: ignore[arg-type]
