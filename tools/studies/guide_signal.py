"""How well the guiding validation gradient points along the held-out gradient, per validation target and draw.

For many validation draws (the steps a run would draw, `ValidationSource`), the full-model gradient
of each drawn example is computed, the guiding gradient is formed as the run would form its target
(`mean`: the plain mean of the rows; `domain_balanced`: every domain present weighted equally), and
its cosine with the held-out gradient is reported. The held-out gradient is the equal-weight mean
over the evaluated domains of each domain's mean-loss gradient on held-out validation examples
(the part of the val split that never guides; the reported metric weighs domains equally). Draws:
`plain` (uniform over the guide examples of every domain) and `stratified` (`validation.stratify`).
With --train-domains (a run restricted to some domains) the held-out gradient covers those domains
and the guiding draw is made from every domain (the old default) and from the trained ones (the
new default of `validation.domains`). `mean` and `domain_balanced` share each draw, so their
difference is paired. This is the guiding-vs-evaluation cosine of `tools/studies/lookahead.py`, over draws.

Example:
    python tools/studies/guide_signal.py --yaml yamls/study/dm_math.yaml --checkpoint runs/guide_signal/base/ep0-ba150-rank0.pt \\
        --draws 40 --out runs/guide_signal/dm_math
    python tools/studies/guide_signal.py --yaml yamls/study/dm_math.yaml --train-domains algebra,arithmetic --draws 40
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--yaml", required=True, help="the run's yaml (model, tokenizer, shards, validation settings)")
    p.add_argument("--checkpoint", help="Composer checkpoint of the model (default: the freshly initialised model)")
    p.add_argument("--draws", type=int, default=40, help="validation draws (steps 0..draws-1, default 40)")
    p.add_argument("--batch-size", type=int, help="validation examples per draw (default: the yaml's validation.batch_size)")
    p.add_argument("--eval-per-domain", type=int, default=32, help="held-out examples per domain (default 32)")
    p.add_argument("--train-domains", help="comma-separated domains of a restricted run (default: every domain)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    p.add_argument("--out", help="directory for summary.json and summary.md")
    p.add_argument("overrides", nargs="*", help="yaml overrides key=value")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.draws < 2:
        raise SystemExit(f"--draws must be >= 2 (an interval needs two), got {args.draws}")
    # tools/studies/lookahead.py: the model (and checkpoint) loaded as the one-step check does.
    from lookahead import load_model_and_optimizer

    from composer_algos.features.targets import unwrap_model
    from pipeline.collators import build_collator
    from pipeline.config import load_config
    from pipeline.dataset import DomainStreamingDataset
    from pipeline.holdout import DEFAULT_GUIDE_FRACTION
    from pipeline.tokenizer import load_tokenizer

    cfg = load_config(args.yaml, args.overrides)
    sel = dict(cfg.algorithms.get("data_selection") or {})
    val_cfg = dict(sel.get("validation") or {})
    batch_size = args.batch_size or int(val_cfg.get("batch_size", 4))
    guide_fraction = float(val_cfg.get("guide_fraction", DEFAULT_GUIDE_FRACTION))
    shard_dir = str(cfg.train_loader.dataset.shard_dir)
    val = DomainStreamingDataset(shard_dir=shard_dir, split="val", shuffle=False)
    names = list(val.domain_names)
    trained = args.train_domains.split(",") if args.train_domains else None
    unknown = [d for d in trained or [] if d not in names]
    if unknown:
        raise SystemExit(f"--train-domains: unknown domains {unknown}; the shards have {names}")

    model, _ = load_model_and_optimizer(cfg, args.checkpoint)
    hf = unwrap_model(model)
    hf.eval()
    params = [p for p in hf.parameters() if p.requires_grad]
    tokenizer = load_tokenizer(cfg.tokenizer_name)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    collate = build_collator(val.manifest.mode, pad_token_id=pad, max_seq_len=cfg.max_seq_len)

    evaluated = trained or [names[i] for i in sorted(set(val.stream_domain_ids))]
    g_eval = _held_out_gradient(hf, params, collate, val, names, evaluated, guide_fraction, args)
    rows = _guide_cosines(
        hf, params, g_eval, args, shard_dir=shard_dir, batch_size=batch_size, guide_fraction=guide_fraction,
        max_seq_len=cfg.max_seq_len, trained=trained,
    )
    summary = {
        "settings": {k: v for k, v in vars(args).items() if k != "overrides"}
        | {"overrides": args.overrides, "batch_size": batch_size, "evaluated_domains": evaluated},
        "cosine": rows,
    }
    text = _format(summary)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        (out / "summary.md").write_text(text + "\n")
        print(f"wrote {out}/summary.md and summary.json")
    return 0


def _held_out_gradient(
    hf, params: list, collate, val, names: list[str], evaluated: list[str], guide_fraction: float,
    args: argparse.Namespace,
):
    """The held-out gradient: each evaluated domain's mean-loss gradient, averaged with equal weights."""
    import torch

    from composer_algos.analysis.lookahead import _flat_grad
    from pipeline.holdout import dataset_guide_mask

    held = ~dataset_guide_mask(val, guide_fraction)
    gen = torch.Generator().manual_seed(args.seed)
    per_domain = []
    for s, did in enumerate(val.stream_domain_ids):
        if names[did] not in evaluated:
            continue
        start, n = int(val.sample_offset_per_stream[s]), int(val.samples_per_stream[s])
        ids = [start + i for i in range(n) if held[start + i]]
        pick = [ids[i] for i in torch.randperm(len(ids), generator=gen)[: args.eval_per_domain].tolist()]
        per_domain.append(_flat_grad(hf, params, collate([val[i] for i in pick]), None))
    return torch.stack(per_domain).mean(0)


def _guide_cosines(
    hf, params: list, g_eval, args: argparse.Namespace, *, shard_dir: str, batch_size: int, guide_fraction: float,
    max_seq_len: int, trained: list[str] | None,
) -> dict[str, dict]:
    """Per draw kind (plain, stratified; on the trained domains too): each target's cosine with `g_eval`."""
    import torch

    from composer_algos.analysis.lookahead import _flat_grad
    from composer_algos.data_selection.capacity_policy import domain_balanced_mean
    from composer_algos.data_selection.validation_source import ValidationSource

    variants = [("plain", False, None), ("stratified", True, None)]
    if trained is not None:
        variants += [("plain, trained domains", False, trained), ("stratified, trained domains", True, trained)]
    rows = {}
    for label, stratify, domains in variants:
        source = ValidationSource(
            shard_dir=shard_dir, batch_size=batch_size, seed=args.seed, stratify=stratify, domains=domains,
            guide_fraction=guide_fraction, max_seq_len=max_seq_len,
        )
        cos = {"mean": [], "domain_balanced": []}
        for step in range(args.draws):
            batch = source.batch_for_step(step)
            grads = torch.stack(
                [_flat_grad(hf, params, {k: v[i : i + 1] for k, v in batch.items()}, None) for i in range(batch_size)]
            )
            dom = batch["domain_id"]
            for target, g in (("mean", grads.mean(0)), ("domain_balanced", domain_balanced_mean(grads, dom))):
                cos[target].append(float(torch.nn.functional.cosine_similarity(g, g_eval, dim=0)))
        diffs = [b - m for b, m in zip(cos["domain_balanced"], cos["mean"])]
        rows[label] = {"mean": _interval(cos["mean"]), "domain_balanced": _interval(cos["domain_balanced"])}
        rows[label]["balanced_minus_mean"] = _interval(diffs)
    return rows


def _interval(values: list[float]) -> dict[str, float]:
    """Mean and 95% t interval (normal quantile 1.96 above 30 values; t table below)."""
    n = len(values)
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if n > 1 else 0.0
    t = _T95.get(n - 1, 1.96)
    half = t * sd / math.sqrt(n) if n > 1 else math.nan
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}


# Two-sided 95% quantiles of Student's t by degrees of freedom (above 30: 1.96 is within 4%).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 19: 2.093, 20: 2.086, 24: 2.064, 29: 2.045, 30: 2.042, 39: 2.023, 49: 2.010}


def _format(summary: dict) -> str:
    def cell(x: dict[str, float]) -> str:
        return f"{x['mean']:+.4f} [{x['low']:+.4f}, {x['high']:+.4f}]"

    s = summary["settings"]
    lines = [
        f"cosine of the guiding gradient with the held-out gradient ({s['draws']} draws of {s['batch_size']}, "
        f"held-out: equal-weight mean over {len(s['evaluated_domains'])} domains), mean [95% interval]",
        "",
        "| draw | target mean | target domain_balanced | balanced - mean (paired) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label, row in summary["cosine"].items():
        lines.append(f"| {label} | {cell(row['mean'])} | {cell(row['domain_balanced'])} | {cell(row['balanced_minus_mean'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
