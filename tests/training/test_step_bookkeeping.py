"""The selection step's own bookkeeping, batched (issue 31.2): few aten ops for many fields, same values.

The step reads the device once (`settle_on_host`); what goes into that read (`selection.types.host_values`),
the checks recorded for it (`check_finite`, the weights' check) and what the host makes of it
(`_host_result`, `selection_hash`, the metrics) must stay exact while they cost a handful of ops.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from step_audit import OpCount  # tools/bench/step_audit.py

from composer_algos.data_selection.step import SelectionProblem, SolveOutcome, selection_hash, settle_on_host
from composer_algos.losses import mask_and_labels
from composer_algos.selection import SelectionNumericsError, SelectionResult, conflict_fraction
from composer_algos.selection.types import DeferredChecks, check_finite, deferring_checks, host_values


def _ops(fn):
    with OpCount() as count:
        out = fn()
    return out, count.ops


def test_host_values_reads_every_dtype_and_shape_exactly_in_a_few_ops():
    big = 2**40 + 3  # exact in float64, not in float32
    idx = torch.tensor([big, 0, 7])
    w = torch.tensor([0.1, -2.5], dtype=torch.float32)
    objective = torch.tensor(1.25, dtype=torch.float32)
    share = torch.tensor(1e-30, dtype=torch.float32)
    flags = torch.tensor([[True, False], [False, True]])
    ok = torch.tensor(True)
    half = torch.tensor([1.5], dtype=torch.float16)
    tensors = [idx, w, objective, share, flags, ok, half, objective]  # objective twice: it travels once
    values, ops = _ops(lambda: host_values(tensors))
    assert values[0] == [float(big), 0.0, 7.0]
    assert values[1] == [float(w[0]), -2.5] and values[2] == [1.25] and values[7] == [1.25]
    assert values[3] == [float(share)] and values[4] == [1.0, 0.0, 0.0, 1.0] and values[5] == [1.0]
    assert values[6] == [1.5]
    # Per dtype: a stack of its 0-dim tensors, a reshape of any other but 1-D, a cat and a conversion
    # (int64 1, float32 3, bool 4, float16 1); then one cat. One by one (detach, reshape, ...) it was 33.
    assert ops <= 10
    assert host_values([]) == []


def test_check_finite_names_exactly_the_broken_tensors_deferred_or_at_once():
    fine = torch.randn(5)
    for bad_value in (float("nan"), float("inf"), float("-inf")):
        broken = torch.randn(3, 4)
        broken[1, 2] = bad_value
        with pytest.raises(SelectionNumericsError, match=r"\['broken'\]"):
            check_finite("s", fine=fine, broken=broken, ids=torch.arange(3))
        checks = DeferredChecks()
        with deferring_checks(checks):
            check_finite("s", fine=fine, broken=broken, ids=torch.arange(3), empty=torch.zeros(0))
        assert checks.width == 2  # one number a floating tensor; integers and empty tensors need none
        with pytest.raises(SelectionNumericsError, match=r"\['broken'\]"):
            checks.judge([v for part in host_values(checks.packed()) for v in part])
    check_finite("s", fine=fine, big=torch.tensor([3e38, -3e38]))  # huge but finite: no overflow in the check


def test_a_missing_mask_is_a_cached_read_only_view_of_ones():
    batch = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]])}
    mask, labels = mask_and_labels(batch)
    assert mask.tolist() == [[1, 1, 1]] * 2 and mask.dtype == torch.long and torch.equal(labels, batch["input_ids"])
    again, ops = _ops(lambda: mask_and_labels({**batch, "labels": labels})[0])
    assert again is mask and ops == 0  # cached: no op the second time
    with pytest.raises(RuntimeError):
        mask.add_(1)  # read-only: one element behind all of them
    single = mask_and_labels({"input_ids": torch.tensor([[5]])})[0]
    single.add_(1)  # a lone element could be written: it is a fresh tensor, the cache is untouched
    assert mask_and_labels({"input_ids": torch.tensor([[5]])})[0].tolist() == [[1]] and mask.tolist() == [[1] * 3] * 2


def test_conflict_fraction_counts_the_pairs_above_the_diagonal():
    g = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    g[4] = 0.0  # zero inner products are no conflict
    idx = torch.tensor([0, 3, 4, 7, 9, 11])
    rows = g[idx]
    pairs = [(i, j) for i in range(len(idx)) for j in range(i + 1, len(idx))]
    count = sum(float(rows[i] @ rows[j]) < 0 for i, j in pairs)
    assert 0 < count < len(pairs)
    expected = float(torch.tensor(float(count)) / len(pairs))  # in float32, as the features
    assert float(conflict_fraction(g, idx)) == expected
    assert float(conflict_fraction(g @ g.T, idx, is_gram=True)) == expected


def test_selection_hash_hashes_the_sorted_positions_as_before():
    idx = torch.randperm(50, generator=torch.Generator().manual_seed(1))[:17]
    old = int.from_bytes(hashlib.sha1(torch.sort(idx).values.numpy().tobytes()).digest()[:3], "little")
    assert selection_hash(idx) == old


def test_settle_on_host_rebuilds_the_result_with_host_numbers_in_one_read():
    domain_P = torch.tensor([0, 1, 1, 2, 0, 2])
    weights = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float32)
    result = SelectionResult(
        indices=torch.tensor([4, 1, 5]),
        domain_counts=torch.tensor([1, 1, 1]),
        weights=weights,
        objective=torch.tensor(3.5, dtype=torch.float64),
        info={"share": torch.tensor(0.25), "pivots": torch.tensor(2), "free": torch.tensor(True), "swaps": 3},
    )
    problem = SelectionProblem(domain_P, 3)
    solver, features = DeferredChecks(), DeferredChecks()
    solver.add(torch.linalg.vector_norm(weights, float("inf")), lambda v: None)
    features.add([torch.tensor([0, 0]), torch.tensor(1.0)], lambda v: None)
    outcome, extras, failed = settle_on_host(
        SolveOutcome(result, "s", None), problem, {"features": features, "solver": solver},
        num_domains=3, seed=0, extras={"conflicts": torch.tensor(0.125)},
    )
    host = outcome.result
    assert failed == {} and extras == {"conflicts": 0.125}
    assert host.indices.tolist() == [4, 1, 5] and host.indices.dtype == torch.long
    assert host.domain_counts.tolist() == [1, 1, 1]
    assert host.weights.dtype == torch.float32 and torch.equal(host.weights, weights)
    assert host.objective.dtype == torch.float64 and float(host.objective) == 3.5
    assert host.info == {"share": 0.25, "pivots": 2, "free": True, "swaps": 3}
    assert type(host.info["pivots"]) is int and type(host.info["free"]) is bool


def test_settle_on_host_falls_back_on_a_failed_check():
    domain_P = torch.tensor([0, 1, 1, 2, 0, 2])
    result = SelectionResult(indices=torch.tensor([0, 1, 3]), domain_counts=torch.tensor([1, 1, 1]))
    checks = DeferredChecks()
    with deferring_checks(checks):
        check_finite("s", diag_K=torch.tensor([1.0, math.nan]))
    outcome, extras, failed = settle_on_host(
        SolveOutcome(result, "s", None), SelectionProblem(domain_P, 3), {"solver failed": checks},
        num_domains=3, seed=0, extras={"conflicts": torch.tensor(0.5)},
    )
    assert list(failed) == ["solver failed"] and "diag_K" in failed["solver failed"]
    assert outcome.strategy == "random_stratified" and outcome.fallback.startswith("solver failed")
    assert extras == {} and outcome.result.indices.numel() == 3
