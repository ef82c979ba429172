"""Open component registries (issue 11.4): every Composer algorithm, callback and logger by its own
registry name, this project's beside them, all checked when the yaml is loaded."""

from __future__ import annotations

import inspect
import sys

import pytest

from composer_algos.registry import load_run_config
from pipeline.config import ConfigError
from tests.common.paths import REPO_ROOT

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"


def test_composer_gradient_clipping_and_speed_monitor_are_accepted_and_built():
    from composer.algorithms import GradientClipping
    from composer.callbacks import SpeedMonitor

    from composer_algos.builders import build_component

    cfg = load_run_config(
        TINY,
        [
            "algorithms.gradient_clipping.clipping_type=norm",
            "algorithms.gradient_clipping.clipping_threshold=1.0",
            "callbacks.speed_monitor.window_size=10",
        ],
    )
    clip = build_component("algorithm", "gradient_clipping", cfg.algorithms["gradient_clipping"], {})
    assert isinstance(clip, GradientClipping)
    assert (clip.clipping_type, clip.clipping_threshold) == ("norm", 1.0)
    speed = build_component("callback", "speed_monitor", cfg.callbacks["speed_monitor"], {})
    assert (
        isinstance(speed, SpeedMonitor) and speed.history_samples.maxlen == 10 + 1
    )  # window + 1 in Composer


def test_every_composer_algorithm_and_callback_is_registered_under_its_package_name():
    import composer.algorithms
    import composer.callbacks
    from composer.core import Algorithm, Callback

    from composer_algos.registry import component_class, component_names

    algos = [getattr(composer.algorithms, n) for n in composer.algorithms.__all__]
    algos = [c for c in algos if isinstance(c, type) and issubclass(c, Algorithm)]
    assert len(algos) > 20
    for cls in algos:
        # composer.algorithms.<name>.<module>.Class: the package is the name Composer's docs use.
        name = cls.__module__.split(".")[2]
        assert component_class("algorithm", name) is cls
    callbacks = [getattr(composer.callbacks, n) for n in composer.callbacks.__all__]
    callbacks = [c for c in callbacks if isinstance(c, type) and issubclass(c, Callback)]
    for cls in callbacks:
        assert component_class("callback", cls.__module__.rsplit(".", 1)[-1]) is cls
    spelled = {"gradient_clipping", "low_precision_layernorm", "selective_backprop", "ema", "sam"}
    assert spelled <= set(component_names("algorithm"))
    assert {"speed_monitor", "lr_monitor", "checkpoint_saver", "memory_monitor"} <= set(
        component_names("callback")
    )


def test_this_projects_components_are_registered_the_same_way():
    from composer_algos.callbacks.eval_history import EvalHistory
    from composer_algos.callbacks.file_logger import AppendFileLogger
    from composer_algos.data_selection.algorithm import DataSelection
    from composer_algos.data_selection.mixture_monitor import MixtureMonitor
    from composer_algos.doremi import DoReMi
    from composer_algos.registry import component_class

    assert component_class("algorithm", "data_selection") is DataSelection
    assert component_class("algorithm", "doremi") is DoReMi
    assert component_class("callback", "mixture_monitor") is MixtureMonitor
    assert component_class("callback", "eval_history") is EvalHistory
    assert component_class("logger", "file") is AppendFileLogger  # ours replaces Composer's FileLogger


def test_composer_component_keys_and_names_are_checked_at_load_time():
    with pytest.raises(ConfigError) as info:
        load_run_config(
            TINY,
            [
                "algorithms.gradient_clipping.clipping_treshold=1.0",  # typo; clipping_type is required
                "callbacks.speed_monitr.window_size=10",  # unknown callback
                "loggers.in_memory.bogus=1",
            ],
        )
    msg = str(info.value)
    assert "algorithms.gradient_clipping.clipping_treshold" in msg and "clipping_threshold" in msg
    assert "algorithms.gradient_clipping.clipping_type" in msg  # missing required key
    assert "callbacks.speed_monitr" in msg and "speed_monitor" in msg  # suggests the near name
    assert "loggers.in_memory.bogus" in msg


def test_a_component_built_from_the_config_gets_the_runs_context_only_where_the_yaml_is_silent():
    from composer_algos.builders import build_component

    cfg = load_run_config(TINY, ["callbacks.mixture_monitor.method=custom"])
    mon = build_component(
        "callback",
        "mixture_monitor",
        cfg.callbacks["mixture_monitor"],
        {"domain_names": ["a", "b"], "run_dir": "/tmp/x", "unused_by_it": 1},
    )
    assert mon.domain_names == ["a", "b"] and str(mon.run_dir) == "/tmp/x" and mon.method == "custom"
    assert "run_dir" in inspect.signature(type(mon)).parameters


def test_train_builds_composer_components_and_a_plugin_strategy_selects(dolma_shards, tmp_path, monkeypatch):
    """Through train.py: gradient_clipping, speed_monitor and an entry-point strategy in one short run."""
    from composer.algorithms import GradientClipping
    from composer.callbacks import SpeedMonitor

    import train
    from composer_algos.data_selection.algorithm import DataSelection
    from composer_algos.selection import get_strategy
    from tests.selection.test_entry_points import install_plugin
    from tests.training.conftest import tiny_overrides

    install_plugin(tmp_path / "plugin", monkeypatch)
    extra = [
        "algorithms.data_selection.strategy=first_k",
        "algorithms.data_selection.strategy_options.first_k.reverse=true",
        "algorithms.gradient_clipping.clipping_type=norm",
        "algorithms.gradient_clipping.clipping_threshold=1.0",
        "callbacks.speed_monitor.window_size=10",
        "max_duration=2ba",
        "eval_interval=2ba",
    ]
    cfg = load_run_config(TINY, tiny_overrides(dolma_shards, tmp_path / "run", *extra))
    trainer = train.build_trainer(cfg)
    trainer.fit()
    algos = {type(a): a for a in trainer.state.algorithms}
    assert algos[GradientClipping].clipping_threshold == 1.0
    assert any(isinstance(c, SpeedMonitor) for c in trainer.state.callbacks)
    selection = algos[DataSelection]
    assert selection.spec is get_strategy("first_k") and int(trainer.state.timestamp.batch) == 2
    # The plugin chose every step's subset: a pool of 4 x 3 (oversampling 3), 4 trained.
    assert sys.modules["first_k_plugin"].CALLS[-2:] == [(12, 4), (12, 4)]
