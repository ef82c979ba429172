"""tools/studies/study_mixtures.py (issue 21.5): every arm and DoReMi stage loads as a config, the commands pair the
right arms against proportional PartitionSel, and the report's distances match hand computations."""

from __future__ import annotations

import json
import math

import pytest
import run_experiment  # noqa: E402
import study_mixtures  # noqa: E402

from tests.common.paths import REPO_ROOT

SEL = "algorithms.data_selection"
CORPORA = study_mixtures.corpora(REPO_ROOT / "runs" / "study", REPO_ROOT / "runs" / "ghpile")


def _arms_of(cmd: list[str]) -> dict[str, tuple[str, list[str]]]:
    arms = {s: (s, []) for s in cmd[cmd.index("--strategies") + 1].split(",")}
    for i, a in enumerate(cmd):
        if a == "--variant":
            label, strategy, overrides = run_experiment.parse_variant(cmd[i + 1])
            arms[label] = (strategy, overrides)
    return arms


@pytest.fixture
def weights_file(tmp_path):
    """An official-DoReMi-format weights file (read when a `fractions: file` policy is parsed)."""
    path = tmp_path / "doremi_weights.json"
    path.write_text(json.dumps({"train_domain_weights": {"x": 1.0, "y": 3.0}}))
    return path


@pytest.mark.parametrize("corpus", list(CORPORA))
def test_the_command_pairs_every_arm_against_proportional_partitionsel(corpus, tmp_path, weights_file):
    c = CORPORA[corpus]
    cmd = study_mixtures.study_command(c, out=tmp_path, seeds="1,2,3", steps=50, jobs=2, weights_file=weights_file)
    assert cmd[cmd.index("--paired-baseline") + 1] == "partitionsel"
    assert cmd[cmd.index("--steps") + 1] == "50" and "--compute-budget" not in cmd  # equal steps
    assert cmd[cmd.index("--seeds") + 1] == "1,2,3"
    assert cmd[cmd.index("--yaml") + 1] == str(c.yaml)
    assert cmd[cmd.index("--out") + 1] == str(tmp_path / corpus / "study")
    arms = _arms_of(cmd)
    assert arms["partitionsel"] == ("partitionsel", [])  # the baseline: the yaml's PartitionSel, proportional
    assert set(arms) == {
        "partitionsel", "ps_slack1_5", "ps_slack2", "ps_slack_inf", "ps_adaptive", "ps_doremi", "ps_balanced",
        "doremi_main", "random", "id",
    }
    assert arms == study_mixtures.arms(weights_file)  # what run_experiment will parse is what the driver meant
    tail = cmd[cmd.index("--") + 1 :]
    assert f"{SEL}.validation.batch_size=16" in tail  # one guide size for every arm
    if corpus == "ghpile":
        assert "variables.max_seq_len=512" in tail and "scheduler.t_warmup=0.1dur" in tail
        assert cmd[cmd.index("--eval-interval") + 1] == "50"  # evaluation at the last step only
    else:
        assert "--eval-interval" not in cmd


@pytest.mark.parametrize("corpus", list(CORPORA))
@pytest.mark.parametrize("label", list(study_mixtures.arms(REPO_ROOT / "w.json")))
def test_each_arm_loads_as_a_config_with_the_policy_it_names(corpus, label, weights_file):
    from composer_algos.data_selection.algorithm import DataSelection
    from composer_algos.data_selection.capacity_policy import (
        AdaptivePolicy,
        FractionsPolicy,
        ProportionalPolicy,
        SlackPolicy,
    )
    from composer_algos.registry import load_run_config

    c = CORPORA[corpus]
    strategy, extra = study_mixtures.arms(weights_file)[label]
    cfg = load_run_config(c.yaml, [f"{SEL}.strategy={strategy}", *extra, *c.overrides])
    ds = cfg.algorithms["data_selection"]
    assert ds["strategy"] == strategy
    algo = DataSelection(**{k: v for k, v in ds.items()})  # the algorithm's own checks, as train.py builds it
    policy = algo.capacity_policy
    expected = {
        "partitionsel": (ProportionalPolicy, None),
        "ps_slack1_5": (SlackPolicy, 1.5),
        "ps_slack2": (SlackPolicy, 2.0),
        "ps_slack_inf": (SlackPolicy, math.inf),
        "ps_adaptive": (AdaptivePolicy, None),
        "ps_doremi": (FractionsPolicy, None),
        "ps_balanced": (ProportionalPolicy, None),
        "doremi_main": (ProportionalPolicy, None),
        "random": (ProportionalPolicy, None),
        "id": (ProportionalPolicy, None),
    }[label]
    assert type(policy) is expected[0]
    if expected[1] is not None:
        assert policy.factor == expected[1]
    if label == "ps_doremi":
        assert policy.weights == pytest.approx({"x": 0.25, "y": 0.75})  # read from the weights file
    assert algo.validation_target == ("domain_balanced" if label == "ps_balanced" else "mean")
    assert algo.log_conflicts is (label == "random")
    weights_given = cfg.train_loader.dataset.domain_weights_file
    assert weights_given == (str(weights_file) if label == "doremi_main" else None)


@pytest.mark.parametrize("corpus", list(CORPORA))
def test_the_doremi_stages_load_as_configs(corpus, tmp_path):
    c = CORPORA[corpus]
    stages = study_mixtures.doremi_commands(c, out=tmp_path, steps=30)
    assert [s for s, *_ in stages] == ["reference", "proxy"]
    reference_ckpt = tmp_path / "ref" / "latest-rank0.pt"
    from composer_algos.registry import load_run_config

    for stage, yaml, run_dir, cmd in stages:
        yaml.parent.mkdir(parents=True, exist_ok=True)
        yaml.write_text(study_mixtures.doremi_stage_yaml(c, stage, reference=reference_ckpt))
        assert cmd[1].endswith("train.py") and cmd[2] == str(yaml)
        cfg = load_run_config(yaml, cmd[3:])
        assert cfg.max_duration == "30ba" and cfg.save_folder == str(run_dir) and cfg.eval_loader is None
        assert cfg.train_loader.dataset.shard_dir == str(c.shards)
        assert cfg.tokenizer_name == load_run_config(c.yaml).tokenizer_name  # the study's tokenizer
        if stage == "reference":
            assert dict(cfg.algorithms) == {}  # no selection: the natural mixture, 16 rows a step
        else:
            assert list(cfg.algorithms) == ["doremi"]
            assert cfg.algorithms["doremi"]["reference"] == str(reference_ckpt)
    assert study_mixtures.doremi_weights_path(tmp_path, corpus) == (
        tmp_path / corpus / "doremi" / "proxy" / "doremi" / "mixture.json"
    )


def _csv(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("step,a,b,c\n" + "".join(f"{s},{a},{b},{c}\n" for s, a, b, c in rows))


def _summary(mean, lo, hi, n=2):
    return {"n": n, "mean": mean, "std": 0.01, "ci_low": lo, "ci_high": hi, "differences": [mean] * n}


def test_report_distances_and_conflicts_from_hand_written_files(tmp_path):
    study = tmp_path / "dm_math" / "study"
    study.mkdir(parents=True)
    (study / "comparison.json").write_text(json.dumps({"strategies": {
        "partitionsel": {"average": {"mean": 1.25, "std": 0.01}},
        "ps_slack2": {"average": {"mean": 1.2, "std": 0.02}},
        "random": {"average": {"mean": 1.5, "std": 0.03}},
    }}))
    (study / "paired.json").write_text(json.dumps({"baseline": "partitionsel", "strategies": {
        "ps_slack2": {"seeds": [1, 2], "average": _summary(-0.05, -0.09, -0.01),
                      "domains": {"a": _summary(-0.1, -0.2, 0.0)}},
        "random": {"seeds": [1, 2], "average": _summary(0.25, 0.2, 0.3), "domains": {}},
    }}))
    (study / "selection.json").write_text(json.dumps({
        "natural": {"a": 0.5, "b": 0.3, "c": 0.2},
        "strategies": {
            "partitionsel": {"conflict_fraction": 0.4},
            "ps_slack2": {"conflict_fraction": 0.3},
            "random": {"conflict_fraction": 0.45},
        },
    }))
    # partitionsel: both seeds average (0.5, 0.3, 0.2), the natural mixture.
    _csv(study / "partitionsel-seed1" / "mixture_steps.csv", [(0, 0.5, 0.25, 0.25), (1, 0.5, 0.35, 0.15)])
    _csv(study / "partitionsel-seed2" / "mixture_steps.csv", [(0, 0.5, 0.3, 0.2)])
    # ps_slack2: seed 1 averages (0.6, 0.2, 0.2), seed 2 (0.5, 0.3, 0.2): induced (0.55, 0.25, 0.2).
    _csv(study / "ps_slack2-seed1" / "mixture_steps.csv", [(0, 0.7, 0.2, 0.1), (1, 0.5, 0.2, 0.3)])
    _csv(study / "ps_slack2-seed2" / "mixture_steps.csv", [(0, 0.4, 0.4, 0.2), (1, 0.6, 0.2, 0.2)])
    # random: only seed 1 finished, (0.4, 0.3, 0.3).
    _csv(study / "random-seed1" / "mixture_steps.csv", [(0, 0.4, 0.3, 0.3)])
    # DoReMi's weights in the official format: (1, 2, 1) / 4 = (0.25, 0.5, 0.25).
    weights = tmp_path / "doremi.json"
    weights.write_text(json.dumps({"train_domain_weights": {"a": 1, "b": 2, "c": 1}}))

    text, numbers = study_mixtures.corpus_report(study, weights_file=weights, seeds=[1, 2], png=tmp_path / "m.png")
    # By hand: TV = 1/2 sum |p - q|.
    # partitionsel: natural 0; DoReMi 1/2 (0.25 + 0.2 + 0.05) = 0.25
    # ps_slack2:    natural 1/2 (0.05 + 0.05 + 0) = 0.05; DoReMi 1/2 (0.3 + 0.25 + 0.05) = 0.3
    # random:       natural 1/2 (0.1 + 0 + 0.1) = 0.1;   DoReMi 1/2 (0.15 + 0.2 + 0.05) = 0.2
    expected = {"partitionsel": (0.0, 0.25, 0.4), "ps_slack2": (0.05, 0.3, 0.3), "random": (0.1, 0.2, 0.45)}
    for label, (tv_nat, tv_dor, conflict) in expected.items():
        got = numbers[label]
        assert got["tv_natural"] == pytest.approx(tv_nat, abs=1e-12), label
        assert got["tv_doremi"] == pytest.approx(tv_dor, abs=1e-12), label
        assert got["conflict_fraction"] == conflict
    assert numbers["ps_slack2"]["induced"] == pytest.approx({"a": 0.55, "b": 0.25, "c": 0.2})
    # Against partitionsel on the same seed (seed 1 (0.5, 0.3, 0.2), seed 2 the same): ps_slack2 moved
    # (0.1, -0.1, 0) and (0, 0, 0), TV 0.1 and 0, mean 0.05; its mean move (0.05, -0.05, 0) against DoReMi's
    # (-0.25, 0.2, 0.05): -0.0225 / (sqrt(0.005) sqrt(0.105)) = -0.9820; partitionsel did not move: blank.
    assert numbers["ps_slack2"]["tv_proportional"] == pytest.approx(0.05)
    assert numbers["partitionsel"]["tv_proportional"] == 0.0
    assert numbers["ps_slack2"]["toward_doremi"] == pytest.approx(-0.0225 / math.sqrt(0.005 * 0.105))
    assert numbers["partitionsel"]["toward_doremi"] is None
    assert "| ps_slack2 | 1.2000 | 0.0500 | 0.3000 | 0.0500 | -0.9820 | - | 0.3000 |" in text  # no selection_log.csv
    # random (seed 1 only) moved (-0.1, 0, 0.1): TV 0.1; 0.03 / (sqrt(0.02) sqrt(0.105)) = 0.6547
    assert "| random | 1.5000 | 0.1000 | 0.2000 | 0.1000 | 0.6547 | - | 0.4500 |" in text
    assert "| ps_slack2 - natural | +0.0500 | -0.0500 | +0.0000 |" in text  # the signed departure per domain
    assert "| DoReMi | 0.2500 | 0.5000 | 0.2500 |" in text
    assert "ps_slack2 - partitionsel" in text and "-0.0500 [-0.0900, -0.0100]" in text  # the paired table
    assert (tmp_path / "m.png").stat().st_size > 0 and "![induced mixture per arm](m.png)" in text


def test_seed_mean_trajectory_averages_the_steps_every_seed_logged(tmp_path):
    _csv(tmp_path / "x-seed1" / "mixture_steps.csv", [(0, 0.2, 0.4, 0.4), (1, 0.6, 0.2, 0.2), (2, 1.0, 0.0, 0.0)])
    _csv(tmp_path / "x-seed2" / "mixture_steps.csv", [(0, 0.4, 0.4, 0.2), (1, 0.2, 0.2, 0.6)])
    steps, names, shares = study_mixtures.seed_mean_trajectory(tmp_path, "x", [1, 2])
    assert steps == [0, 1] and names == ["a", "b", "c"]
    assert shares.flatten().tolist() == pytest.approx([0.3, 0.4, 0.3, 0.4, 0.2, 0.4])


def test_report_without_runs_says_so_and_writes_the_file(tmp_path):
    (tmp_path / "ghpile" / "study").mkdir(parents=True)
    text = study_mixtures.write_report(tmp_path, ["dm_math", "ghpile"], [1])
    assert "## ghpile" in text and "## dm_math" not in text  # a corpus without a study dir is left out
    assert "the study has not run" in text
    assert (tmp_path / "mixtures.md").read_text().strip() == text.strip()


def test_pool_departure_is_the_per_step_distance_of_the_selection_from_its_pool(tmp_path):
    def log(path, rows):
        path.parent.mkdir(parents=True, exist_ok=True)
        head = "step,strategy,mixture/a,mixture/b,pool/a,pool/b,capacity/a,capacity/b\n"
        path.write_text(head + "".join(f"{i},x,{ma},{mb},{pa},{pb},1,1\n" for i, (ma, mb, pa, pb) in enumerate(rows)))

    # seed 1: steps at TV 1/2(0.25 + 0.25) = 0.25 and 0; seed 2: one step at 1/2(0.1 + 0.1) = 0.1.
    log(tmp_path / "arm-seed1" / "selection_log.csv", [(0.75, 0.25, 0.5, 0.5), (0.5, 0.5, 0.5, 0.5)])
    log(tmp_path / "arm-seed2" / "selection_log.csv", [(0.4, 0.6, 0.5, 0.5)])
    # mean over steps per seed (0.125, 0.1), then over seeds
    assert study_mixtures.pool_departure(tmp_path, "arm", [1, 2, 3]) == pytest.approx(0.1125)
    assert study_mixtures.pool_departure(tmp_path, "other", [1]) is None


def test_departure_is_measured_against_proportional_on_the_same_seed_not_the_natural_mixture(tmp_path):
    # The arm lands on the natural mixture, but its baseline (same seed, same pools) sat elsewhere: it moved.
    _csv(tmp_path / "partitionsel-seed1" / "mixture_steps.csv", [(0, 0.4, 0.4, 0.2)])
    _csv(tmp_path / "arm-seed1" / "mixture_steps.csv", [(0, 0.5, 0.3, 0.2)])
    _csv(tmp_path / "arm-seed2" / "mixture_steps.csv", [(0, 0.9, 0.05, 0.05)])  # no baseline seed 2: left out
    natural = {"a": 0.5, "b": 0.3, "c": 0.2}
    tv, toward = study_mixtures.departure_from_baseline(
        study_mixtures.induced_per_seed(tmp_path, "arm", [1, 2]),
        study_mixtures.induced_per_seed(tmp_path, "partitionsel", [1, 2]),
        reference={"a": 0.6, "b": 0.2, "c": 0.2}, natural=natural,
    )
    assert tv == pytest.approx(0.1)  # 1/2 (0.1 + 0.1 + 0)
    assert toward == pytest.approx(1.0)  # moved (0.1, -0.1, 0), DoReMi's direction (0.1, -0.1, 0)
