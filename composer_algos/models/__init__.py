"""The model side: the Composer-wrapped causal LM and the two caches of its frozen blocks.

- `causal_lm.py`: `build_causal_lm` (hub name, local path, GGUF file or inline config; optional
  LoRA) and `DomainCausalLM`, the Composer model the trainer and the selection's features use.
- `frozen_prefix.py`: evaluation that runs the frozen blocks below the adapters once per input.
- `scoring_prefix.py`: the frozen blocks' output on the selected rows, handed from the selection's
  scoring pass to the training forward.
"""

from composer_algos.models.causal_lm import DomainCausalLM, build_causal_lm

__all__ = ["DomainCausalLM", "build_causal_lm"]
