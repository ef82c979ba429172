"""The suite's time limits (issue 20.3): a test that hangs ends the run at its limit and prints every thread's stack,
even when the hang is where a signal cannot reach it."""

from __future__ import annotations

import subprocess
import sys

from tests.common.paths import REPO_ROOT

HANGING_TEST = '''
import signal
import threading
import time


def test_hangs():
    threading.Thread(target=threading.Event().wait, name="helper-thread", daemon=True).start()
    # Libraries block signals in threads they run; a SIGALRM-based time limit then never reaches this one.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(600)  # hangs here
'''


def test_a_hang_ends_the_run_at_its_limit_with_every_threads_stack(tmp_path):
    (tmp_path / "test_hang.py").write_text(HANGING_TEST)
    # The project's pytest settings (pyproject.toml), with a 3 s limit instead of the default.
    cmd = [sys.executable, "-m", "pytest", "-c", str(REPO_ROOT / "pyproject.toml"), "--rootdir", str(tmp_path)]
    cmd += ["-p", "no:cacheprovider", "--timeout", "3", str(tmp_path / "test_hang.py")]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the hanging test was not stopped at its 3 s limit:\n{exc.stdout}") from None
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Timeout" in out, out
    # Every thread: the test's own (where it hangs) and the one it started.
    assert "Stack of MainThread" in out and "Stack of helper-thread" in out, out
    assert "in test_hangs" in out and "time.sleep(600)  # hangs here" in out, out
