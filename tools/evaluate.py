"""Evaluate a checkpoint the paper's way: per-domain perplexity, math-suite accuracy, Mol-Instructions metrics.

Examples:
    # Per-domain validation log-perplexity on shards written by tools/shard.py:
    python tools/evaluate.py ppl --model runs/x/latest-rank0.pt --shards demo_out/shards/dolma --out ppl.json

    # Math suites (MAmmoTH layout) from a Hugging Face folder, LoRA adapter merged:
    python tools/evaluate.py math --model base_dir --adapter runs/x/adapter \\
        --data-dir ../shared/data/eval --suites gsm8k,svamp,aqua --limit 200 --out results/math.json

    # From a Composer checkpoint (tokenizer and config are stored in it):
    python tools/evaluate.py math --model runs/x/checkpoints/latest-rank0.pt --base-model base_dir \\
        --data-dir math_eval/dataset --out results/math.json

    # Molecule metrics of existing predictions ({"task", "prediction", "reference"} per line):
    python tools/evaluate.py mol --predictions preds.jsonl --out results/mol.json

    # Molecule metrics by generation on Mol-Instructions task files:
    python tools/evaluate.py mol --model ckpt.pt --data mol_instructions/ --limit 500 --out results/mol.json
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.evaluation.math_suites import SUITES, resolve_suite_path
from pipeline.prompts import CHAT, PROMPT_TEMPLATES

log = logging.getLogger("evaluate")

# Names, not torch dtypes: torch is imported only when a model is loaded, so --help is fast.
_DTYPES = ("auto", "float32", "bfloat16", "float16")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run the chosen subcommand; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except FileNotFoundError as e:  # a model, adapter, tokenizer or suite that is not there: one line, not a traceback
        raise SystemExit(f"{args.command}: {e.args[-1] if e.args else e}") from None


def build_parser() -> argparse.ArgumentParser:
    """The CLI: one subparser per evaluation (``math``, ``mol``; more can be added beside them)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    _add_math_command(sub, _model_arguments("prompts per generate call"))
    _add_mol_command(sub, _model_arguments("prompts per generate call"))
    _add_ppl_command(sub, _model_arguments("sequences of the shards per forward pass"))
    _add_answers_command(sub, _model_arguments("questions per generate call"))
    return parser


def _model_arguments(batch_size_help: str) -> argparse.ArgumentParser:
    """The options of the model every subcommand loads (a parent parser, its `model` group); `batch_size_help`
    says what --batch-size counts in that subcommand."""
    model_args = argparse.ArgumentParser(add_help=False)
    g = model_args.add_argument_group("model")
    g.add_argument("--model", help="HF model folder, .gguf file (converted once, cached), PEFT adapter folder, or Composer checkpoint (.pt)")
    g.add_argument("--adapter", help="PEFT adapter folder merged into --model (merge_and_unload)")
    g.add_argument("--base-model", help="base model folder or .gguf file for adapter-only inputs")
    g.add_argument("--tokenizer", help="tokenizer folder or .gguf file (default: from the checkpoint or model folder)")
    g.add_argument("--device", help="cuda, cuda:1, cpu, ... (default: cuda when available)")
    g.add_argument("--dtype", choices=sorted(_DTYPES), default="auto", help="default: bf16 on GPU, fp32 on CPU")
    g.add_argument("--batch-size", type=_positive_int, default=8, help=f"{batch_size_help} (default 8)")
    g.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return model_args


def _add_math_command(sub: argparse._SubParsersAction, model_args: argparse.ArgumentParser) -> None:
    """`math`: accuracy on the math suites by greedy generation."""
    m = sub.add_parser("math", parents=[model_args], help="accuracy on the math suites by greedy generation")
    m.add_argument("--data-dir", required=True, help="folder of suite files (flat or MAmmoTH's dataset/ layout)")
    m.add_argument(
        "--suites",
        default="all",
        help=f"comma-separated subset of {','.join(SUITES)} (default: every suite found in --data-dir)",
    )
    m.add_argument("--limit", type=_positive_int, help="first N problems of each suite")
    m.add_argument("--max-new-tokens", type=_positive_int, default=512, help="default 512")
    m.add_argument(
        "--prompt-template",
        default="metamath",
        help="'metamath' (default), a string with {query}, or a pipeline.prompts template name/string "
        "('chat': the tokenizer's chat template, as tools/shard.py --prompt-template chat)",
    )
    m.add_argument("--out", help="summary JSON path (predictions go to <stem>.predictions.jsonl)")
    m.add_argument("--predictions-out", help="predictions JSONL path (default: beside --out)")
    m.set_defaults(func=run_math)


def _add_mol_command(sub: argparse._SubParsersAction, model_args: argparse.ArgumentParser) -> None:
    """`mol`: the Mol-Instructions metrics, of given predictions or of generated ones."""
    mol = sub.add_parser("mol", parents=[model_args], help="BLEU / Levenshtein / exact / validity / fingerprints")
    src = mol.add_mutually_exclusive_group(required=True)
    src.add_argument("--predictions", help="JSONL with task, prediction, reference per line (no model needed)")
    src.add_argument("--data", nargs="+", help="Mol-Instructions task files or folders (generate with --model)")
    mol.add_argument("--split", default="test", help="metadata.split to keep (default test; 'all' keeps all)")
    mol.add_argument("--limit", type=_positive_int, help="first N records of each task")
    mol.add_argument("--max-new-tokens", type=_positive_int, default=256, help="default 256")
    mol.add_argument(
        "--prompt-template",
        default="alpaca",
        help="pipeline.prompts template (default alpaca; 'chat': the tokenizer's chat template, as tools/shard.py)",
    )
    mol.add_argument(
        "--keep-invalid",
        action="store_true",
        help="score every example (default: as Mol-Instructions, drop invalid molecules before BLEU/Levenshtein/exact)",
    )
    mol.add_argument("--out", help="summary JSON path (generated predictions go to <stem>.predictions.jsonl)")
    mol.set_defaults(func=run_mol)


def _add_ppl_command(sub: argparse._SubParsersAction, model_args: argparse.ArgumentParser) -> None:
    """`ppl`: per-domain validation log-perplexity on shards."""
    p = sub.add_parser("ppl", parents=[model_args], help="per-domain validation log-perplexity on shards")
    p.add_argument("--shards", required=True, help="output directory of tools/shard.py")
    p.add_argument("--split", default="val", choices=("train", "val"), help="split to score (default: val)")
    p.add_argument(
        "--guide-fraction",
        type=float,
        default=0.5,
        help="leave out this share of each domain's split, the part that guides selection during training "
        "(default 0.5, as the training evaluators; 0 scores the whole split)",
    )
    p.add_argument("--domains", help="comma-separated domains (default: all)")
    p.add_argument("--max-batches", type=_positive_int, help="at most this many batches per domain")
    p.add_argument("--out", help="write the per-domain results as JSON here")
    p.set_defaults(func=run_ppl)


def _add_answers_command(sub: argparse._SubParsersAction, model_args: argparse.ArgumentParser) -> None:
    """`answers`: exact-match accuracy of greedy answers to the held-out questions of fine-tuning shards."""
    a = sub.add_parser(
        "answers", parents=[model_args],
        help="exact-match accuracy of greedy answers to the held-out questions of fine-tuning shards, per domain",
    )
    a.add_argument("--shards", required=True, help="fine-tuning shards of tools/shard.py (prompt_ids, response_ids)")
    a.add_argument("--split", default="val", choices=("train", "val"), help="split to ask (default: val)")
    a.add_argument(
        "--guide-fraction", type=float, default=0.5,
        help="leave out this share of each domain's split, the part that guides selection (default 0.5, as training)",
    )
    a.add_argument("--domains", help="comma-separated domains (default: all)")
    a.add_argument("--per-domain", type=_positive_int, default=10, help="questions per domain (default 10)")
    a.add_argument("--max-new-tokens", type=_positive_int, default=16, help="default 16")
    a.add_argument("--out", help="write the accuracy and every question's answer as JSON here")
    a.set_defaults(func=run_answers)


def run_answers(args: argparse.Namespace) -> int:
    """``answers`` subcommand: the metric the `answer_accuracy` callback logs at the end of training."""
    import json

    from pipeline.evaluation.heldout_answers import answer_accuracy, heldout_datasets, heldout_questions

    if not args.model:
        raise SystemExit("answers: --model is required")
    domains = [d for d in args.domains.split(",") if d] if args.domains else None
    datasets = heldout_datasets(args.shards, split=args.split, guide_fraction=args.guide_fraction, domains=domains)
    # The prompts are the shards' token ids: under another tokenizer the model would read other words.
    model, tokenizer = _load(args, _check_shard_tokenizer)
    questions = heldout_questions(datasets, tokenizer, per_domain=args.per_domain)
    result = answer_accuracy(model, tokenizer, questions, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    width = max(len(d) for d in result["per_domain"]) + 2
    print(f"{'domain':<{width}}{'n':>5}{'accuracy':>10}")
    for d, acc in result["per_domain"].items():
        print(f"{d:<{width}}{result['n'][d]:>5}{acc:>10.3f}")
    print(f"{'average':<{width}}{sum(result['n'].values()):>5}{result['average']:>10.3f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**result, "run": _run_info(args)}, indent=2))
        print(f"wrote {args.out}")
    return 0


def run_math(args: argparse.Namespace) -> int:
    """``math`` subcommand."""
    from pipeline.evaluation.math_eval import evaluate_math, format_math_table, write_math_results

    if not args.model:
        raise SystemExit("math: --model is required")
    suites = _select_suites(args.suites, args.data_dir)
    model, tokenizer = _load(args, _check_chat_template if args.prompt_template == CHAT else None)
    result = evaluate_math(
        model,
        tokenizer,
        suites,
        args.data_dir,
        limit=args.limit,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        prompt_template=args.prompt_template,
        show_progress=not args.no_progress,
    )
    print(format_math_table(result))
    if args.out:
        out, preds = write_math_results(result, args.out, args.predictions_out, _run_info(args, suites=suites))
        print(f"wrote {out} and {preds}")
    return 0


def run_mol(args: argparse.Namespace) -> int:
    """``mol`` subcommand."""
    from pipeline.evaluation.mol_eval import (
        evaluate_mol_generation,
        format_mol_table,
        load_mol_instructions,
        write_mol_results,
    )
    from pipeline.evaluation.mol_metrics import evaluate_predictions, read_predictions

    drop_invalid = not args.keep_invalid
    records = None
    if args.predictions:
        metrics = evaluate_predictions(read_predictions(args.predictions), drop_invalid=drop_invalid)
    else:
        if not args.model:
            raise SystemExit("mol: --data needs --model to generate predictions")
        examples = load_mol_instructions(
            args.data, split=None if args.split == "all" else args.split, limit_per_task=args.limit
        )
        if not examples:
            raise SystemExit(f"mol: no records with metadata.split == {args.split!r} in {args.data}")
        model, tokenizer = _load(args, _check_chat_template if args.prompt_template == CHAT else None)
        metrics, records = evaluate_mol_generation(
            model,
            tokenizer,
            examples,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            prompt_template=args.prompt_template,
            drop_invalid=drop_invalid,
            show_progress=not args.no_progress,
        )
    print(format_mol_table(metrics))
    if args.out:
        out = write_mol_results(metrics, args.out, records, _run_info(args))
        print(f"wrote {out}")
    return 0


def run_ppl(args: argparse.Namespace) -> int:
    """``ppl`` subcommand."""
    import json

    from pipeline.evaluation.perplexity import domain_log_perplexity, format_ppl_table

    if not args.model:
        raise SystemExit("ppl: --model is required")
    model, tokenizer = _load(args, _check_shard_tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    results = domain_log_perplexity(
        model,
        shard_dir=args.shards,
        pad_token_id=pad,
        split=args.split,
        guide_fraction=args.guide_fraction,
        domains=[d for d in args.domains.split(",") if d] if args.domains else None,
        batch_size=args.batch_size,
        max_batches=args.max_batches,
        show_progress=not args.no_progress,
    )
    print(format_ppl_table(results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"domains": results, "run": _run_info(args)}, indent=2))
        print(f"wrote {args.out}")
    return 0


def _load(args: argparse.Namespace, check: Callable[[argparse.Namespace, Any], None] | None = None) -> tuple[Any, Any]:
    """The subcommand's model and tokenizer (`load_model_and_tokenizer`), `check(args, tokenizer)` run once: before
    the model loads where the tokenizer it will come with can be found first (`find_tokenizer`), else after."""
    from pipeline.evaluation.checkpoint import find_tokenizer, load_model_and_tokenizer

    early = None
    if check is not None:
        early = find_tokenizer(args.model, adapter=args.adapter, tokenizer=args.tokenizer, base_model=args.base_model)
        if early is not None:
            check(args, early)
    model, tokenizer = load_model_and_tokenizer(
        args.model,
        adapter=args.adapter,
        tokenizer=args.tokenizer,
        base_model=args.base_model,
        device=args.device,
        dtype=_torch_dtype(args.dtype),
    )
    if check is not None and early is None:  # only loading the model told (a Composer checkpoint's own tokenizer)
        check(args, tokenizer)
    return model, tokenizer


def _check_shard_tokenizer(args: argparse.Namespace, tokenizer: Any) -> None:
    """ppl, answers: exit when the shards hold another tokenizer's ids (`pipeline.manifest.tokenizer_mismatch`), or
    `--domains` names a domain they lack."""
    from pipeline.manifest import load_manifest, tokenizer_mismatch

    name = args.tokenizer or getattr(tokenizer, "name_or_path", None) or args.model
    try:
        manifest = load_manifest(args.shards)
    except ValueError as e:
        raise SystemExit(f"{args.command}: --shards: {e}") from None
    if problem := tokenizer_mismatch(manifest, tokenizer, str(name), field="the model's tokenizer"):
        raise SystemExit(f"{args.command}: --shards: {problem}")
    known = [d.name for d in manifest.domains]
    if args.domains and (unknown := [d for d in args.domains.split(",") if d and d not in known]):
        raise SystemExit(f"{args.command}: --domains: {unknown} are not domains of {args.shards} (they are: {', '.join(known)})")


def _check_chat_template(args: argparse.Namespace, tokenizer: Any) -> None:
    """--prompt-template chat: exit naming the tokenizer when it has no chat template."""
    if getattr(tokenizer, "chat_template", None):
        return
    source = (
        f"--tokenizer {args.tokenizer}"
        if args.tokenizer
        else f"the tokenizer of --model {args.model} ({getattr(tokenizer, 'name_or_path', '?')})"
    )
    others = (["metamath"] if args.command == "math" else []) + sorted(set(PROMPT_TEMPLATES) - {CHAT})
    raise SystemExit(
        f"{args.command}: --prompt-template chat puts each prompt in the tokenizer's chat template, and {source} "
        f"has none; use the --prompt-template the model was fine-tuned with ({', '.join(others)} or a template "
        "string), or --tokenizer with an instruct model's tokenizer"
    )


def _select_suites(spec: str, data_dir: str) -> list[str]:
    """Suite keys from ``--suites``; ``all`` keeps the suites that have a file in ``data_dir``."""
    if spec.strip().lower() != "all":
        return [s.strip() for s in spec.split(",") if s.strip()]
    found = []
    for key in SUITES:
        try:
            resolve_suite_path(key, data_dir)
            found.append(key)
        except FileNotFoundError:
            log.warning("no %s file in %s; skipping it", SUITES[key].display, data_dir)
    if not found:
        raise SystemExit(f"math: no suite file found in --data-dir {data_dir}")
    return found


def _run_info(args: argparse.Namespace, **extra) -> dict:
    """The settings recorded in the summary JSON."""
    info = {k: v for k, v in vars(args).items() if k != "func" and v is not None}
    info.update(extra)
    return {k: str(v) if isinstance(v, Path) else v for k, v in info.items()}


def _torch_dtype(name: str):
    """The torch dtype of a --dtype name; None for "auto"."""
    if name == "auto":
        return None
    import torch

    return getattr(torch, name)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
