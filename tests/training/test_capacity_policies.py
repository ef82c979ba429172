"""Capacity policies, the validation target and draw inside DataSelection (issue 21): end to end on the tiny config."""

from __future__ import annotations

import csv
import json
import re

import pytest
import torch
from composer.loggers import InMemoryLogger

import train
from composer_algos.data_selection.algorithm import DataSelection, find_data_selection
from composer_algos.data_selection.step import assemble_problem
from composer_algos.data_selection.validation_source import ValidationSource
from composer_algos.mixture_io import write_mixture_json
from composer_algos.registry import load_run_config
from pipeline.config import ConfigError
from tests.common.paths import REPO_ROOT
from tests.training.conftest import tiny_overrides
from tests.training.fake_ranks import ThreadRanks

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
SEL = "algorithms.data_selection."
SLACK = [f"{SEL}capacities.policy=slack"]
ADAPTIVE = [f"{SEL}capacities=adaptive", f"{SEL}validation.stratify=true"]


def _train(shards, run_dir, *extra, close=True):
    cfg = load_run_config(TINY, tiny_overrides(shards, run_dir, "loggers.in_memory={}", "eval_loader=null", *extra))
    trainer = train.build_trainer(cfg)
    trainer.fit()
    if close:
        trainer.close()
    return trainer


def _series(trainer, key):
    mem = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
    return {int(ts.batch.value): float(v) for ts, v in mem.data.get(key, [])}


def _keys(trainer, prefix):
    mem = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
    return sorted(k for k in mem.data if k.startswith(prefix))


# ---------------------------------------------------------------------------------------------- slack
def test_slack_one_selects_what_proportional_selects(dolma_shards, tmp_path):
    prop = _train(dolma_shards, tmp_path / "prop")
    slack = _train(dolma_shards, tmp_path / "slack", *SLACK, f"{SEL}capacities.factor=1")
    for key in ("selection/selected_hash", "loss/train/total"):
        assert _series(slack, key) == _series(prop, key), key
    for key in _keys(prop, "data/capacity/"):
        assert _series(slack, key) == _series(prop, key), key


def test_slack_bounds_are_logged_respected_and_sum_above_kappa(dolma_shards, tmp_path):
    run = _train(dolma_shards, tmp_path / "run", *SLACK, f"{SEL}capacities.factor=2")
    names = [k.removeprefix("data/capacity/") for k in _keys(run, "data/capacity/")]
    assert names, "capacities were not logged"
    steps = sorted(_series(run, "selection/selected_hash"))
    for step in steps:
        caps = [_series(run, f"data/capacity/{n}")[step] for n in names]
        mix = [_series(run, f"data/mixture/{n}")[step] for n in names]
        assert sum(caps) >= 1.0 - 1e-9  # upper bounds as shares of the trained examples
        assert all(m <= c + 1e-9 for m, c in zip(mix, caps)), (step, mix, caps)
        used = [_series(run, f"data/capacity_used/{n}").get(step) for n, c in zip(names, caps) if c > 0]
        assert all(u is not None and 0.0 <= u <= 1.0 for u in used)
    with open(tmp_path / "run" / "capacity_steps.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", *names] and len(rows) == 1 + len(steps)
    with open(tmp_path / "run" / "selection_log.csv", newline="") as f:
        header = next(csv.reader(f))
    assert [h for h in header if h.startswith("capacity/")] == [f"capacity/{n}" for n in names]


# ---------------------------------------------------------------------------------------------- adaptive
def test_adaptive_resume_restores_the_state_and_the_selections(dolma_shards, tmp_path):
    full = _train(dolma_shards, tmp_path / "full", *ADAPTIVE, "max_duration=6ba", "save_interval=3ba")
    ckpt = tmp_path / "full" / "ep0-ba3-rank0.pt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)["state"]["algorithms"]
    sd = next(s for name, s in saved if name == "DataSelection")["capacity_policy"]
    assert sd["name"] == "adaptive" and any(g != 0 for g in sd["gain"]), sd  # the state moved in 3 steps
    resumed = _train(dolma_shards, tmp_path / "resumed", *ADAPTIVE, "max_duration=6ba", f"load_path={ckpt}")
    for key in ("selection/selected_hash", "loss/train/total"):
        full_s, res_s = _series(full, key), _series(resumed, key)
        assert sorted(res_s) == [3, 4, 5]
        assert {s: full_s[s] for s in res_s} == res_s, key
    gains = _keys(full, "selection/adaptive_gain/")
    assert gains
    for key in gains:
        full_s, res_s = _series(full, key), _series(resumed, key)
        assert {s: full_s[s] for s in res_s} == res_s, key


def test_adaptive_capacities_depart_from_proportional(dolma_shards, tmp_path):
    prop = _train(dolma_shards, tmp_path / "prop", "max_duration=4ba")
    run = _train(dolma_shards, tmp_path / "run", *ADAPTIVE, "max_duration=4ba")
    caps = {k: _series(run, k) for k in _keys(run, "data/capacity/")}
    pool = {k: _series(prop, k) for k in _keys(prop, "data/capacity/")}
    assert caps and caps != pool


# ---------------------------------------------------------------------------------------------- DoReMi weights
def test_doremi_weights_file_as_capacities_in_both_formats(dolma_shards, tmp_path):
    names = json.loads((dolma_shards / "manifest.json").read_text())["domains"]
    names = [d["name"] for d in names]
    weights = {n: float(i + 1) for i, n in enumerate(names)}
    total = sum(weights.values())
    ours = tmp_path / "doremi" / "mixture.json"
    write_mixture_json(ours, method="doremi", domain_names=names, weights=[weights[n] / total for n in names], steps=5)
    official = tmp_path / "official.json"
    official.write_text(json.dumps({"train_domain_weights": weights}))
    fractions = []
    for path in (ours, official):
        run = _train(
            dolma_shards, tmp_path / path.stem, f"{SEL}capacities.policy=fractions", f"{SEL}capacities.file={path}",
            "max_duration=1ba", close=False,
        )
        fractions.append(find_data_selection(run.state)._fractions)
        run.close()
    assert fractions[0] == pytest.approx([weights[n] / total for n in names]) and fractions[1] == pytest.approx(fractions[0])


def _domain_names(shards) -> list[str]:
    return [d["name"] for d in json.loads((shards / "manifest.json").read_text())["domains"]]


def _bad_domain_overrides(shards, tmp_path, case: str) -> tuple[list[str], str]:
    """Overrides naming domains the shards do not train, and the message expected (issue 30.1 and 30.2)."""
    if case == "fractions_file":
        names = _domain_names(shards)
        path = tmp_path / "w.json"
        path.write_text(json.dumps({"train_domain_weights": {n: 1.0 for n in names[1:]}}))
        overrides = [f"{SEL}capacities.policy=fractions", f"{SEL}capacities.file={path}"]
        return overrides, rf"capacities.file: the weights file .* has no weight for domains \['{names[0]}'\]"
    overrides = [f"{SEL}capacities.policy=minority_full", f"{SEL}capacities.domains=[nosuch]"]
    return overrides, r"capacities.domains: unknown domains \['nosuch'\]"


@pytest.mark.parametrize("case", ["fractions_file", "minority_full"])
def test_capacity_domains_the_shards_lack_are_reported_before_anything_is_built(
    dolma_shards, tmp_path, monkeypatch, capsys, case
):
    overrides, match = _bad_domain_overrides(dolma_shards, tmp_path, case)
    with pytest.raises(ConfigError, match=match):
        load_run_config(TINY, tiny_overrides(dolma_shards, tmp_path / "run", *overrides))
    # From the command line: exit 2 and one error block, and build_trainer is never reached.
    monkeypatch.setattr(train, "build_trainer", lambda cfg: pytest.fail("build_trainer ran before the error"))
    with pytest.raises(SystemExit) as stop:
        train.main([str(TINY), *tiny_overrides(dolma_shards, tmp_path / "run", *overrides)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and re.search(match, err) and "Traceback" not in err, err


def test_a_capacity_error_the_config_check_could_not_see_ends_with_one_line(dolma_shards, tmp_path, monkeypatch, capsys):
    """The backstop at the first batch (shards not readable when the yaml is loaded): one line, exit 2."""
    import composer_algos.registry as registry

    monkeypatch.setattr(registry, "shard_problems", lambda cfg: [], raising=False)  # as for shards only on a remote
    overrides, match = _bad_domain_overrides(dolma_shards, tmp_path, "minority_full")
    argv = tiny_overrides(dolma_shards, tmp_path / "run", *overrides, "max_duration=1ba", "eval_loader=null")
    with pytest.raises(SystemExit) as stop:
        train.main([str(TINY), *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("train.py:")] == [
        next(line for line in err.splitlines() if re.search(match, line))
    ]


# ---------------------------------------------------------------------------------------------- config checks
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ([f"{SEL}strategy=greats", f"{SEL}capacities.policy=slack", f"{SEL}capacities.factor=2"], "(?s)capacities.*'greats'"),
        ([f"{SEL}strategy=id", f"{SEL}capacities=adaptive"], "(?s)adaptive.*refit weights.*'id'"),
        ([f"{SEL}capacities.policy=slack", f"{SEL}capacities.factor=0.5"], "factor must be a number >= 1"),
        ([f"{SEL}capacities=uniform", f"{SEL}capacity_fractions=uniform"], "capacities and capacity_fractions both"),
        ([f"{SEL}capacities.policy=fractions", f"{SEL}capacities.file=/nonexistent/w.json"], "no such file"),
        ([f"{SEL}validation.target=weighted"], r"validation.target must be one of \['mean', 'domain_balanced'\]"),
        ([f"{SEL}strategy=random", f"{SEL}validation.target=domain_balanced"], "would be ignored"),
    ],
)
def test_bad_capacity_and_validation_settings_are_reported_when_the_yaml_is_loaded(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config(TINY, overrides)


def test_capacity_fractions_keeps_working_as_the_fractions_policy():
    algo = DataSelection(capacity_fractions={"a": 3, "b": 1}, domain_names=["a", "b"])
    algo._resolve_fractions()
    assert algo.capacity_policy.name == "fractions" and algo._fractions == pytest.approx([0.75, 0.25])


# ---------------------------------------------------------------------------------------------- validation
def test_domain_balanced_target_is_the_hand_computed_weighted_mean():
    rows = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
    dom_V = torch.tensor([2, 2, 0])
    feats = torch.randn(4, 2)
    p = assemble_problem(
        torch.tensor([0, 1, 2, 2]), kappa_rank=2, gather=False, needs_features=True, features_ND=feats,
        gbar_D=rows.mean(0), val_rows_VD=rows, val_domain_V=dom_V, balance_domains=True, num_domains=3,
    )
    # Domain 2's rows weigh 1/(2*2), domain 0's row 1/(2*1): [0.25 * 1 + 0.25 * 3, 0.5 * 4].
    torch.testing.assert_close(p.gbar_D, torch.tensor([1.0, 2.0]))
    plain = assemble_problem(
        torch.tensor([0, 1, 2, 2]), kappa_rank=2, gather=False, needs_features=True, features_ND=feats,
        gbar_D=rows.mean(0), val_rows_VD=rows, val_domain_V=dom_V,
    )
    torch.testing.assert_close(plain.gbar_D, rows.mean(0))


def test_domain_balanced_target_under_global_scope_weighs_the_gathered_rows(monkeypatch):
    # Rank 0 holds two rows of domain 0, rank 1 one row of domain 1: each domain weighs 1/2 overall.
    rows = {0: torch.tensor([[2.0, 0.0], [4.0, 0.0]]), 1: torch.tensor([[0.0, 6.0]])}
    doms = {0: torch.tensor([0, 0]), 1: torch.tensor([1])}
    ranks = ThreadRanks(2)
    ranks.patch(monkeypatch)

    def body(rank):
        return assemble_problem(
            torch.tensor([0, 1]), kappa_rank=1, gather=True, needs_features=True, features_ND=torch.randn(2, 2),
            gbar_D=rows[rank].mean(0), n_val=rows[rank].shape[0], val_rows_VD=rows[rank], val_domain_V=doms[rank],
            balance_domains=True, num_domains=2,
        )

    for p in ranks.run(body):
        torch.testing.assert_close(p.gbar_D, torch.tensor([1.5, 3.0]))
        assert p.val_domain_V.tolist() == [0, 0, 1]


def test_stratified_draw_covers_every_domain_each_step(dolma_shards):
    plain = ValidationSource(shard_dir=str(dolma_shards), batch_size=5, seed=1)
    num = len(plain.domain_ids)
    src = ValidationSource(shard_dir=str(dolma_shards), batch_size=num + 2, seed=1, stratify=True)
    domains_of = {}
    for s, did in enumerate(src.dataset.stream_domain_ids):
        start, n = int(src.dataset.sample_offset_per_stream[s]), int(src.dataset.samples_per_stream[s])
        domains_of.update({i: did for i in range(start, start + n)})
    guide = set(int(i) for i in src.sample_ids)
    for step in range(6):
        ids = src.indices_for_step(step)
        assert len(ids) == num + 2 and set(ids) <= guide
        assert {domains_of[i] for i in ids} == set(src.domain_ids), step
        assert ids == ValidationSource(shard_dir=str(dolma_shards), batch_size=num + 2, seed=1, stratify=True).indices_for_step(step)
    # Fewer slots than domains: every domain within ceil(C / batch) steps.
    small = ValidationSource(shard_dir=str(dolma_shards), batch_size=2, seed=1, stratify=True)
    seen = set()
    for step in range(-(-num // 2)):
        seen |= {domains_of[i] for i in small.indices_for_step(step)}
    assert seen == set(src.domain_ids)


def test_validation_domains_default_to_the_trained_domains(dolma_shards, tmp_path):
    names = [d["name"] for d in json.loads((dolma_shards / "manifest.json").read_text())["domains"]]
    trained = names[:2]
    run = _train(
        dolma_shards, tmp_path / "run", f"train_loader.dataset.domains=[{','.join(trained)}]", "max_duration=1ba",
        close=False,
    )
    algo = find_data_selection(run.state)
    drawn = {algo.validation.dataset.domain_names[i] for i in algo.validation.domain_ids}
    run.close()
    assert drawn == set(trained)


def test_validation_shards_given_explicitly_are_restricted_at_the_first_batch(dolma_shards, tmp_path):
    names = [d["name"] for d in json.loads((dolma_shards / "manifest.json").read_text())["domains"]]
    run = _train(
        dolma_shards, tmp_path / "run", f"train_loader.dataset.domains=[{names[-1]}]",
        f"{SEL}validation.shard_dir={dolma_shards}", "max_duration=1ba", close=False,
    )
    algo = find_data_selection(run.state)
    drawn = {algo.validation.dataset.domain_names[i] for i in algo.validation.domain_ids}
    run.close()
    assert drawn == {names[-1]}


def test_mixture_plots_show_the_capacities(dolma_shards, tmp_path):
    import plots  # tools/plots.py (tests/training/conftest.py puts tools/ on the path)
    from comparison_plots import plot_trajectories

    from composer_algos.doremi.compare import load_trajectory

    _train(dolma_shards, tmp_path / "run", *SLACK, f"{SEL}capacities.factor=2")
    mix = plots.read_mixture(tmp_path / "run")
    assert set(mix["capacity"]) == set(mix["domains"]) and len(next(iter(mix["capacity"].values()))) == 3
    assert sum(mix["capacity_mean"].values()) >= 1.0 - 1e-9
    assert plots.plot_mixture(tmp_path / "run", tmp_path / "mixture.png").stat().st_size > 0
    trajectory = load_trajectory("slack 2", tmp_path / "run" / "mixture.json")
    assert trajectory.capacities_SC is not None and trajectory.capacities_SC.shape == (3, len(mix["domains"]))
    assert plot_trajectories([trajectory], tmp_path / "traj.png").stat().st_size > 0


@pytest.mark.world_size(2)
@pytest.mark.flaky(reruns=1)
def test_adaptive_state_and_balanced_target_are_the_same_on_both_ranks(dolma_shards, tmp_path):
    from tests.training.test_multiprocess import _launch, _metrics

    run = tmp_path / "global"
    _launch(
        dolma_shards, run, f"{SEL}scope=global", f"{SEL}check_consistency=true", *ADAPTIVE,
        f"{SEL}validation.target=domain_balanced",
    )
    r0, r1 = _metrics(run, 0), _metrics(run, 1)
    assert len(r0["selection/selected_hash"]) == 3
    assert r0["selection/selected_hash"] == r1["selection/selected_hash"]
    gains = [k for k in r0 if k.startswith("selection/adaptive_gain/")]
    assert gains and all(r0[k] == r1[k] for k in gains)
    assert any(v != 0 for k in gains for v in r0[k].values())


def test_guide_signal_tool_reports_every_draw_and_target(dolma_shards, tmp_path):
    import guide_signal  # tools/studies/guide_signal.py

    overrides = [o for o in tiny_overrides(dolma_shards, tmp_path / "run") if o.startswith(("variables.", "model."))]
    rc = guide_signal.main([
        "--yaml", str(TINY), "--draws", "3", "--batch-size", "2", "--eval-per-domain", "2", "--out", str(tmp_path / "out"),
        *overrides,
    ])
    assert rc == 0
    rows = json.loads((tmp_path / "out" / "summary.json").read_text())["cosine"]
    assert set(rows) == {"plain", "stratified"}
    for row in rows.values():
        for key in ("mean", "domain_balanced"):
            assert -1.0 <= row[key]["mean"] <= 1.0 and row[key]["n"] == 3
    # A stratified draw of 2 from 5 domains holds one row per domain: both targets are the same mean.
    assert rows["stratified"]["balanced_minus_mean"]["mean"] == pytest.approx(0.0, abs=1e-6)
