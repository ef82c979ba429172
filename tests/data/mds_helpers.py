"""Test helpers: read MDS directories with Streaming's readers, write small corpora, load a tool module."""

from __future__ import annotations

import gzip
import importlib.util
import json
import tempfile
from pathlib import Path
from types import ModuleType

from streaming.base.compression import decompress
from streaming.base.format import reader_from_json

from tests.common.paths import REPO_ROOT

__all__ = ["load_tool", "read_mds", "read_output", "write_jsonl"]


def read_mds(directory: Path) -> list[dict]:
    """Every sample of one MDS directory, in order, decoded by Streaming's own reader classes.

    The directory is not modified: compressed shards are decompressed into a scratch copy.
    """
    index = json.loads((directory / "index.json").read_text())
    samples: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch:
        for i, shard in enumerate(index["shards"]):
            local = Path(scratch) / str(i)
            local.mkdir()
            zip_info = shard.get("zip_data")
            if zip_info:
                raw = decompress(shard["compression"], (directory / zip_info["basename"]).read_bytes())
            else:
                raw = (directory / shard["raw_data"]["basename"]).read_bytes()
            (local / shard["raw_data"]["basename"]).write_bytes(raw)
            reader = reader_from_json(str(local), None, shard)
            samples.extend(reader.get_item(j) for j in range(shard["samples"]))
    return samples


def read_output(out: Path) -> dict[tuple[str, str], list[dict]]:
    """(domain name, split) -> samples, for every MDS directory the manifest lists."""
    manifest = json.loads((out / "manifest.json").read_text())
    result = {}
    for d in manifest["domains"]:
        for split in ("train", "val"):
            path = out / split / d["dir"]
            result[(d["name"], split)] = read_mds(path) if path.is_dir() else []
    return result


def write_jsonl(path: Path, lines: list[bytes | dict]) -> Path:
    """Write JSON Lines (dicts are dumped, bytes written as is), gzipped when the name ends in .gz."""
    data = b"".join((json.dumps(x, ensure_ascii=False).encode() if isinstance(x, dict) else x) + b"\n" for x in lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data, mtime=0) if path.name.endswith(".gz") else data)
    return path


def load_tool(name: str) -> ModuleType:
    """Import tools/<name>.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", REPO_ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
