"""Benchmark: training-step time of selection strategies against feature extraction alone.

Example:
    python tools/bench_step.py                  # tiny config, r = 2 and r = 8, about 5 minutes on 2 cores
    python tools/bench_step.py --steps 20 --ratios 2,4,8
    python tools/bench_step.py --device cuda    # on a GPU, in amp_bf16 as a real run

For each oversampling ratio r, side by side in one run, on the tiny config (yamls/testing/
tiny_dolma.yaml, kappa 16 sequences of 128 tokens): the median step time of partitionsel, greats,
random and none (a real Trainer, data loading to optimizer step), the no-grad forward of the pool,
and the feature extraction of the pool and validation batch measured alone with the same model.
Target: partitionsel's step time minus random's is at most 1.15x the feature extraction alone,
i.e. solving, exchanging and bookkeeping add at most 15% on top of the features.

Memory: the peak the scoring pass (pool and validation features, in the run's precision context
and chunks of `chunk_size: auto`, the run's microbatch) adds over the trained model, optimizer
state included, next to the peak of one training microbatch of the same size (forward and
backward, the outputs held through the backward as Composer's trainer holds them). Target: scoring peak <= training peak. On CUDA torch.cuda.max_memory_allocated; on CPU
the rise of the peak RSS (VmHWM), with large allocations served by mmap so freed memory leaves
the RSS (the script re-executes itself with MALLOC_MMAP_THRESHOLD_ set; bench_features.py's method).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

# torch, Composer and train.py load after argument parsing (in the functions), so --help is fast.
if TYPE_CHECKING:
    from composer.core import State
    from composer.loggers import Logger

    from composer_algos.selection_algorithm import DataSelection

STRATEGIES = ("partitionsel", "greats", "random", "none")


def make_step_timer():
    """A Composer callback timing each step: from asking the loader for a batch to the end of the optimizer step."""
    from composer.core import Callback

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._t0 = 0.0

        def before_dataloader(self, state: State, logger: Logger) -> None:
            self._t0 = time.perf_counter()

        def batch_end(self, state: State, logger: Logger) -> None:
            self.times.append(time.perf_counter() - self._t0)

    return StepTimer()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", default="2,8", help="oversampling ratios r (default: 2,8)")
    parser.add_argument("--steps", type=int, default=15, help="steps per run; the first 3 are warm-up (default: 15)")
    parser.add_argument("--repeats", type=int, default=10, help="repeats of the standalone timings (default: 10)")
    parser.add_argument("--yaml", type=Path, default=REPO / "yamls" / "testing" / "tiny_dolma.yaml")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's; 1 is steadier on a busy machine)"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cpu (fp32) or cuda (amp_bf16, the recipes' precision) (default: cpu)",
    )
    args = parser.parse_args(argv)
    import shard as shard_tool
    import torch
    from sample_corpus import write_sample_corpus

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ratios = [float(r) for r in args.ratios.split(",")]
    if args.steps < 5:
        parser.error("--steps must be at least 5 (3 warm-up steps are dropped)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine; use --device cpu")

    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        root = Path(tmp)
        write_sample_corpus(root / "corpus", seed=0, scale=1.0)
        shards = root / "shards"
        rc = shard_tool.main(
            ["dolma", str(root / "corpus" / "dolma" / "documents"), "--out", str(shards),
             "--max-seq-len", "128", "--val-count", "16", "--no-progress"]
        )
        if rc:
            return rc
        where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
        print(f"torch {torch.__version__}, {args.device} ({where}); {args.steps} steps per run\n")
        rows = []
        for r in ratios:
            rows.append(
                bench_ratio(args.yaml, shards, root / f"runs-r{r:g}", r, args.steps, args.repeats, args.device)
            )
        print_table(rows)
    return 0


def bench_ratio(yaml: Path, shards: Path, run_root: Path, r: float, steps: int, repeats: int, device: str) -> dict:
    import train
    from composer_algos.selection_algorithm import DataSelection
    from pipeline.config import load_config

    out: dict = {"r": r}
    algo = None
    for strategy in STRATEGIES:
        cfg = load_config(
            yaml,
            [
                f"variables.shard_dir={shards}",
                f"save_folder={run_root / strategy}",
                f"max_duration={steps}ba",
                "eval_loader=null",
                "python_log_level=error",
                "console_log_interval=1000ba",
                f"algorithms.data_selection.strategy={strategy}",
                f"algorithms.data_selection.oversampling={r}",
                *(["device=gpu", "precision=amp_bf16"] if device == "cuda" else ["device=cpu", "precision=fp32"]),
            ],
        )
        trainer = train.build_trainer(cfg)
        timer = make_step_timer()
        trainer.state.callbacks.append(timer)
        trainer.fit()
        out[strategy] = statistics.median(timer.times[3:])
        if strategy == "partitionsel":
            algo = next(a for a in trainer.state.algorithms if isinstance(a, DataSelection))
            out.update(standalone(trainer, algo, repeats))
            out.update(peak_memory(trainer, algo))
        trainer.close()
        print(f"  r={r:g} {strategy:13s} {1000 * out[strategy]:8.1f} ms/step", flush=True)
    return out


def standalone(trainer, algo: DataSelection, repeats: int) -> dict:
    """Time the pool's no-grad forward and the feature extraction alone, on a real pool batch."""
    import torch

    pool, val, context, chunk = _scoring_inputs(trainer, algo)
    hf = trainer.state.model.model
    optimizer = trainer.state.optimizers[0]
    device = next(hf.parameters()).device

    def forward() -> None:
        with torch.no_grad(), context():
            hf(input_ids=pool["input_ids"].to(device), attention_mask=pool["attention_mask"].to(device))

    def features() -> None:
        algo.extractor.compute(pool, val, step=1, optimizer=optimizer, precision_context=context, auto_chunk_size=chunk)

    def feature_path() -> None:  # what the algorithm pays: validation draw + features
        vb2 = algo.validation.batch_for_step(1)
        val2 = {k: vb2[k] for k in ("input_ids", "attention_mask", "labels")}
        algo.extractor.compute(pool, val2, step=1, optimizer=optimizer, precision_context=context, auto_chunk_size=chunk)

    was_training = hf.training
    hf.eval()
    out = {"forward": _median(forward, repeats)}
    hf.train(was_training)
    out["features"] = _median(features, repeats)
    out["features_with_val_draw"] = _median(feature_path, repeats)
    return out


def peak_memory(trainer, algo: DataSelection) -> dict:
    """Peak bytes added by scoring the pool, and by one training microbatch of the same size (forward + backward)."""
    from bench_features import _memory_peak, _memory_reset

    pool, val, context, chunk = _scoring_inputs(trainer, algo)
    hf = trainer.state.model.model
    device = next(hf.parameters()).device
    optimizer = trainer.state.optimizers[0]
    for p in hf.parameters():
        p.grad = None  # gradients are part of the training peak, not of the baseline

    base = _memory_reset(device)
    algo.extractor.compute(pool, val, step=1, optimizer=optimizer, precision_context=context, auto_chunk_size=chunk)
    _sync(device)
    score = _memory_peak(device) - base

    micro = {k: v[:chunk].to(device) for k, v in pool.items()}
    was_training = hf.training
    hf.train()
    base = _memory_reset(device)
    with context():
        # Held through the backward, as Composer's trainer holds state.outputs (logits included).
        outputs = hf(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"], labels=micro["labels"])
    outputs.loss.backward()
    del outputs
    _sync(device)
    train_peak = _memory_peak(device) - base
    hf.train(was_training)
    for p in hf.parameters():
        p.grad = None
    return {"microbatch": chunk, "score_peak": score, "train_peak": train_peak}


def _scoring_inputs(trainer, algo: DataSelection):
    """A real pool and validation batch, the run's precision context and the scoring chunk (as the algorithm uses them)."""
    from composer.core.precision import get_precision_context

    batch = next(iter(trainer.state.train_dataloader))
    pool = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    assert algo.validation is not None and algo.extractor is not None
    vb = algo.validation.batch_for_step(0)
    val = {k: vb[k] for k in ("input_ids", "attention_mask", "labels")}
    state = trainer.state

    def context():
        return get_precision_context(state.precision, state.precision_config)

    return pool, val, context, algo._auto_chunk_size(state)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _median(fn, repeats: int) -> float:
    import torch

    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(rows: list[dict]) -> None:
    print("\nmedian ms per step (r = pool / kappa):")
    head = ["r", "none", "random", "greats", "partitionsel", "fwd(pool)", "features", "(ps-rand)/feat", "ps/rand", "feat/fwd"]
    print("".join(f"{h:>15}" for h in head))
    for row in rows:
        extra = row["partitionsel"] - row["random"]
        cells = [
            f"{row['r']:g}",
            *(f"{1000 * row[k]:.1f}" for k in ("none", "random", "greats", "partitionsel", "forward", "features")),
            f"{extra / row['features']:.3f}",
            f"{row['partitionsel'] / row['random']:.2f}",
            f"{row['features'] / row['forward']:.2f}",
        ]
        print("".join(f"{c:>15}" for c in cells))
    worst = max((r["partitionsel"] - r["random"]) / r["features"] for r in rows)
    verdict = "PASS" if worst <= 1.15 else "FAIL"
    print(f"\ntarget (partitionsel - random) <= 1.15 x features alone: worst {worst:.3f} -> {verdict}")
    print("\npeak memory added over the trained model (scoring: pool + validation features, chunks of the microbatch):")
    for row in rows:
        ratio = row["score_peak"] / max(row["train_peak"], 1)
        print(
            f"  r={row['r']:g} microbatch {row['microbatch']}: scoring {row['score_peak'] / 2**20:.1f} MB, "
            f"training step {row['train_peak'] / 2**20:.1f} MB, scoring/training {ratio:.2f} "
            f"(target <= 1) -> {'PASS' if ratio <= 1 else 'FAIL'}"
        )


if __name__ == "__main__":
    # --help answers here, before the re-exec below (which would replace the calling process).
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and not {"-h", "--help"} & set(sys.argv[1:]):
        # glibc keeps freed heap memory for reuse; serving every allocation above 64 KiB by mmap
        # makes the RSS track live tensors, so the CPU peak-memory line measures something.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)
    raise SystemExit(main())
