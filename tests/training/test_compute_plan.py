"""Equal compute: the planner's steps, each planned run's schedule ending decayed, and the FLOP estimate."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest
import run_experiment

from composer_algos.analysis.compute_plan import (
    ComputeBudget,
    config_work,
    estimate_run_flops,
    forward_flops_per_token,
    parse_compute_budget,
    parse_step_costs,
    plan_steps,
    scoring_forwards,
    training_forwards,
)
from tests.common.models import HAND_COUNTED_SHAPE
from tests.common.paths import REPO_ROOT

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"


def test_planner_gives_steps_in_inverse_proportion_to_step_cost():
    costs = {"random": 1.0, "partitionsel": 2.0}
    # The budget is what 100 random steps cost (100 s): a step of cost 2 buys 50.
    assert plan_steps(costs, ComputeBudget(reference="random", steps=100), ["random", "partitionsel"]) == {
        "random": 100,
        "partitionsel": 50,
    }
    assert plan_steps(costs, ComputeBudget(seconds=150.0), ["random", "partitionsel"]) == {
        "random": 150,
        "partitionsel": 75,
    }
    # floor: 100 s buy 33 steps of 3 s; exact ratios in floating point do not lose a step.
    assert plan_steps({"a": 1.0, "b": 3.0}, ComputeBudget(reference="a", steps=100), ["b"]) == {"b": 33}
    assert plan_steps({"a": 0.1, "b": 0.3}, ComputeBudget(reference="a", steps=30), ["b"]) == {"b": 10}


def test_planner_rejects_missing_costs_and_budgets_below_one_step():
    with pytest.raises(ValueError, match=r"no step cost for \['random'\]"):
        plan_steps({"partitionsel": 2.0}, ComputeBudget(reference="random", steps=10), ["partitionsel"])
    with pytest.raises(ValueError, match="less than one step of partitionsel"):
        plan_steps({"partitionsel": 2.0}, ComputeBudget(seconds=1.5), ["partitionsel"])
    with pytest.raises(ValueError, match="finite and > 0"):
        plan_steps({"a": 0.0}, ComputeBudget(seconds=1.0), ["a"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("random=200", ComputeBudget(reference="random", steps=200)),
        ("300", ComputeBudget(seconds=300.0)),
        ("12.5s", ComputeBudget(seconds=12.5)),
    ],
)
def test_parse_compute_budget(text, expected):
    assert parse_compute_budget(text) == expected


@pytest.mark.parametrize("bad", ["random=", "random=2.5", "random=0", "=3", "-4", "abc", "0s", "nan"])
def test_parse_compute_budget_rejects_naming_the_text(bad):
    with pytest.raises(ValueError, match="--compute-budget"):
        parse_compute_budget(bad)


def test_parse_step_costs():
    assert parse_step_costs("random=0.5, partitionsel=1.25") == {"random": 0.5, "partitionsel": 1.25}
    for bad in ("random", "random=0", "random=x", "=1", ""):
        with pytest.raises(ValueError, match="--step-costs"):
            parse_step_costs(bad)


def _planned_config(tool, steps: int, tmp_path: Path, *scheduler: str):
    """The config train.py builds for a planned run: run_experiment's own command line, parsed."""
    from pipeline.config import load_config

    cmd = tool.train_command(
        yaml=TINY,
        shard_dir=str(tmp_path / "shards"),
        strategy="random",
        seed=1,
        steps=steps,
        eval_interval=max(1, steps // 5),
        run_dir=tmp_path / f"run{steps}",
        run_name="t",
    )
    overrides = [a for a in cmd[3:]]  # after python, train.py and the yaml
    return load_config(TINY, overrides + list(scheduler))


def _lr_at(scheduler, state, batch: int) -> float:
    from composer.core import Timestamp

    state.timestamp = Timestamp(batch=batch)
    return float(scheduler(state))


@pytest.mark.parametrize("name", ["linear_decay_with_warmup", "cosine_with_warmup"])
def test_planned_runs_schedules_end_at_their_final_rate(name, tmp_path):
    """Step costs 1 and 2, a budget of 100 steps of the first: 100 and 50 steps, each schedule over its own.

    Hand-computed, in multiples of the peak rate: warm-up 0.04dur ends at step 4 of 100 and
    step 2 of 50 (half the peak at half the warm-up); both end at alpha_f = 0.1 at their last
    step; half-way through the decay the linear rate is 0.55 and the cosine one
    0.1 + 0.9 * 0.5 = 0.55 as well.
    """
    import torch
    from composer.core import State
    from composer.devices import DeviceCPU

    from composer_algos.builders import build_scheduler

    tool = run_experiment
    plan = plan_steps({"a": 1.0, "b": 2.0}, ComputeBudget(reference="a", steps=100), ["a", "b"])
    assert plan == {"a": 100, "b": 50}
    for label, steps in plan.items():
        cfg = _planned_config(
            tool, steps, tmp_path, f"scheduler.name={name}", "scheduler.t_warmup=0.04dur", "scheduler.alpha_f=0.1"
        )
        assert cfg.max_duration == f"{steps}ba"
        scheduler = build_scheduler(**dataclasses.asdict(cfg.scheduler))
        state = State(
            model=torch.nn.Linear(1, 1),
            rank_zero_seed=0,
            run_name="t",
            device=DeviceCPU(),
            max_duration=cfg.max_duration,
        )
        warmup = {"a": 4, "b": 2}[label]
        assert _lr_at(scheduler, state, 0) == pytest.approx(0.0)
        assert _lr_at(scheduler, state, warmup // 2) == pytest.approx(0.5)
        assert _lr_at(scheduler, state, warmup) == pytest.approx(1.0)
        assert _lr_at(scheduler, state, warmup + (steps - warmup) // 2) == pytest.approx(0.55)
        assert _lr_at(scheduler, state, steps) == pytest.approx(0.1), f"{label}: not decayed at its last step"


def test_a_planned_run_trains_its_own_steps_with_its_window_and_schedule(dolma_shards, tmp_path):
    """A real (tiny) training of a planned run: `end: 0.5` and a 0.5dur warm-up follow its 4 steps.

    Under the old `--budget-seconds` default (a cap of 1,000,000 steps) neither would ever end.
    Composer evaluates the schedule for step i at the end of step i - 1 (step 0 uses its value
    at 0), so the trained rates are s(0), s(0), s(1), s(2) of s = [0, 0.5, 1, 0.55, 0.1] and the
    optimizer holds s(3) = 0.55 after the last step; the schedule's own end, s(4), is alpha_f.
    """
    from composer.core import Callback

    import train
    from pipeline.config import load_config
    from tests.training.conftest import tiny_overrides

    tool = run_experiment
    run_dir = tmp_path / "run"
    cmd = tool.train_command(
        yaml=TINY,
        shard_dir=str(dolma_shards),
        strategy="partitionsel",
        seed=1,
        steps=4,
        eval_interval=4,
        run_dir=run_dir,
        run_name="planned",
    )

    class Rates(Callback):
        def __init__(self) -> None:
            self.lrs: list[float] = []

        def before_forward(self, state, logger) -> None:
            self.lrs.append(float(state.optimizers[0].param_groups[0]["lr"]))

    base = [o for o in tiny_overrides(dolma_shards, run_dir) if not o.startswith(("max_duration", "eval_interval"))]
    cfg = load_config(
        TINY,
        base
        + cmd[3:]
        + [
            "algorithms.data_selection.end=0.5",
            "scheduler.t_warmup=0.5dur",
            "scheduler.alpha_f=0.1",
            "optimizer.lr=1.0",
        ],
    )
    trainer = train.build_trainer(cfg)
    # What train.main saves beside the run (the FLOP estimate reads the selection's settings there).
    from omegaconf import OmegaConf

    from pipeline.config import config_to_dict

    OmegaConf.save(OmegaConf.create(config_to_dict(cfg)), run_dir / "config.yaml")
    rates = Rates()
    trainer.state.callbacks.append(rates)
    trainer.fit()
    trainer.close()
    assert int(trainer.state.timestamp.batch.value) == 4
    assert rates.lrs == pytest.approx([0.0, 0.0, 0.5, 1.0])
    assert trainer.state.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.55)
    with open(run_dir / "selection_log.csv", newline="") as f:
        ran = [r["strategy"] for r in csv.DictReader(f)]
    assert ran == ["partitionsel", "partitionsel", "random", "random"]
    budget = json.loads((run_dir / "train_budget.json").read_text())
    assert budget["steps"] == 4
    flops = estimate_run_flops(run_dir)
    assert flops is not None and flops["selection"] > 0 and flops["total"] == flops["train"] + flops["selection"]
    # Two of the four steps scored: a pool of 12 rows each (oversampling 3 x kappa 4), and a validation batch of 2.
    assert flops["scored_pool_rows"] == 24 and flops["scored_validation_rows"] == 4


def test_forward_flops_and_scoring_forwards_hand_computed():
    shape = HAND_COUNTED_SHAPE
    # d_head 2; attention weights 4 * (2 + 2) * 2 + 2 * 2 * 4 = 48, MLP 3 * 4 * 8 = 96, lm_head 40:
    # 2 * (2 * 144 + 40) = 656, attention scores 4 * 2 blocks * 8 * 2 heads * 2 = 256.
    assert forward_flops_per_token(shape, 8) == 656 + 256
    # lm_head share 80 / 912; one of two blocks: 1 + s + 2 * 1 * (1 - s) / 2 = 2.
    assert scoring_forwards(shape, 8, 1) == pytest.approx(2.0)
    assert scoring_forwards(shape, 8, 2) == pytest.approx(1 + 80 / 912 + 2 * (1 - 80 / 912))


def test_run_flops_from_the_recorded_counts(tmp_path):
    """A run of 10 steps: 4 rows of width 8 trained a step, pools of 8 rows, 3 steps scored pool and validation."""
    shape = HAND_COUNTED_SHAPE
    (tmp_path / "train_budget.json").write_text(
        json.dumps(
            {
                "steps": 10,
                "trained_samples": 40,
                "trained_tokens": 320,
                "pool_samples": 80,
                "pool_tokens": 640,
                "world_size": 1,
                "model": shape,
            }
        )
    )
    (tmp_path / "config.yaml").write_text(
        "algorithms:\n  data_selection:\n    strategy: partitionsel\n    validation: {batch_size: 2}\n"
        "    features: {last_n_blocks: 1}\n"
    )
    rows = ["partitionsel"] * 2 + ["random"] * 7 + ["random_stratified"]
    fallback = [0] * 9 + [1]
    (tmp_path / "selection_log.csv").write_text(
        "step,strategy,fallback\n" + "".join(f"{i},{s},{f}\n" for i, (s, f) in enumerate(zip(rows, fallback)))
    )
    flops = estimate_run_flops(tmp_path)
    assert flops is not None
    assert flops["train"] == pytest.approx(3 * 320 * 912)
    # 3 scoring steps (two selecting, one that fell back after scoring): 24 pool rows, 6 validation rows,
    # each 8 tokens of 912 FLOPs at 2 forwards.
    assert (flops["scored_pool_rows"], flops["scored_validation_rows"]) == (24, 6)
    assert flops["selection"] == pytest.approx(30 * 8 * 912 * 2.0)
    assert estimate_run_flops(tmp_path / "nothing") is None


def test_training_forwards_hand_computed():
    s = 80 / 912  # the lm_head's share of the forward at width 8 (test_forward_flops_and_scoring_forwards_hand_computed)
    assert training_forwards(HAND_COUNTED_SHAPE, 8) == 3.0
    # LoRA in the top 1 of 2 blocks: the forward, the lm_head's input gradient, one block's input gradient.
    assert training_forwards(HAND_COUNTED_SHAPE, 8, adapted_blocks=1) == pytest.approx(1 + s + (1 - s) / 2)
    # On every block: the backward is one forward's worth (no weight gradient).
    assert training_forwards(HAND_COUNTED_SHAPE, 8, adapted_blocks=2) == pytest.approx(2.0)
    # The frozen block's output handed on from the scoring pass: the forward skips it too.
    assert training_forwards(HAND_COUNTED_SHAPE, 8, adapted_blocks=1, reuse_prefix=True) == pytest.approx(2 * (s + (1 - s) / 2))


def test_run_flops_of_a_lora_run_count_no_weight_gradients_of_the_frozen_blocks(tmp_path):
    """A LoRA run in the top block of 2: its training is not 3 forwards (it was counted so before)."""
    (tmp_path / "train_budget.json").write_text(
        json.dumps(
            {"steps": 10, "trained_samples": 40, "trained_tokens": 320, "pool_samples": 40, "pool_tokens": 320,
             "world_size": 1, "model": HAND_COUNTED_SHAPE}
        )
    )
    (tmp_path / "config.yaml").write_text(
        "model:\n  lora: {r: 8, alpha: 16, dropout: 0.0, target_modules: [q_proj], top_blocks: 1}\n"
        "algorithms:\n  data_selection:\n    strategy: random\n"
    )
    (tmp_path / "selection_log.csv").write_text("step,strategy,fallback\n" + "".join(f"{i},random,0\n" for i in range(10)))
    flops = estimate_run_flops(tmp_path)
    assert flops is not None
    assert flops["train"] == pytest.approx(320 * 912 * (1 + 80 / 912 + (1 - 80 / 912) / 2))
    assert flops["selection"] == 0.0
    # Every block adapted (no top_blocks): one forward and one backward's worth of input gradients.
    (tmp_path / "config.yaml").write_text("model:\n  lora: {r: 8, alpha: 16, dropout: 0.0, target_modules: [q_proj]}\n")
    assert estimate_run_flops(tmp_path)["train"] == pytest.approx(2 * 320 * 912)


def test_a_lora_config_plans_lora_training_work():
    # The fine-tuning recipe's settings (LoRA in the top blocks, the frozen prefix handed on) on the tiny LoRA config.
    from composer_algos.registry import load_run_config

    overrides = ["model.lora.top_blocks=1", "model.reuse_scoring_prefix=true"]
    cfg = load_run_config(REPO_ROOT / "yamls" / "testing" / "tiny_finetune.yaml", overrides)
    work = config_work(cfg)
    assert (work.lora, work.lora_top_blocks, work.reuse_prefix) == (True, 1, True)
    expected = training_forwards(HAND_COUNTED_SHAPE, work.train_width, adapted_blocks=1, reuse_prefix=True)
    assert expected < 3.0
    per_row = work.train_width * forward_flops_per_token(HAND_COUNTED_SHAPE, work.train_width)
    assert work.work(HAND_COUNTED_SHAPE).train_flops == pytest.approx(work.train_rows * per_row * expected)
    plain = config_work(load_run_config(REPO_ROOT / "yamls" / "testing" / "tiny_finetune.yaml", []))
    assert (plain.lora, plain.lora_top_blocks, plain.reuse_prefix) == (True, None, False)
    assert plain.work(HAND_COUNTED_SHAPE).train_flops == pytest.approx(plain.train_rows * per_row * 2.0)  # every block adapted


# ---------------------------------------------------------------------------------------------- cost model (issue 34)
def _samples(step, features=None, selection=None):
    from composer_algos.analysis.compute_plan import StepSamples

    features = features if features is not None else [0.0] * len(step)
    return StepSamples(tuple(step), tuple(features), tuple(selection if selection is not None else features))


def test_cost_model_factors_hand_computed():
    from composer_algos.analysis.compute_plan import StepWork, fit_cost_model

    plain = StepWork(train_flops=100.0)
    ps = StepWork(train_flops=100.0, score_flops=50.0, solver="partitionsel")
    ps_small = StepWork(train_flops=100.0, score_flops=10.0, solver="partitionsel")
    model = fit_cost_model({
        "plain": (plain, _samples([1.0, 3.0])),  # 2 s / 100 FLOPs
        "ps": (ps, _samples([4.0, 4.0], features=[1.5, 1.5], selection=[2.0, 2.0])),
        "ps_small": (ps_small, _samples([2.5], features=[0.3], selection=[0.5])),
    })
    assert model.train_s_per_flop == pytest.approx(0.02)
    assert model.score_s_per_flop == pytest.approx((1.5 + 1.5 + 0.3) / (50 + 50 + 10))
    a = model.score_s_per_flop
    assert model.solve_s == pytest.approx({"plain": 0.0, "ps": 4.0 - 2.0 - 50 * a, "ps_small": 2.5 - 2.0 - 10 * a})
    assert model.step_cost("ps") == pytest.approx(4.0) and model.step_cost("ps_small") == pytest.approx(2.5)
    assert model.step_cost("plain") == pytest.approx(2.0)
    # Without a plain configuration, training is the step less the whole selection.
    alone = fit_cost_model({"ps": (ps, _samples([4.0, 4.0], features=[1.5, 1.5], selection=[2.0, 2.0]))})
    assert alone.train_s_per_flop == pytest.approx(0.02) and alone.step_cost("ps") == pytest.approx(4.0)


def test_two_configurations_of_one_strategy_keep_their_own_costs():
    """PartitionSel with and without `model.reuse_scoring_prefix` have one `StepWork` (the FLOP count does not
    see the frozen blocks the training forward skips) but different work keys and steps of 17.8 and 13.2 CPU s:
    the plan must price each at its own step, not both at one pooled mean (the fine-tuning study's 13.76)."""
    from composer_algos.analysis.compute_plan import StepWork, fit_cost_model

    plain = StepWork(train_flops=100.0)
    ps = StepWork(train_flops=100.0, score_flops=50.0, solver="partitionsel")
    model = fit_cost_model({
        "random": (plain, _samples([4.2, 4.2])),
        "ps": (ps, _samples([17.8, 17.9, 17.7], features=[9.0, 9.1, 8.9], selection=[12.0, 12.1, 11.9])),
        "ps_reuse": (ps, _samples([13.2, 13.1, 13.3], features=[9.0, 9.1, 8.9], selection=[12.0, 12.1, 11.9])),
    })
    assert model.step_cost("ps") == pytest.approx(17.8) and model.step_cost("ps_reuse") == pytest.approx(13.2)
    steps = plan_steps({"random": model.step_cost("random"), "partitionsel": model.step_cost("ps"),
                        "ps_reuse": model.step_cost("ps_reuse")},
                       ComputeBudget(reference="random", steps=20), ["random", "partitionsel", "ps_reuse"])
    assert steps == {"random": 20, "partitionsel": 4, "ps_reuse": 6}


def test_plain_configurations_of_one_size_keep_their_own_costs():
    """Two arms without a model pass and of one training size (random with two optimizers: FLOPs do not see the
    optimizer) measured at 2.0 and 3.0 s a step cost 2.0 and 3.0, not their pooled 2.5."""
    from composer_algos.analysis.compute_plan import StepWork, fit_cost_model

    plain = StepWork(train_flops=100.0)
    model = fit_cost_model({"adamw": (plain, _samples([2.0, 2.0])), "decoupled": (plain, _samples([3.0, 3.0]))})
    assert model.step_cost("adamw") == pytest.approx(2.0) and model.step_cost("decoupled") == pytest.approx(3.0)
    assert model.train_s_per_flop_at == pytest.approx({100.0: 0.025})  # the factor, pooled, says where time went


def test_each_training_size_keeps_its_own_measured_cost():
    """A plain step of twice the FLOPs measured at 1.7x (a larger batch runs faster per FLOP) costs 1.7x,
    not 2x; and calibrating it leaves the costs of the configurations already priced as they were (the
    fine-tuning study's full_pool arm moved PartitionSel from 6 steps to 5 when its factor was pooled)."""
    from composer_algos.analysis.compute_plan import StepWork, fit_cost_model

    plain = StepWork(train_flops=100.0)
    double = StepWork(train_flops=200.0)
    ps = StepWork(train_flops=100.0, score_flops=50.0, solver="partitionsel")
    classes = {"plain": (plain, _samples([2.0, 2.0])),
               "ps": (ps, _samples([5.0, 5.0], features=[1.5, 1.5], selection=[2.5, 2.5]))}
    before = fit_cost_model(classes)
    after = fit_cost_model({**classes, "double": (double, _samples([3.4, 3.4]))})
    assert after.step_cost("double") == pytest.approx(3.4) and after.step_cost("plain") == pytest.approx(2.0)
    assert after.step_cost("ps") == pytest.approx(before.step_cost("ps")) == pytest.approx(5.0)
    assert after.train_s_per_flop == pytest.approx((4.0 + 6.8) / (200 + 400))  # the pooled factor, reported


@pytest.mark.parametrize("seed", range(5))
def test_equal_work_gets_equal_steps_for_any_calibration_noise(seed):
    import random

    from composer_algos.analysis.compute_plan import StepWork, cost_spread, fit_cost_model

    rng = random.Random(seed)
    plain = StepWork(train_flops=1e9)
    ps = StepWork(train_flops=1e9, score_flops=3e8, solver="partitionsel")
    noisy = lambda c, n: [c * (1 + rng.uniform(-0.4, 0.4)) for _ in range(n)]  # noqa: E731
    ps_steps = noisy(1.4, 12)
    classes = {"plain": (plain, _samples(noisy(1.0, 12))), "ps": (ps, _samples(ps_steps, [0.3 * t for t in ps_steps]))}
    arms = {"random": "plain", "random_stratified": "plain", "partitionsel": "ps"}
    model = fit_cost_model(classes)
    costs = {label: model.step_cost(key) for label, key in arms.items()}
    steps = plan_steps(costs, ComputeBudget(reference="random", steps=80), list(arms))
    assert steps["random_stratified"] == steps["random"] == 80
    spread = cost_spread(classes, arms, reference="random", draws=50, seed=seed)
    assert spread["random_stratified"] == spread["random"] == 0.0 and spread["partitionsel"] > 0


def test_work_of_a_config_and_its_key():
    from composer_algos.analysis.compute_plan import config_work, work_key
    from composer_algos.registry import load_run_config

    def work(*overrides):
        cfg = load_run_config(TINY, list(overrides))
        w = config_work(cfg)
        return w, work_key(cfg, w)

    random, k_random = work("algorithms.data_selection.strategy=random", "seed=3", "run_name=a")
    strat, k_strat = work("algorithms.data_selection.strategy=random_stratified", "seed=4", "run_name=b")
    ps, k_ps = work("algorithms.data_selection.strategy=partitionsel")
    window, k_window = work("algorithms.data_selection.strategy=partitionsel", "algorithms.data_selection.features.score_window=16")
    none, k_none = work("algorithms.data_selection.strategy=none")
    assert k_random == k_strat and random == strat and random.solver is None
    assert len({k_random, k_ps, k_window, k_none}) == 4
    assert ps.solver == "partitionsel" and ps.pool_rows == 2 * ps.train_rows and ps.val_rows > 0
    assert window.scored_width == 16 and ps.scored_width == ps.train_width
    assert none.train_rows == ps.pool_rows  # strategy none trains the whole pool
    # Evaluation's frozen-block cache is evaluation only: a study that turned it on keeps its calibration.
    lora = ["algorithms.data_selection.strategy=random", "model.lora={r: 4, target_modules: [q_proj], top_blocks: 1}"]
    _, k_lora = work(*lora)
    _, k_cache = work(*lora, "model.eval_prefix_cache=/tmp/prefix_cache")
    assert k_cache == k_lora != k_random
    _, k_lr = work("algorithms.data_selection.strategy=random", "optimizer.lr=0.5")
    assert k_lr != k_random  # anything else in the config may change the work: its own calibration
    # A setting given at its default is the same work, so a setting added later with a default keeps saved keys.
    _, k_default = work("algorithms.data_selection.strategy=random", "model.logits_at=all")
    assert k_default == k_random
    _, k_targets = work("algorithms.data_selection.strategy=random", "model.logits_at=targets")
    assert k_targets != k_random
    from pipeline.config import config_to_dict

    settings = config_to_dict(load_run_config(TINY, ["algorithms.data_selection.strategy=random"]), skip_defaults=True)
    assert "logits_at" not in settings["model"] and "config" in settings["model"]  # defaults out, given values in


def test_step_samples_of_a_real_run_align_the_selection_log(dolma_shards, tmp_path):
    import train
    from composer_algos.analysis.compute_plan import read_step_samples
    from composer_algos.registry import load_run_config
    from tests.training.conftest import tiny_overrides

    run_dir = tmp_path / "run"
    cfg = load_run_config(TINY, tiny_overrides(dolma_shards, run_dir, "max_duration=4ba", "eval_loader=null",
                                               "callbacks.train_budget.warmup_steps=1"))
    trainer = train.build_trainer(cfg)
    trainer.fit()
    trainer.close()
    wall, shape = read_step_samples(run_dir, "wall")
    cpu, _ = read_step_samples(run_dir, "cpu")
    assert len(wall.step_s) == len(cpu.step_s) == 3 and shape["num_hidden_layers"] > 0
    for step, feat, sel in zip(wall.step_s, wall.features_s, wall.selection_s):
        assert 0 < feat <= sel <= step
    for c, w, cf, wf in zip(cpu.step_s, wall.step_s, cpu.features_s, wall.features_s):
        assert cf == pytest.approx(wf * c / w)


def test_sensitivity_counts_are_what_a_cost_one_spread_off_would_buy():
    from composer_algos.analysis.compute_plan import sensitivity_counts

    # 100 s buys 10 steps at 10 s; at 10.5 s (spread 5%) 9, at 9.5 s 10: only 9 differs.
    assert sensitivity_counts(100.0, 10.0, 0.05) == [9]
    assert sensitivity_counts(100.0, 10.0, 0.15) == [8, 11]  # 100 / 11.5 = 8.7, 100 / 8.5 = 11.8
    assert sensitivity_counts(100.0, 9.0, 0.001) == []  # 11.1 steps: a 0.1% spread cannot move it a step
    assert sensitivity_counts(100.0, 10.0, 0.0) == []  # the reference's work: exact
