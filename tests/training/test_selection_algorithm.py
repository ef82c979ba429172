"""DataSelection inside a real Trainer: every strategy trains, the model trains on the selection."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from composer.core import Callback
from composer.loggers import InMemoryLogger

import train
from composer_algos.data_selection.algorithm import SELECTION_STRATEGIES, DataSelection
from composer_algos.losses import per_example_losses
from composer_algos.selection import STRATEGIES
from pipeline.config import load_config
from tests.common.paths import REPO_ROOT
from tests.training.conftest import tiny_overrides

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"


def _build(shards, run_dir, *extra):
    cfg = load_config(TINY, tiny_overrides(shards, run_dir, "loggers.in_memory={}", *extra))
    return train.build_trainer(cfg)


def _spy(trainer):
    """Record each step's pool and selection, and the input_ids of every training forward."""
    algo = next(a for a in trainer.state.algorithms if isinstance(a, DataSelection))
    record = {"pools": [], "selected": [], "trained": []}
    original = algo._select

    def select(state, logger):
        record["pools"].append({k: v.clone() for k, v in state.batch.items()})
        original(state, logger)
        record["selected"].append({k: v.clone() for k, v in state.batch.items()})

    algo._select = select
    hf = trainer.state.model.model

    def hook(module, args, kwargs):
        if module.training:  # feature extraction runs in eval mode; training forwards are per microbatch
            step = int(trainer.state.timestamp.batch.value)
            ids = kwargs["input_ids"].detach().clone()
            if len(record["trained"]) == step + 1:
                record["trained"][step] = torch.cat([record["trained"][step], ids])
            else:
                record["trained"].append(ids)

    hf.register_forward_pre_hook(hook, with_kwargs=True)
    return algo, record


@pytest.mark.parametrize("strategy", SELECTION_STRATEGIES)
def test_every_strategy_trains_on_its_selection(strategy, dolma_shards, tmp_path):
    trainer = _build(dolma_shards, tmp_path / strategy, f"algorithms.data_selection.strategy={strategy}")
    algo, rec = _spy(trainer)
    trainer.fit()
    assert trainer.state.timestamp.batch.value == 3
    kappa, pool_size = 4, 12
    assert len(rec["selected"]) == 3 and len(rec["trained"]) == 3
    for pool, sel, trained in zip(rec["pools"], rec["selected"], rec["trained"]):
        assert pool["input_ids"].shape[0] == pool_size
        expected = pool_size if strategy == "none" else kappa
        assert sel["input_ids"].shape[0] == expected
        # The forward the optimizer step used saw exactly the selected examples.
        assert torch.equal(trained, sel["input_ids"])
        # Selected rows are distinct rows of the pool.
        match = (sel["input_ids"][:, None, :] == pool["input_ids"][None, :, :]).all(-1)
        assert bool(match.any(1).all())
        if strategy != "none" and STRATEGIES[strategy].uses_capacities:
            C = len(algo.domain_names)
            # Capacities are randomly rounded per step: each is at most ceil(kappa * n_c / n).
            counts = torch.bincount(pool["domain_id"], minlength=C)
            ceil_quota = -(-kappa * counts // counts.sum())
            assert (torch.bincount(sel["domain_id"], minlength=C) <= ceil_quota).all()
    assert all(torch.isfinite(torch.tensor(v)) for v in [trainer.state.total_loss_dict["loss/train/total"]])


def test_mixture_metrics_sum_to_one_and_files_are_written(dolma_shards, tmp_path):
    run_dir = tmp_path / "mix"
    trainer = _build(dolma_shards, run_dir)
    trainer.fit()
    mem = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
    names = trainer.state.algorithms[0].domain_names
    for prefix in ("data/mixture/", "data/mixture_mean/", "data/pool/"):
        per_step = [mem.data[prefix + n] for n in names]
        for step_values in zip(*per_step):
            assert sum(v for _, v in step_values) == pytest.approx(1.0)
    assert "selection/conflict_fraction" in mem.data and "selection/objective" in mem.data
    mix = json.loads((run_dir / "mixture.json").read_text())
    assert mix["method"] == "partitionsel" and sum(mix["weights"].values()) == pytest.approx(1.0)
    assert (run_dir / "mixture_steps.csv").read_text().count("\n") == 1 + 3
    assert (run_dir / "selection_log.csv").exists() and (run_dir / "eval_results.json").exists()


def test_missing_validation_split_fails_at_init(dolma_shards, tmp_path):
    with pytest.raises(ValueError, match="validation"):
        trainer = _build(
            dolma_shards, tmp_path / "noval", "algorithms.data_selection.validation.split=train_missing"
        )
        trainer.fit()


def test_bad_strategy_is_rejected_with_the_allowed_list(dolma_shards, tmp_path):
    with pytest.raises(ValueError, match="partitionsel"):
        _build(dolma_shards, tmp_path / "bad", "algorithms.data_selection.strategy=best")


def test_feature_failure_falls_back_to_random_within_capacities(dolma_shards, tmp_path, monkeypatch, caplog):
    from composer_algos.features import FeatureError, GradFeatureExtractor

    def broken(self, *a, **k):
        raise FeatureError("all-zero features (simulated)")

    monkeypatch.setattr(GradFeatureExtractor, "compute", broken)
    trainer = _build(dolma_shards, tmp_path / "fb")
    algo, rec = _spy(trainer)
    caplog.set_level(logging.WARNING, logger="composer_algos.data_selection.algorithm")
    trainer.fit()
    assert algo.fallbacks == 3
    assert all(s["input_ids"].shape[0] == 4 for s in rec["selected"])
    # Logged every time (warnings.warn would have shown it once per call site).
    assert sum("falling back" in r.getMessage() for r in caplog.records) == 3
    mem = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
    assert [v for _, v in mem.data["selection/fallbacks_total"]] == [1.0, 2.0, 3.0]


class _GradProbe(Callback):
    """Copies the model and the selected batch before the step, and the accumulated gradients after it."""

    def __init__(self) -> None:
        self.model = self.batch = self.grads = None

    def after_dataloader(self, state, logger) -> None:
        self.model = copy.deepcopy(state.model.model)
        self.batch = {k: v.clone() for k, v in state.batch.items()}

    def after_train_batch(self, state, logger) -> None:
        self.grads = {n: p.grad.clone() for n, p in state.model.model.named_parameters() if p.grad is not None}


def test_weighted_loss_over_microbatches_is_the_weighted_mean_of_the_selection(dolma_shards, tmp_path):
    # kappa 4 in microbatches of 1: the accumulated gradient must be that of sum_i w_i l_i / sum_i w_i
    # over the 4 selected examples computed in one pass (not a mean of per-microbatch weighted means).
    trainer = _build(
        dolma_shards,
        tmp_path / "wl",
        "algorithms.data_selection.weighted_loss=true",
        "device_train_microbatch_size=1",
        "max_duration=1ba",
    )
    probe = _GradProbe()
    trainer.state.callbacks.append(probe)
    trainer.fit()
    batch = probe.batch
    w = batch["loss_weight"].double()
    assert w.shape[0] == 4 and float(w.std()) > 0.05  # uneven weights, or the test proves nothing
    model = probe.model.train()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    losses = per_example_losses(logits, batch["labels"]).double()
    ref = (w * losses).sum() / w.sum()
    ref.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(ref_grads) == set(probe.grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(probe.grads[name], g.to(probe.grads[name].dtype), rtol=1e-4, atol=1e-7)


def test_the_share_of_preconditioned_layers_is_logged_every_step(dolma_shards, tmp_path):
    """LoRA with include_lm_head: the frozen lm_head has no Adam state, the adapters do (issue 20.5)."""
    trainer = _build(
        dolma_shards,
        tmp_path,
        "eval_loader=null",
        "model.lora.r=2",
        "model.lora.target_modules=[v_proj,down_proj]",
        "algorithms.data_selection.features.include_lm_head=true",
    )
    algo = next(a for a in trainer.state.algorithms if isinstance(a, DataSelection))
    trainer.fit()
    names = algo.extractor.target_names
    assert any("lm_head" in n for n in names) and len(names) > 1
    mem = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
    series = [float(v) for _, v in mem.data["selection/normalization_preconditioned_fraction"]]
    # Step 0: no optimizer state yet; then every layer but the frozen lm_head is preconditioned.
    assert series == pytest.approx([0.0] + [1 - 1 / len(names)] * 2)
    trainer.close()
