"""Benchmark: a selection step against its floor, the pool's forward, on a tiny and a proportioned model.

Example:
    python tools/bench/bench_step.py                          # both configs, r = 2 and 4 (about 8 minutes on 2 cores)
    python tools/bench/bench_step.py --configs proportioned --ratios 2 --steps 12
    python tools/bench/bench_step.py --device cuda            # on a GPU, in amp_bf16 as a real run
    python tools/bench/bench_step.py --long only              # the long-sequence rows alone
    python tools/bench/bench_step.py --device cuda --long only --long-model llama1b --long-seqs 2048
    python tools/bench/bench_step.py --quick                  # smoke run: tiny, r = 2, 3 steps, 1 round, small corpus
    python tools/bench/bench_step.py --long only --long-model llama1b_cpu --long-seqs 512 --long-ratios 2 \
        --windows 64 --head-windows "" --long-steps 3 --op-sites 25   # who dispatches the 1B step's ops

For each config and each oversampling ratio r, side by side in one run: the median step time
(a real Trainer, data loading to optimizer step) of the plain train step on kappa (`none` with
r = 1), `random`, `partitionsel` and `greats` (at r); and, measured alone on a real pool of the
partitionsel run, the no-grad forward of the pool (`fwd`), the feature extraction of the pool and
the validation batch (`features`) and the solver on those features (`solve`). The ratios printed
are `ps/random` and `(ps - random) / fwd`: what selection adds to a step in units of the pool's
forward, the floor of any model-in-the-loop selector being about 1.

To damp the noise of a shared machine the strategies' trainers are stepped in turn (one batch
each, round robin, `Trainer.fit(duration="1ba")`) and the standalone timings alternate fwd,
features and solve in rounds; every figure is a median.

Configs: `tiny` (yamls/testing/tiny_dolma.yaml: 2 blocks of width 64, the lm_head ~71% of the
forward FLOPs) and `proportioned` (yamls/testing/proportioned.yaml: 8 blocks, MLP 512, lm_head
~20%, like Llama-3.2-1B). The lm_head share of forward FLOPs per token is

    2 h V / (2 h V + L (2 (P_attn + P_mlp) + 4 S h_attn))

with h the hidden size, V the vocabulary, L the blocks, P_attn = h (n_heads + 2 n_kv_heads)
d_head + n_heads d_head h the attention projections' weights, P_mlp = 3 h I (gate, up, down),
and 4 S h_attn (h_attn = n_heads d_head) the attention scores QK^T and their product with V at
sequence length S, counted over the full S x S square (PaLM's appendix B convention; no causal
halving). Embedding lookups, norms and softmax are not counted. Llama-3.2-1B at S = 2048 gives
19.2% by this formula.

Long sequences (issue 22; `--long on|off|only`, tools/bench/window_cost.py): packed rows of S = 1024 and
2048 tokens on yamls/testing/long_proportioned.yaml, a CPU-sized model with Llama-3.2-1B's
attention/weights ratio and lm_head share at every S; per r in {2, 4, 8}, random and partitionsel
scoring a random window of t in {64, 128, 256, S} tokens (`features.score_window`), and t = 128 with
the lm_head's features alone, stepped round robin; each ratio `ps/random` beside its FLOP floor
(`window_cost.window_step_floor`), then Llama-3.2-1B's floors and what the t = 128 floor is made of.
Target: `ps/random <= 1.05` at S = 2048, r = 2, t = 128 (PASS/FAIL). On a GPU, `--device cuda
--long only --long-model llama1b` measures the real shape (random weights).

Targets (issue 15) on the proportioned config at r = 2: `(ps - random) / fwd <= 1.3` and
`ps / random <= 1.6`, each printed PASS/FAIL.

Memory: the peak the scoring pass (pool and validation features, in the run's precision context
and chunks of `chunk_size: auto`, the run's microbatch) adds over the trained model, optimizer
state included, next to the peak of one training microbatch of the same size (forward and
backward, the outputs held through the backward as Composer's trainer holds them). Target:
scoring peak <= training peak. On CUDA torch.cuda.max_memory_allocated; on CPU the rise of the
peak RSS (VmHWM), with large allocations served by mmap so freed memory leaves the RSS (the
script re-executes itself with MALLOC_MMAP_THRESHOLD_ set; bench_features.py's method).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

# torch, Composer and train.py load after argument parsing (in the functions), so --help is fast.
if TYPE_CHECKING:

    from composer_algos.data_selection.algorithm import DataSelection

CONFIGS = {
    "tiny": REPO / "yamls" / "testing" / "tiny_dolma.yaml",
    "proportioned": REPO / "yamls" / "testing" / "proportioned.yaml",
}
# Stepped in this order, round robin; `none` trains the kappa examples of a pool of r = 1.
STRATEGIES = ("none", "random", "partitionsel", "greats")
SEQ_LEN = 128  # the benchmark's shards
WARMUP_STEPS = 3
QUICK_CORPUS_SCALE = 0.25  # --quick's sample corpus (about 1,200 documents): enough for a few steps
QUICK_WARMUP_STEPS, QUICK_STEPS = 1, 3  # --quick: one warm-up step, the median of two

# Llama-3.2-1B (tied embeddings; the lm_head is still a matmul) at its training sequence length.
LLAMA_1B = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}
LLAMA_1B_SEQ = 2048
# Llama-3.2-1B's structure at a CPU's size, for the op and sync counts of its selection step (they
# depend on the structure, not the widths): 16 blocks, 32 query / 8 key-value heads, every target
# layer sketched (exact_max_numel 0, as the 1B's large layers are) and projected to 2048 (the 1B's
# hidden size: each 32 x 32 sketch embedded, as there), 8 rows trained a step (the recipe's per GPU).
LLAMA_1B_CPU = {
    "hidden_size": 64,
    "num_hidden_layers": 16,
    "intermediate_size": 256,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 2,
    "vocab_size": 4096,
}
LLAMA_1B_CPU_OVERRIDES = [
    "algorithms.data_selection.features.exact_max_numel=0",
    "algorithms.data_selection.features.proj_dim=2048",
    "global_train_batch_size=8",
    "device_train_microbatch_size=8",
]

# Issue 15's targets, proportioned config at r = 2.
TARGET_CONFIG, TARGET_RATIO = "proportioned", 2.0
TARGET_EXTRA_PER_FWD = 1.3  # (ps - random) / fwd(pool)
TARGET_PS_PER_RANDOM = 1.6  # ps / random


def lm_head_flop_share(config: Mapping[str, Any], seq_len: int) -> float:
    """The lm_head's share of a Llama-style model's forward FLOPs per token (formula: module docstring).

    Args:
        config: `hidden_size`, `num_hidden_layers`, `intermediate_size`, `num_attention_heads`,
            `vocab_size`, optional `num_key_value_heads` (default: the heads) and `head_dim`
            (default: hidden / heads).
        seq_len: S, the sequence length the attention scores are counted at.

    Returns:
        2 h V / (2 h V + L (2 (P_attn + P_mlp) + 4 S h_attn)), in [0, 1].
    """
    from composer_algos.analysis.compute_plan import flops_per_token_parts

    parts = flops_per_token_parts(config, seq_len)
    return parts["head"] / parts["total"]


def scoring_flop_floor(share: float, num_blocks: int, pool: int, val: int, last_n_blocks: int = 1) -> float:
    """FLOPs of the feature pass in forwards of the pool: the floor of `(ps - random)/fwd` for this design.

    Per example (pool and validation alike) the pass runs the whole forward (1), the lm_head's
    input gradient (its weight gradient is not needed: `share`), and for each of the last
    `last_n_blocks` blocks the input gradient and the per-example products (about two forwards of
    the block: `2 (1 - share) / num_blocks` each). Norms, softmax, the sketch and the solve are
    not counted, so the measured figure sits above this.

    Args:
        share: The lm_head's share of forward FLOPs (`lm_head_flop_share`).
        num_blocks: The model's blocks.
        pool, val: Examples scored per step on the pool and validation side.
        last_n_blocks: The feature targets' blocks.
    """
    per_example = 1 + share + 2 * last_n_blocks * (1 - share) / num_blocks
    return (1 + val / pool) * per_example


def summarize(row: Mapping[str, float]) -> dict[str, float]:
    """The ratios of one (config, r) row: `ps/random`, `(ps - random)/fwd`, `features/fwd`, and the rest.

    `rest/fwd` is what the partitionsel step adds beyond its features and solve, in pool forwards
    (exchange, bookkeeping, logging; negative when noise or caching outweighs it).
    """
    extra = row["partitionsel"] - row["random"]
    return {
        "ps/random": row["partitionsel"] / row["random"],
        "(ps-random)/fwd": extra / row["forward"],
        "features/fwd": row["features"] / row["forward"],
        "rest/fwd": (extra - row["features"] - row["solve"]) / row["forward"],
    }


def target_verdicts(rows: Mapping[str, list[Mapping[str, float]]]) -> list[tuple[str, float, float, bool]]:
    """Issue 15's targets: `(name, value, limit, passed)` for the proportioned config at r = 2 (empty if not run)."""
    row = next((r for r in rows.get(TARGET_CONFIG, []) if r["r"] == TARGET_RATIO), None)
    if row is None:
        return []
    s = summarize(row)
    return [
        ("(ps-random)/fwd", s["(ps-random)/fwd"], TARGET_EXTRA_PER_FWD, s["(ps-random)/fwd"] <= TARGET_EXTRA_PER_FWD),
        ("ps/random", s["ps/random"], TARGET_PS_PER_RANDOM, s["ps/random"] <= TARGET_PS_PER_RANDOM),
    ]


def format_table(
    rows: Mapping[str, list[Mapping[str, float]]],
    shares: Mapping[str, float] | None = None,
    floors: Mapping[str, float] | None = None,
) -> str:
    """The benchmark's report: per config and r the step and standalone medians (ms), the ratios, the targets.

    Args:
        rows: config name -> one dict per r with `r` and the seconds `none`, `random`,
            `partitionsel`, `greats`, `forward`, `features`, `solve` (and optionally the memory
            fields `microbatch`, `score_peak`, `train_peak` in bytes).
        shares: config name -> lm_head share of forward FLOPs (printed in the header).
        floors: label -> `scoring_flop_floor` (printed under the shares).
    """
    lines = [
        "median ms per step (r = pool / kappa; none = plain train step on kappa, r = 1); ps ops, ps syncs: one",
        "partitionsel selection step's aten ops and host syncs (tools/bench/step_audit.py; emulated on a CPU):",
    ]
    head = ["config", "r", "none", "random", "greats", "ps", "fwd(pool)", "features", "solve",
            "ps/random", "(ps-rand)/fwd", "feat/fwd", "rest/fwd", "ps ops", "ps syncs"]
    widths = [13, 3] + [10] * 7 + [10, 14, 9, 9, 8, 9]
    lines.append("".join(f"{h:>{w}}" for h, w in zip(head, widths)))
    for name, config_rows in rows.items():
        for row in config_rows:
            s = summarize(row)
            cells = [
                name,
                f"{row['r']:g}",
                *(f"{1000 * row[k]:.1f}" for k in ("none", "random", "greats", "partitionsel", "forward", "features", "solve")),
                f"{s['ps/random']:.2f}",
                f"{s['(ps-random)/fwd']:.2f}",
                f"{s['features/fwd']:.2f}",
                f"{s['rest/fwd']:.2f}",
                *(str(x) for x in _ps_counts(row)),
            ]
            lines.append("".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    if shares:
        lines.append("")
        lines.append("lm_head share of forward FLOPs per token (formula in the docstring):")
        for name, share in shares.items():
            lines.append(f"  {name}: {100 * share:.1f}%")
    if floors:
        lines.append("")
        lines.append("FLOP floor of the feature pass, in pool forwards (the least (ps-random)/fwd can be; scoring_flop_floor):")
        for label, floor in floors.items():
            lines.append(f"  {label}: {floor:.2f}")
    verdicts = target_verdicts(rows)
    if verdicts:
        lines.append("")
        lines.append(f"targets ({TARGET_CONFIG}, r = {TARGET_RATIO:g}):")
        for label, value, limit, ok in verdicts:
            lines.append(f"  {label} = {value:.2f} <= {limit:g} -> {'PASS' if ok else 'FAIL'}")
    mem = [(n, r) for n, rs in rows.items() for r in rs if "score_peak" in r]
    if mem:
        lines.append("")
        lines.append("peak memory added over the trained model (scoring: pool + validation features, chunks of the microbatch):")
        for name, row in mem:
            ratio = row["score_peak"] / max(row["train_peak"], 1)
            lines.append(
                f"  {name} r={row['r']:g} microbatch {row['microbatch']:g}: scoring {row['score_peak'] / 2**20:.1f} MB, "
                f"training step {row['train_peak'] / 2**20:.1f} MB, scoring/training {ratio:.2f} "
                f"(target <= 1) -> {'PASS' if ratio <= 1 else 'FAIL'}"
            )
    return "\n".join(lines)


def _ps_counts(row: Mapping[str, Any]) -> tuple[int | str, int | str]:
    """`(aten ops, host syncs)` of the row's partitionsel selection step ("-" when not counted)."""
    counted = row.get("counts", {}).get("partitionsel")
    return (counted[0], counted[2]) if counted else ("-", "-")


def parse_ps_variants(specs: list[str]) -> dict[str, list[str]]:
    """`["c:a.b=1,c.d=2"]` -> `{"c": ["a.b=1", "c.d=2"]}` (`--ps-variant`); a clear error for a malformed one."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, rest = spec.partition(":")
        name = name.strip()
        overrides = [o.strip() for o in rest.split(",") if o.strip()]
        if not sep or not name or not overrides or any("=" not in o for o in overrides):
            raise ValueError(f"{spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
        if name in out:
            raise ValueError(f"{spec!r}: the name {name!r} is given twice")
        out[name] = overrides
    return out


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        args.ps_variants = parse_ps_variants(args.ps_variant)
    except ValueError as e:
        parser.error(f"--ps-variant: {e}")
    if bad := [o for o in args.long_override if "=" not in o]:
        parser.error(f"--long-override takes KEY=VALUE, got {bad}")
    if args.solver_threads:
        return solver_threads(args.threads or 2)
    if args.quick:
        args.configs, args.ratios, args.steps, args.repeats = "tiny", "2", QUICK_STEPS, 1
        if args.long == "on":
            args.long = "off"
    long_seqs, long_ratios, windows, head_windows = _parse_long_options(parser, args)
    configs, ratios = _parse_short_options(parser, args)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine; use --device cpu")

    t_start = time.perf_counter()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        root = Path(tmp)
        shards = root / "shards"
        rc = write_bench_shards(root / "corpus", shards, scale=QUICK_CORPUS_SCALE if args.quick else 1.0)
        if rc:
            return rc
        where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
        print(
            f"torch {torch.__version__}, {args.device} ({where}); {args.steps} steps per strategy "
            f"({args.warmup} warm-up), {args.repeats} standalone rounds; load average {load_before[0]:.2f}\n",
            flush=True,
        )
        rows, shares, floors = _short_rows(root, shards, configs, ratios, args)
        shares[f"Llama-3.2-1B (S={LLAMA_1B_SEQ})"] = llama = lm_head_flop_share(LLAMA_1B, LLAMA_1B_SEQ)
        floors["Llama-3.2-1B, no validation batch, last 1 block"] = scoring_flop_floor(
            llama, LLAMA_1B["num_hidden_layers"], 1, 0
        )
        if args.long != "only":
            print()
            print(format_table(rows, shares, floors))
        if args.long != "off":
            long_table(root, args, long_seqs, long_ratios, windows, head_windows)
    load_after = os.getloadavg()
    print(
        f"\nwall {time.perf_counter() - t_start:.0f} s; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after (on a shared machine compare the ratios, not the milliseconds)"
    )
    return 0


def _build_parser() -> argparse.ArgumentParser:
    """The benchmark's options: the short configs, the solver-thread comparison, the long-sequence rows."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="tiny,proportioned", help=f"of {sorted(CONFIGS)} (default: both)")
    parser.add_argument("--ratios", default="2,4", help="oversampling ratios r (default: 2,4)")
    parser.add_argument(
        "--steps", type=int, default=9, help=f"steps per strategy; the first {WARMUP_STEPS} are warm-up (default: 9)"
    )
    parser.add_argument("--repeats", type=int, default=7, help="rounds of the standalone timings (default: 7)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's; 1 is steadier on a busy machine)"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cpu (fp32) or cuda (amp_bf16, the recipes' precision) (default: cpu)",
    )
    parser.add_argument(
        "--solver-threads", action="store_true",
        help="instead: time the partitionsel solve at n = 32, 64, 2048 (kappa n/2) with cpu_single_thread "
        "off and on, interleaved, with --threads (default 2) intra-op threads",
    )
    parser.add_argument(
        "--quick", action="store_true",
        help=f"smoke run (under a minute), not a measurement: --configs tiny --ratios 2 --steps {QUICK_STEPS} "
        f"({QUICK_WARMUP_STEPS} warm-up) --repeats 1 on a quarter-size corpus (overrides those options)",
    )
    parser.add_argument(
        "--long", choices=("on", "off", "only"), default="on",
        help="the long-sequence rows (tools/bench/window_cost.py: packed rows of --long-seqs tokens, partitionsel "
        "scoring --windows-token windows vs random, against the FLOP floor; issue 22's 1.05 target): "
        "on (after the short configs; default), off, or only (default off with --quick)",
    )
    parser.add_argument("--long-seqs", default="1024,2048", help="sequence lengths S of the long rows (default: 1024,2048)")
    parser.add_argument("--long-ratios", default="2,4,8", help="oversampling ratios of the long rows (default: 2,4,8)")
    parser.add_argument(
        "--windows", default="64,128,256,S",
        help="window lengths t scored with last-block features; S = the whole row (default: 64,128,256,S; "
        "the whole row is not measured at r = 8)",
    )
    parser.add_argument(
        "--head-windows", default="128",
        help="window lengths also scored with lm_head features alone (default: 128; empty for none)",
    )
    parser.add_argument(
        "--long-batch", type=int, default=None,
        help="rows trained a step in the long rows (default: the yaml's 2, where the one validation row is half "
        "the trained batch and lifts the floor; 8 is closer to a rank's share of a real recipe's batch)",
    )
    parser.add_argument("--long-steps", type=int, default=6, help="steps per arm of the long rows, 2 warm-up (default: 6)")
    parser.add_argument(
        "--long-fit-batches", type=int, default=1,
        help="batches a fit() call after the warm-up (default 1: arms alternate every step); a ps-variant with "
        "algorithms.data_selection.select_ahead=true needs 4 or more for its median step to be a steady one",
    )
    parser.add_argument(
        "--long-model", choices=("proportioned", "llama1b", "llama1b_cpu"), default="proportioned",
        help="proportioned: yamls/testing/long_proportioned.yaml (CPU-sized, Llama-3.2-1B's cost structure); "
        "llama1b: the real Llama-3.2-1B shape, random weights (for --device cuda); llama1b_cpu: its structure "
        "(16 blocks, heads, sketched targets, proj_dim 2048, 8 rows a step) at a CPU's widths, for the op and "
        "sync counts of the 1B's selection step",
    )
    parser.add_argument(
        "--op-sites", type=int, default=0, metavar="N",
        help="long rows: also print each arm's counted selection step's N busiest op sites (who dispatched the aten "
        "ops: the model's own forward apart from the project's features, solver and step code) (default: 0, off)",
    )
    parser.add_argument(
        "--ps-variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
        help="long rows: also a partitionsel arm at each window with these config overrides, labelled "
        "t+NAME (repeatable), e.g. c:algorithms.data_selection.features.compile_forward=true",
    )
    parser.add_argument(
        "--long-override", action="append", default=[], metavar="KEY=VALUE",
        help="long rows: a config override for every arm (repeatable), e.g. the recipe's optimizer",
    )
    return parser


def _parse_long_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[int], list[float], list[int | None], list[int]]:
    """The long rows' sequence lengths, ratios, windows (None: the whole row) and lm_head windows, checked."""
    try:
        long_seqs = [int(x) for x in args.long_seqs.split(",") if x.strip()]
        long_ratios = [float(x) for x in args.long_ratios.split(",") if x.strip()]
        windows = [None if x.strip() == "S" else int(x) for x in args.windows.split(",") if x.strip()]
        head_windows = [int(x) for x in args.head_windows.split(",") if x.strip()]
    except ValueError as e:
        parser.error(f"--long-seqs/--long-ratios/--windows/--head-windows: {e}")
    if any(s < 2 for s in long_seqs) or any(r <= 1 for r in long_ratios) or any(w is not None and w < 2 for w in windows):
        parser.error("--long-seqs and --windows must be >= 2 tokens and --long-ratios > 1")
    if args.long_batch is not None and args.long_batch < 1:
        parser.error(f"--long-batch must be at least 1 (got {args.long_batch})")
    if args.long_steps < 3:
        parser.error("--long-steps must be at least 3 (2 warm-up steps are dropped)")
    if args.long_fit_batches < 1:
        parser.error(f"--long-fit-batches must be at least 1 (got {args.long_fit_batches})")
    return long_seqs, long_ratios, windows, head_windows


def _parse_short_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[float]]:
    """The short rows' configs and ratios, checked; sets `args.warmup`."""
    args.warmup = QUICK_WARMUP_STEPS if args.quick else WARMUP_STEPS
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        parser.error(f"--configs: {unknown or args.configs!r} not among {sorted(CONFIGS)}")
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps must be at least {WARMUP_STEPS + 2} ({WARMUP_STEPS} warm-up steps are dropped)")
    ratios = [float(r) for r in args.ratios.split(",")]
    if any(r <= 1 for r in ratios):
        parser.error(f"--ratios must all be > 1, got {args.ratios}")
    return configs, ratios


def _short_rows(
    root: Path, shards: Path, configs: list[str], ratios: list[float], args: argparse.Namespace
) -> tuple[dict[str, list[dict]], dict[str, float], dict[str, float]]:
    """Each short config's rows (`bench_ratio` at each ratio), its lm_head FLOP share and its scoring floors."""
    from pipeline.config import load_config

    rows: dict[str, list[dict]] = {}
    shares: dict[str, float] = {}
    floors: dict[str, float] = {}
    for name in configs if args.long != "only" else ():
        cfg = load_config(CONFIGS[name], [f"variables.shard_dir={shards}"])
        model_cfg = cfg.model.config
        assert model_cfg is not None
        shares[f"{name} (S={SEQ_LEN})"] = share = lm_head_flop_share(model_cfg, SEQ_LEN)
        # The yaml's mapping (train.py builds DataSelection from it), with DataSelection's defaults
        # for what it leaves out: validation batch 4 and last_n_blocks 1.
        sel = cfg.algorithms["data_selection"]
        val_cfg = sel.get("validation") or {}
        val = int(val_cfg.get("batch_size", 4) if isinstance(val_cfg, Mapping) else 4)
        blocks = int((sel.get("features") or {}).get("last_n_blocks", 1))
        for r in ratios:
            pool = int(round(cfg.global_train_batch_size * r))
            floors[f"{name} r={r:g} (pool {pool}, validation {val}, last {blocks} block)"] = scoring_flop_floor(
                share, int(model_cfg["num_hidden_layers"]), pool, val, blocks
            )
        rows[name] = [
            bench_ratio(name, CONFIGS[name], shards, root / f"runs-{name}-r{r:g}", r, args) for r in ratios
        ]
    return rows, shares, floors


def long_table(root: Path, args: argparse.Namespace, seqs, ratios, windows, head_windows) -> None:
    """The long-sequence rows (tools/bench/window_cost.py), measured at each S, then their table with the 1.05 target."""
    import window_cost as wc

    from pipeline.config import load_config

    if args.long_model == "llama1b":
        overrides = wc.llama_1b_overrides(LLAMA_1B)
    elif args.long_model == "llama1b_cpu":
        overrides = [f"model.config.{k}={v}" for k, v in LLAMA_1B_CPU.items()] + LLAMA_1B_CPU_OVERRIDES
    else:
        overrides = []
    if args.long_batch is not None:
        overrides = [*overrides, f"global_train_batch_size={args.long_batch}"]
    overrides = [*overrides, *args.long_override]
    cfg = load_config(wc.LONG_YAML, overrides)
    kappa = int(cfg.global_train_batch_size)
    val = int(cfg.algorithms["data_selection"]["validation"]["batch_size"])
    print(f"\nlong sequences ({args.long_model} model, {args.long_steps} steps per arm, 2 warm-up):", flush=True)
    rows: list[dict] = []
    for S in seqs:
        shards = root / f"shards-long-{S}"
        rc = wc.write_long_shards(root / "corpus-long", shards, S)
        if rc:
            raise RuntimeError(f"sharding the long-sequence corpus at S={S} failed (tools/shard.py exit {rc})")
        rows += wc.bench_long(
            shards, root / "runs-long", S, ratios, windows, head_windows=head_windows, steps=args.long_steps,
            device=args.device, model_overrides=overrides, op_sites=args.op_sites, ps_variants=args.ps_variants,
            fit_batches=args.long_fit_batches, log=lambda line: print(line, flush=True),
        )
    print()
    print(wc.format_long_table(rows, config=cfg.model.config, kappa=kappa, val_rows=val, reference=LLAMA_1B))


# (n, D, repeats) of the thread comparison: the tiny configs' pools (proj_dim 64) and a large pool
# at the 1B recipe's proj_dim (its hidden size); kappa = n / 2 (r = 2) throughout.
SOLVER_THREAD_CASES = ((32, 64, 41), (64, 64, 41), (2048, 2048, 3))


def solver_threads(threads: int) -> int:
    """Print the partitionsel solve's median time with `cpu_single_thread` off and on, interleaved, per n."""
    import torch
    from bench_selection import make_instance

    from composer_algos.selection import get_strategy

    torch.set_num_threads(threads)
    spec = get_strategy("partitionsel")
    print(f"partitionsel solve (exact refit, kappa = n/2, 8 domains), {threads} intra-op threads; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'n':>6} {'D':>6} {'off ms':>10} {'on ms':>10} {'on/off':>8}")
    for n, dim, reps in SOLVER_THREAD_CASES:
        features, val_feature, domain_ids = make_instance(n, dim, 8, seed=0)

        def run(single: bool) -> None:
            spec.fn(
                features=features, val_feature=val_feature, domain_ids=domain_ids, num_domains=8, kappa=n // 2,
                eta=0.5, generator=torch.Generator().manual_seed(0), capacities=None, cpu_single_thread=single,
            )

        med = _interleaved({"off": lambda: run(False), "on": lambda: run(True)}, reps)
        print(f"{n:>6} {dim:>6} {1000 * med['off']:>10.2f} {1000 * med['on']:>10.2f} {med['on'] / med['off']:>8.2f}",
              flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} after; torch.get_num_threads() = {torch.get_num_threads()}")
    return 0


def bench_ratio(name: str, yaml: Path, shards: Path, run_root: Path, r: float, args: argparse.Namespace) -> dict:
    """One row: the four strategies stepped round robin, then the standalone timings on a partitionsel pool."""
    from stepping import make_step_timer, prepare_for_stepping

    import train
    from composer_algos.data_selection.algorithm import DataSelection
    from pipeline.config import load_config

    runs = {}
    for strategy in STRATEGIES:
        cfg = load_config(
            yaml,
            [
                f"variables.shard_dir={shards}",
                f"variables.max_seq_len={SEQ_LEN}",
                f"save_folder={run_root / strategy}",
                f"max_duration={args.steps}ba",
                "eval_loader=null",
                "python_log_level=error",
                "console_log_interval=1000ba",
                f"algorithms.data_selection.strategy={strategy}",
                f"algorithms.data_selection.oversampling={1 if strategy == 'none' else r}",
                *(["device=gpu", "precision=amp_bf16"] if args.device == "cuda" else ["device=cpu", "precision=fp32"]),
            ],
        )
        trainer = train.build_trainer(cfg)
        timer = make_step_timer()
        prepare_for_stepping(trainer)
        trainer.state.callbacks.append(timer)
        runs[strategy] = (trainer, timer)
    import window_cost as wc

    counts = wc.step_counts_while_warming_up(runs, args.steps, args.warmup)
    out: dict = {"r": r, "counts": counts}
    for strategy, (_trainer, timer) in runs.items():
        out[strategy] = statistics.median(timer.times[args.warmup :])
    trainer = runs["partitionsel"][0]
    algo = next(a for a in trainer.state.algorithms if isinstance(a, DataSelection))
    out.update(standalone(trainer, algo, args.repeats))
    out.update(peak_memory(trainer, algo))
    for trainer, _timer in runs.values():
        trainer.close()
    s = summarize(out)
    ops, syncs = _ps_counts(out)
    print(
        f"  {name} r={r:g}: " + ", ".join(f"{k} {1000 * out[k]:.1f}" for k in (*STRATEGIES, "forward", "features", "solve"))
        + f" ms; ps/random {s['ps/random']:.2f}, (ps-random)/fwd {s['(ps-random)/fwd']:.2f}; "
        f"ps selection step: {ops} aten ops, {syncs} host syncs",
        flush=True,
    )
    return out


def write_bench_shards(corpus: Path, shards: Path, scale: float = 1.0) -> int:
    """The sample Dolma-style corpus (at `scale`) sharded at SEQ_LEN into `shards` (tools/shard.py's exit code)."""
    import shard as shard_tool
    from sample_corpus import write_sample_corpus

    write_sample_corpus(corpus, seed=0, scale=scale)
    return shard_tool.main(
        ["dolma", str(corpus / "dolma" / "documents"), "--out", str(shards),
         "--max-seq-len", str(SEQ_LEN), "--val-count", "16", "--no-progress"]
    )


def standalone(trainer, algo: DataSelection, repeats: int) -> dict:
    """Median times of the pool's no-grad forward, the features and the solve alone, in interleaved rounds."""
    import torch

    from composer_algos.data_selection.step import assemble_problem, solve_problem

    pool, val, domain_N, context, chunk = _scoring_inputs(trainer, algo)
    hf = trainer.state.model.model
    optimizer = trainer.state.optimizers[0]
    device = next(hf.parameters()).device
    eta = float(optimizer.param_groups[0]["lr"])
    step = int(trainer.state.timestamp.batch.value)
    box: dict[str, Any] = {}

    def forward() -> None:
        was_training = hf.training
        hf.eval()
        with torch.no_grad(), context():
            hf(input_ids=pool["input_ids"].to(device), attention_mask=pool["attention_mask"].to(device), use_cache=False)
        hf.train(was_training)

    def features() -> None:
        box["fg"] = algo.extractor.compute(
            pool, val, step=step, optimizer=optimizer, precision_context=context, auto_chunk_size=chunk
        )

    def solve() -> None:  # what the algorithm runs on the step's features (assemble + solve)
        feats, gbar = box["fg"]
        problem = assemble_problem(
            domain_N, kappa_rank=algo.kappa, gather=False, needs_features=True, features_ND=feats, gbar_D=gbar,
            n_val=int(val["input_ids"].shape[0]),
        )
        solve_problem(
            problem, "partitionsel", eta=eta, seed=step, num_domains=algo.num_domains,
            options=algo.strategy_options.get("partitionsel"), fractions=algo._fractions,
            capacity_fn=algo._capacity_fn(),
        )

    return _interleaved({"forward": forward, "features": features, "solve": solve}, repeats)


def _interleaved(fns: Mapping[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Run the functions in turn for `repeats` rounds (after one warm-up round); the median time of each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            _sync_any()
            times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def peak_memory(trainer, algo: DataSelection) -> dict:
    """Peak bytes added by scoring the pool, and by one training microbatch of the same size (forward + backward)."""
    from bench_features import memory_peak, memory_reset

    pool, val, _domains, context, chunk = _scoring_inputs(trainer, algo)
    hf = trainer.state.model.model
    device = next(hf.parameters()).device
    optimizer = trainer.state.optimizers[0]
    for p in hf.parameters():
        p.grad = None  # gradients are part of the training peak, not of the baseline

    base = memory_reset(device)
    algo.extractor.compute(pool, val, step=1, optimizer=optimizer, precision_context=context, auto_chunk_size=chunk)
    _sync_any()
    score = memory_peak(device) - base

    micro = {k: v[:chunk].to(device) for k, v in pool.items()}
    was_training = hf.training
    hf.train()
    base = memory_reset(device)
    with context():
        # Held through the backward, as Composer's trainer holds state.outputs (logits included).
        outputs = hf(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"], labels=micro["labels"])
    outputs.loss.backward()
    del outputs
    _sync_any()
    train_peak = memory_peak(device) - base
    hf.train(was_training)
    for p in hf.parameters():
        p.grad = None
    return {"microbatch": chunk, "score_peak": score, "train_peak": train_peak}


def _scoring_inputs(trainer, algo: DataSelection):
    """A real pool and validation batch, the pool's domains, the run's precision context and the scoring chunk."""
    from composer.core.precision import get_precision_context

    batch = next(iter(trainer.state.train_dataloader))
    pool = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    assert algo.validation is not None and algo.extractor is not None
    vb = algo.validation.batch_for_step(0)
    val = {k: vb[k] for k in ("input_ids", "attention_mask", "labels")}
    state = trainer.state

    def context():
        return get_precision_context(state.precision, state.precision_config)

    return pool, val, batch[algo.domain_key], context, algo._auto_chunk_size(state)


def _sync_any() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    # --help answers here, before the re-exec below (which would replace the calling process).
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and not {"-h", "--help"} & set(sys.argv[1:]):
        # glibc keeps freed heap memory for reuse; serving every allocation above 64 KiB by mmap
        # makes the RSS track live tensors, so the CPU peak-memory line measures something.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)
    raise SystemExit(main())
