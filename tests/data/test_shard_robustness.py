"""Sharding robustness (issue 14): lone surrogates, empty results, array element positions, leftover staging,
Ctrl-C, raw bytes of invalid UTF-8 in rejects, JSON error wording, --val-file, truncation and the loss line."""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.corpora import make_corpus_spec
from pipeline.manifest import load_manifest, verify_output
from pipeline.sharding import (
    REJECTS_NAME,
    ShardError,
    ShardOptions,
    format_summary,
    shard_corpus,
    truncate_example,
)
from pipeline.tokenizer import DEMO_TOKENIZER
from tests.common.paths import REPO_ROOT, require_shared_data
from tests.data.mds_helpers import load_tool, read_mds, write_jsonl

GOOD = [{"text": f"good document number {i}", "source": "a" if i % 2 else "b"} for i in range(6)]
SURROGATE_LINE = b'{"text": "broken \\ud800 pair", "source": "a"}'  # valid JSON, not valid Unicode


def _options(out: Path, **kw) -> ShardOptions:
    kw.setdefault("max_seq_len", 16)
    return ShardOptions(out=out, tokenizer=DEMO_TOKENIZER, progress=False, **kw)


def _rejects(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / REJECTS_NAME).read_text(encoding="utf-8").splitlines()]


# -- 1. lone surrogates ---------------------------------------------------------------------------


def test_lone_surrogate_stops_with_file_line_and_field(tmp_path):
    path = write_jsonl(tmp_path / "in" / "bad.jsonl", [GOOD[0], GOOD[1], SURROGATE_LINE, *GOOD[2:]])
    with pytest.raises(ShardError) as info:
        shard_corpus(make_corpus_spec("dolma"), [path], _options(tmp_path / "out"))
    message = str(info.value)
    assert message.startswith("bad.jsonl:3: ") and "field 'text'" in message and "lone surrogate" in message


@pytest.mark.parametrize("workers", [1, 2])
def test_lone_surrogate_is_rejected_and_kept_in_rejects(tmp_path, workers):
    path = write_jsonl(tmp_path / "in" / "bad.jsonl", [GOOD[0], GOOD[1], SURROGATE_LINE, *GOOD[2:]])
    out = tmp_path / "out"
    shard_corpus(make_corpus_spec("dolma"), [path], _options(out, on_error="skip", workers=workers))
    (reject,) = _rejects(out)
    assert (reject["line"], reject["domain"]) == (3, "a") and "lone surrogate" in reject["error"]
    assert reject["record"]["text"] == "broken \ud800 pair"  # the record survives, escaped as JSON allows
    assert verify_output(out) == []


def test_lone_surrogate_in_finetune_response_is_rejected(tmp_path):
    good = {"query": "What is 1+1?", "response": "2", "type": "GSM"}
    text = "[" + json.dumps(good) + ', {"query": "q", "response": "bad \\udfff", "type": "GSM"}]'
    path = tmp_path / "mm.json"
    path.write_text(text)
    with pytest.raises(ShardError, match=r"field 'response'.*lone surrogate"):
        shard_corpus(make_corpus_spec("metamathqa"), [path], _options(tmp_path / "o1", max_seq_len=128))
    shard_corpus(
        make_corpus_spec("metamathqa"), [path], _options(tmp_path / "o2", max_seq_len=128, on_error="skip")
    )
    (reject,) = _rejects(tmp_path / "o2")
    assert reject["record"]["response"] == "bad \udfff" and reject["domain"] == "GSM"


# -- 2. nothing written ---------------------------------------------------------------------------


def test_empty_input_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    out = tmp_path / "out"
    with pytest.raises(ShardError, match=r"no records .*empty\.jsonl"):
        shard_corpus(make_corpus_spec("dolma"), [path], _options(out))
    assert not out.exists()


def test_everything_rejected_is_an_error_naming_the_first_problem(tmp_path):
    path = write_jsonl(tmp_path / "all_bad.jsonl", [b'{"source": "a"}', b"{oops"])
    out = tmp_path / "out"
    with pytest.raises(ShardError, match=r"all 2 records .*rejected.*all_bad\.jsonl:1: missing field 'text'"):
        shard_corpus(make_corpus_spec("dolma"), [path], _options(out, on_error="skip"))
    assert not out.exists()


def test_cli_exits_nonzero_when_nothing_is_written(tmp_path, capsys):
    path = write_jsonl(tmp_path / "all_bad.jsonl", [b'{"source": "a"}'])
    args = [
        "dolma",
        str(path),
        "--out",
        str(tmp_path / "o"),
        "--max-seq-len",
        "16",
        "--no-progress",
        "--on-error",
        "skip",
    ]
    assert load_tool("shard").main(args) == 1
    assert "rejected" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_verify_fails_on_a_manifest_without_data(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", GOOD)
    out = tmp_path / "out"
    shard_corpus(make_corpus_spec("dolma"), [path], _options(out))
    obj = json.loads((out / "manifest.json").read_text())
    obj["domains"], obj["inputs"] = [], []
    (out / "manifest.json").write_text(json.dumps(obj))
    for split in ("train", "val"):
        for d in (out / split).glob("*") if (out / split).is_dir() else []:
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
    problems = verify_output(out)
    assert any("no data" in p for p in problems), problems


# -- 3. JSON-array positions ----------------------------------------------------------------------


def test_one_line_array_errors_name_the_element(tmp_path):
    records = [{"query": f"q{i}", "response": f"r{i}", "type": "t"} for i in range(5)]
    del records[3]["response"]
    path = tmp_path / "mm.json"
    path.write_text(json.dumps(records))  # one line, as the real MetaMathQA-395K.json
    with pytest.raises(ShardError, match=r"^mm\.json:1: element 3: missing field 'response'"):
        shard_corpus(make_corpus_spec("metamathqa"), [path], _options(tmp_path / "o1", max_seq_len=64))
    shard_corpus(
        make_corpus_spec("metamathqa"), [path], _options(tmp_path / "o2", max_seq_len=64, on_error="skip")
    )
    (reject,) = _rejects(tmp_path / "o2")
    assert (reject["line"], reject["element"]) == (1, 3)


def test_real_metamathqa_one_line_file_errors_name_the_element(tmp_path):
    records = json.loads(
        (require_shared_data("metamathqa") / "metamathqa_first3.json").read_text(encoding="utf-8")
    )
    records[2]["response"] = 7  # a type error in the last record of the real sample
    path = tmp_path / "MetaMathQA-395K.json"
    path.write_text(
        json.dumps(records, ensure_ascii=False), encoding="utf-8"
    )  # one line, as the released file
    with pytest.raises(
        ShardError, match=r"^MetaMathQA-395K\.json:1: element 2: field 'response' must be a string"
    ):
        shard_corpus(make_corpus_spec("metamathqa"), [path], _options(tmp_path / "o", max_seq_len=512))


# -- 4. leftover staging --------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has this id now (reuse within the test is vanishingly rare)


def test_leftover_staging_of_a_dead_run_is_reported_and_removed(tmp_path, caplog):
    path = write_jsonl(tmp_path / "in.jsonl", GOOD)
    out = tmp_path / "out"
    leftovers = [
        tmp_path / f".out.tmp-{_dead_pid()}-deadbeef",
        tmp_path / ".out.tmp-0123abcd",
    ]  # new and old naming
    for d in leftovers:
        (d / "_staging" / "train").mkdir(parents=True)
        (d / "_staging" / "train" / "shard.00000.mds.zstd").write_bytes(b"x" * 1000)
    live = tmp_path / f".out.tmp-{os.getppid()}-cafef00d"  # a running process: maybe a concurrent run
    live.mkdir()
    keep = tmp_path / ".other.tmp-0123abcd"  # another output's staging
    keep.mkdir()
    with caplog.at_level(logging.WARNING, logger="pipeline.sharding"):
        shard_corpus(make_corpus_spec("dolma"), [path], _options(out))
    assert not any(d.exists() for d in leftovers)
    assert live.is_dir() and keep.is_dir()
    text = caplog.text
    assert all(d.name in text for d in leftovers) and "removing" in text and live.name in text
    assert verify_output(out) == []


# -- 5. Ctrl-C ------------------------------------------------------------------------------------


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, capsys, monkeypatch):
    import pipeline.sharding

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.sharding, "shard_corpus", interrupted)
    path = write_jsonl(tmp_path / "in.jsonl", GOOD)
    code = load_tool("shard").main(
        ["dolma", str(path), "--out", str(tmp_path / "o"), "--max-seq-len", "16", "--no-progress"]
    )
    err = capsys.readouterr().err
    assert code == 130
    assert len(err.strip().splitlines()) == 1 and "interrupted" in err and "Traceback" not in err


# -- 6. invalid UTF-8 keeps its bytes ---------------------------------------------------------------


def test_invalid_utf8_reject_keeps_the_original_bytes(tmp_path):
    bad = b'{"text": "caf\xe9 \xff latin-1", "source": "a"}'
    path = write_jsonl(tmp_path / "in.jsonl", [GOOD[0], bad, GOOD[1]])
    out = tmp_path / "out"
    shard_corpus(make_corpus_spec("dolma"), [path], _options(out, on_error="skip"))
    (reject,) = _rejects(out)
    assert base64.b64decode(reject["record_base64"]) == bad
    assert "\ufffd" in reject["record"]  # the readable form is still there
    assert verify_output(out) == []


# -- 8. JSON error wording ------------------------------------------------------------------------


def test_malformed_json_message_reads_well(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [b'{"source": "a", "text": "abc'])
    with pytest.raises(ShardError) as info:
        shard_corpus(make_corpus_spec("dolma"), [path], _options(tmp_path / "o"))
    message = str(info.value)
    assert "at at" not in message and "Unterminated string starting at column 25" in message


# -- 19. --val-file -------------------------------------------------------------------------------


def _mm_records(prefix: str, n: int, types: tuple[str, ...] = ("GSM", "MATH")) -> list[dict]:
    return [
        {"query": f"{prefix} question {i}?", "response": f"answer {i}", "type": types[i % len(types)]}
        for i in range(n)
    ]


def test_val_file_supplies_the_validation_split(tmp_path):
    train, val = tmp_path / "train.json", tmp_path / "test.json"
    train.write_text(json.dumps(_mm_records("train", 10)))
    val.write_text(json.dumps(_mm_records("test", 4)))
    out = tmp_path / "out"
    shard_corpus(make_corpus_spec("metamathqa"), [train], _options(out, max_seq_len=128, val_inputs=[val]))
    manifest = load_manifest(out)
    assert {d.name: (d.splits["train"].records, d.splits["val"].records) for d in manifest.domains} == {
        "GSM": (5, 2),
        "MATH": (5, 2),
    }
    assert [s["record"] for s in read_mds(manifest.split_dir("GSM", "val"))] == ["test.json:0", "test.json:2"]
    assert [(i.path, i.split) for i in manifest.inputs] == [(str(train), None), (str(val), "val")]
    assert verify_output(out) == []


def test_val_file_validation(tmp_path):
    train, val = tmp_path / "train.json", tmp_path / "test.json"
    train.write_text(json.dumps(_mm_records("train", 4)))
    val.write_text(json.dumps(_mm_records("test", 3, types=("GSM", "MATH", "ONLY_VAL"))))
    with pytest.raises(ValueError, match="mutually exclusive"):
        _options(tmp_path / "o", val_inputs=[val], val_count=2)
    with pytest.raises(ShardError, match=r"'ONLY_VAL'.*only in the validation"):
        shard_corpus(
            make_corpus_spec("metamathqa"),
            [train],
            _options(tmp_path / "o", max_seq_len=128, val_inputs=[val]),
        )


def test_cli_val_file_for_every_reader(capsys):
    shard = load_tool("shard")
    for fmt in ("dolma", "metamathqa", "mol", "jsonl"):
        with pytest.raises(SystemExit):
            shard.main([fmt, "--help"])
        assert "--val-file" in capsys.readouterr().out


@pytest.mark.slow
def test_real_dm_math_train_val_pair(tmp_path):
    data = require_shared_data("dm_math")
    out = tmp_path / "out"
    shard = load_tool("shard")
    args = ["metamathqa", str(data / "train.json"), "--val-file", str(data / "val.json"), "--out", str(out)]
    assert shard.main([*args, "--max-seq-len", "256", "--no-progress", "--workers", "2"]) == 0
    manifest = load_manifest(out)
    assert len(manifest.domains) == 8 and all(d.splits["val"].records == 120 for d in manifest.domains)
    assert sum(d.input_records for d in manifest.domains) == 12300 + 960
    assert verify_output(out) == []


# -- 20. truncation and the loss line -------------------------------------------------------------


def _a(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


@pytest.mark.parametrize(
    "prompt, response, limit, expected",
    [
        ((1, 2, 3), (7, 8, 0), 6, ((1, 2, 3), (7, 8, 0), False)),
        ((1, 2, 3, 4, 5, 6), (7, 0), 4, ((5, 6), (7, 0), True)),  # prompt alone too long: cut from the left
        ((1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 0), 6, ((4, 5, 6), (7, 8, 9), True)),  # both long: half each
        ((1,), (7, 8, 9, 10, 0), 4, ((1,), (7, 8, 9), True)),
    ],
)
def test_left_prompt_right_truncation(prompt, response, limit, expected):
    got = truncate_example(_a(*prompt), _a(*response), limit, "left_prompt_right")
    assert got is not None
    assert (tuple(got[0].tolist()), tuple(got[1].tolist()), got[2]) == expected


def test_summary_last_line_shows_the_loss_per_domain(tmp_path):
    long_prompt = "tell me " * 60
    records = [
        {"query": "short?", "response": "yes", "type": "geometry"},
        {"query": long_prompt, "response": "no", "type": "geometry"},
        {"query": "fine?", "response": "ok", "type": "algebra"},
        {"query": "fine again?", "response": "ok", "type": "algebra"},
    ]
    path = tmp_path / "mm.json"
    path.write_text(json.dumps(records))
    kw = {"max_seq_len": 32, "prompt_template": "none"}
    right = shard_corpus(
        make_corpus_spec("metamathqa"), [path], _options(tmp_path / "o1", truncation="right", **kw)
    )
    last = format_summary(right).splitlines()[-1]
    assert "geometry 1/2 rejected (50.0%, 1 too long)" in last and "algebra 0/2 rejected (0.0%)" in last
    kept = shard_corpus(
        make_corpus_spec("metamathqa"),
        [path],
        _options(tmp_path / "o2", truncation="left_prompt_right", **kw),
    )
    last = format_summary(kept).splitlines()[-1]
    assert "geometry 0/2 rejected (0.0%), 1 truncated" in last
    assert verify_output(tmp_path / "o2") == []


# -- 7. --help stays light ------------------------------------------------------------------------

_HEAVY = ("torch", "transformers", "streaming", "composer")


@pytest.mark.parametrize(
    "tool",
    [
        "shard",
        "train_tokenizer",
        "make_sample_corpus",
        "evaluate",
        "compare_mixtures",
        "studies/plot_conflicts",
        "bench/bench_shard",
        "bench/bench_selection",
        "bench/bench_features",
        "bench/bench_step",
        "studies/knob_fidelity",
    ],
)
def test_help_imports_no_heavy_library(tool):
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['{tool.rpartition('/')[2]}.py', '--help']\n"
        f"sys.path.insert(0, 'tools/{tool.rpartition('/')[0]}')\n"  # the script's folder, as when it runs
        "try:\n"
        f"    runpy.run_path('tools/{tool}.py', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code\n"
        f"print(sorted(m for m in {_HEAVY!r} if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", (
        f"tools/{tool}.py --help imports {proc.stdout.strip().splitlines()[-1]}"
    )
