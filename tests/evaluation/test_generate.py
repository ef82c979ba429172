"""Batched greedy decoding: left padding must not change any completion; prompts and inputs validated."""

from __future__ import annotations

import pytest
import torch

from pipeline.evaluation.generate import METAMATH_PROMPT, _truncate, format_prompt, generate_greedy
from pipeline.evaluation.math_eval import render_math_prompt
from tests.common.models import tiny_llama

PROMPTS = [
    "Q: 1+1?",
    "A much longer question about how many eggs Janet sells at the market every single day?",
    "Mid-length prompt: 7 * 6 =",
    "x",
]


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(seed=3, vocab_size=len(tokenizer), max_position_embeddings=256).eval()


def test_batched_equals_one_by_one(model, tokenizer):
    """Left padding + attention mask: every completion equals the unpadded single-prompt completion,
    in the input order, whatever the batch size."""
    alone = [generate_greedy(model, tokenizer, [p], batch_size=1, max_new_tokens=6, show_progress=False)[0] for p in PROMPTS]
    assert len(set(alone)) > 1  # the prompts lead to different text, so a mix-up would show
    for batch_size in (2, 4):
        batched = generate_greedy(model, tokenizer, PROMPTS, batch_size=batch_size, max_new_tokens=6, show_progress=False)
        assert batched == alone


def test_tokenizer_padding_side_is_restored(model, tokenizer):
    before = tokenizer.padding_side
    tokenizer.padding_side = "right"
    try:
        generate_greedy(model, tokenizer, PROMPTS[:2], batch_size=2, max_new_tokens=2, show_progress=False)
        assert tokenizer.padding_side == "right"
    finally:
        tokenizer.padding_side = before


def _spy_new_tokens(model, seen: list[int]):
    """Wrap `model.generate` to record how many tokens each call appended."""
    original = model.generate

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out.shape[1] - kwargs["input_ids"].shape[1])
        return out

    model.generate = spy
    return original


def test_greedy_is_deterministic_and_budgeted(model, tokenizer):
    seen: list[int] = []
    original = _spy_new_tokens(model, seen)
    try:
        a = generate_greedy(model, tokenizer, PROMPTS, batch_size=3, max_new_tokens=5, show_progress=False)
        b = generate_greedy(model, tokenizer, PROMPTS, batch_size=3, max_new_tokens=5, show_progress=False)
    finally:
        model.generate = original
    assert a == b
    assert seen == [5, 5, 5, 5]  # two calls x two batches, each stopped by the budget


def test_stops_at_eos(tokenizer):
    """With all-zero output weights every logit ties and greedy picks id 0, the EOS token here:
    generation must end at once with an empty completion."""
    assert tokenizer.eos_token_id == 0
    zero = tiny_llama(seed=0, vocab_size=len(tokenizer), max_position_embeddings=256).eval()
    with torch.no_grad():
        zero.lm_head.weight.zero_()
    seen: list[int] = []
    _spy_new_tokens(zero, seen)
    assert generate_greedy(zero, tokenizer, ["hello"], max_new_tokens=8, show_progress=False) == [""]
    assert seen == [1]


def test_empty_and_invalid_inputs(model, tokenizer):
    assert generate_greedy(model, tokenizer, [], show_progress=False) == []
    with pytest.raises(ValueError, match="`batch_size` must be >= 1"):
        generate_greedy(model, tokenizer, ["a"], batch_size=0)
    with pytest.raises(ValueError, match="`max_new_tokens` must be >= 1"):
        generate_greedy(model, tokenizer, ["a"], max_new_tokens=0)


def test_truncate_at_stop_strings():
    assert _truncate("The answer is: 4\n### Instruction:\nmore", ("\n### Instruction",)) == "The answer is: 4"
    assert _truncate("abc", ("zzz",)) == "abc"


def test_prompt_templates():
    assert render_math_prompt("metamath", "What is 2+2?") == METAMATH_PROMPT.format(query="What is 2+2?")
    assert render_math_prompt("metamath", "Q").endswith("### Instruction:\nQ\n\n### Response: Let's think step by step.")
    assert render_math_prompt("Q: {query}\nA:", "2+2?") == "Q: 2+2?\nA:"
    # A training template name from pipeline.prompts, so eval can use the fine-tuning prompt.
    assert render_math_prompt("alpaca", "Q").endswith("### Instruction:\nQ\n\n### Response:")
    with pytest.raises(ValueError, match=r"placeholder\(s\) \['answer'\]"):
        format_prompt("{query} {answer}", {"query": "q"})
    with pytest.raises(ValueError, match="prompt_template"):
        render_math_prompt("{question}", "q")
