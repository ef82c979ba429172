"""Locations of the real data samples beside the checkout (`../shared/data`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

__all__ = ["COMPOSER_LAUNCHER", "REPO_ROOT", "SHARED_DATA", "require_shared_data"]

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

# Composer's launcher (`composer -n N ...`) by module, not by its console script beside the interpreter:
# a stack installed with `pip --target` (the GPU machines, ../shared/gpu) has no `composer` script there.
COMPOSER_LAUNCHER = [sys.executable, "-m", "composer.cli.launcher"]


def require_shared_data(*parts: str) -> Path:
    """Return `../shared/data/<parts>` or skip the calling test when it is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"real data sample {path} not present (../shared is optional)")
    return path
