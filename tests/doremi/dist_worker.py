"""Worker for test_distributed.py: a short DoReMi proxy run, one process or under `composer -n 2`.

    python tests/doremi/dist_worker.py OUT_JSON --device-batch 12 --microbatch 12
    composer -n 2 tests/doremi/dist_worker.py OUT_JSON --device-batch 6 --microbatch 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from composer import Trainer
from composer.models import HuggingFaceModel
from composer.utils import dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from composer_algos.doremi import DoReMi  # noqa: E402
from tests.common.models import tiny_llama  # noqa: E402

NAMES = ["code", "spam", "wiki"]


def _examples(n: int = 48, seq: int = 12) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(0, 128, (seq,), generator=gen)
        labels = ids.clone()
        labels[: int(torch.randint(0, 4, (1,), generator=gen))] = -100
        # Uneven domains so the ranks see different per-domain token counts.
        dom = 0 if i % 5 in (0, 1, 2) else (1 if i % 5 == 3 else 2)
        out.append({"input_ids": ids, "attention_mask": torch.ones(seq, dtype=torch.long), "labels": labels,
                    "domain_id": torch.tensor(dom)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--device-batch", type=int, required=True)
    parser.add_argument("--microbatch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    data = _examples()
    loader = DataLoader(data, batch_size=args.device_batch, sampler=dist.get_sampler(data, shuffle=False))
    model = HuggingFaceModel(tiny_llama(seed=0), use_logits=True)
    algo = DoReMi(reference=tiny_llama(seed=1), domain_names=NAMES, run_dir=str(args.out.parent / "run"))
    trainer = Trainer(model=model, train_dataloader=loader, optimizers=torch.optim.SGD(model.parameters(), lr=0.5),
                      max_duration=f"{args.steps}ba", algorithms=[algo], device="cpu",
                      device_train_microbatch_size=args.microbatch, seed=0, progress_bar=False, log_to_console=False)
    trainer.fit()
    if dist.get_global_rank() == 0:
        first = next(model.parameters()).detach()
        args.out.write_text(json.dumps({
            "alpha": algo.alpha_C.cpu().tolist(),
            "lambda": algo.last_lam_C.cpu().tolist(),
            "average": algo.averaged_weights().cpu().tolist(),
            "param_sum": float(sum(p.detach().double().sum() for p in model.parameters())),
            "first_param": first.flatten()[:16].tolist(),
            "world_size": dist.get_world_size(),
        }))
    trainer.close()


if __name__ == "__main__":
    main()
