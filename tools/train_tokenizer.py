"""Train the demo byte-level BPE tokenizer on the generated sample corpus.

Example:
    python tools/train_tokenizer.py --out assets/tokenizer --vocab-size 4096 --seed 0

The corpus is generated in memory (pipeline.sample_corpus, the same generator as
tools/make_sample_corpus.py), so the result depends only on the seed, the scale and the vocab
size. The tokenizer has `<|endoftext|>` (EOS) and `<|pad|>` (padding) as special tokens, no
BOS, and adds no special tokens on its own; it loads offline with
`AutoTokenizer.from_pretrained(OUT)`.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.prompts import render_prompt  # noqa: E402
from pipeline.sample_corpus import generate_dolma_documents, generate_metamathqa, generate_mol_instructions  # noqa: E402

EOS, PAD = "<|endoftext|>", "<|pad|>"


def corpus_texts(seed: int, scale: float) -> list[str]:
    """All texts of the sample corpus, prompts rendered with the Alpaca template, in a fixed order."""
    texts = [doc["text"] for docs in generate_dolma_documents(seed, scale).values() for doc in docs]
    for rec in generate_metamathqa(seed, scale):
        texts.append(render_prompt("alpaca", rec["query"]) + " " + rec["response"])
    for records in generate_mol_instructions(seed, scale).values():
        for rec in records:
            texts.append(render_prompt("alpaca", rec["instruction"], rec["input"]) + " " + rec["output"])
    return texts


def train(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenization) with the two special tokens."""
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
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="assets/tokenizer", help="output directory (default: assets/tokenizer)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size incl. specials (default: 4096)")
    parser.add_argument("--seed", type=int, default=0, help="sample-corpus seed (default: 0)")
    parser.add_argument("--scale", type=float, default=1.0, help="sample-corpus scale (default: 1.0)")
    args = parser.parse_args(argv)
    if args.vocab_size < 300:
        parser.error(f"--vocab-size must be >= 300 (256 bytes + specials + merges), got {args.vocab_size}")

    texts = corpus_texts(args.seed, args.scale)
    tok = train(texts, args.vocab_size)
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
    n_chars = sum(map(len, texts))
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    digest = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()[:16]
    print(f"wrote {out} (vocab {tok.get_vocab_size()}, {n_chars / n_tokens:.2f} chars/token on {len(texts)} texts, tokenizer.json sha256 {digest})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
