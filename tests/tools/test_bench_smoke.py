"""Smoke runs of the benchmarks (issue 20 point 4): each script's main path end to end at its smallest
sizes, its table complete with finite figures, and a non-zero exit when a row fails.

tools/bench/bench_step.py and tools/bench/profile_step.py have theirs in test_bench_step.py.
"""

from __future__ import annotations

import re

import pytest

from tests.tools.tool_runs import NUMBER, finite, numbers, run_tool, run_tool_patched


def _markdown_rows(out: str, first_cell: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in out.splitlines()
        if line.startswith(f"| {first_cell} |")
    ]


# Slow (24 s idle): test_bench_features_exits_nonzero_when_a_method_fails runs the bench by default.
@pytest.mark.slow
# measured 15-30 s at load 3-11 on 2 cores before feat_compiled, whose block inductor compiles in both workers
# (about 2 minutes at load 3)
@pytest.mark.timeout(600)
def test_bench_features_quick_table_has_every_method():
    proc = run_tool("bench/bench_features.py", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _markdown_rows(proc.stdout, "tiny")
    methods = ["forward", "batch_grad", "feat_exact", "feat_sketch", "feat_default", "func", "feat_compiled"]
    assert [r[1] for r in rows] == methods, proc.stdout
    for row in rows:
        median, peak, per_fwd, per_bgrad = (float(x) for x in row[2:6])
        assert finite([median, peak, per_fwd, per_bgrad]) and median > 0 and per_fwd > 0 and per_bgrad > 0, row
        assert int(row[6]) > 0 and row[7] == "-", row  # aten ops counted; launches only on CUDA
    ops = {r[1]: int(r[6]) for r in rows}
    # The compiled block's pointwise ops are fused into kernels that are not aten ops.
    assert ops["feat_compiled"] < ops["feat_sketch"], ops
    assert f"aten ops {ops['feat_sketch']} -> {ops['feat_compiled']}" in proc.stdout
    assert rows[0][4] == "1.00" and rows[1][5] == "1.00"  # the forward and batch_grad rows against themselves
    ratios = re.findall(rf"\[tiny\] feat_\w+:\s+\(c\)/\(b\) = ({NUMBER})\s+\(d\)/\(c\) = ({NUMBER})", proc.stdout)
    assert len(ratios) == 3 and finite([float(x) for pair in ratios for x in pair]), proc.stdout


@pytest.mark.timeout(240)  # measured 15-30 s at load 3-11 on 2 cores (subprocesses importing torch, transformers)
def test_bench_features_exits_nonzero_when_a_method_fails():
    # An unknown device makes every worker fail: no row may be dropped silently with exit code 0.
    proc = run_tool("bench/bench_features.py", "--quick", "--methods", "forward", "--device", "no_such_device")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FAILED (no row" in proc.stderr and "tiny/forward" in proc.stderr


_RAISE = "def _boom(*a, **k):\n    raise RuntimeError('injected failure')\n"


def test_bench_selection_seed_picks_another_instance():
    def exact_objective(*extra):
        proc = run_tool("bench/bench_selection.py", "--quick", "--threads", "1", *extra)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        line = next(x for x in proc.stdout.splitlines() if x.strip().startswith("exact "))
        return proc.stdout, float(re.search(rf"f\(S\) = ({NUMBER})", line).group(1))

    out0, f0 = exact_objective()
    out1, f1 = exact_objective("--seed", "1")
    assert "seed=0" in out0 and "seed=1" in out1
    assert f0 != f1
    # The device loop's reads and rounds launched (frozen ones included): at least one round a pick, a read a batch.
    line = next(x for x in out0.splitlines() if x.strip().startswith("device loop / host loop"))
    reads, rounds = (int(x) for x in re.search(r"(\d+) reads, (\d+) rounds launched for 64 picks", line).groups())
    assert reads >= 1 and rounds >= 64, line


@pytest.mark.timeout(400)  # --compiled compiles two shapes of the round: about 100 s here with an empty cache
def test_bench_selection_quick_table(tmp_path):
    code = tmp_path / "round.py"
    proc = run_tool(
        "bench/bench_selection.py", "--quick", "--threads", "1", "--compiled", "--triton", "--kernel-table", "--round-code", str(code)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "[small] n=256 kappa=64 C=8 D=1024" in out, out
    for label in ("gram alone", "exact", "exact, device loop", "exact, compiled rounds", "exact, Triton rounds",
                  "exact, Triton, eager repairs", "exact, Triton, in a step", "exact, on the CPU",
                  "apga (support) x128",
                  "apga_pool (paper) x128", "exact + swap"):
        line = next((x for x in out.splitlines() if x.strip().startswith(label + " ")), None)
        assert line is not None, (label, out)
        wall, cpu = (float(x) for x in re.findall(rf"({NUMBER}) ms (?:wall|cpu)", line))
        assert finite([wall, cpu]) and wall > 0 and cpu > 0, line
        if label != "gram alone":
            f_s = float(re.search(rf"f\(S\) = ({NUMBER})", line).group(1))
            assert finite([f_s]) and f_s > 0, line
    # The device loop and the CPU solve pick what the host loop picks, with their launches and syncs counted.
    for prefix in ("device loop / host loop", "compiled rounds / host loop", "Triton rounds / host loop",
                   "Triton rounds in a step / host loop", "Triton rounds, repairs graphed / eager", "cpu solve / host loop",
                   "Triton rounds: the selection"):
        line = next(x for x in out.splitlines() if x.strip().startswith(prefix))
        assert "the same picks: True" in line, line
    # The selection as a step makes it and the solve alone, beside the whole selection's time.
    line = next(x for x in out.splitlines() if x.strip().startswith("Triton rounds: the selection"))
    times = [float(x) for x in re.findall(rf"({NUMBER}) ms", line)]
    assert len(times) == 3 and finite(times) and min(times) > 0, line
    kernels = next(x for x in out.splitlines() if x.strip().startswith("one compiled round:"))
    assert 1 <= int(re.search(r"round: (\d+) kernels", kernels).group(1)) <= 6, kernels
    for loop in ("host", "device", "cpu"):
        assert any(x.strip().startswith(f"exact ({loop} loop), one solve:") for x in out.splitlines()), out
    # --kernel-table: one profiled solve of each device-side loop; --round-code: inductor's code of a round.
    for loop in ("host", "device", "device_compiled", "device_triton"):
        line = next(x for x in out.splitlines() if x.strip().startswith(f"kernels of one solve, solver_loop {loop}:"))
        assert float(re.search(rf"({NUMBER}) ms wall", line).group(1)) > 0 and "device busy 0.0 ms" in line, line
    assert "def " in code.read_text() and "kernel" in code.read_text(), code.read_text()[:500]
    speedups = [x for x in out.splitlines() if x.strip().startswith("exact vs ")]
    assert len(speedups) == 2, out
    for line in speedups:
        assert finite([float(x) for x in re.findall(rf"({NUMBER})x", line)]) and line.endswith(("True", "False")), line


def test_bench_scaling_quick_tables():
    proc = run_tool("bench/bench_scaling.py", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    traffic = [x.split() for x in lines if x.startswith(("llama1b_dolma ", "qwen2.5-3b_metamathqa "))]
    assert len(traffic) == 8, proc.stdout  # 2 recipes x 4 world sizes
    for row in traffic:
        values = [float(v) for v in row[1:] if v != "MiB"]
        assert len(values) == 6 and finite(values) and min(values) > 0, row
    head = next(i for i, x in enumerate(lines) if x.split()[:3] == ["threads", "n", "kappa"])
    solves = [x.split() for x in lines[head + 1 :]]
    assert [r[:3] for r in solves] == [["1", "256", "128"], ["1", "256", "32"]], proc.stdout
    for row in solves:
        wall, cpu, runs = float(row[3]), float(row[4]), int(row[5])
        assert finite([wall, cpu]) and wall > 0 and cpu >= 0 and runs == 1, row


def test_bench_scaling_exits_nonzero_when_a_case_fails():
    proc = run_tool_patched("bench/bench_scaling", _RAISE + "m.time_solve = _boom", "--quick")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("failed after") == 2 and "injected failure" in proc.stdout, proc.stdout
    assert "FAILED cases" in proc.stderr


def test_bench_shard_smallest_run_table():
    proc = run_tool("bench/bench_shard.py", "--scale", "0.05", "--repeats", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    rows = [x for x in lines if x.startswith(("tokenizer alone (1 thread)", "shard.py --workers"))]
    assert rows[0].startswith("tokenizer alone") and len(rows) >= 3, proc.stdout
    for row in rows:
        values = numbers(row)  # the label's own digits come first
        assert len(values) >= 6, row
        tokens, wall, median, per_s, cpu_main, cpu_workers = values[-6:]
        assert finite([tokens, wall, median, per_s, cpu_main, cpu_workers]), row
        assert tokens > 0 and wall > 0 and median >= wall and per_s > 0 and cpu_main >= 0 and cpu_workers >= 0, row
    for target in ("2 workers / 1 worker throughput:", "1 worker total time / tokenizer alone:"):
        line = next(x for x in lines if x.startswith(target))
        assert finite(numbers(line.split(":", 1)[1])) and line.endswith(("PASS", "FAIL")), line


def test_bench_shard_exits_nonzero_when_a_run_fails():
    proc = run_tool_patched("bench/bench_shard", _RAISE + "m.shard_corpus = _boom", "--scale", "0.05", "--repeats", "1")
    assert proc.returncode != 0 and "injected failure" in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_bench_optimizer_quick_table():
    proc = run_tool("bench/bench_optimizer.py", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split()[3]: line.split() for line in proc.stdout.splitlines() if line.split()[3:4] in (["decoupled_adamw"], ["adamw"])}
    assert set(rows) == {"decoupled_adamw", "adamw"}, proc.stdout
    composer, torch_ = rows["decoupled_adamw"], rows["adamw"]
    assert finite([float(composer[4]), float(torch_[4])]) and float(torch_[4]) > 0, proc.stdout
    # Composer: one sync per parameter tensor and ten-odd ops each; torch's fused AdamW: no sync, a few ops.
    tensors = int(composer[1])
    assert int(composer[6]) == tensors and int(torch_[6]) == 0, proc.stdout
    assert int(composer[5]) > 5 * tensors > int(torch_[5]), proc.stdout
    gap = float(re.search(rf"largest relative difference ({NUMBER})", proc.stdout).group(1))
    assert gap < 1e-5, proc.stdout  # the same update


@pytest.mark.timeout(300)  # about 10 s at load 2: Triton's interpreter runs every program of every launch in Python
def test_compare_triton_kernels_times_the_other_kernels_beside_the_trees(tmp_path, monkeypatch):
    """`compare_triton_kernels.py` in Triton's interpreter at a tiny size: the other file's kernels really run in their
    arm (a copy of the tree's whose TritonRound announces itself: once for the warm-up, once for the timed run; its
    file named without ``.py``, as `git show` output may be), the tree's in theirs, every arm with the host loop's
    picks; a --blocks key that BLOCKS lacks, and a block size that is not a power of two, are refused by name."""
    from tests.common.paths import REPO_ROOT

    other = tmp_path / "omp_triton_other"
    other.write_text(
        (REPO_ROOT / "composer_algos/selection/omp_triton.py").read_text()
        + "\n\n_Tree = TritonRound\n\n\nclass TritonRound(_Tree):\n    def __init__(self, *args, **kwargs):\n"
        "        print('the other kernels run', flush=True)\n        super().__init__(*args, **kwargs)\n"
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    proc = run_tool(
        "bench/compare_triton_kernels.py", "--kernels", str(other), "--device", "cpu", "--n", "40", "--kappa", "12",
        "--dim", "64", "--seeds", "0", "--repeats", "1", "--blocks", '{"reduce": 4}',
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("the other kernels run") == 2, proc.stdout
    rows = [x for x in proc.stdout.splitlines() if "the host loop's picks (every run):" in x]
    labels = ("other kernels (omp_triton_other)", "this tree's kernels", "this tree's, reduce=4")
    assert [next(label for label in labels if row.strip().startswith(label)) for row in rows] == list(labels), rows
    for row in rows:
        assert row.endswith("the host loop's picks (every run): True"), row
        ms, ratio, low = (float(x) for x in re.findall(rf"({NUMBER})(?: ms|x)", row))
        assert finite([ms, ratio, low]) and ms > 0 and low > 0, row
    assert rows[0].split("ms")[1].strip().startswith("1.000x"), rows[0]
    bad = run_tool("bench/compare_triton_kernels.py", "--kernels", str(other), "--device", "cpu", "--blocks", '{"reduc": 4}')
    assert bad.returncode == 2 and "unknown keys ['reduc']" in bad.stderr and "'reduce'" in bad.stderr, bad.stderr
    bad = run_tool("bench/compare_triton_kernels.py", "--kernels", str(other), "--device", "cpu", "--blocks", '{"reduce": 3}')
    assert bad.returncode == 2 and "reduce must be a power of two" in bad.stderr and "got 3" in bad.stderr, bad.stderr
