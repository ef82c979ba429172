"""Model loading: Hugging Face folders, PEFT adapters (merged) and Composer checkpoints give the same logits."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from pipeline.evaluation.checkpoint import load_model_and_tokenizer
from tests.common.models import tiny_llama

INPUT_IDS = torch.tensor([[5, 17, 300, 42, 9, 1000]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT_IDS).logits


def _lora_model(tokenizer, seed=0):
    """Tiny Llama (seed 0, as saved in `tiny_model_dir`) with a LoRA whose B is random, so merging matters."""
    base = tiny_llama(seed=0, vocab_size=len(tokenizer), max_position_embeddings=1024)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    return get_peft_model(base, cfg).eval()


def test_hf_folder(tiny_model_dir, tokenizer):
    model, tok = load_model_and_tokenizer(tiny_model_dir, device="cpu")
    expected = _logits(tiny_llama(seed=0, vocab_size=len(tokenizer), max_position_embeddings=1024))
    torch.testing.assert_close(_logits(model), expected)
    assert len(tok) == len(tokenizer) and not model.training
    assert next(model.parameters()).dtype == torch.float32  # fp32 on CPU by default


def test_adapter_is_merged(tmp_path, tiny_model_dir, tokenizer):
    peft_model = _lora_model(tokenizer)
    expected = _logits(peft_model)
    base_logits = _logits(tiny_llama(seed=0, vocab_size=len(tokenizer), max_position_embeddings=1024))
    assert not torch.allclose(expected, base_logits)  # the adapter changes the output
    peft_model.save_pretrained(tmp_path / "adapter")

    merged, _ = load_model_and_tokenizer(tiny_model_dir, adapter=tmp_path / "adapter", device="cpu")
    assert type(merged).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(_logits(merged), expected, atol=1e-5, rtol=1e-5)

    # The adapter folder alone, with its base named explicitly; the tokenizer comes from the base.
    alone, tok = load_model_and_tokenizer(tmp_path / "adapter", base_model=tiny_model_dir, device="cpu")
    torch.testing.assert_close(_logits(alone), expected, atol=1e-5, rtol=1e-5)
    assert len(tok) == len(tokenizer)


def test_missing_paths_and_base(tmp_path, tiny_model_dir, tokenizer):
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        load_model_and_tokenizer(tmp_path / "Qwen2.5-3B", device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="without config.json or adapter_config.json"):
        load_model_and_tokenizer(tmp_path / "empty", device="cpu")
    _lora_model(tokenizer).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match="--base-model"):
        load_model_and_tokenizer(tmp_path / "adapter", device="cpu")


def _composer_checkpoint(path, model, tokenizer, peft_config=None):
    """Save a real Composer checkpoint of a HuggingFaceModel (no training step needed)."""
    from composer import Trainer
    from composer.models import HuggingFaceModel
    from torch.utils.data import DataLoader

    wrapped = HuggingFaceModel(model, tokenizer=tokenizer, peft_config=peft_config, use_logits=True)
    batch = {"input_ids": torch.zeros(8, dtype=torch.long), "labels": torch.zeros(8, dtype=torch.long)}
    trainer = Trainer(
        model=wrapped,
        train_dataloader=DataLoader([batch], batch_size=1),
        max_duration="1ba",
        device="cpu",
        optimizers=torch.optim.SGD(wrapped.parameters(), lr=0.0),
        progress_bar=False,
        log_to_console=False,
        loggers=[],
    )
    trainer.save_checkpoint(str(path))
    trainer.close()
    return path


def test_composer_checkpoint_full_model(tmp_path, tokenizer):
    source = tiny_llama(seed=5, vocab_size=len(tokenizer), max_position_embeddings=1024)
    expected = _logits(source)
    ckpt = _composer_checkpoint(tmp_path / "ep0.pt", source, tokenizer)
    model, tok = load_model_and_tokenizer(ckpt, device="cpu")
    torch.testing.assert_close(_logits(model), expected)
    assert tok is not None and len(tok) == len(tokenizer)  # the tokenizer stored in the checkpoint


def test_composer_checkpoint_lora_only(tmp_path, tiny_model_dir, tokenizer):
    """Composer saves only the LoRA tensors by default: the base comes from --base-model, then merges."""
    base = tiny_llama(seed=0, vocab_size=len(tokenizer), max_position_embeddings=1024)
    torch.manual_seed(1)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    ckpt_model = get_peft_model(base, cfg)
    expected = _logits(ckpt_model.eval())
    ckpt = _composer_checkpoint(tmp_path / "lora.pt", ckpt_model, tokenizer)
    state = torch.load(ckpt, weights_only=False)
    assert all("lora_" in k for k in state["state"]["model"])  # really adapter-only

    with pytest.raises(ValueError, match="pass `base_model`"):
        load_model_and_tokenizer(ckpt, device="cpu")
    model, _ = load_model_and_tokenizer(ckpt, base_model=tiny_model_dir, device="cpu")
    assert type(model).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(_logits(model), expected, atol=1e-5, rtol=1e-5)


def test_not_a_composer_checkpoint(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="not a Composer checkpoint of a HuggingFaceModel"):
        load_model_and_tokenizer(path, device="cpu")
