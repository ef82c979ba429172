"""The one-step check: from a checkpoint, does each strategy's subset lower the loss of examples that never guided it?

For seeded pools drawn from the training shards, every arm (a strategy with its feature settings)
selects kappa examples; one SGD step and one step of the run's optimizer (its state restored from the
checkpoint) are taken on the subset, and the drop of the mean per-example loss is measured on the
guiding validation examples and on independent held-out examples, against --n-random random subsets
with the same per-domain capacities. Also reported: the rank correlation of each arm's scores
<g_i, gbar> with exact full-model gradient scores (Adam-weighted and plain) and with its own
uncompressed features, and the cosine of the guiding and evaluation gradients.

Example:
    python tools/studies/lookahead.py --yaml yamls/testing/study_dm_math.yaml --checkpoint runs/base/ep0-ba100-rank0.pt \\
        --pools 60 --pool-size 32 --kappa 16 --n-random 20 \\
        --arm old=partitionsel,features.precondition=both,features.proj_dim=64 \\
        --arm new=partitionsel,features.precondition=pool,features.proj_dim=1024 \\
        --arm id=id --out runs/lookahead/ba100
    # any yaml key after the flags: python tools/studies/lookahead.py --yaml Y --checkpoint C -- optimizer.lr=1e-3

An arm is NAME=STRATEGY[,key=value...] with keys features.<extractor option>, options.<strategy
option>, weighted_loss, guide_size. Without --arm, the yaml's own data_selection settings are one arm.
Diagnostic strategies: oracle (top kappa within the capacities by the exact Adam-weighted score
against the guiding gradient), oracle_sgd (plain score), oracle_eval (against the evaluation set's
own gradient: an upper bound). The tool holds the pool's full per-example gradients (pool x params
floats): it is meant for small checkpoints.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--yaml", required=True, help="the run's yaml (model, tokenizer, shards, optimizer, selection)"
    )
    p.add_argument(
        "--checkpoint",
        help="Composer checkpoint to start from (model and optimizer state); "
        "without it, the freshly initialised model and an optimizer without state",
    )
    p.add_argument("--arm", action="append", default=[], help="NAME=STRATEGY[,key=value...] (repeatable)")
    p.add_argument("--pools", type=int, default=60, help="seeded pools (default 60)")
    p.add_argument("--pool-size", type=int, default=32, help="examples per pool (default 32)")
    p.add_argument("--kappa", type=int, default=16, help="examples selected per pool (default 16)")
    p.add_argument(
        "--n-random", type=int, default=20, help="random subsets per pool within the capacities (default 20)"
    )
    p.add_argument("--sgd-lr", type=float, default=1e-2, help="learning rate of the SGD step (default 1e-2)")
    p.add_argument(
        "--guide-size",
        type=int,
        default=4,
        help="guiding validation examples (arms take the first guide_size of them; default 4)",
    )
    p.add_argument("--eval-size", type=int, default=200, help="held-out evaluation examples (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--step-kinds",
        default="sgd,opt",
        help="one-step updates to measure: sgd, opt or both (default sgd,opt); each costs a loss "
        "evaluation of the evaluation and guide sets per subset",
    )
    p.add_argument("--out", help="write summary.json, summary.md and selected.json here")
    p.add_argument("overrides", nargs="*", help="yaml key=value overrides")
    return p


def parse_arm(text: str) -> dict[str, Any]:
    """`NAME=STRATEGY[,key=value...]` -> Arm keyword arguments (values parsed as yaml scalars).

    Raises:
        ValueError: a malformed arm or an unknown key, naming it.
    """
    import yaml

    if "=" not in text:
        raise ValueError(f"--arm {text!r}: expected NAME=STRATEGY[,key=value...]")
    name, rest = text.split("=", 1)
    strategy, *pairs = rest.split(",")
    out: dict[str, Any] = {"name": name, "strategy": strategy, "features": {}, "options": {}}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--arm {text!r}: {pair!r} is not key=value")
        key, value = pair.split("=", 1)
        parsed = yaml.safe_load(value)
        if key.startswith("features."):
            out["features"][key[len("features.") :]] = parsed
        elif key.startswith("options."):
            out["options"][key[len("options.") :]] = parsed
        elif key in ("weighted_loss", "guide_size"):
            out[key] = parsed
        else:
            raise ValueError(
                f"--arm {text!r}: unknown key {key!r}; allowed: features.<option>, options.<option>, "
                "weighted_loss, guide_size"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    arm_kwargs = [parse_arm(a) for a in args.arm]  # errors before anything heavy
    step_kinds = [s for s in args.step_kinds.split(",") if s]
    if not step_kinds or any(s not in ("sgd", "opt") for s in step_kinds):
        raise SystemExit(f"--step-kinds: expected sgd, opt or sgd,opt, got {args.step_kinds!r}")

    import torch

    from composer_algos.analysis.lookahead import ORACLES, Arm, format_summary, run_lookahead, summarize
    from composer_algos.selection import STRATEGIES
    from pipeline.config import load_config

    cfg = load_config(args.yaml, args.overrides)
    sel = dict(cfg.algorithms.get("data_selection") or {})
    if not arm_kwargs:
        arm_kwargs = [
            {
                "name": sel.get("strategy", "partitionsel"),
                "strategy": sel.get("strategy", "partitionsel"),
                "features": dict(sel.get("features") or {}),
                "options": dict(
                    (sel.get("strategy_options") or {}).get(sel.get("strategy", "partitionsel"), {})
                ),
                "weighted_loss": bool(sel.get("weighted_loss", False)),
            }
        ]
    unknown = [
        a["strategy"] for a in arm_kwargs if a["strategy"] not in STRATEGIES and a["strategy"] not in ORACLES
    ]
    if unknown:
        raise SystemExit(
            f"--arm: unknown strategies {unknown}; allowed: {sorted(STRATEGIES) + sorted(ORACLES)}"
        )
    base_features = dict(sel.get("features") or {})
    arms = [Arm(**{**a, "features": {**base_features, **a["features"]}}) for a in arm_kwargs]

    model, optimizer = load_model_and_optimizer(cfg, args.checkpoint)
    pools, guide, evalset, num_domains = _data(cfg, args)
    t0 = time.perf_counter()
    from tqdm import tqdm

    bar = tqdm(total=len(pools), desc="pools", unit="pool")
    result = run_lookahead(
        model,
        optimizer,
        pools,
        guide,
        evalset,
        arms,
        kappa=args.kappa,
        num_domains=num_domains,
        n_random=args.n_random,
        sgd_lr=args.sgd_lr,
        seed=args.seed,
        progress=lambda _: bar.update(1),
        steps=step_kinds,
    )
    bar.close()
    summary = summarize(result)
    summary["settings"] = {k: v for k, v in vars(args).items() if k != "overrides"} | {
        "overrides": args.overrides,
        "lr": float(optimizer.param_groups[0]["lr"]),
        "seconds": time.perf_counter() - t0,
    }
    text = format_summary(summary)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        (out / "summary.md").write_text(text + "\n")
        (out / "selected.json").write_text(json.dumps(result.selected))
        print(f"wrote {out}/summary.md, summary.json, selected.json")
    del torch
    return 0


def load_model_and_optimizer(cfg, checkpoint: str | None):
    """The model and its optimizer, with the checkpoint's weights and optimizer state when given."""
    import dataclasses

    from composer import Trainer

    from composer_algos.builders import build_optimizer
    from composer_algos.models.causal_lm import build_causal_lm
    from pipeline.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer_name)
    model = build_causal_lm(tokenizer=tokenizer, **dataclasses.asdict(cfg.model))
    optimizer = build_optimizer(
        [p for p in model.parameters() if p.requires_grad], **dataclasses.asdict(cfg.optimizer)
    )
    if checkpoint is None:
        return model, optimizer
    # The Trainer restores weights and optimizer state exactly as a resumed run would (any format
    # Composer writes); nothing is trained.
    trainer = Trainer(
        model=model,
        optimizers=optimizer,
        load_path=checkpoint,
        max_duration="1ba",
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        loggers=[],
        python_log_level=None,
    )
    return trainer.state.model, trainer.state.optimizers[0]


def _data(cfg, args):
    """Seeded pools from the train split; guiding examples from the val split, held-out ones where the evaluators read."""
    import torch

    from pipeline.collators import build_collator
    from pipeline.dataset import DomainStreamingDataset
    from pipeline.holdout import DEFAULT_GUIDE_FRACTION, dataset_guide_mask, heldout_subset
    from pipeline.tokenizer import load_tokenizer

    shard_dir = cfg.train_loader.dataset.shard_dir
    tokenizer = load_tokenizer(cfg.tokenizer_name)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train = DomainStreamingDataset(shard_dir=shard_dir, split="train", shuffle=False)
    val = DomainStreamingDataset(shard_dir=shard_dir, split="val", shuffle=False)
    collate = build_collator(train.manifest.mode, pad_token_id=pad, max_seq_len=cfg.max_seq_len)
    gen = torch.Generator().manual_seed(args.seed)
    pools = []
    for _ in range(args.pools):
        idx = torch.randperm(int(train.num_samples), generator=gen)[: args.pool_size].tolist()
        pools.append(collate([train[i] for i in idx]))
    # The run's own partition of the val split: guiding examples for the arms, held-out ones for
    # the evaluation, read where the run's per-domain evaluators read them (eval_loader: its
    # shards, split and guide_fraction; without one, the part of the val split that never guides).
    sel = cfg.algorithms.get("data_selection") or {}
    mask = dataset_guide_mask(
        val, float((sel.get("validation") or {}).get("guide_fraction", DEFAULT_GUIDE_FRACTION))
    )
    guide_ids = [int(i) for i in mask.nonzero()[0]]
    ev = cfg.eval_loader
    if ev is None:
        held, eval_ids = val, [int(i) for i in (~mask).nonzero()[0]]
    else:
        same = Path(ev.shard_dir or shard_dir).resolve() == Path(shard_dir).resolve() and ev.split == "val"
        held = val if same else DomainStreamingDataset(shard_dir=ev.shard_dir, split=ev.split, shuffle=False)
        eval_ids = [int(i) for i in heldout_subset(held, ev.guide_fraction, what="lookahead evaluation").indices]
    perm = torch.randperm(len(guide_ids), generator=gen).tolist()
    guide = collate([val[guide_ids[i]] for i in perm[: args.guide_size]])
    perm = torch.randperm(len(eval_ids), generator=gen).tolist()
    evalset = collate([held[eval_ids[i]] for i in perm[: args.eval_size]])
    return pools, guide, evalset, len(train.domain_names)


if __name__ == "__main__":
    raise SystemExit(main())
