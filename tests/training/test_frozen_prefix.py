"""`model.eval_prefix_cache`: evaluation skips the frozen blocks below the adapters on inputs it has seen, with the same results."""

from __future__ import annotations

import pytest
import torch

from composer_algos.models.causal_lm import build_causal_lm
from composer_algos.models.frozen_prefix import evaluation_forwards
from pipeline.collators import IGNORE_INDEX
from pipeline.config import LoraConfig, ModelConfig
from pipeline.evaluation.heldout_answers import generate_from_ids
from pipeline.tokenizer import load_tokenizer
from tests.common.paths import REPO_ROOT

CONFIG = {
    "model_type": "llama", "vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
}
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "top_blocks": 1}


def _models(cache_dir, logits_at="targets"):
    """A model with the cache and the same model without it, on the same weights (adapters made non-zero)."""
    tok = load_tokenizer(REPO_ROOT / "assets" / "tokenizer")
    torch.manual_seed(0)
    plain = build_causal_lm(tokenizer=tok, config=CONFIG, lora=LORA, logits_at=logits_at)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # peft starts B at zero: the adapted blocks would be the base's
    cached = build_causal_lm(tokenizer=tok, config=CONFIG, lora=LORA, logits_at=logits_at, eval_prefix_cache=str(cache_dir))
    cached.load_state_dict(plain.state_dict())
    return plain, cached


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4096, (3, 12), generator=g)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, 8:12] = ids[0, 8:12]
    labels[1, 5:9] = ids[1, 5:9]
    labels[2, 10:12] = ids[2, 10:12]
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _bottom_calls(model):
    """Counts the forwards of the lowest block (the original module, which a replay stands in for)."""
    calls = []
    model.model.get_base_model().get_decoder().layers[0].register_forward_hook(lambda *a: calls.append(1))
    return calls


def _cache(model):
    hooks = model.model.get_base_model().get_decoder()._forward_pre_hooks.values()
    return next(h.__self__ for h in hooks if type(getattr(h, "__self__", None)).__name__ == "FrozenPrefixCache")


@pytest.mark.parametrize("logits_at", ["targets", "all"])
def test_an_evaluation_replayed_from_the_cache_equals_the_full_forward_and_skips_the_frozen_blocks(tmp_path, logits_at):
    plain, cached = _models(tmp_path / "cache", logits_at)
    plain.eval(), cached.eval()
    calls = _bottom_calls(cached)
    with torch.no_grad():
        want = plain.eval_forward(_batch())
        first = cached.eval_forward(_batch())  # recorded
        second = cached.eval_forward(_batch())  # replayed
    assert len(calls) == 1, "the frozen blocks ran on the replayed forward"
    assert (_cache(cached).misses, _cache(cached).hits) == (1, 1)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert list((tmp_path / "cache").rglob("*.pt")), "nothing was written"
    # A second model (another run) on the same base weights replays what the first recorded.
    _, other = _models(tmp_path / "cache", logits_at)
    other.load_state_dict(cached.state_dict())
    other.eval()
    other_calls = _bottom_calls(other)
    with torch.no_grad():
        assert torch.equal(other.eval_forward(_batch()), want)
    assert other_calls == [] and _cache(other).hits == 1


def test_greedy_generation_from_a_replayed_prefill_equals_generation_without_the_cache(tmp_path):
    plain, cached = _models(tmp_path / "cache")
    prompts = [[5, 17, 300, 41, 9, 77], [8, 2000, 31], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    kw = dict(pad_id=0, eos_id=3, max_new_tokens=6, batch_size=2)
    want = generate_from_ids(plain.model, prompts, **kw)
    calls = _bottom_calls(cached)
    with evaluation_forwards():  # as the answer-accuracy callback generates
        first = generate_from_ids(cached.model, prompts, **kw)
        n_first = len(calls)  # prefill and every decode step through the bottom block
        second = generate_from_ids(cached.model, prompts, **kw)
    assert first == want and second == want
    assert len(calls) - n_first == n_first - 2, "the replayed prefills (one per batch of 2) still ran the frozen blocks"
    assert _cache(cached).hits == 2


def test_training_forwards_and_scoring_passes_run_the_model_unchanged(tmp_path):
    _, cached = _models(tmp_path / "cache")
    calls = _bottom_calls(cached)
    cached.eval()
    out = cached(_batch())  # eval mode but autograd on: a scoring pass differentiates through the top blocks
    cached.train()
    cached.loss(cached(_batch()), _batch()).backward()
    assert len(calls) == 2 and not list((tmp_path / "cache").rglob("*.pt"))
    assert out["loss"].requires_grad


def test_the_scoring_pass_and_forwards_outside_evaluation_never_use_the_cache(tmp_path):
    """The scoring pass runs the frozen blocks in eval mode without autograd, like an evaluation; a study's
    runs score the same pools, so a cache there would make selection cheaper in the study than in use."""
    from composer_algos.features.capture import capture_layer_signals, scoring_mode
    from composer_algos.features.targets import choose_cut_module, resolve_targets, unwrap_model

    _, cached = _models(tmp_path / "cache")
    hf = unwrap_model(cached)
    targets = resolve_targets(hf, last_n_blocks=1)
    cut = choose_cut_module(hf, targets)
    calls = _bottom_calls(cached)
    with scoring_mode(hf):
        first = capture_layer_signals(hf, _batch(), targets, cut, logits_at="targets")
        second = capture_layer_signals(hf, _batch(), targets, cut, logits_at="targets")
        with torch.no_grad():  # a plain no-grad forward in eval mode is not an evaluation either
            cached(_batch())
            cached(_batch())
    assert len(calls) == 4 and not list((tmp_path / "cache").rglob("*.pt"))
    torch.testing.assert_close(second[1], first[1])


def test_other_frozen_weights_do_not_replay_an_entry(tmp_path):
    _, cached = _models(tmp_path / "cache")
    cached.eval()
    with torch.no_grad():
        cached.eval_forward(_batch())
    _, other = _models(tmp_path / "cache")
    with torch.no_grad():
        other.model.get_base_model().get_decoder().layers[0].mlp.up_proj.weight.mul_(1.01)
    other.eval()
    calls = _bottom_calls(other)
    with torch.no_grad():
        other.eval_forward(_batch())
    assert len(calls) == 1 and (_cache(other).hits, _cache(other).misses) == (0, 1)


def test_the_cache_without_top_blocks_is_a_configuration_error(tmp_path):
    cfg = ModelConfig(config=CONFIG, lora=LoraConfig(r=4, target_modules=["q_proj"]), eval_prefix_cache=str(tmp_path))
    assert any("model.eval_prefix_cache" in e and "lora.top_blocks" in e for e in cfg.validate())
    with pytest.raises(ValueError, match="eval_prefix_cache needs model.lora.top_blocks"):
        build_causal_lm(tokenizer=load_tokenizer(REPO_ROOT / "assets" / "tokenizer"), config=CONFIG,
                        lora={**LORA, "top_blocks": None}, eval_prefix_cache=str(tmp_path))
