"""Train a byte-level BPE tokenizer offline: on your own corpus, or on the generated demo corpus.

Examples:
    # On your corpus: any input tools/shard.py reads (same formats, field options and domain-free)
    python tools/train_tokenizer.py --format dolma --input /data/dolma/documents --out my_tokenizer --vocab-size 32000
    python tools/train_tokenizer.py --format metamathqa --input MetaMathQA-395K.json --out mm_tok --vocab-size 8192
    python tools/train_tokenizer.py --format jsonl --input qa.jsonl --prompt-field question --response-field answer \\
        --out qa_tok --vocab-size 8192

    # The committed demo tokenizer (assets/tokenizer), from the in-memory sample corpus
    python tools/train_tokenizer.py --out assets/tokenizer --overwrite --vocab-size 4096 --seed 0

With --input, every record the shard readers accept is used once, in file order (at most
--max-records): pretraining text as is, instruction records as the rendered prompt (Alpaca
template for metamathqa and mol, as the sharder's default; --prompt-template to change it), a
space, and the response. Bad records are skipped and counted; an unreadable file stops the run.
Without --input the corpus is generated in memory (tools/sample_corpus.py, the same generator
as tools/make_sample_corpus.py), so the result depends only on the seed, the scale and the vocab
size. The tokenizer has `<|endoftext|>` (EOS) and `<|pad|>` (padding) as special tokens, no
BOS, and adds no special tokens on its own; it loads offline with
`AutoTokenizer.from_pretrained(OUT)`, so `tools/shard.py --tokenizer OUT` and the yamls' tokenizer
settings accept it.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.corpora import (  # noqa: E402
    CORPUS_FORMATS,
    CorpusError,
    RecordError,
    iter_raw_records,
    list_input_files,
    make_corpus_spec,
    parse_record,
)
from pipeline.prompts import render_prompt  # noqa: E402

# tokenizers and transformers load after argument parsing, so --help is fast.
if TYPE_CHECKING:
    from tokenizers import Tokenizer

EOS, PAD = "<|endoftext|>", "<|pad|>"
_STATS_TEXTS = 10_000  # chars/token is measured on the first texts only, to bound memory on a large corpus


def corpus_texts(seed: int, scale: float) -> list[str]:
    """All texts of the sample corpus, prompts rendered with the Alpaca template, in a fixed order."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sample_corpus import (
        generate_dolma_documents,
        generate_metamathqa,
        generate_mol_instructions,
    )

    texts = [doc["text"] for docs in generate_dolma_documents(seed, scale).values() for doc in docs]
    for rec in generate_metamathqa(seed, scale):
        texts.append(render_prompt("alpaca", rec["query"]) + " " + rec["response"])
    for records in generate_mol_instructions(seed, scale).values():
        for rec in records:
            texts.append(render_prompt("alpaca", rec["instruction"], rec["input"]) + " " + rec["output"])
    return texts


class InputTexts:
    """The texts of a corpus read with the shard readers, as a one-pass iterator; counts what it skipped.

    Args:
        fmt: One of `pipeline.corpora.CORPUS_FORMATS`.
        inputs: Files or directories.
        fields: Field overrides for `make_corpus_spec` (text_field, prompt_field, ...).
        prompt_template: Template for instruction records (None: "alpaca", or "none" for jsonl).
        max_records: Stop after this many texts (None: all).

    Raises (while iterating):
        CorpusError: An input file cannot be read.
    """

    def __init__(
        self,
        fmt: str,
        inputs: list[str],
        fields: dict[str, str | None],
        prompt_template: str | None,
        max_records: int | None,
    ) -> None:
        self.spec = make_corpus_spec(fmt, **fields)
        self.files = list_input_files(inputs)
        self.template = prompt_template or ("none" if fmt == "jsonl" else "alpaca")
        self.max_records = max_records
        self.count = 0
        self.bad = 0
        self.first_bad: str | None = None

    def __iter__(self) -> Iterator[str]:
        for file in self.files:
            for raw in iter_raw_records(file):
                if self.max_records is not None and self.count >= self.max_records:
                    return
                try:
                    rec = parse_record(self.spec, raw, file.dir_domain)
                except RecordError as exc:
                    self.bad += 1
                    self.first_bad = self.first_bad or f"{raw.where(file.display)}: {exc.problem}"
                    continue
                if rec is None:
                    continue
                self.count += 1
                if self.spec.is_instruction:
                    yield render_prompt(self.template, rec.instruction, rec.input) + " " + rec.response
                else:
                    yield rec.text


def train(texts: list[str] | Iterator[str], vocab_size: int, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenization) with the two special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory (a new one, or give --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace a tokenizer already in --out")
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size incl. specials (default: 4096)")
    g = parser.add_argument_group("your corpus (any input tools/shard.py accepts)")
    g.add_argument("--input", nargs="+", metavar="INPUT", help="files or directories; without it, the demo corpus")
    g.add_argument("--format", choices=CORPUS_FORMATS, default="jsonl", help="corpus format (default: jsonl)")
    g.add_argument("--text-field", help="jsonl: dotted path of the text (default: text)")
    g.add_argument("--prompt-field", help="jsonl: prompt / instruction field (default with --response-field: prompt)")
    g.add_argument("--input-field", help="jsonl: optional context field")
    g.add_argument("--response-field", help="jsonl: response field (default with --prompt-field: response)")
    g.add_argument("--prompt-template", help="instruction records: template name or string (default: alpaca; jsonl: none)")
    g.add_argument("--max-records", type=int, help="use at most this many records (default: all)")
    g = parser.add_argument_group("demo corpus (without --input)")
    g.add_argument("--seed", type=int, default=0, help="sample-corpus seed (default: 0)")
    g.add_argument("--scale", type=float, default=1.0, help="sample-corpus scale (default: 1.0)")
    args = parser.parse_args(argv)
    if args.vocab_size < 300:
        parser.error(f"--vocab-size must be >= 300 (256 bytes + specials + merges), got {args.vocab_size}")
    if args.max_records is not None and args.max_records < 1:
        parser.error(f"--max-records must be >= 1, got {args.max_records}")
    existing = [f for f in ("tokenizer.json", "tokenizer_config.json") if (Path(args.out) / f).exists()]
    if existing and not args.overwrite:
        parser.error(f"--out {args.out} already holds a tokenizer ({', '.join(existing)}); give another directory, "
                     "or --overwrite to replace it")
    from transformers import PreTrainedTokenizerFast

    reader = None
    try:
        if args.input:
            fields = {k: getattr(args, k) for k in ("text_field", "prompt_field", "input_field", "response_field")}
            reader = InputTexts(args.format, args.input, fields, args.prompt_template, args.max_records)
            sample: list[str] = []
            texts = _keep_first(reader, sample, _STATS_TEXTS)
            tok = train(texts, args.vocab_size)
            if reader.count == 0:
                raise ValueError(f"no usable records in {args.input} (format {args.format}); first problem: {reader.first_bad}")
        else:
            sample = corpus_texts(args.seed, args.scale)
            tok = train(sample, args.vocab_size, length=len(sample))
    except (ValueError, CorpusError) as exc:  # CorpusError is a ValueError; named for the reader
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    n_texts = reader.count if reader is not None else len(sample)
    n_chars = sum(map(len, sample))
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(sample, add_special_tokens=False))
    digest = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()[:16]
    skipped = ""
    if reader is not None and reader.bad:
        skipped = f"; {reader.bad} bad record{'s' if reader.bad != 1 else ''} skipped (first: {reader.first_bad})"
    print(
        f"wrote {out} (vocab {tok.get_vocab_size()}, {n_chars / max(n_tokens, 1):.2f} chars/token on "
        f"{'' if len(sample) == n_texts else f'the first {len(sample)} of '}{n_texts} texts, "
        f"tokenizer.json sha256 {digest}){skipped}"
    )
    return 0


def _keep_first(texts: InputTexts, kept: list[str], n: int) -> Iterator[str]:
    """Pass the texts through, keeping the first `n` in `kept` (for the chars/token figure)."""
    for text in texts:
        if len(kept) < n:
            kept.append(text)
        yield text


if __name__ == "__main__":
    raise SystemExit(main())
