"""Typed run configuration: yaml + `key=value` overrides -> validated, frozen kw_only dataclasses.

Every section is a frozen dataclass. The components under `algorithms`, `callbacks` and `loggers`
are parsed by a `parse_component` hook that the training side supplies
(`composer_algos.registry.load_run_config` passes its registry's), so this module never imports
the training side: each becomes a `ConfigSection` derived from its class's constructor. Every
problem is collected and raised as one `ConfigError` that names the yaml path of each key.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import string
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.gguf import gguf_problem, is_gguf

__all__ = [
    "ConfigError",
    "ConfigSection",
    "DatasetConfig",
    "EvalConfig",
    "LoaderConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainConfig",
    "ComponentParser",
    "build_section",
    "config_to_dict",
    "parse_components",
    "load_config",
    "parse_config",
    "guide_fraction_problems",
    "pool_unit_problems",
]

_DURATION = re.compile(r"^\d+(\.\d+)?(ba|ep|sp|tok|dur)$")


class ConfigError(ValueError):
    """A configuration problem; the message lists every problem found, one per line."""


class ConfigSection(Mapping[str, Any]):
    """Base of the frozen dataclasses that hold a component's constructor arguments.

    Attributes read the effective value (the yaml's, else the constructor's default); as a mapping a
    section holds only the keys the yaml gave, so `cls(**section)` builds exactly what the yaml
    describes and the constructor keeps owning its defaults.
    """

    def given(self) -> frozenset[str]:
        """The keys the yaml set (every field for a section built by hand)."""
        keys = self.__dict__.get("_given")
        return keys if keys is not None else frozenset(f.name for f in dataclasses.fields(self))  # type: ignore[arg-type]

    def __getitem__(self, key: str) -> Any:
        if key not in self.given():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        given = self.given()
        return iter([f.name for f in dataclasses.fields(self) if f.name in given])  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self.given())


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA adapters through peft (the paper: r 16, alpha 96 or 32, dropout 0.05)."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj"])
    # Adapters only in the last this many blocks (None: every block). The blocks below then hold no
    # trainable parameter, so the backward stops at the lowest adapted block.
    top_blocks: int | None = None

    def validate(self) -> list[str]:
        errs = []
        if self.r <= 0:
            errs.append(f"model.lora.r must be > 0, got {self.r}")
        if self.top_blocks is not None and (isinstance(self.top_blocks, bool) or self.top_blocks < 1):
            errs.append(f"model.lora.top_blocks must be an integer >= 1 (or null: every block), got {self.top_blocks!r}")
        if not 0 <= self.dropout < 1:
            errs.append(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            errs.append("model.lora.target_modules must name at least one module")
        return errs


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The causal LM: a hub name, local path or `.gguf` file, or an inline transformers config (random init).

    `pretrained_model_name_or_path` with `pretrained: true` loads weights; with `pretrained:
    false` it loads only the architecture's config. A `.gguf` file is converted once to a cached
    local model directory (`pipeline.gguf`); `tokenizer_name` may name the same file. `config`
    (a dict with `model_type`) builds the architecture offline; `config_overrides` patch either.
    """

    pretrained_model_name_or_path: str | None = None
    pretrained: bool = False
    config: dict[str, Any] | None = None
    config_overrides: dict[str, Any] = field(default_factory=dict)
    lora: LoraConfig | None = None
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    # `targets`: the vocabulary projection only at positions whose next token has a loss (answer-only
    # fine-tuning; `composer_algos.models.causal_lm.DomainCausalLM`), `all`: at every position.
    logits_at: str = "all"
    # A directory where evaluation keeps the outputs of the frozen blocks below `lora.top_blocks`'
    # adapters, so later evaluations of the same inputs (in this run or another) skip those blocks
    # (`composer_algos.models.frozen_prefix`); null: evaluate through every block.
    eval_prefix_cache: str | None = None
    # true: the training forward skips the frozen blocks below `lora.top_blocks`' adapters, taking their
    # output on the selected rows from the selection's scoring pass (`composer_algos.models.scoring_prefix`).
    reuse_scoring_prefix: bool = False

    def validate(self) -> list[str]:
        errs = []
        if self.reuse_scoring_prefix and (self.lora is None or self.lora.top_blocks is None):
            errs.append(
                "model.reuse_scoring_prefix needs model.lora.top_blocks: only the blocks below the adapters are "
                "frozen, so only their output can be handed on; set lora.top_blocks or drop reuse_scoring_prefix"
            )
        if self.eval_prefix_cache is not None and (self.lora is None or self.lora.top_blocks is None):
            errs.append(
                f"model.eval_prefix_cache ({self.eval_prefix_cache!r}) needs model.lora.top_blocks: only the blocks "
                "below the adapters are frozen and can be cached; set lora.top_blocks or drop eval_prefix_cache"
            )
        if self.logits_at not in ("all", "targets"):
            errs.append(f"model.logits_at must be 'all' or 'targets', got {self.logits_at!r}")
        if (self.pretrained_model_name_or_path is None) == (self.config is None):
            errs.append("model: give exactly one of `pretrained_model_name_or_path` or `config`")
        if self.config is not None and "model_type" not in self.config:
            errs.append("model.config needs a `model_type` (e.g. llama, qwen2, gpt2)")
        if self.pretrained and self.pretrained_model_name_or_path is None:
            errs.append("model.pretrained: true needs `pretrained_model_name_or_path`")
        name = self.pretrained_model_name_or_path
        if is_gguf(name) and (problem := gguf_problem(name, "model.pretrained_model_name_or_path")):
            errs.append(problem)  # missing or not GGUF: said now, not after the tokenizer and data are built
        if self.attn_implementation not in ("eager", "sdpa", "flash_attention_2"):
            errs.append(
                f"model.attn_implementation must be eager, sdpa or flash_attention_2, got {self.attn_implementation!r}"
            )
        if self.lora is not None:
            errs += self.lora.validate()
        return errs


@dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    """Which shards to stream, and how (see `pipeline.dataset.DomainStreamingDataset`)."""

    shard_dir: str
    remote: str | None = None
    split: str = "train"
    domains: list[str] | None = None
    domain_weights: dict[str, float] | None = None
    domain_weights_file: str | None = None
    shuffle: bool = True
    shuffle_seed: int = 9176
    shuffle_algo: str = "py1e"
    num_canonical_nodes: int | None = None
    predownload: int | None = None
    epoch_size: int | None = None

    def validate(self, where: str) -> list[str]:
        errs = []
        if self.domain_weights is not None and self.domain_weights_file is not None:
            errs.append(f"{where}.dataset: give `domain_weights` or `domain_weights_file`, not both")
        if self.split not in ("train", "val"):
            errs.append(f"{where}.dataset.split must be train or val, got {self.split!r}")
        from streaming.base.shuffle import algos as shuffle_algos

        if self.shuffle_algo not in shuffle_algos:
            errs.append(
                f"{where}.dataset.shuffle_algo must be one of Streaming's {', '.join(sorted(shuffle_algos))}, "
                f"got {self.shuffle_algo!r}"
            )
        return errs


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """A DataLoader over a `DatasetConfig`."""

    dataset: DatasetConfig
    num_workers: int = 0
    drop_last: bool = True
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    pin_memory: bool = False

    def validate(self, where: str) -> list[str]:
        errs = self.dataset.validate(where)
        if self.num_workers < 0:
            errs.append(f"{where}.num_workers must be >= 0, got {self.num_workers}")
        return errs


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Per-domain validation: one evaluator per domain, labelled `val/<domain>`.

    `guide_fraction` is the share of each domain's split left out of evaluation because
    validation-guided selection draws from it (`pipeline.holdout`); it must be >= the
    selection's `algorithms.data_selection.validation.guide_fraction` when both read the same
    split. 0 evaluates on the whole split (for shards selection never sees).
    """

    shard_dir: str | None = None  # default: train_loader.dataset.shard_dir
    split: str = "val"
    device_eval_batch_size: int = 8
    per_domain: bool = True
    subset_num_batches: int = -1
    remote: str | None = None
    guide_fraction: float = 0.5


# The largest share of every weight the optimizer may decay away in one step at the peak learning rate
# (`OptimizerConfig.validate`): the references' weight decay 0.1 at lr 4e-4 is 4e-5; 0.1 a step (the 1B recipe's
# DecoupledAdamW decay of 0.1 until 2026-11-28) erases a weight's value in a few dozen steps.
MAX_DECAY_PER_STEP = 0.05


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    name: str = "decoupled_adamw"
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0

    def validate(self) -> list[str]:
        errs = []
        if self.name not in ("decoupled_adamw", "adamw", "adam"):
            errs.append(f"optimizer.name must be decoupled_adamw, adamw or adam, got {self.name!r}")
        if not self.lr > 0:
            errs.append(f"optimizer.lr must be > 0, got {self.lr}")
        if len(self.betas) != 2:
            errs.append(f"optimizer.betas must have 2 values, got {self.betas}")
        if not self.weight_decay >= 0:
            errs.append(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        # The share of every weight decayed away a step at the peak lr: torch's AdamW multiplies by 1 - lr x wd,
        # Composer's DecoupledAdamW by 1 - (lr / initial lr) x wd (Adam's decay is an L2 term in the gradient).
        shrink = {"adamw": self.lr * self.weight_decay, "decoupled_adamw": self.weight_decay}.get(self.name, 0.0)
        if self.lr > 0 and shrink >= MAX_DECAY_PER_STEP:
            usual = f"{0.1 * self.lr:g} (0.1 x lr)" if self.name == "decoupled_adamw" else "0.1"
            errs.append(
                f"optimizer.weight_decay {self.weight_decay:g} with {self.name} at lr {self.lr:g} decays every weight "
                f"by {shrink:.0%} a step at the peak lr (at most {MAX_DECAY_PER_STEP:.0%} is allowed); the usual weight "
                f"decay 0.1 is {usual} here: {self.name} multiplies the weights by "
                + ("1 - lr x weight_decay a step" if self.name == "adamw" else "1 - (lr / initial lr) x weight_decay a step")
            )
        return errs


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    name: str = "linear_decay_with_warmup"
    t_warmup: str = "0ba"
    alpha_f: float = 0.0

    def validate(self) -> list[str]:
        errs = []
        allowed = ("linear_decay_with_warmup", "cosine_with_warmup", "constant_with_warmup")
        if self.name not in allowed:
            errs.append(f"scheduler.name must be one of {allowed}, got {self.name!r}")
        if not _DURATION.match(str(self.t_warmup)):
            errs.append(f"scheduler.t_warmup must be a duration like 1000ba or 0.03dur, got {self.t_warmup!r}")
        return errs


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A whole training run. Every field is spelled as in the yaml.

    `global_train_batch_size` is the number of examples the model trains on per step (kappa
    summed over ranks). With a selection algorithm that oversamples by `r`, the loader
    delivers `r` times as many per step (the pool); see the selection method card.
    """

    run_name: str | None = None
    seed: int = 17
    max_seq_len: int
    tokenizer_name: str
    model: ModelConfig
    train_loader: LoaderConfig
    eval_loader: EvalConfig | None = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    global_train_batch_size: int
    device_train_microbatch_size: int | str | None = None
    max_duration: str
    eval_interval: str = "1ep"
    eval_first: bool = False
    precision: str | None = None
    device: str | None = None
    save_folder: str | None = None
    save_interval: str = "1000ba"
    save_num_checkpoints_to_keep: int = -1
    save_overwrite: bool = False
    load_path: str | None = None
    load_weights_only: bool = False
    autoresume: bool = False
    # name -> ConfigSection of that component's constructor arguments (see composer_algos.registry)
    algorithms: dict[str, Any] = field(default_factory=dict)
    callbacks: dict[str, Any] = field(default_factory=dict)
    loggers: dict[str, Any] = field(default_factory=dict)
    console_log_interval: str = "10ba"
    progress_bar: bool = False
    python_log_level: str | None = "info"
    dist_timeout: float = 600.0
    fsdp_config: dict[str, Any] | None = None

    def validate(self) -> list[str]:
        errs = self.model.validate() + self.train_loader.validate("train_loader")
        errs += self.optimizer.validate() + self.scheduler.validate()
        for name in ("max_duration", "eval_interval", "save_interval", "console_log_interval"):
            value = str(getattr(self, name))
            if not _DURATION.match(value):
                errs.append(f"{name} must be a duration like 1000ba, 2ep or 0.5dur, got {value!r}")
        errs += pool_unit_problems("max_duration", self.max_duration)
        if self.global_train_batch_size <= 0:
            errs.append(f"global_train_batch_size must be > 0, got {self.global_train_batch_size}")
        if self.max_seq_len <= 0:
            errs.append(f"max_seq_len must be > 0, got {self.max_seq_len}")
        if is_gguf(self.tokenizer_name) and (problem := gguf_problem(self.tokenizer_name, "tokenizer_name")):
            errs.append(problem)
        mb = self.device_train_microbatch_size
        if isinstance(mb, str) and mb != "auto":
            errs.append(f"device_train_microbatch_size must be an int or 'auto', got {mb!r}")
        if isinstance(mb, int) and mb <= 0:
            errs.append(f"device_train_microbatch_size must be > 0, got {mb}")
        if self.precision not in (None, "fp32", "amp_bf16", "amp_fp16", "amp_fp8"):
            errs.append(f"precision must be fp32, amp_bf16, amp_fp16 or amp_fp8 (or unset for auto), got {self.precision!r}")
        if "doremi" in self.algorithms and "data_selection" in self.algorithms:
            errs.append(
                "algorithms: doremi (proxy training with Group DRO weights) and data_selection cannot run "
                "in the same run; train the DoReMi proxy first, then use its weights via "
                "train_loader.dataset.domain_weights_file"
            )
        if self.device not in (None, "cpu", "gpu"):
            errs.append(f"device must be cpu or gpu (or unset for auto), got {self.device!r}")
        errs += self._validate_guide_fractions()
        errs += fsdp_config_problems(self.fsdp_config)
        errs += save_folder_problems(self.save_folder, self.run_name)
        if self.eval_loader is not None:
            if self.eval_loader.device_eval_batch_size <= 0:
                errs.append(f"eval_loader.device_eval_batch_size must be > 0, got {self.eval_loader.device_eval_batch_size}")
            if self.eval_loader.subset_num_batches == 0 or self.eval_loader.subset_num_batches < -1:
                errs.append(
                    f"eval_loader.subset_num_batches must be > 0, or -1 for every batch, got {self.eval_loader.subset_num_batches}"
                )
        return errs

    @property
    def run_dir(self) -> str:
        """Where the run's own files go on the local disk (the selection's mixture and logs, config.yaml, the log
        file): `save_folder` with ``{run_name}`` filled in as Composer fills it; ``runs/<run_name>`` when it is
        unset or remote (Composer uploads the checkpoints there; the run's files stay local)."""
        folder = self.save_folder
        if folder is None or "://" in folder:
            return os.path.join("runs", self.run_name or "run")
        return folder.replace("{run_name}", self.run_name or "")

    def _validate_guide_fractions(self) -> list[str]:
        return guide_fraction_problems(
            self.algorithms.get("data_selection"), self.eval_loader, self.train_loader.dataset.shard_dir
        )


_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def save_folder_problems(save_folder: str | None, run_name: str | None) -> list[str]:
    """A `save_folder` whose placeholders the run's own files could not follow: Composer formats ``{run_name}``
    (and ``{rank}`` and the like) into the checkpoints' folder, and the run's files must land beside them."""
    if not save_folder or "{" not in save_folder:
        return []
    fields = sorted({f for _, f, _, _ in string.Formatter().parse(save_folder) if f is not None})
    if fields == ["run_name"] and run_name:
        return []
    if fields == ["run_name"]:
        return [
            f"save_folder {save_folder!r} names {{run_name}} and run_name is unset: Composer makes one up when the run "
            "starts, after the selection's files are placed; set run_name"
        ]
    return [
        f"save_folder {save_folder!r} uses {', '.join('{' + f + '}' for f in fields if f != 'run_name')}: the run's "
        "files (the mixture, the selection log, config.yaml) are written once, by rank 0, beside the checkpoints; "
        "use a folder without them ({run_name} may stay)"
    ]


def fsdp_config_problems(fsdp: dict[str, Any] | None) -> list[str]:
    """What Composer would silently ignore or change in `fsdp_config`, or reject late, found before anything is built.

    Composer 0.32.1 builds its `FSDPConfig` from the mapping when the Trainer is constructed, after the loaders and
    the model, and its `__init__` sets every key it is given as an attribute: a misspelt key
    (`sharding_stratgy: HYBRID_SHARD`) is ignored and the default used, with no message. An unknown strategy is a
    KeyError there. And a hybrid strategy needs a two-dimensional device
    mesh: without `data_parallel_replicate_degree` Composer warns and runs FULL_SHARD (or SHARD_GRAD_OP) over every
    rank (composer/distributed/dist_strategy.py), so a multi-node run would shard across nodes. Imports Composer
    (seconds) only when the run asks for FSDP, which builds it anyway.
    """
    if not fsdp:
        return []
    from composer.distributed.mosaic_parallelism import SHARDING_MAP
    from composer.utils.parallelism import FSDPConfig

    known = sorted(f.name for f in dataclasses.fields(FSDPConfig) if f.init)
    errs = []
    for key in fsdp:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            errs.append(f"fsdp_config.{key}: not an option of Composer's FSDPConfig; {hint}the options are "
                        f"{', '.join(known)}")
    strategy = str(fsdp.get("sharding_strategy", "FULL_SHARD")).upper()
    if strategy not in SHARDING_MAP:
        errs.append(f"fsdp_config.sharding_strategy must be one of {', '.join(SHARDING_MAP)}, "
                    f"got {fsdp['sharding_strategy']!r}")
    elif strategy in _HYBRID and fsdp.get("data_parallel_replicate_degree") is None:
        errs.append(
            f"fsdp_config.sharding_strategy {strategy} shards within a replica and replicates across replicas: give "
            "fsdp_config.data_parallel_replicate_degree (how many replicas, e.g. the number of nodes; "
            "data_parallel_shard_degree, default -1, takes the rest). Without it Composer runs "
            f"{'FULL_SHARD' if strategy == 'HYBRID_SHARD' else 'SHARD_GRAD_OP'} over every rank, with only a warning"
        )
    return errs


def guide_fraction_problems(
    selection: Any, ev: EvalConfig | None, train_shard_dir: str, *, eval_key: str = "eval_loader"
) -> list[str]:
    """Evaluation must not read the validation examples that guide selection (see pipeline.holdout).

    Args:
        selection: the `algorithms.data_selection` options (a mapping; None: no selection).
        ev: the evaluation's shards, split and guide fraction (None: no evaluation).
        train_shard_dir: the training shards (the default of both the evaluation's and the guide's).
        eval_key: the yaml path of the evaluation's `guide_fraction`'s section, for messages.
    """
    errs = []
    if ev is not None and not 0.0 <= ev.guide_fraction < 1.0:
        errs.append(f"{eval_key}.guide_fraction must be in [0, 1) (0: the whole split), got {ev.guide_fraction}")
    val = (selection or {}).get("validation") if isinstance(selection, Mapping | None) else None
    if isinstance(val, str):  # a shard directory: its options take their defaults
        val = {"shard_dir": val}
    val = val if isinstance(val, Mapping) else {}
    guide = val.get("guide_fraction", 0.5)
    if selection is None or not isinstance(guide, (int, float)):
        return errs
    if not 0.0 < guide <= 1.0:
        errs.append(f"algorithms.data_selection.validation.guide_fraction must be in (0, 1], got {guide}")
    same_split = (
        ev is not None
        and _same_location(ev.shard_dir or train_shard_dir, val.get("shard_dir", train_shard_dir))
        and ev.split == val.get("split", "val")
    )
    if same_split and ev is not None and ev.guide_fraction < guide:
        errs.append(
            f"{eval_key}.guide_fraction {ev.guide_fraction} is below "
            f"algorithms.data_selection.validation.guide_fraction {guide}: evaluation would read validation "
            f"examples that guide selection; set {eval_key}.guide_fraction={guide}"
        )
    return errs


def pool_unit_problems(key: str, duration: Any) -> list[str]:
    """A duration in samples or tokens, which Composer counts in pool units before selection (else none)."""
    if not str(duration).endswith(("sp", "tok")):
        return []
    return [
        f"{key} {duration!r}: use ba or ep; samples and tokens are counted in pool "
        "units before selection, so sp/tok durations would not mean what they say"
    ]


def _same_location(a: Any, b: Any) -> bool:
    """Whether two shard locations name one directory: local paths resolved (`x`, `x/`, `./x`, a
    symlink), remote URLs compared without a trailing slash."""
    if not isinstance(a, (str, os.PathLike)) or not isinstance(b, (str, os.PathLike)):
        return a == b
    a, b = os.fspath(a), os.fspath(b)
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


ComponentParser = Callable[[str, str, Any, str, list[str]], Any]
"""`(kind, name, value, where, problems) -> section`: parses one `algorithms`/`callbacks`/`loggers` entry."""


def load_config(
    yaml_path: str | Path, overrides: Sequence[str] = (), *, parse_component: ComponentParser | None = None
) -> TrainConfig:
    """Read a run yaml, apply `a.b=value` overrides, resolve `${variables...}` and validate.

    Args:
        yaml_path: the run yaml.
        overrides: `a.b=value` strings applied on top; `~a.b` removes the key `a.b` (and what is
            under it) first, an error when the yaml has no such key.
        parse_component: types each `algorithms`/`callbacks`/`loggers` entry (see `ComponentParser`);
            None keeps them as the yaml's mappings (`composer_algos.registry.load_run_config` passes
            the registry's, and `train.build_trainer` parses untyped ones before building anything).

    Raises:
        FileNotFoundError: `yaml_path` does not exist.
        ConfigError: unknown, missing or invalid fields, all listed.
    """
    path = Path(yaml_path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    cfg = OmegaConf.load(path)
    bad = [o for o in overrides if "=" not in o and not o.startswith("~")]
    if bad:
        raise ConfigError(f"overrides must look like key=value (or ~key to remove a key), got {bad}")
    for o in overrides:
        if o.startswith("~"):  # ~callbacks.answer_accuracy: the key and what is under it removed
            parent, _, key = o[1:].rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            if not isinstance(node, DictConfig) or key not in node:
                raise ConfigError(f"{path}: override {o}: the yaml has no key {o[1:]!r} to remove")
            del node[key]
    settings = [o for o in overrides if not o.startswith("~")]
    if settings:
        cfg = OmegaConf.merge(cfg, *(_override(path, o) for o in settings))
    assert isinstance(cfg, DictConfig)
    if problem := _unused_variable(path, cfg, settings):
        raise ConfigError(problem)
    return parse_config(cfg, source=str(path), parse_component=parse_component)


def _unused_variable(path: Path, cfg: DictConfig, settings: Sequence[str]) -> str | None:
    """An override of `variables.X` that nothing in the config reads (``${variables.X}``): a typo that would leave
    the yaml's own value in force (`variables.shard_dirr=/data` trained on the default shards)."""
    given = {o.split("=", 1)[0].strip().split(".")[1] for o in settings if o.startswith("variables.")}
    if not given or not isinstance(cfg.get("variables"), DictConfig):
        return None
    text = OmegaConf.to_yaml(cfg)  # unresolved: the interpolations as written
    unused = sorted(name for name in given if not re.search(r"\$\{\s*variables\." + re.escape(name) + r"\b", text))
    if not unused:
        return None
    name = unused[0]
    near = difflib.get_close_matches(name, [k for k in cfg.variables if k not in given], n=1)
    return (
        f"{path}: override variables.{name}: nothing in the config reads ${{variables.{name}}}"
        + (f" (did you mean variables.{near[0]}?)" if near else f"; the yaml's variables: {', '.join(str(k) for k in cfg.variables if k not in given)}")
    )


def _override(path: Path, override: str) -> DictConfig:
    """One ``key=value`` override as a config (its value read as YAML), or a `ConfigError` naming it: for a value
    YAML cannot read, and for a mapping key with a colon and no value (``{lr:0.1}`` is YAML's key ``lr:0.1``,
    not ``lr`` at 0.1, which would otherwise fail later as an unknown field or pass unnoticed)."""
    try:
        part = OmegaConf.from_dotlist([override])
    except Exception as e:  # yaml's scanner and parser errors, omegaconf's own
        problem = str(e).strip().splitlines()
        raise ConfigError(
            f"{path}: override {override!r}: its value is not valid YAML ({' '.join(problem[:3]).strip()}); "
            "quote the value (key='...') or fix its brackets"
        ) from None
    pending: list[Any] = [OmegaConf.to_container(part)]
    while pending:
        node = pending.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if isinstance(key, str) and ":" in key and value is None:
                name, _, value_text = key.partition(":")
                raise ConfigError(
                    f"{path}: override {override!r}: YAML reads {key!r} as one key without a value; a mapping "
                    f"needs a space after each colon ({name}: {value_text})"
                )
            pending.append(value)
    return part


def parse_config(
    cfg: DictConfig | dict[str, Any], source: str = "<config>", *, parse_component: ComponentParser | None = None
) -> TrainConfig:
    """Convert a merged config tree into a validated `TrainConfig` (see `load_config`)."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(cfg)
    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:  # interpolation errors name the key
        raise ConfigError(f"{source}: {e}") from e
    assert isinstance(data, dict)
    data.pop("variables", None)
    problems: list[str] = []
    for section, kind in (("algorithms", "algorithm"), ("callbacks", "callback"), ("loggers", "logger")):
        if parse_component is not None and isinstance(data.get(section), dict):
            data[section] = parse_components(parse_component, kind, data[section], section, problems)
    out = _build(TrainConfig, data, "", problems)
    if not problems:
        problems += out.validate()
    if problems:
        raise ConfigError(f"{source}: invalid configuration:\n  - " + "\n  - ".join(problems))
    return out


def build_section(cls: type, data: Any, prefix: str, problems: list[str]) -> Any:
    """Build the (frozen) dataclass `cls` from the yaml mapping `data`, appending every problem found.

    Args:
        cls: the dataclass; a `ConfigSection` subclass also records which keys `data` gave.
        data: the mapping read from the yaml (an instance of `cls` is returned as is).
        prefix: the yaml path of `data` followed by a dot (`algorithms.data_selection.`), or "".
        problems: where each unknown, missing or mistyped key is appended, named by its yaml path.

    Returns:
        The instance, or None when a required key is missing or `data` is not a mapping.
    """
    return _build(cls, data, prefix, problems)


def config_to_dict(value: Any, *, skip_defaults: bool = False) -> Any:
    """The plain-container form of a config (for saving): sections keep only the keys the yaml gave.

    With `skip_defaults`, the fields of the plain dataclasses (`TrainConfig`, `ModelConfig`, ...) that
    are at their defaults are left out too, so a field added later with a default leaves the result
    of an older config unchanged (`compute_plan.work_key`).
    """
    if isinstance(value, ConfigSection):
        return {k: config_to_dict(v, skip_defaults=skip_defaults) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: config_to_dict(getattr(value, f.name), skip_defaults=skip_defaults)
            for f in dataclasses.fields(value)
            if not (skip_defaults and _at_default(f, getattr(value, f.name)))
        }
    if isinstance(value, Mapping):
        return {k: config_to_dict(v, skip_defaults=skip_defaults) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [config_to_dict(v, skip_defaults=skip_defaults) for v in value]
    return value


def _at_default(f: dataclasses.Field, value: Any) -> bool:
    if f.default is not dataclasses.MISSING:
        return value == f.default
    return f.default_factory is not dataclasses.MISSING and value == f.default_factory()


def parse_components(
    parse_component: ComponentParser, kind: str, data: Mapping[str, Any], section: str, problems: list[str]
) -> dict[str, Any]:
    """Each `section.<name>` entry of `data` typed by `parse_component`; problems are appended."""
    parsed = {}
    for name, value in data.items():
        typed = parse_component(kind, str(name), value, f"{section}.{name}", problems)
        if typed is not None:
            parsed[name] = typed
    return parsed


def _build(cls: type, data: Any, prefix: str, problems: list[str]) -> Any:
    """Recursively build dataclass `cls` from `data`, appending every problem found."""
    where = prefix.rstrip(".") or "the top level"
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        problems.append(f"{where} must be a mapping, got {type(data).__name__}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    for key in unknown:
        near = difflib.get_close_matches(str(key), list(fields), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        problems.append(f"{prefix}{key}: unknown key{hint}; allowed: {sorted(fields)}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in data:
            if required:
                problems.append(f"missing required key {prefix}{name}")
            continue
        kwargs[name] = _convert(hints[name], data[name], f"{prefix}{name}", problems)
    try:
        out = cls(**kwargs)
    except TypeError:  # a missing required key, already reported
        return None
    if isinstance(out, ConfigSection):
        object.__setattr__(out, "_given", frozenset(k for k in data if k in fields))
    return out


def _convert(tp: Any, value: Any, key: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        for a in non_none:
            if dataclasses.is_dataclass(a) and isinstance(value, dict):
                return _build(a, value, key + ".", problems)
            if _matches(a, value):
                return _convert(a, value, key, problems)
        problems.append(f"{key} has the wrong type: got {value!r}, expected {_type_name(tp)}{_text_hint(key, value)}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".", problems)
    if not _matches(tp, value):
        problems.append(f"{key} has the wrong type: got {value!r}, expected {_type_name(tp)}{_text_hint(key, value)}")
        return value
    if tp is float and isinstance(value, int):
        return float(value)
    return value


_DURATION_KEYS = ("max_duration", "eval_interval", "save_interval", "console_log_interval", "t_warmup")


def _text_hint(key: str, value: Any) -> str:
    """What a number given where text is meant needs. Not converted: the yaml has already read `007` as 7 and
    `0123` as 83, so the number's text is not what was typed."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return ""
    if key.rsplit(".", 1)[-1] in _DURATION_KEYS:
        return f" (a duration has a unit: {value}ba, {value}ep, or a fraction of the run such as 0.5dur)"
    return f" (a number: quote it to give it as text, {key}='{value}')"


def _matches(tp: Any, value: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp in (str, bool):
        return isinstance(value, tp)
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(_matches(inner, v) for v in value)
    if origin is dict:
        _, inner = typing.get_args(tp) or (str, Any)
        return isinstance(value, dict) and all(_matches(inner, v) for v in value.values())
    if dataclasses.is_dataclass(tp):
        return isinstance(value, (dict, tp))
    if origin is tuple:
        return isinstance(value, (list, tuple))  # yaml has no tuples
    return isinstance(value, tp) if isinstance(tp, type) else True


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
