"""End to end: `tools/evaluate.py math` on a tiny saved model and real GSM8K problems; the `mol` subcommand."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.common.paths import REPO_ROOT, require_shared_data

TOOL = REPO_ROOT / "tools" / "evaluate.py"


def _tool():
    spec = importlib.util.spec_from_file_location("evaluate_tool", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_math_end_to_end_subprocess(tmp_path, tiny_model_dir):
    data = require_shared_data("eval")
    out = tmp_path / "results" / "math.json"
    cmd = [
        sys.executable, str(TOOL), "math",
        "--model", str(tiny_model_dir),
        "--data-dir", str(data),
        "--suites", "gsm8k",
        "--limit", "4",
        "--batch-size", "2",
        "--max-new-tokens", "8",
        "--device", "cpu",
        "--no-progress",
        "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GSM8K" in proc.stdout and "accuracy" in proc.stdout and "Avg" in proc.stdout

    summary = json.loads(out.read_text())
    gsm = summary["suites"]["gsm8k"]
    assert gsm["n"] == 4 and 0.0 <= gsm["accuracy"] <= 1.0 and gsm["correct"] <= 4
    assert summary["average"] == pytest.approx(gsm["accuracy"])
    assert summary["run"]["max_new_tokens"] == 8 and summary["run"]["prompt_template"] == "metamath"

    preds = [json.loads(line) for line in open(summary["predictions"], encoding="utf-8")]
    assert [p["index"] for p in preds] == [0, 1, 2, 3]
    assert [p["gold"] for p in preds] == ["18", "3", "70000", "540"]  # the real file's "#### N" lines
    assert all(isinstance(p["completion"], str) and isinstance(p["correct"], bool) for p in preds)
    assert sum(p["correct"] for p in preds) == gsm["correct"]


def test_all_suites_found_in_a_folder(tmp_path):
    data = require_shared_data("eval")
    tool = _tool()
    assert tool._select_suites("all", str(data)) == ["gsm8k", "svamp", "aqua"]
    assert tool._select_suites("gsm8k, aqua", str(data)) == ["gsm8k", "aqua"]
    with pytest.raises(SystemExit):
        tool._select_suites("all", str(tmp_path))


def test_mol_predictions_subcommand(tmp_path, capsys):
    preds = tmp_path / "preds.jsonl"
    rows = [
        {"task": "forward_reaction_prediction", "prediction": "[O][C][C]", "reference": "[C][C][O]"},
        {"task": "forward_reaction_prediction", "prediction": "junk", "reference": "[C][C][O]"},
        {"task": "retrosynthesis", "prediction": "[C][C][C][O]", "reference": "[C][C][O]"},
    ]
    preds.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "mol.json"
    assert _tool().main(["mol", "--predictions", str(preds), "--keep-invalid", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "forward_reaction_prediction" in printed and "validity" in printed
    tasks = json.loads(out.read_text())["tasks"]
    assert tasks["forward_reaction_prediction"]["validity"] == 0.5
    assert tasks["forward_reaction_prediction"]["exact_match"] == 0.5  # --keep-invalid: junk counts as a miss
    assert tasks["retrosynthesis"]["exact_match"] == 0.0


def test_mol_generation_subcommand(tmp_path, tiny_model_dir):
    def rec(inp, out, split):
        return {"instruction": "Predict the product.", "input": inp, "output": out, "metadata": {"task": "forward", "split": split}}

    records = [rec("[C][C][O].[O]", "[C][C][=O]", "test"), rec("[C][O]", "[C][=O]", "test"), rec("[C]", "[C]", "train")]
    data = tmp_path / "forward_reaction_prediction.json"
    data.write_text(json.dumps(records))
    out = tmp_path / "mol.json"
    argv = ["mol", "--model", str(tiny_model_dir), "--data", str(data), "--max-new-tokens", "4"]
    argv += ["--device", "cpu", "--no-progress", "--out", str(out)]
    assert _tool().main(argv) == 0
    summary = json.loads(out.read_text())
    assert summary["tasks"]["forward"]["n"] == 2  # the train record is not evaluated
    assert 0.0 <= summary["tasks"]["forward"]["validity"] <= 1.0
    preds = [json.loads(line) for line in open(summary["predictions"], encoding="utf-8")]
    assert [p["reference"] for p in preds] == ["[C][C][=O]", "[C][=O]"]
