"""Prompt templates, chat-template prompts and batched greedy decoding (left padding, stop at EOS) for evaluation."""

# Shapes: B prompts in a batch, T padded prompt tokens, S = T + generated tokens, N generated tokens.

from __future__ import annotations

import logging
import string
from collections.abc import Mapping, Sequence

import torch
from tqdm.auto import tqdm

from pipeline.prompts import chat_prompt_affixes

__all__ = [
    "METAMATH_PROMPT",
    "chat_prompt_ids",
    "default_dtype",
    "format_prompt",
    "generate_greedy",
    "resolve_device",
]

log = logging.getLogger(__name__)

#: MetaMath's evaluation prompt (its ``eval_gsm8k.py``/``eval_math.py``): Alpaca without input,
#: with "Let's think step by step." opening the response.
METAMATH_PROMPT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{query}\n\n### Response: Let's think step by step."
)

# A base model that keeps going after its answer starts a new Alpaca turn; cut it there.
_DEFAULT_STOPS = ("\n### Instruction", "\n\n### Input")


def format_prompt(template: str, fields: Mapping[str, str]) -> str:
    """Fill a ``str.format`` template, with an error that names a missing placeholder.

    Args:
        template: e.g. `METAMATH_PROMPT` (placeholder ``{query}``).
        fields: Values for the placeholders.

    Returns:
        The prompt.

    Raises:
        ValueError: If the template uses a placeholder not in ``fields`` (write literal braces as
            ``{{``/``}}``).
    """
    names = {name for _, name, _, _ in string.Formatter().parse(template) if name}
    missing = sorted(names - set(fields))
    if missing:
        raise ValueError(
            f"prompt template uses placeholder(s) {missing} but only {sorted(fields)} are available; "
            "write literal braces as '{{' and '}}'"
        )
    return template.format_map(dict(fields))


def chat_prompt_ids(tokenizer, messages: Sequence[str], *, name: str | None = None) -> list[list[int]]:
    """The token ids of each message as the user turn of the tokenizer's chat template, the assistant's turn opened.

    Built as `tools/shard.py --prompt-template chat` builds the prompt of a fine-tuning example
    (`pipeline.sharding`): the ids `pipeline.prompts.chat_prompt_affixes` gives around the message,
    the message encoded on its own with special-token text kept as text (a question holding
    "<|im_end|>" cannot end its turn). So evaluation sees the fine-tuning prompt token for token.

    Args:
        tokenizer: A transformers tokenizer with a chat template.
        messages: The user messages (`pipeline.prompts.render_prompt("chat", ...)`).
        name: How an error names the tokenizer (default: its ``name_or_path``).

    Returns:
        One list of token ids per message.

    Raises:
        ValueError: If the tokenizer has no chat template, or its template does not render the
            message exactly once.
    """
    name = name or f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r}"
    prefix, suffix = chat_prompt_affixes(tokenizer, name=name)
    if not messages:
        return []
    encoded = tokenizer(list(messages), add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return [[*prefix, *ids, *suffix] for ids in encoded]


def resolve_device(device: str | None = None) -> torch.device:
    """``device`` if given, else CUDA when available, else CPU."""
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPU (halves memory, what the models were trained in), fp32 on CPU (bf16 matmuls are slow there)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@torch.inference_mode()
def generate_greedy(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    batch_size: int = 8,
    max_new_tokens: int = 512,
    stop_strings: Sequence[str] = _DEFAULT_STOPS,
    show_progress: bool = True,
    desc: str = "generate",
) -> list[str]:
    """Greedy-decode a completion for every prompt, in batches.

    Prompts are sorted by token length (longest first, so an out-of-memory error shows up in
    the first batch and padding is minimal), left-padded, decoded greedily until EOS or
    ``max_new_tokens``, and returned in the input order. Only the new tokens are decoded;
    special tokens are dropped and the text is cut at the first of ``stop_strings``.
    A prompt given as token ids (`chat_prompt_ids`) is used as it is.

    Args:
        model: A Hugging Face causal LM (``generate``-capable), already on its device.
        tokenizer: Its tokenizer. Without a pad token the EOS token is used for padding.
        prompts: Prompt strings (encoded with the tokenizer's special tokens) or token-id lists.
        batch_size: Prompts per ``generate`` call (default 8).
        max_new_tokens: Generation budget per prompt (default 512).
        stop_strings: Completions are truncated at the first occurrence of any of these.
        show_progress: Show a tqdm bar over prompts (default True).
        desc: Progress-bar label.

    Returns:
        One completion per prompt.

    Raises:
        ValueError: For a non-positive ``batch_size``/``max_new_tokens``, or a tokenizer with
            neither a pad nor an EOS token.
    """
    from transformers import GenerationConfig

    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
    if max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be >= 1, got {max_new_tokens}")
    if tokenizer.eos_token_id is None and tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has neither an EOS nor a pad token; set `eos_token` in its config")
    if tokenizer.pad_token_id is None:
        log.info("tokenizer has no pad token; padding with EOS %r", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    if not prompts:
        return []

    texts = [p for p in prompts if isinstance(p, str)]
    encoded_texts = iter(tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else [])
    encoded = [list(next(encoded_texts)) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: -len(encoded[i]))
    config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    completions: list[str] = [""] * len(prompts)
    try:
        with tqdm(total=len(prompts), desc=desc, disable=not show_progress, unit="prompt") as bar:
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                texts = _generate_batch(model, tokenizer, [encoded[i] for i in idx], device, config)
                for i, text in zip(idx, texts):
                    completions[i] = _truncate(text, stop_strings)
                bar.update(len(idx))
    finally:
        model.train(was_training)
    return completions


def _generate_batch(
    model: torch.nn.Module, tokenizer, prompts: list[list[int]], device: torch.device, config
) -> list[str]:
    """The decoded new tokens (special tokens dropped) of one ``generate`` call over token-id prompts, left-padded
    (generation continues from the last position of every row)."""
    width = max(len(ids) for ids in prompts)
    input_ids_BT = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids_BT[row, width - len(ids) :] = torch.as_tensor(ids, dtype=torch.long)
        attention_mask_BT[row, width - len(ids) :] = 1
    input_ids_BT, attention_mask_BT = input_ids_BT.to(device), attention_mask_BT.to(device)
    out_BS = model.generate(  # type: ignore[operator]
        input_ids=input_ids_BT, attention_mask=attention_mask_BT, generation_config=config
    )
    new_BN = out_BS[:, input_ids_BT.shape[1] :]
    return tokenizer.batch_decode(new_BN, skip_special_tokens=True)


def _truncate(text: str, stops: Sequence[str]) -> str:
    """Cut at the earliest stop string."""
    cut = min((p for p in (text.find(s) for s in stops) if p >= 0), default=len(text))
    return text[:cut]
