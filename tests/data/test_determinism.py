"""Output bytes do not depend on --workers; the validation split is a deterministic, seeded function of record content."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.corpora import make_corpus_spec
from pipeline.manifest import load_manifest
from pipeline.sharding import ShardOptions, shard_corpus
from pipeline.tokenizer import DEMO_TOKENIZER
from tests.data.mds_helpers import read_output, write_jsonl


def _options(out: Path, **kw) -> ShardOptions:
    kw.setdefault("max_seq_len", 64)
    kw.setdefault("chunk_records", 16)  # many chunks, so workers really interleave
    return ShardOptions(out=out, tokenizer=DEMO_TOKENIZER, progress=False, **kw)


def _tree_bytes(out: Path) -> dict[str, bytes]:
    files = {}
    for path in sorted(out.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            if path.name == "manifest.json":
                obj = json.loads(data)
                obj.pop("created"), obj.pop("command")
                data = json.dumps(obj, sort_keys=True).encode()
            files[str(path.relative_to(out))] = data
    return files


@pytest.mark.parametrize(
    "fmt, subdir, kw",
    [
        ("dolma", "dolma/documents", {"val_fraction": 0.1}),
        ("metamathqa", "metamathqa", {"val_count": 5}),
    ],
)
def test_output_is_identical_for_any_worker_count(sample_corpus, tmp_path, fmt, subdir, kw):
    spec = make_corpus_spec(fmt)
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        shard_corpus(spec, [sample_corpus / subdir], _options(out, workers=workers, **kw))
        outs.append(_tree_bytes(out))
    assert outs[0].keys() == outs[1].keys() and len(outs[0]) > 3
    assert outs[0] == outs[1]


def _val_texts(out: Path, tokenizer) -> dict[str, set[str]]:
    """Domain -> the decoded texts of its validation records (finetune: response texts)."""
    result: dict[str, set[str]] = {}
    for (domain, split), samples in read_output(out).items():
        if split == "val":
            result[domain] = {tokenizer.decode(s["response_ids"][:-1]) for s in samples}
    return result


def _records(n_domains: int, per_domain: int) -> list[dict]:
    return [{"query": f"question {d}-{i}", "response": f"answer {d}-{i}", "type": f"dom{d}"} for d in range(n_domains) for i in range(per_domain)]


def test_val_split_depends_on_seed_and_content_not_order(tmp_path, tokenizer):
    records = _records(3, 40)
    forward = tmp_path / "fwd.json"
    forward.write_text(json.dumps(records))
    backward = tmp_path / "bwd.json"
    backward.write_text(json.dumps(records[::-1]))
    spec = make_corpus_spec("metamathqa")
    runs = {}
    for name, path, seed in (("a", forward, 1), ("again", forward, 1), ("reversed", backward, 1), ("other-seed", forward, 2)):
        shard_corpus(spec, [path], _options(tmp_path / name, val_count=6, seed=seed))
        runs[name] = _val_texts(tmp_path / name, tokenizer)
    assert all(len(v) == 6 for v in runs["a"].values()) and len(runs["a"]) == 3
    assert runs["a"] == runs["again"] == runs["reversed"]
    assert runs["a"] != runs["other-seed"]


def test_val_fraction_is_close_to_the_fraction(tmp_path):
    path = tmp_path / "mm.json"
    path.write_text(json.dumps(_records(2, 1000)))
    shard_corpus(make_corpus_spec("metamathqa"), [path], _options(tmp_path / "o", val_fraction=0.1))
    for d in load_manifest(tmp_path / "o").domains:
        # Binomial(1000, 0.1): standard deviation ~9.5, so 60..140 is a > 4-sigma band.
        assert 60 <= d.splits["val"].records <= 140
        assert d.splits["train"].records + d.splits["val"].records == 1000


@pytest.mark.parametrize("rule", [{"val_count": 10}, {"val_fraction": 0.999}], ids=["count", "fraction"])
def test_tiny_domain_keeps_a_training_record(tmp_path, rule):
    docs = [{"text": "only document of its kind", "source": "tiny"}] + [{"text": f"doc {i}", "source": "big"} for i in range(30)]
    path = write_jsonl(tmp_path / "in.jsonl", docs)
    shard_corpus(make_corpus_spec("dolma"), [path], _options(tmp_path / "o", seed=0, **rule))
    by_name = {d.name: d for d in load_manifest(tmp_path / "o").domains}
    assert by_name["tiny"].splits["train"].records == 1 and by_name["tiny"].splits["val"].records == 0
    assert by_name["big"].splits["train"].records >= 1
    if "val_count" in rule:
        assert by_name["big"].splits["val"].records == 10
