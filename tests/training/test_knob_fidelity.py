"""tools/knob_fidelity.py on the tiny config: it runs, and the full-cost shadow reproduces the trained selection."""

from __future__ import annotations

import json
import sys

from tests.common.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
import knob_fidelity  # noqa: E402  (tools/knob_fidelity.py)

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
