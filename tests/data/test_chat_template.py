"""`--prompt-template chat` (issue 29.2): every fine-tuning example is its model's chat template, the loss on the answer only."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.collators import FinetuneCollator
from pipeline.corpora import make_corpus_spec
from pipeline.manifest import load_manifest
from pipeline.prompts import chat_prompt_affixes
from pipeline.sharding import ShardOptions, shard_corpus
from pipeline.tokenizer import load_tokenizer
from tests.common.gguf_files import write_tiny_gguf
from tests.data.mds_helpers import read_mds

IGNORE = -100
RECORDS = [
    {"query": "What is 2 + 2?", "response": "The answer is: 4", "type": "arithmetic"},
    {"query": "the this is", "response": "The answer is: the", "type": "arithmetic"},
    {"query": "Let x = 3. Is x prime?", "response": "The answer is: True", "type": "numbers"},
    # A message holding a special token's text must stay text (never the special token itself).
    {"query": "Echo <|im_end|> please", "response": "The answer is: ok", "type": "numbers"},
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    monkey = pytest.MonkeyPatch()
    monkey.setenv("PARTITIONSEL_CACHE", str(root / "cache"))
    tiny = write_tiny_gguf(root / "tiny.gguf")
    src = root / "records.json"
    src.write_text(json.dumps(RECORDS))
    out = root / "shards"
    options = ShardOptions(out=out, tokenizer=str(tiny.path), max_seq_len=256, prompt_template="chat", progress=False)
    shard_corpus(make_corpus_spec("metamathqa"), [src], options)
    yield out, load_tokenizer(tiny.path)
    monkey.undo()


def test_every_prompt_is_the_chat_template_of_its_question(shards):
    out, tok = shards
    manifest = load_manifest(out)
    assert manifest.prompt_template == "chat" and manifest.mode == "finetune"
    seen = 0
    for domain in manifest.domains:
        for sample in read_mds(manifest.split_dir(domain.name, "train")):
            prompt = [int(t) for t in sample["prompt_ids"]]
            question = next(r["query"] for r in RECORDS if r["type"] == domain.name and r["query"] in tok.decode(prompt))
            # What the tokenizer's own apply_chat_template gives for that one user message (which would make
            # special-token text in a message a special token: that case is the next test's).
            if "<|" not in question:
                expected = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True)
                assert prompt == list(expected), tok.decode(prompt)
            response = [int(t) for t in sample["response_ids"]]
            assert response[-1] == tok.eos_token_id and tok.eos_token == "<|im_end|>"
            seen += 1
    assert seen == len(RECORDS)


def test_the_special_token_text_in_a_message_stays_text(shards):
    out, tok = shards
    manifest = load_manifest(out)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prefix, suffix = chat_prompt_affixes(tok)
    for sample in read_mds(manifest.split_dir("numbers", "train")):
        prompt = [int(t) for t in sample["prompt_ids"]]
        message = prompt[len(prefix) : len(prompt) - len(suffix)]
        assert im_end not in message  # only the template's own turn ends are the special token
        assert prompt[: len(prefix)] == prefix and prompt[len(prompt) - len(suffix) :] == suffix


def test_the_loss_covers_the_answer_only_in_every_example(shards):
    out, tok = shards
    manifest = load_manifest(out)
    samples = [{**s, "domain_id": i} for i, d in enumerate(manifest.domains) for s in read_mds(manifest.split_dir(d.name, "train"))]
    batch = FinetuneCollator(pad_token_id=tok.pad_token_id, max_seq_len=256)(samples)
    for row, sample in enumerate(samples):
        prompt, response = list(sample["prompt_ids"]), list(sample["response_ids"])
        labels = batch["labels"][row]
        assert (labels[: len(prompt)] == IGNORE).all()  # the whole chat-template prompt is masked
        target = labels[len(prompt) : len(prompt) + len(response)]
        assert target.tolist() == [int(t) for t in response]  # the answer and its <|im_end|>
        assert (labels[len(prompt) + len(response) :] == IGNORE).all()  # padding
        assert torch.equal(batch["input_ids"][row, : len(prompt)], torch.as_tensor(prompt, dtype=torch.long))


def test_a_tokenizer_without_a_chat_template_is_refused_naming_it():
    from pipeline.tokenizer import load_tokenizer as load
    from tests.common.paths import REPO_ROOT

    plain = load(REPO_ROOT / "assets" / "tokenizer")
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template, and mine has none"):
        chat_prompt_affixes(plain, name="mine")
