"""The mixture comparison: natural shares from a manifest, the table, and the figures the tool writes."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from composer_algos.doremi.compare import (
    build_columns,
    format_markdown,
    format_table,
    natural_token_shares,
    total_variation,
)
from composer_algos.mixture_io import MixtureCSVWriter, read_mixture_json, write_mixture_json
from pipeline.manifest import DomainInfo, Manifest, SplitStats, write_manifest
from tests.common.paths import REPO_ROOT

NAMES = ["code", "spam", "wiki"]


def _manifest(tmp_path, train_tokens):
    domains = [
        DomainInfo(name=n, dir=n, input_records=10, rejected=0, truncated=0,
                   splits={"train": SplitStats(records=8, samples=8, tokens=t), "val": SplitStats(records=2, samples=2,
                                                                                                  tokens=5)})
        for n, t in zip(NAMES, train_tokens)
    ]
    m = Manifest(format_version=1, mode="pretrain", tokenizer="tok", vocab_size=10, eos_token_id=0, pad_token_id=None,
                 bos_token_id=None, max_seq_len=8, prompt_template=None, truncation=None, val_fraction=None,
                 val_count=2, seed=0, domains=domains, inputs=[], command="test", created="2025-01-01T00:00:00")
    (tmp_path / "shards").mkdir()
    write_manifest(m, tmp_path / "shards")
    return tmp_path / "shards"


def _write_run(path, method, weights, rows=None, initial=None):
    extra = {"initial_weights": dict(zip(NAMES, initial))} if initial is not None else None
    write_mixture_json(path / "mixture.json", method=method, domain_names=NAMES, weights=weights, steps=3,
                       natural=[0.2, 0.3, 0.5], extra=extra)
    if rows is not None:
        with MixtureCSVWriter(path / "mixture_steps.csv", NAMES) as w:
            for i, r in enumerate(rows):
                w.write(i, r)


def test_natural_token_shares(tmp_path):
    shards = _manifest(tmp_path, [100, 300, 600])
    assert natural_token_shares(shards) == pytest.approx({"code": 0.1, "spam": 0.3, "wiki": 0.6})


def test_table_columns_and_tv(tmp_path):
    _write_run(tmp_path, "doremi", [0.5, 0.1, 0.4], initial=[1 / 3] * 3)
    doremi = read_mixture_json(tmp_path / "mixture.json")
    (tmp_path / "sel").mkdir()
    _write_run(tmp_path / "sel", "partitionsel", [0.3, 0.2, 0.5])
    sel = read_mixture_json(tmp_path / "sel" / "mixture.json")
    natural = {"code": 0.1, "spam": 0.3, "wiki": 0.6}
    names, cols = build_columns(doremi, [("partitionsel", sel)], natural=natural)
    assert names == NAMES
    assert [c.label for c in cols] == ["natural", "DoReMi initial", "DoReMi", "partitionsel"]
    table = format_table(names, cols)
    assert "0.1000" in table.splitlines()[2]  # spam row: DoReMi's 0.1
    # TV(DoReMi, natural) = 0.5 * (0.4 + 0.2 + 0.2) = 0.4
    assert total_variation(cols[2].weights, natural, names) == pytest.approx(0.4)
    assert "0.4000" in table.splitlines()[-1]
    md = format_markdown(names, cols)
    assert md.startswith("| domain | natural | DoReMi initial | DoReMi | partitionsel |")
    # Without a manifest the natural column comes from the files' `natural`.
    _, cols2 = build_columns(doremi, [])
    assert cols2[0].label == "natural" and cols2[0].weights == pytest.approx({"code": 0.2, "spam": 0.3, "wiki": 0.5})


def test_missing_domain_shown_as_dash(tmp_path):
    write_mixture_json(tmp_path / "m.json", method="x", domain_names=["code", "wiki"], weights=[0.5, 0.5], steps=1)
    names, cols = build_columns(None, [("x", read_mixture_json(tmp_path / "m.json"))],
                                natural={"code": 0.2, "spam": 0.3, "wiki": 0.5})
    spam_row = format_table(names, cols).splitlines()[2]
    assert spam_row.split()[0] == "spam" and spam_row.split()[-1] == "-"


def test_tool_writes_table_and_figures(tmp_path, capsys):
    shards = _manifest(tmp_path, [100, 300, 600])
    rng = np.random.default_rng(0)
    (tmp_path / "doremi").mkdir()
    _write_run(tmp_path / "doremi", "doremi", [0.5, 0.1, 0.4], rows=rng.dirichlet(np.ones(3), 5), initial=[1 / 3] * 3)
    (tmp_path / "sel").mkdir()
    _write_run(tmp_path / "sel", "partitionsel", [0.3, 0.2, 0.5], rows=rng.dirichlet(np.ones(3), 5))
    (tmp_path / "rand").mkdir()
    _write_run(tmp_path / "rand", "random", [0.1, 0.3, 0.6])  # no CSV: no trajectory panel
    out = tmp_path / "cmp"
    rc = _tool().main(["--doremi", str(tmp_path / "doremi" / "mixture.json"), "--runs", str(tmp_path / "sel" /
                       "mixture.json"), f"uniform-ish={tmp_path / 'rand'}", "--manifest", str(shards), "--out", str(out)])
    assert rc == 0
    stdout = capsys.readouterr().out
    header = stdout.splitlines()[0]
    for label in ("natural", "DoReMi initial", "DoReMi", "partitionsel (sel)", "uniform-ish"):
        assert label in header
    for name in ("comparison.png", "trajectories.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    md = (out / "comparison.md").read_text()
    assert "| spam |" in md and f"- **uniform-ish**: {tmp_path / 'rand' / 'mixture.json'}" in md


def test_tool_requires_inputs(capsys):
    with pytest.raises(SystemExit) as exc:
        _tool().main([])
    assert exc.value.code == 2 and "--doremi" in capsys.readouterr().err


def test_a_missing_input_is_one_line_naming_its_option_and_nothing_is_written(tmp_path, capsys):
    # A raw FileNotFoundError traceback before (a new-user review).
    (tmp_path / "sel").mkdir()
    _write_run(tmp_path / "sel", "partitionsel", [0.3, 0.2, 0.5])
    out = tmp_path / "cmp"
    for args, option in ((["--doremi", str(tmp_path / "nope.json")], "--doremi"),
                         (["--runs", str(tmp_path / "sel"), f"x={tmp_path / 'gone'}"], f"--runs x={tmp_path / 'gone'}")):
        assert _tool().main([*args, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"compare_mixtures.py: {option}: " in err and "Traceback" not in err, err
    assert not out.exists()


def _tool():
    spec = importlib.util.spec_from_file_location("compare_mixtures", REPO_ROOT / "tools" / "compare_mixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
