"""tools/run_experiment.py: the run queue, the budget commands, and the paired and selection reports."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer_algos.mixture_io import write_mixture_json
from tests.common.models import HAND_COUNTED_SHAPE
from tests.common.paths import REPO_ROOT

TOOL = REPO_ROOT / "tools" / "run_experiment.py"
TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
NAMES = ["a", "b"]
FAKE_STEP_COST = {"random": 0.5, "random_stratified": 0.5, "partitionsel": 1.5}
NOISE: dict = {"amp": 0.0, "rng": random.Random(0)}  # the fake's per-step timing noise (relative)


def _tool():
    spec = importlib.util.spec_from_file_location("run_experiment", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _FakeProc:
    returncode = 0

    def poll(self):
        return 0


@pytest.fixture(autouse=True)
def _shard_dir_s(request, tmp_path_factory, monkeypatch):
    """The tests' `--shard-dir s`, from a directory where `s/manifest.json` exists (run_experiment refuses a
    shard directory without one before any run starts; the faked trainings read nothing from it). Not for the
    tests that train for real on `dolma_shards`: the yaml's tokenizer path is relative to the repository."""
    if "dolma_shards" in request.fixturenames:
        return
    where = tmp_path_factory.mktemp("cwd")
    (where / "s").mkdir()
    (where / "s" / "manifest.json").write_text("{}")
    monkeypatch.chdir(where)


@pytest.fixture
def fake_training(monkeypatch):
    """Replace train.py processes by a stub that records the command and environment and writes results."""
    tool = _tool()
    launched: list[tuple[list[str], dict[str, str]]] = []
    real_popen = tool.subprocess.Popen

    def popen(cmd, cwd=None, stdout=None, stderr=None, env=None, **kwargs):
        if not any(str(a).endswith("train.py") for a in cmd):  # not a training run (e.g. a library probe)
            return real_popen(cmd, cwd=cwd, stdout=stdout, stderr=stderr, env=env, **kwargs)
        launched.append((cmd, env))
        run_dir = next(a.split("=", 1)[1] for a in cmd if a.startswith("save_folder="))
        from pathlib import Path

        steps = int(_arg(cmd, "max_duration").removesuffix("ba"))
        Path(run_dir, "eval_results.json").write_text(
            json.dumps(
                {
                    "val_cross_entropy": {"a": 1.0},
                    "val_cross_entropy_mean": 1.0,
                    "wall_time_s": 1.0,
                    "selection_time_s": 0.0,
                    "steps": steps,
                }
            )
        )
        # A training second per step is the strategy's FAKE_STEP_COST (1.0 when not listed), times
        # 1 + NOISE["amp"] x a uniform draw in [-1, 1) for each timed step (the calibration's samples).
        strategy = _arg(cmd, "algorithms.data_selection.strategy")
        cost = FAKE_STEP_COST.get(strategy, 1.0)
        warmup = int(_arg(cmd, "callbacks.train_budget.warmup_steps")) if any(
            a.startswith("callbacks.train_budget.warmup_steps=") for a in cmd
        ) else 1
        timed = [cost * (1 + NOISE["amp"] * (2 * NOISE["rng"].random() - 1)) for _ in range(max(0, steps - warmup))]
        if strategy == "partitionsel":  # a third of its step is the feature pass, as selection_log.csv says
            rows = [f"{warmup + i},partitionsel,{t / 3},{t / 6},0.0" for i, t in enumerate(timed)]  # from step 0
            Path(run_dir, "selection_log.csv").write_text(
                "step,strategy,time_features_s,time_solve_s,time_exchange_s\n" + "\n".join(rows) + "\n"
            )
        Path(run_dir, "train_budget.json").write_text(
            json.dumps(
                {
                    "cpu_step_end": "after_train_batch",
                    "step_times_s": timed,
                    "step_cpu_times_s": [2 * t for t in timed],
                    "train_time_s": cost * steps,
                    "steps": steps,
                    "warmup_steps": 1,
                    "warmup_time_s": cost,
                    "step_time_s": cost if steps > 1 else None,
                    "train_cpu_s": 2 * cost * steps,  # the fake's CPU clock: twice its wall
                    "warmup_cpu_s": 2 * cost,
                    "step_cpu_s": 2 * cost if steps > 1 else None,
                    "trained_samples": 4 * steps,
                    "trained_tokens": 4 * 8 * steps,
                    "pool_samples": 8 * steps,
                    "pool_tokens": 8 * 8 * steps,
                    "world_size": 1,
                    "model": HAND_COUNTED_SHAPE,
                }
            )
        )
        return _FakeProc()

    monkeypatch.setitem(NOISE, "amp", 0.0)
    monkeypatch.setitem(NOISE, "rng", random.Random(0))
    monkeypatch.setattr(tool.subprocess, "Popen", popen)
    monkeypatch.setattr(tool.time, "sleep", lambda s: None)
    monkeypatch.setattr(tool, "plot_curves", lambda *a, **k: None)
    return tool, launched


def _arg(cmd, key):
    return next(a.split("=", 1)[1] for a in cmd if a.startswith(key + "="))


def test_queue_is_seed_major_and_every_run_gets_omp_threads(fake_training, tmp_path, monkeypatch):
    tool, launched = fake_training
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    rc = tool.main(
        [
            "--yaml",
            str(TINY),
            "--shard-dir",
            "s",
            "--strategies",
            "random,partitionsel",
            "--seeds",
            "1,2",
            "--steps",
            "3",
            "--out",
            str(tmp_path / "exp"),
        ]
    )
    assert rc == 0
    order = [(_arg(c, "algorithms.data_selection.strategy"), _arg(c, "seed")) for c, _ in launched]
    assert order == [("random", "1"), ("partitionsel", "1"), ("random", "2"), ("partitionsel", "2")]
    for _, env in launched:  # --jobs 1 included
        assert int(env["OMP_NUM_THREADS"]) >= 1


def test_with_several_jobs_the_costlier_runs_of_each_seed_start_first(fake_training, tmp_path):
    """Seed-major still; within a seed, at equal steps, the runs whose step does more work first (tiny_dolma:
    kappa 16 of 128 tokens): partitionsel (16 rows trained, its pool of 32 and 4 validation rows scored), then
    none (the pool of 32 trained), then random (16 rows). At equal compute every run costs about the budget."""
    tool, launched = fake_training
    args = ["--yaml", str(TINY), "--shard-dir", "s", "--strategies", "random,none,partitionsel", "--seeds", "1,2",
            "--jobs", "2", "--steps", "3", "--out", str(tmp_path / "exp")]
    assert tool.main(args) == 0
    order = [(_arg(c, "algorithms.data_selection.strategy"), _arg(c, "seed")) for c, _ in launched]
    assert order == [(s, str(seed)) for seed in (1, 2) for s in ["partitionsel", "none", "random"]], order


def test_run_env_divides_cores_among_jobs():
    tool = _tool()
    assert tool.run_env({}, jobs=1, cores=8)["OMP_NUM_THREADS"] == "8"
    assert tool.run_env({}, jobs=3, cores=8)["OMP_NUM_THREADS"] == "2"
    assert tool.run_env({}, jobs=16, cores=8)["OMP_NUM_THREADS"] == "1"
    assert tool.run_env({"X": "1"}, jobs=2, cores=8, gpu="3") == {
        "X": "1",
        "OMP_NUM_THREADS": "4",
        "CUDA_VISIBLE_DEVICES": "3",
    }


def test_budget_commands(fake_training, tmp_path):
    tool, launched = fake_training
    rc = tool.main(
        [
            "--yaml",
            str(TINY),
            "--shard-dir",
            "s",
            "--strategies",
            "random",
            "--seeds",
            "1",
            "--budget-seconds",
            "7.5",
            "--steps",
            "40",
            "--log-selected-ids",
            "--out",
            str(tmp_path / "exp"),
        ]
    )
    assert rc == 0
    ((cmd, _),) = launched
    assert _arg(cmd, "callbacks.train_budget.budget_seconds") == "7.5"
    assert _arg(cmd, "callbacks.mixture_monitor.log_selected_ids") == "true"
    assert _arg(cmd, "max_duration") == "40ba"  # the cap the user gave: the schedule's horizon
    md = (tmp_path / "exp" / "comparison.md").read_text()
    assert "training-time budget of 7.5 s" in md and "schedule laid over 40 steps" in md


def test_budget_seconds_needs_an_explicit_step_cap(tmp_path, capsys):
    """The hidden default cap of 1,000,000 steps made a 0.03dur warm-up and `end: 0.5` never arrive."""
    with pytest.raises(SystemExit):
        _tool().main(
            ["--yaml", str(TINY), "--shard-dir", "s", "--budget-seconds", "5", "--out", str(tmp_path)]
        )
    err = capsys.readouterr().err
    assert "--budget-seconds needs --steps" in err and "--compute-budget" in err


def test_needs_steps_or_budget(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _tool().main(["--yaml", str(TINY), "--shard-dir", "s", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "--budget-seconds" in err and "--compute-budget" in err


@pytest.mark.parametrize("other", [["--steps", "3"], ["--budget-seconds", "5", "--steps", "3"]])
def test_compute_budget_excludes_the_other_budgets(other, tmp_path, capsys):
    with pytest.raises(SystemExit):
        _tool().main(
            ["--yaml", str(TINY), "--shard-dir", "s", "--compute-budget", "random=4", *other, "--out", str(tmp_path)]
        )
    assert "--compute-budget" in capsys.readouterr().err


def _compute_args(tmp_path, *extra):
    return [
        "--yaml",
        str(TINY),
        "--shard-dir",
        "s",
        "--strategies",
        "random,partitionsel",
        "--seeds",
        "1,2",
        "--out",
        str(tmp_path / "exp"),
        *extra,
    ]


def test_compute_budget_with_given_step_costs_gives_each_run_its_own_steps(fake_training, tmp_path):
    tool, launched = fake_training
    rc = tool.main(
        _compute_args(tmp_path, "--compute-budget", "random=40", "--step-costs", "random=0.5,partitionsel=1.0")
    )
    assert rc == 0
    assert len(launched) == 4  # no calibration: the costs were given
    for cmd, _ in launched:
        steps = {"random": 40, "partitionsel": 20}[_arg(cmd, "algorithms.data_selection.strategy")]
        assert _arg(cmd, "max_duration") == f"{steps}ba"  # the schedule's horizon is the run's own steps
        assert _arg(cmd, "save_interval") == f"{steps}ba"
        assert _arg(cmd, "eval_interval") == f"{steps // 5}ba"
        assert _arg(cmd, "callbacks.train_budget.budget_seconds") == "null"
    plan = json.loads((tmp_path / "exp" / "plan.json").read_text())
    assert plan["steps"] == {"random": 40, "partitionsel": 20} and plan["cost_source"] == "given"
    md = (tmp_path / "exp" / "comparison.md").read_text()
    assert "equal compute: the cost of 40 steps of random" in md
    assert "| partitionsel | 2 | 20 | 20 |" in md  # the per-run table: label, seed, planned and trained steps


def test_compute_budget_calibrates_every_configuration_first_and_reuses_it(fake_training, tmp_path):
    tool, launched = fake_training
    args = _compute_args(
        tmp_path, "--compute-budget", "random=60", "--calibration-steps", "6", "--calibration-warmup", "2"
    )
    assert tool.main(args) == 0
    # Noise-free timings: two interleaved rounds of both configurations already agree to 0%.
    calibrations = [c for c, _ in launched if "/calibration/" in _arg(c, "save_folder")]
    runs = [c for c, _ in launched if "/calibration/" not in _arg(c, "save_folder")]
    assert [_arg(c, "algorithms.data_selection.strategy") for c in calibrations] == [
        "random", "partitionsel", "partitionsel", "random"
    ]
    for cmd in calibrations:
        assert _arg(cmd, "max_duration") == "8ba" and _arg(cmd, "seed") == "1"
        assert _arg(cmd, "eval_loader") == "null"
        assert _arg(cmd, "callbacks.train_budget.warmup_steps") == "2"
    # Measured 0.5 and 1.5 s a step: 60 random steps cost 30 s, which buy 20 partitionsel steps.
    steps = {_arg(c, "algorithms.data_selection.strategy"): _arg(c, "max_duration") for c in runs}
    assert steps == {"random": "60ba", "partitionsel": "20ba"} and len(runs) == 4
    plan = json.loads((tmp_path / "exp" / "plan.json").read_text())
    assert plan["spread"] == {"random": 0.0, "partitionsel": 0.0} and plan["sensitivity"] == {}
    model = plan["calibration"]["model"]  # the feature pass is a third of partitionsel's 1.5 s
    assert model["solve_s"]["partitionsel"] == pytest.approx(1.5 - 0.5 - 0.5)
    launched.clear()
    assert tool.main(args) == 0
    assert launched == []  # calibration and runs reused


def test_arms_of_equal_work_get_equal_steps_whatever_the_calibration_measured(fake_training, tmp_path):
    """random_stratified draws a few indices more than random: the same work, so the same steps (issue 34)."""
    tool, launched = fake_training
    NOISE["amp"] = 0.3
    args = _compute_args(tmp_path, "--compute-budget", "random=80", "--calibration-rounds", "3", "--strategies",
                         "random,random_stratified,partitionsel", "--seeds", "1")
    assert tool.main(args) == 0
    calibrated = {_arg(c, "algorithms.data_selection.strategy") for c, _ in launched if "/calibration/" in _arg(c, "save_folder")}
    assert calibrated == {"random", "partitionsel"}  # one calibration for the two of equal work
    plan = json.loads((tmp_path / "exp" / "plan.json").read_text())
    assert plan["steps"]["random_stratified"] == plan["steps"]["random"] == 80
    assert plan["step_costs_s"]["random_stratified"] == plan["step_costs_s"]["random"]
    assert plan["spread"]["random_stratified"] == 0.0 and plan["spread"]["partitionsel"] > 0


def test_a_saved_calibration_reproduces_the_step_counts(fake_training, tmp_path):
    tool, launched = fake_training
    NOISE["amp"] = 0.3
    first = _compute_args(tmp_path, "--compute-budget", "random=80", "--calibration-rounds", "3", "--seeds", "1")
    assert tool.main(first) == 0
    planned = json.loads((tmp_path / "exp" / "plan.json").read_text())
    # Another experiment planned with that file: no calibration run, the same costs and steps, though
    # a new calibration on this (noisy) machine would measure other costs.
    launched.clear()
    other = tmp_path / "other"
    args = [*first, "--out", str(other), "--calibration", str(tmp_path / "exp" / "calibration.json")]  # the last --out wins
    assert tool.main(args) == 0
    assert not [c for c, _ in launched if "/calibration/" in _arg(c, "save_folder")]
    again = json.loads((other / "plan.json").read_text())
    assert again["steps"] == planned["steps"] and again["step_costs_s"] == planned["step_costs_s"]


def test_calibration_rounds_go_on_until_the_spread_is_within_the_target(fake_training, tmp_path):
    tool, launched = fake_training
    NOISE["amp"] = 0.02
    args = _compute_args(tmp_path, "--compute-budget", "random=80", "--calibration-rounds", "6", "--seeds", "1",
                         "--calibration-target", "0.002")
    assert tool.main(args) == 0
    plan = json.loads((tmp_path / "exp" / "plan.json").read_text())
    rounds = plan["calibration"]["rounds"]
    assert 2 < rounds <= 6
    assert plan["calibration"]["max_spread"] <= 0.002 or rounds == 6


def test_sensitivity_runs_train_each_noisy_arm_either_side_of_its_plan(fake_training, tmp_path):
    tool, launched = fake_training
    NOISE["amp"] = 0.5
    args = _compute_args(tmp_path, "--compute-budget", "random=80", "--calibration-rounds", "2", "--seeds", "1,2",
                         "--calibration-steps", "3", "--paired-baseline", "random")
    assert tool.main(args) == 0
    plan = json.loads((tmp_path / "exp" / "plan.json").read_text())
    n = plan["steps"]["partitionsel"]
    low, high = plan["sensitivity"]["partitionsel"]
    # The counts the budget buys at the cost -/+ one spread (hand-computed from the plan's own numbers).
    cost, s, budget = plan["step_costs_s"]["partitionsel"], plan["spread"]["partitionsel"], plan["budget_seconds"]
    assert (low, high) == (int(budget / (cost * (1 + s))), int(budget / (cost * (1 - s))))
    assert low < n < high and "random" not in plan["sensitivity"]
    trained = {(_arg(c, "save_folder").rsplit("/", 1)[1], _arg(c, "max_duration")) for c, _ in launched}
    for seed in (1, 2):
        assert (f"partitionsel@{low}-seed{seed}", f"{low}ba") in trained
        assert (f"partitionsel@{high}-seed{seed}", f"{high}ba") in trained
    md = (tmp_path / "exp" / "sensitivity.md").read_text()
    assert f"| partitionsel | {low} / **{n}** / {high} |" in md


def test_sensitivity_marks_a_verdict_that_flips_inside_the_noise():
    from composer_algos.analysis.experiment_stats import sensitivity

    def runs(values):
        return {seed: {"average": v, "domains": {}} for seed, v in enumerate(values, 1)}

    per_seed = {
        "random": runs([1.0, 1.0, 1.0]),
        "a": runs([0.90, 0.91, 0.92]),  # lower than random beyond noise at the planned 10 steps
        "a@9": runs([1.05, 0.95, 1.01]),  # level at 9
        "a@11": runs([0.80, 0.81, 0.82]),
        "b": runs([1.10, 1.11, 1.12]),
        "b@9": runs([1.10, 1.12, 1.11]),
        "b@11": runs([1.08, 1.09, 1.10]),
    }
    out = sensitivity(per_seed, {"a": [9, 11], "b": [9, 11]}, {"a": 10, "b": 10}, baseline="random",
                      label_at=lambda arm, n: f"{arm}@{n}")
    assert out["a"]["steps"] == [9, 10, 11] and out["a"]["planned"] == 10
    assert out["a"]["verdicts"] == ["level", "lower", "lower"] and out["a"]["flips"]
    assert out["b"]["verdicts"] == ["higher"] * 3 and not out["b"]["flips"]


def test_a_plan_that_never_leaves_warmup_is_rejected_before_training(fake_training, tmp_path, capsys):
    """tiny_dolma warms up over 10ba: 5 planned steps of partitionsel would end inside the warm-up."""
    tool, launched = fake_training
    with pytest.raises(SystemExit):
        tool.main(_compute_args(tmp_path, "--compute-budget", "random=20", "--step-costs", "random=1,partitionsel=4"))
    err = capsys.readouterr().err
    assert "partitionsel" in err and "5 steps" in err and "t_warmup 10ba" in err
    assert launched == []


def test_compute_report_lists_steps_time_and_flops_per_run(fake_training, tmp_path):
    tool, _ = fake_training
    assert tool.main(_compute_args(tmp_path, "--compute-budget", "random=10", "--step-costs", "random=1,partitionsel=2", "--eval-interval", "5", "--", "scheduler.t_warmup=2ba")) == 0
    table = json.loads((tmp_path / "exp" / "comparison.json").read_text())
    runs = {(r["label"], r["seed"]): r for r in table["runs"]}
    ps = runs[("partitionsel", 2)]
    assert (ps["planned_steps"], ps["steps"], ps["train_time_s"]) == (5, 5, 7.5)
    assert ps["flops"]["train"] > 0 and runs[("random", 1)]["flops"]["selection"] == 0


def _fake_run(out, strategy, seed, avg, doms, mixture, pools_sel, conflict=None):
    run = out / f"{strategy}-seed{seed}"
    run.mkdir(parents=True)
    (run / "eval_results.json").write_text(
        json.dumps(
            {
                "val_cross_entropy": dict(zip(NAMES, doms)),
                "val_cross_entropy_mean": avg,
                "wall_time_s": 10.0,
                "selection_time_s": 1.0,
                "steps": 4,
            }
        )
    )
    (run / "train_budget.json").write_text(
        json.dumps({"budget_seconds": 5.0, "train_time_s": 5.2, "steps": 4, "stopped_by_budget": True})
    )
    write_mixture_json(
        run / "mixture.json",
        method=strategy,
        domain_names=NAMES,
        weights=mixture,
        steps=2,
        natural=[0.25, 0.75],
    )
    (run / "selected_ids.jsonl").write_text(
        "".join(
            json.dumps({"step": i, "pool": p, "selected": s}) + "\n" for i, (p, s) in enumerate(pools_sel)
        )
    )
    rows = "step,conflict_fraction\n" + "".join(
        f"{i},{'' if conflict is None else conflict}\n" for i in range(2)
    )
    (run / "selection_log.csv").write_text(rows)


def test_paired_and_selection_report_from_finished_runs(tmp_path, capsys):
    out = tmp_path / "exp"
    pools = [[0, 1, 2, 3], [4, 5, 6, 7]]
    for seed, (b, s) in enumerate([(2.0, 1.9), (2.5, 2.2), (3.0, 2.8)], start=1):
        _fake_run(
            out, "random", seed, b, [b - 0.5, b + 0.5], [0.25, 0.75], [(pools[0], [0, 1]), (pools[1], [4, 5])]
        )
        _fake_run(
            out,
            "partitionsel",
            seed,
            s,
            [s - 0.5, s + 0.5],
            [0.5, 0.5],
            [(pools[0], [1, 2]), (pools[1], [4, 5])],
            conflict=0.25,
        )
    rc = _tool().main(
        [
            "--yaml",
            str(TINY),
            "--shard-dir",
            "s",
            "--strategies",
            "random,partitionsel",
            "--seeds",
            "1,2,3",
            "--budget-seconds",
            "5",
            "--steps",
            "4",
            "--paired-baseline",
            "random",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    paired = json.loads((out / "paired.json").read_text())
    avg = paired["strategies"]["partitionsel"]["average"]
    # Hand-computed: differences -0.1, -0.3, -0.2; mean -0.2; sd 0.1; t(0.975, 2) = 4.302653
    half = 4.302653 * 0.1 / math.sqrt(3)
    assert avg["differences"] == pytest.approx([-0.1, -0.3, -0.2])
    assert (avg["mean"], avg["ci_low"], avg["ci_high"]) == pytest.approx(
        (-0.2, -0.2 - half, -0.2 + half), abs=1e-5
    )
    assert paired["strategies"]["partitionsel"]["domains"]["a"]["mean"] == pytest.approx(-0.2)
    printed = capsys.readouterr().out
    assert "partitionsel - random" in printed and (out / "paired.md").read_text().strip() in printed

    sel = json.loads((out / "selection.json").read_text())
    ps = sel["strategies"]["partitionsel"]
    # step 0: {1,2} vs {0,1} -> 1/3; step 1: identical -> 1
    assert ps["pools_identical"] is True and ps["mean_jaccard"] == pytest.approx(2 / 3)
    assert ps["conflict_fraction"] == pytest.approx(0.25)
    assert sel["natural"] == pytest.approx({"a": 0.25, "b": 0.75})
    assert ps["induced_mixture"] == pytest.approx({"a": 0.5, "b": 0.5})
    assert ps["tv_vs_natural"] == pytest.approx(0.25)
    md = (out / "selection.md").read_text()
    assert "yes (seeds 1, 2, 3)" in md and "0.6667" in md
    table = json.loads((out / "comparison.json").read_text())
    assert table["strategies"]["random"]["train_time_s"]["mean"] == pytest.approx(5.2)


def test_selection_report_flags_different_pools(tmp_path):
    out = tmp_path / "exp"
    _fake_run(out, "random", 1, 2.0, [1.0, 3.0], [0.5, 0.5], [([0, 1, 2, 3], [0, 1])])
    _fake_run(out, "greats", 1, 2.0, [1.0, 3.0], [0.5, 0.5], [([0, 1, 2, 9], [0, 1])])
    sel = _tool().selection_report(out, ["random", "greats"], [1])
    assert sel["strategies"]["greats"]["pools_identical"] is False
    assert "NO: first differing step per seed 1: 0" in _tool().format_selection_markdown(sel)


def test_help_is_fast_and_imports_nothing_heavy():
    code = (
        "import runpy, sys, time\n"
        f"sys.argv = [{str(TOOL)!r}, '--help']\n"
        "t0 = time.perf_counter()\n"
        "try:\n"
        f"    runpy.run_path({str(TOOL)!r}, run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in ('torch', 'composer', 'matplotlib', 'streaming', 'numpy') if m in sys.modules))\n"
    )
    t0 = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )
    elapsed = time.perf_counter() - t0
    assert result.returncode == 0, result.stderr
    assert "--budget-seconds" in result.stdout and "--paired-baseline" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert elapsed < 2.0, f"--help took {elapsed:.2f}s"


def test_variants_run_as_named_configurations(fake_training, tmp_path):
    tool, launched = fake_training
    rc = tool.main(
        [
            "--yaml",
            str(TINY),
            "--shard-dir",
            "s",
            "--strategies",
            "random",
            "--seeds",
            "1",
            "--steps",
            "3",
            "--variant",
            "ps_w=partitionsel,algorithms.data_selection.weighted_loss=true",
            "--paired-baseline",
            "random",
            "--out",
            str(tmp_path / "exp"),
        ]
    )
    assert rc == 0
    (cmd_r, _), (cmd_v, _) = launched
    assert _arg(cmd_v, "algorithms.data_selection.strategy") == "partitionsel"
    assert _arg(cmd_v, "algorithms.data_selection.weighted_loss") == "true"
    assert _arg(cmd_v, "save_folder").endswith("ps_w-seed1")
    assert "algorithms.data_selection.weighted_loss=true" not in cmd_r
    assert "ps_w" in (tmp_path / "exp" / "paired.md").read_text()


@pytest.mark.parametrize("bad", ["ps_w", "ps_w=nosuch", "random=random", "x=partitionsel,weighted_loss"])
def test_bad_variants_are_rejected_naming_them(bad, tmp_path, capsys):
    tool = _tool()
    with pytest.raises(SystemExit):
        tool.main(
            [
                "--yaml",
                str(TINY),
                "--shard-dir",
                "s",
                "--strategies",
                "random",
                "--steps",
                "3",
                "--variant",
                bad,
                "--out",
                str(tmp_path / "exp"),
            ]
        )
    assert "--variant" in capsys.readouterr().err


def test_variant_values_may_hold_commas_inside_braces():
    tool = _tool()
    label, strategy, overrides = tool.parse_variant("u=partitionsel,a.b={x:1,y:2},c=[1,2],d=3")
    assert (label, strategy) == ("u", "partitionsel")
    assert overrides == ["a.b={x:1,y:2}", "c=[1,2]", "d=3"]


def test_report_only_trains_nothing_and_reports_the_finished_runs(fake_training, tmp_path, capsys):
    tool, launched = fake_training
    out = tmp_path / "exp"
    for seed, avg in ((1, 2.0), (2, 2.4)):
        _fake_run(out, "random", seed, avg, [avg - 0.5, avg + 0.5], [0.25, 0.75], [([0, 1], [0])])
    rc = tool.main(
        [
            "--yaml", str(TINY), "--shard-dir", str(tmp_path), "--strategies", "random,partitionsel",
            "--seeds", "1,2", "--steps", "4", "--out", str(out), "--report-only",
        ]
    )
    assert rc == 0 and launched == []
    printed = capsys.readouterr().out
    assert "2 runs not finished" in printed and "partitionsel-seed1" in printed
    summary = json.loads((out / "comparison.json").read_text())
    assert summary["strategies"]["random"]["average"]["mean"] == pytest.approx(2.2)


def test_report_only_without_the_baselines_runs_ends_with_one_line(fake_training, tmp_path, capsys):
    """--report-only on an OUT where the paired baseline has no finished run: exit 2 and why, not a traceback."""
    tool, launched = fake_training
    out = tmp_path / "exp"
    _fake_run(out, "partitionsel", 1, 2.0, [1.5, 2.5], [0.25, 0.75], [([0, 1], [0])])
    rc = tool.main(
        [
            "--yaml", str(TINY), "--shard-dir", str(tmp_path), "--strategies", "random,partitionsel",
            "--seeds", "1,2", "--steps", "4", "--out", str(out), "--report-only", "--paired-baseline", "random",
        ]
    )
    assert rc == 2 and launched == []
    err = capsys.readouterr().err
    assert f"--report-only: no finished run of the paired baseline 'random' in {out}" in err


def test_calibration_on_the_cpu_clock_plans_in_cpu_seconds(fake_training, tmp_path):
    """--cost-clock cpu: 1.0 and 3.0 CPU s a step (the fake's); a budget of 9 CPU s buys 9 and 3 steps."""
    tool, launched = fake_training
    assert tool.main(_compute_args(tmp_path, "--compute-budget", "9s", "--cost-clock", "cpu", "--", "scheduler.t_warmup=0.1dur")) == 0
    runs = launched[2:]
    steps = {_arg(c, "algorithms.data_selection.strategy"): _arg(c, "max_duration") for c, _ in runs}
    assert steps == {"random": "9ba", "partitionsel": "3ba"}
    plan = json.loads((tmp_path / "exp" / "plan.json").read_text())
    assert plan["clock"] == "cpu" and plan["step_costs_s"] == {"random": 1.0, "partitionsel": 3.0}
    assert "9 CPU s of training" in (tmp_path / "exp" / "comparison.md").read_text()


def test_calibration_from_finished_runs_runs_no_calibration_of_its_own(fake_training, tmp_path):
    """Equal-steps runs (the fake's 0.5 and 1.5 s a step, +-30% noise) price the equal-compute plan:
    one calibration chunk per finished run, no calibration run, and an arm of a group with samples keeps them."""
    tool, launched = fake_training
    NOISE["amp"] = 0.3
    steps_out = tmp_path / "steps"
    assert tool.main([*_compute_args(tmp_path, "--steps", "12", "--seeds", "1,2,3"), "--out", str(steps_out)]) == 0
    launched.clear()
    args = _compute_args(tmp_path, "--compute-budget", "random=30", "--seeds", "1,2,3", "--calibration-rounds", "2",
                         "--calibration-from", str(steps_out), "--no-sensitivity", "--", "scheduler.t_warmup=0.1dur")
    assert tool.main(args) == 0
    assert not [c for c, _ in launched if "/calibration/" in _arg(c, "save_folder")]
    plan = json.loads((tmp_path / "exp" / "plan.json").read_text())
    assert plan["calibration"]["rounds"] == 3 and plan["calibration"]["timed_steps"] == {"random": 33, "partitionsel": 33}
    assert sorted(plan["calibration"]["from_runs"]["partitionsel"]) == [str(steps_out / f"partitionsel-seed{s}") for s in (1, 2, 3)]
    ratio = plan["step_costs_s"]["partitionsel"] / plan["step_costs_s"]["random"]
    assert 2.5 < ratio < 3.5 and plan["steps"]["partitionsel"] == int(30 / ratio)
    # A later plan with the same file keeps those samples even though more runs have finished since.
    saved = json.loads((tmp_path / "exp" / "calibration.json").read_text())
    assert tool.main([*_compute_args(tmp_path, "--steps", "12", "--seeds", "4"), "--out", str(steps_out)]) == 0
    assert tool.main(args) == 0
    assert json.loads((tmp_path / "exp" / "calibration.json").read_text())["groups"] == saved["groups"]


def test_runs_that_predate_the_cpu_fix_are_left_out_and_their_group_calibrates_itself(fake_training, tmp_path, capsys):
    tool, launched = fake_training
    steps_out = tmp_path / "steps"
    assert tool.main([*_compute_args(tmp_path, "--steps", "4", "--seeds", "1"), "--out", str(steps_out)]) == 0
    old = steps_out / "partitionsel-seed1" / "train_budget.json"
    budget = json.loads(old.read_text())
    del budget["cpu_step_end"]
    old.write_text(json.dumps(budget))
    launched.clear()
    assert tool.main(_compute_args(tmp_path, "--compute-budget", "random=8", "--seeds", "1", "--calibration-from", str(steps_out),
                                   "--calibration-rounds", "2", "--", "scheduler.t_warmup=0.1dur")) == 0
    assert str(old) in capsys.readouterr().out
    calibrated = [_arg(c, "algorithms.data_selection.strategy") for c, _ in launched if "/calibration/" in _arg(c, "save_folder")]
    # Two chunks each: random's run is one of its two, partitionsel's stale run is none of its.
    assert sorted(calibrated) == ["partitionsel", "partitionsel", "random"]


@pytest.mark.parametrize("flag", [["--step-costs", "random=1"], ["--cost-clock", "cpu"], ["--calibration-steps", "4"]])
def test_equal_compute_flags_without_a_compute_budget_are_rejected(flag, tmp_path, capsys):
    with pytest.raises(SystemExit):
        _tool().main(["--yaml", str(TINY), "--shard-dir", "s", "--steps", "3", *flag, "--out", str(tmp_path)])
    assert f"{flag[0]} only apply with --compute-budget" in capsys.readouterr().err


def test_a_finished_run_of_another_plan_is_trained_again_and_says_why(fake_training, tmp_path, capsys):
    # It was reused with a note, and the report then called its 20 steps 25 (a new-user review). The stub writes
    # no config.yaml, so the steps are what is compared (tests/tools/test_run_experiment_reuse.py: the settings).
    tool, launched = fake_training
    args = _compute_args(tmp_path, "--compute-budget", "random=40", "--step-costs", "random=0.5,partitionsel=1.0")
    assert tool.main(args) == 0
    launched.clear()
    args[args.index("random=0.5,partitionsel=1.0")] = "random=0.5,partitionsel=0.8"  # now 25 steps
    assert tool.main(args) == 0
    assert sorted(_arg(c, "max_duration") for c, _ in launched) == ["25ba", "25ba"]
    assert "partitionsel-seed1: finished with other settings (steps: 20 -> 25); training it again" in (
        capsys.readouterr().out
    )


def test_a_run_finished_elsewhere_with_the_same_settings_is_linked_not_retrained(dolma_shards, tmp_path):
    import train
    from tests.training.conftest import tiny_overrides

    tool = _tool()
    src = tmp_path / "steps" / "random-seed1"

    def command(run_dir, *extra):
        return tool.train_command(
            yaml=TINY, shard_dir=str(dolma_shards), strategy="random", seed=1, steps=3, eval_interval=3, run_dir=run_dir,
            run_name=run_dir.parent.name, extra=[*tiny_overrides(dolma_shards, run_dir)[1:], *extra],
        )

    finished = command(src)
    train.main(finished[2:])  # a real run of the tiny config: config.yaml, eval_results.json
    dst = tmp_path / "compute" / "random-seed1"
    assert tool.reuse_finished_run(dst, [tmp_path / "steps"], steps=3, command=command(dst)) == src
    assert dst.is_symlink() and (dst / "eval_results.json").exists()
    other = tmp_path / "other" / "random-seed1"
    # Another learning rate, or another step count, is another run.
    assert tool.reuse_finished_run(other, [tmp_path / "steps"], steps=3, command=command(other, "optimizer.lr=0.5")) is None
    assert tool.reuse_finished_run(other, [tmp_path / "steps"], steps=4, command=command(other)) is None
    assert not other.exists()


def test_bad_settings_and_shards_are_refused_before_any_run_starts_and_paths_follow_the_caller(fake_training, tmp_path,
                                                                                              capsys):
    """A new-user review: with --steps, a typo in an override or a --shard-dir without shards launched every run in
    turn, each failing with its reason only in its log; and the runs train in the repository's directory, so a
    relative --out or --shard-dir named other folders there than here. Now the configurations load and the shards
    are found before any run, and the paths given are made absolute."""
    tool, launched = fake_training
    base = ["--yaml", str(TINY), "--strategies", "random,partitionsel", "--seeds", "1", "--steps", "3"]
    with pytest.raises(SystemExit):
        tool.main([*base, "--shard-dir", "s", "--out", "exp", "--", "optimizer.lrr=1"])
    err = capsys.readouterr().err
    assert "run 'random'" in err and "optimizer.lrr" in err and launched == [], err
    with pytest.raises(SystemExit):
        tool.main([*base, "--shard-dir", "nowhere", "--out", "exp"])
    err = capsys.readouterr().err
    assert "--shard-dir: nowhere holds no manifest.json" in err and launched == [], err
    assert tool.main([*base, "--shard-dir", "s", "--out", "exp"]) == 0  # relative, from this test's directory
    here = Path.cwd()
    for cmd, _ in launched:
        assert _arg(cmd, "variables.shard_dir") == str(here / "s")
        assert _arg(cmd, "save_folder").startswith(str(here / "exp") + "/"), _arg(cmd, "save_folder")


def test_a_failed_runs_reason_is_printed_from_its_log(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("Traceback (most recent call last):\n  File ...\nValueError: the pool is larger than the split\n")
    assert _tool()._last_error(log) == "\n    ValueError: the pool is larger than the split"
    log.write_text("step 1\ntrain.py: yamls/x.yaml: invalid configuration: optimizer.lrr\n")
    assert _tool()._last_error(log) == "\n    train.py: yamls/x.yaml: invalid configuration: optimizer.lrr"
    log.write_text("all fine\n")
    assert _tool()._last_error(log) == "" and _tool()._last_error(tmp_path / "missing.log") == ""


def test_a_run_saved_with_a_relative_path_is_the_run_given_it_absolute():
    """run_experiment now gives the runs absolute paths; a finished run saved with the relative ones (read from the
    repository's directory, where the runs train) is the same run, not one to train again."""
    tool = _tool()
    saved = {"tokenizer_name": "assets/tokenizer", "train_loader": {"dataset": {"shard_dir": "assets"}}}
    same = {"tokenizer_name": str(REPO_ROOT / "assets" / "tokenizer"), "train_loader": {"dataset": {"shard_dir": str(REPO_ROOT / "assets")}}}
    assert tool._settings_differences(saved, same) == []
    other = {"tokenizer_name": str(REPO_ROOT / "assets"), "train_loader": {"dataset": {"shard_dir": "s3://b/assets"}}}
    assert [d.split(":")[0] for d in tool._settings_differences(saved, other)] == ["tokenizer_name", "train_loader.dataset.shard_dir"]
