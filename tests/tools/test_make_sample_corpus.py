"""tools/make_sample_corpus.py: refuses a non-empty output directory unless --overwrite."""

from __future__ import annotations

import pytest

from tests.data.mds_helpers import load_tool


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_non_empty_outdir_is_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "c"
    stale = out / "dolma" / "documents" / "wiki" / "wiki-0099.json.gz"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old corpus")
    with pytest.raises(SystemExit) as exc:
        load_tool("make_sample_corpus").main([str(out), "--scale", "0.02"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{out} is not empty" in err and "--overwrite" in err
    assert _files(out) == ["dolma/documents/wiki/wiki-0099.json.gz"]  # nothing generated


def test_overwrite_replaces_the_previous_corpus_and_keeps_other_files(tmp_path):
    tool = load_tool("make_sample_corpus")
    out, fresh = tmp_path / "c", tmp_path / "fresh"
    assert tool.main([str(fresh), "--scale", "0.02", "--seed", "1"]) == 0
    assert tool.main([str(out), "--scale", "0.03", "--seed", "2"]) == 0
    (out / "dolma" / "documents" / "wiki" / "wiki-0099.json.gz").write_bytes(b"stale")
    (out / "notes.txt").write_text("mine")
    assert tool.main([str(out), "--scale", "0.02", "--seed", "1", "--overwrite"]) == 0
    assert _files(out) == sorted([*_files(fresh), "notes.txt"])
    for name in _files(fresh):
        assert (out / name).read_bytes() == (fresh / name).read_bytes()


def test_an_empty_existing_outdir_is_fine(tmp_path):
    (tmp_path / "c").mkdir()
    assert load_tool("make_sample_corpus").main([str(tmp_path / "c"), "--scale", "0.02"]) == 0
