"""A tiny GGUF model file written with `gguf`'s own writer, so the GGUF conversion path runs without real weights.

The file holds a seeded tiny Llama (`tests.common.models.tiny_llama`) in F32 and a small GPT-2-style byte-level
BPE tokenizer (the 256 byte symbols, four merges, three ChatML special tokens) with a chat template, laid out
the way llama.cpp's converter lays out a Hugging Face Llama: GGUF's standard tensor names, and the rows of the
query and key projections in GGUF's rotary order (each head's two rotary halves interleaved), which
transformers undoes when it loads the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaForCausalLM
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

from tests.common.models import tiny_llama

__all__ = ["CHAT_TEMPLATE", "SPECIALS", "TinyGGUF", "write_tiny_gguf"]

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # unknown 0, BOS 1, EOS 2 (as SmolLM2)
MERGES = ["Ġ t", "h e", "Ġt he", "i s"]  # GPT-2's merges format: "left right", in priority order
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_NORMAL, _CONTROL = 1, 3  # gguf.TokenType values


@dataclass(frozen=True)
class TinyGGUF:
    path: Path
    model: LlamaForCausalLM  # the weights the file holds, in Hugging Face's layout
    tokens: list[str]


def _rotary_interleaved(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's q/k rows (per head: first rotary half, second half) in GGUF's order (pairs interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, *, architecture: str = "llama", seed: int = 0) -> TinyGGUF:
    """Write the tiny model and tokenizer to `path` (a few hundred KB) and return what it holds."""
    import gguf

    tokens = SPECIALS + list(bytes_to_unicode().values()) + ["".join(m.split(" ")) for m in MERGES]
    model = tiny_llama(seed=seed, vocab_size=len(tokens))
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads

    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny test llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([_CONTROL] * len(SPECIALS) + [_NORMAL] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    # As in SmolLM2's file; without it transformers strips a leading space when decoding.
    w.add_add_space_prefix(False)
    w.add_chat_template(CHAT_TEMPLATE)

    sd = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    for i in range(cfg.num_hidden_layers):
        per_block = {
            "input_layernorm": "attn_norm",
            "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output",
            "post_attention_layernorm": "ffn_norm",
            "mlp.gate_proj": "ffn_gate",
            "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down",
        }
        names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for hf, g in per_block.items()})
    assert set(names) == set(sd), set(sd) ^ set(names)
    for hf_name, gguf_name in names.items():
        arr = sd[hf_name]
        if hf_name.endswith("q_proj.weight"):
            arr = _rotary_interleaved(arr, cfg.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            arr = _rotary_interleaved(arr, cfg.num_key_value_heads)
        w.add_tensor(gguf_name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return TinyGGUF(path=path, model=model, tokens=tokens)
