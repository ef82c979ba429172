"""Tokenizes corpus records in worker processes and writes one MDS directory per domain and split, plus the manifest."""

# Shapes: ids_T = the token ids (int32) of one record or one packed sequence of T tokens.

from __future__ import annotations

import base64
import collections
import dataclasses
import errno
import hashlib
import heapq
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import re
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer

from pipeline.corpora import (
    CorpusError,
    CorpusSpec,
    InputFile,
    ParsedRecord,
    RawRecord,
    RecordError,
    iter_raw_records,
    list_input_files,
    parse_record,
)
from pipeline.manifest import (
    FORMAT_VERSION,
    SPLITS,
    DomainInfo,
    InputInfo,
    Manifest,
    SplitStats,
    vocab_fingerprint,
    write_manifest,
)
from pipeline.prompts import CHAT, chat_prompt_affixes, render_prompt, resolve_prompt_template
from pipeline.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from streaming import MDSWriter

# Streaming (which imports torch, seconds) and transformers are imported when a run starts, not
# at import, so that `tools/shard.py --help` stays fast.

logger = logging.getLogger(__name__)

__all__ = [
    "COMPRESSION",
    "HASHES",
    "MODES",
    "REJECTS_NAME",
    "TRUNCATIONS",
    "ShardError",
    "ShardOptions",
    "ShardResult",
    "columns_for_mode",
    "domain_dirs",
    "format_summary",
    "shard_corpus",
    "truncate_example",
]

MODES = ("pretrain", "finetune")
TRUNCATIONS = ("left_prompt", "right", "left_prompt_right", "skip")
ON_ERROR = ("stop", "skip")
COMPRESSION = "zstd"
HASHES = ["sha1", "xxh64"]
REJECTS_NAME = "rejects.jsonl"
_STAGING = "_staging"


class ShardError(RuntimeError):
    """Sharding stopped: a bad record under `on_error="stop"` or an unreadable input; names file:line."""


@dataclass(kw_only=True)
class ShardOptions:
    """Options of one `shard_corpus` run (the CLI flags of tools/shard.py).

    Args:
        out: Output directory; built under a temporary name beside it and moved into place when complete.
        tokenizer: Tokenizer name or path (`load_tokenizer`); must be a fast tokenizer.
        max_seq_len: Pretrain: length of every packed sample (the last of a domain split may be
            shorter). Finetune: the cap on prompt + response tokens.
        mode: "pretrain" or "finetune"; None picks the corpus default (Dolma: pretrain,
            instruction corpora: finetune).
        prompt_template: Finetune (or pretraining on instruction data): template name or string
            (`pipeline.prompts`); None picks "alpaca" for MetaMathQA and Mol-Instructions, "none" for jsonl.
        truncation: Finetune policy for examples longer than `max_seq_len`: "left_prompt" (default;
            drop prompt tokens from the left, keep the whole response; drop the example when the
            response leaves no room for a prompt token), "right" (cut prompt + response on the
            right; drop the example when no response token is left), "left_prompt_right" (drop
            prompt tokens from the left; when the response is too long as well, the prompt keeps
            its last `max_seq_len // 2` tokens and the response is cut on the right; drops nothing)
            or "skip" (drop it).
        val_fraction: Hold out each record of a domain with this probability (by a seeded hash of
            its content, so duplicates share a split), or None.
        val_count: Hold out this many records per domain (the smallest hashes; a domain of at most this many keeps
            one for training), or None.
            A domain always keeps at least one training record.
        val_inputs: Files or directories whose records all form the validation split (an existing
            train/test pair); the split filter does not apply to them. Excludes `val_fraction`
            and `val_count`; every domain they hold must also occur in the training inputs.
        seed: Seed of the validation split (default 0).
        workers: Tokenizer processes (default 1); each uses one thread. Output does not depend on it.
        start_method: How worker processes start (`multiprocessing` start methods): None (default) for
            forkserver, or spawn where there is none. "fork" is accepted for comparisons
            (tools/bench/bench_shard.py) but is unsafe in a process that runs threads (see `_pool_context`).
            Under forkserver and spawn the workers import the main module, so a script that shards with
            workers > 1 keeps its top-level code under `if __name__ == "__main__":`.
        on_error: "stop" (default: raise `ShardError` naming file:line) or "skip" (write the bad
            record to rejects.jsonl and go on).
        overwrite: Replace an existing output directory (only one that holds a manifest.json or is empty).
        size_limit: MDS shard size limit (bytes or e.g. "64mb").
        progress: Show a tqdm progress bar.
        chunk_records: Records per worker task.
        command: The command line, stored in the manifest.

    Raises:
        ValueError: On invalid values (every problem listed).
    """

    out: Path | str
    tokenizer: str
    max_seq_len: int
    mode: str | None = None
    prompt_template: str | None = None
    truncation: str = "left_prompt"
    val_fraction: float | None = None
    val_count: int | None = None
    val_inputs: list[str | Path] | None = None
    seed: int = 0
    workers: int = 1
    start_method: str | None = None
    on_error: str = "stop"
    overwrite: bool = False
    size_limit: int | str = "64mb"
    progress: bool = True
    chunk_records: int = 256
    command: str = ""

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            problems.append(f"`max_seq_len` must be an integer >= 2, got {self.max_seq_len!r}")
        if self.mode is not None and self.mode not in MODES:
            problems.append(f"`mode` must be one of {list(MODES)}, got {self.mode!r}")
        if self.truncation not in TRUNCATIONS:
            problems.append(f"`truncation` must be one of {list(TRUNCATIONS)}, got {self.truncation!r}")
        if self.val_fraction is not None and self.val_count is not None:
            problems.append(f"`val_fraction` ({self.val_fraction}) and `val_count` ({self.val_count}) are mutually exclusive; give one")
        if self.val_inputs is not None and (self.val_fraction is not None or self.val_count is not None):
            problems.append(
                f"`val_inputs` ({[str(v) for v in self.val_inputs]}) and `val_fraction`/`val_count` are mutually exclusive; give one"
            )
        if self.val_inputs is not None and not self.val_inputs:
            problems.append("`val_inputs` must name at least one file or directory, got an empty list")
        if self.val_fraction is not None and not 0 < self.val_fraction < 1:
            problems.append(f"`val_fraction` must be in (0, 1), got {self.val_fraction}")
        if self.val_count is not None and (not isinstance(self.val_count, int) or self.val_count < 1):
            problems.append(f"`val_count` must be an integer >= 1, got {self.val_count!r}")
        if not isinstance(self.workers, int) or self.workers < 1:
            problems.append(f"`workers` must be an integer >= 1, got {self.workers!r}")
        if self.start_method is not None and self.start_method not in multiprocessing.get_all_start_methods():
            problems.append(f"`start_method` must be None or one of {multiprocessing.get_all_start_methods()}, got {self.start_method!r}")
        if self.on_error not in ON_ERROR:
            problems.append(f"`on_error` must be one of {list(ON_ERROR)}, got {self.on_error!r}")
        if not isinstance(self.chunk_records, int) or self.chunk_records < 1:
            problems.append(f"`chunk_records` must be an integer >= 1, got {self.chunk_records!r}")
        if self.prompt_template is not None:
            try:
                resolve_prompt_template(self.prompt_template)
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            raise ValueError("invalid shard options:\n  " + "\n  ".join(problems))
        self.out = Path(self.out)


@dataclass
class ShardResult:
    """What a `shard_corpus` run produced.

    Attributes:
        manifest: The manifest written (its `root` is the output directory).
        seconds: Wall time of the whole run.
        records_read: Records read from the inputs.
        tokens_written: Tokens written over all domains and splits.
    """

    manifest: Manifest
    seconds: float
    records_read: int
    tokens_written: int

    @property
    def tokens_per_s(self) -> float:
        """Tokens written per second of wall time."""
        return self.tokens_written / max(self.seconds, 1e-9)


def columns_for_mode(mode: str) -> dict[str, str]:
    """The MDS columns of a mode: pretrain `input_ids`; finetune `prompt_ids`, `response_ids`, `record`."""
    if mode == "pretrain":
        return {"input_ids": "ndarray:int32"}
    return {"prompt_ids": "ndarray:int32", "response_ids": "ndarray:int32", "record": "str"}


def truncate_example(prompt_T: np.ndarray, response_T: np.ndarray, max_seq_len: int, policy: str) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """Fit a prompt/response pair into `max_seq_len` tokens.

    Args:
        prompt_T: Prompt token ids.
        response_T: Response token ids (EOS included).
        max_seq_len: The cap on their total length.
        policy: "left_prompt", "right", "left_prompt_right" or "skip" (see `ShardOptions.truncation`).

    Returns:
        (prompt, response, truncated), or None when the policy drops the example.
    """
    total = len(prompt_T) + len(response_T)
    if total <= max_seq_len:
        return prompt_T, response_T, False
    if policy == "left_prompt":
        room = max_seq_len - len(response_T)
        return (prompt_T[len(prompt_T) - room :], response_T, True) if room >= 1 else None
    if policy == "right":
        keep = max_seq_len - len(prompt_T)
        if keep >= 1:
            return prompt_T, response_T[:keep], True
        return None
    if policy == "left_prompt_right":
        # The prompt's end (next to the response) matters most; a long response keeps its start.
        n_prompt = min(len(prompt_T), max(max_seq_len - len(response_T), max_seq_len // 2))
        return prompt_T[len(prompt_T) - n_prompt :], response_T[: max_seq_len - n_prompt], True
    return None


def shard_corpus(spec: CorpusSpec, inputs: list[str | Path], options: ShardOptions) -> ShardResult:
    """Convert a corpus into per-domain MDS directories and a manifest.

    Layout: `OUT/manifest.json`, `OUT/train/<domain dir>/`, `OUT/val/<domain dir>/` (domains
    with validation records) and, with `on_error="skip"` and rejects, `OUT/rejects.jsonl`.
    The output is built in `.OUT.tmp-<pid>-<random>` beside OUT; a run that was killed leaves
    that directory behind, and the next run into OUT removes it (with a warning) unless the
    process that made it is still running.
    Records are read in input order by this process, tokenized by `options.workers` processes
    in chunks, and written back in input order, so the output is identical for any number of
    workers. Pretraining concatenates each record's tokens plus EOS within a domain and split
    only, and cuts `max_seq_len` sequences; fine-tuning writes one sample per record with the
    prompt and response (plus EOS) kept apart.

    Args:
        spec: How to read the corpus (`pipeline.corpora.make_corpus_spec`).
        inputs: Files and directories (or, for MetaMathQA, a hub dataset name).
        options: The run's options.

    Returns:
        The manifest and timing.

    Raises:
        ValueError: On invalid options or inputs, or an existing output without `overwrite`.
        ShardError: On a bad record under `on_error="stop"`, an unreadable input file, an output
            with no records (empty inputs, every record rejected or filtered), or a domain found
            only in `val_inputs`, or a full disk (ENOSPC, EDQUOT: one line saying what was written; nothing
            is kept, and an existing output is left as it was).
    """
    start = time.perf_counter()
    mode = _shard_mode(spec, options)
    template = options.prompt_template or ("none" if spec.format == "jsonl" else "alpaca")
    out = Path(options.out)
    _remove_leftovers(out)
    _check_output(out, options.overwrite)
    files = _list_files(inputs, options.val_inputs, allow_hub=spec.format == "metamathqa")
    tokenizer = load_tokenizer(options.tokenizer)
    if not tokenizer.is_fast:
        raise ValueError(f"`tokenizer` {options.tokenizer!r} has no fast (Rust) implementation; sharding needs one")

    config = _worker_config(spec, mode, template, tokenizer, options)
    # The pid in the name lets a later run tell a dead run's leftovers from a running one's.
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    existed = out.exists()
    writer: _CorpusWriter | None = None
    saved_env = os.environ.get("TOKENIZERS_PARALLELISM")
    try:
        tmp.mkdir(parents=True)
        # One thread per worker (the in-process one included), so --workers N means N cores.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        writer = _CorpusWriter(tmp, mode, options, tokenizer.eos_token_id)
        inputs_info = _write_records(files, config, options, writer)
        domains = writer.finish()
        _check_written(spec, files, inputs_info, domains, writer)
        manifest = _shard_manifest(spec, mode, template, tokenizer, options, domains, inputs_info, writer)
        write_manifest(manifest, tmp)
        _move_into_place(tmp, out)
    except BaseException as exc:
        if writer is not None:
            writer.abandon()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            raise ShardError(_disk_full_message(exc, out, tmp, writer, existed)) from exc
        raise
    finally:
        if saved_env is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved_env
    manifest.root = out
    return ShardResult(
        manifest=manifest,
        seconds=time.perf_counter() - start,
        records_read=sum(i.records for i in inputs_info),
        tokens_written=writer.tokens_written,
    )


def format_summary(result: ShardResult) -> str:
    """A per-domain table: records in, written train/val, rejected, truncated, samples, tokens; then totals, tokens/s,
    and last, per domain, the records lost (rejected, truncated), so that a skew between domains shows."""
    m = result.manifest
    head = f"{'domain':32s} {'in':>8s} {'train':>8s} {'val':>7s} {'rejected':>8s} {'trunc':>6s} {'samples':>15s} {'tokens':>21s}"
    lines = [head, "-" * len(head)]
    for d in m.domains:
        tr, va = d.splits["train"], d.splits["val"]
        rej = f"{d.rejected}" + (f"({d.too_long}L)" if d.too_long else "")
        lines.append(
            f"{d.name[:32]:32s} {d.input_records:8d} {tr.records:8d} {va.records:7d} {rej:>8s} {d.truncated:6d} "
            f"{tr.samples:>8d}/{va.samples:<6d} {tr.tokens:>12d}/{va.tokens:<8d}"
        )
    if m.rejected_other:
        lines.append(f"{'(no domain written)':32s} {m.rejected_other:8d} {0:8d} {0:7d} {m.rejected_other:8d}")
    read = result.records_read
    accounted = sum(d.input_records for d in m.domains) + m.rejected_other + m.filtered_out
    lines.append("-" * len(head))
    lines.append(
        f"records read {read} = written {sum(d.splits['train'].records + d.splits['val'].records for d in m.domains)}"
        f" + rejected {sum(d.rejected for d in m.domains) + m.rejected_other}"
        f" + filtered by split {m.filtered_out}" + ("" if read == accounted else "  (DOES NOT RECONCILE)")
    )
    lines.append(
        f"{result.tokens_written} tokens in {result.seconds:.1f}s: {result.tokens_per_s:,.0f} tokens/s "
        f"({read / max(result.seconds, 1e-9):,.0f} records/s); (L) = dropped by the truncation policy"
    )
    losses = [
        f"{d.name} {d.rejected}/{d.input_records} rejected ({100 * d.rejected / max(d.input_records, 1):.1f}%"
        + (f", {d.too_long} too long" if d.too_long else "")
        + f"), {d.truncated} truncated"
        for d in m.domains
    ]
    if m.rejected_other:
        losses.append(f"(no domain written) {m.rejected_other} rejected")
    lines.append("records lost per domain: " + "; ".join(losses))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Worker side: parse, validate, render prompts, tokenize, truncate, hash.


@dataclass(frozen=True)
class _WorkerConfig:
    spec: CorpusSpec
    mode: str
    backend_json: str  # the Rust tokenizer, serialized: rebuilt in each worker without transformers' slow loading
    eos_id: int
    template: str | None
    # With the `chat` template: the ids the tokenizer's chat template puts around the user message.
    chat_affixes: tuple[tuple[int, ...], tuple[int, ...]] | None
    max_seq_len: int
    truncation: str
    seed: int
    keep_records: bool
    needs_hash: bool  # only the validation split uses the content hash
    val_spec: CorpusSpec  # `spec` without the split filter, for `val_inputs` files


_WORKER: dict[str, Any] = {}


def _init_pool_worker(config: _WorkerConfig) -> None:
    """`_init_worker` in a pool process, which leaves Ctrl-C to the main process (it stops the pool) and ends at
    once on SIGTERM, whatever the parent ignored or handled (ProcessPoolExecutor stops a broken pool with it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _init_worker(config)


def _init_worker(config: _WorkerConfig) -> None:
    """Per-process setup: a private copy of the Rust tokenizer that treats special-token text as text."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    backend = Tokenizer.from_str(config.backend_json)
    # A document that contains the literal text "<|endoftext|>" must not inject an EOS token.
    backend.encode_special_tokens = True
    _WORKER.update(config=config, backend=backend, eos=config.eos_id)


def _process_chunk(chunk: tuple[str, str, list[RawRecord], bool]) -> list[tuple]:
    """Turn a chunk of raw records (of a validation input when its last item is True) into result tuples, in order.

    Results: ("ok", line, loc, domain, hash, ids_T | (prompt_T, response_T), truncated),
    ("err", line, element | None, domain | None, problem, record), ("drop", ...same as err),
    ("filtered", line, loc).
    """
    config: _WorkerConfig = _WORKER["config"]
    backend, eos = _WORKER["backend"], _WORKER["eos"]
    _, dir_domain, raws, is_val = chunk
    spec = config.val_spec if is_val else config.spec
    results: list[tuple | None] = [None] * len(raws)
    parsed: list[tuple[int, ParsedRecord]] = []
    for i, raw in enumerate(raws):
        try:
            rec = parse_record(spec, raw, dir_domain)
        except RecordError as exc:
            results[i] = ("err", raw.line, raw.element, exc.domain, exc.problem, exc.record if config.keep_records else None)
            continue
        if rec is None:
            results[i] = ("filtered", raw.line, raw.loc)
        else:
            parsed.append((i, rec))

    if config.spec.is_instruction:
        prompts = [render_prompt(config.template, r.instruction, r.input) for _, r in parsed]  # type: ignore[arg-type]
    else:
        prompts = [r.text for _, r in parsed]
    hashes = _content_hashes(config, [r for _, r in parsed])

    prefix, suffix = config.chat_affixes or ((), ())  # the chat template's ids around the user message
    if config.mode == "pretrain" and not config.chat_affixes:
        texts = prompts if not config.spec.is_instruction else [p + r.response for p, (_, r) in zip(prompts, parsed)]
        encodings = backend.encode_batch(texts, add_special_tokens=False)
        for (i, rec), enc, h in zip(parsed, encodings, hashes):
            ids_T = np.empty(len(enc.ids) + 1, dtype=np.int32)
            ids_T[:-1] = enc.ids
            ids_T[-1] = eos
            results[i] = ("ok", raws[i].line, raws[i].loc, rec.domain, h, ids_T, False)
    elif config.mode == "pretrain":
        prompt_encs = backend.encode_batch(prompts, add_special_tokens=False)
        response_encs = backend.encode_batch([r.response for _, r in parsed], add_special_tokens=False)
        for (i, rec), p_enc, r_enc, h in zip(parsed, prompt_encs, response_encs, hashes):
            ids_T = np.asarray([*prefix, *p_enc.ids, *suffix, *r_enc.ids, eos], dtype=np.int32)
            results[i] = ("ok", raws[i].line, raws[i].loc, rec.domain, h, ids_T, False)
    else:
        prompt_encs = backend.encode_batch(prompts, add_special_tokens=False)
        response_encs = backend.encode_batch([r.response for _, r in parsed], add_special_tokens=False)
        for (i, rec), p_enc, r_enc, h in zip(parsed, prompt_encs, response_encs, hashes):
            prompt_T = np.asarray([*prefix, *p_enc.ids, *suffix], dtype=np.int32)
            response_T = np.empty(len(r_enc.ids) + 1, dtype=np.int32)
            response_T[:-1] = r_enc.ids
            response_T[-1] = eos
            fitted = truncate_example(prompt_T, response_T, config.max_seq_len, config.truncation)
            if fitted is None:
                problem = (
                    f"too long for max_seq_len {config.max_seq_len} (prompt {len(prompt_T)} + response {len(response_T)} tokens; "
                    f"truncation={config.truncation})"
                )
                results[i] = ("drop", raws[i].line, raws[i].element, rec.domain, problem, rec.obj if config.keep_records else None)
                continue
            results[i] = (
                "ok", raws[i].line, raws[i].loc, rec.domain, h, (fitted[0], fitted[1]), fitted[2]
            )  # fmt: skip
    return results  # type: ignore[return-value]


def _chat_affixes(tokenizer: Any, name: str | os.PathLike) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`pipeline.prompts.chat_prompt_affixes` as tuples (the worker config is frozen and pickled)."""
    before, after = chat_prompt_affixes(tokenizer, name=f"tokenizer {str(name)!r}")
    return tuple(before), tuple(after)


def _content_hashes(config: _WorkerConfig, records: list[ParsedRecord]) -> list[int]:
    """Seeded 64-bit hashes of the records' content (domain included): the validation split is a function of them.

    Content, not position, decides the split, so it does not depend on file order, and exact
    duplicates land in the same split.
    """
    if not config.needs_hash:
        return [0] * len(records)
    seed_prefix = f"{config.seed}\x00".encode()
    out = []
    for r in records:
        content = f"{r.instruction}\x00{r.input}\x00{r.response}" if config.spec.is_instruction else r.text
        h = hashlib.blake2b(seed_prefix + r.domain.encode("utf-8") + b"\x00", digest_size=8)
        h.update(content.encode("utf-8"))
        out.append(int.from_bytes(h.digest(), "little"))
    return out


# ---------------------------------------------------------------------------------------------
# Main side: read, dispatch in order with a bounded window, assign splits, pack, write.


def _shard_mode(spec: CorpusSpec, options: ShardOptions) -> str:
    """The run's mode: `options.mode`, else the corpus's default; finetune needs an instruction corpus."""
    mode = options.mode or spec.default_mode
    if mode == "finetune" and not spec.is_instruction:
        raise ValueError(
            f"`mode` finetune needs prompt/response records, but corpus {spec.format!r} reads text field "
            f"{spec.text_field!r}; use mode pretrain (or, for jsonl, --prompt-field and --response-field)"
        )
    return mode


def _worker_config(spec: CorpusSpec, mode: str, template: str, tokenizer: Any, options: ShardOptions) -> _WorkerConfig:
    """What every worker needs to parse and tokenize records (the tokenizer serialized)."""
    return _WorkerConfig(
        spec=spec,
        mode=mode,
        backend_json=tokenizer.backend_tokenizer.to_str(),  # type: ignore[attr-defined]
        eos_id=int(tokenizer.eos_token_id),  # type: ignore[arg-type]
        template=template if spec.is_instruction else None,
        chat_affixes=_chat_affixes(tokenizer, options.tokenizer) if spec.is_instruction and template == CHAT else None,
        max_seq_len=options.max_seq_len,
        truncation=options.truncation,
        seed=options.seed,
        keep_records=options.on_error == "skip",
        needs_hash=options.val_fraction is not None or options.val_count is not None,
        val_spec=dataclasses.replace(spec, split=None),
    )


def _write_records(files: list[InputFile], config: _WorkerConfig, options: ShardOptions, writer: _CorpusWriter) -> list[InputInfo]:
    """Tokenize every file's records in the workers and hand them to `writer` in input order; return the inputs' info."""
    inputs_info = [InputInfo(path=f.path, sha256=_sha256(f), records=0, split=f.split) for f in files]
    from tqdm import tqdm  # 0.2 s to import, which --help need not pay

    bar = tqdm(desc="sharding", unit="rec", disable=not options.progress, dynamic_ncols=True)
    chunk_results = _run_chunks(files, config, options)
    try:
        for file_idx, n_raw, results in chunk_results:
            inputs_info[file_idx].records += n_raw
            writer.consume(files[file_idx], results)
            bar.update(n_raw)
            bar.set_postfix(tokens=writer.tokens_written, refresh=False)
    finally:
        chunk_results.close()  # stops the worker pool at once on an error
        bar.close()
        writer.close_rejects()
    return inputs_info


def _shard_manifest(
    spec: CorpusSpec,
    mode: str,
    template: str,
    tokenizer: Any,
    options: ShardOptions,
    domains: list[DomainInfo],
    inputs_info: list[InputInfo],
    writer: _CorpusWriter,
) -> Manifest:
    """The manifest of a finished run (`root` unset)."""
    return Manifest(
        format_version=FORMAT_VERSION,
        mode=mode,
        tokenizer=str(options.tokenizer),
        vocab_size=len(tokenizer),
        eos_token_id=int(tokenizer.eos_token_id),  # type: ignore[arg-type]
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[arg-type]
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[arg-type]
        max_seq_len=options.max_seq_len,
        prompt_template=template if spec.is_instruction else None,
        truncation=options.truncation if mode == "finetune" else None,
        val_fraction=options.val_fraction,
        val_count=options.val_count,
        seed=options.seed,
        domains=domains,
        inputs=inputs_info,
        command=options.command,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        source_format=spec.format,
        rejected_other=writer.rejected_other,
        filtered_out=writer.filtered_out,
        split_filter=spec.split if spec.split_field is not None else None,
        vocab_sha256=vocab_fingerprint(tokenizer, len(tokenizer)),
    )


def _iter_chunks(files: list[InputFile], chunk_records: int) -> Iterator[tuple[int, tuple[str, str, list[RawRecord], bool]]]:
    for file_idx, file in enumerate(files):
        batch: list[RawRecord] = []
        is_val = file.split == "val"
        try:
            for raw in iter_raw_records(file):
                batch.append(raw)
                if len(batch) >= chunk_records:
                    yield file_idx, (file.display, file.dir_domain, batch, is_val)
                    batch = []
        except CorpusError as exc:
            raise ShardError(str(exc)) from exc
        if batch:
            yield file_idx, (file.display, file.dir_domain, batch, is_val)


def _run_chunks(files: list[InputFile], config: _WorkerConfig, options: ShardOptions) -> Iterator[tuple[int, int, list[tuple]]]:
    """Yield (file index, records in chunk, results) in input order."""
    chunks = _iter_chunks(files, options.chunk_records)
    if options.workers == 1:
        _init_worker(config)
        for file_idx, chunk in chunks:
            yield file_idx, len(chunk[2]), _process_chunk(chunk)
        return
    executor = ProcessPoolExecutor(
        options.workers, mp_context=_pool_context(options.start_method), initializer=_init_pool_worker, initargs=(config,)
    )
    try:
        yield from _ordered_window(executor.submit, chunks, window=4 * options.workers)
    except BaseException:
        _stop_workers(executor)  # an error, Ctrl-C, or the consumer stopped early (GeneratorExit)
        raise
    # Every result is in: each worker takes a stop sentinel and exits by itself. Nothing is killed: a worker
    # killed while it holds a lock of the queues (multiprocessing.Pool.terminate() does that) leaves the pool's
    # own threads waiting for it forever, and one that misses its SIGTERM waits forever itself (issue 20).
    executor.shutdown(wait=True)


def _stop_workers(executor: ProcessPoolExecutor, grace_s: float = 10.0) -> None:
    """Drop the chunks not yet started and let each worker finish the one it is on and exit; kill the ones still
    running after `grace_s` (stuck on some input). ProcessPoolExecutor, unlike multiprocessing.Pool, survives a
    worker killed at any point: it notices the death and stops without taking the locks the worker held."""
    processes = list((executor._processes or {}).values())  # no public API lists them (there since Python 3.2)
    executor.shutdown(wait=False, cancel_futures=True)
    running = {p.sentinel: p for p in processes}
    deadline = time.monotonic() + grace_s
    while running and (left := deadline - time.monotonic()) > 0:
        for sentinel in multiprocessing.connection.wait(list(running), timeout=left):
            del running[sentinel]
    for p in running.values():
        p.kill()


def _pool_context(method: str | None) -> multiprocessing.context.BaseContext:
    """The workers' start method: `method`, else forkserver (spawn where there is none), not fork.

    This process may run other threads (torch's, the tokenizer's, a test runner's): a forked worker gets a copy of
    every lock they hold, held, with no thread to release it, and the parent's Python signal handlers. A
    forkserver worker is forked from a single-threaded server process, started once per process with this module
    imported; it rebuilds what it needs from `_WorkerConfig` (the tokenizer from its serialized form).
    """
    if method is None:
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        # The main module (as the forkserver loads by default) and this one: a worker then imports nothing.
        context.set_forkserver_preload(["__main__", __name__])  # type: ignore[attr-defined]
    return context


def _ordered_window(submit: Callable, chunks: Iterable[tuple[int, tuple]], window: int) -> Iterator[tuple[int, int, list[tuple]]]:
    """Like Pool.imap, but with at most `window` chunks in flight (imap reads its input eagerly)."""
    pending: collections.deque = collections.deque()
    for file_idx, chunk in chunks:
        try:
            future = submit(_process_chunk, chunk)
        except BrokenProcessPool as exc:
            # A worker died and the pool noticed before any result showed it: report it as the chunks in flight
            # would (their results in order, the first broken one raising), else at this chunk.
            while pending:
                yield _chunk_result(*pending.popleft())
            raise _worker_died(chunk) from exc
        pending.append((file_idx, chunk, future))
        if len(pending) >= window:
            yield _chunk_result(*pending.popleft())
    while pending:
        yield _chunk_result(*pending.popleft())


def _chunk_result(file_idx: int, chunk: tuple, future: Future) -> tuple[int, int, list[tuple]]:
    try:
        return file_idx, len(chunk[2]), future.result()
    except BrokenProcessPool as exc:
        raise _worker_died(chunk) from exc


def _worker_died(chunk: tuple) -> ShardError:
    display, _, raws, _ = chunk
    return ShardError(
        f"a worker process ended abruptly (killed, perhaps for lack of memory) while records up to {display}:"
        f"{raws[-1].line} were being tokenized; nothing was kept; rerun, with fewer workers if memory is short"
    )


@dataclass
class _Held:
    """A written-later record: kept whole until its split is decided."""

    hash: int
    seq: int
    display: str
    loc: int
    payload: Any


@dataclass
class _DomainState:
    name: str
    key: str
    input_records: int = 0
    rejected: int = 0
    truncated: int = 0
    too_long: int = 0
    stats: dict[str, SplitStats] = field(default_factory=lambda: {s: SplitStats() for s in SPLITS})
    writers: dict[str, MDSWriter] = field(default_factory=dict)
    buffers: dict[str, list[np.ndarray]] = field(default_factory=lambda: {s: [] for s in SPLITS})
    buffered: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    held: list[_Held] = field(default_factory=list)  # val candidates (fraction: until a train record exists; count: a max-heap)


class _CorpusWriter:
    """Assigns records to splits, packs (pretrain) and writes MDS samples; tracks every count."""

    def __init__(self, root: Path, mode: str, options: ShardOptions, eos_id: int) -> None:
        self.root = root
        self.mode = mode
        self.options = options
        self.columns = columns_for_mode(mode)
        self.domains: dict[str, _DomainState] = {}
        self.rejected_other = 0
        self.filtered_out = 0
        self.tokens_written = 0
        self.seq = 0
        self.threshold = None if options.val_fraction is None else int(options.val_fraction * 2**64)
        self.rejects_file = None
        self.rejects_written = 0
        self.first_reject: str | None = None  # "file:line: problem" of the first record not written

    # -- records ------------------------------------------------------------------------------

    def consume(self, file: InputFile, results: list[tuple]) -> None:
        for res in results:
            kind = res[0]
            if kind == "ok":
                _, _, loc, domain, h, payload, truncated = res
                state = self._domain(domain)
                state.input_records += 1
                state.truncated += int(truncated)
                item = _Held(h, self.seq, file.display, loc, payload)
                if file.split == "val":
                    self._write(state, "val", item)
                else:
                    self._assign(state, item)
                self.seq += 1
            elif kind == "filtered":
                self.filtered_out += 1
            else:
                _, line, element, domain, problem, record = res
                where = RawRecord(line=line, loc=0, payload=None, element=element).where(file.display)
                if kind == "err" and self.options.on_error == "stop":
                    raise ShardError(f"{where}: {problem} (pass --on-error skip to write bad records to {REJECTS_NAME} and go on)")
                if self.first_reject is None:
                    self.first_reject = f"{where}: {problem}"
                if domain is None:
                    self.rejected_other += 1
                else:
                    state = self._domain(domain)
                    state.input_records += 1
                    state.rejected += 1
                    state.too_long += int(kind == "drop")
                if self.options.on_error == "skip":
                    self._write_reject(file.display, line, element, domain, problem, record)

    def _domain(self, name: str) -> _DomainState:
        state = self.domains.get(name)
        if state is None:
            state = self.domains[name] = _DomainState(name=name, key=f"d{len(self.domains):05d}")
        return state

    def _assign(self, state: _DomainState, item: _Held) -> None:
        opts = self.options
        if opts.val_count is not None:
            # Keep the val_count smallest hashes (a max-heap on -hash); evicted records train.
            heapq.heappush(state.held, _HeapItem(item))  # type: ignore[arg-type]
            if len(state.held) > opts.val_count:
                self._write(state, "train", heapq.heappop(state.held).item)  # type: ignore[attr-defined]
        elif self.threshold is not None and item.hash < self.threshold:
            if state.stats["train"].records == 0:
                state.held.append(item)  # until the domain has a training record (see finish)
            else:
                self._write(state, "val", item)
        else:
            self._write(state, "train", item)
            if state.held and opts.val_count is None:
                for held in state.held:
                    self._write(state, "val", held)
                state.held.clear()

    # -- writing ------------------------------------------------------------------------------

    def _writer(self, state: _DomainState, split: str) -> MDSWriter:
        writer = state.writers.get(split)
        if writer is None:
            from pipeline.mds_writer import FastMDSWriter  # imports Streaming, and so torch: seconds

            path = self.root / _STAGING / split / state.key
            # max_workers=1: each writer owns a thread pool (used for remote uploads only); keep it small,
            # since a corpus may have hundreds of domain x split writers open at once.
            writer = state.writers[split] = FastMDSWriter(
                out=str(path), columns=self.columns, compression=COMPRESSION, hashes=HASHES, size_limit=self.options.size_limit, max_workers=1
            )
        return writer

    def _write(self, state: _DomainState, split: str, item: _Held) -> None:
        stats = state.stats[split]
        stats.records += 1
        if self.mode == "finetune":
            prompt_T, response_T = item.payload
            self._writer(state, split).write({"prompt_ids": prompt_T, "response_ids": response_T, "record": f"{item.display}:{item.loc}"})
            stats.samples += 1
            stats.tokens += len(prompt_T) + len(response_T)
            self.tokens_written += len(prompt_T) + len(response_T)
            return
        ids_T = item.payload
        buf = state.buffers[split]
        buf.append(ids_T)
        state.buffered[split] += len(ids_T)
        if state.buffered[split] >= self.options.max_seq_len:
            self._emit(state, split, final=False)

    def _emit(self, state: _DomainState, split: str, final: bool) -> None:
        """Write every full max_seq_len sequence in the buffer (and, if final, the remainder)."""
        seq_len = self.options.max_seq_len
        buf = state.buffers[split]
        if not buf:
            return
        flat_T = np.concatenate(buf) if len(buf) > 1 else buf[0]
        n_full = len(flat_T) // seq_len
        writer = self._writer(state, split)
        stats = state.stats[split]
        for k in range(n_full):
            writer.write({"input_ids": flat_T[k * seq_len : (k + 1) * seq_len]})
        rest_T = flat_T[n_full * seq_len :]
        n_out = n_full
        if final and len(rest_T):
            writer.write({"input_ids": rest_T})
            n_out += 1
            rest_T = rest_T[:0]
        written = len(flat_T) - len(rest_T)
        stats.samples += n_out
        stats.tokens += written
        self.tokens_written += written
        state.buffers[split] = [rest_T] if len(rest_T) else []
        state.buffered[split] = len(rest_T)

    def _write_reject(self, display: str, line: int, element: int | None, domain: str | None, problem: str, record: Any) -> None:
        if self.rejects_file is None:
            self.rejects_file = open(self.root / REJECTS_NAME, "w", encoding="utf-8")  # noqa: SIM115 - closed in close_rejects
        entry = {"file": display, "line": line, "element": element, "domain": domain, "error": problem, "record": record}
        if isinstance(record, bytes):
            # Invalid UTF-8: a readable form, and the exact bytes so that nothing is lost.
            entry["record"] = record.decode("utf-8", "replace")
            entry["record_base64"] = base64.b64encode(record).decode("ascii")
        text = json.dumps(entry, ensure_ascii=False)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = json.dumps(entry)  # a lone surrogate: JSON's \\udXXX escapes keep it, UTF-8 cannot
        self.rejects_file.write(text + "\n")
        self.rejects_written += 1

    def close_rejects(self) -> None:
        if self.rejects_file is not None:
            self.rejects_file.close()

    def abandon(self) -> None:
        """After an error: stop the thread of every unfinished MDS writer (it uploads to remote storage; idle here).

        Otherwise a Ctrl-C that lands while a writer starts that thread, after the start and before
        concurrent.futures registers the thread with its exit handler, leaves it waiting for work, and the
        interpreter waits for it at exit, forever (issue 20).
        """
        for state in self.domains.values():
            for mds_writer in state.writers.values():
                mds_writer.cancel_future_jobs()  # shutdown(wait=False): wakes the thread, which then ends

    # -- end ----------------------------------------------------------------------------------

    def finish(self) -> list[DomainInfo]:
        """Settle held records, flush, close writers, and move domain dirs to their final names."""
        for state in self.domains.values():
            held = [h.item for h in state.held] if self.options.val_count is not None else list(state.held)  # type: ignore[attr-defined]
            state.held = []
            if held and state.stats["train"].records == 0:
                # Every record hashed into validation: the largest hash trains, so the domain has training data.
                top = max(held, key=lambda h: (h.hash, h.seq))
                held.remove(top)
                self._write(state, "train", top)
            for item in sorted(held, key=lambda h: h.seq):
                self._write(state, "val", item)
            for split in SPLITS:
                self._emit(state, split, final=True)
            for writer in state.writers.values():
                writer.finish()

        kept = sorted((s for s in self.domains.values() if s.stats["train"].records + s.stats["val"].records > 0), key=lambda s: s.name)
        for state in self.domains.values():
            if state.stats["train"].records + state.stats["val"].records == 0:
                logger.warning("domain %r has no valid records (%d rejected); it is left out of the manifest", state.name, state.rejected)
                self.rejected_other += state.rejected
        dirs = domain_dirs([s.name for s in kept])
        infos = []
        for state in kept:
            for split in state.writers:
                dest = self.root / split
                dest.mkdir(exist_ok=True)
                (self.root / _STAGING / split / state.key).rename(dest / dirs[state.name])
            assert state.input_records == state.stats["train"].records + state.stats["val"].records + state.rejected
            infos.append(
                DomainInfo(
                    name=state.name,
                    dir=dirs[state.name],
                    input_records=state.input_records,
                    rejected=state.rejected,
                    truncated=state.truncated,
                    too_long=state.too_long,
                    splits=state.stats,
                )
            )
        shutil.rmtree(self.root / _STAGING, ignore_errors=True)
        return infos


class _HeapItem:
    """Orders held records so that heapq's min-heap pops the largest (hash, seq) first."""

    __slots__ = ("item",)

    def __init__(self, item: _Held) -> None:
        self.item = item

    def __lt__(self, other: _HeapItem) -> bool:
        return (self.item.hash, self.item.seq) > (other.item.hash, other.item.seq)


def domain_dirs(names: list[str]) -> dict[str, str]:
    """Filesystem-safe, unique (case-insensitively) directory names, assigned in sorted-name order."""
    dirs: dict[str, str] = {}
    used: set[str] = set()
    for name in sorted(names):
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._-")[:80] or "domain"
        slug, k = base, 2
        while slug.lower() in used:
            slug, k = f"{base}-{k}", k + 1
        used.add(slug.lower())
        dirs[name] = slug
    return dirs


def _sha256(file: InputFile) -> str | None:
    if file.hub_split is not None:
        return None
    digest = hashlib.sha256()
    with open(file.path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _list_files(inputs: list[str | Path], val_inputs: list[str | Path] | None, allow_hub: bool) -> list[InputFile]:
    """The training inputs, then the validation inputs (marked split "val"); one file may not be both."""
    if not val_inputs:
        return list_input_files(inputs, allow_hub=allow_hub)
    val_paths = {Path(f.path).resolve() for f in list_input_files(val_inputs)}
    train_paths = {Path(f.path).resolve() for f in list_input_files(inputs, allow_hub=allow_hub) if f.hub_split is None}
    both = sorted(str(p) for p in val_paths & train_paths)
    if both:
        raise ValueError(f"input files {both} are given both as training inputs and in `val_inputs` (--val-file); give each once")
    # One call, so that short names stay unambiguous across the two lists.
    files = list_input_files([*inputs, *val_inputs], allow_hub=allow_hub)
    return [dataclasses.replace(f, split="val") if f.hub_split is None and Path(f.path).resolve() in val_paths else f for f in files]


_DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded"}


def _disk_full_message(exc: OSError, out: Path, tmp: Path, writer: _CorpusWriter | None, existed: bool) -> str:
    """One line: the output, what had been written when the disk filled, and that nothing of it was kept."""
    shards = [s for state in writer.domains.values() for w in state.writers.values() for s in w.shards] if writer else []
    size = sum((s["zip_data"] or s["raw_data"])["bytes"] for s in shards)
    size_text = f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.1f} kB"
    kept = "; the existing output is left as it was" if existed else ""
    return (
        f"{_DISK_FULL[exc.errno]} while writing {out}: {len(shards)} shard files ({size_text}) had been written; "
        f"nothing was kept (the partial output {tmp.name} was removed{kept}); free space on {out.parent} or write "
        "elsewhere"
    )


def _check_written(spec: CorpusSpec, files: list[InputFile], inputs_info: list[InputInfo], domains: list[DomainInfo], writer: _CorpusWriter) -> None:
    """Raise `ShardError` when nothing was written, or a domain has validation records only."""
    if not domains:
        read = sum(i.records for i in inputs_info)
        names = ", ".join(f.display for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        if read == 0:
            raise ShardError(f"no records in the inputs ({names}): nothing to write; check the files (blank lines are not records)")
        if writer.filtered_out == read:
            raise ShardError(
                f"all {read} records of {names} were filtered out by the split filter {spec.split!r} (field "
                f"{spec.split_field!r}); nothing to write; pass --split any to keep every record"
            )
        raise ShardError(
            f"all {read} records of {names} were rejected ({read - writer.filtered_out}) or filtered by split "
            f"({writer.filtered_out}); nothing to write. First rejection: {writer.first_reject}"
        )
    only_val = [d.name for d in domains if d.splits["train"].records == 0]
    if only_val:
        raise ShardError(
            f"domains {only_val} occur only in the validation inputs (--val-file), not in the training inputs; "
            "a domain needs training records: add them to the training inputs or map them with --domain-map"
        )


def _remove_leftovers(out: Path) -> None:
    """Remove the staging (`.OUT.tmp-*`) and swap (`.OUT.old-*`) directories of killed runs into `out`."""
    if not out.parent.is_dir():
        return
    prefixes = (f".{out.name}.tmp-", f".{out.name}.old-")
    for path in sorted(p for p in out.parent.iterdir() if p.name.startswith(prefixes) and p.is_dir()):
        match = re.fullmatch(r"(\d+)-[0-9a-f]{8}", path.name[len(prefixes[0]) :])
        pid = int(match.group(1)) if match else None
        if pid is not None and _is_running(pid):
            logger.warning(
                "%s looks like the staging directory of a run into %s that is still going (pid %d); left alone. "
                "Remove it yourself if that process is not a shard run.",
                path,
                out,
                pid,
            )
            continue
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        logger.warning("removing %s (%.1f MB), left behind by an interrupted run into %s", path, size / 1e6, out)
        shutil.rmtree(path, ignore_errors=True)


def _is_running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process cleans up its own staging; one left over is from an earlier, dead run
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _check_output(out: Path, overwrite: bool) -> None:
    if not out.exists():
        return
    if not overwrite:
        raise ValueError(f"output {str(out)!r} already exists; pass --overwrite (overwrite=True) to replace it")
    if not out.is_dir() or (any(out.iterdir()) and not (out / "manifest.json").is_file()):
        raise ValueError(
            f"output {str(out)!r} exists and is not a sharded corpus (no manifest.json); refusing to overwrite it, remove it yourself"
        )


def _move_into_place(tmp: Path, out: Path) -> None:
    """Swap the finished temporary directory in; an old output is removed only after the swap."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
