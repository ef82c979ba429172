"""tools/train_tokenizer.py on a user's corpus (issue 14.21): any corpus the shard readers accept."""

from __future__ import annotations

import json

import pytest

from pipeline.tokenizer import DEMO_TOKENIZER, load_tokenizer
from tests.data.mds_helpers import load_tool, write_jsonl

WORD = " zorblaxquint"  # in no English text: only a tokenizer trained on this corpus has it as one token


def _dolma(tmp_path):
    docs = [{"text": f"record {i} mentions the{WORD} again", "source": "web"} for i in range(300)]
    return write_jsonl(tmp_path / "docs.jsonl.gz", [*docs, b'{"source": "web"}']), "dolma"  # one bad record


def _metamathqa(tmp_path):
    rows = [
        {"query": f"What is the{WORD} of {i}?", "response": f"The{WORD} is {i}.", "type": "t"}
        for i in range(300)
    ]
    path = tmp_path / "mm.json"
    path.write_text(json.dumps(rows))
    return path, "metamathqa"


@pytest.mark.parametrize("make", [_dolma, _metamathqa], ids=["dolma-jsonl", "metamathqa-array"])
def test_train_tokenizer_on_a_user_corpus(tmp_path, capsys, make):
    path, fmt = make(tmp_path)
    out = tmp_path / "tok"
    code = load_tool("train_tokenizer").main(
        ["--out", str(out), "--vocab-size", "400", "--format", fmt, "--input", str(path)]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "300 texts" in printed and ("1 bad record skipped" in printed) == (fmt == "dolma")
    tokenizer = load_tokenizer(out)
    assert len(tokenizer.encode(WORD, add_special_tokens=False)) == 1
    assert len(load_tokenizer(DEMO_TOKENIZER).encode(WORD, add_special_tokens=False)) > 1  # the test can tell
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token == "<|pad|>"


def test_train_tokenizer_reports_unreadable_input(tmp_path, capsys):
    path = tmp_path / "broken.json"
    path.write_text('[{"query": "q" "response": "r"}]')
    code = load_tool("train_tokenizer").main(
        ["--out", str(tmp_path / "tok"), "--format", "metamathqa", "--input", str(path)]
    )
    assert code == 2
    assert "broken.json:1: malformed JSON in array element 0" in capsys.readouterr().err
    assert not (tmp_path / "tok").exists()


def test_the_output_directory_is_required_and_an_existing_tokenizer_is_not_replaced_silently(tmp_path, capsys):
    # --out defaulted to assets/tokenizer: run from the checkout, it replaced the demo tokenizer every yaml uses.
    tool = load_tool("train_tokenizer")
    with pytest.raises(SystemExit) as info:
        tool.main(["--vocab-size", "400", "--scale", "0.03"])
    assert info.value.code == 2 and "--out" in capsys.readouterr().err
    out = tmp_path / "tok"
    assert tool.main(["--out", str(out), "--vocab-size", "400", "--scale", "0.03"]) == 0
    before = (out / "tokenizer.json").read_bytes()
    with pytest.raises(SystemExit) as info:
        tool.main(["--out", str(out), "--vocab-size", "500", "--scale", "0.03"])
    assert info.value.code == 2 and f"--out {out} already holds a tokenizer" in capsys.readouterr().err
    assert (out / "tokenizer.json").read_bytes() == before
    assert tool.main(["--out", str(out), "--vocab-size", "500", "--scale", "0.03", "--overwrite"]) == 0
    assert (out / "tokenizer.json").read_bytes() != before
