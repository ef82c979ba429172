"""Fidelity of the selection cost knobs: shadow selections beside one real PartitionSel run (issues 15.4, 22.4).

Example:
    OMP_NUM_THREADS=1 python tools/studies/knob_fidelity.py --steps 50 --out runs/knob_fidelity
    # windowed scoring on packed long rows (issue 22.4): t in {64, 128, 256}, start and random
    OMP_NUM_THREADS=1 python tools/studies/knob_fidelity.py --set windows --yaml yamls/study/ghpile.yaml \\
        --shards runs/ghpile/shards/s512 --steps 60 --out runs/ghpile/fidelity_s512

One real training run of PartitionSel at full cost (the yaml's settings; default the study config
yamls/study/dm_math.yaml on runs/study/shards/dm_math, sharded from ../shared/data/dm_math into a
temporary directory when that is absent). At every step, before the real selection and on the
same pool and the same model, each knob variant's selection is also computed (a shadow: nothing
is trained on it) and its Jaccard overlap |A & B| / |A | B| with the full-cost selection is
recorded, with the Spearman rank correlation of its scores <g_i, gbar> with the full cost's scores
on the same pool, and its feature time against the full cost's on the same step (the variants run in a
rotating order, so the machine's load drifts over all of them alike). Every variant solves with
the step's own generator, so its capacities are the real step's.

Variants of `--set knobs` (the default):
    full             the yaml's features recomputed: against the trained selection (a check: 1)
    val_redraw       the yaml's features with another validation draw (the next step's): how far
                     the selection moves with the validation batch alone (the noise level)
    score_tokens16/32/64   features.score_tokens (the pool's first t target tokens)
    mlp_down         the last block's MLP down_proj only
    attention        the last block's attention projections only
    proj_dim256      features.proj_dim 256
    stale_topk_i2/4  interval 2 / 4 with between: stale_topk: on the steps between selections the
                     pool's full-cost features scored against the validation feature of the last
                     selecting step (kept from this run's full-cost shadow), top kappa within the
                     capacities; feature time = the pool alone (no validation forward, no solve)
    random           a uniform random subset, as `between: random` trains (the floor)
    random_caps      random within the step's capacities (chance level)

Variants of `--set windows` (features.score_window: each pool row and the validation batch scored
on a t-token window run as its own sequence, composer_algos/features/windows.py):
    full, val_redraw       as above (val_redraw: the noise reference)
    window<t>_start        the first t tokens of every row, for each t of --windows (default 64,128,256)
    window<t>_random       a t-token window at a random position per row and step
    random, random_caps    as above

Reference selections in both sets, from the full-cost features of the step (no features of their own):
    eta0             PartitionSel solved with eta = 0 (pure gradient matching: mu = G gbar, no
                     diagonal bonus)
    gradnorm_caps    the largest ||g_i|| within the step's capacities (what the diagonal bonus
                     (eta/2) ||g_i||^2 of mu alone would pick)
and, per step, what drives mu = G gbar + (eta/2) diag(K) for the full-cost features: the median over
the pool of (eta/2) ||g_i||^2 / |<g_i, gbar>| and of its share (eta/2) ||g_i||^2 / (|<g_i, gbar>| +
(eta/2) ||g_i||^2).

For the stale variants the Jaccard is over the between steps only (a selecting step is the full
selection), and the cost is given per between step and amortised over an interval.

The summary gives each variant's mean Jaccard and score Spearman over all steps and over the
second half of the run (a model past its first steps), and the minimum Jaccard.

Writes DIR/knob_fidelity.md (the table) and DIR/knob_fidelity.json (per step and summary).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

DEFAULT_YAML = REPO / "yamls" / "study" / "dm_math.yaml"
DEFAULT_SHARDS = REPO / "runs" / "study" / "shards" / "dm_math"
DATA = REPO.parent / "shared" / "data" / "dm_math"

# name -> extra feature options over the yaml's (None: not a feature variant).
FEATURE_VARIANTS: dict[str, dict[str, Any]] = {
    "full": {},
    "val_redraw": {},
    "score_tokens16": {"score_tokens": 16},
    "score_tokens32": {"score_tokens": 32},
    "score_tokens64": {"score_tokens": 64},
    "mlp_down": {"target_modules": [r"mlp\.down_proj"]},
    "attention": {"target_modules": [r"self_attn\."]},
    "proj_dim256": {"proj_dim": 256},
}
STALE_INTERVALS = (2, 4)
WINDOW_SIZES = (64, 128, 256)
WINDOW_POSITIONS = ("start", "random")
VARIANT_SETS = ("knobs", "windows")
DESCRIPTIONS = {
    "full": "the yaml's features, recomputed (against the trained selection)",
    "val_redraw": "full cost, another validation draw (noise level)",
    "score_tokens16": "`features.score_tokens: 16`",
    "score_tokens32": "`features.score_tokens: 32`",
    "score_tokens64": "`features.score_tokens: 64`",
    "mlp_down": r"last block, `target_modules: ['mlp\.down_proj']`",
    "attention": r"last block, `target_modules: ['self_attn\.']`",
    "proj_dim256": "`features.proj_dim: 256`",
    "stale_topk_i2": "`interval: 2, between: stale_topk` (between steps)",
    "stale_topk_i4": "`interval: 4, between: stale_topk` (between steps)",
    "random": "`between: random`: a uniform subset (floor)",
    "random_caps": "random within the step's capacities (chance level)",
    "eta0": "full features, PartitionSel with eta = 0 (no diagonal bonus in mu)",
    "gradnorm_caps": "full features, top ||g_i|| within the capacities",
}
REFERENCE_SELECTIONS = ("eta0", "gradnorm_caps")


def window_variants(sizes: tuple[int, ...] = WINDOW_SIZES) -> dict[str, dict[str, Any]]:
    """`window<t>_<position>` -> its feature options, for each t in `sizes` and each position."""
    return {
        f"window{t}_{pos}": {"score_window": t, "score_window_position": pos}
        for t in sizes
        for pos in WINDOW_POSITIONS
    }


def feature_variants(variant_set: str, sizes: tuple[int, ...] = WINDOW_SIZES) -> dict[str, dict[str, Any]]:
    """The feature variants a set runs: `knobs` (issue 15's cost knobs) or `windows` (score_window)."""
    if variant_set == "knobs":
        return dict(FEATURE_VARIANTS)
    if variant_set == "windows":
        return {"full": {}, "val_redraw": {}, **window_variants(sizes)}
    raise ValueError(f"variant set must be one of {list(VARIANT_SETS)}, got {variant_set!r}")


def describe(name: str) -> str:
    """The table's setting column for a variant."""
    if name in DESCRIPTIONS:
        return DESCRIPTIONS[name]
    if name.startswith("window"):
        t, pos = name.removeprefix("window").split("_")
        return f"`features.score_window: {t}`, `score_window_position: {pos}`"
    return name


def mu_terms(features_ND, gbar_D, eta: float) -> dict[str, float]:
    """What drives PartitionSel's `mu = G gbar + (eta/2) diag(K)`: the pool medians of
    `(eta/2) ||g_i||^2 / |<g_i, gbar>|` and of the bonus's share `(eta/2) ||g_i||^2 / (|<g_i, gbar>| +
    (eta/2) ||g_i||^2)` (above 1/2: the selection follows the gradient norms more than the guide)."""
    align_N = (features_ND.double() @ gbar_D.double()).abs()
    bonus_N = 0.5 * eta * (features_ND.double() ** 2).sum(dim=1)
    return {
        "eta": float(eta),
        "bonus_over_alignment": float((bonus_N / align_N.clamp_min(1e-300)).median()),
        "bonus_share": float((bonus_N / (bonus_N + align_N).clamp_min(1e-300)).median()),
    }


def jaccard(a: set[int], b: set[int]) -> float:
    """|a & b| / |a | b| (1 for two empty sets)."""
    union = a | b
    return len(a & b) / len(union) if union else 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--yaml", type=Path, default=DEFAULT_YAML, help="run config (default: the study's)")
    parser.add_argument(
        "--shards", type=Path, default=None,
        help=f"shard directory (default: {DEFAULT_SHARDS.relative_to(REPO)}, else ../shared/data/dm_math sharded "
        "into a temporary directory)",
    )
    parser.add_argument("--steps", type=int, default=50, help="training steps, each with its shadows (default 50)")
    parser.add_argument("--out", type=Path, required=True, help="directory for knob_fidelity.md and .json")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE",
        help="extra config override (repeatable), after the tool's own",
    )
    parser.add_argument(
        "--set", dest="variant_set", choices=VARIANT_SETS, default="knobs",
        help="which variants: knobs (issue 15's cost knobs, default) or windows (features.score_window)",
    )
    parser.add_argument(
        "--windows", default=",".join(str(t) for t in WINDOW_SIZES),
        help="--set windows: comma-separated window lengths t (default 64,128,256)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    try:
        sizes = tuple(int(t) for t in args.windows.split(",") if t.strip())
    except ValueError:
        parser.error(f"--windows must be comma-separated integers, got {args.windows!r}")
    if not sizes or any(t < 2 for t in sizes):
        parser.error(f"--windows: every window length must be an integer >= 2, got {args.windows!r}")

    import torch

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="knob_fidelity_") as tmp:
        shards = args.shards
        if shards is None:
            shards = DEFAULT_SHARDS if (DEFAULT_SHARDS / "manifest.json").exists() else _shard_study(Path(tmp))
        records, meta = run(
            args.yaml, shards, Path(tmp) / "run", args.steps, args.override,
            variants=feature_variants(args.variant_set, sizes), stale=args.variant_set == "knobs",
        )
    meta["wall_s"] = time.perf_counter() - t0
    meta["command"] = "python tools/studies/knob_fidelity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    summary = summarize(records)
    (args.out / "knob_fidelity.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "steps": records}, indent=1)
    )
    table = format_table(summary, meta)
    (args.out / "knob_fidelity.md").write_text(table + "\n")
    print(table)
    return 0


def run(
    yaml: Path,
    shards: Path,
    save_folder: Path,
    steps: int,
    extra: list[str],
    *,
    variants: dict[str, dict[str, Any]] | None = None,
    stale: bool = True,
) -> tuple[list[dict], dict]:
    """Train `steps` steps of the yaml's PartitionSel, computing every variant's shadow selection each step.

    Args:
        variants: feature variant name -> feature options over the yaml's (default: the knobs);
            it must hold `full` (the reference) and may hold `val_redraw` (full features, the next
            step's validation draw).
        stale: also the `stale_topk` variants (they need `full`'s pool-only features each step).
    """
    variants = dict(FEATURE_VARIANTS if variants is None else variants)
    if "full" not in variants:
        raise ValueError(f"the variants must include 'full' (the reference), got {list(variants)}")
    stale_intervals = STALE_INTERVALS if stale else ()
    import torch

    import composer_algos.data_selection.algorithm as sa

    cfg, trainer = _quiet_trainer(yaml, shards, save_folder, steps, extra)
    algo = sa.find_data_selection(trainer.state)
    assert algo is not None and algo.scope != "global", "the shadows compare one rank's selections"
    trained: dict[int, set[int]] = {}
    records: list[dict] = []
    shadows: dict[str, Any] = {}  # variant -> its GradFeatureExtractor, built on the first step
    stale_gbar: dict[int, torch.Tensor] = {}  # selecting step of the stale variants -> its gbar

    original_redistribute = sa.redistribute

    def recording_redistribute(batch, problem, result, **kw):
        trained[int(trainer.state.timestamp.batch.value)] = set(result.indices.tolist())
        return original_redistribute(batch, problem, result, **kw)

    sa.redistribute = recording_redistribute
    original_select = algo._select

    def select_with_shadows(state, logger):
        shadow = _prepare_shadow_step(algo, state, variants, shadows)
        rec = _shadow_record(shadow, variants, stale_intervals, stale_gbar)
        original_select(state, logger)
        rec["trained"] = trained.get(shadow.step)
        full = rec["sel"]["full"]
        rec["jaccard"] = {name: jaccard(sel, full) for name, sel in rec["sel"].items() if name != "full"}
        rec["jaccard"]["full"] = jaccard(full, rec["trained"]) if rec["trained"] is not None else float("nan")
        rec["pool"], rec["kappa"] = int(shadow.domain_N.shape[0]), int(algo.kappa)
        records.append(rec)

    algo._select = select_with_shadows  # type: ignore[method-assign]
    try:
        trainer.fit()
    finally:
        sa.redistribute = original_redistribute
        trainer.close()
    for rec in records:  # sets are not JSON
        rec["sel"] = {k: sorted(v) for k, v in rec["sel"].items()}
        rec["trained"] = sorted(rec["trained"]) if rec["trained"] is not None else None
    return records, _run_meta(yaml, shards, steps, cfg, algo, records, variants, stale_intervals)


def _quiet_trainer(yaml: Path, shards: Path, save_folder: Path, steps: int, extra: list[str]) -> tuple[Any, Any]:
    """(config, trainer) of the yaml's PartitionSel on the CPU in fp32, without evaluation or console loggers."""
    from composer.loggers import ConsoleLogger, ProgressBarLogger

    import train
    from composer_algos.registry import load_run_config

    cfg = load_run_config(
        yaml,
        [
            f"variables.shard_dir={shards}",
            f"save_folder={save_folder}",
            f"max_duration={steps}ba",
            "eval_loader=null",
            "python_log_level=error",
            "console_log_interval=1000ba",
            "algorithms.data_selection.strategy=partitionsel",
            "device=cpu",
            "precision=fp32",
            *extra,
        ],
    )
    trainer = train.build_trainer(cfg)
    quiet = (ConsoleLogger, ProgressBarLogger)
    trainer.logger.destinations = tuple(d for d in trainer.logger.destinations if not isinstance(d, quiet))
    trainer.state.callbacks[:] = [c for c in trainer.state.callbacks if not isinstance(c, quiet)]
    return cfg, trainer


@dataclasses.dataclass
class _ShadowStep:
    """One step's pool, validation batch and solver settings, shared by the step's shadow selections."""

    algo: Any
    state: Any
    step: int
    domain_N: Any
    device: Any
    pool: dict[str, Any]
    val: dict[str, Any]
    n_val: int
    optimizer: Any
    eta: float
    gen_seed: int
    chunk: Any
    options: Any
    shadows: dict[str, Any]

    def context(self):
        """The run's precision context (what the algorithm's own extractor runs under)."""
        from composer.core.precision import get_precision_context

        return get_precision_context(self.state.precision, self.state.precision_config)

    def features(self, name: str, with_val: bool = True, val_batch: dict[str, Any] | None = None):
        """`name`'s features of the pool and of `val_batch` (default the step's validation batch), and their time."""
        val_batch = self.val if val_batch is None else val_batch
        ext = self.shadows[name]
        t = time.perf_counter()
        G, gbar = ext.compute(
            self.pool, val_batch if with_val else None, step=self.step, optimizer=self.optimizer,
            precision_context=self.context, auto_chunk_size=self.chunk,
        )
        return G, gbar, time.perf_counter() - t

    def solve(self, strategy: str, G=None, gbar=None, eta: float | None = None):
        """`strategy`'s selection of the pool (on features `G`, `gbar` when given), its time and its fallback."""
        from composer_algos.data_selection.step import assemble_problem, solve_problem

        eta = self.eta if eta is None else eta
        algo = self.algo
        t = time.perf_counter()
        problem = assemble_problem(
            self.domain_N, kappa_rank=algo.kappa, gather=False, needs_features=G is not None, features_ND=G,
            gbar_D=gbar, n_val=self.n_val,
        )
        outcome = solve_problem(
            problem, strategy, eta=eta, seed=self.gen_seed, num_domains=algo.num_domains,
            options=self.options if strategy == "partitionsel" else None, fractions=algo._fractions,
            capacity_fn=algo._capacity_fn(),
        )
        return set(outcome.result.indices.tolist()), time.perf_counter() - t, outcome.fallback

    def top_within(self, scores_N):
        """The top kappa by `scores_N` within the step's capacities (drawn as a selecting step draws them)."""
        import torch

        import composer_algos.data_selection.algorithm as sa
        from composer_algos.selection import compute_capacities

        algo, domain_N = self.algo, self.domain_N
        t = time.perf_counter()
        counts_C = torch.bincount(domain_N.to(scores_N.device), minlength=algo.num_domains)
        caps_C = compute_capacities(counts_C, algo.kappa, algo._fractions, generator=torch.Generator().manual_seed(self.gen_seed))
        sel = sa.top_k_within_capacities(scores_N, domain_N.to(scores_N.device), caps_C, algo.kappa)
        return set(sel.tolist()), time.perf_counter() - t

    def stale(self, G, gbar_stale):
        """A stale step's selection: the pool's features scored against a kept validation feature."""
        return self.top_within(G @ gbar_stale.to(G.dtype))


def _prepare_shadow_step(algo: Any, state: Any, variants: dict[str, dict[str, Any]], shadows: dict[str, Any]) -> _ShadowStep:
    """The step's inputs as the algorithm's own selection gets them; builds the variants' extractors on the first step."""
    from composer_algos.data_selection.validation_source import model_inputs
    from composer_algos.features import GradFeatureExtractor
    from composer_algos.seeding import mix_seed

    step = int(state.timestamp.batch.value)
    batch = state.batch
    domain_N = batch[algo.domain_key]
    algo._prepare(state, int(domain_N.shape[0]), domain_N)
    if algo.validation is None:
        algo._build_validation(state)
    model = state.model  # as the algorithm's own extractor gets it (single process: no DDP wrapper)
    device = next(model.parameters()).device
    if not shadows:
        for name, opts in variants.items():
            shadows[name] = GradFeatureExtractor(model, seed=algo.seed, **{**algo.feature_cfg, **opts})
    pool = model_inputs(batch, device)
    val_batch = algo.validation.batch_for_step(step)
    val = model_inputs(val_batch, device)
    n_val = int(val["input_ids"].shape[0])
    optimizer = state.optimizers[0]
    eta = float(optimizer.param_groups[0]["lr"])
    gen_seed = mix_seed(algo.seed, step, 0)
    chunk = algo._auto_chunk_size(state)
    options = algo.strategy_options.get("partitionsel")
    return _ShadowStep(
        algo=algo, state=state, step=step, domain_N=domain_N, device=device, pool=pool, val=val, n_val=n_val,
        optimizer=optimizer, eta=eta, gen_seed=gen_seed, chunk=chunk, options=options, shadows=shadows,
    )


def _shadow_record(
    shadow: _ShadowStep,
    variants: dict[str, dict[str, Any]],
    stale_intervals: tuple[int, ...],
    stale_gbar: dict[int, Any],
) -> dict[str, Any]:
    """Every variant's and reference's selection of the step, with their times and score Spearmans (before the real one)."""
    from composer_algos.data_selection.validation_source import model_inputs
    from composer_algos.features import spearman

    step, pool, algo = shadow.step, shadow.pool, shadow.algo
    # The jobs, in an order rotated every step; "pool_only" times the stale steps' features.
    jobs = [*variants, *(["pool_only"] if stale_intervals else [])]
    shift = step % len(jobs)
    targets_N = (pool["labels"][:, 1:] != -100).sum(dim=1)
    rec: dict[str, Any] = {
        "step": step, "feat_s": {}, "solve_s": {}, "sel": {}, "fallback": {}, "score_seq_len": {}, "spearman": {},
        "seq_len": int(pool["input_ids"].shape[1]),
        "targets_median": float(targets_N.float().median()), "targets_max": int(targets_N.max()),
    }
    results: dict[str, Any] = {}
    for name in jobs[shift:] + jobs[:shift]:
        if name == "pool_only":
            G, _, t_feat = shadow.features("full", with_val=False)
            results[name] = G
            rec["feat_s"][name] = t_feat
            continue
        if name == "val_redraw":
            other = model_inputs(algo.validation.batch_for_step(step + 1), shadow.device)
            G, gbar, t_feat = shadow.features("full", val_batch=other)
        else:
            G, gbar, t_feat = shadow.features(name)
        if shadow.shadows[name].score_length_in_use is not None:
            rec["score_seq_len"][name] = shadow.shadows[name].score_length_in_use
        sel, t_solve, fallback = shadow.solve("partitionsel", G, gbar)
        results[name] = (G, gbar)
        rec["feat_s"][name], rec["solve_s"][name], rec["sel"][name] = t_feat, t_solve, sel
        rec["fallback"][name] = fallback
    G_full, gbar_full = results["full"]
    # Each variant's scores <g_i, gbar> (its own features and validation side) against full's.
    scores_full = G_full.double() @ gbar_full.double()
    for name in variants:
        G, gbar = results[name]
        rec["spearman"][name] = spearman(G.double() @ gbar.double(), scores_full)
    for k in stale_intervals:
        name = f"stale_topk_i{k}"
        if step % k == 0:
            stale_gbar[k] = gbar_full
            rec["sel"][name] = rec["sel"]["full"]
            rec.setdefault("stale_between", {})[name] = False
        elif k in stale_gbar:
            rec["sel"][name], rec["solve_s"][name] = shadow.stale(results["pool_only"], stale_gbar[k])
            rec.setdefault("stale_between", {})[name] = True
    rec["terms"] = mu_terms(G_full, gbar_full, shadow.eta)
    rec["sel"]["eta0"], rec["solve_s"]["eta0"], _ = shadow.solve("partitionsel", G_full, gbar_full, eta=0.0)
    rec["sel"]["gradnorm_caps"], rec["solve_s"]["gradnorm_caps"] = shadow.top_within((G_full.double() ** 2).sum(dim=1))
    rec["sel"]["random"], rec["solve_s"]["random"], _ = shadow.solve("random")
    rec["sel"]["random_caps"], rec["solve_s"]["random_caps"], _ = shadow.solve("random_stratified")
    return rec


def _run_meta(
    yaml: Path,
    shards: Path,
    steps: int,
    cfg: Any,
    algo: Any,
    records: list[dict],
    variants: dict[str, dict[str, Any]],
    stale_intervals: tuple[int, ...],
) -> dict[str, Any]:
    """The run's setting beside its records: config, pool, features, model shape, threads, sequence lengths."""
    import torch

    model_cfg = dict(getattr(cfg.model, "config", None) or {})
    meta = {
        "yaml": str(yaml),
        "shards": str(shards),
        "steps": steps,
        "pool": records[0]["pool"] if records else None,
        "kappa": records[0]["kappa"] if records else None,
        "features": {k: v for k, v in algo.feature_cfg.items()},
        "model": {k: model_cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")},
        "max_seq_len": cfg.max_seq_len,
        "threads": torch.get_num_threads(),
        "seq_len_median": statistics.median(r["seq_len"] for r in records) if records else None,
        "targets_per_example_median": statistics.median(r["targets_median"] for r in records) if records else None,
        "targets_per_example_max": max(r["targets_max"] for r in records) if records else None,
        "score_seq_len_median": {
            name: statistics.median(r["score_seq_len"][name] for r in records)
            for name in variants if records and name in records[0]["score_seq_len"]
        },
        "variants": list(variants),
        "stale_intervals": list(stale_intervals),
    }
    return meta


def summarize(records: list[dict]) -> dict[str, dict[str, float]]:
    """Per variant: mean and min Jaccard with the full-cost selection, the mean Spearman of its scores
    with full's (all steps and the second half), and the median time ratios on the same step."""
    out: dict[str, dict[str, float]] = {}
    feature_names = list(records[0]["spearman"]) if records else []  # the run's variants, in order
    stale_names = sorted({n for r in records for n in r.get("stale_between", {})})
    names = feature_names + stale_names + [n for n in REFERENCE_SELECTIONS if records and n in records[0]["sel"]]
    names += ["random", "random_caps"]
    half = (max(r["step"] for r in records) + 1) // 2 if records else 0
    for name in names:
        if name.startswith("stale_topk"):
            rows = [r for r in records if r.get("stale_between", {}).get(name)]
        else:
            rows = [r for r in records if name in r["jaccard"]]
        jac = [(r["step"], r["jaccard"][name]) for r in rows if math.isfinite(r["jaccard"][name])]
        rho = [(r["step"], r["spearman"][name]) for r in rows if math.isfinite(r["spearman"].get(name, math.nan))]
        entry: dict[str, float] = {"steps": float(len(jac))}
        for key, pairs in (("jaccard", jac), ("spearman", rho)):
            if pairs:
                entry[f"{key}_mean"] = statistics.fmean(v for _, v in pairs)
            late = [v for step, v in pairs if step >= half]
            if late:
                entry[f"{key}_mean_late"] = statistics.fmean(late)
        if jac:
            entry["jaccard_min"] = min(v for _, v in jac)
        full_cost = [r["feat_s"]["full"] + r["solve_s"]["full"] for r in rows]
        if name in feature_names:
            entry["feat_ms"] = 1000 * statistics.median(r["feat_s"][name] for r in rows) if rows else float("nan")
            entry["feat_ratio"] = statistics.median(r["feat_s"][name] / r["feat_s"]["full"] for r in rows) if rows else float("nan")
            entry["select_ratio"] = (
                statistics.median((r["feat_s"][name] + r["solve_s"][name]) / c for r, c in zip(rows, full_cost))
                if rows else float("nan")
            )
            entry["fallbacks"] = float(sum(r["fallback"].get(name) is not None for r in rows))
        elif name.startswith("stale_topk") and rows:
            k = int(name.removeprefix("stale_topk_i"))
            entry["feat_ms"] = 1000 * statistics.median(r["feat_s"]["pool_only"] for r in rows)
            entry["feat_ratio"] = statistics.median(r["feat_s"]["pool_only"] / r["feat_s"]["full"] for r in rows)
            between = statistics.median(
                (r["feat_s"]["pool_only"] + r["solve_s"][name]) / c for r, c in zip(rows, full_cost)
            )
            entry["select_ratio"] = between
            entry["select_ratio_amortised"] = (1 + (k - 1) * between) / k
        elif rows:
            entry["feat_ms"], entry["feat_ratio"] = 0.0, 0.0
            entry["select_ratio"] = statistics.median(r["solve_s"][name] / c for r, c in zip(rows, full_cost))
        out[name] = entry
    terms = [r["terms"] for r in records if "terms" in r]
    if terms:
        out["terms"] = {
            key: statistics.median(t[key] for t in terms) for key in ("eta", "bonus_over_alignment", "bonus_share")
        }
        late = [r["terms"] for r in records if "terms" in r and r["step"] >= half]
        if late:
            out["terms"]["bonus_share_late"] = statistics.median(t["bonus_share"] for t in late)
    return out


def format_table(summary: dict[str, dict[str, float]], meta: dict) -> str:
    """The markdown table of `summarize`'s figures, with the run's setting above it."""
    lines = [
        f"{meta.get('steps')} steps of {Path(str(meta.get('yaml'))).name} (pool {meta.get('pool')}, kappa "
        f"{meta.get('kappa')}, features {meta.get('features')}, {meta.get('threads')} thread(s)); Jaccard with "
        "the full-cost selection on the same pool; time ratios are medians over steps of the variant against "
        "the full cost on the same step (features: the feature pass; selection: features + solve). Pools are "
        f"padded to {meta.get('seq_len_median')} tokens (median over steps); an example has "
        f"{meta.get('targets_per_example_median')} target tokens (median of the steps' medians, max "
        f"{meta.get('targets_per_example_max')}); scoring runs over "
        + ", ".join(f"{k}: {v:g}" for k, v in (meta.get("score_seq_len_median") or {}).items())
        + " positions (median).",
        "",
        "Jaccard and Spearman (of the scores <g_i, gbar> against full's) are means over all steps and over "
        "the second half of the run (late).",
        "",
        "| variant | setting | steps | Jaccard mean | Jaccard late | Jaccard min | Spearman mean | Spearman late "
        "| features ms | features / full | selection / full |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, e in summary.items():
        if name == "terms":
            continue
        sel = f"{e['select_ratio']:.2f}" if "select_ratio" in e else "-"
        if "select_ratio_amortised" in e:
            sel += f" ({e['select_ratio_amortised']:.2f} amortised)"
        rho = f"{e['spearman_mean']:.3f}" if "spearman_mean" in e else "-"
        rho_late = f"{e['spearman_mean_late']:.3f}" if "spearman_mean_late" in e else "-"
        lines.append(
            f"| {name} | {describe(name)} | {int(e['steps'])} | {e.get('jaccard_mean', float('nan')):.3f} | "
            f"{e.get('jaccard_mean_late', float('nan')):.3f} | {e.get('jaccard_min', float('nan')):.3f} | {rho} | "
            f"{rho_late} | {e.get('feat_ms', float('nan')):.1f} | {e.get('feat_ratio', float('nan')):.2f} | {sel} |"
        )
    terms = summary.get("terms")
    if terms:
        lines += [
            "",
            f"mu = G gbar + (eta/2) diag(K) of the full-cost features (medians over steps of the pool medians; eta "
            f"{terms['eta']:.3g}): (eta/2) ||g_i||^2 / |<g_i, gbar>| = {terms['bonus_over_alignment']:.3g}; the bonus's "
            f"share of |mu_i| = {terms['bonus_share']:.3f} (second half {terms.get('bonus_share_late', float('nan')):.3f}).",
        ]
    return "\n".join(lines)


def _shard_study(tmp: Path) -> Path:
    """../shared/data/dm_math sharded as the study does (tools/studies/study_dm_math.py), into `tmp`."""
    import shard as shard_tool

    out = tmp / "shards" / "dm_math"
    rc = shard_tool.main(
        ["metamathqa", str(DATA / "train.json"), "--val-file", str(DATA / "val.json"), "--out", str(out),
         "--max-seq-len", "160", "--no-progress"]
    )
    if rc != 0:
        raise SystemExit(f"sharding {DATA} failed (tools/shard.py exit {rc})")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
