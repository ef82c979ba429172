"""Write the synthetic multi-domain sample corpus (Dolma, MetaMathQA and Mol-Instructions layouts).

Example:
    python tools/make_sample_corpus.py demo_out/corpus --seed 0 --scale 1.0

Writes OUTDIR/dolma/documents/<source>/*.json.gz (sources common-crawl, wiki, stackexchange,
reddit and the noisy `spam`), OUTDIR/metamathqa/MetaMathQA-sample.json (8 types with the paper's
shares) and OUTDIR/mol_instructions/<task>.json (the paper's four molecule tasks, SELFIES
strings). No real dataset text is used; the output is identical for the same seed and scale.
OUTDIR must be missing or empty, so that two corpora never mix; --overwrite first removes its
dolma/, metamathqa/ and mol_instructions/ (what this tool writes) and keeps anything else.
Shard it with tools/shard.py, e.g.
    python tools/shard.py dolma OUTDIR/dolma/documents --out OUT --tokenizer assets/tokenizer --max-seq-len 128
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sample_corpus import write_sample_corpus  # noqa: E402  (tools/sample_corpus.py)

# The top-level directories `write_sample_corpus` writes into (its layout), cleared by --overwrite.
_LAYOUT_DIRS = ("dolma", "metamathqa", "mol_instructions")


def _prepare_outdir(outdir: Path, overwrite: bool) -> str | None:
    """Check (and with `overwrite` clear) OUTDIR before anything is generated; a problem's message, or None."""
    if outdir.exists() and not outdir.is_dir():
        return f"{outdir} exists and is not a directory"
    held = sorted(p.name for p in outdir.iterdir()) if outdir.exists() else []
    if not held:
        return None
    if not overwrite:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        return (f"{outdir} is not empty (it holds {shown}): a new corpus there would mix with the files already "
                "in it; give a new or empty directory, or --overwrite to replace " + "/, ".join(_LAYOUT_DIRS) + "/")
    for name in _LAYOUT_DIRS:
        path = outdir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", type=Path, help="directory to write (created if missing; must be empty unless --overwrite)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every record count (default: 1.0, ~0.7M Dolma tokens)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty OUTDIR: remove its " + "/, ".join(_LAYOUT_DIRS) + "/ first, keep the rest")
    args = parser.parse_args(argv)
    if not args.scale > 0:
        parser.error(f"--scale must be > 0, got {args.scale}")
    problem = _prepare_outdir(args.outdir, args.overwrite)
    if problem:
        parser.error(problem)
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
