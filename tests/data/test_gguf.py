"""Pretrained models from GGUF files (issue 29.1): converted once to a cached model directory keyed by content.

The conversion path runs on a tiny GGUF the tests write with `gguf`'s own writer (tests/common/gguf_files.py):
the weights must come back exactly, the tokenizer with the file's special tokens and chat template, through
every loader that accepts a `.gguf` (`load_tokenizer`, `build_causal_lm`, evaluation, sharding). The real
SmolLM2 file in `../shared` is checked when it is present; its conversion takes about a minute here, so those
tests are marked slow.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import pipeline.gguf as gguf_mod
from pipeline.gguf import CACHE_ENV, check_gguf_file, gguf_model_dir
from pipeline.tokenizer import load_tokenizer
from tests.common.gguf_files import CHAT_TEMPLATE, TinyGGUF, write_tiny_gguf
from tests.common.paths import REPO_ROOT, require_shared_data


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyGGUF:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh cache for each test (never the user's ~/.cache)."""
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(root))
    return root


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """The targets of the conversions run during the test (the real ones still run)."""
    done: list[Path] = []
    real = gguf_mod._convert

    def counting(src, digest, target, field):
        done.append(target)
        time.sleep(0.3)  # widens the window in which a second process could start the same conversion
        return real(src, digest, target, field)

    monkeypatch.setattr(gguf_mod, "_convert", counting)
    return done


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():  # F32 in the file: exact, q/k back in Hugging Face's order
        assert torch.equal(got[name], tensor), name


def test_conversion_gives_an_ordinary_model_directory_with_the_weights_written(tiny, cache, conversions):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = gguf_model_dir(tiny.path)
    assert target.parent == cache / "gguf" and target.name.startswith(_sha256(tiny.path))  # keyed by content
    model = AutoModelForCausalLM.from_pretrained(target)
    want = tiny.model.config
    got = model.config
    assert (got.num_hidden_layers, got.hidden_size, got.num_attention_heads, got.num_key_value_heads) == (
        want.num_hidden_layers,
        want.hidden_size,
        want.num_attention_heads,
        want.num_key_value_heads,
    )
    assert (got.intermediate_size, got.vocab_size, got.tie_word_embeddings) == (want.intermediate_size, len(tiny.tokens), False)
    assert model.dtype == torch.float32
    _assert_same_weights(model.state_dict(), tiny.model.state_dict())
    ids = torch.tensor([[5, 80, 120, 261, 7, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tiny.model(ids).logits, rtol=1e-5, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert conversions == [target]


def test_tokenizer_has_the_files_special_tokens_and_chat_template(tiny, cache):
    tok = load_tokenizer(tiny.path)
    # The file says unknown 0, BOS 1, EOS 2, no BOS added (transformers' own GGUF loader makes the BOS the EOS).
    assert (tok.unk_token, tok.bos_token, tok.eos_token) == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert tok.eos_token_id == 2 and tok.pad_token_id == 2  # no padding id in the file: load_tokenizer pads with EOS
    ids = tok(" the this")["input_ids"]
    # Byte-level BPE with the file's merges: " the" is one token, " this" is " t" + "h" + "is".
    assert tok.convert_ids_to_tokens(ids) == ["Ġthe", "Ġt", "h", "is"]
    for text in [" the this is", "hello there", "Ünïcode ✓\ttabs\nlines", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.decode(tok(text)["input_ids"]) == text
    assert tok("<|im_end|>")["input_ids"] == [2]  # a special token, not its characters
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    )


def test_build_causal_lm_loads_the_weights_and_pretrained_false_keeps_the_architecture(tiny, cache, conversions):
    from composer_algos.models.causal_lm import build_causal_lm

    tok = load_tokenizer(tiny.path)
    model = build_causal_lm(tokenizer=tok, pretrained_model_name_or_path=str(tiny.path), pretrained=True)
    _assert_same_weights(model.model.state_dict(), tiny.model.state_dict())
    fresh = build_causal_lm(tokenizer=tok, pretrained_model_name_or_path=str(tiny.path), pretrained=False)
    assert fresh.model.config.num_key_value_heads == tiny.model.config.num_key_value_heads
    assert fresh.model.config.vocab_size == len(tiny.tokens)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert fresh.model.state_dict()[w].shape == tiny.model.state_dict()[w].shape
    assert not torch.equal(fresh.model.state_dict()[w], tiny.model.state_dict()[w])  # randomly initialised
    assert len(conversions) == 1  # the tokenizer's conversion served both models


def test_evaluation_loader_accepts_a_gguf(tiny, cache):
    from pipeline.evaluation.checkpoint import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(tiny.path, device="cpu", dtype=torch.float32)
    _assert_same_weights(model.state_dict(), tiny.model.state_dict())
    assert tok.eos_token == "<|im_end|>"


def test_sharding_with_a_gguf_tokenizer(tiny, cache, tmp_path):
    from pipeline.corpora import make_corpus_spec
    from pipeline.manifest import load_manifest
    from pipeline.sharding import ShardOptions, shard_corpus
    from tests.data.mds_helpers import read_mds, write_jsonl

    docs = [{"text": "the this is", "source": "a"}, {"text": "hello there", "source": "b"}]
    out = tmp_path / "shards"
    options = ShardOptions(out=out, tokenizer=str(tiny.path), max_seq_len=64, progress=False)
    shard_corpus(make_corpus_spec("dolma"), [write_jsonl(tmp_path / "in.jsonl", docs)], options)
    manifest = load_manifest(out)
    assert (manifest.eos_token_id, manifest.vocab_size) == (2, len(tiny.tokens))
    tok = load_tokenizer(tiny.path)
    ids = [int(t) for s in read_mds(manifest.split_dir("a", "train")) for t in s["input_ids"]]
    assert tok.decode(ids[: ids.index(2)]) == "the this is"


def test_second_load_reuses_the_entry_and_the_key_is_the_content(tiny, cache, conversions, tmp_path):
    first = gguf_model_dir(tiny.path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    copy = tmp_path / "renamed.GGUF"
    shutil.copyfile(tiny.path, copy)
    assert gguf_model_dir(tiny.path) == first and gguf_model_dir(copy) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp and conversions == [first]
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)
    assert gguf_model_dir(other.path) != first and len(conversions) == 2


def test_concurrent_loads_convert_once(tiny, cache, conversions):
    results: list[Path] = []
    errors: list[BaseException] = []

    def load():
        try:
            results.append(gguf_model_dir(tiny.path))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert len(conversions) == 1
    assert [p.name for p in (cache / "gguf").iterdir() if p.is_dir()] == [results[0].name]  # no staging left


def test_a_killed_conversions_staging_directory_is_removed(tiny, cache):
    stale = cache / "gguf" / f".{_sha256(tiny.path)}-v1.tmp-999999"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half written")
    target = gguf_model_dir(tiny.path)
    assert not stale.exists() and (target / "model.safetensors").stat().st_size > 1000


def test_missing_file(cache, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"`model` '.*nope\.gguf': no such GGUF file"):
        gguf_model_dir(tmp_path / "nope.gguf")


def test_a_file_that_is_not_gguf(cache, tmp_path):
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip archive")
    with pytest.raises(ValueError, match=r"'.*weights\.gguf' is not a GGUF file: it starts with b'PK\\x03\\x04'"):
        load_tokenizer(bad)
    assert not (cache / "gguf").exists()


def test_gguf_package_missing(tiny, cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    with pytest.raises(ImportError, match=r"`tokenizer` '.*tiny\.gguf' is a GGUF file.*pip install 'gguf"):
        load_tokenizer(tiny.path)


def test_unsupported_architecture(cache, tmp_path):
    odd = write_tiny_gguf(tmp_path / "odd.gguf", architecture="bert")
    with pytest.raises(ValueError, match=r"'.*odd\.gguf': GGUF architecture 'bert' is not one .*supported: llama, "):
        gguf_model_dir(odd.path, field="model.pretrained_model_name_or_path")
    assert [p for p in (cache / "gguf").iterdir() if p.is_dir()] == []


def test_config_validation_reports_a_bad_gguf_before_anything_is_built(tmp_path):
    from pipeline.config import ConfigError, load_config

    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"not gguf")
    overrides = ["model.config=null", f"model.pretrained_model_name_or_path={bad}", f"tokenizer_name={tmp_path}/nope.gguf"]
    with pytest.raises(ConfigError) as info:
        load_config(REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml", overrides)
    text = str(info.value)
    assert "`model.pretrained_model_name_or_path`" in text and "is not a GGUF file" in text
    assert "`tokenizer_name`" in text and "nope.gguf': no such GGUF file" in text


# The real file (../shared/data/smollm2): SmolLM2-135M-Instruct, Q4_1.
REAL = ("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_real_file_passes_the_checks():
    path = require_shared_data(*REAL)
    assert check_gguf_file(path, "model") == path
    metadata = gguf_mod._read_metadata(path, "model")
    assert metadata["general.architecture"] == "llama" and metadata["tokenizer.ggml.eos_token_id"] == 2


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The real file converted once into a cache of this module's own (about a minute here)."""
    path = require_shared_data(*REAL)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("real_cache")))
        start = time.perf_counter()
        target = gguf_model_dir(path)
        print(f"converted {path.name} in {time.perf_counter() - start:.1f} s")
        yield path, target


@pytest.mark.slow
def test_real_tokenizer_round_trip_and_chat_template(real):
    path, _ = real
    tok = load_tokenizer(path)
    assert len(tok) == 49152 and (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", 2, 2)
    for text in ["Hello world, 2+2=4", " leading space\nnew line\ttab", "Ünïcode ✓ 3.14159", "<|im_start|>user\nhi<|im_end|>"]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    assert tok("Hello")["input_ids"][0] != tok.bos_token_id  # the file says no BOS is added
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_real_forward_and_greedy_answer(real):
    from composer_algos.models.causal_lm import build_causal_lm

    path, _ = real
    tok = load_tokenizer(path)
    lm = build_causal_lm(tokenizer=tok, pretrained_model_name_or_path=str(path), pretrained=True).model.eval()
    assert lm.config.num_hidden_layers == 30 and lm.config.hidden_size == 576 and lm.config.num_key_value_heads == 3
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        logits = lm(ids).logits
        assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "4" in answer, answer


@pytest.mark.slow
def test_real_second_load_does_not_convert(real, monkeypatch):
    from transformers import AutoModelForCausalLM

    path, target = real

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_mod, "_convert", no_conversion)
    start = time.perf_counter()
    again = gguf_model_dir(path)
    load_tokenizer(path)
    AutoModelForCausalLM.from_pretrained(again)
    print(f"second load (hash, tokenizer, model): {time.perf_counter() - start:.2f} s")
    assert again == target
