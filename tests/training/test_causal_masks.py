"""`composer_algos.causal_masks`: forwards of unpacked rows keep SDPA's causal path under transformers 4.53."""

from __future__ import annotations

import pytest
import torch
from transformers import masking_utils

from composer_algos.causal_masks import packs_by_position, unpacked_rows, unpacked_rows_for
from composer_algos.models.causal_lm import DomainCausalLM
from tests.common.models import tiny_llama

pytestmark = pytest.mark.skipif(not packs_by_position(), reason="this transformers has no packed-sequence detection")


def _sdpa_llama() -> torch.nn.Module:
    model = tiny_llama(seed=3).eval()
    model.config._attn_implementation = "sdpa"
    return model


@pytest.fixture
def sdpa_calls(monkeypatch) -> list[tuple[bool, bool]]:
    """(mask given, is_causal) of every SDPA call in the test."""
    calls: list[tuple[bool, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is not None, bool(kwargs.get("is_causal"))))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def test_a_forward_without_a_cache_builds_a_mask_outside_and_takes_the_causal_path_inside(sdpa_calls):
    model = _sdpa_llama()
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        assert sdpa_calls and all(masked and not causal for masked, causal in sdpa_calls), sdpa_calls
        sdpa_calls.clear()
        with unpacked_rows():
            fast = model(input_ids=ids, use_cache=False).logits
    assert sdpa_calls and all(causal and not masked for masked, causal in sdpa_calls), sdpa_calls
    # The packed mask of default positions is the causal mask: the same logits (bit for bit on this CPU).
    torch.testing.assert_close(fast, plain, rtol=0, atol=1e-6)


def test_packed_rows_keep_their_mask():
    model = _sdpa_llama()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    packed = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        reference = model(input_ids=ids, position_ids=packed, use_cache=False).logits
        with unpacked_rows_for({"input_ids": ids, "position_ids": packed}):
            kept = model(input_ids=ids, position_ids=packed, use_cache=False).logits
        # The second sequence sees only itself: its logits equal a forward of it alone.
        alone = model(input_ids=ids[:, 6:], use_cache=False).logits
    torch.testing.assert_close(kept, reference, rtol=0, atol=0)
    torch.testing.assert_close(kept[:, 6:], alone, rtol=1e-5, atol=1e-5)


def test_the_detector_is_restored_after_nested_contexts_and_errors():
    own = masking_utils.find_packed_sequence_indices
    with unpacked_rows():
        with unpacked_rows():
            assert masking_utils.find_packed_sequence_indices is not own
        assert masking_utils.find_packed_sequence_indices is not own  # the outer context still holds
    assert masking_utils.find_packed_sequence_indices is own
    with pytest.raises(RuntimeError, match="boom"), unpacked_rows():
        raise RuntimeError("boom")
    assert masking_utils.find_packed_sequence_indices is own


def test_the_composer_model_trains_on_the_causal_path(sdpa_calls):
    composer_model = DomainCausalLM(_sdpa_llama())
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids.clone()}
    loss = composer_model.loss(composer_model(batch), batch)
    loss.backward()
    assert sdpa_calls and all(causal and not masked for masked, causal in sdpa_calls), sdpa_calls
    assert masking_utils.find_packed_sequence_indices.__module__ == "transformers.masking_utils"
