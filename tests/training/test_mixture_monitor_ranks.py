"""MixtureMonitor on several ranks without domain names: every rank sizes its vectors the same."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from composer_algos.data_selection.mixture_monitor import MixtureMonitor
from tests.training.fake_ranks import ListLogger, ThreadRanks


def test_ranks_that_saw_different_ids_agree_on_the_domain_count(monkeypatch, tmp_path):
    # Rank 0's batch holds ids 0..2, rank 1's only 0..1: sized from its own batch, rank 1 all-reduced a
    # shorter vector than rank 0 (a shape mismatch, or a hang on a real backend).
    ranks = ThreadRanks(2, timeout_s=20)
    ranks.patch(monkeypatch)
    batches = [torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 0])]

    moved: list[int] = []

    class RunDevice:  # Composer's Device: the run's device, where NCCL needs collectives' tensors
        def tensor_to_device(self, t):
            moved.append(t.numel())
            return t

    def body(rank: int):
        monitor = MixtureMonitor(run_dir=str(tmp_path / f"r{rank}"))
        logger = ListLogger()
        state = SimpleNamespace(
            batch={"domain_id": batches[rank]}, timestamp=SimpleNamespace(batch=SimpleNamespace(value=0)),
            run_name="r", train_dataloader=None, device=RunDevice(),
        )
        monitor.after_dataloader(state, logger)
        monitor.close(state, logger)
        return monitor.domain_names, logger.metrics[-1]

    (names0, m0), (names1, m1) = ranks.run(body)
    assert names0 == names1 == ["domain_0", "domain_1", "domain_2"]
    # The mixture is the global one on every rank: ids 0, 1, 2 trained 3, 3 and 2 times of 8.
    assert m0 == m1
    assert [m0[f"data/mixture/domain_{i}"] for i in range(3)] == [3 / 8, 3 / 8, 2 / 8]
    # Both collectives of each rank went through the run's device (a CPU tensor fails under NCCL).
    assert sorted(moved) == [1, 1, 10, 10]
