"""The long-sequence rows of tools/bench/bench_step.py: windowed scoring of packed rows, measured and against its FLOP floor.

Issue 22: on packed long sequences (S = 1024, 2048) PartitionSel scores each pool row (and the
validation rows) on a window of t tokens (`features.score_window`), so the scoring forward covers t
positions instead of S. This module holds

- the FLOP model of a Llama-style forward per token at a sequence length (weights, attention scores
  over the full S x S square as in bench_step's lm_head share, the lm_head), and from it
  `window_step_floor`: the least `partitionsel / random` step ratio the design can reach, counting
  the training step as three forwards of the kappa trained rows and the scoring pass, per scored row,
  as the window's forward, the lm_head's input gradient and, for each target block, its input
  gradient and per-example products (about two forwards of the block), as `bench_step.scoring_flop_floor`;
- `bench_long`: the measured ratio, a real Trainer per strategy stepped round robin (random, and
  partitionsel at each window length), on the CPU-sized model of yamls/testing/long_proportioned.yaml,
  whose cost structure (attention/weights and lm_head share) is Llama-3.2-1B's at every S;
- `format_long_table` with the target of issue 22: `partitionsel / random <= 1.05` at S = 2048,
  r = 2, t = 128 (OPUS, arXiv 2602.05400, reports 4.7% extra compute at r = 2).

Not counted by the floor: norms, softmax, the sketch/FFT projection, the solve, the optimizer step,
data loading (the pool's r x kappa rows are read and collated for both strategies).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
LONG_YAML = REPO / "yamls" / "testing" / "long_proportioned.yaml"
LONG_SEQS = (1024, 2048)
LONG_RATIOS = (2.0, 4.0, 8.0)
LONG_WINDOWS: tuple[int | None, ...] = (64, 128, 256, None)  # None: the whole row (t = S)
# Full-row scoring at r = 8 is left out of the measured rows (8 x the pool's forward on 2 CPU cores);
# its floor is still printed.
LONG_SKIP = ((8.0, None),)
# The arm that cuts what dominates above the floor's 1.05 at t = 128: features of the lm_head alone
# (`last_n_blocks: 0, include_lm_head: true`), whose output gradient is the loss's own, so neither the
# lm_head's input gradient nor a block's backward is computed.
HEAD_ONLY = ["algorithms.data_selection.features.last_n_blocks=0", "algorithms.data_selection.features.include_lm_head=true"]
# Issue 22's target.
LONG_TARGET_SEQ, LONG_TARGET_RATIO, LONG_TARGET_WINDOW, LONG_TARGET_LIMIT = 2048, 2.0, 128, 1.05
WARMUP_STEPS = 2


def flops_per_token(config: Mapping[str, Any], seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token at `seq_len` by part: `block` (one), `head`, `total` (composer_algos.analysis.compute_plan)."""
    sys.path.insert(0, str(REPO))
    from composer_algos.analysis.compute_plan import flops_per_token_parts

    return flops_per_token_parts(config, seq_len)


def window_step_floor(
    config: Mapping[str, Any],
    seq_len: int,
    window: int | None,
    r: float,
    *,
    kappa: int,
    val_rows: int,
    last_n_blocks: int = 1,
) -> float:
    """The FLOP floor of `partitionsel / random` per step with windowed scoring.

    `1 + (r kappa + val_rows) w c(w) / (3 kappa S f(S))`, with w = min(t, S) the scored positions per
    row, f(S) the forward FLOPs per token at length S, and c(w) = f(w) + head + 2 last_n_blocks
    block(w) the scoring FLOPs per window token (forward, lm_head input gradient, target blocks'
    input gradients and per-example products).

    Args:
        config: the model config (`flops_per_token`).
        seq_len: S, the packed row length (the training step runs over kappa rows of S).
        window: t, or None for the whole row.
        r: oversampling (pool = r x kappa rows).
        kappa: rows trained per step (per rank).
        val_rows: validation rows scored per step (per rank).
        last_n_blocks: blocks whose gradients are the features; 0 for the lm_head's alone (its
            output gradient is the loss's, so the pass is the window's forward and the sketch).
    """
    w = seq_len if window is None else min(window, seq_len)
    at_w, at_s = flops_per_token(config, w), flops_per_token(config, seq_len)
    if last_n_blocks == 0:  # lm_head features alone: dL/dlogits needs no backward matmul
        per_window_token = at_w["total"]
    else:
        per_window_token = at_w["total"] + at_w["head"] + 2 * last_n_blocks * at_w["block"]
    scoring = (r * kappa + val_rows) * w * per_window_token
    training = 3.0 * kappa * seq_len * at_s["total"]
    return 1.0 + scoring / training


def window_label(window: int | None, head_only: bool = False) -> str:
    return ("S" if window is None else str(window)) + ("/head" if head_only else "")


def long_arms(r: float, windows: Sequence[int | None], head_windows: Sequence[int]) -> list[tuple[str, int | None, int]]:
    """The partitionsel arms measured at ratio r: `(label, window, last_n_blocks)`."""
    arms = [(window_label(w), w, 1) for w in windows if (float(r), w) not in LONG_SKIP]
    return arms + [(window_label(w, True), w, 0) for w in head_windows]


def format_long_table(
    rows: Sequence[Mapping[str, Any]],
    *,
    config: Mapping[str, Any],
    kappa: int,
    val_rows: int,
    reference: Mapping[str, Any] | None = None,
    reference_kappa: int = 8,
) -> str:
    """The long-sequence report: per (S, r, t) the medians, the measured ratio and its floor; the target.

    Args:
        rows: dicts with `S`, `r`, `random` (s) and `ps` {label: (window, last_n_blocks, s)}
            (window None = whole row; last_n_blocks 0 = lm_head features alone).
        config: the benchmarked model's config (for the floors).
        kappa, val_rows: rows trained and validation rows scored per step in the benchmark.
        reference: a second config (Llama-3.2-1B) whose floors are printed for the same (S, r, t).
        reference_kappa: its rows per rank and step (its validation rows: `val_rows`).
    """
    lines = [
        f"long sequences (kappa {kappa} rows trained a step, {val_rows} validation row(s) scored, "
        "random window positions; median ms per step; ops, launches, syncs: one selection step's aten ops,",
        "the kernel launches among them (on a CPU: those the GPU would run) and host syncs, tools/bench/step_audit.py):",
        f"{'S':>6}{'r':>4}{'t':>12}{'random':>10}{'ps':>10}{'ps/random':>11}{'floor':>8}{'ops':>8}{'launches':>10}{'syncs':>7}",
    ]
    for row in rows:
        S, r = int(row["S"]), float(row["r"])
        counts = row.get("counts", {})
        for label, (window, blocks, ps) in row["ps"].items():
            floor = window_step_floor(config, S, window, r, kappa=kappa, val_rows=val_rows, last_n_blocks=blocks)
            ops, kernels, syncs = counts.get(label, ("-", "-", "-"))
            lines.append(
                f"{S:>6}{r:>4g}{label:>12}{1000 * row['random']:>10.1f}{1000 * ps:>10.1f}"
                f"{ps / row['random']:>11.3f}{floor:>8.3f}{ops:>8}{kernels:>10}{syncs:>7}"
            )
        if "random" in counts:
            ops, kernels, syncs = counts["random"]
            lines.append(f"{S:>6}{r:>4g}{'random':>12}{'':>10}{'':>10}{'':>11}{'':>8}{ops:>8}{kernels:>10}{syncs:>7}")
    if reference is not None:
        lines.append("")
        lines.append(
            f"FLOP floor of ps/random for Llama-3.2-1B (kappa {reference_kappa} rows per rank, {val_rows} "
            "validation row(s) per rank, last block):"
        )
        cols = [(w, 1) for w in (64, 128, 256, None)] + [(64, 0), (128, 0)]
        lines.append(f"{'S':>6}{'r':>4}" + "".join(f"{'t=' + window_label(w, b == 0):>11}" for w, b in cols))
        for S in LONG_SEQS:
            for r in LONG_RATIOS:
                cells = [
                    window_step_floor(reference, S, w, r, kappa=reference_kappa, val_rows=val_rows, last_n_blocks=b)
                    for w, b in cols
                ]
                lines.append(f"{S:>6}{r:>4g}" + "".join(f"{c:>11.3f}" for c in cells))
        lines.append(
            "  what the t=128 floor at S=2048, r=2 is made of (share of the scoring FLOPs): "
            + floor_breakdown(reference, 2048, 128, 2.0, kappa=reference_kappa, val_rows=val_rows)
        )
    verdict = long_target_verdict(rows)
    lines.append("")
    if verdict is None:
        lines.append(
            f"target ps/random <= {LONG_TARGET_LIMIT:g} at S = {LONG_TARGET_SEQ}, r = {LONG_TARGET_RATIO:g}, "
            f"t = {LONG_TARGET_WINDOW}: not measured in this run"
        )
    else:
        value, ok = verdict
        floor = window_step_floor(
            config, LONG_TARGET_SEQ, LONG_TARGET_WINDOW, LONG_TARGET_RATIO, kappa=kappa, val_rows=val_rows
        )
        lines.append(
            f"target: ps/random at S = {LONG_TARGET_SEQ}, r = {LONG_TARGET_RATIO:g}, t = {LONG_TARGET_WINDOW}: "
            f"{value:.3f} <= {LONG_TARGET_LIMIT:g} -> {'PASS' if ok else 'FAIL'} (FLOP floor {floor:.3f})"
        )
    return "\n".join(lines)


def long_target_verdict(rows: Sequence[Mapping[str, Any]]) -> tuple[float, bool] | None:
    """`(ps/random, passed)` at the target's (S, r, t) with last-block features, or None when not measured."""
    label = window_label(LONG_TARGET_WINDOW)
    for row in rows:
        if int(row["S"]) == LONG_TARGET_SEQ and float(row["r"]) == LONG_TARGET_RATIO and label in row["ps"]:
            value = row["ps"][label][2] / row["random"]
            return value, value <= LONG_TARGET_LIMIT
    return None


def floor_breakdown(config: Mapping[str, Any], seq_len: int, window: int, r: float, *, kappa: int, val_rows: int) -> str:
    """The scoring FLOPs of one step split into the window forward, the lm_head input gradient, the block backward, and the pool/validation rows."""
    at_w = flops_per_token(config, window)
    parts = {"window forward": at_w["total"], "lm_head input gradient": at_w["head"], "last block backward": 2 * at_w["block"]}
    total = sum(parts.values())
    pool_share = r * kappa / (r * kappa + val_rows)
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in parts.items()) + (
        f"; pool rows {100 * pool_share:.0f}%, validation rows {100 * (1 - pool_share):.0f}%"
    )


def bench_long(
    shards: Path,
    run_root: Path,
    seq_len: int,
    ratios: Sequence[float],
    windows: Sequence[int | None],
    *,
    head_windows: Sequence[int] = (),
    steps: int,
    device: str,
    model_overrides: Sequence[str] = (),
    op_sites: int = 0,
    ps_variants: Mapping[str, Sequence[str]] | None = None,
    fit_batches: int = 1,
    log=print,
) -> list[dict]:
    """Measured rows at one S: per r, random and partitionsel at each window, stepped round robin
    (`fit_batches` batches a `fit()` call after the warm-up: `step_counts_while_warming_up`).

    Returns one dict per r: `S`, `r`, `random` (median s per step after the warm-up) and `ps`
    {label: (window, last_n_blocks, median s)}; `head_windows` adds lm_head-feature arms, and each
    `ps_variants` entry `{name: overrides}` one more partitionsel arm per window, labelled `t+name`,
    with those config overrides (e.g. the compiled scoring forward).
    """
    from stepping import make_step_timer, prepare_for_stepping

    import train
    from pipeline.config import load_config

    out = []
    for r in ratios:
        runs: dict[str, tuple] = {}
        ps_arms = [(lab, "partitionsel", w, b, ()) for lab, w, b in long_arms(r, windows, head_windows)]
        ps_arms += [
            (f"{lab}+{name}", "partitionsel", w, b, tuple(extra))
            for name, extra in (ps_variants or {}).items()
            for lab, w, b in long_arms(r, windows, ())
        ]
        arms = [("random", "random", None, 1, ())] + ps_arms
        shape = {lab: (w, b) for lab, _s, w, b, _x in arms}
        for key, strategy, window, blocks, extra in arms:
            overrides = [
                f"variables.shard_dir={shards}",
                f"variables.max_seq_len={seq_len}",
                f"save_folder={run_root / f'S{seq_len}-r{r:g}-{key.replace(chr(47), chr(95))}'}",
                f"max_duration={steps}ba",
                "python_log_level=error",
                "console_log_interval=1000ba",
                f"algorithms.data_selection.strategy={strategy}",
                f"algorithms.data_selection.oversampling={r}",
                *(["device=gpu", "precision=amp_bf16"] if device == "cuda" else ["device=cpu", "precision=fp32"]),
                *model_overrides,
            ]
            if window is not None and window < seq_len:
                overrides += [
                    f"algorithms.data_selection.features.score_window={window}",
                    "algorithms.data_selection.features.score_window_position=random",
                ]
            if blocks == 0:
                overrides += HEAD_ONLY
            overrides += extra
            trainer = train.build_trainer(load_config(LONG_YAML, overrides))
            timer = make_step_timer()
            prepare_for_stepping(trainer)
            trainer.state.callbacks.append(timer)
            runs[key] = (trainer, timer)
        counts = step_counts_while_warming_up(runs, steps, WARMUP_STEPS, op_sites=op_sites, fit_batches=fit_batches, log=log)
        medians = {k: statistics.median(timer.times[WARMUP_STEPS:]) for k, (_t, timer) in runs.items()}
        for trainer, _timer in runs.values():
            trainer.close()
        random_s = medians.pop("random")
        row = {"S": seq_len, "r": float(r), "random": random_s, "ps": {k: (*shape[k], s) for k, s in medians.items()},
               "counts": counts}
        log(
            f"  S={seq_len} r={r:g}: random {1000 * random_s:.0f} ms; "
            + ", ".join(f"t={k} {1000 * s:.0f} ms ({s / random_s:.3f})" for k, s in medians.items()),
        )
        out.append(row)
    return out


def step_counts_while_warming_up(
    runs: Mapping[str, tuple], steps: int, warmup: int, *, op_sites: int = 0, fit_batches: int = 1, log=print
) -> dict[str, tuple[int, int, int]]:
    """Step the trainers round robin `steps` times; the last warm-up step of each is counted.

    The warm-up steps are one `fit(duration="1ba")` call each; after them each arm runs `fit_batches` batches
    a call (the last call fewer when they do not divide). More than one lets `select_ahead: true` work as in
    a run: its selection for the next batch is made inside a call, so a call's first batch selects at the step
    and its last makes none ahead; with 4 or more a call, the median step is a steady one.

    Returns `{arm: (aten ops, kernel launches, host syncs)}` of one selection step (tools/bench/step_audit.py:
    emulated syncs on a CPU, torch's own on CUDA). The audit watches every step until the counted
    one (what a step caches must be seen being made) and is gone before the timed steps. With
    `op_sites` > 0 each arm's counted ops are also filed by who dispatched them, and the top
    `op_sites` sites are logged.
    """
    from step_audit import StepAuditor, first_read, format_op_sites

    auditors = {key: StepAuditor(trainer, attribute_ops=op_sites > 0) for key, (trainer, _timer) in runs.items()}
    counts: dict[str, tuple[int, int, int]] = {}
    done = 0
    while done < steps:
        n = 1 if done < warmup else min(fit_batches, steps - done)
        for key, (trainer, _timer) in runs.items():
            if done == warmup - 1:
                c = auditors[key].count()
                auditors[key].close()
                counts[key] = (c["ops"], c["kernels"], c["sync"] + c["h2d"])
                if op_sites > 0:
                    log(f"  {key}: one selection step's aten ops by site\n" + format_op_sites(c["op_sites"], op_sites))
                    log(f"  {key}: {first_read(c) or 'no host read in the selection step'}")
            else:
                trainer.fit(duration=f"{n}ba")
        done += n
    return counts


def llama_1b_overrides(llama: Mapping[str, Any]) -> list[str]:
    """Overrides that give yamls/testing/long_proportioned.yaml the real Llama-3.2-1B shape (random weights)."""
    return [f"model.config.{k}={v}" for k, v in llama.items()] + ["algorithms.data_selection.features.proj_dim=2048"]


def write_long_shards(corpus: Path, shards: Path, seq_len: int) -> int:
    """The sample Dolma-style corpus (about 1 M tokens) packed at `seq_len` into `shards` (tools/shard.py's exit code)."""
    import shard as shard_tool
    from sample_corpus import write_sample_corpus

    if not (corpus / "dolma").exists():
        write_sample_corpus(corpus, seed=0, scale=1.0)
    return shard_tool.main(
        ["dolma", str(corpus / "dolma" / "documents"), "--out", str(shards),
         "--max-seq-len", str(seq_len), "--val-count", "16", "--no-progress"]
    )


def recipe_flops(yaml: Path, gpus: int, overrides: Sequence[str] = ()) -> dict[str, float]:
    """FLOPs per optimizer step of a recipe, with and without its selection's scoring pass.

    The training step: three forwards of the global batch's rows at the recipe's sequence length.
    The scoring pass: the recipe's `oversampling` x the batch's rows plus `validation.batch_size`
    rows on every rank, each on its `features.score_window` (whole rows without one), with the
    recipe's `features.last_n_blocks` (0 with `include_lm_head`: the lm_head alone).
    """
    from pipeline.config import load_config

    cfg = load_config(yaml, list(overrides))
    model = cfg.model.config
    S = int(cfg.max_seq_len)
    rows = int(cfg.global_train_batch_size)
    sel = cfg.algorithms.get("data_selection") if isinstance(cfg.algorithms, Mapping) else None
    sel = sel or {}
    feats = sel.get("features", {}) or {}
    r = float(sel.get("oversampling", 1.0))
    window = feats.get("score_window")
    blocks = int(feats.get("last_n_blocks", 1))
    val = int((sel.get("validation", {}) or {}).get("batch_size", 0)) * gpus
    training = 3.0 * rows * S * flops_per_token(model, S)["total"]
    floor = window_step_floor(model, S, window, r, kappa=rows, val_rows=val, last_n_blocks=blocks) if sel else 1.0
    return {
        "tokens": float(rows * S), "training": training, "scoring": (floor - 1.0) * training,
        "ratio": floor, "oversampling": r, "window": float(window or S), "val_rows": float(val),
    }


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        description="FLOPs per step of a recipe yaml, with and without its selection's scoring pass "
        "(the training step as three forwards; the scoring as window_step_floor counts it)."
    )
    parser.add_argument("yaml", type=Path, help="a run yaml, e.g. yamls/llama1b_dolma.yaml")
    parser.add_argument("--gpus", type=int, default=64, help="ranks (each scores validation.batch_size rows; default 64)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the yaml")
    args = parser.parse_intermixed_args(argv)  # overrides may follow --gpus
    sys.path.insert(0, str(REPO))
    f = recipe_flops(args.yaml, args.gpus, args.overrides)
    print(
        f"{args.yaml}: {f['tokens']:,.0f} tokens a step; training {f['training'] / 1e15:.2f} PFLOP a step; "
        f"scoring (r = {f['oversampling']:g}, window {f['window']:.0f}, {f['val_rows']:.0f} validation rows over "
        f"{args.gpus} ranks) {f['scoring'] / 1e15:.3f} PFLOP; with selection {f['ratio']:.3f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
