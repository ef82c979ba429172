"""Suite-wide fixtures."""

from __future__ import annotations

import gc
import os
import warnings

import pytest

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
