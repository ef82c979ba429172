"""Benchmark tools/shard.py throughput against the tokenizer alone, measured side by side in one run.

Example:
    python tools/bench/bench_shard.py --scale 2 --repeats 3

Generates the sample corpus (Dolma-style part) in a temporary directory, then, in each repeat:
  * tokenizer alone: the same documents, already in memory, encoded in batches of 256 by the
    tokenizer's Rust backend in this process on one thread (TOKENIZERS_PARALLELISM=false);
  * shard, 1 worker and 2 workers: the whole pretrain run (read .json.gz, parse, validate,
    tokenize, pack 128-token sequences, write zstd MDS with sha1/xxh64 hashes, manifest),
    timed end to end including the worker pool start.
Prints tokens/s for each and the two ratios the project targets:
  2 workers / 1 worker throughput >= 1.6, and 1-worker total time / tokenizer-alone time <= 1.5.
Best-of-repeats times are used for the ratios (the least disturbed measurement of each).
Also prints, for information, the tokenizer with Rust multithreading on (all cores).

With --start-methods (for example `--start-methods fork,forkserver --workers 2,8`) it instead compares how
the worker processes start: each run is a fresh process (as a tools/shard.py run is, so that forkserver's
server start is paid every time), with Streaming and transformers imported before the timed run (they cost
the same under any method), the methods interleaved within each repeat. It prints the best and median wall
time of `shard_corpus` (pool start included) per method and worker count, and each method's difference to
the first. On the 2-core development machine (other jobs running: load 2-4), 5 repeats, with the pool of
issue 20 (ProcessPoolExecutor):

    scale  tokens   workers  fork best / median   forkserver best / median   forkserver - fork
    0.05   33,534   2        0.16s / 0.20s        0.24s / 0.27s              +0.08s / +0.07s
    0.05   33,534   8        0.37s / 0.39s        0.30s / 0.31s              -0.07s / -0.08s
    1      681,552  2        1.24s / 1.30s        1.38s / 1.45s              +0.14s / +0.15s
    1      681,552  8        1.54s / 1.56s        1.42s / 1.49s              -0.13s / -0.07s

forkserver (sharding's default since issue 20) costs about 0.1 s per run at 2 workers, the start of its
server process (a Python that imports pipeline.sharding), and saves about 0.1 s at 8 workers, where forking 8
workers from that small server is cheaper than forking a parent that has torch loaded. (Measured earlier at
load 7-10 with multiprocessing.Pool: +0.24 / +0.17 s at 2 workers, nothing measurable at 8.)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sample_corpus import write_sample_corpus  # noqa: E402  (tools/sample_corpus.py)

from pipeline.corpora import make_corpus_spec  # noqa: E402
from pipeline.sharding import ShardOptions, shard_corpus  # noqa: E402
from pipeline.tokenizer import DEMO_TOKENIZER, load_tokenizer  # noqa: E402


def _texts(root: Path) -> list[str]:
    texts = []
    for path in sorted(root.rglob("*.json.gz")):
        for line in gzip.decompress(path.read_bytes()).split(b"\n"):
            if line.strip():
                texts.append(json.loads(line)["text"])
    return texts


def _time_tokenizer(backend, texts: list[str], batch: int, parallel: bool) -> tuple[float, int, float]:
    """Wall seconds, tokens, CPU seconds of this process."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"
    cpu = time.process_time()
    start = time.perf_counter()
    n = 0
    for i in range(0, len(texts), batch):
        n += sum(len(e.ids) for e in backend.encode_batch(texts[i : i + batch], add_special_tokens=False))
    return time.perf_counter() - start, n, time.process_time() - cpu


def _children_cpu() -> float:
    """CPU seconds of the reaped child processes: this process's own, plus its forkserver's.

    Sharding starts its workers with forkserver, which makes them children of the forkserver process, not of
    this one: their CPU time is added to the forkserver's (/proc/PID/stat, Linux) when it reaps them.
    """
    t = os.times()
    total = t.children_user + t.children_system
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != os.getpid() or b"forkserver" not in (stat.parent / "cmdline").read_bytes():
                continue
        except (OSError, IndexError, ValueError):  # gone, or not readable
            continue
        total += (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime, cstime
    return total


def _time_shard(docs: Path, out: Path, workers: int, tokenizer: str, max_seq_len: int) -> tuple[float, int, float, float]:
    """Wall seconds, tokens written, CPU seconds of this (main) process and of the worker processes."""
    shutil.rmtree(out, ignore_errors=True)
    options = ShardOptions(out=out, tokenizer=tokenizer, max_seq_len=max_seq_len, workers=workers, progress=False, overwrite=True)
    before, children_before = os.times(), _children_cpu()
    start = time.perf_counter()
    result = shard_corpus(make_corpus_spec("dolma"), [docs], options)
    wall = time.perf_counter() - start
    after = os.times()
    main_cpu = after.user + after.system - before.user - before.system
    child_cpu = max(0.0, _children_cpu() - children_before)
    return wall, result.tokens_written, main_cpu, child_cpu


# One run in a fresh process: argv = docs, out, workers, start method, tokenizer, max_seq_len; prints JSON.
# Streaming (torch) and transformers are imported first, outside the timed run: their import takes seconds
# whatever the start method, and only adds noise to the comparison.
_FRESH_RUN = """
import json, sys
sys.path.insert(0, {root!r})
import streaming, transformers
from pipeline.corpora import make_corpus_spec
from pipeline.sharding import ShardOptions, shard_corpus
docs, out, workers, method, tokenizer, max_seq_len = sys.argv[1:]
options = ShardOptions(out=out, tokenizer=tokenizer, max_seq_len=int(max_seq_len), workers=int(workers),
                       start_method=method, progress=False, overwrite=True)
result = shard_corpus(make_corpus_spec("dolma"), [docs], options)
print(json.dumps({{"seconds": result.seconds, "tokens": result.tokens_written}}))
"""


def _time_fresh_process(docs: Path, out: Path, workers: int, method: str, tokenizer: str, max_seq_len: int) -> tuple[float, int]:
    """`shard_corpus`'s wall seconds and tokens written, run in a new Python process with the given start method."""
    code = _FRESH_RUN.format(root=str(Path(__file__).resolve().parents[2]))
    args = [str(docs), str(out), str(workers), method, tokenizer, str(max_seq_len)]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"shard run (workers {workers}, start method {method}) failed with exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return float(result["seconds"]), int(result["tokens"])


def compare_start_methods(docs: Path, root: Path, methods: list[str], workers_list: list[int], repeats: int, tokenizer: str, max_seq_len: int) -> None:
    """Print wall times per start method and worker count, each run a fresh process, the methods interleaved."""
    wall: dict[tuple[int, str], list[float]] = {(w, m): [] for w in workers_list for m in methods}
    tokens: dict[tuple[int, str], int] = {}
    for r in range(repeats):
        for workers in workers_list:
            # Alternate the order between repeats, so that neither method always runs first.
            for method in methods if r % 2 == 0 else methods[::-1]:
                t, tokens[workers, method] = _time_fresh_process(docs, root / "out", workers, method, tokenizer, max_seq_len)
                wall[workers, method].append(t)
    print(f"machine: {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f} at the end; repeats: {repeats}; each run a fresh process")
    print(f"{'workers':>7s}  {'method':11s} {'tokens':>9s} {'wall best':>9s} {'median':>7s} {'tokens/s':>10s}  vs {methods[0]} (best, median)")
    for workers in workers_list:
        base = wall[workers, methods[0]]
        for method in methods:
            times = wall[workers, method]
            versus = "" if method == methods[0] else f"{min(times) - min(base):+.2f}s, {statistics.median(times) - statistics.median(base):+.2f}s"
            print(
                f"{workers:7d}  {method:11s} {tokens[workers, method]:9d} {min(times):8.2f}s {statistics.median(times):6.2f}s "
                f"{tokens[workers, method] / min(times):10,.0f}  {versus}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.start_methods:
        return _compare_start_methods_command(parser, args)

    tok_key, w1, w2 = "tokenizer alone (1 thread)", "shard.py --workers 1", "shard.py --workers 2"
    wall: dict[str, list[float]] = {tok_key: [], w1: [], w2: []}
    cpu: dict[str, list[tuple[float, float]]] = {tok_key: [], w1: [], w2: []}  # (main process, workers)
    tokens: dict[str, int] = {}
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_sample_corpus(root / "corpus", seed=0, scale=args.scale)
        docs = root / "corpus" / "dolma" / "documents"
        texts = _texts(docs)
        backend = load_tokenizer(args.tokenizer).backend_tokenizer
        backend.encode_special_tokens = True  # as shard.py does
        for _ in range(args.repeats):
            t, tokens[tok_key], c = _time_tokenizer(backend, texts, 256, parallel=False)
            wall[tok_key].append(t)
            cpu[tok_key].append((c, 0.0))
            for workers, key in ((1, w1), (2, w2)):
                t, tokens[key], main_cpu, child_cpu = _time_shard(docs, root / f"out{workers}", workers, args.tokenizer, args.max_seq_len)
                wall[key].append(t)
                cpu[key].append((main_cpu, child_cpu))
        threaded_wall = _time_tokenizer(backend, texts, 256, parallel=True)[0]
    if saved is None:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
    else:
        os.environ["TOKENIZERS_PARALLELISM"] = saved
    _print_report(args, texts, wall, cpu, tokens, threaded_wall, keys=(tok_key, w1, w2))
    return 0


def _build_parser() -> argparse.ArgumentParser:
    """The corpus scale, repeats, tokenizer and sequence length; or the start-method comparison's options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Scale 4 (~2.7M tokens): each worker pays a fixed ~0.4 s to import and load the tokenizer, which
    # a real corpus amortises; at scale 1 that start-up alone is 10% of the run.
    parser.add_argument("--scale", type=float, default=4.0, help="sample-corpus scale (default 4: ~2.7M Dolma tokens)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each measurement (default 3)")
    parser.add_argument("--tokenizer", default=DEMO_TOKENIZER, help="tokenizer (default: the demo tokenizer)")
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument(
        "--start-methods",
        help="compare worker start methods instead, comma-separated (e.g. fork,forkserver; the first is the reference)",
    )
    parser.add_argument("--workers", default="2,8", help="with --start-methods: worker counts, comma-separated (default: 2,8)")
    return parser


def _compare_start_methods_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`--start-methods`: check the methods and worker counts, then compare them on a fresh sample corpus."""
    import multiprocessing

    methods = args.start_methods.split(",")
    unknown = [m for m in methods if m not in multiprocessing.get_all_start_methods()]
    if unknown or len(methods) < 2:
        parser.error(f"--start-methods needs two or more of {multiprocessing.get_all_start_methods()}, got {args.start_methods!r}")
    try:
        workers_list = [int(w) for w in args.workers.split(",")]
    except ValueError:
        workers_list = []
    if not workers_list or min(workers_list) < 2:
        parser.error(f"--workers must be integers >= 2 (a pool starts only then), got {args.workers!r}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_sample_corpus(root / "corpus", seed=0, scale=args.scale)
        docs = root / "corpus" / "dolma" / "documents"
        compare_start_methods(docs, root, methods, workers_list, args.repeats, args.tokenizer, args.max_seq_len)
    return 0


def _print_report(
    args: argparse.Namespace,
    texts: list[str],
    wall: dict[str, list[float]],
    cpu: dict[str, list[tuple[float, float]]],
    tokens: dict[str, int],
    threaded_wall: float,
    *,
    keys: tuple[str, str, str],
) -> None:
    """The measurements' table, then the targets' verdicts from wall time and the same from CPU seconds."""
    tok_key, w1, w2 = keys
    print(f"corpus: {len(texts)} Dolma-style documents, {sum(map(len, texts)) / 1e6:.1f}M characters, max_seq_len {args.max_seq_len}")
    print(f"machine: {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f} at the end; repeats: {args.repeats}")
    print(f"{'measurement':30s} {'tokens':>9s} {'wall best':>9s} {'median':>7s} {'tokens/s':>10s} {'cpu main':>9s} {'cpu workers':>11s}")
    best = {k: min(v) for k, v in wall.items()}
    best_cpu = {k: min(cpu[k], key=sum) for k in cpu}
    for key in wall:
        main_cpu, child_cpu = best_cpu[key]
        print(
            f"{key:30s} {tokens[key]:9d} {best[key]:8.2f}s {statistics.median(wall[key]):6.2f}s {tokens[key] / best[key]:10,.0f} "
            f"{main_cpu:8.2f}s {child_cpu:10.2f}s"
        )
    print(f"{'tokenizer alone (all threads)':30s} {tokens[tok_key]:9d} {threaded_wall:8.2f}s {'':7s} {tokens[tok_key] / threaded_wall:10,.0f}  (information)")

    # Targets, from wall time as specified (shard.py's token count includes one EOS per document).
    speedup = (tokens[w2] / best[w2]) / (tokens[w1] / best[w1])
    overhead = best[w1] / best[tok_key]
    print(f"2 workers / 1 worker throughput:       {speedup:.2f}x  (target >= 1.6): {'PASS' if speedup >= 1.6 else 'FAIL'}")
    print(f"1 worker total time / tokenizer alone: {overhead:.2f}x  (target <= 1.5): {'PASS' if overhead <= 1.5 else 'FAIL'}")
    # The same from CPU seconds, which other load on the machine does not inflate. With 2 workers the
    # workers run in parallel and the main process beside them, so on >= 3 free cores the wall time is
    # about max(main, workers / 2); on exactly 2 free cores about (main + workers) / 2.
    main2, child2 = best_cpu[w2]
    cpu1 = sum(best_cpu[w1])
    print(f"CPU view: 1-worker CPU / tokenizer CPU = {cpu1 / sum(best_cpu[tok_key]):.2f}x; 2-worker run main {main2:.2f}s + workers {child2:.2f}s")
    print(
        f"          projected 2/1-worker speedup: {cpu1 / max(main2, child2 / 2):.2f}x on >= 3 free cores, "
        f"{cpu1 / ((main2 + child2) / 2):.2f}x on 2 free cores"
    )


if __name__ == "__main__":
    raise SystemExit(main())
