"""The Triton round's checks that run its kernels in Triton's interpreter (`test_omp_triton.py` runs this file
in a child process with ``TRITON_INTERPRET=1``: the interpreter must be chosen before Triton is first imported,
and Composer imports it). Skipped when run without that setting."""

from __future__ import annotations

import os

import pytest
import torch

from composer_algos.selection.active_set_device import omp_exact_on_device
from composer_algos.selection.objective import build_objective
from composer_algos.selection.refit import default_grad_tol
from tests.selection.reference import make_instance
from tests.selection.test_active_set_device import _device_solve as _solve
from tests.selection.test_active_set_device import _select

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 from the start")
omp_triton = pytest.importorskip("composer_algos.selection.omp_triton")

ETA = 0.5


@pytest.mark.timeout(300)
def test_the_triton_rounds_pick_what_the_eager_rounds_pick():
    """Well-posed float32 pools (more feature dimensions than picks; as the compiled rounds' test): the same
    picks, the same repairs (some pools drop weights: the KKT variant of the kernels runs after the first), the
    weights up to rounding; and through `select_partitionsel`, `device_triton` selects what `device` selects."""
    seen = {"common": 0, "repaired": 0}
    for seed in range(4):
        for n, dim, kappa in ((64, 64, 16), (96, 128, 32)):
            features, val, dom = make_instance(seed, n, dim=dim, dtype=torch.float32)
            eager = _solve(features, val, dom, kappa)
            tri = _solve(features, val, dom, kappa, triton=True)
            assert tri.clean and eager.clean, (seed, n)
            assert (tri.drops, tri.reentries) == (eager.drops, eager.reentries), (seed, n)
            seen["repaired" if eager.drops else "common"] += 1
            assert tri.sel_K.tolist() == eager.sel_K.tolist(), (seed, n)
            torch.testing.assert_close(tri.v_K, eager.v_K, rtol=2e-4, atol=2e-4 * float(eager.v_K.abs().max()))
            torch.testing.assert_close(tri.phi, eager.phi, rtol=2e-4, atol=0.0)
    assert seen["common"] and seen["repaired"], seen
    features, val, dom = make_instance(1, 64, dim=64, dtype=torch.float32)
    via, plain = (_select(features, val, dom, 16, loop) for loop in ("device_triton", "device"))
    assert via.indices.tolist() == plain.indices.tolist()
    assert via.info["device_loop_fallback"] == plain.info["device_loop_fallback"] == 0


@pytest.mark.parametrize("blocks", [None, {"reduce": 4}, {"reduce": 4, "fused": 0}])
def test_the_triton_rounds_repair_drops_and_hand_over_as_the_eager_rounds(blocks, monkeypatch):
    """float64, 8-dimensional features, kappa 20: the pool where the host loop drops weights without a refit is
    repaired with the host loop's picks and counts; a float32 pool that the host loop promotes to float64 is
    handed back (not clean), as the eager rounds hand it back. With ``reduce`` 4 the 21 slots span six blocks: the
    kernels' loops past their first block of slots run (at the tests' sizes the default block holds every slot)."""
    for key, value in (blocks or {}).items():
        monkeypatch.setitem(omp_triton.BLOCKS, key, value)
    for seed in range(20):
        features, val, dom = make_instance(seed, 40, dim=8, dtype=torch.float64)
        eager = _solve(features, val, dom, 20)
        if eager.drops and eager.clean:
            break
    else:
        pytest.fail("no instance dropped a weight")
    tri = _solve(features, val, dom, 20, triton=True)
    assert tri.clean and (tri.drops, tri.reentries) == (eager.drops, eager.reentries)
    assert tri.sel_K.tolist() == eager.sel_K.tolist()
    torch.testing.assert_close(tri.v_K, eager.v_K, rtol=1e-9, atol=1e-9 * float(eager.v_K.abs().max()))
    features, val, dom = make_instance(2, 40, dim=8, dtype=torch.float32)
    eager, tri = _solve(features, val, dom, 20), _solve(features, val, dom, 20, triton=True)
    assert not eager.clean and not tri.clean


@pytest.mark.parametrize("reduce", [2, 4])
def test_a_weight_that_turns_negative_past_the_first_block_of_slots_freezes_its_round(reduce, monkeypatch):
    """The fused apply kernel checks the new weights for a negative one in its first block of slots, then in a loop
    over the rest: with blocks of 2 or 4 slots, pools of 60 whose 31 slots span many blocks (float64, 12 feature
    dimensions, kappa 30) drop weights whose slots lie past the first block. Every such drop must freeze its round
    and be repaired as the eager rounds repair it: the same drops, re-entries and picks (without the loop the
    rounds run on with a negative weight, and most of these pools end with other picks and no drop)."""
    monkeypatch.setitem(omp_triton.BLOCKS, "reduce", reduce)
    dropped = 0
    for seed in range(2):
        features, val, dom = make_instance(seed, 60, dim=12, dtype=torch.float64)
        eager = _solve(features, val, dom, 30)
        tri = _solve(features, val, dom, 30, triton=True)
        assert (tri.clean, tri.drops, tri.reentries) == (eager.clean, eager.drops, eager.reentries), seed
        assert tri.sel_K.tolist() == eager.sel_K.tolist(), seed
        torch.testing.assert_close(tri.v_K, eager.v_K, rtol=1e-9, atol=1e-9 * float(eager.v_K.abs().max()))
        dropped += eager.drops
    assert dropped >= 2, dropped


@pytest.mark.parametrize("blocks", [None, {"reduce": 4}, {"reduce": 4, "fused": 0}])
def test_a_pool_with_full_domains_and_picks_at_zero_gradient(blocks):
    """Tight capacities close domains (the penalty of every element of a full domain), and more picks than
    elements with a positive gradient leave picks at weight zero: the kernels' penalty, inactive and counter
    updates against the eager round's, every state tensor compared after each round; with ``reduce`` 4 also
    through the kernels' loops past their first block of the 25 slots."""
    from composer_algos.selection import active_set_device as asd

    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(48, 96, generator=gen, dtype=torch.float64) / 96**0.5  # well-conditioned: 96 > 48 dimensions
    gram = feats @ feats.T
    mu = torch.full((48,), -1.0, dtype=torch.float64)
    mu[[0, 4, 8, 13, 21]] = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0], dtype=torch.float64)  # 5 positive gradients
    dom = torch.arange(48) % 3
    caps = torch.tensor([3, 9, 30])  # domains 0 and 1 close within the 24 picks
    tols = (64.0 * torch.finfo(torch.float64).eps, 0.0)
    eager, tri = (asd._initial_state(gram, mu, dom, caps, 24, 1e-6, default_grad_tol(mu)) for _ in range(2))
    step = omp_triton.TritonRound(tri, tols, blocks)
    for r in range(24):
        asd._round(*eager.round_args(), *tols, False)
        step(False)
        for name in ("sel_K", "elem_M", "used_M", "inactive_N", "h_1", "r_1", "rem_C", "live_1", "bad_1", "penalty_N"):
            assert torch.equal(getattr(tri, name), getattr(eager, name)), (r, name)
        for name in ("grad_N", "p_MM", "rows_MN"):
            torch.testing.assert_close(getattr(tri, name), getattr(eager, name), rtol=1e-10, atol=1e-10)
        # The fused rounds (the default) leave a round's new weights in vnext_M for the next pick kernel to copy.
        v_M = torch.where(tri.pending_1, tri.vnext_M, tri.v_M)
        torch.testing.assert_close(v_M, eager.v_M, rtol=1e-10, atol=1e-10)
    # Both paths ran: picks at weight zero, and a domain closed. No round froze: every pick entered or stayed at 0.
    assert int(eager.inactive_N.sum()) > 0 and bool((eager.rem_C == 0).any()), (eager.inactive_N, eager.rem_C)
    assert bool(eager.live_1) and int(eager.h_1) + int(eager.inactive_N.sum()) == 24




def test_the_block_size_sweep_times_every_setting_and_restores_the_default():
    """`bench_selection.py --triton-sweep`'s function: the default and each of `SWEEP`, every one picking the
    eager rounds' picks (the block sizes change only how the work is cut), and `BLOCKS` as it was afterwards."""
    from bench_selection import sweep_triton_blocks  # tools/bench/bench_selection.py

    features, val, dom = make_instance(2, 40, dim=64, dtype=torch.float32)
    gram, mu, _ = build_objective(features, val, ETA)
    before = dict(omp_triton.BLOCKS)
    rows = sweep_triton_blocks(gram, mu, dom, torch.tensor([6, 6, 6]), 12, repeats=1)
    assert [override for override, _, _ in rows] == [{}, *omp_triton.SWEEP]
    assert all(ms > 0 and same for _, ms, same in rows), rows
    assert omp_triton.BLOCKS == before


def test_domain_ids_given_as_a_strided_view():
    """The kernels index the pool's vectors with unit stride: domain ids that are a column of a larger tensor
    (stride 2 here) must close the same domains as the eager round, which gathers them with any stride."""
    features, val, dom = make_instance(1, 64, dim=64, dtype=torch.float32)
    strided = torch.stack([dom, torch.zeros_like(dom)], dim=1)[:, 0]
    assert strided.stride(0) == 2
    gram, mu, _ = build_objective(features, val, ETA)
    caps = torch.tensor([2, 3, 11])  # tight: which elements a full domain closes decides most picks
    eager = omp_exact_on_device(gram, mu, dom, caps, 16, 1e-6, default_grad_tol(mu))
    tri = omp_exact_on_device(gram, mu, strided, caps, 16, 1e-6, default_grad_tol(mu), triton=True)
    assert eager.clean and tri.clean
    assert tri.sel_K.tolist() == eager.sel_K.tolist()
    assert torch.bincount(dom[eager.sel_K], minlength=3).tolist() == [2, 3, 11]


def test_the_fused_variant_solves_as_the_three_kernels_bit_for_bit(monkeypatch):
    """`BLOCKS["fused"]`: before the first drop a round is two kernels, `_pick_kernel` and `_apply_kernel` doing the
    direction kernel's work too (every program deciding the round itself, the new weights copied by the
    next round's pick kernel). The same arithmetic, so the same solve bit for bit as the three kernels, through
    drops and re-entries (after which the rounds are the three kernels' KKT variant) and hand-overs."""
    seen_drops = 0
    for seed in range(3):
        for n, dim, kappa, dtype in ((64, 64, 16, torch.float32), (40, 8, 20, torch.float64), (96, 128, 32, torch.float32)):
            features, val, dom = make_instance(seed, n, dim=dim, dtype=dtype)
            monkeypatch.setitem(omp_triton.BLOCKS, "fused", 0)
            three = _solve(features, val, dom, kappa, triton=True, rounds_per_read=5)
            monkeypatch.setitem(omp_triton.BLOCKS, "fused", 1)
            two = _solve(features, val, dom, kappa, triton=True, rounds_per_read=5)
            assert (two.clean, two.drops, two.reentries, two.reads) == (three.clean, three.drops, three.reentries, three.reads)
            assert torch.equal(two.sel_K, three.sel_K) and torch.equal(two.v_K, three.v_K), (seed, n)
            assert torch.equal(two.phi, three.phi), (seed, n)
            seen_drops += three.drops > 0 and three.clean
    assert seen_drops, "no pool dropped a weight"

