"""Suite-wide fixtures."""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import warnings

import pytest

from tests.common.paths import REPO_ROOT

# The tools are scripts, not a package: the tests import them by module name, as they import each other
# when run (the user's commands and their helpers in tools/, benchmarks in tools/bench/, study drivers
# in tools/studies/).
for _folder in ("tools/studies", "tools/bench", "tools"):
    if str(REPO_ROOT / _folder) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / _folder))

try:
    from _pytest.faulthandler import fault_handler_stderr_fd_key  # pytest's copy of the terminal's stderr
except ImportError:  # another pytest layout: the process's stderr (captured while a test runs)
    fault_handler_stderr_fd_key = None

# Time limits (pyproject.toml has the default and the rule for @pytest.mark.timeout). Slow and gpu tests are not in
# the default run whose durations set the limits: they get this unless they carry their own mark.
UNMEASURED_TIME_LIMIT_S = 1800
# pytest-timeout's "thread" method needs the GIL to print the stacks and exit; a hang in C code that never releases
# the GIL would then go on until CI's own limit. faulthandler's watchdog needs no GIL: this long after a test's
# limit it prints every thread's Python stack and exits.
BACKSTOP_GRACE_S = 30

# Composer's Engine registers `atexit.register(self._close, state, logger)`, so every Trainer a test
# builds keeps its State, and with it the run's StreamingDatasets and their shared-memory blocks
# (six open descriptors each), alive until the interpreter exits. One process running the whole
# suite then reaches the 20000 open-file limit. When descriptors pile up, release the shared memory
# of Streaming objects left by finished tests (nothing is running between tests).
_FD_HIGH_WATER = 4000


@pytest.fixture(autouse=True)
def _release_leaked_streaming_shm():
    yield
    try:
        open_fds = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: nothing to measure
        return
    if open_fds < _FD_HIGH_WATER:
        return
    from streaming.base.shared.memory import SharedMemory

    gc.collect()
    with warnings.catch_warnings():  # isinstance() touches deprecated attributes of lazy modules
        warnings.simplefilter("ignore")
        leaked = [obj for obj in gc.get_objects() if isinstance(obj, SharedMemory)]
    for obj in leaked:
        try:
            obj.cleanup()
        except Exception:  # already closed or unlinked by its owner
            pass


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is None and (item.get_closest_marker("slow") or item.get_closest_marker("gpu")):
            item.add_marker(pytest.mark.timeout(UNMEASURED_TIME_LIMIT_S))


def _time_limit(item: pytest.Item) -> float:
    """The test's pytest-timeout limit in seconds (0: none), with pytest-timeout's precedence: mark, --timeout,
    PYTEST_TIMEOUT, the ini value."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    else:
        value = item.config.getoption("timeout", None)
        if value is None:
            value = os.environ.get("PYTEST_TIMEOUT") or item.config.getini("timeout")
    return float(value or 0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    limit = _time_limit(item)
    if limit <= 0:
        return (yield)
    stash = item.config.stash
    stderr = stash[fault_handler_stderr_fd_key] if fault_handler_stderr_fd_key is not None and fault_handler_stderr_fd_key in stash else sys.__stderr__
    faulthandler.dump_traceback_later(limit + BACKSTOP_GRACE_S, exit=True, file=stderr)
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()
