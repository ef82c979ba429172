"""Load a causal LM for evaluation from a Hugging Face folder, a GGUF file, a PEFT adapter or a Composer checkpoint."""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from pipeline.evaluation.generate import default_dtype, resolve_device
from pipeline.gguf import gguf_model_dir, is_gguf, resolve_pretrained

__all__ = ["find_tokenizer", "load_composer_checkpoint", "load_model_and_tokenizer", "load_tokenizer"]

log = logging.getLogger(__name__)


def load_model_and_tokenizer(
    model_path: str | Path,
    *,
    adapter: str | Path | None = None,
    tokenizer: str | Path | None = None,
    base_model: str | Path | None = None,
    device: str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.nn.Module, Any]:
    """Load a model (LoRA merged) and its tokenizer from local files only, ready for generation.

    ``model_path`` may be:

    - a Hugging Face model folder (``config.json`` + weights);
    - a ``.gguf`` file, converted once to a cached model folder (`pipeline.gguf.gguf_model_dir`);
    - a PEFT adapter folder (``adapter_config.json``): the base is ``base_model`` or the adapter's
      ``base_model_name_or_path``, which must be a local folder;
    - a Composer checkpoint file (``.pt``) of a ``composer.models.HuggingFaceModel``; see
      `load_composer_checkpoint`.

    A separate ``adapter`` folder is applied on top and merged (``merge_and_unload``), so the
    result is a plain ``transformers`` model either way.

    Every folder argument also accepts a ``.gguf`` file (its converted folder is used).

    Args:
        model_path: Model folder, ``.gguf`` file, adapter folder or Composer checkpoint file.
        adapter: Optional PEFT adapter folder to merge into the model.
        tokenizer: Tokenizer folder (default: the one stored in the Composer checkpoint, else the
            model, base-model or adapter folder, whichever has tokenizer files).
        base_model: Base model folder for adapter-only inputs (a PEFT folder or a Composer
            checkpoint saved with ``should_save_peft_only``).
        device: ``"cuda"``, ``"cpu"``, ... (default: CUDA when available).
        dtype: Weight dtype (default: bf16 on GPU, fp32 on CPU).

    Returns:
        ``(model, tokenizer)``, the model in eval mode on ``device``.

    Raises:
        FileNotFoundError: If a path does not exist (hub names are not downloaded).
        ValueError: If a folder is neither a model nor an adapter, no base model can be found for
            an adapter, or no tokenizer can be found.
    """
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    dtype = dtype or default_dtype(dev)
    path = _existing(model_path, "model_path")
    stored_tokenizer = None

    if path.is_file():
        model, stored_tokenizer = load_composer_checkpoint(path, base_model=base_model, dtype=dtype)
    elif (path / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, local_files_only=True)
    elif (path / "adapter_config.json").exists():
        base = _base_for_adapter(path, base_model)
        model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=dtype, local_files_only=True)
        model = _merge_adapter(model, path)
    else:
        raise ValueError(
            f"`model_path` {path} is a folder without config.json or adapter_config.json; pass a Hugging "
            "Face model folder, a PEFT adapter folder or a Composer checkpoint file (.pt)"
        )
    if adapter is not None:
        model = _merge_adapter(model, _existing(adapter, "adapter"))

    tok = _choose_tokenizer(tokenizer, stored_tokenizer, _tokenizer_dirs(path, adapter, base_model))

    model = model.to(device=dev, dtype=dtype).eval()
    return model, tok


def find_tokenizer(
    model_path: str | Path,
    *,
    adapter: str | Path | None = None,
    tokenizer: str | Path | None = None,
    base_model: str | Path | None = None,
) -> Any | None:
    """The tokenizer `load_model_and_tokenizer` returns for these arguments, loaded without the model.

    So a problem with the tokenizer shows before the model loads. None when only loading the
    model tells: a Composer checkpoint without ``tokenizer`` (it may hold its own), or a
    folder `load_model_and_tokenizer` refuses.

    Args:
        model_path, adapter, tokenizer, base_model: As for `load_model_and_tokenizer`.

    Raises:
        FileNotFoundError: If a path does not exist.
        ValueError: If no tokenizer can be found (the error `load_model_and_tokenizer` would raise).
    """
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    path = _existing(model_path, "model_path")
    if path.is_file() or not ((path / "config.json").exists() or (path / "adapter_config.json").exists()):
        return None
    return _choose_tokenizer(None, None, _tokenizer_dirs(path, adapter, base_model))


def load_tokenizer(path: str | Path):
    """``AutoTokenizer`` from a local folder or ``.gguf`` file (no downloads)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_existing(path, "tokenizer"), local_files_only=True)


def load_composer_checkpoint(
    path: str | Path,
    *,
    base_model: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
) -> tuple[torch.nn.Module, Any]:
    """Rebuild the Hugging Face model (and tokenizer) stored in a Composer checkpoint.

    The one reader of Composer checkpoints in the project: evaluation and DoReMi's reference model
    both load through it.

    Composer's ``HuggingFaceModel`` writes the model config, class, PEFT config and tokenizer files
    under ``state.integrations.huggingface`` and the weights, prefixed ``model.``, under
    ``state.model`` (see ``HuggingFaceModel.get_metadata`` and ``hf_from_composer_checkpoint``).
    The architecture is built without random initialisation and the weights are loaded strictly.
    For a LoRA model, a checkpoint saved with ``should_save_peft_only=True`` (Composer's default)
    holds only the adapter tensors: the base weights then come from ``base_model``, or from the
    PEFT config's ``base_model_name_or_path`` / the model config's ``_name_or_path`` when those
    name a local folder. The adapter is merged into the base.

    Only monolithic checkpoints are read (not FSDP sharded ones); the file is unpickled, so load
    only checkpoints you trust.

    Args:
        path: Checkpoint file.
        base_model: Base model folder for adapter-only checkpoints.
        dtype: dtype the base model is loaded in (the result is cast by the caller).
        trust_remote_code: passed to transformers.

    Returns:
        ``(model, tokenizer or None)``.

    Raises:
        ValueError: If the file cannot be read as a torch checkpoint, is not a Composer
            ``HuggingFaceModel`` checkpoint, weights do not
            match the stored architecture, or an adapter-only checkpoint has no local base model.
    """
    from composer.models.huggingface import (
        HuggingFaceModel,
        get_hf_config_from_composer_state_dict,
        get_peft_config_from_composer_state_dict,
    )
    from composer.utils.checkpoint import safe_torch_load

    path = _existing(path, "checkpoint")
    try:
        state = safe_torch_load(str(path))
    except Exception as err:  # torch raises several types for files that are not checkpoints
        raise ValueError(f"{path} could not be read as a torch checkpoint ({err})") from err
    hf_state, weights = _huggingface_parts(state, path)
    config = get_hf_config_from_composer_state_dict(state)
    peft_config = get_peft_config_from_composer_state_dict(state)
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(weights, "model.")

    if peft_config is None:
        model = _build_empty(config, trust_remote_code)
        _load_strict(model, weights, path)
    else:
        model = _load_lora(path, weights, config, peft_config, base_model, dtype, trust_remote_code)
    model.tie_weights()

    tokenizer = None
    if hf_state.get("tokenizer"):
        # Composer writes the tokenizer files to a folder; slow tokenizers keep reading from it, so it
        # must outlive this call.
        save_dir = tempfile.mkdtemp(prefix="composer-tokenizer-")
        tokenizer = HuggingFaceModel.load_huggingface_tokenizer_from_saved_state(
            hf_state, tokenizer_save_dir=save_dir
        )
    return model.to(dtype), tokenizer


def _choose_tokenizer(tokenizer: str | Path | None, stored_tokenizer: Any, tokenizer_dirs: list[Path]) -> Any:
    """The tokenizer: ``tokenizer`` if given, else the checkpoint's, else the first of ``tokenizer_dirs`` with tokenizer files."""
    if tokenizer is not None:
        return load_tokenizer(_existing(tokenizer, "tokenizer"))
    if stored_tokenizer is not None:
        return stored_tokenizer
    found = next((d for d in tokenizer_dirs if _has_tokenizer(d)), None)
    if found is None:
        searched = ", ".join(str(d) for d in tokenizer_dirs) or "(nothing)"
        raise ValueError(f"no tokenizer files found in {searched}; pass `tokenizer` (--tokenizer DIR)")
    return load_tokenizer(found)


def _tokenizer_dirs(path: Path, adapter: str | Path | None, base_model: str | Path | None) -> list[Path]:
    """The folders a tokenizer is looked for in, in order, when none is named and the checkpoint holds none."""
    dirs: list[Path] = []
    if path.is_dir() and (path / "config.json").exists():
        dirs.append(path)
    elif path.is_dir() and (path / "adapter_config.json").exists():
        dirs += [path, _base_for_adapter(path, base_model)]
    if adapter is not None:
        dirs.append(_existing(adapter, "adapter"))
    if base_model is not None:
        dirs.append(Path(resolve_pretrained(base_model, "base_model")))
    return dirs


def _huggingface_parts(state: Any, path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(state.integrations.huggingface, a copy of state.model)`` of a Composer checkpoint."""
    try:
        hf_state = state["state"]["integrations"]["huggingface"]
        weights = dict(state["state"]["model"])
    except (KeyError, TypeError) as err:
        raise ValueError(
            f"{path} is not a Composer checkpoint of a HuggingFaceModel (missing state.integrations.huggingface "
            f"or state.model: {err}); only monolithic checkpoints are read, not sharded FSDP ones"
        ) from err
    return hf_state, weights


def _load_lora(
    path: Path,
    weights: dict[str, torch.Tensor],
    config,
    peft_config,
    base_model: str | Path | None,
    dtype: torch.dtype,
    trust_remote_code: bool,
) -> torch.nn.Module:
    """The LoRA model of a Composer checkpoint, its adapter merged into the base (adapter-only: a local base model)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    adapter_only = all("lora_" in k for k in weights)
    if adapter_only:
        base_dir = _base_for_composer(path, base_model, peft_config, config)
        base = AutoModelForCausalLM.from_pretrained(
            base_dir, torch_dtype=dtype, local_files_only=True, trust_remote_code=trust_remote_code
        )
    else:
        base = _build_empty(config, trust_remote_code)
    peft_model = get_peft_model(base, peft_config)
    result = peft_model.load_state_dict(weights, strict=False)
    missing = [k for k in result.missing_keys if "lora_" in k or not adapter_only]
    missing = _drop_tied(peft_model, missing)
    if result.unexpected_keys or missing:
        raise ValueError(
            f"{path}: weights do not match the stored LoRA model: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {result.unexpected_keys[:5]}"
        )
    return peft_model.merge_and_unload()


def _build_empty(config, trust_remote_code: bool = False) -> torch.nn.Module:
    """The architecture without spending time on random initialisation (weights come next)."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.modeling_utils import no_init_weights
    except ImportError:  # older/newer transformers: fall back to a normal (slower) init
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def _load_strict(model: torch.nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """load_state_dict that tolerates only tied weights being absent."""
    result = model.load_state_dict(weights, strict=False)
    missing = _drop_tied(model, list(result.missing_keys))
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{path}: weights do not match the stored config: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {result.unexpected_keys[:5]}"
        )


def _drop_tied(model: torch.nn.Module, missing: list[str]) -> list[str]:
    """Missing keys minus output embeddings that are tied to the input embeddings."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "tie_word_embeddings", False):
        return missing
    return [k for k in missing if not k.endswith("lm_head.weight")]


def _merge_adapter(model: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """Apply a PEFT adapter folder and fold it into the weights."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()


def _base_for_adapter(adapter_dir: Path, base_model: str | Path | None) -> Path:
    """Base model folder of a PEFT adapter folder."""
    if base_model is not None:
        return _existing(base_model, "base_model")
    with open(adapter_dir / "adapter_config.json", encoding="utf-8") as f:
        named = json.load(f).get("base_model_name_or_path")
    if named and Path(named).is_dir():
        return Path(named)
    raise ValueError(
        f"adapter {adapter_dir} names base_model_name_or_path={named!r}, which is not a local folder; "
        "pass `base_model` (--base-model DIR)"
    )


def _base_for_composer(path: Path, base_model: str | Path | None, peft_config, config) -> Path:
    """Base model folder for an adapter-only Composer checkpoint."""
    if base_model is not None:
        return _existing(base_model, "base_model")
    names = [getattr(peft_config, "base_model_name_or_path", None), getattr(config, "_name_or_path", None)]
    for named in names:
        if named and Path(named).is_dir():
            return Path(named)
    raise ValueError(
        f"{path} holds only LoRA weights (saved with should_save_peft_only) and its base "
        f"{[n for n in names if n]} is not a local folder; pass `base_model` (--base-model DIR)"
    )


def _has_tokenizer(folder: Path) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return folder.is_dir() and any((folder / n).exists() for n in names)


def _existing(path: str | Path, field: str) -> Path:
    """The local file or folder; a ``.gguf`` file as its converted model folder (converted once, then cached)."""
    if is_gguf(path):
        return gguf_model_dir(path, field=field)
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"`{field}` {p} does not exist (only local files are read; nothing is downloaded)")
    return p
