"""tools/bench/window_cost.py: the FLOP floor of windowed scoring by hand, the long-sequence table and its target, a smoke run."""

from __future__ import annotations

import pytest
import window_cost as wc

from tests.common.paths import REPO_ROOT

# h 2, one block, one head of 2, MLP 1, vocabulary 3: attention weights h (1 + 2) 2 + 1 x 2 x h = 16,
# MLP 3 x 2 x 1 = 6, so a block is 2 x 22 + 4 S 2 = 44 + 8 S FLOPs a token, the lm_head 2 x 2 x 3 = 12.
SMALL = {"hidden_size": 2, "num_hidden_layers": 1, "intermediate_size": 1, "num_attention_heads": 1,
         "num_key_value_heads": 1, "vocab_size": 3}


def test_flops_per_token_by_hand():
    f = wc.flops_per_token(SMALL, 4)
    assert (f["block"], f["head"], f["total"]) == (76.0, 12.0, 88.0)


def test_window_floor_by_hand():
    # S 4, window 2, r 2, kappa 1, one validation row. Training: 3 x 1 x 4 x 88 = 1056.
    # A window token: forward 56 + 16 = 72, lm_head input gradient 12, block backward 2 x 60 = 120: 204;
    # scored rows 2 + 1, 2 tokens each: 1224. Floor 1 + 1224 / 1056.
    assert wc.window_step_floor(SMALL, 4, 2, 2.0, kappa=1, val_rows=1) == pytest.approx(1 + 1224 / 1056)
    # lm_head features alone: the window's forward only, 3 x 2 x 72 = 432.
    assert wc.window_step_floor(SMALL, 4, 2, 2.0, kappa=1, val_rows=1, last_n_blocks=0) == pytest.approx(1 + 432 / 1056)
    # No window (or one longer than the row) scores whole rows: 3 rows x 4 tokens x (88 + 12 + 152).
    whole = 1 + 3 * 4 * 252 / 1056
    assert wc.window_step_floor(SMALL, 4, None, 2.0, kappa=1, val_rows=1) == pytest.approx(whole)
    assert wc.window_step_floor(SMALL, 4, 99, 2.0, kappa=1, val_rows=1) == pytest.approx(whole)


def test_llama_floor_at_the_target_is_above_the_target_with_last_block_features():
    # The design question the table answers: at S 2048, r 2, t 128 the last-block features' floor for
    # Llama-3.2-1B (8 rows a rank, 1 validation row) is over 1.05; lm_head features alone are under it.
    from bench_step import LLAMA_1B

    block = wc.window_step_floor(LLAMA_1B, 2048, 128, 2.0, kappa=8, val_rows=1)
    head = wc.window_step_floor(LLAMA_1B, 2048, 128, 2.0, kappa=8, val_rows=1, last_n_blocks=0)
    assert 1.05 < block < 1.06 and 1.03 < head < 1.05


def _row(S, r, random_s, **ps):
    return {"S": S, "r": r, "random": random_s, "ps": {k.replace("t", ""): (int(k[1:]), 1, v) for k, v in ps.items()}}


@pytest.mark.parametrize(("ps_s", "verdict"), [(1.04, "PASS"), (1.06, "FAIL")])
def test_table_prints_ratios_floors_and_the_targets_verdict(ps_s, verdict):
    rows = [_row(2048, 2.0, 1.0, t128=ps_s, t64=1.01), _row(1024, 2.0, 2.0, t128=2.5)]
    assert wc.long_target_verdict(rows) == (pytest.approx(ps_s), verdict == "PASS")
    table = wc.format_long_table(rows, config=SMALL, kappa=1, val_rows=1, reference=SMALL)
    assert f"{ps_s:.3f} <= 1.05 -> {verdict}" in table
    assert "1.250" in table  # the 1024 row's ratio 2.5 / 2.0
    assert "window forward" in table and "validation rows" in table


def test_target_not_measured_is_said():
    table = wc.format_long_table([_row(1024, 2.0, 1.0, t128=1.1)], config=SMALL, kappa=1, val_rows=1)
    assert "not measured in this run" in table


@pytest.mark.timeout(600)
def test_bench_long_smoke(tmp_path):
    # The main path end to end at the smallest size: real trainers, windows and the lm_head arm.
    import shard as shard_tool
    from sample_corpus import write_sample_corpus

    write_sample_corpus(tmp_path / "corpus", seed=0, scale=0.02)
    shards = tmp_path / "shards"
    rc = shard_tool.main(["dolma", str(tmp_path / "corpus" / "dolma" / "documents"), "--out", str(shards),
                          "--max-seq-len", "64", "--val-count", "4", "--no-progress"])
    assert rc == 0
    rows = wc.bench_long(shards, tmp_path / "runs", 64, [2.0], [16, None], head_windows=[16], steps=3,
                         device="cpu", log=lambda *_: None)
    (row,) = rows
    assert set(row["ps"]) == {"16", "S", "16/head"}
    assert row["random"] > 0 and all(s > 0 for _w, _b, s in row["ps"].values())
    assert row["ps"]["16/head"][:2] == (16, 0) and row["ps"]["S"][:2] == (None, 1)


def test_bench_long_ps_variants_reach_their_arms_only(tmp_path, monkeypatch):
    # A variant adds one partitionsel arm per window (none for the lm_head windows), built with its
    # overrides on top of the window's; the other arms do not get them.
    import types

    import stepping

    import train

    built = {}

    def fake_build(cfg):
        key = str(cfg.save_folder).rsplit("-", 1)[-1]
        built[key] = cfg
        return types.SimpleNamespace(state=types.SimpleNamespace(callbacks=[]), close=lambda: None)

    monkeypatch.setattr(train, "build_trainer", fake_build)
    monkeypatch.setattr(stepping, "prepare_for_stepping", lambda trainer: None)
    monkeypatch.setattr(stepping, "make_step_timer", lambda: types.SimpleNamespace(times=[1.0] * 4))
    monkeypatch.setattr(wc, "step_counts_while_warming_up", lambda runs, *a, **k: {})
    loop = "algorithms.data_selection.strategy_options.partitionsel.solver_loop"
    (row,) = wc.bench_long(tmp_path, tmp_path / "runs", 64, [2.0], [16, None], head_windows=[16], steps=4,
                           device="cpu", ps_variants={"d": [f"{loop}=device"]}, log=lambda *_: None)
    assert set(row["ps"]) == {"16", "S", "16/head", "16+d", "S+d"}
    assert row["ps"]["16+d"][:2] == (16, 1) and row["ps"]["S+d"][:2] == (None, 1)
    sel = {k: cfg.algorithms["data_selection"] for k, cfg in built.items()}
    loops = {k: s["strategy_options"]["partitionsel"].get("solver_loop") for k, s in sel.items()}
    assert loops["16+d"] == loops["S+d"] == "device"
    assert "device" not in (loops["16"], loops["S"], loops["16_head"], loops["random"])
    assert sel["16+d"]["features"]["score_window"] == 16 and sel["16+d"]["strategy"] == "partitionsel"


@pytest.mark.timeout(600)
def test_bench_step_long_only_prints_the_long_table(capsys):
    import bench_step

    rc = bench_step.main(["--long", "only", "--long-seqs", "64", "--long-ratios", "2", "--windows", "16",
                          "--head-windows", "", "--long-steps", "3", "--threads", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "long sequences (kappa 2 rows trained a step" in out
    row = next(line.split() for line in out.splitlines() if line.split()[:3] == ["64", "2", "16"])
    assert float(row[5]) > 0 and float(row[6]) > 1  # ps/random measured, floor above 1
    assert "not measured in this run" in out  # the target's S = 2048 row was not asked for


def test_recipe_cli_takes_overrides_after_gpus(capsys):
    # `window_cost.py yaml --gpus N key=value` was rejected ("unrecognized arguments") before the
    # overrides could follow --gpus; a 64-token window must cost half the 128-token one's scoring.
    yaml = str(REPO_ROOT / "yamls" / "llama1b_dolma.yaml")
    assert wc.main([yaml, "--gpus", "64", "algorithms.data_selection.features.score_window=64"]) in (0, None)
    w64 = capsys.readouterr().out
    assert wc.main([yaml, "--gpus", "64", "algorithms.data_selection.features.score_window=128"]) in (0, None)
    w128 = capsys.readouterr().out
    assert "window 64" in w64 and "window 128" in w128
    import re

    scoring = [float(re.search(r"\) ([0-9.]+) PFLOP", out).group(1)) for out in (w64, w128)]
    assert 0.45 < scoring[0] / scoring[1] < 0.55


def test_stepping_runs_warm_up_batches_singly_then_fit_batches_a_call_round_robin(monkeypatch):
    """Two arms, 2 warm-up steps (the second counted by the audit), then 7 steps 3 a call: 3, 3 and the last 1."""
    import step_audit

    calls = []

    class Trainer:
        def __init__(self, name):
            self.name = name

        def fit(self, duration):
            calls.append((self.name, duration))

    class Auditor:
        def __init__(self, trainer, attribute_ops=False):
            self.trainer = trainer

        def count(self):
            calls.append((self.trainer.name, "audited"))
            return {"ops": 5, "kernels": 2, "sync": 1, "h2d": 0}

        def close(self):
            pass

    monkeypatch.setattr(step_audit, "StepAuditor", Auditor)
    runs = {"random": (Trainer("random"), None), "t": (Trainer("t"), None)}
    counts = wc.step_counts_while_warming_up(runs, 9, 2, fit_batches=3, log=lambda *_: None)
    assert counts == {"random": (5, 2, 1), "t": (5, 2, 1)}
    expected = []
    for duration in ("1ba", "audited", "3ba", "3ba", "1ba"):
        expected += [("random", duration), ("t", duration)]
    assert calls == expected
