"""`sharded_adam_scales` on emulated ranks (threads): FSDP shard groups and HYBRID_SHARD replicas give the unsharded scales."""

from __future__ import annotations

import threading

import pytest
import torch

from composer_algos.features.normalize import exact_adam_scale, factored_adam_scales, sharded_adam_scales
from composer_algos.features.targets import ParamShard

EPS = 1e-8
BETA2 = 0.95
STEP = 3
# (d_out, d_in, has_bias, sketched) of each target layer, all in one FSDP unit.
LAYERS = [(6, 5, True, False), (7, 9, False, True), (4, 11, True, True)]


class _FakeOptimizer:
    """Holds Adam's state for this rank's slices, as torch's AdamW does under FSDP (use_orig_params)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.param_groups = [{"params": params, "betas": (0.9, BETA2)}]
        self.state: dict = {}


def _full_v_hats(seed: int = 0) -> list[list[torch.Tensor]]:
    """Per layer, the bias-corrected second moments of weight (and bias); some tiny, as early in training."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for d_out, d_in, has_bias, _ in LAYERS:
        shapes = [(d_out, d_in)] + ([(d_out,)] if has_bias else [])
        out.append([torch.rand(s, generator=gen, dtype=torch.float64).pow(4).float() * 1e-4 for s in shapes])
    return out


def _run_ranks(
    world: int,
    shard_size: int,
    v_hats: list[list[torch.Tensor]],
    drop_state_on: int | None = None,
    no_state: bool = False,
):
    """Every rank's `sharded_adam_scales`; rank r holds shard `r % shard_size` of the unit's flat parameter."""
    numels = [v.numel() for layer in v_hats for v in layer]
    total = sum(numels)
    per_rank = -(-total // shard_size)  # FSDP pads the flat parameter to a multiple of the shard group
    results: list = [None] * world
    errors: list = []
    pending: list[torch.Tensor] = []
    lock = threading.Lock()
    barrier = threading.Barrier(world)

    def all_reduce_sum(t: torch.Tensor) -> None:
        with lock:
            pending.append(t.clone())
        barrier.wait()
        t.copy_(torch.stack(pending).sum(0))
        barrier.wait()

    def rank_fn(rank: int) -> None:
        try:
            lo, hi = (rank % shard_size) * per_rank, (rank % shard_size + 1) * per_rank
            shards, layers, params_all = {}, [], []
            opt_params = []
            offset = 0
            for (d_out, d_in, _, sketched), layer in zip(LAYERS, v_hats):
                params = []
                for v in layer:
                    start, end = max(lo - offset, 0), min(hi - offset, v.numel())
                    start, end = (start, end) if end > start else (0, 0)
                    p = torch.nn.Parameter(torch.zeros(end - start))
                    shards[id(p)] = ParamShard(v.numel(), start, end)
                    params.append(p)
                    offset += v.numel()
                layers.append((params, d_out, d_in, sketched))
                params_all.append(params)
                opt_params += params
            opt = _FakeOptimizer(opt_params)
            for params, layer in zip(params_all, v_hats):
                for p, v in zip(params, layer):
                    s = shards[id(p)]
                    if s.end > s.start and rank != drop_state_on and not no_state:
                        exp_avg_sq = v.reshape(-1)[s.start : s.end] * (1 - BETA2**STEP)
                        opt.state[p] = {"exp_avg_sq": exp_avg_sq, "step": torch.tensor(float(STEP))}
            results[rank] = sharded_adam_scales(opt, layers, shards, EPS, all_reduce_sum)
        except BaseException as err:  # reported by the test thread
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize(
    ("world", "shard_size"),
    [(2, 2), (4, 2), (3, 3)],
    ids=["full_shard_2", "hybrid_2x2", "full_shard_3"],
)
def test_sharded_scales_equal_unsharded(world: int, shard_size: int) -> None:
    v_hats = _full_v_hats()
    expected = [
        factored_adam_scales(v, EPS) if sketched else (exact_adam_scale(v, EPS),)
        for (_, _, _, sketched), v in zip(LAYERS, v_hats)
    ]
    results = _run_ranks(world, shard_size, v_hats)
    for rank, got in enumerate(results):
        assert got is not None, f"rank {rank} fell back to no normalisation"
        assert len(got) == len(expected)
        for layer, (g, e) in enumerate(zip(got, expected)):
            assert len(g) == len(e), f"layer {layer}: {len(g)} scales, expected {len(e)}"
            for gs, es in zip(g, e):
                torch.testing.assert_close(
                    gs, es, rtol=1e-5, atol=0, msg=lambda m, r=rank, i=layer: f"rank {r} layer {i}: {m}"
                )


def test_missing_state_on_one_rank_leaves_only_the_layers_it_holds_unpreconditioned() -> None:
    v_hats = _full_v_hats()
    results = _run_ranks(4, 2, v_hats, drop_state_on=1)
    # Rank 1 holds shard 1 of the flat parameter: the tail of layer 1 and all of layer 2. Layer 0 lies
    # in shard 0 (ranks 0 and 2 hold it with state) and keeps its preconditioner on every rank.
    expected_0 = exact_adam_scale(v_hats[0], EPS)
    for rank, got in enumerate(results):
        assert got is not None and len(got) == len(LAYERS), f"rank {rank}: {got}"
        assert got[1] is None and got[2] is None, f"rank {rank}"
        torch.testing.assert_close(got[0][0], expected_0, rtol=1e-5, atol=0)


def test_no_state_anywhere_gives_no_preconditioner_for_any_layer() -> None:
    results = _run_ranks(2, 2, _full_v_hats(), drop_state_on=None, no_state=True)
    assert results == [[None] * len(LAYERS)] * 2
