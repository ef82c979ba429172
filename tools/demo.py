"""The embedded demo: generate a multi-domain corpus, shard it, train a tiny Llama with PartitionSel.

Example:
    python tools/demo.py                       # everything under demo_out/, about 5 minutes on 2 cores
    python tools/demo.py --steps 100 --strategy random

Offline from end to end: the corpus is synthetic (tools/make_sample_corpus.py), the tokenizer is
the committed assets/tokenizer, and the model is built from a config. It prints the per-domain
validation loss at the end of training and the domain mixture PartitionSel induced next to the
mixture of the candidate pools it chose from.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.sample_corpus import write_sample_corpus  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "demo_out", help="working directory (default: demo_out/)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default: 300)")
    parser.add_argument(
        "--strategy",
        default="partitionsel",
        help="selection strategy: partitionsel, greats, id, iwd, gradnorm, colm, random, random_stratified, none",
    )
    parser.add_argument("--seed", type=int, default=17, help="training seed (default: 17)")
    parser.add_argument("--yaml", type=Path, default=REPO / "yamls" / "testing" / "demo_dolma.yaml")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out: Path = args.out
    corpus, shards, run_dir = out / "corpus", out / "shards" / "dolma", out / "runs" / f"demo-{args.strategy}"

    print(f"[1/3] writing the synthetic corpus to {corpus}", flush=True)
    summary = write_sample_corpus(corpus, seed=0, scale=1.0)
    for name, n in summary.dolma_docs.items():
        print(f"      {name:14s} {n:6d} documents")

    print(f"[2/3] sharding the Dolma-style sources into {shards}", flush=True)
    _run(
        [
            sys.executable,
            str(REPO / "tools" / "shard.py"),
            "dolma",
            str(corpus / "dolma" / "documents"),
            "--out",
            str(shards),
            "--tokenizer",
            str(REPO / "assets" / "tokenizer"),
            "--max-seq-len",
            "128",
            "--val-count",
            "32",
            "--overwrite",
        ]
    )

    print(f"[3/3] training a tiny Llama for {args.steps} steps with strategy={args.strategy}", flush=True)
    _run(
        [
            sys.executable,
            str(REPO / "train.py"),
            str(args.yaml),
            f"variables.shard_dir={shards}",
            f"max_duration={args.steps}ba",
            f"save_folder={run_dir}",
            "save_overwrite=true",
            f"seed={args.seed}",
            f"algorithms.data_selection.strategy={args.strategy}",
        ]
    )
    print_mixture(run_dir)
    print(f"\ndemo finished in {time.perf_counter() - start:.0f}s; run files in {run_dir}")
    return 0


def print_mixture(run_dir: Path) -> None:
    """Print the induced mixture (mean over steps) next to the pools' mixture and the natural shares."""
    mixture_file = run_dir / "mixture.json"
    log_file = run_dir / "selection_log.csv"
    if not mixture_file.exists() or not log_file.exists():
        print(f"(no mixture files in {run_dir})")
        return
    mix = json.loads(mixture_file.read_text())
    with open(log_file, newline="") as f:
        rows = list(csv.DictReader(f))
    names = mix["domains"]
    pool = {n: sum(float(r[f"pool/{n}"]) for r in rows) / max(len(rows), 1) for n in names}
    natural = mix.get("natural") or {}
    print(f"\nDomain mixture over {mix['steps']} steps (method {mix['method']}):")
    print(f"{'domain':<16}{'natural':>10}{'pool':>10}{'selected':>10}")
    for n in names:
        print(f"{n:<16}{natural.get(n, float('nan')):>10.3f}{pool[n]:>10.3f}{mix['weights'][n]:>10.3f}")


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"command failed with exit code {result.returncode}: {' '.join(cmd)}")


if __name__ == "__main__":
    raise SystemExit(main())
