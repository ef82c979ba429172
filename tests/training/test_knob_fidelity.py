"""tools/studies/knob_fidelity.py on the tiny config: it runs, and the full-cost shadow reproduces the trained selection."""

from __future__ import annotations

import json

import knob_fidelity  # tools/studies/knob_fidelity.py
import pytest

from tests.common.paths import REPO_ROOT

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"


def test_knob_fidelity_runs_and_full_cost_against_itself_is_one(dolma_shards, tmp_path):
    overrides = [
        "variables.max_seq_len=64",
        "global_train_batch_size=4",
        "model.config.hidden_size=32",
        "model.config.intermediate_size=64",
        "algorithms.data_selection.oversampling=3",
        "algorithms.data_selection.features.proj_dim=32",
        "algorithms.data_selection.validation.batch_size=2",
    ]
    argv = ["--yaml", str(TINY), "--shards", str(dolma_shards), "--steps", "3", "--out", str(tmp_path)]
    for o in overrides:
        argv += ["--override", o]
    assert knob_fidelity.main(argv) == 0
    report = json.loads((tmp_path / "knob_fidelity.json").read_text())
    steps = report["steps"]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        # The shadow recomputation of the yaml's selection is the selection the run trained on.
        assert r["trained"] == r["sel"]["full"] and r["jaccard"]["full"] == 1.0
        assert len(r["trained"]) == r["kappa"] == 4 and r["pool"] == 12
        for name in ("score_tokens16", "mlp_down", "attention", "proj_dim256", "random", "random_caps"):
            assert len(r["sel"][name]) == 4 and 0.0 <= r["jaccard"][name] <= 1.0
    # The stale variants reuse step 0's validation feature on steps 1 (interval 2) and 1, 2 (interval 4).
    assert report["summary"]["stale_topk_i2"]["steps"] == 1 and report["summary"]["stale_topk_i4"]["steps"] == 2
    assert report["summary"]["full"]["jaccard_mean"] == 1.0
    table = (tmp_path / "knob_fidelity.md").read_text()
    assert "| score_tokens32 |" in table and "| random_caps |" in table


def test_jaccard():
    assert knob_fidelity.jaccard({1, 2, 3}, {2, 3, 4}) == 0.5
    assert knob_fidelity.jaccard(set(), set()) == 1.0


def test_window_set_equals_full_at_the_row_length_and_differs_below_it(dolma_shards, tmp_path):
    """`--set windows`: a window as long as the rows (64) is the full-length selection and scores
    (Spearman 1, Jaccard 1); a 16-token window scores differently; the noise reference is there."""
    overrides = [
        "variables.max_seq_len=64",
        "global_train_batch_size=4",
        "model.config.hidden_size=32",
        "model.config.intermediate_size=64",
        "algorithms.data_selection.oversampling=3",
        "algorithms.data_selection.features.proj_dim=32",
        "algorithms.data_selection.validation.batch_size=2",
    ]
    argv = ["--yaml", str(TINY), "--shards", str(dolma_shards), "--steps", "4", "--out", str(tmp_path),
            "--set", "windows", "--windows", "16,64"]
    for o in overrides:
        argv += ["--override", o]
    assert knob_fidelity.main(argv) == 0
    report = json.loads((tmp_path / "knob_fidelity.json").read_text())
    steps = report["steps"]
    assert report["meta"]["variants"] == [
        "full", "val_redraw", "window16_start", "window16_random", "window64_start", "window64_random",
    ]
    assert report["meta"]["stale_intervals"] == []
    for r in steps:
        assert set(r["sel"]) == {*report["meta"]["variants"], "eta0", "gradnorm_caps", "random", "random_caps"}
        for name in ("window64_start", "window64_random"):
            assert r["sel"][name] == r["sel"]["full"] and r["spearman"][name] == 1.0
        assert r["spearman"]["full"] == 1.0
        assert -1.0 <= r["spearman"]["window16_start"] <= 1.0
        assert r["score_seq_len"]["window16_start"] == 16 and r["score_seq_len"]["window64_start"] == 64
    # 16 of 64 tokens, without their left context: the scores must move on some step.
    assert min(r["spearman"]["window16_start"] for r in steps) < 1.0
    assert min(r["spearman"]["window16_random"] for r in steps) < 1.0
    summary = report["summary"]
    assert summary["window64_start"]["jaccard_mean"] == 1.0 and summary["window64_start"]["spearman_mean"] == 1.0
    assert summary["window16_start"]["spearman_mean"] < 1.0
    # The second half of 4 steps is steps 2 and 3.
    late = [r["spearman"]["window16_start"] for r in steps if r["step"] >= 2]
    assert summary["window16_start"]["spearman_mean_late"] == sum(late) / len(late)
    assert "spearman_mean" in summary["val_redraw"] and "spearman_mean" not in summary["random"]
    table = (tmp_path / "knob_fidelity.md").read_text()
    assert "| window16_random | `features.score_window: 16`, `score_window_position: random` |" in table
    assert "stale_topk" not in table
    # The reference selections from full's features, and what drives its mu.
    for r in steps:
        assert len(r["sel"]["eta0"]) == len(r["sel"]["gradnorm_caps"]) == 4
        assert 0.0 <= r["terms"]["bonus_share"] <= 1.0 and r["terms"]["eta"] >= 0
    assert steps[0]["terms"]["eta"] == 0.0 and steps[0]["terms"]["bonus_share"] == 0.0  # warm-up starts at lr 0
    assert steps[-1]["terms"]["eta"] > 0 and steps[-1]["terms"]["bonus_share"] > 0
    assert "| eta0 |" in table and "| gradnorm_caps |" in table and "the bonus's share" in table


def test_feature_variant_sets():
    assert knob_fidelity.feature_variants("knobs") == knob_fidelity.FEATURE_VARIANTS
    windows = knob_fidelity.feature_variants("windows", (64, 128))
    assert list(windows) == ["full", "val_redraw", "window64_start", "window64_random", "window128_start", "window128_random"]
    assert windows["window128_random"] == {"score_window": 128, "score_window_position": "random"}
    with pytest.raises(ValueError, match="knobs"):
        knob_fidelity.feature_variants("nope")


def test_mu_terms_by_hand():
    import torch

    G = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]])
    gbar = torch.tensor([1.0, 1.0])
    terms = knob_fidelity.mu_terms(G, gbar, 0.5)
    # alignment |<g_i, gbar>| = 1, 2, 3; bonus (0.5 / 2) ||g_i||^2 = 0.25, 1, 2.25
    assert terms["bonus_over_alignment"] == pytest.approx(0.5)  # median of 0.25, 0.5, 0.75
    assert terms["bonus_share"] == pytest.approx(1 / 3)  # median of 0.2, 1/3, 3/7
    assert knob_fidelity.mu_terms(G, gbar, 0.0)["bonus_share"] == 0.0
