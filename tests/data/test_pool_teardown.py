"""Sharding's worker pool ends without a hang (issue 20): deterministic reproductions of the deadlocks of a
terminate()-ed pool and of a pool forked from a process with threads, each in a child process that is killed on a hang."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.corpora import make_corpus_spec
from pipeline.manifest import load_manifest
from pipeline.sharding import ShardError, ShardOptions, shard_corpus
from pipeline.tokenizer import DEMO_TOKENIZER
from tests.common.paths import REPO_ROOT
from tests.data import pool_hazards
from tests.data.mds_helpers import write_jsonl

# A run takes a few seconds (late_worker: LATE_S more); a hang is cut off here instead of at the test's time limit.
RUN_TIMEOUT_S = 60


def _run(scenario: str, workdir: Path, expect_rc: int = 0) -> tuple[str, str]:
    code = f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); from tests.data.pool_hazards import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, scenario, str(workdir)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a hung run is killed with its workers
    )
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the sharding run ({scenario}) hung: not ended after {RUN_TIMEOUT_S} s, killed; stderr tail:\n{stderr[-2000:]}")
    assert proc.returncode == expect_rc, stderr[-3000:]
    return stdout, stderr


@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
def test_run_ends_although_a_worker_joins_late_and_outlives_sigterm(tmp_path):
    stdout, _ = _run("late_worker", tmp_path)
    assert f"finished: {pool_hazards.N_DOCS} records" in stdout
    assert load_manifest(tmp_path / "out").domains  # the output was written and moved into place
    # The normal end closes the pool and lets each worker take its stop sentinel: no worker is sent SIGTERM.
    assert sorted(p.name for p in tmp_path.glob("sigterm-*")) == []


@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
def test_run_ends_although_another_thread_holds_a_lock_the_workers_need(tmp_path):
    stdout, _ = _run("lock_at_fork", tmp_path)
    assert f"finished: {pool_hazards.N_DOCS} records" in stdout
    assert load_manifest(tmp_path / "out").domains


@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
def test_a_worker_killed_holding_the_result_queues_lock_ends_the_run_with_an_error(tmp_path):
    _, stderr = _run("worker_dies", tmp_path, expect_rc=1)
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("pipeline.sharding.ShardError: a worker process ended abruptly"), stderr[-3000:]
    assert "docs.jsonl.gz" in last and "fewer workers" in last, last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl.gz"]  # no output, no staging directory


@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
def test_ctrl_c_while_a_writer_starts_its_thread_still_lets_the_process_exit(tmp_path):
    stdout, _ = _run("interrupt_writer_start", tmp_path, expect_rc=130)
    assert stdout.strip().splitlines()[-1] == "interrupted"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl.gz"]


def test_an_error_stops_the_pool_and_leaves_no_worker_or_staging(tmp_path):
    rows = [{"text": f"document {i}", "source": "ab"[i % 2]} for i in range(200)] + [b'{"text": "cut short']
    path = write_jsonl(tmp_path / "in" / "docs.jsonl", rows)
    before = set(multiprocessing.active_children())
    options = ShardOptions(out=tmp_path / "out", tokenizer=DEMO_TOKENIZER, max_seq_len=16, workers=2, chunk_records=8, progress=False)
    with pytest.raises(ShardError, match=r"^docs.jsonl:201: "):
        shard_corpus(make_corpus_spec("dolma"), [path], options)
    assert set(multiprocessing.active_children()) <= before  # the workers were stopped and reaped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_start_method_must_be_one_multiprocessing_has(tmp_path):
    with pytest.raises(ValueError, match=r"`start_method` must be None or one of \[.*'spawn'.*\], got 'thread'"):
        ShardOptions(out=tmp_path / "out", tokenizer=DEMO_TOKENIZER, max_seq_len=16, start_method="thread")


def _broken_pool_at_third_submit(first_results_broken: bool):
    """A stand-in for `ProcessPoolExecutor.submit` whose pool breaks before the third chunk is handed over: the
    futures already handed out either fail with the break or finished."""
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    calls = []

    def submit(fn, chunk):
        calls.append(chunk)
        if len(calls) == 3:
            raise BrokenProcessPool("A child process terminated abruptly")
        future = Future()
        if first_results_broken:
            future.set_exception(BrokenProcessPool("A child process terminated abruptly"))
        else:
            future.set_result([len(calls)])
        return future

    return submit


def _chunk(name: str, line: int):
    from types import SimpleNamespace

    return (name, None, [SimpleNamespace(line=line)], False)


@pytest.mark.parametrize("first_results_broken", [True, False])
def test_a_pool_that_breaks_before_a_submit_ends_with_the_shard_error(first_results_broken):
    """A worker's death may reach `submit` before any result shows it (the race that made the subprocess test above
    flaky): the run must still end with the ShardError that names where the input stopped, not with
    concurrent.futures' BrokenProcessPool."""
    from pipeline import sharding

    chunks = [(i, _chunk(f"docs{i}.jsonl", 10 * (i + 1))) for i in range(5)]
    window = sharding._ordered_window(_broken_pool_at_third_submit(first_results_broken), chunks, window=8)
    done = []
    with pytest.raises(sharding.ShardError, match="a worker process ended abruptly") as err:
        for item in window:
            done.append(item[0])
    # Broken results: the first chunk in flight reports it. Finished ones are kept in order, then the chunk the
    # pool refused is named.
    assert done == ([] if first_results_broken else [0, 1])
    assert ("docs0.jsonl:10" if first_results_broken else "docs2.jsonl:30") in str(err.value)
