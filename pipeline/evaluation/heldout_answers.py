"""Exact-match accuracy of greedy answers to held-out questions of fine-tuning shards, per domain.

The questions are the held-out part of each domain's validation split (`pipeline.holdout`: never
a selection guide), the same examples the per-domain loss is evaluated on. Each prompt (its
`prompt_ids`, in whatever template the shards were written with, e.g. the model's chat template)
is continued greedily with the KV cache, in left-padded batches; the answer is read from the
continuation and compared with the reference response's answer:

- the answer segment is the text after the last "The answer is" (MetaMath's and dm_math's answer
  line), else the continuation's first non-empty line;
- a numeric reference is matched by the first number of that segment (so "26 apples" answers 26,
  but 27 does not), any other reference (an expression, True/False, an option letter) by the
  segment itself, through `pipeline.evaluation.answers` (math-verify, then string equality).

Legend: B batch, T prompt length (left-padded), N new tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.evaluation.answers import extract_answer, final_answer_segment, is_equivalent, normalize_number

log = logging.getLogger(__name__)

__all__ = [
    "HeldoutQuestion",
    "answer_accuracy",
    "answer_is_contained",
    "answer_is_correct",
    "generate_from_ids",
    "heldout_datasets",
    "heldout_questions",
    "reference_answer",
]


@dataclass(frozen=True)
class HeldoutQuestion:
    """One held-out question: its domain, its prompt's token ids and the reference answer's text."""

    domain: str
    prompt_ids: tuple[int, ...]
    reference: str


def reference_answer(response: str) -> str:
    """The answer a reference response states: after its last "The answer is", else the whole text, stripped."""
    segment, _ = final_answer_segment(response)
    return (segment if segment is not None else response).strip()


def answer_is_correct(completion: str, reference: str) -> bool:
    """Whether a generated continuation states the reference answer (module docstring); an empty one never does."""
    segment, _ = final_answer_segment(completion)
    if segment is None:
        segment = next((line.strip() for line in completion.splitlines() if line.strip()), "")
    if not segment:
        return False
    kind = "number" if normalize_number(reference) is not None else "expression"
    prediction = extract_answer(f"The answer is: {segment}", kind)
    return is_equivalent(prediction, reference, kind)


def heldout_questions(datasets: Iterable[tuple[str, Any]], tokenizer: Any, *, per_domain: int) -> list[HeldoutQuestion]:
    """The first `per_domain` samples of each domain's held-out dataset as questions.

    Args:
        datasets: (domain, map-style dataset of fine-tuning samples with `prompt_ids` and
            `response_ids`), e.g. the per-domain evaluators' held-out subsets.
        tokenizer: decodes the reference responses.
        per_domain: questions per domain (fewer when a domain holds fewer).

    Raises:
        ValueError: a sample without `prompt_ids` / `response_ids` (pretraining shards have no answers).
    """
    out = []
    for domain, dataset in datasets:
        for i in range(min(per_domain, len(dataset))):
            sample = dataset[i]
            if "prompt_ids" not in sample or "response_ids" not in sample:
                raise ValueError(
                    f"answer accuracy needs fine-tuning shards (prompt_ids, response_ids); domain {domain!r} has "
                    f"{sorted(sample)}"
                )
            response = tokenizer.decode([int(t) for t in sample["response_ids"]], skip_special_tokens=True)
            out.append(HeldoutQuestion(domain, tuple(int(t) for t in sample["prompt_ids"]), reference_answer(response)))
    return out


def heldout_datasets(
    shard_dir: str, *, split: str = "val", guide_fraction: float = 0.5, domains: Sequence[str] | None = None
) -> list[tuple[str, Any]]:
    """(domain, held-out dataset) for each domain with samples in `split`: what the per-domain evaluators read."""
    from pipeline.dataset import DomainStreamingDataset
    from pipeline.holdout import heldout_subset
    from pipeline.loaders import eval_domains

    out = []
    for domain in eval_domains(shard_dir, split, domains):
        dataset = DomainStreamingDataset(shard_dir=shard_dir, split=split, domains=[domain], shuffle=False, batch_size=1)
        out.append((domain, heldout_subset(dataset, guide_fraction, what=f"answers of {domain}")))
    return out


@torch.inference_mode()
def generate_from_ids(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    pad_id: int,
    eos_id: int,
    max_new_tokens: int,
    batch_size: int = 16,
) -> list[list[int]]:
    """Greedy continuations (new token ids, up to EOS) of token-id prompts, in left-padded batches with the KV cache.

    Prompts are batched longest first (least padding); the model is put in eval mode for the call
    and restored after.
    """
    from transformers import GenerationConfig

    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size} and {max_new_tokens}")
    device = next(model.parameters()).device
    config = GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_id,
        use_cache=True,
    )
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids_BT = torch.full((len(idx), width), pad_id, dtype=torch.long)
            mask_BT = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                n = len(prompts[i])
                ids_BT[row, width - n :] = torch.as_tensor(prompts[i], dtype=torch.long)
                mask_BT[row, width - n :] = 1
            new_BN = model.generate(
                input_ids=ids_BT.to(device), attention_mask=mask_BT.to(device), generation_config=config
            )[:, width:].tolist()  # the one host transfer of the batch
            for row, i in enumerate(idx):
                tokens = new_BN[row]
                out[i] = tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens
    finally:
        model.train(was_training)
    return out


def answer_accuracy(
    model: Any,
    tokenizer: Any,
    questions: Sequence[HeldoutQuestion],
    *,
    max_new_tokens: int = 16,
    batch_size: int = 16,
) -> dict[str, Any]:
    """Generate and score every question.

    Returns:
        `{"per_domain": {domain: accuracy}, "average": the unweighted mean over domains,
        "contains_average": the same for `answer_is_contained`, "n": {domain: questions},
        "records": [{domain, reference, completion, correct, contains}]}`.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generated = generate_from_ids(
        model,
        [q.prompt_ids for q in questions],
        pad_id=int(pad),
        eos_id=int(tokenizer.eos_token_id),
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
    )
    records, right, near, total = [], {}, {}, {}
    for q, tokens in zip(questions, generated):
        completion = tokenizer.decode(tokens, skip_special_tokens=True)
        ok = answer_is_correct(completion, q.reference)
        contains = answer_is_contained(completion, q.reference)
        records.append(
            {"domain": q.domain, "reference": q.reference, "completion": completion, "correct": ok, "contains": contains}
        )
        right[q.domain] = right.get(q.domain, 0) + int(ok)
        near[q.domain] = near.get(q.domain, 0) + int(contains)
        total[q.domain] = total.get(q.domain, 0) + 1
    per_domain = {d: right[d] / total[d] for d in total}
    mean = lambda values: sum(values) / len(values) if values else float("nan")  # noqa: E731
    return {
        "per_domain": per_domain,
        "average": mean(list(per_domain.values())),
        "contains_average": mean([near[d] / total[d] for d in total]),
        "n": total,
        "records": records,
    }


def answer_is_contained(completion: str, reference: str) -> bool:
    """The lenient reading: the reference's text appears anywhere in the continuation (a stated answer or not).

    What a base model that answers at length gets credit for; the study reports it beside the
    exact-match accuracy for the floor only.
    """
    return bool(reference) and reference.replace(" ", "") in completion.replace(" ", "")
