"""Profile: where one PartitionSel training step spends its time, stage by stage (torch.profiler, CPU).

Example:
    python tools/bench/profile_step.py                              # proportioned config, r = 2, 3 profiled steps
    python tools/bench/profile_step.py --config tiny --ratio 4 --steps 5
    python tools/bench/profile_step.py --quick                      # smoke run: tiny, 1 warm-up + 1 profiled step

Builds the benchmark's trainer (tools/bench/bench_step.py: same synthetic shards, seq 128, fp32 on
CPU), trains `--warmup` steps, then profiles `--steps` steps and prints the mean milliseconds per
step of each stage, with its share of the step. Stages are `record_function` ranges: the ones in
the library (features/forward, loss, backward, products, fjlt, normalization, check_host_sync;
no-ops without a profiler) and ones this script wraps around the algorithm's stage functions
and the model (so the library needs no profiling code in its step):

    selection/*        validation draw, features (pool, validation), assemble, solve (gram, omp), exchange, logging
    model/*            the model forward split by hooks: below the cut (blocks without a graph while
                       scoring), target blocks (from the cut to the final norm), lm_head
    train              the optimizer step with Composer's closure: forward, loss and backward of the
                       selected batch, then the update; train/forward is its forward (+ loss)

Times are inclusive (a stage contains its sub-stages) and CPU wall time on the calling thread;
`model/*` appears under the scoring forward and under the training forward, attributed by
its enclosing range. Load: `uptime` before and after is printed, since on a shared machine
the milliseconds move and the shares are what to compare.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

# Display order; a stage's children follow it, indented by their depth in this list.
STAGES = [
    ("step", 0),
    ("selection", 1),
    ("selection/validation_draw", 2),
    ("selection/features", 2),
    ("features/normalization", 3),
    ("features/pool", 3),
    ("features/validation", 3),
    ("features/forward", 4),
    ("model/below_cut", 5),
    ("model/target_blocks", 5),
    ("model/lm_head", 5),
    ("features/loss", 4),
    ("features/backward", 4),
    ("features/products", 4),
    ("features/fjlt", 4),
    ("features/check_host_sync", 3),
    ("selection/assemble", 2),
    ("selection/solve", 2),
    ("solve/gram", 3),
    ("solve/omp", 3),
    ("selection/exchange", 2),
    ("selection/logging", 2),
    ("train", 1),
    ("train/forward", 2),
    ("train/model/below_cut", 3),
    ("train/model/target_blocks", 3),
    ("train/model/lm_head", 3),
    ("selection/ahead", 2),  # select_ahead: the next step's selection, inside the training stage (its parts above)
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="proportioned", choices=("tiny", "proportioned"))
    parser.add_argument("--ratio", type=float, default=2.0, help="oversampling r (default: 2)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before profiling (default: 3)")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps, averaged (default: 3)")
    parser.add_argument("--strategy", default="partitionsel", help="strategy to profile (default: partitionsel)")
    parser.add_argument(
        "--quick", action="store_true",
        help="smoke run, not a measurement: --config tiny --warmup 1 --steps 1 on bench_step.py's quarter-size "
        "corpus (overrides those)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.config, args.warmup, args.steps = "tiny", 1, 1
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1")

    import torch
    from bench_step import CONFIGS, QUICK_CORPUS_SCALE, write_bench_shards
    from torch.profiler import ProfilerActivity, profile, record_function

    uptime_before = _uptime()
    with tempfile.TemporaryDirectory(prefix="profile_step_") as tmp:
        root = Path(tmp)
        shards = root / "shards"
        rc = write_bench_shards(root / "corpus", shards, scale=QUICK_CORPUS_SCALE if args.quick else 1.0)
        if rc:
            return rc
        trainer = _build(CONFIGS[args.config], shards, root / "run", args)
        _instrument(trainer)
        for _ in range(args.warmup):
            trainer.fit(duration="1ba")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                with record_function("step"):
                    trainer.fit(duration="1ba")
        trainer.close()
    uptime_after = _uptime()
    totals = _stage_totals(prof.events())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; config {args.config}, r={args.ratio:g}, "
        f"strategy {args.strategy}; mean over {args.steps} profiled steps after {args.warmup} warm-up"
    )
    print(f"uptime before: {uptime_before}\nuptime after:  {uptime_after}\n")
    print(format_stages(totals, args.steps))
    return 0


def format_stages(totals_us: dict[str, float], steps: int) -> str:
    """The stage table: mean ms per step and % of the step, children indented under their parents."""
    step = totals_us.get("step", 0.0) / steps
    lines = [f"{'stage':40s} {'ms/step':>9s} {'% step':>7s}"]
    for name, depth in STAGES:
        if name not in totals_us:
            continue
        ms = totals_us[name] / steps / 1000
        share = 100 * totals_us[name] / steps / step if step else float("nan")
        lines.append(f"{'  ' * depth + name:40s} {ms:9.1f} {share:7.1f}")
    accounted = sum(totals_us.get(n, 0.0) for n in ("selection", "train")) / steps
    lines.append(
        f"{'  rest (data loading, callbacks)':40s} {(step - accounted) / 1000:9.1f} "
        f"{100 * (step - accounted) / step if step else float('nan'):7.1f}"
    )
    return "\n".join(lines)


def _build(yaml: Path, shards: Path, run_dir: Path, args: argparse.Namespace):
    """The trainer, stepped one batch per fit() call (no checkpoints, no console output, files kept open)."""
    from bench_step import SEQ_LEN
    from stepping import prepare_for_stepping

    import train
    from pipeline.config import load_config

    cfg = load_config(
        yaml,
        [
            f"variables.shard_dir={shards}",
            f"variables.max_seq_len={SEQ_LEN}",
            f"save_folder={run_dir}",
            f"max_duration={args.warmup + args.steps}ba",
            "eval_loader=null",
            "python_log_level=error",
            "console_log_interval=1000ba",
            f"algorithms.data_selection.strategy={args.strategy}",
            f"algorithms.data_selection.oversampling={args.ratio}",
            "device=cpu",
            "precision=fp32",
        ],
    )
    trainer = train.build_trainer(cfg)
    prepare_for_stepping(trainer)
    return trainer


def _instrument(trainer) -> None:
    """Wrap the algorithm's stage functions, the extractor's pool/validation passes and the model in ranges."""
    import composer_algos.data_selection.algorithm as alg_mod
    import composer_algos.selection.partitionsel as ps_mod
    from composer_algos.data_selection.validation_source import ValidationSource
    from composer_algos.features.extractor import GradFeatureExtractor

    for name, label in (
        ("assemble_problem", "selection/assemble"),
        ("solve_problem", "selection/solve"),
        ("redistribute", "selection/exchange"),
        ("selection_metrics", "selection/logging"),
        ("record_step", "selection/logging"),
    ):
        setattr(alg_mod, name, _ranged(getattr(alg_mod, name), label))
    for name, label in (("build_objective", "solve/gram"), ("omp_select", "solve/omp")):
        setattr(ps_mod, name, _ranged(getattr(ps_mod, name), label))
    alg_mod.DataSelection._select = _ranged(alg_mod.DataSelection._select, "selection")
    alg_mod.DataSelection._select_ahead = _ranged(alg_mod.DataSelection._select_ahead, "selection/ahead")
    alg_mod.DataSelection._features = _ranged(alg_mod.DataSelection._features, "selection/features")
    ValidationSource.batch_for_step = _ranged(ValidationSource.batch_for_step, "selection/validation_draw")
    features = GradFeatureExtractor._features_of
    if getattr(features, "_profile_range", None) == "features/*":
        features = None  # labelled by an earlier trainer's instrumentation
    calls = {"n": 0}

    def labelled_features(self, parts, *a, **kw):
        # compute() scores the pool first, then the validation batch; windows of both share their
        # forwards (one call of two parts), counted under features/pool.
        from torch.profiler import record_function

        calls["n"] += 1 if len(parts) == 1 else 2
        with record_function("features/pool" if len(parts) > 1 or calls["n"] % 2 == 1 else "features/validation"):
            return features(self, parts, *a, **kw)

    if features is not None:
        labelled_features._profile_range = "features/*"
        GradFeatureExtractor._features_of = labelled_features

    composer_model = trainer.state.model
    composer_model.forward = _ranged(composer_model.forward, "train/forward")
    composer_model.loss = _ranged(composer_model.loss, "train/forward")
    optimizer = trainer.state.optimizers[0]
    optimizer.step = _ranged(optimizer.step, "train")  # Composer passes the microbatches' closure
    _hook_model_stages(composer_model.model)


def _hook_model_stages(hf) -> None:
    """Ranges inside the model forward: below the last block, the last block and final norm, the lm_head."""
    from torch.profiler import record_function

    blocks = hf.model.layers
    cut = blocks[-1]  # the features' default cut (last_n_blocks 1)
    open_ranges: list[Any] = []

    def enter(name: str) -> None:
        rf = record_function(name)
        rf.__enter__()
        open_ranges.append(rf)

    def leave() -> None:
        if open_ranges:
            open_ranges.pop().__exit__(None, None, None)

    hf.register_forward_pre_hook(lambda m, a: enter("model/below_cut"))
    cut.register_forward_pre_hook(lambda m, a: (leave(), enter("model/target_blocks"))[-1])
    head = hf.get_output_embeddings()
    head.register_forward_pre_hook(lambda m, a: (leave(), enter("model/lm_head"))[-1])
    head.register_forward_hook(lambda m, a, o: leave())


def _ranged(fn, label: str):
    from functools import wraps

    from torch.profiler import record_function

    if getattr(fn, "_profile_range", None) == label:  # instrumented already (one process, several trainers)
        return fn

    @wraps(fn)
    def wrapper(*a, **kw):
        with record_function(label):
            return fn(*a, **kw)

    wrapper._profile_range = label
    return wrapper


def _stage_totals(events) -> dict[str, float]:
    """Inclusive microseconds per stage label; `model/*` under a training forward becomes `train/model/*`."""
    names = {n for n, _ in STAGES}
    totals: dict[str, float] = defaultdict(float)
    for ev in events:
        name = ev.name
        if name.startswith("model/"):
            parent, in_train = ev.cpu_parent, False
            while parent is not None:
                if parent.name == "train/forward":
                    in_train = True
                    break
                if parent.name.startswith("features/"):
                    break
                parent = parent.cpu_parent
            name = f"train/{name}" if in_train else name
        if name in names:
            totals[name] += ev.cpu_time_total
    return dict(totals)


# The stages whose GPU occupancy `gpu_busy_by_stage` reports: the selection and its two costly parts, the
# training (forward, backward, optimizer) and the whole step.
OCCUPANCY_STAGES = ("step", "selection", "selection/features", "selection/solve", "train", "selection/ahead")


def gpu_busy_by_stage(events, stages=OCCUPANCY_STAGES) -> dict[str, tuple[float, float]]:
    """``{stage: (host us, GPU-busy us)}`` summed over the stage's ranges: the time, within each range's host
    interval, during which at least one device event (a kernel, a copy, whoever launched it) was running.

    A stage whose host time is far above its GPU-busy time left the GPU idle: its host work is not hidden
    behind earlier GPU work. `events` are the profiler's (`prof.events()`): host ranges by name, device events
    by `device_type` CUDA; kineto puts both on the host clock. A `record_function` range also appears on the
    device as a user annotation spanning its first kernel's start to its last kernel's end, idle gaps
    included: those are not device work, and counting them made every annotated stage look fully busy.
    """
    from step_audit import device_busy_intervals

    merged = device_busy_intervals(events)
    out: dict[str, tuple[float, float]] = {}
    for e in events:
        if e.name not in stages or e.device_type.name == "CUDA":
            continue
        lo, hi = e.time_range.start, e.time_range.end
        busy = sum(max(0.0, min(hi, end) - max(lo, start)) for start, end in merged if start < hi and end > lo)
        host, busy_total = out.get(e.name, (0.0, 0.0))
        out[e.name] = (host + hi - lo, busy_total + busy)
    return out


def format_occupancy(busy: dict[str, tuple[float, float]], steps: int) -> str:
    """The occupancy table: per stage, host ms a step, GPU-busy ms a step within it, and the idle share."""
    lines = [f"{'stage (host range)':24s} {'host ms':>9s} {'GPU busy':>9s} {'GPU idle':>9s} {'idle %':>7s}"]
    for name in OCCUPANCY_STAGES:
        if name not in busy:
            continue
        host, gpu = (x / steps / 1000 for x in busy[name])
        idle = 100 * (host - gpu) / host if host else float("nan")
        lines.append(f"{name:24s} {host:9.1f} {gpu:9.1f} {host - gpu:9.1f} {idle:7.1f}")
    return "\n".join(lines)


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    raise SystemExit(main())
