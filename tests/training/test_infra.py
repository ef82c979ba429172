"""Training infrastructure: a fast `--help`, a clear error for a pool larger than the split, log
files kept across autoresume, and stale Streaming shared memory / file locks cleaned at start."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import train
from pipeline import streaming_cleanup
from pipeline.config import load_config
from pipeline.dataset import split_samples
from pipeline.manifest import load_manifest
from tests.common.paths import REPO_ROOT
from tests.training.conftest import tiny_overrides

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
HEAVY = ("torch", "composer", "transformers", "streaming")


def test_train_help_is_fast_and_imports_no_heavy_library():
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['train.py', '--help']\n"
        "try:\n"
        "    runpy.run_path('train.py', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Usage:" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "HEAVY=", out.stdout[-500:]

    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO_ROOT, env=env, capture_output=True)
    elapsed = time.perf_counter() - t0
    print(f"python train.py --help: {elapsed:.2f} s")
    assert res.returncode == 0
    assert elapsed < 2.0, f"python train.py --help took {elapsed:.2f} s (target < 2 s)"


def _train_samples(shard_dir: Path) -> int:
    return sum(split_samples(d, "train") for d in load_manifest(str(shard_dir)).domains)


def test_pool_larger_than_train_split_raises_naming_sizes_and_fix(dolma_shards, tmp_path):
    total = _train_samples(dolma_shards)
    batch = total // 3 + 2  # oversampling 3 in tiny_overrides: the pool is 3 * batch > total
    pool = 3 * batch
    assert pool > total
    cfg = load_config(
        TINY,
        tiny_overrides(
            dolma_shards, tmp_path / "big", "eval_loader=null", f"global_train_batch_size={batch}"
        ),
    )
    with pytest.raises(ValueError) as err:
        train.build_trainer(cfg)
    msg = str(err.value)
    assert str(pool) in msg and str(total) in msg, msg
    assert "global_train_batch_size" in msg and "oversampling" in msg, msg


def test_pool_equal_to_train_split_is_accepted(dolma_shards, tmp_path):
    total = _train_samples(dolma_shards)
    cfg = load_config(
        TINY,
        tiny_overrides(
            dolma_shards,
            tmp_path / "fits",
            "eval_loader=null",
            f"global_train_batch_size={total // 3}",
            "max_duration=1ba",
        ),
    )
    trainer = train.build_trainer(cfg)  # 3 * (total // 3) <= total: at least one full pool per epoch
    trainer.close()


def test_autoresumed_run_keeps_first_runs_log_lines(dolma_shards, tmp_path):
    run = tmp_path / "auto"
    args = tiny_overrides(
        dolma_shards,
        run,
        "eval_loader=null",
        "run_name=autoresume-log",
        "autoresume=true",
        "max_duration=4ba",
        "save_interval=2ba",
        "algorithms.data_selection.strategy=random",
    )
    first = train.build_trainer(load_config(TINY, args))
    first.fit(duration="2ba")  # stop after the checkpoint at batch 2, as a preempted run would
    first.close()
    log_file = run / "log-rank0.txt"
    first_lines = log_file.read_text().splitlines()
    assert any("[batch=1]" in line for line in first_lines)

    second = train.build_trainer(load_config(TINY, args))
    second.fit()
    assert second.state.timestamp.batch.value == 4
    second.close()
    lines = log_file.read_text().splitlines()
    assert lines[: len(first_lines)] == first_lines
    assert any("[batch=3]" in line for line in lines[len(first_lines) :])


# ---- stale Streaming shared memory and file locks ------------------------------------------------


def _hold(path: Path, how: str) -> subprocess.Popen:
    """A child process that keeps `path` mapped (`mmap`) or flock-ed (`flock`) until killed."""
    code = (
        "import fcntl, mmap, os, sys, time\n"
        f"fd = os.open({str(path)!r}, os.O_RDWR)\n"
        + ("m = mmap.mmap(fd, 0)\nos.close(fd)\n" if how == "mmap" else "fcntl.flock(fd, fcntl.LOCK_EX)\n")
        + "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _make(path: Path) -> Path:
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    return path


def test_clean_stale_removes_only_prefixes_no_live_process_holds(tmp_path):
    shm, locks = tmp_path / "shm", tmp_path / "locks"
    shm.mkdir()
    locks.mkdir()
    # 000000: a live run's shared memory (mapped by a live process) -> kept, with its file locks.
    live = [
        _make(shm / "000000_locals"),
        _make(shm / "000000_barrier"),
        _make(locks / "000000_barrier_filelock"),
    ]
    # 000001: left by a killed run -> removed.
    stale = [
        _make(shm / "000001_locals"),
        _make(shm / "000001_epoch_data"),
        _make(locks / "000001_cache_filelock"),
    ]
    # 000002: only a lock file, but flock-ed by a live process right now -> kept.
    locked = _make(locks / "000002_barrier_filelock")
    # 000003: a stale lock file alone (its run's shared memory is gone) -> removed.
    stale_lock = _make(locks / "000003_cache_filelock")
    # Not Streaming's names -> never touched.
    others = [_make(shm / "000004_something_else"), _make(locks / "notes_filelock"), _make(shm / "psm_1234")]
    holders = [_hold(shm / "000000_barrier", "mmap"), _hold(locked, "flock")]
    try:
        removed = streaming_cleanup.clean_stale_streaming_resources(shm_dir=str(shm), lock_dir=str(locks))
    finally:
        for p in holders:
            p.kill()
            p.wait()
    assert sorted(removed) == sorted(str(p) for p in [*stale, stale_lock])
    for p in [*live, locked, *others]:
        assert p.exists(), p
    for p in [*stale, stale_lock]:
        assert not p.exists(), p


def test_clean_stale_ignores_a_live_mapping_of_an_older_block_with_the_same_name(tmp_path):
    """A live process may still map an unlinked block whose name a later, now stale, block reuses."""
    shm, locks = tmp_path / "shm", tmp_path / "locks"
    shm.mkdir()
    locks.mkdir()
    old = _make(shm / "000005_locals")
    holder = _hold(old, "mmap")
    try:
        old.unlink()  # e.g. removed by its creator's atexit; the holder keeps the old inode mapped
        stale = _make(shm / "000005_locals")
        removed = streaming_cleanup.clean_stale_streaming_resources(shm_dir=str(shm), lock_dir=str(locks))
    finally:
        holder.kill()
        holder.wait()
    assert removed == [str(stale)]
    assert not stale.exists()


def test_clean_stale_removes_shared_memory_of_a_killed_streaming_process(dolma_shards):
    """A real StreamingDataset killed with SIGKILL leaves /dev/shm entries; the cleaner removes them."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this platform")
    code = (
        "import os, signal, sys\n"
        "from pipeline.dataset import DomainStreamingDataset\n"
        f"ds = DomainStreamingDataset(shard_dir={str(dolma_shards)!r}, split='val', shuffle=False, batch_size=2)\n"
        "next(iter(ds))\n"
        "print(ds._shm_prefix_int, flush=True)\n"
        # The whole process group, as a job scheduler or the launcher kills it: multiprocessing's
        # resource tracker (which would otherwise unlink the shared memory) dies too.
        "os.killpg(os.getpgid(0), signal.SIGKILL)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        start_new_session=True,
    )
    assert res.returncode == -9, res.stderr[-2000:]
    prefix = int(res.stdout.split()[-1])
    locals_shm = Path("/dev/shm") / f"{prefix:06}_locals"
    assert locals_shm.exists()  # SIGKILL skips Streaming's atexit cleanup
    # Only the killed run's locals name our shard dir; check that to stay safe next to other jobs.
    assert str(dolma_shards) in locals_shm.read_bytes().decode("utf-8", "replace")
    removed = streaming_cleanup.clean_stale_streaming_resources()
    assert str(locals_shm) in removed
    assert not locals_shm.exists()
    assert not (Path(tempfile.gettempdir()) / f"{prefix:06}_barrier_filelock").exists()


def test_train_main_cleans_stale_entries_before_building(monkeypatch, tmp_path, dolma_shards):
    shm, locks = tmp_path / "shm", tmp_path / "locks"
    shm.mkdir()
    locks.mkdir()
    stale = [_make(shm / "000007_locals"), _make(locks / "000007_barrier_filelock")]
    monkeypatch.setattr(streaming_cleanup, "SHM_DIR", str(shm))
    monkeypatch.setattr(tempfile, "tempdir", str(locks))

    class Stop(Exception):
        pass

    def stop(cfg):
        raise Stop

    monkeypatch.setattr(train, "build_trainer", stop)
    with pytest.raises(Stop):
        train.main([str(TINY), *tiny_overrides(dolma_shards, tmp_path / "run")])
    for p in stale:
        assert not p.exists(), p


def test_datasets_of_two_jobs_starting_together_register_distinct_prefixes(monkeypatch, tmp_path, dolma_shards):
    """Streaming finds a free shm prefix, then creates it; two jobs in that window chose the same one.

    The window is widened (a pause after the scan) so that both constructions find the same free
    prefix; without the registration lock the second died with FileExistsError '/<prefix>_locals'
    (tools/run_experiment.py --jobs 2).
    """
    import threading
    import time

    from streaming.base.shared import prefix as prefix_mod

    from pipeline.dataset import DomainStreamingDataset

    real = prefix_mod._check_and_find_retrying

    def slow_scan(*args, **kwargs):
        found = real(*args, **kwargs)
        time.sleep(0.5)
        return found

    monkeypatch.setattr(prefix_mod, "_check_and_find_retrying", slow_scan)
    dirs = [tmp_path / "a", tmp_path / "b"]  # two streams cannot share a local dir: a copy each
    for d in dirs:
        shutil.copytree(dolma_shards, d)
    made, errors = {}, {}

    def build(i: int) -> None:
        try:
            made[i] = DomainStreamingDataset(shard_dir=str(dirs[i]), split="val", shuffle=False, batch_size=2)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors[i] = e

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert made[0]._shm_prefix_int != made[1]._shm_prefix_int


def test_an_autoresumed_run_keeps_a_selection_log_written_with_fewer_columns(dolma_shards, tmp_path):
    """A run resumed under a version whose selection_log.csv has a column more (`made_ahead`) keeps the first
    run's rows by column name: their values stay under their own headers."""
    import csv

    run = tmp_path / "auto"
    args = tiny_overrides(
        dolma_shards, run, "eval_loader=null", "autoresume=true", "max_duration=4ba", "save_interval=2ba",
        "run_name=autoresume-columns",
    )
    first = train.build_trainer(load_config(TINY, args))
    first.fit(duration="2ba")
    first.close()
    path = run / "selection_log.csv"
    with open(path, newline="") as f:
        old = [row for row in csv.DictReader(f)]
    header = [c for c in old[0] if c != "made_ahead"]  # the log as the version before the column wrote it
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(old)
    second = train.build_trainer(load_config(TINY, args))
    second.fit()
    second.close()
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    for before, after in zip(old, rows[:2]):
        assert {k: after[k] for k in header} == {k: before[k] for k in header}
        assert after["made_ahead"] == ""
    mixture = [k for k in header if k.startswith("mixture/")]
    assert all(abs(sum(float(r[k]) for k in mixture) - 1.0) < 1e-6 for r in rows)


def test_a_save_folder_with_run_name_keeps_the_runs_files_beside_its_checkpoints(dolma_shards, tmp_path,
                                                                                no_streaming_cleanup):
    """`save_folder: runs/{run_name}` (Composer's placeholder): the checkpoints went to runs/<name>/ and the run's own
    files (mixture, selection log, config.yaml) to a literal runs/{run_name}/ (a new-user review). Now one folder;
    placeholders the run's files cannot follow, or {run_name} without a run_name, are refused at load."""
    from pipeline.config import ConfigError

    folder = tmp_path / "{run_name}"
    cfg = load_config(TINY, [*tiny_overrides(dolma_shards, folder, "eval_loader=null", "max_duration=2ba",
                                            "save_interval=2ba"), "run_name=named"])
    assert cfg.run_dir == str(tmp_path / "named")
    trainer = train.main([str(TINY), *tiny_overrides(dolma_shards, folder, "eval_loader=null", "max_duration=2ba",
                                                      "save_interval=2ba"), "run_name=named"])
    trainer.close()
    files = {p.name for p in (tmp_path / "named").iterdir()}
    assert {"config.yaml", "mixture.json", "selection_log.csv", "log-rank0.txt"} <= files, files
    assert any(name.endswith(".pt") for name in files) or (tmp_path / "named" / "latest-rank0.pt").exists(), files
    assert not folder.exists()
    for extra, says in ((["run_name=null"], "names {run_name} and run_name is unset"), (["run_name=x", f"save_folder={tmp_path}/{{rank}}"], "uses {rank}")):
        with pytest.raises(ConfigError, match="save_folder") as info:
            load_config(TINY, [*tiny_overrides(dolma_shards, folder), *extra])
        assert says in str(info.value), str(info.value)
