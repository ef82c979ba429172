"""Train a causal LM on domain-partitioned Streaming shards, optionally selecting data each step.

Usage:
    composer train.py yamls/testing/tiny_dolma.yaml [key=value ...]      # any number of ranks
    python train.py yamls/testing/tiny_dolma.yaml max_duration=20ba       # one process

Keys are dotted paths into the yaml (e.g. `optimizer.lr=1e-4`,
`algorithms.data_selection.strategy=random`); unknown or missing keys are reported before
anything is built.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from typing import TYPE_CHECKING, Any

from pipeline.config import ConfigError, TrainConfig, config_to_dict

if TYPE_CHECKING:
    from composer import Trainer

# torch, composer, transformers and streaming take ~10 s to import: they are imported inside the
# functions below, after the arguments are parsed, so `train.py --help` is instant. A config error comes
# after Composer's import (the registry checks the components' arguments against their signatures, some
# 5 s on a 2-core machine) and before the tokenizer, the data or the model is read.

log = logging.getLogger("train")


def build_trainer(cfg: TrainConfig) -> Trainer:
    """Build every object of the run described by `cfg` and return the (unfitted) Trainer."""
    import torch
    from composer import Trainer
    from composer.utils import dist, reproducibility

    from composer_algos.builders import build_component, build_optimizer, build_scheduler
    from composer_algos.data_selection.algorithm import find_data_selection_in
    from composer_algos.mixture_io import stream_weights
    from composer_algos.models.causal_lm import build_causal_lm
    from composer_algos.registry import type_components
    from pipeline.dataset import split_samples
    from pipeline.loaders import train_dataloader_from_config

    cfg = type_components(cfg)  # a config from pipeline.config.load_config: its components checked first
    world = dist.get_world_size()
    _check_microbatching(cfg, world, cuda=torch.cuda.is_available())
    reproducibility.seed_all(cfg.seed)
    if cfg.global_train_batch_size % world:
        raise ValueError(
            f"global_train_batch_size {cfg.global_train_batch_size} must be divisible by the world size {world}"
        )
    device_batch = cfg.global_train_batch_size // world

    data = cfg.train_loader.dataset
    tokenizer, manifest = _tokenizer_and_shards(cfg)
    domain_names = [d.name for d in manifest.domains]
    if "doremi" in cfg.algorithms and data.domains is not None and set(data.domains) != set(domain_names):
        raise ConfigError(
            f"algorithms.doremi learns a weight for every domain of the shards ({', '.join(domain_names)}), and "
            f"train_loader.dataset.domains streams only {list(data.domains)}: the others would get weights from no "
            "data. Shard only the domains to weigh, or stream them all"
        )
    weights = stream_weights(data.domain_weights, data.domain_weights_file, where="train_loader.dataset")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    run_dir = cfg.run_dir
    if cfg.save_folder and "://" in cfg.save_folder:
        log.warning("save_folder %s is remote: Composer uploads the checkpoints there; the run's own files (the mixture, "
                    "the selection log, config.yaml, the log) go to %s on this machine", cfg.save_folder, run_dir)
    context = {
        "domain_names": domain_names,
        "natural_weights": [split_samples(d, "train") for d in manifest.domains],
        "run_dir": run_dir,
        "output_dir": run_dir,
        "seed": cfg.seed,
    }
    algorithms = [build_component("algorithm", n, kw, context) for n, kw in cfg.algorithms.items()]
    # The pool is sized from the algorithm's own oversampling (its default included): one owner.
    selection = find_data_selection_in(algorithms)
    device_pool = int(round(device_batch * selection.oversampling)) if selection is not None else device_batch
    train_loader = train_dataloader_from_config(
        cfg.train_loader, domain_weights=weights, device_batch_size=device_pool, pad_token_id=pad_id,
        max_seq_len=cfg.max_seq_len,
    )
    evaluators = _evaluators(cfg, pad_id)

    model_kwargs: dict[str, Any] = dataclasses.asdict(cfg.model)
    model = build_causal_lm(tokenizer=tokenizer, **model_kwargs)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(trainable, **dataclasses.asdict(cfg.optimizer))
    scheduler = build_scheduler(**dataclasses.asdict(cfg.scheduler))

    callbacks, loggers = _callbacks_and_loggers(cfg, context)

    return Trainer(
        model=model,
        train_dataloader=train_loader,
        eval_dataloader=evaluators or None,
        eval_interval=cfg.eval_interval if evaluators else 1,
        eval_subset_num_batches=-1,
        optimizers=optimizer,
        schedulers=scheduler,
        device_train_microbatch_size=cfg.device_train_microbatch_size or device_batch,
        algorithms=algorithms,
        callbacks=callbacks,
        loggers=loggers,
        **_run_settings(cfg),
    )


def _check_microbatching(cfg: TrainConfig, world: int, *, cuda: bool) -> None:
    """`device_train_microbatch_size: auto` where it cannot run, before anything is built."""
    if cfg.device_train_microbatch_size != "auto":
        return
    if not cuda:
        raise ConfigError("device_train_microbatch_size: auto needs a GPU (Composer's search runs on CUDA only); "
                          "give an integer on the CPU")
    if world > 1 and getattr(cfg.algorithms.get("data_selection"), "select_ahead", False):
        # DataSelection refuses it too, but only when the Trainer starts, after the loaders and the model are built.
        raise ConfigError(
            "algorithms.data_selection.select_ahead: true is not supported with device_train_microbatch_size: auto on "
            f"{world} ranks (a rank retrying its microbatches after an out-of-memory error would meet the others in the "
            "selection's collectives); set a fixed device_train_microbatch_size, or select_ahead: false"
        )


def _tokenizer_and_shards(cfg: TrainConfig) -> tuple[Any, Any]:
    """The run's tokenizer and the training shards' manifest, read before anything is built; what is wrong with
    them (missing, unreadable, another tokenizer's shards) is a `ConfigError`, which train.py reports in one line."""
    from pipeline.manifest import load_manifest
    from pipeline.tokenizer import load_tokenizer

    try:
        manifest = load_manifest(cfg.train_loader.dataset.shard_dir)
    except ValueError as e:
        raise ConfigError(f"train_loader.dataset.shard_dir: {e}") from e
    try:
        _check_train_domains(cfg, manifest)
        tokenizer = load_tokenizer(cfg.tokenizer_name)
        _check_shards(cfg, tokenizer, manifest)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e
    return tokenizer, manifest


def _check_train_domains(cfg: TrainConfig, manifest: Any) -> None:
    """`train_loader.dataset.domains` and its weights name the shards' domains (else the dataset raised it later)."""
    from pipeline.dataset import streamed_domains

    data = cfg.train_loader.dataset
    try:
        streamed_domains(manifest, shard_dir=data.shard_dir, split=data.split, domains=data.domains,
                         domain_weights=data.domain_weights)
    except ValueError as e:
        raise ValueError(f"train_loader.dataset: {e}") from e


def _check_shards(cfg: TrainConfig, tokenizer: Any, manifest: Any) -> None:
    """The training shards, and evaluation and validation shards kept elsewhere, hold this run's tokenizer's ids and
    sequences of its max_seq_len; local evaluation and validation shards without a remote exist."""
    from composer_algos.data_selection.options import validation_config
    from pipeline.manifest import load_manifest, tokenizer_mismatch

    selection = cfg.algorithms.get("data_selection")
    validation = validation_config(getattr(selection, "validation", None) if selection is not None else None)
    others = {  # key -> (local shard directory, its remote)
        "eval_loader.shard_dir": (cfg.eval_loader.shard_dir, cfg.eval_loader.remote) if cfg.eval_loader else (None, None),
        "algorithms.data_selection.validation.shard_dir": (validation.get("shard_dir"), validation.get("remote")),
    }
    checked = [("train_loader.dataset.shard_dir", manifest)]
    seen = {os.path.abspath(cfg.train_loader.dataset.shard_dir)}  # each directory read and fingerprinted once
    for key, (path, remote) in others.items():
        if not path or os.path.abspath(path) in seen:
            continue
        if not os.path.isfile(os.path.join(path, "manifest.json")):
            if remote is None and "://" not in path:  # shards that stream from a remote arrive with their loader
                raise ValueError(f"{key}: {path} holds no manifest.json (the output directory of tools/shard.py)")
            continue
        seen.add(os.path.abspath(path))
        try:
            checked.append((key, load_manifest(path)))
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from e
    for key, m in checked:
        if problem := tokenizer_mismatch(m, tokenizer, str(cfg.tokenizer_name)):
            raise ValueError(f"{key}: {problem}")
        if m.max_seq_len != cfg.max_seq_len:
            raise ValueError(
                f"max_seq_len {cfg.max_seq_len} does not match the shards of {key} (their manifest's max_seq_len "
                f"{m.max_seq_len}); set max_seq_len to {m.max_seq_len} or re-shard"
            )


def _run_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The Trainer's arguments that come from the config as they are: duration, device, checkpoints, logging."""
    import torch

    return {
        "run_name": cfg.run_name,
        "max_duration": cfg.max_duration,
        "precision": cfg.precision or ("amp_bf16" if torch.cuda.is_available() else "fp32"),
        "device": cfg.device,
        "save_folder": cfg.save_folder,
        "save_interval": cfg.save_interval,
        "save_num_checkpoints_to_keep": cfg.save_num_checkpoints_to_keep,
        "save_overwrite": cfg.save_overwrite,
        "load_path": cfg.load_path,
        "load_weights_only": cfg.load_weights_only,
        "autoresume": cfg.autoresume,
        "seed": cfg.seed,
        "console_log_interval": cfg.console_log_interval,
        "log_to_console": True,
        "progress_bar": cfg.progress_bar,
        "dist_timeout": cfg.dist_timeout,
        "parallelism_config": {"fsdp": cfg.fsdp_config} if cfg.fsdp_config else None,
        "python_log_level": cfg.python_log_level,
    }


def _evaluators(cfg: TrainConfig, pad_id: int) -> list:
    """The per-domain evaluators of `eval_loader` (none without one)."""
    from pipeline.loaders import build_domain_evaluators

    if cfg.eval_loader is None:
        return []
    ev, data = cfg.eval_loader, cfg.train_loader.dataset
    return build_domain_evaluators(
        shard_dir=ev.shard_dir or data.shard_dir,
        remote=ev.remote,
        split=ev.split,
        per_domain=ev.per_domain,
        subset_num_batches=ev.subset_num_batches,
        device_batch_size=ev.device_eval_batch_size,
        pad_token_id=pad_id,
        max_seq_len=cfg.max_seq_len,
        domains=data.domains,
        guide_fraction=ev.guide_fraction,
    )


def _callbacks_and_loggers(cfg: TrainConfig, context: dict[str, Any]) -> tuple[list, list]:
    """The configured callbacks (the mixture monitor and the evaluation history always) and loggers."""
    from composer.loggers import FileLogger

    from composer_algos.builders import build_component
    from composer_algos.callbacks.file_logger import AppendFileLogger

    callback_cfgs = dict(cfg.callbacks)
    callback_cfgs.setdefault("mixture_monitor", {})  # the trained domain mixture is always logged
    callback_cfgs.setdefault("eval_history", {})  # per-domain validation curves and final results
    callbacks = [build_component("callback", n, kw, context) for n, kw in callback_cfgs.items()]
    loggers = [build_component("logger", n, kw, context) for n, kw in cfg.loggers.items()]
    if cfg.save_folder and not any(isinstance(lg, FileLogger) for lg in loggers):
        log_file = os.path.join(cfg.run_dir, "log-rank{rank}.txt")
        loggers.append(AppendFileLogger(filename=log_file, flush_interval=50))  # kept across autoresume
    return callbacks, loggers


def domain_val_losses(trainer: Trainer) -> dict[str, float]:
    """The last evaluation's cross-entropy (validation log-perplexity) per `val/<domain>` label."""
    out = {}
    for label, metrics in trainer.state.eval_metrics.items():
        metric = metrics.get("LanguageCrossEntropy")
        if metric is not None and label.startswith("val/"):
            out[label[len("val/") :]] = float(metric.compute())
    return out


def format_domain_losses(losses: dict[str, float]) -> str:
    """A small table of per-domain validation loss with the unweighted average."""
    if not losses:
        return "(no evaluation was run)"
    width = max(len(n) for n in losses) + 2
    lines = [f"{'domain':<{width}}{'val loss':>10}{'val ppl':>12}"]
    for name, loss in losses.items():
        lines.append(f"{name:<{width}}{loss:>10.4f}{math.exp(min(loss, 50)):>12.2f}")
    avg = sum(losses.values()) / len(losses)
    lines.append(f"{'average':<{width}}{avg:>10.4f}{math.exp(min(avg, 50)):>12.2f}")
    return "\n".join(lines)


def main(argv: list[str]) -> Trainer:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    try:
        from composer_algos.registry import load_run_config  # the registries import composer lazily

        cfg = load_run_config(argv[0], argv[1:])
    except (ConfigError, FileNotFoundError) as e:  # one message naming every bad key, not a traceback
        print(f"train.py: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    from composer.utils import dist
    from omegaconf import OmegaConf

    from pipeline.streaming_cleanup import clean_stale_streaming_resources

    if os.environ.get("LOCAL_RANK", "0") == "0":
        clean_stale_streaming_resources()  # left by killed runs; only what no live process holds
    try:
        trainer = build_trainer(cfg)
        if cfg.save_folder and dist.get_global_rank() == 0:
            os.makedirs(cfg.run_dir, exist_ok=True)
            OmegaConf.save(OmegaConf.create(config_to_dict(cfg)), os.path.join(cfg.run_dir, "config.yaml"))
        trainer.fit()
    except ConfigError as e:  # a setting only the data could refute (shards not readable up front): one line
        print(f"train.py: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if dist.get_global_rank() == 0:
        print("\nPer-domain validation loss (log-perplexity) at the end of training:")
        print(format_domain_losses(domain_val_losses(trainer)))
    return trainer


if __name__ == "__main__":
    main(sys.argv[1:])
