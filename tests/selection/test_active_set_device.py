"""The exact greedy OMP with its rounds on the device (issue 31.3): the host loop's picks, no sync in the rounds."""

from __future__ import annotations

import pytest
import torch
from step_audit import SyncAudit  # tools/bench/step_audit.py

from composer_algos.selection import select_partitionsel
from composer_algos.selection.active_set_device import omp_exact_on_device
from composer_algos.selection.objective import build_objective
from composer_algos.selection.partitionsel import PartitionSelOptions, omp_select
from composer_algos.selection.refit import default_grad_tol
from tests.selection.reference import make_instance

ETA = 0.5


def _select(features, val, dom, kappa, loop, **options):
    return select_partitionsel(
        features=features, val_feature=val, domain_ids=dom, num_domains=3, kappa=kappa, eta=ETA, generator=None,
        solver_loop=loop, **options,
    )


# Pools from 12 to 200 rows, kappa from a few to half the pool, features of 8 to 64 dimensions: some
# instances drop weights (the device loop then hands over to the host loop), most do not.
CASES = [(seed, n, dim, kappa) for seed in range(6) for n, dim, kappa in ((12, 32, 4), (40, 8, 20), (64, 64, 16), (200, 32, 100))]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_device_loop_picks_what_the_host_loop_picks(dtype):
    clean = fallback = 0
    for seed, n, dim, kappa in CASES:
        features, val, dom = make_instance(seed, n, dim=dim, dtype=dtype)
        host = _select(features, val, dom, kappa, "host")
        device = _select(features, val, dom, kappa, "device")
        assert device.indices.tolist() == host.indices.tolist(), (seed, n, kappa)
        tol = 1e-9 if dtype == torch.float64 else 2e-4
        torch.testing.assert_close(device.weights, host.weights, rtol=tol, atol=tol * float(host.weights.abs().max()))
        torch.testing.assert_close(device.objective, host.objective, rtol=tol, atol=0.0)
        common = all(host.info[k] == 0 for k in ("weight_drops", "weight_reentries", "slow_refits", "singular_pivots"))
        # The device loop hands over exactly when the host loop left the common round.
        assert device.info["device_loop_fallback"] == (0 if common else 1), (seed, n, kappa, host.info)
        if device.info["device_loop_fallback"]:
            fallback += 1
            assert torch.equal(device.weights, host.weights)  # the host loop's own result
        else:
            clean += 1
    assert clean and fallback  # both paths ran


@pytest.mark.parametrize("loop", ["device", pytest.param("device_compiled", marks=pytest.mark.timeout(200))])
def test_a_round_that_drops_a_weight_hands_over_to_the_host_loop(loop):
    """Kappa at half a pool of 8-dimensional features: past 8 picks the refit must drop weights. The compiled
    rounds (one compilation, about 40 s with an empty cache) hand over as the eager ones do."""
    for seed in range(20):
        features, val, dom = make_instance(seed, 40, dim=8)
        host = _select(features, val, dom, 20, "host")
        if host.info["weight_drops"] > 0:
            device = _select(features, val, dom, 20, loop)
            assert device.info["device_loop_fallback"] == 1
            assert device.indices.tolist() == host.indices.tolist() and torch.equal(device.weights, host.weights)
            return
    pytest.fail("no instance dropped a weight")


def test_the_rounds_never_read_the_device():
    """On a CUDA run every tensor here lives on the device: the emulated audit counts no read in the loop."""
    features, val, dom = make_instance(3, 64, dim=64)
    gram, mu, _ = build_objective(features, val, ETA)
    caps = torch.tensor([8, 8, 8])
    grad_tol = default_grad_tol(mu)
    with SyncAudit([gram, mu, dom, caps, grad_tol]) as audit:
        res = omp_exact_on_device(gram, mu, dom, caps, 16, 1e-6, grad_tol)
    assert not audit.events and not audit.other, audit.events or audit.other
    assert bool(res.clean)
    host_sel, _, _, _ = omp_select(gram, mu, dom, caps, 16, ridge_abs=1e-6)
    assert res.sel_K.tolist() == host_sel.tolist()


def test_the_host_loop_is_the_default_until_a_gpu_run_says_otherwise():
    assert PartitionSelOptions().solver_loop == "host"
    features, val, dom = make_instance(0, 12)
    res = select_partitionsel(features=features, val_feature=val, domain_ids=dom, num_domains=3, kappa=4, eta=ETA, generator=None)
    assert "device_loop_fallback" not in res.info
    assert "device_loop_fallback" in _select(features, val, dom, 4, "device").info
    with pytest.raises(ValueError, match="solver_loop"):
        PartitionSelOptions(solver_loop="gpu")


# ------------------------------------------------------------------ the solve moved to the CPU (solver_loop "cpu")
@pytest.mark.parametrize("options", [{}, {"refine": "swap"}, {"refit": "apga"}])
def test_the_cpu_solve_is_the_host_loop_on_a_cpu(options):
    for seed in range(4):
        features, val, dom = make_instance(seed, 40, dim=16)
        host = _select(features, val, dom, 12, "host", **options)
        cpu = _select(features, val, dom, 12, "cpu", **options)
        assert torch.equal(cpu.indices, host.indices) and torch.equal(cpu.weights, host.weights)
        assert torch.equal(cpu.domain_counts, host.domain_counts) and torch.equal(cpu.objective, host.objective)


def _audited(loop, kappa):
    """One selection with the features on the emulated accelerator and the domain ids on the host, as the
    training loop gives them: (result, syncs, kernel launches)."""
    from step_audit import OpCount

    features, val, dom = make_instance(5, 48, dim=64, dtype=torch.float32)
    audit = SyncAudit([features, val])
    ops = OpCount(on_device=lambda: audit.device_call)
    audit._pause = ops.pause
    from composer_algos.selection import types

    with ops, audit, types.deferring_checks(types.DeferredChecks()):  # as a selection step judges its checks
        res = _select(features, val, dom, kappa, loop)
    syncs = sum(n for (kind, _s, _c), n in audit.events.items() if kind in ("sync", "h2d"))
    return res, syncs, ops.kernels


@pytest.mark.parametrize("kappa", [8, 16])
def test_the_cpu_solve_reads_the_device_once(kappa):
    cpu, syncs_cpu, ops_cpu = _audited("cpu", kappa)
    host, syncs_host, ops_host = _audited("host", kappa)
    assert torch.equal(cpu.indices, host.indices)
    assert syncs_cpu == 1, syncs_cpu
    assert syncs_host >= kappa  # one a pick
    assert ops_cpu < ops_host - 10 * kappa, (ops_cpu, ops_host)  # the rounds launch nothing on the device


def test_the_cuda_graph_rounds_are_refused_off_cuda():
    features, val, dom = make_instance(3, 24, dim=8)
    gram, mu, _ = build_objective(features, val, ETA)
    with pytest.raises(ValueError, match="graph=True needs CUDA tensors, got cpu"):
        omp_exact_on_device(gram, mu, dom, torch.tensor([4, 4, 4]), 8, 1e-6, default_grad_tol(mu), graph=True)


# Each shape compiles (C++ through the system compiler): 77 s for this test with an empty cache at load 3.9.
@pytest.mark.timeout(320)
def test_the_compiled_rounds_pick_what_the_eager_rounds_pick():
    """`solver_loop: device_compiled` (issue 31.3): each round compiled as one graph, the eager rounds' picks.

    Well-posed pools (features of more dimensions than picks; static shapes, so two shapes and two
    compilations; float32, the features' dtype on a GPU): the same picks, the weights up to rounding. A pool
    of 8-dimensional features where kappa is 20 picks among near-ties once the 8 dimensions are spent (the
    ridge decides), where a fused reduction's rounding may pick another; there
    `test_a_round_that_drops_a_weight_hands_over_to_the_host_loop` asks only that a round needing a drop
    hands over as the eager rounds do, and that the selection is then the host loop's.
    """
    torch._dynamo.reset()
    seen = {True: 0, False: 0}
    for seed in range(4):
        for n, dim, kappa in ((64, 64, 16), (96, 128, 32)):
            features, val, dom = make_instance(seed, n, dim=dim, dtype=torch.float32)
            gram, mu, _ = build_objective(features, val, ETA)
            caps, grad_tol = torch.tensor([kappa // 2] * 3), default_grad_tol(mu)
            eager = omp_exact_on_device(gram, mu, dom, caps, kappa, 1e-6, grad_tol)
            compiled = omp_exact_on_device(gram, mu, dom, caps, kappa, 1e-6, grad_tol, compile=True)
            # A round that needs a drop is flagged by both (the host loop then decides); else the same picks.
            assert bool(compiled.clean) == bool(eager.clean), (seed, n)
            seen[bool(eager.clean)] += 1
            via, plain = (_select(features, val, dom, kappa, loop) for loop in ("device_compiled", "device"))
            assert via.indices.tolist() == plain.indices.tolist()
            assert via.info["device_loop_fallback"] == plain.info["device_loop_fallback"]
            if bool(eager.clean):
                assert compiled.sel_K.tolist() == eager.sel_K.tolist(), (seed, n)
                tol = 2e-4
                torch.testing.assert_close(compiled.v_K, eager.v_K, rtol=tol, atol=tol * float(eager.v_K.abs().max()))
    assert seen[True] and seen[False]  # both paths ran (the drop instance: the hand-over test's device_compiled case)


@pytest.mark.timeout(160)  # one compilation: about 40 s with an empty cache
def test_the_compiled_round_is_a_few_fused_kernels():
    """The point of compiling: about 45 eager ops a round become a few kernels (on a CPU 3: 2 fused loops and the
    GEMM; a CUDA count is the benchmark's), counted in the code inductor generated."""
    from bench_selection import compiled_round_kernels  # tools/bench/bench_selection.py

    features, val, dom = make_instance(5, 48, dim=16)
    gram, mu, _ = build_objective(features, val, ETA)
    assert 1 <= compiled_round_kernels(gram, mu, dom, torch.tensor([6, 6, 6]), 12) <= 6
