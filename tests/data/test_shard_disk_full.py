"""A full disk while writing shards (issue 20.11): one line naming the output, what was written and that nothing was kept."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from pipeline.corpora import make_corpus_spec
from pipeline.manifest import load_manifest
from pipeline.sharding import ShardError, ShardOptions, shard_corpus
from pipeline.tokenizer import DEMO_TOKENIZER
from tests.data.mds_helpers import load_tool, write_jsonl

N_DOCS = 300
SHARDS_BEFORE_FULL = 3


@pytest.fixture
def docs(tmp_path) -> Path:
    rows = [{"text": f"document {i} " + "alpha beta gamma delta " * (1 + i % 5), "source": "ab"[i % 2]} for i in range(N_DOCS)]
    return write_jsonl(tmp_path / "in" / "docs.jsonl", rows)


def _fill_disk(monkeypatch) -> list[str]:
    """Make the MDS writer's shard files fail with ENOSPC after SHARDS_BEFORE_FULL of them, as on a full disk.

    Returns the list of shard files written before, filled in as the run goes.
    """
    from pipeline.mds_writer import FastMDSWriter

    real = FastMDSWriter.flush_shard
    written: list[str] = []

    def flush_shard(self) -> None:
        path = os.path.join(self.local, f"shard.{len(self.shards):05d}.mds.zstd")
        if len(written) >= SHARDS_BEFORE_FULL:
            with open(path, "wb") as f:
                f.write(b"the start of a shard")  # the disk fills part-way through a file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real(self)
        written.append(path)

    monkeypatch.setattr(FastMDSWriter, "flush_shard", flush_shard)
    return written


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith((".out.tmp-", ".out.old-")))


@pytest.mark.parametrize("workers", [1, 2])
def test_cli_full_disk_is_one_line_and_keeps_nothing(docs, tmp_path, monkeypatch, capsys, workers):
    out = tmp_path / "out"
    written = _fill_disk(monkeypatch)
    shard = load_tool("shard")
    args = ["dolma", str(docs), "--out", str(out), "--max-seq-len", "16", "--size-limit", "1kb", "--no-progress", "--workers", str(workers)]
    rc = shard.main(args)
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert line.startswith(f"error: no space left on the device while writing {out}: "), line
    assert f"{SHARDS_BEFORE_FULL} shard files" in line and "nothing was kept" in line, line
    assert len(written) == SHARDS_BEFORE_FULL
    assert not out.exists() and _leftovers(tmp_path) == []  # the staging directory is removed


def test_full_disk_leaves_an_existing_output_as_it_was(docs, tmp_path, monkeypatch):
    out = tmp_path / "out"
    options = ShardOptions(out=out, tokenizer=DEMO_TOKENIZER, max_seq_len=16, size_limit="1kb", progress=False)
    shard_corpus(make_corpus_spec("dolma"), [docs], options)
    before = json.loads((out / "manifest.json").read_text())

    written = _fill_disk(monkeypatch)
    options.overwrite = True
    with pytest.raises(ShardError) as info:
        shard_corpus(make_corpus_spec("dolma"), [docs], options)
    message = str(info.value)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert f"while writing {out}" in message and "the existing output is left as it was" in message, message
    assert len(written) == SHARDS_BEFORE_FULL
    assert json.loads((out / "manifest.json").read_text()) == before and load_manifest(out).domains
    assert _leftovers(tmp_path) == []
