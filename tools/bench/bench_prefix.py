"""Time a PartitionSel fine-tuning step with and without `model.reuse_scoring_prefix`, side by side.

With LoRA in the top blocks, the training forward of the selected rows runs the frozen blocks below
the adapters again on rows the selection's scoring pass has just run them on. `model.reuse_scoring_prefix:
true` hands the scoring pass's output on instead (composer_algos/models/scoring_prefix.py). This builds the
yaml's run twice (the same seed: the same weights, pools and selections), steps the two trainers in
turn one batch at a time (data loading to optimizer step, selection included), and prints each one's
median step time on the wall clock and on the process's CPU clock (what the fine-tuning study prices
steps by), their ratio, and the largest relative difference of their training losses (rounding: the
frozen blocks' output comes from a forward over a batch of another size).

Example:
    OMP_NUM_THREADS=1 python tools/bench/bench_prefix.py yamls/smollm2-135m_dm_math.yaml \\
        variables.shard_dir=runs/finetune/shards --steps 6
    python tools/bench/bench_prefix.py yamls/testing/tiny_finetune.yaml variables.shard_dir=... \\
        model.lora.top_blocks=1 --steps 2                                            # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WARMUP = 1  # untimed steps of each run (the first builds the extractor and the optimizer's state)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("yaml", type=Path, help="a fine-tuning run yaml with model.lora.top_blocks (given or overridden)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the yaml")
    p.add_argument("--steps", type=int, default=6, help=f"timed steps of each run (default 6, after {WARMUP} untimed)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tools"))
    import torch
    from composer.core import Callback
    from stepping import prepare_for_stepping

    import train
    from composer_algos.registry import load_run_config

    class Clocks(Callback):
        """Wall and process CPU seconds from asking the loader for a batch to the end of the optimizer step."""

        def __init__(self) -> None:
            self.wall: list[float] = []
            self.cpu: list[float] = []
            self.loss: list[float] = []

        def before_dataloader(self, state, logger) -> None:
            self._t = (time.perf_counter(), time.process_time())

        def after_train_batch(self, state, logger) -> None:
            self.wall.append(time.perf_counter() - self._t[0])
            self.cpu.append(time.process_time() - self._t[1])
            loss = state.loss["total"] if isinstance(state.loss, dict) else state.loss
            self.loss.append(float(loss))

    # A step's time only: no evaluation (each one-batch fit would end with one), no answer generation.
    no_answers = ["~callbacks.answer_accuracy"] if "answer_accuracy" in load_run_config(args.yaml, args.overrides).callbacks else []
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("every block", ["model.reuse_scoring_prefix=false"]),
                            ("reuse_scoring_prefix", ["model.reuse_scoring_prefix=true"])):
            cfg = load_run_config(args.yaml, [
                *args.overrides, f"save_folder={Path(tmp) / name.replace(' ', '_')}", f"max_duration={args.steps + WARMUP}ba",
                "eval_interval=1000000ba", "eval_loader=null", *no_answers, "algorithms.data_selection.strategy=partitionsel",
                "python_log_level=error",
                *extra,
            ])
            if cfg.model.lora is None or cfg.model.lora.top_blocks is None:
                p.error("the run needs model.lora.top_blocks (the frozen blocks lie below them)")
            trainer = train.build_trainer(cfg)
            prepare_for_stepping(trainer)
            clocks = Clocks()
            trainer.state.callbacks.append(clocks)
            runs[name] = (trainer, clocks)
        # Each run keeps its own stream of the global generator (LoRA's dropout draws from it), as if run alone.
        rng = dict.fromkeys(runs, torch.get_rng_state())
        for _ in range(args.steps + WARMUP):
            for name, (trainer, _clocks) in runs.items():
                torch.set_rng_state(rng[name])
                trainer.fit(duration="1ba")
                rng[name] = torch.get_rng_state()
        handed = runs["reuse_scoring_prefix"][0].state.model.scoring_prefix.handed_on
        for trainer, _clocks in runs.values():
            trainer.close()
    (_, base_c), (_, reuse_c) = runs["every block"], runs["reuse_scoring_prefix"]
    print(f"{args.yaml.name}: {args.steps} timed steps each (after {WARMUP}), interleaved; medians:")
    print(f"{'':<22}{'wall s':>10}{'cpu s':>10}")
    for name, (_t, c) in runs.items():
        print(f"{name:<22}{statistics.median(c.wall[WARMUP:]):>10.3f}{statistics.median(c.cpu[WARMUP:]):>10.3f}")
    wall = statistics.median(reuse_c.wall[WARMUP:]) / statistics.median(base_c.wall[WARMUP:])
    cpu = statistics.median(reuse_c.cpu[WARMUP:]) / statistics.median(base_c.cpu[WARMUP:])
    print(f"reuse / every block: wall {wall:.3f}, cpu {cpu:.3f}; training forwards that skipped the frozen blocks: "
          f"{handed} of {args.steps + WARMUP}")
    gap = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(reuse_c.loss, base_c.loss))
    print(f"largest relative training-loss difference: {gap:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
