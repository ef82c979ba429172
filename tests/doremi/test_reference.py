"""Loading DoReMi's reference from a Hugging Face directory and from Composer checkpoints (full and LoRA)."""

from __future__ import annotations

import pytest
import torch
from composer import Trainer
from composer.models import HuggingFaceModel
from peft import LoraConfig
from torch.utils.data import DataLoader

from composer_algos.doremi import freeze_reference, load_reference_model
from tests.common.models import tiny_llama


def _loader():
    gen = torch.Generator().manual_seed(0)
    data = []
    for _ in range(4):
        ids = torch.randint(0, 128, (10,), generator=gen)
        data.append({"input_ids": ids, "attention_mask": torch.ones(10, dtype=torch.long), "labels": ids.clone()})
    return DataLoader(data, batch_size=4)


def _train_and_save(tmp_path, model: HuggingFaceModel) -> str:
    trainer = Trainer(
        model=model, train_dataloader=_loader(), max_duration="1ba", device="cpu", seed=0,
        optimizers=torch.optim.SGD(model.parameters(), lr=1.0),
        save_folder=str(tmp_path / "ckpt"), save_filename="ref.pt", save_interval="1ba", progress_bar=False,
        log_to_console=False,
    )
    trainer.fit()
    trainer.close()
    return str(tmp_path / "ckpt" / "ref.pt")


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.arange(1, 13).view(2, 6)


def test_full_checkpoint_reproduces_trained_model(tmp_path):
    model = HuggingFaceModel(tiny_llama(seed=0), use_logits=True)
    path = _train_and_save(tmp_path, model)
    ref = load_reference_model(path)
    # Trained weights (lr 1.0 moved them), not a fresh init.
    assert not torch.allclose(_logits(ref, IDS), _logits(tiny_llama(seed=0), IDS))
    torch.testing.assert_close(_logits(ref, IDS), _logits(model.model, IDS))


def test_lora_checkpoint_needs_base_and_merges_adapters(tmp_path):
    base = tiny_llama(seed=0)
    base.save_pretrained(tmp_path / "base")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = HuggingFaceModel(tiny_llama(seed=0), use_logits=True, peft_config=lora)
    path = _train_and_save(tmp_path, model)
    with pytest.raises(ValueError, match="reference_base_model"):
        load_reference_model(path)
    ref = load_reference_model(path, base_model=str(tmp_path / "base"))
    assert "lora" not in " ".join(n for n, _ in ref.named_parameters())  # merged
    expected = _logits(model.model, IDS)
    assert not torch.allclose(expected, _logits(tiny_llama(seed=0), IDS))  # the adapters changed something
    torch.testing.assert_close(_logits(ref, IDS), expected, rtol=1e-4, atol=1e-5)


def test_lora_checkpoint_finds_a_local_base_by_itself(tmp_path):
    # The reference is read by the one Composer-checkpoint reader (pipeline.evaluation.checkpoint),
    # which takes the base weights from the local folder the adapter's config names.
    tiny_llama(seed=0).save_pretrained(tmp_path / "base")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", local_files_only=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = HuggingFaceModel(base, use_logits=True, peft_config=lora)
    path = _train_and_save(tmp_path, model)
    ref = load_reference_model(path)
    torch.testing.assert_close(_logits(ref, IDS), _logits(model.model, IDS), rtol=1e-4, atol=1e-5)


def test_hf_directory_and_module_forms(tmp_path):
    model = tiny_llama(seed=2)
    model.save_pretrained(tmp_path / "hf")
    loaded = load_reference_model(tmp_path / "hf")
    torch.testing.assert_close(_logits(loaded, IDS), _logits(model, IDS))
    assert load_reference_model(model) is model
    wrapped = HuggingFaceModel(model, use_logits=True)
    assert load_reference_model(wrapped) is model


def test_freeze_reference():
    model = freeze_reference(tiny_llama(seed=0).train(), "cpu")
    assert not model.training and not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(("make", "match"), [
    (lambda p: p / "missing.pt", "does not exist"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "config.json"),
    (lambda p: (p / "junk.pt").write_text("junk") and p / "junk.pt", "torch checkpoint"),
    (lambda p: torch.save({"state": {}}, p / "other.pt") or p / "other.pt", "not a Composer checkpoint"),
])
def test_bad_references(tmp_path, make, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load_reference_model(make(tmp_path))
