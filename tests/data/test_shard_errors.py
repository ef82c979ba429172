"""Bad input (stop names file:line; skip writes rejects and reconciles), atomic output, --overwrite, verify, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.corpora import make_corpus_spec
from pipeline.manifest import load_manifest, verify_output
from pipeline.sharding import REJECTS_NAME, ShardError, ShardOptions, shard_corpus
from pipeline.tokenizer import DEMO_TOKENIZER
from tests.data.mds_helpers import load_tool, read_mds, write_jsonl

GOOD = [{"text": f"good document number {i}", "source": "a" if i % 2 else "b"} for i in range(6)]
MAP = {"a": "alpha", "b": "beta"}

# case -> (bad line bytes, expected words in the error, domain the reject is counted under, needs the map)
BAD_CASES = {
    "malformed_json": (b'{"text": "unterminated", "source": "a"', "malformed JSON", None, False),
    "missing_field": (b'{"source": "a", "body": "no text field"}', "missing field 'text'", "a", False),
    "empty_text": (b'{"text": "  \\n ", "source": "b"}', "empty text in field 'text'", "b", False),
    "invalid_utf8": (b'{"text": "caf\xe9 latin-1", "source": "a"}', "invalid UTF-8", None, False),
    "unmapped_domain": (b'{"text": "from nowhere", "source": "zzz"}', "unmapped domain 'zzz'", None, True),
    "not_an_object": (b'["text", "source"]', "expected an object", None, False),
    "non_string_text": (b'{"text": 42, "source": "b"}', "field 'text' must be a string", "b", False),
}


def _options(out: Path, **kw) -> ShardOptions:
    kw.setdefault("max_seq_len", 16)
    return ShardOptions(out=out, tokenizer=DEMO_TOKENIZER, progress=False, **kw)


def _bad_file(tmp_path: Path, bad: bytes) -> Path:
    lines: list[bytes | dict] = [GOOD[0], GOOD[1], bad, *GOOD[2:]]  # the bad record is on line 3
    return write_jsonl(tmp_path / "in" / "bad.jsonl.gz", lines)


def _spec(uses_map: bool):
    return make_corpus_spec("dolma", domain_map=MAP if uses_map else None, domain_map_source="map.json")


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_stops_with_file_and_line(tmp_path, case):
    bad, words, _, uses_map = BAD_CASES[case]
    path = _bad_file(tmp_path, bad)
    out = tmp_path / "out"
    with pytest.raises(ShardError) as info:
        shard_corpus(_spec(uses_map), [path], _options(out))
    message = str(info.value)
    assert message.startswith("bad.jsonl.gz:3: ") and words in message
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in"]  # the temporary directory is gone too


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_skip_writes_rejects_and_reconciles(tmp_path, case):
    bad, words, domain, uses_map = BAD_CASES[case]
    path = _bad_file(tmp_path, bad)
    out = tmp_path / "out"
    shard_corpus(_spec(uses_map), [path], _options(out, on_error="skip"))
    rejects = [json.loads(line) for line in (out / REJECTS_NAME).read_text().splitlines()]
    assert len(rejects) == 1
    assert rejects[0]["file"] == "bad.jsonl.gz" and rejects[0]["line"] == 3 and words in rejects[0]["error"]
    final = MAP.get(domain, domain) if uses_map else domain
    assert rejects[0]["domain"] == final and rejects[0]["record"] is not None

    manifest = load_manifest(out)
    by_name = {d.name: d for d in manifest.domains}
    good_per_domain = {"a": 3, "b": 3}
    for raw, n in good_per_domain.items():
        d = by_name[MAP[raw] if uses_map else raw]
        assert d.splits["train"].records == n
        assert d.input_records == n + d.rejected
    assert sum(d.rejected for d in manifest.domains) + manifest.rejected_other == 1
    assert manifest.rejected_other == (1 if domain is None else 0)
    assert manifest.inputs[0].records == 7
    assert verify_output(out) == []


def test_instruction_array_errors_name_the_line(tmp_path):
    records = [
        {"query": "What is 1+1?", "response": "2\nThe answer is: 2", "type": "GSM_AnsAug"},
        {"query": "What is 2+2?", "type": "GSM_AnsAug"},
        {"query": "What is 3+3?", "response": "", "type": "MATH_SV"},
    ]
    path = tmp_path / "mm.json"
    path.write_text(json.dumps(records, indent=4))
    with pytest.raises(ShardError, match=r"^mm\.json:7: element 1: missing field 'response'"):
        shard_corpus(make_corpus_spec("metamathqa"), [path], _options(tmp_path / "o1"))
    shard_corpus(make_corpus_spec("metamathqa"), [path], _options(tmp_path / "o2", on_error="skip"))
    rejects = [json.loads(line) for line in (tmp_path / "o2" / REJECTS_NAME).read_text().splitlines()]
    assert [(r["line"], r["domain"]) for r in rejects] == [(7, "GSM_AnsAug"), (11, "MATH_SV")]
    assert "empty text in field 'response'" in rejects[1]["error"]
    manifest = load_manifest(tmp_path / "o2")
    # MATH_SV has nothing written: it is left out, its reject counted as rejected_other.
    assert manifest.domain_names == ["GSM_AnsAug"] and manifest.rejected_other == 1


def test_malformed_json_array_is_fatal_even_when_skipping(tmp_path):
    path = tmp_path / "mm.json"
    path.write_text('[\n  {"query": "q", "response": "r", "type": "t"},\n  {"query": "q2" "response": "r"}\n]\n')
    with pytest.raises(ShardError, match=r"mm\.json:3: malformed JSON in array element 1"):
        shard_corpus(make_corpus_spec("metamathqa"), [path], _options(tmp_path / "o", on_error="skip"))
    assert not (tmp_path / "o").exists()


def test_truncation_policy_drops_are_counted_not_fatal(tmp_path):
    long_response = "word " * 200
    records = [
        {"query": "short?", "response": "yes", "type": "t"},
        {"query": "long?", "response": long_response, "type": "t"},
    ]
    path = tmp_path / "mm.json"
    path.write_text(json.dumps(records))
    shard_corpus(make_corpus_spec("metamathqa"), [path], _options(tmp_path / "o", prompt_template="none", truncation="skip"))
    (d,) = load_manifest(tmp_path / "o").domains
    assert (d.input_records, d.rejected, d.too_long, d.splits["train"].records) == (2, 1, 1, 1)


def test_existing_output_needs_overwrite(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", GOOD)
    out = tmp_path / "out"
    shard_corpus(_spec(False), [path], _options(out))
    marker = out / "train" / "a" / "index.json"
    before = marker.read_bytes()
    with pytest.raises(ValueError, match="already exists; pass --overwrite"):
        shard_corpus(_spec(False), [path], _options(out, max_seq_len=8))
    assert marker.read_bytes() == before
    shard_corpus(_spec(False), [path], _options(out, max_seq_len=8, overwrite=True))
    assert load_manifest(out).max_seq_len == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out"]  # no temporary or old directories left


def test_overwrite_refuses_a_directory_that_is_not_an_output(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", GOOD)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("do not delete")
    with pytest.raises(ValueError, match="not a sharded corpus"):
        shard_corpus(_spec(False), [path], _options(precious, overwrite=True))
    assert (precious / "thesis.tex").read_text() == "do not delete"


@pytest.fixture
def small_output(tmp_path) -> Path:
    docs = [{"text": f"document {i} " + "lorem ipsum dolor " * (i % 7), "source": "ab"[i % 2]} for i in range(60)]
    path = write_jsonl(tmp_path / "in.jsonl.gz", docs)
    out = tmp_path / "out"
    shard_corpus(_spec(False), [path], _options(out, val_count=4, size_limit=400))
    assert len(json.loads((out / "train" / "a" / "index.json").read_text())["shards"]) > 1
    return out


def test_verify_accepts_a_clean_output(small_output):
    assert verify_output(small_output, check_inputs=True) == []


def _corrupt_shard(out: Path) -> None:
    shard = sorted((out / "train" / "a").glob("*.zstd"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _edit_manifest(out: Path, edit) -> None:
    obj = json.loads((out / "manifest.json").read_text())
    edit(obj)
    (out / "manifest.json").write_text(json.dumps(obj))


@pytest.mark.parametrize(
    "damage, expected",
    [
        (_corrupt_shard, "sha1 mismatch"),
        (lambda out: sorted((out / "val" / "b").glob("*.zstd"))[0].unlink(), "missing shard file"),
        (lambda out: _edit_manifest(out, lambda m: m["domains"][0]["splits"]["train"].update(tokens=1)), "manifest says"),
        (lambda out: _edit_manifest(out, lambda m: m["domains"][1].update(rejected=5)), "input_records"),
        (lambda out: _edit_manifest(out, lambda m: m.pop("max_seq_len")), "missing field `max_seq_len`"),
        (lambda out: (out / "train" / "stray").mkdir(), "train/stray: directory not in the manifest"),
        (lambda out: (out / "rejects.jsonl").write_text('{"file": "x"}\n'), "rejects.jsonl: 1 lines"),
    ],
    ids=["flipped-byte", "missing-shard", "token-count", "reconciliation", "missing-field", "stray-dir", "rejects-count"],
)
def test_verify_reports_damage(small_output, damage, expected):
    damage(small_output)
    problems = verify_output(small_output)
    assert any(expected in p for p in problems), problems


def test_verify_notices_changed_inputs(small_output):
    manifest = load_manifest(small_output)
    Path(manifest.inputs[0].path).write_bytes(b"{}\n")
    assert verify_output(small_output) == []
    assert any("changed since sharding" in p for p in verify_output(small_output, check_inputs=True))


def test_cli_help_and_exit_codes(tmp_path, capsys):
    shard = load_tool("shard")
    with pytest.raises(SystemExit) as info:
        shard.main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert all(word in text for word in ("dolma", "metamathqa", "mol", "jsonl", "verify", "--max-seq-len"))
    for fmt in ("dolma", "metamathqa", "mol", "jsonl"):
        with pytest.raises(SystemExit):
            shard.main([fmt, "--help"])
        text = capsys.readouterr().out
        assert all(word in text for word in ("--on-error", "--val-fraction", "--val-count", "--workers", "--overwrite", "--domain-map"))

    path = _bad_file(tmp_path, BAD_CASES["malformed_json"][0])
    assert shard.main(["dolma", str(path), "--out", str(tmp_path / "o"), "--max-seq-len", "16", "--no-progress"]) == 1
    assert "bad.jsonl.gz:3: malformed JSON" in capsys.readouterr().err
    args = ["dolma", str(path), "--out", str(tmp_path / "o"), "--max-seq-len", "16", "--no-progress", "--on-error", "skip"]
    assert shard.main(args) == 0
    summary = capsys.readouterr().out
    assert "records read 7 = written 6 + rejected 1" in summary and "tokens/s" in summary
    assert shard.main(["verify", str(tmp_path / "o")]) == 0
    assert shard.main(args) == 2  # exists, no --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert load_manifest(tmp_path / "o").command.startswith("tools/shard.py dolma ")


def test_finetune_needs_prompt_response_records(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", GOOD)
    with pytest.raises(ValueError, match="finetune needs prompt/response records"):
        shard_corpus(_spec(False), [path], _options(tmp_path / "o", mode="finetune"))


def test_jsonl_generic_fields(tmp_path):
    rows = [{"q": {"text": f"question {i}?"}, "a": f"answer {i}", "topic": "t1" if i < 3 else "t2", "part": "dev" if i == 4 else "tr"} for i in range(6)]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    spec = make_corpus_spec("jsonl", prompt_field="q.text", response_field="a", domain_field="topic", split_field="part", split="tr")
    out = tmp_path / "o"
    shard_corpus(spec, [path], _options(out, max_seq_len=64))
    manifest = load_manifest(out)
    assert {d.name: d.input_records for d in manifest.domains} == {"t1": 3, "t2": 2} and manifest.filtered_out == 1
    assert manifest.prompt_template == "none"
    samples = read_mds(manifest.split_dir("t2", "train"))
    assert [s["record"] for s in samples] == ["qa.jsonl:4", "qa.jsonl:6"]


def test_shards_of_the_default_demo_tokenizer_are_announced(tmp_path, capsys):
    """A new-user review: without --tokenizer, shard.py wrote the 4096-token demo tokenizer's ids without a word
    (hours of sharding a real corpus that train.py then refuses for the model's tokenizer)."""
    shard = load_tool("shard")
    docs = tmp_path / "docs.jsonl"
    write_jsonl(docs, [{"text": f"document {i} " * 20, "source": "wiki"} for i in range(6)])
    assert shard.main(["dolma", str(docs), "--out", str(tmp_path / "a"), "--max-seq-len", "32", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"no --tokenizer: writing the ids of the demo tokenizer {DEMO_TOKENIZER}" in out, out
    assert load_manifest(str(tmp_path / "a")).tokenizer == DEMO_TOKENIZER
    assert shard.main(["dolma", str(docs), "--out", str(tmp_path / "b"), "--max-seq-len", "32", "--no-progress",
                       "--tokenizer", DEMO_TOKENIZER]) == 0
    assert "no --tokenizer" not in capsys.readouterr().out
