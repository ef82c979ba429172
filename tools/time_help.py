"""Time `--help` of every tool (tools/, tools/bench/, tools/studies/ and train.py), each in a fresh interpreter, against a limit.

Example:
    python tools/time_help.py              # one run each, limit 2 s
    python tools/time_help.py --repeats 3 --limit 2.0

`--help` should only parse arguments: a tool that imports torch, Composer, transformers or
Streaming at module level takes several seconds before it can print its usage. The time is
the wall time of the whole interpreter (start-up included), the best of --repeats runs so that
a busy machine does not fail a light tool. Exit status 1 when any tool is over the limit or
`--help` fails.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tool_paths() -> list[Path]:
    """train.py and every .py of tools/, tools/bench/ and tools/studies/ but this one, sorted."""
    folders = (REPO / "tools", REPO / "tools" / "bench", REPO / "tools" / "studies")
    tools = sorted(p for d in folders for p in d.glob("*.py") if p.name != Path(__file__).name)
    return [REPO / "train.py", *tools]


def has_command_line(path: Path) -> bool:
    """Whether the file runs as a program; helper modules kept in tools/ (imported by the tools) do not."""
    return '__name__ == "__main__"' in path.read_text(encoding="utf-8")


def time_help(path: Path, repeats: int, timeout_s: float) -> tuple[float, int, str]:
    """(best wall seconds, exit status of the last run, its stderr tail) of `python PATH --help`."""
    best, code, err = float("inf"), 0, ""
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, str(path), "--help"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            return timeout_s, -1, f"timed out after {timeout_s:.0f} s"
        best = min(best, time.perf_counter() - start)
        code, err = proc.returncode, proc.stderr.strip()[-300:]
    return best, code, err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--limit", type=float, default=2.0, help="seconds allowed per --help (default: 2.0)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per tool; the best counts (default: 1)")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds before a run is stopped (default: 120)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    failed = n_tools = 0
    for path in tool_paths():
        if not has_command_line(path):
            print(f"SKIP            {path.relative_to(REPO)}  (a helper module: no command line)")
            continue
        n_tools += 1
        seconds, code, err = time_help(path, args.repeats, args.timeout)
        ok = code == 0 and seconds < args.limit
        failed += not ok
        note = "" if code == 0 else f"  (exit {code}: {err.splitlines()[-1] if err else 'no stderr'})"
        print(f"{'PASS' if ok else 'FAIL'}  {seconds:6.2f} s  {path.relative_to(REPO)}{note}", flush=True)
    print(
        f"{failed} of {n_tools} over {args.limit:g} s or failing"
        if failed
        else f"all {n_tools} under {args.limit:g} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
