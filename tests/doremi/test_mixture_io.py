"""Tests for the mixture.json / mixture_steps.csv readers and writers."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from composer_algos.mixture_io import (
    MixtureCSVWriter,
    read_mixture_csv,
    read_mixture_json,
    write_mixture_json,
)

NAMES = ["code", "spam", "wiki"]


@pytest.mark.parametrize("as_tensor", [False, True])
def test_json_round_trip(tmp_path, as_tensor):
    w = [0.5, 0.125, 0.375]
    weights = torch.tensor(w, dtype=torch.float64) if as_tensor else w
    path = tmp_path / "sub" / "mixture.json"
    write_mixture_json(
        path, method="doremi", domain_names=NAMES, weights=weights, steps=7, natural=[0.2, 0.3, 0.5],
        extra={"eta_dro": 1.0},
    )
    raw = json.loads(path.read_text())
    assert raw["format_version"] == 1
    assert raw["domains"] == NAMES
    assert raw["weights"] == {"code": 0.5, "spam": 0.125, "wiki": 0.375}
    assert raw["eta_dro"] == 1.0
    m = read_mixture_json(path)
    assert m.method == "doremi" and m.steps == 7 and m.domain_names == NAMES
    assert m.weights == {"code": 0.5, "spam": 0.125, "wiki": 0.375}
    assert m.natural == {"code": 0.2, "spam": 0.3, "wiki": 0.5}
    assert m.extra == {"eta_dro": 1.0}
    assert m.weights_list(["wiki", "code", "spam"]) == [0.375, 0.5, 0.125]


def test_json_natural_none(tmp_path):
    path = tmp_path / "m.json"
    write_mixture_json(path, method="random", domain_names=["a", "b"], weights=[0.5, 0.5], steps=0)
    m = read_mixture_json(path)
    assert m.natural is None and m.extra == {}


def test_json_renormalises_small_drift_with_warning(tmp_path, caplog):
    path = tmp_path / "m.json"
    with caplog.at_level(logging.WARNING):
        write_mixture_json(path, method="x", domain_names=["a", "b"], weights=[0.5, 0.5002], steps=1)
    assert "renormalising" in caplog.text
    m = read_mixture_json(path)
    assert sum(m.weights.values()) == pytest.approx(1.0, abs=1e-12)
    assert m.weights["b"] > m.weights["a"]


@pytest.mark.parametrize(
    ("names", "weights", "match"),
    [
        (["a", "a"], [0.5, 0.5], "unique"),
        (["a", "b"], [0.5, 0.6], "sum to 1"),
        (["a", "b"], [1.5, -0.5], ">= 0"),
        (["a", "b"], [float("nan"), 1.0], "finite"),
        (["a", "b"], [1.0], "2 domains"),
    ],
)
def test_json_write_rejects_bad_input(tmp_path, names, weights, match):
    path = tmp_path / "bad.json"
    with pytest.raises(ValueError, match=match) as exc:
        write_mixture_json(path, method="x", domain_names=names, weights=weights, steps=1)
    assert "bad.json" in str(exc.value)
    assert not path.exists()


def test_json_write_rejects_reserved_extra(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        write_mixture_json(tmp_path / "m.json", method="x", domain_names=["a"], weights=[1.0], steps=1,
                           extra={"weights": 3})


def _good_doc():
    return {"format_version": 1, "method": "x", "domains": ["a", "b"], "weights": {"a": 0.25, "b": 0.75},
            "steps": 3, "natural": None}


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.pop("weights"), "`weights`"),
        (lambda d: d.update(format_version=2), "format_version"),
        (lambda d: d.update(weights={"a": 0.25, "c": 0.75}), "unknown \\['c'\\]"),
        (lambda d: d.update(weights={"a": 0.5, "b": 0.75}), "sum to 1"),
        (lambda d: d.update(steps=-1), "`steps`"),
        (lambda d: d.update(domains="ab"), "`domains`"),
        (lambda d: d.update(natural={"a": 1.0}), "`natural`"),
    ],
)
def test_json_read_rejects_bad_files(tmp_path, mutate, match):
    doc = _good_doc()
    mutate(doc)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match) as exc:
        read_mixture_json(path)
    assert "broken.json" in str(exc.value)


def test_json_read_rejects_non_json(tmp_path):
    path = tmp_path / "garbage.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="garbage.json"):
        read_mixture_json(path)


def test_csv_round_trip(tmp_path):
    path = tmp_path / "mixture_steps.csv"
    rows = np.random.default_rng(0).dirichlet(np.ones(3), size=4)
    with MixtureCSVWriter(path, NAMES) as w:
        for step, row in enumerate(rows):
            w.write(step, torch.tensor(row) if step % 2 else list(row))
    steps, names, weights_SC = read_mixture_csv(path)
    assert steps == [0, 1, 2, 3] and names == NAMES
    np.testing.assert_array_equal(weights_SC, rows)  # repr() keeps float64 exactly


def test_csv_resume_drops_rows_from_interrupted_part(tmp_path):
    path = tmp_path / "mixture_steps.csv"
    w = MixtureCSVWriter(path, NAMES)
    for step in range(5):
        w.write(step, [step, 0.0, 1.0])
    w.close()
    # Resumed from a checkpoint at step 3: rows 3 and 4 are replaced by the new run's.
    w = MixtureCSVWriter(path, NAMES, resume=True)
    w.write(3, [30.0, 0.0, 1.0])
    w.write(4, [40.0, 0.0, 1.0])
    w.close()
    steps, _, weights_SC = read_mixture_csv(path)
    assert steps == [0, 1, 2, 3, 4]
    assert weights_SC[:, 0].tolist() == [0.0, 1.0, 2.0, 30.0, 40.0]


def test_csv_resume_rejects_other_domains(tmp_path):
    path = tmp_path / "m.csv"
    MixtureCSVWriter(path, NAMES).close()
    with pytest.raises(ValueError, match="header"):
        MixtureCSVWriter(path, ["a", "b"], resume=True)


def test_csv_without_resume_truncates(tmp_path):
    path = tmp_path / "m.csv"
    with MixtureCSVWriter(path, NAMES) as w:
        w.write(0, [1.0, 0.0, 0.0])
    MixtureCSVWriter(path, NAMES).close()
    steps, _, weights_SC = read_mixture_csv(path)
    assert steps == [] and weights_SC.shape == (0, 3)


def test_csv_write_rejects_wrong_length(tmp_path):
    with MixtureCSVWriter(tmp_path / "m.csv", NAMES) as w, pytest.raises(ValueError, match="3 domains"):
        w.write(0, [0.5, 0.5])


def test_csv_read_reports_bad_line(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("step,a,b\n0,0.5,0.5\n1,0.5\n")
    with pytest.raises(ValueError, match="line 3"):
        read_mixture_csv(path)
