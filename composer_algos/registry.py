"""Every Composer algorithm, callback and logger by its registry name, and the typed yaml section of each.

Names are Composer's own: an algorithm is named after its package (`composer.algorithms.gradient_clipping`
-> `gradient_clipping`), a callback after its module (`composer.callbacks.speed_monitor` ->
`speed_monitor`), a logger after its module without `_logger` (`composer.loggers.wandb_logger` ->
`wandb`). This project's components sit beside them under their own names (`data_selection`,
`doremi`, `mixture_monitor`, `eval_history`, `train_budget`) and win a clash (`file` is
`AppendFileLogger`, which keeps the log across autoresume).

A yaml entry `algorithms.<name>: {key: value}` is parsed into a frozen dataclass derived from the
class's constructor (`component_section`): an unknown key, a wrong type or a missing required
argument is reported with its yaml path when the config is loaded, before anything is built.
`algorithms.data_selection` is checked in depth: its `features` against `GradFeatureExtractor`,
`validation` against the algorithm's validation keys, `strategy_options.<strategy>` against that
strategy's option dataclass (`StrategySpec.options`, whose rules check the values), the strategy
name against the open strategy registry, and the remaining values against `DataSelection`'s own
rules. Selection strategies from other packages come through the `partitionsel.strategies`
entry-point group (`composer_algos.selection.get_strategy`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import inspect
import logging
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.config import (
    ConfigError,
    ConfigSection,
    TrainConfig,
    build_section,
    load_config,
    parse_components,
)

log = logging.getLogger(__name__)

__all__ = [
    "CONTEXT_KEYS",
    "KINDS",
    "component_class",
    "component_names",
    "component_section",
    "load_run_config",
    "parse_component",
    "shard_problems",
    "type_components",
]

KINDS = ("algorithm", "callback", "logger")

# Constructor arguments train.py fills in from the run when the yaml leaves them out
# (`composer_algos.builders.build_component`); they are never reported missing.
CONTEXT_KEYS = frozenset({"domain_names", "natural_weights", "run_dir", "output_dir", "seed"})


def load_run_config(yaml_path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """`pipeline.config.load_config` with every algorithm, callback and logger typed by this registry.

    Raises:
        FileNotFoundError: `yaml_path` does not exist.
        ConfigError: every unknown, missing or invalid key (components included), with its yaml path.
    """
    cfg = load_config(yaml_path, overrides, parse_component=parse_component)
    problems = shard_problems(cfg)
    if problems:
        raise ConfigError("invalid configuration for the shards' domains:\n  - " + "\n  - ".join(problems))
    return cfg


def shard_problems(cfg: TrainConfig) -> list[str]:
    """Settings that name the run's domains, checked against the training shards' manifest.

    Only the manifest (and a stream weights file) is read: nothing is built, so a capacity policy
    that names a domain the shards lack, or a weights file that misses a domain the run trains,
    is reported with the other configuration errors instead of after the datasets are built.
    Shards that are not on local disk yet (a remote not downloaded) are checked when the run
    builds its dataset instead (`DataSelection` binds the policy at the first batch).

    Returns:
        One message per problem, each naming its yaml path (empty when all is well).
    """
    from pipeline.dataset import streamed_domains
    from pipeline.manifest import load_manifest

    data = cfg.train_loader.dataset
    problems = _answer_accuracy_problems(cfg)
    selection = cfg.algorithms.get("data_selection")
    capacities = getattr(selection, "capacities", None) if selection is not None else None
    if capacities is None or not (Path(data.shard_dir) / "manifest.json").is_file():
        return problems
    where = "algorithms.data_selection.capacities"
    try:
        from composer_algos.data_selection.capacity_policy import parse_capacity_policy
        from composer_algos.mixture_io import read_mixture_json

        manifest = load_manifest(data.shard_dir)
        names = [d.name for d in manifest.domains]
        weights = data.domain_weights
        if data.domain_weights_file is not None and Path(data.domain_weights_file).is_file():
            weights = dict(read_mixture_json(data.domain_weights_file).weights)
        streamed = streamed_domains(
            manifest, shard_dir=data.shard_dir, split=data.split, domains=data.domains, domain_weights=weights
        )
        policy = parse_capacity_policy(capacities, where=where)
    except (ValueError, FileNotFoundError):
        return problems  # reported where it is the subject (the loader, the algorithm's own option check)
    try:
        policy.bind(names, [names[i] for i, _ in streamed])
    except ValueError as e:
        problems.append(str(e))
    return problems


def _answer_accuracy_problems(cfg: TrainConfig) -> list[str]:
    """`callbacks.answer_accuracy` reads the per-domain evaluators' held-out questions of fine-tuning shards."""
    if "answer_accuracy" not in cfg.callbacks:
        return []
    from composer_algos.callbacks.answer_accuracy import AnswerAccuracy

    try:  # its own value checks (cheap: it builds nothing)
        AnswerAccuracy(**dict(cfg.callbacks["answer_accuracy"] or {}))
    except ValueError as e:
        return [str(e)]
    ev = cfg.eval_loader
    if ev is None or not ev.per_domain:
        return ["callbacks.answer_accuracy asks the per-domain evaluators' held-out questions: give an eval_loader with "
                "per_domain: true (or drop the callback)"]
    shards = Path(ev.shard_dir or cfg.train_loader.dataset.shard_dir)
    if (shards / "manifest.json").is_file():
        from pipeline.manifest import load_manifest

        mode = load_manifest(shards).mode
        if mode != "finetune":
            return [f"callbacks.answer_accuracy needs fine-tuning shards (questions and answers); {shards} holds {mode} shards"]
    return []


def type_components(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with untyped component mappings (from `load_config` without the hook) parsed; else `cfg`.

    Raises:
        ConfigError: every problem of the components, with its yaml path.
    """
    sections = {"algorithms": "algorithm", "callbacks": "callback", "loggers": "logger"}
    if all(isinstance(v, ConfigSection) for name in sections for v in getattr(cfg, name).values()):
        return cfg
    problems: list[str] = []
    typed = {
        name: parse_components(parse_component, kind, getattr(cfg, name), name, problems)
        for name, kind in sections.items()
    }
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    return dataclasses.replace(cfg, **typed)


def component_names(kind: str) -> list[str]:
    """Every registered name of `kind` (`algorithm`, `callback` or `logger`), sorted."""
    return sorted({**_composer(kind), **_project(kind)})


def component_class(kind: str, name: str) -> type:
    """The class registered as `name` (this project's first, then Composer's).

    Raises:
        ValueError: an unknown kind or name, with the closest registered names.
    """
    project = _project(kind)
    if name in project:
        return project[name]
    composer = _composer(kind)
    if name in composer:
        return composer[name]
    raise ValueError(f"unknown {kind} {name!r}; {_suggest(name, component_names(kind))}")


def component_section(kind: str, name: str) -> type[ConfigSection]:
    """The frozen dataclass of `name`'s yaml options, derived from its constructor's keyword arguments.

    Defaults are the constructor's; arguments in `CONTEXT_KEYS` default to None (the run fills them).
    Annotations of this project's classes are checked; Composer's are left to its constructors.
    """
    cls = component_class(kind, name)
    if cls.__module__.startswith("composer_algos.data_selection.algorithm"):
        return _data_selection_section()
    return _section_from_signature(f"{cls.__name__}Options", _parameters(cls))


def parse_component(
    kind: str, name: str, value: Any, where: str, problems: list[str]
) -> ConfigSection | None:
    """Parse the yaml entry `where` (e.g. `algorithms.data_selection`) of component `name`.

    Args:
        kind: `algorithm`, `callback` or `logger`.
        name: the registry name (the yaml key).
        value: the yaml mapping of constructor arguments (None: no arguments).
        where: the yaml path, used in messages.
        problems: every problem found is appended here, one line each, naming the yaml path.

    Returns:
        The typed section, or None when `name` is unknown or `value` is not a mapping.
    """
    try:
        component_class(kind, name)
    except ValueError as e:
        problems.append(f"{where}: {e}")
        return None
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        problems.append(f"{where} must be a mapping of constructor arguments, got {value!r}")
        return None
    data = dict(value)
    if kind == "algorithm" and component_section(kind, name) is _data_selection_section():
        return _parse_data_selection(data, where, problems)
    before = len(problems)
    section = build_section(component_section(kind, name), data, f"{where}.", problems)
    return section if len(problems) == before else None


# ---------------------------------------------------------------------------- registries
@functools.cache
def _project(kind: str) -> dict[str, type]:
    if kind == "algorithm":
        from composer_algos.data_selection.algorithm import DataSelection
        from composer_algos.doremi import DoReMi

        return {"data_selection": DataSelection, "doremi": DoReMi}
    if kind == "callback":
        from composer_algos.callbacks.answer_accuracy import AnswerAccuracy
        from composer_algos.callbacks.eval_history import EvalHistory
        from composer_algos.callbacks.train_budget import TrainTimeBudget
        from composer_algos.data_selection.mixture_monitor import MixtureMonitor

        return {
            "mixture_monitor": MixtureMonitor,
            "answer_accuracy": AnswerAccuracy,
            "eval_history": EvalHistory,
            "train_budget": TrainTimeBudget,
        }
    if kind == "logger":
        from composer_algos.callbacks.file_logger import AppendFileLogger

        return {"file": AppendFileLogger}
    raise ValueError(f"component kind must be one of {KINDS}, got {kind!r}")


@functools.cache
def _composer(kind: str) -> dict[str, type]:
    """Composer's exported classes of `kind`, by the name of the package or module defining each."""
    if kind == "algorithm":
        import composer.algorithms as package
        from composer.core import Algorithm as base

        def name_of(cls: type) -> str:
            return cls.__module__.split(".")[2]  # composer.algorithms.<name>.<module>
    elif kind == "callback":
        import composer.callbacks as package
        from composer.core import Callback as base

        def name_of(cls: type) -> str:
            return cls.__module__.rsplit(".", 1)[-1]  # composer.callbacks.<name>
    elif kind == "logger":
        import composer.loggers as package
        from composer.loggers import LoggerDestination as base

        def name_of(cls: type) -> str:
            return cls.__module__.rsplit(".", 1)[-1].removesuffix("_logger")  # composer.loggers.<name>_logger
    else:
        raise ValueError(f"component kind must be one of {KINDS}, got {kind!r}")
    out: dict[str, type] = {}
    for attr in package.__all__:
        cls = getattr(package, attr)
        if (
            isinstance(cls, type)
            and issubclass(cls, base)
            and cls is not base
            and not inspect.isabstract(cls)
        ):
            out[name_of(cls)] = cls
    return out


# ---------------------------------------------------------------------------- sections
def _parameters(cls: type) -> list[tuple[str, Any, Any]]:
    """(name, type, default) of the keyword arguments `cls(...)` takes, following `**kwargs` to the bases."""
    out: dict[str, tuple[str, Any, Any]] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is object:
            break
        typed = klass.__module__.startswith("composer_algos")
        try:
            hints = typing.get_type_hints(init) if typed else {}
        except Exception:  # an annotation that only resolves under TYPE_CHECKING: leave it unchecked
            hints = {}
        forwards = False
        for p in list(inspect.signature(init).parameters.values())[1:]:
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                forwards = True
            elif p.name not in out:
                out[p.name] = (p.name, hints.get(p.name, Any), p.default)
        if not forwards:
            break
    return list(out.values())


def _section_from_signature(
    cls_name: str, params: list[tuple[str, Any, Any]], *, all_optional: bool = False
) -> type[ConfigSection]:
    fields = []
    for name, tp, default in params:
        if name in CONTEXT_KEYS or (all_optional and default is inspect.Parameter.empty):
            default = None
            tp = tp | None if tp is not Any else Any
        if default is inspect.Parameter.empty:
            fields.append((name, tp))
        elif isinstance(default, (list, dict, set)):
            fields.append(
                (name, tp, dataclasses.field(default_factory=functools.partial(copy.deepcopy, default)))
            )
        else:
            fields.append((name, tp, dataclasses.field(default=default)))
    return dataclasses.make_dataclass(cls_name, fields, bases=(ConfigSection,), frozen=True, kw_only=True)


@functools.cache
def _features_section() -> type[ConfigSection]:
    from composer_algos.features import GradFeatureExtractor

    # The model is the run's and the seed is the algorithm's: neither is a feature option.
    params = [p for p in _parameters(GradFeatureExtractor) if p[0] not in ("model", "seed")]
    return _section_from_signature("FeaturesOptions", params)


@functools.cache
def _validation_section() -> type[ConfigSection]:
    from composer_algos.data_selection.options import VALIDATION_KEYS
    from composer_algos.data_selection.validation_source import ValidationSource

    # The keys are the algorithm's; types and defaults come from ValidationSource where it takes the key.
    source = {name: (name, tp, default) for name, tp, default in _parameters(ValidationSource)}
    params = [source.get(key, (key, Any, None)) for key in VALIDATION_KEYS]
    return _section_from_signature("ValidationOptions", params, all_optional=True)


@functools.cache
def _options_section(options_cls: type) -> type[ConfigSection]:
    hints = typing.get_type_hints(options_cls)
    params = [
        (
            f.name,
            hints.get(f.name, Any),
            f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty,
        )
        for f in dataclasses.fields(options_cls)
    ]
    return _section_from_signature(f"{options_cls.__name__}Section", params)


@functools.cache
def _data_selection_section() -> type[ConfigSection]:
    from composer_algos.data_selection.algorithm import DataSelection

    params = []
    for name, tp, default in _parameters(DataSelection):
        if name == "features":
            tp = _features_section() | None
        elif name == "validation":
            tp = _validation_section() | str | None  # a mapping of options, or a shard directory
        elif name == "strategy_options":
            tp = dict[str, Any] | None  # strategy name -> that strategy's options section
        params.append((name, tp, default))
    return _section_from_signature("DataSelectionOptions", params)


def _parse_data_selection(data: dict[str, Any], where: str, problems: list[str]) -> ConfigSection | None:
    from composer_algos.data_selection.algorithm import SELECTION_STRATEGIES, DataSelection
    from composer_algos.selection import get_strategy, strategy_names

    before = len(problems)
    known = [*dict.fromkeys([*SELECTION_STRATEGIES, *strategy_names()])]
    strategy = data.get("strategy", inspect.signature(DataSelection).parameters["strategy"].default)
    strategy_ok = isinstance(strategy, str) and strategy in known
    if not strategy_ok:
        problems.append(f"{where}.strategy: unknown strategy {strategy!r}; {_suggest(str(strategy), known)}")

    if isinstance(data.get("features"), Mapping):
        data["features"] = _parse_features(data["features"], f"{where}.features", problems)
    raw_options = data.get("strategy_options")
    if isinstance(raw_options, Mapping):
        typed: dict[str, Any] = {}
        for name, opts in raw_options.items():
            key = f"{where}.strategy_options.{name}"
            if name not in strategy_names():
                problems.append(
                    f"{key}: strategy_options is keyed by strategy name and {name!r} is not one; "
                    f"{_suggest(str(name), strategy_names())}"
                )
                continue
            typed[name] = _parse_strategy_options(get_strategy(name).options, opts, key, problems)
        data["strategy_options"] = typed

    section = build_section(_data_selection_section(), data, f"{where}.", problems)
    if section is None:
        return None
    # DataSelection's own rules on the values that parsed (the strategy and options are checked above).
    probe = _well_typed(section, where, problems[before:])
    probe = {k: v for k, v in probe.items() if k not in ("features", "strategy_options")}
    if isinstance(section.features, ConfigSection):
        # Only the feature values that parsed: the algorithm checks them against the validation settings.
        probe["features"] = _well_typed(section.features, f"{where}.features", problems[before:])
    if not strategy_ok:
        probe.pop("strategy", None)
    try:
        DataSelection(**probe)
    except (ValueError, TypeError) as e:
        problems += _with_paths(where, str(e).removeprefix("algorithms.data_selection: "), section)
    return section if len(problems) == before else None


def _parse_features(value: Mapping[str, Any], key: str, problems: list[str]) -> ConfigSection | None:
    from composer_algos.features.extractor import feature_option_problems

    before = len(problems)
    section = build_section(_features_section(), dict(value), f"{key}.", problems)
    if section is None:
        return None
    # The extractor's own value rules, on the given values of the right type (defaults for the others).
    good = _well_typed(section, key, problems[before:])
    values = {f.name: good.get(f.name, f.default) for f in dataclasses.fields(section)}
    args = inspect.signature(feature_option_problems).parameters
    for msg in feature_option_problems(**{k: v for k, v in values.items() if k in args}):
        problems += _with_paths(key, msg, section)
    return section


def _parse_strategy_options(
    options_cls: type, value: Any, key: str, problems: list[str]
) -> ConfigSection | None:
    if value is None:
        value = {}
    before = len(problems)
    section = build_section(_options_section(options_cls), value, f"{key}.", problems)
    if section is None:
        return None
    try:
        options_cls(**_well_typed(section, key, problems[before:]))  # the option dataclass's own value rules
    except (ValueError, TypeError) as e:
        problems += _with_paths(key, str(e).removeprefix("invalid selection options: "), section)
    return section


def _well_typed(section: ConfigSection, where: str, new_problems: list[str]) -> dict[str, Any]:
    """The given keys of `section` that no problem names (a constructor probe must not trip on a bad type)."""
    return {
        k: v
        for k, v in section.items()
        if not any(p.startswith((f"{where}.{k} ", f"{where}.{k}:", f"{where}.{k}.")) for p in new_problems)
    }


def _with_paths(where: str, message: str, section: ConfigSection) -> list[str]:
    """Split a constructor's `a; b` message into one line per problem, each under its key's yaml path.

    A problem that opens with a field name (`name` or name) goes under `where.name`, others under `where`.
    """
    names = {f.name for f in dataclasses.fields(section)}
    out = []
    for part in message.split("; "):
        first = part.split(" ", 1)[0].strip("`")
        out.append(f"{where}.{first}: {part}" if first in names else f"{where}: {part}")
    return out


def _suggest(name: str, choices: list[str]) -> str:
    near = difflib.get_close_matches(name, choices, n=3)
    hint = f"did you mean {' or '.join(repr(n) for n in near)}? " if near else ""
    return f"{hint}choose one of {sorted(choices)}"
