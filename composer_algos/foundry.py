"""llm-foundry plugin: the selection algorithm, the mixture monitor and domain-shard loaders in `llmfoundry train`.

llm-foundry 0.22 builds every component of a training yaml from its catalogue registries, which
also read Python entry points (`llmfoundry/registry.py`: group `llmfoundry_<registry>`). This
package's `pyproject.toml` registers (installed with `pip install -e '.[foundry]'`):

- `llmfoundry_algorithms`: `data_selection` -> `composer_algos.data_selection.algorithm.DataSelection`;
- `llmfoundry_callbacks`: `mixture_monitor` -> `composer_algos.data_selection.mixture_monitor.MixtureMonitor`;
- `llmfoundry_dataloaders`: `domain_shards` -> `build_domain_shards` (training: the oversampled pool
  over the shards of `tools/shard.py`, one stream per domain, a domain id per sample; text
  pretraining and prompt/response fine-tuning shards alike, the manifest's mode picks the
  collator) and `domain_shards_eval` -> `build_domain_shards_eval` (evaluation on the held-out part
  of a split, `pipeline.holdout`);
- `llmfoundry_config_transforms`: `partitionsel` -> `complete_config`.

llm-foundry passes a component's yaml mapping straight to its constructor: nothing checks it before
the run is built, and nothing of the run (its seed, the domains, the pool) reaches it. llm-foundry
applies every registered config transform to a training config before it builds anything, so
`complete_config` does there what `train.py` does between `load_run_config` and `build_trainer`:
it types `algorithms.data_selection` and `callbacks.mixture_monitor` with this project's registry
(`composer_algos.registry.parse_component`: every problem with its yaml path, raised as one
`ConfigError`), checks the loaders' keys, rejects what cannot work under llm-foundry, fills the
run's context into the components (`registry.CONTEXT_KEYS`: seed, domain names, natural shares,
run directory) and sizes the training pool from the algorithm's one `oversampling` (the loader
delivers `oversampling x device_train_batch_size` rows per rank; the algorithm trains
`device_train_batch_size` of them). It leaves a config that names none of these components as it
is. Nothing here imports llmfoundry at module level: llm-foundry loads this module itself.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from composer.core import DataSpec

from pipeline.config import (
    ConfigError,
    DatasetConfig,
    EvalConfig,
    LoaderConfig,
    build_section,
    config_to_dict,
    guide_fraction_problems,
    pool_unit_problems,
)
from pipeline.holdout import DEFAULT_GUIDE_FRACTION

__all__ = [
    "EVAL_LOADER",
    "TRAIN_LOADER",
    "build_domain_shards",
    "build_domain_shards_eval",
    "complete_config",
]

TRAIN_LOADER = "domain_shards"
EVAL_LOADER = "domain_shards_eval"
DATA_SELECTION = "data_selection"
MIXTURE_MONITOR = "mixture_monitor"


@dataclass(frozen=True, kw_only=True)
class FoundryDatasetConfig(DatasetConfig):
    """`train_loader.dataset`: this project's dataset keys, plus the rows' length (llm-foundry's loaders' key)."""

    max_seq_len: int  # default: the run's `max_seq_len` (filled in by complete_config)


@dataclass(frozen=True, kw_only=True)
class FoundryTrainLoader(LoaderConfig):
    """`train_loader` with `name: domain_shards`: this project's loader keys (`pipeline.config.LoaderConfig`)."""

    dataset: FoundryDatasetConfig
    # Rows per rank per step = oversampling x device_train_batch_size; written by complete_config from
    # algorithms.data_selection.oversampling (1 without selection), never by the yaml.
    oversampling: float = 1.0


@dataclass(frozen=True, kw_only=True)
class FoundryEvalDataset:
    """`eval_loader.dataset` with `name: domain_shards_eval` (see `pipeline.loaders.build_heldout_dataloader`)."""

    shard_dir: str
    split: str = "val"
    domains: list[str] | None = None
    remote: str | None = None
    guide_fraction: float = DEFAULT_GUIDE_FRACTION
    max_seq_len: int  # default: the run's `max_seq_len` (filled in by complete_config)

    def validate(self, where: str) -> list[str]:
        if self.split not in ("train", "val"):
            return [f"{where}.dataset.split must be train or val, got {self.split!r}"]
        return []


@dataclass(frozen=True, kw_only=True)
class FoundryEvalLoader:
    dataset: FoundryEvalDataset
    label: str | None = None  # llm-foundry's, in a list of eval loaders

    def validate(self, where: str) -> list[str]:
        return self.dataset.validate(where)


# ---------------------------------------------------------------------------- the loaders
def build_domain_shards(*, tokenizer: Any, device_batch_size: int | float, **cfg: Any) -> DataSpec:
    """llm-foundry's `domain_shards` loader: `pipeline.loaders.build_train_dataloader` on a `train_loader` mapping.

    Args:
        tokenizer: the run's tokenizer (its pad id, else its EOS id, pads).
        device_batch_size: llm-foundry's `device_train_batch_size`, the rows a rank trains per step.
        **cfg: the `train_loader` mapping without its `name` (`FoundryTrainLoader`).

    Returns:
        A `DataSpec` whose batches hold `oversampling x device_batch_size` rows per rank with
        input_ids, attention_mask, labels, domain_id and sample_id.

    Raises:
        ConfigError: unknown, missing or invalid keys, each with its yaml path.
    """
    from composer_algos.mixture_io import stream_weights
    from pipeline.loaders import train_dataloader_from_config

    loader = _checked(FoundryTrainLoader, cfg, "train_loader")
    data = loader.dataset
    _check_tokenizer(data.shard_dir, tokenizer, "train_loader")
    pool = int(round(_rows(device_batch_size, "device_train_batch_size") * loader.oversampling))
    return train_dataloader_from_config(
        loader,
        device_batch_size=pool,
        pad_token_id=_pad_id(tokenizer),
        max_seq_len=data.max_seq_len,
        domain_weights=stream_weights(data.domain_weights, data.domain_weights_file, where="train_loader.dataset"),
    )


def build_domain_shards_eval(*, tokenizer: Any, device_batch_size: int | float, **cfg: Any) -> DataSpec:
    """llm-foundry's `domain_shards_eval` loader: the held-out part of a split's domains, in one loader.

    Evaluation reads only the part of each domain's split that guides no selection (`pipeline.holdout`,
    the same as `train.py`'s per-domain evaluators); a list of eval loaders, one per domain
    (`dataset.domains: [name]`, llm-foundry's `label`), gives per-domain curves.

    Raises:
        ConfigError: unknown, missing or invalid keys, each with its yaml path.
    """
    from pipeline.loaders import build_heldout_dataloader, eval_domains

    loader = _checked(FoundryEvalLoader, cfg, "eval_loader")
    data = loader.dataset
    _check_tokenizer(data.shard_dir, tokenizer, "eval_loader")
    return build_heldout_dataloader(
        shard_dir=data.shard_dir,
        domains=eval_domains(data.shard_dir, data.split, data.domains),
        device_batch_size=_rows(device_batch_size, "device_eval_batch_size"),
        pad_token_id=_pad_id(tokenizer),
        max_seq_len=data.max_seq_len,
        remote=data.remote,
        split=data.split,
        guide_fraction=data.guide_fraction,
        what="eval_loader",
    )


# ---------------------------------------------------------------------------- the config transform
def complete_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """llm-foundry's config transform: check and complete this project's components (see the module doc).

    Args:
        cfg: llm-foundry's training config, as plain containers (before its own dataclass).

    Returns:
        `cfg` itself when it names none of this project's components, else a completed copy.

    Raises:
        ConfigError: every problem found, one line each, naming its yaml path.
    """
    train = cfg.get("train_loader")
    ours_train = _named(train, TRAIN_LOADER)
    algorithms, callbacks = cfg.get("algorithms") or {}, cfg.get("callbacks") or {}
    if not (ours_train or _eval_loaders(cfg) or DATA_SELECTION in algorithms or MIXTURE_MONITOR in callbacks):
        return cfg
    from composer_algos.registry import parse_component

    cfg = copy.deepcopy(cfg)
    evals = _eval_loaders(cfg)
    problems: list[str] = []
    loader = None
    if ours_train:
        if "oversampling" in cfg["train_loader"]:
            problems.append(
                "train_loader.oversampling: unknown key; the pool is sized from "
                "algorithms.data_selection.oversampling (set it there)"
            )
        _default_seq_len(cfg["train_loader"], cfg)
        loader = _parse_loader(FoundryTrainLoader, cfg["train_loader"], "train_loader", problems)
    eval_sections = []
    for where, value in evals:
        _default_seq_len(value, cfg)
        eval_sections.append((where, _parse_loader(FoundryEvalLoader, value, where, problems)))
    context = _context(cfg, loader, problems)

    if DATA_SELECTION in algorithms:
        where = f"algorithms.{DATA_SELECTION}"
        section = parse_component("algorithm", DATA_SELECTION, algorithms[DATA_SELECTION], where, problems)
        if not ours_train:
            name = train.get("name") if isinstance(train, Mapping) else None
            problems.append(
                f"{where} needs train_loader.name: {TRAIN_LOADER} (a domain id per sample and a pool of "
                f"oversampling x device_train_batch_size rows), got train_loader.name {name!r}"
            )
        if section is not None:
            if section.weighted_loss:
                problems.append(
                    f"{where}.weighted_loss: llm-foundry's models compute their loss inside the model's forward "
                    "and never read the batch's loss_weight, so the refit weights would be dropped silently; "
                    "remove it (or train with train.py, whose DomainCausalLM reads them)"
                )
            options = _with_context(config_to_dict(section), section, context)
            cfg["algorithms"][DATA_SELECTION] = options
            if ours_train:
                cfg["train_loader"]["oversampling"] = float(section.oversampling)
            for eval_where, ev in eval_sections:
                if loader is not None and ev is not None:
                    data = ev.dataset
                    problems += guide_fraction_problems(
                        options,
                        EvalConfig(shard_dir=data.shard_dir, split=data.split, guide_fraction=data.guide_fraction),
                        loader.dataset.shard_dir,
                        eval_key=f"{eval_where}.dataset",
                    )
        problems += pool_unit_problems("max_duration", cfg.get("max_duration"))

    if MIXTURE_MONITOR in callbacks:
        where = f"callbacks.{MIXTURE_MONITOR}"
        section = parse_component("callback", MIXTURE_MONITOR, callbacks[MIXTURE_MONITOR], where, problems)
        if section is not None:
            cfg["callbacks"][MIXTURE_MONITOR] = _with_context(config_to_dict(section), section, context)

    if problems:
        raise ConfigError("llm-foundry training config: invalid configuration:\n  - " + "\n  - ".join(problems))
    return cfg


def _context(cfg: Mapping[str, Any], loader: FoundryTrainLoader | None, problems: list[str]) -> dict[str, Any]:
    """What train.py fills into the components (`registry.CONTEXT_KEYS`), from llm-foundry's config."""
    from llmfoundry.utils.config_utils import TrainConfig

    save_folder = cfg.get("save_folder")
    local = isinstance(save_folder, str) and "://" not in save_folder
    run_dir = save_folder if local else os.path.join("runs", cfg.get("run_name") or "run")
    context: dict[str, Any] = {
        "seed": cfg.get("seed", TrainConfig.seed),  # llm-foundry's own default seed when the yaml has none
        "run_dir": run_dir,
        "output_dir": run_dir,
    }
    if loader is not None:
        from pipeline.dataset import split_samples
        from pipeline.manifest import load_manifest

        try:
            manifest = load_manifest(loader.dataset.shard_dir)
        except ValueError as e:
            problems.append(f"train_loader.dataset.shard_dir: {e}")
            return context
        context["domain_names"] = [d.name for d in manifest.domains]
        context["natural_weights"] = [split_samples(d, "train") for d in manifest.domains]
    return context


def _with_context(options: dict[str, Any], section: Any, context: Mapping[str, Any]) -> dict[str, Any]:
    """`options` plus each context value whose key the component takes and the yaml left out."""
    import dataclasses

    takes = {f.name for f in dataclasses.fields(section)}
    return {**{k: v for k, v in context.items() if k in takes and k not in options}, **options}


def _parse_loader(cls: type, value: Any, where: str, problems: list[str]) -> Any:
    if not isinstance(value, Mapping):
        problems.append(f"{where} must be a mapping, got {value!r}")
        return None
    data = {k: v for k, v in value.items() if k != "name"}
    before = len(problems)
    section = build_section(cls, data, f"{where}.", problems)
    if section is not None and len(problems) == before:
        problems += section.validate(where)
    return section if len(problems) == before else None


def _checked(cls: type, cfg: Mapping[str, Any], where: str) -> Any:
    problems: list[str] = []
    section = _parse_loader(cls, cfg, where, problems)
    if problems:
        raise ConfigError(f"{where}: invalid configuration:\n  - " + "\n  - ".join(problems))
    return section


def _named(loader: Any, name: str) -> bool:
    return isinstance(loader, Mapping) and loader.get("name") == name


def _eval_loaders(cfg: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(yaml path, mapping) of each `eval_loader` that is `domain_shards_eval`.

    A yaml's list of eval loaders reaches the transform as `eval_loaders` (llm-foundry moves it there).
    """
    value = cfg.get("eval_loaders", cfg.get("eval_loader"))
    if isinstance(value, list):
        return [(f"eval_loader[{i}]", v) for i, v in enumerate(value) if _named(v, EVAL_LOADER)]
    return [("eval_loader", value)] if _named(value, EVAL_LOADER) else []


def _default_seq_len(loader: Mapping[str, Any], cfg: Mapping[str, Any]) -> None:
    dataset = loader.get("dataset")
    if isinstance(dataset, dict) and "max_seq_len" in cfg:
        dataset.setdefault("max_seq_len", cfg["max_seq_len"])


def _rows(device_batch_size: int | float, key: str) -> int:
    if float(device_batch_size) != int(device_batch_size) or device_batch_size < 1:
        raise ValueError(f"{key} must be a whole number of rows >= 1 for the domain-shard loaders, got {device_batch_size}")
    return int(device_batch_size)


def _check_tokenizer(shard_dir: str, tokenizer: Any, where: str) -> None:
    """The shards hold the ids of the run's tokenizer (`pipeline.manifest.tokenizer_mismatch`), checked where the
    manifest is on local disk (else the loader reports the shards)."""
    from pipeline.manifest import load_manifest, tokenizer_mismatch

    if tokenizer is None or not os.path.isfile(os.path.join(shard_dir, "manifest.json")):
        return
    name = str(getattr(tokenizer, "name_or_path", "") or "?")
    if problem := tokenizer_mismatch(load_manifest(shard_dir), tokenizer, name, field="tokenizer.name"):
        raise ConfigError(f"{where}.dataset.shard_dir: {problem}")


def _pad_id(tokenizer: Any) -> int:
    if tokenizer is None:
        raise ValueError("the domain-shard loaders need the run's tokenizer (llm-foundry's `tokenizer` key)")
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
