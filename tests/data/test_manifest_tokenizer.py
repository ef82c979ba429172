"""The manifest loader's validation and accessors; the committed demo tokenizer and its training script."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from pipeline.corpora import make_corpus_spec
from pipeline.manifest import load_manifest, manifest_from_dict
from pipeline.sharding import ShardOptions, shard_corpus
from pipeline.tokenizer import DEMO_TOKENIZER, load_tokenizer
from tests.common.paths import REPO_ROOT
from tests.data.mds_helpers import load_tool, read_mds, write_jsonl


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("manifest")
    docs = [{"text": f"text {i} <|endoftext|> inside", "source": src} for i, src in enumerate(["x", "y", "x", "z", "y", "x"])]
    path = write_jsonl(root / "in.jsonl", docs)
    out = root / "out"
    shard_corpus(make_corpus_spec("dolma"), [path], ShardOptions(out=out, tokenizer=DEMO_TOKENIZER, max_seq_len=8, progress=False, val_count=1))
    return out


def test_manifest_accessors(output):
    m = load_manifest(output)
    assert m.domain_names == ["x", "y", "z"] and m.domain_index("y") == 1
    assert m.split_dir("y", "train") == output / "train" / "y" and m.split_dir(2, "val") == output / "val" / "z"
    assert m.root == output and m.mode == "pretrain" and m.eos_token_id == 0 and m.pad_token_id == 1
    with pytest.raises(KeyError, match="domain 'w' not in the manifest"):
        m.domain_index("w")
    with pytest.raises(ValueError, match="`split` must be one of"):
        m.split_dir("x", "test")


def test_literal_special_token_text_is_not_an_eos(output, tokenizer):
    m = load_manifest(output)
    ids = [int(t) for s in read_mds(m.split_dir("x", "train")) for t in s["input_ids"]]
    assert ids.count(m.eos_token_id) == m.domains[0].splits["train"].records  # one EOS per record, none from the text
    assert "<|endoftext|>" in tokenizer.decode(ids[: ids.index(m.eos_token_id)])


def _mutations():
    def drop(key):
        return lambda m: m.pop(key)

    def domain0(**kw):
        return lambda m: m["domains"][0].update(kw)

    return [
        (drop("mode"), "missing field `mode`"),
        (lambda m: m.update(mode="train"), "field `mode` must be one of"),
        (lambda m: m.update(max_seq_len="8"), "field `max_seq_len` must be int"),
        (lambda m: m.update(format_version=2), "field `format_version` must be 1"),
        (lambda m: m.update(val_fraction=0.1), "mutually exclusive"),
        (domain0(input_records=99), "domain 'x': `input_records` (99)"),
        (domain0(dir="../evil"), "field `domains[0].dir` must be a plain directory name"),
        (lambda m: m["domains"].reverse(), "field `domains` must be sorted by name"),
        (lambda m: m["domains"][0]["splits"].pop("val"), "field `domains[0].splits.val` must be an object"),
        (lambda m: m["inputs"][0].update(records=5), "records do not reconcile"),
        (lambda m: m.update(eos_token_id=True), "field `eos_token_id` must be int"),
    ]


@pytest.mark.parametrize("mutate, expected", _mutations())
def test_manifest_validation_names_the_field(output, mutate, expected):
    obj = json.loads((output / "manifest.json").read_text())
    manifest_from_dict(copy.deepcopy(obj))  # the original is valid
    mutate(obj)
    with pytest.raises(ValueError, match="invalid manifest") as info:
        manifest_from_dict(obj, source="m.json")
    assert expected in str(info.value) and str(info.value).startswith("m.json: ")


def test_load_manifest_file_errors(tmp_path):
    with pytest.raises(ValueError, match="no manifest"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_manifest(tmp_path)


def test_demo_tokenizer_is_small_and_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = list(Path(DEMO_TOKENIZER).iterdir())
    assert sum(f.stat().st_size for f in files) < 1_000_000
    monkeypatch.chdir(REPO_ROOT)
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained("assets/tokenizer")) == 4096
    tok = load_tokenizer("assets/tokenizer")
    assert len(tok) == 4096 and tok.is_fast
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|endoftext|>", "<|pad|>", None)
    assert tok.eos_token_id != tok.pad_token_id
    text = "Ünïcödé\u2028line 😀 [C][=C][Ring1] The answer is: 42"
    ids = tok(text)["input_ids"]
    assert tok.eos_token_id not in ids  # no special tokens are added
    assert tok.decode(ids) == text


def test_load_tokenizer_errors_and_pad_fallback(tmp_path):
    with pytest.raises(ValueError, match="nothing-here': no such directory"):  # local: not asked of the hub
        load_tokenizer(tmp_path / "nothing-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="could not be loaded"):  # there, but no tokenizer in it
        load_tokenizer(tmp_path / "empty")
    from transformers import PreTrainedTokenizerFast

    base = load_tokenizer(DEMO_TOKENIZER)
    no_pad = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|endoftext|>")
    no_pad.save_pretrained(tmp_path / "no_pad")
    tok = load_tokenizer(tmp_path / "no_pad")
    assert tok.pad_token_id == tok.eos_token_id == 0
    no_eos = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer)
    no_eos.save_pretrained(tmp_path / "no_eos")
    with pytest.raises(ValueError, match="has no EOS token"):
        load_tokenizer(tmp_path / "no_eos")


def test_tokenizer_training_is_deterministic():
    tool = load_tool("train_tokenizer")
    texts = tool.corpus_texts(seed=0, scale=0.03)
    first, second = tool.train(texts, 400).to_str(), tool.train(texts, 400).to_str()
    assert first == second
    assert tool.train(tool.corpus_texts(seed=1, scale=0.03), 400).to_str() != first


@pytest.mark.slow
def test_committed_tokenizer_is_reproduced_by_the_script(tmp_path):
    tool = load_tool("train_tokenizer")
    assert tool.main(["--out", str(tmp_path / "tok")]) == 0
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == (REPO_ROOT / "assets" / "tokenizer" / "tokenizer.json").read_bytes()


def test_a_tokenizer_reads_the_shards_when_it_gives_their_ids_the_same_tokens(output, tmp_path):
    # The shards (`output`) hold the demo tokenizer's ids and its fingerprint.
    from transformers import AutoTokenizer

    from pipeline.manifest import tokenizer_mismatch, vocab_fingerprint

    m = load_manifest(output)
    demo = load_tokenizer(DEMO_TOKENIZER)
    assert m.vocab_sha256 == vocab_fingerprint(demo, 4096) and tokenizer_mismatch(m, demo, "demo") is None
    # Tokens added after the shards' (a GGUF file's padded vocabulary) and another EOS (a base model's tokenizer
    # and its instruct model's): the shards' ids mean what they meant.
    grown = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    grown.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|im_end|>"})
    assert len(grown) == 4098 and grown.eos_token_id != m.eos_token_id
    assert tokenizer_mismatch(m, grown, "grown") is None
    # Another tokenizer of the same size gives the ids other tokens; a smaller one cannot hold them.
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(demo.backend_tokenizer.to_str())
    ids = spec["model"]["vocab"]
    a, b = (next(t for t, i in ids.items() if i == k) for k in (300, 301))
    ids[a], ids[b] = 301, 300  # two tokens trade ids
    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|endoftext|>")
    assert len(other) == 4096 and other.convert_ids_to_tokens(300) == b
    assert "its ids 0-4095 are other tokens than the shards'" in tokenizer_mismatch(m, other, "other")
    # Shards written before the fingerprint: the vocabulary size alone.
    old = dataclasses.replace(m, vocab_sha256=None)
    assert tokenizer_mismatch(old, other, "other") is None
    assert "vocabulary 4098, the shards' 4096" in tokenizer_mismatch(old, grown, "grown")


def test_a_mistyped_local_tokenizer_path_fails_at_once_naming_the_near_directory(tmp_path, monkeypatch):
    """A new-user review: `tokenizer_name=assets/tokenizr` asked the hub for it, about 52 s of retries without a
    network before the error. A path whose parent exists here, or that starts from the filesystem, is local."""
    import time

    import pytest

    from pipeline.gguf import missing_local_directory
    from pipeline.tokenizer import load_tokenizer

    monkeypatch.chdir(tmp_path)
    (tmp_path / "assets" / "tokenizer").mkdir(parents=True)
    assert missing_local_directory("assets/tokenizer") is None
    assert missing_local_directory("Qwen/Qwen2.5-3B") is None  # a hub name: no such parent here
    assert missing_local_directory("gpt2") is None
    assert missing_local_directory("/no/such/dir") == "no such directory"
    start = time.perf_counter()
    with pytest.raises(ValueError) as info:
        load_tokenizer("assets/tokenizr")
    assert time.perf_counter() - start < 5
    assert str(info.value) == ("`tokenizer` 'assets/tokenizr': no such directory (its parent 'assets' is here; "
                               "did you mean 'assets/tokenizer'?)")
