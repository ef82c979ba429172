"""Convert Dolma, MetaMathQA, Mol-Instructions or generic JSON Lines into per-domain MDS shards with a manifest.

Examples:
    # Dolma tree -> pretraining sequences of 128 tokens, domain = `source`, 2% held out per domain
    python tools/shard.py dolma corpus/dolma/documents --out data/dolma --tokenizer assets/tokenizer \\
        --max-seq-len 128 --val-fraction 0.02 --workers 2

    # MetaMathQA JSON array -> fine-tuning examples (Alpaca prompt, loss on the response), 64 val per type
    python tools/shard.py metamathqa corpus/metamathqa/MetaMathQA-sample.json --out data/metamath \\
        --tokenizer assets/tokenizer --max-seq-len 512 --val-count 64

    # Mol-Instructions task files, train split only, domain = metadata.task
    python tools/shard.py mol corpus/mol_instructions --out data/mol --tokenizer assets/tokenizer --max-seq-len 512

    # An existing train/test pair: every record of --val-file goes to the validation split
    python tools/shard.py metamathqa train.json --val-file test.json --out data/mm --max-seq-len 512

    # Any JSON Lines: prompt/response pairs with a domain field; bad lines go to OUT/rejects.jsonl
    python tools/shard.py jsonl data.jsonl --prompt-field question --response-field answer --domain-field topic \\
        --out data/qa --tokenizer assets/tokenizer --max-seq-len 256 --on-error skip

    # Check an output: manifest, shard hashes, sample and token counts
    python tools/shard.py verify data/dolma

Output (OUT): manifest.json; train/<domain>/ and val/<domain>/ MDS directories (zstd, sha1 + xxh64);
rejects.jsonl with --on-error skip. pretrain mode writes column `input_ids` (int32; each domain's
records tokenized, EOS appended, concatenated within the domain and split only, cut into
max_seq_len sequences, the last one holding the remainder). finetune mode writes `prompt_ids`,
`response_ids` (EOS appended) and `record` ("file:line" or "file:index"). Input: `.json.gz`,
`.jsonl.gz`, `.json.zst`, `.jsonl.zst`, `.json`, `.jsonl` files or directories searched recursively;
JSON Lines or a JSON array (told apart by the first character). The output is built in a
temporary directory beside OUT (.OUT.tmp-<pid>-<random>) and moved into place only when complete;
Ctrl-C removes it and exits with 130, and a later run into OUT removes one that a killed run left.
An output with no records (empty inputs, every record rejected) is an error (exit 1), and so is a full
disk: one line says what had been written, and nothing is kept. With --workers N > 1 the tokenizer processes
start with forkserver (spawn where there is none), never fork, which can hang a process that runs threads
(issue 20); that costs about 0.1 s per run at 2 workers and saves about as much at 8 (tools/bench/bench_shard.py
--start-methods fork,forkserver). A program that calls `pipeline.sharding.shard_corpus` with workers > 1 must
keep its top-level code under `if __name__ == "__main__":`, since the workers import its main module.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Light modules only: Streaming (torch) and transformers load when a run starts, so --help is fast.
from pipeline import sharding  # noqa: E402
from pipeline.corpora import CORPUS_FORMATS, load_domain_map, make_corpus_spec  # noqa: E402
from pipeline.manifest import verify_output  # noqa: E402
from pipeline.prompts import PROMPT_TEMPLATES  # noqa: E402
from pipeline.sharding import TRUNCATIONS, ShardError, ShardOptions, format_summary  # noqa: E402
from pipeline.tokenizer import DEMO_TOKENIZER  # noqa: E402

_FORMAT_HELP = {
    "dolma": "Dolma documents (id, text, source, ...): files or a documents/<source>/ tree; default mode pretrain",
    "metamathqa": "MetaMathQA JSON array (query, response, type) or a hub name such as meta-math/MetaMathQA; default mode finetune",
    "mol": "Mol-Instructions per-task JSON arrays (instruction, input, output, metadata.task/split); default mode finetune",
    "jsonl": "generic JSON Lines (or JSON arrays) with --text-field or --prompt-field/--response-field; default by fields",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shard.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join((*CORPUS_FORMATS, "verify")) + "}")
    for fmt in CORPUS_FORMATS:
        p = sub.add_parser(fmt, help=_FORMAT_HELP[fmt], description=_FORMAT_HELP[fmt])
        _add_shard_args(p, fmt)
    v = sub.add_parser("verify", help="check an output directory against its manifest", description=verify_output.__doc__)
    v.add_argument("dir", type=Path, help="output directory of a shard run")
    v.add_argument("--check-inputs", action="store_true", help="also re-hash the input files that still exist")
    return parser


def _add_shard_args(p: argparse.ArgumentParser, fmt: str) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="input files or directories (searched recursively)")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, required=True, help="output directory (must not exist unless --overwrite)")
    g.add_argument("--overwrite", action="store_true", help="replace an existing output (one holding a manifest.json, or empty)")
    g.add_argument("--mode", choices=("pretrain", "finetune"), help="pretrain: packed input_ids; finetune: prompt_ids/response_ids (default: per format)")
    g.add_argument("--tokenizer", help="tokenizer directory, hub name or .gguf model file (converted once, cached): the model's "
                   "(default: the committed 4096-token demo tokenizer, which only the demo's models read; said when used)")
    g.add_argument("--max-seq-len", type=int, required=True, help="pretrain: sequence length; finetune: cap on prompt + response tokens")
    g.add_argument("--size-limit", default="64mb", help="MDS shard size limit (default: 64mb)")

    g = p.add_argument_group("domains")
    choices = ("source", "field", "dir") if fmt == "dolma" else ("field", "dir")
    g.add_argument(
        "--domain-from",
        choices=choices,
        default="field",
        help="domain from the record's domain field ('source' for Dolma, 'type' for MetaMathQA, 'metadata.task' for mol, "
        "--domain-field for jsonl) or from the directory (for Dolma the <source> of documents/<source>/...) (default: field)",
    )
    g.add_argument("--domain-map", type=Path, help="JSON/YAML mapping raw domain -> domain (merge or rename); every domain must be mapped, '*' maps the rest")
    if fmt == "jsonl":
        g.add_argument("--domain-field", default="domain", help="dotted path of the domain field (default: domain)")
        f = p.add_argument_group("fields (dotted paths)")
        f.add_argument("--text-field", help="text for pretraining (default: text, unless --prompt-field/--response-field are given)")
        f.add_argument("--prompt-field", help="prompt / instruction (default with --response-field: prompt)")
        f.add_argument("--input-field", help="optional context appended by the prompt template")
        f.add_argument("--response-field", help="response (default with --prompt-field: response)")
        f.add_argument("--split-field", help="split label field, for --split")
    if fmt in ("mol", "jsonl"):
        g.add_argument("--split", default="train" if fmt == "mol" else "any", help="keep records whose split label equals this; 'any' keeps all; records without a label are kept (default: %(default)s)")

    g = p.add_argument_group("validation split (deterministic: a seeded hash of each record's content)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--val-fraction", type=float, help="hold out each record with this probability, per domain")
    x.add_argument(
        "--val-count", type=int,
        help="hold out this many records per domain, those of the smallest content hashes (the same whatever the "
        "input order); a domain of at most this many keeps one record for training. Without --val-fraction, "
        "--val-count or --val-file there is no validation split",
    )
    x.add_argument(
        "--val-file",
        nargs="+",
        metavar="VAL_INPUT",
        help="files or directories whose records all form the validation split (an existing train/test pair); "
        "the --split filter does not apply to them; every domain in them must also be in the INPUTs",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the split (default: 0)")

    if fmt != "dolma":
        g = p.add_argument_group("fine-tuning")
        g.add_argument(
            "--prompt-template",
            help=f"one of {sorted(PROMPT_TEMPLATES)} or a string with {{instruction}} and optionally {{input}} "
            f"(default: {'none' if fmt == 'jsonl' else 'alpaca, as MetaMath'})",
        )
        g.add_argument(
            "--truncation",
            choices=TRUNCATIONS,
            default="left_prompt",
            help="examples over --max-seq-len: left_prompt drops prompt tokens from the left (keeps the response), right cuts "
            "the end, left_prompt_right drops prompt tokens from the left and, when the response alone is too long, keeps the "
            "prompt's last max_seq_len/2 tokens and cuts the response's end (never drops), skip drops the example; examples "
            "that cannot keep a prompt and a response token are dropped and counted as rejected; the summary's last line "
            "shows what each domain lost (default: left_prompt)",
        )

    g = p.add_argument_group("execution")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes, one thread each; the output does not depend on it (default: 1)")
    g.add_argument(
        "--on-error",
        choices=("stop", "skip"),
        default="stop",
        help="bad input (malformed JSON, missing field, empty text, invalid UTF-8, unmapped domain): stop with file:line "
        "(default), or skip and write it to OUT/rejects.jsonl",
    )
    g.add_argument("--chunk-records", type=int, default=256, help="records per worker task (default: 256)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.command == "verify":
        problems = verify_output(args.dir, check_inputs=args.check_inputs)
        for problem in problems:
            print(f"PROBLEM: {problem}")
        print(f"{args.dir}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 0 if not problems else 1
    if args.tokenizer is None:
        args.tokenizer = DEMO_TOKENIZER
        print(f"shard.py: no --tokenizer: writing the ids of the demo tokenizer {DEMO_TOKENIZER} (4096 tokens); a run whose "
              "model has another tokenizer will refuse these shards", flush=True)  # stdout: errors keep stderr's one line
    try:
        spec = make_corpus_spec(
            args.command,
            domain_from=args.domain_from,
            domain_map=load_domain_map(args.domain_map) if args.domain_map else None,
            domain_map_source=str(args.domain_map) if args.domain_map else None,
            split=getattr(args, "split", None),
            text_field=getattr(args, "text_field", None),
            prompt_field=getattr(args, "prompt_field", None),
            input_field=getattr(args, "input_field", None),
            response_field=getattr(args, "response_field", None),
            domain_field=getattr(args, "domain_field", None),
            split_field=getattr(args, "split_field", None),
        )
        options = ShardOptions(
            out=args.out,
            tokenizer=args.tokenizer,
            max_seq_len=args.max_seq_len,
            mode=args.mode,
            prompt_template=getattr(args, "prompt_template", None),
            truncation=getattr(args, "truncation", "left_prompt"),
            val_fraction=args.val_fraction,
            val_count=args.val_count,
            val_inputs=args.val_file,
            seed=args.seed,
            workers=args.workers,
            on_error=args.on_error,
            overwrite=args.overwrite,
            size_limit=args.size_limit,
            progress=not args.no_progress,
            chunk_records=args.chunk_records,
            command=shlex.join(["tools/shard.py", *argv]),
        )
        result = sharding.shard_corpus(spec, args.inputs, options)
    except (ValueError, ShardError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except KeyboardInterrupt:
        # shard_corpus has removed its staging directory; an existing output is untouched.
        print(f"interrupted: nothing written, {args.out} left as it was", file=sys.stderr)
        return 130
    print(format_summary(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
