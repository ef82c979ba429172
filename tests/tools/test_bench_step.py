"""tools/bench/bench_step.py's table (ratios, targets) and FLOP share, tools/bench/profile_step.py's --help (issue 15)."""

from __future__ import annotations

import re
import subprocess
import sys

import bench_step  # tools/bench/bench_step.py; heavy imports happen in its functions
import pytest

from tests.common.paths import REPO_ROOT


def _row(r, *, none, random, ps, greats, fwd, feat, solve):
    return {"r": r, "none": none, "random": random, "partitionsel": ps, "greats": greats,
            "forward": fwd, "features": feat, "solve": solve}


def test_summary_ratios_by_hand():
    row = _row(2.0, none=0.10, random=0.20, ps=0.30, greats=0.25, fwd=0.08, feat=0.06, solve=0.01)
    s = bench_step.summarize(row)
    assert s["ps/random"] == pytest.approx(1.5)  # 0.30 / 0.20
    assert s["(ps-random)/fwd"] == pytest.approx(1.25)  # 0.10 / 0.08
    assert s["features/fwd"] == pytest.approx(0.75)  # 0.06 / 0.08
    assert s["rest/fwd"] == pytest.approx(0.375)  # (0.10 - 0.06 - 0.01) / 0.08


def test_targets_judge_the_proportioned_config_at_r2_only():
    passing = _row(2.0, none=0.10, random=0.20, ps=0.30, greats=0.25, fwd=0.08, feat=0.06, solve=0.01)
    # (0.34 - 0.20) / 0.10 = 1.4 > 1.3 and 0.34 / 0.20 = 1.7 > 1.6: both fail.
    failing = _row(2.0, none=0.10, random=0.20, ps=0.34, greats=0.25, fwd=0.10, feat=0.06, solve=0.01)
    awful = _row(4.0, none=0.1, random=0.1, ps=9.0, greats=9.0, fwd=0.1, feat=1.0, solve=1.0)
    rows = {"tiny": [failing], "proportioned": [passing, awful]}
    assert [(name, ok) for name, _, _, ok in bench_step.target_verdicts(rows)] == [
        ("(ps-random)/fwd", True),
        ("ps/random", True),
    ]
    text = bench_step.format_table({"proportioned": [failing]}, {"proportioned (S=128)": 0.205})
    assert "(ps-random)/fwd = 1.40 <= 1.3 -> FAIL" in text
    assert "ps/random = 1.70 <= 1.6 -> FAIL" in text
    assert "proportioned (S=128): 20.5%" in text
    assert bench_step.target_verdicts({"tiny": [passing]}) == []


def test_table_prints_milliseconds_and_memory_verdicts():
    # rest/fwd = (0.10 - 0.06 - 0.012) / 0.08 = 0.35
    row = _row(2.0, none=0.10, random=0.20, ps=0.30, greats=0.25, fwd=0.08, feat=0.06, solve=0.012)
    row.update(microbatch=16, score_peak=3 * 2**20, train_peak=4 * 2**20)
    line = next(x for x in bench_step.format_table({"tiny": [row]}).splitlines() if x.strip().startswith("tiny"))
    assert line.split() == ["tiny", "2", "100.0", "200.0", "250.0", "300.0", "80.0", "60.0", "12.0",
                            "1.50", "1.25", "0.75", "0.35", "-", "-"]  # no step counted: no counts
    row["counts"] = {"partitionsel": (900, 500, 3), "random": (20, 15, 0)}  # (aten ops, non-view, syncs)
    line = next(x for x in bench_step.format_table({"tiny": [row]}).splitlines() if x.strip().startswith("tiny"))
    assert line.split()[-2:] == ["900", "3"]
    assert "scoring 3.0 MB, training step 4.0 MB, scoring/training 0.75 (target <= 1) -> PASS" in (
        bench_step.format_table({"tiny": [row]})
    )


def test_lm_head_share_by_hand():
    # h 4, 1 block, MLP 8, 2 heads of 2, 1 kv head, V 10, S 3:
    # attention weights q 4x4 + k 4x2 + v 4x2 + o 4x4 = 48, MLP 3*4*8 = 96 -> 2*(48+96) = 288,
    # scores 4*S*h_attn = 4*3*4 = 48 -> block 336; lm_head 2*4*10 = 80; share 80 / 416.
    cfg = {"hidden_size": 4, "num_hidden_layers": 1, "intermediate_size": 8, "num_attention_heads": 2,
           "num_key_value_heads": 1, "vocab_size": 10}
    assert bench_step.lm_head_flop_share(cfg, 3) == pytest.approx(80 / 416)
    # Llama-3.2-1B at S 2048: lm_head 2*2048*128256 = 525,336,576; per block 2*(10,485,760 + 50,331,648)
    # + 4*2048*2048 = 138,412,032, times 16 = 2,214,592,512.
    assert bench_step.lm_head_flop_share(bench_step.LLAMA_1B, 2048) == pytest.approx(525_336_576 / 2_739_929_088)


def test_proportioned_config_matches_llama_1b_share():
    from pipeline.config import load_config

    cfg = load_config(REPO_ROOT / "yamls" / "testing" / "proportioned.yaml").model.config
    share = bench_step.lm_head_flop_share(cfg, bench_step.SEQ_LEN)
    llama = bench_step.lm_head_flop_share(bench_step.LLAMA_1B, bench_step.LLAMA_1B_SEQ)
    assert cfg["vocab_size"] == 4096 and abs(share - llama) < 0.02, (share, llama)


def test_profile_step_help_imports_no_heavy_library():
    code = (
        "import runpy, sys\n"
        "sys.argv = ['profile_step.py', '--help']\n"
        "try:\n"
        "    runpy.run_path('tools/bench/profile_step.py', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code\n"
        "print(sorted(m for m in ('torch', 'transformers', 'streaming', 'composer') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_scoring_flop_floor_by_hand():
    # (1 + 4/32) * (1 + 0.2 + 2 * 0.8 / 8) = 1.125 * 1.4
    assert bench_step.scoring_flop_floor(0.2, 8, 32, 4) == pytest.approx(1.575)
    assert bench_step.scoring_flop_floor(0.2, 8, 32, 0) == pytest.approx(1.4)
    # Two target blocks add the second block's input gradient and products.
    assert bench_step.scoring_flop_floor(0.2, 8, 32, 0, last_n_blocks=2) == pytest.approx(1.6)


def test_table_prints_the_floors():
    row = {"r": 2.0, "none": 1.0, "random": 1.0, "partitionsel": 2.0, "greats": 2.0, "forward": 0.5, "features": 0.8, "solve": 0.01}
    text = bench_step.format_table({"proportioned": [row]}, floors={"proportioned r=2": 1.6})
    assert "FLOP floor" in text
    assert "  proportioned r=2: 1.60" in text


@pytest.mark.timeout(480)  # measured 20-68 s at load 3-11 on 2 cores (a subprocess: torch, shards, trainers)
def test_quick_run_prints_a_complete_finite_table():
    """`bench_step.py --quick` end to end (shards, four trainers, standalone timings, memory): its table."""
    from tests.tools.tool_runs import finite, numbers, run_tool

    proc = run_tool("bench/bench_step.py", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["config", "r", "none"])
    end = lines.index("", head)  # the table ends at the first blank line
    rows = [line.split() for line in lines[head + 1 : end]]
    assert len(rows) == 1 and len(rows[0]) == 15, out
    r, *cells = (float(x) for x in rows[0][1:])
    assert r == 2
    times, ratios, counts = cells[:7], cells[7:11], cells[11:]  # (ms); 4 ratios; ps ops, ps syncs
    # A forward's ops; the step's syncs: one transfer, and the exact OMP's 16 picks + 2 (+ one per weight drop).
    assert counts[0] > 100 and 1 <= counts[1] <= 1 + 2 + 2 * 16, rows
    assert finite(times) and min(times) > 0, rows
    assert finite(ratios) and ratios[0] > 0 and ratios[2] > 0, rows  # ps/random, feat/fwd; the others may be < 0
    floors = [line for line in out.splitlines() if line.startswith("  tiny r=2 (pool ")]
    assert len(floors) == 1 and numbers(floors[0].rsplit(":", 1)[1])[0] >= 1, out
    mem = [line for line in out.splitlines() if line.startswith("  tiny r=2 microbatch ")]
    assert len(mem) == 1, out
    score, train = (float(x) for x in re.findall(r"(\S+) MB", mem[0]))
    assert finite([score, train]) and score > 0 and train > 0, mem


@pytest.mark.timeout(480)  # measured 20-68 s at load 3-11 on 2 cores (a subprocess: torch, shards, trainers)
def test_profile_step_quick_run_prints_the_stage_table():
    """`profile_step.py --quick` end to end (shards, trainer, instrumentation, profiler): its stage table."""
    from tests.tools.tool_runs import finite, run_tool

    proc = run_tool("bench/profile_step.py", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split() == ["stage", "ms/step", "%", "step"])
    table = {line[:40].strip(): line[40:].split() for line in lines[head + 1 :] if line.strip()}
    needed = ["step", "selection", "selection/features", "features/pool", "features/forward", "features/loss",
              "features/backward", "selection/solve", "train", "train/forward", "rest (data loading, callbacks)"]
    assert set(needed) <= set(table), proc.stdout
    for name in needed[:-1]:
        ms, share = (float(x) for x in table[name])
        assert finite([ms, share]) and ms > 0 and 0 < share <= 100, (name, table[name])
    assert table["step"][1] == "100.0"
    assert float(table["selection"][0]) + float(table["train"][0]) <= float(table["step"][0])


def test_long_batch_sets_the_rows_the_long_table_trains_and_its_floors(monkeypatch, tmp_path, capsys):
    """--long-batch reaches both the measured runs and the floors printed beside them."""
    import argparse

    import window_cost as wc

    seen = {}

    def fake_bench_long(shards, runs, S, ratios, windows, *, model_overrides, **kwargs):
        seen["overrides"] = list(model_overrides)
        return [{"S": S, "r": 2, "random": 1.0, "ps": {64: 1.05}}]

    def fake_table(rows, *, config, kappa, val_rows, reference):
        seen["kappa"], seen["val_rows"] = kappa, val_rows
        return "table"

    monkeypatch.setattr(wc, "write_long_shards", lambda corpus, shards, S: 0)
    monkeypatch.setattr(wc, "bench_long", fake_bench_long)
    monkeypatch.setattr(wc, "format_long_table", fake_table)
    args = argparse.Namespace(long_model="proportioned", long_batch=8, long_steps=3, device="cpu", op_sites=0,
                              long_override=["optimizer.name=adamw"], ps_variants={}, long_fit_batches=1)
    bench_step.long_table(tmp_path, args, [2048], [2], [64], [])
    assert "global_train_batch_size=8" in seen["overrides"]
    assert "optimizer.name=adamw" in seen["overrides"]  # --long-override reaches every arm
    assert seen["kappa"] == 8 and seen["val_rows"] == 1
    args.long_batch = None
    bench_step.long_table(tmp_path, args, [2048], [2], [64], [])
    assert seen["kappa"] == 2  # yamls/testing/long_proportioned.yaml's global_train_batch_size


def test_ps_variants_parse_and_malformed_ones_are_refused_with_the_spec():
    assert bench_step.parse_ps_variants(["c:a.b=true", "cd:a.b=true, x.y=device"]) == {
        "c": ["a.b=true"], "cd": ["a.b=true", "x.y=device"]}
    for bad in (["c"], ["c:"], [":a=1"], ["c:a"], ["c:a=1", "c:b=2"], ["c:a=1", " c :b=2"]):
        with pytest.raises(ValueError, match="expected NAME:KEY=VALUE|given twice"):
            bench_step.parse_ps_variants(bad)
    with pytest.raises(SystemExit):
        bench_step.main(["--long", "only", "--ps-variant", "c:nokey"])
    with pytest.raises(SystemExit):
        bench_step.main(["--long", "only", "--long-override", "novalue"])


def test_long_batch_below_one_is_refused():
    with pytest.raises(SystemExit):
        bench_step.main(["--long", "only", "--long-batch", "0"])
