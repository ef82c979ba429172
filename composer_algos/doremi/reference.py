"""Load DoReMi's frozen reference model from a Hugging Face directory or a Composer checkpoint."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from composer.models import HuggingFaceModel
from composer.models.huggingface import get_hf_config_from_composer_state_dict
from transformers import AutoModelForCausalLM, PreTrainedModel

log = logging.getLogger(__name__)

__all__ = ["load_reference_model", "freeze_reference"]


def load_reference_model(
    reference: str | os.PathLike | torch.nn.Module,
    *,
    base_model: str | None = None,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """Build the reference causal LM (weights loaded, LoRA merged), on CPU, not yet frozen.

    Accepted forms of `reference`:
    - a module (a transformers model or a Composer `HuggingFaceModel`, whose `.model` is used);
    - a Hugging Face model directory (`config.json` + weights), loaded offline;
    - a Composer checkpoint `.pt` of a `HuggingFaceModel` (monolithic, as `Trainer(save_folder=...)`
      writes without FSDP sharding). The architecture comes from the checkpoint's Hugging Face
      metadata; if the run used LoRA, the adapters are rebuilt from the saved peft config and
      merged after loading. A LoRA checkpoint saved with Composer's default
      `should_save_peft_only=True` holds only the adapter weights, so the frozen base weights
      must come from `base_model` (the same pretrained model the reference run started from).

    Args:
        reference: The reference, in one of the forms above.
        base_model: Hugging Face name or directory with the base weights (needed for peft-only
            checkpoints; also used for full checkpoints as the starting point, which is harmless).
        trust_remote_code: Passed to transformers.

    Returns:
        The reference model (a `torch.nn.Module` whose forward takes `input_ids`, `attention_mask`
        and returns an object with `.logits`).

    Raises:
        FileNotFoundError: If the path does not exist.
        ValueError: If the path is neither a model directory nor a checkpoint file, the checkpoint
            is not a Composer `HuggingFaceModel` checkpoint, or weights are missing or unexpected.
    """
    if isinstance(reference, HuggingFaceModel):
        return reference.model
    if isinstance(reference, torch.nn.Module):
        return reference
    path = Path(reference)
    if not path.exists():
        raise FileNotFoundError(
            f"doremi `reference` {str(path)!r} does not exist; give a Hugging Face model directory or the "
            "Composer checkpoint (.pt) of the reference run"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"doremi `reference` directory {str(path)!r} has no config.json (not a Hugging Face model)")
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    return _load_from_composer_checkpoint(path, base_model=base_model, trust_remote_code=trust_remote_code)


def freeze_reference(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """Move the reference to `device`, switch it to eval mode and turn off its gradients.

    Args:
        model: The reference model.
        device: Target device (the proxy's device).

    Returns:
        The same module, frozen.
    """
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def _load_from_composer_checkpoint(path: Path, *, base_model: str | None, trust_remote_code: bool) -> torch.nn.Module:
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises several types for non-checkpoint files
        raise ValueError(f"doremi `reference` {str(path)!r} could not be read as a torch checkpoint ({e})") from e
    try:
        hf_state = ckpt["state"]["integrations"]["huggingface"]
        model_sd = ckpt["state"]["model"]
    except (KeyError, TypeError) as e:
        raise ValueError(
            f"doremi `reference` {str(path)!r} is not a Composer checkpoint of a HuggingFaceModel "
            f"(missing {e}); give the reference run's checkpoint or a Hugging Face directory"
        ) from e
    config = get_hf_config_from_composer_state_dict(ckpt)
    if base_model is not None:
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
            base_model, local_files_only=True, trust_remote_code=trust_remote_code
        )
    else:
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    peft_cfg = hf_state["model"].get("peft_config")
    if peft_cfg is not None:
        from peft import get_peft_config, get_peft_model

        content = dict(peft_cfg["content"])
        content["base_model_name_or_path"] = base_model or content.get("base_model_name_or_path") or ""
        model = get_peft_model(model, get_peft_config(content))  # type: ignore[arg-type]
    # HuggingFaceModel keeps the transformers model as `.model`; strip that prefix.
    state = {k.removeprefix("model."): v for k, v in model_sd.items()}
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(
            f"doremi `reference` {str(path)!r}: checkpoint weights do not fit the rebuilt model; unexpected "
            f"keys {result.unexpected_keys[:5]} ({len(result.unexpected_keys)} in all)"
        )
    if result.missing_keys:
        adapter_only = peft_cfg is not None and all("lora_" not in k for k in result.missing_keys)
        if not adapter_only or base_model is None:
            hint = (
                "the checkpoint holds only the LoRA adapter weights; set `reference_base_model` to the base model "
                "the reference run started from"
                if adapter_only
                else "the checkpoint does not match the model"
            )
            raise ValueError(
                f"doremi `reference` {str(path)!r}: missing weights {result.missing_keys[:5]} "
                f"({len(result.missing_keys)} in all); {hint}"
            )
    if peft_cfg is not None:
        model = model.merge_and_unload()  # type: ignore[operator]  # PeftModel: plain model, faster forward
    assert isinstance(model, (PreTrainedModel, torch.nn.Module))
    log.info("doremi: loaded reference from %s (%s)", path, type(model).__name__)
    return model
