"""The seed mixers keep the outputs the per-step generators were seeded with before they moved to
`composer_algos/seeding.py` (issue 11): same config and seed, same validation draws and projections."""

from __future__ import annotations

import pytest

from composer_algos.features.sketch import derive_seed
from composer_algos.seeding import mix_seed, splitmix_seed

# Recorded from `validation_source._mix` and `features.sketch.derive_seed` before the move.
MIX = {(0, 0, 0): 6002199475437790307, (1, 2, 3): 2172934233085365380}
DERIVE = {(0, 0, 1, None): 6439417417818787448, (7, 3, 2, 5): 4904409454806287647}


@pytest.mark.parametrize("values", list(MIX))
def test_mix_seed_is_unchanged(values):
    assert mix_seed(*values) == MIX[values]


@pytest.mark.parametrize("args", list(DERIVE))
def test_derive_seed_is_unchanged(args):
    assert derive_seed(*args) == DERIVE[args]
    assert splitmix_seed(*args[:3], -1 if args[3] is None else args[3]) == DERIVE[args]


def test_seeds_fit_a_generator_and_depend_on_every_value():
    seeds = {mix_seed(1, s, r) for s in range(20) for r in range(4)} | {
        splitmix_seed(1, s) for s in range(20)
    }
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)
