"""tools/run_experiment.py: which finished runs in --out are reused (only those of the same settings), and the
--compute-budget label, checked before anything runs. train.py is replaced by a stub that writes a finished run
(its config.yaml as train.py writes it, eval_results.json, train_budget.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import run_experiment

from tests.common.paths import REPO_ROOT
from tests.training.test_run_experiment import _shard_dir_s  # noqa: F401  (autouse: `--shard-dir s` holds a manifest)

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"


class _FakeProc:
    returncode = 0

    def poll(self):
        return 0


def _arg(cmd: list[str], key: str) -> str:
    return next(a.split("=", 1)[1] for a in cmd if a.startswith(key + "="))


@pytest.fixture
def fake_training(monkeypatch):
    """train.py's commands recorded and replaced by a finished run: config.yaml as train.py saves it, and results."""
    from omegaconf import OmegaConf

    from composer_algos.registry import load_run_config
    from pipeline.config import config_to_dict

    launched: list[list[str]] = []
    real_popen = run_experiment.subprocess.Popen

    def popen(cmd, cwd=None, stdout=None, stderr=None, env=None, **kwargs):
        if not any(str(a).endswith("train.py") for a in cmd):  # not a training run (e.g. a library probe)
            return real_popen(cmd, cwd=cwd, stdout=stdout, stderr=stderr, env=env, **kwargs)
        launched.append(cmd)
        run_dir = Path(_arg(cmd, "save_folder"))
        OmegaConf.save(OmegaConf.create(config_to_dict(load_run_config(cmd[2], cmd[3:]))), run_dir / "config.yaml")
        steps = int(_arg(cmd, "max_duration").removesuffix("ba"))
        results = {"val_cross_entropy": {"a": 1.0}, "val_cross_entropy_mean": 1.0, "wall_time_s": 1.0,
                   "selection_time_s": 0.0, "steps": steps}
        (run_dir / "eval_results.json").write_text(json.dumps(results))
        (run_dir / "train_budget.json").write_text(json.dumps({"train_time_s": 0.5 * steps, "steps": steps}))
        return _FakeProc()

    monkeypatch.setattr(run_experiment.subprocess, "Popen", popen)
    monkeypatch.setattr(run_experiment.time, "sleep", lambda s: None)
    monkeypatch.setattr(run_experiment, "plot_curves", lambda *a, **k: None)
    return launched


def _args(out: Path, *extra: str) -> list[str]:
    return ["--yaml", str(TINY), "--shard-dir", "s", "--strategies", "partitionsel,random", "--seeds", "1",
            "--out", str(out), *extra]


def test_a_run_finished_with_other_settings_is_trained_again_naming_them(fake_training, tmp_path, capsys):
    out = tmp_path / "exp"
    assert run_experiment.main(_args(out, "--steps", "3")) == 0
    (out / "partitionsel-seed1" / "selected_ids.jsonl").write_text("{}\n")  # a log the new run does not write
    fake_training.clear()
    capsys.readouterr()
    assert run_experiment.main(_args(out, "--steps", "3", "--", "optimizer.lr=1e-2",
                                     "algorithms.data_selection.oversampling=4")) == 0
    printed = capsys.readouterr().out
    assert "already done" not in printed
    old = out / "replaced" / "partitionsel-seed1"
    assert ("partitionsel-seed1: finished with other settings (optimizer.lr: 0.003 -> 0.01, "
            f"algorithms.data_selection.oversampling: 2.0 -> 4.0); training it again (the finished run moved to {old})"
            ) in printed
    assert sorted(_arg(c, "algorithms.data_selection.strategy") for c in fake_training) == ["partitionsel", "random"]
    assert "lr: 0.01" in (out / "partitionsel-seed1" / "config.yaml").read_text()
    assert not (out / "partitionsel-seed1" / "selected_ids.jsonl").exists()  # the retrained run starts empty
    assert "lr: 0.003" in (old / "config.yaml").read_text() and (old / "selected_ids.jsonl").exists()  # kept aside
    assert (old / "partitionsel-seed1.log").exists()  # with its log
    # The same settings again: both reused.
    fake_training.clear()
    assert run_experiment.main(_args(out, "--steps", "3", "--", "optimizer.lr=1e-2",
                                     "algorithms.data_selection.oversampling=4")) == 0
    assert fake_training == []
    assert "partitionsel-seed1: already done, reusing\n" in capsys.readouterr().out


def test_runs_of_other_steps_are_trained_again_not_reported_under_the_new_count(fake_training, tmp_path, capsys):
    out = tmp_path / "exp"
    assert run_experiment.main(_args(out, "--steps", "3")) == 0
    fake_training.clear()
    capsys.readouterr()
    assert run_experiment.main(_args(out, "--steps", "5")) == 0
    assert "random-seed1: finished with other settings (max_duration: 3ba -> 5ba); training it again" in (
        capsys.readouterr().out
    )
    assert [_arg(c, "max_duration") for c in fake_training] == ["5ba", "5ba"]
    table = json.loads((out / "comparison.json").read_text())
    assert [r["steps"] for r in table["runs"]] == [5, 5]
    assert (out / "comparison.md").read_text().startswith("Held-out validation log-perplexity (cross-entropy) after 5 steps")
    # A third change of steps: the second replaced run is kept beside the first.
    assert run_experiment.main(_args(out, "--steps", "4")) == 0
    kept = {p.name: json.loads((p / "eval_results.json").read_text())["steps"] for p in (out / "replaced").iterdir()}
    assert kept == {"partitionsel-seed1": 3, "random-seed1": 3, "partitionsel-seed1.2": 5, "random-seed1.2": 5}


def test_a_run_without_config_yaml_is_compared_by_its_steps(fake_training, tmp_path, capsys):
    out = tmp_path / "exp"
    assert run_experiment.main(_args(out, "--steps", "3")) == 0
    for name in ("partitionsel-seed1", "random-seed1"):
        (out / name / "config.yaml").unlink()
    fake_training.clear()
    assert run_experiment.main(_args(out, "--steps", "3")) == 0
    assert fake_training == []
    assert "random-seed1: already done, reusing (it has no config.yaml: only its steps were compared)" in (
        capsys.readouterr().out
    )
    assert run_experiment.main(_args(out, "--steps", "4")) == 0
    assert [_arg(c, "max_duration") for c in fake_training] == ["4ba", "4ba"]
    assert "random-seed1: finished with other settings (steps: 3 -> 4)" in capsys.readouterr().out


def test_report_only_refuses_runs_finished_with_other_settings(fake_training, tmp_path, capsys):
    out = tmp_path / "exp"
    assert run_experiment.main(_args(out, "--steps", "3")) == 0
    fake_training.clear()
    capsys.readouterr()
    assert run_experiment.main(_args(out, "--steps", "3", "--report-only", "--", "optimizer.lr=1e-2")) == 2
    assert fake_training == []
    captured = capsys.readouterr()
    assert "partitionsel-seed1: finished with other settings (optimizer.lr: 0.003 -> 0.01)\n" in captured.out
    assert (f"--report-only: 2 runs in {out} finished with other settings than these: partitionsel-seed1, "
            "random-seed1") in captured.err


def test_a_linked_run_is_never_trained_through(fake_training, tmp_path, capsys):
    """A run linked from another experiment (--reuse-from) that has to train again (other settings, or --rerun) is
    unlinked and trained in this experiment's folder; the other experiment's run stays as it was."""
    steps_out, out = tmp_path / "steps", tmp_path / "compute"
    assert run_experiment.main(_args(steps_out, "--steps", "3")) == 0
    source = steps_out / "random-seed1"
    saved = {p.name: p.read_text() for p in source.iterdir()}
    fake_training.clear()
    assert run_experiment.main(_args(out, "--steps", "3", "--reuse-from", str(steps_out))) == 0
    assert fake_training == [] and (out / "random-seed1").is_symlink()
    capsys.readouterr()
    assert run_experiment.main(_args(out, "--steps", "3", "--reuse-from", str(steps_out), "--", "optimizer.lr=1e-2")) == 0
    assert ("random-seed1: finished with other settings (optimizer.lr: 0.003 -> 0.01); training it again here "
            "(the run it links to stays)") in capsys.readouterr().out
    assert len(fake_training) == 2 and not (out / "random-seed1").is_symlink()
    assert "lr: 0.01" in (out / "random-seed1" / "config.yaml").read_text()
    assert {p.name: p.read_text() for p in source.iterdir()} == saved
    # A source of other settings is not linked, and says which settings differ.
    other = tmp_path / "other"
    assert run_experiment.main(_args(other, "--steps", "3", "--reuse-from", str(steps_out), "--", "optimizer.lr=1e-2")) == 0
    assert (f"random-seed1: {source} finished with other settings (optimizer.lr: 0.003 -> 0.01); training it here"
            in capsys.readouterr().out)
    assert not (other / "random-seed1").is_symlink()
    # --rerun of a linked run trains here too.
    third = tmp_path / "third"
    assert run_experiment.main(_args(third, "--steps", "3", "--reuse-from", str(steps_out))) == 0
    assert (third / "random-seed1").is_symlink()
    assert run_experiment.main(_args(third, "--steps", "3", "--rerun")) == 0
    assert not (third / "random-seed1").is_symlink()
    assert {p.name: p.read_text() for p in source.iterdir()} == saved


def test_an_unknown_compute_budget_label_is_rejected_before_anything_runs(fake_training, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_experiment.main(_args(tmp_path / "exp", "--strategies", "random,partitionsel", "--compute-budget", "rnd=20"))
    assert fake_training == []  # no calibration ran
    assert (
        "error: --compute-budget 'rnd=20': 'rnd' must be one of --strategies ['random', 'partitionsel']"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "extra",
    [
        ["--variant", "lr2=random,optimizer.lr=1e-2", "--compute-budget", "lr2=20", "--step-costs",
         "random=1,partitionsel=2,lr2=1"],  # a variant's name
        ["--strategies", "partitionsel", "--compute-budget", "random=20", "--step-costs", "random=1,partitionsel=2"],
    ],
)
def test_a_compute_budget_label_is_a_run_or_a_given_step_cost(extra, fake_training, tmp_path):
    assert run_experiment.main([*_args(tmp_path / "exp", *extra), "--", "scheduler.t_warmup=0.1dur"]) == 0
    assert fake_training
