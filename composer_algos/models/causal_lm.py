"""Build the Composer-wrapped causal LM (hub name, local path, GGUF file or inline config; optional LoRA).

Legend: B = batch, T = sequence, V = vocabulary.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from typing import Any

import torch
from composer.metrics.nlp import LanguageCrossEntropy, LanguagePerplexity
from composer.models import HuggingFaceModel
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from composer_algos.causal_masks import unpacked_rows_for
from composer_algos.losses import (
    IGNORE_INDEX,
    per_example_losses,
    projects_at_targets,
    row_means,
    target_position_logits,
    target_token_losses,
)
from composer_algos.models.frozen_prefix import evaluation_forwards, install_frozen_prefix_cache
from composer_algos.models.scoring_prefix import PREFIX_KEY, ScoringPrefix, install_scoring_prefix
from pipeline.gguf import resolve_pretrained

log = logging.getLogger(__name__)

__all__ = ["DomainCausalLM", "build_causal_lm"]


class DomainCausalLM(HuggingFaceModel):
    """A Composer `HuggingFaceModel` for causal LMs whose loss can weight examples.

    When the batch carries `loss_weight` (B,), the loss is `sum_i w_i l_i / B` over the
    microbatch, with `l_i` the mean cross-entropy over example i's target tokens, as used by the
    `weighted_loss` option of the selection algorithm. Dividing by the microbatch size, not by
    the microbatch's sum of weights, is what makes the step loss the weighted mean over the whole
    selection: Composer scales each microbatch's loss by `B / (mean samples per rank)` and DDP
    averages the ranks, giving `sum_i w_i l_i / (total samples)`, which is
    `sum_i w_i l_i / sum_i w_i` because the algorithm normalises the weights to mean 1 over all
    ranks. Otherwise the loss is the model's usual token-mean loss. Other batch keys (such as
    `domain_id`) are not passed to the model.
    """

    #: "all": the vocabulary projection at every position (Hugging Face's forward); "targets": only at the
    #: positions whose next token has a loss (`logits_at: targets`, for answer-only fine-tuning).
    logits_at: str = "all"

    #: `model.reuse_scoring_prefix`: hands the scoring pass's frozen-prefix output on to the training forward.
    scoring_prefix: ScoringPrefix | None = None

    def forward(self, batch: Any) -> Any:
        hidden = batch.get(PREFIX_KEY) if isinstance(batch, Mapping) else None
        if hidden is not None and self.scoring_prefix is not None and self.training and torch.is_grad_enabled():
            if tuple(hidden.shape[:2]) == tuple(batch["input_ids"].shape):
                with self.scoring_prefix.handing_on(hidden):
                    return self._forward(batch)
            log.warning(
                "model.reuse_scoring_prefix: the batch's rows (%s) are not those scored (%s); running every block",
                tuple(batch["input_ids"].shape), tuple(hidden.shape[:2]),
            )
        return self._forward(batch)

    def _forward(self, batch: Any) -> Any:
        # Rows without position ids are not packed: keep SDPA's causal path (composer_algos.causal_masks).
        with unpacked_rows_for(batch):
            return self._forward_unpacked(batch)

    def _forward_unpacked(self, batch: Any) -> Any:
        if self.logits_at == "targets" and isinstance(batch, Mapping) and batch.get("labels") is not None:
            return self._target_forward(batch)
        if isinstance(batch, Mapping) and "use_cache" in self.model_forward_args and "use_cache" not in batch:
            # A training or loss forward keeps no KV cache: Llama's config asks for one, which holds every
            # block's keys and values until the backward ends and which a block recomputed under activation
            # checkpointing would grow a second time (the recomputation then fails on its shapes).
            batch = {**batch, "use_cache": False}
        return super().forward(batch)

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        if isinstance(batch, dict) and "loss_weight" in batch:
            if "target_rows" in outputs:  # the `targets` forward: per-example means from its (N,) losses
                losses_B = row_means(outputs["token_losses"], outputs["target_rows"], batch["labels"].shape[0])
            else:
                losses_B = per_example_losses(outputs["logits"], batch["labels"])
            w_B = batch["loss_weight"].to(device=losses_B.device, dtype=losses_B.dtype)
            return (w_B * losses_B).sum() / max(losses_B.shape[0], 1)
        return super().loss(outputs, batch)

    def eval_forward(self, batch: Any, outputs: Any | None = None) -> Any:
        """With `logits_at: targets`, the (N, V) logits of the target positions; `self.labels` their (N,) targets."""
        with evaluation_forwards():  # the frozen-prefix cache, where installed, serves evaluation only
            if self.logits_at != "targets" or not isinstance(batch, Mapping) or batch.get("mode") is not None:
                return super().eval_forward(batch, outputs)
            out = outputs if outputs else self.forward(batch)
        self.labels = out["targets"]  # what update_metric compares the logits with (token cross-entropy)
        return out["logits"]

    def _target_forward(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The decoder on every position, the vocabulary projection only where a next token has a loss.

        `composer_algos.losses.target_position_logits`; the loss is the mean over the target tokens in
        float32, as Hugging Face's.
        """
        logits_NV, targets_N, rows_N = target_position_logits(
            self.model, batch["input_ids"], batch.get("attention_mask"), batch["labels"]
        )
        token_losses_N = target_token_losses(logits_NV, targets_N)
        loss = token_losses_N.sum() / max(int(targets_N.numel()), 1)
        return {"loss": loss, "logits": logits_NV, "targets": targets_N, "target_rows": rows_N, "token_losses": token_losses_N}


def build_causal_lm(
    *,
    tokenizer: PreTrainedTokenizerBase,
    pretrained_model_name_or_path: str | None = None,
    pretrained: bool = False,
    config: dict[str, Any] | None = None,
    config_overrides: dict[str, Any] | None = None,
    lora: dict[str, Any] | None = None,
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    logits_at: str = "all",
    eval_prefix_cache: str | None = None,
    reuse_scoring_prefix: bool = False,
) -> DomainCausalLM:
    """Build the model described by a `ModelConfig` (fields passed as plain keyword arguments).

    A hub name and a local directory take the same path (`from_pretrained`); a `.gguf` file is
    converted once to a cached local directory (`pipeline.gguf.gguf_model_dir`, float32 weights)
    and then takes it too, with `pretrained: false` as well (the architecture comes from the file);
    an inline `config` builds a randomly initialised model offline.

    Args:
        tokenizer: The run's tokenizer; the model's vocabulary must cover it.
        pretrained_model_name_or_path: Hub name, local directory or `.gguf` file.
        pretrained: Load the weights (else only the architecture, randomly initialised).
        config: Inline transformers config with `model_type`.
        config_overrides: Fields patched into the config.
        lora: `{r, alpha, dropout, target_modules, top_blocks}` to wrap the model with peft LoRA adapters
            (`top_blocks`: only in the last this many blocks, peft's `layers_to_transform`).
        attn_implementation: eager, sdpa or flash_attention_2.
        gradient_checkpointing: Trade compute for activation memory.
        trust_remote_code: Passed to transformers.
        logits_at: `all` (the model's own forward) or `targets`: the vocabulary projection only at the
            positions whose next token has a loss (`DomainCausalLM._target_forward`); the same loss
            and metrics, for fine-tuning with a loss on the answer only.
        eval_prefix_cache: A directory where evaluation forwards keep the outputs of the frozen blocks
            below `lora["top_blocks"]`' adapters and skip those blocks when the same inputs come again
            (`composer_algos.models.frozen_prefix`); needs `top_blocks`.
        reuse_scoring_prefix: The training forward skips the frozen blocks below `lora["top_blocks"]`' adapters,
            taking their output on the selected rows from the selection's scoring pass
            (`composer_algos.models.scoring_prefix`); needs `top_blocks`.

    Returns:
        The Composer model, with per-token cross-entropy and perplexity as eval metrics.

    Raises:
        ValueError: the vocabulary is smaller than the tokenizer's; a `.gguf` file that is not GGUF
            or whose architecture transformers cannot load (`pipeline.gguf.gguf_model_dir`).
    """
    if reuse_scoring_prefix and (lora is None or lora.get("top_blocks") is None):
        raise ValueError("model.reuse_scoring_prefix needs model.lora.top_blocks (the blocks it skips lie below them)")
    if eval_prefix_cache is not None and (lora is None or lora.get("top_blocks") is None):
        raise ValueError("model.eval_prefix_cache needs model.lora.top_blocks (the frozen blocks it caches lie below them)")
    model = _hf_model(
        tokenizer, pretrained_model_name_or_path, pretrained, config, config_overrides, attn_implementation,
        trust_remote_code,
    )
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    peft_config, layers = _lora_config(lora, int(model.config.num_hidden_layers)) if lora is not None else (None, None)
    if logits_at not in ("all", "targets"):
        raise ValueError(f"model.logits_at must be 'all' or 'targets', got {logits_at!r}")
    if logits_at == "targets" and not projects_at_targets(model):
        raise ValueError(
            f"model.logits_at: targets needs a decoder followed by a linear output embedding; "
            f"{type(model).__name__} transforms its logits (or has no get_decoder): use logits_at: all"
        )
    wrapped = _composer_model(model, tokenizer, peft_config, logits_at)
    if eval_prefix_cache is not None:  # the blocks below the lowest adapted one are frozen
        install_frozen_prefix_cache(wrapped.model, layers[0], eval_prefix_cache)
    if reuse_scoring_prefix:
        wrapped.scoring_prefix = install_scoring_prefix(wrapped.model, layers[0])
    return wrapped


def _composer_model(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, peft_config: Any, logits_at: str
) -> DomainCausalLM:
    """The Composer wrapper (LoRA adapters applied by it), with cross-entropy and perplexity as metrics."""
    metrics = [LanguageCrossEntropy(ignore_index=IGNORE_INDEX), LanguagePerplexity(ignore_index=IGNORE_INDEX)]
    wrapped = DomainCausalLM(
        model,
        tokenizer=tokenizer,
        use_logits=True,
        metrics=metrics,
        eval_metrics=[LanguageCrossEntropy(ignore_index=IGNORE_INDEX), LanguagePerplexity(ignore_index=IGNORE_INDEX)],
        shift_labels=True,
        peft_config=peft_config,
        should_save_peft_only=False,
    )
    wrapped.logits_at = logits_at
    _wrap_per_block(wrapped.model)
    return wrapped


def _hf_model(
    tokenizer: PreTrainedTokenizerBase,
    name_or_path: str | None,
    pretrained: bool,
    config: dict[str, Any] | None,
    config_overrides: dict[str, Any] | None,
    attn_implementation: str,
    trust_remote_code: bool,
) -> torch.nn.Module:
    """The transformers model: its config (inline, or the checkpoint's with overrides), weights when `pretrained`."""
    overrides = dict(config_overrides or {})
    if name_or_path is not None:
        name_or_path = resolve_pretrained(name_or_path, field="model.pretrained_model_name_or_path")
    if config is not None:
        cfg_dict = dict(config)
        model_type = cfg_dict.pop("model_type")
        _check_config_keys(AutoConfig.for_model(model_type), {"model.config": cfg_dict, "model.config_overrides": overrides})
        hf_config = AutoConfig.for_model(model_type, **cfg_dict, **overrides)
    else:
        assert name_or_path is not None
        # One read: from_pretrained sets the overrides its config has and hands back (and would drop) the others.
        hf_config, unused = AutoConfig.from_pretrained(
            name_or_path, trust_remote_code=trust_remote_code, return_unused_kwargs=True, **overrides
        )
        _check_config_keys(hf_config, {"model.config_overrides": unused})
    hf_config._attn_implementation = attn_implementation  # honoured by from_config / from_pretrained
    if len(tokenizer) > hf_config.vocab_size:
        raise ValueError(
            f"model vocab_size {hf_config.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens; "
            "set model.config.vocab_size (or model.config_overrides.vocab_size) to at least that"
        )
    if pretrained:
        return AutoModelForCausalLM.from_pretrained(
            name_or_path, config=hf_config, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
        )
    return AutoModelForCausalLM.from_config(
        hf_config, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
    )


def _check_config_keys(base: Any, given: dict[str, dict[str, Any]]) -> None:
    """Refuse keys the model type's config does not have: transformers keeps such a keyword as a stray attribute (a
    config built from keywords) or drops it (from_pretrained's), and builds the model without it (`hidden_sizee: 32`
    trained a model of the default width, without a word)."""
    from pipeline.config import ConfigError

    known = set(base.to_dict())
    for section, keys in given.items():
        unknown = sorted(k for k in keys if k not in known)
        if unknown:
            hints = [f"{k!r} -> {near[0]!r}" for k in unknown if (near := difflib.get_close_matches(k, known, n=1))]
            raise ConfigError(
                f"{section}: {unknown} are not settings of a {base.model_type} config"
                + (f" (did you mean {', '.join(hints)}?)" if hints else "")
                + f"; it has {len(known)}: transformers' {type(base).__name__}"
            )


def _lora_config(lora: dict[str, Any], depth: int) -> tuple[Any, list[int] | None]:
    """peft's LoraConfig from the `lora` section, and the adapted blocks (None: every block)."""
    from peft import LoraConfig as PeftLoraConfig

    layers = None
    if lora.get("top_blocks") is not None:
        if int(lora["top_blocks"]) > depth:
            raise ValueError(f"model.lora.top_blocks {lora['top_blocks']} exceeds the model's {depth} blocks")
        layers = list(range(depth - int(lora["top_blocks"]), depth))
    peft_config = PeftLoraConfig(
        r=int(lora["r"]),
        lora_alpha=int(lora["alpha"]),
        lora_dropout=float(lora["dropout"]),
        target_modules=list(lora["target_modules"]),
        layers_to_transform=layers,
        task_type="CAUSAL_LM",
    )
    return peft_config, layers


def _wrap_per_block(hf_model: torch.nn.Module) -> None:
    """Under `fsdp_config`, one FSDP unit and one activation checkpoint per transformer block.

    Composer wraps the model's child in FSDP units where the child's `fsdp_wrap_fn` says so, and
    checkpoints the modules its `activation_checkpointing_fn` names (`fsdp_config:
    activation_checkpointing`). A Hugging Face model has neither, so without these the whole model was
    one unit (gathered whole for the forward, with no overlap of communication and compute) and
    `activation_checkpointing: true` checkpointed nothing. Both name the decoder's blocks (the
    model's list of same-class blocks, `features.targets.find_blocks`).
    """
    from composer_algos.features.targets import find_blocks

    base = hf_model.get_base_model() if hasattr(hf_model, "get_base_model") else hf_model
    block_class = type(find_blocks(base)[1][0])

    def is_block(module: torch.nn.Module) -> bool:
        return isinstance(module, block_class)

    hf_model.fsdp_wrap_fn = is_block
    hf_model.activation_checkpointing_fn = is_block

