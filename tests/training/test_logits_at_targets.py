"""`model.logits_at: targets`: the vocabulary projection only where a next token has a loss, with the same results."""

from __future__ import annotations

import pytest
import torch

from composer_algos.models.causal_lm import build_causal_lm
from pipeline.collators import IGNORE_INDEX
from pipeline.tokenizer import load_tokenizer
from tests.common.paths import REPO_ROOT

CONFIG = {
    "model_type": "llama", "vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
}
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def _pair(lora):
    tok = load_tokenizer(REPO_ROOT / "assets" / "tokenizer")
    torch.manual_seed(0)
    full = build_causal_lm(tokenizer=tok, config=CONFIG, lora=lora)
    targets = build_causal_lm(tokenizer=tok, config=CONFIG, lora=lora, logits_at="targets")
    targets.load_state_dict(full.state_dict())
    return full, targets


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(0, 4096, (3, 12))
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, 8:12] = ids[0, 8:12]  # answers at different places, one row right-padded
    labels[1, 5:9] = ids[1, 5:9]
    labels[2, 10:12] = ids[2, 10:12]
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "domain_id": torch.tensor([0, 1, 0])}


@pytest.mark.parametrize("lora", [None, LORA])
def test_loss_metrics_and_gradients_equal_the_full_projection(lora):
    full, targets = _pair(lora)
    out_f, out_t = full(_batch()), targets(_batch())
    loss_f, loss_t = full.loss(out_f, _batch()), targets.loss(out_t, _batch())
    assert loss_t.item() == pytest.approx(loss_f.item(), rel=1e-6)
    assert out_t["logits"].shape == (4 + 4 + 2, 4096)  # the target positions only: each label is predicted from the position before it
    loss_f.backward()
    loss_t.backward()
    grads_f = {n: p.grad for n, p in full.named_parameters() if p.grad is not None}
    grads_t = {n: p.grad for n, p in targets.named_parameters() if p.grad is not None}
    assert grads_f.keys() == grads_t.keys() and grads_f
    for name in grads_f:
        torch.testing.assert_close(grads_t[name], grads_f[name], rtol=1e-4, atol=1e-7)
    # The evaluation metric (token cross-entropy) through Composer's eval_forward / update_metric.
    values = []
    for model in (full, targets):
        model.eval()
        metric = model.get_metrics(is_train=False)["LanguageCrossEntropy"]
        metric.reset()
        with torch.no_grad():
            logits = model.eval_forward(_batch())
        model.update_metric(_batch(), logits, metric)
        values.append(float(metric.compute()))
    assert values[1] == pytest.approx(values[0], rel=1e-6)


def test_weighted_loss_uses_each_examples_own_target_mean():
    full, targets = _pair(None)
    batch = {**_batch(), "loss_weight": torch.tensor([0.5, 2.0, 0.5])}
    loss_f = full.loss(full(dict(batch)), batch)
    loss_t = targets.loss(targets(dict(batch)), batch)
    assert loss_t.item() == pytest.approx(loss_f.item(), rel=1e-6)


def test_a_bad_logits_at_is_refused():
    with pytest.raises(ValueError, match="logits_at must be 'all' or 'targets'"):
        build_causal_lm(tokenizer=load_tokenizer(REPO_ROOT / "assets" / "tokenizer"), config=CONFIG, logits_at="some")


def test_a_fine_tuning_run_trains_and_selects_as_with_the_full_projection(math_shards, tmp_path):
    from composer.loggers import InMemoryLogger

    import train
    from composer_algos.registry import load_run_config

    def run(name, *extra):
        cfg = load_run_config(REPO_ROOT / "yamls" / "testing" / "tiny_finetune.yaml", [
            f"variables.shard_dir={math_shards}", f"save_folder={tmp_path / name}", "max_duration=3ba",
            "eval_interval=3ba", "global_train_batch_size=4", "eval_loader.subset_num_batches=1",
            "loggers.in_memory={}", "python_log_level=warning", *extra,
        ])
        trainer = train.build_trainer(cfg)
        trainer.fit()
        mem = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
        series = {k: [float(v) for _, v in mem.data[k]] for k in ("loss/train/total", "selection/selected_hash")}
        evals = {k: float(v[-1][1]) for k, v in mem.data.items() if k.startswith("metrics/val")}
        trainer.close()
        return series, evals

    full, full_eval = run("full")
    targets, targets_eval = run("targets", "model.logits_at=targets")
    assert targets["selection/selected_hash"] == full["selection/selected_hash"]
    assert targets["loss/train/total"] == pytest.approx(full["loss/train/total"], rel=1e-4)
    assert targets_eval.keys() == full_eval.keys() and full_eval
    for key, value in full_eval.items():
        assert targets_eval[key] == pytest.approx(value, rel=1e-4), key


def test_bench_logits_at_runs_and_finds_the_same_losses(math_shards, capsys):
    import bench_logits_at

    rc = bench_logits_at.main([
        str(REPO_ROOT / "yamls" / "testing" / "tiny_finetune.yaml"), f"variables.shard_dir={math_shards}", "--steps", "2",
    ])
    out = capsys.readouterr().out
    assert rc == 0, out
    ratios = {line.split()[0]: float(line.split()[-1]) for line in out.splitlines() if line.split()[:1] in (["train"], ["eval"], ["score"])}
    assert set(ratios) == {"train", "eval", "score"} and all(r > 0 for r in ratios.values())
    gap = float(out.rsplit("largest relative loss difference:", 1)[1].split()[0])
    assert gap <= 1e-4


@pytest.mark.parametrize("lora", [None, LORA])
def test_scoring_pass_at_targets_captures_the_full_projections_signals(lora):
    from composer_algos.features.capture import capture_layer_signals, scoring_mode
    from composer_algos.features.targets import choose_cut_module, resolve_targets, unwrap_model

    full, _ = _pair(lora)
    hf = unwrap_model(full)
    targets = resolve_targets(hf, last_n_blocks=1)
    cut = choose_cut_module(hf, targets)
    batch = _batch()
    with scoring_mode(hf):
        sig_all, loss_all = capture_layer_signals(hf, batch, targets, cut)
        sig_tgt, loss_tgt = capture_layer_signals(hf, batch, targets, cut, logits_at="targets")
    torch.testing.assert_close(loss_tgt, loss_all, rtol=1e-5, atol=1e-6)
    assert len(sig_tgt) == len(sig_all) == len(targets)
    for (a1, d1), (a2, d2) in zip(sig_all, sig_tgt):
        torch.testing.assert_close(a2, a1)
        torch.testing.assert_close(d2, d1, rtol=1e-4, atol=1e-7)
    # Some output gradient is not zero: the signals are not trivially equal.
    assert any(float(d.abs().sum()) > 0 for _, d in sig_all)


def test_the_extractor_scores_at_targets_where_the_model_trains_so():
    from composer_algos.features import GradFeatureExtractor

    full, targets_model = _pair(LORA)
    assert GradFeatureExtractor(targets_model, logits_at=targets_model.logits_at).logits_at == "targets"
    assert GradFeatureExtractor(full, logits_at=full.logits_at).logits_at == "all"
    # A target on the output embedding sees every position: the scoring forward keeps the full projection.
    assert GradFeatureExtractor(targets_model, logits_at="targets", include_lm_head=True).logits_at == "all"


@pytest.mark.parametrize("lora", [None, LORA])
def test_the_training_forward_keeps_no_kv_cache_and_names_each_block_for_fsdp(lora):
    """A training forward used to fill a KV cache (Llama's config asks for one): every block's keys and values
    held to the end of the backward, and grown again by a block recomputed under activation checkpointing."""
    full, _ = _pair(lora)
    full.train()
    out = full(_batch())
    assert out.past_key_values is None
    assert full(_batch() | {"use_cache": True}).past_key_values is not None  # a caller's own choice stands
    # Composer's FSDP reads these from the model's child: one unit and one checkpoint per decoder block
    blocks = [m for m in full.model.modules() if full.model.fsdp_wrap_fn(m)]
    assert len(blocks) == CONFIG["num_hidden_layers"] and all(full.model.activation_checkpointing_fn(b) for b in blocks)
    assert not full.model.fsdp_wrap_fn(full.model) and not full.model.activation_checkpointing_fn(blocks[0].mlp)


@pytest.mark.parametrize("logits_at", ["all", "targets"])
def test_the_training_forward_takes_the_frozen_blocks_output_from_the_scoring_pass(math_shards, tmp_path, logits_at):
    """`model.reuse_scoring_prefix`: the selected rows skip the frozen blocks in the training forward (their output
    comes from the scoring pass); the same selections, the losses within rounding, no training pass through them."""
    from composer.loggers import InMemoryLogger

    import train
    from composer_algos.registry import load_run_config

    def run(name, *extra):
        cfg = load_run_config(REPO_ROOT / "yamls" / "testing" / "tiny_finetune.yaml", [
            f"variables.shard_dir={math_shards}", f"save_folder={tmp_path / name}", "max_duration=3ba",
            "eval_interval=3ba", "global_train_batch_size=4", "eval_loader.subset_num_batches=1",
            "loggers.in_memory={}", "python_log_level=error", "model.config.num_hidden_layers=3",
            "model.lora.top_blocks=1", f"model.logits_at={logits_at}", *extra,
        ])
        trainer = train.build_trainer(cfg)
        model = trainer.state.model
        decoder = model.model.get_base_model().get_decoder()
        trained_through = []  # the bottom block's forwards in training mode with autograd on
        decoder.layers[0].register_forward_hook(
            lambda m, a, o: trained_through.append(1) if m.training and torch.is_grad_enabled() else None
        )
        trainer.fit()
        mem = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
        series = {k: [float(v) for _, v in mem.data[k]] for k in ("loss/train/total", "selection/selected_hash")}
        prefix = model.scoring_prefix
        trainer.close()
        return series, len(trained_through), prefix

    plain, plain_through, no_prefix = run("plain")
    reused, reused_through, prefix = run("reused", "model.reuse_scoring_prefix=true")
    assert no_prefix is None and prefix is not None and prefix.handed_on == 3
    assert plain_through == 3 and reused_through == 0
    assert reused["selection/selected_hash"] == plain["selection/selected_hash"]
    assert reused["loss/train/total"] == pytest.approx(plain["loss/train/total"], rel=1e-4)


def test_reuse_scoring_prefix_needs_frozen_blocks_below_the_adapters():
    from pipeline.config import ModelConfig

    errs = ModelConfig(config={"model_type": "llama"}, reuse_scoring_prefix=True).validate()
    assert any("model.reuse_scoring_prefix needs model.lora.top_blocks" in e for e in errs), errs


@pytest.mark.timeout(900)
def test_bench_prefix_runs_both_and_hands_every_step_on(math_shards, capsys):
    import bench_prefix

    rc = bench_prefix.main([
        str(REPO_ROOT / "yamls" / "testing" / "tiny_finetune.yaml"), f"variables.shard_dir={math_shards}",
        "model.config.num_hidden_layers=3", "model.lora.top_blocks=1", "global_train_batch_size=4", "--steps", "2",
    ])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "training forwards that skipped the frozen blocks: 3 of 3" in out
    ratios = out.split("reuse / every block: wall ", 1)[1].split(";")[0]
    assert all(float(x.split()[-1]) > 0 for x in ratios.split(","))
    assert float(out.rsplit("largest relative training-loss difference:", 1)[1].split()[0]) <= 1e-4
