"""Prompt templates that turn an instruction (and optional input) into the prompt of a fine-tuning example."""

from __future__ import annotations

import functools
import logging
import string

logger = logging.getLogger(__name__)

__all__ = ["CHAT", "PROMPT_TEMPLATES", "chat_prompt_affixes", "resolve_prompt_template", "render_prompt"]

# name -> (template without input, template with input). "alpaca" is Stanford Alpaca's prompt,
# which MetaMath trains with (the loss covers only what follows "### Response:").
PROMPT_TEMPLATES: dict[str, tuple[str, str]] = {
    "alpaca": (
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Response:",
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:",
    ),
    "plain": ("{instruction}\n", "{instruction}\n{input}\n"),
    "none": ("{instruction}", "{instruction}\n\n{input}"),
    # The tokenizer's own chat template around the user turn (`chat_prompt_affixes`); these strings
    # are the user message it wraps (the instruction, and the input after a blank line).
    "chat": ("{instruction}", "{instruction}\n\n{input}"),
}
CHAT = "chat"
_FIELDS = {"instruction", "input"}


def resolve_prompt_template(template: str) -> tuple[str, str]:
    """Return the (without input, with input) pair for a template name or a custom string.

    A custom string must contain `{instruction}` and may contain `{input}`; literal braces are
    written `{{` and `}}`. A custom string without `{input}` serves both cases: a non-empty
    input is then appended to the instruction after a blank line.

    Args:
        template: One of `PROMPT_TEMPLATES` ("alpaca", "plain", "none") or a custom string.

    Returns:
        The two format strings.

    Raises:
        ValueError: If a custom string lacks `{instruction}`, uses another placeholder, or has
            unbalanced braces.
    """
    no_input, with_input, _ = _parse(template)
    return no_input, with_input


def render_prompt(template: str, instruction: str, input: str = "") -> str:  # noqa: A002 - the field's real name
    """Render the prompt of one example.

    Args:
        template: A template name or custom string (see `resolve_prompt_template`).
        instruction: The instruction or question.
        input: Optional context (Mol-Instructions' `input`); empty selects the no-input variant.

    Returns:
        The prompt text (the response is not included).

    Raises:
        ValueError: If `template` is invalid (see `resolve_prompt_template`).
    """
    no_input, with_input, has_input = _parse(template)
    if not input:
        return no_input.format(instruction=instruction, input="")
    if not has_input:
        return with_input.format(instruction=f"{instruction}\n\n{input}", input="")
    return with_input.format(instruction=instruction, input=input)


@functools.lru_cache(maxsize=64)
def _parse(template: str) -> tuple[str, str, bool]:
    """Validated (without input, with input, with-input variant uses {input}) for a template."""
    if template in PROMPT_TEMPLATES:
        return (*PROMPT_TEMPLATES[template], True)
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise ValueError(f"`prompt_template` {template!r} is not a valid format string ({exc}); write literal braces as {{{{ and }}}}") from exc
    unknown = fields - _FIELDS
    if unknown or "instruction" not in fields:
        raise ValueError(
            f"`prompt_template` must be one of {sorted(PROMPT_TEMPLATES)} or a string with an {{instruction}} "
            f"placeholder and optionally {{input}}; got {template!r} (placeholders: {sorted(fields)})"
        )
    return template, template, "input" in fields


def chat_prompt_affixes(tokenizer, *, name: str = "tokenizer") -> tuple[list[int], list[int]]:
    """The token ids the tokenizer's chat template puts before and after a single user message.

    A prompt in the model's chat template is then ``prefix + ids(message) + suffix``: the template's
    special tokens (``<|im_start|>``, ...) are real special tokens while the message's text, encoded on
    its own, can never turn into one. The suffix ends with the generation prompt (the assistant turn's
    header), so the response follows it directly; a default system prompt the template adds when
    given none is part of the prefix.

    Args:
        tokenizer: a transformers tokenizer with a `chat_template`.
        name: how messages name the tokenizer.

    Raises:
        ValueError: the tokenizer has no chat template, or its template does not render the message
            exactly once.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"prompt template {CHAT!r} needs a tokenizer with a chat template, and {name} has none; "
            f"use another --prompt-template ({', '.join(sorted(set(PROMPT_TEMPLATES) - {CHAT}))}) or an instruct model's tokenizer"
        )
    marker = "\x00MESSAGE\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True)
    if text.count(marker) != 1:
        raise ValueError(f"the chat template of {name} does not render a user message exactly once: {text!r}")
    before, after = text.split(marker)
    encode = lambda part: tokenizer(part, add_special_tokens=False)["input_ids"] if part else []  # noqa: E731
    return list(encode(before)), list(encode(after))
