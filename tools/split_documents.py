"""Partition a Dolma corpus's documents into named parts (e.g. train / guide / eval) by a fixed hash of their ids.

Example:
    # 6% of each domain's documents guide selection, another 6% are evaluated, the rest train
    python tools/split_documents.py ../shared/data/ghpile --out runs/ghpile/docs --part guide=0.06 --part eval=0.06
    # then shard each part (train + its guiding val split; the evaluation documents on their own)
    python tools/shard.py dolma runs/ghpile/docs/train --val-file runs/ghpile/docs/guide --out ...
    python tools/shard.py dolma runs/ghpile/docs/eval --val-file runs/ghpile/docs/eval --out ...

Why: `tools/shard.py` holds out whole documents as one `val` split, and packs each split's documents
into sequences; the guide / evaluation partition of that split (`pipeline/holdout.py`) is then by
packed sequence, so a long document can lend sequences to both. Splitting the documents first gives
an evaluation set whose documents never guided a selection, in shards of their own.

Each document is ranked within its domain by a seeded 64-bit hash of (domain, id); the parts take
consecutive runs of that ranking in the order given, `round(fraction x n)` documents each (at least
one when the domain has more documents than parts), and the rest go to `--rest` (default `train`).
The partition depends only on the seed, the ids and the fractions (not on file order or layout),
and a part's documents stay in it when a later part's fraction changes.

Output: OUT/<part>/<domain dir>/part-000.jsonl.gz (the input lines, unchanged, in input order) and
OUT/split.json (the settings, each domain's directory, and documents and characters per part and
domain). The domain is the Dolma record's `source` (`--domain-from dir`: its directory), as
`tools/shard.py dolma` reads it; its directory is named as `tools/shard.py` names a domain's (a
filesystem-safe name, unique case-insensitively: `a/b` -> a_b, `../up` -> up, `Wiki` and `wiki` ->
Wiki and wiki-2), the same in every part. Inputs with no documents are an error (exit 2).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.corpora import (  # noqa: E402
    CorpusError,
    RecordError,
    iter_raw_records,
    list_input_files,
    make_corpus_spec,
    parse_record,
)
from pipeline.sharding import domain_dirs  # noqa: E402  (tools/shard.py's domain -> directory names)


def parse_part(text: str) -> tuple[str, float]:
    """`NAME=FRACTION` -> (name, fraction).

    Raises:
        ValueError: a malformed value, naming it.
    """
    name, sep, value = text.partition("=")
    if not sep or not name or "/" in name:
        raise ValueError(f"--part {text!r}: expected NAME=FRACTION, e.g. eval=0.05")
    try:
        fraction = float(value)
    except ValueError:
        raise ValueError(f"--part {text!r}: the fraction {value!r} is not a number") from None
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"--part {text!r}: the fraction must be in (0, 1), got {fraction}")
    return name, fraction


def document_rank_key(seed: int, domain: str, doc_id: str) -> int:
    """The seeded 64-bit hash that orders a domain's documents (smallest first)."""
    h = hashlib.blake2b(f"{seed}\x00{domain}\x00{doc_id}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def assign_parts(
    ids_by_domain: dict[str, list[str]], parts: list[tuple[str, float]], *, seed: int, rest: str
) -> dict[str, dict[str, str]]:
    """`{domain: {id: part}}`: each domain's documents ranked by hash, the parts taking consecutive runs.

    Args:
        ids_by_domain: the document ids of each domain (unique within a domain).
        parts: (name, fraction) in order; their fractions sum below 1.
        seed: the hash's seed.
        rest: the part of every document the named parts do not take.
    """
    out: dict[str, dict[str, str]] = {}
    for domain, ids in ids_by_domain.items():
        ranked = sorted(ids, key=lambda i: (document_rank_key(seed, domain, i), i))
        n = len(ranked)
        counts = [int(round(f * n)) for _, f in parts]
        if n > len(parts):  # every part gets a document, and the rest keeps one
            counts = [max(c, 1) for c in counts]
            while sum(counts) > n - 1:
                counts[counts.index(max(counts))] -= 1
        start = 0
        assigned = {}
        for (name, _), count in zip(parts, counts):
            for doc_id in ranked[start : start + count]:
                assigned[doc_id] = name
            start += count
        for doc_id in ranked[start:]:
            assigned[doc_id] = rest
        out[domain] = assigned
    return out


def main(argv: list[str] | None = None) -> int:
    p = _build_parser()
    args = p.parse_args(argv)
    try:
        parts = [parse_part(t) for t in args.part]
    except ValueError as e:
        p.error(str(e))
    if not parts:
        p.error("give at least one --part NAME=FRACTION")
    names = [n for n, _ in parts] + [args.rest]
    if len(set(names)) != len(names):
        p.error(f"--part / --rest names must differ, got {names}")
    if sum(f for _, f in parts) >= 1.0:
        p.error(f"--part fractions must sum below 1 (the rest goes to {args.rest!r}), got {sum(f for _, f in parts)}")
    if args.out.exists() and any(args.out.iterdir()):
        if not args.overwrite:
            p.error(f"--out {args.out} exists and is not empty (use --overwrite to replace it)")
        if not (args.out / "split.json").exists():
            p.error(f"--out {args.out} holds no split.json: refusing to delete a directory this tool did not write")

    records = _read_records(args)
    if not records:
        print(f"error: no documents in the inputs ({', '.join(map(str, args.inputs))}): nothing to split; "
              "check the files (blank lines are not documents)", file=sys.stderr)
        return 2

    ids_by_domain: dict[str, list[str]] = defaultdict(list)
    for domain, doc_id, _, _ in records:
        ids_by_domain[domain].append(doc_id)
    assignment = assign_parts(dict(ids_by_domain), parts, seed=args.seed, rest=args.rest)
    dirs = domain_dirs(list(ids_by_domain))

    tmp = args.out.with_name(f".{args.out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        stats = _write_parts(records, assignment, dirs, tmp, names)
        summary = {
            "inputs": [str(x) for x in args.inputs],
            "parts": dict(parts),
            "rest": args.rest,
            "seed": args.seed,
            "id_field": args.id_field,
            "domain_from": args.domain_from,
            "directories": dirs,
            "stats": stats,
        }
        (tmp / "split.json").write_text(json.dumps(summary, indent=1) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if args.out.exists():
        shutil.rmtree(args.out)
    tmp.rename(args.out)
    for name in names:
        docs = sum(e["documents"] for e in stats[name].values())
        chars = sum(e["characters"] for e in stats[name].values())
        print(f"{name}: {docs} documents, {chars / 1e6:.2f} M characters, "
              + ", ".join(f"{_shown(d, dirs[d])} {e['documents']}" for d, e in sorted(stats[name].items())))
    print(f"wrote {args.out}")
    return 0


def _shown(domain: str, directory: str) -> str:
    """The domain as the table shows it: with its directory when that is named differently."""
    return domain if directory == domain else f"{domain} (-> {directory}/)"


def _build_parser() -> argparse.ArgumentParser:
    """The inputs, the output folder, the parts and the hash's seed, the id and domain fields."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="Dolma files or directories")
    p.add_argument("--out", type=Path, required=True, help="output directory (must not exist unless --overwrite)")
    p.add_argument("--part", action="append", default=[], help="NAME=FRACTION (repeatable, in order)")
    p.add_argument("--rest", default="train", help="the part of the remaining documents (default: train)")
    p.add_argument("--seed", type=int, default=0, help="seed of the hash (default: 0)")
    p.add_argument("--id-field", default="id", help="the document id field (default: id)")
    p.add_argument("--domain-from", choices=("source", "dir"), default="source", help="domain: the record's "
                   "`source` field (default) or its directory, as tools/shard.py dolma --domain-from")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    return p


def _read_records(args: argparse.Namespace) -> list[tuple[str, str, bytes, int]]:
    """(domain, id, line, characters) of every input document, in input order; a bad or repeated id stops the tool."""
    spec = make_corpus_spec("dolma", domain_from="field" if args.domain_from == "source" else "dir")
    records: list[tuple[str, str, bytes, int]] = []  # (domain, id, line, characters)
    seen: dict[tuple[str, str], str] = {}
    try:
        files = list_input_files(args.inputs)
        for file in files:
            for raw in iter_raw_records(file):
                where = raw.where(file.display)
                try:
                    rec = parse_record(spec, raw, file.dir_domain)
                except RecordError as exc:
                    raise SystemExit(f"{where}: {exc}") from None
                if rec is None:
                    continue
                doc_id = rec.obj.get(args.id_field)
                if not isinstance(doc_id, (str, int)) or isinstance(doc_id, bool) or str(doc_id) == "":
                    raise SystemExit(f"{where}: field {args.id_field!r} must be a non-empty string or integer, got {doc_id!r}")
                doc_id = str(doc_id)
                if (rec.domain, doc_id) in seen:
                    raise SystemExit(f"{where}: id {doc_id!r} repeats in domain {rec.domain!r} (first at {seen[(rec.domain, doc_id)]})")
                seen[(rec.domain, doc_id)] = where
                line = raw.payload if isinstance(raw.payload, bytes) else json.dumps(raw.payload).encode()
                records.append((rec.domain, doc_id, line, len(rec.text or "")))
    except (CorpusError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    return records


def _write_parts(
    records: list[tuple[str, str, bytes, int]],
    assignment: dict[str, dict[str, str]],
    dirs: dict[str, str],
    tmp: Path,
    names: list[str],
) -> dict[str, dict[str, dict[str, int]]]:
    """Write each document's line to TMP/<part>/<dirs[domain]>/part-000.jsonl.gz; documents and characters per part and domain."""
    tmp.mkdir(parents=True)
    stats: dict[str, dict[str, dict[str, int]]] = {n: {} for n in names}
    writers: dict[tuple[str, str], gzip.GzipFile] = {}
    try:
        for domain, doc_id, line, chars in records:
            part = assignment[domain][doc_id]
            key = (part, domain)
            if key not in writers:
                path = tmp / part / dirs[domain] / "part-000.jsonl.gz"
                path.parent.mkdir(parents=True, exist_ok=True)
                writers[key] = gzip.GzipFile(path, "wb", mtime=0)  # mtime 0: byte-identical reruns
            writers[key].write(line + b"\n")
            entry = stats[part].setdefault(domain, {"documents": 0, "characters": 0})
            entry["documents"] += 1
            entry["characters"] += chars
    finally:
        for w in writers.values():
            w.close()
    return stats


if __name__ == "__main__":
    raise SystemExit(main())
