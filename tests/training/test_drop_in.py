"""DataSelection outside train.py: one owner of oversampling, kappa from the pool, domain key and names,
validation from given batches, the validation running average, and the drop-in example end to end."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
import yaml
from composer.loggers import InMemoryLogger

import train
from composer_algos.data_selection.algorithm import DEFAULT_OVERSAMPLING, DataSelection
from composer_algos.data_selection.validation_source import BatchValidationSource
from composer_algos.selection import STRATEGIES, StrategySpec
from pipeline.config import load_config
from tests.common.paths import REPO_ROOT
from tests.training.conftest import tiny_overrides
from tests.training.fake_ranks import FakeState, ListLogger, ThreadRanks

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"


def _pool(n: int, seed: int = 0, key: str = "domain_id", domains: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (n, 5), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids.clone(),
        key: torch.arange(n) % domains,
    }


def _loader(batch_size: int):
    from types import SimpleNamespace

    return SimpleNamespace(batch_size=batch_size, dataset=None)


# ---------------------------------------------------------------- point 1: one owner of oversampling


def test_tiny_config_without_oversampling_selects_with_the_documented_default(dolma_shards, tmp_path):
    cfg_yaml = yaml.safe_load(TINY.read_text())
    del cfg_yaml["algorithms"]["data_selection"]["oversampling"]
    path = tmp_path / "no_oversampling.yaml"
    path.write_text(yaml.safe_dump(cfg_yaml))
    overrides = [o for o in tiny_overrides(dolma_shards, tmp_path / "run") if "oversampling" not in o]
    cfg = load_config(path, [*overrides, "loggers.in_memory={}", "eval_loader=null", "max_duration=1ba"])
    trainer = train.build_trainer(cfg)
    # global_train_batch_size 4 on one rank: the loader delivers 2 x 4 candidates and 4 are trained.
    assert trainer.state.train_dataloader.batch_size == int(DEFAULT_OVERSAMPLING * 4)
    trainer.fit()
    mem = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
    assert [v for _, v in mem.data["selection/kept_samples"]] == [4.0]
    trainer.close()


def test_oversampling_one_with_a_selecting_strategy_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"oversampling 1 with strategy 'partitionsel'.*default 2"):
        DataSelection(strategy="partitionsel", oversampling=1)
    DataSelection(strategy="none", oversampling=1)  # plain training: allowed


@pytest.mark.parametrize(("pool", "r", "kappa"), [(12, 3.0, 4), (8, 2.0, 4), (5, 2.0, 2)])
def test_kappa_is_the_loaders_pool_over_oversampling(pool, r, kappa):
    algo = DataSelection(strategy="random", oversampling=r, domain_names=["a", "b", "c"])
    state = FakeState(_pool(pool))
    state.train_dataloader = _loader(pool)
    algo._select(state, ListLogger())
    assert algo.kappa == kappa and state.batch["input_ids"].shape[0] == kappa


def test_a_last_smaller_pool_keeps_kappa_from_the_loader():
    algo = DataSelection(strategy="random", oversampling=2.0, domain_names=["a", "b", "c"])
    state = FakeState(_pool(5))  # the end-of-epoch remainder of a loader of 8
    state.train_dataloader = _loader(8)
    algo._select(state, ListLogger())
    assert algo.kappa == 4 and state.batch["input_ids"].shape[0] == 4


def test_a_pool_no_larger_than_kappa_fails_at_the_first_batch_naming_both():
    algo = DataSelection(strategy="random", oversampling=1.1)
    state = FakeState(_pool(2))
    state.train_dataloader = _loader(2)
    with pytest.raises(ValueError, match=r"pool of 2 examples.*kappa 2"):
        algo._select(state, ListLogger())


# ---------------------------------------------------------------- point 2: drop-in use


def test_domain_key_and_default_domain_names():
    algo = DataSelection(strategy="random_stratified", oversampling=2, domain_key="source")
    state = FakeState(_pool(8, key="source", domains=3))
    logger = ListLogger()
    algo._select(state, logger)
    assert algo.domain_names == ["domain_0", "domain_1", "domain_2"]
    assert state.batch["source"].shape[0] == 4
    assert logger.traces[-1]["selection/pool_counts"].tolist() == [3, 3, 2]
    with pytest.raises(TypeError, match="domain_key 'source'"):
        algo._select(FakeState(_pool(8)), ListLogger())


def test_batches_as_validation_are_drawn_by_step_and_resume_exactly():
    batches = [_pool(2, seed=s) for s in range(3)]

    class Loader:  # sized, re-iterable, not indexable: like a DataLoader
        def __len__(self):
            return len(batches)

        def __iter__(self):
            return iter(batches)

    whole = BatchValidationSource(Loader())
    drawn = [whole.batch_for_step(s)["input_ids"] for s in range(7)]
    assert all(torch.equal(drawn[s], batches[s % 3]["input_ids"]) for s in range(7))
    resumed = BatchValidationSource(Loader())
    assert torch.equal(resumed.batch_for_step(5)["input_ids"], drawn[5])
    listed = BatchValidationSource(batches)
    assert torch.equal(listed.batch_for_step(4)["input_ids"], drawn[4])


def test_drop_in_example_trains_without_train_py(tmp_path, capsys):
    sys.path.insert(0, str(REPO_ROOT / "examples"))
    try:
        import drop_in
    finally:
        sys.path.pop(0)
    trainer = drop_in.main(["--out", str(tmp_path / "ex"), "--steps", "3"])
    assert int(trainer.state.timestamp.batch.value) == 3
    algo = trainer.state.algorithms[0]
    assert isinstance(algo, DataSelection) and algo.kappa == 8
    assert algo.domain_names == ["domain_0", "domain_1"] and algo.fallbacks == 0
    assert "trained 3 steps on 8 of 16 candidates" in capsys.readouterr().out
    trainer.close()
    # `none` trains every candidate, and says so (it printed "8 of 16", a new-user review found).
    trainer = drop_in.main(["--out", str(tmp_path / "none"), "--steps", "1", "--strategy", "none"])
    assert int(trainer.state.timestamp.batch.value) == 1 and trainer.state.batch["input_ids"].shape[0] == 16
    assert "trained 1 steps on all 16 candidates each (none: no selection)" in capsys.readouterr().out
    trainer.close()


# ---------------------------------------------------------------- the validation running average


def _spy_gbar(monkeypatch) -> list[torch.Tensor]:
    real = STRATEGIES["partitionsel"]
    seen: list[torch.Tensor] = []
    lock = threading.Lock()

    def spy(**kwargs):
        with lock:
            seen.append(kwargs["val_feature"].clone())
        return real.fn(**kwargs)

    monkeypatch.setitem(STRATEGIES, "partitionsel", StrategySpec(spy, True, True, True))
    return seen


def _feats(step: int, rank: int = 0, n: int = 8, d: int = 6):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(
        d, generator=g, dtype=torch.float64
    )


def _algo_with_features(beta: float, **kwargs) -> DataSelection:
    algo = DataSelection(
        strategy="partitionsel", domain_names=["a", "b", "c"], validation={"average_beta": beta}, **kwargs
    )
    algo.spec = STRATEGIES["partitionsel"]
    algo.kappa = 4
    algo._features = lambda state, batch, step, **_: (*_feats(step), None)
    return algo


def test_average_beta_feeds_the_bias_corrected_running_mean(monkeypatch):
    seen = _spy_gbar(monkeypatch)
    beta = 0.8
    algo = _algo_with_features(beta)
    for step in range(3):
        algo._select(FakeState(_pool(8), step=step), ListLogger())
    g = [_feats(s)[1] for s in range(3)]
    m = torch.zeros_like(g[0])
    for t in range(3):
        m = beta * m + (1 - beta) * g[t]
        torch.testing.assert_close(seen[t], m / (1 - beta ** (t + 1)))
    assert not torch.allclose(seen[2], g[2])  # beta > 0 changed the guiding feature
    seen.clear()
    off = _algo_with_features(0.0)
    off._select(FakeState(_pool(8), step=2), ListLogger())
    torch.testing.assert_close(seen[0], g[2])  # beta 0: the step's own gbar


def test_average_beta_resumes_exactly(monkeypatch):
    seen = _spy_gbar(monkeypatch)
    whole = _algo_with_features(0.7)
    hashes = []
    for step in range(4):
        logger = ListLogger()
        whole._select(FakeState(_pool(8), step=step), logger)
        hashes.append(logger.metrics[-1]["selection/selected_hash"])
    ref = list(seen)
    seen.clear()
    first = _algo_with_features(0.7)
    for step in range(2):
        first._select(FakeState(_pool(8), step=step), ListLogger())
    saved = first.state_dict()
    assert saved["val_average"]["count"] == 2
    resumed = _algo_with_features(0.7)
    resumed.load_state_dict(saved)
    for step in range(2, 4):
        logger = ListLogger()
        resumed._select(FakeState(_pool(8), step=step), logger)
        assert logger.metrics[-1]["selection/selected_hash"] == hashes[step]
    for a, b in zip(seen, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_average_is_taken_after_the_global_gather_so_ranks_hold_one_state(monkeypatch):
    ranks = ThreadRanks(2)
    ranks.patch(monkeypatch)
    _spy_gbar(monkeypatch)

    def body(rank):
        algo = _algo_with_features(0.5, scope="global")
        algo._features = lambda state, batch, step, **_: (*_feats(step, rank), None)
        for step in range(2):
            algo._select(FakeState(_pool(8, seed=rank), step=step), ListLogger())
        return algo.val_average.state_dict()

    s0, s1 = ranks.run(body)
    assert s0["count"] == s1["count"] == 2
    torch.testing.assert_close(s0["m"], s1["m"], rtol=0, atol=0)
    g = [(_feats(s, 0)[1] + _feats(s, 1)[1]) / 2 for s in range(2)]
    torch.testing.assert_close(s0["m"].double(), (0.5 * 0.5 * g[0] + 0.5 * g[1]), rtol=1e-6, atol=1e-7)


def test_average_beta_out_of_range_and_with_local_scope_are_rejected():
    with pytest.raises(ValueError, match=r"validation.average_beta must be in \[0, 1\), got 1.0"):
        DataSelection(validation={"average_beta": 1.0})


@pytest.mark.parametrize(
    ("features", "named"),
    [
        ({"precondition": "both"}, "features.precondition 'both'"),
        ({"precondition": "split"}, "features.precondition 'split'"),
        ({"normalization": "adam_simulated"}, "features.normalization 'adam_simulated'"),
        ({"resample_projections": True}, "features.resample_projections True"),
    ],
)
def test_average_beta_with_step_dependent_validation_features_is_rejected_at_construction(features, named):
    # Averaged validation features must carry no step-dependent scaling or projection (issue 20.6).
    with pytest.raises(ValueError, match="validation.average_beta 0.9") as info:
        DataSelection(validation={"average_beta": 0.9}, features=features)
    assert named in str(info.value)
    # Without averaging, or with the raw validation side, the same settings are accepted.
    DataSelection(validation={"average_beta": 0.0}, features=features)
    DataSelection(validation={"average_beta": 0.9}, features={"precondition": "pool"})
    # The preconditioner's side does not apply without the optimizer's Adam normalisation.
    DataSelection(validation={"average_beta": 0.9}, features={"normalization": "none", "precondition": "both"})


@pytest.mark.parametrize("strategy", ["random_stratified", "partitionsel"])
def test_global_scope_without_domain_names_gives_every_rank_the_same_domain_count(monkeypatch, strategy):
    """A rank whose pool lacks the largest domain id must not size C from its own pool (issue 20.8)."""
    ranks = ThreadRanks(2, timeout_s=30)
    ranks.patch(monkeypatch)
    # Step 0: only rank 0 sees domain 2; step 1: only rank 1 sees domain 3.
    domains = {(0, 0): 3, (0, 1): 2, (1, 0): 2, (1, 1): 4}

    def body(rank):
        algo = DataSelection(strategy=strategy, scope="global")  # no domain names, no manifest
        if strategy == "partitionsel":
            algo._features = lambda state, batch, step, **_: (*_feats(step, rank), None)
        seen = []
        for step in range(2):
            logger = ListLogger()
            algo._select(FakeState(_pool(8, seed=rank, domains=domains[step, rank]), step=step), logger)
            seen.append((algo.num_domains, len(logger.traces[-1]["selection/pool_counts"])))
        return seen, algo.domain_names

    (seen0, names0), (seen1, names1) = ranks.run(body)
    assert seen0 == seen1 == [(3, 3), (4, 4)]
    assert names0 == names1 == ["domain_0", "domain_1", "domain_2", "domain_3"]


def test_global_scope_with_an_id_beyond_the_given_names_fails_on_every_rank(monkeypatch):
    ranks = ThreadRanks(2, timeout_s=30)
    ranks.patch(monkeypatch)

    def body(rank):
        algo = DataSelection(strategy="random_stratified", scope="global", domain_names=["a", "b"])
        try:  # only rank 1's pool holds the unnamed id 2
            algo._select(FakeState(_pool(8, seed=rank, domains=3 if rank == 1 else 2)), ListLogger())
        except ValueError as e:
            return str(e)
        return None

    messages = ranks.run(body)
    assert all(m is not None and "domain id 2" in m and "['a', 'b']" in m for m in messages), messages


def test_settings_a_strategy_never_reads_are_warned_of_at_init(caplog):
    """A `random` arm that carries a guided arm's `features` and `validation` (one yaml, `strategy` overridden) is
    told they have no effect, by name; a strategy that reads them, or `log_conflicts` (which computes features
    under any strategy), is not."""
    import logging

    features, validation = {"proj_dim": 64, "windows": 64}, {"batches": [{"input_ids": torch.zeros(1, 4, dtype=torch.long)}]}
    with caplog.at_level(logging.WARNING, logger="composer_algos.data_selection.algorithm"):
        DataSelection(strategy="random", oversampling=2.0, features=features, validation=validation)
    text = caplog.text
    assert "features (proj_dim, windows): strategy 'random' computes no gradient features" in text, text
    assert "validation: strategy 'random' draws no validation batch" in text, text
    for kwargs in ({"strategy": "partitionsel"}, {"strategy": "random", "log_conflicts": True}):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="composer_algos.data_selection.algorithm"):
            DataSelection(oversampling=2.0, features=features, **kwargs)
        assert "has no effect" not in caplog.text, (kwargs, caplog.text)
