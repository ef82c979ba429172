"""`tools/evaluate.py math|mol --prompt-template chat`: the model sees exactly the prompt of a fine-tuning example
sharded with `tools/shard.py --prompt-template chat`; a tokenizer without a chat template is refused before the
model loads; `--batch-size` says what it counts in each subcommand; molecule counts are integers."""

from __future__ import annotations

import json

import pytest

from pipeline.corpora import make_corpus_spec
from pipeline.evaluation.generate import generate_greedy
from pipeline.evaluation.mol_eval import format_mol_table, write_mol_results
from pipeline.evaluation.mol_metrics import evaluate_predictions
from pipeline.manifest import load_manifest
from pipeline.prompts import render_prompt
from pipeline.sharding import ShardOptions, shard_corpus
from pipeline.tokenizer import load_tokenizer
from tests.common.gguf_files import write_tiny_gguf
from tests.common.models import tiny_llama
from tests.common.paths import REPO_ROOT
from tests.data.mds_helpers import read_mds
from tests.evaluation.test_evaluate_cli import _tool

# One question per domain, so each domain's one sample is that question's example.
MATH = {
    "arithmetic": "What is 2 + 2?",
    "numbers": "Let x = 3. Is x prime?",
    # Special-token text in a question stays text, in the shards as in evaluation.
    "special": "Echo <|im_end|> please",
}
MOL = {  # task -> (instruction, input); an empty input is the no-input variant
    "forward": ("Predict the product.", "[C][C][O].[O]"),
    "describe": ("Describe this molecule.", ""),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny GGUF model whose tokenizer has a ChatML chat template (no ../shared needed), its converted cache private."""
    root = tmp_path_factory.mktemp("chat_eval")
    monkey = pytest.MonkeyPatch()
    monkey.setenv("PARTITIONSEL_CACHE", str(root / "cache"))
    yield root, write_tiny_gguf(root / "tiny.gguf"), monkey
    monkey.undo()


def _shard_prompts(root, gguf, name: str, fmt: str, records: list[dict]) -> dict[str, list[int]]:
    """Shard `records` with the chat template; the one training example's prompt_ids of each domain."""
    src = root / f"{name}.json"
    src.write_text(json.dumps(records))
    out = root / f"shards_{name}"
    options = ShardOptions(
        out=out, tokenizer=str(gguf.path), max_seq_len=256, prompt_template="chat", progress=False
    )
    shard_corpus(make_corpus_spec(fmt), [src], options)
    manifest = load_manifest(out)
    assert manifest.prompt_template == "chat" and manifest.mode == "finetune"
    prompts = {}
    for domain in manifest.domains:
        (sample,) = read_mds(manifest.split_dir(domain.name, "train"))
        prompts[domain.name] = [int(t) for t in sample["prompt_ids"]]
    return prompts


def _spy_prompts(monkeypatch, module: str) -> list:
    """Record the prompts `module`'s evaluation hands to `generate_greedy` (the real one still generates)."""
    seen: list = []

    def spy(model, tokenizer, prompts, **kwargs):
        seen.extend(
            tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str) else list(p)
            for p in prompts
        )
        return generate_greedy(model, tokenizer, prompts, **kwargs)

    monkeypatch.setattr(f"pipeline.evaluation.{module}.generate_greedy", spy)
    return seen


def test_math_chat_prompt_is_the_sharded_fine_tuning_prompt(tiny, tmp_path, monkeypatch):
    root, gguf, _ = tiny
    records = [{"query": q, "response": "The answer is: 4", "type": d} for d, q in MATH.items()]
    sharded = _shard_prompts(root, gguf, "math", "metamathqa", records)

    data = tmp_path / "data"
    data.mkdir()
    (data / "gsm8k.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": "#### 4"}) + "\n" for q in MATH.values())
    )
    seen = _spy_prompts(monkeypatch, "math_eval")
    argv = ["math", "--model", str(gguf.path), "--data-dir", str(data), "--suites", "gsm8k", "--prompt-template", "chat"]
    assert _tool().main([*argv, "--max-new-tokens", "2", "--device", "cpu", "--no-progress"]) == 0
    assert seen == [sharded[d] for d in MATH]
    tok = load_tokenizer(gguf.path)
    assert tok.decode(seen[0]).startswith(
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_mol_chat_prompt_is_the_sharded_fine_tuning_prompt(tiny, tmp_path, monkeypatch):
    root, gguf, _ = tiny
    records = [
        {"instruction": i, "input": x, "output": "[C][=O]", "metadata": {"task": t, "split": "train"}}
        for t, (i, x) in MOL.items()
    ]
    sharded = _shard_prompts(root, gguf, "mol", "mol", records)

    data = tmp_path / "mol.json"
    data.write_text(json.dumps(records))
    seen = _spy_prompts(monkeypatch, "mol_eval")
    argv = ["mol", "--model", str(gguf.path), "--data", str(data), "--split", "train", "--prompt-template", "chat"]
    assert _tool().main([*argv, "--max-new-tokens", "2", "--device", "cpu", "--no-progress"]) == 0
    assert seen == [sharded[t] for t in MOL]


def test_chat_prompt_ids_keep_special_token_text_as_text(tiny):
    from pipeline.evaluation.generate import chat_prompt_ids

    _, gguf, _ = tiny
    tok = load_tokenizer(gguf.path)
    (ids,) = chat_prompt_ids(tok, [render_prompt("chat", "Echo <|im_end|> please")])
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_end) == 1 and ids.count(im_start) == 2  # the user turn's end, the two turns' starts


@pytest.mark.parametrize("command", ["math", "mol"])
@pytest.mark.parametrize("named", [True, False], ids=["--tokenizer", "model folder"])
def test_chat_without_a_chat_template_exits_before_the_model_loads(
    command, named, tiny_model_dir, tmp_path, monkeypatch
):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("pipeline.evaluation.checkpoint.load_model_and_tokenizer", refuse)
    plain = REPO_ROOT / "assets" / "tokenizer"  # a base tokenizer: no chat template
    if command == "math":
        (tmp_path / "gsm8k.jsonl").write_text(
            json.dumps({"question": "What is 2 + 2?", "answer": "#### 4"}) + "\n"
        )
        argv = ["math", "--data-dir", str(tmp_path), "--suites", "gsm8k"]
    else:
        record = {
            "instruction": "Predict.",
            "input": "[C]",
            "output": "[C]",
            "metadata": {"task": "t", "split": "test"},
        }
        (tmp_path / "mol.json").write_text(json.dumps([record]))
        argv = ["mol", "--data", str(tmp_path / "mol.json")]
    argv += ["--model", str(tiny_model_dir), "--prompt-template", "chat"]
    argv += ["--tokenizer", str(plain)] if named else []
    with pytest.raises(SystemExit) as info:
        _tool().main(argv)
    message = str(info.value)
    assert message.startswith(f"{command}: --prompt-template chat") and "has none" in message
    assert (f"--tokenizer {plain}" if named else f"the tokenizer of --model {tiny_model_dir}") in message
    assert "alpaca" in message and ("metamath" in message) == (command == "math")


def test_batch_size_help_says_what_it_counts(capsys):
    def help_of(command: str) -> str:
        with pytest.raises(SystemExit):
            _tool().main([command, "--help"])
        return " ".join(capsys.readouterr().out.split())

    assert "--batch-size BATCH_SIZE sequences of the shards per forward pass (default 8)" in help_of("ppl")
    assert "--batch-size BATCH_SIZE prompts per generate call (default 8)" in help_of("math")
    assert "--batch-size BATCH_SIZE questions per generate call (default 8)" in help_of("answers")


def test_generate_greedy_takes_token_ids_as_their_text(tokenizer):
    model = tiny_llama(seed=3, vocab_size=len(tokenizer), max_position_embeddings=256).eval()
    texts = ["Q: 1+1?", "A longer question about eggs at the market?", "x"]
    ids = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
    got = generate_greedy(model, tokenizer, ids, batch_size=2, max_new_tokens=4, show_progress=False)
    assert generate_greedy(model, tokenizer, texts, batch_size=2, max_new_tokens=4, show_progress=False) == got
    # Against transformers' own left padding, one prompt a call and all three in one (the padding generate_greedy
    # now does itself; its text and id paths share it, so only an outside reference can tell it wrong).
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=4, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    batch = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         generation_config=config)[:, batch["input_ids"].shape[1]:]
    reference = tokenizer.batch_decode(out, skip_special_tokens=True)
    assert got == reference, (got, reference)


def test_molecule_and_text_task_counts_are_integers(tmp_path):
    records = [
        {"task": "describe", "prediction": "An alcohol.", "reference": "An alcohol."},  # a text task
        {"task": "forward", "prediction": "[C][C][O]", "reference": "[C][C][O]"},
    ]
    metrics = evaluate_predictions(records)
    for task in ("describe", "forward"):
        assert type(metrics[task]["n"]) is int and metrics[task]["n"] == 1
    assert type(metrics["forward"]["n_scored"]) is int
    row = next(line.split() for line in format_mol_table(metrics).splitlines() if line.startswith("describe"))
    assert row[1] == "1"  # the n column
    summary = json.loads(write_mol_results(metrics, tmp_path / "mol.json").read_text())
    assert summary["tasks"]["describe"]["n"] == 1 and type(summary["tasks"]["describe"]["n"]) is int
