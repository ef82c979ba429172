"""Time a fine-tuning step with the vocabulary projection at every position against only at the targets.

`model.logits_at: targets` projects onto the vocabulary only where the next token has a loss (the
answer, with an answer-only loss), instead of at every position of prompt and answer. This bench
builds the yaml's model twice (the same weights), draws batches from its shards, and times a
training step (forward, loss, backward), an evaluation forward and selection's scoring pass (the
gradient features' forward and truncated backward) of each mode, interleaved, in one process. It prints the median of each, their ratio, and the largest loss difference between the
two (they compute the same loss).

Example:
    OMP_NUM_THREADS=1 python tools/bench/bench_logits_at.py yamls/smollm2-135m_dm_math.yaml --steps 6
    python tools/bench/bench_logits_at.py yamls/testing/tiny_finetune.yaml variables.shard_dir=... --steps 2   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# train: forward, loss and backward of the batch; eval: an evaluation forward; score: selection's scoring
# pass over the batch (the features' forward and truncated backward, last block's targets).
KINDS = ("train", "eval", "score")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("yaml", type=Path, help="a fine-tuning run yaml (its model, shards and batch size)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the yaml")
    p.add_argument("--steps", type=int, default=6, help="timed steps of each mode (default 6, after one untimed)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    sys.path.insert(0, str(REPO))
    import dataclasses

    import torch

    from composer_algos.features.targets import choose_cut_module, resolve_targets, unwrap_model
    from composer_algos.models.causal_lm import build_causal_lm
    from composer_algos.registry import load_run_config
    from pipeline.loaders import build_train_dataloader
    from pipeline.tokenizer import load_tokenizer

    cfg = load_run_config(args.yaml, args.overrides)
    tok = load_tokenizer(cfg.tokenizer_name)
    kwargs = dataclasses.asdict(cfg.model)
    models = {}
    for mode in ("all", "targets"):
        torch.manual_seed(0)
        models[mode] = build_causal_lm(tokenizer=tok, **{**kwargs, "logits_at": mode})
    models["targets"].load_state_dict(models["all"].state_dict())
    loader = build_train_dataloader(
        shard_dir=cfg.train_loader.dataset.shard_dir, device_batch_size=cfg.global_train_batch_size,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        max_seq_len=cfg.max_seq_len, shuffle_seed=cfg.train_loader.dataset.shuffle_seed,
    )
    batches = []
    for batch in loader.dataloader:
        batches.append(batch)
        if len(batches) == args.steps + 1:
            break
    targets = {mode: resolve_targets(unwrap_model(model), last_n_blocks=1) for mode, model in models.items()}
    cuts = {mode: choose_cut_module(unwrap_model(model), targets[mode]) for mode, model in models.items()}
    times, gap = _time_modes(models, batches, targets, cuts)
    tokens = statistics.mean(float(b["attention_mask"].sum()) for b in batches[1:])
    targets = statistics.mean(float((b["labels"] != -100).sum()) for b in batches[1:])
    print(f"{args.yaml.name}: {len(batches) - 1} batches of {cfg.global_train_batch_size} rows, "
          f"{tokens:.0f} tokens and {targets:.0f} target tokens each (median s)")
    print(f"{'':>8}{'all':>10}{'targets':>10}{'ratio':>8}")
    for kind in KINDS:
        a, t = statistics.median(times[("all", kind)]), statistics.median(times[("targets", kind)])
        print(f"{kind:>8}{a:>10.3f}{t:>10.3f}{t / a:>8.3f}")
    print(f"largest relative loss difference: {gap:.2e}")
    if gap > 1e-4:
        print("error: the two modes' losses differ: `targets` must compute the loss of `all`", file=sys.stderr)
        return 1
    return 0


def _time_modes(models: dict, batches: list, targets: dict, cuts: dict) -> tuple[dict[tuple[str, str], list[float]], float]:
    """Each mode's train, eval and scoring times on every batch but the first, modes interleaved on each batch.

    Also returns the largest relative difference of the two modes' losses.
    """
    import torch

    from composer_algos.features.capture import capture_layer_signals, scoring_mode
    from composer_algos.features.targets import unwrap_model

    times: dict[tuple[str, str], list[float]] = {(m, k): [] for m in models for k in KINDS}
    gap = 0.0
    for i in range(len(batches)):
        losses = {}
        for mode, model in models.items():  # interleaved: the same batch, one mode after the other
            # Composer's eval_forward shifts the labels in place: each pass gets its own copy.
            batch = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batches[i].items()}
            model.train()
            t0 = time.perf_counter()
            loss = model.loss(model(dict(batch)), batch)
            loss.backward()
            train_s = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            model.eval()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.eval_forward(batch)
            eval_s = time.perf_counter() - t0
            # Selection's scoring pass (forward and truncated backward of the per-example signals).
            hf = unwrap_model(model)
            with scoring_mode(hf):
                t0 = time.perf_counter()
                capture_layer_signals(hf, batch, targets[mode], cuts[mode], logits_at=mode)
            score_s = time.perf_counter() - t0
            losses[mode] = float(loss)
            if i:  # the first batch builds lazy state: untimed
                times[(mode, "train")].append(train_s)
                times[(mode, "eval")].append(eval_s)
                times[(mode, "score")].append(score_s)
        gap = max(gap, abs(losses["targets"] - losses["all"]) / max(abs(losses["all"]), 1e-12))
    return times, gap


if __name__ == "__main__":
    raise SystemExit(main())
