"""Host syncs of one selection step (issue 31.1): one per step, where the selection reaches the host.

On a GPU every read of a device value by the host (`.item()`, `.tolist()`, `.cpu()`, `bool()` of a
tensor, `nonzero`, a CUDA `bincount`, a blocking copy to the device, ...) makes the host wait for
the accelerator's queue to drain. `tools/bench/step_audit.py` counts the calls the project's own code
makes during one step of a real Trainer, emulating on this CPU machine which tensors a CUDA run
holds on the device (its docstring gives the rules; on CUDA the same count comes from torch's
`set_sync_debug_mode`, see tests/gpu). The budget: one transfer a step for every strategy, plus,
for the exact OMP refit (partitionsel, iwd), the solver's host-driven active set: one sync per pick
(its Lawson-Hanson decisions) and two more (the setup's reads and the final refactorisation).
"""

from __future__ import annotations

import pytest
import torch
from step_audit import StepAuditor, SyncAudit, format_counts  # tools/bench/step_audit.py
from stepping import prepare_for_stepping  # tools/bench/stepping.py

import train
from pipeline.config import load_config
from tests.common.paths import REPO_ROOT
from tests.training.conftest import tiny_overrides

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
STRATEGIES = ["partitionsel", "greats", "id", "iwd", "gradnorm", "colm", "facloc", "uniprot", "random", "random_stratified"]
EXACT_OMP = {"partitionsel", "iwd"}
KAPPA = 4  # tiny_overrides: 4 rows trained a step (a pool of 12)


def allowed_syncs(strategy: str) -> int:
    """The step's one transfer, plus the exact refit's per-pick sync and its two others."""
    return 1 + (KAPPA + 2 if strategy in EXACT_OMP else 0)


def _count_third_step(shards, run_dir, *overrides):
    """The audited counts of a tiny run's third selection step (after two, the optimizer has state, so
    the Adam normalisation runs), and their report."""
    cfg = load_config(TINY, tiny_overrides(shards, run_dir, "eval_loader=null", *overrides))
    trainer = train.build_trainer(cfg)
    prepare_for_stepping(trainer)
    auditor = StepAuditor(trainer)
    trainer.fit(duration="1ba")
    trainer.fit(duration="1ba")
    counts = auditor.count()
    auditor.close()
    trainer.close()
    return counts, format_counts(counts, top=40)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_selection_step_syncs_at_most_its_budget(strategy, dolma_shards, tmp_path):
    counts, report = _count_third_step(dolma_shards, tmp_path / strategy, f"algorithms.data_selection.strategy={strategy}")
    assert counts["mixed"] == 0, report  # device and host tensors in one op: an error on CUDA
    assert counts["sync"] + counts["h2d"] <= allowed_syncs(strategy), report
    assert counts["ops"] > 0 and counts["ops"] >= counts["kernels"]
    if strategy in ("random", "random_stratified"):  # they select on the host: no device work, no transfer
        assert counts["kernels"] == 0 and counts["sync"] == 0, report
    else:
        assert counts["sync"] >= 1 and counts["kernels"] > 0, report  # the selection reaches the host once
    # The reads in order, each with the work dispatched before it: one entry a read, the counts growing.
    timeline = counts["timeline"]
    assert len(timeline) == counts["sync"] + counts["h2d"], report
    assert all(0 <= a[0] <= b[0] <= counts["ops"] and 0 <= a[1] <= b[1] <= counts["kernels"]
               for a, b in zip(timeline, timeline[1:] + [(counts["ops"], counts["kernels"])])), timeline
    assert ("first host read after" in report) == bool(timeline)


@pytest.mark.parametrize("loop", ["device", "device_triton", "cpu"])
def test_the_device_and_cpu_loops_read_the_device_twice_a_step(loop, dolma_shards, tmp_path):
    """partitionsel with `solver_loop: device` (the solver's one flag; `device_triton` runs its eager rounds on a
    CPU) or `cpu` (K and mu in one read): the step's transfer and one more, against 1 + kappa + 2 with the host
    loop (issue 31.3)."""
    counts, report = _count_third_step(dolma_shards, tmp_path / "run", "algorithms.data_selection.strategy=partitionsel",
                                       f"algorithms.data_selection.strategy_options.partitionsel.solver_loop={loop}")
    assert counts["mixed"] == 0, report
    assert counts["sync"] + counts["h2d"] <= 2, report


def test_the_audit_says_what_was_dispatched_before_each_read():
    """A read right after some device work reports that work's ops: the host work before the first read can overlap
    the GPU's, the rest waits for it."""
    from step_audit import OpCount

    from composer_algos.selection import types

    dev = torch.arange(6.0, dtype=torch.float64)
    audit = SyncAudit([dev])
    ops = OpCount(on_device=lambda: audit.device_call)
    audit.clock = lambda: (ops.ops, ops.kernels)
    with ops, audit:
        y = (dev * 2 + 1).cumsum(0)  # device work (from this file: counted, but its reads would not be the project's)
        before = (ops.ops, ops.kernels)
        types.host_values([y])  # the project's read of a float64 vector: nothing to convert first
        z = y * 3
        types.host_values([z])
    assert before[0] >= 3 and before[1] >= 3
    assert [entry[:3] for entry in audit.timeline] == [(*before, "sync"), (before[0] + 1, before[1] + 1, "sync")]
    assert all(entry[3].startswith("composer_algos/selection/types.py") for entry in audit.timeline)


def _audit(fn, device_tensors):
    with SyncAudit(device_tensors) as audit:
        fn()
    return audit


def test_the_audit_counts_what_syncs_on_cuda_and_not_host_work():
    # Called from this test file, which is not project code: the calls are attributed to "other".
    from composer_algos.selection import count_domains

    dev = torch.arange(6.0)
    host = torch.arange(6.0)
    audit = _audit(
        lambda: (
            dev.sum().item(),
            host.sum().item(),  # host work: free
            dev[dev > 2],  # mask index: a nonzero
            host.to(dev.device),  # a blocking copy to the device
            host.to(dev.device, non_blocking=True),  # not blocking
            torch.bincount(dev.long()),  # CUDA's bincount reads the max
            count_domains(dev.long(), 6),  # the project's scatter: no sync (called inside the project)
            dev + host,  # mixing: an error on CUDA
        ),
        [dev],
    )
    kinds = sorted(kind for (kind, _site, _call), n in audit.other.items() for _ in range(n))
    assert kinds == ["h2d", "sync", "sync", "sync"]
    assert audit.events == {}  # none of it was the project's code


def test_assigning_a_number_through_a_device_index_is_a_sync_and_index_fill_is_not():
    # Measured on CUDA (torch 2.11, an H200, set_sync_debug_mode): `open_N[j] = False` synced once a pick
    # in greats_greedy and once in segmented_argmax_mask; the emulation missed it until this rule.
    dev = torch.ones(6)
    audit = _audit(lambda: dev.__setitem__(dev.argmax().view(1), 0.0), [dev])
    assert [kind for (kind, _s, _c) in audit.other] == ["sync"]
    dev = torch.ones(6)
    audit = _audit(lambda: (dev.index_fill_(0, dev.argmax().view(1), 0.0), dev.__setitem__(slice(0, 2), 0.0)), [dev])
    assert audit.other == {} and audit.events == {}
    dev = torch.ones(6)  # a 0-dim host tensor is copied like a number; a bool mask is the mask rule's one sync
    audit = _audit(lambda: (dev.__setitem__(dev.argsort()[:2], torch.tensor(0.0)), dev.__setitem__(dev > 0, 1.0)), [dev])
    assert [kind for (kind, _s, _c) in audit.other for _ in range(audit.other[(kind, _s, _c)])] == ["sync", "sync"]


def test_the_audit_attributes_project_calls(monkeypatch):
    from composer_algos.selection import types

    dev = torch.arange(4.0)
    audit = _audit(lambda: types.check_finite("x", t=dev), [dev])  # judged at once: one read
    assert sum(audit.events.values()) == 1
    ((kind, site, call),) = audit.events
    assert kind == "sync" and call == "tolist" and site.startswith("composer_algos/selection/types.py:")
    deferred = types.DeferredChecks()
    with types.deferring_checks(deferred):
        audit = _audit(lambda: types.check_finite("x", t=dev), [dev])  # deferred: no read
    assert not audit.events and deferred.width == 1


def test_ops_are_filed_under_the_model_or_the_project_code_that_dispatched_them():
    from step_audit import OpCount, format_op_sites

    from composer_algos.selection import count_domains
    from tests.common.models import tiny_llama

    model = tiny_llama(seed=0)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), OpCount(attribute=True) as plain:
        model(input_ids=ids, use_cache=False)
    domains = torch.tensor([0, 2, 2])
    with torch.no_grad(), OpCount(attribute=True) as ops:
        model(input_ids=ids, use_cache=False)
        count_domains(domains, 3)
        torch.ones(3).sum()  # from this file: neither the project nor a model
    sites = ops.by_site
    assert sum(v[0] for v in sites.values()) == ops.ops
    model_ops = sum(v[0] for k, v in sites.items() if k.startswith("modeling_llama.py"))
    assert model_ops == sum(v[0] for k, v in plain.by_site.items() if k.startswith("modeling_llama.py")) > 0
    assert sites["types.py count_domains"][0] > 0 and sites["other"][0] == 2  # ones, sum
    report = format_op_sites(sites, top=3)
    assert len(report.splitlines()) == 5 and f"the model's own code (modeling_*.py): {model_ops} of {ops.ops} ops" in report
    assert OpCount().by_site is None  # off unless asked
