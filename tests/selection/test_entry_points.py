"""Third-party strategies through the `partitionsel.strategies` entry-point group (issue 11.4)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from composer_algos.selection import ENTRY_POINT_GROUP, get_strategy, strategy_names

PLUGIN = '''
"""A third-party strategy: the first kappa pool examples (or the last with reverse)."""
from dataclasses import dataclass

import torch

from composer_algos.selection import SelectionInputs, StrategySpec, finish_result, strategy


@dataclass(frozen=True, kw_only=True)
class FirstKOptions:
    reverse: bool = False


CALLS = []  # (pool size, examples selected) of every call


@strategy("first_k", options=FirstKOptions, needs_features=False, needs_validation=False)
def select_first_k(inputs: SelectionInputs, opts: FirstKOptions, *, num_domains, generator):
    CALLS.append((inputs.n, inputs.k))
    order = torch.arange(inputs.n, device=inputs.device)
    if opts.reverse:
        order = order.flip(0)
    return finish_result(order[: inputs.k], inputs.domain_ids, num_domains)


SPEC = StrategySpec(select_first_k, needs_features=False, needs_validation=False, uses_capacities=False)
NOT_A_SPEC = 3
'''


def install_plugin(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Install a tiny distribution (module + dist-info with entry points) under `root`, on sys.path."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "first_k_plugin.py").write_text(PLUGIN)
    info = root / "first_k_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: first-k-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent(
            f"""\
            [{ENTRY_POINT_GROUP}]
            first_k = first_k_plugin:SPEC
            broken = first_k_plugin:NOT_A_SPEC
            """
        )
    )
    monkeypatch.syspath_prepend(str(root))
    return root


@pytest.fixture
def plugin_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return install_plugin(tmp_path, monkeypatch)


def test_a_strategy_from_an_entry_point_is_found_and_runs(plugin_on_path):
    assert ENTRY_POINT_GROUP == "partitionsel.strategies"
    assert {"first_k", "partitionsel"} <= set(strategy_names())
    spec = get_strategy("first_k")
    dom = torch.tensor([0, 1, 0, 1, 1])
    kw = dict(
        features=None, val_feature=None, domain_ids=dom, num_domains=2, kappa=2, eta=0.1, generator=None
    )
    assert spec.fn(**kw).indices.tolist() == [0, 1]
    assert spec.fn(reverse=True, **kw).indices.tolist() == [3, 4]
    with pytest.raises(ValueError, match="reverze"):
        spec.fn(reverze=True, **kw)


def test_an_entry_point_that_is_not_a_strategy_spec_is_named(plugin_on_path):
    with pytest.raises(TypeError, match="broken.*first_k_plugin:NOT_A_SPEC.*StrategySpec"):
        get_strategy("broken")


def test_without_the_plugin_the_name_is_unknown():
    with pytest.raises(ValueError, match="unknown selection strategy 'first_k'"):
        get_strategy("first_k")


def test_the_config_accepts_the_plugin_and_checks_its_options(plugin_on_path):
    from composer_algos.registry import load_run_config
    from pipeline.config import ConfigError
    from tests.common.paths import REPO_ROOT

    tiny = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
    sel = "algorithms.data_selection"
    cfg = load_run_config(tiny, [f"{sel}.strategy=first_k", f"{sel}.strategy_options.first_k.reverse=true"])
    assert cfg.algorithms["data_selection"].strategy_options["first_k"].reverse is True
    with pytest.raises(ConfigError, match=f"{sel}.strategy_options.first_k.reverze"):
        load_run_config(tiny, [f"{sel}.strategy=first_k", f"{sel}.strategy_options.first_k.reverze=true"])
