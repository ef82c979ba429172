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
    use_leader_shm_prefix()
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


def use_leader_shm_prefix() -> None:
    """Make every rank of a node use its local leader's Streaming shared-memory prefix.

    Streaming 0.13's `get_shm_prefix` (streaming/base/shared/prefix.py:213-216) has *every* rank scan /dev/shm and
    the temp dir for the first free prefix, before any barrier, and a non-leader then opens `<its own
    number>_locals` (l. 232-239). Another process on the machine that registers, leaves or frees a prefix between
    the leader's scan and a non-leader's (another xdist worker's dataset, a finished run's `<k>_barrier_filelock`,
    which filelock never unlinks, a cleaner) makes them disagree: "prefix=0 was not registered by local leader".
    Here only the leader scans and registers (under pipeline.dataset's machine-wide lock, which it holds); the
    other ranks take its number from an all-gather. Without an initialised process group, Streaming's own.
    """
    import streaming.base.dataset as sd
    from streaming.base.constant import LOCALS, SHM_TO_CLEAN
    from streaming.base.shared import SharedMemory
    from streaming.base.shared import prefix as sp
    from torch import distributed as tdist

    original = sp.get_shm_prefix

    def get_shm_prefix(streams_local, streams_remote, world, retry: int = 100):
        if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
            return original(streams_local, streams_remote, world, retry)
        sp._check_self(streams_local)
        prefix_int, shm, failure = -1, None, None
        if world.is_local_leader:
            try:
                prefix_int = max(sp._check_and_find_retrying(streams_local, streams_remote, shm_name=n, retry=retry)
                                 for n in SHM_TO_CLEAN)
                data = sp._pack_locals(streams_local, prefix_int)
                shm = SharedMemory(sp._get_path(prefix_int, LOCALS), True, len(data))
                shm.buf[:len(data)] = data
            except Exception as e:  # still join the all-gather, so the other ranks fail instead of hanging
                prefix_int, failure = -2, e
        device = "cpu"
        if tdist.get_backend() == "nccl":
            device = torch.device("cuda", world.rank_of_node % torch.cuda.device_count())
        mine = torch.tensor([world.node, prefix_int], dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(tdist.get_world_size())]
        tdist.all_gather(every, mine)
        if failure is not None:
            raise failure
        leader = [int(t[1]) for t in every if int(t[0]) == world.node and int(t[1]) != -1]
        if len(leader) != 1 or leader[0] < 0:
            raise RuntimeError(f"the local leader of node {world.node} could not register a shared memory prefix")
        prefix_int = leader[0]
        if not world.is_local_leader:
            shm = SharedMemory(sp._get_path(prefix_int, LOCALS), False)
            their_locals, their_prefix_int = sp._unpack_locals(bytes(shm.buf))
            if streams_local != their_locals or prefix_int != their_prefix_int:
                raise RuntimeError(f"shared memory prefix {prefix_int}: local leader has {their_locals} and "
                                   f"{their_prefix_int}, this rank {streams_local}")
        return prefix_int, shm

    sd.get_shm_prefix = get_shm_prefix  # the name streaming/base/dataset.py imported (l. 35-36) and calls (l. 541)


def _write(out_path: str, results: dict) -> None:
    from composer.utils import dist

    if dist.get_world_size() > 1:  # launched on several ranks (composer -n N -m ...): one file a rank
        out_path = f"{out_path}.rank{dist.get_global_rank()}"
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
