"""CUDA parity of every strategy with the CPU result (deselected by default; run with -m gpu).

The `cuda` fixture (tests/gpu/conftest.py) skips with the reason on a machine without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from composer_algos.selection import STRATEGIES
from tests.selection.reference import make_instance

pytestmark = pytest.mark.gpu

NAMES = ["partitionsel", "greats", "id", "iwd", "gradnorm", "colm"]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"refine": "swap"},
        {"refit": "apga"},
        {"refit": "apga_pool"},
        {"gram_rows": "lazy", "refine": "swap"},
    ],
)
@pytest.mark.parametrize("name", NAMES)
def test_cuda_matches_cpu(cuda, name, options):
    if options and name not in ("partitionsel", "iwd"):
        pytest.skip("options only apply to the weighted strategies")
    features, val_feature, dom = make_instance(3, 300, dim=64, num_domains=5)
    kw = dict(num_domains=5, kappa=60, eta=0.3, generator=None, **options)
    cpu = STRATEGIES[name].fn(features=features, val_feature=val_feature, domain_ids=dom, **kw)
    gpu = STRATEGIES[name].fn(
        features=features.to(cuda), val_feature=val_feature.to(cuda), domain_ids=dom.to(cuda), **kw
    )
    assert gpu.indices.device.type == "cuda"
    assert gpu.indices.cpu().tolist() == cpu.indices.tolist()
    if cpu.objective is not None:
        torch.testing.assert_close(gpu.objective.cpu(), cpu.objective, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["partitionsel", "random", "random_stratified"])
def test_cuda_generator_is_deterministic(cuda, name):
    features, val_feature, dom = make_instance(1, 200, dim=32, num_domains=4)
    kw = dict(
        features=features.to(cuda),
        val_feature=val_feature.to(cuda),
        domain_ids=dom.to(cuda),
        num_domains=4,
        kappa=40,
        eta=0.3,
    )
    if name == "partitionsel":
        kw["pick"] = "randomized"
    a = STRATEGIES[name].fn(generator=torch.Generator(device=cuda).manual_seed(0), **kw)
    b = STRATEGIES[name].fn(generator=torch.Generator(device=cuda).manual_seed(0), **kw)
    assert a.indices.tolist() == b.indices.tolist()
    # A CPU generator with CUDA inputs also works (draws on the generator's device, moved over).
    c = STRATEGIES[name].fn(generator=torch.Generator().manual_seed(0), **kw)
    assert c.indices.device.type == "cuda"


@pytest.mark.parametrize("n,k", [(64, 20), (2048, 512)])
def test_the_device_loop_replayed_as_a_cuda_graph_is_the_eager_loop(cuda, n, k):
    """`omp_exact_on_device(graph=True)`: one eager round, then graphs of 16 rounds (and of one for a batch's
    remainder) recorded and replayed; the same kernels as the eager rounds, so the same picks, weights and
    objective bit for bit (issue 31.3)."""
    from composer_algos.selection.active_set_device import omp_exact_on_device
    from composer_algos.selection.objective import build_objective
    from composer_algos.selection.refit import default_grad_tol

    features, val, dom = make_instance(5, n, dim=256, num_domains=8)
    gram, mu, _ = build_objective(features.to(cuda), val.to(cuda), 0.3)
    caps = torch.full((8,), k // 8 + 1, device=cuda)
    args = (gram, mu, dom.to(cuda), caps, k, 1e-6, default_grad_tol(mu))
    eager = omp_exact_on_device(*args, graph=False)
    graphed = omp_exact_on_device(*args, graph=True)
    assert torch.equal(graphed.sel_K, eager.sel_K) and torch.equal(graphed.v_K, eager.v_K)
    assert torch.equal(graphed.phi, eager.phi) and bool(graphed.clean) == bool(eager.clean)


@pytest.mark.parametrize("rounds", ["compiled", "triton", "triton_eager", "triton_two_kernels"])
@pytest.mark.parametrize("n,k", [(64, 20), (2048, 512)])
def test_the_fused_rounds_pick_what_the_eager_rounds_pick(cuda, n, k, rounds, monkeypatch):
    """The device loop's rounds fused on CUDA: `solver_loop: device_compiled` (the compiled round, inductor's
    Triton kernels) and `device_triton` (three hand-written Triton kernels; their CPU checks ran only in Triton's
    interpreter, tests/selection/test_omp_triton.py), recorded as CUDA graphs and replayed (others after the
    first drop), and the Triton kernels also launched one by one. The rounds needing a drop are repaired as the
    eager rounds repair them: the same picks, the weights up to rounding (fused reductions round in their own
    order)."""
    from composer_algos.selection.active_set_device import omp_exact_on_device
    from composer_algos.selection.objective import build_objective
    from composer_algos.selection.refit import default_grad_tol

    features, val, dom = make_instance(5, n, dim=256, num_domains=8)
    gram, mu, _ = build_objective(features.to(cuda), val.to(cuda), 0.3)
    caps = torch.full((8,), k // 8 + 1, device=cuda)
    args = (gram, mu, dom.to(cuda), caps, k, 1e-6, default_grad_tol(mu))
    eager = omp_exact_on_device(*args, graph=False)
    from composer_algos.selection import omp_triton

    # triton_two_kernels: `BLOCKS["fused"]`, two kernels a round before the first drop (never run on a GPU before).
    monkeypatch.setitem(omp_triton.BLOCKS, "fused", int(rounds == "triton_two_kernels"))
    how = {"compiled": dict(compile=True), "triton": dict(triton=True), "triton_eager": dict(triton=True, graph=False),
           "triton_two_kernels": dict(triton=True)}
    fused = omp_exact_on_device(*args, **{"graph": True, **how[rounds]})
    # On the CPU the n = 64 instance stays on the common path and the n = 2048 one is repaired: both must
    # compare picks here, or the test compared nothing but flags.
    assert eager.clean and fused.clean
    assert (fused.drops, fused.reentries) == (eager.drops, eager.reentries)
    assert torch.equal(fused.sel_K, eager.sel_K)
    torch.testing.assert_close(fused.v_K, eager.v_K, rtol=2e-4, atol=2e-4 * float(eager.v_K.abs().max()))
    if rounds == "triton_two_kernels":  # and the three kernels' picks (compiled apart, they may round apart)
        monkeypatch.setitem(omp_triton.BLOCKS, "fused", 0)
        three = omp_exact_on_device(*args, triton=True)
        assert torch.equal(fused.sel_K, three.sel_K)
        torch.testing.assert_close(fused.v_K, three.v_K, rtol=2e-4, atol=2e-4 * float(three.v_K.abs().max()))


@pytest.mark.parametrize("triton", [False, True])
def test_a_workspace_replays_its_graphs_across_solves_and_streams_on_cuda(cuda, monkeypatch, triton):
    """Solves of the same shapes replay the CUDA graphs the first one recorded, in its workspace (K copied in):
    a pool solved again, after another pool and on another stream, gives its first result bit for bit, and the
    first result stands after the workspace has solved the other pool (issue 31.3)."""
    from composer_algos.selection import active_set_device as asd
    from composer_algos.selection.objective import build_objective
    from composer_algos.selection.refit import default_grad_tol

    recorded, waits = [], []
    real = asd._recorded
    monkeypatch.setattr(asd, "_recorded", lambda fn: recorded.append(1) or real(fn))
    monkeypatch.setattr(asd._workspaces, "by_key", {}, raising=False)
    real_wait = torch.cuda.Stream.wait_event
    monkeypatch.setattr(torch.cuda.Stream, "wait_event", lambda self, event: waits.append((self, event)) or real_wait(self, event))

    def args(seed):
        features, val, dom = make_instance(seed, 2048, dim=256, num_domains=8)
        gram, mu, _ = build_objective(features.to(cuda), val.to(cuda), 0.3)
        return (gram, mu, dom.to(cuda), torch.full((8,), 65, device=cuda), 512, 1e-6, default_grad_tol(mu))

    a, b = args(5), args(6)
    first = asd.omp_exact_on_device(*a, triton=triton)
    kept = (first.sel_K.clone(), first.v_K.clone())
    n_recorded = len(recorded)
    other = asd.omp_exact_on_device(*b, triton=triton)
    # Before the workspace solves the first pool again (which would restore an aliased result).
    assert torch.equal(first.sel_K, kept[0]) and torch.equal(first.v_K, kept[1])
    (ws,) = asd._workspaces.by_key.values()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        again = asd.omp_exact_on_device(*a, triton=triton)
    torch.cuda.current_stream().wait_stream(side)
    assert n_recorded > 0 and len(recorded) == n_recorded  # the second and third solves recorded nothing
    # On the side stream the solve first waited, on the device, for the workspace's last solve.
    assert any(stream == side and event is ws.done for stream, event in waits), waits
    # These pools drop many weights (256 feature dimensions, 512 picks): the repairs' segments ran as graphs too.
    assert first.drops > 0 and ws.rounds.repair_steps()._graphs, first.drops
    fresh_b = asd.omp_exact_on_device(*b, triton=triton, reuse=False)
    assert first.clean and again.clean and other.clean
    assert torch.equal(first.sel_K, kept[0]) and torch.equal(first.v_K, kept[1])
    assert torch.equal(again.sel_K, first.sel_K) and torch.equal(again.v_K, first.v_K)
    assert torch.equal(other.sel_K, fresh_b.sel_K) and torch.equal(other.v_K, fresh_b.v_K)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_features_raise_on_cuda(cuda, name, bad_value):
    """The finiteness checks are inf-norms (`amax` of `abs`), which rely on CUDA's `amax` propagating NaN as the CPU's
    does: a NaN or an infinity in one feature must still be caught on the device (tested on the CPU only before)."""
    features, val_feature, dom = make_instance(0, 10)
    features[3, 5] = bad_value
    with pytest.raises(ValueError, match="non-finite"):
        STRATEGIES[name].fn(features=features.to(cuda), val_feature=val_feature.to(cuda), domain_ids=dom.to(cuda),
                            num_domains=3, kappa=3, eta=0.1, generator=None)


def test_deferred_finiteness_checks_name_the_broken_tensor_on_cuda(cuda):
    """The selection step's deferred form: the checks packed on the device, read once, judged on the host."""
    from composer_algos.selection.types import (
        DeferredChecks,
        SelectionNumericsError,
        check_finite,
        deferring_checks,
        host_values,
    )

    fine = torch.randn(5, device=cuda)
    for bad_value in (float("nan"), float("inf"), float("-inf")):
        broken = torch.randn(3, 4, device=cuda)
        broken[1, 2] = bad_value
        checks = DeferredChecks()
        with deferring_checks(checks):
            check_finite("s", fine=fine, broken=broken, ids=torch.arange(3, device=cuda))
        with pytest.raises(SelectionNumericsError, match=r"\['broken'\]"):
            checks.judge([v for part in host_values(checks.packed()) for v in part])
