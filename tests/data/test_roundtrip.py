"""Round trips: every input record of the three formats comes back out of the MDS shards under its domain, and counts reconcile."""

from __future__ import annotations

import collections
import gzip
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipeline.corpora import make_corpus_spec
from pipeline.manifest import load_manifest, verify_output
from pipeline.sharding import ShardOptions, shard_corpus
from pipeline.tokenizer import DEMO_TOKENIZER
from tests.common.paths import require_shared_data
from tests.data.mds_helpers import read_mds, read_output

# Stanford Alpaca's prompts (MetaMath trains with them), written out independently of pipeline.prompts.
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)
ALPACA_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)


def _options(out: Path, **kw) -> ShardOptions:
    kw.setdefault("max_seq_len", 64)
    return ShardOptions(out=out, tokenizer=DEMO_TOKENIZER, progress=False, chunk_records=32, **kw)


def _read_dolma_texts(files: list[Path], domain_of) -> dict[str, list[str]]:
    """An independent reader: split on b"\\n" only, one JSON document per non-blank line."""
    texts: dict[str, list[str]] = collections.defaultdict(list)
    for path in files:
        for line in gzip.decompress(path.read_bytes()).split(b"\n"):
            if line.strip():
                doc = json.loads(line)
                texts[domain_of(path, doc)].append(doc["text"])
    return texts


def _split_on_eos(samples: list[dict], eos: int) -> list[list[int]]:
    flat = np.concatenate([s["input_ids"] for s in samples]) if samples else np.zeros(0, np.int32)
    assert len(flat) == 0 or flat[-1] == eos, "a domain split must end with EOS"
    cuts = np.flatnonzero(flat == eos)
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [flat[a:b].tolist() for a, b in zip(starts, cuts)]


@pytest.mark.parametrize("with_real", [False, True], ids=["generated", "generated+real"])
def test_dolma_pretrain_roundtrip(sample_corpus, tokenizer, tmp_path, with_real):
    inputs = [sample_corpus / "dolma" / "documents"]
    files = sorted(inputs[0].rglob("*.json.gz"))
    if with_real:
        real = require_shared_data("dolma")
        inputs.append(real)
        files += sorted(p for p in real.iterdir() if p.name.endswith(".gz"))
    out = tmp_path / "out"
    result = shard_corpus(make_corpus_spec("dolma"), inputs, _options(out, max_seq_len=48, val_fraction=0.25, seed=3))
    manifest = load_manifest(out)
    expected = _read_dolma_texts(files, lambda path, doc: doc["source"])

    assert manifest.domain_names == sorted(expected)
    data = read_output(out)
    for d in manifest.domains:
        got = {}
        for split in ("train", "val"):
            samples = data[(d.name, split)]
            lengths = [len(s["input_ids"]) for s in samples]
            assert all(n == 48 for n in lengths[:-1]) and (not lengths or 0 < lengths[-1] <= 48)
            assert (d.splits[split].samples, d.splits[split].tokens) == (len(samples), sum(lengths))
            got[split] = [tokenizer.decode(ids) for ids in _split_on_eos(samples, manifest.eos_token_id)]
            assert len(got[split]) == d.splits[split].records
        assert collections.Counter(got["train"] + got["val"]) == collections.Counter(expected[d.name]), d.name
        assert d.input_records == len(expected[d.name]) and d.rejected == 0
        assert d.splits["train"].records >= 1
    n_records = sum(map(len, expected.values()))
    n_val = sum(d.splits["val"].records for d in manifest.domains)
    assert 0.15 * n_records < n_val < 0.35 * n_records  # val_fraction 0.25
    assert result.records_read == n_records == sum(i.records for i in manifest.inputs)
    assert [i.sha256 for i in manifest.inputs] == [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
    assert verify_output(out, check_inputs=True) == []


def test_dolma_domain_from_dir_and_mapping(sample_corpus, tmp_path):
    """documents/<source>/ gives the domain; a mapping merges two sources and renames the rest with '*'."""
    mapping = {"reddit": "social", "stackexchange": "social", "*": "web-and-wiki"}
    spec = make_corpus_spec("dolma", domain_from="dir", domain_map=mapping)
    out = tmp_path / "out"
    shard_corpus(spec, [sample_corpus / "dolma" / "documents"], _options(out))
    manifest = load_manifest(out)
    counts = collections.Counter()
    for path in (sample_corpus / "dolma" / "documents").rglob("*.json.gz"):
        n = sum(1 for line in gzip.decompress(path.read_bytes()).split(b"\n") if line.strip())
        counts[mapping.get(path.parent.name, mapping["*"])] += n
    assert {d.name: d.input_records for d in manifest.domains} == dict(counts)


def _load_arrays(paths: list[Path]) -> dict[str, list[dict]]:
    return {p.name: json.loads(p.read_text()) for p in paths}  # files given by path are named by their base name


def _check_finetune_output(out: Path, arrays: dict[str, list[dict]], domain_of, keep, tokenizer) -> None:
    manifest = load_manifest(out)
    seen = collections.Counter()
    for (domain, _split), samples in read_output(out).items():
        for s in samples:
            display, loc = s["record"].rsplit(":", 1)
            rec = arrays[display][int(loc)]
            seen[(display, int(loc))] += 1
            assert domain_of(rec) == domain
            assert s["response_ids"][-1] == manifest.eos_token_id
            assert tokenizer.decode(s["response_ids"][:-1]) == rec.get("response", rec.get("output"))
            if "query" in rec:
                prompt = ALPACA_NO_INPUT.format(instruction=rec["query"])
            elif rec["input"]:
                prompt = ALPACA_INPUT.format(instruction=rec["instruction"], input=rec["input"])
            else:
                prompt = ALPACA_NO_INPUT.format(instruction=rec["instruction"])
            assert tokenizer.decode(s["prompt_ids"]) == prompt
    wanted = {(display, i) for display, arr in arrays.items() for i, rec in enumerate(arr) if keep(rec)}
    assert set(seen) == wanted and max(seen.values()) == 1  # every kept record exactly once
    per_domain = collections.Counter(domain_of(rec) for display, arr in arrays.items() for rec in arr if keep(rec))
    assert {d.name: d.input_records for d in manifest.domains} == dict(per_domain)
    assert all(d.rejected == 0 and d.truncated == 0 for d in manifest.domains)
    assert manifest.filtered_out == sum(not keep(rec) for arr in arrays.values() for rec in arr)
    assert verify_output(out) == []


@pytest.mark.parametrize("with_real", [False, True], ids=["generated", "generated+real"])
def test_metamathqa_finetune_roundtrip(sample_corpus, tokenizer, tmp_path, with_real):
    paths = [sample_corpus / "metamathqa" / "MetaMathQA-sample.json"]
    if with_real:
        paths.append(require_shared_data("metamathqa", "metamathqa_first3.json"))
    out = tmp_path / "out"
    shard_corpus(make_corpus_spec("metamathqa"), paths, _options(out, max_seq_len=1024, val_count=3))
    _check_finetune_output(out, _load_arrays(paths), lambda r: r["type"], lambda r: True, tokenizer)
    manifest = load_manifest(out)
    assert manifest.prompt_template == "alpaca" and manifest.mode == "finetune"
    assert all(d.splits["val"].records == min(3, d.input_records - 1) for d in manifest.domains)
    assert len(manifest.domains) == 8


@pytest.mark.parametrize("with_real", [False, True], ids=["generated", "generated+real"])
def test_mol_instructions_finetune_roundtrip(sample_corpus, tokenizer, tmp_path, with_real):
    paths = sorted((sample_corpus / "mol_instructions").glob("*.json"))
    if with_real:
        paths += sorted(require_shared_data("mol_instructions").glob("*.json"))
    out = tmp_path / "out"
    shard_corpus(make_corpus_spec("mol", split="train"), paths, _options(out, max_seq_len=4096))
    keep = lambda r: r["metadata"].get("split", "train") == "train"  # noqa: E731 - records without a split are kept
    _check_finetune_output(out, _load_arrays(paths), lambda r: r["metadata"]["task"], keep, tokenizer)


def test_streaming_dataset_reads_the_output(sample_corpus, tmp_path):
    """The lead's reader will use StreamingDataset; it must accept a domain directory as written."""
    from streaming import StreamingDataset

    out = tmp_path / "out"
    shard_corpus(make_corpus_spec("mol"), [sample_corpus / "mol_instructions"], _options(out, max_seq_len=512))
    manifest = load_manifest(out)
    copy = tmp_path / "copy"
    shutil.copytree(manifest.split_dir(0, "train"), copy)  # StreamingDataset decompresses in place
    dataset = StreamingDataset(local=str(copy), shuffle=False, batch_size=1)
    assert len(dataset) == manifest.domains[0].splits["train"].samples
    direct = read_mds(manifest.split_dir(0, "train"))
    for i in (0, len(dataset) - 1):
        assert np.array_equal(dataset[i]["response_ids"], direct[i]["response_ids"])
        assert dataset[i]["record"] == direct[i]["record"]
