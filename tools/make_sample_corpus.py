"""Write the synthetic multi-domain sample corpus (Dolma, MetaMathQA and Mol-Instructions layouts).

Example:
    python tools/make_sample_corpus.py demo_out/corpus --seed 0 --scale 1.0

Writes OUTDIR/dolma/documents/<source>/*.json.gz (sources common-crawl, wiki, stackexchange,
reddit and the noisy `spam`), OUTDIR/metamathqa/MetaMathQA-sample.json (8 types with the paper's
shares) and OUTDIR/mol_instructions/<task>.json (the paper's four molecule tasks, SELFIES
strings). No real dataset text is used; the output is identical for the same seed and scale.
Shard it with tools/shard.py, e.g.
    python tools/shard.py dolma OUTDIR/dolma/documents --out OUT --tokenizer assets/tokenizer --max-seq-len 128
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sample_corpus import write_sample_corpus  # noqa: E402  (tools/sample_corpus.py)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", type=Path, help="directory to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every record count (default: 1.0, ~0.7M Dolma tokens)")
    args = parser.parse_args(argv)
    if not args.scale > 0:
        parser.error(f"--scale must be > 0, got {args.scale}")
    start = time.perf_counter()
    summary = write_sample_corpus(args.outdir, seed=args.seed, scale=args.scale)
    size = sum((args.outdir / f).stat().st_size for f in summary.files)
    print(f"wrote {len(summary.files)} files, {size / 1e6:.2f} MB, to {args.outdir} in {time.perf_counter() - start:.1f}s")
    for title, counts in (("dolma source", summary.dolma_docs), ("metamathqa type", summary.metamath_records), ("mol task", summary.mol_records)):
        for name, n in counts.items():
            print(f"  {title:16s} {name:36s} {n:6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
