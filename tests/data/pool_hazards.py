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
  worker_dies: the worker that gets the chunk holding DIE_MARKER takes the lock of the queue that carries results
      back and is killed (SIGKILL) while holding it, as a worker killed mid-send is (by the out-of-memory killer,
      or by `Pool.terminate()` on an error or Ctrl-C: a shard.py run hung that way after Ctrl-C). The run must
      end with an error, not wait for the chunk's result or for that lock forever.
  interrupt_writer_start: Ctrl-C lands while an MDS writer starts its (upload) thread, after the thread started
      and before concurrent.futures registered it for its exit handler (ThreadPoolExecutor._adjust_thread_count):
      nothing then tells the thread to stop and the interpreter waits for it at exit, after "interrupted" is
      printed. Ctrl-C when the first shard file appears, as tests/data/test_faults_shard.py sends it, hits that
      window about once in 15 runs; here the KeyboardInterrupt is raised right there. One worker, no pool.
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

SCENARIOS = ("late_worker", "lock_at_fork", "worker_dies", "interrupt_writer_start")
LATE_S = 3.0  # the late worker's start-up when nothing signals it
N_DOCS = 64
CHUNK_RECORDS = 8
DIR_ENV = "POOL_HAZARD_DIR"
DIE_MARKER = "die-holding-the-result-lock"
DIE_AT = 20  # the record that carries it: in the third chunk

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


def die_holding_result_lock(chunk):
    """`_process_chunk`, except that for the chunk with DIE_MARKER the worker takes the result queue's lock and dies."""
    if any(DIE_MARKER.encode() in raw.payload for raw in chunk[2]):
        frame = sys._getframe(1)
        while frame is not None:  # the pool's worker loop holds the queue: Pool's `outqueue`, ProcessPoolExecutor's `result_queue`
            queue = frame.f_locals.get("outqueue") or frame.f_locals.get("result_queue")
            if queue is not None:
                queue._wlock.acquire()
                os.kill(os.getpid(), signal.SIGKILL)
            frame = frame.f_back
        raise RuntimeError("no result queue found in the worker's frames")
    return _PROCESS(chunk)


def interrupt_after_the_first_writer_thread_starts() -> None:
    """Make the first start of a concurrent.futures worker thread raise KeyboardInterrupt once it has started."""
    import concurrent.futures.thread

    real_start = threading.Thread.start

    def start(self) -> None:
        real_start(self)
        if self._target is concurrent.futures.thread._worker and not getattr(start, "done", False):
            start.done = True
            raise KeyboardInterrupt

    threading.Thread.start = start


def write_corpus(path: Path, die_at: int | None = None) -> Path:
    lines = [json.dumps({"text": f"document {i} " + "alpha beta gamma " * (i % 7 + 1), "source": "ab"[i % 2]}) for i in range(N_DOCS)]
    if die_at is not None:
        lines[die_at] = json.dumps({"text": DIE_MARKER, "source": "a"})
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0))
    return path


def main(argv: list[str]) -> int:
    scenario, workdir = argv[0], Path(argv[1])
    if scenario not in SCENARIOS:
        raise SystemExit(f"unknown scenario {scenario!r}; one of {SCENARIOS}")
    os.environ[DIR_ENV] = str(workdir)
    corpus = write_corpus(workdir / "docs.jsonl.gz", die_at=DIE_AT if scenario == "worker_dies" else None)
    workers = 1 if scenario == "interrupt_writer_start" else 2
    options = ShardOptions(out=workdir / "out", tokenizer=DEMO_TOKENIZER, max_seq_len=32, workers=workers, chunk_records=CHUNK_RECORDS, progress=False)
    release = threading.Event()
    if scenario == "late_worker":
        # Ignored until late_start installs its handler, so that an early SIGTERM cannot end a worker either.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sharding._init_pool_worker = late_start
    elif scenario == "worker_dies":
        sharding._process_chunk = die_holding_result_lock
    elif scenario == "interrupt_writer_start":
        interrupt_after_the_first_writer_thread_starts()
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
    except KeyboardInterrupt:
        print("interrupted", flush=True)  # as tools/shard.py does; then the interpreter exits
        return 130
    finally:
        release.set()
    print(f"finished: {result.records_read} records, {result.tokens_written} tokens", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
