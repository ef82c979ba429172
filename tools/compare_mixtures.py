"""Compare DoReMi's learned domain weights with the mixtures other runs trained on.

Prints a table (domain x method, beside the natural shares of the data in the same units: shares
of examples by default, as the mixtures are; `--units tokens` converts every mixture to token
shares with the manifest's tokens per example), and writes
comparison.md (the same table), comparison.png (grouped bars, like the paper's DoReMi
domain-weights figure) and trajectories.png (per-step weights and their running mean, from the
mixture_steps.csv next to each mixture.json, when present).

Example:
    python tools/compare_mixtures.py \\
        --doremi runs/doremi-demo-proxy/doremi/mixture.json \\
        --runs runs/demo-partitionsel/mixture.json random=runs/demo-random \\
        --manifest demo_out/shards/dolma --out runs/compare
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, print the table and write the Markdown table and the two figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doremi", type=Path, help="DoReMi's mixture.json (the proxy run's doremi/mixture.json)")
    parser.add_argument("--runs", nargs="*", default=[], help="other runs: mixture.json, its run directory, or LABEL=PATH")
    parser.add_argument("--manifest", type=Path, help="shard directory whose manifest gives the natural shares")
    parser.add_argument("--split", default="train", help="manifest split for the natural shares (default: train)")
    parser.add_argument(
        "--units",
        choices=("examples", "tokens"),
        default="examples",
        help="compare shares of examples (default; what mixture.json holds) or of tokens (needs --manifest)",
    )
    parser.add_argument("--out", type=Path, default=Path("mixture_comparison"), help="output directory")
    parser.add_argument("--title", help="figure title")
    args = parser.parse_args(argv)
    # torch (via composer_algos.mixture_io) loads after parsing, so --help is fast.
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by file path
    from comparison_plots import plot_grouped_bars, plot_trajectories  # tools/comparison_plots.py

    from composer_algos.doremi.compare import (
        build_columns,
        format_markdown,
        format_table,
        load_trajectory,
        to_token_shares,
    )

    if args.doremi is None and not args.runs:
        parser.error("give --doremi and/or --runs")

    if args.units == "tokens" and args.manifest is None:
        parser.error("--units tokens needs --manifest (tokens per example come from the shard manifest)")
    try:
        doremi, runs, natural = _read_inputs(args)
    except _InputError as e:
        print(f"compare_mixtures.py: {e}", file=sys.stderr)
        return 2
    if args.units == "tokens":
        if doremi is not None:
            doremi.weights = to_token_shares(dict(doremi.weights), args.manifest, args.split)
            init = doremi.extra.get("initial_weights")
            if isinstance(init, dict):
                doremi.extra["initial_weights"] = to_token_shares(init, args.manifest, args.split)
        for _, mix, _ in runs:
            mix.weights = to_token_shares(dict(mix.weights), args.manifest, args.split)
    names, columns = build_columns(
        doremi,
        [(label, mix) for label, mix, _ in runs],
        doremi_source=str(args.doremi),
        natural=natural,
        natural_source=f"{args.units[:-1]} shares of the {args.split} split in {args.manifest}/manifest.json",
        run_sources=[str(path) for _, _, path in runs],
    )
    print(format_table(names, columns))
    print(f"(shares of {args.units})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "comparison.md").write_text(format_markdown(names, columns))
    bars = plot_grouped_bars(names, columns, args.out / "comparison.png", title=args.title)
    written = [args.out / "comparison.md", bars]
    trajectories = []
    if doremi is not None and args.doremi is not None:
        trajectories.append(load_trajectory("DoReMi", args.doremi))
    trajectories += [load_trajectory(label, path) for label, _, path in runs]
    trajectories = [t for t in trajectories if t is not None]
    if trajectories:
        written.append(plot_trajectories(trajectories, args.out / "trajectories.png", title=args.title))
    else:
        print("no mixture_steps.csv next to the inputs; trajectories.png not written", file=sys.stderr)
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


class _InputError(Exception):
    """An input that is missing or unreadable, with the option that named it."""


def _read_inputs(args: argparse.Namespace) -> tuple:
    """DoReMi's mixture, the runs' (label, mixture, path) and the natural shares, all read before anything is
    written, so a missing or unreadable one is one line naming its option."""
    from composer_algos.doremi.compare import natural_sample_shares, natural_token_shares, read_labelled
    from composer_algos.mixture_io import read_mixture_json

    option = "--doremi"
    try:
        doremi = read_mixture_json(args.doremi) if args.doremi is not None else None
        runs = []
        for spec in args.runs:
            option = f"--runs {spec}"
            runs.append(read_labelled(spec))
        natural = None
        if args.manifest is not None:
            option = "--manifest"
            shares = natural_token_shares if args.units == "tokens" else natural_sample_shares
            natural = shares(args.manifest, args.split)
    except (OSError, ValueError) as e:
        raise _InputError(f"{option}: {e}") from e
    return doremi, runs, natural


if __name__ == "__main__":
    sys.exit(main())
