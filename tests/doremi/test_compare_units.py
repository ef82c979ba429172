"""compare_mixtures sets the induced mixtures (example shares) against natural shares in the same units."""

from __future__ import annotations

import pytest

from composer_algos.doremi.compare import natural_sample_shares, to_token_shares
from composer_algos.mixture_io import write_mixture_json
from pipeline.manifest import DomainInfo, Manifest, SplitStats, write_manifest
from tests.doremi.test_compare import _tool

NAMES = ["code", "wiki"]


def _manifest(tmp_path):
    # code: 10 examples of 100 tokens; wiki: 30 examples of 10 tokens
    stats = {"code": (10, 1000), "wiki": (30, 300)}
    domains = [
        DomainInfo(
            name=n,
            dir=n,
            input_records=s + 1,
            rejected=0,
            truncated=0,
            splits={
                "train": SplitStats(records=s, samples=s, tokens=t),
                "val": SplitStats(records=1, samples=1, tokens=5),
            },
        )
        for n, (s, t) in stats.items()
    ]
    m = Manifest(
        format_version=1,
        mode="pretrain",
        tokenizer="tok",
        vocab_size=10,
        eos_token_id=0,
        pad_token_id=None,
        bos_token_id=None,
        max_seq_len=8,
        prompt_template=None,
        truncation=None,
        val_fraction=None,
        val_count=0,
        seed=0,
        domains=domains,
        inputs=[],
        command="test",
        created="2025-01-01T00:00:00",
    )
    (tmp_path / "shards").mkdir()
    write_manifest(m, tmp_path / "shards")
    return tmp_path / "shards"


def test_natural_sample_shares_and_token_conversion(tmp_path):
    shards = _manifest(tmp_path)
    assert natural_sample_shares(shards) == pytest.approx({"code": 0.25, "wiki": 0.75})
    # half the examples from each: code 0.5*100, wiki 0.5*10 tokens per example
    assert to_token_shares({"code": 0.5, "wiki": 0.5}, shards) == pytest.approx(
        {"code": 50 / 55, "wiki": 5 / 55}
    )


@pytest.mark.parametrize(
    ("units", "natural", "run"),
    [("examples", (0.25, 0.75), (0.5, 0.5)), ("tokens", (1000 / 1300, 300 / 1300), (50 / 55, 5 / 55))],
)
def test_tool_uses_one_unit(tmp_path, units, natural, run):
    shards = _manifest(tmp_path)
    (tmp_path / "run").mkdir()
    write_mixture_json(
        tmp_path / "run" / "mixture.json",
        method="partitionsel",
        domain_names=NAMES,
        weights=[0.5, 0.5],
        steps=2,
    )
    out = tmp_path / "out"
    args = ["--runs", f"ps={tmp_path / 'run'}", "--manifest", str(shards), "--out", str(out)]
    assert _tool().main([*args, "--units", units]) == 0
    md = (out / "comparison.md").read_text()
    assert f"| code | {natural[0]:.4f} | {run[0]:.4f} |" in md
    assert f"| wiki | {natural[1]:.4f} | {run[1]:.4f} |" in md
