"""Seeds for the per-step random generators, derived from several integers (the project's seed mixers).

Two mixing schemes exist because runs are pinned to their outputs: ``mix_seed`` seeds the
validation draws and the selection generators, ``splitmix_seed`` the random feature projections.
Changing either would change the selections of an existing config and seed, so both are kept, here
and nowhere else.
"""

from __future__ import annotations

__all__ = ["mix_seed", "splitmix_seed"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, splitmix64's increment


def mix_seed(*values: int) -> int:
    """A 63-bit seed from several integers (boost-style hash combine, stable across runs and platforms).

    Args:
        *values: the integers to fold in order, e.g. ``(seed, step, rank)``.

    Returns:
        A non-negative int usable with ``torch.Generator.manual_seed``.
    """
    h = _GOLDEN
    for v in values:
        h ^= (int(v) + _GOLDEN + (h << 6) + (h >> 2)) & _MASK64
        h = (h * 0xBF58476D1CE4E5B9) & _MASK64
    return h & 0x7FFFFFFFFFFFFFFF


def splitmix_seed(*words: int) -> int:
    """A 63-bit seed from several integers, one splitmix64 round per word (Steele et al. 2014).

    Args:
        *words: the integers to fold in order (negative ones are taken modulo 2**64).

    Returns:
        A non-negative int usable with ``torch.Generator.manual_seed``.
    """
    state = _GOLDEN
    for word in words:
        state = _splitmix64((state ^ (word & _MASK64)) & _MASK64)
    return state >> 1


def _splitmix64(x: int) -> int:
    """One round of splitmix64 on a 64-bit int."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
