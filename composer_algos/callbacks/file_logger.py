"""Composer's FileLogger, appending to an existing log file instead of truncating it on autoresume."""

from __future__ import annotations

import logging
import os
from typing import Any

from composer.core import State
from composer.loggers import FileLogger, Logger

log = logging.getLogger(__name__)

__all__ = ["AppendFileLogger"]


class AppendFileLogger(FileLogger):
    """`composer.loggers.FileLogger` that appends to an existing file unless `overwrite` is true.

    Composer 0.32.1 sets `self.overwrite = overwrite,` (a one-element tuple, always truthy), so
    its FileLogger always opens the file with `w+`: a run resumed with `autoresume` (or any
    relaunch into the same `save_folder`) erases the earlier run's `log-rank*.txt`. Here the
    flag is a plain bool and `overwrite: false` opens with `a+`, so the resumed run's lines follow
    the earlier ones (steps between the last checkpoint and the kill appear twice).

    Args:
        overwrite: Truncate an existing file (default False: append to it).
        **kwargs: Passed to `FileLogger` (filename, flush_interval, capture_stdout, ...).
    """

    def __init__(self, *args: Any, overwrite: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, overwrite=overwrite, **kwargs)
        self.overwrite = bool(overwrite)

    def init(self, state: State, logger: Logger) -> None:
        del logger  # unused
        self._is_newline = True
        self._run_name = state.run_name
        if self.file is not None:
            raise RuntimeError("The file logger is already initialized")
        dirname = os.path.dirname(self.filename)
        if dirname:
            os.makedirs(dirname, exist_ok=True)
        self.file = open(self.filename, "w+" if self.overwrite else "a+", buffering=self.buffer_size)
        self._flush_queue()
