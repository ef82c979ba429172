"""Fault injection for tests/data/test_pool_teardown.py: a sharding run with two workers, in a child process of its own.

The child is started as `python -c "...main(argv)" SCENARIO DIR` so that a run that hangs can be killed with its
workers. The injected functions live in this importable module, so that they reach the workers under any start
method (pickled by name: a forked worker finds them in its copy of the parent, a spawned or forkserver worker
imports this module afresh).

Scenarios:
  late_worker: the pool's teardown meets a worker that is not yet waiting for work and that does not end on
      SIGTERM. The first worker starts at once and does every chunk; the second finishes its start-up only once
      it is sent SIGTERM (or after LATE_S seconds), and then carries on instead of ending, as a worker does when a
      Python SIGTERM handler it inherited (Composer's engine installs one at import) is tripped just before the
      worker blocks: the handler never runs (seen with gdb in the hang of issue 20: `Handlers[SIGTERM].tripped`
      was 1 in a worker asleep in the task queue's lock). `Pool.terminate()` takes the task queue's read lock for
      good and then joins every worker, so it waits for that worker forever.
  lock_at_fork: another thread of the parent holds a lock while the pool starts, and the workers need that lock
      for each chunk (as they could need a lock inside a library: an I/O buffer, an allocator, the tokenizer's).
      A forked worker gets the lock in its held state, with no thread left to release it, and waits forever.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from pipeline import sharding
from pipeline.corpora import make_corpus_spec
from pipeline.sharding import ShardOptions, shard_corpus
from pipeline.tokenizer import DEMO_TOKENIZER

SCENARIOS = ("late_worker", "lock_at_fork")
LATE_S = 3.0  # the late worker's start-up when nothing signals it
N_DOCS = 64
CHUNK_RECORDS = 8
DIR_ENV = "POOL_HAZARD_DIR"

# The real functions, taken before main() replaces them in `sharding` (in this process; a forked worker copies the
# replaced ones, and these names then still point to the real ones).
_INIT = sharding._init_pool_worker
_PROCESS = sharding._process_chunk
HELD = threading.Lock()


def late_start(config) -> None:
    """Pool initializer: the first worker starts at once, any other waits for SIGTERM or LATE_S, notes a SIGTERM and goes on."""
    terms: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))
    workdir = Path(os.environ[DIR_ENV])
    try:
        os.close(os.open(workdir / "first-worker", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        deadline = time.monotonic() + LATE_S
        while not terms and time.monotonic() < deadline:
            time.sleep(0.01)
    if terms:
        (workdir / f"sigterm-{os.getpid()}").touch()
    _INIT(config)


def process_under_lock(chunk):
    """`_process_chunk`, after taking and releasing HELD."""
    with HELD:
        pass
    return _PROCESS(chunk)


def write_corpus(path: Path) -> Path:
    lines = [json.dumps({"text": f"document {i} " + "alpha beta gamma " * (i % 7 + 1), "source": "ab"[i % 2]}) for i in range(N_DOCS)]
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0))
    return path


def main(argv: list[str]) -> int:
    scenario, workdir = argv[0], Path(argv[1])
    if scenario not in SCENARIOS:
        raise SystemExit(f"unknown scenario {scenario!r}; one of {SCENARIOS}")
    os.environ[DIR_ENV] = str(workdir)
    corpus = write_corpus(workdir / "docs.jsonl.gz")
    options = ShardOptions(out=workdir / "out", tokenizer=DEMO_TOKENIZER, max_seq_len=32, workers=2, chunk_records=CHUNK_RECORDS, progress=False)
    release = threading.Event()
    if scenario == "late_worker":
        # Ignored until late_start installs its handler, so that an early SIGTERM cannot end a worker either.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sharding._init_pool_worker = late_start
    else:
        held = threading.Event()

        def hold() -> None:
            with HELD:
                held.set()
                release.wait()

        threading.Thread(target=hold, name="holds-HELD", daemon=True).start()
        held.wait()
        sharding._process_chunk = process_under_lock
    try:
        result = shard_corpus(make_corpus_spec("dolma"), [corpus], options)
    finally:
        release.set()
    print(f"finished: {result.records_read} records, {result.tokens_written} tokens", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
