"""Readers: containers and compressions, line splitting, array line numbers, domains and maps, split filter; prompts; truncation."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import zstandard

from pipeline.corpora import (
    CorpusError,
    RecordError,
    iter_raw_records,
    list_input_files,
    load_domain_map,
    make_corpus_spec,
    parse_record,
)
from pipeline.prompts import render_prompt, resolve_prompt_template
from pipeline.sharding import truncate_example

DOCS = [
    {"id": "1", "text": "line one\u2028still record one\u2029and more", "source": "web"},
    {"id": "2", "text": "second\r\nrecord with CRLF inside", "source": "wiki"},
    {"id": "3", "text": "third \u0085 NEL and \x0b VT and \x0c FF", "source": "web"},
]


def _payload() -> bytes:
    return b"".join(json.dumps(d, ensure_ascii=False).encode() + b"\n" for d in DOCS)


@pytest.mark.parametrize(
    "name, encode",
    [
        ("docs.json.gz", lambda b: gzip.compress(b)),  # Dolma's .json.gz files hold JSON Lines
        ("docs.jsonl.gz", lambda b: gzip.compress(b)),
        ("docs.json.zst", lambda b: zstandard.ZstdCompressor().compress(b)),
        ("docs.jsonl.zst", lambda b: zstandard.ZstdCompressor().compress(b)),
        ("docs.jsonl", lambda b: b),
        ("docs.json", lambda b: b"\xef\xbb\xbf" + b.replace(b"\n", b"\r\n") + b"\n\n"),  # BOM, CRLF, blank lines
    ],
)
def test_json_lines_in_every_container_keep_unicode_separators(tmp_path, name, encode):
    path = tmp_path / name
    path.write_bytes(encode(_payload()))
    (file,) = list_input_files([path])
    spec = make_corpus_spec("dolma")
    parsed = [parse_record(spec, raw, file.dir_domain) for raw in iter_raw_records(file)]
    assert [p.text for p in parsed] == [d["text"] for d in DOCS]  # str.splitlines would have cut record 1 and 3
    assert [p.domain for p in parsed] == ["web", "wiki", "web"]
    assert [raw.line for raw in iter_raw_records(file)] == [1, 2, 3]


def test_json_array_elements_carry_their_start_line(tmp_path):
    records = [{"query": f"q{i}", "response": f"r{i}", "type": "t"} for i in range(3)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(records, indent=4))
    (file,) = list_input_files([path])
    raws = list(iter_raw_records(file))
    lines = path.read_text().split("\n")
    assert [r.loc for r in raws] == [0, 1, 2]
    assert all(lines[r.line - 1].strip() == "{" for r in raws)
    assert [lines[r.line].strip() for r in raws] == [f'"query": "q{i}",' for i in range(3)]


@pytest.mark.parametrize(
    "text, match",
    [
        ('[{"a": 1} {"b": 2}]', "malformed JSON array: expected ',' or ']' after element 0"),
        ("[1, 2", "unexpected end of file after element 1"),
        ('[1, {"a": }]', "malformed JSON in array element 1"),
        ("[1 2]", "expected ',' or ']'"),
        ("[1, 2] trailing", "unexpected data after the JSON array"),
    ],
)
def test_broken_json_arrays(tmp_path, text, match):
    path = tmp_path / "a.json"
    path.write_text(text)
    (file,) = list_input_files([path])
    with pytest.raises(CorpusError, match=match):
        list(iter_raw_records(file))


def test_invalid_utf8_in_array_file_names_the_line(tmp_path):
    path = tmp_path / "a.json"
    path.write_bytes(b'[\n {"query": "ok", "response": "r", "type": "t"},\n {"query": "caf\xe9"}\n]')
    (file,) = list_input_files([path])
    with pytest.raises(CorpusError, match=r"a\.json:3: invalid UTF-8"):
        list(iter_raw_records(file))


def test_directory_inputs_and_dolma_dir_domains(tmp_path):
    root = tmp_path / "release" / "documents"
    for rel in ("wiki/part-0.json.gz", "wiki/deeper/part-1.json.gz", "reddit/r.jsonl.zst", "README.md"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"")
    files = list_input_files([root])
    assert [(f.display, f.dir_domain) for f in files] == [
        ("documents/reddit/r.jsonl.zst", "reddit"),
        ("documents/wiki/deeper/part-1.json.gz", "wiki"),
        ("documents/wiki/part-0.json.gz", "wiki"),
    ]
    loose = tmp_path / "loose" / "x.jsonl"
    loose.parent.mkdir()
    loose.write_text("")
    assert list_input_files([loose])[0].dir_domain == "loose"
    with pytest.raises(ValueError, match="must end in one of"):
        list_input_files([root / "README.md"])
    with pytest.raises(ValueError, match="does not exist"):
        list_input_files([tmp_path / "nope"])


def test_same_base_name_in_two_inputs_gets_full_paths(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "x.jsonl").write_text("")
    files = list_input_files([tmp_path / "a" / "x.jsonl", tmp_path / "b" / "x.jsonl", tmp_path / "a" / "x.jsonl"])
    assert [f.display for f in files] == [str(tmp_path / "a" / "x.jsonl"), str(tmp_path / "b" / "x.jsonl")]


def test_domain_map_files(tmp_path):
    (tmp_path / "m.yaml").write_text("reddit: social\nstackexchange: social\n'*': other\n")
    assert load_domain_map(tmp_path / "m.yaml") == {"reddit": "social", "stackexchange": "social", "*": "other"}
    (tmp_path / "m.json").write_text(json.dumps({"a": ""}))
    with pytest.raises(ValueError, match="non-empty strings"):
        load_domain_map(tmp_path / "m.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="could not be parsed"):
        load_domain_map(tmp_path / "bad.json")


def _raw(obj) -> object:
    from pipeline.corpora import RawRecord

    return RawRecord(line=1, loc=0, payload=obj)


def test_mol_split_filter_and_missing_split():
    spec = make_corpus_spec("mol", split="train")
    base = {"instruction": "Design a molecule.", "input": "", "output": "[C][O]"}
    kept = parse_record(spec, _raw({**base, "metadata": {"task": "design", "split": "train"}}), "d")
    assert kept is not None and kept.domain == "design" and kept.input == ""
    assert parse_record(spec, _raw({**base, "metadata": {"task": "design", "split": "test"}}), "d") is None
    assert parse_record(spec, _raw({**base, "metadata": {"task": "design"}}), "d") is not None  # text tasks carry no split
    assert parse_record(make_corpus_spec("mol", split="any"), _raw({**base, "metadata": {"task": "x", "split": "test"}}), "d") is not None
    with pytest.raises(RecordError, match="missing field 'metadata.task'"):
        parse_record(spec, _raw({**base, "metadata": {}}), "d")


def test_spec_validation():
    with pytest.raises(ValueError, match="must be one of"):
        make_corpus_spec("parquet")
    with pytest.raises(ValueError, match="not both"):
        make_corpus_spec("jsonl", text_field="t", response_field="r")
    spec = make_corpus_spec("jsonl", response_field="answer")
    assert (spec.prompt_field, spec.response_field, spec.default_mode) == ("prompt", "answer", "finetune")
    assert make_corpus_spec("dolma", domain_from="source").domain_from == "field"


def test_prompt_templates():
    assert render_prompt("alpaca", "What is 2+3?") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nWhat is 2+3?\n\n### Response:"
    )
    assert render_prompt("alpaca", "Translate.", "[C][O]").endswith("### Instruction:\nTranslate.\n\n### Input:\n[C][O]\n\n### Response:")
    assert render_prompt("Q: {instruction}\nA:", "Why?") == "Q: Why?\nA:"
    assert render_prompt("Q: {instruction}\nA:", "Why?", "ctx") == "Q: Why?\n\nctx\nA:"
    assert render_prompt("Q: {instruction} [{input}] {{x}}", "Why?", "ctx") == "Q: Why? [ctx] {x}"
    assert render_prompt("none", "{braces} stay", "") == "{braces} stay"
    for bad in ("no placeholder", "{instruction} {answer}", "{instruction", "{}"):
        with pytest.raises(ValueError, match="prompt_template"):
            resolve_prompt_template(bad)


def _a(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


@pytest.mark.parametrize(
    "policy, prompt, response, limit, expected",
    [
        ("left_prompt", (1, 2, 3), (7, 8, 0), 6, ((1, 2, 3), (7, 8, 0), False)),
        ("left_prompt", (1, 2, 3, 4), (7, 8, 0), 5, ((3, 4), (7, 8, 0), True)),
        ("left_prompt", (1, 2), (7, 8, 9, 0), 4, None),  # no room for a prompt token
        ("right", (1, 2, 3), (7, 8, 9, 0), 5, ((1, 2, 3), (7, 8), True)),
        ("right", (1, 2, 3), (7, 0), 3, None),  # no response token left
        ("skip", (1, 2), (7, 0), 3, None),
        ("skip", (1, 2), (7, 0), 4, ((1, 2), (7, 0), False)),
    ],
)
def test_truncation_policies(policy, prompt, response, limit, expected):
    got = truncate_example(_a(*prompt), _a(*response), limit, policy)
    if expected is None:
        assert got is None
    else:
        assert got is not None
        assert (tuple(got[0].tolist()), tuple(got[1].tolist()), got[2]) == expected


def test_fast_mds_writer_matches_streaming_bytes(tmp_path):
    """The direct column encoder must produce exactly what MDSWriter's generic path produces."""
    from streaming import MDSWriter

    from pipeline.mds_writer import FastMDSWriter
    from pipeline.sharding import columns_for_mode

    rng = np.random.default_rng(0)
    arrays = [rng.integers(-(2**31), 2**31 - 1, size=n, dtype=np.int32) for n in (1, 2, 255, 256, 1000, 65535, 65536, 70000)]
    for mode in ("pretrain", "finetune"):
        outs = {}
        for name, cls in (("generic", MDSWriter), ("fast", FastMDSWriter)):
            with cls(out=str(tmp_path / mode / name), columns=columns_for_mode(mode), compression="zstd", hashes=["sha1", "xxh64"], size_limit=1 << 18) as w:
                for ids in arrays:
                    n = len(ids)
                    if mode == "pretrain":
                        w.write({"input_ids": ids})
                    else:
                        w.write({"prompt_ids": ids[: max(1, n // 3)], "response_ids": ids, "record": f"fïlé\u2028.json:{n}"})
            outs[name] = {p.name: p.read_bytes() for p in sorted((tmp_path / mode / name).iterdir())}
        assert outs["fast"] == outs["generic"] and len(outs["fast"]) > 2
