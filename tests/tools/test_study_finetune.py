"""tools/studies/study_finetune.py: the study's commands, the linked runs of random's work, and its report tables."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.common.paths import REPO_ROOT

spec = importlib.util.spec_from_file_location("study_finetune", REPO_ROOT / "tools" / "studies" / "study_finetune.py")
assert spec is not None and spec.loader is not None
study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study)


def _arg(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def _variants(cmd):
    return {v.split("=", 1)[0]: v for v, f in zip(cmd[1:], cmd) if f == "--variant"}


def test_quick_commands_run_equal_steps_then_equal_compute_paired_against_random(tmp_path):
    steps, compute = study.study_commands(tmp_path, shards=tmp_path / "s", arms=list(study.QUICK_ARMS), seeds="1,2",
                                          steps=40, jobs=2)
    for cmd in (steps, compute):
        assert _arg(cmd, "--strategies") == "random,random_stratified,partitionsel"
        assert _arg(cmd, "--paired-baseline") == "random" and _arg(cmd, "--yaml") == str(study.YAML)
        assert "eval_loader.subset_num_batches=1" in cmd[cmd.index("--") :]
        # every run shares one cache of the frozen blocks' outputs on the evaluation sets
        assert f"model.eval_prefix_cache={tmp_path / 'prefix_cache'}" in cmd[cmd.index("--") :]
        # the order the study's runs were made with, whatever the recipe's shuffle
        assert "train_loader.dataset.shuffle_algo=py1e" in cmd[cmd.index("--") :]
        # and the step its runs were made with (the recipe's reuse_scoring_prefix is newer)
        assert "model.reuse_scoring_prefix=false" in cmd[cmd.index("--") :]
    assert _arg(steps, "--steps") == "40" and _arg(steps, "--out") == str(tmp_path / "equal_steps")
    assert _arg(compute, "--compute-budget") == "random=40" and _arg(compute, "--cost-clock") == "cpu"
    assert _arg(compute, "--out") == str(tmp_path / "equal_compute") and "--steps" not in compute
    assert _arg(compute, "--reuse-from") == str(tmp_path / "equal_steps")  # random's runs are the same runs
    # and the equal-steps runs price the plan: no calibration rounds of its own
    assert _arg(compute, "--calibration-from") == str(tmp_path / "equal_steps")


def test_full_profile_names_every_arm_and_the_variants_their_settings(tmp_path):
    cmd = study.study_commands(tmp_path, shards=tmp_path, arms=list(study.ARMS), seeds="1", steps=40, jobs=2)[0]
    plain = _arg(cmd, "--strategies").split(",")
    variants = _variants(cmd)
    assert set(plain) | set(variants) == set(study.ARMS)
    assert variants["ps_r4"] == "ps_r4=partitionsel,algorithms.data_selection.oversampling=4"
    assert variants["full_pool"] == "full_pool=none"
    assert variants["ps_reuse"] == "ps_reuse=partitionsel,model.reuse_scoring_prefix=true"  # after the tail: it wins
    assert variants["ps_ahead"] == "ps_ahead=partitionsel,algorithms.data_selection.select_ahead=true"


def _comparison(losses, accuracies):
    """comparison.json of run_experiment: label -> per-seed average loss / accuracy (2 domains each)."""
    per_seed = {k: {str(s): {"average": v, "domains": {"a": v, "b": v}} for s, v in enumerate(vals, 1)} for k, vals in losses.items()}
    per_acc = {k: {str(s): {"average": v, "domains": {"a": v, "b": v}} for s, v in enumerate(vals, 1)} for k, vals in accuracies.items()}
    strategies = {k: {"average": {"mean": sum(v) / len(v), "std": 0.0}, "accuracy": {"mean": sum(accuracies[k]) / 3, "std": 0.0},
                      "steps": {"mean": 40.0, "std": 0.0}} for k, v in losses.items()}
    return {"strategies": strategies, "per_seed": per_seed, "per_seed_accuracy": per_acc}


def test_report_pairs_loss_and_accuracy_against_random_and_random_stratified(tmp_path):
    losses = {"random": [1.0, 1.1, 1.2], "random_stratified": [0.9, 1.0, 1.1], "partitionsel": [0.8, 0.9, 1.0]}
    accuracies = {"random": [0.1, 0.2, 0.3], "random_stratified": [0.1, 0.2, 0.3], "partitionsel": [0.2, 0.3, 0.4]}
    (tmp_path / "equal_steps").mkdir()
    (tmp_path / "equal_steps" / "comparison.json").write_text(json.dumps(_comparison(losses, accuracies)))
    (tmp_path / "floor.json").write_text(json.dumps(
        {"val_cross_entropy_mean": 1.5, "answer_accuracy_mean": 0.0, "answer_contains_mean": 0.125}))
    text = study.study_report(tmp_path)
    assert "held-out loss 1.5000, exact-match accuracy 0.000" in text and "0.125" in text
    row = next(line for line in text.splitlines() if line.startswith("| partitionsel |"))
    # Every seed differs by exactly -0.2 / -0.1 in loss and +0.1 / +0.1 in accuracy: zero-width intervals.
    assert "-0.2000 [-0.2000, -0.2000] (n 3)" in row and "-0.1000 [-0.1000, -0.1000] (n 3)" in row
    assert "+0.100 [+0.100, +0.100] (n 3)" in row
    assert "Per domain, loss - random_stratified" in text
    assert (tmp_path / "study.md").read_text().strip() == text.strip()


def test_help_is_fast_and_bad_arms_are_refused(capsys):
    with pytest.raises(SystemExit):
        study.main(["--arms", "random,nosuch"])
    assert "unknown ['nosuch']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        study.main(["--arms", "partitionsel"])
    assert "random is the budget's reference" in capsys.readouterr().err


@pytest.fixture
def ran(tmp_path, monkeypatch):
    """The commands `study.main` would run (recorded, not run), with stand-ins for the corpus and the model."""
    (tmp_path / "dm_math").mkdir()
    (tmp_path / "dm_math" / "train.json").write_text("[]")
    (tmp_path / "model.gguf").write_text("")
    monkeypatch.setattr(study, "DATA", tmp_path)
    monkeypatch.setattr(study, "MODEL", tmp_path / "model.gguf")
    commands = []
    monkeypatch.setattr(study, "_run", lambda cmd, env: commands.append(cmd))
    return commands


def test_budgets_choose_which_commands_the_study_part_runs(tmp_path, ran, capsys):
    """--budgets steps trains only the equal-steps runs, compute only the equal-compute ones; a budget outside
    the two is refused before anything runs."""
    for budgets, outs in (("steps", ["equal_steps"]), ("compute", ["equal_compute"]), ("steps,compute", ["equal_steps", "equal_compute"])):
        ran.clear()
        study.main(["--parts", "study", "--budgets", budgets, "--out", str(tmp_path / "out")])
        assert [_arg(cmd, "--out") for cmd in ran] == [str(tmp_path / "out" / out) for out in outs], budgets
    ran.clear()
    with pytest.raises(SystemExit):
        study.main(["--parts", "study", "--budgets", "steps,flops", "--out", str(tmp_path / "out")])
    assert "--budgets: a comma-separated subset of steps,compute, got 'steps,flops'" in capsys.readouterr().err
    assert not ran


def test_report_also_pairs_every_arm_against_partitionsel_and_the_whole_pool(tmp_path):
    losses = {"random": [1.0, 1.1, 1.2], "partitionsel": [0.8, 0.9, 1.0], "full_pool": [0.7, 0.8, 0.9],
              "greats": [0.85, 0.95, 1.05]}
    accuracies = {k: [0.1, 0.2, 0.3] for k in losses}
    (tmp_path / "equal_steps").mkdir()
    (tmp_path / "equal_steps" / "comparison.json").write_text(json.dumps(_comparison(losses, accuracies)))
    text = study.study_report(tmp_path)
    head = "| arm | loss - partitionsel | loss - full_pool | accuracy - partitionsel | accuracy - full_pool |"
    assert head in text
    table = text[text.index(head):].split("\n\n")[0].splitlines()
    greats = next(line for line in table if line.startswith("| greats |"))
    assert "+0.0500 [+0.0500, +0.0500] (n 3)" in greats and "+0.1500 [+0.1500, +0.1500] (n 3)" in greats
    ps = next(line for line in table if line.startswith("| partitionsel |"))
    assert ps.split(" | ")[1] == "-" and "+0.1000 [+0.1000, +0.1000] (n 3)" in ps  # not against itself
    # without the reference arms there is no such table
    (tmp_path / "equal_steps" / "comparison.json").write_text(json.dumps(_comparison(
        {"random": losses["random"], "greats": losses["greats"]}, {"random": [0.1] * 3, "greats": [0.1] * 3})))
    assert "loss - partitionsel" not in study.study_report(tmp_path)


def test_the_gpu_profile_runs_the_larger_shape_in_bf16_priced_on_the_wall_clock(tmp_path):
    steps, compute = study.study_commands(tmp_path, shards=tmp_path / "s", arms=list(study.QUICK_ARMS), seeds="1",
                                          steps=100, jobs=1, gpu=True)
    for cmd in (steps, compute):
        tail = cmd[cmd.index("--") :]
        assert {"device=gpu", "precision=amp_bf16", "global_train_batch_size=32"} <= set(tail)
        assert "callbacks.answer_accuracy.per_domain=50" in tail
    assert _arg(compute, "--cost-clock") == "wall" and _arg(compute, "--compute-budget") == "random=100"
    cpu = study.study_commands(tmp_path, shards=tmp_path / "s", arms=list(study.QUICK_ARMS), seeds="1", steps=20, jobs=2)
    assert "device=gpu" not in cpu[0] and _arg(cpu[1], "--cost-clock") == "cpu"
    with pytest.raises(SystemExit):
        study.main(["--gpu", "--smoke"])


def test_the_full_profile_keeps_the_tables_ten_arms(tmp_path, ran):
    """ps_ahead came after the ten-arm tables and ran in its own directory: the full profile, whose command the
    docs give as resumable, must not add it (it would re-plan equal compute with eleven arms)."""
    study.main(["--parts", "study", "--budgets", "steps", "--profile", "full", "--out", str(tmp_path / "out")])
    arms = set(_arg(ran[0], "--strategies").split(",")) | set(_variants(ran[0]))
    assert len(arms) == 10 and "ps_ahead" not in arms and "ps_reuse" in arms and "full_pool" in arms


def test_overrides_reach_every_run_after_the_studys_own_settings(tmp_path, ran, capsys):
    """--override KEY=VALUE goes to both budgets' runs, last, so it wins over the study's settings, and no arm's own
    settings leak into the other arms' (ps_ahead's select_ahead is its variant's, not every run's); a malformed one
    is refused before anything runs."""
    study.main(["--parts", "study", "--out", str(tmp_path / "out"), "--arms", "random,partitionsel,ps_ahead",
                "--override", "optimizer.lr=3e-3", "--override", "model.reuse_scoring_prefix=true"])
    assert len(ran) == 2
    for cmd in ran:
        tail = cmd[cmd.index("--") :]
        assert tail[-2:] == ["optimizer.lr=3e-3", "model.reuse_scoring_prefix=true"], tail
        assert not any("select_ahead" in setting for setting in tail), tail
        assert _variants(cmd)["ps_ahead"] == "ps_ahead=partitionsel,algorithms.data_selection.select_ahead=true"
    ran.clear()
    with pytest.raises(SystemExit):
        study.main(["--parts", "study", "--out", str(tmp_path / "out"), "--override", "optimizer.lr"])
    assert "--override: KEY=VALUE expected, got ['optimizer.lr']" in capsys.readouterr().err
    assert not ran
