"""Load DoReMi's frozen reference model from a Hugging Face directory or a Composer checkpoint."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from composer.models import HuggingFaceModel
from transformers import AutoModelForCausalLM

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
      merged after loading (read by `pipeline.evaluation.checkpoint.load_composer_checkpoint`).
      A LoRA checkpoint saved with Composer's default `should_save_peft_only=True` holds only
      the adapter weights, so the frozen base weights come from `base_model` (the same
      pretrained model the reference run started from) or the local folder the checkpoint names.

    Args:
        reference: The reference, in one of the forms above.
        base_model: Local directory with the base weights (for adapter-only checkpoints whose
            base is not a local folder named in the checkpoint).
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
    # The project's one Composer-checkpoint reader; its messages name the file, this adds the yaml key.
    from pipeline.evaluation.checkpoint import load_composer_checkpoint

    try:
        model, _ = load_composer_checkpoint(path, base_model=base_model, trust_remote_code=trust_remote_code)
    except ValueError as e:
        hint = (
            "; set `reference_base_model` to the base model the reference run started from"
            if "should_save_peft_only" in str(e)
            else ""
        )
        raise ValueError(f"doremi `reference` {str(path)!r}: {e}{hint}") from e
    log.info("doremi: loaded reference from %s (%s)", path, type(model).__name__)
    return model
