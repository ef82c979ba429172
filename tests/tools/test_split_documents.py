"""tools/split_documents.py: a partition of a Dolma corpus's documents by a fixed hash of their ids."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import split_documents  # noqa: E402  (tools/split_documents.py)


def _write(path: Path, docs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")


def _read_parts(out: Path) -> dict[str, dict[str, list[str]]]:
    """{part: {domain: [raw lines]}}."""
    parts: dict[str, dict[str, list[str]]] = {}
    for path in sorted(out.glob("*/*/part-000.jsonl.gz")):
        part, domain = path.parts[-3], path.parts[-2]
        with gzip.open(path, "rt") as f:
            parts.setdefault(part, {})[domain] = f.read().splitlines()
    return parts


def _corpus(root: Path, n_a: int = 40, n_b: int = 9) -> dict[str, list[dict]]:
    docs = {
        "a": [{"id": f"a{i}", "text": f"alpha document {i} " * 3, "source": "a"} for i in range(n_a)],
        "b": [{"id": i, "text": f"beta document {i}", "source": "b", "metadata": {"x": i}} for i in range(n_b)],
    }
    _write(root / "a" / "part-000.jsonl.gz", docs["a"][: n_a // 2])
    _write(root / "a" / "part-001.jsonl.gz", docs["a"][n_a // 2 :])
    _write(root / "b" / "part-000.jsonl.gz", docs["b"])
    return docs


def test_parts_are_disjoint_complete_sized_and_lines_unchanged(tmp_path):
    docs = _corpus(tmp_path / "in")
    out = tmp_path / "out"
    assert split_documents.main([str(tmp_path / "in"), "--out", str(out), "--part", "guide=0.1", "--part", "eval=0.25"]) == 0
    parts = _read_parts(out)
    assert set(parts) == {"guide", "eval", "train"}
    for domain, expected in (("a", {"guide": 4, "eval": 10, "train": 26}), ("b", {"guide": 1, "eval": 2, "train": 6})):
        ids = {p: [json.loads(line)["id"] for line in parts[p][domain]] for p in parts}
        assert {p: len(v) for p, v in ids.items()} == expected  # round(f x n); b: round(0.9) = 1, round(2.25) = 2
        all_ids = [i for v in ids.values() for i in v]
        assert sorted(map(str, all_ids)) == sorted(str(d["id"]) for d in docs[domain])  # each once
    # Lines are copied unchanged (the JSON text, metadata included).
    written = {line for p in parts.values() for lines in p.values() for line in lines}
    assert {json.dumps(d) for d in docs["b"]} <= written
    summary = json.loads((out / "split.json").read_text())
    assert summary["stats"]["eval"]["a"]["documents"] == 10 and summary["parts"] == {"guide": 0.1, "eval": 0.25}


def test_partition_depends_on_ids_and_seed_only_and_earlier_parts_are_stable(tmp_path):
    docs = _corpus(tmp_path / "in")
    # The same documents in one file, in reverse order.
    _write(tmp_path / "flat" / "all.jsonl.gz", list(reversed(docs["a"] + docs["b"])))

    def split(inputs: Path, name: str, *extra: str) -> dict[str, dict[str, set]]:
        out = tmp_path / name
        assert split_documents.main([str(inputs), "--out", str(out), *extra]) == 0
        return {p: {d: {json.loads(x)["id"] for x in v} for d, v in ds.items()} for p, ds in _read_parts(out).items()}

    one = split(tmp_path / "in", "one", "--part", "guide=0.1", "--part", "eval=0.25")
    assert split(tmp_path / "flat", "two", "--part", "guide=0.1", "--part", "eval=0.25") == one
    # A larger evaluation part leaves the guide part as it was.
    three = split(tmp_path / "in", "three", "--part", "guide=0.1", "--part", "eval=0.4")
    assert three["guide"] == one["guide"] and three["eval"]["a"] > one["eval"]["a"]
    other_seed = split(tmp_path / "in", "four", "--part", "guide=0.1", "--part", "eval=0.25", "--seed", "1")
    assert other_seed["eval"]["a"] != one["eval"]["a"]


def test_every_part_keeps_a_document_in_a_small_domain():
    got = split_documents.assign_parts({"d": ["x", "y", "z"]}, [("guide", 0.01), ("eval", 0.01)], seed=0, rest="train")
    assert sorted(got["d"].values()) == ["eval", "guide", "train"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--part", "eval"], "expected NAME=FRACTION"),
        (["--part", "eval=x"], "is not a number"),
        (["--part", "eval=1.5"], "must be in (0, 1)"),
        (["--part", "eval=0.6", "--part", "guide=0.5"], "sum below 1"),
        (["--part", "train=0.1"], "must differ"),
        ([], "at least one --part"),
    ],
)
def test_bad_parts_are_rejected_with_the_value(tmp_path, capsys, args, message):
    _corpus(tmp_path / "in")
    with pytest.raises(SystemExit):
        split_documents.main([str(tmp_path / "in"), "--out", str(tmp_path / "out"), *args])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_repeated_id_and_existing_output_are_errors(tmp_path):
    root = tmp_path / "in"
    _write(root / "a" / "part-000.jsonl.gz", [{"id": "d1", "text": "one", "source": "a"}, {"id": "d1", "text": "two", "source": "a"}])
    with pytest.raises(SystemExit, match="id 'd1' repeats in domain 'a'"):
        split_documents.main([str(root), "--out", str(tmp_path / "out"), "--part", "eval=0.5"])
    _write(root / "a" / "part-000.jsonl.gz", [{"id": "d1", "text": "one", "source": "a"}, {"id": "d2", "text": "two", "source": "a"}])
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(SystemExit):
        split_documents.main([str(root), "--out", str(tmp_path / "busy"), "--part", "eval=0.5", "--overwrite"])
    assert (tmp_path / "busy" / "keep.txt").exists()  # not a directory this tool wrote: never deleted


def test_inputs_without_documents_are_one_error_line_exit_2_and_leave_no_temp_dir(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    empty = tmp_path / "in" / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "s0"
    assert split_documents.main([str(empty), "--out", str(out), "--part", "guide=0.1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no documents") and str(empty) in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # neither OUT nor .OUT.tmp


def test_domain_directories_are_named_as_shard_names_them_and_stay_inside_the_part(tmp_path, capsys):
    sources = ["Wiki", "wiki", "a/b", "../up"]
    docs = [{"id": f"{s}-{i}", "text": f"text {i}", "source": s} for s in sources for i in range(5)]
    _write(tmp_path / "in" / "all.jsonl.gz", docs)
    out = tmp_path / "out"
    assert split_documents.main([str(tmp_path / "in"), "--out", str(out), "--part", "guide=0.2"]) == 0
    expected = {"Wiki": "Wiki", "wiki": "wiki-2", "a/b": "a_b", "../up": "up"}
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.jsonl.gz") if "in" not in p.parts)
    assert written == sorted(f"out/{part}/{d}/part-000.jsonl.gz" for part in ("guide", "train") for d in expected.values())
    parts = _read_parts(out)
    for source, directory in expected.items():
        for part, n in (("guide", 1), ("train", 4)):
            assert [json.loads(x)["source"] for x in parts[part][directory]] == [source] * n
    assert json.loads((out / "split.json").read_text())["directories"] == expected
    table = capsys.readouterr().out
    assert "../up (-> up/) 4" in table and "a/b (-> a_b/) 4" in table and "wiki (-> wiki-2/) 4" in table
    assert "Wiki 4" in table and "Wiki (->" not in table
