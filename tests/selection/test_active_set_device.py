"""The exact greedy OMP with its rounds on the device (issue 31.3): the host loop's picks, no sync in the rounds."""

from __future__ import annotations

import pytest
import torch
from step_audit import SyncAudit  # tools/bench/step_audit.py

from composer_algos.selection import select_partitionsel
from composer_algos.selection.active_set_device import ROUNDS_PER_READ, omp_exact_on_device
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
# instances drop weights and re-enter them (the device loop repairs those rounds), most do not; the
# float32 ones with more picks than dimensions need the host loop's float64 promotion (it hands over).
CASES = [(seed, n, dim, kappa) for seed in range(6) for n, dim, kappa in ((12, 32, 4), (40, 8, 20), (64, 64, 16), (200, 32, 100))]
LH_KEYS = ("weight_drops", "weight_reentries")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_device_loop_picks_what_the_host_loop_picks(dtype):
    seen = {"common": 0, "repaired": 0, "handed over": 0}
    for seed, n, dim, kappa in CASES:
        features, val, dom = make_instance(seed, n, dim=dim, dtype=dtype)
        host = _select(features, val, dom, kappa, "host")
        device = _select(features, val, dom, kappa, "device")
        assert device.indices.tolist() == host.indices.tolist(), (seed, n, kappa)
        tol = 1e-9 if dtype == torch.float64 else 2e-4
        torch.testing.assert_close(device.weights, host.weights, rtol=tol, atol=tol * float(host.weights.abs().max()))
        torch.testing.assert_close(device.objective, host.objective, rtol=tol, atol=0.0)
        # The device loop hands over exactly where the host loop refitted (a dependent column or, in float32,
        # the promotion to float64); it repairs drops and re-entries itself, the host loop's number of each.
        host_only = host.info["slow_refits"] + host.info["singular_pivots"] > 0
        assert device.info["device_loop_fallback"] == int(host_only), (seed, n, kappa, host.info)
        if dtype == torch.float64:  # in float32 the rounding may drop a weight that the next step re-enters
            assert [int(device.info[key]) for key in LH_KEYS] == [int(host.info[key]) for key in LH_KEYS], (seed, n, kappa)
        if host_only:
            seen["handed over"] += 1
            assert torch.equal(device.weights, host.weights)  # the host loop's own result
        else:
            seen["repaired" if host.info["weight_drops"] else "common"] += 1
    assert seen["common"] and seen["repaired"], seen
    assert seen["handed over"] or dtype == torch.float64, seen  # float64 never promotes


def _drop_instance(dtype=torch.float64):
    """The first of the 40-row, 8-dimension, kappa = 20 pools where the host loop drops a weight without a refit."""
    for seed in range(20):
        features, val, dom = make_instance(seed, 40, dim=8, dtype=dtype)
        host = _select(features, val, dom, 20, "host")
        if host.info["weight_drops"] > 0 and host.info["slow_refits"] == 0:
            return features, val, dom, host
    pytest.fail("no instance dropped a weight")


@pytest.mark.parametrize("loop", ["device", pytest.param("device_compiled", marks=pytest.mark.timeout(300))])
def test_a_round_that_drops_a_weight_is_repaired_on_the_device(loop):
    """Kappa at half a pool of 8-dimensional features: past 8 picks the refit must drop weights and re-enter
    them. The device loop repairs those rounds and finishes without the host loop, with its picks. The
    compiled rounds (two compilations: before and after the first drop, about 40 s each with an empty cache)
    repair as the eager ones do."""
    features, val, dom, host = _drop_instance()
    device = _select(features, val, dom, 20, loop)
    assert device.info["device_loop_fallback"] == 0
    assert device.indices.tolist() == host.indices.tolist()
    assert device.info["weight_drops"] == host.info["weight_drops"] > 0
    torch.testing.assert_close(device.weights, host.weights, rtol=1e-9, atol=1e-9 * float(host.weights.abs().max()))


def test_a_round_the_host_loop_refits_hands_over_to_it():
    """float32 with more picks than feature dimensions: the host loop promotes to float64 (a refit), which the
    device loop leaves to it: the selection is then the host loop's own."""
    for seed in range(20):
        features, val, dom = make_instance(seed, 40, dim=8, dtype=torch.float32)
        host = _select(features, val, dom, 20, "host")
        if host.info["slow_refits"] > 0:
            device = _select(features, val, dom, 20, "device")
            assert device.info["device_loop_fallback"] == 1
            assert device.indices.tolist() == host.indices.tolist() and torch.equal(device.weights, host.weights)
            return
    pytest.fail("no instance refitted")


def _device_solve(features, val, dom, kappa, **kw):
    gram, mu, _ = build_objective(features, val, ETA)
    caps = torch.tensor([kappa // 2] * 3)
    return omp_exact_on_device(gram, mu, dom, caps, kappa, 1e-6, default_grad_tol(mu), **kw)


def test_a_frozen_round_changes_nothing_until_its_repair():
    """A round that needs a repair freezes the state for the rest of its batch: however many rounds run between
    two reads (1, 3, 7 or all 20), the solve is the same bit for bit, and it reads once a batch and once a
    step of each repair."""
    features, val, dom, _ = _drop_instance()
    base = _device_solve(features, val, dom, 20, rounds_per_read=1)
    assert base.clean and base.drops > 0 and base.reentries > 0
    for batch in (3, 7, 20):
        other = _device_solve(features, val, dom, 20, rounds_per_read=batch)
        assert other.clean and (other.drops, other.reentries) == (base.drops, base.reentries)
        assert torch.equal(other.sel_K, base.sel_K) and torch.equal(other.v_K, base.v_K) and torch.equal(other.phi, base.phi)
        assert other.reads < base.reads, (batch, other.reads, base.reads)


def test_every_prefix_of_the_picks_is_the_host_loops():
    """Every k from 2 to 20 picks, so that each repair is also the last round once (the solve's final check follows
    the repair), and some rounds need only a KKT re-entry (they enter without a drop; an element dropped before
    wants back in): the host loop's counts growing from k - 1 to k picks say which (greedy picks are the same
    prefix). The device loop makes the host loop's picks and repairs, with one read a round or one in all."""
    seen = {"a drop in the last round": 0, "a re-entry alone": 0}
    for seed in range(3):
        features, val, dom = make_instance(seed, 40, dim=8)
        gram, mu, _ = build_objective(features, val, ETA)
        caps = torch.tensor([10, 10, 10])
        prev = (0, 0)
        for k in range(2, 21):
            host_sel, host_v, _, info = omp_select(gram, mu, dom, caps, k, ridge_abs=1e-6)
            cur = int(info["weight_drops"]), int(info["weight_reentries"])
            seen["a drop in the last round"] += cur[0] > prev[0]
            seen["a re-entry alone"] += cur[1] > prev[1] and cur[0] == prev[0]
            prev = cur
            for per_read in (1, k):
                res = omp_exact_on_device(gram, mu, dom, caps, k, 1e-6, default_grad_tol(mu), rounds_per_read=per_read)
                assert res.clean and (res.drops, res.reentries) == cur, (seed, k, per_read)
                assert res.sel_K.tolist() == host_sel.tolist(), (seed, k)
                torch.testing.assert_close(res.v_K, host_v, rtol=1e-9, atol=1e-9 * float(host_v.abs().max()))
    assert all(seen.values()), seen


@pytest.mark.parametrize("per_graph", [16, 3])
def test_the_cuda_graph_rounds_control_flow_on_the_cpu(monkeypatch, per_graph):
    """The graph path with CUDA's two calls faked (a side stream runs in place; a recorded graph replays its
    rounds): each variant warms up once, eagerly; a graph of `ROUNDS_PER_GRAPH` rounds and one of a single
    round are each recorded once a variant, when a batch first needs them; warm-ups and replays run exactly
    the rounds the eager path runs, and the result is the eager path's bit for bit."""
    from composer_algos.selection import active_set_device as asd

    features, val, dom, _ = _drop_instance()
    eager = _device_solve(features, val, dom, 20, rounds_per_read=4)
    calls = {"eager": 0, "graph": 0}
    recorded = []
    real_round = asd._round

    def counted_round(*args):
        calls["graph" if any(g.replaying for g in recorded) else "eager"] += 1
        return real_round(*args)

    class FakeGraph:
        def __init__(self, fn):
            self.fn, self.replaying, self.rounds, self.replays = fn, False, None, 0
            recorded.append(self)

        def replay(self):
            self.replays += 1
            self.replaying = True
            before = calls["graph"]
            self.fn()
            self.replaying = False
            assert self.rounds in (None, calls["graph"] - before)  # a graph replays the same rounds each time
            self.rounds = calls["graph"] - before

    class GraphOnCpu(asd._Rounds):
        def __init__(self, st, tols, *, kind, graph):
            super().__init__(st, tols, kind=kind, graph=True)

    monkeypatch.setattr(asd, "ROUNDS_PER_GRAPH", per_graph)
    monkeypatch.setattr(asd, "_round", counted_round)
    monkeypatch.setattr(asd, "_Rounds", GraphOnCpu)
    monkeypatch.setattr(asd, "_on_side_stream", lambda fn: fn())
    monkeypatch.setattr(asd, "_recorded", FakeGraph)
    graphed = _device_solve(features, val, dom, 20, rounds_per_read=4)
    assert torch.equal(graphed.sel_K, eager.sel_K) and torch.equal(graphed.v_K, eager.v_K)
    assert (graphed.drops, graphed.reentries, graphed.reads) == (eager.drops, eager.reentries, eager.reads)
    # Batches of at most 4 rounds: with 16 rounds a graph, only one-round graphs (one a variant: before the
    # first drop, and after it); with 3, a three-round graph and a one-round graph a variant.
    round_graphs = [g for g in recorded if getattr(getattr(g.fn, "func", None), "__name__", "") == "_rounds"]
    sizes = sorted(g.rounds for g in round_graphs if g.rounds is not None)
    assert sizes == ([1, 1] if per_graph == 16 else [1, 1, 3, 3]), sizes
    # The final refactorisation: graphed only in a workspace (this solve keeps none, and finalises once).
    finals = [g for g in recorded if getattr(g.fn, "__name__", "") == "_compute"]
    assert finals == []
    # The repairs' segments (3 drops and 3 re-entries here): each recorded at its second use, then replayed, and
    # none replays a round.
    segments = [g for g in recorded if g not in round_graphs and g not in finals]
    assert segments and all(g.replays and g.rounds == 0 for g in segments), [(g.fn, g.replays, g.rounds) for g in segments]
    assert len(segments) == len({repr(g.fn) for g in segments}) <= 5  # an entry, a re-entry, a drop, pack or resume
    # Every round the eager path ran: 20 picks, plus the rounds that froze and were run again by the repairs.
    monkeypatch.setattr(asd, "_Rounds", GraphOnCpu.__mro__[1])
    calls_graph = dict(calls)
    calls.update(eager=0, graph=0)
    recorded.clear()
    _device_solve(features, val, dom, 20, rounds_per_read=4)
    assert calls_graph["eager"] + calls_graph["graph"] == calls["eager"] > 20
    assert calls_graph["eager"] == 2 and not recorded  # one warm-up a variant; the eager path records nothing


def test_the_rounds_read_the_device_once_a_batch():
    """On a CUDA run every tensor here lives on the device: the emulated audit counts one read for up to
    `ROUNDS_PER_READ` rounds without a repair (the final check read with the batch), and below that one a batch
    and one for the final check (4 batches of 4 or 5 rounds for 16 picks)."""
    features, val, dom = make_instance(3, 64, dim=64)
    gram, mu, _ = build_objective(features, val, ETA)
    caps = torch.tensor([8, 8, 8])
    grad_tol = default_grad_tol(mu)
    host_sel, _, _, _ = omp_select(gram, mu, dom, caps, 16, ridge_abs=1e-6)
    for per_read, reads in ((ROUNDS_PER_READ, 1), (16, 1), (4, 5), (5, 5)):
        with SyncAudit([gram, mu, dom, caps, grad_tol]) as audit:
            res = omp_exact_on_device(gram, mu, dom, caps, 16, 1e-6, grad_tol, rounds_per_read=per_read)
        syncs = sum(n for (kind, _s, _c), n in audit.events.items() if kind == "sync")
        assert syncs == res.reads == reads and not audit.other, (per_read, audit.events, audit.other)
        assert res.clean and res.drops == 0
        assert res.sel_K.tolist() == host_sel.tolist()
    with pytest.raises(ValueError, match="rounds_per_read must be at least 1, got 0"):
        omp_exact_on_device(gram, mu, dom, caps, 16, 1e-6, grad_tol, rounds_per_read=0)


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

    Well-posed pools (features of more dimensions than picks; static shapes, so two shapes, each compiled
    before and after its first drop; float32, the features' dtype on a GPU): the same picks, the same repairs,
    the weights up to rounding. (A pool of 8-dimensional features where kappa is 20 picks among near-ties once
    the 8 dimensions are spent, where a fused reduction's rounding may pick another: there
    `test_a_round_that_drops_a_weight_is_repaired_on_the_device` asks for the host loop's picks in float64.)
    """
    torch._dynamo.reset()
    seen = {"common": 0, "repaired": 0}
    for seed in range(4):
        for n, dim, kappa in ((64, 64, 16), (96, 128, 32)):
            features, val, dom = make_instance(seed, n, dim=dim, dtype=torch.float32)
            gram, mu, _ = build_objective(features, val, ETA)
            caps, grad_tol = torch.tensor([kappa // 2] * 3), default_grad_tol(mu)
            eager = omp_exact_on_device(gram, mu, dom, caps, kappa, 1e-6, grad_tol)
            compiled = omp_exact_on_device(gram, mu, dom, caps, kappa, 1e-6, grad_tol, compile=True)
            assert compiled.clean and eager.clean, (seed, n)
            assert (compiled.drops, compiled.reentries) == (eager.drops, eager.reentries), (seed, n)
            seen["repaired" if eager.drops else "common"] += 1
            assert compiled.sel_K.tolist() == eager.sel_K.tolist(), (seed, n)
            tol = 2e-4
            torch.testing.assert_close(compiled.v_K, eager.v_K, rtol=tol, atol=tol * float(eager.v_K.abs().max()))
            via, plain = (_select(features, val, dom, kappa, loop) for loop in ("device_compiled", "device"))
            assert via.indices.tolist() == plain.indices.tolist()
            assert via.info["device_loop_fallback"] == plain.info["device_loop_fallback"] == 0
    assert seen["common"] and seen["repaired"], seen  # both paths ran


@pytest.mark.timeout(160)  # one compilation: about 40 s with an empty cache
def test_the_compiled_round_is_a_few_fused_kernels():
    """The point of compiling: about 60 eager ops a round (58, 63 after a drop) become a few kernels (on a CPU 3: 2 fused loops and the
    GEMM; a CUDA count is the benchmark's), counted in the code inductor generated."""
    from bench_selection import compiled_round_kernels  # tools/bench/bench_selection.py

    features, val, dom = make_instance(5, 48, dim=16)
    gram, mu, _ = build_objective(features, val, ETA)
    assert 1 <= compiled_round_kernels(gram, mu, dom, torch.tensor([6, 6, 6]), 12) <= 6


def test_a_solve_of_several_batches_factorises_once_after_its_last_batch_is_read(monkeypatch):
    """The final refactorisation (a Cholesky factorisation of kappa + 1 slots, 0.35 ms of an H200 at kappa = 512)
    follows the read that says the last batch ran through, in a solve of several batches: once, however often
    its rounds froze. (Ridden on the last batch's read, it was wasted wherever the first frozen round fell in the
    last batch: with batches of 4 rounds, the drop pool's budgets of 5 to 20 picks put it there for some of them.)
    The same solve bit for bit as one read a round."""
    from composer_algos.selection import active_set_device as asd

    features, val, dom, _ = _drop_instance()
    calls = []
    real = asd._finalized
    monkeypatch.setattr(asd, "_finalized", lambda *args: calls.append(1) or real(*args))
    for kappa in range(5, 21):
        base = _device_solve(features, val, dom, kappa, rounds_per_read=1)
        calls.clear()
        res = _device_solve(features, val, dom, kappa, rounds_per_read=4)
        assert res.clean and (res.drops, res.reentries) == (base.drops, base.reentries), kappa
        assert torch.equal(res.sel_K, base.sel_K) and torch.equal(res.v_K, base.v_K) and torch.equal(res.phi, base.phi)
        assert len(calls) == 1, (kappa, len(calls))
    assert base.drops >= 2


def test_after_a_repair_the_final_refactorisation_waits_for_the_rounds_to_finish(monkeypatch):
    """A solve within one batch (all 20 rounds) computes the final refactorisation with the batch, to read it
    with the batch; the drop instance freezes there and is repaired several times, and after the first repair the
    factorisation waits for a read that says the rounds ran through: at most one is wasted (the one before the
    first repair), where each frozen last batch wasted one."""
    from composer_algos.selection import active_set_device as asd

    features, val, dom, _ = _drop_instance()
    base = _device_solve(features, val, dom, 20, rounds_per_read=1)
    calls = []
    real = asd._finalized
    monkeypatch.setattr(asd, "_finalized", lambda *args: calls.append(1) or real(*args))
    res = _device_solve(features, val, dom, 20, rounds_per_read=20)
    assert res.clean and res.drops >= 2, (res.drops, res.reentries)
    assert torch.equal(res.sel_K, base.sel_K) and torch.equal(res.v_K, base.v_K)
    assert len(calls) <= 2, len(calls)


def _graph_kind(graph) -> str:
    """What a faked graph records: ``_rounds``, ``_restart``, ``_compute`` (the final refactorisation) or a segment."""
    fn = getattr(graph.fn, "func", graph.fn)
    return fn.__name__


def _fake_graphs(monkeypatch):
    """The CUDA-graph path on the CPU (as test_the_cuda_graph_rounds_control_flow_on_the_cpu): the graphs recorded."""
    from composer_algos.selection import active_set_device as asd

    recorded = []

    class FakeGraph:
        def __init__(self, fn):
            self.fn = fn
            recorded.append(self)

        def replay(self):
            self.fn()

    class GraphOnCpu(asd._Rounds):
        def __init__(self, st, tols, *, kind, graph):
            super().__init__(st, tols, kind=kind, graph=True)

    monkeypatch.setattr(asd, "_Rounds", GraphOnCpu)
    monkeypatch.setattr(asd, "_on_side_stream", lambda fn: fn())
    monkeypatch.setattr(asd, "_recorded", FakeGraph)
    monkeypatch.setattr(asd._workspaces, "by_key", {}, raising=False)
    return recorded


def test_a_workspace_replays_its_graphs_in_the_next_solve_and_its_results_stand(monkeypatch):
    """Solves of the same shapes in the thread's workspace (as a training run's steps): the second and third
    solves record no graph and warm nothing up; each result is a fresh solve's bit for bit, also after the
    workspace has solved another pool (the results do not alias it); a pool of other shapes gets its own."""
    from composer_algos.selection import active_set_device as asd

    drop = _drop_instance()[:3]
    other = make_instance(7, 40, dim=8, dtype=torch.float64)
    fresh = [_device_solve(*inst, 20, rounds_per_read=4) for inst in (drop, other)]
    recorded = _fake_graphs(monkeypatch)
    first = _device_solve(*drop, 20, rounds_per_read=4, reuse=True)
    after_first = len(recorded)
    (ws,) = asd._workspaces.by_key.values()
    warm, rows = set(ws.rounds._warm), ws.st.rows_MN
    second = _device_solve(*other, 20, rounds_per_read=4, reuse=True)
    # Before the workspace solves the first pool again (which would restore an aliased result).
    assert torch.equal(first.sel_K, fresh[0].sel_K) and torch.equal(first.v_K, fresh[0].v_K)
    third = _device_solve(*drop, 20, rounds_per_read=4, reuse=True)
    assert after_first > 0 and len(recorded) == after_first  # the graphs of the first solve, replayed since
    # Among them the restart and the final refactorisation (the second and third results are theirs).
    assert {"_restart", "_compute"} <= {_graph_kind(g) for g in recorded}
    assert list(asd._workspaces.by_key.values()) == [ws] and ws.st.rows_MN is rows and ws.rounds._warm == warm
    for got, want in ((first, fresh[0]), (second, fresh[1]), (third, fresh[0])):
        assert got.clean and (got.drops, got.reentries) == (want.drops, want.reentries)
        assert torch.equal(got.sel_K, want.sel_K) and torch.equal(got.v_K, want.v_K) and torch.equal(got.phi, want.phi)
    assert fresh[0].drops > 0  # the replayed graphs include the variant after a drop
    smaller = _device_solve(*make_instance(1, 30, dim=8, dtype=torch.float64), 10, rounds_per_read=4, reuse=True)
    assert smaller.clean and len(asd._workspaces.by_key) == 2


def test_a_thread_keeps_the_workspaces_of_its_last_four_shapes(monkeypatch):
    from composer_algos.selection import active_set_device as asd

    _fake_graphs(monkeypatch)
    for kappa in (4, 5, 6, 7, 8):
        _device_solve(*make_instance(0, 24, dim=16, dtype=torch.float64), kappa, reuse=True)
    assert sorted(key[4] for key in asd._workspaces.by_key) == [5, 6, 7, 8]  # (device, dtypes, n, k, ...)


def test_a_repair_reads_the_device_only_where_it_decides(monkeypatch):
    """The repairs' segments take no host value and read nothing (they are CUDA graphs from their second use): on
    the drop instance every host sync of the solve is one of its counted reads, the batches' and the repairs'
    (the pivot tests, each drop, each KKT check), and the graphed repairs (faked on the CPU) read the same."""
    features, val, dom, _ = _drop_instance()
    gram, mu, _ = build_objective(features, val, ETA)
    caps, grad_tol = torch.tensor([10, 10, 10]), default_grad_tol(mu)
    results = []
    for graphed in (False, True):
        if graphed:
            _fake_graphs(monkeypatch)
        with SyncAudit([gram, mu, dom, caps, grad_tol]) as audit:
            res = omp_exact_on_device(gram, mu, dom, caps, 20, 1e-6, grad_tol, rounds_per_read=4, reuse=graphed)
        syncs = sum(n for (kind, _s, _c), n in audit.events.items() if kind == "sync")
        assert res.clean and res.drops >= 2 and res.reentries >= 1, (res.drops, res.reentries)
        assert syncs == res.reads and not audit.other, (graphed, syncs, res.reads, audit.events, audit.other)
        results.append(res)
    assert torch.equal(results[0].sel_K, results[1].sel_K) and torch.equal(results[0].v_K, results[1].v_K)


def test_a_repair_reads_once_an_entry_or_a_drop(monkeypatch):
    """The weights, the gradient and the KKT check ride on the segment that leaves every weight positive (an
    entry's or the last drop's), so a repair reads once for the frozen round's pick, once a re-entry and once a
    drop: 2 reads for one drop, where it read 3 (and 4 for a re-entry alone, where it now reads 2)."""
    from composer_algos.selection import active_set_device as asd

    repairs, segments = [], []
    real, real_run = asd._repair, asd._RepairSteps.run
    monkeypatch.setattr(asd._RepairSteps, "run", lambda self, name: segments.append(name) or real_run(self, name))

    def repair(*args):
        segments.clear()
        repairs.append((real(*args), list(segments)))
        return repairs[-1][0]

    monkeypatch.setattr(asd, "_repair", repair)
    for seed in range(3):
        res = _device_solve(*make_instance(seed, 40, dim=8), 20, rounds_per_read=4)
        assert res.clean
    assert sum(r.drops for r, _ in repairs) >= 2 and sum(r.reentries for r, _ in repairs) >= 2, repairs
    assert any(r.drops == 0 < r.reentries for r, _ in repairs), repairs  # a round frozen for a KKT re-entry alone
    for r, ran in repairs:
        assert r.ok and r.reads == 1 + r.drops + r.reentries, r
        # Only a drop frees a slot: without one the slots in use are still the first, and nothing is packed.
        assert ran[-1] == ("pack" if r.drops else "resume"), (r, ran)


def test_after_a_repair_the_batches_start_short_and_double_back(monkeypatch):
    """Repairs come in clusters (a drop, then a KKT re-entry a round or two later), so after one the batches of
    rounds between reads start at `ROUNDS_AFTER_REPAIR` rounds and double back to ``rounds_per_read``: fewer
    rounds run frozen than when every batch is whole, and the solve is the same bit for bit. ``rounds`` counts
    the rounds launched, frozen ones included."""
    from composer_algos.selection import active_set_device as asd

    features, val, dom, _ = _drop_instance()
    batches = []
    real_run, real_repair = asd._Rounds.run, asd._repair
    monkeypatch.setattr(asd._Rounds, "run", lambda self, count, *, kkt: batches.append(count) or real_run(self, count, kkt=kkt))
    monkeypatch.setattr(asd, "_repair", lambda *args: batches.append("repair") or real_repair(*args))
    short = _device_solve(features, val, dom, 20, rounds_per_read=16)
    log = list(batches)
    assert "repair" in log and short.rounds == sum(b for b in log if b != "repair"), (log, short.rounds)
    for i, b in enumerate(log[:-1]):
        if b == "repair":
            after = [x for x in log[i + 1:] if x != "repair"]
            assert after[0] <= asd.ROUNDS_AFTER_REPAIR == 4, log
            assert all(x <= min(4 << j, 16) for j, x in enumerate(after)), log
    batches.clear()
    monkeypatch.setattr(asd, "ROUNDS_AFTER_REPAIR", 16)  # every batch whole, as before
    whole = _device_solve(features, val, dom, 20, rounds_per_read=16)
    assert whole.rounds > short.rounds >= 20, (whole.rounds, short.rounds)
    assert torch.equal(whole.sel_K, short.sel_K) and torch.equal(whole.v_K, short.v_K) and torch.equal(whole.phi, short.phi)
    assert (whole.drops, whole.reentries) == (short.drops, short.reentries)


def test_repairs_run_eagerly_when_their_graphs_are_off(monkeypatch):
    """`REPAIR_GRAPHS = False` (the benchmark's side-by-side row) runs the repairs' segments eagerly while the
    rounds stay graphed: only the rounds', the restart's and the final refactorisation's graphs are recorded, and the
    solve is the graphed repairs' bit for bit."""
    from composer_algos.selection import active_set_device as asd

    features, val, dom, _ = _drop_instance()
    recorded = _fake_graphs(monkeypatch)
    graphed = _device_solve(features, val, dom, 20, rounds_per_read=4, reuse=True)
    kinds = lambda: {_graph_kind(g) for g in recorded}  # noqa: E731
    assert kinds() == {"_rounds", "_restart", "_compute", "_pick_and_enter", "_reenter", "_drop", "_pack", "_resume"}, kinds()
    monkeypatch.setattr(asd._workspaces, "by_key", {})
    monkeypatch.setattr(asd, "REPAIR_GRAPHS", False)
    recorded.clear()
    eager = _device_solve(features, val, dom, 20, rounds_per_read=4, reuse=True)
    assert kinds() == {"_rounds", "_restart", "_compute"}, kinds()
    assert torch.equal(graphed.sel_K, eager.sel_K) and torch.equal(graphed.v_K, eager.v_K) and graphed.reads == eager.reads


def test_a_final_refactorisation_that_cannot_be_recorded_runs_eagerly_with_a_warning(monkeypatch):
    """Where the linear-algebra library cannot be captured in a CUDA graph (faked: its recording raises), the final
    refactorisation warns once and runs eagerly in this and later solves, with the graphed solve's result."""
    from composer_algos.selection import active_set_device as asd

    drop = _drop_instance()[:3]
    recorded = _fake_graphs(monkeypatch)
    want = _device_solve(*drop, 20, rounds_per_read=4, reuse=True)
    monkeypatch.setattr(asd._workspaces, "by_key", {})
    fake = asd._recorded

    def refuse_final(fn):
        if getattr(fn, "__name__", "") == "_compute":
            raise RuntimeError("operation not permitted when stream is capturing")
        return fake(fn)

    monkeypatch.setattr(asd, "_recorded", refuse_final)
    recorded.clear()
    with pytest.warns(UserWarning, match="final refactorisation runs eagerly"):
        first = _device_solve(*drop, 20, rounds_per_read=4, reuse=True)
    again = _device_solve(*drop, 20, rounds_per_read=4, reuse=True)
    assert "_compute" not in {_graph_kind(g) for g in recorded}
    for got in (first, again):
        assert got.clean and torch.equal(got.sel_K, want.sel_K) and torch.equal(got.v_K, want.v_K)
        assert torch.equal(got.phi, want.phi)
