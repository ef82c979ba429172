"""Gradient features under FSDP units that hold whole parameters (one process, CPU, gloo) equal those of the unwrapped model.

On one rank FSDP turns every sharding strategy into NO_SHARD (torch 2.7, `_init_core_state`): a
Composer run with `fsdp_config` on one GPU gets units that shard nothing (issue 30.4). The features
must then be the ones the same model gives without FSDP, for `use_orig_params` true (the optimizer
holds the original parameters) and false (it holds FSDP's flat parameters), and scoring must leave
FSDP's state as a training step expects it (the truncated backward runs none of FSDP's
post-backward hooks; tests/features/test_fsdp.py covers units that shard, on two processes).

The worker runs in a spawned process so that its process group does not outlive it.
"""

from __future__ import annotations

import copy

import pytest
import torch

LR = 1e-2
# (sharding strategy given to FSDP, use_orig_params): FULL_SHARD is what Composer passes for the
# recipe's `fsdp_config`, HYBRID_SHARD is a shard group of one rank; torch makes each NO_SHARD here.
CASES = [("NO_SHARD", True), ("NO_SHARD", False), ("FULL_SHARD", True), ("HYBRID_SHARD", False)]
OPTS = dict(last_n_blocks=1, include_lm_head=True, exact_max_numel=4096, sketch_dim=8, proj_dim=0, chunk_size=3)


def _train_step(model, opt, batch: dict) -> None:
    model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _wrap(model, strategy: str, use_orig_params: bool, **kwargs):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return FSDP(
        model,
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
        **kwargs,
    )


def _worker(rank: int, init_file: str, out_file: str) -> None:
    import torch.distributed as tdist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision

    from composer_algos.features import GradFeatureExtractor
    from tests.common.models import tiny_llama
    from tests.features.helpers import make_batch

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    results: dict = {}
    pool, val = make_batch(n=5, seed=20, pad_rows=2), make_batch(n=2, seed=30)
    for strategy, use_orig_params in CASES:
        reference = tiny_llama(seed=0)
        inner = copy.deepcopy(reference)
        fsdp = _wrap(inner, strategy, use_orig_params)
        opt = torch.optim.AdamW(fsdp.parameters(), lr=LR)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
        for model, optimizer in ((fsdp, opt), (reference, ref_opt)):
            _train_step(model, optimizer, make_batch(n=4, seed=10))
        ext, ref_ext = GradFeatureExtractor(fsdp, **OPTS), GradFeatureExtractor(reference, **OPTS)
        # Two calls of two chunks each: every forward after the first meets what scoring left behind.
        G, gbar = ext.compute(pool, val, optimizer=opt)
        G2, _ = ext.compute(pool, val, optimizer=opt)
        G_ref, gbar_ref = ref_ext.compute(pool, val, optimizer=ref_opt)
        no_grads = all(p.grad is None for p in fsdp.parameters())
        for model, optimizer in ((fsdp, opt), (reference, ref_opt)):
            _train_step(model, optimizer, make_batch(n=4, seed=40))
        with FSDP.summon_full_params(fsdp):
            param_err = max(float((p - q).abs().max()) for p, q in zip(inner.parameters(), reference.parameters()))
        results[(strategy, use_orig_params)] = dict(
            effective=FSDP.fsdp_modules(fsdp)[0].sharding_strategy.name,
            names=ext.target_names, ref_names=ref_ext.target_names, sketched=[t.sketched for t in ext.targets],
            normalization=ext.normalization_in_use, ref_normalization=ref_ext.normalization_in_use,
            fraction=ext.preconditioned_fraction,
            G=G, G2=G2, G_ref=G_ref, gbar=gbar, gbar_ref=gbar_ref, no_grads=no_grads, param_err=param_err,
        )
    # bf16 parameters in the forward (Composer's mixed_precision PURE on a GPU): scoring must leave the
    # full-precision parameters in place, so training with scoring between the steps matches training without.
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    runs = []
    for score in (True, False):
        inner = tiny_llama(seed=0)
        fsdp = _wrap(inner, "NO_SHARD", True, mixed_precision=mp)
        opt = torch.optim.AdamW(fsdp.parameters(), lr=LR)
        _train_step(fsdp, opt, make_batch(n=4, seed=10))
        if score:
            GradFeatureExtractor(fsdp, **OPTS).compute(pool, val, optimizer=opt)
        _train_step(fsdp, opt, make_batch(n=4, seed=40))
        with FSDP.summon_full_params(fsdp):
            runs.append([p.detach().clone() for p in inner.parameters()])
    results["mixed_precision_err"] = max(float((p - q).abs().max()) for p, q in zip(*runs))
    results["mixed_precision_dtypes"] = sorted({str(p.dtype) for p in runs[0]})
    torch.save(results, out_file)
    tdist.destroy_process_group()


@pytest.fixture(scope="module")
def whole_results(tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("fsdp_whole")
    mp.spawn(_worker, args=(str(out / "init"), str(out / "results.pt")), nprocs=1, join=True)
    return torch.load(out / "results.pt", weights_only=False)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("strategy", "use_orig_params"), CASES)
def test_features_of_whole_parameter_units_match_the_unwrapped_model(whole_results, strategy, use_orig_params):
    r = whole_results[(strategy, use_orig_params)]
    assert r["effective"] == "NO_SHARD", "torch makes every strategy NO_SHARD on one rank"
    assert r["names"] == r["ref_names"]
    assert any(r["sketched"]) and not all(r["sketched"]), "both exact and sketched targets are covered"
    # Adam-normalised from the optimizer's state, every target (flat parameters' slices for use_orig_params false).
    assert r["normalization"] == r["ref_normalization"] == "adam_optimizer/pool"
    assert r["fraction"] == 1.0
    scale = float(r["G_ref"].abs().max())
    torch.testing.assert_close(r["G"], r["G_ref"], rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(r["G2"], r["G"], rtol=0, atol=0)
    torch.testing.assert_close(r["gbar"], r["gbar_ref"], rtol=1e-4, atol=1e-5 * float(r["gbar_ref"].abs().max()))
    assert r["no_grads"], "scoring wrote a parameter gradient"
    assert r["param_err"] < 1e-6, f"the step after scoring diverged by {r['param_err']}"


def test_scoring_under_mixed_precision_leaves_training_unchanged(whole_results):
    assert whole_results["mixed_precision_dtypes"] == ["torch.float32"]
    assert whole_results["mixed_precision_err"] == 0.0
