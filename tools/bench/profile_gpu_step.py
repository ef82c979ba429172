"""Profile the recipe's selection step against random at Llama-3.2-1B's shape: stage table, kernels, syncs.

    python tools/bench/profile_gpu_step.py                     # on a GPU: S = 2048, 8 rows, r = 2, t = 64
    python tools/bench/profile_gpu_step.py --trace-dir /tmp/tr # also a Chrome trace of each arm's profiled steps
    python tools/bench/profile_gpu_step.py --smoke             # a CPU run of the path at S = 256 (not a measurement)

Four arms, built and profiled one after the other (each one `fit()` of 4 warm-up steps, `--steps`
profiled and one more, so that every profiled step is a steady one): random, partitionsel with 64-token
windows at random positions (eager scoring pass), the same with `features.compile_forward: true`, and
the same with `select_ahead: true` (its selection for the next step runs inside the training stage,
under `selection/ahead`); amp_bf16, the 1B recipe's optimizer (torch's AdamW) and 4 loader workers in
all four.
For each: wall milliseconds a step under the profiler, the GPU time and count of its kernels, the
stage table of `tools/bench/profile_step.py` (host milliseconds a step: selection, features, solve, train,
the rest), on CUDA how long the GPU was busy and idle within the host ranges of the step, the selection,
its features and solve, and the training (is the selection's host work hidden behind GPU work?), and
for the partitionsel arms the busiest ops by host and by GPU time and the host reads
(`aten::item`, stream synchronisations). docs/results/bench_gpu.md quotes an H200 run of its first
form (no loader workers).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tools"), str(ROOT)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="profiled steps per arm (default: 4)")
    parser.add_argument("--trace-dir", type=Path, default=None, help="write each arm's Chrome trace here")
    parser.add_argument("--smoke", action="store_true", help="CPU, S = 256, 1 profiled step: a test of the path")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1 (got {args.steps})")

    import profile_step as ps
    import torch
    import window_cost as wc
    from bench_step import LLAMA_1B
    from stepping import prepare_for_stepping
    from torch.profiler import ProfilerActivity, profile, record_function

    import train
    from pipeline.config import load_config

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        parser.error("no CUDA device: run it on a GPU, or --smoke for the CPU path")
    S = 2048 if cuda else 256
    steps = args.steps if cuda else 1
    root = Path(tempfile.mkdtemp(prefix="profile_gpu_step_"))
    shards = root / "shards"
    if wc.write_long_shards(root / "corpus", shards, S):
        raise RuntimeError("sharding the sample corpus failed")
    sel = "algorithms.data_selection"
    arms = {
        "random": [f"{sel}.strategy=random"],
        "partitionsel": [f"{sel}.strategy=partitionsel"],
        "partitionsel+compiled": [f"{sel}.strategy=partitionsel", f"{sel}.features.compile_forward=true"],
        "partitionsel+ahead": [f"{sel}.strategy=partitionsel", f"{sel}.select_ahead=true"],
    }
    window = [f"{sel}.features.score_window=64", f"{sel}.features.score_window_position=random"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name, extra in arms.items():
        overrides = [
            f"variables.shard_dir={shards}", f"variables.max_seq_len={S}", f"save_folder={root / name}",
            "max_duration=20ba", "python_log_level=error", "console_log_interval=1000ba",
            f"{sel}.oversampling=2", "global_train_batch_size=8", "optimizer.name=adamw", "optimizer.weight_decay=0.1",
            # the recipe's loader prefetches in workers (it has 8); on the step's thread the pool's loading is the step's
            "train_loader.num_workers=4", "train_loader.persistent_workers=true",
            *(["device=gpu", "precision=amp_bf16", *wc.llama_1b_overrides(LLAMA_1B)] if cuda else ["device=cpu", "precision=fp32"]),
            *extra, *(window if name != "random" else []),
        ]
        trainer = train.build_trainer(load_config(wc.LONG_YAML, overrides))
        prepare_for_stepping(trainer)
        ps._instrument(trainer)
        prof = profile(activities=activities)
        profiled = _ProfiledSteps(prof, first=4 if cuda else 1, steps=steps, cuda=cuda, record_function=record_function)
        trainer.state.callbacks.append(profiled.callback)
        trainer.fit(duration=f"{profiled.first + steps + 1}ba")  # the last step makes the profiled last one's ahead
        _print_profile(name, prof, profiled.wall_ms / steps, steps, cuda)
        if args.trace_dir is not None:
            args.trace_dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(args.trace_dir / f"{name}.json"))
        trainer.close()
        del trainer
    return 0


class _ProfiledSteps:
    """A Composer callback: the profiler runs over batches `first` to `first + steps - 1` of one fit, each in a
    `step` range from asking the loader for it to its end, and `wall_ms` is their wall time."""

    def __init__(self, prof, *, first: int, steps: int, cuda: bool, record_function) -> None:
        from composer.core import Callback

        self.prof, self.first, self.steps, self.cuda = prof, first, steps, cuda
        self.wall_ms, self._t0, self._range = 0.0, 0.0, None
        outer = self

        class Window(Callback):  # a Callback subclass built here: Composer loads only when the tool runs
            def before_dataloader(self, state, logger) -> None:
                outer._begin(int(state.timestamp.batch), record_function)

            def batch_end(self, state, logger) -> None:
                outer._end(int(state.timestamp.batch))

        self.callback = Window()

    def _begin(self, batch: int, record_function) -> None:
        if not self.first <= batch < self.first + self.steps:
            return
        if batch == self.first:
            self._sync()
            self.prof.start()
            self._t0 = time.perf_counter()
        self._range = record_function("step")
        self._range.__enter__()

    def _end(self, batch: int) -> None:  # the timestamp has counted the batch by BATCH_END
        if self._range is None:
            return
        self._range.__exit__(None, None, None)
        self._range = None
        if batch == self.first + self.steps:
            self._sync()
            self.wall_ms = (time.perf_counter() - self._t0) * 1000
            self.prof.stop()

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()


def _print_profile(name: str, prof, wall: float, steps: int, cuda: bool) -> None:
    """One arm's profile: its time a step, the GPU's events, the step's stages and (but random) the busiest ops."""
    import profile_step as ps
    from step_audit import device_work

    print(f"\n===== {name}: {wall:.1f} ms a step (profiled, {steps} steps) =====")
    if cuda:
        kernels = device_work(prof.events())
        print(f"GPU: {sum(e.device_time for e in kernels) / 1000 / steps:.1f} ms of device events a step, "
              f"{len(kernels) / steps:.0f} events a step")
    print(ps.format_stages(ps._stage_totals(prof.events()), steps))
    if cuda:  # how long the GPU idled while each stage's host work ran (docs/results/bench_gpu.md: Composer drains it)
        print(ps.format_occupancy(ps.gpu_busy_by_stage(prof.events()), steps))
    if name != "random":
        averages = prof.key_averages()
        print(averages.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
        if cuda:
            print(averages.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        for e in averages:
            if "synchron" in e.key.lower() or e.key in ("aten::item", "Command Buffer Full"):
                print(f"host wait: {e.key} {e.count / steps:.0f} a step, {e.cpu_time_total / 1000 / steps:.1f} ms a step")


if __name__ == "__main__":
    raise SystemExit(main())
