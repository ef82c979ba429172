"""Exact-match accuracy of greedy answers (issue 29.3): the metric on hand-made generations, and the generation path."""

from __future__ import annotations

import pytest
import torch

from pipeline.evaluation.heldout_answers import (
    HeldoutQuestion,
    answer_accuracy,
    answer_is_correct,
    generate_from_ids,
    reference_answer,
)


@pytest.mark.parametrize(
    ("completion", "reference", "correct"),
    [
        ("The answer is: 26", "26", True),  # the right number
        ("The answer is: 26 apples, as 13 + 13 = 26", "26", True),  # with extra words
        ("I think it is 26.", "26", True),  # no answer line: the first line's number
        ("The answer is: 27", "26", False),  # a wrong number
        ("The answer is: 260", "26", False),
        ("13 + 13, so the answer is: 25", "26", False),  # the stated answer counts, not a number on the way
        ("", "26", False),  # empty
        ("   \n", "26", False),
        ("The answer is: -1/3", "-1/3", True),
        ("The answer is: -0.3333333333", "-1/3", True),  # the same number within float noise
        ("The answer is: -0.33", "-1/3", False),
        ("The answer is: True", "True", True),
        ("The answer is: False", "True", False),
        ("The answer is: b", "b", True),  # an option letter
        ("The answer is: c", "b", False),
        ("The answer is: 3*x**2 + 2", "3*x**2 + 2", True),
    ],
)
def test_accuracy_metric_on_hand_made_generations(completion, reference, correct):
    assert answer_is_correct(completion, reference) is correct


def test_reference_answer_is_the_stated_answer():
    assert reference_answer("The answer is: 42") == "42"
    assert reference_answer("Some work. The answer is: x + 1") == "x + 1"
    assert reference_answer(" 7 ") == "7"


class _Echo(torch.nn.Module):
    """A stand-in causal LM whose greedy continuation of a row is its last token + 1, + 2, ... (mod 32)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.calls, self.widths = 0, []

    def generate(self, *, input_ids, attention_mask, generation_config):
        self.calls += 1
        self.widths.append(input_ids.shape[1])
        # Left padding: every row's prompt ends in the last column, its padding is masked at the start.
        assert bool((attention_mask[:, -1] == 1).all())
        steps = torch.arange(1, generation_config.max_new_tokens + 1).unsqueeze(0)
        return torch.cat([input_ids, (input_ids[:, -1:] + steps) % 32], dim=1)


def test_generate_from_ids_left_pads_keeps_order_and_cuts_at_eos():
    model = _Echo()
    prompts = [[1, 2, 3], [5], [7, 8]]
    out = generate_from_ids(model, prompts, pad_id=0, eos_id=9, max_new_tokens=4, batch_size=2)
    assert out == [[4, 5, 6, 7], [6, 7, 8], []]  # cut before EOS 9; the last prompt meets it at once
    assert model.calls == 2 and model.widths == [3, 1]  # longest first: [1, 2, 3] with [7, 8], then [5]


def test_answer_accuracy_per_domain_and_unweighted_average():
    class Tok:
        pad_token_id, eos_token_id = 0, 9

        def decode(self, tokens, skip_special_tokens=True):
            return {(4, 5): "The answer is: 4", (6, 7): "The answer is: 5"}.get(tuple(tokens[:2]), "")

    questions = [
        HeldoutQuestion("a", (3,), "4"),  # continues 4, 5 -> "4": right
        HeldoutQuestion("a", (5,), "4"),  # continues 6, 7 -> "5": wrong
        HeldoutQuestion("b", (3,), "4"),  # right
    ]
    result = answer_accuracy(_Echo(), Tok(), questions, max_new_tokens=2)
    assert result["per_domain"] == {"a": 0.5, "b": 1.0} and result["average"] == 0.75
    assert [r["correct"] for r in result["records"]] == [True, False, True]
