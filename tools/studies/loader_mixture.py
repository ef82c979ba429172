"""How far the first samples of an epoch stray from the corpus's domain mixture, for each Streaming shuffle.

`tools/shard.py` writes every domain to its own shards, and Streaming shuffles at shard granularity
first. With few shards per domain (a fine-tuning set: dm_math has one per domain), `py1e`, Streaming's
default, places each shard's samples uniformly over a range clipped at the ends of the epoch, so the
first positions take about as many samples from every shard, whatever its size: the first pools lean
towards equal domain shares. This prints, for each shuffle algorithm, the total variation between the
domain shares of the epoch's first N samples and the corpus's shares (mean over seeds), beside what
independent draws from the corpus would give (the multinomial expectation, by simulation).

The order is Streaming's own (`streaming.base.shuffle.get_shuffle` over the split's shard sizes in the
manifest's domain order): the loader's order for the natural mixture on one node, one rank
(`tests/tools/test_loader_mixture.py` checks it against `DomainStreamingDataset`).

Example:
    python tools/studies/loader_mixture.py runs/ft/shards_dm_math --samples 320 2000
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
ALGOS = ("py1e", "py1br", "py1s", "py2s", "naive")


def shard_sizes(shard_dir: str | Path, split: str = "train") -> tuple[list[str], np.ndarray, np.ndarray]:
    """(domain names, samples per shard in stream order, each shard's domain index) of a split."""
    sys.path.insert(0, str(REPO))
    from pipeline.dataset import streamed_domains
    from pipeline.manifest import load_manifest

    manifest = load_manifest(shard_dir)
    names, sizes, domain_of = [], [], []
    for k, (domain_id, _) in enumerate(streamed_domains(manifest, shard_dir=str(shard_dir), split=split)):
        info = manifest.domains[domain_id]
        names.append(info.name)
        index = json.loads((Path(shard_dir) / split / info.dir / "index.json").read_text())
        for shard in index["shards"]:
            sizes.append(int(shard["samples"]))
            domain_of.append(k)
    return names, np.asarray(sizes, dtype=np.int64), np.asarray(domain_of, dtype=np.int64)


def epoch_order(sizes: np.ndarray, algo: str, seed: int, *, block_size: int = 1 << 18, canonical_nodes: int = 1) -> np.ndarray:
    """Streaming's shuffled order of the epoch's sample ids (epoch 0)."""
    from streaming.base.shuffle import get_shuffle

    return get_shuffle(algo, sizes, canonical_nodes, seed, 0, block_size)


def prefix_tv(
    sizes: np.ndarray, domain_of: np.ndarray, algo: str, seeds: Sequence[int], samples: int, *, block_size: int = 1 << 18
) -> float:
    """Mean over seeds of the total variation between the first `samples` samples' domain shares and the corpus's."""
    n_domains = int(domain_of.max()) + 1
    domain_per_sample = np.repeat(domain_of, sizes)
    natural = np.bincount(domain_per_sample, minlength=n_domains) / len(domain_per_sample)
    tvs = []
    for seed in seeds:
        first = domain_per_sample[epoch_order(sizes, algo, seed, block_size=block_size)[:samples]]
        shares = np.bincount(first, minlength=n_domains) / len(first)
        tvs.append(0.5 * float(np.abs(shares - natural).sum()))
    return float(np.mean(tvs))


def iid_tv(sizes: np.ndarray, domain_of: np.ndarray, samples: int, draws: int = 2000) -> float:
    """The same distance for `samples` independent draws from the corpus (what a perfect shuffle gives)."""
    n_domains = int(domain_of.max()) + 1
    natural = np.bincount(np.repeat(domain_of, sizes), minlength=n_domains) / sizes.sum()
    rng = np.random.default_rng(0)
    counts = rng.multinomial(samples, natural, size=draws) / samples
    return float(0.5 * np.abs(counts - natural).sum(axis=1).mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shard_dir", help="output directory of tools/shard.py")
    p.add_argument("--split", default="train", choices=("train", "val"))
    p.add_argument("--samples", type=int, nargs="+", default=[320, 2000], help="prefix lengths (default 320 2000)")
    p.add_argument("--seeds", default="17-36", help="shuffle seeds, A-B or comma-separated (default 17-36)")
    p.add_argument("--algos", default=",".join(ALGOS), help=f"comma-separated subset of {','.join(ALGOS)}")
    p.add_argument("--block-size", type=int, default=1 << 18, help="shuffle_block_size (Streaming's default 262144)")
    args = p.parse_args(argv)
    if not (Path(args.shard_dir) / "manifest.json").exists():
        p.error(f"{args.shard_dir}: no manifest.json (give the output directory of tools/shard.py)")
    algos = [a for a in args.algos.split(",") if a]
    if bad := [a for a in algos if a not in ALGOS]:
        p.error(f"--algos: unknown {bad}; allowed: {', '.join(ALGOS)}")
    if "-" in args.seeds:
        lo, hi = (int(x) for x in args.seeds.split("-"))
        seeds = list(range(lo, hi + 1))
    else:
        seeds = [int(x) for x in args.seeds.split(",") if x]
    if any(n < 1 for n in args.samples) or not seeds:
        p.error("--samples must be >= 1 and --seeds non-empty")
    names, sizes, domain_of = shard_sizes(args.shard_dir, args.split)
    natural = np.bincount(np.repeat(domain_of, sizes), minlength=len(names)) / sizes.sum()
    print(f"{args.shard_dir} ({args.split}): {int(sizes.sum())} samples in {len(sizes)} shards over {len(names)} domains; "
          f"shares " + ", ".join(f"{n} {s:.3f}" for n, s in zip(names, natural)))
    print(f"total variation from those shares of the epoch's first N samples, mean over {len(seeds)} seeds:")
    print("| shuffle | " + " | ".join(f"N = {n}" for n in args.samples) + " |")
    print("|---|" + "---:|" * len(args.samples))
    for algo in algos:
        cells = [f"{prefix_tv(sizes, domain_of, algo, seeds, n, block_size=args.block_size):.3f}" for n in args.samples]
        print(f"| {algo} | " + " | ".join(cells) + " |")
    print("| independent draws | " + " | ".join(f"{iid_tv(sizes, domain_of, n):.3f}" for n in args.samples) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
