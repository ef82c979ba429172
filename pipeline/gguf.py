"""Pretrained models from GGUF files: converted once to an ordinary local model directory, cached by content.

A `.gguf` file (llama.cpp's format: weights, often quantised, plus the tokenizer and its chat template) is
accepted wherever a pretrained model or tokenizer is named: `model.pretrained_model_name_or_path`,
`tokenizer_name`, `tools/shard.py --tokenizer`, `tools/evaluate.py --model/--base-model/--tokenizer`. The
first load converts it with transformers' own GGUF loader (`from_pretrained(dir, gguf_file=name)`, which
de-quantises to float32) and writes the model and tokenizer with `save_pretrained` into
`<cache>/gguf/<sha256 of the file>-v<N>/`; every later load, by any process, reads that directory, which
takes about a second instead of the tens of seconds a conversion takes. `<cache>` is `$PARTITIONSEL_CACHE`,
else `~/.cache/partitionsel`.

Two processes converting the same file at once (a study starts its runs in parallel) do not both work: a
file lock per cache entry lets one convert while the other waits and then reuses the result, and the
result appears by renaming a finished staging directory, so a killed conversion never leaves a half entry.

The tokenizer's special tokens are set from the file's own metadata (`tokenizer.ggml.{bos,eos,padding,
unknown}_token_id`, `tokenizer.ggml.add_bos_token`): transformers 4.53 takes the EOS token from the BOS id
and adds a BOS to every encoding for llama files, which for SmolLM2 would make `<|im_start|>` the EOS that
separates packed documents instead of `<|im_end|>`.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "CACHE_ENV",
    "GGUF_SUFFIX",
    "cache_root",
    "check_gguf_file",
    "gguf_model_dir",
    "gguf_problem",
    "is_gguf",
    "resolve_pretrained",
]

GGUF_SUFFIX = ".gguf"
CACHE_ENV = "PARTITIONSEL_CACHE"
_MAGIC = b"GGUF"
# Part of each cache entry's name: bump it when the conversion's output changes, so old entries are not reused.
_CONVERSION_VERSION = 1
_SOURCE_RECORD = "gguf_source.json"
_HASH_CHUNK = 1 << 20


def is_gguf(name_or_path: str | os.PathLike[str] | None) -> bool:
    """Whether a model or tokenizer name is a GGUF file (by its `.gguf` suffix, any case)."""
    return name_or_path is not None and os.fspath(name_or_path).lower().endswith(GGUF_SUFFIX)


def cache_root() -> Path:
    """`$PARTITIONSEL_CACHE`, else `~/.cache/partitionsel`: converted GGUF models live in its `gguf/`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "partitionsel").expanduser()


def check_gguf_file(path: str | os.PathLike[str], field: str) -> Path:
    """The file, checked to exist and to start with GGUF's magic bytes (its first 4 bytes are read).

    The architecture is checked when the file is converted: reading the metadata takes seconds.

    Raises:
        FileNotFoundError: No such file.
        ValueError: The file is not GGUF.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"`{field}` {os.fspath(path)!r}: no such GGUF file (a .gguf name must be a local file; nothing is downloaded)"
        )
    with open(p, "rb") as f:
        head = f.read(len(_MAGIC))
    if head != _MAGIC:
        raise ValueError(
            f"`{field}` {os.fspath(path)!r} is not a GGUF file: it starts with {head!r}, not {_MAGIC!r}; give a "
            ".gguf model file (llama.cpp's format), a model directory or a hub name"
        )
    return p


def gguf_problem(path: str | os.PathLike[str], field: str) -> str | None:
    """`check_gguf_file`'s complaint as a message (None when the file looks fine), for config validation."""
    try:
        check_gguf_file(path, field)
    except (FileNotFoundError, ValueError) as exc:
        return str(exc)
    return None


def resolve_pretrained(name_or_path: str | os.PathLike[str], field: str = "model") -> str:
    """A hub name or directory unchanged; a `.gguf` file as its converted directory (converting it once).

    Args:
        name_or_path: What the user named (a yaml value or a command-line argument).
        field: The setting's name, for error messages (e.g. `model.pretrained_model_name_or_path`).

    Returns:
        Something `from_pretrained` loads: `name_or_path` itself, or the cached model directory.

    Raises:
        ValueError: a local directory that does not exist (`missing_local_directory`).
    """
    if not is_gguf(name_or_path):
        name = os.fspath(name_or_path)
        if problem := missing_local_directory(name):  # not a minute of the hub's retries first
            raise ValueError(f"`{field}` {name!r}: {problem}")
        return name
    return str(gguf_model_dir(name_or_path, field=field))


def missing_local_directory(name: str) -> str | None:
    """Why `name` names a local directory that does not exist, or None (it exists, or reads as a hub name).

    A path that starts from the filesystem (``/``, ``./``, ``../``, ``~``), or whose parent directory exists here
    (``assets/tokenizr``), is meant to be local: `from_pretrained` would instead ask the hub for it, which on a
    machine without network retries for about a minute before failing."""
    path = Path(name).expanduser()
    if path.exists() or not name or "://" in name:
        return None
    local = name.startswith(("/", "./", "../", "~")) or (len(path.parts) > 1 and path.parent.is_dir())
    if not local:
        return None
    near = ""
    if path.parent.is_dir():
        names = [p.name for p in path.parent.iterdir() if p.is_dir()]
        if close := difflib.get_close_matches(path.name, names, n=1):
            near = f"; did you mean {str(path.parent / close[0])!r}?"
    return f"no such directory (its parent {str(path.parent)!r} is here{near})" if path.parent.is_dir() else "no such directory"


def gguf_model_dir(path: str | os.PathLike[str], *, field: str = "model") -> Path:
    """The local model directory (model, tokenizer, chat template) converted from a GGUF file.

    The directory is keyed by the file's sha256, so a renamed or copied file reuses it and a changed
    file does not. The first call converts (a line is logged before and after, with the time taken);
    later calls only hash the file (0.1 s for 100 MB).

    Args:
        path: The `.gguf` file.
        field: The setting that named it, for error messages.

    Returns:
        The cache directory, loadable with `AutoModelForCausalLM.from_pretrained` and
        `AutoTokenizer.from_pretrained`.

    Raises:
        FileNotFoundError: The file does not exist.
        ValueError: It is not a GGUF file, or its architecture is one transformers cannot load.
        ImportError: It must be converted and the `gguf` package is not installed.
    """
    src = check_gguf_file(path, field).resolve()
    digest = _sha256(src)
    root = cache_root() / "gguf"
    target = root / f"{digest}-v{_CONVERSION_VERSION}"
    if (target / _SOURCE_RECORD).is_file():
        return target
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{target.name}.lock")):
        if (target / _SOURCE_RECORD).is_file():  # another process converted it while this one waited
            return target
        _convert(src, digest, target, field)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _convert(src: Path, digest: str, target: Path, field: str) -> None:
    """Convert under the entry's lock: staging directory, save_pretrained, then one rename."""
    metadata = _read_metadata(src, field)
    for stale in target.parent.glob(f".{target.name}.tmp-*"):  # a killed conversion's (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    size_mb = src.stat().st_size / 1e6
    logger.info("converting %s (%.0f MB) once to %s; later loads reuse it", src, size_mb, target)
    start = time.perf_counter()
    staging = target.parent / f".{target.name}.tmp-{os.getpid()}"
    try:
        staging.mkdir(parents=True)
        tokenizer, model = _load_with_transformers(src, field)
        _set_special_tokens(tokenizer, metadata)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        record = {
            "source": str(src),
            "sha256": digest,
            "bytes": src.stat().st_size,
            "architecture": metadata["general.architecture"],
            "converted_by": _versions(),
            "seconds": round(time.perf_counter() - start, 1),
        }
        (staging / _SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        if target.exists():  # not a finished entry (those have the source record): replaced
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("converted %s in %.1f s", src.name, time.perf_counter() - start)


def _read_metadata(src: Path, field: str) -> dict[str, Any]:
    """The header fields the conversion needs, read with gguf's own reader; the architecture checked."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise ImportError(
            f"`{field}` {str(src)!r} is a GGUF file, and converting it needs the `gguf` package "
            f"(the GGUF project's reader, a dependency of this project): pip install 'gguf>=0.17.1' ({exc})"
        ) from exc
    reader = GGUFReader(src)
    keys = (
        "general.architecture",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_eos_token",
    )
    metadata = {k: reader.fields[k].contents() for k in keys if k in reader.fields}
    arch = metadata.get("general.architecture")
    supported = _supported_architectures()
    if arch not in supported:
        raise ValueError(
            f"`{field}` {str(src)!r}: GGUF architecture {arch!r} is not one transformers can load from GGUF "
            f"(supported: {', '.join(supported)})"
        )
    return metadata


def _supported_architectures() -> list[str]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    # The list is the keys of transformers' metadata mapping, which also holds the two non-architecture sections.
    return [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]


def _load_with_transformers(src: Path, field: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, torch_dtype=torch.float32
        )
    except (OSError, ValueError, KeyError, NotImplementedError) as exc:
        raise ValueError(
            f"`{field}` {str(src)!r}: transformers could not load this GGUF file ({exc})"
        ) from exc
    return tokenizer, model


def _set_special_tokens(tokenizer: Any, metadata: dict[str, Any]) -> None:
    """BOS/EOS/padding/unknown tokens and whether a BOS/EOS is added, as the file's metadata says."""
    for role, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("pad", "padding_token_id"),
        ("unk", "unknown_token_id"),
    ):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokenizer):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(int(token_id)))
    for flag in ("add_bos_token", "add_eos_token"):
        value = metadata.get(f"tokenizer.ggml.{flag}")
        if value is not None and hasattr(tokenizer, flag):
            setattr(tokenizer, flag, bool(value))


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("transformers", "gguf", "torch"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out
