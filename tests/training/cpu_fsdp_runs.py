"""Runs of train.py's trainer with Composer's FSDP on the CPU, in a process of their own (for tests).

Usage: python -m tests.training.cpu_fsdp_runs OUT.json YAML RUNS.json
       composer -n 2 --master_port P -m tests.training.cpu_fsdp_runs OUT.json YAML RUNS.json  (OUT.json.rank<r>)

RUNS.json maps a run name to its list of overrides; OUT.json gets, per run, the per-step
`selection/selected_hash` and `loss/train/total` (an in-memory logger is added), and `wrappers`: how
many FSDP units and activation-checkpoint wrappers the model ended with, and `sharding`, the units' strategies. Composer 0.32.1
cannot build FSDP without CUDA: composer/distributed/dist_strategy.py passes
`device_id=torch.cuda.current_device()` to FSDP unconditionally (the one call on the path of a run
whose parameters are not on the meta device). This process answers that call with the CPU, so
torch's FSDP1, which runs on CPU with gloo, wraps the model exactly as Composer configures it; on
one process Composer initialises a one-rank gloo group itself. Nothing else is changed. A process
of its own because the patch and Composer's process group must not outlive the runs.
"""

from __future__ import annotations

import json
import sys

import torch


def main(argv: list[str]) -> None:
    out_path, yaml_path, runs_path = argv
    torch.cuda.current_device = lambda: torch.device("cpu")  # see the module docstring
    torch.set_num_threads(1)
    from composer.loggers import InMemoryLogger

    import train
    from composer_algos.registry import load_run_config

    runs = json.loads(open(runs_path).read())
    results = {}
    for name, overrides in runs.items():
        trainer = train.build_trainer(load_run_config(yaml_path, [*overrides, "loggers.in_memory={}"]))
        trainer.fit()
        mem = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
        results[name] = {
            key: [float(v) for _, v in mem.data.get(key, [])] for key in ("selection/selected_hash", "loss/train/total")
        }
        # How Composer wrapped the model: FSDP units and activation-checkpoint wrappers, by class name.
        kinds = [type(m).__name__ for m in trainer.state.model.modules()]
        results[name]["wrappers"] = {k: kinds.count(k) for k in ("FullyShardedDataParallel", "CheckpointWrapper")}
        # The strategies the units ended with: Composer falls back from HYBRID_SHARD to FULL_SHARD, with only a
        # warning, when the mesh has one dimension.
        results[name]["sharding"] = sorted({m.sharding_strategy.name for m in trainer.state.model.modules()
                                            if type(m).__name__ == "FullyShardedDataParallel"})
        _write(out_path, results)  # before close: a two-rank FSDP run on the CPU crashed saving its last checkpoint
        trainer.close()


def _write(out_path: str, results: dict) -> None:
    from composer.utils import dist

    if dist.get_world_size() > 1:  # launched on several ranks (composer -n N -m ...): one file a rank
        out_path = f"{out_path}.rank{dist.get_global_rank()}"
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
