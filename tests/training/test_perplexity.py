"""tools/evaluate.py ppl agrees with the per-domain evaluators Composer runs during training."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import train
from pipeline.config import load_config
from pipeline.evaluation.perplexity import domain_log_perplexity
from tests.common.paths import REPO_ROOT
from tests.training.conftest import tiny_overrides

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"


def test_ppl_matches_training_evaluators_and_cli(dolma_shards, tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(
        TINY,
        tiny_overrides(dolma_shards, run_dir, "eval_loader.subset_num_batches=-1",
                       "algorithms.data_selection.strategy=random"),
    )
    trainer = train.build_trainer(cfg)
    trainer.fit()
    during = train.domain_val_losses(trainer)
    ours = domain_log_perplexity(trainer.state.model.model, shard_dir=str(dolma_shards), pad_token_id=1,
                                 batch_size=8, show_progress=False)
    assert set(ours) == set(during)
    for name, value in during.items():
        assert ours[name]["log_ppl"] == pytest.approx(value, rel=1e-5)
    trainer.close()

    out = tmp_path / "ppl.json"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "evaluate.py"), "ppl", "--model", str(run_dir / "latest-rank0.pt"),
         "--shards", str(dolma_shards), "--out", str(out), "--no-progress"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads(out.read_text())["domains"]
    for name, value in during.items():
        assert saved[name]["log_ppl"] == pytest.approx(value, rel=1e-5)
    assert "average" in result.stdout


@pytest.mark.parametrize(("command", "shards", "extra"), [("ppl", "dolma_shards", ["--no-progress"]), ("answers", "math_shards", [])])
def test_ppl_and_answers_refuse_shards_of_another_tokenizer_before_the_model_loads(command, shards, extra, tmp_path,
                                                                                   monkeypatch, request):
    # Found by new-user reviews: under ppl a model of another vocabulary failed in the embedding ("index out of
    # range"); answers asked the shards' prompt ids, which another tokenizer reads as other words, without a word.
    import pipeline.evaluation.checkpoint
    from tests.data.mds_helpers import load_tool

    shard_dir = request.getfixturevalue(shards)
    other = tmp_path / "tok"
    assert load_tool("train_tokenizer").main(["--out", str(other), "--vocab-size", "400", "--scale", "0.03"]) == 0

    def loads(*args, **kwargs):
        raise AssertionError("the model was loaded before the shards' tokenizer was checked")

    monkeypatch.setattr(pipeline.evaluation.checkpoint, "load_model_and_tokenizer", loads)
    with pytest.raises(SystemExit) as info:
        load_tool("evaluate").main([command, "--model", str(tmp_path / "model.pt"), "--tokenizer", str(other),
                                    "--shards", str(shard_dir), *extra])
    msg = str(info.value.code)
    assert msg.startswith(f"{command}: --shards: the model's tokenizer {str(other)!r} is not the tokenizer the shards "
                          f"in {shard_dir} were written with"), msg
    assert "vocabulary 400, smaller than the shards' 4096" in msg, msg


def test_evaluate_errors_are_one_line_before_the_model_loads(dolma_shards, tmp_path, monkeypatch):
    """A new-user review: a missing --model printed a FileNotFoundError traceback, and `--domains wiki,nosuch` a
    KeyError after the model had loaded."""
    import pipeline.evaluation.checkpoint
    from pipeline.tokenizer import DEMO_TOKENIZER
    from tests.data.mds_helpers import load_tool

    evaluate = load_tool("evaluate")
    with pytest.raises(SystemExit) as info:
        evaluate.main(["ppl", "--model", str(tmp_path / "none.pt"), "--shards", str(dolma_shards), "--no-progress"])
    assert str(info.value.code) == (f"ppl: `model_path` {tmp_path / 'none.pt'} does not exist (only local files are "
                                    "read; nothing is downloaded)")

    def loads(*args, **kwargs):
        raise AssertionError("the model was loaded before --domains was checked")

    monkeypatch.setattr(pipeline.evaluation.checkpoint, "load_model_and_tokenizer", loads)
    with pytest.raises(SystemExit) as info:
        evaluate.main(["ppl", "--model", str(tmp_path / "m.pt"), "--tokenizer", DEMO_TOKENIZER, "--shards",
                       str(dolma_shards), "--domains", "wiki,nosuch", "--no-progress"])
    assert str(info.value.code).startswith(f"ppl: --domains: ['nosuch'] are not domains of {dolma_shards} (they are: "), info.value
