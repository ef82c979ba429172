"""Data selection in your own Composer script: a Hugging Face model, your own Streaming dataset, one import.

Example:
    python examples/drop_in.py --out /tmp/drop_in --steps 20

The script writes a small two-domain corpus as MDS shards with Streaming's `MDSWriter` (a token
column and a `domain_id` column), reads it back with a plain `StreamingDataset`, builds a tiny
Llama from a config (offline; tokenizer from `assets/tokenizer`) and trains it with
`DataSelection`: the loader delivers `oversampling` x 8 examples a step and PartitionSel keeps 8,
guided by a few held-out batches. Nothing from `train.py` or the yamls is used.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np
import torch
from composer import Trainer
from composer.models import HuggingFaceModel
from streaming import MDSWriter, StreamingDataset
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from anywhere without installing the package

from composer_algos.data_selection import DataSelection  # noqa: E402  (the one import selection needs)

SEQ_LEN = 32
DOMAINS = ("arithmetic", "animals")


def make_text(domain: int, rng: random.Random) -> str:
    """One synthetic document of the given domain."""
    if domain == 0:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"{a} plus {b} equals {a + b}. {b} minus {a} equals {b - a}."
    animal = rng.choice(["cat", "dog", "horse", "otter", "heron", "fox"])
    place = rng.choice(["river", "field", "barn", "forest", "garden"])
    return f"The {animal} sleeps by the {place}. A {animal} likes the quiet {place} at night."


def write_shards(out: Path, tokenizer, n: int, seed: int) -> None:
    """`n` tokenized examples, alternating domains, as MDS shards with a domain id column."""
    rng = random.Random(seed)
    columns = {"input_ids": "ndarray:int32", "domain_id": "int"}
    with MDSWriter(out=str(out), columns=columns, compression=None) as writer:
        for i in range(n):
            domain = i % len(DOMAINS)
            ids = tokenizer(make_text(domain, rng))["input_ids"][:SEQ_LEN]
            writer.write({"input_ids": np.asarray(ids, dtype=np.int32), "domain_id": domain})


def collate(samples, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to SEQ_LEN; labels ignore the padding; domain ids ride along (the model never sees them)."""
    input_ids = torch.full((len(samples), SEQ_LEN), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, s in enumerate(samples):
        ids = torch.as_tensor(s["input_ids"], dtype=torch.long)
        input_ids[row, : len(ids)] = ids
        mask[row, : len(ids)] = 1
    labels = input_ids.masked_fill(mask == 0, -100)
    domain_id = torch.tensor([int(s["domain_id"]) for s in samples], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "domain_id": domain_id}


def main(argv: list[str] | None = None) -> Trainer:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="working directory (shards and checkpoints-free run)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strategy", default="partitionsel")
    parser.add_argument("--oversampling", type=float, default=2.0)
    parser.add_argument("--batch-size", type=int, default=8, help="examples trained per step")
    args = parser.parse_args(argv)
    out = Path(args.out)
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(str(REPO / "assets" / "tokenizer"))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if not (out / "train" / "index.json").exists():
        write_shards(out / "train", tokenizer, n=512, seed=1)
        write_shards(out / "val", tokenizer, n=32, seed=2)

    pool = int(round(args.batch_size * args.oversampling))  # the loader delivers the candidate pool
    train_data = StreamingDataset(local=str(out / "train"), batch_size=pool, shuffle=True, shuffle_seed=3)
    train_loader = DataLoader(
        train_data, batch_size=pool, collate_fn=lambda s: collate(s, pad_id), drop_last=True
    )
    val_data = StreamingDataset(local=str(out / "val"), batch_size=4, shuffle=False)
    val_batches = list(DataLoader(val_data, batch_size=4, collate_fn=lambda s: collate(s, pad_id)))

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
    )
    model = HuggingFaceModel(LlamaForCausalLM(config), tokenizer=tokenizer, use_logits=True)
    selection = DataSelection(
        strategy=args.strategy,
        oversampling=args.oversampling,
        validation=val_batches,
        features={"proj_dim": 32},
    )
    trainer = Trainer(
        model=model,
        train_dataloader=train_loader,
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
        max_duration=f"{args.steps}ba",
        algorithms=[selection],
        device="gpu" if torch.cuda.is_available() else "cpu",
        progress_bar=False,
        log_to_console=False,
        seed=0,
    )
    trainer.fit()
    if args.strategy == "none":  # no selection: every candidate trains
        print(f"trained {args.steps} steps on all {pool} candidates each (none: no selection)")
    else:
        print(f"trained {args.steps} steps on {args.batch_size} of {pool} candidates each ({args.strategy})")
    return trainer


if __name__ == "__main__":
    main()
