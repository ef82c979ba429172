"""Plot the per-step fraction of conflicting gradient pairs per strategy (the paper's conflict figure).

Reads each run's `selection_log.csv` (written by the MixtureMonitor callback), averages runs of the
same strategy, smooths, plots, and prints a per-strategy summary.

Example:
    python tools/studies/plot_conflicts.py runs/id_seed0 runs/id_seed1 runs/partitionsel_seed0 \\
        --out conflicts.png --window 25 --summary-json conflicts.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, write the plot (and summary), print the summary table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories with selection_log.csv (or the CSV files)")
    parser.add_argument("--out", default="conflicts.png", help="image path (default conflicts.png)")
    parser.add_argument("--window", type=int, default=25, help="moving-average window in steps (1 = raw)")
    parser.add_argument("--skip-steps", type=int, default=0, help="leave steps below this out of the summary")
    parser.add_argument("--title", help="plot title")
    parser.add_argument("--summary-json", help="also write the per-strategy summary here")
    args = parser.parse_args(argv)
    # numpy and matplotlib load after parsing, so --help is fast.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also when loaded by file path
    from comparison_plots import plot_conflicts  # tools/comparison_plots.py

    from pipeline.evaluation.conflicts import load_conflict_curves, summarize_conflicts

    if args.window < 1:
        parser.error(f"--window must be >= 1, got {args.window}")

    curves = load_conflict_curves(args.runs)
    if not curves:
        print("no selection_log.csv row has a conflict_fraction; nothing to plot", file=sys.stderr)
        return 1
    out = plot_conflicts(curves, args.out, window=args.window, title=args.title)
    summary = summarize_conflicts(curves, skip_steps=args.skip_steps)
    print(f"{'strategy':<20} {'runs':>4} {'steps':>6} {'mean':>8} {'median':>8} {'last':>8}")
    for strategy, s in summary.items():
        print(
            f"{strategy:<20} {int(s['n_runs']):>4} {int(s['n_steps']):>6} "
            f"{s['mean']:>8.4f} {s['median']:>8.4f} {s['last']:>8.4f}"
        )
    print(f"wrote {out}")
    if args.summary_json:
        clean = {k: {m: (None if math.isnan(v) else v) for m, v in d.items()} for k, d in summary.items()}
        with open(args.summary_json, "w", encoding="utf-8") as f:
            json.dump(clean, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
