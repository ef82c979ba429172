"""Running a tools/ script end to end for a smoke test, and reading the numbers of its table."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

from tests.common.paths import REPO_ROOT

__all__ = ["NUMBER", "finite", "numbers", "run_tool", "run_tool_patched"]

NUMBER = r"[-+]?(?:\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?|nan|inf)"


def run_tool(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python tools/<script> <args>` from the repository root, one intra-op thread; stdout and stderr captured."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / script), *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def numbers(text: str) -> list[float]:
    """Every number in `text` (thousands separators allowed), as floats; `nan`/`inf` included so they can fail."""
    return [float(x.replace(",", "")) for x in re.findall(NUMBER, text)]


def finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


def run_tool_patched(module: str, patch: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`tools/<module>.py`'s main() with `args`, after running `patch` (Python, the module bound to `m`).

    `module` may name a folder of tools/, e.g. `bench/bench_shard`.

    For the failure paths: the patch makes one part of the benchmark raise, as a broken row would.
    """
    folder, _, name = module.rpartition("/")
    code = "\n".join([
        "import sys",
        f"sys.path[:0] = [{str(REPO_ROOT / 'tools' / folder)!r}, {str(REPO_ROOT / 'tools')!r}, {str(REPO_ROOT)!r}]",
        f"sys.argv = [{name + '.py'!r}, *{list(args)!r}]",
        f"import {name} as m",
        patch,
        "raise SystemExit(m.main())",
    ])
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
